"""How a worker's ranks are started and watched: the RankLauncher contract, and the local one.

    EngineClient ──place(tp)──> RankLauncher ──> [RankSite per rank]   where each rank will run
                 (binds its sockets where the sites can reach them, writes the WorkerConfig)
                 ──start(config)──> [RankHandle per rank]                one process per rank

A RankHandle is what the client watches: `sentinel` is a file descriptor that turns readable
once the rank's process has ended (the client polls it beside its output socket), `is_alive()`
and `exitcode` say the same synchronously, `terminate()` / `kill()` stop it. Launchers:

  ProcessLauncher  child processes of the client, on this host (the "mp" backend): ipc://
                   channels, a loopback rendezvous, a pidfd per rank.
  RayLauncher      ray_launch.py (the "ray" backend): each rank a Ray actor placed by a
                   placement group, possibly on another node; tcp:// channels on node addresses.

Either way the rank itself is the same program, `python -m pdserve.worker.worker CONFIG RANK`,
and it watches its parent process (WorkerConfig.client_pid): the client, or the Ray actor that
stands for the client on the rank's node (Ray ends an actor with its owner).
"""
from __future__ import annotations

import abc
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import EngineConfig


@dataclass(frozen=True)
class RankSite:
    """Where one rank will run, known before it starts."""
    node: str                   # the node it is placed on (a host; Ray's node id under Ray)
    address: str                # an address of that node its peers can reach
    device: str | None = None   # its device, when the launcher assigns it (else the config's)
    # environment the rank's process gets on top of its launcher's (Ray: CUDA_VISIBLE_DEVICES)
    env: tuple[tuple[str, str], ...] = ()


class RankHandle(abc.ABC):
    """One rank's process, as its client sees it. `sentinel` turns readable (POLLIN) once the
    process has ended, whatever ended it, and stays so until close()."""
    rank: int
    pid: int | None             # on its own node (None: its process never started)
    sentinel: int
    error: str | None = None    # why it ended, when not by its own exit (Ray: actor or node lost)

    @abc.abstractmethod
    def is_alive(self) -> bool:
        """False once the process has ended (or can no longer be reached)."""

    @property
    @abc.abstractmethod
    def exitcode(self) -> int | None:
        """None while alive; the exit status after (negative: a signal; 1 for a rank that
        could not be reached any more, such as one on a lost node)."""

    @abc.abstractmethod
    def join(self, timeout_s: float) -> None:
        """Waits up to timeout_s for the process to end."""

    @abc.abstractmethod
    def terminate(self) -> None:
        """Asks the process to stop (SIGTERM)."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Stops it now (SIGKILL, or the launcher's equivalent)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Frees what watching it took (the sentinel); the process is ended by then."""


class StartCancelled(RuntimeError):
    """A worker's start was called off from another thread (its `cancel` event was set)."""


class RankLauncher(abc.ABC):
    """Starts one worker's ranks. place() once, then start() once; close() when the worker is
    gone (after its handles are joined). Errors: ValueError for a configuration the launcher
    cannot satisfy (it names why), RuntimeError for a place or start that failed,
    StartCancelled for one called off: a place() or start() that waits (Ray: for room, for its
    actors) looks at `cancel` at least every quarter second; close() gives back what it took."""

    #: CPU: torch threads of each rank (None: the rank's default, see worker_main)
    cpu_threads: int | None = None
    #: set by another thread to call the start off (make_launcher passes the client's)
    cancel: threading.Event | None = None

    def check_cancel(self) -> None:
        """Raises StartCancelled once `cancel` is set."""
        if self.cancel is not None and self.cancel.is_set():
            raise StartCancelled("the worker's start was called off")

    @abc.abstractmethod
    def place(self, tp: int, name: str) -> list[RankSite]:
        """Reserve room for tp ranks of worker `name`; where each will run."""

    @abc.abstractmethod
    def client_address(self) -> str:
        """An address of this (the client's) host that every placed rank can reach."""

    @abc.abstractmethod
    def endpoint(self, address: str, name: str) -> str:
        """A zmq endpoint to bind on the host reachable at `address` (the client's or a
        rank's), unique to this worker by `name`; a `*` port is picked when bound (zmq's
        LAST_ENDPOINT tells which)."""

    @abc.abstractmethod
    def rendezvous(self) -> str:
        """The TP group's torch.distributed init_method (on rank 0's node)."""

    @abc.abstractmethod
    def start(self, config: bytes) -> list[RankHandle]:
        """Start every placed rank on `config` (a pickled WorkerConfig), in rank order."""

    def close(self) -> None:
        """Give back what place() reserved."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on host right now (the usual race: free until someone else binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_id() -> str:
    """This host's kernel and pid namespace: two processes with the same id see each other's
    pids (a pid read elsewhere names nothing here, or someone else)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"


def rank_command(config_path: str, rank: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one rank's process. A fresh interpreter (not
    multiprocessing's spawn), so the caller's script needs no `if __name__ == "__main__"`
    guard; it imports this very pdserve, wherever it was imported from."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [root, os.environ.get("PYTHONPATH")])))
    return [sys.executable, "-m", "pdserve.worker.worker", config_path, str(rank)], env


class LocalRank(RankHandle):
    """A rank that is a child process of this one; `sentinel` is its pidfd."""

    def __init__(self, config_path: str, rank: int):
        self.rank = rank
        argv, env = rank_command(config_path, rank)
        self.popen = subprocess.Popen(argv, env=env)
        self.pid = self.popen.pid
        self.sentinel = os.pidfd_open(self.pid)

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout_s: float) -> None:
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()

    def close(self) -> None:
        os.close(self.sentinel)


class ProcessLauncher(RankLauncher):
    """Every rank a child process of the client, on this host (the "mp" backend)."""

    def __init__(self, workdir: str, cpu_threads: int | None = None):
        self.workdir = workdir        # the client's directory: the config file goes there
        self.cpu_threads = cpu_threads
        self.tp = 0

    def place(self, tp: int, name: str) -> list[RankSite]:
        self.tp = tp
        return [RankSite(host_id(), "127.0.0.1")] * tp

    def client_address(self) -> str:
        return "127.0.0.1"

    def endpoint(self, address: str, name: str) -> str:
        return f"ipc://{self.workdir}/{name}"

    def rendezvous(self) -> str:
        return f"tcp://127.0.0.1:{free_port()}"

    def start(self, config: bytes) -> list[RankHandle]:
        path = os.path.join(self.workdir, "worker-config.pickle")
        with open(path, "wb") as f:
            f.write(config)
        ranks: list[RankHandle] = []
        try:
            for r in range(self.tp):
                ranks.append(LocalRank(path, r))
        except BaseException:   # (the client holds none of them yet: stop the ones started)
            for h in ranks:
                h.kill()
                h.join(2.0)
                h.close()
            raise
        return ranks


def make_launcher(config: "EngineConfig", workdir: str, cpu_threads: int | None,
                  place_timeout_s: float, cancel: threading.Event) -> RankLauncher:
    """The launcher of config's executor backend ("mp" or "ray"); workdir: the client's own
    directory; cpu_threads: torch threads of each CPU rank (what Ray reserves for it); cancel:
    set by another thread to call the start off."""
    if config.executor_backend == "ray":
        from .ray_launch import RayLauncher
        launcher: RankLauncher = RayLauncher(config, cpu_threads, place_timeout_s)
    else:
        launcher = ProcessLauncher(workdir, cpu_threads)
    launcher.cancel = cancel
    return launcher
