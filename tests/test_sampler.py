"""Sampler (greedy, temperature, top-k, top-p, per-request seeds) and Sampling validation: CPU only, no model."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import pytest
import torch

from router_service.engine.sampler import SampleError, Sampler
from router_service.engine.sequence import Sampling

torch.set_num_threads(1)


@dataclass
class Row:
    """What the sampler reads of a sequence."""

    uid: str
    sampling: Sampling
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


def rows(pairs: list[tuple[str, Sampling]]) -> list[Row]:
    return [Row(uid, sp) for uid, sp in pairs]

try:
    from scipy.stats import chisquare
except ImportError:  # the max-abs-deviation bound below is always checked; chi-square only when scipy is there
    chisquare = None

N_DRAWS = 4000
N_SUPPORT = 2500  # fewer where the wrong alternatives differ in support, to keep the file fast
SIGMAS = 5.0
# Six tokens whose descending order is not index order: 3, 1, 5, 4, 2, 0.
PROBS = torch.tensor([0.04, 0.25, 0.06, 0.40, 0.10, 0.15], dtype=torch.float64)
LOGITS = PROBS.log().float()
ARGMAX = 3


def tempered(temperature: float) -> torch.Tensor:
    """softmax(LOGITS / T) in float64."""
    return torch.softmax(LOGITS.double() / temperature, dim=-1)


def restricted(probs: torch.Tensor, support: set[int]) -> torch.Tensor:
    """probs with everything outside support zeroed, renormalised."""
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[sorted(support)] = True
    out = probs.masked_fill(~mask, 0.0)
    return out / out.sum()


def draw(sampler: Sampler, logits: torch.Tensor, sp: Sampling, n: int, rid: str = "r") -> list[int]:
    """n single-row steps of one request, so its generator is reused from step to step."""
    row = logits.reshape(1, -1)
    return [sampler.tokens(row, rows([(rid, sp)]))[0] for _ in range(n)]


BATCH = 50


def draws(logits: torch.Tensor, sp: Sampling, n: int) -> list[int]:
    """n draws for a frequency check: n / 50 steps of 50 requests (seeds 50 * sp.seed + j: two calls with other
    seeds share no generator), the batched path a serving step takes, each generator reused from step to step;
    request by request, step by step."""
    assert n % BATCH == 0 and sp.seed is not None
    sampler = Sampler()
    batch = rows([(f"r{j}", dataclasses.replace(sp, seed=BATCH * sp.seed + j)) for j in range(BATCH)])
    steps = [sampler.tokens(logits.reshape(1, -1).expand(BATCH, -1), batch) for _ in range(n // BATCH)]
    return [step[j] for j in range(BATCH) for step in steps]


def mismatch(tokens: list[int], expected: torch.Tensor, sigmas: float = SIGMAS) -> str | None:
    """None if the draws are consistent with `expected`, else why not.

    Tokens of probability 0 must never appear; every other token's frequency must lie within `sigmas` binomial
    standard errors of its probability; and, with scipy, a chi-square test over the support must not reject at 1e-6.
    """
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens), minlength=expected.numel()).double()
    if counts.numel() != expected.numel():
        return f"token ids out of range: {sorted(set(tokens))}"
    support = expected > 0
    if counts[~support].sum() > 0:
        return f"tokens outside the support {support.nonzero().flatten().tolist()} appeared: {counts.tolist()}"
    freq = counts / n
    bound = sigmas * (expected * (1 - expected) / n).sqrt()
    dev = (freq - expected).abs()
    if bool((dev > bound + 1e-12)[support].any()):
        return f"frequencies {freq.tolist()} vs expected {expected.tolist()} (bound {bound.tolist()})"
    if chisquare is not None and int(support.sum()) > 1:
        p_value = float(chisquare(counts[support].numpy(), (expected[support] * n).numpy()).pvalue)
        if p_value < 1e-6:
            return f"chi-square rejects: p = {p_value:.2e}, counts {counts.tolist()}, expected {expected.tolist()}"
    return None


def assert_distribution(tokens: list[int], expected: torch.Tensor, wrong: list[torch.Tensor]) -> None:
    """The draws match `expected`, and the same check would have rejected each distribution in `wrong`."""
    problem = mismatch(tokens, expected)
    assert problem is None, problem
    for alt in wrong:
        assert mismatch(tokens, alt) is not None, f"the check cannot tell {expected.tolist()} from {alt.tolist()}"


# ---------------------------------------------------------------------------------------------------- greedy


def test_greedy_rows_take_the_argmax_and_rows_stay_paired_with_their_requests() -> None:
    # Each row's two best tokens are distinct from every other row's, so a row paired with the wrong request, or a
    # greedy row that was sampled, shows up as a token outside that row's allowed set.
    top = [(5, 2), (0, 7), (3, 1), (6, 4)]
    g = torch.Generator().manual_seed(0)
    logits = -torch.rand(len(top), 8, generator=g)
    for r, (a, b) in enumerate(top):
        logits[r, a], logits[r, b] = 4.0, 3.8
    requests = [
        ("greedy-plain", Sampling()),
        ("sampled-k2", Sampling(temperature=1.0, top_k=2, seed=1)),
        ("greedy-with-knobs", Sampling(temperature=0.0, top_k=3, top_p=0.5, seed=2)),  # knobs ignored when T = 0
        ("sampled-p", Sampling(temperature=1.5, top_p=0.6, seed=3)),
    ]
    s = Sampler()
    seen: list[set[int]] = [set() for _ in requests]
    for _ in range(60):
        out = s.tokens(logits, rows(requests))
        assert len(out) == len(requests) and all(isinstance(t, int) for t in out)
        for r, t in enumerate(out):
            seen[r].add(t)
    assert seen[0] == {5} and seen[2] == {3}, seen
    # The sampled rows really sample (both of their top-2 show up) and never leave their own row's top-2.
    assert seen[1] == {0, 7} and seen[3] == {6, 4}, seen
    assert Sampler().tokens(logits, rows([(f"g{r}", Sampling()) for r in range(len(top))])) == [a for a, _ in top]


def test_greedy_never_samples_even_on_nearly_flat_logits() -> None:
    logits = torch.tensor([[0.0, 0.01, 0.0, -0.01, 0.0, 0.0]])
    s = Sampler()
    assert {s.tokens(logits, rows([("g", Sampling(seed=5))]))[0] for _ in range(200)} == {1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_takes_the_first_of_equal_maxima_and_fails_only_non_finite_rows(dtype: torch.dtype) -> None:
    """float32 logits on the CPU are reduced by numpy, the others by torch: the same first-of-ties token, the same
    rows failed (any NaN, inf or -inf), and a row of large finite values whose sum overflows is not failed."""
    big = torch.finfo(dtype).max
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0],
                           [-math.inf, -1.0, -1.0, -3.0, -2.0, -1.0],     # -inf too: "non-finite logits"
                           [0.0, math.nan, 1.0, 1.0, 0.0, 0.0],
                           [0.0, 1.0, math.inf, 1.0, 0.0, 0.0],
                           [big, big, 0.0, big, 0.0, 0.0],
                           [0.0, -math.inf, 0.5, 0.5, 0.0, 0.0]], dtype=dtype)
    out = Sampler().tokens(logits, rows([(f"r{i}", Sampling()) for i in range(len(logits))]))
    assert [t if isinstance(t, int) else "error" for t in out] == [1, "error", "error", "error", 0, "error"]


# ------------------------------------------------------------------------------------------------ temperature


def test_temperature_frequencies_match_the_tempered_softmax() -> None:
    freq_of_argmax = {}
    for seed, temperature, other in ((11, 0.5, 2.0), (12, 2.0, 0.5)):
        tokens = draws(LOGITS, Sampling(temperature=temperature, seed=seed), N_DRAWS)
        # T = 1 and the other temperature are far enough away that the check would catch a sampler ignoring T.
        assert_distribution(tokens, tempered(temperature), wrong=[tempered(1.0), tempered(other)])
        freq_of_argmax[temperature] = tokens.count(ARGMAX) / N_DRAWS
    assert freq_of_argmax[0.5] > freq_of_argmax[2.0] + 0.2, freq_of_argmax
    assert freq_of_argmax[0.5] > 0.5 > freq_of_argmax[2.0], freq_of_argmax


# ------------------------------------------------------------------------------------------------------ top-k


def test_top_k_keeps_only_the_k_best_tokens_with_renormalised_frequencies() -> None:
    temperature = 1.5
    tokens = draws(LOGITS, Sampling(temperature=temperature, top_k=3, seed=21), N_DRAWS)
    assert set(tokens) == {3, 1, 5}
    uniform = torch.full((6,), 1 / 6, dtype=torch.float64)
    wrong = [restricted(tempered(1.0), {3, 1, 5}), restricted(uniform, {3, 1, 5}), tempered(temperature)]
    assert_distribution(tokens, restricted(tempered(temperature), {3, 1, 5}), wrong=wrong)


@pytest.mark.parametrize("top_k", [1, 6, 100])
def test_top_k_edges(top_k: int) -> None:
    tokens = draws(LOGITS, Sampling(temperature=1.0, top_k=top_k, seed=22), 1000 if top_k > 1 else 200)
    if top_k == 1:
        assert set(tokens) == {ARGMAX}
    else:  # k >= vocab: nothing is cut
        assert set(tokens) == set(range(6))
        problem = mismatch(tokens, tempered(1.0))
        assert problem is None, problem


# ------------------------------------------------------------------------------------------------------ top-p


@pytest.mark.parametrize(
    ("temperature", "top_p", "support"),
    [
        (1.0, 0.85, {3, 1, 5, 4}),  # cumulative 0.40, 0.65, 0.80 < 0.85 <= 0.90
        (2.0, 0.60, {3, 1, 5}),     # top-p applies to the tempered distribution: 0.28, 0.50 < 0.60 <= 0.67
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(temperature: float, top_p: float, support: set[int]) -> None:
    tokens = draws(LOGITS, Sampling(temperature=temperature, top_p=top_p, seed=31), N_SUPPORT)
    assert set(tokens) == support
    full = tempered(temperature)
    # Sanity of the hard-coded support: the smallest descending prefix whose mass reaches top_p.
    in_order = torch.argsort(full, descending=True).tolist()
    assert set(in_order[:len(support)]) == support
    assert full[in_order[:len(support) - 1]].sum() < top_p <= full[in_order[:len(support)]].sum()
    assert_distribution(tokens, restricted(full, support), wrong=[full])


@pytest.mark.parametrize("top_p", [1e-6, 0.25])  # the top token has 0.28 at T = 2
def test_top_p_below_the_top_token_keeps_only_the_top_token(top_p: float) -> None:
    tokens = draws(LOGITS, Sampling(temperature=2.0, top_p=top_p, seed=32), 300)
    assert set(tokens) == {ARGMAX}


# ---------------------------------------------------------------------------------------------- top-k + top-p


@pytest.mark.parametrize(
    ("top_k", "top_p", "support"),
    [
        # top-k first, then top-p on the renormalised top-4 (0.44, 0.72, ...): two tokens. Had top-p looked at the
        # untruncated distribution (0.40, 0.65, 0.80) it would have kept three.
        (4, 0.70, {3, 1}),
        (3, 0.95, {3, 1, 5}),  # top-k binds: top-p alone would keep five
    ],
)
def test_top_k_and_top_p_together(top_k: int, top_p: float, support: set[int]) -> None:
    tokens = draws(LOGITS, Sampling(temperature=1.0, top_k=top_k, top_p=top_p, seed=41), N_SUPPORT)
    assert set(tokens) == support
    assert_distribution(tokens, restricted(tempered(1.0), support), wrong=[tempered(1.0)])


# ------------------------------------------------------------------------------------------------------ seeds

FLAT = torch.zeros(16)  # 16 equally likely tokens: two independent 50-token runs agree with probability 16**-50


def test_same_seed_reproduces_and_different_seeds_differ() -> None:
    sp = Sampling(temperature=1.0, seed=1234)
    a = draw(Sampler(), FLAT, sp, 50)
    b = draw(Sampler(), FLAT, sp, 50)
    c = draw(Sampler(), FLAT, Sampling(temperature=1.0, seed=4321), 50)
    assert a == b
    assert a != c
    assert len(set(a)) > 4  # really sampling over the flat distribution


def test_generator_is_kept_until_forget_then_restarts() -> None:
    sp = Sampling(temperature=1.0, seed=7)
    s = Sampler()
    first = draw(s, FLAT, sp, 50, rid="a")
    more = draw(s, FLAT, sp, 50, rid="a")
    assert more != first  # the generator carries on; it is not reseeded every step
    s.forget("a")
    s.forget("never-seen")  # no-op
    assert draw(s, FLAT, sp, 50, rid="a") == first
    assert draw(s, FLAT, sp, 50, rid="a") == more


def test_requests_in_one_batch_have_their_own_generators() -> None:
    sp = Sampling(temperature=1.0, seed=7)
    reference = draw(Sampler(), FLAT, sp, 50)
    s = Sampler()
    out = [s.tokens(FLAT.expand(3, -1), rows([("a", sp), ("greedy", Sampling()), ("b", sp)])) for _ in range(50)]
    assert [r[0] for r in out] == reference
    assert [r[2] for r in out] == reference
    assert {r[1] for r in out} == {0}


def test_unseeded_requests_get_different_sequences() -> None:
    sp = Sampling(temperature=1.0)
    assert draw(Sampler(), FLAT, sp, 50) != draw(Sampler(), FLAT, sp, 50)


# ------------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": -math.inf}, "temperature"),
        ({"top_p": -0.01}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
    ],
)
def test_sampling_rejects_bad_values_naming_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Sampling(**kwargs)


def test_sampling_accepts_the_boundaries() -> None:
    for kwargs in ({"temperature": 0.0}, {"top_p": 0.0}, {"top_p": 1.0}, {"top_k": 0}, {"max_tokens": 1}):
        Sampling(**kwargs)


# ------------------------------------------------------------------------------------------------- known bugs


def test_nan_temperature_is_rejected() -> None:
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=math.nan)


def test_tiny_temperature_acts_as_greedy_or_is_rejected() -> None:
    try:
        sp = Sampling(temperature=1e-40)
    except ValueError:
        return
    assert Sampler().tokens(LOGITS.reshape(1, -1), rows([("tiny", sp)])) == [ARGMAX]


def test_unseeded_request_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    Sampler().tokens(LOGITS.reshape(1, -1), rows([("unseeded", Sampling(temperature=1.0))]))
    assert torch.equal(torch.rand(4), expected)


# --------------------------------------------------------------------------------- min-p, penalties, logprobs


def test_min_p_keeps_the_tokens_at_least_min_p_times_the_likeliest() -> None:
    # p_max = 0.40: min_p 0.3 keeps p >= 0.12, i.e. {3, 1, 5}; min_p 0.5 keeps p >= 0.20, i.e. {3, 1}.
    for min_p, support in ((0.3, {3, 1, 5}), (0.5, {3, 1})):
        tokens = draws(LOGITS, Sampling(temperature=1.0, min_p=min_p, seed=51), N_SUPPORT)
        assert set(tokens) == support
        assert_distribution(tokens, restricted(tempered(1.0), support), wrong=[tempered(1.0)])


def penalised_reference(logits: torch.Tensor, prompt: list[int], output: list[int], rep: float, freq: float,
                        pres: float) -> torch.Tensor:
    """The penalties written out token by token in float64: transformers' repetition penalty over prompt +
    output, OpenAI's frequency and presence penalties over the output."""
    x = logits.double().clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(output):
        x[t] -= freq * output.count(t) + pres
    return x


