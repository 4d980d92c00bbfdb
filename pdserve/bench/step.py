"""`pdserve bench step`: what one engine step costs, and how much of it is the host's.

Three kinds of step are timed, each on its own, through the public engine API
(`LLM(...).llm_engine`: add_request / step / abort_request):

    prefill  one request of N prompt tokens, nothing else running: the one step that
             prefills it (a fresh random prompt every rep; the request is aborted after)
    decode   B requests at context C, prefilled first; then decode-only steps
    mixed    B requests decoding at context C plus one new prompt of --chunk tokens
             scheduled in the same step (aborted after); each rep also times one
             decode-only step at the same B just before it, for the ratio

Decode and mixed rows then run the same number of steps again, queued as a server runs them
(async scheduling for their duration: the host prepares a step while the device runs the one
before; a mixed step gets a fresh prompt each): queued_wall_ms is their period, queued_gpu_ms
the median device bracket of those started behind another step. A synced step's bracket also
holds the device's idle time while the host stages its inputs and sets up sampling; a queued
one's does not, so queued_gpu_ms is the device time a busy server's steps take.

Every timed step has a device sync before and after it; wall_ms is the host's
perf_counter around step() with those syncs, gpu_ms the CUDA-event time (forward through
sampling) from the engine's StepRecord (None on CPU), host_share = 1 - gpu_ms / wall_ms.
Each timed step (warm-up ones too) is checked against its StepRecord: exactly one record,
with the prefill tokens, prefill and decode sequences and empty queue the row means. A step that
does not match makes the row an error (its message says what ran instead); it is never
recorded as if it were the step meant.

Row fields: model, kind, num_tokens (prompt tokens the step fed: N, 0 or the chunk),
num_decodes (decoding sequences: 0 or B), context (C, the decoding requests' prompt length;
0 for prefill; the requests prefilled first have decoded a few tokens more by the time the
timed steps start, at most the number of prefill steps; decode and mixed rows also carry
ctx_sum, the tokens the decoding requests attend over in a timed step, read from the engine's
scheduler, mean over the reps), wall_ms with
wall_ms_p10 / wall_ms_p90, gpu_ms, host_share, reps; record_wall_ms (the engine's own
step time, without the syncs) and `samples` (each timed rep's numbers); mixed rows add
decode_wall_ms / decode_gpu_ms / mixed_over_decode; decode and mixed rows carry queued_wall_ms,
queued_gpu_ms, queued_reps and queued_samples, or queued_error. Rows that do not fit the engine
(token budget, sequence slots, max_model_len, KV pool) carry `skipped` with the reason;
rows whose steps were not the ones meant carry `error`.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import math
import os
import statistics
import sys
import time
from typing import Any

import torch

from ..args import add_engine_args, engine_config
from .common import copy_bandwidth, random_prompts, run_described, sync, write_result

EMBEDDED = "embedded"   # --models name of the embedded SmolLM2 (model=None)
_ENGINE_FLAGS_EXCLUDED = ("--model", "--skip-tokenizer-init", "--tensor-parallel-size",
                          "--distributed-executor-backend", "--disable-custom-all-reduce",
                          "--async-scheduling")


def build_parser() -> argparse.ArgumentParser:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        prog="pdserve bench step",
        description="Time lone prefill, decode-only and mixed engine steps; report host wall "
                    "time, device time and the host's share of each. --max-num-batched-tokens "
                    "and --max-num-seqs default to what the requested rows need; a value given "
                    "is kept and the rows beyond it are skipped (and said so).")
    w = p.add_argument_group("workload")
    w.add_argument("--models", nargs="+", default=None,
                   help="presets (qwen2.5-1.5b, qwen2.5-7b, ...), model paths, or "
                        f"'{EMBEDDED}' (the embedded SmolLM2); default qwen2.5-1.5b on cuda, "
                        f"{EMBEDDED} on cpu")
    w.add_argument("--prefill-tokens", type=int, nargs="*",
                   default=[256, 512, 1024, 2048, 4096, 8192],
                   help="prompt sizes of the lone prefill rows (none: no prefill rows)")
    w.add_argument("--decode-batches", type=int, nargs="*", default=[1, 8, 32, 64, 128, 256],
                   help="batch sizes of the decode-only rows (none: no decode rows)")
    w.add_argument("--context", type=int, default=1024,
                   help="prompt tokens of each decoding request (decode and mixed rows)")
    w.add_argument("--mixed-decodes", type=int, nargs="*", default=[32, 128],
                   help="running decodes of the mixed rows (none: no mixed rows)")
    w.add_argument("--chunk", type=int, default=256,
                   help="prompt tokens of the new request in each mixed step")
    w.add_argument("--reps", type=int, default=20, help="timed steps per row")
    w.add_argument("--warmup", type=int, default=3,
                   help="untimed (but checked) steps per row first")
    add_engine_args(p, exclude=_ENGINE_FLAGS_EXCLUDED)
    # None: sized here to what the rows need (a value given is kept; rows beyond it are skipped)
    p.set_defaults(load_format="dummy", device="cuda" if cuda else "cpu",
                   max_num_batched_tokens=None, max_num_seqs=None)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    o = p.add_argument_group("output")
    o.add_argument("--skip-bandwidth", action="store_true",
                   help="do not measure the device copy bandwidth reported beside the rows")
    o.add_argument("--output", default=None,
                   help="JSON result path (default: bench/results/step-cost-<device type>.json)")
    return p


def check_args(a: argparse.Namespace) -> None:
    for name in ("prefill_tokens", "decode_batches", "mixed_decodes"):
        bad = [v for v in getattr(a, name) if v < 1]
        if bad:
            raise ValueError(f"--{name.replace('_', '-')} values must be >= 1, got {bad}")
    for name in ("context", "chunk", "reps"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.threads is not None and a.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {a.threads}")
    if a.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {a.warmup}")
    for name in ("max_num_batched_tokens", "max_num_seqs"):
        v = getattr(a, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if not (a.prefill_tokens or a.decode_batches or a.mixed_decodes):
        raise ValueError("nothing to time: --prefill-tokens, --decode-batches and "
                         "--mixed-decodes are all empty")


def token_budget(a: argparse.Namespace) -> int:
    """The step budget that admits every requested row: the biggest prefill, the biggest decode
    batch, and each mixed step's decodes plus its chunk."""
    return max([*a.prefill_tokens, *a.decode_batches,
                *(b + a.chunk for b in a.mixed_decodes)])


