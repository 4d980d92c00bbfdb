"""EngineClient: starts a worker (one process per TP rank) and drives it over messages with the
same request API as an in-process LLMEngine: add_requests / abort_request / step /
has_unfinished_requests, plus drain() and shutdown().

A worker that dies is noticed at once (the client waits on the processes' sentinels together with
the output socket): the waiting call raises EngineDeadError naming the rank and its exit code,
every pending request fails with it, and the surviving ranks are stopped (they would otherwise
wait forever in a collective with the dead one).
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque

import msgspec
import zmq

from ..config import EngineConfig
from ..protocol import AddRequest
from ..loader.model_loader import engine_tokenizer, resolve_source
from ..models.config import ModelConfig
from ..outputs import RequestOutput
from . import messages as m
from .launch import RankHandle, RankLauncher, StartCancelled, make_launcher
from .output_delta import DeltaDecoder
from .worker import WorkerAddresses, WorkerConfig, channel


STEP_RECORDS_KEPT = 1024
_CANCEL_POLL_S = 0.1   # a start waiting for Ready looks at its `cancel` this often


class EngineDeadError(RuntimeError):
    """The worker behind this client is gone; requests in flight are lost."""


class _Answer:
    """The worker's answer to a submitted add, queued where it arrived among the outputs."""
    __slots__ = ("errors",)

    def __init__(self, errors: list[str | None]):
        self.errors = errors


def _stop_processes(procs: list[RankHandle], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)


def _cleanup(ctx: zmq.Context, procs: list[RankHandle], tmpdir: str,
             launcher: RankLauncher) -> None:
    _stop_processes(procs, 0.0)
    for p in procs:
        p.close()
    launcher.close()
    ctx.destroy(linger=0)
    shutil.rmtree(tmpdir, ignore_errors=True)


