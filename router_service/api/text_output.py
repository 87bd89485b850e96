"""One choice's text on its way to the client: incremental detokenizing, stop strings, token texts for
log-probabilities. Plain Python, no torch; runs on the request's gRPC thread, not the engine's.

Stop strings are matched on the detokenized text, as vLLM does: the text returned ends before the first
match (the stop string is never sent), and text that could be the start of a stop string is held back until
the next token shows it is not. They end nothing before `min_tokens` tokens are out.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_common.tokenizer import Detokenizer, Tokenizer


class StopStrings:
    """Finds the first of `stops` in a growing text; holds back a tail that may begin one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._held = ""            # text not sent yet: it may be the start of a stop string

    def push(self, text: str, may_stop: bool = True) -> tuple[str, str | None]:
        """(text to send now, the stop string found or None). After a match, nothing more is to be sent."""
        buf = self._held + text
        if not self.stops:
            return buf, None
        if may_stop:
            hits = [(pos, s) for s in self.stops if (pos := buf.find(s)) >= 0]
            if hits:
                pos, stop = min(hits)
                self._held = ""
                return buf[:pos], stop
        keep = self._partial(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], None

    def flush(self) -> str:
        """The held tail, at the end of the generation (it began no stop string after all)."""
        held, self._held = self._held, ""
        return held

    def _partial(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of a stop string."""
        for k in range(min(len(buf), max(len(s) for s in self.stops) - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


@dataclass
class TextPiece:
    text: str
    stop: str | None = None          # the stop string that ended the choice here


class ChoiceText:
    """Token ids in, text out, for one of a request's choices."""

    def __init__(self, tokenizer: Tokenizer | None, stops: tuple[str, ...], min_tokens: int,
                 prompt: list[int] | tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.detok = Detokenizer(tokenizer, prompt)       # primed with the prompt: the text the ids add to it
        self.stops = StopStrings(stops if tokenizer is not None else ())
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.done = False

    def push(self, token_ids: list[int], stop_token: bool = False) -> TextPiece:
        """`stop_token`: the last id is the stop token or EOS that ends the choice; its text is left out, as
        vLLM leaves it (a special token has none anyway)."""
        self.num_tokens += len(token_ids)
        text = self.detok.push(token_ids[:-1] if stop_token else token_ids)
        text, stop = self.stops.push(text, may_stop=self.num_tokens > self.min_tokens)
        if stop is not None:
            self.done = True
        return TextPiece(text, stop)

    def finish(self) -> TextPiece:
        """The text still held at the end (an unfinished character; a tail that began no stop string)."""
        text, stop = self.stops.push(self.detok.finish(), may_stop=self.num_tokens > self.min_tokens)
        self.done = True
        return TextPiece(text if stop is not None else text + self.stops.flush(), stop)

    def token_text(self, token_id: int) -> str:
        """One token's own text for log-probabilities (special tokens included; part of a character is U+FFFD):
        its own bytes as text, so a SentencePiece "▁Hello" is " Hello" as in the output, and the tokens' texts
        join to it (a decode of the id alone strips that space); "" without a tokenizer."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.token_bytes(token_id).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes for log-probabilities (a part of a character too); b"" without a tokenizer."""
        return self.tokenizer.token_bytes(token_id) if self.tokenizer is not None else b""
