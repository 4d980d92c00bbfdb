"""RayLauncher: a worker's ranks on a Ray cluster (distributed_executor_backend="ray").

    client ── placement group: one bundle per rank (CPU: cpu_threads CPUs; CUDA: one GPU),
      │       strategy EngineConfig.ray_placement_strategy (STRICT_PACK: the TP group on one node)
      ├── _RankActor per bundle ── site(): its node, node address, GPU ids
      └── start: actor.run(config, rank) ── `python -m pdserve.worker.worker CONFIG RANK`, the
              same rank program as a local worker's, a child of the actor on the actor's node;
              run() returns its exit status

Ray owns placement and lifetime: it ends the actors when the client's process (their owner) ends,
and a rank watches its parent, the actor, so it goes too. A rank's files (its config, KV pool
files) are in a directory of its own on its node (rank_dir()): its actor removes it when the rank
ends; an actor killed with its rank (ray.kill, the client's end, a crash: Ray SIGKILLs both) leaves
it, and the next actor placed on that node removes it (sweep_rank_dirs()). A rank the client can no longer reach
(its actor died, its node was lost) counts as exited: a thread per rank waits on run()'s result
and makes the rank's sentinel readable, which the client treats like any rank's exit (the worker
is dead; a router restarts it wherever Ray can place it then).

The cluster: the one this process is connected to, else `ray.init()`'s (RAY_ADDRESS, the latest
`ray start` on this machine, else a local one started for this process).
"""
from __future__ import annotations

import atexit
import dataclasses
import fcntl
import glob
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref

from ..config import EngineConfig
from .launch import (RankHandle, RankLauncher, RankSite, StartCancelled, free_port,
                     rank_command)

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError:  # the backend is refused by name until ray is installed
    ray = None

_WATCH_S = 0.25   # how long a wait on Ray lasts at a time (a stop or a cancel waits this long)
_START_S = 60.0   # how long an actor may take to start its rank's process
_PLACE_NOTICE_S = 30.0  # how often a placement that waits says so


def ray_address() -> str:
    """This process's address on the cluster (where ranks reach the client and the router)."""
    return ray.util.get_node_ip_address()


_WATCHERS: "weakref.WeakSet[RayRank]" = weakref.WeakSet()
_AT_EXIT = []


def connect() -> None:
    """Join the cluster (see the module docstring) unless this process already has."""
    if ray is None:
        raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install "
                         "'ray>=2.40,<3' (or pdserve[ray])")
    if not ray.is_initialized():
        try:
            ray.init()
        except ConnectionError as e:
            raise RuntimeError(
                f"could not join the Ray cluster: {e} (a cluster made by `ray start` with Ray "
                ">= 2.59 checks a token: set RAY_AUTH_MODE=token, with the cluster's token in "
                "~/.ray/auth_token or RAY_AUTH_TOKEN)") from e
    if not _AT_EXIT:
        # Registered after ray.init's own exit hook, so it runs first: watcher threads must not
        # be inside a Ray call while Ray's core worker is torn down (it crashes the process).
        _AT_EXIT.append(atexit.register(_stop_watchers))


def _wait(refs: list, timeout_s: float, cancel: threading.Event | None) -> bool:
    """Waits for every ref in refs: True once they are all ready, False after timeout_s;
    StartCancelled once `cancel` is set (looked at every _WATCH_S)."""
    deadline = time.monotonic() + timeout_s
    while not (cancel is not None and cancel.is_set()):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if len(ray.wait(refs, num_returns=len(refs), timeout=min(_WATCH_S, left))[0]) == \
                len(refs):
            return True
    raise StartCancelled("the worker's start was called off")


_RANK_DIR_PREFIX = "pdserve-ray-rankdir-"


def rank_dir() -> tuple[str, int]:
    """A new directory for one rank's files (in the temporary directory) and a descriptor that
    holds an exclusive flock on it: the actor holds it and the rank inherits it, so the lock
    is free once both are gone, however they ended (the kernel drops a dead process's locks)."""
    while True:
        path = tempfile.mkdtemp(prefix=_RANK_DIR_PREFIX)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX)   # (waits only while a sweep that came first runs)
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return path, fd
        except FileNotFoundError:
            pass
        os.close(fd)                     # swept before it was locked: take another


def sweep_rank_dirs() -> list[str]:
    """Removes the rank directories here whose lock nobody holds (their actor and rank are
    gone without removing them); returns them."""
    removed = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), _RANK_DIR_PREFIX + "*")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid == os.getuid():
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(path, ignore_errors=True)   # (under the lock: see rank_dir)
                removed.append(path)
        except OSError:
            pass                         # held: its actor or rank lives
        finally:
            os.close(fd)
    return removed


def _stop_watchers() -> None:
    for r in list(_WATCHERS):
        r.stop_watching()


