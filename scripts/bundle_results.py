"""Bundle result JSON files into one (the device tool brings back at most 8 files a call):

    python3 scripts/bundle_results.py OUT.json FILE.json...

OUT.json maps each file's name (without .json) to its parsed content; the inputs are removed
once OUT.json is written. Missing inputs are skipped (a run that wrote nothing). Each run's
per-token gaps ("itls": a list per request) are left out, and counted in "itls_dropped": they
are most of a serving result's bytes (a 2,048-request multi-turn run writes ~6 MB of them), and
the tool brings back no file over 16 MiB; every per-request list beside them is kept."""
from __future__ import annotations

import json
import os
import sys


def slim(result):
    """`result` without its runs' per-token gaps (in place; returned). A one-rate result holds
    its run's fields at top level too."""
    if isinstance(result, dict):
        for run in [result, *(result.get("runs") or ())]:
            if isinstance(run, dict) and isinstance(run.get("itls"), list):
                run["itls_dropped"] = sum(len(x) for x in run.pop("itls") if isinstance(x, list))
    return result


def bundle(out: str, paths: list[str]) -> dict:
    parts = {}
    for p in paths:
        if os.path.exists(p):
            with open(p) as f:
                parts[os.path.basename(p).removesuffix(".json")] = slim(json.load(f))
    with open(out, "w") as f:
        json.dump(parts, f, indent=1)
    for p in paths:
        if os.path.exists(p) and os.path.abspath(p) != os.path.abspath(out):
            os.remove(p)
    return parts


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    parts = bundle(sys.argv[1], sys.argv[2:])
    print(f"wrote {sys.argv[1]} ({len(parts)} results)")
