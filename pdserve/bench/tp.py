"""`pdserve bench tp`: decode step time at TP=1 and TP=N through worker processes, and the
all-reduce latency of one decode step's message, measured in the same run.

Step time: `batch` streaming requests are prefilled, then the worker sends one Outputs message per
engine step; the client records when each arrives and reports the median gap over `--steps` steps
(the engine's step as a client sees it: schedule + broadcast to the other ranks + forward +
sample). TP=1 runs through the same worker process path, so the two are comparable.

Graph floor (CUDA): the same ranks' batch-1 decode graph replayed back to back with nothing in
between — the GPU time of a step — and with the logits, argmax and host sync a step adds. The
difference between the step and this floor is host time the GPU waits for.

All-reduce: one process per GPU, a tensor of batch x hidden elements in the model dtype, through
NCCL and through the one-shot P2P kernel the engine uses for small messages, each timed eagerly
and replayed from a CUDA graph of 100 all-reduces (how the decode graph runs them).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from .common import copy_bandwidth, git_info, hardware_info, random_prompts, write_result


def measure_stream(llm, batch: int, context: int, steps: int, warmup: int, seed: int
                   ) -> dict[str, Any]:
    from pdserve import SamplingParams
    from pdserve.protocol import AddRequest
    client = llm.llm_engine
    prompts = random_prompts(batch, context, context + 1, client.info.vocab_size, seed)
    sp = SamplingParams(temperature=0, max_tokens=warmup + steps + 4, ignore_eos=True)
    ids = [f"tp-{batch}-{context}-{i}" for i in range(batch)]
    errors = client.add_requests([AddRequest(r, {"prompt_token_ids": p}, sp)
                                  for r, p in zip(ids, prompts)])
    assert errors == [None] * batch, errors
    started: set[str] = set()
    while len(started) < batch:  # prefill until every sequence has its first token
        started.update(o.request_id for o in client.step())
    arrivals = []
    while len(arrivals) < warmup + steps + 1:
        outs = client.step()
        if outs:
            arrivals.append(time.perf_counter())
    client.abort_request(ids)
    gaps = [b - a for a, b in zip(arrivals[warmup:], arrivals[warmup + 1:])]
    gaps.sort()
    return {"step_ms": statistics.median(gaps) * 1e3,
            "step_ms_p10": gaps[len(gaps) // 10] * 1e3,
            "step_ms_p90": gaps[len(gaps) * 9 // 10] * 1e3, "steps": len(gaps)}


# ---- all-reduce microbenchmark (one process per rank) ------------------------------------------
def _time_allreduce(fn, x: torch.Tensor) -> tuple[float, float]:
    """(eager us, us inside a CUDA graph of 100) per all-reduce of x by fn."""
    import torch.distributed as dist
    for _ in range(20):
        fn(x)
    torch.cuda.synchronize()
    iters = 200
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x)
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - t0) / iters * 1e6
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(100):
            fn(x)
    g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return eager_us, (time.perf_counter() - t0) / (reps * 100) * 1e6


def _allreduce_rank(rank: int, world: int, init: str, numels: list[int], dtype: str,
                    out_path: str) -> None:
    import torch.distributed as dist

    from ..layers.parallel_state import destroy_tp_group, init_tp_group
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    tp = init_tp_group(rank, world, init, dev, one_shot=True)
    dt = getattr(torch, dtype)
    results = []
    for n in numels:
        x = torch.full((n,), float(rank + 1), dtype=dt, device=dev)
        want = world * (world + 1) / 2
        row = {"numel": n, "bytes": n * x.element_size(), "dtype": dtype}

        def nccl(t):
            dist.all_reduce(t)
            return t
        ok = bool(torch.all(nccl(x.clone()) == want).item())
        row["nccl_eager_us"], row["nccl_graph_us"] = _time_allreduce(nccl, x.clone())
        row["nccl_correct"] = ok
        if tp.one_shot is not None and tp.one_shot.supports(x):
            row["one_shot_correct"] = bool(torch.all(tp.one_shot(x) == want).item())
            row["one_shot_eager_us"], row["one_shot_graph_us"] = _time_allreduce(tp.one_shot, x)
        results.append(row)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    destroy_tp_group()


def _graph_floor_rank(rank: int, world: int, init: str, model: str, dtype: str, one_shot: bool,
                      out_path: str) -> None:
    """GPU floor of a batch-1 decode step: the captured decode graph replayed back to back (no
    host work between replays), and the same with the logits and argmax a step adds."""
    from ..config import EngineConfig
    from ..worker.build import build_model_runner
    from ..layers.parallel_state import destroy_tp_group, init_tp_group
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    init_tp_group(rank, world, init, dev, one_shot=one_shot)
    cfg = EngineConfig(model=model, load_format="dummy", dtype=dtype, device=str(dev),
                       skip_tokenizer_init=True, max_num_seqs=1, max_model_len=1024,
                       num_kv_blocks=256, tensor_parallel_size=world)
    runner, _, _ = build_model_runner(cfg)
    key = runner.graphs.plan(1, 1, 1, 1).key   # the batch-1 decode graph, shortest tier
    g, hidden = runner.graphs.graphs[key], runner.graphs.outputs[key]

    def timed(fn, iters=300) -> float:
        for _ in range(30):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters * 1e3

    with torch.inference_mode():
        replay_ms = timed(g.replay)
        step_ms = timed(lambda: (g.replay(), runner.model.compute_logits(hidden).argmax(-1).tolist()))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"graph_replay_ms": replay_ms, "replay_logits_argmax_sync_ms": step_ms}, f)
    runner.release()
    destroy_tp_group()


def _launch_ranks(world: int, flag: str, args: list[str]) -> dict | list:
    """Runs this module's `flag` entry in `world` processes; returns what rank 0 wrote."""
    from ..worker.launch import free_port
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        init = f"tcp://127.0.0.1:{free_port()}"
        procs = [subprocess.Popen([sys.executable, "-m", "pdserve.bench.tp", flag, str(r),
                                   str(world), init, out, *args]) for r in range(world)]
        try:
            codes = [p.wait(300) for p in procs]
        except subprocess.TimeoutExpired:
            codes = None
        finally:
            for p in procs:
                p.kill()
        if codes is None or any(codes):
            raise RuntimeError(f"{flag} ranks failed or hung (exit codes {codes})")
        with open(out) as f:
            return json.load(f)


