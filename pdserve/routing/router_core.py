"""The router's core: every request's path and stage, the workers' load, the KV held for
hand-offs, and what happens when a worker dies. Pure: events in, actions out, no I/O, no clock
of its own. The shell (router.py) turns the actions into messages to EngineClients and feeds
back what the workers answer; a simulator or a test can drive it the same way with fakes.

    add ──> placed by the policy ─┬─> COLLOCATED on W ─────────────────output(finished)──> done
                                  └─> PREFILL on P (max_tokens 1, kv_hold)
                                        │ output: first token + KVSource (else done: a stop,
                                        ▼          max_model_len, no KV)
                                      HANDOFF (queued for D until flush_handoffs)
                                        │ Send to D with kv_source; accepted
                                        ▼
                                      DECODE on D ──output(finished)──> done
                                        (D's loads_done: Release P's held KV)

Events (methods): add, accepted (a Send's answer), output, loads_done, abort, flush_handoffs,
worker_died, worker_up, observe (stats and step records), reset_prefix_index (the workers'
caches were reset). Each returns the actions to carry out, in order (actions.py: Send, Abort,
Release, SendKV, DropPeer, Deliver, Reject); observe and reset_prefix_index return nothing.

Faults: a worker that dies leaves routing; its requests that have not produced a token are
placed again (RouterStats.rerouted), the others fail ("worker W died: ..."). A hand-off whose
decode worker died goes to another decode worker with the KV still held (placed as any request
is: policy.place, cache-aware), else (none left) runs whole elsewhere with its KV recomputed; a
hand-off whose prefill worker died (or restarted: a new KV name) travels without KV and is
recomputed (RouterStats.recomputed).

Two-sided hand-offs (SendKV) send only the blocks the decode worker lacks: once the decode
worker is final (flush_handoffs, after any redirect), the KVSource's skip_blocks is set to the
whole blocks of the prompt the prefix index believes it holds (its block size from
block_sizes; never the last block), and the SendKV carries the rest. The decode worker reuses
exactly those from its cache, or, when its cache no longer holds them, receives and discards
the tail and recomputes the prompt (a failed transfer in RouterStats).

Prefix index (prefix_index.py): what each worker likely has cached, for the policy's cache-aware
placement (WorkerView.cached). A request's prompt is inserted for the worker that computes it
when it is placed (the collocated or prefill worker), and a finished sequence's prompt and
output tokens for the worker it finished on (its engine caches them when it frees the request).
A worker that dies or comes back has its entries dropped; reset_prefix_index drops them all.

Length prediction and load (for the adaptive policy, adaptive.py): every request gets a predicted
output length when it arrives (LengthPredictor, learned from the requests that finish: observe
at each finish, censored when it was aborted or cut by the context length). For a policy that
wants_load, each WorkerView carries the worker's WorkerLoad, built from the routes: prompt tokens
placed there and not computed yet (a route that produced no token there, less the worker's
cached match at placement), and the sequences decoding there (a route past its first token, or
handed off to it) with their contexts (prompt + tokens seen so far: streamed outputs count them,
a final-only request counts as its first token) and predicted remaining outputs. A policy with a
cost model is fed every step record, transfer and finished request's latencies.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import msgspec

from ..outputs import CompletionOutput, RequestOutput
from ..protocol import AddRequest, KVLoadDone, KVSend, StepRecord, WorkerStats
from .actions import Abort, Action, Deliver, DropPeer, Reject, Release, Send, SendKV
from ..perf.cost_profile import step_kind
from .cost_model import WorkerLoad
from .length_predictor import LengthPredictor
from .policies import (Path, PathKind, RouteRequest, RoutingPolicy, StepSummary, WorkerView,
                       disaggregable, make_policy)
from .prefix_index import PREFIX_INDEX_TOKENS, PrefixIndex, token_array

STEP_RECORDS_KEPT = 1024   # per worker: the router's ring of its recent steps
STEP_SUMMARY_WINDOW = 64   # the newest records a WorkerView summarises
LOADS_REUSED = 16          # observations served by one loads() snapshot (the cost model's contexts)


class Unavailable(str):
    """A rejection that is the deployment's state, not the request's fault (no live worker):
    an error string like any other, which the server answers with 503 instead of 400."""


class Stage(enum.Enum):
    COLLOCATED = "collocated"  # on path.worker, the whole request
    PREFILL = "prefill"        # on path.prefill: its first token, KV held for the hand-off
    HANDOFF = "handoff"        # prefilled: waits for flush_handoffs to reach path.worker
    DECODE = "decode"          # on path.worker, continuing after the first token


@dataclass
class StepTotals:
    """A worker's engine steps of one kind since the router started (across its restarts)."""
    steps: int = 0
    wall_ms: float = 0.0           # the steps' host time (StepRecord.wall_ms)
    gpu_steps: int = 0             # of them, those whose device time was measured
    gpu_ms: float = 0.0            # their device time (StepRecord.gpu_ms)
    prefill_tokens: int = 0
    decode_tokens: int = 0

    def add(self, r: StepRecord) -> None:
        self.steps += 1
        self.wall_ms += r.wall_ms
        if r.gpu_ms is not None:
            self.gpu_steps += 1
            self.gpu_ms += r.gpu_ms
        self.prefill_tokens += r.num_prefill_tokens
        self.decode_tokens += r.num_decode_tokens


