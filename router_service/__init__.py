"""The router service: the process clients talk to. Four rooms, one job each, imports only downwards:

- `api/`    the client-facing gRPC service and the composition root (`build.py`): requests in, tokens out.
- `engine/` continuous batching: the scheduler, the sequences, the KV block allocator (both torch-free), one
            step as schedule → execute → postprocess, sampling and metrics.
- `model/`  the decoder on the router: weights, KV cache, attention (MHA/GQA/MLA), the MoE gate, lm_head.
- `moe/`    where a token crosses to the workers: the `Experts` protocol, partition → transport → combine,
            liveness and failover, and the in-process `LocalExperts`.

api → engine → model → moe (import-linter checks it: `make lint`); `moe` knows nothing of the decoder.
"""
