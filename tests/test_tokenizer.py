"""Tokenizer loading and incremental detokenization (colibri_common.tokenizer)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from colibri_common.errors import CheckpointError
from colibri_common.tokenizer import Detokenizer, Tokenizer
from tests.tokenizer_fixtures import byte_level_tokenizer, save_tokenizer

MIXED = "héllo wörld € 😀 日本"


class CountingTokenizer(Tokenizer):
    """Records every full decode (the work a non-incremental detokenizer would repeat each step)."""

    def __init__(self, hf: tokenizers.Tokenizer) -> None:
        super().__init__(hf)
        self.decoded_lengths: list[int] = []

    def decode(self, ids: list[int]) -> str:
        self.decoded_lengths.append(len(ids))
        return super().decode(ids)


@pytest.fixture
def tok() -> Tokenizer:
    return Tokenizer(byte_level_tokenizer())


def stream(detok: Detokenizer, ids: list[int], sizes: list[int] | None = None) -> list[str]:
    """Push `ids` in pieces of `sizes` (one at a time by default); returns the chunks."""
    chunks, i = [], 0
    for n in sizes or [1] * len(ids):
        chunks.append(detok.push(ids[i:i + n]))
        i += n
    assert i >= len(ids)
    return chunks


def sentencepiece_like() -> Tokenizer:
    """Metaspace + byte fallback + a special token, as Llama/Mixtral-style tokenizers are built."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁": 4, "<0xC3>": 5, "<0xA9>": 6, "<0xFF>": 7}
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens([AddedToken("</s>", special=True)])
    return Tokenizer(hf)


def test_fixture_is_one_token_per_byte(tok: Tokenizer) -> None:
    assert tok.vocab_size == 256
    assert sorted(tok.hf.get_vocab().values()) == list(range(256))
    assert [len(tok.encode(c)) for c in "aé€😀"] == [1, 2, 3, 4]
    assert tok.encode(MIXED) == list(MIXED.encode())
    assert tok.token_to_id("a") == 97
    assert tok.token_to_id("no such token") is None


def test_round_trip(tok: Tokenizer) -> None:
    ids = tok.encode(MIXED)
    assert len(ids) == len(MIXED.encode("utf-8")) > len(MIXED)
    assert tok.decode(ids) == MIXED
    assert tok.decode(tok.encode(" leading and trailing ")) == " leading and trailing "


def test_one_token_at_a_time(tok: Tokenizer) -> None:
    ids = tok.encode(MIXED)
    chunks = stream(Detokenizer(tok), ids)
    assert "".join(chunks) == tok.decode(ids) == MIXED
    assert all("\ufffd" not in c for c in chunks)
    assert "" in chunks  # held back mid-character
    # with one byte per token, each push completes at most one character, exactly when its last byte arrives
    assert [c for c in chunks if c] == list(MIXED)
    assert chunks[:3] == ["h", "", "é"]


@pytest.mark.parametrize("seed", range(5))
def test_several_ids_at_once(tok: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice(["a", " ", "é", "€", "😀", "日本", "\n", "ß"]) for _ in range(200))
    ids = tok.encode(text)
    sizes = []
    while sum(sizes) < len(ids):
        sizes.append(rng.randint(1, 7))  # pieces that cut characters anywhere
    chunks = stream(Detokenizer(tok), ids, sizes)
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)
    assert Detokenizer(tok).push(ids) == text  # everything in one push


def test_no_tokenizer() -> None:
    detok = Detokenizer(None)
    assert detok.push([104, 105]) == ""
    assert detok.push([]) == ""
    assert detok.finish() == ""


def test_from_dir(tmp_path: Path) -> None:
    assert Tokenizer.from_dir(tmp_path) is None
    (tmp_path / "tokenizer.json").mkdir()  # not a file: a broken checkpoint, not one without a tokenizer
    with pytest.raises(CheckpointError, match="not a regular file"):
        Tokenizer.from_dir(tmp_path)
    good = tmp_path / "good"
    good.mkdir()
    path = save_tokenizer(good)
    assert path == good / "tokenizer.json" and path.is_file()
    loaded = Tokenizer.from_dir(str(good))
    assert loaded is not None and isinstance(loaded.hf, tokenizers.Tokenizer)
    assert loaded.vocab_size == 256 and loaded.decode(loaded.encode(MIXED)) == MIXED


