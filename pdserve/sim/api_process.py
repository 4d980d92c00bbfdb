"""The simulated serving front: the one `pdserve serve` process in front of every worker of a
deployment (uvicorn, the API, the router, the engine client's I/O thread: one Python process,
one GIL), whose CPU work is serial. At overload it, not the device, can be what limits a
server: it admits every request and streams every token, and a token the engine sampled is
not the client's until the API has written it.

One FIFO server of CPU work on the simulated clock, costed by a profile's api_cost_ms:

    a request arriving at t       queues  a = per_request_ms + per_prompt_token_ms * prompt len
    an engine step ending at t    queues  s = per_step_ms, once, if it sampled any token (its
      with tokens                         worker's message: the engine client's I/O thread
                                          receives and decodes it, wakes the event loop, the
                                          router books it, whatever the number of streams in it)
    a write of k tokens           costs   per_write_ms + per_output_token_ms * k
    work queued at t              starts at max(t, when the work queued before it ends) and
                                  ends its cost later

A step that sampled no token (a prefill chunk short of its prompt's end) costs nothing here;
each worker's step is a message of its own, so two workers' steps ending together are two
charges. The step's charge is queued before its tokens' writes, so a token that is a write of
its own is delivered after both. The server writes each stream once per wake-up, with every
token that reached it since the stream's last write (server/serving.py's stream body,
RequestStream.__anext__ taking all queued outputs). So when the API lags, a stream's next
token joins the write still waiting for the API. A token of stream x sampled at t, after its
step's charge:

    x's last write has not started by t (its start > t)
                    joins it: delivered at that write's end; its c_t = per_output_token_ms is
                    charged at the end of the queue (the work queued so far ends c_t later)
    otherwise       queues a write of its own at t: w + c_t (w = per_write_ms), delivered at
                    that write's end

    time ──────────────────────────────────────────────────────────────────────────────>
    API    [ a: req 2 ][ s ][ w+c: x1 ][ w+c: x2 ][ s ][ w+c: x1 ][c]
                 ^ step 1 ends: its charge, then x1's and x2's tokens, a write each
                                   ^ step 2 ends: its charge; x1's write has started,
                                     so its token is a new write; x2's has not: its token
                                     joins it (delivered at its end) and charges c at the
                                     end of the queue

A request's first token has no write to join: it is a write of its own, as in the server.

The charge for a joined token lands at the end of the queue, not in its write: an
approximation. In the server the write would grow by c_t and push back what was queued after
it; here that write and the items queued between it and the end are not shifted. So the queue's
end (when it empties, and so when a new write or an admission queued next starts: a first
token's time) is exact for the same joins, and the API's busy time is; a joined token's write,
and the items behind it, end early by up to c_t per token joined ahead of them. That is small
while few tokens wait, but it adds up under a long overload (with the API far behind, most
tokens join writes queued long before): facts() says how long the queue runs past the last
delivery. (The unshifted writes also start a little earlier than in the server, so slightly
fewer tokens join.) The step's charge is the same approximation: a joined token is delivered at
its write's end even where that comes before its step's charge, which sits at the end of the
queue behind it. In the server the I/O thread decodes the message beside the event loop (they
share the GIL), so a write queued before the message was decoded may still start after and carry
its token, but the decode would push that write back a little. A stream's state (its last
write) is dropped when its request ends (close).

Work must be queued in time order (the simulator's event loop pops events in time order and
queues at the event's time); queueing earlier than the last work queued is an error.

The serving overhead (the profile's serving_overhead_ms, measured on a lone request from the
client's send to its first token, less the lone prefill) already holds that request's admission,
its prefill step's charge and its first token's write (one token) on an idle API. So a request
reaches the router when its admission is done plus what the overhead holds beyond those three:

    reach = admission done + max(0, overhead - a - (s + w + c))

and a lone request on an idle API keeps the measured TTFT: overhead + prefill (as long as the
overhead is at least a + s + w + c). Tokens do not hold the engine back: a real engine keeps
stepping while the API lags (its outputs queue in the API's socket), so only the client's
times move. Plain Python.
"""
from __future__ import annotations

import math
from typing import Any, Hashable, Mapping, NamedTuple, Sequence

from ..perf.cost_profile import API_COST_KEYS


class _Write(NamedTuple):
    """A stream's latest write on the API's queue (s): when it starts and ends."""
    start: float
    end: float


