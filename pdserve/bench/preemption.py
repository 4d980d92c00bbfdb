"""`pdserve bench preemption`: swap against recompute preemption on an oversubscribed KV pool
(issue 21's target: no output differs from an unpressured run, and swap's throughput is at least
the recompute-only policy's on long prompts).

One workload (`--num-prompts` random-token prompts of `--min-input-len`..`--max-input-len`
tokens, `--output-len` tokens each, greedy, ignore_eos), offline LLM.generate, run in turn on
engines built one after the other in this process (each released before the next):

    reference  a pool that holds the whole batch (nothing is preempted): the tokens to match
    recompute  the oversubscribed pool, preemption_mode recompute, no host tier (the
               recompute-only policy)
    swap       the oversubscribed pool, preemption_mode swap, a host tier of --swap-space
    by-cost    the oversubscribed pool, preemption_mode None (per victim, by the cost rule),
               the same host tier

The batch's demand is sum(ceil((prompt + output) / block_size)) blocks; the oversubscribed pool
is demand / --oversubscription blocks (default 3), at least the longest request's, or exactly
--num-kv-blocks. The host tier defaults to what can be swapped out at once (demand - pool + the
longest request's blocks). Prefix caching is off unless --enable-prefix-caching: the prompts
share nothing, and with it a recomputed victim may re-match its own freed blocks and evicted
prefixes go to the host tier, so the sides would differ by more than the preemption mode.

Per side: wall time of the timed generate (after a short warm-up), output and total tok/s,
preemptions (swap / recompute), blocks swapped out and in, prefill tokens computed (prompts +
recomputation), and how many outputs differ from the reference's token lists (with where they
first diverge). In bf16 a different batch composition alone can flip a greedy token, so the
recompute side's count is the noise floor the swap side's is read against; --dtype float32
makes token equality meaningful on a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from typing import Any

import torch

from ..args import add_engine_args, engine_config
from ..engine.core import STEP_RECORDS_KEPT
from .common import (CpuUsage, free_device_memory, random_prompts, release_llm, run_described,
                     sync, write_result)

# (side, preemption_mode, has a host tier); the reference runs first, always
PRESSURED_SIDES = {"recompute": ("recompute", False), "swap": ("swap", True),
                   "by-cost": (None, True)}
# flags this benchmark sets per side (or for the workload) instead of taking the engine's
_OWN_FLAGS = ("--seed", "--num-kv-blocks", "--swap-space", "--preemption-mode",
              "--enable-prefix-caching", "--max-model-len", "--max-num-seqs",
              "--skip-tokenizer-init", "--tensor-parallel-size",
              "--distributed-executor-backend")
_SIDE_FIELDS = ("num_kv_blocks", "swap_space_gb", "max_num_seqs", "enable_prefix_caching")
_WARMUP_PROMPTS, _WARMUP_LEN, _WARMUP_OUTPUT = 2, 64, 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench preemption", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # the engine's flags (--model, --load-format, --dtype, --device, --gpu-memory-utilization,
    # --max-num-batched-tokens, --enforce-eager, ...); the counters are read from the engine in
    # this process, so no TP / worker processes
    add_engine_args(p, exclude=_OWN_FLAGS)
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=64, help="(default %(default)s)")
    w.add_argument("--min-input-len", type=int, default=2048, help="(default %(default)s)")
    w.add_argument("--max-input-len", type=int, default=4096,
                   help="prompt lengths are uniform in [min, max) (default %(default)s)")
    w.add_argument("--output-len", type=int, default=256,
                   help="output tokens per prompt (ignore_eos) (default %(default)s)")
    w.add_argument("--seed", type=int, default=0,
                   help="the prompts' and the engine's seed (default %(default)s)")
    k = p.add_argument_group("pool and preemption")
    k.add_argument("--oversubscription", type=float, default=3.0,
                   help="the batch's demand over the pressured pool (default %(default)s)")
    k.add_argument("--num-kv-blocks", type=int, default=None,
                   help="the pressured pool in blocks (default: demand / --oversubscription, at "
                        "least the longest request's)")
    k.add_argument("--swap-space", dest="swap_space_gb", type=float, default=None, metavar="GiB",
                   help="the swap and by-cost sides' host tier (default: demand - pool + the "
                        "longest request's blocks)")
    k.add_argument("--modes", nargs="+", default=list(PRESSURED_SIDES),
                   choices=list(PRESSURED_SIDES),
                   help="pressured sides to run, in this order (default %(default)s)")
    k.add_argument("--max-num-seqs", type=int, default=None,
                   help="(default: --num-prompts; more can never run at once)")
    k.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=False, help="(default off: see above)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for the whole run (CPU; default torch's)")
    p.add_argument("--output", default=None,
                   help="the JSON result file (default bench/results/preemption-DEVICE.json)")
    return p


def _check_args(args) -> None:
    for name in ("num_prompts", "min_input_len", "max_input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_input_len < args.min_input_len:
        raise ValueError(f"--max-input-len ({args.max_input_len}) must be >= --min-input-len "
                         f"({args.min_input_len})")
    if not (math.isfinite(args.oversubscription) and args.oversubscription >= 1):
        raise ValueError(f"--oversubscription must be a finite number >= 1, got "
                         f"{args.oversubscription}")
    if args.num_kv_blocks is not None and args.num_kv_blocks < 1:
        raise ValueError(f"--num-kv-blocks must be >= 1, got {args.num_kv_blocks}")
    if args.swap_space_gb is not None and not (math.isfinite(args.swap_space_gb)
                                               and args.swap_space_gb > 0):
        raise ValueError(f"--swap-space must be a finite number > 0, got {args.swap_space_gb}")
    if len(set(args.modes)) != len(args.modes):
        raise ValueError(f"--modes lists a side twice: {' '.join(args.modes)}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")


def plan_pool(lengths: list[int], output_len: int, block_size: int, oversubscription: float,
              num_kv_blocks: int | None) -> dict[str, int]:
    """The blocks the batch needs in all (demand), the longest request's, the pressured pool and
    the reference pool (demand + one block per request: nothing is ever short). A pressured
    pool that cannot hold the longest request is a ValueError (nothing could ever finish)."""
    per_request = [-(-(n + output_len) // block_size) for n in lengths]
    demand, longest = sum(per_request), max(per_request)
    pool = num_kv_blocks if num_kv_blocks is not None else max(
        longest, math.ceil(demand / oversubscription))
    if pool < longest:
        raise ValueError(f"--num-kv-blocks {pool} cannot hold the longest request ({longest} "
                         f"blocks of {block_size} tokens: prompt + --output-len)")
    return {"demand_blocks": demand, "longest_request_blocks": longest,
            "pressured_blocks": pool, "reference_blocks": demand + len(lengths)}


def _vocab_size(args) -> int:
    from ..loader.model_loader import resolve_source
    from ..models.config import ModelConfig
    return ModelConfig.from_hf(resolve_source(args.model).hf_config).vocab_size


def _llm(args, max_model_len: int, num_kv_blocks: int, mode: str | None, swap_gb: float):
    from pdserve import LLM
    # (this benchmark's own flags that share a name with an EngineConfig field are set per side)
    shared = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in _SIDE_FIELDS})
    cfg = dataclasses.replace(
        engine_config(shared), seed=args.seed, num_kv_blocks=num_kv_blocks, swap_space_gb=swap_gb,
        preemption_mode=mode, enable_prefix_caching=args.enable_prefix_caching,
        max_model_len=max_model_len, max_num_seqs=args.max_num_seqs or args.num_prompts,
        skip_tokenizer_init=True)
    return LLM(**dataclasses.asdict(cfg))




def _counters(core) -> dict[str, int]:
    s, kv = core.scheduler, core.kv
    return {"preemptions": s.num_preemptions, "swap_preemptions": s.num_swap_preemptions,
            "recompute_preemptions": s.num_recompute_preemptions,
            "blocks_swapped_out": kv.blocks_swapped_out, "blocks_swapped_in": kv.blocks_swapped_in}


def _divergence(ref: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    """How many outputs differ from the reference's, and where the first few first diverge."""
    first = []
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first.append([i, pos])
    return {"outputs_differ": len(first), "first_divergence": first[:8]}