def seq_slots(a: argparse.Namespace) -> int:
    """Sequence slots that admit every row, a mixed row's queued steps included (b decodes,
    the new prompt, and the one before it until its token is read)."""
    return max([1, *a.decode_batches, *(b + 2 for b in a.mixed_decodes)])


def _unmeant(rec, want: dict[str, int]) -> str:
    """The fields of a StepRecord that differ from what its row means ("" when none)."""
    return ", ".join(f"{k}={getattr(rec, k)} (meant {v})" for k, v in want.items()
                     if getattr(rec, k) != v)


class StepMismatch(Exception):
    """A timed step was not the step its row means."""


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * p / 100))]


class StepBench:
    """The rows of one model on one engine."""

    def __init__(self, llm, args: argparse.Namespace, label: str):
        from pdserve import SamplingParams
        self._sp = SamplingParams
        self.eng = llm.llm_engine
        for name in ("add_request", "step", "abort_request", "take_step_records"):
            if not hasattr(self.eng, name):
                raise ValueError(f"the engine ({type(self.eng).__name__}) has no {name}(); "
                                 "bench step needs the in-process engine")
        self.args = args
        self.label = label
        self.device = self.eng.config.torch_device
        self.budget = self.eng.config.max_num_batched_tokens
        self.max_seqs = self.eng.config.max_num_seqs
        self.block_size = self.eng.config.block_size
        self.vocab = self.eng.vocab_size
        self._seeds = itertools.count((args.seed % (1 << 32)) * 1_000_003)
        self._ids = itertools.count()

    # ---- one timed step ---------------------------------------------------------------------
    def _prompts(self, num: int, length: int) -> list[list[int]]:
        return random_prompts(num, length, length + 1, self.vocab, next(self._seeds))

    def _add(self, prompt: list[int], max_tokens: int) -> str:
        rid = f"step-{next(self._ids)}"
        self.eng.add_request(rid, {"prompt_token_ids": prompt},
                             self._sp(temperature=0, ignore_eos=True, max_tokens=max_tokens))
        return rid

    def _timed_step(self, want: dict[str, int]):
        """(wall ms, the step's StepRecord); StepMismatch unless exactly one step ran and its
        record has the fields in want."""
        sync(self.device)
        self.eng.take_step_records()   # the earlier steps' records (all settled by the sync)
        t0 = time.perf_counter()
        self.eng.step()
        sync(self.device)
        wall = (time.perf_counter() - t0) * 1e3
        recs = self.eng.take_step_records()
        if len(recs) != 1:
            raise StepMismatch(f"expected the record of one step, got {len(recs)}")
        rec = recs[0]
        bad = _unmeant(rec, want)
        if bad:
            raise StepMismatch("the step ran " + bad)
        return wall, rec

    def _queued(self, want: dict[str, int], steps: int, before_each=None) -> dict[str, Any]:
        """`steps` steps run back to back as a server runs them: async scheduling for their
        duration, so each step() starts its step before it applies the one in flight and the
        host's work for a step overlaps the device's for the step before (before_each() runs
        before every step() call; the request id it returns is aborted at the end if it is
        still there). Returns queued_wall_ms (wall time from the first start to
        the last step's end on the device, per step: the period the host and the device
        sustain together), queued_gpu_ms (the median device bracket of the steps started
        behind another: the device's own period, without the gaps a synced step leaves for
        the host's staging and sampling setup; None on CPU) and queued_reps; or queued_error,
        never a number, when a step was not the one meant or the engine cannot run steps
        asynchronously. One more step runs synchronously after them (it applies the last
        one's tokens) and is not counted."""
        eng = self.eng
        if not hasattr(eng.executor, "execute_async"):
            return {"queued_error": f"the executor ({type(eng.executor).__name__}) cannot "
                                    "start a step asynchronously"}
        sync(self.device)
        eng.take_step_records()
        eng.async_scheduling = True
        added = []
        try:
            t0 = time.perf_counter()
            for _ in range(steps):
                if before_each is not None:
                    added.append(before_each())
                eng.step()
            sync(self.device)
            wall = (time.perf_counter() - t0) * 1e3 / steps
        finally:
            eng.async_scheduling = False
            eng.step()   # applies the step in flight (and runs one more, synchronously)
            sync(self.device)
            eng.abort_request(added)   # (a prompt still queued when a step was not the one meant)
        recs = sorted(eng.take_step_records(), key=lambda r: r.t)
        if len(recs) != steps + 1:
            return {"queued_error": f"expected the records of {steps + 1} steps, got {len(recs)}"}
        for i, rec in enumerate(recs[:steps]):
            bad = _unmeant(rec, want)
            if bad:
                return {"queued_error": f"queued step {i} ran " + bad}
        gpus = [r.gpu_ms for r in recs[1:steps] if r.gpu_ms is not None]
        return {"queued_wall_ms": wall, "queued_reps": steps,
                "queued_gpu_ms": statistics.median(gpus) if gpus else None,
                "queued_samples": {"gpu_ms": [None if r.gpu_ms is None else round(r.gpu_ms, 4)
                                              for r in recs[:steps]],
                                   "t": [r.t for r in recs[:steps]]}}

    def _prefill_steps(self, b: int, context: int | None = None) -> int:
        """At most how many steps prefilling b requests of `context` (default --context) tokens
        takes (the ones done first decode meanwhile, one token a step, out of the budget)."""
        c = self.args.context if context is None else context
        return math.ceil(b * c / max(1, self.budget - b)) + b + 8

    def _prefill_all(self, ids: list[str], context: int | None = None) -> None:
        """Step until every request in ids has its first token."""
        waiting = set(ids)
        limit = self._prefill_steps(len(ids), context)
        for _ in range(limit):
            for out in self.eng.step():
                if out.outputs and out.outputs[0].token_ids:
                    waiting.discard(out.request_id)
            if not waiting:
                return
        raise StepMismatch(f"{len(waiting)} of {len(ids)} requests had no first token after "
                           f"{limit} steps")

    # ---- fits -------------------------------------------------------------------------------
    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _unfit(self, *, step_tokens: int, seqs: int, seq_len: int, blocks: int) -> str | None:
        """Why a row cannot run on this engine (None: it fits)."""
        why = []
        if step_tokens > self.budget:
            why.append(f"its step feeds {step_tokens} tokens > max_num_batched_tokens "
                       f"{self.budget}")
        if seqs > self.max_seqs:
            why.append(f"it runs {seqs} sequences > max_num_seqs {self.max_seqs}")
        if seq_len > self.eng.max_model_len:
            why.append(f"its sequences reach {seq_len} tokens > max_model_len "
                       f"{self.eng.max_model_len}")
        if blocks > self.eng.num_kv_blocks:
            why.append(f"it needs {blocks} KV blocks > the pool's {self.eng.num_kv_blocks}")
        return "; ".join(why) or None

    # ---- rows -------------------------------------------------------------------------------
    def _base(self, kind: str, num_tokens: int, num_decodes: int, context: int) -> dict:
        return {"model": self.label, "kind": kind, "num_tokens": num_tokens,
                "num_decodes": num_decodes, "context": context, "wall_ms": None,
                "wall_ms_p10": None, "wall_ms_p90": None, "gpu_ms": None, "host_share": None,
                "reps": 0}

    @staticmethod
    def _summary(samples: list[tuple[float, Any]]) -> dict[str, Any]:
        walls = [w for w, _ in samples]
        gpus = [r.gpu_ms for _, r in samples if r.gpu_ms is not None]
        wall = statistics.median(walls)
        gpu = statistics.median(gpus) if gpus else None
        return {"wall_ms": wall, "wall_ms_p10": _pct(walls, 10), "wall_ms_p90": _pct(walls, 90),
                "gpu_ms": gpu, "host_share": None if gpu is None else 1 - gpu / wall,
                "reps": len(samples),
                "record_wall_ms": statistics.median(r.wall_ms for _, r in samples),
                "gpu_ms_measured": len(gpus),
                "samples": {"wall_ms": [round(w, 4) for w in walls],
                            "gpu_ms": [None if r.gpu_ms is None else round(r.gpu_ms, 4)
                                       for _, r in samples],
                            "record_wall_ms": [round(r.wall_ms, 4) for _, r in samples],
                            "t": [r.t for _, r in samples]}}

    def _run_row(self, row: dict, body) -> dict:
        ids: list[str] = []
        try:
            row.update(body(ids))
        except (StepMismatch, ValueError) as e:
            row["error"] = str(e)
        finally:
            if ids:
                self.eng.abort_request(ids)
            if self.eng.has_unfinished_requests():   # (a row leaves nothing behind)
                row.setdefault("error", "requests were left unfinished after the row")
        return row

    def prefill(self, n: int) -> dict:
        row = self._base("prefill", n, 0, 0)
        why = self._unfit(step_tokens=n, seqs=1, seq_len=n + 1, blocks=self._blocks(n + 1))
        if why:
            return {**row, "skipped": why}
        want = {"num_prefill_tokens": n, "num_prefill_seqs": 1, "num_decode_seqs": 0,
                "num_waiting": 0}

        def body(ids):
            samples = []
            for i in range(self.args.warmup + self.args.reps):
                ids[:] = [self._add(self._prompts(1, n)[0], max_tokens=2)]
                try:
                    sample = self._timed_step(want)
                except StepMismatch as e:
                    raise StepMismatch(f"rep {i}: {e}") from None
                self.eng.abort_request(ids)
                ids.clear()
                if i >= self.args.warmup:
                    samples.append(sample)
            return self._summary(samples)
        return self._run_row(row, body)

    def _start_decodes(self, ids: list[str], b: int, max_tokens: int, context: int) -> None:
        ids.extend(self._add(p, max_tokens) for p in self._prompts(b, context))
        self._prefill_all(ids, context)

    def _ctx_sum(self, ids: list[str]) -> int | None:
        """The tokens the decoding requests in ids attend over in the next step (prompt and
        output so far, the token fed included), read from the engine's scheduler; None where
        the engine has none to read."""
        reqs = getattr(getattr(self.eng, "scheduler", None), "requests", None)
        if reqs is None:
            return None
        want = set(ids)   # the scheduler keys a request's sequences "<request id>#<index>"
        seqs = [r for k, r in reqs.items() if k.rpartition("#")[0] in want or k in want]
        return sum(r.num_tokens for r in seqs) if len(seqs) == len(want) else None

    @staticmethod
    def _with_ctx(out: dict, ctx: list[int | None]) -> dict:
        if all(c is not None for c in ctx) and ctx:
            out["ctx_sum"] = statistics.mean(ctx)
            out["samples"]["ctx_sum"] = ctx
        return out

    def decode(self, b: int, context: int | None = None) -> dict:
        """Decode-only steps of b requests at `context` prompt tokens (default --context)."""
        c = self.args.context if context is None else context
        steps = self.args.warmup + self.args.reps
        row = self._base("decode", 0, b, c)
        # (never reached: aborted first; the timed steps, the queued ones and the one after)
        max_tokens = self._prefill_steps(b, c) + 2 * steps + 3
        seq_len = c + max_tokens
        why = self._unfit(step_tokens=b, seqs=b, seq_len=seq_len, blocks=b * self._blocks(seq_len))
        if why:
            return {**row, "skipped": why}
        want = {"num_prefill_tokens": 0, "num_prefill_seqs": 0, "num_decode_seqs": b,
                "num_waiting": 0}

        def body(ids):
            self._start_decodes(ids, b, max_tokens, c)
            samples, ctx = [], []
            for i in range(steps):
                before = self._ctx_sum(ids)
                try:
                    sample = self._timed_step(want)
                except StepMismatch as e:
                    raise StepMismatch(f"rep {i}: {e}") from None
                if i >= self.args.warmup:
                    samples.append(sample)
                    ctx.append(before)
            out = self._with_ctx(self._summary(samples), ctx)
            out.update(self._queued(want, steps))
            return out
        return self._run_row(row, body)

    def mixed(self, b: int, context: int | None = None, chunk: int | None = None) -> dict:
        """Steps of b decodes at `context` (default --context) plus one new prompt of `chunk`
        (default --chunk) tokens, each beside a decode-only step at the same b."""
        a = self.args
        c = a.context if context is None else context
        k = a.chunk if chunk is None else chunk
        steps = a.warmup + a.reps
        row = self._base("mixed", k, b, c)
        max_tokens = self._prefill_steps(b, c) + 3 * steps + 3
        seq_len = max(c + max_tokens, k + 1)
        why = self._unfit(step_tokens=b + k, seqs=b + 1, seq_len=seq_len,
                          blocks=b * self._blocks(seq_len) + self._blocks(k + 1))
        if why:
            return {**row, "skipped": why}
        want_dec = {"num_prefill_tokens": 0, "num_prefill_seqs": 0, "num_decode_seqs": b,
                    "num_waiting": 0}
        want_mix = {"num_prefill_tokens": k, "num_prefill_seqs": 1, "num_decode_seqs": b,
                    "num_waiting": 0}

        def body(ids):
            self._start_decodes(ids, b, max_tokens, c)
            mixed, decode, ctx = [], [], []
            for i in range(steps):
                try:
                    dec = self._timed_step(want_dec)
                    before = self._ctx_sum(ids)   # (the b decodes; the new prompt not added yet)
                    ids.append(self._add(self._prompts(1, k)[0], max_tokens=2))
                    mix = self._timed_step(want_mix)
                except StepMismatch as e:
                    raise StepMismatch(f"rep {i}: {e}") from None
                self.eng.abort_request(ids.pop())
                if i >= a.warmup:
                    mixed.append(mix)
                    decode.append(dec)
                    ctx.append(before)
            out = self._with_ctx(self._summary(mixed), ctx)
            d = self._summary(decode)
            out.update(decode_wall_ms=d["wall_ms"], decode_gpu_ms=d["gpu_ms"],
                       decode_host_share=d["host_share"],
                       mixed_over_decode=out["wall_ms"] / d["wall_ms"],
                       mixed_over_decode_gpu=(None if out["gpu_ms"] is None or not d["gpu_ms"]
                                              else out["gpu_ms"] / d["gpu_ms"]),
                       decode_samples=d["samples"])
            # the same steps queued: a fresh prompt of k tokens before each (one token
            # wanted: it is done with its prefill, never a decode in the next step; it holds
            # its slot and blocks until that token is read, while the next prompt runs). The
            # prompts are drawn first: drawing one takes the host longer than a step.
            if b + 2 > self.max_seqs:
                out["queued_error"] = (f"not run: its steps need {b + 2} sequence slots "
                                       f"> max_num_seqs {self.max_seqs}")
            else:
                fresh = iter(self._prompts(steps, k))
                out.update(self._queued(want_mix, steps,
                                        lambda: self._add(next(fresh), max_tokens=1)))
            return out
        return self._run_row(row, body)

    def rows(self) -> list[dict]:
        a = self.args
        out = []
        for make, sizes in ((self.prefill, a.prefill_tokens), (self.decode, a.decode_batches),
                            (self.mixed, a.mixed_decodes)):
            for v in sizes:
                gc.collect()
                row = make(v)
                out.append(row)
                print(_line(row), flush=True)
        return out


