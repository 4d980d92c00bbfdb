"""A simulated sweep against a measured one (`pdserve simulate --compare MEASURED.json`): per
request rate, each latency / throughput field side by side with its relative error
(simulated - measured) / measured, whether both ran the same requests, and the issue's targets.

Both files are `bench serve` payloads (the simulator writes the same shape). Runs are matched by
their request rate label ("2", "inf"). Targets (issue 18):
    below saturation (a finite offered rate under the measured saturation): mean TTFT and
        mean TPOT within TARGET_REL_ERR;
    saturation (the largest request throughput of the sweep, the rate=inf run's as a rule)
        within TARGET_REL_ERR.
Plain Python."""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

TARGET_REL_ERR = 0.10
FIELDS = ("request_throughput", "output_throughput",
          "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms",
          "mean_tpot_ms", "p50_tpot_ms", "p99_tpot_ms",
          "mean_itl_ms", "p50_itl_ms", "p99_itl_ms", "mean_e2el_ms")


def _rate(run: Mapping) -> float:
    r = run.get("request_rate")
    if r == "inf":
        return math.inf
    try:
        return float(r)
    except (TypeError, ValueError):
        raise ValueError(f"a run has no usable request_rate: {r!r}") from None


def _label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def rel_err(sim: Any, meas: Any) -> float | None:
    """(sim - meas) / meas; None where either is missing or not finite, or meas is 0."""
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
               for x in (sim, meas)) or meas == 0:
        return None
    return (sim - meas) / meas


def _runs(payload: Mapping, what: str) -> dict[float, Mapping]:
    runs = payload.get("runs")
    if not isinstance(runs, list) or not runs:
        if "request_rate" in payload:   # a one-rate payload without "runs"
            runs = [payload]
        else:
            raise ValueError(f"the {what} file has no runs (not a bench serve / simulate JSON)")
    return {_rate(r): r for r in runs}


def saturation(payload: Mapping) -> float:
    """The largest request throughput over the payload's runs (req/s)."""
    vals = [r.get("request_throughput") for r in _runs(payload, "given").values()]
    vals = [v for v in vals if isinstance(v, (int, float))]
    if not vals:
        raise ValueError("no run has a request_throughput")
    return float(max(vals))


def compare(simulated: Mapping, measured: Mapping, fields: Sequence[str] = FIELDS
            ) -> dict[str, Any]:
    """The comparison (JSON-ready). ValueError when the two files share no request rate."""
    sim, meas = _runs(simulated, "simulated"), _runs(measured, "measured")
    common = sorted(set(sim) & set(meas))
    if not common:
        raise ValueError(f"no request rate in common: simulated {sorted(map(_label, sim))}, "
                         f"measured {sorted(map(_label, meas))}")
    sat_m, sat_s = saturation(measured), saturation(simulated)
    per_rate = []
    below_ok = []
    for rate in common:
        s, m = sim[rate], meas[rate]
        row: dict[str, Any] = {"request_rate": _label(rate)}
        same = None
        if isinstance(s.get("input_lens"), list) and isinstance(m.get("input_lens"), list):
            same = (s["input_lens"] == m["input_lens"]
                    and s.get("output_lens") == m.get("output_lens"))
        row["same_requests"] = same
        for f in fields:
            row[f] = {"measured": m.get(f), "simulated": s.get(f),
                      "rel_err": rel_err(s.get(f), m.get(f))}
        below = not math.isinf(rate) and rate < sat_m
        row["below_saturation"] = below
        if below:
            errs = [row[f]["rel_err"] for f in ("mean_ttft_ms", "mean_tpot_ms")]
            ok = all(e is not None and abs(e) <= TARGET_REL_ERR for e in errs)
            row["target_met"] = ok
            below_ok.append(ok)
        per_rate.append(row)
    sat_err = rel_err(sat_s, sat_m)
    return {
        "fields": list(fields), "target_rel_err": TARGET_REL_ERR,
        "saturation": {"measured": sat_m, "simulated": sat_s, "rel_err": sat_err,
                       "target_met": sat_err is not None and abs(sat_err) <= TARGET_REL_ERR},
        "below_saturation_target_met": all(below_ok) if below_ok else None,
        "rates_compared": [_label(r) for r in common],
        "rates_only_simulated": [_label(r) for r in sorted(set(sim) - set(meas))],
        "rates_only_measured": [_label(r) for r in sorted(set(meas) - set(sim))],
        "per_rate": per_rate}


def format_comparison(cmp: Mapping, fields: Sequence[str] = (
        "request_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
        "mean_itl_ms")) -> str:
    """A table: per rate, each field's measured / simulated value and relative error."""
    def cell(d):
        m, s, e = d["measured"], d["simulated"], d["rel_err"]
        num = lambda x: "-" if not isinstance(x, (int, float)) else f"{x:.4g}"
        err = "-" if e is None else f"{100 * e:+.0f}%"
        return f"{num(m)}/{num(s)} {err}"
    short = {"request_throughput": "req/s", "output_throughput": "out tok/s"}
    head = ["rate"] + [short.get(f, f.replace("_ms", "")) + " meas/sim" for f in fields] + ["target"]
    rows = [head]
    for r in cmp["per_rate"]:
        t = {True: "met", False: "MISSED"}.get(r.get("target_met"), "")
        if r.get("same_requests") is False:
            t += " (other requests!)"
        rows.append([r["request_rate"]] + [cell(r[f]) for f in fields] + [t])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    sat = cmp["saturation"]
    e = sat["rel_err"]
    lines.append(f"saturation (max req/s): measured {sat['measured']:.4g}, simulated "
                 f"{sat['simulated']:.4g} ({'-' if e is None else f'{100 * e:+.1f}%'}; target "
                 f"±{100 * cmp['target_rel_err']:.0f}%: "
                 f"{'met' if sat['target_met'] else 'MISSED'})")
    return "\n".join(lines)


def plot_comparison(measured: Mapping, simulated: Mapping[str, Mapping], path: str,
                    title: str = "") -> str:
    """Measured vs simulated mean TTFT, mean TPOT and request throughput against the offered
    rate (rate inf drawn at twice the largest finite rate); simulated: {label: payload}."""
    from ..bench.serve_report import import_pyplot
    plt = import_pyplot()
    series = {"measured": _runs(measured, "measured")}
    for k, v in simulated.items():
        series[f"simulated ({k})" if k else "simulated"] = _runs(v, "simulated")
    finite = [r for s in series.values() for r in s if not math.isinf(r)]
    inf_x = 2 * max(finite) if finite else 1.0
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    panels = [("mean_ttft_ms", "mean TTFT (ms)", True), ("mean_tpot_ms", "mean TPOT (ms)", False),
              ("request_throughput", "throughput (req/s)", False)]
    for ax, (key, ylabel, logy) in zip(axes, panels):
        for i, (name, runs) in enumerate(series.items()):
            rates = sorted(runs)
            xs = [inf_x if math.isinf(r) else r for r in rates]
            ys = [runs[r].get(key) for r in rates]
            ax.plot(xs, ys, marker="o" if i == 0 else "s", linestyle="-" if i == 0 else "--",
                    label=name)
        ax.set_xscale("log")
        ticks = sorted({r for s in series.values() for r in s})
        ax.set_xticks([inf_x if math.isinf(r) else r for r in ticks],
                      [_label(r) for r in ticks])
        ax.minorticks_off()
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