def _quietly(call) -> None:
    """A Ray call on the way out: the actor, its node or the cluster may be gone already."""
    if ray.is_initialized():
        try:
            call()
        except Exception:  # noqa: BLE001 - (see above) nothing left to stop
            pass


class _RankActor:
    """Stands for the client on a rank's node: reports where it is, then runs the rank as its
    child process. Threaded (max_concurrency), so terminate() reaches it while run() waits."""

    def __init__(self):
        sweep_rank_dirs()                  # what killed ranks left on this node
        self.popen: subprocess.Popen | None = None
        self.stopped = False
        self.started = threading.Event()   # run() has started the rank (or given up)
        self.lock = threading.Lock()       # terminate() either stops the rank or comes first

    def site(self) -> tuple[str, str, list[str]]:
        return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
                [str(g) for g in ray.get_gpu_ids()])

    def rank_pid(self, timeout_s: float) -> int | None:
        """The rank process's pid, once run() has started it (None: it did not start)."""
        self.started.wait(timeout_s)
        return None if self.popen is None else self.popen.pid

    def free_port(self) -> int:
        return free_port(ray.util.get_node_ip_address())

    def run(self, config: bytes, rank: int, env: dict[str, str]) -> int:
        # the rank's parent (what it watches) is this actor; its files stay on this node, in a
        # directory that this actor and the rank hold locked while either lives
        workdir, held = rank_dir()
        try:
            wc = dataclasses.replace(pickle.loads(config), client_pid=os.getpid(),
                                     workdir=workdir)
            path = os.path.join(workdir, "worker-config.pickle")
            with open(path, "wb") as f:
                pickle.dump(wc, f)
            argv, base = rank_command(path, rank)
            with self.lock:
                if self.stopped:
                    return -15
                self.popen = subprocess.Popen(argv, env={**base, **env}, pass_fds=(held,))
            self.started.set()
            return self.popen.wait()
        finally:
            self.started.set()
            shutil.rmtree(workdir, ignore_errors=True)
            os.close(held)

    def terminate(self) -> None:
        with self.lock:
            self.stopped = True
            if self.popen is not None and self.popen.poll() is None:
                self.popen.terminate()


