"""The offline API (`colibri.LLM`): in this process and over a local fleet it gives transformers' greedy tokens;
text prompts, stop strings, one sampling per prompt; bad input is a clear error and the LLM goes on."""

from __future__ import annotations

import shutil
import socket
import time

import pytest
import torch

from colibri import LLM, SamplingParams
from tests.test_e2e_oracle import NEW_TOKENS, PROMPTS, check_against_oracle
from tests.tokenizer_fixtures import save_tokenizer


@pytest.fixture(scope="module")
def model(oracles, tmp_path_factory):
    """The olmoe oracle's checkpoint with a byte-level tokenizer (id == byte), so text prompts work."""
    oracle = oracles["olmoe"]
    path = tmp_path_factory.mktemp("llm") / "olmoe"
    shutil.copytree(oracle.path, path)
    save_tokenizer(path)
    return oracle, path


def _greedy(n: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def test_in_process_gives_transformers_tokens_and_text(model):
    oracle, path = model
    with LLM(path, 0, expert_cache_heat="off") as llm:
        outs = llm.generate(PROMPTS, _greedy(return_logits=True))       # every prompt in one batch
        assert len({o.request_id for o in outs}) == len(outs)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            c = out.outputs[0]
            check_against_oracle(oracle, prompt, c.token_ids, c.logits, c.finish_reason)
            assert out.prompt_token_ids == prompt and out.prompt is None
            assert c.text == bytes(c.token_ids).decode("utf-8", "replace")
        text = llm.generate("Colibri", _greedy())[0]
        assert text.prompt == "Colibri" and text.prompt_token_ids == list(b"Colibri")
        assert text.outputs[0].token_ids == oracle.greedy(list(b"Colibri"), NEW_TOKENS)


def test_a_stop_string_ends_the_text_before_it(model):
    oracle, path = model
    with LLM(path, 0, expert_cache_heat="off") as llm:
        full = [o.outputs[0] for o in llm.generate(PROMPTS, _greedy())]
        # a printable ASCII token after the first: its character's first place in the text is where it stops
        cases = [(p, c, chr(t)) for p, c in zip(PROMPTS, full, strict=True) for t in c.token_ids[1:] if 32 < t < 127]
        assert cases, "no printable token in the greedy outputs; change the prompts"
        prompt, c, stop = cases[0]
        stopped = llm.generate([prompt], _greedy(stop=(stop,)))[0].outputs[0]
        assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
        assert stopped.text == c.text[:c.text.index(stop)]
        assert len(stopped.token_ids) < NEW_TOKENS


def test_bad_input_is_a_clear_error_and_the_llm_goes_on(model):
    oracle, path = model
    with pytest.raises(TypeError, match="unknown option.*nonsense"):
        LLM(path, 0, nonsense=1)
    with pytest.raises(ValueError, match="workers"):
        LLM(path, -1)
    # keyword options are checked as their flags are: types and choices, before anything loads
    for kw, error, match in [({"dtype": "BFLOAT16"}, ValueError,
                              "dtype='BFLOAT16' is not one of auto, float32, bfloat16"),
                             ({"dtype": "float16"}, ValueError, "not one of"), ({"dtype": 3}, TypeError, "dtype"),
                             ({"threads": "two"}, TypeError, "threads must be int"),
                             ({"kv_cache_mb": "100"}, TypeError, "kv_cache_mb must be int"),
                             ({"max_batch_size": "8"}, TypeError, "max_batch_size must be int"),
                             ({"sched": {"max_batch_size": 8}}, TypeError, "sched must be a .*SchedulerConfig")]:
        with pytest.raises(error, match=match):
            LLM(path, 0, **kw)
    # what one request carries: a value past it failed the engine step of every request beside it
    for bad, match in [({"seed": 2**70}, r"seed must be in \[0, 2\^64\)"), ({"seed": -1}, "seed"),
                       ({"top_k": 2**64}, "top_k must be at most"), ({"stop_token_ids": (-1,)}, "stop_token_ids")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)
    with LLM(path, 0, expert_cache_heat="off", max_batch_size=16) as llm:   # serve's scheduler flags as keywords
        assert llm.built.engine.limits.max_batch_size == 16
        limit = llm.built.max_model_len
        for prompts, params, match in [
            ([[]], None, "empty"),
            ([[3, 256]], None, r"outside the vocabulary \[0, 256\)"),
            ([[3] * (limit - 2)], _greedy(4), "maximum context length"),
            ([[3], [4]], [_greedy(), _greedy(), _greedy()], "3 sampling params for 2 prompts"),
            ([[3]], _greedy(stop_token_ids=(5, 300)), r"stop_token_ids \[300\] are outside the vocabulary"),
            (["bad \ud800"], None, "not valid UTF-8"),
        ]:
            with pytest.raises(ValueError, match=match):
                llm.generate(prompts, params)
        with pytest.raises(ValueError, match="max_tokens must be > 0"):
            SamplingParams(max_tokens=0)
        with pytest.raises(TypeError, match="token ids are ints, not bools"):        # True ran as token id 1
            llm.generate([[True, 3]], _greedy())
        assert llm.generate([PROMPTS[0]], _greedy())[0].outputs[0].token_ids == oracle.greedy(PROMPTS[0], NEW_TOKENS)
        assert llm.generate([], _greedy()) == []
    with LLM(oracle.path, 0, expert_cache_heat="off") as bare:         # no tokenizer.json: as the router refuses them
        with pytest.raises(ValueError, match="stop strings need the model's tokenizer.json"):   # (never matched)
            bare.generate([PROMPTS[0]], _greedy(stop=("x",)))


def test_a_local_fleet_gives_the_same_tokens_as_in_process(model):
    oracle, path = model
    params = [_greedy(return_logits=True), _greedy(return_logits=True, temperature=0.8, seed=7)]
    prompts = [PROMPTS[0], PROMPTS[2]]
    with LLM(path, 0, expert_cache_heat="off") as llm:
        here = [o.outputs[0] for o in llm.generate(prompts, params)]
    with LLM(path, 2, expert_cache_heat="off", log_level="WARNING", dtype=torch.float32) as fleet:
        there = [o.outputs[0] for o in fleet.generate(prompts, params)]
        with pytest.raises(ValueError, match="outside the vocabulary"):      # checked before any prompt runs
            fleet.generate([PROMPTS[0], [3, 999]], _greedy())
        with pytest.raises(ValueError, match="stop_token_ids"):
            fleet.generate([PROMPTS[0]], _greedy(stop_token_ids=(300,)))
        # the router refuses one (too long once tokenized): the error comes at once and the others are aborted,
        # where the executor's exit had waited for them to finish in full
        limit = fleet._fleets[0].client.model_info().max_model_len
        t0 = time.monotonic()
        fleet.generate([[3, 5], [7, 9]], _greedy(limit - 10))
        full = time.monotonic() - t0
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="maximum context length"):
            fleet.generate([[3, 5], "x" * (2 * limit), [7, 9]], _greedy(limit - 10))
        assert time.monotonic() - t0 < full / 2, (time.monotonic() - t0, full)
        text = fleet.generate("Colibri", _greedy())[0]
    check_against_oracle(oracle, PROMPTS[0], there[0].token_ids, there[0].logits, there[0].finish_reason)
    for a, b in zip(here, there, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
        assert max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits, strict=True)) < 1e-4
    assert text.prompt_token_ids == list(b"Colibri")
    assert text.outputs[0].token_ids == oracle.greedy(list(b"Colibri"), NEW_TOKENS)
    assert torch.equal(torch.tensor(here[1].token_ids), torch.tensor(there[1].token_ids))   # seeded sampling too


