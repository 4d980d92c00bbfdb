"""The serve-kv-tier device stage's two helpers (issue 21's multi-turn target: prefix caching
with the KV host tier against GPU-only prefix caching, same GPU pool, same conversations).

    attach RESULT.json BEFORE AFTER   the server's host-tier series (Prometheus text, '-' for
                                      stdin) before and after one bench serve run, kept in the
                                      run's result file under "server_metrics"; prints AFTER's
    report DIR [--output FILE]        DIR/tier-mt-<side>-<rate>.json of the two sides: per rate
                                      found on both, each side's output tok/s, goodput, mean and
                                      p99 TTFT, its host-tier counters, engine steps and the
                                      server's mean request phases (TTFT as the server saw it,
                                      queue, prefill) over the run, and the tier / GPU-only
                                      ratios; printed, and written as JSON

A ratio with a zero denominator is inf (written "inf"), or null when both are zero; a side
without goodput (no --goodput) or without server metrics gives null there.
"""
from __future__ import annotations

import argparse
import glob
import math
import os
import re
import sys
from typing import Any

from pdserve.bench.serve_report import jsonable
from pdserve.perf.files import read_json_object, write_json
from pdserve.routing.router_core import StepTotals, summarize_steps

# The series kept from /metrics. Gauges (a level now) are reported as they were after the run;
# counters (totals since the server started) as what they grew by over the run.
GAUGES = ("pdserve:kv_host_blocks", "pdserve:kv_host_blocks_used", "pdserve:kv_cache_blocks_total")
COUNTERS = ("pdserve:kv_blocks_swapped_total", "pdserve:kv_blocks_offloaded_total",
            "pdserve:kv_blocks_loaded_back_total", "pdserve:prefix_cache_host_hits_total",
            "pdserve:prefix_cache_hits_total", "pdserve:prefix_cache_queries_total",
            "pdserve:num_preemptions_total",
            # the engine's steps by kind (their count, host and device time, tokens)
            "pdserve:engine_steps_total", "pdserve:engine_step_wall_seconds_total",
            "pdserve:engine_step_gpu_seconds_total", "pdserve:engine_steps_gpu_timed_total",
            "pdserve:engine_step_tokens_total",
            # the server's own request phases (histograms' sums and counts): where a client's
            # TTFT goes, split by the server (phase_summary)
            *(f"{h}_{part}" for h in ("pdserve:request_admission_seconds",
                                      "pdserve:time_to_first_token_seconds",
                                      "pdserve:request_queue_time_seconds",
                                      "pdserve:request_prefill_time_seconds")
              for part in ("sum", "count")))
# phase_summary's fields: the histogram each mean comes from
PHASES = {"admission_ms": "pdserve:request_admission_seconds",       # HTTP in -> to engine
          "server_ttft_ms": "pdserve:time_to_first_token_seconds",   # to engine -> 1st output
          "queue_ms": "pdserve:request_queue_time_seconds",         # engine arrival -> scheduled
          "prefill_ms": "pdserve:request_prefill_time_seconds"}     # scheduled -> first token
