"""Colibri's native CPU kernels (kernels/native/, built by `make setup`): loaded here when the build exists, one
Python op per kernel, each checked against a float64 reference before it may be used (kernels/cpu_check.py).

    linear(x, w, tiles) -> x @ w.T in x's dtype            w float32 | bfloat16 | Int8Weight (weight-only or W8A8);
        `tiles`: weight-only int8 against bf16 x on AMX tiles (widened per block), where the level has them
    moe_(acc, x, ids, weights, expert_map, w13, w2, act, b13, b2): the whole expert side of a layer in one call
        (sort, gather, expert FFN, routed weights, the float64 sum into acc [T, H]); W8A8 experts quantise the
        pairs' rows and the activations' rows (int8 x int8 products, exact int32 sums; AVX2: maddubs)
    moe_sum_(acc, ys, rows, weights): acc [T, H] float64 += each pair's ys * weight (float32) at its token's row
    decode_attention(q, k, v, slots, lens, sinks, scale): each decode query against its keys where the paged KV
        cache holds them (SDPA's flash maths for one query, no gather)
    rms_norm(x, weight, eps), rope(x, cos, sin): transformers' RMSNorm and rotary embedding in one call each
    topk_route(logits, routing, bias): a layer's routing (scores, the choice, the weights) in one call, the choice
        torch.topk's own; moe_route(h, ln, gate, eps, routing, bias): rms_norm, the gate's linear and topk_route
        in one call (the MoE block's front)
    attention_block(h, …): a decode step's whole attention block (norm, qkv, q/k norms, rope, cache write,
        attention, o) in one call, with the bits of those ops run one by one
    decoder_layer(h, …): a decode step's MoE layer (attention block, routing, in-process experts) in one call;
        decoder_front(h, …): its front (the attention block, the residual add, moe_route), where the experts are
        elsewhere
    rest(): the ops' pool threads (kernels/native/pool.h, `colibri-pool`), which spin a moment after each op,
        sleep now: a caller about to block on other processes leaves them the cores; wake(): they get up again
        for the next op, as that wait ends
    The fleet's wire in native calls (a layer's request, the workers' replies combined, a worker's whole answer):
    kernels/native_wire.py, over the same library.

The ISA level is chosen when the library loads, by CPUID (generic, avx2, avx512, avx512bf16, amx);
COLIBRI_CPU_ISA=LEVEL overrides it, and `use_isa(LEVEL)` switches it in this process (the tests run every
level the machine has). Every output element has one fixed order of float32 operations whatever the row count,
the tile or the thread (kernels/native/gemm.h): batch-invariant by construction.

Shapes: x [n, K], w [Dout, K]; P token-expert pairs sorted by expert, H hidden size, I expert width, E experts.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.activation import SILU, GatedAct
from kernels.expert_rows import ExpertRows
from kernels.formats.int8 import Int8Weight
from kernels.routing import Routing

LIBRARY = Path(__file__).resolve().parent / "native" / "_build" / "colibri_native.so"
SCORING_CODES = {"softmax": 0, "sigmoid": 1, "topk_softmax": 2}     # colibri::topk_route's codes
GROUP_SCORE_CODES = {"max": 0, "top2": 1}
KINDS = ("float32", "bfloat16", "int8-float32", "int8-bfloat16", "w8a8-float32", "w8a8-bfloat16")   # they take
OPS = ("linear", "expert_blocks", "expert_blocks_free", "moe_blocks_", "moe_sum_", "decode_attention", "rms_norm",
       "rope", "attention_block", "decoder_layer", "decoder_front", "decoder_front_sum", "topk_route", "moe_route",
       "expert_answer",
       "combine_replies", "forward_request", "forward_send", "recv_frame", "isa", "use_isa", "rest", "wake",
       "exit_on_sigbus", "door_open", "door_free", "door_publish", "door_serve", "door_write", "door_forget",
       "door_stats")


def _load() -> str | None:
    """None when loaded; else why not (for the start-up log)."""
    if os.environ.get("COLIBRI_NATIVE") == "off":
        return "COLIBRI_NATIVE=off"
    if not LIBRARY.is_file():
        return f"not built ({LIBRARY} is missing: run `make setup`, which needs g++)"
    try:
        torch.ops.load_library(str(LIBRARY))
    except (OSError, RuntimeError) as exc:
        return f"cannot load {LIBRARY}: {str(exc).splitlines()[0]} (run `make setup` again)"
    missing = [op for op in OPS if not hasattr(torch.ops.colibri, op)]
    if missing:                                          # a build older than these sources (no `make setup` since)
        return f"{LIBRARY} lacks {', '.join(missing)}: it was built from older sources (run `make setup` again)"
    try:
        torch.ops.colibri.isa()                          # the CPUID choice, or the override's refusal
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return None


UNAVAILABLE = _load()


def _c_function(name: str) -> Callable[[], None] | None:
    """A void(void) C function of the loaded library, called through ctypes with the GIL held (PyDLL): a fraction of
    a torch op's dispatch, for calls that pass nothing (None without the library, or in a build without it)."""
    if UNAVAILABLE is not None:
        return None
    try:
        fn = getattr(ctypes.PyDLL(str(LIBRARY)), name)      # the same handle torch loaded (dlopen counts)
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = None, []
    return fn


