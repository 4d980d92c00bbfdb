"""`pdserve plan`: which deployment serves a workload best per GPU under SLOs, found with the
simulator (simulator.py) over a step-cost profile, optionally scaled to another GPU.

Goodput (the planner's definition): the largest request rate (req/s, Poisson arrivals of the
workload's N requests, the same seeded requests and arrival pattern at every rate) at which at
least `attainment` (default 90%) of the N requests complete and meet every SLO (perf/slo.py:
TTFT, TPOT, e2e). It is searched on a geometric grid of rates, 2^(k/steps) req/s (steps per
doubling, default 8: ~9% apart), by doubling then bisection, which assumes the attainment falls
with the rate (a noisy run can break that; the answer is then one of the crossings).

Units and copies (the assumption that keeps the search small): a deployment of G GPUs is
G/g copies of a unit of g GPUs (g divides G, g <= --max-unit-gpus), each copy taking rate/k of
a router that splits the load evenly; so the planner simulates one unit at a per-unit rate and
reports goodput(G) = (G/g) * goodput(unit). Units that are themselves copies (2P2D = 2 x 1P1D,
2C = 2 x 1C) are skipped. A pooled deployment balances better than independent copies (a
queue shared by k servers waits less than k queues), so this is a lower bound on it.

    candidate = (unit: counts P/D/C and a TP size per role, chunk = max_num_batched_tokens,
                 routing policy)
    goodput(candidate) = max { rate(k) : attainment(simulate(unit, rate(k))) >= 0.9 }
    best = argmax over candidates of goodput(candidate) / unit GPUs

Every simulation is cached by (candidate, k) (Planner.runs), so SLO sets probing the same rates
share runs.

Profile scaling (scale_profile; each flag names the terms it divides, and why):

    --flops-ratio f          alpha_ms_per_token, prefill_quadratic_ms, gamma_ms_per_token  / f
        (per prompt token: the matmuls, 2 x params FLOPs a token, and attention's quadratic
        part; compute-bound at prefill batch sizes)
    --bandwidth-ratio h      beta_ms (fixed_ms, per_seq_ms_below, per_seq_ms_above,
                             per_context_token_ms, split_ms), prefill_fixed_ms          / h
        (a decode step reads every weight once (fixed) and each sequence's KV (per context
        token); small-batch per-sequence work is memory-bound too; a prefill step's fixed part
        is its weight pass.) Caveat: on the profiled H200 the fixed terms are ~3.5x the weight
        floor (CPU launch overhead, DESIGN.md), which scales with neither ratio; dividing them
        by h overstates what a faster memory buys.
    --interconnect-gb-s B    transfer_gb_per_s := B (the P -> D KV hand-off's bandwidth);
                             transfer_fixed_ms and kv_bytes_per_token are kept.
    batch_threshold (the decode knee) is kept.

TP: only profiles say what a TP size costs. TP 1 is --profile; `--tp-profile 2=FILE` adds a
measured TP-2 profile (its engine_config.tensor_parallel_size, when recorded, must say 2); the
scaling flags apply to every profile. No TP size without a profile is modelled.

Serving path: every simulated request reaches the router the TP-1 profile's
serving_overhead_ms after it arrives, every worker's steps take at least its profile's
served-step floor (serving_host_ms), and one API process per simulated unit (the TP-1
profile's api_cost_ms) admits its requests and delivers its tokens, as in `pdserve simulate`
(--no-serving-overhead: none of them); no scaling flag changes them (host work: HTTP, the
router, IPC, SSE, output processing). A deployment of several copies of a unit is planned as
copies each with its own `pdserve serve` front.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from datetime import datetime
from functools import reduce
from itertools import product
from typing import Any, Mapping, Sequence

from ..config import EngineConfig
from ..perf.cost_profile import CostProfile
from ..perf.slo import meets_slos, parse_goodput
from ..perf.workload import arrival_times
from .simulator import Deployment, SimRequest, Simulator, serving_path

MAX_GPUS = 64
KINDS = ("collocated", "disagg", "mixed")
DEFAULT_CHUNKS = (512, 2048, 8192)
_RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "bench", "results")


# ---- profiles ------------------------------------------------------------------------------
def known_profiles() -> dict[str, str]:
    """Our committed profiles by name: bench/results/profile-<name>.json."""
    try:
        names = sorted(os.listdir(_RESULTS))
    except OSError:
        return {}
    return {n[len("profile-"):-len(".json")]: os.path.join(_RESULTS, n) for n in names
            if n.startswith("profile-") and n.endswith(".json")}


def load_profile(name_or_path: str) -> CostProfile:
    """A committed profile by name (e.g. h200-qwen2.5-1.5b) or a profile file."""
    known = known_profiles()
    if name_or_path in known:
        return CostProfile.from_json(known[name_or_path])
    if os.path.isfile(name_or_path):
        return CostProfile.from_json(name_or_path)
    raise ValueError(f"unknown profile {name_or_path!r}: give a profile file or one of "
                     f"{', '.join(known) or '(none committed)'}")


def _ratio(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    return float(v)


def scale_profile(p: CostProfile, bandwidth_ratio: float = 1.0, flops_ratio: float = 1.0,
                  interconnect_gb_s: float | None = None) -> CostProfile:
    """p on another GPU / interconnect (the module docstring says which term each scales)."""
    h = _ratio("bandwidth ratio", bandwidth_ratio)
    f = _ratio("flops ratio", flops_ratio)
    bw = p.transfer_gb_per_s if interconnect_gb_s is None else _ratio(
        "interconnect bandwidth (GB/s)", interconnect_gb_s)
    if h == 1.0 and f == 1.0 and bw == p.transfer_gb_per_s:
        return p
    return dataclasses.replace(
        p, alpha_ms_per_token=p.alpha_ms_per_token / f,
        prefill_quadratic_ms=p.prefill_quadratic_ms / f,
        gamma_ms_per_token=p.gamma_ms_per_token / f,
        prefill_fixed_ms=p.prefill_fixed_ms / h,
        beta_ms={k: v / h for k, v in p.beta_ms.items()},
        transfer_gb_per_s=bw,
        extra={**p.extra, "scaled": {"bandwidth_ratio": h, "flops_ratio": f,
                                     "interconnect_gb_s": bw, "from_hardware": p.hardware_label}})


def parse_tp_profile(item: str) -> tuple[int, str]:
    """"2=FILE" -> (2, "FILE")."""
    tp, sep, path = item.partition("=")
    try:
        n = int(tp)
    except ValueError:
        n = 0
    if not sep or n < 1 or not path:
        raise ValueError(f"--tp-profile takes TP=FILE with TP an integer >= 1, got {item!r}")
    return n, path


def tp_profiles(base: CostProfile, extra: Sequence[tuple[int, CostProfile]]
                ) -> dict[int, CostProfile]:
    """TP size -> profile: base at TP 1, the --tp-profile ones (checked) at theirs."""
    out = {1: base}
    for tp, prof in extra:
        if tp in out:
            raise ValueError(f"--tp-profile: TP {tp} given twice (TP 1 is --profile)")
        rec = prof.engine_config.get("tensor_parallel_size") if isinstance(
            prof.engine_config, dict) else None
        if rec is not None and rec != tp:
            raise ValueError(f"--tp-profile {tp}=...: the profile was measured at "
                             f"tensor_parallel_size {rec}")
        out[tp] = prof
    return out


# ---- candidates ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Unit:
    """prefill/decode/collocated workers and the TP size of each role's workers."""
    prefill: int = 0
    decode: int = 0
    collocated: int = 0
    tp_prefill: int = 1
    tp_decode: int = 1
    tp_collocated: int = 1

    @property
    def deployment(self) -> Deployment:
        return Deployment(self.prefill, self.decode, self.collocated)

    @property
    def gpus(self) -> int:
        return (self.prefill * self.tp_prefill + self.decode * self.tp_decode
                + self.collocated * self.tp_collocated)

    @property
    def kind(self) -> str:
        if self.prefill and self.collocated:
            return "mixed"
        return "disagg" if self.prefill else "collocated"

    @property
    def label(self) -> str:
        def part(n: int, role: str, tp: int) -> str:
            return f"{n}{role}" + (f"(tp{tp})" if tp > 1 else "")
        parts = []
        if self.prefill:
            parts.append(part(self.prefill, "P", self.tp_prefill)
                         + part(self.decode, "D", self.tp_decode))
        if self.collocated:
            parts.append(part(self.collocated, "C", self.tp_collocated))
        return "+".join(parts)


