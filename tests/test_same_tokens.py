"""The same greedy tokens in bfloat16 whatever the fleet's shape, and, with --batch-invariant, whatever the batch.

The checkpoint is a bf16 Qwen3-MoE with small random weights (std 0.05), so its logits are close together: a
last-bit difference in any sum flips greedy choices within a few tokens (rounding each worker's partial sum
to bf16, as Colibri once did, changed the tokens of every configuration below). Every fleet
here serves the same prompts; their tokens must be identical.

- The fleet's shape: 1, 2 or 3 workers, replicas, the unary transport, a bounded expert cache. The MoE sum
  is exact in float64 and rounded once, and every worker computes an expert's rows with the same forms, so
  none of these may change a token. Streams run one after another here: concurrent streams change the
  batches, which only --batch-invariant makes irrelevant.
- `--batch-invariant`: the same prompts one at a time, all at once, and over two micro-batches; in-process
  in float32 on odd sizes (hidden 72: vector loops with scalar tails), a sigmoid-gated shared expert, latent
  attention, sliding layers with sinks.
"""

from __future__ import annotations

import os
import random
import tempfile
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import Qwen3MoeConfig

from colibri.client import Client
from kernels import native
from tests.conftest import fleet
from tests.inprocess import InProcess
from tests.models import build_model, save_checkpoint, small_config

PROMPTS = [[random.Random(i).randrange(512) for _ in range(4 + 3 * i)] for i in range(6)]
TOKENS = 32


def near_tie_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(vocab_size=512, hidden_size=256, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, num_experts=24, num_experts_per_tok=4,
                          moe_intermediate_size=96, intermediate_size=256, norm_topk_prob=True,
                          max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=None,
                          bos_token_id=None, pad_token_id=None)


@pytest.fixture(scope="module")
def near_ties(tmp_path_factory) -> Path:
    model = build_model(near_tie_config(), seed=7, std=0.05, dtype=torch.bfloat16)   # logits close: ties often
    return save_checkpoint(model, tmp_path_factory.mktemp("near-ties") / "qwen3-bf16")


@dataclass
class Run:
    """Per prompt its tokens and the float32 logits of each step they were chosen from; the fleet's INFO log."""
    tokens: list[list[int]]
    logits: list[list[bytes]]
    log: str


def serve(path: Path, workers: int, extra: list[str], together: bool = False) -> Run:
    with tempfile.TemporaryFile("w+") as log:
        with fleet(path, workers, ["--dtype", "bfloat16", "--log-level", "INFO", *extra], stderr=log) as (addr, _):
            client = Client(addr)

            def one(prompt: list[int]) -> tuple[list[int], list[bytes]]:
                res = client.generate(prompt, TOKENS, return_logits=True)
                return res.token_ids, [x.tobytes() for x in res.logits]

            if not together:
                got = [one(p) for p in PROMPTS]
            else:
                with ThreadPoolExecutor(len(PROMPTS)) as pool:
                    got = list(pool.map(one, PROMPTS))
        log.seek(0)
        return Run([t for t, _ in got], [lg for _, lg in got], log.read())


def same(a: Run, b: Run) -> None:
    """Identical tokens, and the logits behind them identical to the bit (a last-bit difference anywhere in a
    step shows there even where it flips no token)."""
    assert a.tokens == b.tokens, where(a, b)
    assert a.logits == b.logits, where(a, b)


def where(a: Run, b: Run) -> str:
    """Where two runs part: per prompt that differs, the first step whose logits differ (step 0: the prefill's) and
    by how much, and the first step whose token differs."""
    said = []
    for i, (la, lb) in enumerate(zip(a.logits, b.logits, strict=True)):
        step = next((s for s, (x, y) in enumerate(zip(la, lb, strict=False)) if x != y),
                    None if len(la) == len(lb) else min(len(la), len(lb)))
        if step is None:
            continue
        if step >= min(len(la), len(lb)):
            said.append(f"prompt {i}: {len(la)} steps against {len(lb)}")
            continue
        diff = float((torch.frombuffer(bytearray(la[step]), dtype=torch.float32)
                      - torch.frombuffer(bytearray(lb[step]), dtype=torch.float32)).abs().max())
        token = next((s for s, (x, y) in enumerate(zip(a.tokens[i], b.tokens[i], strict=False)) if x != y), None)
        tokens = "the same tokens" if token is None else f"tokens from step {token}"
        said.append(f"prompt {i}: logits from step {step} (largest difference {diff:.3g}), {tokens}")
    return "; ".join(said) or "the same"


