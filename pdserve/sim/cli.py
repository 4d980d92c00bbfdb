"""`pdserve simulate`: a serving benchmark run on the simulator instead of a server. The same
workload flags, JSON fields and table as `pdserve bench serve`, from the real engine core and
router core on a simulated clock over a step-cost profile (`pdserve profile`).

Each rate of a sweep is simulated on a fresh deployment (empty caches). Every request runs
with max_tokens = its dataset output length, ignore_eos, greedy; a token reaches the client
when its step ends (TTFT, ITL and e2e from those times, as a streaming client measures them). Text prompts (ShareGPT)
become seeded random token ids of their approximate length (the simulator has no tokenizer).
The simulated cores run without async scheduling; --async-scheduling models its two effects on
timing (steps at the device's time, requests joining the step after the next). A request
reaches the router the profile's serving_overhead_ms after it arrives (the serving path `pdserve
profile` measured: HTTP, the router, IPC, SSE, the client), and every step takes at least the
profile's served-step floor (serving_host_ms: the same server's host work per step, fixed +
per sequence, measured on batches of streams at once), and the serving front's own CPU
(api_cost_ms: the `pdserve serve` process's per request, per prompt token, per engine step
that sampled tokens, per SSE write and per streamed token) runs on one simulated API process
for the whole deployment, a FIFO queue that admits every request and writes every stream's
tokens, several to a write when it lags (sim/api_process.py: at overload it delays first
tokens and completions); --no-serving-overhead turns all three off (requests reach the router
at once, steps take their costs alone, a token reaches the client when its step ends).
Per-role profiles (--prefill-profile ...)
stand for a different TP size or GPU per role; the adaptive policy's cost model uses --profile.

Determinism: the same flags and seed give the same "runs" (and the same file but for "date"
and "simulation_wall", the host's facts)."""
from __future__ import annotations

import argparse
import math
import sys
from datetime import datetime
from typing import Any

import numpy as np

from ..config import KV_OFFLOAD_POLICIES, EngineConfig
from ..perf.cost_profile import CostProfile
from ..perf.files import read_json_object, write_json
from ..perf.metrics import compute_metrics
from ..perf.slo import parse_goodput
from ..perf.workload import (add_multi_turn_args, arrival_times, load_sharegpt,
                             mixed_requests, multi_turn_conversations,
                             prefix_repetition_requests, random_requests)
from .simulator import (Deployment, SimConversation, SimRequest, Simulator, parse_deployment,
                        serving_path)

DEFAULT_NUM_KV_BLOCKS = 65536
# The host tier's copy rate a run assumes (GB/s): the low end of what kv_host_tier.py moved on one
# H200 with 64 to 1,024 blocks per step (bench/results/kv-tier-h200.json: 28.8-34.5 GB/s with
# scattered host ids, 41-45.5 with consecutive ones), so a host tier is not predicted faster than
# it runs; 0 makes the copies free (the simulator before this flag).
DEFAULT_HOST_COPY_GBPS = 30.0


def add_workload_args(g) -> None:
    """The workload's flags (load and dataset), shared by simulate and plan."""
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times (1 = Poisson)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dataset-name", default="random",
                   choices=["random", "sharegpt", "prefix-repetition", "multi-turn", "mixed"])
    g.add_argument("--dataset-path", default=None, help="sharegpt: the JSON file")
    g.add_argument("--vocab-size", type=int, default=32000)
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--random-prefix-len", type=int, default=0)
    g.add_argument("--sharegpt-output-len", type=int, default=None)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)
    add_multi_turn_args(g)
    g.add_argument("--mixed-long-share", type=float, default=0.2)
    g.add_argument("--mixed-short-input-len", type=int, default=256)
    g.add_argument("--mixed-short-output-len", type=int, default=128)
    g.add_argument("--mixed-long-input-len", type=int, default=4096)
    g.add_argument("--mixed-long-output-len", type=int, default=128)


