"""benchmarks/decode_attention.py: its paged cache (blocks of 16 slots, shuffled, no slot shared by two sequences)
and its torch form, which must compute what the native op computes, or the ratio it prints compares two things."""

from __future__ import annotations

import pytest
import torch

from benchmarks import decode_attention as bench
from kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")


def test_the_cache_is_paged_in_shuffled_blocks_of_distinct_slots():
    q, k, v, slots, lens = bench.case(3, 37, torch.Generator().manual_seed(0))
    assert slots.shape == (3, 37) and lens.tolist() == [37] * 3
    assert slots.unique().numel() == slots.numel()                               # no slot in two sequences
    starts = slots[:, ::bench.BLOCK]
    assert bool((starts % bench.BLOCK == 0).all())                               # each block starts one
    within = slots[:, : 2 * bench.BLOCK].reshape(3, 2, bench.BLOCK)
    assert bool((within.diff(dim=-1) == 1).all())                                # consecutive inside a block
    assert not bool((starts.flatten().diff() == bench.BLOCK).all())              # the blocks' order shuffled


def test_the_torch_form_computes_the_native_ops_attention():
    q, k, v, slots, lens = bench.case(2, 45, torch.Generator().manual_seed(1))
    got = native.decode_attention(q, k, v, slots, lens, None, bench.D**-0.5).float()            # [B, Hq, D]
    want = bench.torch_form(q.double(), k.double(), v.double(), slots, lens).float()            # [B, Hq, D]
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert not torch.equal(got, bench.torch_form(q, k, v, slots[:, :20], lens).float())         # keys matter
