"""The discrete-event loop: the real engine core (Scheduler, KVCacheManager with its prefix
cache, KVCoordinator, OutputProcessor without a tokenizer: token-id prompts) on every simulated
worker over a cost-model runner (runner.py), and the real router core with the real policies
placing each request; time is simulated.

    arrival (the workload's offsets) ─(+ serving_overhead_ms)─> RouterCore.add ─> Send ─>
        EngineCore.add_requests
    a worker with work steps: EngineCore.step() at its start time; the runner advances the
        worker's clock by the step's cost; its outputs reach the router core when it ends:
        output ─> Deliver (a request's end), observe (stats, step records),
        loads_done (KV pulls that ended), flush_handoffs ─> Send to decode workers
    Release ─> release_kv on the producer; Abort ─> abort_request

Token times: every token reaches the client when its step ends (with an API model: when the API
process has delivered it, below); the runners record the step ends per sequence (P/D: the
first on the prefill worker, the rest on the decode worker), so the requests go to the router
core final-only (a load-aware policy still follows every token).
Streaming every token through the router core gives the same runs, slower.

The serving path (HTTP, the API, IPC to and from the worker, SSE, the client: the profile's
serving_overhead_ms, measured on a lone request) is spent before the router: a request reaches
the router core that long after its arrival, and its TTFT and e2e count from the arrival, so a
lone request's TTFT is the overhead plus its prefill and queues form behind the router as they
would. (A multi-turn conversation's next turn is sent when the answer has ended and pays it
again.) The same serving path spends host work on every step of the served engine (output
processing, streaming each sequence's token: the profile's serving_host_ms, measured on b
requests at once): with serving_floor on, a step of s sequences takes at least
served_step_floor_ms(s) (runner.py).

The serving front's own CPU (api_cost_ms given: the profile's, measured on the `pdserve serve`
process): one API process for the whole deployment, a FIFO server of CPU work on the simulated
clock (api_process.py). Then a request's arrival is an event of its own: at its arrival time it
queues its admission on the API, and reaches the router when that is done plus what the
overhead holds beyond it (ApiProcess.admit). When a step ends, if it sampled any token, the
API decodes its worker's message (one charge per step) and then each token goes to it (a write
of its own, or joining its stream's write that has not started yet: ApiProcess.step), before
the step's outputs reach the router core
(so a conversation's next turn leaves when its answer's last token is delivered); the client's
token times (TTFT, ITL, e2e, a request's completion) are the deliveries. Since every event is
handled at its time and in time order, the API sees its work in time order: admissions and
deliveries delay each other as in one Python process. The engine is not held back by it.

Events are ordered by time, then by the order they were made (a heap; deterministic). A worker
runs one step at a time; between steps it takes what the router sent it meanwhile (as a
worker process takes its messages at a step boundary). A step without chunks costs nothing
(host-tier copies it carries run on the copy stream, runner.py) and, if it moved host-tier
blocks, the worker steps again at once; a worker whose only work is KV in flight sleeps until
the first load ends. The engine cores run
synchronously (async_scheduling off: with no device there is nothing to overlap; the
scheduler's decisions are those of a synchronous engine). pipelined_pickup=True models what
async scheduling does to admissions (a request reaching a busy worker joins the step after the
next); its other effect, steps at the device's time, is the profile's (device_time_profile).

P/D: the prefill worker runs max_tokens=1 with kv_hold (the router core does that), the
decode worker's EngineCore has a KV coordinator, and its runner's loads end transfer_ms(tokens)
after they start (one-sided: the consumer pulls, as the "shared" connector does).
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

from ..config import EngineConfig
from ..engine.core import EngineCore
from ..engine.request import sequence_id
from ..outputs import RequestOutput, request_phases
from ..perf.cost_profile import deployment_graph_sizes
from ..perf.metrics import RequestResult
from ..protocol import AddRequest, WorkerStats
from ..routing import actions as act
from ..routing.router_core import RouterCore, summarize_steps
from ..sampling_params import SamplingParams
from .api_process import ApiProcess
from .runner import SIM_TOKEN_ID, CostModelRunner, SimClock

# multi-turn with retokenized answers: an answer comes back in the next turn's history as one
# token more than it had, all of this id (any id but the engine's own, SIM_TOKEN_ID): a text
# tokenized again rarely keeps its ids, its count, or the block alignment of what follows
RETOKENIZED_ID = SIM_TOKEN_ID + 1

# the loop's events, in the heap as (time, order made, kind, arg)
_ADD = 0            # requests reach the router core
_STEP_END = 1       # a worker's step ended
_WAKE = 2           # a worker wakes for its KV loads
_ADMIT = 3          # a request reaches the API process (with an API model)

class ServingPath(NamedTuple):
    """The measured serving path's terms a run uses: the profile's serving overhead (ms before
    the router), served-step floor (serving_host_ms) and API process costs (api_cost_ms); 0,
    {} and {} for none."""
    overhead_ms: float
    host_ms: dict
    api_cost_ms: dict


def serving_path(profile, on: bool) -> ServingPath:
    """What `profile`'s serving path gives a run: all of it (--serving-overhead, simulate's and
    plan's default) or none of it (--no-serving-overhead)."""
    if not on:
        return ServingPath(0.0, {}, {})
    return ServingPath(profile.serving_overhead_ms, dict(profile.serving_host_ms),
                       dict(profile.api_cost_ms))