def _why(e: Exception) -> str:
    """Ray's error in a line: its first, and the one that says why the actor died."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    cause = next((ln for ln in lines[1:] if "died because" in ln or "node" in ln.lower()), None)
    return "; ".join(filter(None, [f"{type(e).__name__}: {lines[0] if lines else ''}", cause]))


class RayRank(RankHandle):
    """A rank run by a _RankActor. The sentinel is a pipe that a watcher thread closes the
    write end of once run() has returned or failed (the actor died, its node was lost)."""

    def __init__(self, actor, rank: int, config: bytes, env: dict[str, str],
                 cancel: threading.Event | None = None):
        self.actor, self.rank = actor, rank
        self._done = threading.Event()
        self._stop = threading.Event()
        self._code: int | None = None
        self.error: str | None = None
        ref = actor.run.remote(config, rank, env)
        pid = actor.rank_pid.remote(_START_S)
        if not _wait([pid], 2 * _START_S, cancel):
            raise RuntimeError(f"the actor of rank {rank} did not start it within "
                               f"{2 * _START_S:g} s")
        self.pid = ray.get(pid)
        self.sentinel, self._w = os.pipe()
        self._thread = threading.Thread(target=self._watch, args=(ref,), daemon=True,
                                        name=f"pdserve-ray-rank-{rank}")
        _WATCHERS.add(self)
        self._thread.start()

    def _watch(self, ref) -> None:
        try:
            while not self._stop.is_set():  # (a short wait: stop_watching() ends it)
                if ray.wait([ref], timeout=_WATCH_S)[0]:
                    self._code = ray.get(ref)
                    break
            else:
                self._code, self.error = 1, "no longer watched (this process is exiting)"
        except Exception as e:  # noqa: BLE001 - whatever Ray says (actor died, node lost, ...):
            self._code, self.error = 1, _why(e)  # the rank is gone
        self._done.set()
        os.close(self._w)       # the sentinel's read end turns readable (end of file)

    def stop_watching(self) -> None:
        self._stop.set()
        self._thread.join(2 * _WATCH_S)

    def is_alive(self) -> bool:
        return not self._done.is_set()

    @property
    def exitcode(self) -> int | None:
        return self._code if self._done.is_set() else None

    def join(self, timeout_s: float) -> None:
        self._done.wait(timeout_s)

    def terminate(self) -> None:
        if not self._done.is_set():
            _quietly(lambda: self.actor.terminate.remote())

    def kill(self) -> None:
        _quietly(lambda: ray.kill(self.actor))

    def close(self) -> None:
        self.stop_watching()
        os.close(self.sentinel)


def rank_sites(found: list[tuple[str, str, list[str]]], cuda: bool) -> list[RankSite]:
    """Each rank's site from what its actor reported: (node id, node address, the GPU ids Ray
    gave it). CUDA: a rank sees every GPU its worker holds on its node, in id order (NCCL and
    the one-shot all-reduce want the peers on a node visible to each other), and takes its own
    by index among them:

        node A: rank 0 got GPU 3, rank 1 got GPU 1  ->  both CUDA_VISIBLE_DEVICES=1,3;
                                                        rank 0 cuda:1, rank 1 cuda:0
    """
    if not cuda:
        return [RankSite(node, address) for node, address, _ in found]
    held: dict[str, set[str]] = {}
    for node, _, ids in found:
        held.setdefault(node, set()).update(ids)
    sites = []
    for node, address, ids in found:
        if len(ids) != 1:
            raise RuntimeError(f"a CUDA rank on node {node} was given GPUs {ids}, not one")
        mine = sorted(held[node], key=lambda g: (len(g), g))   # numeric order of the ids
        sites.append(RankSite(node, address, f"cuda:{mine.index(ids[0])}",
                              (("CUDA_VISIBLE_DEVICES", ",".join(mine)),)))
    return sites


class RayLauncher(RankLauncher):
    """A worker's ranks on the Ray cluster (see the module docstring): place() reserves a
    placement group and starts an actor per bundle, start() runs each rank under its actor,
    close() kills the actors and removes the group."""

    def __init__(self, config: EngineConfig, cpu_threads: int | None = None,
                 place_timeout_s: float = 900.0):
        connect()
        self.config = config
        # CPU: the CPUs a rank's bundle reserves, and its torch threads (one unless given: this
        # host's cores say nothing of the nodes')
        self.cpu_threads = None if config.is_cuda else cpu_threads or 1
        self.place_timeout_s = place_timeout_s
        self.pg = None
        self.actors: list = []
        self.sites: list[RankSite] = []

    def _bundle(self) -> dict[str, float]:
        if self.config.is_cuda:
            return {"GPU": 1, "CPU": 1}
        return {"CPU": self.cpu_threads}

    def place(self, tp: int, name: str) -> list[RankSite]:
        bundle = self._bundle()
        self.pg = placement_group([bundle] * tp, strategy=self.config.ray_placement_strategy,
                                  name=f"pdserve-{name}-{uuid.uuid4().hex[:8]}")
        what = (f"{tp} rank(s) of {bundle} ({self.config.ray_placement_strategy}) for worker "
                f"{name}")
        ready, waited = self.pg.ready(), 0.0
        while True:   # (Ray keeps a placement it cannot make pending: say so while waiting)
            step = min(_PLACE_NOTICE_S, self.place_timeout_s - waited)
            if _wait([ready], step, self.cancel):   # (called off: close() removes the group)
                break
            waited += step
            if waited >= self.place_timeout_s:
                raise RuntimeError(
                    f"Ray could not place {what} within {self.place_timeout_s:g} s; the cluster "
                    f"has {ray.available_resources()} available")
            print(f"pdserve: waiting {waited:.0f} s so far for Ray to place {what}; the cluster "
                  f"has {ray.available_resources()} available", file=sys.stderr, flush=True)
        ray.get(ready)
        cls = ray.remote(_RankActor)
        self.actors = [cls.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_concurrency=4,
            max_restarts=0, name=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=r)).remote() for r in range(tp)]
        found = [a.site.remote() for a in self.actors]
        if not _wait(found, _START_S, self.cancel):
            raise RuntimeError(f"the actors Ray placed for {what} did not start within "
                               f"{_START_S:g} s")
        self.sites = rank_sites(ray.get(found), self.config.is_cuda)
        return self.sites

    def client_address(self) -> str:
        return ray_address()

    def endpoint(self, address: str, name: str) -> str:
        return f"tcp://{address}:*"

    def rendezvous(self) -> str:
        port = ray.get(self.actors[0].free_port.remote(), timeout=_START_S)
        return f"tcp://{self.sites[0].address}:{port}"

    def start(self, config: bytes) -> list[RankHandle]:
        ranks: list[RankHandle] = []
        try:
            for r, (a, s) in enumerate(zip(self.actors, self.sites)):
                ranks.append(RayRank(a, r, config, dict(s.env), self.cancel))
        except BaseException:   # (the client holds none of them yet: stop the ones started)
            for h in ranks:
                h.kill()
                h.close()
            raise
        return ranks

    def close(self) -> None:
        for a in self.actors:
            _quietly(lambda: ray.kill(a))
        self.actors = []
        if self.pg is not None:
            pg, self.pg = self.pg, None
            _quietly(lambda: remove_placement_group(pg))