def _fmt(v, spec: str, width: int = 0) -> str:
    return "-".rjust(width) if v is None else format(v, spec).rjust(width)


_HEADER = (f"{'model':>14} {'kind':>7} {'tokens':>6} {'decodes':>7} {'ctx':>5} "
           f"{'wall ms':>9} {'p10':>9} {'p90':>9} {'gpu ms':>9} {'host':>6}  note")


def _line(r: dict) -> str:
    note = ""
    if "skipped" in r:
        note = f"skipped: {r['skipped']}"
    elif "error" in r:
        note = f"ERROR: {r['error']}"
    elif r["kind"] == "mixed":
        note = (f"decode-only {_fmt(r['decode_wall_ms'], '.3f')} ms, mixed/decode "
                f"x{r['mixed_over_decode']:.2f}")
    if "queued_error" in r:
        note += f" queued: ERROR {r['queued_error']}"
    elif "queued_wall_ms" in r:
        note += (f" queued: {r['queued_wall_ms']:.3f} ms a step, "
                 f"gpu {_fmt(r['queued_gpu_ms'], '.3f')}")
    return (f"{r['model']:>14} {r['kind']:>7} {r['num_tokens']:>6} {r['num_decodes']:>7} "
            f"{r['context']:>5} {_fmt(r['wall_ms'], '.3f', 9)} {_fmt(r['wall_ms_p10'], '.3f', 9)} "
            f"{_fmt(r['wall_ms_p90'], '.3f', 9)} {_fmt(r['gpu_ms'], '.3f', 9)} "
            f"{_fmt(r['host_share'], '.1%', 6)}  {note}")


