"""The kernels' one API: everything outside `kernels/` imports from here, nothing deeper (a test checks it).

Fused MoE and routing, Triton on CUDA tensors and the CPU forms (native or torch) on CPU tensors:

    fused_moe(x, w13, w2, topk_ids, topk_weights, expert_map=None, backend=None, out=None, act=SILU,
              b13=None, b2=None) -> [T, H]
    topk_route(logits, k, renormalize, scoring="softmax", bias=None, num_groups=1, topk_groups=1,
               group_score="max", scaling=1.0) -> (weights float32 [T, k], ids int64 [T, k])

`backend=None` picks Triton for CUDA tensors and the torch path otherwise; COLIBRI_MOE_BACKEND=triton|torch
overrides the automatic choice (with TRITON_INTERPRET=1 the Triton kernels run on CPU tensors).

`paged_decode_attention` is the Triton decode attention over the paged KV cache (where `backend_for` is triton);
`graph_safe()` switches this thread's kernels to their CUDA-graph forms (kernels/graph_safe.py).

Also here: the small-M `linear` of the router and its CPU forms (`pick_rows`, `tune`, `install` through the
forms file, `set_batch_invariant`), the weight formats (`int8`, `fp8`, `mxfp4` modules of kernels/formats/ and
their weight classes), `native` (the C++ ops: `native.describe()`, `native.decoder_ops()`, ...) and
`native_build` (their build: the ISA levels and their compiler flags, the compiler found).
"""

from __future__ import annotations

import os

from kernels.omp_policy import users_environment  # first: it sets OMP_WAIT_POLICY before torch loads libgomp

import torch

from kernels import native, native_build
from kernels.activation import SILU, GatedAct
from kernels.cpu_forms import BUCKETS, FORMS, Weight, batch_invariant, pick_rows, set_batch_invariant, weight_kind
from kernels.cpu_forms import describe as describe_forms
from kernels.cpu_forms import in_force as forms_in_force
from kernels.cpu_forms import kind as form_kind
from kernels.cpu_linear import cpu_has_fast_bf16, linear
from kernels.cpu_moe import fused_moe_cpu, native_serves, pick_moe
from kernels.cpu_tune import CANDIDATES, MoeShape, tune
from kernels.expert_rows import ExpertRows
from kernels.formats import fp8, int8, mxfp4
from kernels.formats.fp8 import Fp8Weight
from kernels.formats.int8 import QUANTIZE_MODES, Int8Weight, quantize_int8
from kernels.formats.mxfp4 import Mxfp4Weight
from kernels.graph_safe import graph_safe
from kernels.routing import Routing, topk_route_torch

BACKENDS = ("triton", "torch")


def backend_for(device: torch.device | str) -> str:
    """The backend `fused_moe` and `topk_route` pick for tensors on `device` when not told."""
    return os.environ.get("COLIBRI_MOE_BACKEND") or ("triton" if torch.device(device).type == "cuda" else "torch")


def describe_backend(device: torch.device | str) -> str:
    """For the start-up logs: 'torch', 'triton', or 'triton (interpreter)' on CPU tensors."""
    choice = backend_for(device)
    on_cpu = torch.device(device).type == "cpu"
    interpreted = choice == "triton" and on_cpu and os.environ.get("TRITON_INTERPRET") == "1"
    return f"{choice} (interpreter)" if interpreted else choice


def describe_expert_kernels(device: torch.device | str, shape: MoeShape | None) -> str:
    """For a worker's start-up log: what computes its experts (`shape`, as the forms were tuned for; None off the
    CPU) on `device`, e.g. 'native CPU kernels (amx)', 'torch forms (native CPU kernels: none, ...)' or 'triton
    kernels'."""
    choice = describe_backend(device)
    if torch.device(device).type != "cpu" or choice != "torch" or shape is None:
        return f"{choice} kernels"
    if not native.available():
        return f"torch forms (native CPU kernels: none, {native.UNAVAILABLE})"
    if shape.kind not in native.KINDS:
        return f"torch forms (the native CPU kernels take no {shape.kind} experts)"
    if not native_serves(shape.experts, shape.width, shape.hidden, shape.kind):
        return "torch forms (the native expert FFN was found wrong for this shape here)"
    return f"native CPU kernels ({native.isa()})"


