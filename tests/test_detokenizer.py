"""IncrementalDetokenizer with the embedded SmolLM2 tokenizer: stop strings whose characters arrive
over several tokens (whole tokens, mid-token starts and ends, a character split over byte
tokens), where the stop is reported, the cut, and the streamed text never showing a piece of a
stop string that is cut later.

Token sequences come from encoding strings; every expectation is written out by hand from the
strings (the per-token pieces are asserted first, so a different tokenizer fails loudly instead of
testing something else)."""
from __future__ import annotations

import pytest

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.loader.default_model import default_gguf_path
from pdserve.loader.tokenizer import Tokenizer

PROMPT = "Hello"
STORY = " world, once upon a time, the end. Goodbye"
STORY_PIECES = [" world", ",", " once", " upon", " a", " time", ",", " the", " end", ".", " Good",
                "bye"]
BIRDS = " I love \U0001F600 and \U0001F99C birds"    # 😀 and 🦜, each split over byte tokens
# 🦜 (F0 9F A6 9C) arrives as " F0 9F" | "A6" | "9C": decoded alone, each is U+FFFD
BIRDS_TOKENS = ["\u0120I", "\u0120love", "\u0120\u00f0\u0141\u013a", "\u0122", "\u0120and",
                "\u0120\u00f0\u0141", "\u00a6", "\u013e", "\u0120birds"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_file(default_gguf_path())


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _run(tok, text, stop):
    """Feeds the tokens of `text` one by one after PROMPT, as the engine does: add, then take the
    streamable text; stops feeding when add reports a stop. Returns (index of the token that
    reported the stop or None, the stop string, the detokenizer's final text, the streamed text
    after each token, everything streamed once finished)."""
    d = IncrementalDetokenizer(tok, _ids(tok, PROMPT), True, tuple(stop))
    d.take_new_text(False)
    streamed, after = "", []
    at = hit = None
    for i, t in enumerate(_ids(tok, text)):
        hit = d.add(t)
        if hit is not None:
            at = i
            break
        streamed += d.take_new_text(False)
        after.append(streamed)
    streamed += d.take_new_text(True)
    return at, hit, d.text, after, streamed


def test_the_token_pieces_are_what_the_cases_assume(tok):
    assert _ids(tok, PROMPT) == [19556]
    assert [tok.decode([i]) for i in _ids(tok, STORY)] == STORY_PIECES
    assert [tok.id_to_token(i) for i in _ids(tok, BIRDS)] == BIRDS_TOKENS


# (stop strings, index of the token that completes the first stop, the text left), by hand from
# STORY_PIECES: 0 " world", 1 ",", 2 " once", 3 " upon", 4 " a", 5 " time", 6 ",", 7 " the",
# 8 " end", 9 ".", 10 " Good", 11 "bye"
STORY_CASES = [
    # two whole tokens: " the" + " end", completed by token 8
    ((" the end",), 8, " world, once upon a time,"),
    # starts inside " time" (its "e"), spans "," and " the", ends inside " end" (its " e")
    (("e, the e",), 8, " world, once upon a tim"),
    # starts inside " once" ("ce"), ends inside " upon" (" up"): completed by token 3
    (("ce up",), 3, " world, on"),
    # a stop that never occurs: everything is streamed once finished
    (("THE END",), None, STORY),
    # several stops: the one that occurs first in the text wins, whatever the list order --
    # also when both complete on the same token (" end" and "e e" on token 8)
    ((" Goodbye", "upon a"), 4, " world, once "),
    ((" end", "e e"), 8, " world, once upon a time, th"),
]


@pytest.mark.parametrize("stop,at,text", STORY_CASES, ids=[repr(c[0]) for c in STORY_CASES])
def test_stop_string_over_several_tokens(tok, stop, at, text):
    got_at, hit, final, after, streamed = _run(tok, STORY, stop)
    assert got_at == at
    if at is None:
        assert hit is None
    else:
        want_stop = min((s for s in stop if s in STORY), key=STORY.index)
        assert hit == want_stop and STORY.startswith(text + want_stop)
    assert final == text and streamed == text
    assert not any(s in final for s in stop)
    # nothing streamed while running is ever taken back: each running total is a prefix of the
    # final text (a piece of a stop string streamed before its last token arrives would not be)
    for s in after:
        assert text.startswith(s), (s, text)


def test_hold_back_is_no_longer_than_a_stop_string_minus_one(tok):
    """The tail withheld while running is at most len(longest stop) - 1 characters: with stop
    "e, the e" (8 characters) the text " world, once upon a time" (24) after token 5 has at
    least its first 17 characters out, " world, once upon"."""
    _, _, final, after, _ = _run(tok, STORY, ("e, the e",))
    assert after[5].startswith(" world, once upon") and final.startswith(after[5])


BIRD_CASES = [
    # the emoji's three tokens, then the stop ends inside " birds": completed by its last token
    (("\U0001F99C bi",), 8, " I love \U0001F600 and "),
    # the stop ends on the emoji itself: completed by its last byte token (index 7)
    (("and \U0001F99C",), 7, " I love \U0001F600 "),
    # a stop made of the emoji only, which no single token's text contains
    (("\U0001F99C",), 7, " I love \U0001F600 and "),
]


@pytest.mark.parametrize("stop,at,text", BIRD_CASES, ids=["emoji+word", "word+emoji", "emoji"])
def test_stop_string_over_a_character_split_into_byte_tokens(tok, stop, at, text):
    got_at, hit, final, after, streamed = _run(tok, BIRDS, stop)
    assert (got_at, hit) == (at, stop[0])
    assert final == text and streamed == text
    for s in after:
        assert "\ufffd" not in s and text.startswith(s), (s, text)
