"""The CUDA graphs' decode step (router_service/model/decode_graphs.py) without a GPU: the same buffered step a
graph records (fixed input buffers, padding rows to the bucket, the spare KV block, the paged Triton attention,
the device alignment over the worst-case grid) run op by op under the Triton interpreter, against transformers,
with several sequences at once so the buckets pad. The capture and replay themselves are tests/gpu's."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from router_service.engine.sequence import Sampling, Sequence
from router_service.model.decode_graphs import DecodeGraphs, buckets, why_not
from router_service.model.step_inputs import SeqSlice
from tests.inprocess import InProcess
from tests.test_e2e_oracle import PROMPTS, rel_err


def test_buckets_cover_every_batch_up_to_the_largest():
    assert buckets(1) == [1]
    assert buckets(5) == [1, 2, 4, 5]
    assert buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert buckets(100)[-3:] == [80, 96, 100]


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])      # gpt_oss: sliding layers and sinks
def test_the_buffered_decode_step_matches_transformers(oracles, monkeypatch, arch):
    monkeypatch.setenv("COLIBRI_MOE_BACKEND", "triton")         # the GPU's kernels, on CPU tensors
    oracle = oracles[arch]
    with InProcess(oracle.path, block_size=4) as llm:
        engine = llm.engine
        assert why_not(engine.model, engine.experts, 1, False) == "not on a GPU"
        spare: list[int] = []
        engine.scheduler.alloc.grow(spare, 1)                    # a block no sequence gets, as build.py's spare
        max_blocks = -(-engine.scheduler.cfg.max_model_len // 4)
        graphs = DecodeGraphs(engine.model, engine.kv, engine.experts, 8, max_blocks, spare[0], engine.window)
        engine.graphs = graphs
        prompts = [*PROMPTS[:2], PROMPTS[0][:3]]      # 3 sequences, then 2, then 1: buckets 4 (a padding row), 2, 1
        new = [9, 7, 5]
        handles = [engine.submit(Sequence(f"r{i}", list(p), Sampling(max_tokens=n, return_logits=True)))
                   for i, (p, n) in enumerate(zip(prompts, new, strict=True))]
        results = [InProcess.collect(h) for h in handles]
        assert llm.metrics()["colibri:cuda_graph_replays_total"] == 0
    assert graphs.runs >= max(new) - 1 and graphs.replays == 0  # every decode step on the buffers (no GPU: no graph)
    for p, n, res in zip(prompts, new, results, strict=True):
        assert res.token_ids == oracle.greedy(p, n), f"prompt {p}"
        assert rel_err(res.logits[-1], oracle.last_logits(p + res.token_ids[:-1])) < 1e-4


def test_steps_a_graph_cannot_run_go_op_by_op(oracles, monkeypatch):
    """A prompt (prefill) and a batch over the largest bucket do not fit; decode steps within it do."""
    monkeypatch.setenv("COLIBRI_MOE_BACKEND", "triton")
    with InProcess(oracles["qwen3_moe"].path, block_size=4) as llm:
        engine = llm.engine
        graphs = DecodeGraphs(engine.model, engine.kv, engine.experts, 2, 3, 0, 0)
        decode = SeqSlice(5, 1, [1, 2], True)
        assert graphs.fits([decode, decode])
        assert not graphs.fits([decode] * 3)                       # over the largest bucket
        assert not graphs.fits([SeqSlice(0, 5, [1, 2], True)])      # a prompt
        assert not graphs.fits([SeqSlice(12, 1, [1, 2, 3, 4], True)])   # more blocks than the table holds
        assert not graphs.fits([])
        graphs.failed = "a capture failed"
        assert not graphs.fits([decode])


class _HostTraffic(TorchDispatchMode):
    """Records the ops a CUDA graph's capture refuses or cannot hold: a Python value made a host tensor and
    copied in (an item set), a read back to the host (item, a sync), outputs sized by the data."""

    REFUSED = {"lift_fresh", "_local_scalar_dense", "nonzero", "unique", "_unique2", "masked_select", "bincount",
               "repeat_interleave", "item"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.REFUSED:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_the_buffered_step_reads_nothing_back_and_makes_no_host_tensors(oracles, monkeypatch, arch):
    """What failed the first capture on a GPU (an item set in the device alignment is a copy from the host), and
    every sync: none may happen inside the step a graph records."""
    monkeypatch.setenv("COLIBRI_MOE_BACKEND", "triton")
    with InProcess(oracles[arch].path, block_size=4) as llm:
        engine = llm.engine
        graphs = DecodeGraphs(engine.model, engine.kv, engine.experts, 4, 8, 0, engine.window)
        slices = [SeqSlice(5, 1, [1, 2], True), SeqSlice(2, 1, [3], True), SeqSlice(7, 1, [4, 5], True)]
        seen, forward = _HostTraffic(), engine.model.forward

        def recorded(*args):                       # the step a graph records (not the inputs' copies before it)
            with seen:
                return forward(*args)

        monkeypatch.setattr(engine.model, "forward", recorded)
        logits = graphs.run(slices, [11, 12, 13])
    assert logits.shape[0] == 3 and torch.isfinite(logits).all()
    assert seen.seen == []
