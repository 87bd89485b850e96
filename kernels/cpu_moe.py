"""Fused MoE on CPU: token-expert pairs sorted by expert, then one of three forms.

- `loop`: one pair of GEMMs per expert that has work, each through the linear form `kernels.cpu_forms` picks
  for its row count and kind. Any weight kind, int8 included.
- `grouped`: one `torch._grouped_mm` over all the experts for gate/up and one for down, on the packed
  buffers as they are (a transposed view, no copy). Float weights only. It computes each expert exactly as
  the `linear` form does (checked bitwise on the machine before it may be chosen), so it runs only where
  every expert of the call would use `linear` anyway: which form runs never changes a pair's result.
- batch invariance (`cpu_forms.set_batch_invariant`): every pair alone, one-row forms, so a pair's result
  does not depend on the other pairs of the call.
- `native`: Colibri's own expert FFN (kernels/native/), the whole layer's experts in one call, gate/up, the
  activation and down in float32: used wherever it was built, takes the kind and was found right (not raced,
  so no measurement can change a pair's result; batch-invariant by construction).

No Python work per token outside batch invariance: the sort, the counts and the scatter-add are vectorised.
Each pair's weighted output is float32; the sum over a token's pairs is float64. A sum of K float32 values
whose magnitudes lie within 2^(29 - ceil(log2 K)) of each other (2^26 for top-8, 2^25 for top-16) is exact in
float64, so it is the same in any order or grouping: the experts' placement over workers, replicas, an
expert cache's rounds, none of them changes it. Callers that add several calls (workers, cache rounds) pass
one float64 `acc` and round once at the end.

Shapes: T tokens, H hidden size, E local experts, I expert width, K experts per token (top-k), P
token-expert pairs computed here, n pairs of one expert.
"""

from __future__ import annotations

import torch

from kernels import native
from kernels.activation import SILU, GatedAct
from kernels.cpu_forms import FORMS, Form, batch_invariant, bucket, dtype_name, kind, pick_rows
from kernels.expert_rows import ExpertRows
from kernels.formats.int8 import Int8Weight

MOE_FORMS = ("loop", "grouped")
_TABLE: dict[str, str] = {}
_NATIVE_REJECTED: set[str] = set()       # moe_shape_id()s whose native expert FFN was found wrong here


def moe_key(E: int, I: int, H: int, weight_kind: str, rows: int) -> str:
    return f"moe:{E}x{I}x{H}:{weight_kind}:{rows}"


def moe_shape_id(E: int, I: int, H: int, weight_kind: str) -> str:
    return f"{E}x{I}x{H}:{weight_kind}"


def moe_candidates(weight_kind: str) -> tuple[str, ...]:
    """The torch forms raced where the native expert FFN does not serve (the native one is not raced: it is
    used wherever it takes the kind and was found right, so no measurement can change a pair's result)."""
    return ("loop",) if weight_kind.startswith(("int8-", "w8a8-")) else MOE_FORMS


def native_serves(E: int, I: int, H: int, weight_kind: str) -> bool:
    """Whether the native expert FFN computes E experts of this width, hidden size and kind here (not found
    wrong for this very shape)."""
    return native.available() and weight_kind in native.KINDS and moe_shape_id(E, I, H, weight_kind) not in \
        _NATIVE_REJECTED


def install_moe(table: dict[str, str], native_rejected: set[str] | frozenset[str] = frozenset()) -> None:
    """Make `fused_moe_cpu` use these winners (keys from `moe_key`; others keep `loop`) where the native expert
    FFN does not serve, and never the native one for the `native_rejected` shapes."""
    unknown = set(table.values()) - set(MOE_FORMS)
    if unknown:
        raise ValueError(f"unknown CPU MoE forms {sorted(unknown)}; known: {', '.join(MOE_FORMS)}")
    _TABLE.update(table)
    _NATIVE_REJECTED.update(native_rejected)


