"""The checkpoint's `tokenizer.json` (Hugging Face `tokenizers`), with incremental detokenization."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, tok: HFTokenizer) -> None:
        self.tok = tok

    @staticmethod
    def from_dir(model_dir: str | Path) -> Tokenizer | None:
        path = Path(model_dir) / "tokenizer.json"
        return Tokenizer(HFTokenizer.from_file(str(path))) if path.is_file() else None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


class Detokenizer:
    """Emits the new text of each step; holds back an incomplete UTF-8 tail ('\\ufffd')."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, new_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else text
        self.emitted = text
        return delta
