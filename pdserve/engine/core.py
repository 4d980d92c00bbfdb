"""EngineCore: one engine's request API over an Executor, in plain Python.

    add_request(id, prompt, params)  -> validates, tokenizes, queues (ValueError on bad input)
    step()                           -> schedule -> execute -> update; RequestOutputs of the
                                        requests that advanced (async scheduling: the
                                        update is the previous step's, see below)
    abort_request(id)                -> frees everything the request holds
    has_unfinished_requests()

A user request with n samples is n sequences ("id#0" .. "id#{n-1}", request.sequence_id); the
OutputProcessor's table maps each back to its group. The Scheduler owns batching and blocks,
the KVCoordinator (with a kv_connector) the P/D state, the Executor (the ModelRunner in
process) the tensors, the OutputProcessor detokenization, stops, logprobs and outputs.

Each step with a forward leaves a StepRecord (take_step_records): its prefill/decode mix, the
queue, its wall time and, once the executor's measurement settles (never waited for), the
forward's device time.

Async scheduling (config.async_scheduling, an executor with execute_async): one step stays in
flight between step() calls, so the host's work overlaps the device's:

    step() k:   schedule N+1 ─ start N+1 ─ read N's tokens ─ update, stops, outputs of N ─ return
    device:     ...... N ...............─ N+1 (its pending inputs: N's tokens, on the device)

A sequence that stopped in N already has a chunk in N+1: that token is dropped, its blocks were
freed when it stopped (the device reuses them only after N+1), and its outputs, finish reason
and token counts are those of a synchronous run. A step waits for the one in flight first (a
synchronous step) when the host must know the tokens before it is started: a sequence sampled
in the step in flight has repetition/frequency/presence penalties, or reaches its min_tokens
with that token (the runner builds the next step's penalties and bans from the output history
it keeps on the host). KV pulls need no wait: a connector's copy runs after the work already
queued on the device (connectors/base.py start_load), the step in flight's writes to freed
blocks included.
The scheduler itself holds back a sequence with a pending token that may end by length or that
holds its KV (scheduler.py). The last step drains: when no sequence is left, the step in flight
is read at once; has_unfinished_requests() and has_work() count a step in flight.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from ..config import EngineConfig
from ..outputs import RequestOutput
from ..protocol import (AddRequest, KVDrop, KVLoadDone, KVPeer, KVSend, KVSource, Prompt,
                        StepRecord, WorkerStats, check_token_ids, kv_transfer_unsupported, parse_prompt)
from ..sampling_params import SamplingParams
from .executor import Executor, Ready, StepHandle
from .kv_cache_manager import KVCacheManager
from .kv_coordinator import KVCoordinator
from .output_processor import OutputProcessor
from .request import Request, RequestStatus, sequence_id
from .scheduler import Scheduler, SchedulerOutput

# Settled step records kept for a reader (a worker takes them every step; in process nobody
# may): the newest win.
STEP_RECORDS_KEPT = 4096
# Steps whose device time is not settled yet, at most (an executor that never settles one).
_PENDING_RECORDS = 64


@dataclass
class _Started:
    """A step handed to the executor whose tokens were not applied yet."""
    sched: SchedulerOutput
    handle: StepHandle
    t0: float            # when its schedule() began (perf_counter)
    num_waiting: int     # the queue after its schedule()


class EngineCore:
    """config: the engine's configuration (the scheduler's budgets, the KV timeouts);
    executor: runs the steps; num_kv_blocks / max_model_len: the pool it built; vocab_size and
    eos_token_ids: the model's; tokenizer: None (token ids only) or the request tokenizer.
    kv_transfer: P/D (a kv_connector): build a KVCoordinator (two_sided: the connector's
    producer sends whether or not the consumer still wants the KV). on_schedule: called with
    every SchedulerOutput before this process runs it (a TP driver sends it to the other
    ranks there). clock: the time source for arrivals, output metrics, KV timeouts and step
    durations (None: time.monotonic for the former, time.perf_counter for a step's wall time,
    as a served engine reads them; a simulator passes its simulated clock for all of them).
    Host tier of the KV cache (0: none): num_host_blocks host blocks of kv_block_bytes each
    (one block's KV on one rank), host_copy_gb_per_s the measured copy rate (0.0: unknown);
    config.preemption_mode picks swap or recompute (None: by cost, scheduler.py). The
    scheduler's PrefillRate learns from every step's prefill tokens and wall time; the moves
    ride in SchedulerOutput.kv_moves to the executor unchanged. delta_outputs: step() reports
    deltas, not cumulative outputs (a worker's channel: engine/output_processor.py)."""

    def __init__(self, config: EngineConfig, executor: Executor, *, num_kv_blocks: int,
                 max_model_len: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 tokenizer=None, kv_transfer: bool = False, two_sided: bool = False,
                 on_schedule: Callable[[SchedulerOutput], None] | None = None,
                 clock: Callable[[], float] | None = None, num_host_blocks: int = 0,
                 host_copy_gb_per_s: float = 0.0, kv_block_bytes: int = 0,
                 delta_outputs: bool = False):
        self.config = config
        # the host tier the runner built (0: none), its measured copy rate and one block's bytes
        # on one rank (the scheduler's swap-or-recompute cost rule)
        self.num_host_blocks = num_host_blocks
        self.host_copy_gb_per_s = host_copy_gb_per_s
        self.kv_block_bytes = kv_block_bytes
        self._now = clock or time.monotonic
        self._timer = clock or time.perf_counter
        self.executor = executor
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.num_kv_blocks = num_kv_blocks
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                 num_host_blocks=num_host_blocks, kv_block_bytes=kv_block_bytes,
                                 kv_offload_policy=config.kv_offload_policy)
        self.kv_coordinator = None
        if kv_transfer:
            self.kv_coordinator = KVCoordinator(
                self.kv, config.max_kv_loads, two_sided, config.kv_transfer_timeout_s,
                config.kv_hold_timeout_s)
        # (preemption_mode: an EngineConfig field from the CPU-tier config change; a config
        # without it has no host tier to choose)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.kv_coordinator,
                                   preemption_mode=config.preemption_mode,
                                   host_copy_gb_per_s=host_copy_gb_per_s)
        self.outputs = OutputProcessor(tokenizer, eos_token_ids, max_model_len, delta_outputs)
        self._on_schedule = on_schedule
        self._kv_events: list[KVLoadDone] = []
        self._pending_records: dict[int, StepRecord] = {}
        self._early_times: dict[int, float | None] = {}   # device times of steps not applied yet
        self._records: deque[StepRecord] = deque(maxlen=STEP_RECORDS_KEPT)
        self.last_step_ran = False   # the last step() ran a forward
        self.async_scheduling = config.async_scheduling and hasattr(executor, "execute_async")
        self._in_flight: _Started | None = None
        self.num_sync_steps = 0      # async scheduling: steps that waited for the one in flight

    # ---- requests ---------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return parse_prompt(prompt, self.tokenizer, self.vocab_size)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, final_only: bool = False,
                    kv_hold: bool = False, kv_source: KVSource | None = None) -> None:
        """Queue a request. final_only: step() reports it once, when it finishes, instead of
        after every token (what an offline batch wants; streaming leaves it False).
        P/D: kv_hold keeps its KV when it finishes (the output's kv_transfer says where);
        kv_source continues a request whose prompt KV waits on a producer."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.outputs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n > self.config.max_num_seqs:  # its sequences are admitted together
            raise ValueError(f"n={params.n} is more than max_num_seqs={self.config.max_num_seqs} "
                             "sequences can run at once")
        # (SamplingParams checked that they are integers >= 0; the vocabulary is known here)
        check_token_ids("stop_token_ids", params.stop_token_ids, self.vocab_size)
        if params.logit_bias:
            check_token_ids("logit_bias", params.logit_bias.keys(), self.vocab_size)
        text, ids = self.tokenize_prompt(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             "(room for at least one generated token is needed)")
        done_ids: list[int] = []
        if kv_hold or kv_source is not None:
            self._check_kv_request(ids, params, kv_hold, kv_source)
            if kv_source is not None:
                done_ids = list(kv_source.output_token_ids)
        seqs = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            seqs.append(Request(sequence_id(request_id, i), ids, params, seed, self.max_model_len,
                                output_token_ids=list(done_ids), hold_kv=kv_hold))
        first = seqs[0]
        for s in seqs[1:]:
            s.status = RequestStatus.FORK_PENDING
            first.siblings.append(s)
        if kv_source is not None and not kv_source.lost:
            self.scheduler.add_remote(first, kv_source)
        else:  # (a lost kv_source: computed here from the prompt, after its output tokens)
            self.scheduler.add(first)
        self.outputs.add(request_id, text, ids, params, seqs, final_only,
                         arrival_time or self._now(), done_ids)

    def add_requests(self, requests: list[AddRequest]) -> list[str | None]:
        """Queues each request; returns, per request, None or why it was rejected (the others
        are queued regardless)."""
        errors: list[str | None] = []
        for r in requests:
            try:
                self.add_request(r.request_id, r.prompt, r.params, r.arrival_time, r.final_only,
                                 r.kv_hold, r.kv_source)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        return errors

    def _check_kv_request(self, ids: list[int], params: SamplingParams, kv_hold: bool,
                          kv_source: KVSource | None) -> None:
        if self.kv_coordinator is None and (kv_hold or not kv_source.lost):
            raise ValueError("this engine has no kv_connector: it cannot "
                             + ("hold KV" if kv_hold else "pull KV"))
        why = kv_transfer_unsupported(params)
        if why is not None:
            raise ValueError(why)
        if kv_source is None:
            return
        if kv_source.num_tokens != len(ids):
            raise ValueError(f"kv_source covers {kv_source.num_tokens} tokens; the prompt has "
                             f"{len(ids)}")
        if not kv_source.lost and len(kv_source.block_ids) != self.kv.blocks_for(kv_source.num_tokens):
            raise ValueError(f"kv_source has {len(kv_source.block_ids)} blocks for "
                             f"{kv_source.num_tokens} tokens (block size {self.config.block_size})")
        if not 0 <= kv_source.skip_blocks < max(1, len(kv_source.block_ids)):
            raise ValueError(f"kv_source.skip_blocks is {kv_source.skip_blocks}; it must be at "
                             f"least 0 and less than its {len(kv_source.block_ids)} blocks (the "
                             "last block is always sent)")
        if not kv_source.output_token_ids or not all(
                0 <= t < self.vocab_size for t in kv_source.output_token_ids):
            raise ValueError("kv_source needs the producer's sampled token(s), in the vocabulary")
        if len(ids) + len(kv_source.output_token_ids) >= self.max_model_len:
            raise ValueError("the request does not fit max_model_len here")

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            for req in self.outputs.remove(rid):
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)

    def stats(self, kv_peers: int = 0, kv_broken: int = 0) -> WorkerStats:
        """The engine's state now and its totals since start, as a worker reports them (a
        served worker and a simulated one alike); kv_peers / kv_broken: its connector's."""
        sched, kv = self.scheduler, self.kv
        return WorkerStats(
            len(sched.running), len(sched.waiting), self.num_kv_blocks - kv.num_free_blocks(),
            self.num_kv_blocks, sched.num_preemptions, kv_peers, kv_broken, kv.prefix_queries,
            kv.prefix_hits, kv.num_cached_blocks, num_host_blocks=kv.num_host_blocks,
            num_host_blocks_used=kv.num_host_blocks_used,
            blocks_swapped_out=kv.blocks_swapped_out, blocks_swapped_in=kv.blocks_swapped_in,
            blocks_offloaded=kv.blocks_offloaded, blocks_loaded_back=kv.blocks_loaded_back,
            prefix_host_hits=kv.prefix_host_hits)

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix that no running request uses (they keep theirs until they
        finish); returns the KV blocks that went back to the pool."""
        return self.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """Requests, or a step in flight (async scheduling: the next step() reads it)."""
        return len(self.outputs) > 0 or self._in_flight is not None

    def has_work(self) -> bool:
        """step() has something to do: requests, a step in flight, or KV work (peers, sends,
        verdicts)."""
        return self.has_unfinished_requests() or (self.kv_coordinator is not None
                                                  and self.kv_coordinator.has_work())

    def only_transfers_in_flight(self) -> bool:
        """The last step ran no forward and KV loads are in flight: nothing runs until a pull
        ends (a caller looping on step() should wait a little instead of spinning)."""
        return (not self.last_step_ran and self.kv_coordinator is not None
                and bool(self.kv_coordinator.started))

    # ---- P/D control plane (sequence ids: a P/D request has one sequence, index 0) -----------
    def add_kv_peer(self, peer: KVPeer | KVDrop) -> None:
        """Reach a producer (or drop a dead peer) on every rank with the next step."""
        self._coordinator().add_peer(peer)

    def send_kv(self, sends: list[KVSend]) -> None:
        """Two-sided producer: send held KV to consumers (next step, every rank), then drop the
        hold (KVCoordinator.send_held: a request no longer held is sent as filler, not ok)."""
        coord = self._coordinator()
        for s in sends:
            coord.send_held(sequence_id(s.request_id, 0), s)

    def release_kv(self, request_ids: Iterable[str]) -> None:
        """A producer's held KV is no longer needed (pulled, or the request went elsewhere)."""
        coord = self.kv_coordinator
        if coord is not None:
            for rid in request_ids:
                coord.release_held(sequence_id(rid, 0))

    def expire_held_kv(self, now: float | None = None) -> int:
        """Releases KV held longer than kv_hold_timeout_s (a consumer that never pulled)."""
        if self.kv_coordinator is None:
            return 0
        return self.kv_coordinator.expire_held(self._now() if now is None else now)

    def take_kv_events(self) -> list[KVLoadDone]:
        """The loads that ended since the last call, by request id."""
        out, self._kv_events = self._kv_events, []
        return out

    def _coordinator(self) -> KVCoordinator:
        if self.kv_coordinator is None:
            raise ValueError("this engine has no kv_connector")
        return self.kv_coordinator

    def _finish_loads(self) -> None:
        coord = self.kv_coordinator
        done = coord.poll(self.executor.poll_loads(), self._now())
        if done:
            # (by request id, through the table: the sequences are still live)
            events = [KVLoadDone(self.outputs.request_id_of(d.request_id), d.ok, d.nbytes,
                                 d.seconds, d.error) for d in done]
            self.scheduler.finish_loads(done)
            self._kv_events.extend(events)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the outputs of the requests that advanced. Synchronous: the
        step scheduled here. Async scheduling: the step started by the previous call (this
        call's step stays in flight, see the module docstring)."""
        t0 = self._timer()
        prev, self._in_flight = self._in_flight, None
        if prev is not None and self._needs_tokens_first():
            self._apply(prev)
            prev = None
            self.num_sync_steps += 1
        sched = self.scheduler.schedule()
        num_waiting = len(self.scheduler.waiting)
        if sched.new_requests:
            self.outputs.scheduled((r.request_id for r in sched.new_requests), self._now())
        if self._on_schedule is not None:
            self._on_schedule(sched)
        started = None
        if sched.is_empty:
            self.executor.execute(sched)  # no forward: the KV work and the runner's bookkeeping
        elif self.async_scheduling:
            started = _Started(sched, self.executor.execute_async(sched), t0, num_waiting)
        else:
            started = _Started(sched, Ready(self.executor.execute(sched)), t0, num_waiting)
        self._take_prompt_logprobs()
        coord = self.kv_coordinator
        if coord is not None:
            coord.loads_started(sched.kv_work, self._now())
            if coord.started or coord.unpulled:
                self._finish_loads()
        if prev is not None:
            self._apply(prev)
        if started is not None:
            if self.async_scheduling and self.scheduler.requests:
                self._in_flight = started
            else:  # synchronous, or nothing left to run: its tokens (if any) end here
                self._apply(started)
        self.last_step_ran = not sched.is_empty
        return self.outputs.take_outputs(self._now())

    def _needs_tokens_first(self) -> bool:
        """The runner builds a step's penalties and min_tokens bans from the output tokens it
        knows on the host: a sequence sampled in the step in flight must get that token there
        before its next step is started if it has penalties, or if that token is the one that
        lifts its min_tokens ban (the runner would count one token too few)."""
        for req in self.scheduler.pending_samplers():
            p = req.params
            if not req.status.finished and (
                    p.has_penalty or len(req.output_token_ids) + req.num_pending == p.min_tokens):
                return True
        return False

    def _take_prompt_logprobs(self) -> None:
        """Taken as soon as the executor has them (the ModelRunner: when it starts the step,
        while their sequences are surely live); an aborted request's are dropped."""
        for rid, entries in self.executor.take_prompt_logprobs().items():
            if self.outputs.has_sequence(rid):
                self.outputs.add_prompt_logprobs(rid, entries)

    def _apply(self, started: _Started) -> None:
        """A started step's tokens: the scheduler's update, stops, the outputs and its record."""
        sampled = started.handle.result()
        self._take_prompt_logprobs()
        advanced = self.scheduler.update({k: v.token_id for k, v in sampled.items()})
        now = self._now()
        for req in advanced:
            stop = self.outputs.append(req, sampled[req.request_id], now)
            if stop is not None:
                held = self.scheduler.finish(req, stop.status, now)
                self.outputs.finish(req, stop, held)
        self._record(started, now)

    def _record(self, started: _Started, now: float) -> None:
        """wall_ms: from the step's schedule() to its tokens applied (async: across two
        step() calls)."""
        sched = started.sched
        dec = sched.num_decodes
        wall_s = self._timer() - started.t0
        self.scheduler.prefill_rate.add(sched.num_prefill_tokens, wall_s)
        self._pending_records[sched.step_id] = StepRecord(
            now, sched.num_prefill_tokens, dec, len(sched.chunks) - dec, dec,
            started.num_waiting, wall_s * 1e3)
        self._settle_records()
        if sched.step_id in self._early_times:    # measured before its tokens were applied
            rec = self._pending_records.pop(sched.step_id)
            rec.gpu_ms = self._early_times.pop(sched.step_id)
            self._records.append(rec)
        if len(self._pending_records) > _PENDING_RECORDS:   # never settled: give it up as unmeasured
            oldest = next(iter(self._pending_records))
            self._records.append(self._pending_records.pop(oldest))

    def _settle_records(self) -> None:
        for step_id, ms in self.executor.take_gpu_times().items():
            rec = self._pending_records.pop(step_id, None)
            if rec is not None:
                rec.gpu_ms = ms
                self._records.append(rec)
            else:  # async scheduling: a step in flight, its record comes when it is applied
                self._early_times[step_id] = ms
                if len(self._early_times) > _PENDING_RECORDS:
                    del self._early_times[next(iter(self._early_times))]

    def take_step_records(self) -> list[StepRecord]:
        """The records of the steps whose device time settled since the last call, oldest
        first (a step still on the device comes with a later call)."""
        self._settle_records()
        out = list(self._records)
        self._records.clear()
        return out

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
