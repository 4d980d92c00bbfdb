"""pdserve bench grammar: the grammar engines for structured outputs side by side, on one
tokenizer (default: the embedded model's).

For each engine (xgrammar, llguidance), on the same seeded random JSON schemas:

* tokenizer set-up (once per model; ms);
* compile time per schema (ms, cold: every schema is new), and the schemas it refused;
* per decode step: the mask of the next token (ms) and advancing by the chosen token (ms), on a
  walk that picks a random allowed token each step (EOS as soon as the grammar allows it, with
  probability --eos-prob), up to --max-steps steps;
* whether the text of every walk that ended parses as JSON and validates against its schema
  (jsonschema, when installed).

    pdserve bench grammar --schemas 100 --output bench/results/grammar-engines-cpu.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from typing import Any

import torch

from .common import run_described, write_result


# ---- random JSON schemas -------------------------------------------------------------------------
def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A JSON schema of the shapes applications send: objects with required properties, arrays,
    enums, strings with lengths or formats, bounded numbers, nested up to depth 3."""
    kinds = ["string", "integer", "number", "boolean", "enum"]
    if depth < 3:
        kinds += ["object", "object", "array"]
    kind = rng.choice(kinds)
    if kind == "object":
        names = rng.sample(["name", "age", "id", "city", "tags", "score", "items", "kind", "note",
                            "valid", "count", "title", "meta", "value"], rng.randint(1, 4))
        props = {n: random_schema(rng, depth + 1) for n in names}
        req = [n for n in names if rng.random() < 0.7]
        s: dict[str, Any] = {"type": "object", "properties": props, "required": req}
        if rng.random() < 0.5:
            s["additionalProperties"] = False
        return s
    if kind == "array":
        s = {"type": "array", "items": random_schema(rng, depth + 1)}
        if rng.random() < 0.5:
            s["minItems"] = rng.randint(0, 2)
            s["maxItems"] = s["minItems"] + rng.randint(0, 3)
        return s
    if kind == "string":
        s = {"type": "string"}
        r = rng.random()
        if r < 0.3:
            s["maxLength"] = rng.randint(1, 12)
        elif r < 0.4:
            s["pattern"] = rng.choice(["^[a-z]+$", "^[0-9]{3}-[0-9]{4}$", "^(yes|no)$"])
        elif r < 0.5:
            s["format"] = rng.choice(["date", "email", "uuid"])
        return s
    if kind == "integer":
        s = {"type": "integer"}
        if rng.random() < 0.5:
            s["minimum"] = rng.randint(-100, 0)
            s["maximum"] = rng.randint(1, 1000)
        return s
    if kind == "number":
        return {"type": "number"}
    if kind == "boolean":
        return {"type": "boolean"}
    return {"enum": rng.sample(["red", "green", "blue", "cyan", 1, 2, None, True], rng.randint(1, 4))}


# Schemas with keywords an engine may not enforce: does it compile them (and then enforce them:
# see the walks) or refuse them with an error?
FEATURE_CASES: dict[str, Any] = {
    "unknown type": {"type": "foo"},
    "recursive $ref": {"$defs": {"n": {"type": "object", "properties": {
        "c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"},
    "missing $ref": {"$ref": "#/$defs/missing"},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"required": ["a"]}]},
    "const": {"const": 5},
    "minimum > maximum": {"type": "integer", "minimum": 5, "maximum": 1},
    "bad pattern": {"type": "string", "pattern": "(["},
    "not": {"not": {"type": "string"}},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "if/then": {"if": {"type": "string"}, "then": {"maxLength": 3}},
    "contains": {"type": "array", "contains": {"type": "integer"}},
}


