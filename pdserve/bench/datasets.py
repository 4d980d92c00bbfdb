"""`python -m pdserve.bench.datasets make-sharegpt OUT.json --num N --seed S`: writes a synthetic
ShareGPT-format file for `pdserve bench serve --dataset-name sharegpt` (the real one cannot be
downloaded everywhere). The datasets themselves live in pdserve.perf.workload."""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..perf.workload import make_sharegpt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.datasets",
                                description="Dataset helpers for pdserve bench serve.")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-sharegpt", help="write a synthetic ShareGPT-format JSON file")
    m.add_argument("out")
    m.add_argument("--num", type=int, default=1000)
    m.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    data = make_sharegpt(a.num, a.seed)
    folder = os.path.dirname(a.out)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(data, f)
    print(f"wrote {len(data)} conversations to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
