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

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[float, int]:
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    # fields after the command: state(3) ppid(4) ... utime(14) stime(15), counted from 1
    return (int(rest[11]) + int(rest[12])) / TICK, int(rest[1])


def _cmd(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]


def tree(root: int) -> dict[str, dict]:
    """{pid: {"cmd", "cpu_s"}} of root and its descendants alive now."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                parents[int(name)] = _stat(int(name))[1]
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
            out[str(p)] = {"cmd": _cmd(p), "cpu_s": _stat(p)[0]}
        except OSError:
            continue
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