def add_serving_overhead_arg(g) -> None:
    """--serving-overhead / --no-serving-overhead, shared by simulate and plan."""
    g.add_argument("--serving-overhead", action=argparse.BooleanOptionalAction, default=True,
                   help="the serving path measured by pdserve profile: a request reaches the "
                        "router the profile's serving_overhead_ms after it arrives (HTTP, "
                        "router, IPC and SSE), and a step of s sequences takes at least the "
                        "profile's served-step floor, fixed_ms + per_seq_ms * s of its "
                        "serving_host_ms (the server's host work per step), and the API "
                        "process's CPU (its api_cost_ms: per request, per prompt token, per "
                        "engine step, per SSE write, per streamed token) is one FIFO queue "
                        "in front of every worker that admits requests and delivers tokens; "
                        "each is off in profiles made "
                        "before it was measured. --no-serving-overhead turns all three off "
                        "(default on)")


def api_model_line(api: dict) -> str:
    """How a run models the API process, for the printed header."""
    if not api:
        return "no API process model (tokens reach the client when their step ends)"
    return (f"one API process: {api['per_request_ms']:.3f} ms + {api['per_prompt_token_ms']:.5f}"
            f" ms per prompt token to admit a request, {api['per_step_ms']:.4f} ms per engine "
            f"step with tokens, {api['per_write_ms']:.4f} ms per SSE write + "
            f"{api['per_output_token_ms']:.4f} ms per token in it (FIFO; a lagging API joins a "
            "stream's tokens into its pending write)")


def serving_path_async(profile: CostProfile) -> bool | None:
    """Whether the profile's serving path was measured on a server that schedules
    asynchronously: its serving_setup's async_scheduling, else the flag in its server command
    (files made before the field); None where the file does not say."""
    setup = profile.extra.get("serving_setup")
    if not isinstance(setup, dict):
        return None
    if isinstance(setup.get("async_scheduling"), bool):
        return setup["async_scheduling"]
    cmd = setup.get("command") if isinstance(setup.get("command"), list) else ()
    if "--no-async-scheduling" in cmd:
        return False
    return True if "--async-scheduling" in cmd else None


