"""Structured outputs: the grammar engine behind one small contract.

    compiler = GrammarCompiler(tokenizer, vocab_size)  # one per engine: the model's vocabulary
    compiler.check(spec)          # ValueError when the constraint cannot be compiled (add time)
    m = compiler.matcher(spec)    # a Matcher per sequence, at the start of the output
    m.accept(token)               # advance by a sampled token (False: the grammar refused it)
    fill_bitmask([(m, row), ...], bitmask)   # the next token's mask of each row, in parallel

A bitmask is an int32 host tensor [B, ceil(V / 32)]: bit j of word w allows token 32 w + j. A
matcher that has stopped (its grammar is complete) or failed allows only the stop tokens, so its
sequence ends at its next token.

The engine is llguidance, chosen by measurement (pdserve bench grammar,
bench/results/grammar-engines-cpu.json; RESULTS.md "Structured outputs"): on 100 random schemas
over the embedded tokenizer both engines' masks kept every walk valid at a like cost (tens of
microseconds a token, far below a decode step), but xgrammar compiled
schemas whose keywords it does not enforce (not, uniqueItems, if/then, contains), so output
could break the schema, while llguidance refuses them with a message (an HTTP 400 here). It is
also one wheel with no dependencies.

JSON is generated compactly (no free whitespace between tokens): a small model given free
whitespace can spend its whole budget on newlines.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Sequence

from ..sampling_params import StructuredOutputsParams

# Distinct constraints whose compiled matcher is kept (LRU).
GRAMMAR_CACHE_SIZE = 256
_JSON_OPTIONS = {"whitespace_flexible": False}
# (errors name the constraint, not the request field: it may have come as response_format,
# structured_outputs, guided_* or a tool choice)
_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
               "choice": "choice", "grammar": "grammar"}


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for a constraint."""
    import llguidance
    M = llguidance.LLMatcher
    kind = spec.kind
    if kind == "json":
        return M.grammar_from_json_schema(spec.json, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return M.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
    if kind == "regex":
        return M.grammar_from_regex(spec.regex)
    if kind == "choice":
        return M.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
    from llguidance.gbnf_to_lark import any_to_lark   # Lark as it is; GBNF (::= rules) converted
    return M.grammar_from_lark(any_to_lark(spec.grammar))


class Matcher:
    """One sequence's place in its grammar."""

    __slots__ = ("_m",)

    def __init__(self, ll_matcher):
        self._m = ll_matcher

    def accept(self, token: int) -> bool:
        """Advance by token; False when the grammar does not allow it (the matcher then allows
        only stop tokens)."""
        return bool(self._m.consume_token(int(token)))

    @property
    def done(self) -> bool:
        """The grammar is complete (only a stop token may follow) or failed."""
        return self._m.is_stopped() or self._m.is_error()

    @property
    def error(self) -> str | None:
        return self._m.get_error() or "failed" if self._m.is_error() else None


class GrammarCompiler:
    """Compiles constraints for one vocabulary; thread-safe (the engine checks requests while
    the runner makes matchers, in one process). tokenizer: pdserve's Tokenizer (its
    token_bytes() and encode()); vocab_size: the model's (the logits' width, which may exceed
    the tokenizer's); stop_token_ids: what ends a sequence (the first is the grammar's EOS)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        if not stop_token_ids:
            raise ValueError("structured outputs need a stop token (the model's EOS)")
        self._tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self._ll_tokenizer = None
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = None

    @property
    def bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def prepare(self) -> None:
        """Build the engine's view of the vocabulary now (else at the first constraint)."""
        self._ll()

    def _ll(self):
        with self._lock:
            return self._ll_locked()

    def _ll_locked(self):
        if self._ll_tokenizer is None:   # ~1-3 s for a 50k-150k vocabulary: built once
            import llguidance
            self._ll_tokenizer = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_Vocabulary(self._tokenizer, self.stop_token_ids,
                                                        self.vocab_size)),
                n_vocab=self.vocab_size, eos_token=list(self.stop_token_ids))
        return self._ll_tokenizer

    def _compiled(self, spec: StructuredOutputsParams):
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        import llguidance
        try:
            text = grammar_text(spec)
        except Exception as e:  # noqa: BLE001 - the converters raise their own kinds
            raise ValueError(f"the output constraint ({_KIND_NAMES[spec.kind]}) cannot be "
                             f"compiled: {_one_line(e)}") from None
        m = llguidance.LLMatcher(self._ll(), text, log_level=0)
        if m.is_error():
            raise ValueError(f"the output constraint ({_KIND_NAMES[spec.kind]}) cannot be "
                             f"compiled: {_one_line(m.get_error())}")
        with self._lock:
            self._cache[key] = m
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return m

    def check(self, spec: StructuredOutputsParams) -> None:
        """ValueError (with the engine's reason) when spec cannot be compiled."""
        self._compiled(spec)

    def matcher(self, spec: StructuredOutputsParams) -> Matcher:
        return Matcher(self._compiled(spec).deep_copy())

    def fill_bitmask(self, rows: Sequence[tuple[Matcher, int]], bitmask) -> None:
        """Write the next-token mask of each (matcher, row) into bitmask (an int32 CPU tensor
        [B, bitmask_words], contiguous); the other rows are left as they are."""
        if not rows:
            return
        words = bitmask.shape[1]
        if words != self.bitmask_words or not bitmask.is_contiguous():
            raise ValueError(f"bitmask must be contiguous with {self.bitmask_words} words a row")
        if len(rows) == 1:
            m, row = rows[0]
            m._m.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * words * 4, words * 4)
            return
        if self._executor is None:
            import llguidance
            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr([(m._m, row) for m, row in rows],
                                               bitmask.data_ptr(), words * 4, bitmask.shape[0])


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: each id's bytes, the special ids, EOS and an
    encoder (it tokenizes the grammar's literal strings with it). Ids past the tokenizer's
    vocabulary (a model's padded embedding rows) are special: never allowed."""

    def __init__(self, tokenizer, stop_token_ids: Sequence[int], vocab_size: int):
        tokens = list(tokenizer.token_bytes()[:vocab_size])
        n = len(tokens)
        self.tokens = tokens + [b""] * (vocab_size - n)
        self.eos_token_id = stop_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted({i for i in tokenizer.special_token_ids if i < vocab_size}
                                        | set(range(n, vocab_size)))
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def _one_line(e) -> str:
    return " ".join(str(e).split())[:500]
