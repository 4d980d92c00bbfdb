"""KVCoordinator: the scheduler's side of P/D KV transfer (the role vLLM gives the scheduler half
of its connector). The scheduler without one is the plain collocated scheduler.

It owns every piece of P/D state the engine core keeps; the transport (the connector, on every
rank) only ever sees the per-step KVStepWork this builds.

    consumer  admit ──> waiting ──(start_loads: blocks allocated)──> loading ──(finish_loads)
              (prompt KV on a producer,  (a KVLoad in the step's work,     ok: runs from the
               no blocks here yet)        the pull runs on every rank)     producer's position;
                            │                                              failed / timed out:
                            │ two-sided, the blocks the producer skipped   recomputed here
                            └──────────> are no longer cached here: the tail is received and
                                         discarded, the sequence recomputed here (a failed load)
    producer  a finished hold_kv sequence ──> held ──> released by release_held, send_held
              (its blocks detached from the KV manager)  or expire_held (nobody claimed it)

What a load moves: the prompt's blocks past those this worker reuses from its prefix cache.
One-sided, the consumer decides: it matches the prompt in its own cache (whole blocks, never
the last one). Two-sided, the producer's send is issued by the router before the consumer
sees the request, so the router decides (KVSource.skip_blocks: the whole blocks its prefix
index believes this worker holds); the consumer reuses exactly those and receives the rest,
block for block as sent, or, when they are gone from its cache, receives and discards the
tail and recomputes the sequence. Two-sided, receives must meet sends in order: the loads of one
producer's sequences leave in their admission order (the order the router asks that producer to
send in), a receive-and-discard included; one that is known before an earlier sequence's load
(that one still waiting for blocks) waits for it.

The Scheduler calls (and nothing else; all of it is P/D):
    admit(req, source)             queue a sequence whose first source.num_tokens are remote
    num_loading                    sequences that hold a seq slot while their KV arrives
    start_loads(kv, free_slots)    allocate blocks for waiting sequences (reusing the whole
                                   blocks of their prompt this worker cached), queue their loads;
                                   returns those to recompute here instead (two-sided: the
                                   skipped blocks are gone)
    drop(req)                      a WAITING_FOR_KV / LOADING_KV sequence leaves for good
                                   (two-sided, waiting: its receive-and-discard load is queued
                                   behind the loads of that producer's earlier sequences)
    hold(rid, table, now)          keep a finished hold_kv sequence's blocks for a consumer
    finish_loads(done)             resolve ended loads: [(request, ok)] for the scheduler to place
    take_work()                    this step's KV work (None: none), once per schedule()
    waiting, loading, held_tables() what it holds (admission order, seq slots, integrity check)
The engine core calls the control plane: add_peer, send_held, release_held, expire_held,
has_work, loads_started and poll (which adds the transfer timeouts).

Pure Python: times are passed in (a simulator drives it on its own clock); ids are sequence ids.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..protocol import KVDrop, KVLoad, KVLoadDone, KVPeer, KVSend, KVSource
from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus


@dataclass
class KVStepWork:
    """What every rank's connector does before a step's forward, in this order: reach new peers
    (or drop dead ones, in the order announced), apply the driver's verdicts on earlier loads
    (ok: the blocks may be read now; not ok: cancel before the blocks are reused), send held
    blocks (two-sided producer), start loads (a load with no destination blocks receives and
    discards: two-sided, its request left before it had blocks)."""
    peers: list[KVPeer | KVDrop] = field(default_factory=list)
    verdicts: list[tuple[str, bool]] = field(default_factory=list)
    sends: list[KVSend] = field(default_factory=list)
    loads: list[KVLoad] = field(default_factory=list)


class KVCoordinator:
    """two_sided: the connector's producer sends whether or not the consumer still wants the
    KV, so a sequence dropped before its load still receives (and discards) what is sent, and
    the next receive meets the next send: per producer, loads leave in admission order
    (_issue). What it sends is the source's sent_block_ids (the router skipped the whole blocks
    it believes this worker holds, KVSource.skip_blocks): a consumer reuses exactly those from
    its prefix cache, or, when they are gone, receives and discards the tail and recomputes the
    sequence (reported as a failed load)."""

    def __init__(self, kv: KVCacheManager, max_loads: int = 64, two_sided: bool = False,
                 transfer_timeout_s: float = 30.0, hold_timeout_s: float = 300.0):
        self.kv = kv
        self.max_loads = max_loads                 # loads in flight at once (back-pressure)
        self.two_sided = two_sided
        self.transfer_timeout_s = transfer_timeout_s
        self.hold_timeout_s = hold_timeout_s
        self.waiting: deque[Request] = deque()     # prompt KV on a producer, no blocks yet
        self.sources: dict[str, KVSource] = {}     # of waiting and loading sequences
        self.loading: dict[str, Request] = {}      # blocks allocated, KV being pulled
        self.started: dict[str, float] = {}        # loads whose pull runs: since when
        # producer: tables of finished sequences kept until a consumer pulled them
        # (sequence id -> (table, time held))
        self.held: dict[str, tuple[list[int], float]] = {}
        # two-sided consumer: loads given up before they started (the skipped blocks were gone
        # here), reported with the next poll
        self.unpulled: list[KVLoadDone] = []
        # two-sided consumer: per producer, a slot per admitted sequence whose load is not in
        # the work yet, in admission order (that producer's send order); a slot holds its load
        # once known and loads leave from the front only (_issue)
        self._recvs: dict[str, deque[list[KVLoad]]] = {}
        self._slots: dict[str, list[KVLoad]] = {}   # of waiting sequences, by id
        self._work = KVStepWork()

    # ---- called by the scheduler ------------------------------------------------------------
    def admit(self, req: Request, source: KVSource) -> None:
        self.sources[req.request_id] = source
        req.status = RequestStatus.WAITING_FOR_KV
        self.waiting.append(req)
        if self.two_sided:
            slot = self._slots[req.request_id] = []
            self._recvs.setdefault(source.worker, deque()).append(slot)

    @property
    def num_loading(self) -> int:
        return len(self.loading)

    def start_loads(self, kv: KVCacheManager, free_slots: int) -> list[Request]:
        """Oldest first, while loads may start, sequence slots last and the pool has the blocks.
        Returns the sequences to recompute here instead (WAITING_FOR_KV still; the scheduler
        queues them): two-sided, the blocks the producer skipped are no longer cached here."""
        recompute = []
        while self.waiting and len(self.loading) < self.max_loads and free_slots > 0:
            req = self.waiting[0]
            rid, source = req.request_id, self.sources[req.request_id]
            # Whole blocks of the prompt this worker has cached are not pulled; the last block
            # always is (a load moves at least one block). Two-sided: the producer sends what
            # the router chose (all but source.skip_blocks), so exactly those are reused.
            bs = kv.block_size
            if not self.two_sided:
                kept = kv.match_prefix(rid, req.prompt_token_ids,
                                       (source.num_tokens - 1) // bs * bs, whole_blocks=True)
            else:
                kept = source.skip_blocks * bs
                if kept and kv.match_prefix(rid, req.prompt_token_ids, kept,
                                            whole_blocks=True) != kept:
                    kv.free(rid)   # (what did match, if any)
                    self.waiting.popleft()
                    del self.sources[rid]
                    self._issue(KVLoad(rid, source.worker, source.sent_block_ids, []))
                    self.unpulled.append(KVLoadDone(
                        rid, False, 0, 0.0, f"the {source.skip_blocks} blocks the producer "
                        "skipped are no longer cached here: recomputed"))
                    recompute.append(req)
                    continue
            if kv.allocate_slots(rid, kept, source.num_tokens - kept) is None:
                kv.free(rid)
                break
            if req.num_cached_tokens is None:
                req.num_cached_tokens = kept
            self.waiting.popleft()
            free_slots -= 1
            req.status = RequestStatus.LOADING_KV
            self.loading[rid] = req
            k = kept // bs
            self._issue(KVLoad(rid, source.worker, source.block_ids[k:],
                               kv.block_tables[rid][k:]))
        return recompute

    def _issue(self, load: KVLoad) -> None:
        """Put a load into the step's work; two-sided, after the loads of the sequences admitted
        before it from the same producer (held back until theirs are issued: a receive issued
        early would take an earlier sequence's send, and that one the next)."""
        if not self.two_sided:
            self._work.loads.append(load)
            return
        self._slots.pop(load.request_id).append(load)
        q = self._recvs[load.worker]
        while q and q[0]:
            self._work.loads.append(q.popleft()[0])
        if not q:
            del self._recvs[load.worker]

    def drop(self, req: Request) -> None:
        """`req` (WAITING_FOR_KV or LOADING_KV) leaves; the scheduler frees its blocks. Loading:
        its pull is cancelled (a verdict). Waiting, two-sided: it still receives and discards
        what its producer sends, after the loads of that producer's earlier sequences."""
        rid = req.request_id
        if req.status is RequestStatus.WAITING_FOR_KV:
            self.waiting.remove(req)
            if self.two_sided:
                src = self.sources[rid]
                self._issue(KVLoad(rid, src.worker, src.sent_block_ids, []))
        else:
            del self.loading[rid]
            self.started.pop(rid, None)
            self._work.verdicts.append((rid, False))  # cancel before the blocks are reused
        del self.sources[rid]

    def hold(self, request_id: str, table: list[int], now: float) -> list[int]:
        """Keep a finished sequence's blocks (detached from the KV manager) for a consumer."""
        self.held[request_id] = (table, now)
        return table

    def finish_loads(self, done: list[KVLoadDone]) -> list[tuple[Request, bool]]:
        """The loads that ended, as (sequence, ok): ok -> its first source.num_tokens positions
        are computed (set here); failed -> nothing is (the scheduler frees its blocks and
        recomputes it). Either way the driver's verdict goes to every rank with the next step
        (ok: the blocks may be read; not ok: the pull is cancelled before the blocks are reused).
        Loads no longer in flight (dropped meanwhile: their verdict is queued) are skipped."""
        out = []
        for d in done:
            req = self.loading.pop(d.request_id, None)
            if req is None:
                continue
            self.started.pop(d.request_id, None)
            self._work.verdicts.append((d.request_id, d.ok))
            source = self.sources.pop(d.request_id)
            req.num_computed_tokens = source.num_tokens if d.ok else 0
            out.append((req, d.ok))
        return out

    def take_work(self) -> KVStepWork | None:
        if not self.has_work():
            return None
        work, self._work = self._work, KVStepWork()
        return work

    def held_tables(self) -> list[list[int]]:
        return [t for t, _ in self.held.values()]

    # ---- called by the engine core (control plane) --------------------------------------------
    def has_work(self) -> bool:
        """KV work for the next step even without sequences to run (peers, sends, verdicts)."""
        w = self._work
        return bool(w.peers or w.verdicts or w.sends or w.loads)

    def add_peer(self, peer: KVPeer | KVDrop) -> None:
        self._work.peers.append(peer)

    def send_held(self, seq_id: str, send: KVSend) -> None:
        """Two-sided producer: send send.block_ids, the blocks held for `seq_id` or a tail of
        them (the router skipped the leading blocks the consumer has cached), with the next
        step, on every rank; then drop the hold (the runner reads the blocks before any later
        forward writes them). A sequence no longer held, or blocks that are not a tail of its
        table, are still sent (send's block count of filler, marked not ok), so the consumer's
        receives stay in step; it recomputes that one."""
        entry = self.held.get(seq_id)
        n = len(send.block_ids)
        ok = entry is not None and 0 < n <= len(entry[0]) and entry[0][-n:] == list(send.block_ids)
        blocks = list(send.block_ids) if ok else [0] * n
        self._work.sends.append(KVSend(send.request_id, send.consumer, blocks, ok))
        self.release_held(seq_id)

    def release_held(self, seq_id: str) -> bool:
        entry = self.held.pop(seq_id, None)
        if entry is None:
            return False
        self.kv.release(entry[0])
        return True

    def expire_held(self, now: float) -> int:
        """Releases what was held longer than hold_timeout_s (a consumer that never pulled)."""
        old = [rid for rid, (_, t) in self.held.items() if now - t > self.hold_timeout_s]
        for rid in old:
            self.release_held(rid)
        return len(old)

    def loads_started(self, work: KVStepWork | None, now: float) -> None:
        """The step that carried `work` ran: its pulls run from `now` (receive-and-discard
        loads are nobody's: not tracked)."""
        if work is not None:
            for load in work.loads:
                if load.dst_block_ids and load.request_id in self.loading:
                    self.started[load.request_id] = now

    def poll(self, reported: list[KVLoadDone], now: float) -> list[KVLoadDone]:
        """The loads that ended: those the transport reported (a load given up on, or dropped,
        may still report when its copy stops: not news, skipped) and those in flight longer
        than transfer_timeout_s (failed here; the verdict cancels them on every rank); first
        the loads given up before they started (unpulled: nothing to judge)."""
        done = [d for d in reported if d.request_id in self.started]
        for d in done:
            del self.started[d.request_id]
        done[:0], self.unpulled = self.unpulled, []
        limit = self.transfer_timeout_s
        for rid, t in list(self.started.items()):
            if now - t > limit:
                del self.started[rid]
                done.append(KVLoadDone(rid, False, 0, now - t, f"timed out after {limit:g} s"))
        return done
