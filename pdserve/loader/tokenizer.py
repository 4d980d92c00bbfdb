"""Tokenizer wrapper over the Hugging Face ``tokenizers`` library.

Two sources are supported:

* a Hugging Face model folder (``tokenizer.json`` + ``tokenizer_config.json`` and, optionally,
  ``generation_config.json`` / ``chat_template.jinja``), see :meth:`Tokenizer.from_hf_dir`;
* GGUF metadata (the ``tokenizer.*`` keys written by llama.cpp's converter), see
  :meth:`Tokenizer.from_gguf`.

GGUF vocabularies
-----------------
``tokenizer.ggml.model == "gpt2"`` is byte-level BPE.  The text is split by the pre-tokenizer regexes
llama.cpp associates with ``tokenizer.ggml.pre`` (``src/llama-vocab.cpp``, ``llm_tokenizer_bpe``).
llama.cpp applies a *list* of regexes one after the other: every regex cuts each piece produced so
far into matches and the text between matches, both kept.  That is exactly a sequence of
``tokenizers.pre_tokenizers.Split(regex, behavior="isolated")`` steps, followed by the byte-level
alphabet mapping.

``tokenizer.ggml.model == "llama"`` is SentencePiece-style BPE: pieces are merged greedily by the
score of the merged piece, unknown characters fall back to ``<0xXX>`` byte tokens, spaces are
written as U+2581 and (unless ``tokenizer.ggml.add_space_prefix`` is false) a space is prepended to
the text.  It is built as a ``tokenizers`` BPE model whose merge ranks are derived from the scores.

Tokens of GGUF type CONTROL (3) and USER_DEFINED (4) are registered as added tokens, so they are
matched whole in the input text (``"<|im_start|>"`` -> one id), like llama.cpp does.  Their GGUF
text is the raw text (not byte-level spelled), so GGUF decoding is done here from a per-id byte
table instead of through a ``tokenizers`` decoder.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from .chat_template import render_chat_template

if TYPE_CHECKING:  # pragma: no cover
    import gguf

__all__ = ["Tokenizer", "PRE_TOKENIZER_REGEXES", "pre_tokenizer_regexes"]

logger = logging.getLogger(__name__)

# GGUF token types (gguf.TokenType / llama_token_type)
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

_SPIECE_SPACE = "\u2581"  # "▁", SentencePiece's visible space

# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, as llama.cpp's llm_tokenizer_bpe uses them per tokenizer.ggml.pre value.
# Each entry is a sequence of regexes applied one after another (see module docstring).
# ---------------------------------------------------------------------------------------------

# GPT-2's split (llama.cpp writes it without GPT-2's trailing "|\s+"; a lone whitespace character
# left unmatched becomes a piece of its own anyway, so the result is the same).
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Llama-3 (tokenizer.json has "(?i:'s|...)"; llama.cpp spells the case-insensitivity out).
_RE_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
              r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2: the Llama-3 split with single digits.
_RE_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
             r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Tekken (Mistral Nemo) and GPT-4o: the tokenizer.json originals (oniguruma has \p{Lu} etc., which
# llama.cpp's std::regex lacks, so llama.cpp rewrites them; the original is the reference).
_RE_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
              r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
              r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
             r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
             r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
             r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_PRE_GPT2 = (_RE_GPT2,)
_PRE_DIGITS_GPT2 = (r"\p{N}", _RE_GPT2)  # every digit on its own, then GPT-2
_PRE_LLAMA3 = (_RE_LLAMA3,)
_PRE_QWEN2 = (_RE_QWEN2,)
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT (used when tokenizer.ggml.pre is missing or "default").
_PRE_LLAMACPP_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

#: tokenizer.ggml.pre value -> regex sequence.
PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "default": _PRE_LLAMACPP_DEFAULT,
    # plain GPT-2 split
    "gpt2": _PRE_GPT2, "gpt-2": _PRE_GPT2, "phi-2": _PRE_GPT2, "mpt": _PRE_GPT2, "olmo": _PRE_GPT2,
    "jais": _PRE_GPT2, "jina-es": _PRE_GPT2, "jina-de": _PRE_GPT2, "jina-v2-es": _PRE_GPT2,
    "jina-v2-de": _PRE_GPT2, "gigachat": _PRE_GPT2, "exaone4": _PRE_GPT2, "trillion": _PRE_GPT2,
    "granite-docling": _PRE_GPT2,
    # single digits, then GPT-2 (SmolLM, StarCoder, ...)
    "smollm": _PRE_DIGITS_GPT2, "starcoder": _PRE_DIGITS_GPT2, "refact": _PRE_DIGITS_GPT2,
    "command-r": _PRE_DIGITS_GPT2, "codeshell": _PRE_DIGITS_GPT2, "exaone": _PRE_DIGITS_GPT2,
    "minerva-7b": _PRE_DIGITS_GPT2,
    # Llama-3 family
    "llama-bpe": _PRE_LLAMA3, "llama3": _PRE_LLAMA3, "llama-v3": _PRE_LLAMA3, "falcon3": _PRE_LLAMA3,
    "falcon-h1": _PRE_LLAMA3, "pixtral": _PRE_LLAMA3, "midm-2.0": _PRE_LLAMA3, "lfm2": _PRE_LLAMA3,
    "dbrx": _PRE_LLAMA3, "smaug-bpe": _PRE_LLAMA3, "chatglm-bpe": _PRE_LLAMA3, "glm4": _PRE_LLAMA3,
    # Qwen2 family
    "qwen2": _PRE_QWEN2, "deepseek-r1-qwen": _PRE_QWEN2, "stablelm2": _PRE_QWEN2,
    "megrez": _PRE_QWEN2,
    # others whose tokenizer.json regex oniguruma can run as-is
    "tekken": (_RE_TEKKEN,),
    "gpt-4o": (_RE_GPT4O,), "llama4": (_RE_GPT4O,),
}

# llama.cpp sets ignore_merges (a whole pre-token found in the vocab is used as is) for these.
_IGNORE_MERGES_PRE = {"llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                      "lfm2", "tekken"}
# llama.cpp turns add_bos on for these unless tokenizer.ggml.add_bos_token says otherwise.
_ADD_BOS_PRE = {"llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                "lfm2", "tekken"}


def pre_tokenizer_regexes(pre: str | None) -> tuple[str, ...]:
    """Regex sequence for a ``tokenizer.ggml.pre`` value.

    Missing -> llama.cpp's "default" sequence (llama.cpp warns and does the same).  Unknown name ->
    plain GPT-2 split with a warning (current llama.cpp refuses to load such a file instead).
    """
    if not pre:
        logger.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer "
                       "(tokenization may differ from the original model)")
        return _PRE_LLAMACPP_DEFAULT
    regexes = PRE_TOKENIZER_REGEXES.get(pre)
    if regexes is None:
        logger.warning("unknown pre-tokenizer %r in GGUF; falling back to the GPT-2 regex "
                       "(tokenization may differ from the original model)", pre)
        return _PRE_GPT2
    return regexes


# ---------------------------------------------------------------------------------------------
# Byte-level alphabet (GPT-2): every byte gets a printable character.  Printable Latin-1 bytes map
# to themselves, the remaining 68 bytes to U+0100 onwards in byte order.
# ---------------------------------------------------------------------------------------------

def _byte_alphabet() -> dict[int, str]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_TO_CHAR = _byte_alphabet()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _byte_level_bytes(token: str) -> bytes:
    """Bytes a byte-level-spelled token stands for (raw UTF-8 if it is not byte-level spelled)."""
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


_BYTE_TOKEN_RE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


# ---------------------------------------------------------------------------------------------
# GGUF metadata access
# ---------------------------------------------------------------------------------------------

def _field_value(field: Any) -> Any:
    """Python value of a gguf ReaderField (scalar, string, or array of either)."""
    contents = getattr(field, "contents", None)
    if callable(contents):
        return contents()
    # Older gguf-py: decode parts by hand.
    import gguf  # local import: only needed for the type enum

    types = list(field.types)
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) > 1 and types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def _gguf_get(reader: Any, key: str, default: Any = None) -> Any:
    if isinstance(reader, _GGUFMetadata):
        return reader.values.get(key, default)
    field = reader.fields.get(key)
    if field is None:
        return default
    return _field_value(field)


# GGUF value type -> struct format character (tokenizer arrays are read with numpy).
_GGUF_SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _GGUFMetadata:
    """Key/value metadata of a GGUF file, parsed directly (tensor data is never touched).

    ``gguf.GGUFReader`` builds numpy views for every element of every array, which takes
    seconds for a 50k-token vocabulary; reading the key/value section with ``struct``/numpy
    takes a fraction of that.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        import mmap
        import struct

        import numpy as np

        self.values: dict[str, Any] = {}
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise ValueError(f"{str(path)!r} is not a GGUF file")
            (version,) = struct.unpack_from("<I", buf, 4)
            end = "<" if version & 0xFFFF else ">"  # a big-endian file reads as a huge version
            (version,) = struct.unpack_from(end + "I", buf, 4)
            if version < 2:
                raise ValueError(f"GGUF version {version} is not supported")
            _, kv_count = struct.unpack_from(end + "QQ", buf, 8)
            pos = 24
            u64 = struct.Struct(end + "Q")
            u32 = struct.Struct(end + "I")

            def read_str(pos: int) -> tuple[str, int]:
                (n,) = u64.unpack_from(buf, pos)
                pos += 8
                return buf[pos:pos + n].decode("utf-8", errors="replace"), pos + n

            def read_value(vtype: int, pos: int) -> tuple[Any, int]:
                if vtype == _GGUF_STRING:
                    return read_str(pos)
                if vtype == _GGUF_ARRAY:
                    (itype,) = u32.unpack_from(buf, pos)
                    (count,) = u64.unpack_from(buf, pos + 4)
                    pos += 12
                    if itype == _GGUF_STRING:
                        items = []
                        for _ in range(count):
                            item, pos = read_str(pos)
                            items.append(item)
                        return items, pos
                    if itype in _GGUF_SCALAR_FMT:
                        dtype = np.dtype(_GGUF_SCALAR_FMT[itype]).newbyteorder(end)
                        arr = np.frombuffer(buf, dtype=dtype, count=count, offset=pos)
                        return arr.tolist(), pos + count * dtype.itemsize
                    items = []
                    for _ in range(count):
                        item, pos = read_value(itype, pos)
                        items.append(item)
                    return items, pos
                fmt = _GGUF_SCALAR_FMT.get(vtype)
                if fmt is None:
                    raise ValueError(f"unknown GGUF value type {vtype}")
                (value,) = struct.unpack_from(end + fmt, buf, pos)
                return value, pos + struct.calcsize(fmt)

            for _ in range(kv_count):
                key, pos = read_str(pos)
                (vtype,) = u32.unpack_from(buf, pos)
                value, pos = read_value(vtype, pos + 4)
                self.values[key] = value