def serving_path_note(a: argparse.Namespace, profile: CostProfile, overhead: float) -> str | None:
    """A line for stderr when the overhead was measured on a server that schedules otherwise
    than this run: its lone request paid another path than the one it is added to."""
    measured = serving_path_async(profile)
    if not overhead or measured is None or measured == bool(a.async_scheduling):
        return None
    mode = {True: "asynchronous", False: "synchronous"}
    return (f"note: the profile's serving overhead ({overhead:.3f} ms) was measured on a "
            f"{mode[measured]} server and this run schedules {mode[bool(a.async_scheduling)]}ly; "
            f"`pdserve profile --serving-args` measures it on the deployment's own flags")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve simulate",
        description="Simulate serving a workload on a deployment (the real scheduler and router "
                    "on a simulated clock over a step-cost profile): TTFT, TPOT, ITL, e2e "
                    "latency, throughput and goodput per request rate, as `pdserve bench serve` "
                    "reports them.")
    g = p.add_argument_group("deployment")
    g.add_argument("--profile", required=True, metavar="FILE",
                   help="step-cost profile JSON (`pdserve profile`), for every role by default")
    for role in ("prefill", "decode", "collocated"):
        g.add_argument(f"--{role}-profile", default=None, metavar="FILE",
                       help=f"the {role} workers' profile (e.g. another TP size)")
    g.add_argument("--deployment", default=None,
                   help='workers, e.g. "2P2D", "4C", "1P1D+2C" (default: 1C)')
    g.add_argument("--prefill", type=int, default=None, help="prefill workers (instead of --deployment)")
    g.add_argument("--decode", type=int, default=None, help="decode workers")
    g.add_argument("--collocated", type=int, default=None, help="collocated workers")
    g.add_argument("--routing-policy", default=None,
                   help="collocated, disagg, round-robin, adaptive (default: disagg with P/D "
                        "workers, else collocated)")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="adaptive: TTFT SLO")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="adaptive: TPOT SLO")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
                   help="model a server with async scheduling (pdserve serve's default): "
                        "steps take the profile's device time (--step-time device) and "
                        "a request reaching a busy worker joins the step after the next "
                        "(GPU profiles only; default off: synchronous steps)")
    g.add_argument("--step-time", choices=["wall", "device"], default=None,
                   help="wall: a step takes the profile's synced wall time; device: the "
                        "profile refitted on its rows' device time (gpu_ms), the step period "
                        "when async scheduling hides the host's work behind the device's "
                        "(default: device with --async-scheduling, else wall)")
    add_serving_overhead_arg(g)
    g = p.add_argument_group("engine (per worker)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool per worker (default: the profile's engine_config, else "
                        f"{DEFAULT_NUM_KV_BLOCKS})")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-model-len", type=int, default=None,
                   help="default: the profile's engine_config, else the pool's tokens")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--num-host-blocks", type=int, default=0,
                   help="the KV cache's host tier per worker in blocks (a server's --swap-space "
                        "GiB over one block's bytes) (default %(default)s: none)")
    g.add_argument("--host-copy-gbps", type=float, default=DEFAULT_HOST_COPY_GBPS, metavar="GB/S",
                   help="the host tier's copy rate: a step's moves (offloads, load-backs, swaps) "
                        "take blocks * block bytes / this on a copy stream beside its forward, "
                        "and the next forward waits for them; 0: free (default %(default)s, "
                        "kv_host_tier.py's scattered-id rate on one H200, "
                        "bench/results/kv-tier-h200.json)")
    g.add_argument("--kv-offload-policy", default="on-eviction",
                   choices=list(KV_OFFLOAD_POLICIES),
                   help="when cached prefixes reach the host tier (--num-host-blocks), as the "
                        "engine's flag: on-eviction or write-through (default %(default)s)")
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="requests per second, one or more (a sweep); inf = all at once")
    add_workload_args(g)
    g.add_argument("--multi-turn-retokenized-answers", action="store_true",
                   help="multi-turn: the next turn carries each answer as other token ids, one "
                        "more than it had, as a served run does when the answer's text does not "
                        "tokenize back to the same ids (dummy weights): the cached answer is "
                        "never reused, and a turn matches at most the previous turn's prompt "
                        "(default: the engine's ids)")
    g = p.add_argument_group("output")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs a request must all meet to count for goodput: ttft:MS tpot:MS e2el:MS")
    g.add_argument("--metric-percentiles", default="50,90,99")
    g.add_argument("--compare", default=None, metavar="MEASURED.json",
                   help="a measured `bench serve` sweep of the same workload: print and store "
                        "(key \"comparison\") each field's relative error per rate")
    g.add_argument("--compare-plot", default=None, metavar="PATH.png",
                   help="with --compare: measured vs simulated TTFT, TPOT and throughput vs rate")
    g.add_argument("--result-file", default=None,
                   help="default: bench/results/simulate-<deployment>-<timestamp>.json")
    return p


def build_conversations(a: argparse.Namespace) -> list[tuple[list[int], list[list[int]],
                                                              list[int], list[float]]]:
    """multi-turn: (system prompt ids, user messages' ids, answer lengths, think times) per
    conversation: bench serve's conversations (perf/workload.multi_turn_conversations, the same
    lengths and pauses for the same seed), their words as seeded random token ids (one per
    word; the system prompt's the same in all of them, as its text is). No chat template around
    the turns."""
    convs = multi_turn_conversations(a.multi_turn_conversations, a.multi_turn_turns,
                                     a.multi_turn_user_len, a.multi_turn_output_len,
                                     a.multi_turn_range_ratio, a.multi_turn_system_len,
                                     a.vocab_size, a.seed, a.multi_turn_think_time)
    rng = np.random.default_rng([a.seed, 0x3D8])
    system = rng.integers(0, a.vocab_size, size=a.multi_turn_system_len).tolist()
    return [(system, [rng.integers(0, a.vocab_size, size=n).tolist() for n in c.user_lens],
             list(c.output_lens), list(c.think_s)) for c in convs]


