"""Routing policies: which path a request takes among the live workers.

    RouteRequest + [WorkerView] ──policy.choose──> Path("collocated", W)        run whole on W
                                                └─> Path("disagg", D, prefill=P)  P prefills, D decodes
                                                └─> None                        no live worker

A policy is pure: it reads what it is given and keeps no reference to it. The constraint every
policy obeys (and the router core enforces, falling back to a whole-request path) is the P/D
eligibility rule, `disaggregable(params)`, stated once here.

Placement within a role (RoutingPolicy.place): the worker that will compute the prompt (the
collocated worker, or the prefill worker of a disaggregated path) is chosen cache-aware, as
SGLang's router does. Each WorkerView carries `cached`: how much of this request's prompt the
router's prefix index (prefix_index.py) believes that worker holds. Among the workers whose load
is close to the least loaded one's, the longest match wins (ties: the least loaded); a match
shorter than min_cached_tokens counts as none, and with no match anywhere the choice is exactly
least_loaded. A decode worker receiving a hand-off is chosen the same way (also when its first
choice died before the hand-off): the consumer moves only the blocks it lacks (a one-sided
connector pulls them, engine/kv_coordinator.py; a two-sided producer sends them, the router
core skipping what its index believes the consumer holds), and the worker that decoded a
conversation's last turn holds its history.

    close(w) = w.load - min_load <= balance_abs  or  w.load <= min_load * balance_rel

SGLang's gateway calls loads imbalanced when both the absolute and the relative gap exceed their
thresholds (defaults 64 requests and 1.5); this is the same rule, per worker. The load is what
least_loaded reads: the requests the router has on the worker (running and waiting there, or
bound for it). Our default absolute gap is smaller, 4 requests, because a worker's batch here is
often a few requests and a prefill worker serves its queue in order.
"""
from __future__ import annotations

import abc
import enum
import itertools
from dataclasses import dataclass
from typing import NamedTuple

from ..protocol import StepRecord, kv_transfer_unsupported
from ..sampling_params import SamplingParams
from .cost_model import WorkerLoad

ROLES = ("prefill", "decode", "collocated")

BALANCE_ABS_THRESHOLD = 4     # requests: at most this many more than the least loaded is close
BALANCE_REL_THRESHOLD = 1.5   # or at most this many times the least loaded's load
# A match shorter than this is worth nothing to place on: that many tokens of prefill cost about
# one weight-bound forward, i.e. as much as a decode step of the batch they would join.
MIN_CACHED_TOKENS = 64


def disaggregable(params: SamplingParams) -> bool:
    """Whether a request may take the disaggregated path: its KV can travel (one sequence, no
    prompt logprobs: protocol.kv_transfer_unsupported, the rule the engine enforces on a
    kv_source) and something is left to decode after the prefill worker's first token
    (max_tokens > 1)."""
    return kv_transfer_unsupported(params) is None and params.max_tokens > 1


class PathKind(str, enum.Enum):
    COLLOCATED = "collocated"
    DISAGG = "disagg"


class Path(NamedTuple):
    kind: str                     # a PathKind ("collocated" | "disagg")
    worker: str                   # collocated: the worker; disagg: the decode worker
    prefill: str | None = None    # disagg: the prefill worker


class StepSummary(NamedTuple):
    """A worker's recent engine steps (its last StepRecords) in a few numbers: how many steps
    are summarised, their mean host time and device time (None when no step measured it),
    tokens per step and host milliseconds per token, the newest record's time (the worker's
    clock), and prompt tokens per step."""
    steps: int
    mean_wall_ms: float
    mean_gpu_ms: float | None
    tokens_per_step: float
    wall_ms_per_token: float | None   # None when the steps ran no token
    last_t: float
    prefill_tokens_per_step: float = 0.0

    @classmethod
    def of(cls, records: list[StepRecord]) -> "StepSummary | None":
        if not records:
            return None
        n = len(records)
        wall = sum(r.wall_ms for r in records)
        tokens = sum(r.num_prefill_tokens + r.num_decode_tokens for r in records)
        gpu = [r.gpu_ms for r in records if r.gpu_ms is not None]
        return cls(n, wall / n, sum(gpu) / len(gpu) if gpu else None, tokens / n,
                   wall / tokens if tokens else None, records[-1].t,
                   sum(r.num_prefill_tokens for r in records) / n)


@dataclass
class WorkerView:
    name: str
    role: str
    outstanding: int              # requests the router has on it now (and bound for it)
    kv_usage: float               # fraction of its KV pool in use (as of its last report)
    steps: StepSummary | None = None  # its recent steps (None before its first report)
    cached: int = 0               # tokens of the request being placed that it likely has cached
    load: WorkerLoad | None = None  # its work in progress (only for a policy that wants_load)


@dataclass(frozen=True)
class RouteRequest:
    """What a policy sees of a request."""
    request_id: str
    num_prompt_tokens: int
    params: SamplingParams
    predicted_output_tokens: float | None = None   # the router core's length predictor's guess

    @property
    def disaggregable(self) -> bool:
        return disaggregable(self.params)


