"""The native decoder ops (decode attention, rms_norm, rope, routing) checked once per router process on the model's
own shapes before they may run: against float64 (attention, the norm), against torch's ops to the bit (rope) and
in their choice of experts (routing). A wrong op, on a CPU or compiler the tests never met, switches them all off in
this process with one warning, and the torch forms serve (`native.refuse_decoder_ops`). The check takes about a
millisecond.

Shapes: B decode rows, Hq / Hkv query / KV heads, D / Dv key / value dims, S cache slots, C context.
"""

from __future__ import annotations

import logging

import torch

from kernels import Routing, native, topk_route_torch
from router_service.model.layers import apply_rope_torch

log = logging.getLogger("colibri.router")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}    # absolute, on unit-scale values (the kernel tests')


def _attention_error(heads: int, kv_heads: int, head_dim: int, v_dim: int, dtype: torch.dtype,
                     g: torch.Generator) -> float:
    """The largest difference of decode attention from float64 over 3 rows of 1, 9 and 40 scattered keys."""
    S, C = 64, 40
    q = torch.randn(3, heads, head_dim, generator=g).to(dtype)                       # [B, Hq, D]
    k = torch.randn(S, kv_heads, head_dim, generator=g).to(dtype)                    # [S, Hkv, D]
    v = torch.randn(S, kv_heads, v_dim, generator=g).to(dtype)                       # [S, Hkv, Dv]
    slots = torch.stack([torch.randperm(S, generator=g)[:C] for _ in range(3)])      # [B, C]
    lens = torch.tensor([1, 9, C])
    sinks = torch.randn(heads, generator=g)                                          # [Hq]
    scale = head_dim ** -0.5
    got = native.decode_attention(q, k, v, slots, lens, sinks, scale).double()       # [B, Hq, Dv]
    rep = heads // kv_heads
    err = 0.0
    for b in range(3):
        kk = k[slots[b, :lens[b]]].double().repeat_interleave(rep, dim=1)           # [n, Hq, D]
        vv = v[slots[b, :lens[b]]].double().repeat_interleave(rep, dim=1)           # [n, Hq, Dv]
        s = torch.einsum("hd,nhd->hn", q[b].double(), kk) * scale                   # [Hq, n]
        p = torch.softmax(torch.cat([s, sinks.double()[:, None]], dim=1), dim=1)[:, :-1]
        err = max(err, float((got[b] - torch.einsum("hn,nhd->hd", p, vv)).abs().max()))
    return err


def _norm_error(hidden: int, dtype: torch.dtype, w_dtype: torch.dtype, g: torch.Generator) -> float:
    x = torch.randn(5, hidden, generator=g).to(dtype)                                # [T, H]
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(w_dtype)                     # [H]
    xd = x.double()
    ref = w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    return float(((native.rms_norm(x, w, 1e-6).double() - ref) / ref.abs().clamp(min=1e-3)).abs().max())


def _routing_differs(routing: Routing, experts: int, g: torch.Generator) -> bool:
    """Whether the native routing chooses other experts than the torch form, or weighs them otherwise (beyond a
    last bit), on 5 rows of random logits (and a choice-steering bias where the scoring takes one)."""
    logits = torch.randn(5, experts, generator=g) * 2                                 # [T, E]
    bias = None if routing.scoring == "topk_softmax" else torch.randn(experts, generator=g) * 0.5
    (w, ids), (tw, tids) = native.topk_route(logits, routing, bias), topk_route_torch(logits, routing, bias)
    return not (torch.equal(ids, tids) and torch.allclose(w, tw, rtol=1e-5, atol=1e-7))


def check_decoder_ops(heads: int, kv_heads: int, head_dim: int, v_dim: int, hidden: int, rotary_dim: int,
                      dtype: torch.dtype, routing: Routing | None = None, experts: int = 0) -> str | None:
    """None where the ops are right for these shapes and this routing (or are not built, or not for this dtype);
    else why not, after switching them off in this process."""
    if not native.decoder_ops() or dtype not in TOLERANCE or kv_heads < 1 or heads % kv_heads:
        return None
    g = torch.Generator().manual_seed(7)
    why = None
    try:
        err = _attention_error(heads, kv_heads, head_dim, v_dim, dtype, g)
        if not err <= TOLERANCE[dtype]:
            why = f"decode attention is off by {err:.3g} against float64"
        for w_dtype in (dtype, torch.float32) if dtype == torch.bfloat16 else (dtype,):   # GPT-OSS: fp32 scales
            rel = _norm_error(hidden, dtype, w_dtype, g)
            if why is None and not rel <= (2**-7 if dtype == torch.bfloat16 else 1e-6):
                why = f"rms_norm ({w_dtype} scale) is off by {rel:.3g} (relative) against float64"
        if why is None and rotary_dim:
            qkv = torch.randn(3, 2 * heads * head_dim, generator=g).to(dtype)
            x = qkv[:, :heads * head_dim].view(3, heads, head_dim)                 # [T, Hq, D] strided, as a split
            cos, sin = (torch.randn(3, rotary_dim, generator=g).to(dtype) for _ in range(2))   # [T, R]
            if not torch.equal(native.rope(x, cos, sin), apply_rope_torch(x, cos, sin)):
                why = "rope differs from torch's ops"
        if why is None and routing is not None and experts and _routing_differs(routing, experts, g):
            why = "the routing differs from torch's ops"
    except Exception as exc:                # noqa: BLE001  (any failure of an op means the torch forms serve)
        why = f"it failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if why is not None:
        native.refuse_decoder_ops(why)
        log.warning("the native decoder ops are not used in this process (%s, %s heads / %s KV heads of %s): %s; "
                    "the torch forms serve", native.isa(), heads, kv_heads, head_dim, why)
    return why
