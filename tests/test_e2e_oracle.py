"""The fleet against transformers: greedy tokens identical, logits within 1e-4 relative (float32)."""

from __future__ import annotations

import pytest
import torch

from colibri_common.client import Client
from tests.conftest import ARCHS, fleet

PROMPTS = [[3, 17, 42, 99, 5, 8], [200], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 1, 2]]
NEW_TOKENS = 16


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_logits_match_transformers(oracles, arch, workers):
    oracle = oracles[arch]
    with fleet(oracle.path, workers) as (addr, _):
        client = Client(addr)
        for prompt in PROMPTS:
            res = client.generate(prompt, NEW_TOKENS, return_logits=True)
            assert res.finish_reason == "length"
            assert res.token_ids == oracle.greedy(prompt, NEW_TOKENS), f"{arch} prompt {prompt}"
            assert len(res.logits) == NEW_TOKENS
            got = torch.from_numpy(res.logits[0].copy())
            assert rel_err(got, oracle.last_logits(prompt)) < 1e-4
            # the logits of a later step too: the KV cache path, not only prefill
            full = prompt + res.token_ids[:5]
            assert rel_err(torch.from_numpy(res.logits[5].copy()), oracle.last_logits(full)) < 1e-4
        client.close()