_PART = re.compile(r"(\d+)([PDC])", re.IGNORECASE)
_ROLE = {"P": "prefill", "D": "decode", "C": "collocated"}


@dataclass(frozen=True)
class Deployment:
    prefill: int = 0
    decode: int = 0
    collocated: int = 0

    def __post_init__(self):
        for k in ("prefill", "decode", "collocated"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"deployment: {k} must be an integer >= 0, got {v!r}")
        if self.prefill + self.decode + self.collocated == 0:
            raise ValueError("deployment: no workers")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("deployment: prefill workers need decode workers and vice versa "
                             f"(got {self.label})")

    @property
    def label(self) -> str:
        parts = []
        if self.prefill or self.decode:
            parts.append(f"{self.prefill}P{self.decode}D")
        if self.collocated:
            parts.append(f"{self.collocated}C")
        return "+".join(parts) or "0"

    def workers(self) -> list[tuple[str, str]]:
        """(name, role) of each worker: p0.., d0.., c0.."""
        return ([(f"p{i}", "prefill") for i in range(self.prefill)]
                + [(f"d{i}", "decode") for i in range(self.decode)]
                + [(f"c{i}", "collocated") for i in range(self.collocated)])


def parse_deployment(text: str) -> Deployment:
    """"2P2D", "4C", "1P1D+2C" (counts then roles P, D, C; parts joined by '+')."""
    s = str(text).strip()
    counts = {"P": 0, "D": 0, "C": 0}
    if not s:
        raise ValueError("deployment: empty string (e.g. 2P2D, 4C, 1P1D+2C)")
    for part in s.split("+"):
        part = part.strip()
        if not part or _PART.sub("", part):
            raise ValueError(f"unknown deployment {text!r}: expected counts and roles such as "
                             "2P2D, 4C or 1P1D+2C (P prefill, D decode, C collocated)")
        for n, role in _PART.findall(part):
            counts[role.upper()] += int(n)
    return Deployment(counts["P"], counts["D"], counts["C"])


@dataclass(frozen=True)
class SimRequest:
    """One request of a simulated run: token-id prompt, output length (ignore_eos), offset."""
    prompt_token_ids: list[int]
    output_len: int
    arrival: float          # seconds from the start of the run


@dataclass(frozen=True)
class SimConversation:
    """A multi-turn chat of a simulated run, as `bench serve --dataset-name multi-turn` plays
    one: it starts at `start` (s), turn k is sent when the answer to turn k - 1 has reached
    the client, think_s[k] seconds later (empty: at once), and its prompt is the conversation so
    far: the system prompt, then each earlier turn's user message and answer (the tokens the
    simulated engine produced), then this turn's message (token ids; no chat template around
    them)."""
    start: float
    system: list[int]
    user_messages: list[list[int]]
    output_lens: list[int]
    think_s: tuple[float, ...] = ()

    def __post_init__(self):
        if not self.user_messages or len(self.user_messages) != len(self.output_lens):
            raise ValueError("conversation: need one output length per user message, and at "
                             f"least one turn (got {len(self.user_messages)} messages, "
                             f"{len(self.output_lens)} output lengths)")
        if self.think_s and (len(self.think_s) != len(self.user_messages)
                             or not all(t >= 0 for t in self.think_s)):
            raise ValueError("conversation: think_s needs one pause >= 0 s per turn, got "
                             f"{list(self.think_s)!r} for {len(self.user_messages)} turns")