def _opt_int(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        value = int(value)
    except (TypeError, ValueError):
        return None
    return value if value >= 0 else None


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def _not_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"the text cannot be tokenized: it holds a lone surrogate "
                f"{text[e.start]!r} at character {e.start}, which is not valid Unicode")
    return "the text cannot be tokenized"


class Tokenizer:
    """Encode/decode text and render chat prompts for one model."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    stop_token_ids: frozenset[int]
    add_bos_token: bool
    chat_template: str | None

    def __init__(self, backend: _HFTokenizer, *, vocab_size: int, bos_token_id: int | None,
                 eos_token_id: int | None, pad_token_id: int | None = None,
                 unk_token_id: int | None = None, stop_token_ids: Iterable[int] = (),
                 add_bos_token: bool = False, chat_template: str | None = None,
                 named_chat_templates: Mapping[str, str] | None = None,
                 special_ids: Iterable[int] = (), id_to_text: Sequence[str] | None = None,
                 piece_bytes: Sequence[bytes] | None = None, strip_leading_space: bool = False,
                 source: str = "") -> None:
        backend.no_padding()
        backend.no_truncation()
        self._backend = backend
        self.vocab_size = int(vocab_size)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        stops = set(int(i) for i in stop_token_ids)
        if eos_token_id is not None:
            stops.add(eos_token_id)
        self.stop_token_ids = frozenset(stops)
        self.add_bos_token = bool(add_bos_token) and bos_token_id is not None
        self.chat_template = chat_template
        self.named_chat_templates = dict(named_chat_templates or {})
        # bos/eos/unk always count as special; pad only when the source says so (a GGUF padding
        # id sometimes points at an ordinary token, which decode must not drop).
        specials = set(int(i) for i in special_ids)
        specials.update(i for i in (bos_token_id, eos_token_id, unk_token_id) if i is not None)
        self._special_ids = frozenset(specials)
        self._id_to_text = list(id_to_text) if id_to_text is not None else None
        self._piece_bytes = list(piece_bytes) if piece_bytes is not None else None
        self._strip_leading_space = strip_leading_space
        self.source = source

    def __repr__(self) -> str:
        return (f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={self.eos_token_id}, stop={sorted(self.stop_token_ids)}, add_bos={self.add_bos_token})")

    # -- basic operations ------------------------------------------------------------------

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (encodes without BOS; decoding is done here)."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``.  Special-token text such as ``<|im_start|>`` maps to its id.

        With ``add_special_tokens`` the BOS id is prepended when the model wants it
        (:attr:`add_bos_token`).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        try:
            # the batch call releases the GIL (a single encode holds it for the whole text:
            # seconds for megabytes, during which no other thread of the process runs)
            ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        except TypeError:  # what the backend raises for a str that is not valid Unicode
            raise ValueError(_not_unicode(text)) from None
        if add_special_tokens and self.add_bos_token:
            ids = [self.bos_token_id, *ids]
        return ids

    def _check_id(self, token_id: int) -> int:
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} out of range [0, {self.vocab_size})")
        return token_id

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids``.  Invalid UTF-8 (e.g. half a character) becomes U+FFFD."""
        specials = self._special_ids
        if not isinstance(ids, list):
            ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)  # numpy / torch input
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"token id {bad} out of range [0, {self.vocab_size})")
        if self._piece_bytes is not None:
            pieces = self._piece_bytes
            if skip_special_tokens:
                data = b"".join(pieces[i] for i in ids if i not in specials)
            else:
                data = b"".join(pieces[i] for i in ids)
            if self._strip_leading_space and data[:1] == b" ":
                data = data[1:]
            return data.decode("utf-8", errors="replace")
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in specials]
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The raw vocabulary string of ``token_id`` (byte-level spelling for BPE vocabularies)."""
        token_id = self._check_id(token_id)
        if self._id_to_text is not None:
            return self._id_to_text[token_id]
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} has no vocabulary entry")
        return token

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self._special_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    def _token_text(self, token_id: int | None) -> str | None:
        if token_id is None:
            return None
        try:
            return self.id_to_token(token_id)
        except ValueError:
            return None

    @property
    def bos_token(self) -> str | None:
        return self._token_text(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._token_text(self.eos_token_id)

    # -- chat ------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs: Any) -> str | list[int]:
        """Render ``messages`` with the model's chat template.

        Extra keyword arguments become template variables (``tools``, ``enable_thinking``, ...).
        ``chat_template=`` overrides the template (a template string, or the name of one of the
        model's named templates).  When ``tools`` are given and the model has a template named
        ``tool_use`` it is used, as transformers does.  With ``tokenize=True`` the rendered text is
        encoded without adding BOS: the template already writes BOS where the model wants it.
        """
        template = kwargs.pop("chat_template", None)
        if template is not None and template in self.named_chat_templates:
            template = self.named_chat_templates[template]
        if template is None and kwargs.get("tools") and "tool_use" in self.named_chat_templates:
            template = self.named_chat_templates["tool_use"]
        if template is None:
            template = self.chat_template
        if template is None:
            raise ValueError(f"the model ({self.source or 'tokenizer'}) has no chat template; "
                             "pass chat_template= or use the completions API")
        text = render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    # -- construction: Hugging Face folder -------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"no tokenizer.json in model folder {str(folder)!r}")
        backend = _HFTokenizer.from_file(str(tok_file))

        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        gen_config = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")

        def token_id(name: str) -> int | None:
            for source in (config, special_map):
                if name in source:
                    text = _token_content(source[name])
                    if text is None:
                        return None
                    tid = backend.token_to_id(text)
                    if tid is None:
                        logger.warning("%s %r of %s is not in the vocabulary", name, text, folder)
                    return tid
            return None

        bos = token_id("bos_token")
        eos = token_id("eos_token")
        pad = token_id("pad_token")
        unk = token_id("unk_token")
        ids_source = gen_config or model_config
        if bos is None and "bos_token" not in config and "bos_token" not in special_map:
            bos = _first_id(ids_source.get("bos_token_id"))
        if eos is None and "eos_token" not in config and "eos_token" not in special_map:
            eos = _first_id(ids_source.get("eos_token_id"))
        if pad is None and "pad_token" not in config and "pad_token" not in special_map:
            pad = _opt_int(ids_source.get("pad_token_id"))

        stops: set[int] = set()
        value = (gen_config if "eos_token_id" in gen_config else model_config).get("eos_token_id")
        for item in value if isinstance(value, list) else [value]:
            if _opt_int(item) is not None:
                stops.add(_opt_int(item))

        if isinstance(config.get("add_bos_token"), bool):
            add_bos = config["add_bos_token"]
        else:
            # No explicit flag: trust tokenizer.json's post-processor (e.g. Llama-3 adds BOS there).
            probe = backend.encode("", add_special_tokens=True).ids
            add_bos = bos is not None and len(probe) > 0 and probe[0] == bos

        default_template, named = _hf_chat_templates(folder, config)

        specials = {tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special}
        if pad is not None:
            specials.add(pad)
        return cls(backend, vocab_size=backend.get_vocab_size(with_added_tokens=True),
                   bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, unk_token_id=unk,
                   stop_token_ids=stops, add_bos_token=add_bos, chat_template=default_template,
                   named_chat_templates=named, special_ids=specials, source=str(folder))

    # -- construction: GGUF ----------------------------------------------------------------

    @classmethod
    def from_gguf_file(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load from a GGUF file, reading only its key/value metadata (no ``GGUFReader``)."""
        return cls.from_gguf(_GGUFMetadata(path), source=str(path))

    @classmethod
    def from_gguf(cls, reader: "gguf.GGUFReader", source: str = "") -> "Tokenizer":
        """Build from an open ``gguf.GGUFReader`` (only ``reader.fields`` is used)."""
        model = _gguf_get(reader, "tokenizer.ggml.model")
        tokens = _gguf_get(reader, "tokenizer.ggml.tokens")
        if model is None or tokens is None:
            raise ValueError(f"GGUF {source!r} has no tokenizer (tokenizer.ggml.model/tokens missing)")
        tokens = list(tokens)
        n = len(tokens)
        types = _gguf_get(reader, "tokenizer.ggml.token_type")
        types = [int(t) for t in types] if types is not None else [_TT_NORMAL] * n
        if len(types) != n:
            raise ValueError(f"GGUF token_type has {len(types)} entries for {n} tokens")

        def tid(key: str) -> int | None:
            value = _opt_int(_gguf_get(reader, f"tokenizer.ggml.{key}"))
            if value is not None and value >= n:
                logger.warning("GGUF tokenizer.ggml.%s=%d is outside the vocabulary; ignored", key, value)
                return None
            return value

        bos, eos = tid("bos_token_id"), tid("eos_token_id")
        pad, unk = tid("padding_token_id"), tid("unknown_token_id")
        eot, eom = tid("eot_token_id"), tid("eom_token_id")
        pre = _gguf_get(reader, "tokenizer.ggml.pre")
        add_bos_flag = _gguf_get(reader, "tokenizer.ggml.add_bos_token")

        if model == "gpt2":
            backend, pieces, strip = _build_gguf_bpe(tokens, types, reader, pre)
            add_bos_default = pre in _ADD_BOS_PRE
        elif model == "llama":
            backend, pieces, strip = _build_gguf_spm(tokens, types, reader, unk)
            add_bos_default = True
        else:
            raise ValueError(f"unsupported GGUF tokenizer model {model!r} (tokenizer.ggml.model); "
                             "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)")
        add_bos = bool(add_bos_flag) if add_bos_flag is not None else add_bos_default

        template = _gguf_get(reader, "tokenizer.chat_template")
        named: dict[str, str] = {}
        for name in _gguf_get(reader, "tokenizer.chat_templates") or []:
            value = _gguf_get(reader, f"tokenizer.chat_template.{name}")
            if isinstance(value, str):
                named[name] = value
        if template is not None:
            named.setdefault("default", template)

        specials = [i for i, t in enumerate(types) if t in (_TT_CONTROL, _TT_UNKNOWN)]
        stops = [i for i in (eos, eot, eom) if i is not None]
        return cls(backend, vocab_size=n, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
                   unk_token_id=unk, stop_token_ids=stops, add_bos_token=add_bos,
                   chat_template=template, named_chat_templates=named, special_ids=specials,
                   id_to_text=tokens, piece_bytes=pieces, strip_leading_space=strip,
                   source=source or f"gguf:{model}/{pre}")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return _opt_int(value[0]) if value else None
    return _opt_int(value)


def _hf_chat_templates(folder: Path, config: Mapping[str, Any]) -> tuple[str | None, dict[str, str]]:
    named: dict[str, str] = {}
    default: str | None = None
    raw = config.get("chat_template")
    if isinstance(raw, str):
        default = raw
    elif isinstance(raw, list):
        for entry in raw:
            if isinstance(entry, Mapping) and isinstance(entry.get("name"), str) \
                    and isinstance(entry.get("template"), str):
                named[entry["name"]] = entry["template"]
        default = named.get("default")
        if default is None and named:
            first = next(iter(named))
            logger.warning("no 'default' chat template in %s; using %r", folder, first)
            default = named[first]
    jinja_file = folder / "chat_template.jinja"
    json_file = folder / "chat_template.json"
    if jinja_file.is_file():
        default = jinja_file.read_text(encoding="utf-8")
    elif default is None and json_file.is_file():
        value = _read_json(json_file).get("chat_template")
        if isinstance(value, str):
            default = value
    if default is not None:
        named["default"] = default
    return default, named


def _add_gguf_added_tokens(backend: _HFTokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    special, plain = [], []
    for token, ttype in zip(tokens, types):
        if not token:
            continue
        if ttype == _TT_CONTROL:
            special.append(AddedToken(token, special=True, normalized=False))
        elif ttype == _TT_USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)


def _build_gguf_bpe(tokens: list[str], types: list[int], reader: Any, pre: str | None
                    ) -> tuple[_HFTokenizer, list[bytes], bool]:
    """Byte-level BPE (tokenizer.ggml.model == "gpt2")."""
    merges_raw = _gguf_get(reader, "tokenizer.ggml.merges")
    if merges_raw is None:
        raise ValueError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab[token] = i  # duplicates: the last id wins, as in llama.cpp's token_to_id map
    merges: list[tuple[str, str]] = []
    dropped = 0
    for merge in merges_raw:
        cut = merge.find(" ", 1)  # llama.cpp splits at the first space after position 0
        if cut <= 0:
            dropped += 1
            continue
        left, right = merge[:cut], merge[cut + 1:]
        if left in vocab and right in vocab and (left + right) in vocab:
            merges.append((left, right))
        else:
            dropped += 1
    if dropped:
        logger.warning("ignored %d GGUF merges that do not fit the vocabulary", dropped)

    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES_PRE)
    backend = _HFTokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre_tokenizer_regexes(pre)]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    _add_gguf_added_tokens(backend, tokens, types)

    pieces = [token.encode("utf-8") if ttype in (_TT_CONTROL, _TT_USER_DEFINED) else _byte_level_bytes(token)
              for token, ttype in zip(tokens, types)]
    return backend, pieces, False