def pick_moe(x: torch.Tensor, w13: torch.Tensor | Int8Weight | ExpertRows) -> str:
    E, two_i, H = w13.shape
    if isinstance(w13, ExpertRows):                      # in place: only the native kernel reads row blocks
        if not native_serves(E, two_i // 2, H, dtype_name(w13.dtype)):
            raise ValueError("experts in place (mapped) need the native expert FFN, which is not in use here "
                             f"({native.UNAVAILABLE or 'found wrong for this shape'}); pack them instead")
        return "native"
    weight_kind = kind(w13[0], x.dtype)
    if native_serves(E, two_i // 2, H, weight_kind):
        return "native"
    return _TABLE.get(moe_key(E, two_i // 2, H, weight_kind, bucket(x.shape[0])), "loop")


def local_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Global ids -> local rows; -1 where the expert is not held here or the id is negative."""
    ids = topk_ids.long()
    if expert_map is None:
        return ids
    safe = ids.clamp(min=0)
    return torch.where(ids >= 0, expert_map.long()[safe], torch.full_like(ids, -1))


def _loop(xs: torch.Tensor, w13: torch.Tensor | Int8Weight, w2: torch.Tensor | Int8Weight,
          counts: list[int], act: GatedAct, b13: torch.Tensor | None, b2: torch.Tensor | None) -> torch.Tensor:
    """The linear form is looked up once per row count (every expert has the same shapes and kind), and an
    int8 stack's per-expert views are made once: at one token this loop is most of a decode step's Python."""
    I = w2.shape[2]
    ys = torch.empty(xs.shape[0], w2.shape[1], dtype=torch.float32)           # [P, H]
    e13 = w13.rows if isinstance(w13, Int8Weight) else w13
    e2 = w2.rows if isinstance(w2, Int8Weight) else w2
    forms: dict[int, tuple[Form, Form]] = {}
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        f13, f2 = forms.get(n) or forms.setdefault(n, (pick_rows(n, xs.dtype, e13[e]), pick_rows(n, xs.dtype, e2[e])))
        gate_up = f13(xs[start:start + n], e13[e])                            # [n, 2I]
        if b13 is not None:                                                   # in the GEMM's dtype: an int8
            gate_up = (gate_up + b13[e]).to(gate_up.dtype)                    # down GEMM keeps its form
        h = act(gate_up[:, :I], gate_up[:, I:])                               # [n, I]
        ys[start:start + n] = f2(h, e2[e])                                    # [n, H]
        if b2 is not None:
            ys[start:start + n] += b2[e]
        start += n
    return ys


def _rows(xs: torch.Tensor, w13: torch.Tensor | Int8Weight, w2: torch.Tensor | Int8Weight,
          counts: list[int], act: GatedAct, b13: torch.Tensor | None, b2: torch.Tensor | None) -> torch.Tensor:
    """Batch invariance: each pair alone (one-row forms, the activation on one row)."""
    I = w2.shape[2]
    ys = torch.empty(xs.shape[0], w2.shape[1], dtype=torch.float32)           # [P, H]
    e13 = w13.rows if isinstance(w13, Int8Weight) else w13
    e2 = w2.rows if isinstance(w2, Int8Weight) else w2
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        f13, f2 = pick_rows(1, xs.dtype, e13[e]), pick_rows(1, xs.dtype, e2[e])
        for p in range(start, start + n):
            gate_up = f13(xs[p:p + 1], e13[e])                                 # [1, 2I]
            if b13 is not None:
                gate_up = (gate_up + b13[e]).to(gate_up.dtype)
            ys[p:p + 1] = f2(act(gate_up[:, :I], gate_up[:, I:]), e2[e])       # [1, H]
            if b2 is not None:
                ys[p] += b2[e]
        start += n
    return ys


def _grouped_matches_linear(counts: list[int], dtype: torch.dtype, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether every expert with work would use the `linear` form for its row count (the grouped GEMM then
    computes what the loop would)."""
    linear = FORMS["linear"].fn
    return all(pick_rows(n, dtype, w13[0]) is linear and pick_rows(n, dtype, w2[0]) is linear
               for n in set(counts) if n)


def _grouped(xs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: list[int], act: GatedAct,
             b13: torch.Tensor | None, b2: torch.Tensor | None) -> torch.Tensor:
    I = w2.shape[2]
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)  # [E] end row of each expert
    gate_up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)           # [P, 2I]
    expert = None
    if b13 is not None:                                                       # each pair's expert's biases
        expert = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))   # [P]
        gate_up = gate_up + b13[expert].to(gate_up.dtype)
    h = act(gate_up[:, :I], gate_up[:, I:])                                   # [P, I]
    ys = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs).float()          # [P, H]
    return ys if b2 is None else ys + b2[expert].float()


