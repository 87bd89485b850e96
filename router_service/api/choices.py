"""A request's choices as their clients see them: the engine's events through detokenisation and stop strings,
into `Piece`s (token ids, text, logits, log-probabilities) and one `Done` per choice. The gRPC service streams
them (server.py) and the offline API collects them (colibri/llm.py): one loop for both.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from colibri_common.tokenizer import Tokenizer
from router_service.api.text_output import ChoiceText
from router_service.engine.engine import Engine
from router_service.engine.events import Failed, Outputs, Tokens
from router_service.engine.sequence import FinishReason, Sampled, Sequence


@dataclass(frozen=True)
class Piece:
    index: int                              # which of the request's choices
    token_ids: list[int]
    text: str                               # the text these tokens completed (held back: a stop string's start)
    logits: list[bytes] = ()                # float32 [V] per token, when asked for
    logprobs: tuple[Sampled, ...] = ()      # per token, when asked for


@dataclass(frozen=True)
class Done:
    index: int
    reason: FinishReason
    stop_reason: str                        # the stop string, or the stop token id as text, or ""
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float


class ChoiceFailed(Exception):
    """A choice failed in the engine; the request ends (its other choices are the caller's to cancel)."""

    def __init__(self, failed: Failed) -> None:
        super().__init__(failed.message)
        self.failed = failed


class Choices:
    """Iterate for the pieces of `group` (one request's choices, submitted together) as `events` brings them."""

    def __init__(self, engine: Engine, group: list[Sequence], events: Outputs,
                 tokenizer: Tokenizer | None) -> None:
        self.engine, self.group, self.events = engine, group, events
        self.texts = [ChoiceText(tokenizer, seq.sampling.stop, seq.sampling.min_tokens, seq.prompt_ids)
                      for seq in group]

    def token_text(self, index: int, token_id: int) -> str:
        """One token's own text (for log-probabilities); "" without a tokenizer."""
        return self.texts[index].token_text(token_id)

    def token_bytes(self, index: int, token_id: int) -> bytes:
        """One token's own bytes (for log-probabilities); b"" without a tokenizer."""
        return self.texts[index].token_bytes(token_id)

    def __iter__(self) -> Iterator[Piece | Done]:
        last = [-1] * len(self.group)
        left = len(self.group)
        while left:
            ev = self.events.get()
            i = ev.index
            seq, text = self.group[i], self.texts[i]
            if text.done:                      # this choice already ended at a stop string; the engine lags
                continue
            if isinstance(ev, Failed):
                raise ChoiceFailed(ev)
            if isinstance(ev, Tokens):
                piece = text.push(ev.token_ids, ev.stop_token)
                last[i] = ev.token_ids[-1]
                if piece.stop is not None:     # end it in the engine first: a slow reader costs no steps
                    self.engine.cancel(seq, FinishReason.STOP)
                yield Piece(i, ev.token_ids, piece.text, ev.logits, ev.logprobs)
                if piece.stop is None:
                    continue
                ttft = (seq.first_token_at - seq.arrival) * 1e3 if seq.first_token_at else 0.0
                left -= 1
                yield Done(i, FinishReason.STOP, piece.stop, len(seq.prompt_ids), text.num_tokens, ttft)
                continue
            piece = text.finish()              # Finished: text held back (a character, a stop string's start)
            if piece.text:
                yield Piece(i, [], piece.text)
            reason, stop_reason = ev.reason, piece.stop or ""
            if piece.stop is not None:
                reason = FinishReason.STOP
            elif reason is FinishReason.STOP and last[i] in seq.sampling.stop_token_ids:
                stop_reason = str(last[i])
            left -= 1
            yield Done(i, reason, stop_reason, len(seq.prompt_ids), ev.completion_tokens, ev.ttft_ms)
