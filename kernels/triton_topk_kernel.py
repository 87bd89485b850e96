"""Triton top-k softmax routing kernel (jit code only).

Shapes: E experts (BLOCK_E lanes, the next power of two), TOP_K experts per token (any k; TOPK_POW2 lanes,
the padded ones masked).
"""

import triton
import triton.language as tl


@triton.jit
def topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l,
                        TOP_K: tl.constexpr, TOPK_POW2: tl.constexpr, BLOCK_E: tl.constexpr,
                        RENORMALIZE: tl.constexpr):
    """One row: softmax over all experts in float32, the k largest (lowest index on ties), renormalised."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    ok = cols < num_experts
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + cols, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)                                   # [BLOCK_E]
    p = tl.where(ok, p, -1.0)
    total = 0.0
    for k in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, cols, BLOCK_E), axis=0)
        tl.store(weights_ptr + row * TOP_K + k, best)
        tl.store(ids_ptr + row * TOP_K + k, idx.to(tl.int64))
        total += best
        p = tl.where(cols == idx, -1.0, p)
    if RENORMALIZE:
        slot = tl.arange(0, TOPK_POW2)
        used = slot < TOP_K
        w = tl.load(weights_ptr + row * TOP_K + slot, mask=used, other=0.0)
        tl.store(weights_ptr + row * TOP_K + slot, w / total, mask=used)
