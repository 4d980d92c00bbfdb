"""PrefillRate: the engine's own measure of what prefill costs per token, for the scheduler's
choice between swapping a preempted sequence out and recomputing it later. Pure Python.

It keeps the last `window` steps that carried prefill tokens, as (tokens, seconds), and
estimates seconds per token as the ratio of their sums (a step's fixed cost is spread over its
tokens, as it is when a recompute runs). Nothing is assumed before the first measured step:
seconds_per_token() is None until then.
"""
from __future__ import annotations

import math
from collections import deque


class PrefillRate:
    def __init__(self, window: int = 32):
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)
        self._tokens = 0
        self._seconds = 0.0

    def add(self, num_prefill_tokens: int, seconds: float) -> None:
        """One step's prefill tokens and its time; steps without prefill, and times that are
        not finite and positive, are ignored."""
        if num_prefill_tokens <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        if len(self._steps) == self._steps.maxlen:
            t, s = self._steps[0]
            self._tokens -= t
            self._seconds -= s
        self._steps.append((num_prefill_tokens, seconds))
        self._tokens += num_prefill_tokens
        self._seconds += seconds

    def seconds_per_token(self) -> float | None:
        if not self._steps:
            return None
        return max(self._seconds, 0.0) / self._tokens
