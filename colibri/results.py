"""What the clients give back (client.py): `GenerationError` for a failed call, a whole request's `Result` with
its `Choice`s, and the `Delta`s `stream_text` yields."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import numpy as np

from colibri_common.pb import generation_pb2 as pb

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


class GenerationError(grpc.RpcError):
    """A failed call: `code()` is the gRPC status, `details()` the router's message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self._code, self._message = code, message

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message

    @property
    def retryable(self) -> bool:
        return self._code in RETRYABLE

    @staticmethod
    def of(exc: grpc.RpcError) -> GenerationError:
        if isinstance(exc, GenerationError):
            return exc
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        return GenerationError(code or grpc.StatusCode.UNKNOWN, exc.details() if hasattr(exc, "details") else "")


@dataclass
class Choice:
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    stop_reason: str = ""                 # the stop string or stop token id that ended it
    completion_tokens: int = 0
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)


@dataclass
class Result:
    """A whole request: its choices, and choice 0's fields at the top for the usual n = 1."""

    request_id: str = ""
    choices: list[Choice] = field(default_factory=list)
    prompt_tokens: int = 0
    ttft_ms: float = 0.0

    def _first(self) -> Choice:
        return self.choices[0] if self.choices else Choice()

    @property
    def token_ids(self) -> list[int]:
        return self._first().token_ids

    @property
    def text(self) -> str:
        return self._first().text

    @property
    def finish_reason(self) -> str:
        return self._first().finish_reason

    @property
    def logits(self) -> list[np.ndarray]:
        return self._first().logits

    @property
    def logprobs(self) -> list[pb.TokenLogprob]:
        return self._first().logprobs

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    def add(self, msg: pb.GenerateResponse) -> None:
        """Fold one streamed message in."""
        self.request_id = msg.request_id
        kind = msg.WhichOneof("response")
        if kind is None:
            return
        part = getattr(msg, kind)
        while len(self.choices) <= part.index:
            self.choices.append(Choice(index=len(self.choices)))
        choice = self.choices[part.index]
        if kind == "chunk":
            choice.token_ids.extend(part.token_ids)
            choice.text += part.text
            choice.logprobs.extend(part.logprobs)
            choice.logits.extend(np.frombuffer(b, dtype="<f4") for b in part.logits)
        else:
            choice.finish_reason, choice.stop_reason = part.finish_reason, part.stop_reason
            choice.completion_tokens = part.completion_tokens
            self.prompt_tokens = part.prompt_tokens
            if part.index == 0:
                self.ttft_ms = part.ttft_ms


@dataclass(frozen=True)
class Delta:
    """One streamed piece of one choice; `finish_reason` is set on its last."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str = ""
