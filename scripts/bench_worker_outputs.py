"""Per-step host cost of a worker's output path on this CPU: an OutputProcessor with N streams of
1,024-token prompts, every step one token for each until 320; what is timed is what the worker
does with a step's outputs (worker.py): take_outputs (deltas, as a worker's engine reports
them) and msgpack of the Outputs message. The appends (detokenization, stops) are not timed.
Medians over the steps:

    PYTHONPATH=. python scripts/bench_worker_outputs.py [--n 128] [--logprobs] [--tokenizer]

--tokenizer detokenizes with the embedded model's tokenizer (off: skip_tokenizer_init, what the
serving benchmark runs).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import msgspec

from pdserve.engine.executor import SampledToken
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.request import Request, sequence_id
from pdserve.sampling_params import SamplingParams
from pdserve.worker import messages as m

PROMPT, OUTPUT = 1024, 320


def run(n: int, logprobs: bool, tokenizer) -> list[float]:
    """Seconds per step of the output path, one entry per step."""
    rng = random.Random(0)
    params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True, logprobs=1 if logprobs else None)
    proc = OutputProcessor(tokenizer, (), 1 << 20, deltas=True)
    reqs = []
    for i in range(n):
        req = Request(sequence_id(f"r{i}", 0), [rng.randrange(1000, 40000) for _ in range(PROMPT)],
                      params)
        proc.add(f"r{i}", None, req.prompt_token_ids, params, [req], False, 0.0, [])
        reqs.append(req)
    enc = msgspec.msgpack.Encoder()
    times = []
    for step in range(OUTPUT):
        now = float(step)
        for req in reqs:
            tok = rng.randrange(1000, 40000)
            req.append_output(tok)
            top = [(tok, -0.5)] if logprobs else None
            stop = proc.append(req, SampledToken(tok, -0.5 if logprobs else None, top), now)
            if stop is not None:
                proc.finish(req, stop, None)
        t0 = time.perf_counter()
        outs = proc.take_outputs(now)
        enc.encode(m.Outputs(outs))
        times.append(time.perf_counter() - t0)
        assert len(outs) == n
    assert len(proc) == 0
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[128, 16])
    ap.add_argument("--logprobs", action="store_true")
    ap.add_argument("--tokenizer", action="store_true")
    args = ap.parse_args()
    tokenizer = None
    if args.tokenizer:
        from pdserve.loader.model_loader import load_tokenizer, resolve_source
        tokenizer = load_tokenizer(resolve_source(None))
    for n in args.n:
        times = run(n, args.logprobs, tokenizer)
        med = statistics.median(times)
        print(f"N={n} logprobs={args.logprobs} tokenizer={args.tokenizer}: "
              f"{med * 1e3:.3f} ms/step median ({med / n * 1e6:.2f} us per request)")


if __name__ == "__main__":
    main()
