"""Router: admits requests, picks a path per request, and drives the workers on it.

    add_requests ──> policy.choose ──> collocated: worker W runs the whole request
                                  └──> disagg:     prefill worker P (max_tokens 1, kv_hold)
                                                     │ finished: its first token + KVSource
                                                     ▼
                                                   decode worker D (kv_source: pulls P's blocks,
                                                     continues from the first token)
                                                     │ KVLoadDone
                                                     ▼
                                                   ReleaseKV to P

It has the request API of an EngineClient (add_requests / abort_request / step /
has_unfinished_requests / check_integrity / drain / shutdown), so the offline LLM and the server
drive one worker or a P/D deployment the same way. Each worker is an EngineClient (its own
processes, TP group and GPUs); the router waits on all of them at once.

Faults: a worker that dies is removed from routing; its requests that have not produced a token
are routed again, the others finish with finish_reason "abort" (stop_reason and error say why).
A pull that fails or times out is recomputed on the decode worker (the worker does that itself).
While a role has no live worker, requests run whole on a worker of another role. A dead worker
is restarted (RestartPolicy: bounded attempts with back-off) in a background thread and taken
back into routing once it is up (its KV peers connected again):

    up ──dies──> dead ──back-off──> restarting ──Ready──> up   (a new client, a new KV name)
                  │                     └──fails──> dead (next attempt, longer back-off)
                  └── attempts used up ──> failed (stays out of routing)

Nothing a request carries can raise out of add_requests: each request's problem is its own
error string (Unavailable when the deployment, not the request, is at fault).
"""
from __future__ import annotations

import abc
import dataclasses
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec
import zmq

from ..checks import check_int, check_number
from ..config import EngineConfig
from ..protocol import AddRequest, KVPair, KVSend, WorkerStats, parse_prompt
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import SamplingParams
from ..worker.client import EngineClient, EngineDeadError

ROLES = ("prefill", "decode", "collocated")


class Unavailable(str):
    """A rejection that is the deployment's state, not the request's fault (no live worker):
    an error string like any other, which the server answers with 503 instead of 400."""


@dataclass(frozen=True)
class RestartPolicy:
    """How a dead worker is brought back: up to max_restarts attempts in a row, the k-th after
    backoff_s * 2**k (at most max_backoff_s). A worker that stays up for stable_s has its
    count reset, so a rare death far apart from the last never uses the budget up."""
    max_restarts: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 300.0

    def __post_init__(self):
        check_int("max_restarts", self.max_restarts, minimum=0)
        for name in ("backoff_s", "max_backoff_s", "stable_s"):
            check_number(name, getattr(self, name), allow_zero=True)

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** attempt)


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    role: str                     # prefill | decode | collocated
    config: EngineConfig


def plan_workers(base: EngineConfig, prefill: int = 0, decode: int = 0, collocated: int = 0,
                 prefill_tp: int | None = None, decode_tp: int | None = None,
                 collocated_tp: int | None = None, kv_connector: str = "shared") -> list[WorkerSpec]:
    """Worker specs for a deployment: each its own TP group; on CUDA consecutive GPUs from the
    base device (prefill workers first, then decode, then collocated)."""
    for name, v in (("prefill", prefill), ("decode", decode), ("collocated", collocated)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"number of {name} workers must be a non-negative integer, got {v!r}")
    if prefill + decode + collocated == 0:
        raise ValueError("a deployment needs at least one worker")
    if (prefill == 0) != (decode == 0):
        raise ValueError("prefill and decode workers come together (--prefill N --decode M)")
    specs = []
    dev = base.torch_device
    next_gpu = dev.index or 0
    for role, count, tp in (("prefill", prefill, prefill_tp), ("decode", decode, decode_tp),
                            ("collocated", collocated, collocated_tp)):
        tp = tp or base.tensor_parallel_size
        for i in range(count):
            device = base.device
            if dev.type == "cuda":
                device = f"cuda:{next_gpu}"
                next_gpu += tp
            cfg = dataclasses.replace(
                base, device=device, tensor_parallel_size=tp, distributed_executor_backend="mp",
                kv_connector=kv_connector if role != "collocated" else None)
            specs.append(WorkerSpec(f"{role}-{i}", role, cfg))
    return specs


class Path(NamedTuple):
    kind: str                     # "collocated" | "disagg"
    worker: str                   # collocated: the worker; disagg: the decode worker
    prefill: str | None = None    # disagg: the prefill worker