def _run_side(args, prompts, max_model_len: int, num_kv_blocks: int, mode: str | None,
              swap_gb: float, device) -> tuple[dict[str, Any], list[list[int]]]:
    from pdserve import SamplingParams
    t0 = time.perf_counter()
    llm = _llm(args, max_model_len, num_kv_blocks, mode, swap_gb)
    start_s = time.perf_counter() - t0
    core = llm.llm_engine
    n = min(_WARMUP_LEN, args.min_input_len)      # (fits max_model_len and the pool)
    warm = random_prompts(_WARMUP_PROMPTS, n, n, core.vocab_size, args.seed + 1)
    llm.generate([{"prompt_token_ids": p} for p in warm],
                 SamplingParams(temperature=0, max_tokens=min(_WARMUP_OUTPUT, args.output_len),
                                ignore_eos=True), use_tqdm=False)
    core.take_step_records()
    before = _counters(core)
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with CpuUsage() as cpu:
        sync(device)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        sync(device)
        wall = time.perf_counter() - t0
    after = _counters(core)
    records = core.take_step_records()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n_out = sum(len(t) for t in tokens)
    n_in = sum(len(p) for p in prompts)
    side = {"preemption_mode": mode, "num_kv_blocks": core.num_kv_blocks,
            "kv_block_bytes": core.kv_block_bytes,
            "swap_space_gb": swap_gb, "host_blocks": core.num_host_blocks,
            "host_copy_gb_per_s": round(core.host_copy_gb_per_s, 3),
            "engine_start_s": round(start_s, 3), "wall_s": round(wall, 4),
            "output_tokens": n_out, "output_tok_per_s": round(n_out / wall, 2),
            "total_tok_per_s": round((n_in + n_out) / wall, 2),
            **{k: after[k] - before[k] for k in after},
            "steps": len(records),
            # cores other processes kept busy meanwhile (a CPU run's numbers are noise above ~0)
            "other_load": cpu.result()["other_load"],
            # (the engine keeps a bounded ring of step records: None when it may have wrapped)
            "prefill_tokens_computed": (sum(r.num_prefill_tokens for r in records)
                                        if len(records) < STEP_RECORDS_KEPT else None)}
    core.scheduler.check_integrity()
    release_llm(llm)
    del llm, core, outs    # (the engine's KV pool, host tier and weights go with the last reference)
    free_device_memory(device)
    return side, tokens


