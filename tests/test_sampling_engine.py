"""The full sampling in the engine against references computed from transformers' logits: penalties, min_p,
min_tokens, log-probabilities, n > 1 sharing the prompt's KV blocks. In-process (no fleet): the maths and the
engine, not the processes."""

from __future__ import annotations

import pytest
import torch

from router_service.engine.events import Finished, Tokens
from router_service.engine.scheduler import SchedulerConfig
from router_service.engine.sequence import Sampling, Sequence
from tests.inprocess import InProcess

PROMPT = [3, 17, 42, 99, 5, 8, 61, 7, 19, 23, 4, 77, 12, 90]    # 14 tokens: 3 full blocks of 4 before the last
BLOCK = 4
N_NEW = 10


@pytest.fixture(scope="module")
def qwen3(oracles):
    oracle = oracles["qwen3_moe"]
    with InProcess(oracle.path, block_size=BLOCK, kv_cache_blocks=64,
                   sched=SchedulerConfig(max_model_len=256)) as engine:   # 64 blocks of 4 tokens
        yield oracle, engine


def run(engine: InProcess, group: list[Sequence]) -> dict[int, tuple[list[int], list, str]]:
    """Every choice's (tokens, Sampled per token, finish reason)."""
    events = engine.engine.submit(group)
    out: dict[int, tuple[list[int], list, str]] = {seq.index: ([], [], "") for seq in group}
    left = len(group)
    while left:
        ev = events.get(timeout=120)
        if isinstance(ev, Tokens):
            out[ev.index][0].extend(ev.token_ids)
            out[ev.index][1].extend(ev.logprobs)
        elif isinstance(ev, Finished):
            out[ev.index] = (out[ev.index][0], out[ev.index][1], ev.reason.value)
            left -= 1
        else:
            raise AssertionError(ev)
    return out


def one(engine: InProcess, sp: Sampling) -> tuple[list[int], list, str]:
    return run(engine, [Sequence("one", list(PROMPT), sp)])[0]


def oracle_steps(oracle, tokens: list[int]) -> torch.Tensor:
    """transformers' logits [n, V] at each step of generating `tokens` after PROMPT (teacher-forced)."""
    return oracle.step_logits(PROMPT, tokens).double()


def test_greedy_logprobs_are_the_oracles_log_softmax(qwen3):
    oracle, engine = qwen3
    tokens, lps, _ = one(engine, Sampling(max_tokens=N_NEW, logprobs=True, top_logprobs=5, ignore_eos=True))
    assert tokens == oracle.greedy(PROMPT, N_NEW)
    ref = torch.log_softmax(oracle_steps(oracle, tokens), dim=-1)                         # [n, V]
    for t, (tok, s) in enumerate(zip(tokens, lps, strict=True)):
        assert s.token == tok
        assert s.logprob == pytest.approx(float(ref[t, tok]), abs=1e-4)
        assert [i for i, _ in s.top] == ref[t].topk(5).indices.tolist()
        assert [v for _, v in s.top] == pytest.approx(ref[t].topk(5).values.tolist(), abs=1e-4)


def test_repetition_penalty_greedy_equals_transformers_generate(qwen3):
    oracle, engine = qwen3
    with torch.no_grad():
        ref = oracle.model.generate(torch.tensor([PROMPT]), max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                                    do_sample=False, repetition_penalty=1.8)[0, len(PROMPT):].tolist()
    assert ref != oracle.greedy(PROMPT, N_NEW)               # the penalty changes the answer: the test can fail
    tokens, _, _ = one(engine, Sampling(max_tokens=N_NEW, repetition_penalty=1.8, ignore_eos=True))
    assert tokens == ref


@pytest.mark.parametrize(("freq", "pres"), [(1.5, 0.0), (0.0, 2.0), (0.8, 0.8)])
def test_frequency_and_presence_penalties_against_the_oracles_logits(qwen3, freq: float, pres: float):
    oracle, engine = qwen3
    sp = Sampling(max_tokens=N_NEW, frequency_penalty=freq, presence_penalty=pres, logprobs=True, ignore_eos=True)
    tokens, lps, _ = one(engine, sp)
    # Reference: at each step, transformers' logits after the tokens so far, penalised by hand, argmax.
    ref: list[int] = []
    for _ in range(N_NEW):
        x = oracle.last_logits(PROMPT + ref).double().clone()
        for t in set(ref):
            x[t] -= freq * ref.count(t) + pres
        ref.append(int(x.argmax()))
        if len(ref) == len(tokens) or tokens[:len(ref)] != ref:
            break
        lp = torch.log_softmax(oracle.last_logits(PROMPT + ref[:-1]).double(), dim=-1)   # the model's own
        assert lps[len(ref) - 1].logprob == pytest.approx(float(lp[ref[-1]]), abs=1e-4)
    assert tokens == ref
    assert len(set(tokens)) > len(set(oracle.greedy(PROMPT, N_NEW))) or tokens != oracle.greedy(PROMPT, N_NEW)


