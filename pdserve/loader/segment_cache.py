"""Encoding by pieces: a text with added tokens (a rendered chat) is cut at them, and each piece
between two is encoded on its own through a cache of recent pieces. A conversation sends its
whole history with every turn; its earlier messages are then not encoded again (the server's
API process spent about half its samples encoding multi-turn histories: bench/RESULTS.md).

Why the ids are the same as the whole text's: the tokenizers library cuts a text at its added
tokens first (the leftmost, then the longest match) and normalizes, pre-tokenizes and encodes
each piece between them on its own. The ids of the text are then those of its pieces and of the
added tokens, in order, unless some step looks past its piece:
- an added token that eats the whitespace beside it (lstrip / rstrip) or matches whole words
  only (single_word), or that is matched after normalization when there is a normalizer;
- a Metaspace pre-tokenizer that marks only the text's first piece (prepend_scheme "first");
- a backend that encodes added tokens' text as ordinary text (encode_special_tokens).
`SegmentEncoder.for_backend` returns None for such a backend, and for one that encodes its probe
texts differently piecewise (checked once, at the first long text).

The cache is bounded by the characters it holds (least recently used pieces go first) and is
shared by the threads that encode (a lock around it; the encoding itself runs outside it, in
tokenizers' batch call, which releases the GIL).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

MIN_CHARS = 256               # a shorter text is encoded whole (cutting it saves nothing)
MAX_CACHED_CHARS = 2_000_000  # the cache's bound: about 20 MB of pieces and their ids


def _first_only_prefix(section: Any) -> bool:
    """A Metaspace (anywhere in a Sequence) that prefixes only a text's first piece."""
    if isinstance(section, list):
        return any(_first_only_prefix(s) for s in section)
    if not isinstance(section, dict):
        return False
    if section.get("type") == "Metaspace" and section.get("prepend_scheme") == "first":
        return True
    return any(_first_only_prefix(section.get(k)) for k in ("pretokenizers", "normalizers"))


class SegmentEncoder:
    def __init__(self, backend, added: dict[str, int], max_chars: int = MAX_CACHED_CHARS):
        self._backend = backend
        self._added = dict(added)                      # content -> id
        alts = sorted(self._added, key=len, reverse=True)   # (longest first at one position)
        self._split = re.compile("(" + "|".join(map(re.escape, alts)) + ")")
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self.max_chars = max_chars
        self._lock = threading.Lock()
        self.pieces_hit = 0           # counters since start: pieces found in the cache
        self.pieces_encoded = 0       # and pieces encoded

    @classmethod
    def for_backend(cls, backend, max_chars: int = MAX_CACHED_CHARS) -> "SegmentEncoder | None":
        """An encoder for `backend` (a tokenizers.Tokenizer), or None where encoding by pieces
        could give other ids than encoding the whole text (see the module's docstring)."""
        if getattr(backend, "encode_special_tokens", False):
            return None
        spec = json.loads(backend.to_str())
        added = spec.get("added_tokens") or []
        if not added:
            return None
        has_normalizer = spec.get("normalizer") is not None
        for t in added:
            if t.get("single_word") or t.get("lstrip") or t.get("rstrip") \
                    or (t.get("normalized") and has_normalizer) or not t.get("content"):
                return None
        if _first_only_prefix(spec.get("pre_tokenizer")) or _first_only_prefix(spec.get("normalizer")):
            return None
        enc = cls(backend, {t["content"]: int(t["id"]) for t in added}, max_chars)
        return enc if enc._agrees_on_probes() else None

    def _agrees_on_probes(self) -> bool:
        """Pieces and whole texts give the same ids on texts that put added tokens against
        words, spaces, newlines and non-ASCII text on both sides."""
        toks = sorted(self._added, key=lambda s: self._added[s])[:4]
        glue = ["", " ", "  ", "\n", "\n\n", " \n ", "x", " word", "Ünï ", "\t"]
        texts = []
        for i, t in enumerate(toks):
            u = toks[(i + 1) % len(toks)]
            for g in glue:
                texts.append(f"{g}{t}{g}user{g}\nHello, there.{g}{u}{g}{t}{g} end{g}")
        whole = [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=False)]
        return all(self._encode(s, cache=False) == w for s, w in zip(texts, whole))

    def encode(self, text: str) -> list[int]:
        """The ids of `text` (no special tokens added): pieces from the cache where it has them.
        A text without added tokens is encoded whole, uncached."""
        return self._encode(text, cache=True)

    def _encode(self, text: str, cache: bool) -> list[int]:
        parts = self._split.split(text)     # piece, token, piece, ..., token, piece
        if len(parts) == 1:
            return self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        found: list[tuple[int, ...] | None] = [None] * len(parts)
        missing = []
        with self._lock:
            for i in range(0, len(parts), 2):
                piece = parts[i]
                if not piece:
                    found[i] = ()
                    continue
                hit = self._cache.get(piece) if cache else None
                if hit is None:
                    missing.append(i)
                else:
                    self._cache.move_to_end(piece)
                    found[i] = hit
            if cache:
                self.pieces_hit += (len(parts) + 1) // 2 - len(missing)
                self.pieces_encoded += len(missing)
        if missing:
            encs = self._backend.encode_batch([parts[i] for i in missing], add_special_tokens=False)
            with self._lock:
                for i, e in zip(missing, encs):
                    found[i] = ids = tuple(e.ids)
                    if cache:
                        self._put(parts[i], ids)
        out: list[int] = []
        added = self._added
        for i, part in enumerate(parts):
            if i % 2:
                out.append(added[part])
            else:
                out.extend(found[i])
        return out

    def _put(self, piece: str, ids: tuple[int, ...]) -> None:
        if len(piece) > self.max_chars // 8 or piece in self._cache:
            return                          # (a huge piece would push out everything else)
        self._cache[piece] = ids
        self._chars += len(piece)
        while self._chars > self.max_chars:
            old, _ = self._cache.popitem(last=False)
            self._chars -= len(old)

    @property
    def cached_chars(self) -> int:
        return self._chars

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self._chars = 0