@pytest.mark.parametrize(("rep", "freq", "pres"), [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, 1.1),
                                                   (0.8, -0.4, 0.5)])
def test_penalties_match_the_written_out_formulas_and_logprobs_stay_the_models(rep: float, freq: float,
                                                                                pres: float) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 12, generator=g) * 2                                  # [2, V]
    histories = [([1, 4], [4, 7, 7, 2, 7]), ([9], [])]
    sp = Sampling(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres, logprobs=True,
                  top_logprobs=12)
    batch = [Row(f"p{i}", sp, p, o) for i, (p, o) in enumerate(histories)]
    out = Sampler().sample(logits, batch)
    for i, (prompt, output) in enumerate(histories):
        ref = penalised_reference(logits[i], prompt, output, rep, freq, pres)
        ref_lp = torch.log_softmax(logits[i].double(), dim=-1)                    # the model's own, unpenalised
        assert out[i].token == int(ref.argmax())                                  # greedy on the penalised logits
        assert out[i].logprob == pytest.approx(float(ref_lp[out[i].token]), abs=1e-5)
        got = dict(out[i].top)
        assert [t for t, _ in out[i].top] == ref_lp.argsort(descending=True).tolist()
        assert all(got[t] == pytest.approx(float(ref_lp[t]), abs=1e-5) for t in range(12))
    # the penalties change the answer for the row with a history (else this test could not fail)
    assert not torch.allclose(penalised_reference(logits[0], *histories[0], rep, freq, pres).float(), logits[0])


