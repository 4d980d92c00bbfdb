"""`pdserve bench predictor`: how well the router's output-length predictor
(routing/length_predictor.py) guesses, against two baselines, on seeded synthetic workloads; and
what a call costs.

Workloads (`synthetic_workload`, deterministic in the seed; lengths in tokens, drawn log-normal
around a median and clamped):

    mixed        50% chat turns: prompt ~60, answer ~80;  20% code/QA: prompt ~400, answer ~350;
                 30% document summaries: prompt ~3000, summary ~150
    independent  the same prompts; every answer ~150 whatever the prompt (nothing to learn from
                 the prompt: the predictor should match the global mean, not beat it)
    drift        mixed, but from the middle on chat answers are three times longer (~240)

In every workload `--capped-share` of the requests ask for max_tokens drawn from 64/128/256/512
and generate min(natural length, max_tokens); the rest ask for no cap.

Replay: requests arrive in order; each is predicted on arrival and learned from `--lag` arrivals
later (the requests in flight meanwhile: a router learns a request's length only when it ends).
Each scheme is scored over the predictions made on arrival, against the tokens generated: mean
absolute error (mae), root mean squared error (rmse: what a mean estimate minimises, and the
right target for summed decode cost), mean signed error (bias) and the MAE over the first
`--first` requests (mae_first: the cold start). The schemes:

    predictor     LengthPredictor (log2 buckets, empirical-Bayes shrinkage, E[min(L, cap)])
    global_mean   the mean of the predictor's global window, min(mean, max_tokens)
    nanopd        nanoPD's scheme: buckets bounded at 64/128/.../2048 tokens of prompt, the mean of
                  the bucket's last 50 answers when it has >= 5, else of the last 300 overall,
                  else 256; as published (no cap), and `nanopd_capped`: min(its guess, max_tokens)

plus the predictor's own prequential stats (stats(): scored at observe time). Timing: every
predict and observe call of the replay timed on its own (perf_counter_ns), mean and p99 in µs.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from bisect import bisect_left
from collections import deque
from typing import Any, Iterator, NamedTuple

from ..routing.length_predictor import LengthPredictor
from .common import run_described, write_result

WORKLOADS = ("mixed", "independent", "drift")
CAPS = (64, 128, 256, 512)
SCHEMES = ("predictor", "global_mean", "nanopd", "nanopd_capped")


class Request(NamedTuple):
    prompt_len: int
    max_tokens: int | None
    output_len: int          # tokens generated: min(natural length, max_tokens)


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(median * math.exp(rng.gauss(0.0, sigma)))))


def synthetic_workload(kind: str, n: int, seed: int, capped_share: float = 0.3) -> list[Request]:
    """n requests of the workload `kind` (module docstring)."""
    if kind not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {kind!r}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    if not 0 <= capped_share <= 1:
        raise ValueError(f"capped_share must be in [0, 1], got {capped_share!r}")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        u = rng.random()
        if u < 0.5:       # chat turn
            prompt = _lognormal(rng, 60, 0.6, 4, 2000)
            median = 240 if kind == "drift" and i >= n // 2 else 80
            natural = _lognormal(rng, median, 0.5, 1, 4096)
        elif u < 0.7:     # code / QA
            prompt = _lognormal(rng, 400, 0.4, 16, 8000)
            natural = _lognormal(rng, 350, 0.4, 1, 4096)
        else:             # document summary
            prompt = _lognormal(rng, 3000, 0.5, 256, 32000)
            natural = _lognormal(rng, 150, 0.3, 1, 4096)
        if kind == "independent":
            natural = _lognormal(rng, 150, 0.7, 1, 4096)
        cap = rng.choice(CAPS) if rng.random() < capped_share else None
        out.append(Request(prompt, cap, natural if cap is None else min(natural, cap)))
    return out


class NanoPDScheme:
    """nanoPD's output-length predictor, written from its description (module docstring)."""

    def __init__(self, bounds=(64, 128, 256, 512, 1024, 2048), window: int = 50,
                 default: int = 256, min_samples: int = 5):
        self.bounds = list(bounds)
        self.buckets = [deque(maxlen=window) for _ in bounds]
        self.all = deque(maxlen=window * len(bounds))
        self.default, self.min_samples = default, min_samples

    def _idx(self, prompt_len: int) -> int:
        return min(bisect_left(self.bounds, prompt_len), len(self.bounds) - 1)

    def predict(self, prompt_len: int) -> int:
        b = self.buckets[self._idx(prompt_len)]
        if len(b) >= self.min_samples:
            return max(1, round(sum(b) / len(b)))
        if self.all:
            return max(1, round(sum(self.all) / len(self.all)))
        return self.default

    def observe(self, prompt_len: int, output_len: int) -> None:
        self.buckets[self._idx(prompt_len)].append(output_len)
        self.all.append(output_len)


def _p99(xs: list[int]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * 0.99))] / 1e3 if s else 0.0