def build_requests(a: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, from the dataset flags."""
    if a.dataset_name == "random":
        reqs = random_requests(a.num_prompts, a.random_input_len, a.random_output_len,
                               a.random_range_ratio, a.random_prefix_len, a.vocab_size, a.seed)
    elif a.dataset_name == "mixed":
        reqs = mixed_requests(a.num_prompts, a.mixed_long_share, a.mixed_short_input_len,
                              a.mixed_short_output_len, a.mixed_long_input_len,
                              a.mixed_long_output_len, a.random_range_ratio, a.vocab_size, a.seed)
    elif a.dataset_name == "prefix-repetition":
        reqs = prefix_repetition_requests(
            a.num_prompts, a.prefix_repetition_num_prefixes, a.prefix_repetition_prefix_len,
            a.prefix_repetition_suffix_len, a.prefix_repetition_output_len, a.vocab_size, a.seed)
    elif a.dataset_name == "multi-turn":
        raise ValueError("multi-turn conversations are build_conversations'")
    else:
        if not a.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path")
        reqs = load_sharegpt(a.dataset_path, a.num_prompts, a.seed, a.sharegpt_output_len)
        rng = np.random.default_rng([a.seed, 0x51])
        return [(rng.integers(0, a.vocab_size, size=r.prompt_len).tolist(), r.expected_output_len)
                for r in reqs]
    return [(list(r.prompt), r.expected_output_len) for r in reqs]


def _deployment(a: argparse.Namespace) -> Deployment:
    counts = (a.prefill, a.decode, a.collocated)
    if a.deployment is not None and any(c is not None for c in counts):
        raise ValueError("give --deployment or --prefill/--decode/--collocated, not both")
    if a.deployment is not None:
        return parse_deployment(a.deployment)
    if all(c is None for c in counts):
        return Deployment(collocated=1)
    return Deployment(*(c or 0 for c in counts))


def _policy(a: argparse.Namespace, dep: Deployment, profile: CostProfile):
    name = a.routing_policy or ("disagg" if dep.prefill else "collocated")
    if name != "adaptive":
        if a.slo_ttft_ms is not None or a.slo_tpot_ms is not None:
            raise ValueError("--slo-ttft-ms / --slo-tpot-ms are the adaptive policy's")
        from ..routing.policies import make_policy
        return name, make_policy(name)
    from ..routing.adaptive import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS, AdaptivePolicy
    from ..routing.cost_model import CostModel
    return name, AdaptivePolicy(
        CostModel(profile, a.max_num_batched_tokens),
        DEFAULT_SLO_TTFT_MS if a.slo_ttft_ms is None else a.slo_ttft_ms,
        DEFAULT_SLO_TPOT_MS if a.slo_tpot_ms is None else a.slo_tpot_ms)


def simulate(a: argparse.Namespace, argv: list[str]) -> tuple[dict[str, Any], list[dict]]:
    """Runs the sweep; returns the payload (bench serve's shape) and its runs. ValueError on
    bad input."""
    from ..bench.serve_report import jsonable, rate_label, warn_failures
    percentiles = [float(x) for x in a.metric_percentiles.split(",") if x.strip()]
    if any(not 0 <= x <= 100 for x in percentiles):
        raise ValueError(f"--metric-percentiles: numbers in [0, 100], got {a.metric_percentiles!r}")
    slos = parse_goodput(a.goodput)
    if any(not r > 0 for r in a.request_rate):
        raise ValueError("--request-rate values must be > 0 (inf for all at once)")
    if not a.burstiness > 0:
        raise ValueError("--burstiness must be > 0")
    if a.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if a.compare_plot and not a.compare:
        raise ValueError("--compare-plot needs --compare MEASURED.json")
    measured = _load_measured(a.compare) if a.compare else None
    if a.step_time is None:
        a.step_time = "device" if a.async_scheduling else "wall"
    dep = _deployment(a)
    profile = _load_profile(a.profile, a.step_time)
    profiles = {"default": profile}
    for role in ("prefill", "decode", "collocated"):
        path = getattr(a, f"{role}_profile")
        if path:
            profiles[role] = _load_profile(path, a.step_time)
    ec = profile.engine_config if isinstance(profile.engine_config, dict) else {}
    blocks = a.num_kv_blocks if a.num_kv_blocks is not None else (
        ec.get("num_kv_blocks") if isinstance(ec.get("num_kv_blocks"), int) else DEFAULT_NUM_KV_BLOCKS)
    config = EngineConfig(max_num_seqs=a.max_num_seqs,
                          max_num_batched_tokens=a.max_num_batched_tokens,
                          block_size=a.block_size, num_kv_blocks=blocks,
                          enable_prefix_caching=a.enable_prefix_caching, skip_tokenizer_init=True,
                          async_scheduling=False, kv_offload_policy=a.kv_offload_policy)
    max_len = a.max_model_len if a.max_model_len is not None else (
        ec.get("max_model_len") if isinstance(ec.get("max_model_len"), int) else blocks * a.block_size)
    policy_name, _ = _policy(a, dep, profile)   # (checks the flags once)
    path = serving_path(profile, a.serving_overhead)
    overhead = path.overhead_ms
    rates = ", ".join(rate_label(x) for x in a.request_rate)
    if a.dataset_name == "multi-turn":
        convs = build_conversations(a)
        n = sum(len(u) for _, u, _, _ in convs)
        print(f"pdserve simulate: {len(convs)} conversations, {n} turns, on {dep.label} "
              f"({policy_name}); conversation starts at {rates} /s, burstiness "
              f"{a.burstiness:g}", flush=True)
    else:
        reqs = build_requests(a)
        n = len(reqs)
        print(f"pdserve simulate: {n} {a.dataset_name} requests "
              f"({sum(len(p) for p, _ in reqs)} prompt / {sum(o for _, o in reqs)} output "
              f"tokens) on {dep.label} ({policy_name}); rates {rates} req/s, burstiness "
              f"{a.burstiness:g}", flush=True)
    host = path.host_ms
    floor = (f"served-step floor {host['fixed_ms']:.3f} ms + {host['per_seq_ms']:.4f} ms per "
             "sequence" if host else "no served-step floor")
    api = path.api_cost_ms
    print(f"serving overhead {overhead:.3f} ms per request before the router, {floor}; "
          f"{api_model_line(api)}"
          + ("" if a.serving_overhead else " (--no-serving-overhead)"), flush=True)
    note = serving_path_note(a, profile, overhead)
    if note:
        print(note, file=sys.stderr, flush=True)
    runs, walls = [], []
    for rate in a.request_rate:
        sim = Simulator(dep, profiles, config, blocks, max_len, _policy(a, dep, profile)[1],
                        a.vocab_size, pipelined_pickup=a.async_scheduling,
                        serving_overhead_ms=overhead, num_host_blocks=a.num_host_blocks,
                        retokenized_answers=a.multi_turn_retokenized_answers,
                        host_copy_gb_per_s=a.host_copy_gbps, serving_floor=a.serving_overhead,
                        api_cost_ms=api)
        if a.dataset_name == "multi-turn":
            offsets = arrival_times(len(convs), rate, a.burstiness, a.seed)
            res = sim.run_conversations([SimConversation(float(t), s, u, o, tuple(th))
                                         for (s, u, o, th), t in zip(convs, offsets)])
        else:
            offsets = arrival_times(len(reqs), rate, a.burstiness, a.seed)
            res = sim.run([SimRequest(p, o, float(t)) for (p, o), t in zip(reqs, offsets)])
        m = compute_metrics(res.results, res.duration, percentiles, slos)
        facts = dict(res.facts)
        walls.append({"request_rate": rate_label(rate), "wall_s": facts.pop("wall_s"),
                      "cpu_s": facts.pop("cpu_s")})
        run = {"request_rate": rate_label(rate), "burstiness": a.burstiness,
               "max_concurrency": None, "num_prompts": n, **m, "simulation": facts}
        runs.append(run)
        warn_failures(run)
    payload: dict[str, Any] = {
        "benchmark": "simulate", "date": datetime.now().isoformat(timespec="seconds"),
        "deployment": dep.label, "routing_policy": policy_name,
        "profile": {"model": profile.model, "hardware": profile.hardware_label,
                    "file": a.profile, "step_time": a.step_time,
                    "serving_overhead_ms": overhead, "serving_host_ms": host,
                    "api_cost_ms": api, "serving_path_async": serving_path_async(profile)},
        "async_scheduling": a.async_scheduling,
        "dataset_name": a.dataset_name, "percentiles": percentiles, "runs": runs}
    if len(runs) == 1:
        payload.update({k: v for k, v in runs[0].items() if k not in payload})
    payload.update(command=["pdserve", "simulate", *argv], config=vars(a),
                   simulation_wall=walls)
    payload = jsonable(payload)
    if measured is not None:
        from .compare import compare
        payload["comparison"] = {"measured_file": a.compare, **compare(payload, measured)}
    return payload, runs


def _load_profile(path: str, step_time: str) -> CostProfile:
    profile = CostProfile.from_json(path)
    if step_time == "device":
        from ..perf.cost_fit import device_time_profile
        try:
            profile = device_time_profile(profile)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return profile


def _load_measured(path: str) -> dict:
    try:
        return read_json_object(path, "bench serve result")
    except ValueError as e:
        raise ValueError(f"--compare {e}") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = build_parser()
    a = p.parse_args(argv)
    from ..bench.serve_report import format_table
    try:
        payload, runs = simulate(a, argv)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(payload["runs"], payload["percentiles"]))
    for w, run in zip(payload["simulation_wall"], payload["runs"]):
        s = run["simulation"]
        print(f"rate {w['request_rate']}: simulated {s['simulated_s']:.2f} s, {s['events']} events, "
              f"{s['transfers']} KV transfers, wall {w['wall_s']:.2f} s (CPU {w['cpu_s']:.2f} s)")
        ph = s.get("request_phases") or {}
        if ph.get("queue_ms") is not None:
            print(f"  phases (means): admission {ph['admission_ms']:.1f} ms, TTFT from the router "
                  f"{ph['server_ttft_ms']:.1f} ms, queue {ph['queue_ms']:.1f} ms, prefill "
                  f"{ph['prefill_ms']:.1f} ms")
        if s.get("api"):
            api = s["api"]
            util = "-" if api["utilization"] is None else f"{api['utilization']:.0%}"
            lag = api["delivery_lag_ms_mean"]
            tpw = api["tokens_per_write"]
            print(f"  API process: busy {api['busy_s']:.3f} s ({util} of the run), "
                  f"{api['writes']} writes ({'-' if tpw is None else f'{tpw:.2f}'} tokens "
                  f"each), token "
                  f"delivery lag mean {'-' if lag is None else f'{lag:.3f}'} ms, max "
                  f"{api['delivery_lag_ms_max']:.3f} ms; admission wait max "
                  f"{api['admission_wait_ms_max']:.3f} ms")
            tail = api["queue_end_after_last_delivery_ms"]
            if tail:    # (the joined tokens' charges: sim/api_process.py's approximation)
                print(f"  (its queue ran {tail:.1f} ms past the last delivery: work of tokens "
                      "that joined earlier writes, charged at the queue's end)")
    if "comparison" in payload:
        from .compare import format_comparison, plot_comparison
        print(f"against {a.compare} (measured / simulated, relative error):")
        print(format_comparison(payload["comparison"]))
        if a.compare_plot:
            try:
                print("wrote", plot_comparison(_load_measured(a.compare), {a.step_time: payload},
                                               a.compare_plot))
            except RuntimeError as e:   # matplotlib missing: the numbers are still written
                print(f"warning: {e}", file=sys.stderr)
    out = a.result_file or (f"bench/results/simulate-{payload['deployment'].replace('+', '_')}-"
                            f"{datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    print("wrote", write_json(out, payload, allow_nan=False))
    return 0 if any(r["completed"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