def summarize_steps(steps: dict[tuple[str, str], StepTotals]) -> dict[str, dict[str, float | None]]:
    """Per step kind, every worker's steps together: steps, mean host and device ms per step
    (device: over the steps it was measured on; None without any) and prompt / decode tokens
    per step. What a served run's step counters say (scripts/tier_report.py) and what a
    simulated run's router core saw, in one form."""
    by: dict[str, StepTotals] = {}
    for (_, kind), t in steps.items():
        a = by.setdefault(kind, StepTotals())
        a.steps += t.steps
        a.wall_ms += t.wall_ms
        a.gpu_steps += t.gpu_steps
        a.gpu_ms += t.gpu_ms
        a.prefill_tokens += t.prefill_tokens
        a.decode_tokens += t.decode_tokens
    out = {}
    for kind, a in sorted(by.items()):
        n = a.steps
        out[kind] = {"steps": n,
                     "mean_wall_ms": a.wall_ms / n if n else None,
                     "mean_gpu_ms": a.gpu_ms / a.gpu_steps if a.gpu_steps else None,
                     "prefill_tokens_per_step": a.prefill_tokens / n if n else None,
                     "decode_tokens_per_step": a.decode_tokens / n if n else None}
    return out


@dataclass
class RouterStats:
    requests: dict[str, int] = field(default_factory=lambda: {"collocated": 0, "disagg": 0})
    transfers: int = 0            # pulls that completed
    transfer_bytes: int = 0       # on each decode worker's rank 0
    transfer_seconds: float = 0.0
    transfer_failures: int = 0    # pulls that failed or timed out (recomputed on the decode side)
    rerouted: int = 0             # requests sent again after their worker died
    recomputed: int = 0           # handed off without KV (their prefill worker died)
    failed: int = 0               # requests lost with a dead worker
    # per worker and step kind (cost_model.STEP_KINDS): the engine steps its StepRecords reported
    steps: dict[tuple[str, str], StepTotals] = field(default_factory=dict)


@dataclass(eq=False)
class Route:
    req: AddRequest               # as the user sent it (prompt as token ids, arrival set)
    prompt: str | None
    num_prompt_tokens: int
    path: Path | None = None
    stage: Stage | None = None
    first: RequestOutput | None = None   # the prefill worker's output (disagg)
    produced: bool = False        # a token reached the user
    bound: bool = False           # disagg, before the hand-off: counted in RouterCore.bound
    admitted: bool = False        # accepted by a worker once (add_requests answered None)
    rerouted_from: str | None = None  # placed again after this worker died
    predicted: float = 0.0        # output tokens the length predictor expects
    cached: int = 0               # prompt tokens the computing worker was thought to hold
    generated: int = 0            # output tokens seen so far (streamed outputs)

    @property
    def arrival(self) -> float:
        return self.req.arrival_time


