"""The simulator's executor: a cost-model runner in place of the model. It runs no forward; it
returns a token for every chunk that samples and advances its worker's simulated clock by what
the profile says the step costs, from the step's own mix:

    prefill tokens n (chunks that are not single-token decodes), decoding sequences b, and the
    sum of their contexts S (each decode chunk's position + 1):
        b == 0          prefill_ms(n)         (a lone prefill)
        n == 0          decode_ms(b, S)
        otherwise       mixed_ms(b, S, n)
    with the step's longest sequence (a decode's position + 1, a chunk's end) for the decode
    part's split term: the attention kernel splits keys once any sequence in the step is long
    enough, whatever the mean.

at the step's shape (perf/cost_profile.step_cost_ms): with a profile whose terms are per CUDA
graph shape (graph_padded), n is padded to the deployment's graph bucket (graph_sizes: the
buckets of its token budget, cost_profile.deployment_graph_sizes), as the ModelRunner replays it.

Served-step floor (serving_floor on: the simulator's serving path, as the profile measured it
through `pdserve serve`): a served step also waits for the server's host work, which grows with
the sequences in the step (output processing, detokenizing and streaming each one's token, IPC)
and which the step costs above, timed on a bare engine, do not hold. With s = len(chunks) (every
sequence the step feeds, prefill chunks and decodes alike):

    step_ms = max(the cost above, profile.served_step_floor_ms(s))

(served_step_floor_ms: serving_host_ms' fixed_ms + per_seq_ms * s; 0 without the term). The
runner counts the steps the floor lengthened and the time it added; the step's device time
(take_gpu_times) stays the cost above.

P/D: a consumer's KV loads (the step's kv_work) start when the step starts and end
transfer_ms(tokens) later on the same clock (tokens: what the load moves, the source's
positions past the blocks this worker already had cached); poll_loads reports those that
have ended by the clock's time.

Host tier (the step's kv_moves: prefix-cache offloads and load-backs, swap-outs and swap-ins,
all alike): a step's copies run on a copy stream beside its forward and the next step's forward
waits for them, as the ModelRunner queues them on a GPU (worker/kv_host_tier.py: apply() queues
step N's copies after the work already on the compute stream, the forward of N does not wait for
them, begin_step() makes step N + 1's compute wait for them; the sampled tokens wait only for
the forward). On the simulated clock, with host_copy_gb_per_s > 0:

    start_N  = max(clock, copies_end_{N-1})          the forward (and step N's copies) start
    end_N    = start_N + step_ms(N)                  its tokens' time; the clock moves here
    copies_end_N = start_N + copy_ms(N)              copy_ms = blocks moved (to_host + to_device)
                                                     * block_size * kv_bytes_per_token
                                                     / host_copy_gb_per_s

so copies no longer than their step's forward cost nothing, and longer ones delay the next
step's forward by the difference. (kv_bytes_per_token is one rank's, as the profiler measures
it: under TP every rank moves its own share at this rate at once.) A step without chunks (moves only) starts its copies at
max(clock, copies_end) and ends at once. 0 (the default here): the copies take no time.
Leaves out: the copy stream's gathers taking SMs from the forward, and the rate's dependence
on the step's move count and host-id runs (one rate for all). Plain Python.
"""
from __future__ import annotations

import heapq
import math
from typing import Sequence

from ..engine.block_pool import host_runs
from ..engine.executor import SampledToken
from ..engine.scheduler import SchedulerOutput
from ..perf.cost_profile import step_cost_ms
from ..protocol import KVLoadDone

# What every sampled position gets: a fixed id (requests run with ignore_eos and fixed
# max_tokens, as the serving benchmark sends them, so the value never matters).
SIM_TOKEN_ID = 1