@pytest.mark.parametrize("content", ['{"version": "1.0", "model": ', "not json at all", '{"model": {"type": "Nope"}}'])
def test_corrupt_tokenizer_json(tmp_path: Path, content: str) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text(content)
    with pytest.raises(CheckpointError, match="tokenizer") as info:
        Tokenizer.from_dir(tmp_path)
    assert str(bad) in str(info.value)


def test_truncated_tokenizer_json(tmp_path: Path) -> None:
    path = save_tokenizer(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=str(path)):
        Tokenizer.from_dir(tmp_path)


def test_constant_work_per_token() -> None:
    """5,000 tokens pushed one by one: no full decode at all (the old detokenizer decoded all ids each step)."""
    tok = CountingTokenizer(byte_level_tokenizer())
    text = (MIXED + " 🙂 naïve ") * 250
    ids = tok.encode(text)[:5000]
    assert len(ids) == 5000
    detok = Detokenizer(tok)
    chunks = [detok.push([i]) for i in ids]
    assert tok.decoded_lengths == []
    assert "".join(chunks) + detok.finish() == tok.hf.decode(ids)


def test_invalid_bytes_are_streamed_with_bounded_work() -> None:
    """A model repeating an invalid byte: DecodeStream alone would hold everything back and re-decode it all."""
    tok = CountingTokenizer(byte_level_tokenizer())
    detok = Detokenizer(tok)
    chunks = [detok.push([0xFF]) for _ in range(5000)]
    out = "".join(chunks)
    assert len(out) >= 5000 - Detokenizer.MAX_PENDING  # streamed, not held back
    assert max(tok.decoded_lengths) <= 2 * Detokenizer.MAX_PENDING
    assert len(tok.decoded_lengths) <= 2 * 5000 // (Detokenizer.MAX_PENDING - Detokenizer.KEEP) + 2
    assert out + detok.finish() == tok.hf.decode([0xFF] * 5000) == "\ufffd" * 5000


@pytest.mark.parametrize("seed", range(5))
def test_random_bytes_match_full_decode(tok: Tokenizer, seed: int) -> None:
    """What a random-weight model emits: valid characters among invalid bytes, never broken by the stream."""
    rng = random.Random(seed)
    ids: list[int] = []
    for _ in range(300):
        r = rng.random()
        ids += [rng.randrange(256)] * rng.randint(1, 20) if r < 0.3 else tok.encode(rng.choice(["€", "😀", "é", "x"]))
    detok = Detokenizer(tok)
    chunks = [detok.push([i]) for i in ids]
    assert "".join(chunks) + detok.finish() == tok.decode(ids)


def test_split_character_after_invalid_run_is_not_broken(tok: Tokenizer) -> None:
    ids = [0xFF] * 20 + tok.encode("😀") + [0xFE] * 9 + tok.encode("€")
    detok = Detokenizer(tok)
    out = "".join(detok.push([i]) for i in ids)
    assert out == "\ufffd" * 20 + "😀" + "\ufffd" * 9 + "€"
    assert detok.finish() == ""


def test_unfinished_tail_needs_finish(tok: Tokenizer) -> None:
    ids = tok.encode("a€")[:-1]
    detok = Detokenizer(tok)
    assert stream(detok, ids) == ["a", "", ""]
    tail = detok.finish()
    assert "a" + tail == tok.decode(ids) and tail.startswith("\ufffd")
    assert detok.finish() == ""


def test_special_tokens_are_skipped() -> None:
    hf = byte_level_tokenizer()
    hf.add_special_tokens([AddedToken("</s>", special=True)])
    tok = CountingTokenizer(hf)
    eos = tok.token_to_id("</s>")
    assert eos == 256 and eos in tok.special_ids
    ids = tok.encode("é") + [eos] * 3000 + tok.encode(" €")
    ids.insert(1, eos)  # between the two bytes of 'é'
    detok = Detokenizer(tok)
    assert "".join(detok.push([i]) for i in ids) == tok.hf.decode(ids, skip_special_tokens=True) == "é €"
    assert tok.decoded_lengths == []