@dataclass(frozen=True)
class Candidate:
    unit: Unit
    chunk: int                  # max_num_batched_tokens of every worker
    policy: str

    @property
    def label(self) -> str:
        return f"{self.unit.label} chunk {self.chunk} {self.policy}"


def policies_for(kind: str) -> tuple[str, ...]:
    """The routing policies worth searching per kind of unit: one role set has one policy; a
    unit with P/D and collocated workers lets the router choose (adaptive) or alternate."""
    return {"collocated": ("collocated",), "disagg": ("disagg",),
            "mixed": ("adaptive", "round-robin")}[kind]


def units(num_gpus: int, tps: Sequence[int], max_unit_gpus: int,
          kinds: Sequence[str] = KINDS) -> list[Unit]:
    """Every unit of <= max_unit_gpus GPUs whose GPU count divides num_gpus and that is not
    itself k >= 2 copies of a smaller unit, of the given kinds, smallest first."""
    check_gpus(num_gpus)
    cap = min(max_unit_gpus, num_gpus)
    out = []
    for p, d, c in product(range(cap + 1), repeat=3):
        if p + d + c == 0 or bool(p) != bool(d) or reduce(math.gcd, (p, d, c)) != 1:
            continue
        for tp_p, tp_d, tp_c in product(tps if p else (1,), tps if d else (1,), tps if c else (1,)):
            u = Unit(p, d, c, tp_p, tp_d, tp_c)
            if u.kind in kinds and u.gpus <= cap and num_gpus % u.gpus == 0:
                out.append(u)
    return sorted(out, key=lambda u: (u.gpus, KINDS.index(u.kind), u.label))