@dataclass
class WorkerView:
    name: str
    role: str
    outstanding: int              # requests the router has on it now
    kv_usage: float               # fraction of its KV pool in use (as of its last report)


@dataclass(frozen=True)
class RouteRequest:
    """What a policy sees of a request (the cost model will want more)."""
    request_id: str
    num_prompt_tokens: int
    params: SamplingParams


class RoutingPolicy(abc.ABC):
    """Chooses a path for each request among the live workers. The adaptive (cost-model) policy
    plugs in here."""
    name = ""

    @abc.abstractmethod
    def choose(self, req: RouteRequest, workers: list[WorkerView]) -> Path:
        ...

    @staticmethod
    def least_loaded(workers: list[WorkerView], role: str) -> WorkerView | None:
        cands = [w for w in workers if w.role == role]
        return min(cands, key=lambda w: (w.outstanding, w.kv_usage), default=None)

    def collocated(self, workers: list[WorkerView]) -> Path | None:
        """A whole request on one worker: a collocated one, else a decode worker, else (no
        decode worker left) a prefill worker, which runs it as any engine would."""
        w = (self.least_loaded(workers, "collocated") or self.least_loaded(workers, "decode")
             or self.least_loaded(workers, "prefill"))
        return None if w is None else Path("collocated", w.name)

    def disagg(self, workers: list[WorkerView]) -> Path | None:
        p, d = self.least_loaded(workers, "prefill"), self.least_loaded(workers, "decode")
        return None if p is None or d is None else Path("disagg", d.name, p.name)


class CollocatedPolicy(RoutingPolicy):
    name = "collocated"

    def choose(self, req, workers):
        return self.collocated(workers) or self.disagg(workers)


class DisaggPolicy(RoutingPolicy):
    name = "disagg"

    def choose(self, req, workers):
        return self.disagg(workers) or self.collocated(workers)


class RoundRobinPolicy(RoutingPolicy):
    """Alternates between the disaggregated and the collocated path (each least-loaded within
    its roles) where both exist."""
    name = "round-robin"

    def __init__(self):
        self._turn = itertools.count()

    def choose(self, req, workers):
        paths = [p for p in (self.disagg(workers), self.collocated(workers)) if p is not None]
        return paths[next(self._turn) % len(paths)] if paths else None


POLICIES = {p.name: p for p in (CollocatedPolicy, DisaggPolicy, RoundRobinPolicy)}


def make_policy(name: str | RoutingPolicy) -> RoutingPolicy:
    if isinstance(name, RoutingPolicy):
        return name
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name]()


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


@dataclass(eq=False)
class _Route:
    req: AddRequest               # as the user sent it (prompt as token ids)
    prompt: str | None
    num_prompt_tokens: int
    path: Path
    stage: str                    # "collocated" | "prefill" | "handoff" | "decode"
    arrival: float
    first: RequestOutput | None = None   # the prefill worker's output (disagg)
    produced: bool = False        # a token reached the user
    bound: bool = False           # disagg, before the hand-off: counted in Router._bound


def _sum_stats(stats) -> WorkerStats:
    total = WorkerStats(0, 0, 0, 0, 0)
    for s in stats:
        for f in WorkerStats.__struct_fields__:
            setattr(total, f, getattr(total, f) + getattr(s, f))
    return total


class _Starting:
    """A worker starting in a daemon thread, so that the router keeps serving meanwhile. The
    thread is never joined (a start outliving the deployment is shut down when it completes;
    the worker's processes also exit once this process is gone)."""

    def __init__(self, spec: WorkerSpec, name: str, timeout_s: float):
        self.client: EngineClient | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._abandoned = False
        threading.Thread(target=self._run, args=(spec, name, timeout_s), daemon=True,
                         name=f"pdserve-start-{name}").start()

    def _run(self, spec: WorkerSpec, name: str, timeout_s: float) -> None:
        try:
            client = EngineClient(spec.config, timeout_s, name)
        except BaseException as e:  # noqa: BLE001 - the router reads it as a failed attempt
            self.error = e
        else:
            with self._lock:
                abandoned, self.client = self._abandoned, client
            if abandoned:
                client.shutdown(5.0)
        self.done.set()

    def abandon(self) -> None:
        with self._lock:
            self._abandoned, client, self.client = True, self.client, None
        if client is not None:
            client.shutdown(5.0)