def test_sentencepiece_leading_space() -> None:
    """Metaspace decoders strip the first token's space: the stream does the same as a full decode, no more."""
    tok = sentencepiece_like()
    assert tok.token_to_id("</s>") == 8
    for ids in ([1, 2, 3], [2, 1], [4, 1], [1, 5, 6, 2], [1, 8, 2, 8], [8, 1, 2], [4] * 20 + [1]):
        chunks = stream(Detokenizer(tok), ids)
        assert "".join(chunks) == tok.decode(ids), ids
        assert all("\ufffd" not in c for c in chunks)
    for ids in ([1] + [7] * 20 + [2], [7] * 20 + [4, 1], [1] + [7] * 20 + [5, 6, 2]):  # forced out: spaces kept
        detok = Detokenizer(tok)
        assert "".join(stream(detok, ids)) + detok.finish() == tok.decode(ids), ids
    assert tok.decode([1] + [7] * 20 + [2]) == "Hello" + "\ufffd" * 20 + " world"
    assert stream(Detokenizer(tok), [1, 2, 3]) == ["Hello", " world", "!"]
    assert stream(Detokenizer(tok), [1, 5, 6]) == ["Hello", "", "é"]
    assert tok.decode([2, 1]) == "world Hello"  # the generated text alone: its first space is stripped


def test_primed_with_the_prompt_the_stream_is_what_the_ids_add_to_it() -> None:
    """As vLLM and transformers' pipelines: the text generated after a prompt keeps the space a SentencePiece "▁"
    carries on its first token (decode(output_ids) alone strips it), and a prompt that ends inside a character
    does not make its text come twice."""
    tok = sentencepiece_like()

    def added(prompt: list[int], ids: list[int]) -> str:
        return tok.decode(prompt + ids)[len(tok.decode(prompt)):]

    cases = [([1], [2, 3]), ([1, 2], [2]), ([4] * 30 + [1], [2, 1]), ([1, 8], [2, 8, 1]),
             ([1] * 30, [7] * 12 + [2]), ([8], [1, 2]), ([7, 1], [2]), ([7] * 20 + [1], [2]),
             ([1, 8, 8, 8, 8], [2]), ([1, 2, 3] + [8] * 5, [2, 3]), ([8] * 6, [2])]      # special tokens last
    for prompt, ids in cases:
        detok = Detokenizer(tok, prompt)
        text = "".join(stream(detok, ids)) + detok.finish()
        assert text == added(prompt, ids), (prompt, ids)
    assert stream(Detokenizer(tok, [1]), [2, 3]) == [" world", "!"]
    assert stream(Detokenizer(tok), [2, 3]) == ["world", "!"]              # no prompt: decode(ids), as before
    # a prompt that ends in a character's first bytes (a generation cut inside one, sent back): the output's
    # first bytes complete it, as vLLM's primed stream has it
    detok = Detokenizer(tok, [1, 5])
    assert "".join(stream(detok, [6, 2])) + detok.finish() == "é world"
    detok = Detokenizer(tok, [1, 5])                         # ... and none that does not: nothing of the prompt's
    assert detok.push([8]) + detok.finish() == ""
    detok = Detokenizer(tok, [1, 5])                         # nor output that does not complete it
    assert "".join(stream(detok, [2, 3])) + detok.finish() == tok.decode([1, 5, 2, 3])[len(tok.decode([1, 5])):]
    # a prompt that ends in invalid bytes has no whole suffix: the ids' own text, as without a prompt
    detok = Detokenizer(tok, [7] * 30)
    assert "".join(stream(detok, [6, 2])) + detok.finish() == tok.decode([6, 2]) == "\ufffd world"