@pytest.mark.parametrize("temperature", [2.0, 1.0, 2e-5, 1e-5, 0.0])
def test_logprobs_are_the_models_own_whatever_the_temperature_and_top_is_cut_to_n(temperature: float) -> None:
    """vLLM's default (raw_logprobs): they had been taken over the temperature, so a runner-up read -36754 at 2e-5
    and the model's own value at 1e-5, where greedy begins."""
    sp = Sampling(temperature=temperature, seed=8, logprobs=True, top_logprobs=2, min_tokens=3, stop_token_ids=(3,))
    out = Sampler().sample(LOGITS.reshape(1, -1), [Row("t", sp)])[0]
    ref = torch.log_softmax(LOGITS.double(), dim=-1)
    assert out.logprob == pytest.approx(float(ref[out.token]), abs=1e-6)
    assert out.token != 3                                     # masked for min_tokens, yet in the top: the model's
    assert [t for t, _ in out.top] == [3, 1] and dict(out.top)[3] == pytest.approx(float(ref[3]), abs=1e-6)
    assert Sampler().sample(LOGITS.reshape(1, -1), [Row("n", Sampling())])[0].logprob is None   # not asked


def test_min_tokens_masks_eos_and_stop_tokens_until_enough_are_out() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]])               # 2 (EOS here) > 3 (stop token) > 4
    s = Sampler(eos_token_ids=frozenset({2}))
    sp = Sampling(min_tokens=2, stop_token_ids=(3,))
    assert s.tokens(logits, [Row("m", sp, [0], [])]) == [4]
    assert s.tokens(logits, [Row("m", sp, [0], [4])]) == [4]
    assert s.tokens(logits, [Row("m", sp, [0], [4, 4])]) == [2]       # two out: EOS may come
    ignore = Sampling(min_tokens=2, stop_token_ids=(3,), ignore_eos=True)
    assert s.tokens(logits, [Row("i", ignore, [0], [])]) == [2]     # ignore_eos: EOS is just a token


def test_a_non_finite_row_fails_alone_beside_penalised_and_sampled_rows() -> None:
    logits = torch.stack([LOGITS, torch.full((6,), math.nan), LOGITS])
    out = Sampler().sample(logits, [Row("a", Sampling(repetition_penalty=1.2), [3], []), Row("b", Sampling()),
                                    Row("c", Sampling(temperature=1.0, min_p=0.5, seed=1))])
    assert isinstance(out[1], SampleError)
    assert out[0].token in range(6) and out[2].token in {3, 1}


def test_a_seeded_row_draws_the_same_tokens_whatever_its_batch_neighbours_ask_for() -> None:
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(4))
    sp = Sampling(temperature=1.0, seed=123)
    alone = draw(Sampler(), logits[0], sp, 30)
    s = Sampler()
    beside = [s.tokens(logits.expand(2, -1), [Row("x", sp), Row("k", Sampling(temperature=1.0, top_k=5, seed=9))])[0]
              for _ in range(30)]
    assert beside == alone                     # a neighbour's top-k sends the batch down the sorted path
    assert len(set(alone)) > 5
