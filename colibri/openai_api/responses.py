"""The router's streamed messages -> OpenAI response bodies and server-sent-event chunks.

One `Reply` per HTTP request: it knows the endpoint (completions or chat), the id, the model name, and folds
in the gRPC messages of each of the request's prompts (choice index = prompt index * n + the router's index).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from colibri_common.pb import generation_pb2 as pb

NEG_INF_LOGPROB = -9999.0          # what OpenAI sends for a log-probability of -inf (JSON has no infinity)


def _lp(value: float) -> float:
    return value if math.isfinite(value) else NEG_INF_LOGPROB


@dataclass
class ChoiceState:
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None        # the stop string, or the stop token id (an int, as vLLM's)
    completion_tokens: int = 0
    tokens: list[pb.TokenLogprob] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    token_chars: int = 0                       # the tokens' texts so far: where the next one's offset is
    started: bool = False                      # chat streams send the assistant role once per choice


class Reply:
    def __init__(self, chat: bool, model: str, n: int, has_tokenizer: bool, logprobs: bool,
                 stop_strings: tuple[str, ...] = (), request_id: str | None = None) -> None:
        self.chat, self.model, self.n = chat, model, n
        self.stop_strings = stop_strings
        self.has_tokenizer, self.logprobs = has_tokenizer, logprobs
        # the client's request id where it gave one (X-Request-Id, or vLLM's `request_id` field) in the response's
        # id, as vLLM's; the router's calls add a part of their own, so two requests sent with one id both run
        self.id = ("chatcmpl-" if chat else "cmpl-") + (request_id or uuid.uuid4().hex)
        self.call_id = self.id if request_id is None else f"{self.id}-{uuid.uuid4().hex[:12]}"
        self.echoed_id = request_id or self.id        # the response's X-Request-Id header
        self.created = int(time.time())
        self.t0 = time.monotonic()
        self.counted = True                # set False while the front counts it in flight
        self.choices: dict[int, ChoiceState] = {}
        self.prompt_tokens: dict[int, int] = {}

    # -- folding gRPC messages in ---------------------------------------------------------------------
    def index(self, prompt: int, msg_index: int) -> int:
        return prompt * self.n + msg_index

    def add(self, prompt: int, msg: pb.GenerateResponse) -> tuple[int, str, list[pb.TokenLogprob], str | None]:
        """Fold one message in: (choice index, new text, new log-probabilities, finish reason or None)."""
        kind = msg.WhichOneof("response")
        part = msg.chunk if kind == "chunk" else msg.complete
        i = self.index(prompt, part.index)
        c = self.choices.setdefault(i, ChoiceState())
        if kind == "chunk":
            for lp in part.logprobs:                # as vLLM: the running sum of the tokens' own texts (the
                c.text_offsets.append(c.token_chars)  # text may hold a piece back, a stop string's start)
                c.token_chars += len(lp.token)
            c.text += part.text
            c.tokens.extend(part.logprobs)
            return i, part.text, list(part.logprobs), None
        c.finish_reason, c.completion_tokens = part.finish_reason, part.completion_tokens
        c.stop_reason = part.stop_reason or None
        if c.stop_reason is not None and c.stop_reason not in self.stop_strings and c.stop_reason.isdigit():
            c.stop_reason = int(c.stop_reason)        # the wire's text of a stop token id
        self.prompt_tokens[prompt] = part.prompt_tokens
        return i, "", [], part.finish_reason

    def usage(self) -> dict[str, int]:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(c.completion_tokens for c in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # -- log-probabilities ----------------------------------------------------------------------------
    def _token(self, token: str, token_id: int) -> str:
        return token if self.has_tokenizer else f"token_id:{token_id}"

    def _chat_logprobs(self, tokens: list[pb.TokenLogprob]) -> dict[str, Any]:
        def entry(x: pb.TokenLogprob | pb.TopLogprob) -> dict[str, Any]:
            text = self._token(x.token, x.token_id)
            raw = x.token_bytes or text.encode("utf-8")        # the token's own: a part of a character too
            return {"token": text, "logprob": _lp(x.logprob), "bytes": list(raw)}

        return {"content": [{**entry(t), "top_logprobs": [entry(x) for x in t.top]} for t in tokens]}

    def _completion_logprobs(self, tokens: list[pb.TokenLogprob], offsets: list[int]) -> dict[str, Any]:
        return {"tokens": [self._token(t.token, t.token_id) for t in tokens],
                "token_logprobs": [_lp(t.logprob) for t in tokens],
                "top_logprobs": [self._top_dict(t.top, t) for t in tokens],
                "text_offset": offsets}

    def _top_dict(self, top: list[pb.TopLogprob], sampled: pb.TokenLogprob) -> dict[str, float]:
        """{token text: logprob}: the N likeliest and the sampled token (OpenAI's legacy shape: up to N + 1, as
        vLLM's; `logprobs: 0` is the sampled one alone); tokens that print alike (partial UTF-8 bytes) keep the
        likeliest's value."""
        out: dict[str, float] = {}
        for x in top:
            out.setdefault(self._token(x.token, x.token_id), _lp(x.logprob))
        out.setdefault(self._token(sampled.token, sampled.token_id), _lp(sampled.logprob))
        return out

    def _logprobs_of(self, tokens: list[pb.TokenLogprob], offsets: list[int]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return self._chat_logprobs(tokens) if self.chat else self._completion_logprobs(tokens, offsets)

    # -- whole answers --------------------------------------------------------------------------------
    def body(self) -> dict[str, Any]:
        choices = []
        for i in sorted(self.choices):
            c = self.choices[i]
            choice: dict[str, Any] = {"index": i}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            choice["logprobs"] = self._logprobs_of(c.tokens, c.text_offsets)
            choice["finish_reason"] = c.finish_reason
            choice["stop_reason"] = c.stop_reason
            choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}

    # -- stream chunks --------------------------------------------------------------------------------
    def chunk(self, i: int, text: str, tokens: list[pb.TokenLogprob], finish: str | None,
              include_usage: bool) -> dict[str, Any] | None:
        """The SSE chunk for one folded message; None when it carries nothing to send."""
        c = self.choices[i]
        first_role = self.chat and not c.started
        if not (text or tokens or finish or first_role):
            return None
        choice: dict[str, Any] = {"index": i}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first_role else {}
            c.started = True
            if text or first_role:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        offsets = c.text_offsets[len(c.text_offsets) - len(tokens):] if tokens else []
        choice["logprobs"] = self._logprobs_of(tokens, offsets) if tokens else None
        choice["finish_reason"] = finish
        if finish is not None:
            choice["stop_reason"] = c.stop_reason
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": self.usage()}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