@dataclass
class WorkerSlot:
    """The core's view of one worker: its role, liveness, load and KV name (the incarnation's:
    a restarted worker gets a new one, so that its KV is never mistaken for the dead one's)."""
    name: str
    role: str
    kv_name: str
    alive: bool = True
    block_size: int | None = None  # its KV block size (None: unknown, no block is ever skipped)
    outstanding: int = 0
    kv_usage: float = 0.0
    steps: deque = field(default_factory=lambda: deque(maxlen=STEP_RECORDS_KEPT))
    _summary: StepSummary | None = None
    _summary_stale: bool = False      # steps came since _summary was made

    @property
    def summary(self) -> StepSummary | None:
        """Its newest STEP_SUMMARY_WINDOW steps summarised (None before its first report);
        made when read, once per batch of new steps (a router reads it to place a request,
        far less often than steps arrive)."""
        if self._summary_stale:
            n = len(self.steps)
            self._summary = StepSummary.of(
                list(itertools.islice(self.steps, max(0, n - STEP_SUMMARY_WINDOW), None)))
            self._summary_stale = False
        return self._summary


@dataclass
class _Batch:
    worker: str
    handoff: bool
    items: list                   # first leg: [(route, sent)]; hand-off: [(route, sent, prefill)]


class RouterCore:
    def __init__(self, workers: Iterable[tuple[str, str, str]], policy: str | RoutingPolicy,
                 max_model_len: int, describe: Callable[[], str] | None = None,
                 prefix_tokens: int | Mapping[str, int] = PREFIX_INDEX_TOKENS,
                 block_sizes: Mapping[str, int] | None = None):
        """workers: (name, role, kv_name) of each; describe(): the deployment's state in a few
        words, for Unavailable errors (default: each worker up or down); prefix_tokens: the
        prefix index's budget per worker, one for all or each worker's (0: not tracked, e.g.
        prefix caching off there); block_sizes: each worker's KV block size (its config's),
        which a two-sided hand-off needs to skip the whole blocks the decode worker is believed
        to hold (a worker not named: nothing skipped)."""
        self.workers = {n: WorkerSlot(n, role, kv) for n, role, kv in workers}
        for what, m in (("prefix_tokens", prefix_tokens), ("block_sizes", block_sizes)):
            unknown = set(m) - set(self.workers) if isinstance(m, Mapping) else ()
            if unknown:
                raise ValueError(f"{what} names unknown workers {sorted(unknown)}")
        for name, bs in (block_sizes or {}).items():
            if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
                raise ValueError(f"block_sizes[{name!r}] must be a positive integer, got {bs!r}")
            self.workers[name].block_size = bs
        if isinstance(prefix_tokens, Mapping):
            self.prefix = PrefixIndex(PREFIX_INDEX_TOKENS, prefix_tokens)
        else:
            self.prefix = PrefixIndex(prefix_tokens)
        self.policy = make_policy(policy)
        self.predictor = LengthPredictor()
        self.max_model_len = max_model_len
        self.describe = describe or (lambda: ", ".join(
            f"{w.name} {'up' if w.alive else 'down'}" for w in self.workers.values()))
        self.two_sided = False
        self.closed = False
        self.stats = RouterStats()
        self.routes: dict[str, Route] = {}
        # KV a prefill worker holds for a request sent on to a decode worker: request id ->
        # prefill worker, until the decode worker reports the pull (which may come after the
        # request has finished) or the request fails.
        self.held: dict[str, str] = {}
        # prefilled requests waiting for flush_handoffs: decode worker -> [(route, sent, prefill)]
        self.handoffs: dict[str, list[tuple[Route, AddRequest, str]]] = {}
        # disaggregated requests routed to a decode worker but not handed to it yet (still
        # prefilling): they count towards its load when the next request is placed
        self.bound: dict[str, int] = {}
        self._batches: dict[int, _Batch] = {}
        self._ids = itertools.count()
        self._observed_loads: dict[str, WorkerLoad] | None = None
        self._observed_age = 0

    # ---- queries ----------------------------------------------------------------------------
    def live(self, prompt: Sequence[int] | None = None,
             loads: Mapping[str, WorkerLoad] | None = None) -> list[WorkerView]:
        """The live workers' views; with prompt, each says how much of it the worker likely has
        cached (the prefix index's match); with loads (loads()), each carries its own."""
        return [WorkerView(w.name, w.role, w.outstanding + self.bound.get(w.name, 0),
                           w.kv_usage, w.summary,
                           self.prefix.match(w.name, prompt) if prompt else 0,
                           None if loads is None else loads.get(w.name, WorkerLoad()))
                for w in self.workers.values() if w.alive]

    def loads(self) -> dict[str, WorkerLoad]:
        """Each worker's WorkerLoad from the routes the core holds (admitted, or sent and not
        answered yet)."""
        acc: dict[str, list] = {}   # worker -> [queued prefill, decodes, context, remaining]
        prefill_stage, collocated = Stage.PREFILL, Stage.COLLOCATED
        pending = (it[0] for b in self._batches.values() if not b.handoff for it in b.items)
        for r in itertools.chain(self.routes.values(), pending):
            path, stage = r.path, r.stage
            if path is None:
                continue
            if stage is prefill_stage or (stage is collocated and not r.produced):
                name = path.prefill if stage is prefill_stage else path.worker
                a = acc.get(name) or acc.setdefault(name, [0, 0, 0, 0.0])
                a[0] += max(1, r.num_prompt_tokens - r.cached)
            else:
                seen = r.generated or 1
                a = acc.get(path.worker) or acc.setdefault(path.worker, [0, 0, 0, 0.0])
                a[1] += 1
                a[2] += r.num_prompt_tokens + seen
                a[3] += max(0.0, r.predicted - seen)
        out = {}
        for name, (q, b, ctx, rem) in acc.items():
            s = self.workers[name].summary
            out[name] = WorkerLoad(q, b, ctx, rem, s.prefill_tokens_per_step if s else 0.0)
        for name, w in self.workers.items():
            if name not in out and w.summary is not None:
                out[name] = WorkerLoad(prefill_tokens_per_step=w.summary.prefill_tokens_per_step)
        return out

    def model_stats(self) -> dict:
        """What the router's models have learned, for /metrics: the length predictor's stats
        (its prequential MAE and the global mean's), and with a cost model its error per term
        before correction, its correction factors and the policy's decisions per path."""
        out: dict = {"predictor": self.predictor.stats()._asdict()}
        cost = self.policy.cost
        if cost is not None:
            out["cost_errors"] = cost.error_stats()
            out["cost_factors"] = {f"{w}:{k}": f for (w, k), f in cost.factors.items()}
            out["decisions"] = dict(getattr(self.policy, "decisions", {}))
        return out

    def has_request(self, request_id: str) -> bool:
        return request_id in self.routes or any(
            it[0].req.request_id == request_id for b in self._batches.values() for it in b.items)

    # ---- events -----------------------------------------------------------------------------
    def add(self, requests: list[tuple[AddRequest, str | None]]) -> list[Action]:
        """New requests, checked already (prompt as {"prompt_token_ids": ids}, arrival_time
        set), each with its prompt text or None. Each ends in a Send (then accepted) or a
        Reject."""
        routes = [Route(r, text, len(r.prompt["prompt_token_ids"])) for r, text in requests]
        return self._place(routes)

    def accepted(self, batch: int, errors: list[str | None]) -> list[Action]:
        """The worker's answer to Send(batch): None (queued) or an error per request."""
        b = self._batches.pop(batch)
        if b.handoff:
            return self._handed_off(b, errors)
        actions: list[Action] = []
        w = self.workers[b.worker]
        for (route, _), err in zip(b.items, errors):
            if err is None:
                route.admitted = True
                self.routes[route.req.request_id] = route
                self.stats.requests[PathKind(route.path.kind).value] += 1
                continue
            w.outstanding -= 1
            self._unbind(route)
            if route.admitted:  # placed again after its worker died
                self._fail(route, f"worker {route.rerouted_from} died and rerouting failed: {err}",
                           actions)
            else:
                actions.append(Reject(route.req.request_id, err))
        return actions

    def output(self, worker: str, out: RequestOutput) -> list[Action]:
        """An output of worker's step (cumulative, as EngineClient.step returns it)."""
        route = self.routes.get(out.request_id)
        if route is None:
            return []
        w = self.workers[worker]
        if route.stage is Stage.PREFILL:
            return self._prefilled(w, route, out)
        if out.prompt is None:
            out.prompt = route.prompt
        if route.first is not None:  # disagg: the first token and its logprobs came from P
            first = route.first.outputs[0]
            for o in out.outputs:
                if o.logprobs is not None and first.logprobs:
                    o.logprobs = first.logprobs[:1] + o.logprobs
            # (its prefill worker's times: the decode worker's start after the hand-off)
            pm = route.first.metrics
            out.metrics = {**out.metrics, "arrival": route.arrival,
                           "first_token": pm.get("first_token", 0.0),
                           **({"scheduled": pm["scheduled"]} if "scheduled" in pm else {})}
        route.produced = True
        route.generated = max((len(o.token_ids) for o in out.outputs), default=0)
        if out.finished:
            del self.routes[out.request_id]
            w.outstanding -= 1
            if len(out.outputs) == 1:  # its engine keeps the computed tokens (not the last)
                self.prefix.insert(worker, [*route.req.prompt["prompt_token_ids"],
                                            *out.outputs[0].token_ids[:-1]])
            self._learn(route, out)
        elif route.req.final_only:    # (sent with partial outputs for a load-aware policy)
            return []
        return [Deliver(out)]

    def _learn(self, route: Route, out: RequestOutput) -> None:
        """A finished request: its output length for the predictor (censored when it was
        aborted or cut by the context length), its latencies for the policy."""
        n, params = route.generated, route.req.params
        reasons = {o.finish_reason for o in out.outputs}
        censored = True if "abort" in reasons or (n < params.max_tokens and "length" in reasons) \
            else None
        if n >= 1 and out.error is None:
            self.predictor.observe(route.num_prompt_tokens, min(n, params.max_tokens),
                                   params.max_tokens, censored=censored)
        m = out.metrics
        arrival, first, done = m.get("arrival"), m.get("first_token"), m.get("finished")
        ttft = (first - arrival) * 1e3 if arrival and first else None
        tpot = (done - first) * 1e3 / (n - 1) if first and done and n > 1 else None
        self.policy.observe_request(route.req.request_id, ttft, tpot)

    def loads_done(self, events: list[KVLoadDone], worker: str | None = None) -> list[Action]:
        """A decode worker's reports on its pulls: each releases the producer's held KV.
        worker: the decode worker that reports them (for the policy's cost model)."""
        actions: list[Action] = []
        cost = self.policy.cost
        for ev in events:
            if ev.ok:
                self.stats.transfers += 1
                self.stats.transfer_bytes += ev.nbytes
                self.stats.transfer_seconds += ev.seconds
                if cost is not None and worker is not None:
                    cost.observe_transfer_bytes(worker, ev.nbytes, ev.seconds * 1e3)
            else:
                self.stats.transfer_failures += 1
            self._release_held(ev.request_id, None, actions)
        return actions

    def abort(self, request_ids: list[str]) -> list[Action]:
        """The user gave up on these (admitted) requests; unknown ids are ignored."""
        actions: list[Action] = []
        for rid in request_ids:
            route = self.routes.pop(rid, None)
            if route is None:
                continue
            self.policy.forget(rid)
            self._unbind(route)
            w = self.workers[route.path.prefill if route.stage is Stage.PREFILL
                             else route.path.worker]
            if route.stage is not Stage.HANDOFF:
                w.outstanding -= 1
            if w.alive:
                actions.append(Abort(w.name, [rid]))
            if route.path.kind == PathKind.DISAGG:
                # Also at the prefill stage: the prefill may have finished (KV held) with its
                # output still on the way. The worker reads the abort first, then this.
                self._release_held(rid, route.path.prefill, actions)
        return actions

    def flush_handoffs(self, exited: Iterable[str] = ()) -> list[Action]:
        """Send the prefilled requests on to their decode workers: one Send per decode worker.
        `exited`: workers whose processes have ended though no call has noticed yet (their KV
        is gone). A dead (or exited, or restarted) prefill worker's KV died with it, and a pull
        from a dead GPU's memory could fault the decode GPU: those requests travel without KV
        and the decode worker recomputes the prompt, then continues."""
        exited = set(exited)
        pending, self.handoffs = self.handoffs, {}
        for items in pending.values():
            for k, (route, sent, prefill) in enumerate(items):
                p = self.workers[prefill]
                if not p.alive or prefill in exited or sent.kv_source.worker != p.kv_name:
                    items[k] = (route, dataclasses.replace(
                        sent, kv_source=sent.kv_source.without_kv()), prefill)
        actions: list[Action] = []
        while pending:
            name = next(iter(pending))
            items = pending.pop(name)
            if self.workers[name].alive:
                actions.append(self._send(name, True, items))
            else:
                self._redirect(name, items, pending, actions)
        return actions

    def worker_died(self, worker: str, error: str) -> list[Action]:
        """worker is gone (its processes died, or a message found it dead). Its requests that
        produced nothing are placed again; the others fail (their tokens cannot be continued
        elsewhere without their KV); its hand-offs and sends in flight go elsewhere."""
        w = self.workers[worker]
        if not w.alive:
            return []
        w.alive = False
        w.outstanding = 0
        self.prefix.drop(worker)
        actions: list[Action] = []
        if self.two_sided:  # its pairs are aborted now, not after a send times out
            actions += [DropPeer(o.name, w.kv_name) for o in self.workers.values()
                        if o.alive and o.role != w.role]
        again: list[Route] = []
        lost_handoffs: list[tuple[Route, AddRequest, str]] = []
        for bid in [b for b, batch in self._batches.items() if batch.worker == worker]:
            batch = self._batches.pop(bid)
            if batch.handoff:
                lost_handoffs += batch.items
            else:  # not on the worker yet: placed again as they are
                for route, _ in batch.items:
                    self._unbind(route)
                    again.append(route)
        retry = []
        for route in list(self.routes.values()):
            # (a request in HANDOFF is not on w yet: its hand-off finds another)
            on_w = (route.path.worker == worker and route.stage in (Stage.COLLOCATED, Stage.DECODE)) \
                or (route.path.prefill == worker and route.stage is Stage.PREFILL)
            if not on_w:
                continue
            if not route.produced and not self.closed:
                del self.routes[route.req.request_id]
                self._unbind(route)
                route.rerouted_from = worker
                retry.append(route)
            else:
                self._fail(route, f"worker {worker} died: {error}", actions)
        self.stats.rerouted += len(retry)
        if lost_handoffs:
            pending: dict[str, list] = {}
            self._redirect(worker, lost_handoffs, pending, actions)
            actions += [self._send(n, True, items) for n, items in pending.items()]
        actions += self._place(again + retry)
        return actions

    def worker_up(self, worker: str, kv_name: str) -> list[Action]:
        """worker is back (restarted, its KV peers connected) under a new KV name."""
        w = self.workers[worker]
        w.alive, w.outstanding, w.kv_name = True, 0, kv_name
        self.prefix.drop(worker)   # a new incarnation starts with an empty cache
        return []

    def reset_prefix_index(self) -> None:
        """The workers' prefix caches were reset: forget what the index guessed of them."""
        self.prefix.clear()

    def observe(self, worker: str, stats: WorkerStats | None = None,
                steps: Iterable[StepRecord] = ()) -> None:
        """The worker's latest stats (its KV usage, for placement) and engine steps."""
        w = self.workers[worker]
        if stats is not None:
            w.kv_usage = stats.num_kv_blocks_used / max(1, stats.num_kv_blocks)
        steps = list(steps)
        cost = self.policy.cost
        if steps and cost is not None:
            # (the loads at most LOADS_REUSED observations old: a step's contexts need not be
            # exact, and rebuilding them is a pass over every route)
            if self._observed_loads is None or self._observed_age >= LOADS_REUSED:
                self._observed_loads, self._observed_age = self.loads(), 0
            self._observed_age += 1
            load = self._observed_loads.get(worker, WorkerLoad())
            per_seq = load.decode_context_tokens / load.decodes if load.decodes else 0.0
            for r in steps:
                cost.observe_step(worker, r.num_prefill_tokens, r.num_decode_seqs,
                                  per_seq * r.num_decode_seqs, r.wall_ms)
        if steps:
            totals = self.stats.steps
            for r in steps:
                kind = step_kind(r.num_decode_seqs, r.num_prefill_tokens)
                if kind is not None:
                    t = totals.get((worker, kind))
                    if t is None:
                        t = totals[(worker, kind)] = StepTotals()
                    t.add(r)
            w.steps.extend(steps)
            w._summary_stale = True

    def close(self) -> None:
        """No more work: every request is forgotten, a dying worker's are not placed again."""
        self.closed = True
        self.routes.clear()

    # ---- internals --------------------------------------------------------------------------
    def _place(self, routes: list[Route]) -> list[Action]:
        """Choose a path for each route (the next one sees this one's load) and send each
        worker its share in one batch."""
        actions: list[Action] = []
        batches: dict[str, list[tuple[Route, AddRequest]]] = {}
        wants_load = self.policy.wants_load
        loads = self.loads() if wants_load else None
        for route in routes:
            req = route.req
            if not route.admitted:   # (a rerouted request keeps its first prediction)
                route.predicted = self.predictor.predict(route.num_prompt_tokens, req.params.max_tokens)
            ids = token_array(req.prompt["prompt_token_ids"])   # (once for every worker)
            live = self.live(ids, loads)
            path = self.policy.choose(RouteRequest(req.request_id, route.num_prompt_tokens,
                                                   req.params, route.predicted), live)
            if path is not None and path.kind == PathKind.DISAGG and not disaggregable(req.params):
                path = self.policy.collocated(live) or path  # the policy's constraint, enforced
            if path is None:
                if route.admitted:
                    self._fail(route, f"worker {route.rerouted_from} died and rerouting failed: "
                               f"{Unavailable(f'no live worker ({self.describe()})')}", actions)
                else:
                    actions.append(Reject(req.request_id, Unavailable(
                        f"no worker can serve requests now ({self.describe()})")))
                continue
            route.path = path
            if path.kind == PathKind.DISAGG:
                route.stage, target = Stage.PREFILL, path.prefill
                p = req.params
                first = dataclasses.replace(p, max_tokens=1, min_tokens=min(p.min_tokens, 1))
                sent = dataclasses.replace(req, params=first, final_only=True, kv_hold=True)
            else:
                route.stage, target = Stage.COLLOCATED, path.worker
                # (a load-aware policy follows every request's progress; output() keeps a
                # final-only request's partial outputs from the user)
                sent = dataclasses.replace(req, final_only=False) if wants_load and req.final_only else req
            route.cached = next((w.cached for w in live if w.name == target), 0)
            route.produced, route.generated = False, 0
            if wants_load:   # the next request of this batch sees this one queued there
                cur = loads.get(target, WorkerLoad())
                loads[target] = dataclasses.replace(cur, queued_prefill_tokens=(
                    cur.queued_prefill_tokens + max(1, route.num_prompt_tokens - route.cached)))
            batches.setdefault(target, []).append((route, sent))
            self.prefix.insert(target, ids)   # computed there
            # counted at once, so that the next request of this batch sees the load
            self.workers[target].outstanding += 1
            self._bind(route)
        actions += [self._send(name, False, items) for name, items in batches.items()]
        return actions

    def _send(self, worker: str, handoff: bool, items: list) -> Send:
        if handoff:   # the decode worker is final here (a redirect may have changed it)
            items = [(route, self._skipping(worker, sent), prefill)
                     for route, sent, prefill in items]
        bid = next(self._ids)
        self._batches[bid] = _Batch(worker, handoff, items)
        return Send(bid, worker, [it[1] for it in items])

    def _prefilled(self, p: WorkerSlot, route: Route, out: RequestOutput) -> list[Action]:
        p.outstanding -= 1
        route.first = out
        route.produced = True
        rid = route.req.request_id
        o = out.outputs[0]
        params = route.req.params
        done = (o.finish_reason == "abort"
                or (o.finish_reason == "stop" and params.min_tokens <= 1)
                or route.num_prompt_tokens + len(o.token_ids) >= self.max_model_len
                or out.kv_transfer is None)
        actions: list[Action] = []
        if done:
            if out.kv_transfer is not None:
                actions.append(Release(p.name, [rid]))
            del self.routes[rid]
            self._unbind(route)
            route.generated = len(o.token_ids)
            self._learn(route, out)
            out.prompt = route.prompt
            actions.append(Deliver(out))
            return actions
        if not route.req.final_only:  # stream the first token now
            actions.append(Deliver(RequestOutput(
                rid, route.prompt, out.prompt_token_ids,
                [CompletionOutput(o.index, o.text, list(o.token_ids), o.logprobs, None, None,
                                  list(o.token_ids), o.text)],
                False, dict(out.metrics))))
        source = msgspec.structs.replace(out.kv_transfer, worker=p.kv_name)
        route.stage = Stage.HANDOFF
        sent = dataclasses.replace(route.req, kv_source=source)
        if self.policy.wants_load and sent.final_only:   # (as in _place)
            sent = dataclasses.replace(sent, final_only=False)
        self.handoffs.setdefault(route.path.worker, []).append((route, sent, p.name))
        return actions

    def _redirect(self, dead: str, items: list, pending: dict, actions: list[Action]) -> None:
        """Hand-offs meant for dead decode worker `dead`, each placed as any request is
        (policy.place, cache-aware: the decode worker holding most of its conversation): to
        another decode worker (the KV is still held), else whole to any worker (which
        recomputes the prompt; the producer drops the KV it holds), else they fail."""
        lost = []
        for route, sent, prefill in items:
            live = self.live(token_array(route.req.prompt["prompt_token_ids"]))
            other = self.policy.place(live, "decode")
            if other is not None:
                name = other.name
            else:
                whole = self.policy.collocated(live)
                if whole is None:
                    lost.append((route, sent, prefill))
                    continue
                name = whole.worker
                if not sent.kv_source.lost:
                    self._release_held(route.req.request_id, prefill, actions)
                    sent = dataclasses.replace(sent, kv_source=sent.kv_source.without_kv())
            self._unbind(route)
            route.path = route.path._replace(worker=name)
            pending.setdefault(name, []).append((route, sent, prefill))
        if lost:
            why = f"worker {dead} is gone and no worker is left to continue on"
            actions += self._handed_off(_Batch(dead, True, lost), [why] * len(lost))

    def _skipping(self, decode: str, sent: AddRequest) -> AddRequest:
        """A hand-off to `decode` with its kv_source's skip_blocks set: two-sided, the whole
        blocks of the prompt the prefix index believes `decode` holds (the producer sends the
        rest), never the last block (a load moves at least one, as a one-sided consumer's
        does); one-sided, 0 (the consumer matches its own cache)."""
        src = sent.kv_source
        bs = self.workers[decode].block_size
        skip = 0
        if self.two_sided and bs is not None and not src.lost:
            held = self.prefix.match(decode, sent.prompt["prompt_token_ids"])
            skip = min(held, src.num_tokens - 1) // bs
        if skip == src.skip_blocks:
            return sent
        return dataclasses.replace(sent, kv_source=msgspec.structs.replace(src, skip_blocks=skip))

    def _handed_off(self, b: _Batch, errors: list[str | None]) -> list[Action]:
        actions: list[Action] = []
        d = self.workers[b.worker]
        sends: dict[str, list[KVSend]] = {}
        for (route, sent, prefill), err in zip(b.items, errors):
            self._unbind(route)
            rid = route.req.request_id
            held = not sent.kv_source.lost   # else: recomputed there (producer died)
            if err is None and held and self.two_sided:  # sent as it is handed over
                sends.setdefault(prefill, []).append(
                    KVSend(sent.kv_source.request_id, d.kv_name, sent.kv_source.sent_block_ids))
            if self.routes.get(rid) is not route:  # aborted meanwhile
                if held:
                    self._release_held(rid, prefill, actions)
                if err is None:
                    actions.append(Abort(d.name, [rid]))
            elif err is not None:
                self._fail(route, f"decode worker rejected the request: {err}", actions)
            else:
                if held:
                    self.held[rid] = prefill
                else:
                    self.stats.recomputed += 1
                route.stage = Stage.DECODE
                d.outstanding += 1
        actions += [SendKV(p, batch) for p, batch in sends.items() if self.workers[p].alive]
        return actions

    def _release_held(self, rid: str, prefill: str | None, actions: list[Action]) -> None:
        """Tell the prefill worker holding rid's KV to drop it (harmless if nothing is held)."""
        name = self.held.pop(rid, None) or prefill
        if name is not None and self.workers[name].alive:
            actions.append(Release(name, [rid]))

    def _fail(self, route: Route, why: str, actions: list[Action]) -> None:
        self.routes.pop(route.req.request_id, None)
        self.policy.forget(route.req.request_id)
        self._unbind(route)
        self.stats.failed += 1
        if route.path is not None and route.path.kind == PathKind.DISAGG:
            self._release_held(route.req.request_id, route.path.prefill, actions)
        tokens = list(route.first.outputs[0].token_ids) if route.first is not None else []
        actions.append(Deliver(RequestOutput(
            route.req.request_id, route.prompt, route.req.prompt["prompt_token_ids"],
            [CompletionOutput(0, "", tokens, None, "abort", why)], True,
            {"arrival": route.arrival}, error=why)))

    def _bind(self, route: Route) -> None:
        if route.path.kind == PathKind.DISAGG and not route.bound:
            route.bound = True
            self.bound[route.path.worker] = self.bound.get(route.path.worker, 0) + 1

    def _unbind(self, route: Route) -> None:
        """route no longer waits to reach its decode worker (handed off, done or gone)."""
        if route.bound:
            route.bound = False
            self.bound[route.path.worker] -= 1
