"""Validate `pdserve simulate` against a measured `pdserve bench serve` sweep: the workload flags
are read from the measured file's config (the same requests, seed and rates), each variant's
simulate flags are added, and one JSON (+ PNG) holds every variant's per-rate comparison.

    PYTHONPATH=. python scripts/sim_validation.py --measured bench/results/serve-h200.json \
        --profile bench/results/profile-h200-qwen2.5-1.5b.json \
        --engine "--num-kv-blocks 246092 --max-model-len 32768 --no-enable-prefix-caching" \
        --variant "sync=" --variant "async=--async-scheduling" \
        --server-command "pdserve serve ..." --out bench/results/sim-validation-h200.json \
        --plot bench/results/sim-validation-h200.png
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import sys
from datetime import datetime

from pdserve.bench.common import git_info, hardware_info
from pdserve.perf.files import write_json
from pdserve.sim import cli
from pdserve.sim.compare import FIELDS, format_comparison, plot_comparison

# measured config key -> simulate flag (the workload; the rest is the variant's and --engine's)
WORKLOAD_FLAGS = {
    "num_prompts": "--num-prompts", "seed": "--seed", "burstiness": "--burstiness",
    "dataset_name": "--dataset-name", "vocab_size": "--vocab-size",
    "random_input_len": "--random-input-len", "random_output_len": "--random-output-len",
    "random_range_ratio": "--random-range-ratio", "random_prefix_len": "--random-prefix-len",
    "request_rate": "--request-rate", "goodput": "--goodput",
    "metric_percentiles": "--metric-percentiles"}


def workload_args(config: dict) -> list[str]:
    """The simulate flags that reproduce a bench serve run's workload (its "config")."""
    if config.get("dataset_name", "random") != "random":
        raise ValueError(f"only the random dataset is mapped, got {config.get('dataset_name')!r}")
    if config.get("max_concurrency") is not None:
        raise ValueError("a measured run with --max-concurrency has no simulate counterpart")
    out: list[str] = []
    for key, flag in WORKLOAD_FLAGS.items():
        v = config.get(key)
        if v is None:
            continue
        vals = v if isinstance(v, list) else [v]
        out += [flag, *(str(x) for x in vals)]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measured", required=True)
    p.add_argument("--profile", required=True)
    p.add_argument("--engine", default="", help="simulate flags for every variant (engine, pool)")
    p.add_argument("--variant", action="append", required=True, metavar="NAME=FLAGS",
                   help="a named set of extra simulate flags (repeatable)")
    p.add_argument("--server-command", default=None, help="how the measured server ran (text)")
    p.add_argument("--note", action="append", default=[], help="a note to store (repeatable)")
    p.add_argument("--out", required=True)
    p.add_argument("--plot", default=None)
    a = p.parse_args(argv)
    with open(a.measured) as f:
        measured = json.load(f)
    common = ["--profile", a.profile, *workload_args(measured["config"]), *shlex.split(a.engine)]
    variants = {}
    for spec in a.variant:
        name, _, flags = spec.partition("=")
        argv_v = common + shlex.split(flags) + ["--compare", a.measured]
        args = cli.build_parser().parse_args(argv_v)
        with contextlib.redirect_stdout(io.StringIO()):
            payload, _ = cli.simulate(args, argv_v)
        print(f"== {name}: pdserve simulate {' '.join(argv_v)}")
        print(format_comparison(payload["comparison"]))
        runs = [{k: r.get(k) for k in ("request_rate", "completed", "failed", "duration",
                                        *FIELDS, "request_goodput")}
                | {"simulation": r.get("simulation")} for r in payload["runs"]]
        variants[name] = {"command": ["pdserve", "simulate", *argv_v],
                          "profile": payload["profile"], "comparison": payload["comparison"],
                          "runs": runs, "simulation_wall": payload["simulation_wall"]}
    with open(a.profile) as f:
        prof = json.load(f)
    out = {"benchmark": "sim-validation", "date": datetime.now().isoformat(timespec="seconds"),
           "command": ["python", "scripts/sim_validation.py", *(sys.argv[1:] if argv is None
                                                                 else argv)],
           **git_info(), "hardware": hardware_info(),
           "measured": {"file": a.measured, "server_command": a.server_command,
                        "bench_command": measured.get("command"),
                        "git_commit": measured.get("git_commit"),
                        "hardware": measured.get("hardware")},
           "profile": {"file": a.profile, "command": prof.get("command"),
                       "commit": prof.get("commit"), "engine_config": prof.get("engine_config"),
                       "hardware": prof.get("hardware")},
           "notes": a.note, "variants": variants}
    print("wrote", write_json(a.out, out, allow_nan=False))
    if a.plot:
        sims = {}
        for name in variants:
            sims[name] = {"runs": variants[name]["runs"]}
        print("wrote", plot_comparison(measured, sims, a.plot,
                                       title=f"{a.measured} vs pdserve simulate"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
