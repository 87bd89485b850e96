"""The Triton paged decode attention (kernels/triton_decode_attention.py) under the interpreter, against a float64
reference written from the definition (softmax over each sequence's visible positions, a sink logit in the
denominator), on odd shapes: grouped and ungrouped heads, head dims that are not powers of two, value dims unlike
the key dims, blocks of 1, 3 and 16 slots, contexts from one key to several loop iterations, scattered blocks,
sliding windows shorter and longer than the context, and bad arguments."""

from __future__ import annotations

import pytest
import torch

from kernels.triton_decode_attention import paged_decode_attention


def _case(B, Hq, Hkv, D, Dv, block_size, lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = max((n + block_size - 1) // block_size for n in lens) + 1
    blocks = B * nb + 3
    S = blocks * block_size
    k = torch.randn(S, Hkv, D, generator=g).to(dtype)                      # [S, Hkv, D]
    v = torch.randn(S, Hkv, Dv, generator=g).to(dtype)                     # [S, Hkv, Dv]
    q = torch.randn(B, Hq, D, generator=g).to(dtype)                       # [B, Hq, D]
    perm = torch.randperm(blocks, generator=g)[:B * nb].view(B, nb)        # scattered blocks per sequence
    return q, k, v, perm.to(torch.int32), torch.tensor(lens, dtype=torch.int32)


def _reference(q, k, v, table, lens, block_size, sinks=None, window=0):
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    out = torch.zeros(B, Hq, v.shape[2], dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        pos = torch.arange(max(0, n - window) if window else 0, n)
        slots = table[b, pos // block_size].long() * block_size + pos % block_size
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            logits = (k[slots, kv].double() @ q[b, h].double()) * D ** -0.5        # [C]
            if sinks is not None:
                logits = torch.cat([logits, sinks[h].double().view(1)])
            p = torch.softmax(logits, dim=0)[:len(pos)]
            out[b, h] = p @ v[slots, kv].double()
    return out


@pytest.mark.parametrize("B, Hq, Hkv, D, Dv, block_size, lens", [
    (1, 1, 1, 8, 8, 16, [1]),
    (3, 4, 2, 12, 12, 3, [1, 7, 40]),
    (2, 6, 1, 24, 24, 16, [33, 65]),
    (4, 5, 5, 10, 6, 1, [2, 9, 17, 31]),
    (5, 8, 2, 64, 64, 16, [70, 1, 16, 17, 100]),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_decode_attention_matches_float64(B, Hq, Hkv, D, Dv, block_size, lens, dtype):
    q, k, v, table, ln = _case(B, Hq, Hkv, D, Dv, block_size, lens, dtype)
    got = paged_decode_attention(q, k, v, table, ln, block_size)
    assert got.dtype == dtype and got.shape == (B, Hq, Dv)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.double(), _reference(q, k, v, table, ln, block_size), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [1, 5, 64])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_sliding_windows_and_sinks_match_float64(window, sinks, splits):
    B, Hq, Hkv, D, block_size, lens = 3, 4, 2, 20, 4, [3, 30, 50]
    q, k, v, table, ln = _case(B, Hq, Hkv, D, D, block_size, lens, torch.float32, seed=1)
    s = torch.randn(Hq, generator=torch.Generator().manual_seed(2)) * 3 if sinks else None
    got = paged_decode_attention(q, k, v, table, ln, block_size, sinks=s, window=window, splits=splits)
    want = _reference(q, k, v, table, ln, block_size, s, window)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("splits", [2, 5, 16])
@pytest.mark.parametrize("sinks", [False, True])
def test_split_contexts_join_as_one_softmax(splits, sinks):
    """Flash-decoding: each context in parts, the parts' partial softmaxes joined; contexts of one key (every split
    but the first empty), of fewer keys than splits, and of several loop iterations a split, with odd dims."""
    B, Hq, Hkv, D, Dv, block_size, lens = 4, 6, 3, 24, 10, 3, [1, 4, 97, 200]
    q, k, v, table, ln = _case(B, Hq, Hkv, D, Dv, block_size, lens, torch.float32, seed=3)
    s = torch.randn(Hq, generator=torch.Generator().manual_seed(4)) * 3 if sinks else None
    got = paged_decode_attention(q, k, v, table, ln, block_size, sinks=s, splits=splits)
    torch.testing.assert_close(got.double(), _reference(q, k, v, table, ln, block_size, s), atol=2e-5, rtol=2e-5)


def test_the_split_count_follows_the_shapes():
    """Enough programs for two a multiprocessor (an H200 has 132), each split at least MIN_SPLIT keys, at most
    MAX_SPLITS; one on a CPU."""
    from kernels.triton_decode_attention import MAX_SPLITS, MIN_SPLIT, auto_splits, split_count

    assert split_count(16, 4096, 132) == MAX_SPLITS == 16                  # one stream, 16 heads, a 4K context
    assert split_count(16, 80, 132) == 1                                    # a short context: one split
    assert split_count(16, 3 * MIN_SPLIT, 132) == 3
    assert split_count(8 * 16, 4096, 132) == 3                              # 8 streams: 128 programs, 3 splits
    assert split_count(64 * 16, 4096, 132) == 1                             # programs enough already
    assert auto_splits(torch.empty(1, 16, 64), 4096) == 1                   # CPU tensors (the interpreter)


def test_a_sink_takes_weight_from_the_keys():
    """One key: without a sink its value comes out whole; a sink of logit equal to the key's halves it."""
    q, k, v, table, ln = _case(1, 1, 1, 4, 4, 2, [1], torch.float32)
    k.zero_()                                                              # the key's logit is 0
    alone = paged_decode_attention(q, k, v, table, ln, 2)
    slot = int(table[0, 0]) * 2
    torch.testing.assert_close(alone[0, 0], v[slot, 0])
    halved = paged_decode_attention(q, k, v, table, ln, 2, sinks=torch.zeros(1))
    torch.testing.assert_close(halved[0, 0], v[slot, 0] / 2)


def test_writes_into_out_and_takes_an_empty_batch():
    q, k, v, table, ln = _case(2, 2, 1, 8, 8, 4, [5, 6], torch.float32)
    out = torch.full((2, 2, 8), float("nan"))
    assert paged_decode_attention(q, k, v, table, ln, 4, out=out) is out
    assert not out.isnan().any()
    empty = paged_decode_attention(q[:0], k, v, table[:0], ln[:0], 4)
    assert empty.shape == (0, 2, 8)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(q=a["q"][0]), "need q"),
    (lambda a: a.update(k_cache=a["k_cache"][:, :, :4]), "shapes disagree"),
    (lambda a: a.update(table=a["table"][:1]), "table must be"),
    (lambda a: a.update(sinks=torch.zeros(3)), "sinks must be"),
    (lambda a: a.update(out=torch.empty(2, 2, 4)), "out must be"),
    (lambda a: a.update(splits=0), "splits must be in 1..16"),
    (lambda a: a.update(splits=17), "splits must be in 1..16"),
])
def test_bad_arguments_are_named(change, message):
    q, k, v, table, ln = _case(2, 2, 1, 8, 8, 4, [5, 6], torch.float32)
    args = dict(q=q, k_cache=k, v_cache=v, table=table, lens=ln, block_size=4)
    change(args)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args)


def test_cpu_tensors_outside_the_interpreter_are_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, table, ln = _case(1, 1, 1, 8, 8, 4, [3], torch.float32)
    with pytest.raises(RuntimeError, match="needs CUDA tensors, or TRITON_INTERPRET=1"):
        paged_decode_attention(q, k, v, table, ln, 4)
