"""`pdserve bench pd`: P/D hand-off on one host — per-request KV transfer bandwidth and time,
and TTFT with and without disaggregation, on one 1-prefill / 1-decode deployment.

For each prompt length, one request at a time (so nothing else shares the GPUs):
  disagg:     the router sends it to the prefill worker (first token + KV held), then to the
              decode worker, which pulls the KV (the decode worker's rank 0 reports the bytes it
              moved and the copies' GPU time) and decodes one more token;
  collocated: the same request on the decode worker alone (prefill + decode there).
TTFT is the time from add_requests to the first token reaching the router; transfer share =
transfer time / disagg TTFT. The peer-copy roofline (one large contiguous copy from GPU 0 to
GPU 1) is measured in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from .common import git_info, hardware_info, random_prompts, write_result


def peer_copy_bandwidth(src: int, dst: int, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes per second of one contiguous copy from GPU src to GPU dst (median)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(dst)
        times.append(time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return nbytes / statistics.median(times)


def host_copy_bandwidth(dev: int, nbytes: int = 256 << 20, reps: int = 10) -> dict[str, float]:
    """Bytes per second of one contiguous copy GPU -> pinned host and back (medians): the
    ceiling of each of the relay's two hops."""
    g = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dev}")
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, a, b in (("d2h", h, g), ("h2d", g, h)):
        for _ in range(3):
            a.copy_(b, non_blocking=True)
        times = []
        for _ in range(reps):
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            a.copy_(b, non_blocking=True)
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        out[f"{name}_GBps"] = nbytes / statistics.median(times) / 1e9
    del g, h
    torch.cuda.empty_cache()
    return out


def _one(router, rid: str, prompt: list[int], sp) -> dict[str, float]:
    from ..protocol import AddRequest
    before = (router.route_stats.transfers, router.route_stats.transfer_bytes,
              router.route_stats.transfer_seconds)
    t0 = time.perf_counter()
    assert router.add_requests([AddRequest(rid, {"prompt_token_ids": prompt}, sp)]) == [None]
    first = None
    while router.has_unfinished_requests():
        if router.step() and first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    s = router.route_stats
    return {"ttft_ms": (first - t0) * 1e3, "e2e_ms": (end - t0) * 1e3,
            "transfers": s.transfers - before[0], "transfer_bytes": s.transfer_bytes - before[1],
            "transfer_ms": (s.transfer_seconds - before[2]) * 1e3}


def measure(model: str, prompt_lens: list[int], reps: int, mode: str, gpu_util: float,
            seed: int, connector: str = "shared") -> dict[str, Any]:
    from .. import SamplingParams
    from ..args import DeploymentArgs
    from ..config import EngineConfig
    from ..deploy import build
    from ..routing import CollocatedPolicy, DisaggPolicy
    base = EngineConfig(model=model, load_format="dummy", skip_tokenizer_init=True,
                        device="cuda", gpu_memory_utilization=gpu_util, kv_transfer_mode=mode,
                        max_num_batched_tokens=max(8192, max(prompt_lens)))
    router = build(base, DeploymentArgs(prefill=1, decode=1, routing_policy="disagg",
                                        kv_connector=connector))
    rows = []
    try:
        vocab = router.info.vocab_size
        kv_per_token = router.info.kv_bytes_per_token_per_rank
        sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        for n in prompt_lens:
            prompts = random_prompts(reps + 1, n, n + 1, vocab, seed)
            for policy in (DisaggPolicy(), CollocatedPolicy()):
                router.policy = policy
                runs = [_one(router, f"{policy.name}-{n}-{i}", p, sp)
                        for i, p in enumerate(prompts)][1:]  # the first is warm-up
                row = {"model": model, "connector": connector, "prompt_len": n,
                       "path": policy.name, "reps": reps,
                       "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
                       "e2e_ms": statistics.median(r["e2e_ms"] for r in runs),
                       "kv_bytes_expected": n * kv_per_token}
                if policy.name == "disagg":
                    assert all(r["transfers"] == 1 for r in runs), runs
                    row["transfer_ms"] = statistics.median(r["transfer_ms"] for r in runs)
                    row["transfer_bytes"] = runs[0]["transfer_bytes"]
                    row["transfer_GBps"] = row["transfer_bytes"] / row["transfer_ms"] / 1e6
                    row["transfer_share_of_ttft"] = row["transfer_ms"] / row["ttft_ms"]
                row["runs"] = runs
                rows.append(row)
                print({k: (round(v, 3) if isinstance(v, float) else v)
                       for k, v in row.items() if k != "runs"}, flush=True)
        router.check_workers()
    finally:
        router.shutdown()
    return {"model": model, "connector": connector, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench pd")
    p.add_argument("--models", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-7b"])
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--mode", default="sync", choices=["sync", "async"])
    p.add_argument("--kv-connectors", nargs="+", default=["shared"],
                   help="GPU connectors to compare (shared, relay, nccl)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None)
    a = p.parse_args(argv)
    peer = peer_copy_bandwidth(0, 1)
    print(f"peer copy GPU0 -> GPU1: {peer / 1e9:.1f} GB/s", flush=True)
    host = host_copy_bandwidth(1)
    print(f"pinned host copies on GPU1: {host}", flush=True)
    results = [measure(m, a.prompt_lens, a.reps, a.mode, a.gpu_memory_utilization, a.seed, c)
               for m in a.models for c in a.kv_connectors]
    argv = sys.argv[1:] if argv is None else argv
    payload = {"benchmark": "pd-handoff", "command": ["pdserve", "bench", "pd", *argv],
               "hardware": hardware_info(), **git_info(), "peer_copy_GBps": peer / 1e9,
               "host_copy": host,
               "mode": a.mode, "results": results}
    if a.output:
        write_result(a.output, payload)
    return 0
