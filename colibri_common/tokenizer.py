"""The checkpoint's `tokenizer.json` (Hugging Face `tokenizers`) and incremental detokenization.

`Tokenizer.from_dir` is the project's one tokenizer loader (router, `colibri validate`, demo).
`Detokenizer` turns a stream of generated ids into text with bounded work per token.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import tokenizers
from tokenizers.decoders import DecodeStream

from colibri_common.errors import CheckpointError
from colibri_common.token_bytes import TokenBytes

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    """A loaded `tokenizer.json`: encode without special tokens, decode skipping them."""

    def __init__(self, hf: tokenizers.Tokenizer, path: Path | None = None) -> None:
        self._hf = hf
        self.path = path
        self._special_ids = frozenset(i for i, t in hf.get_added_tokens_decoder().items() if t.special)
        self._bytes: TokenBytes | None = None

    @staticmethod
    def from_dir(model_dir: str | Path) -> Tokenizer | None:
        """`<model_dir>/tokenizer.json`, or None when the checkpoint has none.

        Raises CheckpointError naming the file when it exists but cannot be loaded.
        """
        path = Path(model_dir) / TOKENIZER_FILE
        if not path.is_file():
            if path.exists() or path.is_symlink():       # a directory, or a link to nothing: not "no tokenizer"
                raise CheckpointError(f"{path}: not a regular file (a directory, or a link to nothing); replace it "
                                      f"with the model's {TOKENIZER_FILE}, or delete it to serve token ids only")
            return None
        if not os.access(path, os.R_OK):                  # (tokenizers says only "Permission denied")
            raise PermissionError(errno.EACCES, "permission denied", str(path))
        try:
            hf = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for bad JSON or an unknown schema
            raise CheckpointError(f"{path}: cannot load the tokenizer ({exc}); replace the file with the model's "
                                  f"original {TOKENIZER_FILE}, or delete it to serve token ids only") from exc
        return Tokenizer(hf, path)

    @property
    def hf(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (dropped by `decode`)."""
        return self._special_ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The text's ids; `add_special_tokens`: with what the tokenizer's post-processor adds (a BOS for Llama,
        Mistral and DeepSeek tokenizers), as `transformers`' `tokenizer(text)` and vLLM's prompts have it."""
        return self._hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._hf.decode(ids, skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (a part of a UTF-8 character where it carries one), for log-probabilities."""
        if self._bytes is None:
            self._bytes = TokenBytes(self._hf)
        return self._bytes.of(token_id)


