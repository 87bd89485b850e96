"""The decoder that runs on the router: dense weights mapped from the checkpoint (`weights.py`), the paged KV
cache (`kv_cache.py`), one step's token layout (`step_inputs.py`, `query_context.py`), attention (`attention.py`,
`mla.py`), norms, rope and dense MLPs (`layers.py`), and the model (`model.py`): per layer attention, the MoE gate
(top-k routing), a call to the experts, the final norm and lm_head. `native_check.py` checks the native decoder
ops once at start; `fusion.py` says which parts of a CPU decode step run as one native call each, and
`decode_layers.py` runs a decode step's layers from one plan.

May import `moe` (the `Experts` protocol it calls each layer), never `api` or `engine`.
"""