class SimClock:
    """A worker's simulated time in seconds: the loop sets it, the runner advances it, the
    engine core reads it (EngineCore(clock=...))."""
    __slots__ = ("t",)

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class CostModelRunner:
    """An Executor whose steps take the profile's time on `clock`. coordinator: the engine
    core's KVCoordinator (a P/D consumer: where a load's token count is read), else None.
    host_copy_gb_per_s: the host tier's copy rate (GB/s, both ways; 0: copies are free), see
    the module docstring. graph_sizes: the deployment's graph buckets (empty: steps at their
    own token counts). serving_floor: a step takes at least the profile's served-step floor
    (the module docstring)."""

    def __init__(self, profile, clock: SimClock, block_size: int, token_id: int = SIM_TOKEN_ID,
                 host_copy_gb_per_s: float = 0.0, graph_sizes: Sequence[int] = (),
                 serving_floor: bool = False):
        r = host_copy_gb_per_s
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0:
            raise ValueError(f"host_copy_gb_per_s must be a finite number >= 0, got {r!r}")
        self.host_copy_gb_per_s = float(r)
        self.profile = profile
        self.graph_sizes = list(graph_sizes)
        self.serving_floor = bool(serving_floor)
        self.clock = clock
        self.block_size = block_size
        self.token = SampledToken(token_id, None, None)
        self.coordinator = None
        self._prompt_len: dict[str, int] = {}
        self._gpu_times: dict[int, float | None] = {}
        self._loads: list[tuple[float, int, str, int, float]] = []   # (done, seq, rid, bytes, s)
        self._load_seq = 0
        self._done: list[KVLoadDone] = []
        self.num_steps = 0
        self.busy_s = 0.0
        self.num_loads = 0
        self.last_step_ms = 0.0
        # the served-step floor: steps it lengthened, and the time it added to them (s)
        self.floor_steps = 0
        self.floor_s = 0.0
        # host tier: when the copy stream has run every move queued (s), its busy time, the time
        # forwards waited for it, and the blocks it moved
        self.copies_end = 0.0
        self.copy_s = 0.0
        self.copy_wait_s = 0.0
        self.blocks_copied = 0
        self.copy_runs = 0         # of them, runs of consecutive host ids (a step, a direction)
        self.last_moves = 0        # blocks the last step moved (a step of moves only progressed)
        # the sequences the last step sampled a token for, in the step's chunk order (forks
        # last): what the simulator's API process streams when the step ends
        self.last_sampled: list[str] = []

    def floor_ms(self, sched: SchedulerOutput) -> float:
        """The served-step floor of `sched` (ms); 0 when off or for a step without chunks."""
        if not self.serving_floor or not sched.chunks:
            return 0.0
        return self.profile.served_step_floor_ms(len(sched.chunks))

    def device_ms(self, sched: SchedulerOutput) -> float:
        """The profile's cost of `sched` (ms) at its shape (graph_sizes); 0 for a step
        without chunks."""
        if not sched.chunks:
            return 0.0
        plen = self._prompt_len
        b, ctx, longest = 0, 0, 0
        for c in sched.chunks:
            end = c.start_pos + len(c.token_ids)
            longest = max(longest, end)
            if len(c.token_ids) == 1 and c.start_pos >= plen[c.request_id]:
                b += 1
                ctx += end
        return step_cost_ms(self.profile, b, ctx, sched.num_prefill_tokens, self.graph_sizes,
                            longest)[1]

    def copy_ms(self, sched: SchedulerOutput) -> float:
        """The simulated duration of `sched`'s host-tier copies on the copy stream (ms)."""
        m = sched.kv_moves
        if m is None or self.host_copy_gb_per_s <= 0:
            return 0.0
        nbytes = (len(m.to_host) + len(m.to_device)) * self.block_bytes
        return nbytes / (self.host_copy_gb_per_s * 1e6)

    @property
    def block_bytes(self) -> int:
        """One KV block's bytes on one rank (what a host-tier move copies per block)."""
        return self.block_size * self.profile.kv_bytes_per_token

    # ---- Executor ------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> dict[str, SampledToken]:
        for rid in sched.finished_ids:
            self._prompt_len.pop(rid, None)
        for nr in sched.new_requests:
            self._prompt_len[nr.request_id] = len(nr.prompt_token_ids)
        now = self.clock.t
        self.last_sampled = []
        work = sched.kv_work
        if work is not None and work.loads:
            self._start_loads(work.loads, now)
        # (the previous step's copies first: this step's forward and copies wait for them)
        start = max(now, self.copies_end)
        self.last_moves = 0
        if sched.kv_moves is not None:
            m = sched.kv_moves
            self.last_moves = len(m.to_host) + len(m.to_device)
            self.blocks_copied += self.last_moves
            # (the copy engine's DMAs, before its staging chunks cut the longest runs)
            self.copy_runs += (len(host_runs(sorted(h for _, h in m.to_host)))
                               + len(host_runs(sorted(h for h, _ in m.to_device))))
            cs = self.copy_ms(sched) / 1e3
            if cs > 0:
                self.copies_end = start + cs
                self.copy_s += cs
        if not sched.chunks:
            return {}
        dev = self.device_ms(sched)
        ms = max(dev, self.floor_ms(sched))
        if ms > dev:
            self.floor_steps += 1
            self.floor_s += (ms - dev) / 1e3
        self.last_step_ms = ms
        self.num_steps += 1
        self.busy_s += ms / 1e3
        self.copy_wait_s += start - now
        self.clock.t = start + ms / 1e3     # (its tokens' time: the simulator reads it)
        # (the device's share: the floor is the server's host work, not the forward's)
        self._gpu_times[sched.step_id] = dev
        tok = self.token
        sampled = self.last_sampled
        out = {}
        for c in sched.chunks:
            if c.sample:
                out[c.request_id] = tok
                sampled.append(c.request_id)
        for f in sched.forks:
            out[f.request_id] = tok
            sampled.append(f.request_id)
        return out

    def _start_loads(self, loads, now: float) -> None:
        coord, bs = self.coordinator, self.block_size
        for load in loads:
            if not load.dst_block_ids:   # (two-sided receive-and-discard: not simulated)
                continue
            src = coord.sources[load.request_id]
            skipped = (len(src.block_ids) - len(load.src_block_ids)) * bs
            tokens = max(0, src.num_tokens - skipped)
            s = self.profile.transfer_ms(tokens) / 1e3
            self._load_seq += 1
            heapq.heappush(self._loads, (now + s, self._load_seq, load.request_id,
                                         tokens * self.profile.kv_bytes_per_token, s))
            self.num_loads += 1

    def next_load_done(self) -> float | None:
        """When the earliest load in flight ends (None: none in flight)."""
        return self._loads[0][0] if self._loads else None

    def poll_loads(self) -> list[KVLoadDone]:
        now = self.clock.t
        while self._loads and self._loads[0][0] <= now:
            _, _, rid, nbytes, s = heapq.heappop(self._loads)
            self._done.append(KVLoadDone(rid, True, nbytes, s))
        out, self._done = self._done, []
        return out

    def take_prompt_logprobs(self) -> dict:
        return {}

    def take_gpu_times(self) -> dict[int, float | None]:
        out, self._gpu_times = self._gpu_times, {}
        return out
