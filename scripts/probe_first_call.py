"""Is the first CUDA call of an engine step slow whatever it is? (issue 16, case 1's warm step)

In a traced warm prefix hit, the step's first CUDA call (the copy-on-write ids' upload) held the
host for ~390 us in cudaMemcpyAsync with the device idle, while later small uploads of the same
step took 10-20 us. This times one call of each kind below after the host has done
--busy-us of Python work since a device synchronize (as a step does: add_request, schedule),
and the same call straight after another (hot). Host wall time per call, median of --reps.

  upload_new     torch.tensor(4 ints, pinned) then .to(cuda, non_blocking): model_runner._to_device
  upload_pinned  a preallocated pinned tensor's .copy_ into a preallocated device tensor
  tiny_kernel    x.add_(1) on a 1-element device tensor
  event_record   torch.cuda.Event().record()

With --engine MODEL (a dummy-weight LLM), the engine's own pre-forward steps too, in its process
(its allocators, graphs and pools), on its scratch block (nothing live is touched):

  engine_cow     ModelRunner._copy_blocks of one pair (the copy-on-write a mid-block hit needs)
  engine_stage   StepInputs.stage of a 42-token chunk over 2,083 cached tokens, padded to the
                 48-token mixed graph (what case 1's warm step stages)
  engine_replay  the replay of that graph (the host's cudaGraphLaunch; the device then runs
                 the whole forward, untimed)

    python scripts/probe_first_call.py [--engine qwen2.5-1.5b] [--output probe.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def busy(us: float) -> None:
    """Python work for about `us` microseconds (allocations and dict traffic, like a scheduler)."""
    end = time.perf_counter() + us * 1e-6
    junk = {}
    i = 0
    while time.perf_counter() < end:
        junk[i % 512] = [i] * 16
        i += 1


def engine_ops(model: str) -> dict:
    """The engine's copy-on-write, staging and graph replay for case 1's warm step, as ops."""
    from pdserve import LLM
    from pdserve.engine.scheduler import ScheduledChunk
    llm = LLM(model, device="cuda", load_format="dummy", skip_tokenizer_init=True)
    runner = llm.llm_engine.runner
    s, bs = runner.scratch_block, runner.inputs.block_size
    chunk = ScheduledChunk("probe", [0] * 42, 2083, [s] * -(-2125 // bs), False)
    plan = runner.graphs.plan(42, 1, 42, 2125)
    assert plan is not None and plan.key[0] == "mixed", plan
    ops = {"engine_cow": lambda: runner._copy_blocks([(s, s)]),
           "engine_stage": lambda: runner.inputs.stage([chunk], plan.num_tokens, plan.num_seqs)}
    ops["engine_stage"]()
    ops["engine_replay"] = lambda: runner.graphs.replay(plan, 42)
    engine_ops.llm = llm     # (kept alive)
    return ops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--busy-us", type=float, nargs="+", default=[0.0, 300.0, 900.0, 3000.0])
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--engine", help="also time the engine's pre-forward steps (a model preset)")
    p.add_argument("--output")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    x = torch.zeros(1, device=dev)
    pinned = torch.arange(4, dtype=torch.long).pin_memory()
    dst = torch.empty(4, dtype=torch.long, device=dev)
    ops = {
        "upload_new": lambda: torch.tensor([1, 2, 3, 4], dtype=torch.long,
                                           pin_memory=True).to(dev, non_blocking=True),
        "upload_pinned": lambda: dst.copy_(pinned, non_blocking=True),
        "tiny_kernel": lambda: x.add_(1),
        "event_record": lambda: torch.cuda.Event().record(),
    }
    if a.engine:
        ops.update(engine_ops(a.engine))
    for op in ops.values():      # warm every path once
        op()
    torch.cuda.synchronize()
    rows = []
    for name, op in ops.items():
        for busy_us in a.busy_us:
            first, hot = [], []
            for _ in range(a.reps):
                torch.cuda.synchronize()
                busy(busy_us)
                t0 = time.perf_counter()
                op()
                t1 = time.perf_counter()
                op()
                t2 = time.perf_counter()
                first.append((t1 - t0) * 1e6)
                hot.append((t2 - t1) * 1e6)
            row = {"op": name, "busy_us": busy_us, "first_us": round(statistics.median(first), 1),
                   "first_p90_us": round(sorted(first)[int(0.9 * (len(first) - 1))], 1),
                   "hot_us": round(statistics.median(hot), 1)}
            rows.append(row)
            print(f"{name:<14} after {busy_us:6.0f} us of Python: first {row['first_us']:7.1f} us "
                  f"(p90 {row['first_p90_us']:7.1f}), the next one {row['hot_us']:6.1f} us", flush=True)
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"command": " ".join(["python", *sys.argv]),
                       "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