_REST, _WAKE = _c_function("colibri_rest"), _c_function("colibri_wake")


def available() -> bool:
    return UNAVAILABLE is None


_decoder_refused: str | None = None     # why the decoder ops failed their start-up check (native_check.py)


def decoder_ops() -> bool:
    """Whether decode_attention, rms_norm and rope serve the router's layers: built, and not refused here."""
    return UNAVAILABLE is None and _decoder_refused is None


def refuse_decoder_ops(why: str | None) -> None:
    """Switch the decoder ops off in this process (None: on again, as the tests reset it). Process-wide: every
    router model in the process then runs the torch forms (one router per process is the services' case)."""
    global _decoder_refused
    _decoder_refused = why


def build_id() -> str:
    """Which build of the kernels is loaded (its sources' fingerprint from kernels/native_build.py), so that
    forms measured with another build are measured again; 'none' without them."""
    stamp = LIBRARY.parent / "fingerprint"
    if not available():
        return "none"
    return stamp.read_text().strip() if stamp.is_file() else "unknown"


def refused_override() -> str | None:
    """Why COLIBRI_CPU_ISA cannot be honoured (a level this CPU lacks, a name that is none): a start-up error
    for the services, who were asked for it explicitly; None when it is unset or honoured."""
    return UNAVAILABLE if os.environ.get("COLIBRI_CPU_ISA") and UNAVAILABLE and "COLIBRI_CPU_ISA" in UNAVAILABLE \
        else None


def isa() -> str:
    return torch.ops.colibri.isa() if available() else "none"


def use_isa(level: str = "") -> str:
    """Switch this process to `level` ('' = the CPUID choice); a level the CPU lacks is a RuntimeError."""
    return torch.ops.colibri.use_isa(level)


def rest() -> None:
    """The native ops' pool threads stop spinning and sleep until the next op (kernels/native/pool.h): for a
    caller about to block on something else, so the cores go to whoever computes meanwhile."""
    if _REST is not None:
        _REST()
    elif available():
        torch.ops.colibri.rest()


def wake() -> None:
    """The native ops' sleeping pool threads get up and spin for the next op (kernels/native/pool.h): for a caller
    whose wait is ending, ahead of its next op (a router as the first of a layer's workers answers: the thread takes
    the core that worker left). A thread woken by the op itself takes 0.1-0.2 ms to run on a VM, longer than a
    decode step's op, which then runs on the caller's thread alone."""
    if _WAKE is not None:
        _WAKE()
    elif available():
        torch.ops.colibri.wake()


