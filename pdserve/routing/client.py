"""What drives an engine from outside its processes, as two structural types:

    EngineProtocol   the request API a front end drives: the offline LLM, the server's
                     AsyncEngine and benchmarks. Satisfied by EngineClient (one worker) and
                     Router (a deployment), so either serves any of them.
    WorkerClient     EngineProtocol plus what the router needs of each worker: its KV name,
                     what to wait on, the P/D control plane, its reports (KV loads, steps).
                     Satisfied by EngineClient; a fake one drives the router in tests.

Plain typing: nothing here is imported at run time but the types' names, so the router core
and a simulator can name these without torch or zmq.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..outputs import RequestOutput
    from ..protocol import AddRequest, KVLoadDone, KVSend, StepRecord, WorkerStats


@runtime_checkable
class EngineProtocol(Protocol):
    """Contract: add_requests answers, per request in order, None (queued) or why it was
    rejected (an Unavailable when the deployment, not the request, is at fault), and raises
    only when the engine itself is gone (EngineDeadError). step() returns outputs of requests
    still wanted (cumulative, finished once), blocking until something is reported, timeout_s
    passes or wakeup_fd is readable. abort_request ignores unknown ids. check_integrity raises
    AssertionError naming a broken invariant and returns fresh stats. drain finishes what is in
    flight, then stops; shutdown stops now; both are idempotent."""

    @property
    def tokenizer(self) -> Any: ...            # None with skip_tokenizer_init

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def num_kv_blocks(self) -> int: ...

    @property
    def info(self) -> Any: ...                 # worker.messages.WorkerInfo (of the first worker)

    @property
    def stats(self) -> WorkerStats | None: ...  # as of the last report (None before any)

    @property
    def pids(self) -> list[int]: ...

    def add_requests(self, requests: list[AddRequest]) -> list[str | None]: ...

    def abort_request(self, request_id: str | list[str]) -> None: ...

    def step(self, timeout_s: float | None = None, wakeup_fd: int | None = None
             ) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def check_integrity(self) -> WorkerStats: ...

    def num_free_blocks(self) -> int: ...

    def drain(self, timeout_s: float = 60.0) -> list[RequestOutput]: ...

    def shutdown(self, timeout_s: float = 30.0) -> None: ...

    def __enter__(self): ...

    def __exit__(self, *exc): ...


@runtime_checkable
class WorkerClient(EngineProtocol, Protocol):
    """One worker as the router drives it. `name` is the incarnation's KV name (peers address
    its pools by it). readable(): step(0) has news; pollables(): what to wait on for that;
    exited(): a process ended, noticed or not. submit_requests: add_requests without waiting;
    step() returns [] when its answer comes first, and take_answers() then has the answers,
    one list per submit in order (before any output that came after them). The P/D calls send
    no reply but connect_kv, which answers an error or None per peer."""

    @property
    def name(self) -> str: ...

    def pollables(self) -> list: ...

    def readable(self) -> bool: ...

    def exited(self) -> bool: ...

    def submit_requests(self, requests: list[AddRequest]) -> None: ...

    def take_answers(self) -> list[list[str | None]]: ...

    def connect_kv(self, peers: list) -> list[str | None]: ...

    def send_kv(self, sends: list[KVSend]) -> None: ...

    def drop_kv_peer(self, worker: str) -> None: ...

    def release_kv(self, request_ids: list[str]) -> None: ...

    def take_kv_events(self) -> list[KVLoadDone]: ...

    def take_step_records(self) -> list[StepRecord]: ...