def test_a_fleet_that_cannot_start_says_why_in_the_error(model, capfd):
    """The child's own line is the error's (it said "its log above says why"), and its log still reaches
    stderr; nothing is left running."""
    _, path = model
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"exited with code 2 before it was ready: .*--metrics-port {port}: "
                                               rf"127\.0\.0\.1:{port} is in use"):
            LLM(path, 2, metrics_port=port, expert_cache_heat="off")
    assert f"127.0.0.1:{port} is in use" in capfd.readouterr().err


def test_n_completions_top_logprobs_and_wrong_types(model):
    oracle, path = model
    with LLM(path, 0, expert_cache_heat="off") as llm:
        out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, ignore_eos=True, n=3, temperature=0.9, seed=5,
                                                        logprobs=True, top_logprobs=2))[0]
        assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 6 for c in out.outputs)
        assert all(len(c.logprobs) == 6 and all(len(t) == 2 for t in c.top_logprobs) for c in out.outputs)
        again = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, ignore_eos=True, n=3, temperature=0.9,
                                                          seed=5))[0]
        assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]    # seeds seed + i
        assert SamplingParams(stop="ab").stop == ("ab",)                  # one stop string, not its characters
        for prompts, params, error in [
            ({"prompt": "hi"}, None, TypeError), ([[1.5, 2.0]], None, TypeError), (["a", None], None, TypeError),
            ([PROMPTS[0]], {"max_tokens": 3}, TypeError), ([PROMPTS[0]], [None], TypeError),
        ]:
            with pytest.raises(error):
                llm.generate(prompts, params)
        for bad in ({"max_tokens": None}, {"logprobs": 3}, {"n": 0}):
            with pytest.raises((TypeError, ValueError)):
                SamplingParams(**bad)
        assert llm.generate((3, 17, 42, 99, 5, 8), _greedy())[0].outputs[0].token_ids == \
            oracle.greedy(PROMPTS[0], NEW_TOKENS)                        # a tuple of ids is one prompt
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([PROMPTS[0]])


