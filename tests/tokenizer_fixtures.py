"""A byte-level BPE tokenizer built in memory: 256 tokens, id == byte value, no merges, no network.

'é' is 2 tokens, '€' 3 and '😀' 4, so multi-byte characters always split across tokens. Its ids fit
the random-weight test checkpoints (vocab_size 256).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from colibri_common.token_bytes import byte_to_unicode


def byte_level_tokenizer() -> Tokenizer:
    """Exactly 256 tokens, token id b standing for byte b; ByteLevel pre-tokenizer and decoder."""
    mapping = byte_to_unicode()
    assert set(mapping.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: b for b, ch in mapping.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    assert tok.get_vocab_size(with_added_tokens=True) == 256
    return tok


def save_tokenizer(dir: Path) -> Path:
    """Write `byte_level_tokenizer()` as `<dir>/tokenizer.json`; returns that path."""
    path = Path(dir) / "tokenizer.json"
    byte_level_tokenizer().save(str(path))
    return path