# ---- engines -----------------------------------------------------------------------------------
class _Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        import xgrammar as xg
        self.xg = xg
        # raw bytes per id; special tokens are b"" (xgrammar never allows those but the stops)
        self.info = xg.TokenizerInfo(tokenizer.token_bytes(), xg.VocabType.RAW,
                                     vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.compiler = xg.GrammarCompiler(self.info, max_threads=1)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xg.GrammarMatcher(compiled)

    def fill(self, m, bitmask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(bitmask, 0)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()


class _Llguidance:
    """The engine as pdserve serves with it: structured.grammar.GrammarCompiler."""
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        from ..sampling_params import StructuredOutputsParams
        from ..structured.grammar import GrammarCompiler
        self.spec = StructuredOutputsParams
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_ids)
        self.compiler.prepare()

    def compile(self, schema: dict):
        return self.spec(json=schema)

    def matcher(self, spec):
        return self.compiler.matcher(spec)    # (compiles: a new schema is not in the cache)

    def fill(self, m, bitmask: torch.Tensor) -> None:
        self.compiler.fill_bitmask([(m, 0)], bitmask)

    def accept(self, m, token: int) -> bool:
        return m.accept(token)

    def done(self, m) -> bool:
        return m.done


ENGINES = {"xgrammar": _Xgrammar, "llguidance": _Llguidance}


def _allowed(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    words = bitmask[0]
    bits = (words.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()


def run_engine(cls, tokenizer, vocab_size: int, stop_ids: list[int], schemas: list[dict],
               args) -> dict[str, Any]:
    t0 = time.perf_counter()
    eng = cls(tokenizer, vocab_size, stop_ids)
    setup_ms = (time.perf_counter() - t0) * 1e3
    rng = random.Random(args.seed)
    compile_ms, mask_ms, accept_ms, refused, ended, parsed, valid, rejected = \
        [], [], [], [], 0, 0, 0, 0
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    bitmask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
    for i, schema in enumerate(schemas):
        t = time.perf_counter()
        try:
            compiled = eng.compile(schema)
            m = eng.matcher(compiled)
        except Exception as e:  # noqa: BLE001 - each engine raises its own kinds
            refused.append({"schema": i, "error": str(e)[:200]})
            continue
        compile_ms.append((time.perf_counter() - t) * 1e3)
        out: list[int] = []
        for _ in range(args.max_steps):
            t = time.perf_counter()
            eng.fill(m, bitmask)
            mask_ms.append((time.perf_counter() - t) * 1e3)
            allowed = _allowed(bitmask, vocab_size)
            stops = [a for a in allowed if a in stop_ids]
            if stops and (rng.random() < args.eos_prob or len(stops) == len(allowed)):
                tok = stops[0]
            else:
                tok = rng.choice([a for a in allowed if a not in stop_ids])
            t = time.perf_counter()
            ok = eng.accept(m, tok)
            accept_ms.append((time.perf_counter() - t) * 1e3)
            if not ok:
                rejected += 1
                break
            if tok in stop_ids:
                break
            out.append(tok)
            if eng.done(m):   # (llguidance stops once nothing but a stop token can follow)
                break
        else:
            continue
        if not ok:
            continue
        ended += 1
        text = tokenizer.decode(out)
        try:
            value = json.loads(text)
        except ValueError:
            continue
        parsed += 1
        if jsonschema is not None:
            try:
                jsonschema.validate(value, schema)
                valid += 1
            except jsonschema.ValidationError:
                pass

    def summary(xs: list[float]) -> dict[str, float]:
        if not xs:
            return {}
        s = sorted(xs)
        return {"mean": statistics.fmean(s), "p50": s[len(s) // 2],
                "p99": s[min(len(s) - 1, int(len(s) * 0.99))], "max": s[-1], "n": len(s)}

    features = {}
    for name, schema in FEATURE_CASES.items():
        try:
            eng.matcher(eng.compile(schema))
            features[name] = "compiled"
        except Exception as e:  # noqa: BLE001
            features[name] = "refused: " + " ".join(str(e).split())[:120]
    return {"engine": eng.name, "features": features, "setup_ms": setup_ms, "compile_ms": summary(compile_ms),
            "mask_ms": summary(mask_ms), "accept_ms": summary(accept_ms),
            "schemas": len(schemas), "refused": refused, "walks_ended": ended,
            "walks_parsed": parsed, "walks_valid": valid if jsonschema is not None else None,
            "tokens_rejected_after_mask": rejected}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench grammar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="model whose tokenizer to use (default: the embedded SmolLM2-135M)")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES),
                   help="grammar engines to measure (default: both)")
    p.add_argument("--schemas", type=int, default=100, help="random JSON schemas (default 100)")
    p.add_argument("--max-steps", type=int, default=256,
                   help="tokens per walk at most (default 256)")
    p.add_argument("--eos-prob", type=float, default=0.5,
                   help="chance of taking EOS when the grammar allows it (default 0.5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the schemas and walks")
    p.add_argument("--output", default="bench/results/grammar-engines-cpu.json",
                   help="the result JSON (default bench/results/grammar-engines-cpu.json)")
    return p


def run(args) -> dict[str, Any]:
    from ..loader.model_loader import load_tokenizer, resolve_source
    tok = load_tokenizer(resolve_source(args.model))
    vocab = tok.vocab_size
    stop_ids = sorted(tok.stop_token_ids | ({tok.eos_token_id} - {None}))
    rng = random.Random(args.seed)
    schemas = [random_schema(rng) for _ in range(args.schemas)]
    results = []
    for name in args.engines:
        if importlib.util.find_spec(name) is None:
            raise ValueError(f"{name} is not installed (pip install {name})")
        r = run_engine(ENGINES[name], tok, vocab, stop_ids, schemas, args)
        results.append(r)
        c, m = r["compile_ms"], r["mask_ms"]
        print(f"{name:>11}: set-up {r['setup_ms']:.0f} ms; compile mean {c.get('mean', 0):.2f} "
              f"p99 {c.get('p99', 0):.2f} ms; mask mean {m.get('mean', 0):.3f} p99 "
              f"{m.get('p99', 0):.3f} ms; accept mean {r['accept_ms'].get('mean', 0):.3f} ms; "
              f"refused {len(r['refused'])}; walks ended {r['walks_ended']}, parsed "
              f"{r['walks_parsed']}, valid {r['walks_valid']}; tokens the mask allowed but the "
              f"matcher rejected {r['tokens_rejected_after_mask']}")
    return {"vocab_size": vocab, "stop_token_ids": stop_ids, "results": results}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.schemas < 1 or args.max_steps < 1 or not 0 <= args.eos_prob <= 1:
        print("error: --schemas and --max-steps must be >= 1, --eos-prob in [0, 1]",
              file=sys.stderr)
        return 2
    payload = run_described("grammar", run, args, argv, args.output)
    if payload is None:
        return 1
    print(f"wrote {os.path.abspath(write_result(args.output, payload))}")
    return 0
