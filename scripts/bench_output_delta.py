"""Per-output cost of the client's delta decoding (worker/output_delta.py) on this CPU: 128
streams with 1,280-token prompts, 64 steps each; every step decodes each stream's delta report
(what a worker's engine sends, engine/output_processor.py) back to the cumulative output, as
the server's I/O thread does. (The worker's side: scripts/bench_worker_outputs.py.) Medians of
5 runs, in microseconds per output:

    PYTHONPATH=. python scripts/bench_output_delta.py
"""
from __future__ import annotations

import copy
import random
import statistics
import time

from pdserve.outputs import CompletionOutput, RequestOutput
from pdserve.worker.output_delta import DeltaDecoder

N_REQ, STEPS, PROMPT = 128, 64, 1280


def _workload():
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(150000) for _ in range(PROMPT)] for i in range(N_REQ)}
    tokens = {r: [rng.randrange(150000) for _ in range(STEPS)] for r in prompts}

    def step(s: int) -> list[RequestOutput]:
        """The delta reports of step s (the first one cumulative)."""
        fin = "length" if s == STEPS - 1 else None
        return [RequestOutput(r, None, p if s == 0 else [], [CompletionOutput(
            0, "x" if s == 0 else "x" * (s + 1) if fin else "", [tokens[r][s]], None, fin, None,
            [tokens[r][s]], "x")], fin is not None) for r, p in prompts.items()]
    return step


def run_once(step) -> float:
    dec = DeltaDecoder()
    t_dec = 0.0
    for s in range(STEPS):
        wire = copy.deepcopy(step(s))     # (the client gets fresh objects off the channel)
        t0 = time.perf_counter()
        for o in wire:
            dec.decode(o)
        t_dec += time.perf_counter() - t0
    return t_dec / (STEPS * N_REQ) * 1e6


def main() -> None:
    step = _workload()
    runs = [run_once(step) for _ in range(5)]
    print(f"decode {statistics.median(runs):.2f} us per output per step")


if __name__ == "__main__":
    main()