def _build_gguf_spm(tokens: list[str], types: list[int], reader: Any, unk: int | None
                    ) -> tuple[_HFTokenizer, list[bytes], bool]:
    """SentencePiece-style BPE (tokenizer.ggml.model == "llama").

    SentencePiece BPE repeatedly merges the adjacent pair whose concatenation is the vocabulary
    piece with the highest score.  A BPE model whose merges (every split of every mergeable piece
    into two vocabulary pieces) are ranked by the merged piece's score does the same, up to ties.
    """
    scores = _gguf_get(reader, "tokenizer.ggml.scores")
    if scores is None:
        raise ValueError("GGUF SentencePiece tokenizer has no tokenizer.ggml.scores")
    scores = [float(s) for s in scores]
    add_space_prefix = _gguf_get(reader, "tokenizer.ggml.add_space_prefix")
    add_space_prefix = True if add_space_prefix is None else bool(add_space_prefix)

    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    mergeable = {t for t, i in vocab.items() if types[i] in (_TT_NORMAL, _TT_USER_DEFINED, _TT_UNUSED)}
    candidates: list[tuple[float, int, int, str, str]] = []
    for token in mergeable:
        tid_ = vocab[token]
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in mergeable and right in mergeable:
                candidates.append((-scores[tid_], tid_, cut, left, right))
    candidates.sort()
    merges = [(left, right) for _, _, _, left, right in candidates]

    has_bytes = any(t == _TT_BYTE for t in types)
    bpe = models.BPE(vocab=vocab, merges=merges,
                     unk_token=tokens[unk] if unk is not None else None,
                     fuse_unk=True, byte_fallback=has_bytes)
    backend = _HFTokenizer(bpe)
    steps = [normalizers.Replace(" ", _SPIECE_SPACE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(_SPIECE_SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    _add_gguf_added_tokens(backend, tokens, types)

    pieces: list[bytes] = []
    for token, ttype in zip(tokens, types):
        if ttype == _TT_BYTE:
            m = _BYTE_TOKEN_RE.fullmatch(token)
            pieces.append(bytes([int(m.group(1), 16)]) if m else token.encode("utf-8"))
        elif ttype in (_TT_CONTROL, _TT_UNKNOWN):
            pieces.append(token.encode("utf-8"))
        else:
            pieces.append(token.replace(_SPIECE_SPACE, " ").encode("utf-8"))
    return backend, pieces, add_space_prefix