def exit_on_sigbus(code: int) -> bool:
    """A read through a mapping whose file changed under the process (SIGBUS, which kills it without a word) prints
    the file's name and exits with `code` instead (kernels/native/sigbus_op.cpp); False where the native library is
    not loaded (the fault then kills the process, exit -7, as before)."""
    return bool(torch.ops.colibri.exit_on_sigbus(code)) if available() else False


def describe() -> str:
    """For the start-up logs."""
    if not available():
        return f"native CPU kernels: none ({UNAVAILABLE}); the torch forms run"
    chosen = "COLIBRI_CPU_ISA" if os.environ.get("COLIBRI_CPU_ISA") else "CPUID"
    off = f"; decoder ops off: {_decoder_refused}" if _decoder_refused else ""
    return f"native CPU kernels: {isa()} (by {chosen}){off}"


def linear(x: torch.Tensor, w: torch.Tensor | Int8Weight, tiles: bool = False) -> torch.Tensor:
    """x [n, K] @ w.T -> [n, Dout] in x's dtype (float32 accumulation, one rounding); a W8A8 weight quantises x's
    rows as formats.int8.quantize_rows and sums the int8 products exactly (the bits of cpu_forms' w8a8_intmm).
    `tiles`: a weight-only int8 weight against bf16 x is widened to bf16 and multiplied on AMX tiles where the level
    has them (`int8_tiles()`; exact products, float32 sums in the tiles' order: bits of their own), else ignored."""
    y = torch.ops.colibri.linear(x, w.q, w.scale, w.w8a8, tiles) if isinstance(w, Int8Weight) else \
        torch.ops.colibri.linear(x, w)
    return y if y.dtype == x.dtype else y.to(x.dtype)


TILE_LEVELS = ("amx",)      # the levels whose linear takes `tiles` for weight-only int8 against bf16 x


def int8_tiles() -> bool:
    """Whether the level in force multiplies weight-only int8 against bf16 x on tiles (`linear(..., tiles=True)`)."""
    return available() and isa() in TILE_LEVELS


# the levels whose weight-only int8 linear takes bf16 x as int16 (gemm.h CK_X16): every one but generic
X16_LEVELS = ("avx2", "avx512", "avx512bf16", "amx")


def int8_x16() -> bool:
    """Whether the level in force multiplies weight-only int8 weights by bf16 x quantised to int16 in blocks
    (`formats.int8.quantize_x16`) rather than by x widened to float32 (float32 x always is)."""
    return available() and isa() in X16_LEVELS


