"""Where a token crosses to the workers. `experts.py` declares the `Experts` protocol the model calls each MoE
layer and implements it over the fleet (`RemoteExperts`): rows are split by owner (`partition.py`), sent over gRPC
(`transport.py`) or a worker's same-host socket (`same_host.py`), weighted and summed back (`combine.py`);
`liveness.py` and `worker_watch.py` track which workers are up for in-step failover. `LocalExperts` (in
`experts.py`) runs the experts in the router's own process.

Imports nothing of `api`, `engine` or `model`.
"""
