"""Plot a P/D serving comparison from bench/results/pd-h200x2.json: per workload, goodput
under a loose and a tight TPOT SLO, and TTFT / TPOT p99, against request rate, one line per
deployment. Goodput is re-scored from the per-request TTFT/TPOT in the file (TTFT <= --ttft ms
and TPOT <= each of --tpot ms; a one-token request meets any TPOT SLO).

    python scripts/plot_pd_sweep.py bench/results/pd-h200x2.json third_pass.serve out.png
"""
from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def goodput(run: dict, ttft_ms: float, tpot_ms: float) -> float:
    good = sum(1 for t, p in zip(run["ttfts"], run["tpots"])
               if t is not None and t * 1e3 <= ttft_ms and (p is None or p * 1e3 <= tpot_ms))
    return good / run["duration"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json")
    p.add_argument("key", help="dotted path to {workload: {deployment: bench-serve result}}")
    p.add_argument("output")
    p.add_argument("--ttft", type=float, default=500.0)
    p.add_argument("--tpot", type=float, nargs=2, default=[50.0, 5.0])
    a = p.parse_args(argv)
    data = json.load(open(a.json))
    for k in a.key.split("."):
        data = data[k]
    panels = [(f"goodput (TTFT {a.ttft:g} / TPOT {s:g} ms), req/s", s) for s in a.tpot]
    panels += [("TTFT p99, ms", "p99_ttft_ms"), ("TPOT p99, ms", "p99_tpot_ms")]
    fig, axes = plt.subplots(len(data), len(panels), figsize=(4.2 * len(panels), 3.4 * len(data)),
                             squeeze=False)
    for row, (workload, deps) in zip(axes, data.items()):
        for ax, (title, what) in zip(row, panels):
            for dep, result in deps.items():
                runs = result["runs"]
                xs = list(range(len(runs)))
                ys = [goodput(r, a.ttft, what) if isinstance(what, float) else r[what]
                      for r in runs]
                ax.plot(xs, ys, "o-", label=dep)
                ax.set_xticks(xs, [str(r["request_rate"]) for r in runs])
            ax.set_title(f"{workload}: {title}", fontsize=9)
            ax.set_xlabel("request rate (req/s)")
            if "p99" in str(what):
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.output, dpi=110)


if __name__ == "__main__":
    main()
