"""Continuous batching: requests become sequences (`sequence.py`), the scheduler (`scheduler.py`) and KV block
allocator (`block_allocator.py`) choose each step's batch without torch, the engine (`engine.py`, what the API
calls; `step_loop.py`, its thread) runs a step as schedule → execute → postprocess (`step_stats.py` tells the
metrics), the sampler draws tokens (`sampler.py`), events carry results to the API (`events.py`) and the
Prometheus families live in `metrics.py`.

May import `model` and `moe`, never `api`.
"""
