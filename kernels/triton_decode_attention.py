"""Launcher of the Triton paged decode attention: checks shapes and dtypes, computes the grid (one program per
sequence and query head).

On a GPU a decode step's attention was a gather of every sequence's keys into a padded copy, a mask, and an
SDPA call per layer (a dozen launches, shapes that change every step); this reads the keys where the cache
holds them, through the block tables, in one launch whose shapes depend only on the batch, so a decode step can
be captured in a CUDA graph (router_service/model/decode_graphs.py).

Few sequences over long contexts would leave most of a GPU idle with one program per (sequence, head) walking a
whole context, so the keys are split (flash-decoding) until there are about two programs per multiprocessor:
each split at least MIN_SPLIT keys, at most MAX_SPLITS splits, their partial softmaxes joined by a second kernel.
The split count follows from the shapes alone (the table's width, not the lengths: no sync), so a CUDA graph
fixes it per batch bucket; splits past a short context exit at once. It also sets the order of a softmax's sums,
so a query's float32 bits depend on its batch's size and the GPU, as the GPU's linears and MoE tiles already do
(`--batch-invariant` is the CPU path's).

Shapes: B sequences, Hq / Hkv query / key-value heads, D / Dv the key / value head dims, S slots, NB blocks a row,
P splits.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from kernels.triton_decode_attention_kernel import combine_splits_kernel, paged_decode_attention_kernel

BLOCK_N = 32          # keys a loop iteration
MIN_SPLIT = 256       # keys a split takes at least
MAX_SPLITS = 16


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_count(programs: int, span: int, multiprocessors: int) -> int:
    """How many splits each of `programs` (sequence, head) pairs gets over its `span` keys at most: one where there
    are already two programs per multiprocessor; else enough for that, each of at least MIN_SPLIT keys, at most
    MAX_SPLITS."""
    wanted = triton.cdiv(2 * multiprocessors, max(programs, 1))
    return max(1, min(MAX_SPLITS, wanted, triton.cdiv(span, MIN_SPLIT)))


def auto_splits(q: torch.Tensor, span: int) -> int:
    """`split_count` on q's GPU; one on a CPU (the interpreter)."""
    return split_count(q.shape[0] * q.shape[1], span, _multiprocessors(q.device)) if q.is_cuda else 1


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                           lens: torch.Tensor, block_size: int, sinks: torch.Tensor | None = None,
                           window: int = 0, scale: float | None = None, out: torch.Tensor | None = None,
                           splits: int | None = None) -> torch.Tensor:
    """q [B, Hq, D], k_cache [S, Hkv, D], v_cache [S, Hkv, Dv], table [B, NB] block ids, lens [B] each sequence's
    context, at least 1 (its keys are positions 0..lens-1, the query's own included; not checked: that would read
    the lengths back, a sync) -> [B, Hq, Dv] in q's dtype (into `out` when given). `window` > 0: only the last
    `window` positions (a sliding layer). `sinks` [Hq]: GPT-OSS's per-head logit in the softmax's denominator.
    `scale` defaults to D ** -0.5. `splits`: how many parts each context is split into, 1..MAX_SPLITS (None:
    `auto_splits`)."""
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("paged_decode_attention needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        raise ValueError(f"paged_decode_attention: need q [B,Hq,D], k_cache [S,Hkv,D], v_cache [S,Hkv,Dv]; got "
                         f"{list(q.shape)}, {list(k_cache.shape)}, {list(v_cache.shape)}")
    B, Hq, D = q.shape
    S, Hkv, Dk = k_cache.shape
    Dv = v_cache.shape[2]
    if Dk != D or v_cache.shape[:2] != (S, Hkv) or Hq % Hkv:
        raise ValueError(f"paged_decode_attention: shapes disagree: q {list(q.shape)}, k_cache "
                         f"{list(k_cache.shape)}, v_cache {list(v_cache.shape)} (Hq must be a multiple of Hkv)")
    if table.dim() != 2 or table.shape[0] != B or lens.shape != (B,):
        raise ValueError(f"paged_decode_attention: table must be [B={B}, NB] and lens [B], got {list(table.shape)}, "
                         f"{list(lens.shape)}")
    if sinks is not None and sinks.shape != (Hq,):
        raise ValueError(f"paged_decode_attention: sinks must be [Hq={Hq}], got {list(sinks.shape)}")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or table.stride(1) != 1:
        raise ValueError("paged_decode_attention: the head dims and the table rows must have unit stride")
    tensors = [k_cache, v_cache, table, lens] + ([sinks] if sinks is not None else [])
    if any(t.device != q.device for t in tensors):
        raise ValueError(f"paged_decode_attention: every tensor must be on the query's device {q.device}")
    if out is None:
        out = torch.empty(B, Hq, Dv, dtype=q.dtype, device=q.device)      # [B, Hq, Dv]
    elif out.shape != (B, Hq, Dv) or out.stride(2) != 1:
        raise ValueError(f"paged_decode_attention: out must be [B={B}, Hq={Hq}, Dv={Dv}] with unit stride")
    if splits is not None and not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"paged_decode_attention: splits must be in 1..{MAX_SPLITS}, got {splits}")
    if B == 0:
        return out
    span = table.shape[1] * block_size if window <= 0 else min(window, table.shape[1] * block_size)   # keys a row
    parts = auto_splits(q, span) if splits is None else splits
    split_len = triton.cdiv(triton.cdiv(max(span, 1), parts), BLOCK_N) * BLOCK_N   # a multiple of BLOCK_N
    if parts > 1:
        m = torch.empty(B, Hq, parts, dtype=torch.float32, device=q.device)          # [B, Hq, P]
        ls = torch.empty_like(m)
        acc = torch.empty(B, Hq, parts, Dv, dtype=torch.float32, device=q.device)   # [B, Hq, P, Dv]
    else:
        m = ls = acc = out                                                          # unused
    sink_arg = sinks if sinks is not None else q
    paged_decode_attention_kernel[(B, Hq, parts)](
        q, k_cache, v_cache, out, table, lens, sink_arg, m, ls, acc,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), table.stride(0),
        float(D ** -0.5 if scale is None else scale), int(window), Hq // Hkv, int(block_size), D, Dv,
        split_len if parts > 1 else max(span, 1), Hq, parts,
        BLOCK_N=BLOCK_N, BLOCK_D=triton.next_power_of_2(D), BLOCK_DV=triton.next_power_of_2(Dv),
        HAS_SINKS=sinks is not None, SPLIT=parts > 1)
    if parts > 1:
        combine_splits_kernel[(B, Hq)](
            m, ls, acc, out, sink_arg, out.stride(0), out.stride(1), Dv, Hq, parts,
            BLOCK_S=triton.next_power_of_2(MAX_SPLITS), BLOCK_DV=triton.next_power_of_2(Dv),
            HAS_SINKS=sinks is not None)
    return out
