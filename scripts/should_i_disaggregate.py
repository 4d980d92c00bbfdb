"""Should I disaggregate here? For one profile and a fixed GPU count, the ratio of the best
disaggregated goodput to the best collocated goodput (pdserve plan's search and goodput
definition, pdserve/sim/planner.py) over a grid of KV interconnect bandwidth x prompt length x
TPOT SLO, at a fixed output length. Writes bench/results/should-i-disaggregate.{json,png}.

    disaggregated: the P/D units (no collocated worker) whose GPUs divide --num-gpus
    collocated:    1C (copies of it)
    ratio = best disaggregated goodput / best collocated goodput   (> 1: disaggregate)

The TTFT SLO is tied to the prompt: max(--ttft-floor-ms, --ttft-prefills x the profile's lone
prefill of the prompt), so that it is neither free nor impossible at every length. The
interconnect sets the profile's transfer_gb_per_s only (planner.scale_profile); collocated
runs move no KV, so they are simulated once per prompt length.

    PYTHONPATH=. python scripts/should_i_disaggregate.py
"""
from __future__ import annotations

import argparse
import math
import sys
import time

from pdserve.perf.workload import random_requests
from pdserve.sim.planner import (Candidate, Planner, check_gpus, load_profile, row,
                                 scale_profile, units)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="should_i_disaggregate")
    p.add_argument("--profile", default="h200-qwen2.5-1.5b")
    p.add_argument("--num-gpus", type=int, default=2)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--bandwidths", type=float, nargs="+",
                   default=[5, 12.5, 25, 50, 100, 200, 400],
                   help="GB/s: 5 (40 GbE), 12.5 (100 GbE), 25 (PCIe 4 x16), 50 (PCIe 5 x16), "
                        "100, 200, 400 (NVLink, effective)")
    p.add_argument("--tpot-slos", type=float, nargs="+", default=[10, 25, 50])
    p.add_argument("--ttft-floor-ms", type=float, default=50.0)
    p.add_argument("--ttft-prefills", type=float, default=3.0)
    p.add_argument("--collocated-chunks", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--disagg-chunks", type=int, nargs="+", default=[2048])
    p.add_argument("--max-unit-gpus", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=1500, help="the pool (most per probe)")
    p.add_argument("--min-prompts", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-bytes-per-token", type=int, default=None,
                   help="a what-if: replace the profile's KV bytes per token (e.g. 524288, a "
                        "7B model without GQA: 32 layers x 2 x 4096 x 2 B), step costs kept")
    p.add_argument("--out", default="bench/results/should-i-disaggregate.json")
    p.add_argument("--plot", default="bench/results/should-i-disaggregate.png")
    p.add_argument("--replot", default=None, metavar="JSON",
                   help="only draw --plot from an earlier run's JSON")
    a = p.parse_args(argv)
    if a.replot:
        import json
        with open(a.replot) as f:
            plot(json.load(f), a.plot)
        print("wrote", a.plot)
        return 0
    try:
        check_gpus(a.num_gpus)
        base = load_profile(a.profile)
        if a.kv_bytes_per_token is not None:
            import dataclasses
            base = dataclasses.replace(base, kv_bytes_per_token=a.kv_bytes_per_token)
    except ValueError as e:
        p.error(str(e))
    t_start = time.perf_counter()
    pd_units = units(a.num_gpus, [1], a.max_unit_gpus, ["disagg"])
    c_units = units(a.num_gpus, [1], a.max_unit_gpus, ["collocated"])
    points, sims = [], 0
    for L in a.prompt_lens:
        reqs = [(list(r.prompt), r.expected_output_len) for r in random_requests(
            a.num_prompts, L, a.output_len, 0.0, 0, 32000, a.seed)]
        ttft = max(a.ttft_floor_ms, a.ttft_prefills * base.prefill_ms(L))

        def best(profile, us, chunks, policy, runs, tpot):
            pl = Planner({1: profile}, reqs, {"ttft": ttft, "tpot": tpot}, a.min_prompts,
                         seed=a.seed, runs=runs)
            found = pl.search([Candidate(u, ch, policy) for u in us for ch in chunks])
            return pl, found

        c_runs: dict = {}     # collocated runs: the same at every bandwidth
        pd_runs: dict = {}    # bandwidth -> P/D runs (this prompt length only)
        for tpot in a.tpot_slos:
            pl, cf = best(base, c_units, a.collocated_chunks, "collocated", c_runs, tpot)
            sims += pl.num_simulations
            c_best = cf[0]
            for bw in a.bandwidths:
                prof = scale_profile(base, interconnect_gb_s=bw)
                runs = pd_runs.setdefault(bw, {})
                pl, df = best(prof, pd_units, a.disagg_chunks, "disagg", runs, tpot)
                sims += pl.num_simulations
                d_best = df[0]
                cg, dg = c_best.per_gpu, d_best.per_gpu
                pt = {"prompt_len": L, "output_len": a.output_len, "interconnect_gb_s": bw,
                      "slo_ttft_ms": ttft, "slo_tpot_ms": tpot,
                      "transfer_ms_of_prompt": prof.transfer_ms(L),
                      "best_collocated": row(c_best, a.num_gpus),
                      "best_disagg": row(d_best, a.num_gpus),
                      "disagg_candidates": [row(g, a.num_gpus) for g in df],
                      "collocated_candidates": [row(g, a.num_gpus) for g in cf],
                      "ratio": (dg / cg) if cg > 0 else (math.inf if dg > 0 else None)}
                points.append(pt)
                print(f"L={L} tpot={tpot:g} ttft={ttft:.0f} bw={bw:g}: disagg "
                      f"{d_best.candidate.unit.label} {dg * a.num_gpus:.2f} req/s vs collocated "
                      f"{c_best.candidate.label} {cg * a.num_gpus:.2f} -> "
                      f"{pt['ratio'] if pt['ratio'] is None else round(pt['ratio'], 3)} "
                      f"({time.perf_counter() - t_start:.0f} s)", flush=True)
    from pdserve.bench.common import git_info, hardware_info
    from pdserve.perf.files import write_json
    payload = {"benchmark": "should-i-disaggregate",
               "command": ["python", "scripts/should_i_disaggregate.py", *argv],
               **git_info(), "hardware_of_run": hardware_info(),
               "profile": {"source": a.profile, "model": base.model,
                           "hardware": base.hardware_label, "commit": base.commit,
                           "kv_bytes_per_token": base.kv_bytes_per_token,
                           "kv_bytes_per_token_replaced": a.kv_bytes_per_token is not None,
                           "transfer_note": base.fit.get("transfer", {}).get("note")},
               "num_gpus": a.num_gpus,
               "goodput_definition": "pdserve plan's: the largest Poisson rate on the grid "
                                     "2^(k/8) req/s at which >= 90% of the requests meet both "
                                     "SLOs and the run is not overloaded, per GPU",
               "ttft_slo_rule": f"max({a.ttft_floor_ms:g} ms, {a.ttft_prefills:g} x lone "
                                "prefill_ms(prompt))",
               "config": vars(a), "simulations": sims,
               "wall_s": time.perf_counter() - t_start, "points": points}
    print("wrote", write_json(a.out, payload, allow_nan=False))
    plot(payload, a.plot)
    print("wrote", a.plot)
    return 0


def plot(payload: dict, path: str) -> None:
    """One heatmap per TPOT SLO: prompt length (rows) x interconnect (columns), the ratio."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm
    pts = payload["points"]
    tpots = sorted({p["slo_tpot_ms"] for p in pts})
    lens = sorted({p["prompt_len"] for p in pts})
    bws = sorted({p["interconnect_gb_s"] for p in pts})
    ratios = [p["ratio"] for p in pts if p["ratio"] is not None and math.isfinite(p["ratio"])]
    hi = max([2.0, *ratios])
    fig, axes = plt.subplots(1, len(tpots), figsize=(5.0 * len(tpots), 3.6), squeeze=False)
    for n, (ax, tpot) in enumerate(zip(axes[0], tpots)):
        grid = [[math.nan] * len(bws) for _ in lens]
        for p in pts:
            if p["slo_tpot_ms"] == tpot and p["ratio"] is not None:
                grid[lens.index(p["prompt_len"])][bws.index(p["interconnect_gb_s"])] = min(
                    p["ratio"], hi)
        im = ax.imshow(grid, cmap="RdBu", norm=TwoSlopeNorm(1.0, 0.0, hi), aspect="auto",
                       origin="lower")
        for i, _ in enumerate(lens):
            for j, _ in enumerate(bws):
                v = grid[i][j]
                ax.text(j, i, "n/a" if math.isnan(v) else f"{v:.2f}", ha="center",
                        va="center", fontsize=8)
        ax.set_xticks(range(len(bws)), [f"{b:g}" for b in bws])
        ax.set_yticks(range(len(lens)), [str(n) for n in lens])
        ax.set_xlabel("KV interconnect (GB/s)")
        if n == 0:
            ax.set_ylabel("prompt tokens")
        ax.set_title(f"TPOT SLO {tpot:g} ms")
    fig.colorbar(im, ax=axes[0].tolist(), label="best P/D goodput / best collocated")
    prof = payload["profile"]
    what_if = (f", KV {prof['kv_bytes_per_token'] // 1024} KiB/token (what-if)"
               if prof.get("kv_bytes_per_token_replaced") else "")
    fig.suptitle(f"Should I disaggregate? {prof['model']} on {prof['hardware']} profile{what_if}, "
                 f"{payload['num_gpus']} GPUs, output {payload['config']['output_len']} tokens "
                 f"(simulated; >1: disaggregate)", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    sys.exit(main())