def test_more_prompts_than_the_waiting_queue_and_a_failure_leave_nothing_running(model):
    from router_service.engine.scheduler import SchedulerConfig

    oracle, path = model
    with LLM(path, 0, expert_cache_heat="off", sched=SchedulerConfig(max_waiting=4, max_batch_size=4)) as llm:
        outs = llm.generate([[3, i + 1] for i in range(11)], _greedy(4))
        assert [o.outputs[0].token_ids for o in outs] == [oracle.greedy([3, i + 1], 4) for i in range(11)]
        assert not llm.engine.seqs                                       # every request retired


def test_generate_starts_its_prompts_at_one_step_so_its_bits_do_not_hang_on_timing(oracles, monkeypatch):
    """In-process generate gives its prompts the same batches run after run (Engine.together), even where the
    engine thread could step between two submissions: float32 GPT-OSS, whose linears batch their rows (no
    --batch-invariant), gives the same bits and tokens with a pause after each submission as without."""
    import random

    from router_service.engine.metrics import parse

    prompts = [[random.Random(70 + i).randrange(256) for _ in range(3 + 4 * i)] for i in range(4)]

    def run(pause: float) -> tuple[list[bytes], float]:
        with LLM(oracles["gpt_oss"].path, 0, expert_cache_heat="off", dtype=torch.float32, cpu_forms="off") as llm:
            submit = llm.engine.submit

            def slow(group):
                out = submit(group)
                time.sleep(pause)                  # room for the engine thread to step the first prompts alone
                return out
            monkeypatch.setattr(llm.engine, "submit", slow)
            outs = llm.generate(prompts, _greedy(6, return_logits=True))
            batch_max = parse(llm.engine.metrics.render())["colibri:batch_size_max"]
        return [b"".join(x.numpy().tobytes() for x in o.outputs[0].logits) + repr(o.outputs[0].token_ids).encode()
                for o in outs], batch_max

    quick, _ = run(0.0)
    paused, batch_max = run(0.05)
    assert paused == quick
    assert batch_max == 4                          # all four shared the first steps


