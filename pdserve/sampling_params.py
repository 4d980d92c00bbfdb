"""User-facing sampling parameters (vLLM / OpenAI compatible subset).

A frozen dataclass validated on construction: every bad value raises ``ValueError`` whose message
names the field and the offending value. Normalisations done in ``__post_init__``:

* ``top_k=None`` -> ``-1`` (disabled);
* ``stop`` (None, str or list of str) -> ``tuple[str, ...]`` (empty when None);
* ``stop_token_ids`` (None or list of int) -> ``tuple[int, ...]`` (empty when None);
* ``logit_bias`` (None or a mapping token id -> bias) -> a new ``dict[int, float]``, or None when
  empty;
* ints passed as floats where a float is expected are converted to ``float``;
* ``structured_outputs`` (None or a StructuredOutputsParams) -> None when it asks for nothing.

Turning a batch of these into tensors happens in exactly one place:
``pdserve.layers.sampler.SamplingBatch.build``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .checks import is_int, is_number

# Temperatures below this are treated as greedy (argmax) sampling.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20
# OpenAI's bound on a logit_bias value: -100 bans a token in practice, 100 all but forces it.
MAX_LOGIT_BIAS = 100.0


# StructuredOutputsParams' constraints, each a field of it
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's names): exactly one of

    * ``json``: a JSON schema (a dict, or its JSON text): the output is one JSON value that
      validates against it;
    * ``json_object=True``: any JSON object (OpenAI's ``response_format: json_object``);
    * ``regex``: the whole output matches the regular expression;
    * ``choice``: the output is one of these strings;
    * ``grammar``: a context-free grammar in Lark syntax (or GBNF, llama.cpp's, recognised by
      its ``::=`` rules).

    The schema is kept as JSON text in the order it was given (properties are generated in
    that order); equal texts share one compiled grammar. Whether the grammar engine can compile it is checked when the request is added
    (ValueError there), not here."""
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, "
                             f"grammar, json_object; got {given or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object), got "
                                 f"{type(schema).__name__}")
            try:
                set_(self, "json", json.dumps(schema, ensure_ascii=False))
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs.json is not JSON-serialisable: {e}") from None
        for field in ("regex", "grammar"):
            v = getattr(self, field)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{field} must be a non-empty string, "
                                 f"got {v!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) \
                    or not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 f"non-empty strings, got {self.choice!r}")
            set_(self, "choice", tuple(self.choice))
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got "
                             f"{self.json_object!r}")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def from_mapping(cls, fields: Mapping[str, Any]) -> "StructuredOutputsParams":
        """From a JSON object (vLLM's structured_outputs); ValueError for a field it lacks."""
        unknown = sorted(set(fields) - set(STRUCTURED_OUTPUT_KINDS))
        if unknown:
            raise ValueError(f"structured_outputs has unsupported fields {unknown}: unknown "
                             f"fields are refused (supported: {', '.join(STRUCTURED_OUTPUT_KINDS)})")
        return cls(**fields)

    @property
    def key(self) -> tuple:
        """Equal for equal constraints (the compiled-grammar cache's key)."""
        return (self.kind, getattr(self, self.kind))


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None   # logprob of each prompt token (+ top-k) given its prefix
    skip_special_tokens: bool = True
    # token id -> added to its logit before penalties and sampling (OpenAI's logit_bias; the
    # returned logprobs stay the model's own)
    logit_bias: Mapping[int, float] | None = None
    # a constraint on the output (JSON schema, regex, choice, grammar): the sampler masks the
    # tokens that would break it (pdserve/structured)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: normalise through object.__setattr__

        def bad(field: str, value, why: str):
            raise ValueError(f"{field} {why}, got {value!r}")

        # ---- integers -------------------------------------------------------------------------
        if not is_int(self.n) or self.n < 1:
            bad("n", self.n, "must be an integer >= 1")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        top_k = -1 if self.top_k is None else self.top_k
        if not is_int(top_k) or top_k == 0 or top_k < -1:
            bad("top_k", self.top_k, "must be -1/None (disabled) or an integer >= 1")
        set_(self, "top_k", top_k)
        if self.logprobs is not None and (
                not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", self.logprobs, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (
                not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad("prompt_logprobs", self.prompt_logprobs,
                f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", self.seed, "must be None or an integer")

        # ---- floats (comparisons written so that NaN fails them) ------------------------------
        def number(field: str) -> float:
            v = getattr(self, field)
            if not is_number(v):
                bad(field, v, "must be a number")
            v = float(v)
            set_(self, field, v)
            return v

        t = number("temperature")
        if not (0.0 <= t < math.inf):
            bad("temperature", self.temperature, "must be a finite number >= 0")
        p = number("top_p")
        if not (0.0 < p <= 1.0):
            bad("top_p", self.top_p, "must be in (0, 1]")
        mp = number("min_p")
        if not (0.0 <= mp <= 1.0):
            bad("min_p", self.min_p, "must be in [0, 1]")
        rp = number("repetition_penalty")
        if not (0.0 < rp < math.inf):
            bad("repetition_penalty", self.repetition_penalty, "must be a finite number > 0")
        for field in ("presence_penalty", "frequency_penalty"):
            v = number(field)
            if not (-2.0 <= v <= 2.0):
                bad(field, getattr(self, field), "must be in [-2, 2]")

        # ---- stop strings / stop token ids ----------------------------------------------------
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)):
            stop = tuple(stop)
        else:
            bad("stop", self.stop, "must be None, a string or a list of strings")
        for s in stop:
            if not isinstance(s, str):
                bad("stop", self.stop, "entries must be strings")
            if not s:
                bad("stop", self.stop, "entries must be non-empty strings")
        set_(self, "stop", stop)

        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        elif isinstance(ids, (list, tuple)):
            ids = tuple(ids)
        else:
            bad("stop_token_ids", self.stop_token_ids, "must be None or a list of integers")
        for i in ids:
            if not is_int(i) or i < 0:
                bad("stop_token_ids", self.stop_token_ids, "entries must be integers >= 0")
        set_(self, "stop_token_ids", ids)

        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, Mapping):
                bad("logit_bias", bias, "must be None or a mapping of token ids to numbers")
            norm = {}
            for tok, v in bias.items():
                if not is_int(tok) or tok < 0:
                    bad("logit_bias", bias, f"keys must be token ids (integers >= 0); {tok!r} "
                                            "is not")
                if not is_number(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                    bad("logit_bias", bias, f"values must be numbers in [-100, 100]; token "
                                            f"{tok}'s is {v!r}")
                norm[int(tok)] = float(v)
            set_(self, "logit_bias", norm or None)

        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            if isinstance(so, Mapping):
                so = StructuredOutputsParams.from_mapping(so)
            else:
                bad("structured_outputs", so, "must be None or a StructuredOutputsParams")
            set_(self, "structured_outputs", so)

        for field in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, field), bool):
                bad(field, getattr(self, field), "must be a bool")

    # ---------------------------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        """Greedy (argmax) decoding: temperature 0, or so small it is treated as 0."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalty(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