def _scores(guesses: list[float], actual: list[int], first: int) -> dict[str, float]:
    n = len(actual)
    err = [g - a for g, a in zip(guesses, actual)]
    head = err[:first]
    return {"mae": sum(map(abs, err)) / n, "rmse": math.sqrt(sum(e * e for e in err) / n),
            "bias": sum(err) / n, "mae_first": sum(map(abs, head)) / max(1, len(head))}


def replay(requests: list[Request], lag: int, first: int = 500,
           predictor: LengthPredictor | None = None) -> dict[str, Any]:
    """Every request predicted on arrival by each scheme and learned `lag` arrivals later;
    returns each scheme's scores (MAE, RMSE, mean signed error, MAE over the first `first`
    requests), the ratios of the MAEs, the predictor's stats and per-call timings."""
    pred = predictor or LengthPredictor()
    nano = NanoPDScheme()
    guesses: dict[str, list[float]] = {k: [] for k in SCHEMES}
    t_predict: list[int] = []
    t_observe: list[int] = []
    in_flight: deque[Request] = deque()
    clock = time.perf_counter_ns

    def finish(r: Request) -> None:
        t0 = clock()
        pred.observe(r.prompt_len, r.output_len, r.max_tokens)
        t_observe.append(clock() - t0)
        nano.observe(r.prompt_len, r.output_len)

    for r in requests:
        t0 = clock()
        guess = pred.predict(r.prompt_len, r.max_tokens)
        t_predict.append(clock() - t0)
        guesses["predictor"].append(guess)
        guesses["global_mean"].append(pred.baseline(r.max_tokens))
        g = nano.predict(r.prompt_len)
        guesses["nanopd"].append(g)
        guesses["nanopd_capped"].append(g if r.max_tokens is None else min(g, r.max_tokens))
        in_flight.append(r)
        if len(in_flight) > lag:
            finish(in_flight.popleft())
    while in_flight:
        finish(in_flight.popleft())
    actual = [r.output_len for r in requests]
    scores = {k: _scores(v, actual, first) for k, v in guesses.items()}
    mae = {k: v["mae"] for k, v in scores.items()}
    s = pred.stats()
    return {
        "requests": len(requests),
        "capped_requests": sum(r.max_tokens is not None for r in requests),
        "censored": s.censored,
        "mean_output_len": sum(actual) / len(actual),
        "scores": scores,
        "predictor_over_global_mean": mae["predictor"] / mae["global_mean"],
        "predictor_over_nanopd": mae["predictor"] / mae["nanopd"],
        "predictor_over_nanopd_capped": mae["predictor"] / mae["nanopd_capped"],
        "prequential_stats": s._asdict(),
        "predict_us_mean": sum(t_predict) / len(t_predict) / 1e3,
        "predict_us_p99": _p99(t_predict),
        "observe_us_mean": sum(t_observe) / len(t_observe) / 1e3,
        "observe_us_p99": _p99(t_observe),
    }


def run(args) -> dict[str, Any]:
    results = {}
    for i, kind in enumerate(args.workloads):
        reqs = synthetic_workload(kind, args.num_requests, args.seed + i, args.capped_share)
        results[kind] = r = replay(reqs, args.lag, args.first)
        line = ", ".join(f"{k} {v['mae']:.1f}/{v['rmse']:.1f}/{v['bias']:+.1f}/{v['mae_first']:.1f}"
                         for k, v in r["scores"].items())
        print(f"[bench predictor] {kind} (MAE/RMSE/bias/MAE first {args.first}): {line}; "
              f"MAE ratio to the global mean {r['predictor_over_global_mean']:.3f}; predict "
              f"{r['predict_us_mean']:.2f} us, observe {r['observe_us_mean']:.2f} us", flush=True)
    return {"results": results}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench predictor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--num-requests", type=int, default=20000, help="requests per workload")
    p.add_argument("--lag", type=int, default=32,
                   help="requests in flight: each is learned from this many arrivals later")
    p.add_argument("--capped-share", type=float, default=0.3,
                   help="share of requests with a max_tokens cap (64/128/256/512)")
    p.add_argument("--first", type=int, default=500,
                   help="mae_first: the MAE over this many requests from the start (cold start)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="bench/results/length-predictor.json")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.num_requests < 1:
        print("error: --num-requests must be >= 1", file=sys.stderr)
        return 2
    if args.first < 1:
        print("error: --first must be >= 1", file=sys.stderr)
        return 2
    if args.lag < 0:
        print("error: --lag must be >= 0", file=sys.stderr)
        return 2
    if not 0 <= args.capped_share <= 1:
        print("error: --capped-share must be in [0, 1]", file=sys.stderr)
        return 2
    payload = run_described("predictor", run, args, argv, args.output)
    if payload is None:
        return 1
    print(f"wrote {os.path.abspath(write_result(args.output, payload))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
