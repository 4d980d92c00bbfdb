"""Where issue 16 case 1's warm TTFT goes (one-token LLM.generate of a 2,083-token system prompt,
seen once, + a 30-50-token question), against the cold one: wall per call (median of 8), the
device kernels of the warm and the cold call (torch.profiler, 8 calls each) and the device busy
time per call; then the warm call's host side: its parts timed by wall-clock wrappers (no
profiler; timed first, before any profiler session), cProfile, and one call's timeline as a Chrome trace (prefix-warm-trace.json; the
profilers inflate host times, the wrappers much less). Writes prefix-warm-prof.txt (tables) and
prefix-warm-prof.json (numbers) to --out. --device cpu --model smollm2-135m: a CPU dry run.

    python scripts/profile_prefix_warm.py --model qwen2.5-1.5b --out /tmp/prof
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pdserve import LLM, SamplingParams
from pdserve.bench.common import random_prompts


def host_breakdown(llm, prompts, call, prepare) -> dict[str, float]:
    """Mean ms per call(prompt) spent in each wrapped part of the engine: wall clock, inclusive
    (a part's callees are inside it), timed during those calls only (prepare() runs untimed
    before each), no profiler."""
    from pdserve.worker.model_runner import StepResult
    eng = llm.llm_engine
    runner = eng.runner
    acc: dict[str, float] = {}
    timing = [False]

    def timed(fn, label):
        def inner(*a, **k):
            if not timing[0]:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[label] = acc.get(label, 0.0) + (time.perf_counter() - t0) * 1e3
        return inner

    parts = [(eng, "add_request", "engine.add_request"), (eng, "step", "engine.step"),
             (eng.scheduler, "schedule", "scheduler.schedule"),
             (runner, "execute_async", "runner.execute_async"),
             (runner, "_copy_blocks", "runner._copy_blocks (copy-on-write)"),
             (runner, "_forward", "runner._forward (staging + graph replay or eager forward)"),
             (runner.inputs, "stage", "inputs.stage"),
             (runner.model, "compute_logits", "model.compute_logits"),
             (runner, "sampler", "sampler")]
    if runner.graphs is not None:
        parts.append((runner.graphs, "replay", "graphs.replay"))
    saved = [(obj, name, vars(obj).get(name)) for obj, name, _ in parts]
    for obj, name, label in parts:
        setattr(obj, name, timed(getattr(obj, name), label))
    result = StepResult.result
    StepResult.result = timed(result, "StepResult.result (waits for the device)")
    walls = []
    try:
        for prompt in prompts:
            prepare()
            timing[0] = True
            walls.append(call(prompt))
            timing[0] = False
    finally:
        StepResult.result = result
        for obj, name, own in saved:   # (an instance attribute back, or the class's method again)
            if own is not None:
                setattr(obj, name, own)
            else:
                delattr(obj, name)
    n = len(prompts)
    return {"LLM.generate (wall)": sum(walls) / n, **{k: v / n for k, v in acc.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--system-len", type=int, default=2083)
    p.add_argument("--device", default="cuda")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--out", default=".")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    llm = LLM(a.model, device=a.device, load_format=a.load_format, skip_tokenizer_init=True)
    vocab = min(100000, llm.llm_engine.model_config.vocab_size)
    system = random_prompts(1, a.system_len, a.system_len, vocab, 0)[0]
    qs = random_prompts(8, 30, 51, vocab, 1)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

    def call(prompt):
        sync()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        sync()
        return (time.perf_counter() - t0) * 1e3

    def seen_system() -> None:   # an empty cache, then the system prompt once: a warm start
        llm.reset_prefix_cache()
        call(system)

    call(random_prompts(1, 64, 64, vocab, 2)[0])
    # the warm call's host time without a profiler, first: a torch.profiler session may leave
    # CUDA instrumentation attached for the rest of the process (the replay timed 0.21-0.35 ms
    # after one, 33-39 us alone in an engine's process: bench/RESULTS.md, twelfth session)
    breakdown = host_breakdown(llm, [system + q for q in qs], call, seen_system)
    activity = ProfilerActivity.CUDA if a.device == "cuda" else ProfilerActivity.CPU  # (a CPU dry run)
    out = {}
    lines = []
    for label in ("cold", "warm"):
        walls, kernels = [], {}
        for i, q in enumerate(qs * 2):        # the first 8: wall alone; the next 8: profiled
            (seen_system if label == "warm" else llm.reset_prefix_cache)()
            if i < len(qs):
                walls.append(call(system + q))
                continue
            with profile(activities=[activity]) as prof:
                call(system + q)
            for e in prof.key_averages():
                t = e.self_device_time_total if a.device == "cuda" else e.self_cpu_time_total
                if t > 0:
                    kernels[e.key] = kernels.get(e.key, 0.0) + t / len(qs)
        top = sorted(kernels.items(), key=lambda kv: -kv[1])
        out[label] = {"wall_ms_median": statistics.median(walls), "wall_ms": walls,
                      "device_us_per_call": sum(kernels.values()),
                      "kernels_us_per_call": {k: round(v, 2) for k, v in top[:40]}}
        lines.append(f"==== {label}: wall median {statistics.median(walls):.3f} ms, device "
                     f"{sum(kernels.values()):.1f} us per call")
        lines += [f"{v:10.1f} us  {k[:110]}" for k, v in top[:30]]
    # the host side of the warm call: cProfile over the 8 warm calls (each after the system
    # prompt was seen once), by own time and by cumulative time
    prof = cProfile.Profile()
    for q in qs:
        seen_system()
        prof.enable()
        call(system + q)
        prof.disable()
    for order in ("tottime", "cumtime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(35)
        lines.append(f"==== warm call, host (cProfile, 8 calls) by {order}")
        lines.append(buf.getvalue())
    # the warm call's host time without a profiler (timed first, above): wall-clock timers
    # around the engine's parts (inclusive; nested parts are inside their callers), mean ms per call
    out["warm_host_breakdown_ms"] = breakdown
    lines.append("==== warm call, host parts (timers, no profiler, before any profiler ran; "
                 "inclusive), ms per call")
    lines += [f"{v:8.3f}  {k}" for k, v in out["warm_host_breakdown_ms"].items()]
    # one warm call's timeline, host and device (a Chrome trace): where the device waits
    seen_system()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with profile(activities=acts, with_stack=False) as tl:
        call(system + qs[0])
    tl.export_chrome_trace(os.path.join(a.out, "prefix-warm-trace.json"))
    open(os.path.join(a.out, "prefix-warm-prof.txt"), "w").write("\n".join(lines) + "\n")
    json.dump(out, open(os.path.join(a.out, "prefix-warm-prof.json"), "w"), indent=1)
    print("\n".join(lines[:70]))


if __name__ == "__main__":
    main()