class RoutingPolicy(abc.ABC):
    """Chooses a path for each request among the live workers (the adaptive, cost-model policy
    plugs in here).

    Contract of choose(req, workers):
      - `workers` are the live workers' views (never empty when a path is possible); the path
        names only workers among them, by name;
      - a Path("disagg", D, prefill=P) has P a prefill worker and D a decode worker, and only
        when req.disaggregable (the router core replaces a disagg path for any other request by
        collocated(workers));
      - None only when no worker of any role is live;
      - it may keep state of its own (a turn counter) but never mutates what it is given.
    The helpers below are the building blocks the registered policies share; the thresholds of
    the cache-aware choice (place) are arguments, their defaults the module's constants."""
    name = ""
    wants_load = False            # True: the core fills WorkerView.load (costs a pass over routes)
    cost = None                   # a policy with a cost model (adaptive.py) is fed observations
    balance_abs = BALANCE_ABS_THRESHOLD
    balance_rel = BALANCE_REL_THRESHOLD
    min_cached_tokens = MIN_CACHED_TOKENS

    def __init__(self, balance_abs: int = BALANCE_ABS_THRESHOLD,
                 balance_rel: float = BALANCE_REL_THRESHOLD,
                 min_cached_tokens: int = MIN_CACHED_TOKENS):
        for what, v in (("balance_abs", balance_abs), ("min_cached_tokens", min_cached_tokens)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{what} must be a non-negative integer, got {v!r}")
        if (not isinstance(balance_rel, (int, float)) or isinstance(balance_rel, bool)
                or not balance_rel >= 1 or balance_rel == float("inf")):
            raise ValueError(f"balance_rel must be a finite number >= 1, got {balance_rel!r}")
        self.balance_abs, self.balance_rel = balance_abs, float(balance_rel)
        self.min_cached_tokens = min_cached_tokens

    @abc.abstractmethod
    def choose(self, req: RouteRequest, workers: list[WorkerView]) -> Path | None:
        ...

    def observe_request(self, request_id: str, ttft_ms: float | None, tpot_ms: float | None) -> None:
        """A request this policy placed finished, with these latencies (None: not measured)."""

    def forget(self, request_id: str) -> None:
        """A request this policy placed ended without an outcome to learn from."""

    @staticmethod
    def least_loaded(workers: list[WorkerView], role: str) -> WorkerView | None:
        cands = [w for w in workers if w.role == role]
        return min(cands, key=lambda w: (w.outstanding, w.kv_usage), default=None)

    def place(self, workers: list[WorkerView], role: str) -> WorkerView | None:
        """The worker of `role` to compute a prompt on: among those whose load is close to the
        least loaded one's (module docstring), the one with the longest cached match of at
        least min_cached_tokens; ties, and no such match, go to the least loaded."""
        least = self.least_loaded(workers, role)
        if least is None:
            return None
        lo = least.outstanding

        def close(w: WorkerView) -> bool:
            return w.outstanding - lo <= self.balance_abs or w.outstanding <= lo * self.balance_rel

        def gain(w: WorkerView) -> int:
            return w.cached if w.cached >= self.min_cached_tokens else 0

        cands = [w for w in workers if w.role == role and close(w)]
        return min(cands, key=lambda w: (-gain(w), w.outstanding, w.kv_usage))

    def collocated(self, workers: list[WorkerView]) -> Path | None:
        """A whole request on one worker: a collocated one, else a decode worker, else (no
        decode worker left) a prefill worker, which runs it as any engine would; within the
        role, place()'s choice."""
        w = (self.place(workers, "collocated") or self.place(workers, "decode")
             or self.place(workers, "prefill"))
        return None if w is None else Path(PathKind.COLLOCATED, w.name)

    def disagg(self, workers: list[WorkerView], req: RouteRequest | None = None) -> Path | None:
        """place()'s prefill and decode workers; None without both, or when req (if given) may
        not be disaggregated."""
        if req is not None and not req.disaggregable:
            return None
        p, d = self.place(workers, "prefill"), self.place(workers, "decode")
        return None if p is None or d is None else Path(PathKind.DISAGG, d.name, p.name)


class CollocatedPolicy(RoutingPolicy):
    name = "collocated"

    def choose(self, req, workers):
        return self.collocated(workers) or self.disagg(workers, req)


class DisaggPolicy(RoutingPolicy):
    name = "disagg"

    def choose(self, req, workers):
        return self.disagg(workers, req) or self.collocated(workers)


class RoundRobinPolicy(RoutingPolicy):
    """Alternates between the disaggregated and the collocated path (each least-loaded within
    its roles) where both exist; a request that cannot be disaggregated takes its turn on the
    collocated path."""
    name = "round-robin"

    def __init__(self, **thresholds):
        super().__init__(**thresholds)
        self._turn = itertools.count()

    def choose(self, req, workers):
        turn = next(self._turn)
        paths = [p for p in (self.disagg(workers), self.collocated(workers)) if p is not None]
        if not paths:
            return None
        path = paths[turn % len(paths)]
        return path if path.kind != PathKind.DISAGG or req.disaggregable else self.collocated(workers)


POLICIES = {p.name: p for p in (CollocatedPolicy, DisaggPolicy, RoundRobinPolicy)}


def make_policy(name: str | RoutingPolicy, **kwargs) -> RoutingPolicy:
    """A policy by name (kwargs: its constructor's, e.g. the adaptive policy's cost model), or
    the given instance."""
    if isinstance(name, RoutingPolicy):
        return name
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)


from .adaptive import AdaptivePolicy  # noqa: E402  (it builds on the classes above)

POLICIES[AdaptivePolicy.name] = AdaptivePolicy