def allreduce_latency(world: int, numels: list[int], dtype: str) -> list[dict[str, Any]]:
    return _launch_ranks(world, "--allreduce-rank", [json.dumps(numels), dtype])


def graph_floor(world: int, model: str, dtype: str, one_shot: bool) -> dict[str, float]:
    return _launch_ranks(world, "--graph-floor-rank", [model, dtype, str(int(one_shot))])


def run(args) -> dict[str, Any]:
    from pdserve import LLM
    from pdserve.models.config import ModelConfig
    from pdserve.models.presets import PRESETS
    device = torch.device(args.device)
    bw = copy_bandwidth(device)
    results = []
    allreduce = {}
    for model in args.models:
        mcfg = ModelConfig.from_hf(dict(PRESETS[model])) if model in PRESETS else None
        variants = [(tp, False) for tp in args.tp_sizes]
        if args.compare_nccl:
            variants += [(tp, True) for tp in args.tp_sizes if tp > 1]
        for tp, nccl_only in variants:
            llm = LLM(model, load_format=args.load_format, dtype=args.dtype, device=args.device,
                      skip_tokenizer_init=True, max_num_seqs=max(args.batch_sizes),
                      max_model_len=args.context + args.steps + args.warmup + 16,
                      tensor_parallel_size=tp, distributed_executor_backend="mp",
                      enforce_eager=args.enforce_eager, disable_custom_all_reduce=nccl_only,
                      gpu_memory_utilization=args.gpu_memory_utilization)
            info = llm.llm_engine.info
            for bs in args.batch_sizes:
                r = measure_stream(llm, bs, args.context, args.steps, args.warmup, args.seed)
                kv = bs * (args.context + args.warmup + args.steps // 2) * info.kv_bytes_per_token_per_rank
                entry = {"model": model, "tp": tp, "batch_size": bs, "context": args.context,
                         "all_reduce": "nccl" if nccl_only or tp == 1 else "one-shot", **r,
                         "weight_bytes_per_rank": info.weight_bytes_per_rank,
                         "roofline_ms": (info.weight_bytes_per_rank + kv) / bw * 1e3}
                results.append(entry)
                print(f"{model:>14} tp={tp} {entry['all_reduce']:>8} bs={bs:<4} step {r['step_ms']:8.3f} ms  "
                      f"(p10 {r['step_ms_p10']:.3f}, p90 {r['step_ms_p90']:.3f})  per-rank roofline "
                      f"{entry['roofline_ms']:.3f} ms", flush=True)
            llm.shutdown()
            if device.type == "cuda" and args.graph_floor and not args.enforce_eager:
                dtype = "bfloat16" if args.dtype == "auto" else args.dtype
                try:
                    floor = graph_floor(tp, model, dtype, one_shot=not nccl_only)
                except RuntimeError as e:
                    print(f"graph floor not measured: {e}", flush=True)
                    continue
                for e in results:
                    if e["model"] == model and e["tp"] == tp and e["batch_size"] == 1 and \
                            e["all_reduce"] == ("nccl" if nccl_only or tp == 1 else "one-shot"):
                        e.update(floor)
                print(f"{model:>14} tp={tp} batch-1 decode graph replayed back to back: "
                      f"{floor['graph_replay_ms']:.3f} ms; with logits + argmax + sync: "
                      f"{floor['replay_logits_argmax_sync_ms']:.3f} ms", flush=True)
        if mcfg is not None and device.type == "cuda" and max(args.tp_sizes) > 1:
            dtype = "bfloat16" if args.dtype == "auto" else args.dtype
            numels = sorted({bs * mcfg.hidden_size for bs in args.batch_sizes})
            allreduce[model] = allreduce_latency(max(args.tp_sizes), numels, dtype)
            for a in allreduce[model]:
                print(f"{model:>14} all-reduce {a['bytes']:>8} B in a CUDA graph: NCCL "
                      f"{a['nccl_graph_us']:.1f} us, one-shot {a.get('one_shot_graph_us', float('nan')):.1f}"
                      f" us (eager {a['nccl_eager_us']:.1f} / {a.get('one_shot_eager_us', float('nan')):.1f};"
                      f" correct {a['nccl_correct']} / {a.get('one_shot_correct')})")
    speedups = []
    for e in results:
        base = next((b for b in results if b["model"] == e["model"] and b["tp"] == 1
                     and b["batch_size"] == e["batch_size"]), None)
        if base is not None and e["tp"] > 1:
            speedups.append({"model": e["model"], "tp": e["tp"], "batch_size": e["batch_size"],
                             "all_reduce": e["all_reduce"],
                             "speedup_vs_tp1": base["step_ms"] / e["step_ms"]})
            print(f"{e['model']:>14} bs={e['batch_size']} TP={e['tp']} ({e['all_reduce']}) is "
                  f"{base['step_ms'] / e['step_ms']:.2f}x TP=1")
    return {"benchmark": "tp", "copy_bandwidth_bytes_per_s": bw, "results": results,
            "speedups": speedups, "allreduce": allreduce}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--allreduce-rank"]:
        rank, world, init, out, numels, dtype = argv[1:7]
        _allreduce_rank(int(rank), int(world), init, json.loads(numels), dtype, out)
        return 0
    if argv[:1] == ["--graph-floor-rank"]:
        rank, world, init, out, model, dtype, one_shot = argv[1:8]
        _graph_floor_rank(int(rank), int(world), init, model, dtype, one_shot == "1", out)
        return 0
    p = argparse.ArgumentParser(prog="pdserve bench tp")
    p.add_argument("--models", nargs="+", default=["qwen2.5-7b"])
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--compare-nccl", action=argparse.BooleanOptionalAction, default=True,
                   help="also run TP > 1 with NCCL for every all-reduce")
    p.add_argument("--graph-floor", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA: also time the batch-1 decode graph replayed with no engine around it")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    payload = run(args)
    payload.update(command=["pdserve", "bench", "tp", *argv], config=vars(args),
                   hardware=hardware_info(), **git_info())
    out = args.output or f"bench/results/tp-{torch.device(args.device).type}.json"
    print("wrote", write_result(out, payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