def _pick(x: torch.Tensor, backend: str | None) -> str:
    choice = backend or backend_for(x.device)
    if choice not in BACKENDS:
        raise ValueError(f"MoE backend '{choice}' is unknown; use one of {', '.join(BACKENDS)}")
    if choice == "triton" and batch_invariant():
        raise ValueError("batch invariance runs the CPU forms one row at a time; the Triton kernels' tiles depend "
                         "on the batch (unset COLIBRI_MOE_BACKEND=triton, or serve without --batch-invariant)")
    return choice


def fused_moe(x: torch.Tensor, w13: Weight | ExpertRows, w2: Weight | ExpertRows, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, expert_map: torch.Tensor | None = None,
              backend: str | None = None, out: torch.Tensor | None = None, act: GatedAct = SILU,
              b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
              acc: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k w_k · (w2[e_k] @ act(gate, up) + b2[e_k]) per token; gate/up are the first/second halves of
    w13[e] @ x + b13[e]; `act` is silu(gate) * up or GPT-OSS's clamped form (kernels/activation.py).

    x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids/topk_weights [T, K] -> [T, H] in x's dtype (written
    into `out` when given). expert_map [E_global] maps global ids to rows of w13/w2, -1 = not held here.
    b13 [E, 2I] and b2 [E, H] (optional, together) are the experts' biases, rows as w13's.
    Each pair's weighted output is float32 and the sum over a token's pairs float64 (exact, so in any order:
    kernels/cpu_moe.py), rounded once to x's dtype; with `acc` (a float64 [T, H] tensor) the sum is added to
    it and `acc` returned unrounded, so calls over parts of the experts (workers, cache rounds) add up exactly.
    w13 and w2 may be `Int8Weight`s (per-row int8 with float32 scales): the CPU path computes them; or
    `Fp8Weight`s (block-scaled e4m3, as FP8 checkpoints publish them) or `Mxfp4Weight`s (GPT-OSS's experts as
    published): the Triton kernels compute them; or `ExpertRows` (experts in place over a mapped checkpoint):
    the native CPU kernels compute them.
    """
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe: need x [T,H], w13 [E,2I,H], w2 [E,H,I]; got {list(x.shape)}, "
                         f"{list(w13.shape)}, {list(w2.shape)}")
    E, two_i, H = w13.shape
    if x.shape[1] != H or w2.shape != (E, H, two_i // 2) or two_i % 2:
        raise ValueError(f"fused_moe: shapes disagree: x {list(x.shape)}, w13 {list(w13.shape)}, "
                         f"w2 {list(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: topk_ids {list(topk_ids.shape)} and topk_weights "
                         f"{list(topk_weights.shape)} must both be [T={x.shape[0]}, K]")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"fused_moe: out must be a contiguous {x.dtype} tensor of shape {list(x.shape)}")
    if (b13 is None) != (b2 is None) or (b13 is not None and (b13.shape != (E, two_i) or b2.shape != (E, H))):
        raise ValueError(f"fused_moe: biases must come together as b13 [E={E}, 2I={two_i}] and b2 [E, H={H}], got "
                         f"{None if b13 is None else list(b13.shape)}, {None if b2 is None else list(b2.shape)}")
    if acc is not None and (acc.shape != x.shape or acc.dtype != torch.float64 or not acc.is_contiguous()
                            or acc.device != x.device):
        raise ValueError(f"fused_moe: acc must be a contiguous float64 tensor of shape {list(x.shape)} on {x.device}")
    if x.shape[0] == 0:
        return acc if acc is not None else torch.empty_like(x) if out is None else out
    kept = isinstance(w13, (Fp8Weight, Mxfp4Weight)) or isinstance(w2, (Fp8Weight, Mxfp4Weight))
    if _pick(x, backend) == "triton":
        if isinstance(w13, (Int8Weight, ExpertRows)) or isinstance(w2, (Int8Weight, ExpertRows)):
            raise ValueError("fused_moe: int8 experts and experts in place run on the CPU path (backend='torch'); "
                             "the Triton kernels take packed float32, float16 or bfloat16 weights")
        from kernels.triton_moe import fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_ids, topk_weights, expert_map, out=out, act=act, b13=b13, b2=b2,
                                acc=acc)
    if kept:
        raise ValueError("fused_moe: FP8 and MXFP4 experts are computed by the Triton kernels (backend='triton', a "
                         "GPU or TRITON_INTERPRET=1); the CPU path takes them dequantised")
    return fused_moe_cpu(x, w13, w2, topk_ids, topk_weights, expert_map, out=out, act=act, b13=b13, b2=b2, acc=acc)


def topk_route(logits: torch.Tensor, k: int, renormalize: bool, scoring: str = "softmax",
               bias: torch.Tensor | None = None, num_groups: int = 1, topk_groups: int = 1, group_score: str = "max",
               scaling: float = 1.0, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` with the routing spelled out: scoring softmax | sigmoid | topk_softmax, a choice-only `bias` [E],
    group-limited choice (`num_groups`, `topk_groups`, `group_score` max | top2), renormalisation, `scaling`."""
    return route(logits, Routing(k, scoring, renormalize, num_groups, topk_groups, group_score, scaling), bias,
                 backend)


