"""`pdserve profile`: measure what steps and KV hand-offs cost on the real engine, fit the
cost-model terms (cost_fit.py) and write a CostProfile (cost_profile.py) as JSON.

What runs, in order:
  1. one in-process engine (the engine flags given; async scheduling off, so one step() is one
     step), timed by `pdserve bench step`'s StepBench (a device sync around every timed step,
     each step checked against its StepRecord):
       prefill  one lone prefill step per prompt length (--prefill-tokens)
       decode   decode-only steps for each batch size (--decode-batches) at each context
                (--contexts); ctx_sum read from the engine's scheduler
       mixed    b decodes at --mixed-context plus one n-token prompt, per B:N in --mixed
     decode and mixed rows are also run queued (async scheduling, as a server runs them):
     their queued_gpu_ms is the device time of a step started behind another, which the
     device-time refit (cost_fit.device_time_profile) takes over the synced bracket
  2. the KV hand-off: a 1-prefill / 1-decode deployment of the same engine config with the
     connector given (--kv-connector, default "shared": a shared file on CPU, CUDA IPC on one
     GPU, the peer / relay path across GPUs), one request of each --transfer-tokens length at
     a time; the decode worker reports the bytes it pulled and the pull's time. On one GPU both
     workers share it (each with --transfer-kv-gb of KV pool). If the deployment cannot run,
     the file says why and the transfer terms are an estimate that says what it is.
  3. the serving path (perf/serving_path.py; --no-serving-overhead skips it): `pdserve serve`
     started as a subprocess with this engine config, then the flags of --serving-args (the
     deployment the term will be added to, e.g. a server with async scheduling and a 2,048-token
     budget: the server's defaults), streaming requests of a few prompt lengths
     (--serving-tokens, each within the server's token budget: one prefill step) sent one at
     a time through bench serve's client; the term serving_overhead_ms is the median of their
     TTFT less the prefill fit's lone-prefill time. The file's serving_setup says which server
     (its command, serving_args, async_scheduling).
     Then, on the same server, the served batches: for each b in --serving-batches, b
     streaming requests at once (--serving-batch-prompt-tokens, --serving-batch-max-tokens),
     their median TPOT per b; the term serving_host_ms (the server's host work per step:
     fixed_ms + per_seq_ms * b, what a served step takes at least) is fitted on the batches
     whose TPOT the profile's decode_ms does not explain (cost_fit.fit_serving_batch). Each b
     within the server's max_num_seqs, its prompts within MAX_BATCH_PREFILL_STEPS steps of its
     token budget (preset sizes that are not are left out, and said; given ones are an error).
     Around each timed request and each served batch, the API process's CPU seconds (the
     `pdserve serve` process itself, not its worker): a row per prompt length and one per
     batch (samples["serving_api"], with the client's count of the SSE writes its tokens came
     in and the engine steps the server's /metrics counted); the term api_cost_ms (per
     request, per prompt token, per SSE write, per token in a write, per engine step: what
     the simulator queues on its one API process) is fitted on them
     (cost_fit.fit_serving_api; per_step_ms 0 with a note where the steps were not read,
     per_output_token_ms 0 with a note where no phase's writes carried several tokens, {}
     with a note where they cannot separate the costs).
     If the server cannot start, or a request fails, the file says why and the three terms
     are 0 / {} ("not measured").
  4. the fits, a table of term / value / held-out error, and the JSON (--output).

Row sets (prefill lengths, batches, contexts, ...) default to one of three presets, by device
and --quick; any flag given replaces its preset value. `--quick` on CPU with the embedded model
is sized to finish in under two minutes on a 2-core machine.

The module imports no torch itself until run() (pdserve.perf stays plain to import).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import re
import statistics
import sys
import time
from typing import Any

from ..args import add_engine_args, engine_config
from .cost_fit import profile_from_samples
from .cost_profile import CostProfile, hardware_label, model_name
_EXCLUDED = ("--skip-tokenizer-init", "--tensor-parallel-size", "--distributed-executor-backend",
             "--disable-custom-all-reduce", "--async-scheduling")

# Row sets. GPU sizes follow bench step's defaults and what an H200 step costs (a 1.5B model:
# lone prefill 3 ms at 256 tokens .. 59 ms at 8192; decode 2.7 ms at batch 1 .. 9.6 ms at 256).
PRESETS: dict[str, dict[str, Any]] = {
    "cuda": dict(prefill_tokens=[128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192],
                 # (2 and 4: decode graph sizes of their own, where a lightly loaded server
                 # spends most of its steps)
                 decode_batches=[1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256],
                 contexts=[256, 1024, 4096], mixed_context=1024,
                 # (the graph bucket holding b + n is 1.5x the chunk n in every row but 64:960
                 # and 128:1920, where it is 1.07x (1024, 2048): those two tell a cost per
                 # chunk token from a cost per padded token)
                 mixed=["8:256", "32:256", "32:1024", "64:512", "64:960", "128:256", "128:1024",
                        "128:1920", "128:2048", "256:512"],
                 transfer_tokens=[256, 1024, 2048, 4096, 8192], reps=10, warmup=3,
                 transfer_reps=5, serving_tokens=[256, 1024, 2048, 4096], serving_reps=10,
                 serving_max_tokens=16, serving_batches=[1, 16, 64, 128, 256],
                 serving_batch_prompt_tokens=16, serving_batch_max_tokens=64),
    "cuda-quick": dict(prefill_tokens=[256, 1024, 2048, 4096, 8192],
                       decode_batches=[1, 16, 64, 128, 256], contexts=[512, 2048],
                       mixed_context=1024, mixed=["32:256", "128:256", "128:1024", "64:2048"],
                       transfer_tokens=[512, 2048, 8192], reps=5, warmup=2, transfer_reps=3,
                       serving_tokens=[256, 1024, 4096], serving_reps=5, serving_max_tokens=8,
                       serving_batches=[16, 128], serving_batch_prompt_tokens=16,
                       serving_batch_max_tokens=32),
    # CPU (the embedded 135M model, one thread): a step costs ~0.1-0.6 s and other work on the
    # machine makes single steps noisy, so rows stay small and reps are what buy precision.
    "cpu": dict(prefill_tokens=[16, 32, 64, 128, 192, 256], decode_batches=[1, 2, 4, 8, 16],
                contexts=[32, 128], mixed_context=32, mixed=["2:16", "4:32", "8:16", "8:64"],
                transfer_tokens=[16, 64, 128, 256, 512], reps=6, warmup=1, transfer_reps=4,
                serving_tokens=[16, 64, 128, 256], serving_reps=5, serving_max_tokens=8,
                serving_batches=[1, 4, 8, 16], serving_batch_prompt_tokens=16,
                serving_batch_max_tokens=12),
    "cpu-quick": dict(prefill_tokens=[16, 32, 64, 96, 128], decode_batches=[1, 2, 4, 8],
                      contexts=[16, 64], mixed_context=16, mixed=["2:16", "4:32", "8:16"],
                      transfer_tokens=[16, 48, 96, 192], reps=4, warmup=1, transfer_reps=3,
                      serving_tokens=[16, 64, 128], serving_reps=3, serving_max_tokens=4,
                      serving_batches=[2, 8], serving_batch_prompt_tokens=16,
                      serving_batch_max_tokens=6),
}
# A served batch's prompts must be prefilled within this many steps of the server's budget: its
# TPOT is then decode steps but for a few, and the batch's run stays short.
MAX_BATCH_PREFILL_STEPS = 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve profile",
        description="Time lone prefill, decode and mixed steps and the KV hand-off on the real "
                    "engine; fit the cost-model terms (alpha, beta with batch_threshold, gamma, "
                    "transfer bandwidth) with held-out errors; write them as one JSON profile.")
    w = p.add_argument_group("rows (default: a preset by device and --quick)")
    w.add_argument("--quick", action="store_true",
                   help="a small row set (CPU + embedded model: under two minutes on 2 cores)")
    w.add_argument("--prefill-tokens", type=int, nargs="+", default=None)
    w.add_argument("--decode-batches", type=int, nargs="+", default=None)
    w.add_argument("--contexts", type=int, nargs="+", default=None,
                   help="prompt tokens of the decoding requests (>= 2 values: the context term)")
    w.add_argument("--mixed", nargs="+", default=None, metavar="B:N",
                   help="mixed steps: B decodes plus an N-token prompt")
    w.add_argument("--mixed-context", type=int, default=None,
                   help="prompt tokens of the mixed rows' decoding requests")
    w.add_argument("--transfer-tokens", type=int, nargs="+", default=None,
                   help="prompt lengths handed off from a prefill to a decode worker")
    w.add_argument("--reps", type=int, default=None, help="timed steps per row")
    w.add_argument("--warmup", type=int, default=None, help="untimed (but checked) steps per row")
    w.add_argument("--transfer-reps", type=int, default=None,
                   help="timed hand-offs per length (after one untimed)")
    t = p.add_argument_group("KV transfer")
    t.add_argument("--kv-connector", default="shared",
                   help="connector of the measured hand-off (shared, relay, torch-dist, nccl, or "
                        "a package.module:Class plugin)")
    t.add_argument("--no-transfer", action="store_true",
                   help="do not measure the hand-off: the transfer terms are an estimate from "
                        "the device copy bandwidth (said in the file)")
    t.add_argument("--transfer-kv-gb", type=float, default=4.0,
                   help="CUDA: KV pool of each of the two transfer workers (they may share a GPU)")
    s = p.add_argument_group("serving path (what a request costs outside the steps)")
    s.add_argument("--no-serving-overhead", action="store_true",
                   help="do not start `pdserve serve` to measure it: serving_overhead_ms is 0 "
                        "and serving_host_ms empty (\"not measured\" in the file)")
    s.add_argument("--serving-tokens", type=int, nargs="+", default=None,
                   help="prompt lengths of its requests (within the --prefill-tokens range; "
                        "default: the preset's that lie there)")
    s.add_argument("--serving-reps", type=int, default=None,
                   help="timed requests per length (after one untimed)")
    s.add_argument("--serving-max-tokens", type=int, default=None,
                   help="max_tokens of each request (its token gaps: the batch-1 ITL)")
    s.add_argument("--serving-batches", type=int, nargs="+", default=None, metavar="B",
                   help="then, on the same server, B streaming requests at once per value: "
                        "their TPOT against the profile's decode_ms(B) gives the server's host "
                        "work per step (serving_host_ms); each B within the server's "
                        "max_num_seqs")
    s.add_argument("--serving-batch-prompt-tokens", type=int, default=None,
                   help="prompt tokens of each served-batch request")
    s.add_argument("--serving-batch-max-tokens", type=int, default=None,
                   help="max_tokens of each served-batch request (>= 2: its TPOT)")
    s.add_argument("--serving-args", default="",
                   help="engine flags of the measured server, after the profile's own (later "
                        "ones win), quoted as one string: the deployment the term is added to, "
                        "e.g. \"--async-scheduling --max-num-batched-tokens 2048\" for a "
                        "server run with the defaults (default: the profile's engine config, "
                        "synchronous)")
    add_engine_args(p, exclude=_EXCLUDED)
    p.set_defaults(device=None, max_num_batched_tokens=None, max_num_seqs=None)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--output", default=None,
                   help="JSON path (default: profile-<model>-<hardware>.json here)")
    return p


def _pair(s: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", s)
    if not m:
        raise ValueError(f"--mixed takes B:N pairs (decodes:chunk tokens), got {s!r}")
    return int(m.group(1)), int(m.group(2))


def resolve(a: argparse.Namespace, device_type: str) -> argparse.Namespace:
    """a with every unset row option taken from the preset for device_type and --quick, and
    checked (ValueError for a bad value)."""
    preset = PRESETS[("cuda" if device_type == "cuda" else "cpu") + ("-quick" if a.quick else "")]
    out = argparse.Namespace(**vars(a))
    for k, v in preset.items():
        if getattr(out, k) is None:
            setattr(out, k, v)
    out.preset = ("cuda" if device_type == "cuda" else "cpu") + ("-quick" if a.quick else "")
    lo, hi = min(out.prefill_tokens), max(out.prefill_tokens)
    out.serving_tokens_given = a.serving_tokens is not None
    if a.serving_tokens is None:
        # the preset's lengths where the prefill fit interpolates, else the prefill lengths
        out.serving_tokens = ([n for n in preset["serving_tokens"] if lo <= n <= hi]
                              or sorted(set(out.prefill_tokens)))
    elif not out.no_serving_overhead and any(not lo <= n <= hi for n in out.serving_tokens):
        raise ValueError(f"--serving-tokens must lie within the prefill lengths ({lo}..{hi}: "
                         f"the prefill fit subtracted from their TTFT), got {out.serving_tokens}")
    out.serving_batches_given = a.serving_batches is not None
    out.mixed_pairs = [_pair(s) for s in out.mixed]
    for name in ("prefill_tokens", "decode_batches", "contexts", "transfer_tokens",
                 "serving_batches"):
        bad = [v for v in getattr(out, name) if v < 1]
        if bad:
            raise ValueError(f"--{name.replace('_', '-')} values must be >= 1, got {bad}")
    if any(b < 1 or n < 1 for b, n in out.mixed_pairs):
        raise ValueError(f"--mixed pairs need B >= 1 and N >= 1, got {out.mixed}")
    if len(set(out.prefill_tokens)) < 3:
        raise ValueError("--prefill-tokens needs >= 3 distinct lengths (fixed + per-token terms, "
                         "one held out)")
    if len(set(out.contexts)) < 2:
        raise ValueError("--contexts needs >= 2 values: the decode fit's context term")
    if len(set(out.decode_batches)) < 2:
        raise ValueError("--decode-batches needs >= 2 batch sizes")
    if len(out.decode_batches) * len(out.contexts) < 5:
        raise ValueError("decode rows (batches x contexts) must be >= 5 for a held-out error")
    if not out.mixed_pairs:
        raise ValueError("--mixed needs at least one B:N pair")
    if not out.no_transfer and len(set(out.transfer_tokens)) < 3:
        raise ValueError("--transfer-tokens needs >= 3 distinct lengths (or --no-transfer)")
    for name in ("reps", "transfer_reps", "mixed_context", "serving_reps", "serving_max_tokens",
                 "serving_batch_prompt_tokens"):
        if getattr(out, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(out, name)}")
    if out.serving_batch_max_tokens < 2:
        raise ValueError("--serving-batch-max-tokens must be >= 2 (a TPOT is the time between "
                         f"the first and the last token), got {out.serving_batch_max_tokens}")
    if len(set(out.serving_batches)) != len(out.serving_batches):
        raise ValueError(f"--serving-batches has a size twice: {out.serving_batches}")
    if out.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {out.warmup}")
    if out.threads is not None and out.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {out.threads}")
    if not out.no_transfer:
        from ..disagg.connectors import check_connector_name
        check_connector_name(out.kv_connector)
    if out.transfer_kv_gb <= 0:
        raise ValueError(f"--transfer-kv-gb must be > 0, got {out.transfer_kv_gb}")
    return out


def served_batch_sizes(a, serving_cfg) -> tuple[list[int], list[int]]:
    """(the batch sizes the measured server takes, the preset's left out): each b within its
    max_num_seqs (all b requests run at once) and b * prompt tokens within
    MAX_BATCH_PREFILL_STEPS steps of its token budget. ValueError for a given size that is not,
    or when no preset size is."""
    seqs, budget = serving_cfg.max_num_seqs, serving_cfg.max_num_batched_tokens
    p = a.serving_batch_prompt_tokens
    ok, out = [], []
    for b in a.serving_batches:
        why = None
        if b > seqs:
            why = (f"{b} requests at once need {b} sequence slots; the measured server has "
                   f"max_num_seqs {seqs} (--max-num-seqs, or --serving-args)")
        elif b * p > MAX_BATCH_PREFILL_STEPS * budget:
            why = (f"{b} prompts of {p} tokens take more than {MAX_BATCH_PREFILL_STEPS} steps "
                   f"of the measured server's {budget}-token budget to prefill (fewer or "
                   "shorter prompts: --serving-batch-prompt-tokens)")
        if why is None:
            ok.append(b)
        elif a.serving_batches_given:
            raise ValueError(f"--serving-batches {a.serving_batches}: {why}")
        else:
            out.append(b)
    if not ok:
        raise ValueError(f"no served batch size of the preset ({a.serving_batches}) fits the "
                         f"measured server (max_num_seqs {seqs}, token budget {budget}); give "
                         "--serving-batches")
    return ok, out


def _budget(a) -> tuple[int, int]:
    """(token budget, sequence slots) that admit every row (a mixed row's queued steps hold
    b + 2 sequences: the new prompt's and the one before it until its token is read)."""
    tokens = max([*a.prefill_tokens, *a.decode_batches, *(b + n for b, n in a.mixed_pairs)])
    seqs = max([1, *a.decode_batches, *(b + 2 for b, _ in a.mixed_pairs)])
    return tokens, seqs


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", s.lower()).strip("-") or "x"


def default_output(model: str, hardware: dict) -> str:
    hw = hardware.get("gpu") or "cpu"
    return f"profile-{_slug(os.path.basename(model.rstrip('/')))}-{_slug(hw)}.json"


# ---- measuring ----------------------------------------------------------------------------------
def _step_rows(a, cfg, label: str) -> tuple[list[dict], dict[str, Any], int]:
    """The step rows (bench step's row dicts), the engine's facts, and its KV bytes per token
    (one rank's, over all layers)."""
    from .. import LLM
    from ..bench.step import StepBench, _graph_info, _line, _HEADER
    llm = LLM(**dataclasses.asdict(cfg))
    try:
        sb_args = argparse.Namespace(context=a.contexts[0], chunk=a.mixed_pairs[0][1],
                                     reps=a.reps, warmup=a.warmup, seed=a.seed)
        bench = StepBench(llm, sb_args, label)
        eng = bench.eng
        kv = eng.runner.kv_cache
        kvb = int(kv[:, :, 0, 0].numel() * kv.element_size())
        facts = {"max_model_len_used": eng.max_model_len, "num_kv_blocks_used": eng.num_kv_blocks,
                 "use_cuda_graphs": cfg.use_cuda_graphs, "vocab_size": eng.vocab_size,
                 **_graph_info(eng)}
        print(_HEADER, flush=True)
        rows = []
        # decode rows alternate contexts at each batch size: a machine whose speed drifts
        # (other work on a CPU host) then shifts neighbouring contexts alike, instead of
        # passing for a context cost
        todo = ([(bench.prefill, (n,)) for n in a.prefill_tokens]
                + [(bench.decode, (b, c)) for b in a.decode_batches for c in a.contexts]
                + [(bench.mixed, (b, a.mixed_context, n)) for b, n in a.mixed_pairs])
        for make, params in todo:
            gc.collect()
            row = make(*params)
            rows.append(row)
            print(_line(row), flush=True)
        return rows, facts, kvb
    finally:
        runner = getattr(llm.llm_engine, "runner", None)
        if runner is not None:
            runner.release()
        del llm
        gc.collect()
        _empty_cuda_cache(cfg)


def _empty_cuda_cache(cfg) -> None:
    import torch
    if cfg.torch_device.type == "cuda":
        torch.cuda.empty_cache()


def _transfer_rows(a, cfg, kvb: int) -> tuple[list[dict], dict[str, Any]]:
    """One request at a time through a 1P1D deployment: each hand-off's bytes and pull time."""
    import torch

    from .. import SamplingParams
    from ..bench.common import random_prompts
    from ..bench.pd import _one
    from ..routing import DisaggPolicy, RestartPolicy, Router, plan_workers
    longest = max(a.transfer_tokens)
    base = dataclasses.replace(
        cfg, max_num_batched_tokens=max(cfg.max_num_batched_tokens, min(longest, 8192)),
        max_num_seqs=max(cfg.max_num_seqs, 2))
    if base.max_model_len is not None and base.max_model_len < longest + 2:
        base = dataclasses.replace(base, max_model_len=longest + 2)
    info: dict[str, Any] = {"connector": a.kv_connector, "kv_transfer_mode": base.kv_transfer_mode}
    dev = base.torch_device
    one_gpu = dev.type == "cuda" and torch.cuda.device_count() < 2   # both workers on it
    specs = plan_workers(base, 1, 1, 0, kv_connector=a.kv_connector,
                         num_gpus=1 if one_gpu else None)
    if dev.type == "cuda":
        specs = [dataclasses.replace(s, config=dataclasses.replace(
            s.config, kv_cache_memory_gb=a.transfer_kv_gb)) for s in specs]
        info["devices"] = [s.config.device for s in specs]
        info["note"] = ("both workers on one GPU (CUDA IPC, same-device pull)"
                        if len({s.config.device for s in specs}) == 1
                        else "prefill and decode workers on consecutive GPUs")
    else:
        info["note"] = "two CPU worker processes on this host"
    t0 = time.perf_counter()
    router = Router(specs, DisaggPolicy(), restart=RestartPolicy(max_restarts=0))
    info["startup_s"] = round(time.perf_counter() - t0, 2)
    rows = []
    try:
        vocab = router.info.vocab_size
        sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        for i, n in enumerate(a.transfer_tokens):
            prompts = random_prompts(a.transfer_reps + 1, n, n + 1, vocab, a.seed * 7919 + i)
            runs = [_one(router, f"transfer-{n}-{j}", p, sp) for j, p in enumerate(prompts)][1:]
            bad = [r for r in runs if r["transfers"] != 1]
            if bad:
                raise RuntimeError(f"{n}-token hand-off: {len(bad)} of {len(runs)} requests did "
                                   "not report exactly one completed pull")
            row = {"tokens": n, "ms": statistics.median(r["transfer_ms"] for r in runs),
                   "bytes": int(statistics.median(r["transfer_bytes"] for r in runs)),
                   "kv_bytes_per_token": kvb, "reps": len(runs),
                   "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
                   "ms_samples": [round(r["transfer_ms"], 4) for r in runs]}
            rows.append(row)
            print(f"transfer {n:>6} tokens: {row['ms']:9.3f} ms, {row['bytes']} bytes, "
                  f"{row['bytes'] / row['ms'] / 1e6:.2f} GB/s (TTFT {row['ttft_ms']:.1f} ms)",
                  flush=True)
        router.check_workers()
    finally:
        router.shutdown()
        _empty_cuda_cache(cfg)
    return rows, info


def serving_config(cfg, serving_args: str):
    """The measured server's engine config: cfg's flags, then serving_args' (a shell-quoted
    string of engine flags; later flags win). ValueError for a flag that is not an engine flag
    or a bad value (run() then checks that its token budget takes each serving prompt in one
    step)."""
    import shlex

    from ..args import engine_argv

    class _Parser(argparse.ArgumentParser):
        def error(self, message):
            raise ValueError(f"--serving-args: {message}")

    try:
        extra = shlex.split(serving_args or "")
    except ValueError as e:
        raise ValueError(f"--serving-args: {e}") from None
    if not extra:
        return cfg
    p = _Parser(add_help=False, prog="--serving-args")
    add_engine_args(p)
    try:
        ns = p.parse_args([*engine_argv(cfg), *extra])
    except SystemExit:     # (argparse's own exits, e.g. a bad choice: said by error() above)
        raise ValueError(f"--serving-args: cannot parse {serving_args!r}") from None
    return engine_config(ns)


def _serving_rows(a, cfg, facts: dict):
    """Requests one at a time, then the served batches, through a `pdserve serve` of this
    engine config: serving_path.ServingRows."""
    from .serving_path import ServedBatches, measure_serving
    print(f"serving path: starting pdserve serve ({len(a.serving_tokens)} prompt lengths x "
          f"{a.serving_reps} requests, max_tokens {a.serving_max_tokens}; then batches of "
          f"{', '.join(map(str, a.serving_batches))} requests at once, "
          f"{a.serving_batch_prompt_tokens} prompt tokens, max_tokens "
          f"{a.serving_batch_max_tokens}"
          + (f"; {a.serving_args}" if a.serving_args else "") + ")", flush=True)
    got = measure_serving(
        cfg, a.serving_tokens, a.serving_reps, a.serving_max_tokens, facts["vocab_size"], a.seed,
        a.threads, ServedBatches(a.serving_batches, a.serving_batch_prompt_tokens,
                                 a.serving_batch_max_tokens))
    rows, batch_rows, info = got.rows, got.batch_rows, got.info
    info["serving_args"] = a.serving_args
    info["async_scheduling"] = bool(cfg.async_scheduling)
    # (the server's own step shapes: --serving-args may change its budget or its graphs)
    info["graph_max_tokens"] = cfg.graph_max_tokens
    for n in a.serving_tokens:
        ttft = [r["ttft_ms"] for r in rows if r["n"] == n]
        print(f"serving {n:>6} tokens: TTFT median {statistics.median(ttft):9.3f} ms over "
              f"{len(ttft)} requests", flush=True)
    for r in batch_rows:
        print(f"served batch {r['b']:>4}: TPOT median {r['tpot_ms']:9.3f} ms (p10 "
              f"{r['tpot_ms_p10']:.3f}, p90 {r['tpot_ms_p90']:.3f}) over {r['b']} streams, "
              f"{r['wall_s']:.2f} s", flush=True)
    for r in got.api_rows:
        what = f"{r['n']:>6} tokens" if r["phase"] == "sequential" else f"{r['phase']} {r['b']:>5}"
        cpu = "not readable" if r["api_cpu_s"] is None else f"{r['api_cpu_s'] * 1e3:9.2f} ms"
        steps = "? (unread)" if r["steps"] is None else r["steps"]
        print(f"API CPU, {what}: {cpu} over {r['requests']} requests ({r['prompt_tokens']} "
              f"prompt, {r['output_tokens']} output tokens in {r['writes']} writes, {steps} "
              f"engine steps), {r['wall_s']:.2f} s", flush=True)
    print(f"serving path: server up in {info['startup_s']} s, {info['wall_s']} s in all, "
          f"stopped {'cleanly' if info['stopped_cleanly'] else 'NOT cleanly'} "
          f"(exit code {info['exit_code']})", flush=True)
    return got


def _transfer_estimate(device, why: str, kvb: int) -> dict[str, Any]:
    from ..bench.common import copy_bandwidth
    moved = copy_bandwidth(device) / 2          # copy_bandwidth counts bytes read + written
    return {"transfer_fixed_ms": 0.0, "transfer_gb_per_s": moved / 1e9, "kv_bytes_per_token": kvb,
            "note": f"not measured ({why}); estimate: one large copy on {device} in this run "
                    f"({moved / 1e9:.2f} GB/s of data moved), no fixed cost: a lower bound on "
                    "the hand-off's time"}


# ---- fitting and reporting ----------------------------------------------------------------------
def _samples(rows: list[dict]) -> tuple[dict[str, list[dict]], list[dict]]:
    """The fit's rows from bench step's (and the rows left out, with why)."""
    out: dict[str, list[dict]] = {"prefill": [], "decode": [], "mixed": []}
    unused = []
    for r in rows:
        why = r.get("skipped") or r.get("error")
        if why is None and r["kind"] != "prefill" and r.get("ctx_sum") is None:
            why = "no ctx_sum (the engine's scheduler was not readable)"
        if why is not None:
            unused.append({"kind": r["kind"], "num_tokens": r["num_tokens"],
                           "num_decodes": r["num_decodes"], "context": r["context"], "why": why,
                           "status": "error" if "error" in r else "skipped"})
            continue
        base = {"wall_ms": r["wall_ms"], "reps": r["reps"], "wall_ms_p10": r["wall_ms_p10"],
                "wall_ms_p90": r["wall_ms_p90"], "gpu_ms": r["gpu_ms"],
                "wall_ms_samples": r["samples"]["wall_ms"]}
        for k in ("queued_gpu_ms", "queued_wall_ms"):
            if r.get(k) is not None:
                base[k] = r[k]
        if r["kind"] == "prefill":
            out["prefill"].append({"n": r["num_tokens"], **base})
        elif r["kind"] == "decode":
            out["decode"].append({"b": r["num_decodes"], "context": r["context"],
                                  "ctx_sum": r["ctx_sum"], **base})
        else:
            out["mixed"].append({"b": r["num_decodes"], "context": r["context"],
                                 "ctx_sum": r["ctx_sum"], "n": r["num_tokens"], **base,
                                 "decode_wall_ms": r["decode_wall_ms"]})
    return out, unused


def table(p: CostProfile) -> str:
    def err(term: str) -> str:
        f = p.fit[term]
        if f["heldout_mean_abs_rel_err"] is None:
            return f"{'-':>9} {'-':>9} {f['n_samples']:>4}  {f.get('source', '')}"
        return (f"{f['heldout_mean_abs_rel_err']:>9.1%} {f['heldout_max_abs_rel_err']:>9.1%} "
                f"{f['n_samples']:>4}  {f.get('source', '')}")
    lines = [f"{'term':<34} {'value':>14}  {'held-out mean':>9} {'max':>9} {'rows':>4}"]
    b = p.beta_ms
    for term, name, value in (
            ("prefill", "prefill_fixed_ms", p.prefill_fixed_ms),
            ("prefill", "alpha_ms_per_token", p.alpha_ms_per_token),
            ("prefill", "prefill_quadratic_ms", p.prefill_quadratic_ms),
            ("decode", "beta_ms.fixed_ms", b["fixed_ms"]),
            ("decode", "beta_ms.per_seq_ms_below", b["per_seq_ms_below"]),
            ("decode", "beta_ms.per_seq_ms_above", b["per_seq_ms_above"]),
            ("decode", "beta_ms.per_context_token_ms", b["per_context_token_ms"]),
            ("decode", "beta_ms.split_ms", b.get("split_ms", 0.0)),
            ("decode", "batch_threshold", p.batch_threshold),
            ("mixed", "gamma_ms_per_token", p.gamma_ms_per_token),
            ("transfer", "transfer_fixed_ms", p.transfer_fixed_ms),
            ("transfer", "transfer_gb_per_s", p.transfer_gb_per_s),
            ("transfer", "kv_bytes_per_token", p.kv_bytes_per_token),
            ("serving", "serving_overhead_ms", p.serving_overhead_ms),
            ("serving_batch", "serving_host_ms.fixed_ms", p.serving_host_ms.get("fixed_ms")),
            ("serving_batch", "serving_host_ms.per_seq_ms", p.serving_host_ms.get("per_seq_ms")),
            ("serving_api", "api_cost_ms.per_request_ms", p.api_cost_ms.get("per_request_ms")),
            ("serving_api", "api_cost_ms.per_prompt_token_ms",
             p.api_cost_ms.get("per_prompt_token_ms")),
            ("serving_api", "api_cost_ms.per_write_ms", p.api_cost_ms.get("per_write_ms")),
            ("serving_api", "api_cost_ms.per_output_token_ms",
             p.api_cost_ms.get("per_output_token_ms")),
            ("serving_api", "api_cost_ms.per_step_ms", p.api_cost_ms.get("per_step_ms"))):
        if term in p.fit and value is not None:
            lines.append(f"{name:<34} {value:>14.6g}  {err(term)}")
    itl = p.fit.get("serving", {}).get("batch1_itl_overhead_ms")
    if itl is not None:
        lines.append(f"{'(batch-1 ITL overhead, not a term)':<34} {itl:>14.6g}")
    sb = p.fit.get("serving_batch", {})
    if sb.get("source") == "not measured":
        lines.append(f"{'serving_host_ms':<34} {'(none)':>14}  {err('serving_batch')}")
    for r in sb.get("rows") or ():
        # the served TPOT beside what the profile's own decode step says for that batch
        lines.append(f"served batch {r['b']:>4}: TPOT {r['tpot_ms']:9.3f} ms, decode_ms "
                     f"{r['decode_ms']:9.3f} ms, "
                     + (f"x{r['ratio']:.2f}" if r["ratio"] is not None else "-")
                     + ("  host-bound" if r["host_bound"] else ""))
    if sb.get("note"):
        lines.append(f"  ({sb['note']})")
    sa = p.fit.get("serving_api", {})
    if "serving_api" in p.fit and not p.api_cost_ms:
        lines.append(f"{'api_cost_ms':<34} {'(none)':>14}  {err('serving_api')}")
    for r in sa.get("rows") or ():
        # each phase's API CPU beside what the costs say for it
        writes = f" {r['writes']:>6} writes" if "writes" in r else ""
        steps = f" {r['steps']:>6} steps" if r.get("steps") is not None else ""
        lines.append(f"API CPU, {r['phase'] or '?':<10} {r['requests']:>4} req "
                     f"{r['prompt_tokens']:>7} prompt {r['output_tokens']:>6} output tokens"
                     f"{writes}{steps}: {r['api_cpu_ms']:9.2f} ms, fit "
                     f"{r['predicted_ms']:9.2f} ms")
    if sa.get("note"):
        lines.append(f"  ({sa['note']})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure, fit and return the profile's dict (what main writes). ValueError for bad
    arguments or a row set the fits cannot use."""
    import torch

    from ..bench.common import CpuUsage, git_info, hardware_info
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    a = resolve(args, device.type)
    a.device = str(device)
    notes = ["steps run synchronously (async scheduling off), each with a device sync around it",
             "times are the median over a row's reps; the fits weight each row by 1 / its time"]
    if device.type == "cpu" and a.threads is None:
        # what each worker of a 1P1D deployment on this host gets (plan_workers' share), the
        # deployments whose paths the profile compares
        a.threads = max(1, len(os.sched_getaffinity(0)) // 2)
        notes.append(f"CPU: {a.threads} torch thread(s), each worker's share of the cores in a "
                     "1P1D deployment on this host (--threads to change)")
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    label = model_name(a.model)
    budget, seqs = _budget(a)
    ns = argparse.Namespace(**vars(a))
    if ns.max_num_batched_tokens is None:
        ns.max_num_batched_tokens = budget
    if ns.max_num_seqs is None:
        ns.max_num_seqs = seqs
    ns.skip_tokenizer_init, ns.async_scheduling = True, False
    # a cached prefix (a random prompt sharing its first tokens with an earlier one) would
    # shorten the step or the pull being timed
    ns.enable_prefix_caching = False
    notes.append("prefix caching off in the engines measured: each step and each pull moves "
                 "the whole prompt")
    cfg = engine_config(ns)
    serving_cfg = serving_config(cfg, a.serving_args)   # (a bad flag fails before measuring)
    if not a.no_serving_overhead:
        # each request is one lone-prefill step: the prefill fit subtracted from its TTFT
        budget = serving_cfg.max_num_batched_tokens
        fit = [n for n in a.serving_tokens if n <= budget]
        if a.serving_tokens_given and len(fit) < len(a.serving_tokens):
            raise ValueError(f"--serving-tokens {a.serving_tokens}: the measured server's token "
                             f"budget is {budget}, so a longer prompt takes more than one step")
        if not fit:
            raise ValueError(f"no serving prompt length fits the measured server's token budget "
                             f"({budget}); give --serving-tokens")
        a.serving_tokens = fit
        a.serving_batches, left_out = served_batch_sizes(a, serving_cfg)
        if left_out:
            notes.append(f"served batches of the preset left out: {left_out} (beyond the "
                         f"measured server's max_num_seqs {serving_cfg.max_num_seqs} or "
                         f"{MAX_BATCH_PREFILL_STEPS} steps of its token budget)")
    hw_start = hardware_info()
    t0 = time.perf_counter()
    with CpuUsage() as usage:
        rows, facts, kvb = _step_rows(a, cfg, label)
        samples, unused = _samples(rows)
        transfer_info: dict[str, Any] = {"connector": a.kv_connector}
        estimate = None
        if a.no_transfer:
            estimate = _transfer_estimate(device, "--no-transfer", kvb)
        else:
            try:
                samples["transfer"], transfer_info = _transfer_rows(a, cfg, kvb)
            except Exception as e:  # noqa: BLE001 - recorded in the file and printed, not hidden
                transfer_info["error"] = f"{type(e).__name__}: {e}"
                print(f"warning: the hand-off could not be measured: {e}", file=sys.stderr)
                estimate = _transfer_estimate(device, f"the 1P1D deployment failed: {e}", kvb)
        serving_info: dict[str, Any] = {}
        if a.no_serving_overhead:
            serving_note = "not measured (--no-serving-overhead)"
        else:
            try:
                got = _serving_rows(a, serving_cfg, facts)
                samples["serving"], serving_info = got.rows, got.info
                if got.batch_rows:
                    samples["serving_batch"] = got.batch_rows
                if got.api_rows:
                    samples["serving_api"] = got.api_rows
                serving_note = ""
            except Exception as e:  # noqa: BLE001 - recorded in the file and printed, not hidden
                serving_info["error"] = f"{type(e).__name__}: {e}"
                print(f"warning: the serving path could not be measured: {e}", file=sys.stderr)
                serving_note = f"not measured (pdserve serve could not be run: {e})"
    wall_s = time.perf_counter() - t0
    hw = hardware_info()
    hw["load_avg_at_start"] = hw_start.get("load_avg_1_5_15")
    git = git_info()
    extra = {"benchmark": "profile", "hardware_label": hardware_label(hw),
             "git_dirty": git["git_dirty"], "preset": a.preset,
             "row_set": {k: getattr(a, k) for k in ("prefill_tokens", "decode_batches",
                                                     "contexts", "mixed", "mixed_context",
                                                     "transfer_tokens", "reps", "warmup",
                                                     "transfer_reps", "serving_tokens",
                                                     "serving_reps", "serving_max_tokens",
                                                     "serving_batches",
                                                     "serving_batch_prompt_tokens",
                                                     "serving_batch_max_tokens")},
             "engine_facts": facts, "transfer_setup": transfer_info,
             "serving_setup": serving_info, "rows_not_used": unused,
             "notes": notes, "wall_s": round(wall_s, 2), "cpu_usage": usage.result(),
             "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    p = profile_from_samples(samples, model=label, hardware=hw,
                             engine_config=dataclasses.asdict(cfg), commit=git["git_commit"],
                             transfer_estimate=estimate, extra=extra,
                             serving_note=serving_note or "no serving-path rows")
    return p.to_dict()


# What a deployment's engine config hands a start-up profile: the model and how it runs. The
# row set, the token budget and sequence slots are the profiler's (what its rows need).
_CONFIG_FIELDS = ("model", "load_format", "dtype", "device", "seed", "block_size",
                  "gpu_memory_utilization", "max_model_len", "attention_backend", "enforce_eager",
                  "cuda_graph_max_batch", "cuda_graph_max_tokens")


def profile_config(config, quick: bool = True) -> CostProfile:
    """Profile the engine a deployment's EngineConfig describes, with the quick (or the full)
    row set of its device: what the adaptive policy measures at start-up when it has no
    profile (deploy.adaptive_policy). No serving-path measurement: the cost model does not use
    it, and a server starting would start another one."""
    ns = build_parser().parse_args(["--no-serving-overhead", *(["--quick"] if quick else [])])
    for name in _CONFIG_FIELDS:
        setattr(ns, name, getattr(config, name))
    return CostProfile.from_json(run(ns))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        d = run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    d["command"] = ["pdserve", "profile", *argv]
    p = CostProfile.from_json(d)
    print(table(p))
    print(f"({d['wall_s']:.1f} s; other processes kept {d['cpu_usage']['other_load']} cores busy "
          "meanwhile)" if d["cpu_usage"].get("other_load") is not None else
          f"({d['wall_s']:.1f} s)")
    out = args.output or default_output(p.model, p.hardware)
    print(f"wrote {os.path.abspath(p.save(out))}")
    if d["rows_not_used"]:
        print(f"warning: {len(d['rows_not_used'])} row(s) not used: "
              + "; ".join(f"{u['kind']} {u['num_decodes']}x{u['num_tokens']}: {u['why']}"
                          for u in d["rows_not_used"]), file=sys.stderr)
    return 1 if any(u["status"] == "error" for u in d["rows_not_used"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
