"""Scheduler: continuous batching under a per-step token budget.

There is no prefill or decode phase: each request has `num_computed_tokens` that catch up to
`num_tokens` (prompt + output). A step gives every running request, oldest first, up to its
missing tokens (one for a decode, a chunk of a long prompt otherwise) while the token budget
lasts, then admits waiting requests first-come-first-served. One forward runs the whole mix.
When the pool is short, the newest running request is preempted: its blocks are freed and it
goes back to the front of the queue to be recomputed later (same tokens, since its outputs are kept).

With a host tier (KVCacheManager(num_host_blocks=...)) a victim is swapped instead of recomputed
when preemption_mode is "swap", or, with None, when the host has room and moving its blocks out
and back (2 x bytes / host bandwidth) costs less than prefilling its computed tokens again (the
engine's measured PrefillRate; before any measurement, and without a known bandwidth or block
size, swap is preferred). A swapped sequence (SWAPPED) keeps num_computed_tokens and waits first
in the queue, like a recomputed one; when admitted again its blocks are copied back and it runs
from the next step on. A victim whose blocks another sequence shares (n > 1 forks) or that holds
KV for P/D is recomputed. Copies between tiers (SchedulerOutput.kv_moves) run beside the step's
forward, so the blocks a swap gives back come free at the next step: a sequence short of blocks
that the next step brings waits one step rather than preempting more, and a sequence whose
table lists a block copied this step (loaded back for its cached prefix) runs from the next step,
admitted only with the blocks of its next chunk held for it (KVCacheManager.reserve_slots).
A cached prefix whose load-back stopped for room that the next step brings (the eviction made
it from blocks copied this step, as write-through's fresh copies are) is not admitted with part
of its prefix: it waits a step for the rest, MAX_LOAD_WAITS times at most in its life (then it
takes what loaded, so it cannot wait forever), and admission stops behind it.

P/D lives in a KVCoordinator (kv_coordinator.py) given to the constructor: sequences whose
prompt KV is on a producer (add_remote), loads in flight, blocks held for a consumer. Without
one this is the plain collocated scheduler; with one, the coordinator's per-step KV work rides
in SchedulerOutput.kv_work.

Async scheduling (engine/core.py): schedule() may run while the previous step is still on the
device. It advances num_computed_tokens as it schedules, and a sequence that samples in a step
counts one pending token (Request.num_pending) until update() hands it the token; its next decode
chunk feeds that token from the device (ScheduledChunk.last_pending). A sequence with a pending
token is not scheduled again when it would run past max_tokens / max_model_len, nor when it holds
its KV for a consumer (P/D: the held KV must end at its prompt); update() drops the tokens of
sequences that finished meanwhile. A sequence preempted with a token pending keeps it (the step
in flight computed it from its blocks before they were freed, and the device runs steps in
order); its recompute starts in a later step, when the token is known. With one step in flight
at most, a chunk holds one pending token at most, at its end.

Pure Python; the model runner only sees the SchedulerOutput.
"""
from __future__ import annotations

import collections
from collections import deque
from dataclasses import dataclass, field
from itertools import chain
from typing import Iterator, NamedTuple