@dataclass
class SimWorker:
    name: str
    role: str
    clock: SimClock
    runner: CostModelRunner
    core: EngineCore
    busy: bool = False
    wake_at: float | None = None
    deferred: list = field(default_factory=list)   # Sends held for the step after next


@dataclass
class _Track:
    arrival: float
    first: float | None = None
    last: float | None = None
    seen: int = 0
    itl: list[float] = field(default_factory=list)
    done: bool = False
    error: str = ""
    # multi-turn: (conversation index, turn, prompt token ids) of this request
    turn: tuple[int, int, list[int]] | None = None
    cached: int | None = None       # prompt tokens the engine found cached (usage's)
    # (its arrival at the router, queue s, prefill s): the engine's times of it (request_phases)
    phases: tuple[float, float, float] | None = None


@dataclass
class SimResult:
    results: list[RequestResult]
    duration: float                 # s, first arrival to last completion (simulated)
    facts: dict[str, Any]


class Simulator:
    """One deployment, simulated. profiles: role -> CostProfile ("default" for the rest);
    config: the engine options every worker takes (budgets, blocks, prefix caching; its
    async_scheduling is ignored: the simulated cores run synchronously); policy: a name or a
    RoutingPolicy instance (the adaptive policy with a CostModel over the profile).

    pipelined_pickup: what async scheduling does to a request's start. A worker under async
    scheduling schedules step N+1 as soon as step N is launched, so requests that reach it while
    N runs can join N+2 at the earliest (a sync worker takes them into N+1). With it on, requests
    sent to a busy worker are handed to its core right after its next step starts (an idle
    worker takes them at once, as both kinds do). Pair it with a device-time profile
    (perf.cost_fit.device_time_profile): the step period under async scheduling.

    serving_overhead_ms: the time from a request's arrival to the router (the module docstring;
    a profile's serving_overhead_ms; 0: arrivals reach the router at once). serving_floor: every
    worker's steps take at least its profile's served-step floor (runner.py; off: the steps'
    costs alone). api_cost_ms: the serving front's CPU costs (a profile's api_cost_ms), one API
    process for the whole deployment that admits requests and delivers tokens (the module
    docstring; {} or None: none, tokens reach the client when their step ends).

    num_host_blocks: each worker's KV host tier (0: none), as a served worker's --swap-space
    gives it: the real engine offloads, loads back and swaps as it would, and its stats carry
    the host tier's counters. host_copy_gb_per_s: the tier's copy rate (GB/s; 0: the copies
    take no simulated time): each step's moves (offloads, load-backs, swaps) run on a copy
    stream beside its forward and the next forward waits for them (runner.py); the engine
    core gets the rate and the block's bytes (block_size * the profile's kv_bytes_per_token)
    for its swap-or-recompute rule, as a served worker gets its measured rate."""

    def __init__(self, deployment: Deployment, profiles: Mapping[str, Any], config: EngineConfig,
                 num_kv_blocks: int, max_model_len: int, policy, vocab_size: int = 32000,
                 *, pipelined_pickup: bool = False, serving_overhead_ms: float = 0.0,
                 num_host_blocks: int = 0, retokenized_answers: bool = False,
                 host_copy_gb_per_s: float = 0.0, serving_floor: bool = False,
                 api_cost_ms: Mapping[str, float] | None = None):
        if "default" not in profiles and any(r not in profiles for _, r in deployment.workers()):
            raise ValueError("profiles: give a 'default' profile or one per role")
        if not isinstance(num_kv_blocks, int) or num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be a positive integer, got {num_kv_blocks!r}")
        if isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, int) \
                or num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be an integer >= 0, got {num_host_blocks!r}")
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        o = serving_overhead_ms
        if isinstance(o, bool) or not isinstance(o, (int, float)) or not math.isfinite(o) or o < 0:
            raise ValueError(f"serving_overhead_ms must be a finite number >= 0, got {o!r}")
        self.serving_overhead_s = float(o) / 1e3
        self.api = ApiProcess(api_cost_ms) if api_cost_ms else None
        # per sequence: when the client saw each of its tokens (their API deliveries, or without
        # an API model their steps' ends; P/D: the first on the prefill worker), in order
        self._delivered: dict[str, list[float]] = {}
        # multi-turn: the next turn carries each answer as RETOKENIZED_ID tokens, not the
        # engine's (SIM_TOKEN_ID): what a served run sends when the answer's text tokenizes
        # back to other ids (and another count)
        self.retokenized_answers = bool(retokenized_answers)
        self.deployment = deployment
        self.pipelined_pickup = bool(pipelined_pickup)
        self.config = dataclasses.replace(config, async_scheduling=False)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.workers: dict[str, SimWorker] = {}
        pd = deployment.prefill > 0
        for name, role in deployment.workers():
            prof = profiles.get(role, profiles.get("default"))
            clock = SimClock()
            runner = CostModelRunner(prof, clock, self.config.block_size,
                                     host_copy_gb_per_s=host_copy_gb_per_s,
                                     graph_sizes=deployment_graph_sizes(
                                         prof, None, self.config.max_num_batched_tokens),
                                     serving_floor=serving_floor)
            core = EngineCore(self.config, runner, num_kv_blocks=num_kv_blocks,
                              max_model_len=max_model_len, vocab_size=vocab_size,
                              eos_token_ids=(), kv_transfer=pd and role != "collocated",
                              clock=clock, num_host_blocks=num_host_blocks,
                              host_copy_gb_per_s=runner.host_copy_gb_per_s,
                              kv_block_bytes=(runner.block_bytes
                                              if runner.host_copy_gb_per_s > 0 else 0))
            runner.coordinator = core.kv_coordinator
            self.workers[name] = SimWorker(name, role, clock, runner, core)
        # (prefix caching off: the router's prefix index tracks nothing)
        kw = {} if self.config.enable_prefix_caching else {"prefix_tokens": 0}
        self.router = RouterCore([(n, w.role, f"{n}.kv") for n, w in self.workers.items()],
                                 policy, max_model_len, **kw)
        self.router.two_sided = False
        self._heap: list = []
        self._seq = 0
        self.now = 0.0
        self.num_events = 0
        self._dirty: dict[str, SimWorker] = {}
        self._tracks: dict[str, _Track] = {}

    # ---- the loop ------------------------------------------------------------------------
    def _push(self, t: float, kind: int, arg) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, arg))

    def run(self, requests: Sequence[SimRequest], params: SamplingParams | None = None
            ) -> SimResult:
        """Serve `requests` (each with max_tokens = its output_len, ignore_eos, greedy)."""
        wall0, cpu0 = time.perf_counter(), time.process_time()
        self._base = params or SamplingParams(temperature=0.0, ignore_eos=True)
        for i, r in enumerate(requests):
            if not r.arrival >= 0:
                raise ValueError(f"request {i}: arrival must be >= 0 s, got {r.arrival!r}")
            self._arrive(f"r{i}", r.prompt_token_ids, r.output_len, r.arrival)
        self._loop()
        results = [self._result(rid, len(r.prompt_token_ids), r.output_len)
                   for rid, r in zip(self._tracks, requests)]
        return self._finish(results, min(r.arrival for r in requests), wall0, cpu0)

    def run_conversations(self, conversations: Sequence[SimConversation],
                          params: SamplingParams | None = None) -> SimResult:
        """Play multi-turn `conversations` (see SimConversation). Results: one per turn,
        conversation by conversation, with `conversation` and `turn` set; the turns after a
        failed one are failed ("not sent"), as the serving benchmark counts them."""
        wall0, cpu0 = time.perf_counter(), time.process_time()
        self._base = params or SamplingParams(temperature=0.0, ignore_eos=True)
        self._convs = list(conversations)
        for i, c in enumerate(self._convs):
            if not c.start >= 0:
                raise ValueError(f"conversation {i}: start must be >= 0 s, got {c.start!r}")
            self._send_turn(i, 0, list(c.system), c.start)
        self._loop()
        results = []
        for i, c in enumerate(self._convs):
            for k, n_out in enumerate(c.output_lens):
                tr = self._tracks.get(f"c{i}t{k}")
                if tr is None:   # an earlier turn failed
                    r = RequestResult(0, int(n_out), start=c.start, error="not sent: "
                                      "an earlier turn of this conversation failed")
                else:
                    r = self._result(f"c{i}t{k}", len(tr.turn[2]), n_out)
                r.conversation, r.turn = i, k
                results.append(r)
        return self._finish(results, min(c.start for c in self._convs), wall0, cpu0)

    def _arrive(self, rid: str, prompt: Sequence[int], output_len: int, at: float,
                turn: tuple[int, int, list[int]] | None = None) -> None:
        p = dataclasses.replace(self._base, max_tokens=int(output_len))
        self._tracks[rid] = _Track(at, turn=turn)
        if self.api is None:
            reach = at + self.serving_overhead_s
            self._push(reach, _ADD, self._add_request(rid, prompt, p, reach))
        else:   # (its admission queues on the API at its arrival, in time order)
            self._push(at, _ADMIT, (rid, prompt, p))

    @staticmethod
    def _add_request(rid: str, prompt: Sequence[int], p: SamplingParams,
                     reach: float) -> AddRequest:
        # final-only: the user's outputs come when a request ends (a load-aware policy still
        # follows every token: the router core streams them to itself); each token's time is
        # its step's end, which the runners record (what a streaming client sees), or its
        # delivery by the API process
        # (the router stamps a request when it gets it, as the server's does)
        return AddRequest(rid, {"prompt_token_ids": list(prompt)}, p, final_only=True,
                          arrival_time=reach)

    def _send_turn(self, i: int, k: int, history: list[int], at: float) -> None:
        c = self._convs[i]
        prompt = history + list(c.user_messages[k])
        self._arrive(f"c{i}t{k}", prompt, c.output_lens[k], at, (i, k, prompt))

    def _finish(self, results: list[RequestResult], first_arrival: float, wall0: float,
                cpu0: float) -> SimResult:
        ends = [x.latency + x.start for x in results if x.success]
        duration = max(ends) - first_arrival if ends else 0.0
        facts = self._facts(time.perf_counter() - wall0)
        facts["api"] = self.api.facts(duration) if self.api is not None else None
        facts["request_phases"] = self._phase_means()
        facts["cpu_s"] = time.process_time() - cpu0
        return SimResult(results, duration, facts)

    def _loop(self) -> None:
        heap = self._heap
        while heap:
            t, _, kind, arg = heapq.heappop(heap)
            self.now = t
            self.num_events += 1
            if kind == _ADD:        # every request reaching the router now, in one add
                batch = [(arg, None)]
                while heap and heap[0][0] == t and heap[0][2] == _ADD:
                    batch.append((heapq.heappop(heap)[3], None))
                    self.num_events += 1
                self._do(self.router.add(batch))
            elif kind == _STEP_END:
                self._step_ended(*arg)
            elif kind == _ADMIT:
                rid, prompt, p = arg
                reach = self.api.admit(t, len(prompt), self.serving_overhead_s)
                self._push(reach, _ADD, self._add_request(rid, prompt, p, reach))
            else:                   # a worker wakes for its KV loads
                w = arg
                if w.wake_at == t:
                    w.wake_at = None
                    self._dirty[w.name] = w
            while self._dirty:
                dirty, self._dirty = self._dirty, {}
                for w in dirty.values():
                    self._try_step(w)
        self._token_times()

    def _try_step(self, w: SimWorker) -> None:
        """Start w's next step now, if it is idle and has anything to do."""
        if w.busy:
            return
        if not w.core.has_work():
            if not w.deferred:
                return
            self._flush_deferred(w)     # nothing in flight: the requests are taken at once
            if not w.core.has_work():
                return
        w.clock.t = self.now
        outs = w.core.step()
        if w.core.last_step_ran:
            w.busy = True
            self._push(w.clock.t, _STEP_END, (w, outs, w.runner.last_sampled))
            if w.deferred:              # scheduled after this step's launch: the next one
                self._flush_deferred(w)
            return
        # no forward: nothing ran, it cost nothing; KV loads may have ended, or the step moved
        # host-tier blocks only (a swap-out when every sequence was short of blocks: what it
        # frees comes at the next step, which a worker runs at once)
        progressed = self._collect(w, outs) or w.runner.last_moves > 0
        if progressed:
            self._dirty[w.name] = w
            return
        nxt = w.runner.next_load_done()
        if nxt is not None and w.wake_at != nxt:
            w.wake_at = max(nxt, self.now)
            self._push(w.wake_at, _WAKE, w)

    def _flush_deferred(self, w: SimWorker) -> None:
        sends, w.deferred = w.deferred, []
        for a in sends:
            self._do(self.router.accepted(a.batch, w.core.add_requests(a.requests)))

    def _step_ended(self, w: SimWorker, outs: list[RequestOutput], sampled: list[str]) -> None:
        w.busy = False
        # (before the outputs: a finished answer's last token too; a stream is a sequence: the
        # simulator serves n = 1, one SSE stream a request)
        seen = (self.api.step(self.now, sampled) if self.api is not None
                else [self.now] * len(sampled))
        delivered = self._delivered
        for seq, t in zip(sampled, seen):
            ts = delivered.get(seq)
            if ts is None:
                delivered[seq] = [t]
            else:
                ts.append(t)
        self._collect(w, outs)
        self._dirty[w.name] = w

    def _collect(self, w: SimWorker, outs: list[RequestOutput]) -> bool:
        """A step's results to the router core, as the router shell feeds them; True when KV
        loads ended (the worker has new work)."""
        router = self.router
        for out in outs:
            self._do(router.output(w.name, out))
        router.observe(w.name, self._stats(w), w.core.take_step_records())
        events = w.core.take_kv_events()
        if events:
            self._do(router.loads_done(events, w.name))
        if router.handoffs:
            self._do(router.flush_handoffs())
        return bool(events)

    @staticmethod
    def _stats(w: SimWorker) -> WorkerStats:
        return w.core.stats()

    def worker_stats(self) -> dict[str, WorkerStats]:
        """Each worker's stats now (what the router core observed after its last step)."""
        return {name: self._stats(w) for name, w in self.workers.items()}

    def _do(self, actions: list) -> None:
        """Carry out the router core's actions in order (what one leads to comes first)."""
        todo = list(reversed(actions))
        while todo:
            a = todo.pop()
            more: list = []
            if isinstance(a, act.Deliver):
                self._deliver(a.output)
            elif isinstance(a, act.Reject):
                if self.api is not None:
                    self.api.close(sequence_id(a.request_id, 0))
                tr = self._tracks[a.request_id]
                tr.done, tr.error = True, a.error
            else:
                w = self.workers[a.worker]
                w.clock.t = max(w.clock.t, self.now) if not w.busy else w.clock.t
                if isinstance(a, act.Send) and self.pipelined_pickup and w.busy:
                    w.deferred.append(a)
                    continue
                if isinstance(a, act.Send):
                    more = self.router.accepted(a.batch, w.core.add_requests(a.requests))
                elif isinstance(a, act.Release):
                    w.core.release_kv(a.request_ids)
                elif isinstance(a, act.Abort):
                    if w.deferred:      # (requests still held: the core takes them first)
                        self._flush_deferred(w)
                    w.core.abort_request(a.request_ids)
                else:
                    raise TypeError(f"the simulator does not carry out {a!r} (one-sided KV only)")
                self._dirty[w.name] = w
            todo.extend(reversed(more))

    def _deliver(self, out: RequestOutput) -> None:
        if out.finished and self.api is not None:   # (its stream has had its last write)
            self.api.close(sequence_id(out.request_id, 0))
        tr = self._tracks.get(out.request_id)
        if tr is None or tr.done:
            return
        o = out.outputs[0]
        if out.finished:
            tr.seen = len(o.token_ids)
            tr.done = True
            tr.cached = out.num_cached_tokens
            ph = request_phases(out.metrics)
            if ph is not None:
                tr.phases = (out.metrics["arrival"], ph.queue, ph.prefill)
            if out.error or o.finish_reason == "abort":
                tr.error = out.error or "aborted"
            elif tr.turn is not None:   # the next turn goes when the client has the answer
                i, k, prompt = tr.turn
                if k + 1 < len(self._convs[i].user_messages):
                    answer = [RETOKENIZED_ID] * (len(o.token_ids) + 1) \
                        if self.retokenized_answers else list(o.token_ids)
                    seen = self._delivered.get(sequence_id(out.request_id, 0))
                    think = self._convs[i].think_s[k + 1] if self._convs[i].think_s else 0.0
                    self._send_turn(i, k + 1, prompt + answer,
                                    (seen[-1] if seen else self.now) + think)

    def _token_times(self) -> None:
        """Each finished request's token times: when its client saw them (_delivered)."""
        times = self._delivered
        for rid, tr in self._tracks.items():
            ts = sorted(times.get(sequence_id(rid, 0), ()))
            if not tr.done or tr.error or not ts:
                continue
            if len(ts) != tr.seen:
                tr.error = f"simulator: {len(ts)} token times for {tr.seen} tokens"
                continue
            tr.first, tr.last = ts[0], ts[-1]
            tr.itl = [b - a for a, b in zip(ts, ts[1:])]

    def _result(self, rid: str, prompt_len: int, output_len: int) -> RequestResult:
        tr = self._tracks[rid]
        r = RequestResult(prompt_len, int(output_len), start=tr.arrival)
        if tr.done and not tr.error and tr.first is not None:
            r.success = True
            r.output_len = tr.seen
            r.ttft = tr.first - tr.arrival
            r.latency = tr.last - tr.arrival
            r.itl = tr.itl
            r.cached_tokens = tr.cached
        else:
            r.error = tr.error or "not finished (the simulation ran out of events)"
        return r

    def _phase_means(self) -> dict[str, float | None]:
        """The mean phases of the requests that finished, in ms, named as a served run's
        (scripts/tier_report.py phase_summary): admission_ms, the request's arrival to its
        arrival at the router (the API process's queue and admit cost, or the serving
        overhead); server_ttft_ms, from there to its first token's delivery; queue_ms and
        prefill_ms, the engine's (request_phases). None each without a finished request."""
        rows = []
        for tr in self._tracks.values():
            if tr.phases is not None and tr.first is not None and not tr.error:
                reach, queue, prefill = tr.phases
                rows.append((reach - tr.arrival, tr.first - reach, queue, prefill))
        names = ("admission_ms", "server_ttft_ms", "queue_ms", "prefill_ms")
        if not rows:
            return dict.fromkeys(names)
        return {k: 1e3 * sum(col) / len(rows) for k, col in zip(names, zip(*rows))}

    def _facts(self, wall_s: float) -> dict[str, Any]:
        st = self.router.stats
        per = {}
        for n, w in self.workers.items():
            kv = w.core.kv
            per[n] = {"role": w.role, "steps": w.runner.num_steps,
                      "busy_s": w.runner.busy_s, "preemptions": w.core.scheduler.num_preemptions,
                      "kv_loads": w.runner.num_loads, "prefix_cache_hits": kv.prefix_hits,
                      "prefix_cache_queries": kv.prefix_queries,
                      "prefix_cache_host_hits": kv.prefix_host_hits,
                      "blocks_offloaded": kv.blocks_offloaded,
                      "blocks_loaded_back": kv.blocks_loaded_back,
                      "blocks_swapped_out": kv.blocks_swapped_out,
                      "blocks_copied": w.runner.blocks_copied,
                      "host_copy_runs": w.runner.copy_runs,
                      "host_copy_s": w.runner.copy_s,
                      "host_copy_wait_s": w.runner.copy_wait_s,
                      "served_floor_steps": w.runner.floor_steps,
                      "served_floor_s": w.runner.floor_s}
        return {"simulated_s": self.now, "events": self.num_events, "wall_s": wall_s,
                "requests": dict(st.requests), "transfers": st.transfers,
                "transfer_bytes": st.transfer_bytes, "transfer_seconds": st.transfer_seconds,
                "transfer_failures": st.transfer_failures, "workers": per,
                # (as a served run's step counters give them: scripts/tier_report.py)
                "steps": summarize_steps(st.steps)}
