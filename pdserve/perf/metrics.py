"""Latency and throughput of a run from its per-request results: the arithmetic behind
`pdserve bench serve`'s numbers, in plain Python and numpy so a router and a simulator compute
the same figures from their own records.

A RequestResult holds one request's timings (seconds, from whoever measured them: an HTTP
client's clock, a simulated clock). compute_metrics summarises a run with vLLM's JSON field
names: duration, completed, failed, token totals, request/output/total-token throughput,
request_goodput (requests meeting every SLO per second, see slo.py), mean/median/std/percentiles
of TTFT, TPOT, ITL and e2e latency in ms, and per-request lists (ttfts, itls in seconds; null
for a failed request). When the server reports usage.prompt_tokens_details.cached_tokens: their
total and share of the prompt tokens. When the requests are turns of conversations (multi-turn):
per-turn aggregates (per_turn_metrics). Percentiles interpolate linearly between order
statistics (numpy's default, as vLLM's benchmark reports them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .slo import meets_slos

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """One request as its sender saw it."""
    prompt_len: int
    expected_output_len: int
    success: bool = False
    output_len: int = 0
    ttft: float = 0.0                  # s, send to first token
    itl: list[float] = field(default_factory=list)  # s, the gaps between tokens
    latency: float = 0.0               # s, send to last token
    start: float = 0.0                 # s since the run started
    error: str = ""
    connect_error: bool = False        # the target could not be reached at all
    generated_text: str = ""           # the answer's text, as streamed
    cached_tokens: int | None = None   # usage.prompt_tokens_details.cached_tokens, if reported
    conversation: int | None = None    # multi-turn: which conversation and turn (from 0)
    turn: int | None = None

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def percentile_label(p: float) -> str:
    """How a percentile appears in a field name: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if float(p).is_integer() else str(p)


def latency_stats(values_s: list[float], name: str,
                  percentiles: list[float]) -> dict[str, float | None]:
    """mean/median/std (population) and the given percentiles of `values_s` (seconds) in ms, as
    {mean,median,std,p<P>}_<name>_ms; None each when there are no values."""
    a = np.asarray(values_s, dtype=float) * 1e3
    ok = a.size > 0
    out: dict[str, float | None] = {
        f"mean_{name}_ms": float(a.mean()) if ok else None,
        f"median_{name}_ms": float(np.median(a)) if ok else None,
        f"std_{name}_ms": float(a.std()) if ok else None}
    for p in percentiles:
        out[f"p{percentile_label(p)}_{name}_ms"] = float(np.percentile(a, p)) if ok else None
    return out


def per_turn_metrics(results: list[RequestResult]) -> list[dict[str, Any]]:
    """One entry per turn index (results with a turn), in order: completed, failed, mean and
    median TTFT (ms), mean prompt tokens, cached tokens (sum over the completed turns that
    reported them; None when none did) and their share of those turns' prompt tokens."""
    by_turn: dict[int, list[RequestResult]] = {}
    for r in results:
        if r.turn is not None:
            by_turn.setdefault(r.turn, []).append(r)
    out = []
    for t in sorted(by_turn):
        rs = by_turn[t]
        ok = [r for r in rs if r.success]
        ttfts = np.asarray([r.ttft for r in ok]) * 1e3
        rep = [r for r in ok if r.cached_tokens is not None]
        cached = sum(r.cached_tokens for r in rep) if rep else None
        rep_in = sum(r.prompt_len for r in rep)
        out.append({
            "turn": t, "completed": len(ok), "failed": len(rs) - len(ok),
            "mean_ttft_ms": float(ttfts.mean()) if ok else None,
            "median_ttft_ms": float(np.median(ttfts)) if ok else None,
            "mean_input_tokens": float(np.mean([r.prompt_len for r in ok])) if ok else None,
            "cached_tokens": cached,
            "cached_token_fraction": cached / rep_in if rep and rep_in else None})
    return out


def compute_metrics(results: list[RequestResult], duration: float,
                    percentiles: list[float] = (50, 90, 99),
                    goodput: dict[str, float] | None = None) -> dict[str, Any]:
    """The run's summary (see the module docstring); `duration` in seconds (first send to last
    completion), `goodput` the SLOs in ms (None: no goodput fields)."""
    ok = [r for r in results if r.success]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_len for r in ok)
    m: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": n_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (n_in + n_out) / duration if duration > 0 else 0.0}
    if goodput:
        good = sum(meets_slos(r, goodput) for r in results)
        m["request_goodput"] = good / duration if duration > 0 else 0.0
        m["num_good_requests"] = good
        m["goodput_slos_ms"] = dict(goodput)
    values = {"ttft": [r.ttft for r in ok],
              "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [g for r in ok for g in r.itl],
              "e2el": [r.latency for r in ok]}
    for name in METRICS:
        m.update(latency_stats(values[name], name, list(percentiles)))
    reported = [r for r in ok if r.cached_tokens is not None]
    if reported:  # the share is of the prompt tokens of the requests that reported a count
        cached = sum(r.cached_tokens for r in reported)
        rep_in = sum(r.prompt_len for r in reported)
        m["total_cached_tokens"] = cached
        m["cached_token_fraction"] = cached / rep_in if rep_in else 0.0
        m["cached_tokens_reported"] = len(reported)
    if any(r.turn is not None for r in results):
        m["per_turn"] = per_turn_metrics(results)
        m["conversation_ids"] = [r.conversation for r in results]
        m["turn_ids"] = [r.turn for r in results]
    m.update(
        input_lens=[r.prompt_len for r in results],
        output_lens=[r.output_len if r.success else 0 for r in results],
        ttfts=[r.ttft if r.success else None for r in results],
        tpots=[r.tpot for r in results],
        e2els=[r.latency if r.success else None for r in results],
        itls=[r.itl if r.success else [] for r in results],
        start_times=[r.start for r in results],
        errors=[r.error for r in results])
    if reported:
        m["cached_tokens"] = [r.cached_tokens if r.success else None for r in results]
    return m
