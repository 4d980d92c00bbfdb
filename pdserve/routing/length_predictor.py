"""The output-length predictor: how many tokens a request will generate, guessed before it runs,
learned online from the requests that finished. Plain Python (no torch, no numpy): it runs in the
router's hot path, once per arrival (predict) and once per completion (observe).

Requests are grouped by prompt length into log-spaced buckets (one per power of two):

    bucket j = clamp(prompt_len.bit_length(), min_bucket_log2, max_bucket_log2)
    prompt_len  0..15 | 16..31 | 32..63 | ... | 2^18..2^19-1 | >= 2^19     (defaults 4 and 20)
    bucket       4    |   5    |   6    | ... |     19       |    20

Each bucket keeps the output lengths of its last `window` requests, and one global window keeps
the last `global_window` requests of every bucket. A prediction is the bucket's estimate shrunk
toward the global one (empirical Bayes):

    predict(p, cap) = w * m_b(cap) + (1 - w) * m_g(cap),    w = n_b / (n_b + k)
    m(cap)          = mean of min(x, cap) over the window's samples x   (mean of x without a cap)

- n_b = 0 gives the global estimate exactly: the fallback of nanoPD's scheme (bucket mean, or the
  global mean below a sample count), made smooth: a bucket earns weight as its samples come in.
- k, the prior strength, is how many samples a bucket needs before its own mean counts as much as
  the global one. By default it is estimated from the data and re-estimated as they change: the
  method-of-moments estimator of a one-way random-effects model (the buckets' true means spread
  with variance tau^2 around the grand mean; samples spread with variance sigma^2 within a
  bucket) gives the weight that minimises the expected squared error, k = sigma^2 / tau^2, with

      MSW   = sum_b sum_i (x_bi - mean_b)^2 / (N - B)                  sigma^2
      MSB   = sum_b n_b (mean_b - mean)^2 / (B - 1)
      n0    = (N - sum_b n_b^2 / N) / (B - 1)
      tau^2 = (MSB - MSW) / n0

  over the B non-empty bucket windows holding N samples. Where the buckets do not differ
  (tau^2 <= 0, or fewer than two buckets) k is K_MAX and predictions are the global mean; k is
  kept within [K_MIN, K_MAX] so that one sample never outweighs the global estimate on its own.
  A fixed prior_strength replaces the estimate.
- The cap. A request asking for at most `max_tokens` will generate min(L, max_tokens) tokens, so
  the estimate is E[min(L, cap)] over the samples, never min(E[L], cap): a bucket whose answers
  are 50 or 500 tokens (mean 275) asked with a cap of 100 will generate 75 on average, not 100.
  Both terms are at most the cap, so a prediction never exceeds it. Each window keeps a sorted
  copy of its samples, so m(cap) is a bisection and one C-level sum of at most half the window.
- Censored samples. A request that stopped at its max_tokens (output_len == max_tokens) would
  have run at least that long: its length L is only known to be >= x = output_len. It is stored
  as an estimate of E[L | L >= x]: the mean of the window's samples >= x, bucket and global,
  shrunk as above (x itself when no sample reaches x; max(x, default) before any sample). This is
  one step of Efron's redistribute-to-the-right (the Kaplan-Meier estimate, made online): the cut
  request takes the lengths of the requests that ran past its cut. A flood of max_tokens=1
  requests therefore leaves the estimates where they were instead of dragging them toward 1;
  every later prediction with a cap at or below the censoring point is still exact for that
  sample (min(stored, cap) = cap); the stored values never exceed the largest length observed
  or the prior. The count is in stats().censored. The caller may say more (censored=True for a
  request aborted or stopped by the context length, censored=False for one that ended on EOS at
  exactly max_tokens); by default a request is censored exactly when output_len == max_tokens.
- Before any observation every prediction is `default` (capped); the default of 256 tokens is a
  typical chat answer, and is what nanoPD starts from.
- The estimate is a mean, not a median: the router sums predicted lengths into a decode cost, and
  the mean is what a sum needs (it minimises squared error). Scored by absolute error, a median
  would do a little better on skewed lengths.
- Drift: only the windows count, so a change in the workload is followed within a window.

Memory is bounded (at most window samples per bucket, global_window in all, at most
max_bucket_log2 - min_bucket_log2 + 1 buckets). predict is O(log window) plus, with a cap below
a window's largest sample, one C-level sum over at most half of it; observe adds two sorted
insertions (memmoves in C) and updates the sums behind k in O(1). Not thread-safe: the router
core calls it from one thread.

Scoring (for /metrics): observe() first scores the outcome against what predict() would have said
for that request just before learning it (the prequential error: each outcome scored by a model
that has not seen it), and the same for the global-mean baseline, min(global mean, cap). The
caller passes nothing more than the outcome; stats() reports both mean absolute errors. Since a
prediction targets min(L, max_tokens), requests cut at their max_tokens are scored like the others;
one cut short of it (censored=True below the cap: an abort, the context length) is learned from
but not scored, since its outcome is not what was predicted.
"""
from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from typing import NamedTuple

