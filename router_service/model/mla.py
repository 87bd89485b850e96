"""Multi-head latent attention (DeepSeek-V2/V3) over the paged cache, in the absorbed form throughout.

Per token the cache holds the normalised latent c [Lkv] (as K) and the shared rotated key k_pe [Dr] (as V): the
real, compressed size (ModelConfig.kv_layout). Keys and values are never expanded per head: the query's
no-position part is moved into latent space (q_nope · W_UK, per head), so a score is
q_lat · c + q_pe · k_pe, the same as transformers' q_nope · k_nope + q_pe · k_pe; the attention output over
the latents goes back through W_UV per head. One SDPA call per decode batch / prefill over keys [c | k_pe] of
one head shared by every query head, with the keys as values too (equal dims let SDPA use its fused kernels;
the first Lkv output dims are the latent output): decode folds the heads into the query length (one query
per head against one key head), prefill shares the key head across query heads (enable_gqa).

Shapes: T tokens, Hq heads, Dn / Dr / Dv a head's no-position, rotary and value dims, Lq / Lkv the query and
KV latent ranks, Bd decode sequences, C context length, n new tokens of one prefill.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from colibri_common.config import ModelConfig
from kernels import linear
from router_service.model.kv_cache import KVCache
from router_service.model.layers import RowMap, rms_norm, whole
from router_service.model.query_context import query_contexts
from router_service.model.sdpa import sdpa
from router_service.model.step_inputs import StepInputs
from router_service.model.weights import MlaWeights

LATENT_EPS = 1e-6       # q_a_layernorm and kv_a_layernorm: transformers' and DeepSeek's fixed eps


def mla_scale(cfg: ModelConfig) -> float:
    """Softmax scale: (Dn + Dr)^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when the RoPE is scaled."""
    m, r = cfg.mla, cfg.rope_scaling
    assert m is not None
    scale = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
    if r.type != "default" and r.mscale_all_dim and r.factor > 1:
        mscale = 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0
        scale *= mscale * mscale
    return scale


Rope = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]      # (x, cos, sin) -> rotated x


def mla_attention(cfg: ModelConfig, w: MlaWeights, layer: int, x: torch.Tensor, rope: Rope, cos: torch.Tensor,
                  sin: torch.Tensor, step: StepInputs, kv: KVCache, scale: float, rows: RowMap = whole,
                  per_query: bool = False) -> torch.Tensor:
    """x [T, H] (normed) -> the heads' outputs [T, Hq Dv], before o_proj; writes this step's latents. `rows` runs
    the row-local parts (`by_row` under batch invariance), `per_query` the attention one query at a time."""
    m = cfg.mla
    assert m is not None
    T, heads = x.shape[0], cfg.num_heads
    Dn, Dr, L = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank

    def project(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each token's query in latent space and its latent and rotated key."""
        t = x.shape[0]
        if w.q is not None:
            q = linear(x, w.q)                                                # [t, Hq (Dn + Dr)]
        else:
            q = linear(rms_norm(linear(x, w.q_a), w.q_a_norm, LATENT_EPS), w.q_b)  # [t, Hq (Dn + Dr)]
        q_nope, q_pe = q.view(t, heads, Dn + Dr).split([Dn, Dr], dim=-1)     # [t, Hq, Dn], [t, Hq, Dr]
        c, k_pe = linear(x, w.kv_a).split([L, Dr], dim=-1)                  # [t, Lkv], [t, Dr]
        c = rms_norm(c, w.kv_a_norm, LATENT_EPS)[:, None, :]                # [t, 1, Lkv]
        q_pe, k_pe = rope(q_pe, cos, sin), rope(k_pe[:, None, :], cos, sin) # [t, Hq, Dr], [t, 1, Dr]
        q_lat = torch.einsum("thn,hnl->thl", q_nope, w.w_uk)                # [t, Hq, Lkv]
        return torch.cat([q_lat, q_pe], dim=-1), c, k_pe                     # [t, Hq, Lkv + Dr]

    query, c, k_pe = rows(project, x, cos, sin)
    kv.write(layer, step.slots, c, k_pe)
    out = torch.empty(T, heads, L, dtype=x.dtype, device=x.device)          # [T, Hq, Lkv]
    if per_query:                            # the decode layout for every query: heads as the query length
        for row, slots in query_contexts(step, False):
            lat, rot = kv.gather(layer, slots)                               # [C, 1, Lkv], [C, 1, Dr]
            keys = torch.cat([lat, rot], dim=-1).transpose(0, 1)[None]       # [1, 1, C, Lkv + Dr]
            o = sdpa(query[row][None, None], keys, keys, scale=scale)        # [1, 1, Hq, Lkv + Dr]
            out[row] = o[0, 0, :, :L]
        return rows(lambda o: torch.einsum("thl,hvl->thv", o, w.w_uv), out).reshape(T, -1)
    nd = step.num_decode
    if nd:
        lat, rot = kv.gather(layer, step.decode_slots)                       # [Bd, C, 1, Lkv], [Bd, C, 1, Dr]
        keys = torch.cat([lat, rot], dim=-1).transpose(1, 2)                 # [Bd, 1, C, Lkv + Dr]
        o = sdpa(query[:nd, None], keys, keys, attn_mask=step.decode_mask, scale=scale)   # [Bd, 1, Hq, Lkv + Dr]
        out[:nd] = o[:, 0, :, :L]                                            # [Bd, Hq, Lkv]
    for row, n, ctx_slots, mask in step.prefills:
        lat, rot = kv.gather(layer, ctx_slots)                               # [ctx, 1, Lkv], [ctx, 1, Dr]
        keys = torch.cat([lat, rot], dim=-1).transpose(0, 1)[None]           # [1, 1, ctx, Lkv + Dr]
        o = sdpa(query[row:row + n].transpose(0, 1)[None], keys, keys, attn_mask=mask, is_causal=mask is None,
                 scale=scale, enable_gqa=True)
        out[row:row + n] = o[0, :, :, :L].transpose(0, 1)                    # [n, Hq, Lkv]
    values = torch.einsum("thl,hvl->thv", out, w.w_uv)                      # [T, Hq, Dv]
    return values.reshape(T, -1)
