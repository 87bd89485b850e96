"""One request's state inside the router: plain Python, no torch."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from colibri_common.flags import escaped_list, option, seed_number

_NUMBER = (int, float)
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38     # the largest finite float32: a request's floats are float32
_TYPES: dict[str, tuple[type, ...]] = {     # what each field takes (a bool is no number here: logprobs=3 is no bool)
    "temperature": _NUMBER, "top_p": _NUMBER, "top_k": (int,), "min_p": _NUMBER, "max_tokens": (int,),
    "min_tokens": (int,), "presence_penalty": _NUMBER, "frequency_penalty": _NUMBER, "repetition_penalty": _NUMBER,
    "seed": (int, type(None)), "stop_token_ids": (tuple, list), "stop": (tuple, list), "ignore_eos": (bool,),
    "logprobs": (bool,), "top_logprobs": (int,), "return_logits": (bool,)}


@dataclass(frozen=True)
class Sampling:
    """One request's sampling parameters, as vLLM names them; temperatures below GREEDY_BELOW sample greedily
    (a smaller temperature would overflow logits / T).

    Order on the logits (`Sampler`): repetition, frequency and presence penalties; `min_tokens` masks the stop
    tokens; then greedy takes the argmax, or temperature, top-k, top-p and min-p shape the distribution that
    is sampled. Log-probabilities are the model's own (the log-softmax of its logits before any of these), as
    vLLM's default (raw_logprobs).
    """

    GREEDY_BELOW = 1e-5
    MAX_TOP_LOGPROBS = 20

    temperature: float = option(0.0, "0 = greedy")
    top_p: float = option(1.0, "nucleus sampling: the smallest set of tokens with this much probability; 1 = off")
    top_k: int = option(0, "sample among the k likeliest tokens; 0 = off")
    min_p: float = option(0.0, "drop tokens less likely than min_p times the likeliest one; 0 = off")
    max_tokens: int = option(16, "new tokens at most")
    min_tokens: int = option(0, "new tokens before EOS, a stop token or a stop string may end the generation")
    presence_penalty: float = option(0.0, "subtracted from the logit of every token already generated (-2..2)")
    frequency_penalty: float = option(0.0, "subtracted per occurrence of a token already generated (-2..2)")
    repetition_penalty: float = option(1.0, "divides positive / multiplies negative logits of the tokens in the "
                                            "prompt or the output (> 0; 1 = off)")
    seed: int | None = option(None, "seed of this request's sampling, in [0, 2**64) (default: random)",
                              type=seed_number)
    stop_token_ids: tuple[int, ...] = option((), "comma-separated token ids that end the generation")
    stop: tuple[str, ...] = option((), "comma-separated strings that end the generation (not included in the "
                                       "text), kept as typed, spaces included; \\n \\t \\r, \\, for a comma, "
                                       "\\\\ for a backslash", type=escaped_list)
    ignore_eos: bool = option(False, "keep generating past the model's EOS token")
    logprobs: bool = option(False, "return the log-probability of every sampled token")
    top_logprobs: int = option(0, f"with each sampled token, the N likeliest tokens and their log-probabilities "
                                  f"(0-{MAX_TOP_LOGPROBS})")
    return_logits: bool = option(False, "return the float32 logits of every sampled position")

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):               # one stop string, not its characters
            object.__setattr__(self, "stop", (self.stop,))
        for name, kinds in _TYPES.items():
            value = getattr(self, name)
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                raise TypeError(f"{name} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
        if not all(isinstance(s, str) for s in self.stop) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise TypeError("stop takes strings and stop_token_ids integers")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        for name in ("max_tokens", "min_tokens", "top_k"):     # what a request carries (int32): a value past
            if getattr(self, name) > INT32_MAX:                 # it failed the step of every request beside it
                raise ValueError(f"{name} must be at most {INT32_MAX}, got {getattr(self, name)}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2^64), got {self.seed}")
        if any(not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {INT32_MAX}], got "
                             f"{[t for t in self.stop_token_ids if not 0 <= t <= INT32_MAX][:4]}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}")
        if not 0 <= self.temperature <= FLOAT32_MAX:         # a float32 on the wire: 1e308 arrived as inf
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:                     # 0 is taken as off too (the wire's unset)
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= FLOAT32_MAX:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got "
                             f"{self.repetition_penalty}")
        if not 0 <= self.top_logprobs <= self.MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {self.MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < self.GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0


@dataclass(frozen=True)
class Sampled:
    """One sampled token, with its log-probabilities when the request asked for them."""

    token: int
    logprob: float | None = None                    # log-probability of `token`
    top: tuple[tuple[int, float], ...] = ()          # the N likeliest (token, log-probability), likeliest first


class FinishReason(enum.StrEnum):
    STOP = "stop"          # a stop token id or EOS was sampled
    LENGTH = "length"      # max_tokens, or the model's maximum length
    ABORT = "abort"        # the client went away or called Abort
    ERROR = "error"        # the step failed (a worker or the engine)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_UIDS = itertools.count(1)


@dataclass(eq=False)
class Sequence:
    """`uid` is the engine's own id: every callback and abort inside the router uses it, so a client that
    reuses another request's `request_id` can never touch that request."""

    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0          # tokens whose K/V are in the cache
    status: Status = Status.WAITING
    arrival: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None   # its first step (the end of its wait in the queue)
    first_token_at: float | None = None
    last_token_at: float = 0.0
    uid: int = field(default_factory=lambda: next(_UIDS))
    experts: frozenset[int] = frozenset()   # recent routing, layer·E + e (routing-aware batching)
    passed_over: int = 0                     # admission rounds in which a younger request went first
    index: int = 0                           # which of the request's n choices this is
    paused: bool = False                     # its reader is behind (Outputs full): no steps until it reads

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def append_token(self, token: int, eos_token_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
        """Record a sampled token; returns why the sequence is finished now, or None while it goes on.

        Stop tokens and EOS (unless ignore_eos) end it with STOP once more than `min_tokens` tokens are out (the
        sampler masks them before); reaching max_tokens or the model's
        maximum length (prompt + output) ends it with LENGTH. A stop token wins over the length limit.
        """
        self.output_ids.append(token)
        sp = self.sampling
        stops = token in sp.stop_token_ids or (not sp.ignore_eos and token in eos_token_ids)
        if stops and len(self.output_ids) > sp.min_tokens:
            return FinishReason.STOP
        if len(self.output_ids) >= sp.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None
