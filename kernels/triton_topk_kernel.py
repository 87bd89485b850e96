"""Triton top-k routing kernel (jit code only): softmax / sigmoid / top-k-then-softmax scores, a choice-only
bias, group-limited choice, renormalisation and a scaling factor (kernels/routing.py has the semantics).

Shapes: E experts (BLOCK_E lanes, the next power of two), TOP_K experts per token (any k; TOPK_POW2 lanes,
the padded ones masked), NUM_GROUPS groups of `group_size` consecutive experts.
"""

import triton
import triton.language as tl


@triton.jit
def topk_route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, group_size, stride_l, scaling,
                      TOP_K: tl.constexpr, TOPK_POW2: tl.constexpr, BLOCK_E: tl.constexpr, SCORING: tl.constexpr,
                      HAS_BIAS: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                      GROUP_TOP2: tl.constexpr, RENORMALIZE: tl.constexpr):
    """One row (token). SCORING: 0 softmax, 1 sigmoid, 2 top-k logits then softmax. Ties go to the lower
    index (expert or group), as torch.topk and the float64 reference do."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    ok = cols < num_experts
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + cols, mask=ok, other=float("-inf")).to(tl.float32)
    if SCORING == 0:
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)                                 # [BLOCK_E]
    elif SCORING == 1:
        p = tl.sigmoid(x)
    else:
        p = x
    c = p                                                         # what choosing reads
    if HAS_BIAS:
        c = p + tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    c = tl.where(ok, c, float("-inf"))
    if NUM_GROUPS > 1:
        grp = cols // group_size
        taken = cols < 0                                          # experts of the groups chosen so far
        for _ in tl.static_range(TOPK_GROUPS):
            best_s = float("-inf")
            best_g = NUM_GROUPS
            for g in tl.static_range(NUM_GROUPS):
                in_g = (grp == g) & ok
                done = tl.max(tl.where(in_g & taken, 1, 0), axis=0) > 0
                v = tl.where(in_g, c, float("-inf"))
                s = tl.max(v, axis=0)
                if GROUP_TOP2:
                    first = tl.min(tl.where(v == s, cols, BLOCK_E), axis=0)
                    s = s + tl.max(tl.where(cols == first, float("-inf"), v), axis=0)
                s = tl.where(done, float("-inf"), s)
                better = s > best_s
                best_s = tl.where(better, s, best_s)
                best_g = tl.where(better, g, best_g)
            taken = taken | (grp == best_g)
        c = tl.where(taken, c, float("-inf"))
    slot = tl.arange(0, TOPK_POW2)
    used = slot < TOP_K
    w_acc = tl.zeros([TOPK_POW2], dtype=tl.float32)               # the k chosen, kept in registers
    i_acc = tl.zeros([TOPK_POW2], dtype=tl.int64)
    total = 0.0
    for k in tl.static_range(TOP_K):
        best = tl.max(c, axis=0)
        idx = tl.min(tl.where(c == best, cols, BLOCK_E), axis=0)
        idx = tl.minimum(idx, num_experts - 1)                    # a NaN row still names a real expert
        w = tl.sum(tl.where(cols == idx, p, 0.0), axis=0)        # the unbiased score (a logit for SCORING 2)
        w_acc = tl.where(slot == k, w, w_acc)
        i_acc = tl.where(slot == k, idx.to(tl.int64), i_acc)
        total += w
        c = tl.where(cols == idx, float("-inf"), c)
    if SCORING == 2:
        v = tl.where(used, w_acc, float("-inf"))
        e = tl.exp(v - tl.max(v, axis=0))
        w_acc = e / tl.sum(e, axis=0)
    elif RENORMALIZE:
        w_acc = w_acc / (total + 1e-20)
    tl.store(weights_ptr + row * TOP_K + slot, w_acc * scaling, mask=used)
    tl.store(ids_ptr + row * TOP_K + slot, i_acc, mask=used)