def test_priming_holds_for_byte_level_text_too(tok: Tokenizer) -> None:
    prompt = tok.encode("Sag «é» ")
    for text in ("weiter 😀 日本", " und", "é"):
        ids = tok.encode(text)
        assert "".join(stream(Detokenizer(tok, prompt), ids)) == text
        assert "".join(stream(Detokenizer(tok, prompt[:2]), ids)) == text    # a prompt shorter than PRIME
    # a generation cut by max_tokens inside a character and sent back as the prompt: the rest completes it
    for text, cut in (("Un café ok", 7), ("Emoji: 😀 d", 9), ("Emoji: 😀 d", 10), ("日本", 1), ("日本", 2)):
        ids = tok.encode(text)
        detok = Detokenizer(tok, ids[:cut])
        done = tok.decode(ids[:cut]).rstrip("\ufffd")
        assert "".join(stream(detok, ids[cut:])) + detok.finish() == text[len(done):], (text, cut)
    # a prompt that ends in a character's first byte, and an output that does not complete it: the output's own
    # text, as decode(prompt + ids) less decode(prompt)
    for start in ([0xC3], [0xE6, 0x97], [0xF0, 0x9F, 0x98]):
        for out in (list(b"1 ok"), list("é ok".encode()), [0xC3] * 9 + [49]):
            prompt = tok.encode("ab") + start
            detok = Detokenizer(tok, prompt)
            got = "".join(stream(detok, out)) + detok.finish()
            assert got == tok.decode(prompt + out)[len(tok.decode(prompt)):], (start, out, got)


def test_token_bytes_are_each_tokens_own_bytes(tok: Tokenizer) -> None:
    """OpenAI's logprob `bytes`: a byte-level token's byte (half a character too), a byte-fallback token's byte, a
    SentencePiece "▁" as a space, an added token's text; joined they rebuild the text where each token's own
    text is U+FFFD."""
    text = "aé€😀 日本"
    ids = tok.encode(text)
    assert [tok.token_bytes(i) for i in ids] == [bytes([b]) for b in text.encode()]
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == text
    sp = sentencepiece_like()
    assert [sp.token_bytes(i) for i in (1, 2, 3, 5, 6, 7, 8)] == [b" Hello", b" world", b"!", b"\xc3", b"\xa9",
                                                                  b"\xff", b"</s>"]
    assert b"".join(sp.token_bytes(i) for i in (1, 5, 6)).decode() == " Hello\u00e9"


@pytest.mark.parametrize("seed", range(4))
def test_random_outputs_after_a_whole_prompt_are_what_they_add_to_its_text(tok: Tokenizer, seed: int) -> None:
    """Random runs of these pieces (characters, split characters, invalid bytes) generated after a prompt of whole
    characters: the pushes and finish() are decode(prompt + ids) less decode(prompt), whatever the push sizes.
    (Some longer runs of invalid bytes are cut apart by the forced flush of MAX_PENDING held ids, and say a
    U+FFFD more than a whole decode would.)"""
    rng = random.Random(seed)
    pieces = [b"a", b" ", "é".encode(), "€".encode(), "😀".encode(), b"\xff", b"\xc3", b"\x80", b"\n"]
    for _ in range(50):
        prompt = tok.encode("".join(rng.choice(["x", " y", "é", "日本", "😀"]) for _ in range(rng.randint(1, 6))))
        ids = list(b"".join(rng.choice(pieces) for _ in range(rng.randint(1, 14))))
        sizes = [rng.randint(1, 4) for _ in ids]
        detok = Detokenizer(tok, prompt)
        got = "".join(stream(detok, ids, sizes)) + detok.finish()
        assert got == tok.decode(prompt + ids)[len(tok.decode(prompt)):], (prompt, ids)


def test_a_character_cut_inside_a_merged_token_is_completed_too() -> None:
    """Byte-level vocabularies merge a space (or a whole character) with a character's first byte (" \\xe4"): the
    prompt's last token holds whole text and a character's start; the output completes the character and says
    none of the prompt's own text."""
    from tests.tokenizer_fixtures import byte_to_unicode

    mapping = byte_to_unicode()
    vocab = {ch: b for b, ch in mapping.items()}
    vocab[mapping[0x20] + mapping[0xE4]] = 256
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[(mapping[0x20], mapping[0xE4])]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    tok = Tokenizer(hf)
    assert tok.token_bytes(256) == b" \xe4" and tok.encode(" 你") == [256, 0xBD, 0xA0]
    for out, want in (([0xBD, 0xA0, ord("!")], "你!"), ([ord("!")], "!")):
        detok = Detokenizer(tok, [ord("x"), 256])
        assert "".join(stream(detok, out)) + detok.finish() == want, out