@dataclass(frozen=True)
class WorkerHealth:
    name: str
    role: str
    state: str                    # up | dead (waiting to restart) | restarting | failed
    restarts: int                 # successful restarts so far
    error: str | None             # why it last died (or why its restart failed)


class _Worker:
    """One worker slot of the deployment: its spec, the client of its current incarnation (a
    restart makes a new one, named spec.name.N so that KV peers never mistake it for the
    dead one) and the restart state."""

    def __init__(self, spec: WorkerSpec, client: EngineClient):
        self.spec, self.client = spec, client
        self.outstanding = 0
        self.alive = True
        self.started = time.monotonic()
        self.generation = 0
        self.attempts = 0             # restarts in a row without a stable run
        self.restarts = 0
        self.restart_at: float | None = None   # dead: when the next attempt starts
        self.starting: _Starting | None = None  # an attempt in progress
        self.error: str | None = None

    @property
    def state(self) -> str:
        if self.alive:
            return "up"
        if self.starting is not None:
            return "restarting"
        return "dead" if self.restart_at is not None else "failed"

    def view(self, bound: int = 0) -> WorkerView:
        s = self.client.stats
        usage = 0.0 if s is None else s.num_kv_blocks_used / max(1, s.num_kv_blocks)
        return WorkerView(self.spec.name, self.spec.role, self.outstanding + bound, usage)


