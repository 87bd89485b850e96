"""The offline API's values, as vLLM's: `SamplingParams` in, a `RequestOutput` per prompt with a
`CompletionOutput` per completion out; a prompt is a text or a list of token ids."""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field

import torch

from router_service.engine.sequence import Sampling

Prompt = str | list[int]


@dataclass(frozen=True)
class SamplingParams(Sampling):
    """vLLM's name and fields (temperature, top_p, top_k, min_p, max_tokens, stop, seed, logprobs ...), plus `n`:
    that many completions of each prompt (completion i seeded seed + i)."""

    n: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")

    def choices(self) -> list[Sampling]:
        """One engine sampling per completion, as the router's server makes them."""
        base = Sampling(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Sampling)})
        return [base if self.seed is None or i == 0 else dataclasses.replace(base, seed=(self.seed + i) % 2**64)
                for i in range(self.n)]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""                 # "stop" (EOS, a stop token or string) or "length"
    stop_reason: str = ""                   # the stop string, or the stop token id, that ended it
    logits: list[torch.Tensor] = field(default_factory=list)   # float32 [V] per token, with return_logits
    logprobs: list[float] = field(default_factory=list)        # the sampled token's, per token, with logprobs
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)   # with top_logprobs=N


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]         # one per completion (SamplingParams.n)


def token_ids(prompt: object) -> list[int]:
    try:
        items = list(prompt)                                     # type: ignore[call-overload]  (iterated once)
        ids = [operator.index(t) for t in items]
    except TypeError:
        raise TypeError(f"a prompt is a str or a list of int token ids, got {prompt!r:.80}") from None
    if any(isinstance(t, bool) for t in items):                  # True was token id 1
        raise TypeError(f"a prompt's token ids are ints, not bools: got {items!r:.80}")
    return ids


def check_stop_ids(sp: SamplingParams, vocab: int) -> None:
    bad = [t for t in sp.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"stop_token_ids {bad[:8]} are outside the vocabulary [0, {vocab})")
