"""Cost model: what each candidate path would cost one request, from a fitted profile and the
live state of the workers. Pure Python; the adaptive policy (policies.py) and the simulator use
it.

The profile (perf/cost_profile.py, fitted by `pdserve profile`) gives the time of one engine
step of each kind:

    prefill_ms(n)          a lone step of n prompt tokens
    decode_ms(b, S)        b sequences decoding, contexts summing to S
    mixed_ms(b, S, n)      both: decode_ms(b, S) + gamma * n
    transfer_ms(t)         the KV of t tokens from a prefill worker to a decode worker

each step at its shape (cost_profile.step_cost_ms: with a profile fitted per CUDA graph shape, n
padded to the graph bucket of the worker's token budget).

A worker's state (WorkerLoad, built by the router core from what it placed there) is: prompt
tokens queued for prefill (after what that worker has cached), the sequences decoding with their
contexts and predicted remaining outputs, and the prefill tokens its recent steps carried (the
rate at which new prompts interfere with its decodes). The engine schedules decodes first and
fills each step up to the token budget (chunk) with prompt tokens, first come first served; the
model follows that:

  collocated on W (prompt L, of which W lacks L'; predicted output O)
    TTFT = the steps that prefill W's queue and then L': each chunk of `chunk` tokens rides
           along W's decodes (mixed_ms(b, S, chunk)), or runs alone when nothing decodes
    TPOT = mixed_ms(b + 1, S + L + O/2, p): a step of W's batch with this request in it, at
           its mean context, carrying W's recent prefill tokens per step p
    harm = W's decoding requests that this request's prefill chunks (plus one more sequence
           in the batch) push over the TPOT SLO: the extra step time spread over their
           predicted remaining tokens
  disaggregated P -> D (P lacks L'_P; D holds whole blocks of the first c_D tokens)
    TTFT = P's queue and L'_P prefilled on P (its first token streams from there)
    TPOT = (transfer_ms(L - c_D) + (O - 1) * mixed_ms(b_D + 1, S_D + L + O/2, p_D)) / (O - 1)
    harm = P's decoding requests (if any) pushed over by the prefill chunks, and D's by one
           more sequence in D's batch

Online correction: every observed step (StepRecord), transfer and request latency is compared
with what the model predicts for it; a per-worker, per-kind factor (exponentially weighted
mean of observed / predicted, kinds "prefill", "decode", "mixed", and "transfer" per decode
worker) scales that worker's predictions from then on, and the errors before correction are
kept for /metrics (error_stats).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from ..perf.cost_profile import deployment_graph_sizes, step_cost_ms

STEP_KINDS = ("prefill", "decode", "mixed")
TERMS = (*STEP_KINDS, "transfer", "ttft", "tpot")
CORRECTION_WEIGHT = 0.05      # EWMA weight of one observation in a correction factor
CORRECTION_BOUNDS = (0.25, 4.0)   # a factor stays within these (a wild sample cannot run away)


class StepCosts(Protocol):
    """What the cost model reads of a profile (perf/cost_profile.py's CostProfile)."""
    def prefill_ms(self, n: int) -> float: ...
    def decode_ms(self, b: int, ctx_sum: int, longest: int | None = None) -> float: ...
    def mixed_ms(self, b: int, ctx_sum: int, n: int, longest: int | None = None) -> float: ...
    def transfer_ms(self, tokens: int) -> float: ...
    kv_bytes_per_token: int


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's work in progress as the router knows it."""
    queued_prefill_tokens: int = 0      # prompt tokens placed there, not yet computed
    decodes: int = 0                    # sequences decoding there (or handed off to it)
    decode_context_tokens: int = 0      # the sum of their contexts
    decode_remaining_tokens: float = 0.0  # the sum of their predicted remaining outputs
    prefill_tokens_per_step: float = 0.0  # prompt tokens its recent steps carried, per step


@dataclass(frozen=True)
class Estimate:
    """One path's predicted cost for one request (ms), and the other requests it would push
    over the TPOT SLO."""
    ttft_ms: float
    tpot_ms: float | None          # None: nothing to decode after the first token
    transfer_ms: float = 0.0
    harmed: int = 0

    def e2e_ms(self, output_tokens: float) -> float:
        return self.ttft_ms + (self.tpot_ms or 0.0) * max(0.0, output_tokens - 1)


@dataclass
class _Err:
    """Running error of one term before correction: count, mean |observed/predicted - 1|, and
    the mean signed ratio."""
    n: int = 0
    abs_rel: float = 0.0
    ratio: float = 0.0

    def add(self, observed: float, predicted: float) -> None:
        r = observed / predicted
        self.n += 1
        self.abs_rel += (abs(r - 1.0) - self.abs_rel) / self.n
        self.ratio += (r - self.ratio) / self.n


@dataclass
class CostModel:
    profile: StepCosts
    chunk_tokens: int                       # a step's token budget (max_num_batched_tokens)
    correction_weight: float = CORRECTION_WEIGHT   # 0: the profile as it is, never corrected
    factors: dict[tuple[str, str], float] = field(default_factory=dict)  # (worker, kind) -> f
    errors: dict[str, _Err] = field(default_factory=lambda: {t: _Err() for t in TERMS})
    # the deployment's CUDA-graph buckets its steps are costed at (cost_profile.step_cost_ms);
    # None: a deployment like the profile's own on this budget (deployment_graph_sizes)
    graph_sizes: list | None = None

    def __post_init__(self):
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be a positive integer, got {self.chunk_tokens!r}")
        if not 0 <= self.correction_weight <= 1:
            raise ValueError(f"correction_weight must be in [0, 1], got {self.correction_weight!r}")
        if self.graph_sizes is None:
            self.graph_sizes = deployment_graph_sizes(self.profile, None, self.chunk_tokens)

    # ---- step times ------------------------------------------------------------------------
    def _raw_step_ms(self, b: int, ctx: float, n: int, shaped: bool = True) -> tuple[str, float]:
        return step_cost_ms(self.profile, b, int(ctx), n, self.graph_sizes if shaped else ())

    def step_ms(self, worker: str, b: int, ctx: float, n: float, mean: bool = False) -> float:
        """One step on worker with b decodes (contexts summing to ctx) and n prompt tokens,
        corrected by what that worker's steps of this kind have measured. mean: n is a mean
        over steps (not one step's count), costed without padding it to a step's shape."""
        kind, ms = self._raw_step_ms(b, ctx, int(round(n)), shaped=not mean)
        return ms * self.factors.get((worker, kind), 1.0)

    def prefill_run_ms(self, worker: str, load: WorkerLoad, tokens: int) -> float:
        """Until `tokens` more prompt tokens, queued behind the worker's, are computed: full
        chunks then the remainder, each step carrying the worker's decodes."""
        total = load.queued_prefill_tokens + max(0, tokens)
        if total <= 0:   # (everything cached: one step still runs the last token)
            total = 1
        full, rest = divmod(total, self.chunk_tokens)
        b, ctx = load.decodes, load.decode_context_tokens
        ms = full * self.step_ms(worker, b, ctx, self.chunk_tokens) if full else 0.0
        return ms + (self.step_ms(worker, b, ctx, rest) if rest else 0.0)

    # ---- paths -----------------------------------------------------------------------------
    def _decode_step_ms(self, worker: str, load: WorkerLoad, prompt: int, output: float) -> float:
        ctx = load.decode_context_tokens + prompt + output / 2
        return self.step_ms(worker, load.decodes + 1, ctx, load.prefill_tokens_per_step,
                            mean=True)

    def _harmed(self, worker: str, load: WorkerLoad, extra_ms: float, slo_tpot_ms: float | None) -> int:
        """W's decodes that extra_ms of added step time (spread over their predicted remaining
        tokens) pushes over the TPOT SLO (all of them or none: they share every step)."""
        if slo_tpot_ms is None or load.decodes == 0 or extra_ms <= 0:
            return 0
        base = self.step_ms(worker, load.decodes, load.decode_context_tokens,
                            load.prefill_tokens_per_step, mean=True)
        remaining = max(1.0, load.decode_remaining_tokens / load.decodes)
        return load.decodes if base <= slo_tpot_ms < base + extra_ms / remaining else 0

    def _prefill_extra_ms(self, worker: str, load: WorkerLoad, uncached: int) -> float:
        """What prefilling `uncached` tokens adds to the steps of the worker's decodes."""
        if not load.decodes:
            return 0.0
        b, ctx = load.decodes, load.decode_context_tokens
        alone = self.step_ms(worker, b, ctx, 0)
        full, rest = divmod(max(1, uncached), self.chunk_tokens)
        extra = full * (self.step_ms(worker, b, ctx, self.chunk_tokens) - alone)
        return extra + (self.step_ms(worker, b, ctx, rest) - alone if rest else 0.0)

    def _join_extra_ms(self, worker: str, load: WorkerLoad, output: float) -> float:
        """What one more sequence in the batch adds to the worker's decodes while it decodes."""
        if not load.decodes or output <= 1:
            return 0.0
        b, ctx = load.decodes, load.decode_context_tokens
        return (self.step_ms(worker, b + 1, ctx, 0) - self.step_ms(worker, b, ctx, 0)) * (output - 1)

    def collocated(self, worker: str, load: WorkerLoad, prompt: int, uncached: int,
                   output: float, slo_tpot_ms: float | None = None) -> Estimate:
        ttft = self.prefill_run_ms(worker, load, uncached)
        tpot = self._decode_step_ms(worker, load, prompt, output) if output > 1 else None
        extra = self._prefill_extra_ms(worker, load, uncached) + self._join_extra_ms(worker, load, output)
        return Estimate(ttft, tpot, 0.0, self._harmed(worker, load, extra, slo_tpot_ms))

    def disaggregated(self, prefill: str, p_load: WorkerLoad, p_uncached: int,
                      decode: str, d_load: WorkerLoad, prompt: int, d_cached: int,
                      output: float, slo_tpot_ms: float | None = None) -> Estimate:
        ttft = self.prefill_run_ms(prefill, p_load, p_uncached)
        p_harmed = self._harmed(prefill, p_load, self._prefill_extra_ms(prefill, p_load, p_uncached),
                                slo_tpot_ms)
        if output <= 1:
            return Estimate(ttft, None, 0.0, p_harmed)
        moved = max(0, prompt - d_cached)
        xfer = self.profile.transfer_ms(moved) * self.factors.get((decode, "transfer"), 1.0) \
            if moved else 0.0
        step = self._decode_step_ms(decode, d_load, prompt, output)
        tpot = (xfer + (output - 1) * step) / (output - 1)
        d_harmed = self._harmed(decode, d_load, self._join_extra_ms(decode, d_load, output), slo_tpot_ms)
        return Estimate(ttft, tpot, xfer, p_harmed + d_harmed)

    # ---- online correction -----------------------------------------------------------------
    def _correct(self, key: tuple[str, str], observed: float, predicted: float) -> None:
        if not (predicted > 0 and observed > 0 and math.isfinite(observed)):
            return
        self.errors[key[1]].add(observed, predicted)
        f = self.factors.get(key, 1.0)
        target = f * observed / predicted
        lo, hi = CORRECTION_BOUNDS
        self.factors[key] = min(hi, max(lo, f + self.correction_weight * (target - f)))

    def observe_step(self, worker: str, prefill_tokens: int, decodes: int, ctx: float,
                     wall_ms: float) -> None:
        """A step the worker ran (its StepRecord; ctx: the router's estimate of its decodes'
        contexts then). The error counts against the corrected prediction; the factor moves."""
        if prefill_tokens <= 0 and decodes <= 0:
            return
        kind, raw = self._raw_step_ms(decodes, ctx, prefill_tokens)
        f = self.factors.get((worker, kind), 1.0)
        self._correct((worker, kind), wall_ms, raw * f)

    def observe_transfer(self, decode: str, tokens: int, ms: float) -> None:
        if tokens > 0:
            f = self.factors.get((decode, "transfer"), 1.0)
            self._correct((decode, "transfer"), ms, self.profile.transfer_ms(tokens) * f)

    def observe_transfer_bytes(self, decode: str, nbytes: int, ms: float) -> None:
        """A pull the decode worker reported, in bytes (the profile's KV bytes per token)."""
        self.observe_transfer(decode, round(nbytes / self.profile.kv_bytes_per_token), ms)

    def observe_latency(self, term: str, observed_ms: float, predicted_ms: float) -> None:
        """A finished request's TTFT or TPOT against what was predicted when it was placed
        (reported, not fed back: the step factors already carry what these would say)."""
        if term not in ("ttft", "tpot"):
            raise ValueError(f"unknown latency term {term!r}")
        if predicted_ms > 0 and observed_ms >= 0 and math.isfinite(observed_ms):
            self.errors[term].add(observed_ms, predicted_ms)

    def error_stats(self) -> dict[str, dict[str, float]]:
        """Per term: samples, mean |observed / predicted - 1| and mean observed / predicted."""
        return {t: {"n": e.n, "mean_abs_rel_err": e.abs_rel, "mean_ratio": e.ratio}
                for t, e in self.errors.items()}
