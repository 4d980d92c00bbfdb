"""Encoding long texts by pieces between added tokens, through a cache (loader/segment_cache.py).

The reference is the tokenizers library encoding the whole text (`backend.encode_batch([text])`),
on the embedded SmolLM2 tokenizer and on small BPE tokenizers trained here, one for each kind of
backend that must not be encoded by pieces."""
from __future__ import annotations

import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from tokenizers import AddedToken, Tokenizer as HFTokenizer, models, normalizers, pre_tokenizers, \
    trainers

from pdserve.loader.default_model import default_gguf_path
from pdserve.loader.segment_cache import MIN_CHARS, SegmentEncoder
from pdserve.loader.tokenizer import Tokenizer

WORDS = ("the a of to and in is it you that was for on are with as I his they be at one have "
         "this from état naïve 東京 12345 don't").split()


@pytest.fixture(scope="module")
def smol():
    return Tokenizer.from_gguf_file(default_gguf_path())


def whole(tok_or_backend, text: str) -> list[int]:
    backend = getattr(tok_or_backend, "backend", tok_or_backend)
    return backend.encode_batch([text], add_special_tokens=False)[0].ids


def chat(rng: random.Random, turns: int) -> list[list[dict]]:
    """The message lists of a conversation's turns, each the history plus a new user message."""
    def msg(lo, hi):
        out = " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
        return out + rng.choice([".", "?", "!\n", "\n\n- item", "  ", " <|im_end|> x", "\t"])
    conv, out = [{"role": "system", "content": msg(20, 60)}], []
    for _ in range(turns):
        conv.append({"role": "user", "content": msg(10, 80)})
        out.append(list(conv))
        conv.append({"role": "assistant", "content": msg(30, 200)})
    return out


def test_multi_turn_chats_encode_as_whole_texts_and_reuse_earlier_turns(smol):
    """Six turns of four conversations: each turn's ids equal the whole text's; from the second
    turn on, the earlier messages' pieces come from the cache (more pieces hit than are encoded)."""
    enc = smol.segment_encoder()
    assert enc is not None                       # (SmolLM2: byte-level BPE, plain added tokens)
    rng = random.Random(0)
    for _ in range(4):
        for k, messages in enumerate(chat(rng, 6)):
            text = smol.apply_chat_template(messages, True)
            assert len(text) >= MIN_CHARS or k == 0
            hit, new = enc.pieces_hit, enc.pieces_encoded
            assert smol.encode(text, add_special_tokens=False) == whole(smol, text)
            if k >= 1:
                assert enc.pieces_hit - hit > enc.pieces_encoded - new, k
    text = smol.apply_chat_template(messages, True)
    assert smol.encode(text) == [smol.bos_token_id] * smol.add_bos_token + whole(smol, text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=40),
    st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start", "im_end|>",
                     "\n", " ", "  \n", "<|im_end|><|im_start|>"])), min_size=1, max_size=40))
def test_any_text_encodes_as_the_whole_text(smol, parts):
    """Random text around added tokens, their fragments and whitespace (padded past MIN_CHARS),
    encoded twice (the second time from the cache): the whole text's ids both times."""
    text = "".join(parts)
    text = text + " pad" * max(0, (MIN_CHARS - len(text) + 3) // 4)
    ref = whole(smol, text)
    assert smol.encode(text, add_special_tokens=False) == ref
    assert smol.encode(text, add_special_tokens=False) == ref


def _bpe(pre_tokenizer=None, normalizer=None, added=("<|im_start|>", "<|im_end|>")):
    rng = random.Random(1)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(200)]
    tok = HFTokenizer(models.BPE(unk_token="[UNK]"))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]"]))
    tok.add_special_tokens([a if isinstance(a, AddedToken) else AddedToken(a, normalized=False)
                            for a in added])
    return tok


@pytest.mark.parametrize("kind", ["metaspace-first", "lstrip", "rstrip", "single-word",
                                  "normalized-with-normalizer", "encode-special-tokens"])