def run(args) -> dict[str, Any]:
    _check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    vocab = _vocab_size(args)
    prompts = random_prompts(args.num_prompts, args.min_input_len, args.max_input_len, vocab,
                             args.seed)
    lengths = [len(p) for p in prompts]
    pool = plan_pool(lengths, args.output_len, args.block_size, args.oversubscription,
                     args.num_kv_blocks)
    max_model_len = max(lengths) + args.output_len
    workload = {"num_prompts": len(prompts), "prompt_tokens": sum(lengths),
                "prompt_len_min": min(lengths), "prompt_len_max": max(lengths),
                "output_len": args.output_len, "vocab_size": vocab,
                "max_model_len": max_model_len}
    sides: dict[str, dict[str, Any]] = {}
    ref, block_bytes = None, None
    for name in ["reference", *args.modes]:
        if name == "reference":
            mode, blocks, swap_gb = None, pool["reference_blocks"], 0.0
        else:
            mode, tier = PRESSURED_SIDES[name]
            blocks, swap_gb = pool["pressured_blocks"], 0.0
            if tier:
                swap_gb = args.swap_space_gb
                if swap_gb is None:   # one block over, so the floor in plan_host_tier keeps them all
                    host = pool["demand_blocks"] - blocks + pool["longest_request_blocks"] + 1
                    swap_gb = math.ceil(host * block_bytes / 2 ** 30 * 1e6) / 1e6
        side, tokens = _run_side(args, prompts, max_model_len, blocks, mode, swap_gb, device)
        if name == "reference":
            ref, block_bytes = tokens, side["kv_block_bytes"]
        else:
            side.update(_divergence(ref, tokens))
        sides[name] = side
        print(f"[bench preemption] {name}: {side}", flush=True)
    return {"workload": workload, "pool": pool, "sides": sides, "summary": _summary(sides)}


def _summary(sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each pressured side's throughput over the recompute side's and over the reference's,
    its differing outputs, and whether the recompute side differs too (bf16 noise: a swap side
    that differs as much says nothing against swap)."""
    out: dict[str, Any] = {"reference_preemptions": sides["reference"]["preemptions"]}
    rec = sides.get("recompute")
    for name, s in sides.items():
        if name == "reference":
            continue
        key = name.replace("-", "_")
        out[f"{key}_outputs_differ"] = s["outputs_differ"]
        out[f"{key}_over_reference_output_tok_per_s"] = round(
            s["output_tok_per_s"] / sides["reference"]["output_tok_per_s"], 4)
        if rec is not None and name != "recompute":
            out[f"{key}_over_recompute_output_tok_per_s"] = round(
                s["output_tok_per_s"] / rec["output_tok_per_s"], 4)
    if rec is not None:
        out["recompute_also_differs"] = rec["outputs_differ"] > 0
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        _check_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    output = args.output or f"bench/results/preemption-{torch.device(args.device).type}.json"
    payload = run_described("preemption", run, args, argv, output)
    if payload is None:
        return 1
    for k, v in payload["summary"].items():
        print(f"{k}: {v}")
    print(f"wrote {os.path.abspath(write_result(output, payload))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