def linear_int8_tiles(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """`linear` with `tiles`: the form cpu_forms races for weight-only int8 against bf16 x where int8_tiles()."""
    return linear(x, w, tiles=True)


_NO_MAP = torch.empty(0, dtype=torch.long)      # an empty int64 tensor: no expert map (also: every row, combine)


def _no_blocks() -> None:
    """What a pickled `_Blocks` becomes: nothing (the unpickled weights register their own)."""
    return None


class _Blocks:
    """One projection's experts registered with the kernel (`colibri::expert_blocks`: every expert's row blocks in
    order, the blocks per expert, the int8 scales per expert or none) under a number that `moe_blocks_` takes; freed
    with this object (the registry holds the tensors until then). A caller holds the object across the op that
    takes its number. A deep copy or a pickle of the weights that hold one is not registered (it gets its own)."""

    __slots__ = ("id",)

    def __init__(self, blocks: list[torch.Tensor], parts: int, scales: list[torch.Tensor]) -> None:
        self.id = torch.ops.colibri.expert_blocks(blocks, parts, scales)

    def __del__(self) -> None:
        try:
            torch.ops.colibri.expert_blocks_free(self.id)
        except Exception:                          # interpreter shutdown, or __init__ failed: nothing to free
            pass

    def __deepcopy__(self, memo: dict) -> None:   # the copy's tensors are not these: it registers its own
        return None

    def __reduce__(self) -> tuple:                 # a number means nothing in another process
        return _no_blocks, ()


# packed stacks' registrations, keyed by their storage (a worker's stacks are often fresh views of one storage per
# call), least recently used first; a model's every MoE layer has two stacks, so the cap is far above a plan's
_BLOCKS: OrderedDict[tuple, _Blocks] = OrderedDict()
_BLOCKS_CAP = 1024
_BLOCKS_LOCK = threading.Lock()


def forget(weights: list[object]) -> None:
    """Drop the registrations made for these packed stacks (a worker releasing a plan's experts): the cache
    would keep their memory alive."""
    ptrs = {t.data_ptr() for w in weights for t in ((w.q,) if isinstance(w, Int8Weight) else (w,))
            if isinstance(t, torch.Tensor)}
    with _BLOCKS_LOCK:
        for key in [k for k in _BLOCKS if k[0] in ptrs]:
            del _BLOCKS[key]


def _blocks(w: torch.Tensor | Int8Weight | ExpertRows) -> _Blocks:
    """One projection's experts registered with the kernel, registering them the first time: in-place experts keep
    theirs on the ExpertRows object, packed stacks in a cache keyed by their storage. The caller holds the result
    while the op runs (a concurrent eviction or forget then frees nothing it uses)."""
    if isinstance(w, ExpertRows):
        made = w.__dict__.get("_native_blocks")          # as cached_property stores (the dataclass is frozen)
        if made is None:
            with _BLOCKS_LOCK:
                made = w.__dict__.get("_native_blocks")
                if made is None:
                    made = w.__dict__["_native_blocks"] = _Blocks(list(w.flat), w.parts, [])
        return made
    t = w.q if isinstance(w, Int8Weight) else w
    scale = w.scale.data_ptr() if isinstance(w, Int8Weight) else 0
    key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, scale)
    with _BLOCKS_LOCK:
        made = _BLOCKS.get(key)
        if made is None:
            scales = list(w.scale.unbind(0)) if isinstance(w, Int8Weight) else []
            made = _BLOCKS[key] = _Blocks(list(t.unbind(0)), 1, scales)
            while len(_BLOCKS) > _BLOCKS_CAP:
                _BLOCKS.popitem(last=False)
        else:
            _BLOCKS.move_to_end(key)
        return made


def moe_(acc: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
         expert_map: torch.Tensor | None, w13: torch.Tensor | Int8Weight | ExpertRows,
         w2: torch.Tensor | Int8Weight | ExpertRows, act: GatedAct = SILU, b13: torch.Tensor | None = None,
         b2: torch.Tensor | None = None) -> torch.Tensor:
    """acc [T, H] float64 += Σ_k weights[t, k] · FFN_e(x[t]) (e = expert_map[ids[t, k]], -1 = not here): the sort,
    the gather, the expert FFN, the routed weights and the sum in one native call; the bits of
    `fused_moe_cpu`'s native form step by step. Returns acc."""
    a, b = _blocks(w13), _blocks(w2)                # held across the call: their numbers stay registered
    torch.ops.colibri.moe_blocks_(acc, x, ids, weights, _NO_MAP if expert_map is None else expert_map, a.id, b.id,
                                  b13, b2, act.alpha, act.limit, act.up_offset,
                                  isinstance(w13, Int8Weight) and w13.w8a8)
    return acc


@dataclass(frozen=True)
class LayerExperts:
    """One MoE layer's experts as `decoder_layer` takes them (expert_service.shard.ExpertShard.native_layer): the
    stacks (or rows in place), the map from global ids to their rows (-1 = not held), the activation, biases."""

    w13: torch.Tensor | Int8Weight | ExpertRows      # [E, 2I, H]
    w2: torch.Tensor | Int8Weight | ExpertRows       # [E, H, I]
    expert_map: torch.Tensor | None                  # [E_global] int32
    act: GatedAct
    b13: torch.Tensor | None                         # [E, 2I]
    b2: torch.Tensor | None                          # [E, H]


