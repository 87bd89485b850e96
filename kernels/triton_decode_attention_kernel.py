"""Triton paged decode-attention kernel (jit code only): one query token per sequence against its keys where the
paged KV cache holds them, read through the sequence's block table; grouped heads, a sliding window and GPT-OSS's
sinks (kernels/triton_decode_attention.py has the launcher and the semantics).

One program per (sequence, query head, split of the keys): an online softmax over BLOCK_N keys at a time, in
float32; with more than one split, combine_splits_kernel joins the splits' partial softmaxes (flash-decoding).

Shapes: B sequences, Hq / Hkv query / key-value heads (GROUP = Hq / Hkv), D / DV the key / value head dims
(BLOCK_D / BLOCK_DV lanes, the next powers of two), S splits of a context (BLOCK_S lanes), NB blocks in a table
row.
"""

import triton
import triton.language as tl


# The table's row stride, the split length and the split count follow the step's block count op by op (1, 2, 3, ...)
# and the largest context's in a CUDA graph: Triton would compile a variant for 1 and for multiples of 16 of each on
# first use, mid-serving (hundreds of ms each).
@triton.jit(do_not_specialize=["stride_tb", "split_len", "num_splits"])
def paged_decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, lens_ptr, sinks_ptr, m_ptr, l_ptr, acc_ptr,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ob, stride_oh, stride_tb,
    scale, window, group, block_size, head_d, head_dv, split_len, num_heads, num_splits,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """out[b, h] = Σ_j softmax_j(scale · q[b, h] · k[slot_j]) v[slot_j] over positions j in [start, lens[b]) of
    sequence b, slot_j = table[b, j // block_size] · block_size + j % block_size, start = max(0, lens[b] - window)
    when window > 0; with sinks, sinks[h] joins the softmax's denominator as one more logit (its value is zero).
    Program (b, h, s) takes the keys [start + s · split_len, start + (s + 1) · split_len). SPLIT: it writes its
    running max m, sum l and unnormalised acc [Dv] to m / l / acc [B, Hq, S(, Dv)] for combine_splits_kernel (a
    split past the context writes m = -inf, l = 0); else (one split) it writes out, normalised, the sink included."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    kvh = h // group
    length = tl.load(lens_ptr + b)
    start = tl.where(window > 0, tl.maximum(length - window, 0), 0)     # a sliding layer's first key
    lo = start + sp * split_len
    hi = tl.minimum(length, lo + split_len)                                # this program's keys [lo, hi)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_d
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < head_dv
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    q = q * scale                                                          # [BLOCK_D]
    m = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)     # the running max logit
    l_sum = tl.sum(tl.zeros([BLOCK_N], dtype=tl.float32), axis=0)         # the running Σ exp(logit - m)
    if HAS_SINKS and not SPLIT:
        m = tl.load(sinks_ptr + h).to(tl.float32)                          # the sink's logit: exp(s - m) = 1
        l_sum = l_sum + 1.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)                                   # [BLOCK_N]
        ok = pos < hi
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
    if SPLIT:
        part = (b.to(tl.int64) * num_heads + h) * num_splits + sp
        tl.store(m_ptr + part, m)
        tl.store(l_ptr + part, l_sum)
        tl.store(acc_ptr + part * head_dv + dv, acc, mask=dv_ok)
    else:
        out = acc / l_sum                                                  # [BLOCK_DV]
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + dv, out.to(out_ptr.dtype.element_ty),
                 mask=dv_ok)


@triton.jit(do_not_specialize=["num_splits"])
def combine_splits_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, sinks_ptr, stride_ob, stride_oh, head_dv, num_heads, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """out[b, h] = Σ_s exp(m_s - M) acc_s / (Σ_s exp(m_s - M) l_s [+ exp(sink_h - M)]), M the largest m_s (and the
    sink): the splits of one (sequence, head) joined as one softmax. Split 0 always holds a key, so M is finite."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    base = (b.to(tl.int64) * num_heads + h) * num_splits
    sp = tl.arange(0, BLOCK_S)
    s_ok = sp < num_splits
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < head_dv
    m = tl.load(m_ptr + base + sp, mask=s_ok, other=float("-inf"))      # [BLOCK_S]
    ls = tl.load(l_ptr + base + sp, mask=s_ok, other=0.0)
    top = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        top = tl.maximum(top, sink)
    w = tl.exp(m - top)                                                    # [BLOCK_S], 0 for empty splits
    total = tl.sum(w * ls, axis=0)
    if HAS_SINKS:
        total = total + tl.exp(sink - top)
    acc = tl.load(acc_ptr + (base + sp)[:, None] * head_dv + dv[None, :], mask=s_ok[:, None] & dv_ok[None, :],
                  other=0.0)                                               # [BLOCK_S, BLOCK_DV]
    out = tl.sum(w[:, None] * acc, axis=0) / total                         # [BLOCK_DV]
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + dv, out.to(out_ptr.dtype.element_ty), mask=dv_ok)