class OneOffDifference(UserWarning):
    """Two fleets differed, then agreed when both served the prompts again."""


AGAIN = 3       # times both fleets serve the prompts again where they differ, before the difference fails the test


def agree(a: Run, b: Run, again: Callable[[], tuple[Run, Run]], what: str) -> None:
    """`same(a, b)`; where they differ, both fleets serve the prompts again, up to AGAIN times, and must then be the
    same: a difference that lasts through every retry fails, one that goes is a warning in the run's summary, which
    names a file with the fleets' logs. An open bug (docs/models.md): on a 2-core Intel Xeon VM with AMX, beside the
    rest of the suite a fleet here now and then computes its decode steps otherwise (every prompt's logits parting at
    the first decode step: the same other bits whatever its shape), once through every try of a CI run, and no run of
    this module alone did, so `make test` runs it alone. A fleet's shape that changed the bits would differ at every
    try."""
    try:
        same(a, b)
        return
    except AssertionError:
        seen = [where(a, b)]
    fd, name = tempfile.mkstemp(prefix="colibri-near-ties-", suffix=".log")
    os.close(fd)
    logs = Path(name)
    tried = what.split(" against ")[0]
    logs.write_text(f"{what}: {seen[0]}\n\n--- {tried}\n{a.log}\n--- the other\n{b.log}")
    first = (a, b)
    torch.save({"tried": [a.tokens, a.logits], "other": [b.tokens, b.logits]}, logs.with_suffix(".pt"))
    for _ in range(AGAIN):
        a, b = again()
        try:
            same(a, b)
        except AssertionError:
            seen.append(where(a, b))
            with logs.open("a") as f:
                f.write(f"\n\n=== served again: {seen[-1]}\n--- {tried}\n{a.log}\n--- the other\n{b.log}")
            continue
        odd = odd_one(first, a, tried)
        with logs.open("a") as f:
            f.write(f"\n\n=== served again: the same; {odd}\n")
        warnings.warn(OneOffDifference(f"{what}: differed {len(seen)} time(s), the same when served again; {odd} "
                                       f"({seen[0]}; the fleets' logs: {logs}, their first tokens and logits: "
                                       f"{logs.with_suffix('.pt')})"), stacklevel=2)
        return
    raise AssertionError(f"{what}: differed at every try: {' / '.join(seen)} (the fleets' logs: {logs})")


def odd_one(first: tuple[Run, Run], again: Run, tried: str) -> str:
    """Which fleet of a first try that differed computed otherwise: the one whose logits the agreeing retry did not
    give (the other's it gave to the bit)."""
    if again.logits == first[1].logits:
        return f"the first try's {tried} fleet computed otherwise"
    if again.logits == first[0].logits:
        return "the first try's other fleet computed otherwise"
    return "the retry matched neither fleet of the first try"


@pytest.fixture(scope="module")
def one_worker(near_ties) -> Run:
    return serve(near_ties, 1, [])


@pytest.mark.parametrize("workers, extra", [
    (2, []),
    (3, []),
    (3, ["--replicas", "2"]),
    (2, ["--replicas", "2"]),                # every worker holds every expert: each layer split by distinct experts
    (2, ["--transport", "unary"]),
    (2, ["--expert-cache-capacity", "25%"]),
], ids=["2-workers", "3-workers", "3-workers-2-replicas", "2-workers-2-replicas", "unary", "cache-25pct"])
def test_bf16_tokens_do_not_depend_on_the_fleets_shape(near_ties, one_worker, workers, extra):
    got = serve(near_ties, workers, extra)
    assert all(len(t) == TOKENS for t in got.tokens)
    agree(got, one_worker, lambda: (serve(near_ties, workers, extra), serve(near_ties, 1, [])),
          f"{workers} workers {' '.join(extra)} against one worker")


def test_batch_invariant_tokens_are_the_same_alone_together_and_in_micro_batches(near_ties):
    """Prompts served one at a time, then all at once (their steps shared by up to six sequences, prefills beside
    decodes), then over two micro-batches on three workers: identical bf16 tokens."""
    alone = serve(near_ties, 2, ["--batch-invariant"])
    for workers, extra in ((2, []), (3, ["--micro-batches", "2"])):
        agree(serve(near_ties, workers, ["--batch-invariant", *extra], together=True), alone,
              lambda w=workers, e=extra: (serve(near_ties, w, ["--batch-invariant", *e], together=True),
                                          serve(near_ties, 2, ["--batch-invariant"])),
              f"{workers} workers {' '.join(extra)} together against alone")


