"""Continuous batching: requests become sequences (`sequence.py`), the scheduler (`scheduler.py`) and KV block
allocator (`block_allocator.py`) choose each step's batch without torch, the engine (`engine.py`) runs a step as
schedule → execute → postprocess, the sampler draws tokens (`sampler.py`), events carry results to the API
(`events.py`) and the Prometheus families live in `metrics.py`.

May import `model` and `moe`, never `api`.
"""
