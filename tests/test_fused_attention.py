"""A decode step's attention block as one native call (kernels.native.attention_block) gives the bits of the
op-by-op path it replaces, for every attention variant of the suite's architectures: per-head and full-width
q/k norms (Qwen3, OLMoE), qkv biases (Qwen2-MoE), sinks, sliding windows and output biases (GPT-OSS), plain
(Mixtral), in float32 and bf16, with several sequences decoding together."""

from __future__ import annotations

import random

import pytest

from kernels import cpu_forms, native
from tests.inprocess import InProcess

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.UNAVAILABLE}")


def logits(path, dtype: str, fused: bool) -> list[bytes]:
    prompts = [[random.Random(70 + i).randrange(256) for _ in range(3 + 4 * i)] for i in range(4)]
    with InProcess(path, dtype=dtype, cpu_forms="off") as engine:
        engine.engine.model.fused_attention = fused
        runs = [engine.submit(p, 7, return_logits=True) for p in prompts]
        results = [engine.collect(r) for r in runs]
    return [b"".join(x.numpy().tobytes() for x in r.logits) + repr(r.token_ids).encode() for r in results]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss", "mixtral"])
def test_the_fused_attention_block_has_the_bits_of_the_op_by_op_path(oracles, monkeypatch, arch, dtype):
    calls = [0]
    real = native.attention_block

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(native, "attention_block", counted)
    monkeypatch.setattr(cpu_forms, "_TABLE", {})         # the defaults (native), not forms earlier tests measured
    monkeypatch.setattr(cpu_forms, "_REJECTED", set())
    fused = logits(oracles[arch].path, dtype, True)
    assert calls[0] > 0                                  # the decode steps really took the one-call path
    n = calls[0]
    assert logits(oracles[arch].path, dtype, False) == fused
    assert calls[0] == n                                 # and the other run never did