from ..protocol import KVLoadDone, KVSource
from .kv_cache_manager import BlockCopy, KVCacheManager, KVMoves
from .kv_coordinator import KVCoordinator, KVStepWork
from .prefill_rate import PrefillRate
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
    # token_ids[-1] is the token the previous step sampled for this sequence, not known on the
    # host yet (0 here): the runner writes it on the device before the forward (async scheduling)
    last_pending: bool = False


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
    kv_work: KVStepWork | None = None   # P/D: every rank's connector does it before the forward
    kv_moves: KVMoves | None = None     # copies between the KV tiers (None: none), see KVMoves
    step_id: int = 0                    # counts schedule() calls (GPU times come back keyed by it)
    num_decodes: int = 0                # chunks that feed one output token (the rest is prefill)
    num_prefill_tokens: int = 0         # tokens of the other chunks (prompt or recomputed)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    PREEMPTION_MODES = (None, "recompute", "swap")
    MAX_LOAD_WAITS = 4      # steps a sequence may wait for room to load its cached prefix back

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 kv_coordinator: KVCoordinator | None = None, preemption_mode: str | None = None,
                 host_copy_gb_per_s: float = 0.0, prefill_rate: PrefillRate | None = None):
        if preemption_mode not in self.PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {self.PREEMPTION_MODES}, got "
                             f"{preemption_mode!r}")
        if preemption_mode == "swap" and kv.host_pool is None:
            raise ValueError("preemption_mode='swap' needs a host tier (num_host_blocks > 0)")
        if not host_copy_gb_per_s >= 0:
            raise ValueError(f"host_copy_gb_per_s must be >= 0, got {host_copy_gb_per_s}")
        self.preemption_mode = preemption_mode
        self.host_copy_gb_per_s = host_copy_gb_per_s   # 0.0: unknown
        self.prefill_rate = prefill_rate if prefill_rate is not None else PrefillRate()
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0
        self.kv = kv
        self.kv_coordinator = kv_coordinator   # None: collocated, no P/D path below is taken
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._known_to_runner: set[str] = set()
        self._finished_since_step: list[str] = []
        # per scheduled step not updated yet, oldest first: the sequences that sample in it
        self._unread: deque[list[Request]] = deque()
        self.num_preemptions = 0  # total, for metrics and tests
        self._step_id = 0

    # ---- admission and removal ------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a sequence (with any FORK_PENDING siblings attached to req.siblings)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.hold_kv and self.kv_coordinator is None:
            raise ValueError("this scheduler has no KV coordinator: it cannot hold KV")
        self.requests[req.request_id] = req
        for s in req.siblings:
            self.requests[s.request_id] = s
        self.waiting.append(req)

    def add_remote(self, req: Request, source: KVSource) -> None:
        """Queue a sequence whose first source.num_tokens positions are computed on a producer
        (needs a KV coordinator): its blocks are allocated when the pool has room, then the KV
        is pulled, then it runs from there like any other sequence."""
        if self.kv_coordinator is None:
            raise ValueError("this scheduler has no KV coordinator: it cannot pull KV")
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.kv_coordinator.admit(req, source)

    def finish(self, req: Request, status: RequestStatus, now: float = 0.0) -> list[int] | None:
        """Remove a sequence (and its unforked siblings) for good, freeing its blocks (or, for a
        producer's hold_kv sequence that did not abort, handing them to the KV coordinator to
        hold: returns its table)."""
        held = None
        for r in [req, *req.siblings]:
            if r.status.finished:
                continue
            if r.status is RequestStatus.RUNNING:
                self.running.remove(r)
            elif r.status in (RequestStatus.WAITING, RequestStatus.SWAPPED):
                self.waiting.remove(r)
            elif r.status in (RequestStatus.WAITING_FOR_KV, RequestStatus.LOADING_KV):
                self.kv_coordinator.drop(r)
            was_running = r.status is RequestStatus.RUNNING
            r.status = status
            if r.hold_kv and status is not RequestStatus.FINISHED_ABORTED:
                held = self.kv_coordinator.hold(
                    r.request_id, self.kv.detach(r.request_id, self._computed(r)), now)
            else:   # (a loading sequence's blocks hold no KV yet: nothing to cache)
                self.kv.free(r.request_id, self._computed(r) if was_running else ())
            del self.requests[r.request_id]
            if r.request_id in self._known_to_runner:
                self._known_to_runner.discard(r.request_id)
                self._finished_since_step.append(r.request_id)
        req.siblings = []
        return held

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _num_seq_slots_used(self) -> int:
        used = sum(1 + len(r.siblings) for r in self.running)
        return used if self.kv_coordinator is None else used + self.kv_coordinator.num_loading

    def finish_loads(self, done: list[KVLoadDone]) -> None:
        """P/D: place the sequences whose loads ended (the coordinator resolves them): ok ->
        it runs from the producer's position (its next forward follows the ok verdict); failed
        -> its blocks are freed and it is recomputed here from scratch, first in the queue."""
        for req, ok in self.kv_coordinator.finish_loads(done):
            if ok:
                req.status = RequestStatus.RUNNING
                self.running.append(req)
            else:
                self._recompute(req)

    def _recompute(self, req: Request) -> None:
        """P/D: a sequence whose KV did not arrive is computed here from scratch (its prompt,
        then the producer's tokens), first in the queue."""
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    @staticmethod
    def _computed(req: Request) -> list[int]:
        """The tokens whose KV a running sequence's blocks hold (or a step in flight writes):
        what the prefix cache may keep of it (a pending token is not known yet)."""
        return req.token_slice(0, min(req.num_computed_tokens, req.num_tokens))

    def _preempt(self, req: Request) -> None:
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self._should_swap(req) and self.kv.swap_out(req.request_id, req.num_computed_tokens):
            req.status = RequestStatus.SWAPPED
            self.num_swap_preemptions += 1
        else:
            self.kv.free(req.request_id, self._computed(req))
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            self.num_recompute_preemptions += 1
        self.waiting.appendleft(req)

    def _should_swap(self, req: Request) -> bool:
        """Swap (rather than recompute) this victim: see the module docstring."""
        if self.preemption_mode == "recompute" or req.hold_kv:
            return False
        blocks = self.kv.swap_blocks(req.request_id, req.num_computed_tokens)
        if not blocks:
            return False
        if self.preemption_mode == "swap":
            return True
        rate = self.prefill_rate.seconds_per_token()
        nbytes = blocks * self.kv.kv_block_bytes
        if rate is None or nbytes == 0 or self.host_copy_gb_per_s <= 0:
            return True             # nothing measured yet: moving is the safer bet
        return 2 * nbytes / (self.host_copy_gb_per_s * 1e9) < rate * req.num_computed_tokens

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._step_id += 1
        self.kv.begin_step()
        out = SchedulerOutput(finished_ids=self._finished_since_step, step_id=self._step_id)
        self._finished_since_step = []
        budget = self.max_num_batched_tokens
        picked: list[tuple[Request, int]] = []
        short = False      # a running sequence waits for blocks the next step brings

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending and self._waits_for_host(req):
                i += 1
                continue
            n = min(req.num_total_tokens - req.num_computed_tokens, budget)
            copies = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            while copies is None:  # pool short: preempt the newest until this one fits
                if self.kv.room_arrives(req.request_id, req.num_computed_tokens, n):
                    break          # (the blocks it lacks come free next step: it waits)
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    break
                copies = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            if copies is None:
                if req.status is not RequestStatus.RUNNING:
                    break          # (it was preempted itself: the newest, nothing follows)
                short = True
                i += 1
                continue
            out.block_copies.extend(copies)
            picked.append((req, n))
            budget -= n
            i += 1

        # Admit new work only when nothing was preempted (it would just be preempted again).
        while self.waiting and budget > 0 and not out.preempted_ids and not short:
            req = self.waiting[0]
            if self._num_seq_slots_used() + 1 + len(req.siblings) > self.max_num_seqs:
                break
            if req.status is RequestStatus.SWAPPED:   # its KV back from the host: next step
                if not self.kv.swap_in(req.request_id):
                    break
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                continue
            # New or preempted: start from a cached prefix (at least one token left to compute:
            # the step must produce its logits), unless the prompt's own logprobs are asked for
            # (every prompt position must then go through the forward).
            if req.num_computed_tokens == 0 and req.params.prompt_logprobs is None:
                req.num_computed_tokens = self.kv.match_prefix(
                    req.request_id, req.token_slice(0, req.num_tokens), req.num_tokens - 1)
                if self.kv.table_busy(req.request_id):   # (its prefix loads back this step)
                    # (the blocks of its next chunk held now: none for it next step would
                    # preempt others, or itself, the newest, swapping out what just came back)
                    n = min(req.num_tokens - req.num_computed_tokens, self.max_num_batched_tokens)
                    if (not self.kv.reserve_slots(req.request_id, req.num_computed_tokens, n)
                            or self._waits_for_load(req)):
                        self.kv.free(req.request_id)   # (the loaded prefix stays cached)
                        req.num_computed_tokens = 0
                        break
                    if req.num_cached_tokens is None:
                        req.num_cached_tokens = req.num_computed_tokens
                    self.waiting.popleft()
                    req.status = RequestStatus.RUNNING
                    self.running.append(req)
                    continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            copies = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            if copies is None or self._waits_for_load(req):
                self.kv.free(req.request_id)   # (the matched prefix: matched again next time)
                req.num_computed_tokens = 0
                break
            if req.num_cached_tokens is None:   # (what its first admission found cached)
                req.num_cached_tokens = req.num_computed_tokens
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.block_copies.extend(copies)
            picked.append((req, n))
            budget -= n

        coord = self.kv_coordinator
        if coord is not None:
            if coord.waiting and not out.preempted_ids:
                # (two-sided: those whose reused blocks are gone here; admitted next step)
                for req in reversed(coord.start_loads(
                        self.kv, self.max_num_seqs - self._num_seq_slots_used())):
                    self._recompute(req)
            out.kv_work = coord.take_work()

        samplers: list[Request] = []
        forked: list[Request] = []
        num_decodes = 0
        for req, n in picked:
            start = req.num_computed_tokens
            end = start + n
            sample = end == req.num_total_tokens
            if n == 1 and start >= req.num_prompt_tokens:
                num_decodes += 1
            if req.request_id not in self._known_to_runner:
                self._known_to_runner.add(req.request_id)
                out.new_requests.append(self._new_data(req))
            # The block table is passed by reference: the runner reads it within this step.
            out.chunks.append(ScheduledChunk(
                req.request_id, req.token_slice(start, end), start,
                self.kv.block_tables[req.request_id], sample, end > req.num_tokens))
            req.num_computed_tokens = end
            if sample:
                req.num_pending += 1
                samplers.append(req)
            if sample and req.siblings:
                for s in req.siblings:
                    self.kv.fork(req.request_id, s.request_id)
                    s.status = RequestStatus.RUNNING
                    s.num_computed_tokens = s.num_prompt_tokens
                    s.num_pending += 1
                    self.running.append(s)
                    self._known_to_runner.add(s.request_id)
                    out.new_requests.append(self._new_data(s))
                    out.forks.append(Fork(s.request_id, req.request_id))
                    forked.append(s)
                req.siblings = []
        out.num_decodes = num_decodes
        out.num_prefill_tokens = self.max_num_batched_tokens - budget - num_decodes
        self.kv.offload_ahead()   # (the next step's room: its offloads are this step's moves)
        out.kv_moves = self.kv.take_moves()
        if out.chunks:
            self._unread.append(samplers + forked)
        return out

    def _waits_for_load(self, req: Request) -> bool:
        """Admitting req (its room for the next chunk just made), whose cached prefix stopped
        loading back from the host for room that the next step brings (what eviction freed is
        being copied this step: KVCacheManager.load_room_arrives): it waits a step for the rest
        rather than computing it again, MAX_LOAD_WAITS times at most in its life, so it cannot
        wait forever. The room taken for its chunk goes back at once with its table."""
        if req.num_load_waits >= self.MAX_LOAD_WAITS or not self.kv.load_room_arrives(
                req.request_id):
            return False
        req.num_load_waits += 1
        return True

    @staticmethod
    def _waits_for_host(req: Request) -> bool:
        """A sequence with a token still on the device that is not scheduled again until the
        host has it: it may end there by length (no chunk past a request's end), or it holds
        its KV for a consumer when it finishes (which must then cover its prompt only)."""
        return (req.hold_kv or len(req.output_token_ids) + req.num_pending >= req.params.max_tokens
                or req.num_total_tokens >= req.max_model_len)

    @staticmethod
    def _new_data(req: Request) -> NewRequestData:
        return NewRequestData(req.request_id, req.prompt_token_ids, req.params, req.seed,
                              list(req.output_token_ids))

    def update(self, sampled: dict[str, int]) -> list[Request]:
        """Apply the results of the oldest scheduled step with chunks that has not been updated
        (steps are updated in the order they were scheduled; steps without chunks are not).
        Returns the sequences that got a new token; a sequence that finished (stopped,
        aborted) since that step was scheduled gets nothing. A preempted one keeps its token
        (computed before its blocks were freed)."""
        got: list[Request] = []
        if not self._unread:   # (a step without chunks: nothing to apply)
            return got
        for req in self._unread.popleft():
            if req.status.finished:
                continue
            req.num_pending -= 1
            req.append_output(sampled[req.request_id])
            got.append(req)
        return got

    def pending_samplers(self) -> Iterator[Request]:
        """The sequences that sample in the steps scheduled but not updated yet (walked in place:
        the engine core asks every step)."""
        return chain.from_iterable(self._unread)

    def check_integrity(self) -> None:
        coord = self.kv_coordinator
        self.kv.check_integrity([] if coord is None else coord.held_tables())
        held = set(self.kv.block_tables)
        live = {r.request_id for r in self.running}
        if coord is not None:
            live |= set(coord.loading)
        assert held <= live, f"block tables held by non-running requests: {held - live}"
        swapped = {r.request_id for r in self.waiting if r.status is RequestStatus.SWAPPED}
        assert set(self.kv.host_tables) == swapped, "host tables vs swapped requests"
        assert all(r.status is RequestStatus.RUNNING for r in self.running), "running status"
        assert self.num_preemptions == self.num_swap_preemptions + self.num_recompute_preemptions
        assert self._num_seq_slots_used() <= self.max_num_seqs
        unread = collections.Counter(self.pending_samplers())   # (by object: ids are reused)
        for r in self.requests.values():
            assert r.num_pending == unread[r], f"{r.request_id}: pending tokens"
            assert r.num_computed_tokens <= r.num_total_tokens, f"{r.request_id}: computed"