_SAMPLE = re.compile(r'^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_RESULT = re.compile(r"^tier-mt-(?P<side>[A-Za-z0-9_]+)-(?P<rate>[^/]+)\.json$")


def parse_metrics(text: str) -> dict[str, float]:
    """The kept series of a Prometheus exposition: {name: value}, a labelled series (other than
    model_name) as name{label=value,...}; samples of one key are summed (several models)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m.group(1) not in GAUGES + COUNTERS:
            continue
        labels = sorted((k, v) for k, v in _LABEL.findall(m.group(2) or "") if k != "model_name")
        key = m.group(1) + ("{" + ",".join(f"{k}={v}" for k, v in labels) + "}" if labels else "")
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Gauges as after the run, counters as grown over it (a series new since before grew from
    0)."""
    out = {}
    for key, v in sorted(after.items()):
        name = key.partition("{")[0]
        out[key] = v if name in GAUGES else v - before.get(key, 0.0)
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if b == 0:
        return None if a == 0 else math.inf
    return a / b


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    with open(path) as f:
        return f.read()


def attach(result_path: str, before_path: str, after_path: str) -> dict[str, Any]:
    after_text = _read(after_path)
    result = read_json_object(result_path, "bench serve result")
    result["server_metrics"] = {"before": parse_metrics(_read(before_path)),
                                "after": parse_metrics(after_text)}
    write_json(result_path, result)
    for line in after_text.splitlines():
        if _SAMPLE.match(line) and _SAMPLE.match(line).group(1) in GAUGES + COUNTERS:
            print(line)
    return result


def step_summary(delta: dict[str, float]) -> dict[str, dict[str, float | None]]:
    """Per step kind over a run (every worker's steps together, from metrics_delta's counters):
    router_core.summarize_steps of the counters' totals."""
    totals: dict[tuple[str, str], StepTotals] = {}
    for key, v in delta.items():
        name, _, labels = key.partition("{")
        lab = dict(x.split("=", 1) for x in labels.rstrip("}").split(",") if "=" in x)
        kind = lab.get("kind")
        if kind is None or not name.startswith("pdserve:engine_step"):
            continue
        t = totals.setdefault((lab.get("worker", ""), kind), StepTotals())
        if name == "pdserve:engine_steps_total":
            t.steps += v
        elif name == "pdserve:engine_step_wall_seconds_total":
            t.wall_ms += 1e3 * v
        elif name == "pdserve:engine_step_gpu_seconds_total":
            t.gpu_ms += 1e3 * v
        elif name == "pdserve:engine_steps_gpu_timed_total":
            t.gpu_steps += v
        elif name == "pdserve:engine_step_tokens_total":
            if lab.get("phase") == "prefill":
                t.prefill_tokens += v
            elif lab.get("phase") == "decode":
                t.decode_tokens += v
    return summarize_steps(totals)


def phase_summary(delta: dict[str, float]) -> dict[str, float | None]:
    """The server's mean request phases over a run (ms), from metrics_delta's histogram sums
    and counts (PHASES); None for a phase without an observation. queue_ms + prefill_ms is
    the engine's part of a request's TTFT (its arrival at the router to its first token, on the
    engine's clock); the client's TTFT less that is the API's admission (HTTP, tokenizing), the
    way to the engine and the stream's way back. server_ttft_ms is the API's own timer, from
    the hand-off to the engine to the first output there: it holds queue_ms + prefill_ms and
    the trip to the worker and back (before bc2399e it started when the response body began to
    read, and a CPU dry run gave a mean 238 ms against a 240 ms prefill phase). admission_ms
    is the API's time before that hand-off, from the HTTP request's headers read (body,
    parsing, tokenizing); the client's TTFT less admission_ms and server_ttft_ms is the
    connection, the HTTP server's own queue and the client's."""
    out: dict[str, float | None] = {}
    for field, h in PHASES.items():
        n = delta.get(f"{h}_count", 0.0)
        out[field] = 1e3 * delta.get(f"{h}_sum", 0.0) / n if n else None
    return out


def side_summary(result: dict[str, Any]) -> dict[str, Any]:
    """One side at one rate: its numbers and the host-tier counters over the run."""
    runs = result.get("runs") or [result]
    if len(runs) != 1:
        raise ValueError(f"a result of one rate expected, got {len(runs)} runs")
    r = runs[0]
    sm = result.get("server_metrics")
    delta = None if sm is None else metrics_delta(sm["before"], sm["after"])
    return {"completed": r["completed"], "failed": r["failed"], "duration_s": r["duration"],
            "output_tok_per_s": r["output_throughput"],
            "request_goodput": r.get("request_goodput"),
            "goodput_slos_ms": r.get("goodput_slos_ms"),
            "mean_ttft_ms": r["mean_ttft_ms"], "p99_ttft_ms": r.get("p99_ttft_ms"),
            "cached_token_fraction": r.get("cached_token_fraction"),
            "server_metrics": delta,
            "steps": None if delta is None else step_summary(delta),
            "request_phases": None if delta is None else phase_summary(delta)}


def _rate_key(rate: str) -> float:
    try:
        return float(rate)
    except ValueError:
        return math.inf


def find_results(folder: str) -> dict[str, dict[str, str]]:
    """{side: {rate: path}} of the tier-mt-<side>-<rate>.json files in folder."""
    found: dict[str, dict[str, str]] = {}
    for path in glob.glob(os.path.join(folder, "tier-mt-*.json")):
        m = _RESULT.match(os.path.basename(path))
        if m:
            found.setdefault(m["side"], {})[m["rate"]] = path
    return found


def summarize(folder: str, tier: str = "tier", gpu: str = "gpu") -> dict[str, Any]:
    found = find_results(folder)
    missing = [s for s in (tier, gpu) if s not in found]
    if missing:
        raise ValueError(f"{folder}: no tier-mt-<side>-<rate>.json of side(s) {', '.join(missing)}"
                         f" (found: {', '.join(sorted(found)) or 'none'})")
    rates = sorted(set(found[tier]) & set(found[gpu]), key=_rate_key)
    if not rates:
        raise ValueError(f"{folder}: the sides {tier} and {gpu} share no rate")
    out = []
    for rate in rates:
        t = side_summary(read_json_object(found[tier][rate], "bench serve result"))
        g = side_summary(read_json_object(found[gpu][rate], "bench serve result"))
        out.append({"rate": rate, tier: t, gpu: g,
                    "output_tok_per_s_ratio": ratio(t["output_tok_per_s"], g["output_tok_per_s"]),
                    "goodput_ratio": ratio(t["request_goodput"], g["request_goodput"])})
    only = {s: sorted(set(found[s]) - set(rates), key=_rate_key) for s in (tier, gpu)}
    return {"tier_side": tier, "gpu_side": gpu, "rates": out,
            "unpaired_rates": {s: v for s, v in only.items() if v}}


def format_summary(s: dict[str, Any]) -> str:
    tier, gpu = s["tier_side"], s["gpu_side"]

    def f(v, d=1):
        if v is None:
            return "-"
        return "inf" if v == math.inf else f"{v:.{d}f}"
    lines = [f"{'rate':>5} | {'out tok/s':>17} {'ratio':>5} | {'goodput req/s':>13} {'ratio':>5} | "
             f"{'mean TTFT ms':>15} | {'p99 TTFT ms':>15} | offloaded loaded_back host_hits",
             f"{'':>5} | {tier + ' / ' + gpu:>17} {'':>5} |"]
    for r in s["rates"]:
        t, g = r[tier], r[gpu]
        sm = t["server_metrics"] or {}
        lines.append(
            f"{r['rate']:>5} | {f(t['output_tok_per_s']):>8} / {f(g['output_tok_per_s']):<6} "
            f"{f(r['output_tok_per_s_ratio'], 2):>5} | {f(t['request_goodput'], 2):>6} / "
            f"{f(g['request_goodput'], 2):<4} {f(r['goodput_ratio'], 2):>5} | "
            f"{f(t['mean_ttft_ms']):>7} / {f(g['mean_ttft_ms']):<5} | "
            f"{f(t['p99_ttft_ms']):>7} / {f(g['p99_ttft_ms']):<5} | "
            f"{f(sm.get('pdserve:kv_blocks_offloaded_total'), 0)} "
            f"{f(sm.get('pdserve:kv_blocks_loaded_back_total'), 0)} "
            f"{f(sm.get('pdserve:prefix_cache_host_hits_total'), 0)}")
        for side, x in ((tier, t), (gpu, g)):
            for kind, k in (x.get("steps") or {}).items():
                # (wall: schedule to tokens applied; with async scheduling two steps overlap)
                lines.append(f"{'':>5}   {side} {kind} steps: {f(k['steps'], 0)}, "
                             f"{f(k['mean_gpu_ms'], 2)} ms device / {f(k['mean_wall_ms'], 2)} ms "
                             f"wall each, {f(k['prefill_tokens_per_step'], 0)} prompt + "
                             f"{f(k['decode_tokens_per_step'], 0)} decode tokens")
            ph = x.get("request_phases")
            if ph:
                lines.append(f"{'':>5}   {side} server's means: admission "
                             f"{f(ph.get('admission_ms'))} ms, TTFT {f(ph['server_ttft_ms'])} ms, "
                             f"queue {f(ph['queue_ms'])} ms, prefill {f(ph['prefill_ms'])} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tier_report.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("attach", help="keep the server's host-tier series in a result file")
    a.add_argument("result")
    a.add_argument("before", help="/metrics text before the run (a file, '-': stdin)")
    a.add_argument("after", help="/metrics text after the run (a file, '-': stdin)")
    r = sub.add_parser("report", help="compare the two sides' result files")
    r.add_argument("folder")
    r.add_argument("--tier-side", default="tier")
    r.add_argument("--gpu-side", default="gpu")
    r.add_argument("--output", default=None, help="write the summary here (JSON)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "attach":
            if args.before == "-" and args.after == "-":
                raise ValueError("only one of before / after can be stdin")
            attach(args.result, args.before, args.after)
            return 0
        s = summarize(args.folder, args.tier_side, args.gpu_side)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_summary(s))
    if args.output:
        print("wrote", write_json(args.output, jsonable(s), allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
