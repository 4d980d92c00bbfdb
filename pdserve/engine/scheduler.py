"""Scheduler: continuous batching under a per-step token budget.

There is no prefill or decode phase: each request has `num_computed_tokens` that catch up to
`num_tokens` (prompt + output). A step gives every running request, oldest first, up to its
missing tokens (one for a decode, a chunk of a long prompt otherwise) while the token budget
lasts, then admits waiting requests first-come-first-served. One forward runs the whole mix.
When the pool is short, the newest running request is preempted: its blocks are freed and it
goes back to the front of the queue to be recomputed later (same tokens, since its outputs are kept).

Pure Python; the model runner only sees the SchedulerOutput.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from ..protocol import KVLoad, KVLoadDone, KVPeer, KVSend, KVSource
from .kv_cache_manager import BlockCopy, KVCacheManager
from .request import Request, RequestStatus


@dataclass(frozen=True)
class NewRequestData:
    """Sent once per sequence, the first time it is scheduled (the runner keeps sampling state)."""
    request_id: str
    prompt_token_ids: list[int]
    params: object
    seed: int | None
    output_token_ids: list[int]


class ScheduledChunk(NamedTuple):  # a NamedTuple: built for every running sequence every step
    request_id: str
    token_ids: list[int]      # tokens fed this step
    start_pos: int            # position of token_ids[0] (= cached tokens)
    block_table: list[int]    # the live table: valid until the next schedule()
    sample: bool              # True when this chunk reaches the end of the sequence


@dataclass(frozen=True)
class Fork:
    request_id: str           # the new sibling
    parent_id: str            # samples from the parent's last-position logits


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)   # since the last step: runner drops state
    # P/D consumer, handled by every rank before the forward: producers to reach, the driver's
    # verdicts on earlier loads (ok: the blocks may be read now; not ok: cancel), new loads.
    kv_peers: list[KVPeer] = field(default_factory=list)
    kv_verdicts: list[tuple[str, bool]] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)
    kv_sends: list[KVSend] = field(default_factory=list)   # two-sided producer: blocks to send

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def has_kv_work(self) -> bool:
        return bool(self.kv_peers or self.kv_verdicts or self.kv_loads or self.kv_sends)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_kv_loads: int = 64):
        self.kv = kv
        self.max_kv_loads = max_kv_loads  # P/D consumer: loads in flight at once (back-pressure)
        self.kv_waiting: deque[Request] = deque()      # prompt KV on a producer, no blocks yet
        self.loading: dict[str, Request] = {}          # blocks allocated, KV being pulled
        self.kv_sources: dict[str, KVSource] = {}
        self._kv_verdicts: list[tuple[str, bool]] = []
        self._kv_peers: list[KVPeer] = []
        self._kv_sends: list[KVSend] = []
        self._kv_discards: list[KVLoad] = []
        # two-sided transfers: a request dropped before its load still receives (and discards)
        # what the producer sends, so the next receive meets the next send
        self.discard_unloaded = False
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._known_to_runner: set[str] = set()
        self._finished_since_step: list[str] = []
        self._last: tuple[list[tuple[Request, int]], list[Request]] = ([], [])
        self.num_preemptions = 0  # total, for metrics and tests

    # ---- admission and removal ------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a sequence (with any FORK_PENDING siblings attached to req.siblings)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        for s in req.siblings:
            self.requests[s.request_id] = s
        self.waiting.append(req)

    def add_remote(self, req: Request, source: KVSource) -> None:
        """Queue a sequence whose first source.num_tokens positions are computed on a producer:
        its blocks are allocated when the pool has room, then the KV is pulled (kv_loads), then
        it runs from there like any other sequence."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.kv_sources[req.request_id] = source
        req.status = RequestStatus.WAITING_FOR_KV
        self.kv_waiting.append(req)

    def add_kv_peer(self, peer: KVPeer) -> None:
        self._kv_peers.append(peer)

    def add_kv_send(self, send: KVSend) -> None:
        self._kv_sends.append(send)

    def has_kv_work(self) -> bool:
        """KV work for the next step even without requests to run (peers, sends, verdicts)."""
        return bool(self._kv_peers or self._kv_sends or self._kv_verdicts or self._kv_discards)

    def finish(self, req: Request, status: RequestStatus, now: float = 0.0) -> list[int] | None:
        """Remove a sequence (and its unforked siblings) for good, freeing its blocks (or, for a
        producer's hold_kv sequence that did not abort, keeping them: returns its table)."""
        held = None
        for r in [req, *req.siblings]:
            if r.status.finished:
                continue
            if r.status is RequestStatus.RUNNING:
                self.running.remove(r)
            elif r.status is RequestStatus.WAITING:
                self.waiting.remove(r)
            elif r.status is RequestStatus.WAITING_FOR_KV:
                self.kv_waiting.remove(r)
                if self.discard_unloaded:
                    src = self.kv_sources[r.request_id]
                    self._kv_discards.append(KVLoad(r.request_id, src.worker, src.block_ids, []))
            elif r.status is RequestStatus.LOADING_KV:
                del self.loading[r.request_id]
                self._kv_verdicts.append((r.request_id, False))  # cancel before reuse
            self.kv_sources.pop(r.request_id, None)
            r.status = status
            if r.hold_kv and status is not RequestStatus.FINISHED_ABORTED:
                held = self.kv.hold(r.request_id, now)
            else:
                self.kv.free(r.request_id)
            del self.requests[r.request_id]
            if r.request_id in self._known_to_runner:
                self._known_to_runner.discard(r.request_id)
                self._finished_since_step.append(r.request_id)
        req.siblings = []
        return held

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _num_seq_slots_used(self) -> int:
        return sum(1 + len(r.siblings) for r in self.running) + len(self.loading)

    def finish_loads(self, done: list[KVLoadDone]) -> None:
        """The pulls that ended: ok -> the sequence runs from the producer's position (its next
        forward follows the runner's ok verdict); failed -> its blocks are freed (the runner
        cancels the pull before anything reuses them) and it is recomputed here from scratch."""
        for d in done:
            req = self.loading.pop(d.request_id, None)
            if req is None:
                continue  # aborted meanwhile: its verdict is already queued
            self._kv_verdicts.append((d.request_id, d.ok))
            source = self.kv_sources.pop(d.request_id)
            if d.ok:
                req.num_computed_tokens = source.num_tokens
                req.status = RequestStatus.RUNNING
                self.running.append(req)
            else:
                self.kv.free(req.request_id)
                req.num_computed_tokens = 0
                req.status = RequestStatus.WAITING
                self.waiting.appendleft(req)

    def _start_loads(self, out: SchedulerOutput) -> None:
        while self.kv_waiting and len(self.loading) < self.max_kv_loads:
            req = self.kv_waiting[0]
            if self._num_seq_slots_used() + 1 > self.max_num_seqs:
                break
            source = self.kv_sources[req.request_id]
            if self.kv.allocate_slots(req.request_id, 0, source.num_tokens) is None:
                break
            self.kv_waiting.popleft()
            req.status = RequestStatus.LOADING_KV
            self.loading[req.request_id] = req
            out.kv_loads.append(KVLoad(req.request_id, source.worker, source.block_ids,
                                       list(self.kv.block_tables[req.request_id])))

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_since_step,
                              kv_peers=self._kv_peers, kv_verdicts=self._kv_verdicts,
                              kv_sends=self._kv_sends, kv_loads=self._kv_discards)
        self._finished_since_step, self._kv_peers, self._kv_verdicts = [], [], []
        self._kv_sends, self._kv_discards = [], []
        budget = self.max_num_batched_tokens
        picked: list[tuple[Request, int]] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            copies = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            while copies is None:  # pool short: preempt the newest until this one fits
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    break
                copies = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            if copies is None:
                break
            out.block_copies.extend(copies)
            picked.append((req, n))
            budget -= n
            i += 1

        # Admit new work only when nothing was preempted (it would just be preempted again).
        while self.waiting and budget > 0 and not out.preempted_ids:
            req = self.waiting[0]
            if self._num_seq_slots_used() + 1 + len(req.siblings) > self.max_num_seqs:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            copies = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            if copies is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.block_copies.extend(copies)
            picked.append((req, n))
            budget -= n

        if self.kv_waiting and not out.preempted_ids:
            self._start_loads(out)

        forked: list[Request] = []
        for req, n in picked:
            end = req.num_computed_tokens + n
            if req.request_id not in self._known_to_runner:
                self._known_to_runner.add(req.request_id)
                out.new_requests.append(self._new_data(req))
            # The block table is passed by reference: the runner reads it within this step.
            out.chunks.append(ScheduledChunk(
                req.request_id, req.token_slice(req.num_computed_tokens, end),
                req.num_computed_tokens, self.kv.block_tables[req.request_id],
                sample=end == req.num_tokens))
            if end == req.num_tokens and req.siblings:
                for s in req.siblings:
                    self.kv.fork(req.request_id, s.request_id)
                    s.status = RequestStatus.RUNNING
                    self.running.append(s)
                    self._known_to_runner.add(s.request_id)
                    out.new_requests.append(self._new_data(s))
                    out.forks.append(Fork(s.request_id, req.request_id))
                    forked.append(s)
                req.siblings = []
        self._last = (picked, forked)
        return out

    @staticmethod
    def _new_data(req: Request) -> NewRequestData:
        return NewRequestData(req.request_id, req.prompt_token_ids, req.params, req.seed,
                              list(req.output_token_ids))

    def update(self, sampled: dict[str, int]) -> list[Request]:
        """Apply the last step's results. Returns the sequences that got a new token."""
        picked, forked = self._last
        self._last = ([], [])
        got: list[Request] = []
        for req, n in picked:
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted later in the same schedule() call
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                req.append_output(sampled[req.request_id])
                got.append(req)
        for s in forked:
            s.num_computed_tokens = s.num_prompt_tokens
            s.append_output(sampled[s.request_id])
            got.append(s)
        return got

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        held = set(self.kv.block_tables)
        live = {r.request_id for r in self.running} | set(self.loading)
        assert held <= live, f"block tables held by non-running requests: {held - live}"
        assert self._num_seq_slots_used() <= self.max_num_seqs