def combine(sums: torch.Tensor, ys: torch.Tensor, rows: torch.Tensor, pair_weights: torch.Tensor) -> None:
    """sums [T, H] float64 += ys [P, H] float32 x pair_weights [P] (in float32) at rows [P]: natively where built
    (torch's index_add_ is a serial scatter, 12% of a one-stream step), else in torch; the same bits either way."""
    if native.available():
        native.moe_sum_(sums, ys, rows, pair_weights)
    else:
        sums.index_add_(0, rows, (ys * pair_weights[:, None]).double())


def fused_moe_cpu(x: torch.Tensor, w13: torch.Tensor | Int8Weight | ExpertRows,
                  w2: torch.Tensor | Int8Weight | ExpertRows,
                  topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, form: str | None = None, act: GatedAct = SILU,
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  acc: torch.Tensor | None = None) -> torch.Tensor:
    """`form` None = the measured one for this shape and row count (a given `form` is run as asked: the
    measurement races them); `act`, b13 [E, 2I], b2 [E, H], `acc` (float64 [T, H], added to and returned) as
    kernels.fused_moe."""
    T, H = x.shape
    K = topk_ids.shape[1]
    forced = form is not None
    form = form or pick_moe(x, w13)
    if isinstance(w13, ExpertRows) != isinstance(w2, ExpertRows) or (isinstance(w13, ExpertRows)
                                                                     and form != "native"):
        raise ValueError("experts in place (ExpertRows) come as both w13 and w2 and run the native expert FFN")
    if form == "native":                                         # the layer's expert side in one native call
        sums = torch.zeros(T, H, dtype=torch.float64) if acc is None else acc
        native.moe_(sums, x, topk_ids, topk_weights, expert_map, w13, w2, act, b13, b2)
        if acc is not None:
            return acc
        return sums.to(x.dtype) if out is None else out.copy_(sums)
    if form == "grouped" and isinstance(w13, Int8Weight):
        raise ValueError("the grouped CPU MoE form takes float weights; int8 experts use 'loop'")
    flat = local_ids(topk_ids, expert_map).reshape(-1)           # [T*K]
    order = torch.argsort(flat, stable=True)                     # [T*K] pairs grouped by expert, dropped first
    counts = torch.bincount(flat + 1, minlength=w13.shape[0] + 1).tolist()  # [1 + E]; slot 0 = dropped
    order = order[counts[0]:]                                    # [P] the pairs computed here
    rows = order // K                                            # [P] token of each pair
    same = x.dtype == w13.dtype or isinstance(w13, Int8Weight)   # int8 weights take x's dtype as it is
    xs = (x if same else x.to(w13.dtype))[rows]                  # [P, H] one gather for all experts
    if order.numel() == 0:
        ys = torch.empty(0, H, dtype=torch.float32)
    elif batch_invariant() and not forced:
        ys = _rows(xs, w13, w2, counts[1:], act, b13, b2)
    elif form == "grouped" and (forced or _grouped_matches_linear(counts[1:], xs.dtype, w13, w2)):  # type: ignore[arg-type]
        ys = _grouped(xs, w13, w2, counts[1:], act, b13, b2)     # type: ignore[arg-type]
    else:
        ys = _loop(xs, w13, w2, counts[1:], act, b13, b2)
    pair_weights = topk_weights.reshape(-1)[order].float()      # [P] routed weight per pair, float32
    sums = torch.zeros(T, H, dtype=torch.float64) if acc is None else acc
    combine(sums, ys, rows, pair_weights)                        # [T, H] sum over k, exact (see above)
    if acc is not None:
        return acc
    return sums.to(x.dtype) if out is None else out.copy_(sums)
