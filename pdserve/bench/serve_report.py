"""What `pdserve bench serve` shows and writes besides the numbers: the summary table, the
strict-JSON form of a result, and the latency / throughput plots (matplotlib, imported only
for --plot)."""
from __future__ import annotations

import math
import os
import sys
from typing import Any

import numpy as np

from ..perf.metrics import percentile_label


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def jsonable(x: Any) -> Any:
    """Non-finite floats as strings ("inf"), so the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else None)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def warn_failures(run: dict[str, Any]) -> None:
    """One line on stderr when requests of a run (a sweep's rate) failed: how many, and the first
    error."""
    if run["failed"]:
        first = next(e for e in run["errors"] if e)
        print(f"rate {run['request_rate']}: {run['failed']} of {run['num_prompts']} requests "
              f"failed; first error: {first}", file=sys.stderr, flush=True)


def format_table(runs: list[dict[str, Any]], percentiles: list[float]) -> str:
    top = percentile_label(max(percentiles)) if percentiles else None

    def f(v, w=7, d=1):
        return f"{v:{w}.{d}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"
    groups = " | ".join(f"{n + ' ms':<8}{'mean':>7} {'median':>7} {('p' + top) if top else '':>7}"
                        for n in ("TTFT", "TPOT", "ITL"))
    head = f"{'rate':>6} {'done':>5} {'fail':>5} {'req/s':>7} {'out tok/s':>9} {'goodput':>7} | {groups}"
    lines = [head, "-" * len(head)]
    for r in runs:
        cells = []
        for n in ("ttft", "tpot", "itl"):
            tail = r.get(f"p{top}_{n}_ms") if top else None
            cells.append(f"{'':<8}{f(r[f'mean_{n}_ms'])} {f(r[f'median_{n}_ms'])} {f(tail)}")
        rate = r["request_rate"]
        lines.append(f"{rate if isinstance(rate, str) else rate_label(rate):>6} "
                     f"{r['completed']:>5} {r['failed']:>5} {f(r['request_throughput'], 7, 2)} "
                     f"{f(r['output_throughput'], 9, 1)} {f(r.get('request_goodput'), 7, 2)} | "
                     + " | ".join(cells))
    return "\n".join(lines)


def format_per_turn(run: dict[str, Any]) -> str:
    """A run's prefix-cache line (when the server reported cached tokens) and, for a multi-turn
    run, TTFT and tokens by turn index; "" when neither applies."""
    lines = []
    if run.get("total_cached_tokens") is not None:
        lines.append(f"rate {run['request_rate']}: cached prompt tokens "
                     f"{run['total_cached_tokens']} of {run['total_input_tokens']} ({100 * run['cached_token_fraction']:.1f}%"
                     f" of the prompt tokens of the {run['cached_tokens_reported']} requests that "
                     "reported them)")
    if run.get("per_turn"):
        def f(v, w, d=1):
            return f"{v:{w}.{d}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"
        lines.append(f"{'turn':>6} {'done':>5} {'fail':>5} {'TTFT mean':>10} {'median':>8} "
                     f"{'prompt tok':>10} {'cached tok':>10} {'cached %':>8}")
        for t in run["per_turn"]:
            frac = t["cached_token_fraction"]
            lines.append(f"{t['turn']:>6} {t['completed']:>5} {t['failed']:>5} "
                         f"{f(t['mean_ttft_ms'], 10)} {f(t['median_ttft_ms'], 8)} "
                         f"{f(t['mean_input_tokens'], 10)} {f(t['cached_tokens'], 10, 0)} "
                         f"{f(None if frac is None else 100 * frac, 8)}")
    return "\n".join(lines)


def import_pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib, which is not installed "
                           "(pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_runs(runs: list[dict[str, Any]], path: str, percentiles: list[float]) -> str:
    """Latency CDFs per rate (TTFT, TPOT, ITL, e2e) and, for a sweep, throughput/goodput and
    p50/p-top TTFT/TPOT versus request rate; written to `path` (PNG)."""
    plt = import_pyplot()
    sweep = len(runs) > 1
    rows = 3 if sweep else 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4 * rows))
    panels = [("ttfts", "TTFT"), ("tpots", "TPOT"), ("itls", "ITL"), ("e2els", "e2e latency")]
    for ax, (key, title) in zip(axes.flat, panels):
        for run in runs:
            vals = run[key]
            if key == "itls":
                vals = [g for gaps in vals for g in gaps]
            v = np.sort(np.asarray([x for x in vals if x is not None], dtype=float) * 1e3)
            if v.size:
                ax.step(np.concatenate([[v[0]], v]), np.arange(v.size + 1) / v.size, where="post",
                        label=f"{rate_label(rate_value(run['request_rate']))} req/s")
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if sweep:
        rates = [rate_value(r["request_rate"]) for r in runs]
        finite = [x for x in rates if math.isfinite(x)]
        inf_at = 2 * max(finite) if finite else 1.0
        xs = [x if math.isfinite(x) else inf_at for x in rates]
        ticks = [rate_label(x) for x in rates]
        ax = axes[2, 0]
        ax.plot(xs, [r["request_throughput"] for r in runs], "o-", label="throughput")
        if "request_goodput" in runs[0]:
            ax.plot(xs, [r["request_goodput"] for r in runs], "s--", label="goodput")
        ax.set_ylabel("req/s")
        ax2 = ax.twinx()
        ax2.plot(xs, [r["output_throughput"] for r in runs], "^:", color="gray",
                 label="output tok/s")
        ax2.set_ylabel("output tok/s")
        ax.set_title("throughput vs request rate")
        ax.legend(loc="upper left", fontsize=8)
        ax2.legend(loc="lower right", fontsize=8)
        ax = axes[2, 1]
        top = percentile_label(max(percentiles)) if percentiles else None
        for n in ("ttft", "tpot"):
            ax.plot(xs, [r[f"median_{n}_ms"] for r in runs], "o-", label=f"p50 {n.upper()}")
            if top:
                ax.plot(xs, [r[f"p{top}_{n}_ms"] for r in runs], "s--", label=f"p{top} {n.upper()}")
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title("latency vs request rate")
        ax.legend(fontsize=8)
        for a in axes[2]:
            a.set_xticks(xs)
            a.set_xticklabels(ticks)
            a.set_xlabel("request rate (req/s)")
            a.grid(alpha=0.3)
    fig.tight_layout()
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def rate_value(rate: Any) -> float:
    return float(rate)  # float("inf") for the string "inf"
