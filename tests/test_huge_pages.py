"""The router's copied weights on 2 MiB pages (colibri_common/huge_pages.py, RouterWeights.onto_huge_pages): the
same bits, shapes and dtypes, laid out in one mapping aligned to 2 MiB that the kernel was asked to back with huge
pages (its VmFlags say so), shared tensors still shared, the mapped checkpoint's weights left where they lie.
Served through build_engine, the oracle tests hold the tokens."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from colibri_common.checkpoint import Checkpoint
from colibri_common.config import ModelConfig
from colibri_common.huge_pages import HUGE, huge_pages_advisable, onto_huge_pages
from router_service.model.weights import RouterWeights, _tensors_of
from tests.models import build_model, save_checkpoint, small_config

linux = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE")
                           or not Path("/sys/kernel/mm/transparent_hugepage").is_dir(),
                           reason="Linux's transparent huge pages (madvise(MADV_HUGEPAGE))")


def advised_huge(address: int) -> bool:
    """Whether this process's mapping holding `address` carries MADV_HUGEPAGE ("hg" in its smaps VmFlags)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0] and len(head) >= 5:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False


@linux
def test_copies_keep_the_bits_in_one_huge_page_mapping():
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(3, 5, generator=g).to(torch.bfloat16), torch.randn(7, generator=g),
          torch.randint(-128, 127, (33, 17), dtype=torch.int8, generator=g), torch.tensor(2.5, dtype=torch.float64),
          torch.tensor([True, False, True]), torch.randn(1, 1001, generator=g).half()]
    out = onto_huge_pages(ts)
    assert all(o is not t and o.dtype == t.dtype and o.shape == t.shape and torch.equal(o, t)
               for o, t in zip(out, ts, strict=True))
    starts = [o.data_ptr() for o in out]
    assert starts[0] % HUGE == 0 and all(p % 64 == 0 for p in starts)        # a 2 MiB page's start; cache lines
    assert starts == sorted(starts) and starts[-1] - starts[0] < HUGE           # one after another, one mapping
    assert advised_huge(starts[0]) and advised_huge(starts[-1])
    out[0][0, 0] = 7.0                                                          # copies: the originals unchanged
    assert ts[0][0, 0] != 7.0
    assert onto_huge_pages([]) == []


@linux
@pytest.mark.parametrize("quantize_dense, tied, in_place", [(False, False, True), (True, False, True),
                                                             (False, True, False), (False, True, True)])
def test_router_weights_move_whole_and_leave_the_mapped_ones(tmp_path, quantize_dense, tied, in_place):
    cfg_hf = small_config("qwen3_moe")
    cfg_hf.tie_word_embeddings = tied
    path = save_checkpoint(build_model(cfg_hf, seed=3), tmp_path / "m")
    cfg = ModelConfig.from_dir(path)
    ckpt = Checkpoint(path)
    w = RouterWeights.load(ckpt, cfg, torch.float32, in_place=in_place)
    assert ("embed" in w.mapped) == in_place       # the float32 checkpoint's embedding is used where it lies
    if quantize_dense:
        w.quantize_int8()
    before = [t.clone() for lw in w.layers for t in _tensors_of(lw)]
    head_before = [t.clone() for t in _tensors_of(w.lm_head)]
    embed, lm_head = w.embed, w.lm_head
    moved = w.onto_huge_pages()
    after = [t for lw in w.layers for t in _tensors_of(lw)]
    assert moved >= sum(t.numel() * t.element_size() for t in after)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(after, before, strict=True))
    assert all(advised_huge(t.data_ptr()) for t in after if t.numel())
    assert all(torch.equal(a, b) for a, b in zip(_tensors_of(w.lm_head), head_before, strict=True))
    if "lm_head" in w.mapped or tied and "embed" in w.mapped:   # the checkpoint's own bytes: left where they lie
        assert w.lm_head is lm_head and w.embed is embed
    else:
        assert all(advised_huge(t.data_ptr()) for t in _tensors_of(w.lm_head))
    if tied:
        assert w.lm_head is w.embed                # still one tensor
    ckpt.close(keep=w.mapped.values())


