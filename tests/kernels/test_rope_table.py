"""Rope's cos/sin table (router_service/model/layers.py): a step's rows read from the table are the values the
same ops give on the step's own positions, at every row count and rotary width (vector tails), float32 and bf16,
scaled (YaRN) or not, as the table grows, and past its last position (computed then)."""

from __future__ import annotations

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
