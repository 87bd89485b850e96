"""Triton paged decode-attention kernel (jit code only): one query token per sequence against its keys where the
paged KV cache holds them, read through the sequence's block table; grouped heads, a sliding window and GPT-OSS's
sinks (kernels/triton_decode_attention.py has the launcher and the semantics).

One program per (sequence, query head): an online softmax over BLOCK_N keys at a time, in float32.

Shapes: B sequences, Hq / Hkv query / key-value heads (GROUP = Hq / Hkv), D / DV the key / value head dims
(BLOCK_D / BLOCK_DV lanes, the next powers of two), S cache slots, NB blocks in a table row.
"""

import triton
import triton.language as tl


# The table's row stride is the step's block count op by op (1, 2, 3, ...) and the largest context's in a CUDA graph:
# Triton would compile a variant for 1 and for multiples of 16 on first use, mid-serving (hundreds of ms each).
@triton.jit(do_not_specialize=["stride_tb"])
def paged_decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, lens_ptr, sinks_ptr,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ob, stride_oh, stride_tb,
    scale, window, group, block_size, head_d, head_dv,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """out[b, h] = Σ_j softmax_j(scale · q[b, h] · k[slot_j]) v[slot_j] over positions j in [start, lens[b]) of
    sequence b, slot_j = table[b, j // block_size] · block_size + j % block_size, start = max(0, lens[b] - window)
    when window > 0; with sinks, sinks[h] joins the softmax's denominator as one more logit (its value is zero)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // group
    length = tl.load(lens_ptr + b)
    start = tl.where(window > 0, tl.maximum(length - window, 0), 0)     # a sliding layer's first key
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_d
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < head_dv
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    q = q * scale                                                          # [BLOCK_D]
    m = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)     # the running max logit
    l_sum = tl.sum(tl.zeros([BLOCK_N], dtype=tl.float32), axis=0)         # the running Σ exp(logit - m)
    if HAS_SINKS:
        m = tl.load(sinks_ptr + h).to(tl.float32)                          # the sink's logit: exp(s - m) = 1
        l_sum = l_sum + 1.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for n0 in range(start, length, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)                                   # [BLOCK_N]
        ok = pos < length
        blk = tl.load(table_ptr + b.to(tl.int64) * stride_tb + pos // block_size, mask=ok, other=0)
        slot = blk.to(tl.int64) * block_size + pos % block_size           # [BLOCK_N]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)     # [BLOCK_N, BLOCK_D]
        s = tl.sum(k * q[None, :], axis=1)                                 # [BLOCK_N]
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        p = tl.exp(s - m_new)                                              # [BLOCK_N], 0 where masked
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + dv[None, :],
                    mask=ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)   # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_sum = l_sum * alpha + tl.sum(p, axis=0)
        m = m_new
    out = acc / l_sum                                                      # [BLOCK_DV]
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + dv, out.to(out_ptr.dtype.element_ty), mask=dv_ok)
