"""Router: a deployment of workers (each an EngineClient: its own processes, TP group, GPUs)
behind one request API, the EngineProtocol of a single EngineClient, so the offline LLM and
the server drive one worker or a P/D deployment the same way.

The decisions are the router core's (router_core.py: paths, stages, hand-offs, held KV, what a
death does to each request; policies.py: which path). This shell carries them out: it starts
the workers, turns the core's actions into messages, waits on every worker at once, feeds
their outputs and KV reports back, connects KV peers (one-sided: each decode worker maps every
prefill worker's pools; two-sided: a pair group per (prefill, decode) at a TCPStore hosted
here), and restarts dead workers (RestartPolicy, workers.py) in the background:

    add_requests ─> core.add ─> Send ─> client.add_requests ─> core.accepted / core.worker_died
    submit       ─> core.add ─> Send ─> client.submit_requests; its answer with a later step:
                    client.take_answers ─> core.accepted ─> take_answers (the server's way:
                    its I/O thread never waits for a worker's step boundary)
    step ─> client.step(0) per readable worker ─> core.output / loads_done ─> Deliver, Release
        ─> core.flush_handoffs ─> Send (with kv_source) to decode workers ─> SendKV (two-sided)

Faults: a worker that dies is removed from routing; its requests that have not produced a token
are routed again, the others finish with finish_reason "abort" (stop_reason and error say why).
A pull that fails or times out is recomputed on the decode worker (the worker does that itself).
While a role has no live worker, requests run whole on a worker of another role. A dead worker
is restarted and taken back into routing once it is up (its KV peers connected again).

Nothing a request carries can raise out of add_requests: each request's problem is its own
error string (Unavailable when the deployment, not the request, is at fault).
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import zmq

from ..protocol import AddRequest, KVPair, StepRecord, WorkerStats, parse_prompt
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..worker.client import EngineClient, EngineDeadError
from . import actions as act
from .router_core import RouterCore, RouterStats
from .policies import ROLES, RoutingPolicy, make_policy
from .prefix_index import PREFIX_INDEX_TOKENS
from .workers import RestartPolicy, Starting, Worker, WorkerHealth, WorkerSpec, abandon_all


def _nodes(w: Worker) -> str:
    return ",".join(sorted({n[:12] for n in w.client.nodes}))


def _sum_stats(stats) -> WorkerStats:
    total = WorkerStats(0, 0, 0, 0, 0)
    for s in stats:
        for f in WorkerStats.__struct_fields__:
            setattr(total, f, getattr(total, f) + getattr(s, f))
    return total


class Router:
    def __init__(self, specs: list[WorkerSpec], policy: str | RoutingPolicy = "disagg",
                 startup_timeout_s: float = 900.0, restart: RestartPolicy | None = None):
        if len({s.name for s in specs}) != len(specs):
            raise ValueError("worker names must be unique")
        for s in specs:
            if s.role not in ROLES:
                raise ValueError(f"unknown worker role {s.role!r}; roles: {ROLES}")
        policy = make_policy(policy)
        self.restart = restart if restart is not None else RestartPolicy()
        self.startup_timeout_s = startup_timeout_s
        # Ray placed the workers: this process is reached at its node's address
        self._on_ray = any(s.config.executor_backend == "ray" for s in specs)
        if self._on_ray:
            from ..worker.ray_launch import connect
            connect()   # once, here: the start threads below would race to join
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = [pool.submit(EngineClient, s.config, startup_timeout_s, s.name,
                                   s.cpu_threads) for s in specs]
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
        first = clients[0]
        self.tokenizer = first.tokenizer
        self.eos_token_ids = first.eos_token_ids
        self.max_model_len = min(c.max_model_len for c in clients)
        self.num_kv_blocks = min(c.num_kv_blocks for c in clients)
        self.info = first.info
        # the prefix index keeps no more per worker than its pool can cache (none: caching off)
        prefix_tokens = {s.name: min(PREFIX_INDEX_TOKENS, c.num_kv_blocks * s.config.block_size)
                         if s.config.enable_prefix_caching else 0 for s, c in zip(specs, clients)}
        self.core = RouterCore([(s.name, s.role, c.name) for s, c in zip(specs, clients)],
                                  policy, self.max_model_len, describe=self._summary,
                                  prefix_tokens=prefix_tokens,
                                  block_sizes={s.name: s.config.block_size for s in specs})
        self.workers = {s.name: Worker(s, c, self.core.workers[s.name])
                        for s, c in zip(specs, clients)}
        self._store = None
        self._orphans: list[RequestOutput] = []  # outputs produced outside step()
        # Submitted adds (submit): each worker's Sends not answered yet (batch ids, oldest
        # first); the submitted requests whose answer is not known yet, those to abort once
        # admitted, rejections found meanwhile, and the answers for take_answers.
        # Once submit is used, every Send goes without waiting (hand-offs too).
        self.pipelined = False
        self._sent: dict[str, deque[int]] = {s.name: deque() for s in specs}
        self._awaiting: set[str] = set()
        self._abort_when_admitted: set[str] = set()
        self._rejected: dict[str, str] = {}
        self._answers: dict[str, str | None] = {}
        self._unsettled = False   # a submitted request may have been admitted or rejected
        try:
            self._connect_kv()
        except BaseException:  # a bad pairing, or a worker that died on the way: stop them all
            self.shutdown(5.0)
            raise

    # the core's state, as the router's (policy may be swapped between requests)
    @property
    def policy(self) -> RoutingPolicy:
        return self.core.policy

    @policy.setter
    def policy(self, policy: str | RoutingPolicy) -> None:
        self.core.policy = make_policy(policy)

    @property
    def route_stats(self) -> RouterStats:
        return self.core.stats

    @property
    def model_stats(self) -> dict:
        return self.core.model_stats()

    @property
    def two_sided(self) -> bool:
        return self.core.two_sided

    def step_records(self, worker: str) -> list[StepRecord]:
        """worker's recent engine steps (StepRecord), oldest first, across its restarts."""
        return list(self.core.workers[worker].steps)

    def _connect_kv(self, new: set[str] | None = None) -> None:
        """Introduce prefill and decode workers (new: only the pairs with one end among these
        workers, just restarted, and the live ones; None: all). One-sided connectors: each
        decode worker maps every prefill worker's pools. Two-sided: every (prefill, decode)
        pair forms a process group at a TCPStore hosted here; both ends are told, and they join
        on their next step. Workers are named by their incarnation (client.name)."""
        from ..disagg.connectors import get_connector_class
        live = [w for w in self.workers.values() if w.alive or (new and w.spec.name in new)]
        prefill = [w for w in live if w.spec.role == "prefill"]
        decode = [w for w in live if w.spec.role == "decode"]
        if not prefill or not decode:
            return
        wanted = lambda p, d: new is None or p.spec.name in new or d.spec.name in new  # noqa: E731
        cls = get_connector_class(decode[0].spec.config.kv_connector)
        self.core.two_sided = cls.two_sided
        plan: dict[str, list] = {}
        if not cls.two_sided:
            ray_gpus = [w.spec.name for w in live
                        if w.spec.config.executor_backend == "ray" and w.spec.config.is_cuda]
            if ray_gpus:   # (its device indices: each worker numbers the GPUs Ray gave it)
                raise ValueError(f"the {cls.name!r} KV connector names the producer's GPU by its "
                                 f"index, and under Ray each worker numbers its own GPUs "
                                 f"({', '.join(ray_gpus)}); use nccl")
            for p, d in ((p, d) for p in prefill for d in decode if wanted(p, d)):
                if len(set(p.client.nodes + d.client.nodes)) > 1:
                    raise ValueError(
                        f"the {cls.name!r} KV connector works within one host, and "
                        f"{p.spec.name} and {d.spec.name} run on different nodes "
                        f"({_nodes(p)} / {_nodes(d)}); use a two-sided one (torch-dist on "
                        "CPU, nccl on CUDA)")
            for d in decode:
                peers = [p.client.info.kv_export for p in prefill if wanted(p, d)]
                if peers:
                    plan[d.spec.name] = peers
        else:
            import datetime

            import torch.distributed as dist
            if self._store is None:  # port 0: the store picks a free one
                self._store_host = self._address()
                self._store = dist.TCPStore(self._store_host, 0, is_master=True,
                                            wait_for_workers=False,
                                            timeout=datetime.timedelta(seconds=120))
            store = f"{self._store_host}:{self._store.port}"
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

    def _address(self) -> str:
        """Where this process is reached by its workers (loopback, unless Ray placed them)."""
        if self._on_ray:
            from ..worker.ray_launch import ray_address
            return ray_address()
        return "127.0.0.1"

    # ---- carrying out the core's actions -----------------------------------------------------
    def _run(self, actions: list, results: list[RequestOutput], rejected: dict | None = None,
             raise_if_none_left: bool = True) -> None:
        """Carry out actions in order; what an action leads to (a Send's answer when it waits
        for it, a worker found dead) is carried out before the next one."""
        todo = deque(actions)
        while todo:
            a = todo.popleft()
            more = self._do(a, results, rejected, raise_if_none_left)
            todo.extendleft(reversed(more))
        self._settle()

    def _do(self, a, results, rejected, raise_if_none_left) -> list:
        if isinstance(a, act.Deliver):
            results.append(a.output)
            return []
        if isinstance(a, act.Reject):
            if a.request_id in self._awaiting:   # (submitted: its answer, whoever placed it)
                self._rejected[a.request_id] = a.error
                self._unsettled = True
            elif rejected is not None:
                rejected[a.request_id] = a.error
            return []
        w = self.workers[a.worker]
        if not w.alive:  # found dead by an earlier action: the core has moved its work on
            return []
        if isinstance(a, act.Send):
            try:
                # (add_requests passes `rejected` and waits for its answers; submit, step and
                # abort do not, once pipelined)
                if self.pipelined and rejected is None:
                    try:  # (the answer comes with a later step: _take_answers)
                        w.client.submit_requests(a.requests)
                        self._sent[a.worker].append(a.batch)
                        return []
                    except ValueError:  # the batch does not encode: below, each alone, once
                        # the worker's earlier sends are answered (the core takes a worker's
                        # answers in the order it admitted them: two-sided KV sends follow it)
                        self._await_answers(w, results)
                try:
                    errors = w.client.add_requests(a.requests)
                except ValueError:  # the batch does not encode: each alone, only the bad fails
                    errors = [self._add_one(w, r) for r in a.requests]
            except EngineDeadError as e:
                return self._worker_died(w, e, raise_if_none_left)
            self._unsettled = True
            return self.core.accepted(a.batch, errors)
        if isinstance(a, act.Abort):
            w.client.abort_request(a.request_ids)
        elif isinstance(a, act.Release):
            w.client.release_kv(a.request_ids)
        elif isinstance(a, act.SendKV):
            w.client.send_kv(a.sends)
        elif isinstance(a, act.DropPeer):
            w.client.drop_kv_peer(a.peer)
        else:
            raise TypeError(f"unknown router action {a!r}")
        return []

    @staticmethod
    def _add_one(w: Worker, req: AddRequest) -> str | None:
        try:
            return w.client.add_requests([req])[0]
        except ValueError as e:
            return str(e)

    def _observe(self, w: Worker) -> None:
        self.core.observe(w.spec.name, w.client.stats, w.client.take_step_records())

    # ---- requests ---------------------------------------------------------------------------
    def add_requests(self, requests: list[AddRequest]) -> list[str | None]:
        """Routes each request; returns, per request, None or why it was rejected. A worker
        found dead while sending leaves routing and its share is routed again."""
        return self._add(requests, wait=True)

    def submit(self, requests: list[AddRequest]) -> list[str | None]:
        """add_requests without waiting for the workers' answers: per request, why it was
        rejected at once, or None: sent, and its answer (None: admitted, or why a worker
        rejected it) comes from take_answers() after a later step(), which returns as soon as
        it has one. From the first call on, hand-offs to decode workers do not wait either."""
        self.pipelined = True
        return self._add(requests, wait=False)

    def _add(self, requests: list[AddRequest], wait: bool) -> list[str | None]:
        self._check_open()
        errors: list[str | None] = [None] * len(requests)
        now = time.monotonic()
        todo: list[tuple[int, AddRequest, str | None]] = []
        ids = set()
        for i, r in enumerate(requests):
            try:
                if self.core.has_request(r.request_id) or r.request_id in ids:
                    raise ValueError(f"request id {r.request_id!r} is already in use")
                if not isinstance(r.params, SamplingParams):
                    raise ValueError("sampling params must be a SamplingParams")
                text, tokens = parse_prompt(r.prompt, self.tokenizer, self.info.vocab_size)
                todo.append((i, dataclasses.replace(r, prompt={"prompt_token_ids": tokens},
                                                    arrival_time=r.arrival_time or now), text))
                ids.add(r.request_id)
            except ValueError as e:
                errors[i] = str(e)
            except Exception as e:  # noqa: BLE001 - whatever a request carries (a tokenizer's
                # TypeError on a lone surrogate...) is that request's error, never the router's
                errors[i] = f"the prompt cannot be processed: {type(e).__name__}: {e}"
        if not todo:
            return errors
        for w in self.workers.values():
            if w.alive:
                self._observe(w)
        rejected: dict[str, str] | None = {} if wait else None
        if not wait:
            self._awaiting.update(r.request_id for _, r, _ in todo)
        # (found dead while adding: its requests' final outputs go out with the next step's)
        self._run(self.core.add([(r, text) for _, r, text in todo]), self._orphans, rejected,
                  raise_if_none_left=False)
        for i, r, _ in todo:
            if wait:
                errors[i] = rejected.get(r.request_id)
            elif self._answers.get(r.request_id) is not None:   # rejected at once (no worker
                errors[i] = self._answers.pop(r.request_id)      # left...): said here
        return errors

    def take_answers(self) -> dict[str, str | None]:
        """The answers to submitted requests known since the last call: None (admitted) or
        why it was rejected (an Unavailable when no worker could take it)."""
        out, self._answers = self._answers, {}
        return out

    def _take_answers(self, w: Worker, results: list[RequestOutput]) -> None:
        """w's answers to Sends that did not wait, in order (each to the oldest unanswered)."""
        for errors in w.client.take_answers():
            self._unsettled = True
            self._run(self.core.accepted(self._sent[w.spec.name].popleft(), errors), results)

    def _await_answers(self, w: Worker, results: list[RequestOutput]) -> None:
        """Waits until w has answered every Send that did not wait (what it reports meanwhile
        is carried out as step() would)."""
        while self._sent[w.spec.name]:
            for out in w.client.step(None):
                self._run(self.core.output(w.spec.name, out), results)
            self._take_answers(w, results)
        self._on_loads(w, results)

    def _settle(self) -> None:
        """Submitted requests whose fate is known now (after an answer or a rejection, from
        whatever carried it out): admitted (a route of the core) or rejected; an admitted one
        aborted while it waited is aborted now."""
        if not self._unsettled:
            return
        self._unsettled = False
        for rid in [r for r in self._awaiting if r in self._rejected or r in self.core.routes]:
            self._awaiting.discard(rid)
            self._answers[rid] = self._rejected.pop(rid, None)
            if rid in self._abort_when_admitted:
                self._abort_when_admitted.discard(rid)
                self._run(self.core.abort([rid]), self._orphans)

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._abort_when_admitted.update(i for i in ids if i in self._awaiting)
        self._run(self.core.abort(ids), self._orphans)

    def has_unfinished_requests(self) -> bool:
        return bool(self.core.routes or self._orphans or self._awaiting)

    # ---- progress ---------------------------------------------------------------------------
    def step(self, timeout_s: float | None = None, wakeup_fd: int | None = None
             ) -> list[RequestOutput]:
        """Outputs of whatever the workers reported next (blocks until something, timeout_s or
        wakeup_fd readable: then []; an answer to a submitted request is something: take_answers
        has it). With nothing in flight it returns at once, unless timeout_s is given: then it
        waits as long, noticing idle workers' deaths and restarts meanwhile."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            outs = self._collect()
            if outs or self._answers or (not self.has_unfinished_requests() and deadline is None):
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
        for name, w in list(self.workers.items()):
            if not w.alive:
                continue
            try:
                self._drain(w, results)
                self._observe(w)
            except EngineDeadError as e:
                self._run(self._worker_died(w, e), results)
        if self.core.handoffs:
            self._flush_handoffs(results)
        return results

    def _flush_handoffs(self, results: list[RequestOutput]) -> None:
        """Send the prefilled requests on to their decode workers: one message per decode worker
        per collect, and its answer (the worker gives it between two of its steps): waited for
        here, unless pipelined (submit): then it comes with a later step."""
        exited = [n for n, w in self.workers.items() if w.alive and w.client.exited()]
        self._run(self.core.flush_handoffs(exited), results)

    def _drain(self, w: Worker, results: list[RequestOutput]) -> None:
        """What w has reported, in the order it came (outputs, answers to sends that did not
        wait, each before what came after it), then the KV loads those outputs carried."""
        for _ in range(1000):
            if not w.client.readable():
                break
            for out in w.client.step(0):
                self._run(self.core.output(w.spec.name, out), results)
            self._take_answers(w, results)
        self._on_loads(w, results)

    def _on_loads(self, d: Worker, results: list[RequestOutput]) -> None:
        events = d.client.take_kv_events()
        if events:
            self._run(self.core.loads_done(events, d.spec.name), results)

    # ---- faults and restarts ----------------------------------------------------------------
    def _worker_died(self, w: Worker, error: Exception, raise_if_none_left: bool = True) -> list:
        """Removes w from routing (the core decides what becomes of its requests: the actions
        returned) and schedules its restart. Raises EngineDeadError once no worker is left and
        none will come back."""
        if not w.alive:
            return []
        w.error = str(error)
        self._sent[w.spec.name].clear()   # (the core places those sends' requests again)
        actions = self.core.worker_died(w.spec.name, str(error))
        w.client.shutdown(1.0)
        self._schedule_restart(w)
        if not self.core.live() and raise_if_none_left and not self._restarting():
            raise EngineDeadError(f"every worker is gone (last: {w.spec.name}: {error})")
        return actions

    def _schedule_restart(self, w: Worker) -> None:
        now = time.monotonic()
        if now - w.started >= self.restart.stable_s:
            w.attempts = 0
        if self.core.closed or w.attempts >= self.restart.max_restarts:
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
            if w.alive or self.core.closed:
                continue
            if w.starting is None and w.restart_at is not None and now >= w.restart_at:
                w.restart_at = None
                w.generation += 1
                w.starting = Starting(w.spec, f"{w.spec.name}.{w.generation}",
                                      self.startup_timeout_s)
            elif w.starting is not None and w.starting.done.is_set():
                st, w.starting = w.starting, None
                if st.error is not None:
                    w.error = f"restart failed: {type(st.error).__name__}: {st.error}"
                    w.started = now
                    self._schedule_restart(w)
                else:
                    self._adopt(w, st.client)

    def _adopt(self, w: Worker, client: EngineClient) -> None:
        """A restarted worker joins: its KV peers are connected, then it is routed to."""
        w.client, w.started = client, time.monotonic()
        try:
            self._connect_kv({w.spec.name})
        except Exception as e:  # noqa: BLE001 - (ValueError, EngineDeadError...): another attempt
            w.error = f"restarted, but its KV peers could not be connected: {e}"
            client.shutdown(1.0)
            self._schedule_restart(w)
            return
        self.core.worker_up(w.spec.name, client.name)
        w.restarts += 1

    def _summary(self) -> str:
        return ", ".join(f"{w.spec.name} {w.state}" for w in self.workers.values())

    def health(self) -> list[WorkerHealth]:
        """Every worker's state (the server's /health and metrics)."""
        return [w.health() for w in self.workers.values()]

    # ---- lifecycle --------------------------------------------------------------------------
    def check_workers(self) -> dict[str, WorkerStats]:
        """Every live worker's invariants (AssertionError naming the worker); their stats."""
        out = {}
        # decode workers first: pull reports that arrive meanwhile release prefill-side KV
        # before the prefill workers are checked
        for name, w in sorted(self.workers.items(), key=lambda kv: kv[1].spec.role != "decode"):
            for d in self.workers.values():
                if d.alive:
                    try:
                        self._drain(d, self._orphans)
                    except EngineDeadError as e:
                        self._run(self._worker_died(d, e), self._orphans)
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

    def reset_prefix_cache(self) -> int:
        """Every live worker drops its cached prefixes no request uses; the blocks freed. The
        router's prefix index forgets every worker's entries."""
        self.core.reset_prefix_index()
        return sum(w.client.reset_prefix_cache() for w in self.workers.values() if w.alive)

    @property
    def pids(self) -> list[int]:
        return [pid for w in self.workers.values() for pid in w.client.pids]

    def worker_ranks(self) -> dict[str, list[dict]]:
        """Each worker's ranks (EngineClient.ranks): a pid means a process on that rank's node,
        which under Ray may be another machine."""
        return {name: w.client.ranks for name, w in self.workers.items()}

    def _check_open(self) -> None:
        if self.core.closed:
            raise EngineDeadError("the router was shut down")

    def drain(self, timeout_s: float = 60.0) -> list[RequestOutput]:
        """No more requests: finish the ones in flight, then stop every worker."""
        collected = []
        deadline = time.monotonic() + timeout_s
        while self.has_unfinished_requests() and time.monotonic() < deadline:
            self._answers.clear()   # (no one takes answers while draining: step would return)
            try:
                collected += self.step(timeout_s=max(0.0, deadline - time.monotonic()))
            except EngineDeadError:
                break
        self.shutdown(max(1.0, deadline - time.monotonic()))
        return collected

    def shutdown(self, timeout_s: float = 30.0) -> None:
        if self.core.closed:
            return
        self.core.close()
        # (submitted requests not answered yet: nobody will answer them now)
        for state in (self._awaiting, self._abort_when_admitted, self._rejected, self._answers):
            state.clear()
        for sent in self._sent.values():
            sent.clear()
        abandon_all([w.starting for w in self.workers.values() if w.starting is not None])
        for w in self.workers.values():
            w.starting, w.restart_at = None, None
        # decode workers first: they may still be reading the prefill workers' pools
        order = sorted(self.workers.values(), key=lambda w: w.spec.role != "decode")
        for w in order:
            w.client.shutdown(timeout_s)
        self._store = None  # the TCPStore's server stops with its last reference

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