def _graph_info(eng) -> dict[str, Any]:
    """The CUDA graphs the engine captured at start-up: how many, how long, how much memory."""
    g = getattr(getattr(eng, "runner", None), "graphs", None)
    if g is None:
        return {"cuda_graphs": None}
    return {"cuda_graphs": {"decode": len(g.decode_sizes) * len(g.tiers),
                            "mixed": len(g.mixed_sizes) * len(g.mixed_tiers),
                            "mixed_max_tokens": g.mixed_sizes[-1] if g.mixed_sizes else 0,
                            "capture_s": g.capture_s, "memory_mib": g.memory_bytes / 2 ** 20}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve import LLM
    device = torch.device(args.device)
    models = args.models or ["qwen2.5-1.5b" if device.type == "cuda" else EMBEDDED]
    budget_set = args.max_num_batched_tokens is not None
    budget = args.max_num_batched_tokens if budget_set else token_budget(args)
    seqs = args.max_num_seqs if args.max_num_seqs is not None else seq_slots(args)
    notes = ["steps run synchronously (async scheduling off): each timed step() is one whole "
             "step, its record its own"]
    if budget_set and budget < token_budget(args):
        notes.append(f"--max-num-batched-tokens {budget} is below the {token_budget(args)} "
                     "the requested rows need: the rows that do not fit are skipped")
    engines, rows = [], []
    print(_HEADER, flush=True)
    for model in models:
        ns = argparse.Namespace(**vars(args))
        ns.model = None if model == EMBEDDED else model
        ns.max_num_batched_tokens, ns.max_num_seqs, ns.skip_tokenizer_init = budget, seqs, True
        # One step at a time: under async scheduling a step() call would apply the step before
        # it (its record and tokens), so each timed step here runs synchronously.
        ns.async_scheduling = False
        cfg = engine_config(ns)
        llm = LLM(**dataclasses.asdict(cfg))
        try:
            bench = StepBench(llm, args, model)
            eng = bench.eng
            engines.append({"name": model, **dataclasses.asdict(cfg),
                            "max_model_len_used": eng.max_model_len,
                            "num_kv_blocks_used": eng.num_kv_blocks,
                            "use_cuda_graphs": cfg.use_cuda_graphs, **_graph_info(eng)})
            rows.extend(bench.rows())
        finally:
            runner = getattr(llm.llm_engine, "runner", None)
            if runner is not None:
                runner.release()
            del llm
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for note in notes:
        print(f"note: {note}", flush=True)
    bw = None if args.skip_bandwidth else copy_bandwidth(device)
    return {"benchmark": "step", "models": models, "engines": engines, "notes": notes,
            "copy_bandwidth_bytes_per_s": bw, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    output = args.output or f"bench/results/step-cost-{torch.device(args.device).type}.json"
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    payload = run_described("step", run, args, argv, output)
    if payload is None:
        return 1
    print(f"wrote {os.path.abspath(write_result(output, payload))}")
    errors = [r for r in payload["rows"] if "error" in r]
    if errors:
        print(f"error: {len(errors)} row(s) did not time the step they meant", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
