"""Rope's cos/sin table (router_service/model/layers.py): a step's rows read from the table are the values the
same ops give on the step's own positions, at every row count and rotary width (vector tails), float32 and bf16,
scaled (YaRN) or not, as the table grows, and past its last position (computed then)."""

from __future__ import annotations

import math

import pytest
import torch

from colibri_common.rope_scaling import RopeScaling
from router_service.model import layers
from router_service.model.layers import Rope


@pytest.mark.parametrize("dim", [64, 24, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("yarn", [False, True])
def test_table_rows_are_the_values_of_the_steps_own_positions(dim, dtype, yarn):
    scaling = RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=64) if yarn else None
    rope = Rope(dim, 10000.0, scaling=scaling)
    g = torch.Generator().manual_seed(dim)
    top = 3
    for T in (1, 3, 8, 17, 64, 333, 1):                  # the table grows as the positions do
        top = top * 3 + T
        positions = torch.randint(0, top, (T,), generator=g)
        positions[-1] = top
        cos, sin = rope.cos_sin(positions, dtype, top)
        want_cos, want_sin = rope._computed(positions, dtype)
        assert cos.dtype == sin.dtype == dtype and cos.shape == (T, dim)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), (T, top)
    assert rope._tables[dtype][0].shape[0] > top         # grown, not computed past it


def test_positions_past_the_table_or_of_unknown_range_are_computed(monkeypatch):
    monkeypatch.setattr(layers, "TABLE_POSITIONS", 512)
    rope = Rope(64, 10000.0)
    positions = torch.tensor([5, 511, 512, 90000])
    for top in (90000, -1):                              # past the table; not known on the host
        cos, sin = rope.cos_sin(positions, torch.float32, top)
        want_cos, want_sin = rope._computed(positions, torch.float32)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert torch.float32 not in rope._tables             # no table of 90001 positions was made
    rope.cos_sin(positions[:2], torch.float32, 511)
    assert rope._tables[torch.float32][0].shape[0] == 512


@pytest.mark.parametrize("dim, positions", [(32, 256), (64, 256), (128, 4096)])
def test_the_table_holds_the_correctly_rounded_cos_and_sin_on_two_threads(dim, positions):
    """Each value is the float32 rounding of cos / sin of its float32 angle (as transformers makes the angles),
    whatever the intra-op threads: torch 2.13's float32 `cos` of 256 x 32 angles on two threads erred by up to
    1.5e-4 in one thread's half in about a third of the processes on an Intel Xeon, and a router whose table was
    made so computed otherwise than every other (the reference here is Python's math, not torch's nor numpy's)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rope = Rope(dim, 10000.0)
        cos, sin = rope.cos_sin(torch.arange(positions), torch.float32, positions - 1)   # [N, R] each
    finally:
        torch.set_num_threads(threads)
    angles = (torch.arange(positions)[:, None].float() * rope.inv_freq[None, :]).flatten().tolist()   # float32
    want_cos = torch.tensor([math.cos(a) for a in angles], dtype=torch.float64).float().view(positions, -1)
    want_sin = torch.tensor([math.sin(a) for a in angles], dtype=torch.float64).float().view(positions, -1)
    half = dim // 2
    assert torch.equal(cos[:, :half], want_cos) and torch.equal(cos[:, half:], want_cos)
    assert torch.equal(sin[:, :half], want_sin) and torch.equal(sin[:, half:], want_sin)