class Detokenizer:
    """Incremental detokenizer over `tokenizers.decoders.DecodeStream(skip_special_tokens=True)`.

    `push(ids)` returns the text the new ids add. A character split across tokens is held back ("" is
    returned) until its last byte arrives, so no '\\ufffd' is ever emitted for it. Each token costs one
    decode of a window of at most 2 * MAX_PENDING ids (the ids behind the last chunk plus those held
    since), never a re-decode of the whole output; `Tokenizer.decode` is not called for valid text.

    A prompt that ends in the first bytes of a character (a generation cut inside one by max_tokens, sent
    back as the prompt) has them held as if pushed, so the output's first bytes complete that character, as
    vLLM's primed stream does (nothing is said of them if none does).

    For valid text, the concatenation of all pushes equals what the ids add to the prompt's text,
    `decode(prompt + ids)[len(decode(prompt)):]`, as vLLM's and transformers' pipelines return it: the
    stream is primed with the prompt's last ids (the shortest suffix of at least PRIME ids whose text is
    whole, at most PRIME_MAX), so a SentencePiece "▁" on the first generated token is the space it is
    after the prompt, not stripped as `decode(output_ids)` alone would. Without a prompt (or without a
    whole suffix) it equals `decode(ids)`. Where DecodeStream alone differs, and what is done about it:

    * `step` returns None whenever its decoded window ends in '\\ufffd': an incomplete character, but
      also genuinely invalid bytes or a literal U+FFFD. A model repeating an invalid byte would stream
      nothing and re-decode a growing buffer each step. So once MAX_PENDING ids are held, all but the
      last KEEP (room for an unfinished 4-byte character) are forced out through `Tokenizer.decode`,
      '\\ufffd' included, and the stream restarts with the last emitted ids as context. Work stays
      bounded; the split-character guarantee then assumes each held token carries at least one byte.
    * `DecodeStream(ids=...)` does not count a context whose decode ends in '\\ufffd' as emitted (its next
      chunk repeats that text), so the forced-out ids are never used as context.
    * `step` returns None for a token adding no text (a skipped special token, a lone leading "▁");
      special tokens are dropped here before stepping, as the full decode with skip_special_tokens does.
    * Text held back when generation stops (an invalid or unfinished tail) is returned by `finish()`,
      not by `push`: pushes + finish() == decode(all_ids) holds for invalid UTF-8 too.
    * `step` raises if decode(context + new) does not start with decode(context) (a decoder that rewrites
      earlier text); the held ids are then forced out and the stream restarted.
    """

    MAX_PENDING = 8  # ids held back before the held text is forced out
    KEEP = 3  # ids kept back when forcing: the first 3 bytes of a 4-byte character
    PRIME, PRIME_MAX = 4, 24  # the prompt's last ids the stream starts after (vLLM's bounds)

    def __init__(self, tokenizer: Tokenizer | None, prompt: list[int] | tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        prompt = list(prompt)
        tail, whole = self._unfinished(prompt)   # the first bytes of a character the output may finish
        self._context: list[int] = self._prime(prompt[:len(prompt) - len(tail)])  # ids behind the last emitted
        self._stream = DecodeStream(ids=self._context, skip_special_tokens=True) if self._context else \
            DecodeStream(skip_special_tokens=True)
        self._pending: list[int] = []  # ids pushed since the last emitted text
        self._from_prompt: list[int] = []
        self._prompt_text = ""             # the held prompt ids' own text (theirs U+FFFD), if no output completes it
        self._prompt_whole = whole         # ... and of their whole characters, the prompt's, said either way
        if tail and tokenizer is not None and all(self._stream.step(tokenizer.hf, i) is None for i in tail):
            self._pending, self._from_prompt = list(tail), list(tail)   # held as a character's first bytes
            self._prompt_text = tokenizer.decode(self._context + tail)[len(tokenizer.decode(self._context)):]
        elif tail:                         # (not held after all: as without a prompt)
            self._context, self._stream = [], DecodeStream(skip_special_tokens=True)

    def _unfinished(self, prompt: list[int]) -> tuple[list[int], str]:
        """(the prompt's last ids that hold the first bytes of an unfinished UTF-8 character, the text of the
        whole characters those ids hold before it): a generation cut by max_tokens inside a character and sent
        back as the prompt, whose output's first bytes complete it, as vLLM's primed stream has it; ([], "")
        otherwise."""
        tok = self.tokenizer
        if tok is None or not prompt:
            return [], ""
        raws = [tok.token_bytes(i) for i in prompt[-3:]]
        cut = _incomplete_tail(b"".join(raws))
        k = next((k for k in range(1, len(raws) + 1) if cut and sum(map(len, raws[-k:])) >= cut), 0)
        return (prompt[-k:], b"".join(raws[-k:])[:-cut].decode("utf-8", "replace")) if k else ([], "")

    def _prime(self, prompt: list[int]) -> list[int]:
        """The prompt's shortest suffix of at least PRIME ids (all of a shorter prompt) whose text is not empty and
        has no '\ufffd' (a character the prompt splits would be re-emitted), up to PRIME_MAX, else the longest
        shorter one; [] if there is none (the prompt ends inside a character, or in special tokens only)."""
        tok = self.tokenizer
        if tok is None or not prompt:
            return []
        first = min(self.PRIME, len(prompt))
        for n in (*range(first, min(self.PRIME_MAX, len(prompt)) + 1), *range(first - 1, 0, -1)):
            text = tok.decode(prompt[-n:])
            if text and "\ufffd" not in text:       # (special tokens alone decode to "": no context)
                return prompt[-n:]
        return []

    def push(self, new_ids: list[int]) -> str:
        """The text that `new_ids` add to the output; "" while a character is still incomplete."""
        tok = self.tokenizer
        if tok is None:
            return ""
        special = tok.special_ids
        out: list[str] = []
        for i in new_ids:
            if i in special:
                continue
            try:
                text = self._stream.step(tok.hf, i)
            except Exception:  # DecodeStream's "invalid prefix": the decoder rewrote earlier text
                self._pending.append(i)
                out.append(self._force(0))
                continue
            if text is None:
                self._pending.append(i)
                if len(self._pending) >= self.MAX_PENDING:
                    out.append(self._force(self.KEEP))
            else:
                self._context = [*self._pending, i]
                out.append(self._without_prompt(text))
                self._pending = []
        return "".join(out)

    def _without_prompt(self, text: str) -> str:
        """`text` less the held prompt bytes' own U+FFFD where the output did not complete their character (the
        prompt's text has it already: decode(prompt + ids) less decode(prompt) holds none of it)."""
        if self._from_prompt and self._prompt_text and text.startswith(self._prompt_text):
            text = text[len(self._prompt_text):]
        elif self._from_prompt and text.startswith(self._prompt_whole):
            text = text[len(self._prompt_whole):]
        self._from_prompt = []
        return text

    def finish(self) -> str:
        """The text still held back (an unfinished or invalid tail, shown as '\\ufffd'); call once at the end."""
        if self.tokenizer is None or not self._pending or self._pending == self._from_prompt:
            return ""                      # (the prompt's own unfinished bytes, which no output completed)
        return self._force(0)

    def _force(self, keep: int) -> str:
        """Emit the held ids but the last `keep`, then restart the stream after them."""
        tok = self.tokenizer
        assert tok is not None
        n = len(self._pending) - keep
        emit, rest = self._pending[:n], self._pending[n:]
        prefix = tok.decode(self._context)
        full = tok.decode(self._context + emit)
        text = full[len(prefix):] if full.startswith(prefix) else tok.decode(emit)
        # Restart after `emit` with the last emitted ids as context (a Metaspace "▁" keeps its space). Not
        # with `emit` itself: DecodeStream(ids=...) would re-emit a prefix that ends in '\ufffd'.
        text = self._without_prompt(text) if emit[:len(self._from_prompt)] == self._from_prompt else text
        self._pending, self._from_prompt = [], []
        self._stream = DecodeStream(ids=self._context, skip_special_tokens=True)
        return text + self.push(rest)


def _incomplete_tail(raw: bytes) -> int:
    """How many of `raw`'s last bytes are the start of a UTF-8 character it does not finish (0: none)."""
    for i in range(1, min(3, len(raw)) + 1):
        c = raw[-i]
        if 0x80 <= c <= 0xBF:                  # a continuation byte: its lead is further back
            continue
        need = 2 if 0xC2 <= c <= 0xDF else 3 if 0xE0 <= c <= 0xEF else 4 if 0xF0 <= c <= 0xF4 else 0
        return i if need > i else 0
    return 0