class Router:
    def __init__(self, specs: list[WorkerSpec], policy: str | RoutingPolicy = "disagg",
                 startup_timeout_s: float = 900.0, restart: RestartPolicy | None = None):
        if len({s.name for s in specs}) != len(specs):
            raise ValueError("worker names must be unique")
        for s in specs:
            if s.role not in ROLES:
                raise ValueError(f"unknown worker role {s.role!r}; roles: {ROLES}")
        self.policy = make_policy(policy)
        self.restart = restart if restart is not None else RestartPolicy()
        self.startup_timeout_s = startup_timeout_s
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = [pool.submit(EngineClient, s.config, startup_timeout_s, s.name)
                       for s in specs]
            clients, error = [], None
            for f in futures:
                try:
                    clients.append(f.result())
                except BaseException as e:  # noqa: BLE001 - stop the others, then raise it
                    error = error or e
        if error is not None:
            for c in clients:
                c.shutdown(5.0)
            raise error
        self.workers = {s.name: _Worker(s, c) for s, c in zip(specs, clients)}
        first = clients[0]
        self.tokenizer = first.tokenizer
        self.eos_token_ids = first.eos_token_ids
        self.max_model_len = min(c.max_model_len for c in clients)
        self.num_kv_blocks = min(c.num_kv_blocks for c in clients)
        self.info = first.info
        self.route_stats = RouterStats()
        self._routes: dict[str, _Route] = {}
        # KV a prefill worker holds for a request sent on to a decode worker: request id ->
        # prefill worker, until the decode worker reports the pull (which may come after the
        # request has finished) or the request fails.
        self._held: dict[str, str] = {}
        # prefilled requests waiting (within one collect) to be sent to their decode worker
        self._handoffs: dict[str, list[tuple[_Route, AddRequest, str]]] = {}
        # disaggregated requests routed to a decode worker but not handed to it yet (still
        # prefilling): they count towards its load when the next request is placed
        self._bound: dict[str, int] = {}
        self._closed = False
        self._store = None
        self.two_sided = False
        self._orphans: list[RequestOutput] = []  # outputs produced outside step()
        try:
            self._connect_kv()
        except BaseException:  # a bad pairing, or a worker that died on the way: stop them all
            self.shutdown(5.0)
            raise

    def _connect_kv(self, new: set[str] | None = None) -> None:
        """Introduce prefill and decode workers (new: only the pairs with one end among these
        live workers, after a restart; None: all). One-sided connectors: each decode worker
        maps every prefill worker's pools. Two-sided: every (prefill, decode) pair forms a
        process group at a TCPStore hosted here; both ends are told, and they join on their
        next step. Workers are named by their incarnation (client.name)."""
        from .connectors import get_connector_class
        live = [w for w in self.workers.values() if w.alive]
        prefill = [w for w in live if w.spec.role == "prefill"]
        decode = [w for w in live if w.spec.role == "decode"]
        if not prefill or not decode:
            return
        wanted = lambda p, d: new is None or p.spec.name in new or d.spec.name in new  # noqa: E731
        cls = get_connector_class(decode[0].spec.config.kv_connector)
        self.two_sided = cls.two_sided
        plan: dict[str, list] = {}
        if not cls.two_sided:
            for d in decode:
                peers = [p.client.info.kv_export for p in prefill if wanted(p, d)]
                if peers:
                    plan[d.spec.name] = peers
        else:
            import datetime

            import torch.distributed as dist
            if self._store is None:  # port 0: the store picks a free one
                self._store = dist.TCPStore("127.0.0.1", 0, is_master=True,
                                            wait_for_workers=False,
                                            timeout=datetime.timedelta(seconds=120))
            store = f"127.0.0.1:{self._store.port}"
            heads = prefill[0].client.info.kv_export.num_kv_heads
            for p in prefill:
                for d in decode:
                    if not wanted(p, d):
                        continue
                    pair = dict(producer=p.client.name, consumer=d.client.name,
                                producer_tp=p.spec.config.tensor_parallel_size,
                                consumer_tp=d.spec.config.tensor_parallel_size,
                                num_kv_heads=heads, store=store)
                    plan.setdefault(p.spec.name, []).append(KVPair(**pair, side="producer"))
                    plan.setdefault(d.spec.name, []).append(KVPair(**pair, side="consumer"))
        # a worker's peer count includes those of dead incarnations: wait for this many more
        before = {name: self.workers[name].client.check_integrity().kv_peers for name in plan}
        for name, peers in plan.items():
            errors = self.workers[name].client.connect_kv(peers)
            bad = next((e for e in errors if e is not None), None)
            if bad is not None:
                raise ValueError(f"{name} cannot exchange KV with its peers: {bad}")
        # Every rank adds its peers on its next step (two-sided: the pair's ranks meet there).
        # Ready means joined: wait for it, so that a deployment is whole when it is returned.
        deadline = time.monotonic() + 300
        for name, peers in plan.items():
            while self.workers[name].client.check_integrity().kv_peers < before[name] + len(peers):
                if time.monotonic() > deadline:
                    raise EngineDeadError(f"{name} did not join its KV peers in 300 s")
                time.sleep(0.01)

    # ---- requests ---------------------------------------------------------------------------
    def _live(self) -> list[WorkerView]:
        return [w.view(self._bound.get(name, 0)) for name, w in self.workers.items() if w.alive]

    def _bind(self, route: _Route) -> None:
        if route.path.kind == "disagg" and not route.bound:
            route.bound = True
            self._bound[route.path.worker] = self._bound.get(route.path.worker, 0) + 1

    def _unbind(self, route: _Route) -> None:
        """route no longer waits to reach its decode worker (handed off, done or gone)."""
        if route.bound:
            route.bound = False
            self._bound[route.path.worker] -= 1

    def add_requests(self, requests: list[AddRequest]) -> list[str | None]:
        """Routes each request; returns, per request, None or why it was rejected. A worker
        found dead while sending leaves routing and its share is routed again."""
        self._check_open()
        errors: list[str | None] = [None] * len(requests)
        now = time.monotonic()
        todo: list[tuple[int, AddRequest, str | None]] = []
        for i, r in enumerate(requests):
            try:
                if r.request_id in self._routes or any(r.request_id == q.request_id
                                                       for _, q, _ in todo):
                    raise ValueError(f"request id {r.request_id!r} is already in use")
                if not isinstance(r.params, SamplingParams):
                    raise ValueError("sampling params must be a SamplingParams")
                text, ids = parse_prompt(r.prompt, self.tokenizer, self.info.vocab_size)
                todo.append((i, dataclasses.replace(r, prompt={"prompt_token_ids": ids},
                                                    arrival_time=r.arrival_time or now), text))
            except ValueError as e:
                errors[i] = str(e)
            except Exception as e:  # noqa: BLE001 - whatever a request carries (a tokenizer's
                # TypeError on a lone surrogate...) is that request's error, never the router's
                errors[i] = f"the prompt cannot be processed: {type(e).__name__}: {e}"
        while todo:
            batches: dict[str, list[tuple[int, AddRequest, _Route]]] = {}
            for i, req, text in todo:
                n = len(req.prompt["prompt_token_ids"])
                live = self._live()
                path = self.policy.choose(RouteRequest(req.request_id, n, req.params), live)
                if path is not None and path.kind == "disagg" and (
                        req.params.n != 1 or req.params.prompt_logprobs is not None
                        or req.params.max_tokens <= 1):
                    path = self.policy.collocated(live) or path
                if path is None:
                    errors[i] = Unavailable(f"no worker can serve requests now ({self._summary()})")
                    continue
                route = _Route(req, text, n, path,
                               "prefill" if path.kind == "disagg" else "collocated",
                               req.arrival_time)
                target, sent = self._first_leg(route)
                batches.setdefault(target, []).append((i, sent, route))
                # counted at once, so that the next request of this batch sees the load
                self.workers[target].outstanding += 1
                self._bind(route)
            todo = []
            for name, items in batches.items():
                w = self.workers[name]
                try:
                    res = w.client.add_requests([sent for _, sent, _ in items])
                except ValueError:  # the batch does not encode: each alone, only the bad fails
                    res = [self._add_one(w, sent) for _, sent, _ in items]
                except EngineDeadError as e:
                    for *_, route in items:
                        self._unbind(route)
                    self._worker_died(w, e, raise_if_none_left=False)
                    todo += [(i, r.req, r.prompt) for i, _, r in items]
                    continue
                for (i, sent, route), err in zip(items, res):
                    if err is not None:
                        errors[i] = err
                        w.outstanding -= 1
                        self._unbind(route)
                        continue
                    self._routes[sent.request_id] = route
                    self.route_stats.requests[route.path.kind] += 1
        return errors

    @staticmethod
    def _add_one(w: _Worker, req: AddRequest) -> str | None:
        try:
            return w.client.add_requests([req])[0]
        except ValueError as e:
            return str(e)

    def _first_leg(self, route: _Route) -> tuple[str, AddRequest]:
        req = route.req
        if route.path.kind == "collocated":
            return route.path.worker, req
        p = req.params
        first = dataclasses.replace(p, max_tokens=1, min_tokens=min(p.min_tokens, 1))
        return route.path.prefill, dataclasses.replace(req, params=first, final_only=True,
                                                      kv_hold=True)

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            route = self._routes.pop(rid, None)
            if route is None:
                continue
            self._unbind(route)
            w = self.workers[route.path.prefill if route.stage == "prefill" else route.path.worker]
            if route.stage != "handoff":
                w.outstanding -= 1
            if w.alive:
                w.client.abort_request(rid)
            if route.path.kind == "disagg":
                # Also at the prefill stage: the prefill may have finished (KV held) with its
                # output still on the way. The worker reads the abort first, then this.
                self._release_held(rid, route.path.prefill)

    def has_unfinished_requests(self) -> bool:
        return bool(self._routes or self._orphans)

    def get_num_unfinished_requests(self) -> int:
        return len(self._routes)

    # ---- progress ---------------------------------------------------------------------------
    def step(self, timeout_s: float | None = None, wakeup_fd: int | None = None
             ) -> list[RequestOutput]:
        """Outputs of whatever the workers reported next (blocks until something, timeout_s or
        wakeup_fd readable: then []). With nothing in flight it returns at once, unless
        timeout_s is given: then it waits as long, noticing idle workers' deaths and
        restarts meanwhile."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            outs = self._collect()
            if outs or (not self._routes and deadline is None):
                return outs
            poller = zmq.Poller()
            for w in self.workers.values():
                if w.alive:
                    for p in w.client.pollables():
                        poller.register(p, zmq.POLLIN)
            if wakeup_fd is not None:
                poller.register(wakeup_fd, zmq.POLLIN)
            # a start in progress is not pollable: look at it every 0.2 s
            cap = 0.2 if self._restarting() else 1.0
            left = cap if deadline is None else min(cap, deadline - time.monotonic())
            events = dict(poller.poll(max(0, int(left * 1000))))
            if wakeup_fd is not None and wakeup_fd in events:
                return self._collect()
            if deadline is not None and time.monotonic() >= deadline and not events:
                return []

    def _collect(self) -> list[RequestOutput]:
        self._service()
        results, self._orphans = self._orphans, []
        for w in list(self.workers.values()):
            if not w.alive:
                continue
            try:
                for _ in range(1000):
                    if not w.client.readable():
                        break
                    for out in w.client.step(0):
                        self._on_output(w, out, results)
                if w.client.kv_events:
                    self._on_loads(w)
            except EngineDeadError as e:
                self._worker_died(w, e, results)
        if self._handoffs:
            self._flush_handoffs(results)
        return results

    def _on_output(self, w: _Worker, out: RequestOutput, results: list[RequestOutput]) -> None:
        route = self._routes.get(out.request_id)
        if route is None:
            return
        if route.stage == "prefill":
            self._on_prefilled(w, route, out, results)
            return
        if out.prompt is None:
            out.prompt = route.prompt
        if route.first is not None:  # disagg: the first token and its logprobs came from P
            first = route.first.outputs[0]
            for o in out.outputs:
                if o.logprobs is not None and first.logprobs:
                    o.logprobs = first.logprobs[:1] + o.logprobs
            out.metrics = {**out.metrics, "arrival": route.arrival,
                           "first_token": route.first.metrics.get("first_token", 0.0)}
        if out.finished:
            del self._routes[out.request_id]
            w.outstanding -= 1
        route.produced = True
        results.append(out)

    def _on_prefilled(self, p: _Worker, route: _Route, out: RequestOutput,
                      results: list[RequestOutput]) -> None:
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
        if done:
            if out.kv_transfer is not None:
                p.client.release_kv([rid])
            del self._routes[rid]
            self._unbind(route)
            out.prompt = route.prompt
            results.append(out)
            return
        if not route.req.final_only:  # stream the first token now
            results.append(RequestOutput(
                rid, route.prompt, out.prompt_token_ids,
                [CompletionOutput(o.index, o.text, list(o.token_ids), o.logprobs, None, None,
                                  list(o.token_ids), o.text)],
                False, dict(out.metrics)))
        source = msgspec.structs.replace(out.kv_transfer, worker=p.client.name)
        route.stage = "handoff"
        self._handoffs.setdefault(route.path.worker, []).append(
            (route, dataclasses.replace(route.req, kv_source=source), p.spec.name))

    def _flush_handoffs(self, results: list[RequestOutput]) -> None:
        """Send the prefilled requests on to their decode workers: one message (and one reply,
        which waits for the worker's next step boundary) per decode worker per collect. Those
        whose decode worker died go to another one (their KV is still held); with none left,
        they fail."""
        pending, self._handoffs = self._handoffs, {}
        # A dead prefill worker's KV died with it (and a pull from a dead GPU's memory could
        # fault the decode GPU): the decode worker recomputes the prompt, then continues.
        # (a restarted prefill worker is a new incarnation: the KV died with the old one)
        def kv_gone(sent: AddRequest, prefill: str) -> bool:
            p = self.workers[prefill]
            return not p.alive or p.client.exited() or sent.kv_source.worker != p.client.name

        for items in pending.values():
            for k, (route, sent, prefill) in enumerate(items):
                if kv_gone(sent, prefill):
                    items[k] = (route, dataclasses.replace(
                        sent, kv_source=sent.kv_source.without_kv()), prefill)
        while pending:
            name = next(iter(pending))
            items = pending.pop(name)
            d = self.workers[name]
            errors = None
            if d.alive:
                try:
                    errors = d.client.add_requests([sent for _, sent, _ in items])
                except EngineDeadError as e:
                    self._worker_died(d, e, results)
            if errors is None:
                live = self._live()
                other = self.policy.least_loaded(live, "decode")
                if other is None:
                    # no decode worker left: the request continues whole on another worker,
                    # which recomputes the prompt (the producer drops the KV it holds)
                    whole = self.policy.collocated(live)
                    other = None if whole is None else self.workers[whole.worker].view()
                    if other is not None:
                        for k, (route, sent, prefill) in enumerate(items):
                            if not sent.kv_source.lost:
                                self._release_held(route.req.request_id, prefill)
                                items[k] = (route, dataclasses.replace(
                                    sent, kv_source=sent.kv_source.without_kv()), prefill)
                if other is not None:
                    for route, _, _ in items:
                        self._unbind(route)
                        route.path = route.path._replace(worker=other.name)
                    pending.setdefault(other.name, []).extend(items)
                    continue
                errors = [f"worker {name} is gone and no worker is left to continue on"] * len(items)
            sends: dict[str, list[KVSend]] = {}
            for (route, sent, prefill), err in zip(items, errors):
                self._unbind(route)
                rid = route.req.request_id
                held = not sent.kv_source.lost   # else: recomputed there (producer died)
                if err is None and held and self.two_sided:  # sent as it is handed over
                    sends.setdefault(prefill, []).append(
                        KVSend(sent.kv_source.request_id, d.client.name, sent.kv_source.block_ids))
                if self._routes.get(rid) is not route:  # aborted meanwhile
                    if held:
                        self._release_held(rid, prefill)
                    if err is None:
                        d.client.abort_request(rid)
                elif err is not None:
                    self._fail(route, f"decode worker rejected the request: {err}", results)
                else:
                    if held:
                        self._held[rid] = prefill
                    else:
                        self.route_stats.recomputed += 1
                    route.stage = "decode"
                    d.outstanding += 1
            for prefill, batch in sends.items():
                if self.workers[prefill].alive:
                    self.workers[prefill].client.send_kv(batch)

    def _on_loads(self, d: _Worker) -> None:
        events, d.client.kv_events = d.client.kv_events, []
        for ev in events:
            if ev.ok:
                self.route_stats.transfers += 1
                self.route_stats.transfer_bytes += ev.nbytes
                self.route_stats.transfer_seconds += ev.seconds
            else:
                self.route_stats.transfer_failures += 1
            self._release_held(ev.request_id)

    def _release_held(self, rid: str, prefill: str | None = None) -> None:
        """Tell the prefill worker holding rid's KV to drop it (harmless if nothing is held)."""
        name = self._held.pop(rid, None) or prefill
        if name is not None and self.workers[name].alive:
            self.workers[name].client.release_kv([rid])

    # ---- faults ----------------------------------------------------------------------------
    def _fail(self, route: _Route, why: str, results: list[RequestOutput]) -> None:
        self._routes.pop(route.req.request_id, None)
        self._unbind(route)
        self.route_stats.failed += 1
        if route.path.kind == "disagg":
            self._release_held(route.req.request_id, route.path.prefill)
        tokens = list(route.first.outputs[0].token_ids) if route.first is not None else []
        results.append(RequestOutput(
            route.req.request_id, route.prompt, route.req.prompt["prompt_token_ids"],
            [CompletionOutput(0, "", tokens, None, "abort", why)], True,
            {"arrival": route.arrival}, error=why))

    def _worker_died(self, w: _Worker, error: Exception,
                     results: list[RequestOutput] | None = None, raise_if_none_left: bool = True) -> None:
        """Remove w from routing. Its requests that produced nothing are routed again; the
        others fail (their tokens cannot be continued elsewhere without their KV)."""
        if not w.alive:
            return
        w.alive = False
        w.outstanding = 0
        w.error = str(error)
        w.client.shutdown(1.0)
        if self.two_sided:  # its pairs are aborted now, not after a send times out
            for other in self.workers.values():
                if other.alive and other.spec.role != w.spec.role:
                    other.client.drop_kv_peer(w.client.name)
        self._schedule_restart(w)
        # (found dead while adding: its requests' final outputs go out with the next step's)
        results = results if results is not None else self._orphans
        retry = []
        for route in list(self._routes.values()):
            # (a request being handed to w is not on it yet: the hand-off finds another)
            on_w = (route.path.worker == w.spec.name and route.stage in ("collocated", "decode")) \
                or (route.path.prefill == w.spec.name and route.stage == "prefill")
            if not on_w:
                continue
            if not route.produced and not self._closed:
                del self._routes[route.req.request_id]
                self._unbind(route)
                retry.append(route)
            else:
                self._fail(route, f"worker {w.spec.name} died: {error}", results)
        if retry:
            self.route_stats.rerouted += len(retry)
            again = [dataclasses.replace(r.req, arrival_time=r.arrival, prompt=(
                r.req.prompt if r.prompt is None else {**r.req.prompt, "prompt": r.prompt}))
                for r in retry]
            errors = self.add_requests(again) if self._live() else \
                [Unavailable(f"no live worker ({self._summary()})")] * len(retry)
            for r, err in zip(retry, errors):
                if err is not None:
                    self._routes[r.req.request_id] = r
                    self._fail(r, f"worker {w.spec.name} died and rerouting failed: {err}", results)
        if not self._live() and raise_if_none_left and not self._restarting():
            raise EngineDeadError(f"every worker is gone (last: {w.spec.name}: {error})")

    # ---- restarts ---------------------------------------------------------------------------
    def _schedule_restart(self, w: _Worker) -> None:
        now = time.monotonic()
        if now - w.started >= self.restart.stable_s:
            w.attempts = 0
        if self._closed or w.attempts >= self.restart.max_restarts:
            w.restart_at = None   # failed: stays out of routing
            return
        w.restart_at = now + self.restart.delay(w.attempts)
        w.attempts += 1

    def _restarting(self) -> bool:
        """Some dead worker will be tried again."""
        return any(w.restart_at is not None or w.starting is not None
                   for w in self.workers.values())

    def _service(self) -> None:
        """Restart upkeep between steps (never blocks on a start): begins the attempts whose
        back-off has passed, and takes the started workers back into routing."""
        now = time.monotonic()
        for w in self.workers.values():
            if w.alive or self._closed:
                continue
            if w.starting is None and w.restart_at is not None and now >= w.restart_at:
                w.restart_at = None
                w.generation += 1
                w.starting = _Starting(w.spec, f"{w.spec.name}.{w.generation}",
                                       self.startup_timeout_s)
            elif w.starting is not None and w.starting.done.is_set():
                st, w.starting = w.starting, None
                if st.error is not None:
                    w.error = f"restart failed: {type(st.error).__name__}: {st.error}"
                    w.started = now
                    self._schedule_restart(w)
                else:
                    self._adopt(w, st.client)

    def _adopt(self, w: _Worker, client: EngineClient) -> None:
        """A restarted worker joins: its KV peers are connected, then it is routed to."""
        w.client, w.alive, w.started, w.outstanding = client, True, time.monotonic(), 0
        try:
            self._connect_kv({w.spec.name})
        except Exception as e:  # noqa: BLE001 - (ValueError, EngineDeadError...): another attempt
            w.alive = False
            w.error = f"restarted, but its KV peers could not be connected: {e}"
            client.shutdown(1.0)
            self._schedule_restart(w)
            return
        w.restarts += 1

    def _summary(self) -> str:
        return ", ".join(f"{w.spec.name} {w.state}" for w in self.workers.values())

    def health(self) -> list[WorkerHealth]:
        """Every worker's state (the server's /health and metrics)."""
        return [WorkerHealth(w.spec.name, w.spec.role, w.state, w.restarts, w.error)
                for w in self.workers.values()]

    # ---- lifecycle --------------------------------------------------------------------------
    def check_workers(self) -> dict[str, WorkerStats]:
        """Every live worker's invariants (AssertionError naming the worker); their stats."""
        out = {}
        # decode workers first: pull reports that arrive meanwhile release prefill-side KV
        # before the prefill workers are checked
        for name, w in sorted(self.workers.items(), key=lambda kv: kv[1].spec.role != "decode"):
            for d in self.workers.values():
                if d.alive and d.client.kv_events:
                    self._on_loads(d)
            if w.alive:
                try:
                    out[name] = w.client.check_integrity()
                except AssertionError as e:
                    raise AssertionError(f"{name}: {e}") from None
        return out

    def check_integrity(self) -> WorkerStats:
        """As EngineClient.check_integrity: the live workers' stats summed."""
        return _sum_stats(self.check_workers().values())

    @property
    def stats(self) -> WorkerStats:
        """The live workers' stats as of their last reports, summed (what metrics show)."""
        # (all zeros while no worker is up: a dead worker's last report is not the present)
        return _sum_stats(w.client.stats for w in self.workers.values()
                          if w.alive and w.client.stats)

    def num_free_blocks(self) -> int:
        return min(s.num_kv_blocks - s.num_kv_blocks_used for s in self.check_workers().values())

    @property
    def pids(self) -> list[int]:
        return [pid for w in self.workers.values() for pid in w.client.pids]

    def _check_open(self) -> None:
        if self._closed:
            raise EngineDeadError("the router was shut down")

    def drain(self, timeout_s: float = 60.0) -> list[RequestOutput]:
        """No more requests: finish the ones in flight, then stop every worker."""
        collected = []
        deadline = time.monotonic() + timeout_s
        while self._routes and time.monotonic() < deadline:
            try:
                collected += self.step(timeout_s=max(0.0, deadline - time.monotonic()))
            except EngineDeadError:
                break
        self.shutdown(max(1.0, deadline - time.monotonic()))
        return collected

    def shutdown(self, timeout_s: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._routes.clear()
        for w in self.workers.values():
            if w.starting is not None:
                w.starting.abandon()
                w.starting = None
            w.restart_at = None
        # decode workers first: they may still be reading the prefill workers' pools
        order = sorted(self.workers.values(), key=lambda w: w.spec.role != "decode")
        for w in order:
            w.client.shutdown(timeout_s)
        self._store = None  # the TCPStore's server stops with its last reference

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
