"""Triton kernels of the fused MoE (jit code only; launchers live in triton_moe.py).

Shapes: P token-expert pairs (T tokens x top_k), H hidden size, I expert width; tiles BLOCK_M pair rows,
BLOCK_N output columns, BLOCK_K steps of the reduction dimension (H in gate/up, I in down). The launcher sums
each token's top_k weighted rows afterwards (one torch reduction). HAS_BIAS adds the experts' biases
(b13 [E, 2I], b2 [E, H]); CLAMPED is GPT-OSS's clamped SwiGLU (kernels/activation.py), else alpha = 1 and
up_offset = 0 give silu(gate) * up.
WFMT, the weights' format: 0 the activations' float dtype; 1 block-scaled FP8 (kernels/formats/fp8.py), each
loaded tile times its blocks' float32 scales; 2 MXFP4 (kernels/formats/mxfp4.py), each tile's e2m1 nibbles
decoded and times 2^(s - SCALE_BIAS) of its BLOCK-value block. Scales are [E, R / scale_bn, C / scale_bk] either way;
a quantised tile is cast to the activations' dtype before the dot.
"""

import triton
import triton.language as tl

from kernels.formats.mxfp4 import SCALE_BIAS

MX_SCALE_BIAS = tl.constexpr(SCALE_BIAS)


@triton.jit
def weight_tile(w_base, s_base, rows, ks, ok, stride_wn, stride_sn, stride_sk, scale_bn, scale_bk,
                WFMT: tl.constexpr):
    """The weight tile [BK, BN] of output rows `rows` [BN] and inputs `ks` [BK]: as stored (WFMT 0) or
    dequantised to float32."""
    # one return at the end: Triton's code generator follows every constexpr branch's tail
    if WFMT == 2:                                                         # MXFP4: two e2m1 codes a byte
        byte = tl.load(w_base + rows[None, :] * stride_wn + ks[:, None] // 2, mask=ok, other=0).to(tl.int32)
        code = (byte >> ((ks[:, None] % 2) * 4)) & 15                     # [BK, BN] sign | exponent(2) | mantissa
        exp = (code >> 1) & 3
        half = (code & 1).to(tl.float32) * 0.5
        mag = tl.where(exp == 0, half, (1.0 + half) * tl.exp2((exp - 1).to(tl.float32)))
        sc = tl.load(s_base + (rows[None, :] // scale_bn) * stride_sn + (ks[:, None] // scale_bk) * stride_sk,
                     mask=ok, other=MX_SCALE_BIAS).to(tl.float32)
        w = tl.where((code & 8) != 0, -mag, mag) * tl.exp2(sc - MX_SCALE_BIAS)
    elif WFMT == 1:                                                       # FP8: times its block's scale
        v = tl.load(w_base + rows[None, :] * stride_wn + ks[:, None], mask=ok, other=0.0)
        sc = tl.load(s_base + (rows[None, :] // scale_bn) * stride_sn + (ks[:, None] // scale_bk) * stride_sk,
                     mask=ok, other=0.0)
        w = v.to(tl.float32) * sc
    else:
        w = tl.load(w_base + rows[None, :] * stride_wn + ks[:, None], mask=ok, other=0.0)
    return w


@triton.jit
def gate_up_act_kernel(
    x_ptr, w13_ptr, h_ptr, pair_ids_ptr, block_expert_ptr, b13_ptr, s13_ptr,
    num_pairs, top_k, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_hp, stride_be,
    stride_se, stride_sn, stride_sk, scale_bn, scale_bk,
    alpha, limit, up_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, WFMT: tl.constexpr,
):
    """h[pair, n] = act(x[t] · w13[e, n] + b13[e, n], x[t] · w13[e, I + n] + b13[e, I + n]) for the pairs of
    one block; act(g, u) = g · sigmoid(alpha g) · (u + up_offset), g and u clamped first when CLAMPED."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:                                                        # past the data (a graph's fixed grid)
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ids_ptr + rows)                                  # [BM]
    row_ok = pairs < num_pairs
    tokens = pairs // top_k
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                        # [BN]
    col_ok = cols < inter
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    s_base = s13_ptr + expert.to(tl.int64) * stride_se
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None].to(tl.int64) * stride_xt + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)      # [BM, BK]
        ok = col_ok[None, :] & k_ok[:, None]
        wg = weight_tile(w_base, s_base, cols, ks, ok, stride_wn, stride_sn, stride_sk, scale_bn, scale_bk,
                         WFMT).to(a.dtype)                                # [BK, BN] gate
        wu = weight_tile(w_base, s_base, cols + inter, ks, ok, stride_wn, stride_sn, stride_sk, scale_bn,
                         scale_bk, WFMT).to(a.dtype)                      # [BK, BN] up
        acc_g = tl.dot(a, wg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=PRECISION)
    if HAS_BIAS:
        b_base = b13_ptr + expert.to(tl.int64) * stride_be
        acc_g += tl.load(b_base + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_base + inter + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if CLAMPED:
        acc_g = tl.minimum(acc_g, limit)
        acc_u = tl.maximum(tl.minimum(acc_u, limit), -limit)
    h = acc_g * tl.sigmoid(acc_g * alpha) * (acc_u + up_offset)           # [BM, BN]
    tl.store(h_ptr + pairs[:, None].to(tl.int64) * stride_hp + cols[None, :],
             h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def down_weighted_kernel(
    h_ptr, w2_ptr, y_ptr, pair_ids_ptr, block_expert_ptr, weights_ptr, b2_ptr, s2_ptr,
    num_pairs, hidden, inter,
    stride_hp, stride_we, stride_wn, stride_yp, stride_be,
    stride_se, stride_sn, stride_sk, scale_bn, scale_bk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr, WFMT: tl.constexpr,
):
    """y[pair, n] = w[pair] · (h[pair] · w2[e, n] + b2[e, n]): bias and routed weight in the epilogue."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:                                                        # past the data (a graph's fixed grid)
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ids_ptr + rows)
    row_ok = pairs < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w2_ptr + expert.to(tl.int64) * stride_we
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(h_ptr + pairs[:, None].to(tl.int64) * stride_hp + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)      # [BM, BK]
        w = weight_tile(w_base, s2_ptr + expert.to(tl.int64) * stride_se, cols, ks, col_ok[None, :] & k_ok[:, None],
                        stride_wn, stride_sn, stride_sk, scale_bn, scale_bk, WFMT).to(a.dtype)   # [BK, BN]
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b2_ptr + expert.to(tl.int64) * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    rw = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)  # [BM]
    acc = acc * rw[:, None]
    tl.store(y_ptr + pairs[:, None].to(tl.int64) * stride_yp + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])
