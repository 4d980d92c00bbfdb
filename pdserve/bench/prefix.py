"""`pdserve bench prefix`: what the prefix cache buys, with it on and off in one run.

Three cases, each run on an engine with `enable_prefix_caching` on and on one with it off (the
same model, config and prompts; random token ids, so a dummy model measures speed):

1. system: one `--system-len`-token system prompt and `--questions` different questions of
   30–50 tokens. Cold: each question alone on an empty cache (reset before each). Warm: the
   system prompt was seen once, then each question alone. TTFT = LLM.generate of one token;
   mean over the questions.
2. multi-turn: `--conversations` conversations x `--turns` turns; each turn's prompt is the
   whole history (earlier prompts and answers) plus a new 20–60-token user message; all
   conversations' turn t run as one batch, `--turn-output` tokens each. Throughput (output
   tok/s over the whole run) and the mean per-turn batch time.
3. zero reuse: `--random-prompts` random prompts of 100–`--random-max-len` tokens, `--random-output` tokens
   each: throughput, cache on vs off (what the cache costs when nothing matches). A 2% effect is
   smaller than what the order of engines in one process does (the first engine of a process ran
   ~8% slower on the H200, in either order), so this case runs on engines of its own, after the
   other cases: one untimed engine first, then `--zero-reuse-rounds` rounds of one engine per
   side, in the order on, off, off, on, ... (each side first as often as second); the loss is
   1 - mean(on) / mean(off) over the rounds.

Offline (LLM.generate), not through the server: case 2's serving form (TTFT per turn, arrival
process, cached tokens as the server reports them) is `pdserve bench serve --dataset-name
multi-turn`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

from .common import (free_device_memory, random_prompts, release_llm, run_described, sync,
                     write_result)


def _llm(args, cache: bool):
    from pdserve import LLM
    return LLM(args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
               skip_tokenizer_init=True, enable_prefix_caching=cache,
               gpu_memory_utilization=args.gpu_memory_utilization,
               max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)




def _timed(llm, prompts, max_tokens: int, device) -> tuple[float, list]:
    from pdserve import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    sync(device)
    return time.perf_counter() - t0, outs


def case_system(llm, args, vocab: int, device, cache: bool) -> dict[str, Any]:
    system = random_prompts(1, args.system_len, args.system_len, vocab, args.seed)[0]
    qs = random_prompts(args.questions, 30, 51, vocab, args.seed + 1)
    _timed(llm, [random_prompts(1, 64, 64, vocab, args.seed + 2)[0]], 1, device)   # warm-up
    cold, warm, cached = [], [], []
    for q in qs:
        llm.reset_prefix_cache()
        t, _ = _timed(llm, [system + q], 1, device)
        cold.append(t)
    llm.reset_prefix_cache()
    _timed(llm, [system], 1, device)            # the system prompt seen once
    for q in qs:
        t, outs = _timed(llm, [system + q], 1, device)
        warm.append(t)
        cached.append(outs[0].num_cached_tokens)
    return {"cold_ttft_ms": statistics.mean(cold) * 1e3, "warm_ttft_ms": statistics.mean(warm) * 1e3,
            "cold_over_warm": statistics.mean(cold) / statistics.mean(warm),
            "mean_cached_tokens": statistics.mean(cached), "prompt_tokens_mean":
            statistics.mean(len(system) + len(q) for q in qs)}


def case_multi_turn(llm, args, vocab: int, device) -> dict[str, Any]:
    histories = [[] for _ in range(args.conversations)]
    total_time, out_tokens, cached, prompt_tokens, turn_times = 0.0, 0, 0, 0, []
    for t in range(args.turns):
        msgs = random_prompts(args.conversations, 20, 61, vocab, args.seed + 100 + t)
        prompts = [h + m for h, m in zip(histories, msgs)]
        dt, outs = _timed(llm, prompts, args.turn_output, device)
        total_time += dt
        turn_times.append(dt)
        for i, o in enumerate(outs):
            histories[i] = prompts[i] + list(o.outputs[0].token_ids)
            out_tokens += len(o.outputs[0].token_ids)
            cached += o.num_cached_tokens
            prompt_tokens += len(prompts[i])
    return {"output_tok_per_s": out_tokens / total_time, "elapsed_s": total_time,
            "turn_s": turn_times, "cached_fraction_of_prompt_tokens": cached / prompt_tokens,
            "prompt_tokens": prompt_tokens}


def case_zero_reuse(llm, args, vocab: int, device) -> dict[str, Any]:
    prompts = random_prompts(args.random_prompts, 100, args.random_max_len + 1, vocab, args.seed + 7)
    _timed(llm, prompts[:4], 4, device)          # warm-up (distinct from the timed run's)
    llm.reset_prefix_cache()
    dt, outs = _timed(llm, prompts, args.random_output, device)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tok_per_s": n / dt, "elapsed_s": dt,
            "cached_tokens": sum(o.num_cached_tokens for o in outs)}


def _on_engine(args, cache: bool, device, fn):
    """fn(llm, vocab) on a fresh engine, released after."""
    llm = _llm(args, cache)
    try:
        return fn(llm, llm.llm_engine.model_config.vocab_size)
    finally:
        release_llm(llm)
        del llm          # (the engine's KV pool and weights go with the last reference)
        free_device_memory(device)


def zero_reuse_order(rounds: int) -> list[bool]:
    """The cache setting of each engine of the zero-reuse rounds: on, off, off, on, on, off, ..."""
    return [(r % 2 == 0) == (i == 0) for r in range(rounds) for i in range(2)]


def run_zero_reuse(args, device) -> dict[str, Any]:
    """The zero-reuse case on engines of its own (module docstring, case 3)."""
    warmup = _on_engine(args, True, device,
                        lambda llm, vocab: case_zero_reuse(llm, args, vocab, device))
    per: dict[str, list] = {"on": [], "off": []}
    for cache in zero_reuse_order(args.zero_reuse_rounds):
        r = _on_engine(args, cache, device,
                       lambda llm, vocab: case_zero_reuse(llm, args, vocab, device))
        per["on" if cache else "off"].append(r)
        print(f"[bench prefix] zero reuse, cache {'on' if cache else 'off'}: "
              f"{r['output_tok_per_s']:.1f} tok/s", flush=True)
    out = {}
    for side, rs in per.items():
        tps = [r["output_tok_per_s"] for r in rs]
        out[side] = {"output_tok_per_s": statistics.mean(tps), "rounds_tok_per_s": tps,
                     "elapsed_s": sum(r["elapsed_s"] for r in rs),
                     "cached_tokens": sum(r["cached_tokens"] for r in rs)}
    out["warmup_engine_tok_per_s"] = warmup["output_tok_per_s"]
    return out


def run(args) -> dict[str, Any]:
    device = torch.device(args.device)
    results: dict[str, dict] = {}
    for cache in (True, False) if args.order == "on-first" else (False, True):
        side = "on" if cache else "off"

        def cases(llm, vocab, cache=cache):
            r = {}
            if "system" in args.cases:
                r["system"] = case_system(llm, args, vocab, device, cache)
            if "multi-turn" in args.cases:
                llm.reset_prefix_cache()
                r["multi_turn"] = case_multi_turn(llm, args, vocab, device)
            return r
        results[side] = (_on_engine(args, cache, device, cases)
                         if {"system", "multi-turn"} & set(args.cases) else {})
        print(f"[bench prefix] cache {side}: {results[side]}", flush=True)
    if "zero-reuse" in args.cases:
        z = run_zero_reuse(args, device)
        results["on"]["zero_reuse"], results["off"]["zero_reuse"] = z["on"], z["off"]
        results["zero_reuse_warmup_engine_tok_per_s"] = z["warmup_engine_tok_per_s"]
    on, off = results["on"], results["off"]
    summary = {}
    if "system" in on:
        summary["system_warm_over_cold"] = on["system"]["warm_ttft_ms"] / on["system"]["cold_ttft_ms"]
    if "multi_turn" in on:
        summary["multi_turn_speedup"] = (on["multi_turn"]["output_tok_per_s"]
                                         / off["multi_turn"]["output_tok_per_s"])
    if "zero_reuse" in on:
        summary["zero_reuse_loss"] = 1 - (on["zero_reuse"]["output_tok_per_s"]
                                          / off["zero_reuse"]["output_tok_per_s"])
    return {"results": results, "summary": summary}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench prefix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--cases", nargs="+", default=["system", "multi-turn", "zero-reuse"],
                   choices=["system", "multi-turn", "zero-reuse"])
    p.add_argument("--order", default="on-first", choices=["on-first", "off-first"])
    p.add_argument("--system-len", type=int, default=2083)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--turn-output", type=int, default=64)
    p.add_argument("--random-prompts", type=int, default=256)
    p.add_argument("--random-output", type=int, default=128)
    p.add_argument("--random-max-len", type=int, default=1000)
    p.add_argument("--zero-reuse-rounds", type=int, default=2,
                   help="rounds of one engine per side for case 3, after an untimed engine "
                        "(default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    for name in ("system_len", "questions", "conversations", "turns", "turn_output",
                 "random_prompts", "random_output", "random_max_len", "zero_reuse_rounds"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    output = args.output or f"bench/results/prefix-{torch.device(args.device).type}.json"
    payload = run_described("prefix", run, args, argv, output)
    if payload is None:
        return 1
    for k, v in payload["summary"].items():
        print(f"{k}: {v:.3f}")
    print(f"wrote {os.path.abspath(write_result(output, payload))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