def check_gpus(num_gpus: Any) -> int:
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or not 1 <= num_gpus <= MAX_GPUS:
        raise ValueError(f"--num-gpus must be an integer from 1 to {MAX_GPUS}, got {num_gpus!r}")
    return num_gpus


# ---- the search ----------------------------------------------------------------------------
def overloaded(results: Sequence, share: float = 0.85, sigmas: float = 3.0) -> bool:
    """A finite run can meet the SLOs at a rate the deployment cannot sustain: the backlog
    grows through the run, and a short run ends before it shows in TTFT or TPOT (a P/D
    request's wait for a decode slot is spread over its TPOT). Overloaded: over the last third
    of the arrival window, the requests completed fall short of those that arrived in it by
    more than (1 - share) of them and by more than `sigmas` x sqrt(arrived) (a stable run, past
    its fill, completes as many as arrive, give or take the counts' Poisson noise: in a window
    of ~100 arrivals a stable run falls 15% short now and then)."""
    t0 = min(r.start for r in results)
    t1 = max(r.start for r in results)
    a = t0 + 2 * (t1 - t0) / 3
    arrived = sum(a < r.start <= t1 for r in results)
    done = sum(r.success and a < r.start + r.latency <= t1 for r in results)
    short = arrived - done
    return short > (1 - share) * arrived and short > sigmas * math.sqrt(arrived)


@dataclass(frozen=True)
class Goodput:
    candidate: Candidate
    rate: float                 # req/s of one unit (0: not even the lowest rate meets the SLOs)
    attainment: float           # at that rate
    next_rate: float            # the grid's next rate, which misses (the bracket's top)
    next_attainment: float

    @property
    def per_gpu(self) -> float:
        return self.rate / self.candidate.unit.gpus


