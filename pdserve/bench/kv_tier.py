"""`pdserve bench kv-tier`: the KV host tier's block moves (worker/kv_host_tier.py) against a
plain pinned-memory copy of the same bytes, measured in the same run (issue 21's target: moves at
>= 80% of the pinned copy's bandwidth).

For each moves-per-step count n, each direction (to_host: device -> host, to_device: host ->
device) and each host-id pattern, one step's KVMoves are applied and waited for, `--reps` times
(the best and the median reported):

    runs       host ids 0 .. n-1 (one run: one DMA per staging chunk)
    scattered  host ids 0, 2, 4, ... (no two consecutive: one DMA per block)
    runs:K     runs of K consecutive host ids, one id left out between them (one DMA per K
               blocks): what a workload's steps look like, e.g. runs:16 (in `pdserve simulate`'s
               multi-turn run of the H200 shape, a step's host ids came in runs of 18-28 blocks
               on average)

Device block ids are a random sample of the pool either way (the gather/scatter on the device
does not care). The pinned baseline copies a contiguous device tensor of n blocks' bytes to (and
from) a pinned host tensor. The start-up probe's own figure (KVHostTier.copy_gb_per_s, what the
engine's cost rule gets) and its time are reported too. A block's shape defaults to one rank of
Qwen2.5-1.5B in bf16 (28 layers, 2 KV heads, head_dim 128, 16 tokens: 448 KiB).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

import torch

from .common import run_described, write_result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench kv-tier", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the device pool lives (default %(default)s)")
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 64, 256, 1024, 4096],
                   help="blocks moved per step, one measurement each (default %(default)s)")
    p.add_argument("--layers", type=int, default=28, help="layers (default %(default)s)")
    p.add_argument("--kv-heads", type=int, default=2,
                   help="KV heads on this rank (default %(default)s)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (default %(default)s)")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per block (default %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"],
                   help="KV dtype (default %(default)s)")
    p.add_argument("--patterns", nargs="+", default=["runs", "scattered"], type=_pattern,
                   help="host-id patterns: runs, scattered, runs:K (default %(default)s)")
    p.add_argument("--reps", type=int, default=5,
                   help="timed repetitions per point, after one warm-up (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="device ids' seed (default %(default)s)")
    p.add_argument("--output", default="bench/results/kv-tier.json",
                   help="the JSON result file (default %(default)s)")
    return p


def _pattern(s: str) -> str:
    if s in ("runs", "scattered"):
        return s
    k = s[len("runs:"):] if s.startswith("runs:") else ""
    if not (k.isdigit() and int(k) >= 1):
        raise argparse.ArgumentTypeError(f"a pattern is runs, scattered or runs:K (K >= 1), "
                                         f"got {s!r}")
    return f"runs:{int(k)}"


def host_ids(pattern: str, n: int) -> list[int]:
    """The n host ids of a pattern (module docstring), ascending; all below 2 * n."""
    if pattern == "runs":
        return list(range(n))
    if pattern == "scattered":
        return list(range(0, 2 * n, 2))
    k = int(pattern[len("runs:"):])          # (checked by the parser: _pattern)
    return [i + i // k for i in range(n)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, reps: int) -> list[float]:
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ..engine.kv_cache_manager import KVMoves
    from ..worker.kv_host_tier import KVHostTier
    if min(args.blocks) < 1 or args.reps < 1:
        raise ValueError("--blocks and --reps must be >= 1")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    most = max(args.blocks)
    shape = (args.layers, 2, most + 1, args.block_size, args.kv_heads, args.head_dim)
    kv = torch.randn(shape, dtype=torch.float32, device=device).to(dtype)
    t0 = time.perf_counter()
    tier = KVHostTier(kv, 2 * most, measure=False)        # (host_ids: all below 2 * n)
    alloc_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    probe = tier._measure()
    probe_s = time.perf_counter() - t0
    bb = tier.block_bytes
    rng = random.Random(args.seed)
    points = []
    for n in args.blocks:
        dev = rng.sample(range(most), n)
        nbytes = n * bb
        flat = torch.empty(nbytes // kv.element_size(), dtype=dtype, device=device)
        pinned = torch.empty(flat.shape, dtype=dtype, pin_memory=device.type == "cuda")
        cuda = device.type == "cuda"
        base = {"to_host": _timed(lambda: pinned.copy_(flat, non_blocking=cuda), device, args.reps),
                "to_device": _timed(lambda: flat.copy_(pinned, non_blocking=cuda), device,
                                    args.reps)}
        for pattern in args.patterns:
            host = host_ids(pattern, n)
            rng.shuffle(host)
            moves = {"to_host": KVMoves(list(zip(dev, host)), []),
                     "to_device": KVMoves([], list(zip(host, dev)))}
            for direction, mv in moves.items():
                def step(mv=mv):
                    tier.begin_step()
                    tier.apply(mv)
                    tier.synchronize()
                t = _timed(step, device, args.reps)
                b = base[direction]
                gbs, pin = nbytes / min(t) / 1e9, nbytes / min(b) / 1e9
                points.append({
                    "blocks": n, "pattern": pattern, "direction": direction, "bytes": nbytes,
                    "best_ms": round(min(t) * 1e3, 4), "median_ms": round(statistics.median(t) * 1e3, 4),
                    "blocks_per_s": round(n / min(t)), "gb_per_s": round(gbs, 3),
                    "pinned_copy_best_ms": round(min(b) * 1e3, 4),
                    "pinned_copy_gb_per_s": round(pin, 3),
                    "fraction_of_pinned": round(gbs / pin, 3)})
                p = points[-1]
                print(f"{n:5d} blocks {pattern:9s} {direction:9s}: {p['gb_per_s']:8.2f} GB/s "
                      f"({p['blocks_per_s']} blocks/s), pinned copy {p['pinned_copy_gb_per_s']:8.2f} "
                      f"GB/s -> {p['fraction_of_pinned']:.0%}", flush=True)
        del flat, pinned
    worst = min(p["fraction_of_pinned"] for p in points)
    big = [p["fraction_of_pinned"] for p in points if p["bytes"] >= 64 << 20]
    return {"block_bytes": bb, "chunk_blocks": tier.chunk_blocks,
            "host_pool_blocks": tier.num_host_blocks,
            "host_pool_alloc_s": round(alloc_s, 4),
            "startup_probe_gb_per_s": round(probe, 3), "startup_probe_s": round(probe_s, 4),
            "points": points, "worst_fraction_of_pinned": worst,
            "worst_fraction_of_pinned_at_64MiB_or_more": min(big) if big else None,
            "target_fraction": 0.8}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    payload = run_described("kv-tier", run, args, argv, args.output)
    if payload is None:
        return 1
    print(f"wrote {os.path.abspath(write_result(args.output, payload))}")
    return 0
