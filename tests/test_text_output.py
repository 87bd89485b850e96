"""Stop strings on the detokenized text and one choice's text stream: no model, no processes."""

from __future__ import annotations

import random

import pytest

from colibri_common.tokenizer import Tokenizer
from router_service.api.text_output import ChoiceText, StopStrings
from tests.tokenizer_fixtures import byte_level_tokenizer


def run(stops: tuple[str, ...], pieces: list[str], may_stop: bool = True) -> tuple[list[str], str | None]:
    m = StopStrings(stops)
    sent = []
    for piece in pieces:
        text, stop = m.push(piece, may_stop)
        sent.append(text)
        if stop is not None:
            return sent, stop
    sent.append(m.flush())
    return sent, None


def test_the_text_ends_before_the_first_match_even_across_pieces() -> None:
    sent, stop = run(("END",), ["hello E", "N", "D and more"])
    assert "".join(sent) == "hello " and stop == "END"
    assert sent == ["hello ", "", ""]                    # "E" and "EN" were held: they might begin "END"


def test_the_earliest_of_several_stop_strings_wins() -> None:
    sent, stop = run(("world", "lo w"), ["hello world"])
    assert "".join(sent) == "hel" and stop == "lo w"


def test_a_tail_that_begins_no_stop_string_is_sent_at_once_or_at_the_end() -> None:
    sent, stop = run(("STOP",), ["abc S", "x", "yz ST"])
    assert stop is None
    assert sent == ["abc ", "Sx", "yz ", "ST"]            # only a possible start is held, and flushed at the end


def test_may_stop_false_holds_but_never_matches() -> None:
    m = StopStrings(("ab",))
    assert m.push("xab", may_stop=False) == ("xab", None)   # a whole stop string passes while it may not stop
    assert m.push("ya", may_stop=False) == ("y", None)      # "a" may begin "ab": held
    assert m.push("b", may_stop=True) == ("", "ab")          # now it may: the held start completes a match


def test_no_stop_strings_sends_everything() -> None:
    assert run((), ["a", "b"]) == (["a", "b", ""], None)


@pytest.mark.parametrize("seed", range(20))
def test_random_texts_agree_with_a_plain_find(seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice("abc") for _ in range(60))
    stops = tuple({"".join(rng.choice("abc") for _ in range(rng.randint(2, 4))) for _ in range(3)})
    cuts = sorted(rng.sample(range(1, 60), 8))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, 60], strict=True)]
    sent, stop = run(stops, pieces)
    hits = [(text.find(s), s) for s in stops if s in text]
    if hits:
        pos, first = min(hits)
        assert "".join(sent) == text[:pos] and stop == first
    else:
        assert "".join(sent) == text and stop is None


@pytest.fixture
def tok() -> Tokenizer:
    return Tokenizer(byte_level_tokenizer())


def test_a_choice_stops_on_text_made_of_split_characters(tok: Tokenizer) -> None:
    ids = list("naïve café ok".encode())             # 'ï' and 'é' are two tokens each
    choice = ChoiceText(tok, ("é o",), min_tokens=0)
    out, stop, used = "", None, 0
    for i in ids:
        piece = choice.push([i])
        out += piece.text
        used += 1
        if piece.stop is not None:
            stop = piece.stop
            break
    assert out == "naïve caf" and stop == "é o"
    assert used == len("naïve café o".encode())       # the token that completed the match is counted
    assert choice.done


def test_stop_strings_end_nothing_before_min_tokens(tok: Tokenizer) -> None:
    ids = list(b"ab ab ab")
    choice = ChoiceText(tok, ("ab",), min_tokens=4)
    pieces = [choice.push([i]) for i in ids[:5]]
    assert [p.stop for p in pieces] == [None, None, None, None, "ab"]   # the "ab" of tokens 1-2 is text
    assert "".join(p.text for p in pieces) == "ab "
    # as vLLM and the engine's stop tokens: a stop string may end it from token min_tokens + 1 on
    choice = ChoiceText(tok, ("ab",), min_tokens=2)
    assert [choice.push([i]).stop for i in b"abab"] == [None, None, None, "ab"]


def test_finish_flushes_the_held_tail_and_can_still_match(tok: Tokenizer) -> None:
    choice = ChoiceText(tok, ("xyz",), min_tokens=0)
    assert choice.push(list(b"abc x")).text == "abc "
    end = choice.finish()
    assert end.text == "x" and end.stop is None
    assert ChoiceText(tok, ("b",), 0).token_text(ord("b")) == "b"


def test_a_stop_string_with_the_first_tokens_space_matches_after_the_prompt() -> None:
    """A SentencePiece "▁world" first generated after "Hello" is " world": stop=[" world"] ends the choice there
    (the stream is primed with the prompt; alone it would be "world", and the stop would be missed)."""
    from tests.test_tokenizer import sentencepiece_like

    tok = sentencepiece_like()
    choice = ChoiceText(tok, (" world",), min_tokens=0, prompt=[1])
    piece = choice.push([2])
    assert (piece.text, piece.stop) == ("", " world")
    choice = ChoiceText(tok, ("!",), min_tokens=0, prompt=[1])
    assert choice.push([2, 2]).text == " world world"
    # log-probabilities' token texts are the tokens' own, space included: they join to the text
    assert [choice.token_text(i) for i in (2, 2)] == [" world", " world"]
    assert [choice.token_text(i) for i in (5, 8)] == ["\ufffd", "</s>"]