@dataclass
class Planner:
    """Simulates candidates on one workload. `requests`: the pool of (prompt ids, output
    length); a probe at rate r runs its first n(r) = max(min_requests, r * span_s) of them
    (at most the pool), so that the arrivals span at least span_s seconds: a run much shorter
    than a request's stay in the system would hide an overload (every request would arrive
    before the queue builds). span_s None: 20 lone-request latencies of the mean request on
    the TP-1 profile, at least 1 s."""
    profiles: Mapping[int, CostProfile]         # TP size -> profile
    requests: Sequence[tuple[list[int], int]]
    slos: Mapping[str, float]
    min_requests: int = 100
    span_s: float | None = None
    attainment: float = 0.9
    steps_per_doubling: int = 8
    max_num_seqs: int = 256
    block_size: int = 16
    num_kv_blocks: int = 65536
    max_model_len: int | None = None
    enable_prefix_caching: bool = False
    burstiness: float = 1.0
    seed: int = 0
    min_rate: float = 2.0 ** -6
    max_rate: float = 2.0 ** 14
    serving_overhead: bool = True   # requests reach the router the profile's overhead late,
    #                                 steps take at least its served-step floor, and one API
    #                                 process admits requests and delivers tokens
    # (candidate, k) -> that run's RequestResults (token gaps dropped); share one dict only
    # among planners of the same profiles, requests, engine options and serving overhead
    # (e.g. other SLOs)
    runs: dict | None = None

    def __post_init__(self):
        if not self.slos:
            raise ValueError("give at least one SLO (--goodput ttft:MS tpot:MS)")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment!r}")
        if not self.requests:
            raise ValueError("no requests")
        if self.steps_per_doubling < 1:
            raise ValueError("steps per doubling must be >= 1")
        if not 1 <= self.min_requests <= len(self.requests):
            raise ValueError(f"min_requests must be in [1, {len(self.requests)}] (the pool), "
                             f"got {self.min_requests!r}")
        if self.span_s is None:
            n = len(self.requests)
            L = sum(len(p) for p, _ in self.requests) / n
            O = sum(o for _, o in self.requests) / n
            p1 = self.profiles[1]
            lone = p1.prefill_ms(L) + max(O - 1, 0) * p1.decode_ms(1, L + O / 2)
            self.span_s = max(1.0, 20 * lone / 1e3)
        elif not self.span_s > 0:
            raise ValueError(f"span_s must be > 0, got {self.span_s!r}")
        self.short_probes = 0     # probes the pool's size cut below span_s of arrivals
        if self.runs is None:
            self.runs = {}
        self.num_simulations = 0
        self.simulated_requests = 0

    @property
    def serving_path(self):
        """The serving path's terms every run uses (simulate's rule: simulator.serving_path)."""
        return serving_path(self.profiles[1], self.serving_overhead)

    @property
    def serving_overhead_ms(self) -> float:
        """What a request spends before the router in every run."""
        return self.serving_path.overhead_ms

    @property
    def api_cost_ms(self) -> dict:
        """The API process's costs in every run ({}: none)."""
        return self.serving_path.api_cost_ms

    def rate(self, k: int) -> float:
        return 2.0 ** (k / self.steps_per_doubling)

    def probe_size(self, rate: float) -> int:
        return min(len(self.requests), max(self.min_requests, math.ceil(rate * self.span_s)))

    def simulate(self, cand: Candidate, rate: float) -> list:
        """The RequestResults of one run of the workload on one unit at `rate` req/s."""
        reqs = self.requests[:self.probe_size(rate)]
        if len(reqs) < rate * self.span_s:
            self.short_probes += 1
        u = cand.unit
        for tp in {u.tp_prefill, u.tp_decode, u.tp_collocated}:
            if tp not in self.profiles:
                raise ValueError(f"no profile for TP {tp} (give --tp-profile {tp}=FILE)")
        profiles = {"prefill": self.profiles[u.tp_prefill], "decode": self.profiles[u.tp_decode],
                    "collocated": self.profiles[u.tp_collocated]}
        config = EngineConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=cand.chunk,
                              block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                              enable_prefix_caching=self.enable_prefix_caching,
                              skip_tokenizer_init=True, async_scheduling=False)
        longest = max(len(p) + o for p, o in self.requests)
        max_len = self.max_model_len or max(longest, 2)
        sim = Simulator(u.deployment, profiles, config, self.num_kv_blocks, max_len,
                        self._policy(cand, profiles),
                        serving_overhead_ms=self.serving_overhead_ms,
                        serving_floor=self.serving_overhead, api_cost_ms=self.api_cost_ms)
        offsets = arrival_times(len(reqs), rate, self.burstiness, self.seed)
        res = sim.run([SimRequest(p, o, float(t)) for (p, o), t in zip(reqs, offsets)])
        self.num_simulations += 1
        self.simulated_requests += len(reqs)
        return res.results

    def _policy(self, cand: Candidate, profiles: Mapping[str, CostProfile]):
        from ..routing.policies import make_policy
        if cand.policy != "adaptive":
            return make_policy(cand.policy)
        from ..routing.adaptive import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS, AdaptivePolicy
        from ..routing.cost_model import CostModel
        return AdaptivePolicy(CostModel(profiles["collocated"], cand.chunk),
                              self.slos.get("ttft", DEFAULT_SLO_TTFT_MS),
                              self.slos.get("tpot", DEFAULT_SLO_TPOT_MS))

    def attained(self, cand: Candidate, k: int) -> float:
        """The share of requests meeting every SLO at rate(k), 0 when the run is overloaded
        (cached)."""
        key = (cand, k)
        res = self.runs.get(key)
        if res is None:
            res = self.simulate(cand, self.rate(k))
            for r in res:
                r.itl = []
            self.runs[key] = res = (overloaded(res), res)
        over, res = res
        return 0.0 if over else sum(meets_slos(r, self.slos) for r in res) / len(res)

    def _start(self, cand: Candidate) -> int:
        """A first rate near the unit's capacity: each request's prefill alone plus its share
        of 64-sequence decode steps, over the unit's workers (only where the search starts)."""
        u = cand.unit
        prof = self.profiles.get(u.tp_collocated if u.collocated else u.tp_decode)
        if prof is None:
            return 0
        n = len(self.requests)
        L = sum(len(p) for p, _ in self.requests) / n
        O = sum(o for _, o in self.requests) / n
        ms = prof.prefill_ms(L) + O * prof.decode_ms(64, 64 * (L + O / 2)) / 64
        workers = u.collocated + max(u.prefill, u.decode)
        est = 1e3 * workers / ms / 2
        return int(math.floor(self.steps_per_doubling * math.log2(max(est, self.min_rate))))

    def goodput(self, cand: Candidate) -> Goodput:
        """Doubling from a first guess, then bisection on the rate grid."""
        s = self.steps_per_doubling
        kmin = math.floor(s * math.log2(self.min_rate))
        kmax = math.ceil(s * math.log2(self.max_rate))
        ok = lambda k: self.attained(cand, k) >= self.attainment  # noqa: E731
        k = min(max(self._start(cand), kmin), kmax)
        if ok(k):
            lo, hi = k, k + s
            while hi <= kmax and ok(hi):
                lo, hi = hi, hi + s
            if hi > kmax:
                raise ValueError(f"{cand.label}: meets the SLOs even at {self.max_rate:g} req/s "
                                 "(the search's ceiling); are the SLOs meant to be that loose?")
        else:
            lo, hi = k - s, k
            while lo >= kmin and not ok(lo):
                lo, hi = lo - s, lo
            if lo < kmin:
                return Goodput(cand, 0.0, 0.0, self.rate(kmin), self.attained(cand, kmin))
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return Goodput(cand, self.rate(lo), self.attained(cand, lo), self.rate(hi),
                       self.attained(cand, hi))

    def search(self, candidates: Sequence[Candidate]) -> list[Goodput]:
        """Every candidate's goodput, best per GPU first (ties: fewer GPUs per unit)."""
        found = [self.goodput(c) for c in candidates]
        return sorted(found, key=lambda g: (-g.per_gpu, g.candidate.unit.gpus, g.candidate.label))


