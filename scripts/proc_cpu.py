"""CPU seconds (user + system) of a process and of each of its descendants, from /proc (Linux):

    python3 scripts/proc_cpu.py PID                      -> {"<pid>": {"cmd": ..., "cpu_s": ...}}
    python3 scripts/proc_cpu.py PID --since BEFORE.json --attach RESULT.json
                                                          the growth since BEFORE, kept in
                                                          RESULT.json under "process_cpu_s"

The serve device stage uses it around one bench serve run: how much CPU the API server process
and the worker processes spent on it (is the API process the bottleneck at overload?)."""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pdserve.perf.serving_path import process_cpu_s  # noqa: E402 (the profiler's reading)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return int(rest[1])     # (after the command: state, then ppid)


def _cmd(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]


def tree(root: int) -> dict[str, dict]:
    """{pid: {"cmd", "cpu_s"}} of root and its descendants alive now."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                parents[int(name)] = _ppid(int(name))
            except (OSError, IndexError, ValueError):
                continue
    pids, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p and c not in pids]
        pids.update(kids)
        frontier += kids
    out = {}
    for p in sorted(pids):
        try:
            cmd, cpu = _cmd(p), process_cpu_s(p)
        except OSError:
            continue
        if cpu is not None:     # (None: it ended meanwhile)
            out[str(p)] = {"cmd": cmd, "cpu_s": cpu}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pid", type=int)
    ap.add_argument("--since", default=None)
    ap.add_argument("--attach", default=None)
    a = ap.parse_args(argv)
    now = tree(a.pid)
    if a.since is None:
        print(json.dumps(now))
        return 0
    with open(a.since) as f:
        before = json.load(f)
    grown = {p: {"cmd": v["cmd"], "cpu_s": round(v["cpu_s"] - before.get(p, {}).get("cpu_s", 0.0), 3)}
             for p, v in now.items()}
    print(json.dumps(grown, indent=1))
    if a.attach:
        with open(a.attach) as f:
            result = json.load(f)
        result["process_cpu_s"] = grown
        with open(a.attach, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
