"""Grouped-query attention over the paged KV cache, for every non-latent architecture: one call per decode batch
(on a GPU the Triton kernel and on a CPU the native one, each reading a query's keys where the cache holds
them; else gathered keys and SDPA) and one SDPA call per prefill. A sliding layer reads only its window's keys
(the step's window slots and masks, or the window's length for the Triton kernel).

Attention sinks (GPT-OSS): transformers appends each head's learned logit s_h as one more column of the scores,
softmaxes, and drops it, so the weights are exp(x_j) / (Σ exp(x_i) + exp(s_h)). Here that column is one extra
key that SDPA attends to like the others: every query gains a last dimension s_h / scale, every real key a 0
there, the sink key is (0, …, 0, 1) with a zero value; its score is exactly s_h and it adds nothing to the
output. Keys and values both get the extra dimension, so SDPA keeps its fused (blockwise) CPU kernels: no
[heads, n, C] score tensor is ever materialised.

Shapes: T tokens, Hq / Hkv query / key-value heads, D head dim, Bd decode sequences, C context (padded for
decode, the window's keys for a sliding layer), n new tokens of one prefill.
"""

from __future__ import annotations

import torch

from kernels import backend_for, native, paged_decode_attention
from router_service.model.kv_cache import KVCache
from router_service.model.query_context import query_contexts
from router_service.model.sdpa import sdpa
from router_service.model.step_inputs import StepInputs


def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepInputs, kv: KVCache,
              sliding: bool, sinks: torch.Tensor | None, per_query: bool = False) -> torch.Tensor:
    """q [T, Hq, D], this step's rotated k and v [T, Hkv, D] (written to the cache here) -> [T, Hq, D].
    `per_query` (batch invariance): each query alone over its exact context (router_service/model/query_context.py)."""
    kv.write(layer, step.slots, k, v)
    out = torch.empty_like(q)                                                # [T, Hq, D]
    if per_query:
        for row, slots in query_contexts(step, sliding):
            kc, vc = kv.gather(layer, slots)                                 # [C, Hkv, D]
            out[row] = _attend(q[row][None, :, None, :], kc.transpose(0, 1)[None], vc.transpose(0, 1)[None],
                               None, sinks, causal=False)[0, :, 0, :]        # [Hq, D]
        return out
    nd = step.num_decode
    if nd and paged(q, step):                                                # the Triton kernel, through the tables
        paged_decode_attention(q[:nd], kv.k[layer], kv.v[layer], step.decode_table, step.decode_lens,
                               kv.block_size, sinks, step.window if sliding else 0, out=out[:nd])   # [Bd, Hq, D]
    elif nd and in_place(q, kv):                                             # where the cache holds the keys
        slots, lens = (step.decode_window_slots, step.decode_window_lens) if sliding else \
            (step.decode_slots, step.decode_lens)                            # [Bd, C], [Bd]
        out[:nd] = native.decode_attention(q[:nd], kv.k[layer], kv.v[layer], slots, lens, sinks,
                                           q.shape[-1] ** -0.5)              # [Bd, Hq, D]
    elif nd:
        slots, mask = (step.decode_window_slots, step.decode_window_mask) if sliding else \
            (step.decode_slots, step.decode_mask)                            # [Bd, C], [Bd, 1, 1, C]
        kd, vd = kv.gather(layer, slots)                                     # [Bd, C, Hkv, D]
        out[:nd] = _attend(q[:nd, :, None, :], kd.transpose(1, 2), vd.transpose(1, 2), mask, sinks)[:, :, 0, :]
    for j, (row, n, ctx_slots, mask) in enumerate(step.prefills):
        if sliding:                                                          # keys lo.. are the window's
            lo, mask = step.prefill_windows[j]                               # mask [n, ctx - lo]
            ctx_slots = ctx_slots[lo:]
        kp, vp = kv.gather(layer, ctx_slots)                                 # [C, Hkv, D]
        o = _attend(q[row:row + n].transpose(0, 1)[None], kp.transpose(0, 1)[None], vp.transpose(0, 1)[None],
                    mask, sinks)                                             # [1, Hq, n, D]
        out[row:row + n] = o[0].transpose(0, 1)
    return out


def paged(q: torch.Tensor, step: StepInputs) -> bool:
    """Decode rows attend through their block tables in the Triton kernel (kernels.paged_decode_attention): where
    the MoE backend is Triton (a GPU; or CPU tensors under the interpreter with COLIBRI_MOE_BACKEND=triton, as the
    suite runs the GPU's path)."""
    return step.decode_table is not None and backend_for(q.device) == "triton"


def in_place(q: torch.Tensor, kv: KVCache) -> bool:
    """Decode rows attend where the cache holds their keys (kernels.native.decode_attention): on a CPU with the
    native kernels, a float32 or bf16 cache; elsewhere gathered copies and SDPA."""
    return not q.is_cuda and native.decoder_ops() and kv.k.dtype in (torch.float32, torch.bfloat16)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            sinks: torch.Tensor | None, causal: bool = True) -> torch.Tensor:
    """q [B, Hq, n, D], k/v [B, Hkv, C, D], mask bool [B | 1, 1, n | 1, C] or [n, C] or None (causal, or every key
    with causal=False) -> [B, Hq, n, D]. 4-D throughout: SDPA's fused CPU kernels (router_service/model/sdpa.py on a
    GPU)."""
    if sinks is None:
        return sdpa(q, k, v, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=True)
    B, Hq, n, D = q.shape
    Hkv, C = k.shape[1], k.shape[2]
    scale = D**-0.5
    column = (sinks.to(q.dtype) / scale).view(1, Hq, 1, 1).expand(B, Hq, n, 1)
    qa = torch.cat([q, column], dim=-1)                                      # [B, Hq, n, D + 1]
    ka = k.new_zeros(B, Hkv, C + 1, D + 1)                                   # [B, Hkv, C + 1, D + 1]
    ka[:, :, :C, :D] = k
    ka[:, :, C, D] = 1                                                       # the sink key
    va = v.new_zeros(B, Hkv, C + 1, D + 1)                                   # its value: zeros
    va[:, :, :C, :D] = v
    if mask is None:
        mask = torch.ones(n, C, dtype=torch.bool, device=q.device)
        mask = mask.tril(C - n) if causal else mask
    sink_ok = torch.ones(*mask.shape[:-1], 1, dtype=torch.bool, device=mask.device)
    mask = torch.cat([mask, sink_ok], dim=-1)                                # every query sees the sink
    out = sdpa(qa, ka, va, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[..., :D]                                                      # [B, Hq, n, D]