class ApiProcess:
    """The serving front's CPU as one FIFO server (the module docstring). cost: a profile's
    api_cost_ms, the five API_COST_KEYS (ms)."""

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
        self.steps = 0                  # engine steps charged (those that sampled a token)
        self.tokens = 0
        self.writes = 0
        self.lag_s = 0.0                # summed: a token's delivery less its sampling
        self.lag_max_s = 0.0
        self.last_seen = 0.0            # s: the latest delivery
        self._last_write: dict[Hashable, _Write] = {}   # per open stream

    @property
    def open_streams(self) -> int:
        """Streams with a write on record (delivered to and not closed yet)."""
        return len(self._last_write)

    def admission_ms(self, prompt_len: int) -> float:
        c = self.cost
        return c["per_request_ms"] + c["per_prompt_token_ms"] * prompt_len

    def _in_order(self, t: float) -> None:
        if t < self.last_queued:
            raise RuntimeError(f"API work queued at {t!r} s after work queued at "
                               f"{self.last_queued!r} s: the simulator must queue in time order")
        self.last_queued = t

    def _queue(self, t: float, ms: float) -> _Write:
        """`ms` of work queued at t."""
        self._in_order(t)
        start = max(t, self.free_at)
        self.free_at = start + ms / 1e3
        self.busy_s += ms / 1e3
        return _Write(start, self.free_at)

    def admit(self, t: float, prompt_len: int, serving_overhead_s: float) -> float:
        """A request of prompt_len tokens arriving at t: when it reaches the router."""
        a = self.admission_ms(prompt_len)
        start, done = self._queue(t, a)
        self.admissions += 1
        self.admission_wait_s += start - t
        self.admission_wait_max_s = max(self.admission_wait_max_s, start - t)
        c = self.cost
        held = (a + c["per_step_ms"] + c["per_write_ms"] + c["per_output_token_ms"]) / 1e3
        return done + max(0.0, serving_overhead_s - held)

    def step(self, t: float, streams: Sequence[Hashable]) -> list[float]:
        """An engine step of one worker ending at t, that sampled a token for each of `streams`
        (in its chunks' order): its charge, once, then each token's delivery (deliver); when
        the client sees each. No stream: nothing (a step without tokens costs nothing)."""
        if not streams:
            return []
        self._queue(t, self.cost["per_step_ms"])
        self.steps += 1
        return [self.deliver(t, st) for st in streams]

    def deliver(self, t: float, stream: Hashable) -> float:
        """A token of `stream` sampled at t, its step already charged (step() charges it, then
        calls this): when the client sees it (it joins the stream's write if that has not
        started by t, else it is a write of its own)."""
        c_s = self.cost["per_output_token_ms"] / 1e3
        last = self._last_write.get(stream)
        if last is not None and last.start > t:
            self._in_order(t)
            # (charged at the end of the queue, not inside its write: the module docstring)
            self.free_at += c_s
            self.busy_s += c_s
            seen = last.end
        else:
            w = self._queue(t, self.cost["per_write_ms"] + self.cost["per_output_token_ms"])
            self._last_write[stream] = w
            self.writes += 1
            seen = w.end
        self.tokens += 1
        self.lag_s += seen - t
        self.lag_max_s = max(self.lag_max_s, seen - t)
        self.last_seen = max(self.last_seen, seen)
        return seen

    def close(self, stream: Hashable) -> None:
        """`stream`'s request has ended: forget its last write (a stream never written to, or
        closed already, is fine)."""
        self._last_write.pop(stream, None)

    def facts(self, span_s: float) -> dict[str, Any]:
        """What the API did over a run of span_s seconds (utilization: busy / span).
        queue_end_after_last_delivery_ms: how long the API still works after the run's last
        delivery, which is the joined tokens' charges left at the end of the queue (the module
        docstring's approximation; in the server that work would have come before some of the
        deliveries): its visible size in a run."""
        return {"cost_ms": dict(self.cost), "busy_s": self.busy_s,
                "utilization": self.busy_s / span_s if span_s > 0 else None,
                "admissions": self.admissions,
                "admission_wait_ms_mean": (self.admission_wait_s / self.admissions * 1e3
                                           if self.admissions else None),
                "admission_wait_ms_max": self.admission_wait_max_s * 1e3,
                "steps": self.steps, "tokens": self.tokens, "writes": self.writes,
                "tokens_per_write": self.tokens / self.writes if self.writes else None,
                "delivery_lag_ms_mean": self.lag_s / self.tokens * 1e3 if self.tokens else None,
                "delivery_lag_ms_max": self.lag_max_s * 1e3,
                "queue_end_after_last_delivery_ms": (
                    max(0.0, self.free_at - self.last_seen) * 1e3 if self.tokens else None)}