def test_min_tokens_holds_back_a_stop_token(qwen3):
    oracle, engine = qwen3
    greedy = oracle.greedy(PROMPT, N_NEW)
    stop = greedy[1]
    assert one(engine, Sampling(max_tokens=N_NEW, stop_token_ids=(stop,)))[0] == greedy[:2]    # stops at once
    tokens, _, reason = one(engine, Sampling(max_tokens=N_NEW, stop_token_ids=(stop,), min_tokens=5))
    ref: list[int] = []
    while len(ref) < N_NEW:          # reference: the stop token masked while fewer than 5 are out, then argmax
        x = oracle.last_logits(PROMPT + ref).clone()
        if len(ref) < 5:
            x[stop] = float("-inf")
        ref.append(int(x.argmax()))
        if ref[-1] == stop:
            break
    assert tokens == ref and len(tokens) > 2
    assert reason == ("stop" if ref[-1] == stop else "length")


def test_min_p_samples_only_tokens_the_oracle_allows(qwen3):
    oracle, engine = qwen3
    T, min_p = 1.5, 0.2
    for seed in range(3):
        tokens, lps, _ = one(engine, Sampling(max_tokens=N_NEW, temperature=T, min_p=min_p, seed=seed,
                                              logprobs=True, ignore_eos=True))
        probs = torch.softmax(oracle_steps(oracle, tokens) / T, dim=-1)                  # [n, V]
        lp = torch.log_softmax(oracle_steps(oracle, tokens).double(), dim=-1)       # the model's own, untempered
        for t, tok in enumerate(tokens):
            assert probs[t, tok] >= min_p * probs[t].max() - 1e-6, (t, tok)
            assert lps[t].logprob == pytest.approx(float(lp[t, tok]), abs=1e-4)
        assert (probs < min_p * probs.max(dim=-1, keepdim=True).values).any(dim=-1).all()  # min_p cut something


def test_n_choices_share_the_prompt_blocks_and_greedy_choices_agree(qwen3):
    oracle, engine = qwen3
    before = engine.metrics().get("colibri:kv_cache_blocks_shared_total", 0.0)
    sp = Sampling(max_tokens=N_NEW, ignore_eos=True)
    out = run(engine, [Sequence("n3", list(PROMPT), sp, index=i) for i in range(3)])
    greedy = oracle.greedy(PROMPT, N_NEW)
    assert [out[i][0] for i in range(3)] == [greedy] * 3
    shared = (len(PROMPT) - 1) // BLOCK
    assert engine.metrics()["colibri:kv_cache_blocks_shared_total"] - before == 2 * shared
    assert engine.metrics()["colibri:kv_cache_blocks_free"] == 64          # every shared block came back


def test_n_seeded_choices_differ_and_reproduce(qwen3):
    _, engine = qwen3

    def choices() -> list[list[int]]:
        group = [Sequence("s", list(PROMPT), Sampling(max_tokens=N_NEW, temperature=1.0, seed=100 + i,
                                                      ignore_eos=True), index=i) for i in range(3)]
        out = run(engine, group)
        return [out[i][0] for i in range(3)]

    a, b = choices(), choices()
    assert a == b
    assert len({tuple(c) for c in a}) == 3


def test_an_aborted_request_ends_every_choice_and_frees_the_shared_blocks(qwen3):
    _, engine = qwen3
    # 100 tokens each (the cache's 64 blocks hold both): the abort must come before the end, on a loaded CI machine
    group = [Sequence("ab", list(PROMPT), Sampling(max_tokens=100, ignore_eos=True), index=i) for i in range(2)]
    events = engine.engine.submit(group)
    assert isinstance(events.get(timeout=60), Tokens)
    assert engine.engine.abort("ab")
    reasons = []
    while len(reasons) < 2:
        ev = events.get(timeout=60)
        if isinstance(ev, Finished):
            reasons.append(ev.reason.value)
    assert reasons == ["abort", "abort"]
    assert engine.metrics()["colibri:kv_cache_blocks_free"] == 64


def test_an_aborted_requests_id_is_free_at_once(qwen3):
    """A gateway that cancels on its timeout and retries under the same id is served, not told ALREADY_EXISTS
    (not retryable) for the step until the aborted request left the engine; the old request's pausing never
    touches the new one."""
    oracle, engine = qwen3
    for _ in range(5):
        events = engine.engine.submit([Sequence("again", list(PROMPT), Sampling(max_tokens=100, ignore_eos=True))])
        assert isinstance(events.get(timeout=60), Tokens)
        assert engine.engine.abort("again")
        retry = engine.engine.submit([Sequence("again", list(PROMPT), Sampling(max_tokens=8, ignore_eos=True))])
        got = []
        while not isinstance(ev := retry.get(timeout=60), Finished):
            got += ev.token_ids
        assert got == oracle.greedy(PROMPT, 8)
        while not isinstance(events.get(timeout=60), Finished):    # the aborted one ended as aborted
            pass