def route(logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None = None,
          backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k experts (best first) and their weights, as `routing` says (kernels/routing.py).
    logits [T, E] -> (weights float32 [T, k], ids int64 [T, k])."""
    if logits.dim() != 2:
        raise ValueError(f"topk_route: logits must be [T, E], got {list(logits.shape)}")
    routing.check(logits.shape[-1])
    if bias is not None and bias.shape != (logits.shape[-1],):
        raise ValueError(f"topk_route: bias must be [E={logits.shape[-1]}], got {list(bias.shape)}")
    if bias is not None and routing.scoring == "topk_softmax":
        raise ValueError("topk_route: a correction bias needs softmax or sigmoid scores, not topk_softmax")
    if _pick(logits, backend) == "triton":
        from kernels.triton_topk import topk_route_triton

        return topk_route_triton(logits, routing, bias)
    if logits.device.type == "cpu" and native.decoder_ops():      # one call where the torch form takes 6-12 ops
        return native.topk_route(logits, routing, bias)
    return topk_route_torch(logits, routing, bias)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                           lens: torch.Tensor, block_size: int, sinks: torch.Tensor | None = None,
                           window: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence against its keys where the paged cache holds them (the Triton kernel: CUDA
    tensors, or CPU ones under TRITON_INTERPRET=1; `backend_for` says where the router uses it).
    q [B, Hq, D], k_cache / v_cache [S, Hkv, D(v)], table [B, NB], lens [B] -> [B, Hq, Dv]
    (kernels/triton_decode_attention.py has the rest)."""
    from kernels.triton_decode_attention import paged_decode_attention as launch

    return launch(q, k_cache, v_cache, table, lens, block_size, sinks, window, out=out)


__all__ = [
    # fused MoE and routing
    "fused_moe", "route", "topk_route", "topk_route_torch", "backend_for", "describe_backend",
    "describe_expert_kernels", "BACKENDS", "Routing", "GatedAct", "SILU", "paged_decode_attention", "graph_safe",
    "ExpertRows", "native_serves", "fused_moe_cpu", "pick_moe",
    # the router's linear and the CPU forms
    "linear", "cpu_has_fast_bf16", "pick_rows", "Weight", "weight_kind", "form_kind", "describe_forms", "FORMS",
    "BUCKETS", "CANDIDATES", "MoeShape", "tune", "set_batch_invariant", "batch_invariant", "forms_in_force",
    # weight formats
    "int8", "fp8", "mxfp4", "Int8Weight", "Fp8Weight", "Mxfp4Weight", "quantize_int8", "QUANTIZE_MODES",
    # the C++ ops
    "native", "native_build",
    # the environment the user gave (less the OpenMP policy Colibri set for itself)
    "users_environment",
]