@pytest.fixture(scope="module")
def odd_shapes(tmp_path_factory, oracles) -> dict[str, Path]:
    """Qwen2-MoE at hidden 72 (its shared expert's sigmoid gate is one value a token, so a batch's vector loop
    meets a scalar tail), and the suite's DeepSeek-V3 (latent attention) and GPT-OSS (sliding layers, sinks)."""
    qwen2 = build_model(small_config("qwen2_moe", hidden_size=72), seed=3)
    return {"qwen2_moe": save_checkpoint(qwen2, tmp_path_factory.mktemp("odd") / "qwen2-72"),
            "deepseek_v3": oracles["deepseek_v3"].path, "gpt_oss": oracles["gpt_oss"].path}


def logits_of(path: Path, together: bool, **opts) -> list[bytes]:
    prompts = [[random.Random(50 + i).randrange(256) for _ in range(5 + 2 * i)] for i in range(6)]
    with InProcess(path, cpu_forms="off", **opts) as engine:
        if together:
            runs = engine.submit_all(prompts, 6, return_logits=True)
            results = [engine.collect(r) for r in runs]
        else:
            results = [engine.generate(p, 6, return_logits=True) for p in prompts]
    return [b"".join(x.numpy().tobytes() for x in r.logits) for r in results]


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_batch_invariant_float32_logits_are_the_same_bits_alone_and_together(odd_shapes, arch):
    path = odd_shapes[arch]
    assert logits_of(path, True, batch_invariant=True) == logits_of(path, False, batch_invariant=True)
    # the test can see a batch: without the mode, and with SDPA over gathered keys and torch's norms and rope (the
    # native decoder ops are row-local whatever the mode), the batch shows in the last bits
    native.refuse_decoder_ops("the torch forms, to show the test sees a batch")
    try:
        assert logits_of(path, True) != logits_of(path, False)
    finally:
        native.refuse_decoder_ops(None)


def test_a_one_off_difference_names_the_fleet_that_computed_otherwise_and_keeps_its_logits(monkeypatch, tmp_path):
    """`agree` on made-up runs: a first try whose tried fleet differs, then runs that agree with the other fleet,
    warns naming the tried fleet and keeps both first tries' logits beside the logs; a lasting difference fails."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))               # the files it writes, here

    def run(value: float) -> Run:
        return Run([[1, 2]], [[torch.full((4,), value).numpy().tobytes()] * 2], f"log {value}")

    with pytest.warns(OneOffDifference, match="the first try's 2 workers fleet computed otherwise") as caught:
        agree(run(1.5), run(1.0), lambda: (run(1.0), run(1.0)), "2 workers against one worker")
    kept = Path(str(caught[0].message).rsplit("their first tokens and logits: ", 1)[1].rstrip(")"))
    assert kept.parent == tmp_path
    first = torch.load(kept)
    assert first["tried"][1] == run(1.5).logits and first["other"][1] == run(1.0).logits
    assert "=== served again: the same; the first try's 2 workers fleet" in kept.with_suffix(".log").read_text()
    with pytest.raises(AssertionError, match="differed at every try"):
        agree(run(1.5), run(1.0), lambda: (run(1.5), run(1.0)), "2 workers against one worker")


def test_the_near_tie_probe_names_its_probes_and_refuses_others(capsys):
    from tests import near_tie_probe

    assert near_tie_probe.main(["--list"]) == 0
    assert capsys.readouterr().out.split("\n")[:2] == list(near_tie_probe.PROBES)[:2]
    assert near_tie_probe.main(["no such probe"]) == 2
    assert "no probe no such probe; --list names them" in capsys.readouterr().err
    assert near_tie_probe.main(["--caught"]) == 2
    assert "--caught takes the .pt file" in capsys.readouterr().err
    caught = {"tried": [[[1]], [[b"a", b"b"]]], "other": [[[1]], [[b"a", b"c"]]]}
    said = near_tie_probe.against(Run([[1]], [[b"a", b"c"]], ""), caught)
    assert said == "; caught: 1/2 steps those of the fleet that computed otherwise, 2/2 the other's"