def decoder_layer(h: torch.Tensor, attention: tuple, ln2: torch.Tensor, gate: torch.Tensor, routing: Routing,
                  gate_bias: torch.Tensor | None, experts: LayerExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's MoE decoder layer in one call, with the bits of the calls the router makes one by one:
    h [T, H] -> (h + attn + moe [T, H], the routed ids [T, k]). `attention`: attention_block's arguments after h
    (ln1 .. eps, in its order; moe_route's norm takes the same eps, as every model's two norms do); then moe_route's
    (ln2, gate, routing, gate_bias) and moe_'s (`experts`)."""
    call = DecoderLayerCall(attention[:6], attention[13:], ln2, gate, routing, gate_bias, experts)
    return call(h, *attention[6:13])


def decoder_front(h: torch.Tensor, attention: tuple, ln2: torch.Tensor, gate: torch.Tensor, routing: Routing,
                  gate_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's MoE layer up to its experts in one call, with the bits of `h + attention_block(h, …)` and then
    `moe_route`: h [T, H] -> (h1 = h + attn [T, H], r [T, H], weights float32 [T, k], ids int64 [T, k]), for experts
    elsewhere (a fleet's workers) or beside shared ones. `attention`: attention_block's arguments after h."""
    return torch.ops.colibri.decoder_front.default(h, *attention, ln2, gate, gate_bias, routing.top_k,
                                                   SCORING_CODES[routing.scoring], routing.renormalize,
                                                   routing.num_groups, routing.topk_groups,
                                                   GROUP_SCORE_CODES[routing.group_score], routing.scaling)


def decoder_front_sum(payloads: list[torch.Tensor], rows: list[torch.Tensor | None], h: torch.Tensor,
                      attention: tuple, ln2: torch.Tensor, gate: torch.Tensor, routing: Routing,
                      gate_bias: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[float]] | None:
    """`decoder_front` of `h` plus the last layer's sum of the workers' replies (each uint8 [B], over its `rows`,
    None = all), the bits of `native_wire.combine_replies`, `h + out` and `decoder_front` in one call -> (h1, r,
    weights, ids, each reply's compute_ms); None where combine_replies would decline the replies (nothing written:
    the caller sums them on the Python path)."""
    h1, r, weights, ids, ms = torch.ops.colibri.decoder_front_sum.default(
        payloads, [_NO_MAP if x is None else x for x in rows], h, *attention, ln2, gate, gate_bias, routing.top_k,
        SCORING_CODES[routing.scoring], routing.renormalize, routing.num_groups, routing.topk_groups,
        GROUP_SCORE_CODES[routing.group_score], routing.scaling)
    return (h1, r, weights, ids, ms) if h1.numel() else None


class DecoderLayerCall:
    """One layer's `decoder_layer` with the arguments that stay the same step after step bound once (a decode
    plan's, router_service/model/decode_layers.py): a call passes the step's own (h, rope's cos and sin, the layer's
    KV cache, the slots to write, the slots and lengths to read)."""

    def __init__(self, head: tuple, tail: tuple, ln2: torch.Tensor, gate: torch.Tensor, routing: Routing,
                 gate_bias: torch.Tensor | None, experts: LayerExperts) -> None:
        """`head`: attention_block's arguments ln1 .. full_qk_norm; `tail`: sinks .. eps."""
        self.experts = experts
        self.head = head
        self.mid = (*tail, ln2, gate, gate_bias, routing.top_k, SCORING_CODES[routing.scoring], routing.renormalize,
                    routing.num_groups, routing.topk_groups, GROUP_SCORE_CODES[routing.group_score], routing.scaling,
                    _NO_MAP if experts.expert_map is None else experts.expert_map)
        act = experts.act
        self.tail = (experts.b13, experts.b2, act.alpha, act.limit, act.up_offset,
                     isinstance(experts.w13, Int8Weight) and experts.w13.w8a8)

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, write: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = _blocks(self.experts.w13), _blocks(self.experts.w2)   # held across the call: their numbers stay
        return torch.ops.colibri.decoder_layer.default(                 # registered
            h, *self.head, cos, sin, k_cache, v_cache, write, slots, lens, *self.mid, a.id, b.id, *self.tail)


def moe_sum_(acc: torch.Tensor, ys: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """acc [T, H] float64 += ys [P, H] float32 times weights [P] (the product in float32) at rows [P]; returns acc.
    The same bits as `acc.index_add_(0, rows, (ys * weights[:, None]).double())`, without its serial scatter."""
    torch.ops.colibri.moe_sum_(acc, ys, rows, weights)
    return acc


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
                     sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [B, Hq, D] against a layer's cache k [S, Hkv, D], v [S, Hkv, Dv] (float32 or bf16): row b reads the keys at
    slots[b, :lens[b]] only -> [B, Hq, Dv] in q's dtype. softmax(q·k · scale) over those keys and, where given, one
    sink logit per head (GPT-OSS), which takes weight but adds no value."""
    return torch.ops.colibri.decode_attention(q, k, v, slots, lens, sinks, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of x [..., H] (float32 or bf16; weight [H] float32, or bf16 on bf16 x) in one call: the
    float32 norm from a float64 sum of squares, the scale and the casts in transformers' order."""
    return torch.ops.colibri.rms_norm(x, weight, eps)


def topk_route(logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.routing.topk_route_torch in one call: logits [T, E] (any float dtype) -> (weights float32 [T, k], ids
    int64 [T, k]), best first; the choice by torch.topk's own rule (ties fall as torch's), exp from libm (a weight
    may differ from the torch form's in its last bit)."""
    return torch.ops.colibri.topk_route(logits, bias, routing.top_k, SCORING_CODES[routing.scoring],
                                        routing.renormalize, routing.num_groups, routing.topk_groups,
                                        GROUP_SCORE_CODES[routing.group_score], routing.scaling)


def moe_route(h: torch.Tensor, ln: torch.Tensor, gate: torch.Tensor, eps: float, routing: Routing,
              bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MoE block's front in one call, with the bits of rms_norm, linear (the native form) and topk_route called
    one by one: h [T, H], ln [H], gate [E, H] of h's dtype -> (r = rms_norm(h) [T, H], weights float32 [T, k], ids
    int64 [T, k])."""
    return torch.ops.colibri.moe_route(h, ln, gate, eps, bias, routing.top_k, SCORING_CODES[routing.scoring],
                                       routing.renormalize, routing.num_groups, routing.topk_groups,
                                       GROUP_SCORE_CODES[routing.group_score], routing.scaling)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """layers.apply_rope in one call, with its bits: x [T, heads, D], cos/sin [T, R] (R <= D rotate; rotate_half's
    layout) -> [T, heads, D] contiguous."""
    return torch.ops.colibri.rope(x, cos, sin)


def attention_block(h: torch.Tensor, ln1: torch.Tensor, w_qkv: torch.Tensor, b_qkv: torch.Tensor | None,
                    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, full_qk_norm: bool, cos: torch.Tensor,
                    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, write: torch.Tensor,
                    slots: torch.Tensor, lens: torch.Tensor, sinks: torch.Tensor | None, w_o: torch.Tensor,
                    b_o: torch.Tensor | None, heads: int, kv_heads: int, eps: float) -> torch.Tensor:
    """A decode step's attention block in one call, with the bits of the router's op-by-op path: h [T, H] (every
    row one decode token) -> the block's output [T, H]; this step's keys and values are written to k_cache /
    v_cache [S, Hkv, D] at `write` [T], row t attends to slots[t, :lens[t]]."""
    return torch.ops.colibri.attention_block(h, ln1, w_qkv, b_qkv, q_norm, k_norm, full_qk_norm, cos, sin, k_cache,
                                             v_cache, write, slots, lens, sinks, w_o, b_o, heads, kv_heads, eps)
