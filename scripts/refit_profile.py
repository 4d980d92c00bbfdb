"""Refit a cost profile (pdserve profile's JSON) from its own samples:

    python3 scripts/refit_profile.py IN.json OUT.json [--graph-shapes]

--graph-shapes fits the prefill and mixed rows at the CUDA-graph buckets the measuring engine
padded them to (its engine_config's; perf/cost_fit.py, step_shapes.py), for a file made before
profiles recorded them (fit_graph_sizes). Without it the file is refitted at the shapes it was
fitted at. Prints the terms that changed."""
from __future__ import annotations

import argparse
import sys

from pdserve.perf.cost_fit import refit
from pdserve.perf.cost_profile import CostProfile
from pdserve.step_shapes import graph_max_tokens, mixed_sizes

TERMS = ("prefill_fixed_ms", "alpha_ms_per_token", "prefill_quadratic_ms", "gamma_ms_per_token",
         "serving_overhead_ms", "batch_threshold")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--graph-shapes", action="store_true",
                   help="fit at the measuring engine's CUDA-graph buckets")
    a = p.parse_args(argv)
    try:
        old = CostProfile.from_json(a.input)
        sizes = None
        if a.graph_shapes:
            sizes = mixed_sizes(graph_max_tokens(old.engine_config))
            if not sizes:
                raise ValueError(f"{a.input}: its engine_config ran no CUDA graphs")
        new = refit(old, sizes)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for t in TERMS:
        if getattr(old, t) != getattr(new, t):
            print(f"{t}: {getattr(old, t):.6g} -> {getattr(new, t):.6g}")
    if old.serving_host_ms != new.serving_host_ms:     # (a dict: {} or fixed_ms, per_seq_ms)
        print(f"serving_host_ms: {old.serving_host_ms} -> {new.serving_host_ms}")
    print(f"fit_graph_sizes: {old.fit_graph_sizes} -> {new.fit_graph_sizes}")
    print("wrote", new.save(a.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