def test_a_fleet_takes_more_prompts_than_its_routers_queue_as_in_process(model):
    """A local fleet's generate sends as many as the router's --max-waiting queue takes and the rest as those
    finish, as the in-process engine does (it sent up to 64 at once, and the first refused failed the call)."""
    from router_service.engine.scheduler import SchedulerConfig

    oracle, path = model
    sched = SchedulerConfig(max_waiting=4, max_batch_size=2)
    with LLM(path, 1, expert_cache_heat="off", log_level="WARNING", dtype=torch.float32, sched=sched) as fleet:
        outs = fleet.generate([[3, i + 1] for i in range(13)], _greedy(4))
        assert [o.outputs[0].token_ids for o in outs] == [oracle.greedy([3, i + 1], 4) for i in range(13)]
        n2 = fleet.generate([[3, i + 1] for i in range(5)], SamplingParams(max_tokens=4, ignore_eos=True, n=2))
        assert [[c.token_ids for c in o.outputs] for o in n2] == [[oracle.greedy([3, i + 1], 4)] * 2
                                                                  for i in range(5)]


def test_the_start_up_log_names_what_routes(model, caplog):
    """A CPU router with the native decoder ops routes each MoE layer in one native call, and its start-up line
    says so ("native routing"; it said "torch routing", the kernels' backend, whatever routed)."""
    from kernels import native

    _, path = model
    with caplog.at_level("INFO", logger="colibri.router"), LLM(path, 0, expert_cache_heat="off") as llm:
        form = llm.built.engine.model.routing_form()
        assert form == ("native" if native.decoder_ops() else "torch")
        assert f"{form} routing" in caplog.text
        native.refuse_decoder_ops("a test")
        try:
            assert llm.built.engine.model.routing_form() == "torch"
        finally:
            native.refuse_decoder_ops(None)


def test_n_choices_of_a_long_prompt_on_a_small_cache_finish_with_their_tokens(model):
    """n = 8 choices of a 200-token prompt in a 16-block cache: the other choices waited holding the first's
    prompt blocks after it was preempted, nothing could run, and the engine hung for good (every later request
    behind it). Now they give their blocks back and recompute; each choice's tokens are those of a roomy cache."""
    import threading

    from router_service.engine.scheduler import SchedulerConfig

    _, path = model
    prompt = [(5 * j + 1) % 256 for j in range(200)]
    sp = SamplingParams(max_tokens=56, ignore_eos=True, n=8, temperature=0.8, seed=3)
    with LLM(path, 0, expert_cache_heat="off") as roomy:
        want = [c.token_ids for c in roomy.generate([prompt], sp)[0].outputs]
    got: list = []
    with LLM(path, 0, expert_cache_heat="off", kv_cache_blocks=16, block_size=16,
             sched=SchedulerConfig(max_model_len=256)) as small:
        runner = threading.Thread(target=lambda: got.append(small.generate([prompt], sp)), daemon=True)
        runner.start()
        runner.join(timeout=120)
        assert got, "the engine hung: n choices of a long prompt on a small KV cache"
        assert [c.token_ids for c in got[0][0].outputs] == want
        assert small.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0].outputs[0].token_ids    # it goes on


def test_torch_imported_first_is_warned_about(model):
    """libgomp reads OMP_WAIT_POLICY when torch loads: a program that imported torch before colibri keeps its
    OpenMP threads spinning beside the kernels' (up to 2x slower at 5-8 rows an expert), with no word of it."""
    import os
    import subprocess
    import sys

    _, path = model
    code = "{}from colibri import LLM; LLM({!r}, 0, expert_cache_heat='off').close()"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    said = []
    for first in ("import torch; ", ""):
        out = subprocess.run([sys.executable, "-c", code.format(first, str(path))], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        said.append("import colibri first, or run with OMP_WAIT_POLICY=PASSIVE" in out.stderr)
    assert said == [True, False]
