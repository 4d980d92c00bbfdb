"""The simulated serving front: the one `pdserve serve` process in front of every worker of a
deployment (uvicorn, the API, the router, the engine client's I/O thread: one Python process,
one GIL), whose CPU work is serial. At overload it, not the device, can be what limits a
server: it admits every request and streams every token, and a token the engine sampled is
not the client's until the API has done its part.

One FIFO server of CPU work on the simulated clock, costed by a profile's api_cost_ms:

    a request arriving at t       queues  a = per_request_ms + per_prompt_token_ms * prompt len
    a token sampled at t          queues  c = per_output_token_ms
    work queued at t              starts at max(t, when the work queued before it ends) and
                                  ends its cost later

    time ──────────────────────────────────────────────────────────────────────────────>
    API    [ a: req 1 ][ a: req 2 ][c][c][c]   [ a: req 3 ][c][c] ...
                                   ^ a step's three tokens, sampled at its end, delivered
                                     c, 2c, 3c after it (in the step's chunk order)

Work must be queued in time order (the simulator's event loop pops events in time order and
queues at the event's time); queueing earlier than the last work queued is an error.

The serving overhead (the profile's serving_overhead_ms, measured on a lone request from the
client's send to its first token, less the lone prefill) already holds that request's admission
and its first token's delivery on an idle API. So a request reaches the router when its
admission is done plus what the overhead holds beyond those two:

    reach = admission done + max(0, overhead - a - c)

and a lone request on an idle API keeps the measured TTFT: overhead + prefill (as long as the
overhead is at least a + c). Tokens do not hold the engine back: a real engine keeps stepping
while the API lags (its outputs queue in the API's socket), so only the client's times move.
Plain Python.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from ..perf.cost_profile import API_COST_KEYS


class ApiProcess:
    """The serving front's CPU as one FIFO server (the module docstring). cost: a profile's
    api_cost_ms, the three API_COST_KEYS (ms)."""

    def __init__(self, cost: Mapping[str, float]):
        if set(cost) != set(API_COST_KEYS):
            raise ValueError(f"api cost: needs exactly {', '.join(API_COST_KEYS)}, got "
                             f"{sorted(cost)}")
        for k in API_COST_KEYS:
            v = cost[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0:
                raise ValueError(f"api cost: {k} must be a finite number >= 0, got {v!r}")
        self.cost = {k: float(cost[k]) for k in API_COST_KEYS}
        self.free_at = 0.0          # s: when the work queued so far is done
        self.last_queued = 0.0      # s: when the latest work was queued
        self.busy_s = 0.0
        self.admissions = 0
        self.admission_wait_s = 0.0     # summed: time a request's admission waited to start
        self.admission_wait_max_s = 0.0
        self.tokens = 0
        self.lag_s = 0.0                # summed: a token's delivery less its sampling
        self.lag_max_s = 0.0

    def admission_ms(self, prompt_len: int) -> float:
        c = self.cost
        return c["per_request_ms"] + c["per_prompt_token_ms"] * prompt_len

    def _queue(self, t: float, ms: float) -> tuple[float, float]:
        """(start, end) of `ms` of work queued at t."""
        if t < self.last_queued:
            raise RuntimeError(f"API work queued at {t!r} s after work queued at "
                               f"{self.last_queued!r} s: the simulator must queue in time order")
        self.last_queued = t
        start = max(t, self.free_at)
        self.free_at = start + ms / 1e3
        self.busy_s += ms / 1e3
        return start, self.free_at

    def admit(self, t: float, prompt_len: int, serving_overhead_s: float) -> float:
        """A request of prompt_len tokens arriving at t: when it reaches the router."""
        a = self.admission_ms(prompt_len)
        start, done = self._queue(t, a)
        self.admissions += 1
        self.admission_wait_s += start - t
        self.admission_wait_max_s = max(self.admission_wait_max_s, start - t)
        held = (a + self.cost["per_output_token_ms"]) / 1e3
        return done + max(0.0, serving_overhead_s - held)

    def deliver(self, t: float) -> float:
        """A token sampled at t: when the client sees it."""
        _, seen = self._queue(t, self.cost["per_output_token_ms"])
        self.tokens += 1
        self.lag_s += seen - t
        self.lag_max_s = max(self.lag_max_s, seen - t)
        return seen

    def facts(self, span_s: float) -> dict[str, Any]:
        """What the API did over a run of span_s seconds (utilization: busy / span)."""
        return {"cost_ms": dict(self.cost), "busy_s": self.busy_s,
                "utilization": self.busy_s / span_s if span_s > 0 else None,
                "admissions": self.admissions,
                "admission_wait_ms_mean": (self.admission_wait_s / self.admissions * 1e3
                                           if self.admissions else None),
                "admission_wait_ms_max": self.admission_wait_max_s * 1e3,
                "tokens": self.tokens,
                "delivery_lag_ms_mean": self.lag_s / self.tokens * 1e3 if self.tokens else None,
                "delivery_lag_ms_max": self.lag_max_s * 1e3}
