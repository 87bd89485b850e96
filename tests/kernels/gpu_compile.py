"""Compile the fused-MoE, routing and decode-attention Triton kernels for real GPU targets (sm_80, sm_90) to Triton
IR, with no GPU: the interpreter runs plain Python, so code that only the compiler refuses (mismatched returns, types
a target lacks) would pass every interpreter test. Run as a script in a process without TRITON_INTERPRET
(tests/kernels sets it).

    python -m tests.kernels.gpu_compile   -> one line per variant, exit 1 if any fails
"""

from __future__ import annotations

import itertools
import sys

import triton
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend

from kernels.triton_decode_attention_kernel import combine_splits_kernel, paged_decode_attention_kernel
from kernels.triton_moe_kernel import down_weighted_kernel, gate_up_act_kernel
from kernels.triton_topk_kernel import topk_route_kernel

INTS = ("num_pairs", "top_k", "hidden", "inter", "stride_xt", "stride_we", "stride_wn", "stride_hp", "stride_be",
        "stride_se", "stride_sn", "stride_sk", "scale_bn", "scale_bk", "stride_yp", "stride_yt", "stride_ot")
WEIGHT = {0: None, 1: "*fp8e4nv", 2: "*u8"}             # WFMT -> the weights' pointer type (None: the activations')
SCALES = {0: None, 1: "*fp32", 2: "*u8"}


def signature(kernel, act: str, wfmt: int) -> dict[str, str]:
    sig = {}
    for name in kernel.arg_names:                      # constexprs are dropped by the caller
        if name in ("w13_ptr", "w2_ptr"):
            sig[name] = WEIGHT[wfmt] or f"*{act}"
        elif name in ("s13_ptr", "s2_ptr"):
            sig[name] = SCALES[wfmt] or f"*{act}"
        elif name in ("pair_ids_ptr", "block_expert_ptr"):
            sig[name] = "*i32"
        elif name in ("y_ptr", "weights_ptr"):
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = f"*{act}"
        elif name in INTS:
            sig[name] = "i32"
        elif name in ("alpha", "limit", "up_offset"):
            sig[name] = "fp32"
    return sig


def make_ir(kernel, sig: dict[str, str], constants: dict, capability: int) -> None:
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    ASTSource(kernel, sig, constants).make_ir(target, options, backend.get_codegen_implementation(options),
                                              backend.get_module_map(), context)


def variants():
    tiles = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, PRECISION="tf32")
    for capability, act, wfmt, bias in itertools.product((80, 90), ("bf16", "fp16"), (0, 1, 2), (False, True)):
        if wfmt == 1 and capability < 89:
            continue                                   # no FP8 there: kept_format refuses it
        yield (f"gate_up sm_{capability} {act} wfmt={wfmt} bias={bias}", gate_up_act_kernel,
               signature(gate_up_act_kernel, act, wfmt),
               dict(tiles, HAS_BIAS=bias, CLAMPED=bias, WFMT=wfmt), capability)
        yield (f"down sm_{capability} {act} wfmt={wfmt} bias={bias}", down_weighted_kernel,
               signature(down_weighted_kernel, act, wfmt), dict(tiles, HAS_BIAS=bias, WFMT=wfmt), capability)
    route_sig = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64",
                 "num_experts": "i32", "group_size": "i32", "stride_l": "i32", "scaling": "fp32"}
    for scoring, groups in itertools.product((0, 1, 2), (1, 8)):   # DeepSeek-V3: sigmoid, 8 groups, top-2 scores
        if scoring == 2 and groups > 1:
            continue
        yield (f"topk_route sm_90 scoring={scoring} groups={groups}", topk_route_kernel, dict(route_sig),
               dict(TOP_K=8, TOPK_POW2=8, BLOCK_E=256, SCORING=scoring, HAS_BIAS=scoring == 1, NUM_GROUPS=groups,
                    TOPK_GROUPS=min(4, groups), GROUP_TOP2=True, RENORMALIZE=True), 90)
    attn_ints = [n for n in paged_decode_attention_kernel.arg_names if n.startswith("stride_")] + [
        "window", "group", "block_size", "head_d", "head_dv", "split_len", "num_heads", "num_splits"]
    for capability, act, sinks, (d, dv), split in itertools.product(
            (80, 90), ("bf16", "fp16", "fp32"), (False, True), ((64, 64), (128, 128), (192, 128)), (False, True)):
        if split and d != 128:
            continue                                   # the split form on one head size (its own stores only)
        sig = {n: f"*{act}" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
        sig.update(table_ptr="*i32", lens_ptr="*i32", sinks_ptr="*fp32" if sinks else f"*{act}", scale="fp32",
                   m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", **{n: "i32" for n in attn_ints})
        yield (f"decode_attention sm_{capability} {act} sinks={sinks} D={d}/{dv} split={split}",
               paged_decode_attention_kernel, sig,
               dict(BLOCK_N=32, BLOCK_D=triton.next_power_of_2(d), BLOCK_DV=triton.next_power_of_2(dv),
                    HAS_SINKS=sinks, SPLIT=split), capability)
    for capability, act, sinks in itertools.product((80, 90), ("bf16", "fp16", "fp32"), (False, True)):
        sig = {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": f"*{act}",
               "sinks_ptr": "*fp32" if sinks else f"*{act}",
               **{n: "i32" for n in ("stride_ob", "stride_oh", "head_dv", "num_heads", "num_splits")}}
        yield (f"combine_splits sm_{capability} {act} sinks={sinks}", combine_splits_kernel, sig,
               dict(BLOCK_S=16, BLOCK_DV=128, HAS_SINKS=sinks), capability)



def main() -> int:
    failed = 0
    for name, kernel, sig, constants, capability in variants():
        sig = {k: v for k, v in sig.items() if k not in constants}
        try:
            make_ir(kernel, sig, constants, capability)
            print(f"ok   {name}")
        except Exception as exc:                          # the compiler's message names the line
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[-600:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