def test_nothing_is_copied_where_an_administrator_turned_huge_pages_off(tmp_path, monkeypatch):
    from colibri_common import huge_pages

    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_MODE", mode)
    ts = [torch.randn(4, 4)]
    assert huge_pages.onto_huge_pages(ts) is ts
    cfg_hf = small_config("qwen3_moe")
    path = save_checkpoint(build_model(cfg_hf, seed=1), tmp_path / "m")
    ckpt = Checkpoint(path)
    w = RouterWeights.load(ckpt, ModelConfig.from_dir(path), torch.float32, in_place=True)
    qkv = w.layers[0].qkv
    assert w.onto_huge_pages() == 0 and w.layers[0].qkv is qkv
    mode.write_text("always [madvise] never\n")
    assert huge_pages.huge_pages_advisable() == hasattr(mmap, "MADV_HUGEPAGE")
    ckpt.close(keep=w.mapped.values())


def test_a_move_asked_to_stop_ends_after_the_layer_it_is_moving(tmp_path):
    """`stop` set before the move: nothing moves; set while it moves (after the first layer): the layers after it
    stay where they were, with the bits they had."""
    import threading

    cfg_hf = small_config("qwen3_moe")
    path = save_checkpoint(build_model(cfg_hf, seed=2), tmp_path / "m")
    ckpt = Checkpoint(path)
    w = RouterWeights.load(ckpt, ModelConfig.from_dir(path), torch.float32)
    stop = threading.Event()
    stop.set()
    first = [lw.o for lw in w.layers]
    assert w.onto_huge_pages(stop) == 0 and [lw.o for lw in w.layers] == first
    stop.clear()
    layers = w.layers

    class Once(list):                              # the stop arrives as the first layer is taken to be moved
        def __iter__(self):
            for i, lw in enumerate(list.__iter__(self)):
                yield lw
                if i == 0:
                    stop.set()

    w.layers = Once(layers)
    moved = w.onto_huge_pages(stop)
    expect = huge_pages_advisable()
    assert (moved > 0) == expect and (w.layers[0].o is not first[0]) == expect
    assert all(lw.o is o for lw, o in zip(w.layers[1:], first[1:], strict=True))
    ckpt.close(keep=w.mapped.values())


@linux
def test_a_serving_engine_moves_its_weights_once_ready_and_its_tokens_do_not_change(tmp_path):
    """build_engine leaves the move to `settle` (a thread, once the engine serves): the weights go onto 2 MiB pages
    while steps run, and the greedy tokens are those of an engine whose weights never moved."""
    import threading
    import time

    from colibri import LLM, SamplingParams
    from router_service.api import build

    path = save_checkpoint(build_model(small_config("qwen3_moe"), seed=5), tmp_path / "m")
    prompts = [[1, 2, 3, 4], [9, 8, 7]]

    def tokens(llm: LLM) -> list[list[int]]:
        return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, SamplingParams(max_tokens=24))]

    llm = LLM(path, 0, dtype="float32")
    try:
        moving = tokens(llm)                                   # (its first steps run beside the move)
        deadline = time.monotonic() + 60
        while any(t.name == "router-huge-pages" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.05)
        qkv = llm.engine.model.w.layers[0].qkv
        assert advised_huge(qkv.data_ptr()), "the layers' weights did not move"
        moved = tokens(llm)
    finally:
        llm.close()
    assert not any(t.name == "router-huge-pages" for t in threading.enumerate())
    real = build._onto_huge_pages
    started, saw_stop = threading.Event(), []

    def slow(weights, stop):                       # a move still running when the engine closes
        started.set()
        saw_stop.append(stop.wait(60))
        real(weights, stop)

    build._onto_huge_pages = slow
    try:
        early = LLM(path, 0, dtype="float32")
        assert started.wait(30)
        t0 = time.monotonic()
        early.close()                              # the move is told to stop and waited for, not left running
    finally:
        build._onto_huge_pages = real
    assert saw_stop == [True] and time.monotonic() - t0 < 30
    assert not any(t.name == "router-huge-pages" for t in threading.enumerate())
    real = build._onto_huge_pages
    build._onto_huge_pages = lambda weights, stop: None             # an engine whose weights stay where they were
    try:
        still = LLM(path, 0, dtype="float32")
        try:
            assert not advised_huge(still.engine.model.w.layers[0].qkv.data_ptr())
            never = tokens(still)
        finally:
            still.close()
    finally:
        build._onto_huge_pages = real
    assert moving == moved == never and all(len(t) == 24 for t in never)