class EngineClient:
    def __init__(self, config: EngineConfig, startup_timeout_s: float = 900.0,
                 name: str = "worker", cpu_threads: int | None = None,
                 cancel: threading.Event | None = None):
        """cpu_threads: on CPU, torch threads per rank (None: the worker's default); a router
        running several workers on one host gives each its share of the cores. cancel: set
        by another thread to call the start off: this constructor then raises StartCancelled
        within a fraction of a second of its next wait (for placement, for Ready), having
        stopped what it started and given back what it placed."""
        source = resolve_source(config.model)
        tp = config.tensor_parallel_size
        ModelConfig.from_hf(source.hf_config).check_tensor_parallel(tp)
        if config.is_cuda and config.executor_backend != "ray":  # (Ray: GPUs of its nodes)
            import torch
            first = config.torch_device.index or 0
            if first + tp > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size {tp} from cuda:{first} needs "
                                 f"{first + tp} GPUs; {torch.cuda.device_count()} visible")
        self.config = config
        self.tokenizer = engine_tokenizer(config, source)
        self._tmp = tempfile.mkdtemp(prefix="pdserve-worker-")
        self._cancel = cancel
        try:
            launcher = make_launcher(config, self._tmp, cpu_threads, startup_timeout_s,
                                     cancel)
        except BaseException:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        self._ctx = zmq.Context()
        # this start's key: its tcp channels admit only its own ranks (worker.channel)
        self._key = zmq.curve_keypair() if zmq.has("curve") else None
        self._procs: list[RankHandle] = []
        self._finalizer = weakref.finalize(self, _cleanup, self._ctx, self._procs, self._tmp,
                                           launcher)
        try:
            sites = launcher.place(tp, name)
            here = launcher.client_address()
            self._requests = self._bind(zmq.PUSH, launcher.endpoint(here, "requests"))
            self._outputs = self._bind(zmq.PULL, launcher.endpoint(here, "outputs"))
            addrs = WorkerAddresses(
                self._requests.getsockopt(zmq.LAST_ENDPOINT).decode(),
                self._outputs.getsockopt(zmq.LAST_ENDPOINT).decode(),
                tuple(launcher.endpoint(s.address, f"steps-{r}")
                      for r, s in enumerate(sites) if r > 0),
                launcher.rendezvous(), self._key)
            devices = tuple(s.device for s in sites)
            ranks_config = config
            if config.is_cuda and len({s.node for s in sites}) > 1:
                # the one-shot all-reduce maps its peers' memory: never across nodes
                ranks_config = dataclasses.replace(config, disable_custom_all_reduce=True)
            wc = WorkerConfig(ranks_config, addrs, os.getpid(), self._tmp, name,
                              cpu_threads=launcher.cpu_threads,
                              rank_devices=devices if all(devices) else ())
            launcher.check_cancel()
            self._procs.extend(launcher.start(pickle.dumps(wc)))
        except BaseException:
            self._finalizer()
            raise
        #: the node each rank runs on (RankSite.node): KV transports that need one host check it
        self.nodes = tuple(s.node for s in sites)
        self._addresses = tuple(s.address for s in sites)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(m.FromWorker)
        self._poller = zmq.Poller()
        self._poller.register(self._outputs, zmq.POLLIN)
        for p in self._procs:
            self._poller.register(p.sentinel, zmq.POLLIN)
        self._pending: set[str] = set()
        # what arrived while a call waited for something else, in arrival order: Outputs
        # messages and answers to submitted adds (_Answer), which step() hands on in turn (an
        # Outputs' KV loads with its outputs: never before the answer to the add they load for)
        self._ready: deque[m.Outputs | _Answer] = deque()
        self._unanswered: deque[list[str]] = deque()  # submitted adds' ids, oldest first
        self._answers: deque[list[str | None]] = deque()  # their answers, for take_answers
        self._dead: str | None = None
        self.name = name
        self.stats: m.WorkerStats | None = None  # as of the last Outputs received
        self.kv_events: list = []  # P/D consumer: KVLoadDone reports, for the router to take
        # the worker's latest engine steps (StepRecord), newest last: its measured speed
        self.step_records: deque = deque(maxlen=STEP_RECORDS_KEPT)
        self._deltas = DeltaDecoder()
        self._closed = False
        try:
            msg = self._recv(startup_timeout_s, starting=True)
        except BaseException:
            self._finalizer()
            raise
        if not isinstance(msg, m.Ready):
            self._finalizer()
            raise EngineDeadError(f"worker sent {type(msg).__name__} before Ready")
        self.info: m.WorkerInfo = msg.info
        self.max_model_len = msg.info.max_model_len
        self.num_kv_blocks = msg.info.num_kv_blocks
        self.eos_token_ids = tuple(msg.info.eos_token_ids)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    @property
    def ranks(self) -> list[dict]:
        """Where each rank runs: {"rank", "pid" (a pid on its own node; None if it never
        started), "node", "address"}."""
        return [{"rank": r, "pid": p.pid, "node": n, "address": a}
                for r, (p, n, a) in enumerate(zip(self._procs, self.nodes, self._addresses))]

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def pollables(self) -> list:
        """What a caller driving several clients waits on: readable when step(0) has news."""
        return [self._outputs, *(p.sentinel for p in self._procs)]

    def exited(self) -> bool:
        """A rank's process has ended (whether or not a call has noticed yet)."""
        return any(not p.is_alive() for p in self._procs)

    def readable(self) -> bool:
        """True when step(0) has something: buffered or arrived outputs or answers, or a rank's
        exit."""
        return bool(self._ready) or bool(self._outputs.poll(0)) or any(
            not p.is_alive() for p in self._procs)

    # ---- P/D --------------------------------------------------------------------------------
    def connect_kv(self, peers: list) -> list[str | None]:
        """Let this (consumer) worker pull from these producers; an error or None per peer."""
        return self._request(m.ConnectKV(list(peers)), m.Accepted).errors

    def send_kv(self, sends: list) -> None:
        """Two-sided producer: send held KV (m.SendKV; no reply)."""
        if sends and self._dead is None and not self._closed:
            self._send(m.SendKV(list(sends)))

    def drop_kv_peer(self, worker: str) -> None:
        """P/D: worker (a peer's KV name) is gone; abort the pair with it (no reply)."""
        if self._dead is None and not self._closed:
            self._send(m.DropPeer(worker))

    def release_kv(self, request_ids: list[str]) -> None:
        if request_ids and self._dead is None and not self._closed:
            self._send(m.ReleaseKV(list(request_ids)))

    def take_kv_events(self) -> list:
        """P/D consumer: the KVLoadDone reports received since the last call."""
        events, self.kv_events = self.kv_events, []
        return events

    def take_step_records(self) -> list:
        """The worker's StepRecords received since the last call, oldest first."""
        records = list(self.step_records)
        self.step_records.clear()
        return records

    # ---- the LLMEngine request API -----------------------------------------------------------
    def add_requests(self, requests: list[AddRequest]) -> list[str | None]:
        """Sends the requests and waits for the worker's answer: None (queued) or an error per
        request. The worker answers between two of its steps."""
        self.submit_requests(requests)
        mine = self._unanswered[-1]
        while True:
            reply = self._recv(None)
            if isinstance(reply, m.Accepted) and self._unanswered:
                ids = self._unanswered[0]
                self._answer(reply)
                if ids is mine:
                    self._ready.pop()   # (the answer just queued: returned here instead)
                    return reply.errors
            elif isinstance(reply, m.Outputs):
                self._ready.append(reply)
            else:
                raise EngineDeadError(f"unexpected {type(reply).__name__} from the worker")

    def submit_requests(self, requests: list[AddRequest]) -> None:
        """Sends the requests without waiting for the worker's answer, which arrives between
        two of its steps: step() returns [] for it, and take_answers() then has it (answers come
        in the order the requests were submitted). Until then the requests count as pending
        (abort_request reaches them). ValueError if they cannot be encoded (nothing is sent)."""
        try:
            payload = self._encoder.encode(m.AddRequests(list(requests)))
        except (TypeError, OverflowError, msgspec.EncodeError) as e:  # e.g. an int over 64 bits
            raise ValueError(f"a request cannot be sent to the worker: {e}") from None
        self._check_alive()
        self._send(payload)
        ids = [r.request_id for r in requests]
        self._pending.update(ids)
        self._unanswered.append(ids)

    def take_answers(self) -> list[list[str | None]]:
        """The answers to submitted adds that step() has passed since the last call, oldest
        first, one per submit_requests call: None (queued) or an error per request, in the
        order submitted. (Router.take_answers is by request id: the router's answer.)"""
        if not self._answers:   # (the router asks after every message it reads)
            return []
        out = list(self._answers)
        self._answers.clear()
        return out

    def _answer(self, msg: m.Accepted) -> None:
        """An answer to the oldest submitted add: its rejected requests are not pending; the
        answer is queued among the outputs, where it arrived."""
        ids = self._unanswered.popleft()
        for rid, err in zip(ids, msg.errors):
            if err is not None:
                self._pending.discard(rid)
        self._ready.append(_Answer(msg.errors))

    def _request(self, msg, reply_type):
        """Sends msg (a message, or one already encoded) and returns the worker's reply of
        reply_type; Outputs and answers to submitted adds arriving meanwhile are kept for
        step() (the worker answers in order: an Accepted while adds are unanswered is theirs)."""
        self._check_alive()
        self._send(msg)
        while True:
            reply = self._recv(None)
            if isinstance(reply, m.Accepted) and self._unanswered:
                self._answer(reply)
                continue
            if isinstance(reply, reply_type):
                return reply
            if not isinstance(reply, m.Outputs):
                raise EngineDeadError(f"unexpected {type(reply).__name__} from the worker")
            self._ready.append(reply)

    def check_integrity(self) -> m.WorkerStats:
        """Checks the worker's invariants (AssertionError naming the broken one) and returns its
        current stats."""
        report = self._request(m.CheckIntegrity(), m.IntegrityReport)
        self.stats = report.stats
        if report.error is not None:
            raise AssertionError(report.error)
        return report.stats

    def reset_prefix_cache(self) -> int:
        """Drop the worker's cached prefixes that no request uses; returns the blocks freed."""
        return self._request(m.ResetPrefixCache(), m.PrefixCacheReset).num_blocks_freed

    def num_free_blocks(self) -> int:
        s = self.check_integrity()
        return s.num_kv_blocks - s.num_kv_blocks_used

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        ids = [i for i in ids if i in self._pending]
        if ids and self._dead is None:
            self._pending.difference_update(ids)
            self._deltas.forget(ids)
            self._send(m.Abort(ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending)

    def step(self, timeout_s: float | None = None, wakeup_fd: int | None = None
             ) -> list[RequestOutput]:
        """The outputs of the worker's next step that reported anything (blocks until then, or
        until timeout_s, or until wakeup_fd is readable: then []). Outputs of aborted requests
        are dropped. An answer to submitted adds that arrives first returns [] (take_answers
        has it): it is handed on before any output that came after it."""
        if not self._pending and not self._ready and not self._unanswered and timeout_s != 0:
            return []
        if self._ready:
            msg = self._ready.popleft()
        else:
            self._check_alive()
            msg = self._recv(timeout_s, wakeup_fd=wakeup_fd)
            if msg is None:
                return []
            if isinstance(msg, m.Accepted) and self._unanswered:
                self._answer(msg)
                msg = self._ready.pop()
            elif not isinstance(msg, m.Outputs):
                raise EngineDeadError(f"unexpected {type(msg).__name__} from the worker")
        if isinstance(msg, _Answer):  # (take_answers has it now; outputs after it come next)
            self._answers.append(msg.errors)
            return []
        if msg.kv_loads:
            self.kv_events.extend(msg.kv_loads)
        outs = msg.outputs
        # outputs travel as deltas: rebuild the cumulative ones (only for requests still
        # wanted; an aborted request's state is already gone)
        live = [self._deltas.decode(o) for o in outs if o.request_id in self._pending]
        for o in live:
            if o.finished:
                self._pending.discard(o.request_id)
        return live

    # ---- lifecycle ---------------------------------------------------------------------------
    def drain(self, timeout_s: float = 60.0) -> list[RequestOutput]:
        """No more requests: the worker finishes everything in flight and exits. Returns the
        outputs that arrived meanwhile; then every process is joined (and killed past the
        timeout)."""
        collected: list[RequestOutput] = []
        if self._dead is None and not self._closed:
            self._send(m.Drain())
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                msg = self._recv(max(0.0, left)) if left > 0 else None
                if msg is None or isinstance(msg, m.Drained):
                    break
                if isinstance(msg, m.Outputs):
                    collected.extend(self._deltas.decode(o) for o in msg.outputs
                                     if o.request_id in self._pending)
        self._pending.clear()
        self.shutdown(timeout_s)
        return collected

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stops the worker: politely (drain) when it is alive, then joins every process."""
        if self._closed:
            return
        self._closed = True
        if self._dead is None:
            try:  # never wait here: a worker that has already exited takes no message
                self._requests.send(self._encoder.encode(m.Drain()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        _stop_processes(self._procs, timeout_s)
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ---- plumbing ----------------------------------------------------------------------------
    def _bind(self, kind: int, endpoint: str) -> zmq.Socket:
        return channel(self._ctx, kind, endpoint, self._key, bind=True)

    def _send(self, msg) -> None:
        """Sends msg (a message, or one already encoded) to rank 0. A PUSH socket with no
        connected peer blocks forever, so never block: wait for room a second at a time and
        look at the ranks in between. A message for a worker that has exited is dropped; the
        next wait reports the death (EngineDeadError)."""
        payload = msg if isinstance(msg, bytes) else self._encoder.encode(msg)
        while True:
            try:
                self._requests.send(payload, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass
            if not self._requests.poll(1000, zmq.POLLOUT) and \
                    any(not p.is_alive() for p in self._procs):
                return

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._closed:
            raise EngineDeadError("the engine client was shut down")

    def _recv(self, timeout_s: float | None, starting: bool = False,
              wakeup_fd: int | None = None):
        """The next message from the worker, or None after timeout_s (or once wakeup_fd is
        readable). Raises EngineDeadError (or ValueError for a configuration the worker
        rejected) when a rank fails or exits."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if wakeup_fd is not None:
            self._poller.register(wakeup_fd, zmq.POLLIN)
        try:
            while True:
                # Wake at least once a second to look at the ranks ourselves: a rank's exit must
                # end the wait even if its sentinel is never reported.
                cap = _CANCEL_POLL_S if starting and self._cancel is not None else 1.0
                left = cap if deadline is None else min(cap, deadline - time.monotonic())
                events = dict(self._poller.poll(max(0, int(left * 1000))))
                if events or any(not p.is_alive() for p in self._procs):
                    break
                if starting and self._cancel is not None and self._cancel.is_set():
                    raise StartCancelled("the worker's start was called off")
                if deadline is not None and time.monotonic() >= deadline:
                    return None
        finally:
            if wakeup_fd is not None:
                self._poller.unregister(wakeup_fd)
        if wakeup_fd is not None and wakeup_fd in events and self._outputs not in events \
                and all(p.is_alive() for p in self._procs):
            return None
        if self._outputs in events:
            msg = self._decoder.decode(self._outputs.recv())
            if isinstance(msg, m.Outputs):
                if msg.stats is not None:
                    self.stats = msg.stats
                if msg.steps:
                    self.step_records.extend(msg.steps)
            if not isinstance(msg, m.Failed):
                return msg
            if starting and msg.error_type == "ValueError":
                self._fail(msg.message)
                raise ValueError(msg.message)
            # A rank 0 error is often the echo of another rank's death (a broken collective):
            # name the dead rank first.
            detail = msg.message.strip().splitlines()[-1] if self._deaths() else msg.message
            self._fail("; ".join(filter(None, [self._deaths(), f"rank 0 failed: {detail}"])))
            raise EngineDeadError(self._dead)
        # A rank that exited may still have its last message (Failed) on the way.
        if self._outputs.poll(200):
            return self._recv(0, starting)
        n = len(self._pending)
        self._fail(f"{self._deaths() or 'a worker rank exited'}; {n} request(s) in flight failed")
        raise EngineDeadError(self._dead)

    def _deaths(self) -> str:
        return ", ".join(f"worker rank {p.rank} (pid {p.pid}) exited with code {p.exitcode}"
                         + (f" ({p.error})" if p.error else "")
                         for p in self._procs if not p.is_alive())

    def _fail(self, why: str) -> None:
        self._dead = why
        self._pending.clear()
        self._ready.clear()
        self._unanswered.clear()
        self._answers.clear()
        self._closed = True
        self._finalizer()
