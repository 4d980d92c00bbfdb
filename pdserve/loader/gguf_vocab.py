"""``tokenizers`` backends built from a GGUF vocabulary (the ``tokenizer.ggml.*`` keys written by
llama.cpp's converter), with the per-id byte table GGUF decoding uses.

``tokenizer.ggml.model == "gpt2"`` is byte-level BPE: the pre-tokenizer regexes of
``tokenizer.ggml.pre`` (pretokenizers.py), then GPT-2's byte-level alphabet.

``tokenizer.ggml.model == "llama"`` is SentencePiece-style BPE: pieces are merged greedily by the
score of the merged piece, unknown characters fall back to ``<0xXX>`` byte tokens, spaces are
written as U+2581 and (unless ``tokenizer.ggml.add_space_prefix`` is false) a space is prepended to
the text.  It is built as a ``tokenizers`` BPE model whose merge ranks are derived from the scores.

Tokens of GGUF type CONTROL (3) and USER_DEFINED (4) are registered as added tokens, so they are
matched whole in the input text (``"<|im_start|>"`` -> one id), like llama.cpp does.  Their GGUF
text is the raw text (not byte-level spelled), so GGUF decoding is done from a per-id byte table
(the ``pieces`` each builder returns) instead of through a ``tokenizers`` decoder.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Sequence

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from .gguf_kv import gguf_get
from .pretokenizers import IGNORE_MERGES_PRE, pre_tokenizer_regexes

__all__ = ["build_gguf_bpe", "build_gguf_spm", "TT_NORMAL", "TT_UNKNOWN", "TT_CONTROL",
           "TT_USER_DEFINED", "TT_UNUSED", "TT_BYTE"]

logger = logging.getLogger(__name__)

# GGUF token types (gguf.TokenType / llama_token_type)
TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = 1, 2, 3, 4, 5, 6

SPIECE_SPACE = "\u2581"  # "▁", SentencePiece's visible space

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


def byte_level_bytes(token: str) -> bytes:
    """Bytes a byte-level-spelled token stands for (raw UTF-8 if it is not byte-level spelled)."""
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


BYTE_TOKEN_RE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def add_gguf_added_tokens(backend: _HFTokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    special, plain = [], []
    for token, ttype in zip(tokens, types):
        if not token:
            continue
        if ttype == TT_CONTROL:
            special.append(AddedToken(token, special=True, normalized=False))
        elif ttype == TT_USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)


def build_gguf_bpe(tokens: list[str], types: list[int], reader: Any, pre: str | None
                    ) -> tuple[_HFTokenizer, list[bytes], bool]:
    """Byte-level BPE (tokenizer.ggml.model == "gpt2")."""
    merges_raw = gguf_get(reader, "tokenizer.ggml.merges")
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

    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in IGNORE_MERGES_PRE)
    backend = _HFTokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre_tokenizer_regexes(pre)]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    add_gguf_added_tokens(backend, tokens, types)

    pieces = [token.encode("utf-8") if ttype in (TT_CONTROL, TT_USER_DEFINED) else byte_level_bytes(token)
              for token, ttype in zip(tokens, types)]
    return backend, pieces, False


def build_gguf_spm(tokens: list[str], types: list[int], reader: Any, unk: int | None
                    ) -> tuple[_HFTokenizer, list[bytes], bool]:
    """SentencePiece-style BPE (tokenizer.ggml.model == "llama").

    SentencePiece BPE repeatedly merges the adjacent pair whose concatenation is the vocabulary
    piece with the highest score.  A BPE model whose merges (every split of every mergeable piece
    into two vocabulary pieces) are ranked by the merged piece's score does the same, up to ties.
    """
    scores = gguf_get(reader, "tokenizer.ggml.scores")
    if scores is None:
        raise ValueError("GGUF SentencePiece tokenizer has no tokenizer.ggml.scores")
    scores = [float(s) for s in scores]
    add_space_prefix = gguf_get(reader, "tokenizer.ggml.add_space_prefix")
    add_space_prefix = True if add_space_prefix is None else bool(add_space_prefix)

    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    mergeable = {t for t, i in vocab.items() if types[i] in (TT_NORMAL, TT_USER_DEFINED, TT_UNUSED)}
    candidates: list[tuple[float, int, int, str, str]] = []
    for token in mergeable:
        tid_ = vocab[token]
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in mergeable and right in mergeable:
                candidates.append((-scores[tid_], tid_, cut, left, right))
    candidates.sort()
    merges = [(left, right) for _, _, _, left, right in candidates]

    has_bytes = any(t == TT_BYTE for t in types)
    bpe = models.BPE(vocab=vocab, merges=merges,
                     unk_token=tokens[unk] if unk is not None else None,
                     fuse_unk=True, byte_fallback=has_bytes)
    backend = _HFTokenizer(bpe)
    steps = [normalizers.Replace(" ", SPIECE_SPACE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPIECE_SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    add_gguf_added_tokens(backend, tokens, types)

    pieces: list[bytes] = []
    for token, ttype in zip(tokens, types):
        if ttype == TT_BYTE:
            m = BYTE_TOKEN_RE.fullmatch(token)
            pieces.append(bytes([int(m.group(1), 16)]) if m else token.encode("utf-8"))
        elif ttype in (TT_CONTROL, TT_UNKNOWN):
            pieces.append(token.encode("utf-8"))
        else:
            pieces.append(token.replace(SPIECE_SPACE, " ").encode("utf-8"))
    return backend, pieces, add_space_prefix