K_MIN = 1.0        # a bucket with one sample weighs at most as much as the global estimate
K_MAX = 10_000.0   # "the buckets do not differ": the global estimate, within 1% up to 100 samples
DEFAULT_OUTPUT_LEN = 256
_EXACT_EVERY = 4096  # observations between exact recomputations of the float sum behind k


def _check_count(name: str, v, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")


class PredictorStats(NamedTuple):
    observations: int          # finished requests learned from
    censored: int              # of them, cut short (by their max_tokens, or as the caller said)
    scored: int                # of them, scored (all but those cut short of their max_tokens)
    mae: float | None          # prequential mean absolute error of the predictor (None: none)
    baseline_mae: float | None  # the same for the global-mean baseline
    prior_strength: float      # k in effect (estimated, or the fixed one)
    buckets: int               # buckets holding samples


class _Window:
    """The last `size` values of a stream: in arrival order (to drop the oldest), sorted (for the
    capped mean), and their sum and sum of squares (ints: exact)."""
    __slots__ = ("size", "fifo", "sorted", "total", "total_sq")

    def __init__(self, size: int):
        self.size = size
        self.fifo: deque[int] = deque()
        self.sorted: list[int] = []
        self.total = 0
        self.total_sq = 0

    def add(self, v: int) -> None:
        if len(self.fifo) == self.size:
            old = self.fifo.popleft()
            del self.sorted[bisect_left(self.sorted, old)]
            self.total -= old
            self.total_sq -= old * old
        self.fifo.append(v)
        insort(self.sorted, v)
        self.total += v
        self.total_sq += v * v

    def mean(self, cap: int | None = None) -> float:
        """Mean of min(x, cap) over the window (of x when cap is None); the window is not empty."""
        s = self.sorted
        n = len(s)
        if cap is None or cap >= s[-1]:
            return self.total / n
        i = bisect_left(s, cap)              # s[:i] < cap <= s[i:]
        below = sum(s[:i]) if i <= n - i else self.total - sum(s[i:])
        return (below + cap * (n - i)) / n

    def tail_mean(self, x: int) -> float | None:
        """Mean of the window's samples >= x (None when there are none)."""
        s = self.sorted
        n = len(s)
        i = bisect_left(s, x)
        if i == n:
            return None
        above = self.total - sum(s[:i]) if i <= n - i else sum(s[i:])
        return above / (n - i)


class LengthPredictor:
    """Predicts a request's output length from its prompt length and max_tokens (module
    docstring: buckets, shrinkage, the cap, censoring, scoring).

    predict(prompt_len, max_tokens=None) -> float  expected tokens generated, <= max_tokens
    observe(prompt_len, output_len, max_tokens=None, censored=None)
                                                   a finished request: output_len tokens, asked
                                                   with max_tokens; censored: whether it was cut
                                                   short of its natural end (None: exactly when
                                                   output_len == max_tokens)
    baseline(max_tokens=None) -> float             the global-mean baseline's prediction
    stats() -> PredictorStats                      counts, prequential MAE of both, k
    Arguments are non-negative ints (max_tokens >= 1 or None); anything else is a ValueError."""

    def __init__(self, default: int = DEFAULT_OUTPUT_LEN, window: int = 128,
                 global_window: int = 512, prior_strength: float | None = None,
                 min_bucket_log2: int = 4, max_bucket_log2: int = 20):
        _check_count("default", default, 0)
        _check_count("window", window, 1)
        _check_count("global_window", global_window, 1)
        _check_count("min_bucket_log2", min_bucket_log2, 0)
        _check_count("max_bucket_log2", max_bucket_log2, min_bucket_log2)
        if prior_strength is not None and (
                not isinstance(prior_strength, (int, float)) or isinstance(prior_strength, bool)
                or not 0 <= prior_strength < float("inf")):
            raise ValueError(f"prior_strength must be a finite number >= 0 or None (estimated), "
                             f"got {prior_strength!r}")
        self.default = default
        self.window = window
        self.min_bucket_log2, self.max_bucket_log2 = min_bucket_log2, max_bucket_log2
        self._fixed_k = None if prior_strength is None else float(prior_strength)
        self._k = K_MAX if self._fixed_k is None else self._fixed_k
        # Sums over the bucket windows for the k estimate, kept as the windows change (exact
        # ints, and the float sum_b S_b^2 / n_b, recomputed from scratch now and then).
        self._n_all = self._s_all = self._q_all = self._n2_all = 0
        self._between = 0.0
        self._global = _Window(global_window)
        self._buckets: dict[int, _Window] = {}
        self._observations = 0
        self._censored = 0
        self._scored = 0
        self._abs_err = 0.0
        self._baseline_abs_err = 0.0

    # ---- the two hot calls ---------------------------------------------------------------------
    def predict(self, prompt_len: int, max_tokens: int | None = None) -> float:
        _check_count("prompt_len", prompt_len, 0)
        if max_tokens is not None:
            _check_count("max_tokens", max_tokens, 1)
        return self._predict(prompt_len, max_tokens)

    def observe(self, prompt_len: int, output_len: int, max_tokens: int | None = None,
                censored: bool | None = None) -> None:
        _check_count("prompt_len", prompt_len, 0)
        _check_count("output_len", output_len, 0)
        if max_tokens is not None:
            _check_count("max_tokens", max_tokens, 1)
            if output_len > max_tokens:
                raise ValueError(f"output_len ({output_len}) exceeds max_tokens ({max_tokens})")
        if censored is not None and not isinstance(censored, bool):
            raise ValueError(f"censored must be True, False or None, got {censored!r}")
        at_cap = max_tokens is not None and output_len == max_tokens
        if censored is None:
            censored = at_cap
        if not censored or at_cap:       # the outcome is min(L, max_tokens): score it
            self._abs_err += abs(self._predict(prompt_len, max_tokens) - output_len)
            self._baseline_abs_err += abs(self._baseline(max_tokens) - output_len)
            self._scored += 1
        self._observations += 1
        value = output_len
        if censored:
            self._censored += 1
            value = self._impute(prompt_len, output_len)
        j = self._bucket(prompt_len)
        b = self._buckets.get(j)
        if b is None:
            b = self._buckets[j] = _Window(self.window)
        n, s, q = len(b.fifo), b.total, b.total_sq
        b.add(value)
        self._global.add(value)
        n1, s1 = len(b.fifo), b.total
        self._n_all += n1 - n
        self._s_all += s1 - s
        self._q_all += b.total_sq - q
        self._n2_all += n1 * n1 - n * n
        if self._observations % _EXACT_EVERY == 0:
            self._between = math.fsum(w.total * w.total / len(w.fifo)
                                      for w in self._buckets.values())
        else:
            self._between += s1 * s1 / n1 - (s * s / n if n else 0.0)
        if self._fixed_k is None:
            self._k = self._estimate_k()

    # ---- the rest ------------------------------------------------------------------------------
    def baseline(self, max_tokens: int | None = None) -> float:
        """The global-mean baseline: min(mean of the global window, max_tokens) (the default
        before any observation)."""
        if max_tokens is not None:
            _check_count("max_tokens", max_tokens, 1)
        return self._baseline(max_tokens)

    def prior_strength(self) -> float:
        return self._k

    def stats(self) -> PredictorStats:
        n = self._scored
        return PredictorStats(self._observations, self._censored, n,
                              self._abs_err / n if n else None,
                              self._baseline_abs_err / n if n else None, self.prior_strength(),
                              len(self._buckets))

    def _bucket(self, prompt_len: int) -> int:
        return min(max(prompt_len.bit_length(), self.min_bucket_log2), self.max_bucket_log2)

    def _baseline(self, cap: int | None) -> float:
        g = self._global
        m = g.total / len(g.fifo) if g.fifo else self.default
        return m if cap is None or m <= cap else float(cap)

    def _predict(self, prompt_len: int, cap: int | None) -> float:
        g = self._global
        if not g.fifo:
            return float(self.default if cap is None else min(self.default, cap))
        gm = g.mean(cap)
        b = self._buckets.get(self._bucket(prompt_len))
        if b is None:
            return gm
        n = len(b.fifo)
        w = n / (n + self._k)
        v = w * b.mean(cap) + (1.0 - w) * gm
        return v if cap is None or v <= cap else float(cap)   # (a rounding error above it)

    def _impute(self, prompt_len: int, x: int) -> int:
        """A censored length (>= x): the estimate of E[L | L >= x], the shrunk mean of the
        samples >= x, bucket and global (x itself where no sample reaches x; the prior before
        any sample)."""
        g = self._global
        if not g.fifo:
            return max(x, self.default)
        tg = g.tail_mean(x)
        if tg is None:
            return x
        b = self._buckets.get(self._bucket(prompt_len))
        tb = None if b is None else b.tail_mean(x)
        if tb is not None:
            n = len(b.fifo)
            w = n / (n + self._k)
            tg = w * tb + (1.0 - w) * tg
        return max(x, round(tg))

    def _estimate_k(self) -> float:
        """k = sigma^2 / tau^2 by the method of moments over the bucket windows (module
        docstring), within [K_MIN, K_MAX]."""
        nb, N = len(self._buckets), self._n_all
        if nb < 2 or N <= nb:
            return K_MAX
        ssw = max(0.0, self._q_all - self._between)
        ssb = max(0.0, self._between - self._s_all * self._s_all / N)
        msw = ssw / (N - nb)
        msb = ssb / (nb - 1)
        n0 = (N - self._n2_all / N) / (nb - 1)
        tau2 = (msb - msw) / n0
        if tau2 <= 0:
            return K_MAX
        return min(K_MAX, max(K_MIN, msw / tau2))