def test_backends_that_look_past_a_piece_are_encoded_whole(kind):
    """Each such backend gets no piece encoder, and a Tokenizer over it still encodes long
    texts as whole ones (for the first kind the pieces would differ: its "▁" goes only on the
    text's first piece)."""
    added = ["<|im_start|>", "<|im_end|>"]
    kw = {}
    if kind == "metaspace-first":
        kw["pre_tokenizer"] = pre_tokenizers.Metaspace(prepend_scheme="first")
    elif kind in ("lstrip", "rstrip", "single-word"):
        flag = {"lstrip": "lstrip", "rstrip": "rstrip", "single-word": "single_word"}[kind]
        added[1] = AddedToken("<|im_end|>", normalized=False, **{flag: True})
    elif kind == "normalized-with-normalizer":
        kw["normalizer"] = normalizers.Lowercase()
        added[1] = AddedToken("<|im_end|>", normalized=True)
    backend = _bpe(added=added, **kw)
    if kind == "encode-special-tokens":
        backend.encode_special_tokens = True
    assert SegmentEncoder.for_backend(backend) is None
    tok = Tokenizer(backend, vocab_size=backend.get_vocab_size(), bos_token_id=None,
                    eos_token_id=None)
    text = ("<|im_start|>user\nthe a of  <|im_end|> \n<|im_start|>assistant to and in " * 12)
    assert tok.encode(text, add_special_tokens=False) == whole(backend, text)
    if kind == "metaspace-first":   # (what the check guards against: the pieces differ here)
        pieces = SegmentEncoder(backend, {"<|im_start|>": backend.token_to_id("<|im_start|>"),
                                          "<|im_end|>": backend.token_to_id("<|im_end|>")})
        assert pieces.encode(text) != whole(backend, text)


@pytest.mark.parametrize("pre", ["metaspace-always", "byte-level-prefix-space"])
def test_backends_whose_pieces_stand_alone_are_encoded_by_pieces(pre):
    """A Metaspace that marks every piece, and a byte-level pre-tokenizer that adds a space to
    every piece, look at their piece only: a piece encoder, and the whole text's ids."""
    p = (pre_tokenizers.Metaspace(prepend_scheme="always") if pre == "metaspace-always"
         else pre_tokenizers.ByteLevel(add_prefix_space=True))
    backend = _bpe(pre_tokenizer=p)
    enc = SegmentEncoder.for_backend(backend)
    assert enc is not None
    rng = random.Random(2)
    for _ in range(30):
        text = "".join(rng.choice(["<|im_start|>", "<|im_end|>", "\n", " ", *WORDS])
                       + rng.choice(["", " "]) for _ in range(120))
        assert enc.encode(text) == whole(backend, text)


def test_the_cache_stays_within_its_bound(smol):
    """A small bound: after many different conversations the cache holds at most that many
    characters, and the ids stay right."""
    enc = SegmentEncoder.for_backend(smol.backend, max_chars=4000)
    rng = random.Random(3)
    for _ in range(10):
        for messages in chat(rng, 3):
            text = smol.apply_chat_template(messages, True)
            assert enc.encode(text) == whole(smol, text)
            assert enc.cached_chars <= 4000
    assert enc.cached_chars > 0


def test_threads_share_the_cache(smol):
    """Four threads encode interleaved turns of the same conversations at once: every result
    equals the whole text's."""
    rng = random.Random(4)
    texts = [smol.apply_chat_template(m, True) for _ in range(6) for m in chat(rng, 5)]
    refs = [whole(smol, t) for t in texts]
    bad = []

    def work(k):
        for i in range(k, len(texts) + k):
            j = i % len(texts)
            if smol.encode(texts[j], add_special_tokens=False) != refs[j]:
                bad.append(j)
    threads = [threading.Thread(target=work, args=(k * 7,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


def test_a_long_text_with_a_lone_surrogate_is_a_value_error(smol):
    text = "<|im_start|>user\n" + "word " * 100 + "\ud800<|im_end|>"
    with pytest.raises(ValueError, match="surrogate"):
        smol.encode(text)
