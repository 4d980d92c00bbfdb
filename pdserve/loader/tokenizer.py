"""Tokenizer wrapper over the Hugging Face ``tokenizers`` library.

Two sources are supported:

* a Hugging Face model folder (``tokenizer.json`` + ``tokenizer_config.json`` and, optionally,
  ``generation_config.json`` / ``chat_template.jinja``), see :meth:`Tokenizer.from_hf_dir`;
* GGUF metadata (the ``tokenizer.*`` keys written by llama.cpp's converter), see
  :meth:`Tokenizer.from_gguf`.

How a GGUF vocabulary becomes a ``tokenizers`` backend: gguf_vocab.py (pre-tokenizer regexes:
pretokenizers.py; reading the metadata: gguf_kv.py).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from tokenizers import Tokenizer as _HFTokenizer

from .chat_template import render_chat_template
from .gguf_kv import GGUFMetadata, gguf_get
from .gguf_vocab import (BYTE_TOKEN_RE, SPIECE_SPACE, TT_CONTROL, TT_NORMAL, TT_UNKNOWN,
                         build_gguf_bpe, build_gguf_spm, byte_level_bytes)
from .pretokenizers import ADD_BOS_PRE
from .segment_cache import MIN_CHARS, SegmentEncoder

if TYPE_CHECKING:  # pragma: no cover
    import gguf

__all__ = ["Tokenizer"]

logger = logging.getLogger(__name__)


_UNSET = object()


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
        self._token_bytes: list[bytes] | None = None
        self._segments: SegmentEncoder | None | object = _UNSET
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
            pieces = self.segment_encoder() if len(text) >= MIN_CHARS else None
            if pieces is not None:     # cut at its added tokens, pieces through a cache
                ids = pieces.encode(text)
            else:
                # the batch call releases the GIL (a single encode holds it for the whole text:
                # seconds for megabytes, during which no other thread of the process runs)
                ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        except TypeError:  # what the backend raises for a str that is not valid Unicode
            raise ValueError(_not_unicode(text)) from None
        if add_special_tokens and self.add_bos_token:
            ids = [self.bos_token_id, *ids]
        return ids

    def segment_encoder(self) -> SegmentEncoder | None:
        """The encoder of long texts by pieces between added tokens, through a cache (made at
        the first long text; None where pieces could encode differently: segment_cache.py)."""
        if self._segments is _UNSET:
            self._segments = SegmentEncoder.for_backend(self._backend)
        return self._segments

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

    def token_bytes(self) -> list[bytes]:
        """What each id adds to decoded text, as bytes (b"" for a special token), one entry per
        id below vocab_size: the vocabulary a grammar engine masks over. Computed once."""
        if self._token_bytes is None:
            if self._piece_bytes is not None:
                out = list(self._piece_bytes)
            else:
                out = _backend_token_bytes(self._backend, self.vocab_size)
            out += [b""] * (self.vocab_size - len(out))
            for i in self._special_ids:
                if 0 <= i < len(out):
                    out[i] = b""
            self._token_bytes = out[: self.vocab_size]
        return self._token_bytes

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

    def chat_template_for(self, tools: bool) -> str | None:
        """The template a chat is rendered with when none is named: the model's `tool_use`
        template for a request with tools, when it has one (as transformers picks), else its
        default."""
        if tools and "tool_use" in self.named_chat_templates:
            return self.named_chat_templates["tool_use"]
        return self.chat_template

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
        if template is None:
            template = self.chat_template_for(bool(kwargs.get("tools")))
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
        return cls.from_gguf(GGUFMetadata(path), source=str(path))

    @classmethod
    def from_gguf(cls, reader: "gguf.GGUFReader", source: str = "") -> "Tokenizer":
        """Build from an open ``gguf.GGUFReader`` (only ``reader.fields`` is used)."""
        model = gguf_get(reader, "tokenizer.ggml.model")
        tokens = gguf_get(reader, "tokenizer.ggml.tokens")
        if model is None or tokens is None:
            raise ValueError(f"GGUF {source!r} has no tokenizer (tokenizer.ggml.model/tokens missing)")
        tokens = list(tokens)
        n = len(tokens)
        types = gguf_get(reader, "tokenizer.ggml.token_type")
        types = [int(t) for t in types] if types is not None else [TT_NORMAL] * n
        if len(types) != n:
            raise ValueError(f"GGUF token_type has {len(types)} entries for {n} tokens")

        def tid(key: str) -> int | None:
            value = _opt_int(gguf_get(reader, f"tokenizer.ggml.{key}"))
            if value is not None and value >= n:
                logger.warning("GGUF tokenizer.ggml.%s=%d is outside the vocabulary; ignored", key, value)
                return None
            return value

        bos, eos = tid("bos_token_id"), tid("eos_token_id")
        pad, unk = tid("padding_token_id"), tid("unknown_token_id")
        eot, eom = tid("eot_token_id"), tid("eom_token_id")
        pre = gguf_get(reader, "tokenizer.ggml.pre")
        add_bos_flag = gguf_get(reader, "tokenizer.ggml.add_bos_token")

        if model == "gpt2":
            backend, pieces, strip = build_gguf_bpe(tokens, types, reader, pre)
            add_bos_default = pre in ADD_BOS_PRE
        elif model == "llama":
            backend, pieces, strip = build_gguf_spm(tokens, types, reader, unk)
            add_bos_default = True
        else:
            raise ValueError(f"unsupported GGUF tokenizer model {model!r} (tokenizer.ggml.model); "
                             "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)")
        add_bos = bool(add_bos_flag) if add_bos_flag is not None else add_bos_default

        template = gguf_get(reader, "tokenizer.chat_template")
        named: dict[str, str] = {}
        for name in gguf_get(reader, "tokenizer.chat_templates") or []:
            value = gguf_get(reader, f"tokenizer.chat_template.{name}")
            if isinstance(value, str):
                named[name] = value
        if template is not None:
            named.setdefault("default", template)

        specials = [i for i, t in enumerate(types) if t in (TT_CONTROL, TT_UNKNOWN)]
        stops = [i for i in (eos, eot, eom) if i is not None]
        return cls(backend, vocab_size=n, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
                   unk_token_id=unk, stop_token_ids=stops, add_bos_token=add_bos,
                   chat_template=template, named_chat_templates=named, special_ids=specials,
                   id_to_text=tokens, piece_bytes=pieces, strip_leading_space=strip,
                   source=source or f"gguf:{model}/{pre}")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def tokenizer_from_spec(spec: str | os.PathLike) -> Tokenizer:
    """The tokenizer a --tokenizer flag names: a .gguf (or other) file, an HF folder, or a repo
    id in the local Hugging Face cache. ValueError when it is none of them."""
    from .hf_cache import cached_snapshot, looks_like_repo_id
    spec = os.fspath(spec)
    if os.path.isfile(spec):
        return Tokenizer.from_gguf_file(spec)
    if os.path.isdir(spec):
        return Tokenizer.from_hf_dir(spec)
    snapshot = cached_snapshot(spec) if looks_like_repo_id(spec) else None
    if snapshot is None:
        raise ValueError(f"tokenizer {spec!r} is neither a file, a folder nor a repo id in the "
                         "local Hugging Face cache")
    return Tokenizer.from_hf_dir(snapshot)


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


def _decoder_kinds(section: Any) -> set[str]:
    """The types of a tokenizer.json decoder (or pre-tokenizer) and of those in its Sequence."""
    if not isinstance(section, dict):
        return set()
    kinds = {str(section.get("type"))}
    for d in (section.get("decoders") or []) + (section.get("pretokenizers") or []):
        kinds |= _decoder_kinds(d)
    return kinds


def _backend_token_bytes(backend: _HFTokenizer, vocab_size: int) -> list[bytes]:
    """Each id's bytes from a tokenizers backend: byte-level BPE spells bytes as characters
    (GPT-2's alphabet); SentencePiece-style vocabularies write a space as "▁" and bytes as
    <0xNN>; added tokens are their own text."""
    spec = json.loads(backend.to_str())
    # (a ByteLevel pre-tokenizer spells bytes so too, where the file has no decoder section)
    kinds = _decoder_kinds(spec.get("decoder")) | (
        {"ByteLevel"} & _decoder_kinds(spec.get("pre_tokenizer")))
    added = {int(t["id"]): t["content"] for t in spec.get("added_tokens") or []}
    out: list[bytes] = []
    for i in range(vocab_size):
        tok = backend.id_to_token(i)
        if tok is None:
            out.append(b"")
        elif i in added:
            out.append(added[i].encode("utf-8"))
        elif "ByteLevel" in kinds:
            out.append(byte_level_bytes(tok))
        elif "ByteFallback" in kinds and (m := BYTE_TOKEN_RE.fullmatch(tok)):
            out.append(bytes([int(m.group(1), 16)]))
        elif "Metaspace" in kinds or "Replace" in kinds or "ByteFallback" in kinds:
            out.append(tok.replace(SPIECE_SPACE, " ").encode("utf-8"))
        else:
            out.append(backend.decode([i], skip_special_tokens=False).encode("utf-8"))
    return out