def candidates(unit_list: Sequence[Unit], chunks: Sequence[int],
               policies: Sequence[str] | None = None) -> list[Candidate]:
    out = []
    for u in unit_list:
        for pol in policies_for(u.kind):
            if policies is not None and pol not in policies:
                continue
            out.extend(Candidate(u, ch, pol) for ch in chunks)
    return out


# ---- the command ---------------------------------------------------------------------------
_WORKLOAD = ("dataset_name", "dataset_path", "vocab_size", "random_input_len", "random_output_len",
             "random_range_ratio", "random_prefix_len", "sharegpt_output_len",
             "prefix_repetition_num_prefixes", "prefix_repetition_prefix_len",
             "prefix_repetition_suffix_len", "prefix_repetition_output_len", "mixed_long_share",
             "mixed_short_input_len", "mixed_short_output_len", "mixed_long_input_len",
             "mixed_long_output_len", "num_prompts", "burstiness", "seed")


def build_parser() -> argparse.ArgumentParser:
    from .cli import add_serving_overhead_arg, add_workload_args
    p = argparse.ArgumentParser(
        prog="pdserve plan",
        description="Search deployments (prefill/decode/collocated counts, TP per role, chunk "
                    "size, routing policy) for the best goodput per GPU under SLOs, with the "
                    "simulator. Goodput: the largest Poisson request rate at which >= "
                    "--attainment of the requests meet every SLO.")
    g = p.add_argument_group("hardware")
    g.add_argument("--num-gpus", type=int, required=True, help=f"GPUs to plan for (1-{MAX_GPUS})")
    g.add_argument("--profile", required=True, metavar="NAME|FILE",
                   help=f"TP-1 step-cost profile: a file or one of ours "
                        f"({', '.join(known_profiles()) or 'none'})")
    g.add_argument("--tp-profile", action="append", default=[], metavar="TP=FILE",
                   help="a measured profile at another TP size (repeatable); only TP sizes "
                        "with a profile are searched")
    g.add_argument("--bandwidth-ratio", type=float, default=1.0,
                   help="target GPU's HBM bandwidth / the profiled one's: divides the decode "
                        "terms (beta_ms) and prefill_fixed_ms")
    g.add_argument("--flops-ratio", type=float, default=1.0,
                   help="target GPU's matmul rate / the profiled one's: divides "
                        "alpha_ms_per_token, prefill_quadratic_ms, gamma_ms_per_token")
    g.add_argument("--interconnect-gb-s", type=float, default=None,
                   help="P->D KV transfer bandwidth: replaces transfer_gb_per_s")
    add_serving_overhead_arg(g)
    g = p.add_argument_group("search")
    g.add_argument("--goodput", nargs="+", required=True, metavar="KEY:MS",
                   help="SLOs: ttft:MS tpot:MS e2el:MS")
    g.add_argument("--attainment", type=float, default=0.9,
                   help="share of requests that must meet the SLOs (default 0.9)")
    g.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    g.add_argument("--policies", nargs="+", default=None,
                   choices=["collocated", "disagg", "adaptive", "round-robin"],
                   help="limit mixed units' policies (default: adaptive and round-robin)")
    g.add_argument("--chunk-sizes", type=int, nargs="+", default=list(DEFAULT_CHUNKS),
                   help="max_num_batched_tokens values to try")
    g.add_argument("--max-unit-gpus", type=int, default=4,
                   help="largest unit simulated (a deployment is copies of a unit)")
    g.add_argument("--steps-per-doubling", type=int, default=8,
                   help="rate grid: 2^(k/steps) req/s")
    g.add_argument("--top", type=int, default=10, help="rows in the table")
    g = p.add_argument_group("engine (per worker)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=65536)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False)
    g = p.add_argument_group("workload (as pdserve simulate)")
    add_workload_args(g)   # (simulate's flags: one source)
    p.set_defaults(num_prompts=1500)
    g.add_argument("--min-prompts", type=int, default=100,
                   help="requests per probe at least; --num-prompts is the most (the pool)")
    g.add_argument("--probe-span-s", type=float, default=None,
                   help="a probe at rate r runs r * this many requests (bounded by the two "
                        "above), so its arrivals span this long (default: 20 lone-request "
                        "latencies of the mean request, at least 1 s)")
    p.add_argument("--result-file", default=None,
                   help="default: bench/results/plan-<gpus>gpu-<timestamp>.json")
    return p


def plan(a: argparse.Namespace) -> dict[str, Any]:
    """Runs the search the flags describe; returns the JSON payload. ValueError on bad input."""
    from .cli import build_requests
    check_gpus(a.num_gpus)
    if a.dataset_name == "multi-turn":
        raise ValueError("pdserve plan takes independent requests; simulate multi-turn "
                         "conversations with pdserve simulate --dataset-name multi-turn")
    slos = parse_goodput(a.goodput)
    if a.min_prompts < 20:
        raise ValueError("--min-prompts must be >= 20 (a 90% share of fewer is too coarse)")
    if a.num_prompts < a.min_prompts:
        raise ValueError(f"--num-prompts ({a.num_prompts}) must be >= --min-prompts "
                         f"({a.min_prompts})")
    if not a.burstiness > 0:
        raise ValueError("--burstiness must be > 0")
    if any(c < 1 for c in a.chunk_sizes):
        raise ValueError("--chunk-sizes must be >= 1")
    if a.max_unit_gpus < 1:
        raise ValueError("--max-unit-gpus must be >= 1")
    scale = dict(bandwidth_ratio=a.bandwidth_ratio, flops_ratio=a.flops_ratio,
                 interconnect_gb_s=a.interconnect_gb_s)
    base = scale_profile(load_profile(a.profile), **scale)
    extra = [(tp, scale_profile(load_profile(path), **scale))
             for tp, path in map(parse_tp_profile, a.tp_profile)]
    profs = tp_profiles(base, extra)
    reqs = build_requests(a)
    planner = Planner(profs, reqs, slos, a.min_prompts, a.probe_span_s, a.attainment,
                      a.steps_per_doubling, a.max_num_seqs, a.block_size, a.num_kv_blocks, None,
                      a.enable_prefix_caching, a.burstiness, a.seed,
                      serving_overhead=a.serving_overhead)
    ul = units(a.num_gpus, sorted(profs), a.max_unit_gpus, a.kinds)
    cands = candidates(ul, sorted(set(a.chunk_sizes)), a.policies)
    if not cands:
        raise ValueError("no candidate deployment (check --kinds, --policies, --max-unit-gpus)")
    print(f"pdserve plan: {len(cands)} candidates ({len(ul)} units x chunk sizes x policies) "
          f"for {a.num_gpus} GPUs, {len(reqs)} {a.dataset_name} requests per probe", flush=True)
    t0 = datetime.now()
    found = planner.search(cands)
    rows = [row(g, a.num_gpus) for g in found]
    return {"benchmark": "plan", "date": datetime.now().isoformat(timespec="seconds"),
            "num_gpus": a.num_gpus, "slos_ms": slos, "attainment": a.attainment,
            "goodput_definition": "the largest Poisson rate on the grid 2^(k/steps) req/s at "
                                  "which >= attainment of the requests meet every SLO; a "
                                  "deployment is num_gpus/unit_gpus copies of a unit",
            "profile": {"model": base.model, "hardware": base.hardware_label,
                        "source": a.profile, "tp_sizes": sorted(profs), **scale,
                        "serving_overhead_ms": planner.serving_overhead_ms,
                        "serving_host_ms": planner.serving_path.host_ms,
                        "api_cost_ms": planner.api_cost_ms},
            "workload": {k: getattr(a, k) for k in _WORKLOAD},
            "best": rows[0], "candidates": rows,
            "search": {"simulations": planner.num_simulations,
                       "probe_span_s": planner.span_s, "min_prompts": a.min_prompts,
                       "max_prompts": len(reqs), "short_probes": planner.short_probes,
                       "simulated_requests": planner.simulated_requests,
                       "wall_s": (datetime.now() - t0).total_seconds()}}


def row(g: Goodput, num_gpus: int) -> dict[str, Any]:
    u = g.candidate.unit
    copies = num_gpus // u.gpus
    return {"unit": u.label, "kind": u.kind, "unit_gpus": u.gpus, "copies": copies,
            "chunk": g.candidate.chunk, "policy": g.candidate.policy,
            "unit_goodput_rps": g.rate, "goodput_rps": g.rate * copies,
            "goodput_per_gpu_rps": g.per_gpu, "attainment": g.attainment,
            "next_rate_rps": g.next_rate, "next_attainment": g.next_attainment}


def format_rows(rows: Sequence[Mapping[str, Any]], top: int) -> str:
    head = (f"{'rank':>4}  {'deployment':<22} {'chunk':>6} {'policy':<12} {'goodput/GPU':>11} "
            f"{'goodput':>9} {'attain':>6}")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows[:top], 1):
        dep = f"{r['copies']} x {r['unit']}" if r["copies"] > 1 else r["unit"]
        lines.append(f"{i:>4}  {dep:<22} {r['chunk']:>6} {r['policy']:<12} "
                     f"{r['goodput_per_gpu_rps']:>11.3f} {r['goodput_rps']:>9.3f} "
                     f"{r['attainment']:>6.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ..perf.files import write_json
    argv = sys.argv[1:] if argv is None else list(argv)
    p = build_parser()
    a = p.parse_args(argv)
    try:
        payload = plan(a)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    payload["command"] = ["pdserve", "plan", *argv]
    print(format_rows(payload["candidates"], a.top))
    b = payload["best"]
    s = payload["search"]
    dep = f"{b['copies']} x {b['unit']}" if b["copies"] > 1 else b["unit"]
    print(f"best: {dep} (chunk {b['chunk']}, {b['policy']}): "
          f"{b['goodput_rps']:.3f} req/s on {a.num_gpus} GPUs ({b['goodput_per_gpu_rps']:.3f} "
          f"per GPU); {s['simulations']} simulations in {s['wall_s']:.1f} s")
    if s["short_probes"]:
        print(f"note: {s['short_probes']} probes ran the whole pool of {s['max_prompts']} "
              f"requests, under {s['probe_span_s']:.2f} s of arrivals (raise --num-prompts)")
    out = a.result_file or (f"bench/results/plan-{a.num_gpus}gpu-"
                            f"{datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    print("wrote", write_json(out, payload, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
