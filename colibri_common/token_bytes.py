"""One token's own bytes, for log-probabilities (OpenAI's `bytes`: joined over a message they rebuild its text,
characters split across tokens included, where each token's text alone is U+FFFD).

Read from the tokenizer's decoder, once: a byte-level vocabulary (GPT-2's printable alphabet: Qwen, DeepSeek,
OLMoE, GPT-OSS) maps each character of the token back to its byte; a SentencePiece one with byte fallback
(Llama, Mistral, Mixtral) has `<0xXX>` tokens for single bytes and "▁" for a space; added tokens are their
content. Anything else is the token's decoded text in UTF-8.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

import tokenizers

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of the ByteLevel pre-tokenizer and decoder."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


_UNICODE_TO_BYTE = {c: b for b, c in byte_to_unicode().items()}


def _decoders(spec: dict | None) -> list[dict]:
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        return [d for inner in spec.get("decoders", []) for d in _decoders(inner)]
    return [spec]


class TokenBytes:
    def __init__(self, hf: tokenizers.Tokenizer) -> None:
        self.hf = hf
        spec = json.loads(hf.to_str())
        steps = _decoders(spec.get("decoder"))
        kinds = {d.get("type") for d in steps}
        self.byte_level = "ByteLevel" in kinds
        self.byte_fallback = "ByteFallback" in kinds
        self.replace = [(d["pattern"]["String"], d.get("content", "")) for d in steps
                        if d.get("type") == "Replace" and isinstance(d.get("pattern"), dict)
                        and "String" in d["pattern"]]
        if "Metaspace" in kinds:                       # the Metaspace decoder: its replacement is a space
            self.replace += [(d.get("replacement", "▁"), " ") for d in steps if d.get("type") == "Metaspace"]
        self.added = {t.content for t in hf.get_added_tokens_decoder().values()}
        self.of = lru_cache(maxsize=65536)(self._of)

    def _of(self, token_id: int) -> bytes:
        piece = self.hf.id_to_token(token_id)
        if piece is None:
            return b""
        if piece in self.added:
            return piece.encode("utf-8")
        if self.byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        if self.byte_fallback and (m := _BYTE_TOKEN.match(piece)):
            return bytes([int(m.group(1), 16)])
        if self.replace:
            for old, new in self.replace:
                piece = piece.replace(old, new)
            return piece.encode("utf-8")
        return self.hf.decode([token_id], skip_special_tokens=False).encode("utf-8")
