"""A deployment's workers as the router shell holds them: the plan (WorkerSpec, plan_workers),
how a dead worker is brought back (RestartPolicy, a start in a background thread) and each
worker slot's restart state, reported by health():

    up ──dies──> dead ──back-off──> restarting ──Ready──> up   (a new client, a new KV name)
                  │                     └──fails──> dead (next attempt, longer back-off)
                  └── attempts used up ──> failed (stays out of routing)
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass

from ..checks import check_int, check_number
from ..config import EngineConfig
from ..worker.client import EngineClient
from .router_core import WorkerSlot


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
    # CPU: torch threads of each of its ranks (None: the worker's own default, see worker_main)
    cpu_threads: int | None = None


def plan_workers(base: EngineConfig, prefill: int = 0, decode: int = 0, collocated: int = 0,
                 prefill_tp: int | None = None, decode_tp: int | None = None,
                 collocated_tp: int | None = None, kv_connector: str = "shared",
                 num_gpus: int | None = None) -> list[WorkerSpec]:
    """Worker specs for a deployment: each its own TP group; on CUDA consecutive GPUs from the
    base device (prefill workers first, then decode, then collocated), wrapping around to the
    first when num_gpus is given and used up (workers then share GPUs: split their memory with
    gpu_memory_utilization). On CPU the ranks of all
    the workers share the host's cores: each gets an equal share of threads (torch's default,
    one thread per core in every rank, oversubscribes the cores as soon as two workers run,
    and their OpenMP threads then spin waiting for descheduled peers)."""
    for name, v in (("prefill", prefill), ("decode", decode), ("collocated", collocated)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"number of {name} workers must be a non-negative integer, got {v!r}")
    if prefill + decode + collocated == 0:
        raise ValueError("a deployment needs at least one worker")
    if (prefill == 0) != (decode == 0):
        raise ValueError("prefill and decode workers come together (--prefill N --decode M)")
    specs = []
    ray = base.executor_backend == "ray"
    if ray and num_gpus is not None:
        raise ValueError("num_gpus places workers on this host's GPUs; under Ray, Ray places "
                         "them (one GPU per rank)")
    dev = base.torch_device
    ranks = sum(n * (t or base.tensor_parallel_size) for n, t in
                ((prefill, prefill_tp), (decode, decode_tp), (collocated, collocated_tp)))
    cpu_threads = None
    if dev.type == "cpu" and ranks > 1 and not ray:   # (under Ray: its nodes' cores, not ours)
        cpu_threads = max(1, len(os.sched_getaffinity(0)) // ranks)
    if num_gpus is not None:
        if not isinstance(num_gpus, int) or isinstance(num_gpus, bool) or num_gpus < 1:
            raise ValueError(f"num_gpus must be a positive integer, got {num_gpus!r}")
        widest = max(t or base.tensor_parallel_size for n, t in
                     ((prefill, prefill_tp), (decode, decode_tp), (collocated, collocated_tp)) if n)
        if widest > num_gpus:
            raise ValueError(f"a worker of TP {widest} needs {widest} GPUs, num_gpus is {num_gpus}")
    first, used = dev.index or 0, 0
    for role, count, tp in (("prefill", prefill, prefill_tp), ("decode", decode, decode_tp),
                            ("collocated", collocated, collocated_tp)):
        tp = tp or base.tensor_parallel_size
        for i in range(count):
            device = base.device
            if dev.type == "cuda" and not ray:   # (Ray assigns GPUs per rank)
                if num_gpus is not None and used + tp > num_gpus:
                    used = 0   # wrap around: this worker shares GPUs with the first ones
                device = f"cuda:{first + used}"
                used += tp
            cfg = dataclasses.replace(
                base, device=device, tensor_parallel_size=tp,
                distributed_executor_backend="ray" if ray else "mp",
                kv_connector=kv_connector if role != "collocated" else None)
            specs.append(WorkerSpec(f"{role}-{i}", role, cfg, cpu_threads))
    return specs


@dataclass(frozen=True)
class WorkerHealth:
    name: str
    role: str
    state: str                    # up | dead (waiting to restart) | restarting | failed
    restarts: int                 # successful restarts so far
    error: str | None             # why it last died (or why its restart failed)


class Starting:
    """A worker starting in a daemon thread, so that the router keeps serving meanwhile.
    abandon() calls the start off: the thread's EngineClient stops waiting (for a placement,
    for Ready) within a fraction of a second, stops the ranks it started and gives back what
    it placed; a start that completes anyway is shut down."""

    def __init__(self, spec: WorkerSpec, name: str, timeout_s: float):
        self.client: EngineClient | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        threading.Thread(target=self._run, args=(spec, name, timeout_s), daemon=True,
                         name=f"pdserve-start-{name}").start()

    def _run(self, spec: WorkerSpec, name: str, timeout_s: float) -> None:
        try:
            client = EngineClient(spec.config, timeout_s, name, spec.cpu_threads,
                                  cancel=self._cancel)
        except BaseException as e:  # noqa: BLE001 - the router reads it as a failed attempt
            self.error = e
        else:
            with self._lock:
                abandoned = self._cancel.is_set()
                if not abandoned:
                    self.client = client
            if abandoned:              # (completed after it was called off: not kept)
                client.shutdown(5.0)
        self.done.set()

    def abandon(self, wait_s: float = 10.0) -> None:
        """Calls the start off and waits up to wait_s for its thread to have cleaned up (a
        start still in a step that does not look at the cancel, such as loading a tokenizer,
        cleans up once that step is over)."""
        abandon_all([self], wait_s)

    def _call_off(self) -> None:
        with self._lock:
            self._cancel.set()
            client, self.client = self.client, None
        if client is not None:
            client.shutdown(5.0)


def abandon_all(starts: list[Starting], wait_s: float = 10.0) -> None:
    """Calls every start off, then waits for them all together, up to wait_s in all (not
    wait_s each: a shutdown with several workers restarting waits for the slowest)."""
    for st in starts:
        st._call_off()
    deadline = time.monotonic() + wait_s
    for st in starts:
        st.done.wait(max(0.0, deadline - time.monotonic()))


class Worker:
    """One worker slot of the deployment: its spec, the client of its current incarnation (a
    restart makes a new one, named spec.name.N so that KV peers never mistake it for the
    dead one) and the restart state. Liveness and load are the router core's (`slot`)."""

    def __init__(self, spec: WorkerSpec, client: EngineClient, slot: WorkerSlot):
        self.spec, self.client, self.slot = spec, client, slot
        self.started = time.monotonic()
        self.generation = 0
        self.attempts = 0             # restarts in a row without a stable run
        self.restarts = 0
        self.restart_at: float | None = None   # dead: when the next attempt starts
        self.starting: Starting | None = None  # an attempt in progress
        self.error: str | None = None

    @property
    def alive(self) -> bool:
        return self.slot.alive

    @property
    def outstanding(self) -> int:
        return self.slot.outstanding

    @property
    def state(self) -> str:
        if self.alive:
            return "up"
        if self.starting is not None:
            return "restarting"
        return "dead" if self.restart_at is not None else "failed"

    def health(self) -> WorkerHealth:
        return WorkerHealth(self.spec.name, self.spec.role, self.state, self.restarts, self.error)
