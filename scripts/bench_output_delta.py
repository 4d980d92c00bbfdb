"""Per-output cost of the worker -> client delta encoding (worker/output_delta.py) on this CPU:
128 streams with 1,280-token prompts, 64 steps each; every step encodes each stream's cumulative
output (the worker's side) and decodes the delta back (the server's I/O thread). Medians of 5
runs, in microseconds per output:

    PYTHONPATH=. python scripts/bench_output_delta.py
"""
from __future__ import annotations

import copy
import random
import statistics
import time

from pdserve.outputs import CompletionOutput, RequestOutput
from pdserve.worker.output_delta import DeltaDecoder, DeltaEncoder

N_REQ, STEPS, PROMPT = 128, 64, 1280


def _workload():
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(150000) for _ in range(PROMPT)] for i in range(N_REQ)}
    tokens = {r: [rng.randrange(150000) for _ in range(STEPS)] for r in prompts}

    def step(s: int) -> list[RequestOutput]:
        fin = "length" if s == STEPS - 1 else None
        return [RequestOutput(r, None, p, [CompletionOutput(
            0, "x" * (s + 1), tokens[r][:s + 1], None, fin, None, [tokens[r][s]], "x")],
            fin is not None) for r, p in prompts.items()]
    return step


def run_once(step) -> tuple[float, float]:
    enc, dec = DeltaEncoder(), DeltaDecoder()
    t_enc = t_dec = 0.0
    for s in range(STEPS):
        outs = step(s)
        t0 = time.perf_counter()
        wire = [enc.encode(o) for o in outs]
        t_enc += time.perf_counter() - t0
        wire = copy.deepcopy(wire)        # (the client gets fresh objects off the channel)
        t0 = time.perf_counter()
        for o in wire:
            dec.decode(o)
        t_dec += time.perf_counter() - t0
    n = STEPS * N_REQ
    return t_enc / n * 1e6, t_dec / n * 1e6


def main() -> None:
    step = _workload()
    runs = [run_once(step) for _ in range(5)]
    print(f"encode {statistics.median(r[0] for r in runs):.2f} us, "
          f"decode {statistics.median(r[1] for r in runs):.2f} us per output per step")


if __name__ == "__main__":
    main()
