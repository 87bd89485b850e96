"""router_service/model/sdpa.py: on a GPU, a masked grouped-head call repeats the keys and values to the query heads
itself (so torch's memory-efficient kernel can take it); that is the same attention as enable_gqa's, checked here
on the CPU, where the GPU branch's repeat is the same torch code."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from router_service.model.sdpa import repeat_groups, sdpa


@pytest.mark.parametrize("Hq, Hkv", [(8, 2), (6, 1), (4, 4)])
def test_repeating_the_groups_is_enable_gqa(Hq, Hkv):
    g = torch.Generator().manual_seed(Hq * Hkv)
    q = torch.randn(3, Hq, 5, 16, generator=g, dtype=torch.float64)          # [B, Hq, n, D]
    k = torch.randn(3, Hkv, 11, 16, generator=g, dtype=torch.float64)        # [B, Hkv, C, D]
    v = torch.randn(3, Hkv, 11, 12, generator=g, dtype=torch.float64)        # [B, Hkv, C, Dv]
    mask = torch.rand(3, 1, 5, 11, generator=g) > 0.3                        # [B, 1, n, C]
    mask[..., 0] = True                                                      # every query sees a key
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    kr, vr = repeat_groups(q, k, v)
    assert kr.shape == (3, Hq, 11, 16) and vr.shape == (3, Hq, 11, 12)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask), want, rtol=0, atol=1e-12)
    # and the router's call on the CPU is torch's as written
    torch.testing.assert_close(sdpa(q, k, v, attn_mask=mask, enable_gqa=True), want, rtol=0, atol=0)
