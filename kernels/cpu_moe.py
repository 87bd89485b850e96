"""Fused MoE on CPU: token-expert pairs sorted by expert, then one of two measured forms.

- `loop`: one pair of GEMMs per expert that has work, each through `kernels.cpu_linear.linear` (which
  picks its own form per row count and dtype). Any weight kind, int8 included.
- `grouped`: one `torch._grouped_mm` over all the experts for gate/up and one for down, on the packed
  buffers as they are (a transposed view, no copy). Float weights only; the activations take their dtype.

No Python work per token: the sort, the counts and the scatter-add are vectorised. Accumulation is float32
whatever the weights' dtype. Which form runs is measured per machine (`kernels/cpu_tune.py`) for the
shard's shape and the row bucket; before that, `loop` (the form measured on the AVX2 dev machine).

Shapes: T tokens, H hidden size, E local experts, I expert width, K experts per token (top-k), P
token-expert pairs computed here, n pairs of one expert.
"""

from __future__ import annotations

import torch

from kernels.activation import SILU, GatedAct
from kernels.cpu_forms import Form, bucket, dtype_name, pick_rows
from kernels.quant import Int8Weight

MOE_FORMS = ("loop", "grouped")
_TABLE: dict[str, str] = {}


def moe_key(E: int, I: int, H: int, weight_kind: str, rows: int) -> str:
    return f"moe:{E}x{I}x{H}:{weight_kind}:{rows}"


def moe_candidates(weight_kind: str) -> tuple[str, ...]:
    return ("loop",) if weight_kind.startswith("int8") else MOE_FORMS


def install_moe(table: dict[str, str]) -> None:
    """Make `fused_moe_cpu` use these winners (keys from `moe_key`); others keep `loop`."""
    unknown = set(table.values()) - set(MOE_FORMS)
    if unknown:
        raise ValueError(f"unknown CPU MoE forms {sorted(unknown)}; known: {', '.join(MOE_FORMS)}")
    _TABLE.update(table)


def _kind(w13: torch.Tensor | Int8Weight, x: torch.Tensor) -> str:
    return f"int8-{dtype_name(x.dtype)}" if isinstance(w13, Int8Weight) else dtype_name(w13.dtype)


def pick_moe(x: torch.Tensor, w13: torch.Tensor | Int8Weight) -> str:
    E, two_i, H = w13.shape
    return _TABLE.get(moe_key(E, two_i // 2, H, _kind(w13, x), bucket(x.shape[0])), "loop")


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


def fused_moe_cpu(x: torch.Tensor, w13: torch.Tensor | Int8Weight, w2: torch.Tensor | Int8Weight,
                  topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, form: str | None = None, act: GatedAct = SILU,
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
    """`form` None = the measured one for this shape and row count; `act`, b13 [E, 2I], b2 [E, H] as
    kernels.fused_moe."""
    T, H = x.shape
    K = topk_ids.shape[1]
    form = form or pick_moe(x, w13)
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
    elif form == "grouped":
        ys = _grouped(xs, w13, w2, counts[1:], act, b13, b2)     # type: ignore[arg-type]
    else:
        ys = _loop(xs, w13, w2, counts[1:], act, b13, b2)
    ys *= topk_weights.reshape(-1)[order].float()[:, None]       # routed weight per pair
    acc = torch.zeros(T, H, dtype=torch.float32).index_add_(0, rows, ys)  # [T, H] sum over k
    if out is None:
        return acc.to(x.dtype)
    return out.copy_(acc)
