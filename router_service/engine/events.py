"""What the engine sends back to a request's handler: tokens, then one `Finished` per choice or a `Failed`.
No torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from router_service.engine.sequence import FinishReason, Sampled


class FailureCode(enum.Enum):
    """Named as gRPC status codes, so the server maps them by name; clients retry only UNAVAILABLE."""

    UNAVAILABLE = "unavailable"     # a worker failed or the router is shutting down: retrying may succeed
    INTERNAL = "internal"           # a bug in the engine step: retrying the same request will not help


@dataclass(frozen=True)
class Tokens:
    token_ids: list[int]
    logits: list[bytes]             # float32 [V] per token, when the request asked for them
    index: int = 0                  # which of the request's n choices
    logprobs: tuple[Sampled, ...] = ()   # per token, when the request asked for them


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float
    index: int = 0


@dataclass(frozen=True)
class Failed:
    code: FailureCode
    message: str
    index: int = 0                  # the choice that failed (the handler ends the whole request)


Event = Tokens | Finished | Failed
