"""Where a process's busy samples went, from `py-spy record -f raw` files (one line per
distinct stack: frames separated by ';', then a count):

    python3 scripts/pyspy_summary.py RAW.txt [RAW2.txt ...] [--top 40] [--json OUT.json]

Frames are counted per function (--lines: per source line). Samples whose innermost frame is a
wait (a selector or zmq poll, a thread pool's idle worker,
a lock or queue wait, a sleep) are counted as idle and left out; of the rest it prints, per
function, the samples in it (self) and under it (inclusive), as shares of the busy samples.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys

IDLE = ("Poller.poll", "poll (", "select (", "EpollSelector.select", "_worker (concurrent",
        "wait (threading", "Condition.wait", "Event.wait (threading", "sleep (", "get (queue",
        "_wait_for_tstate_lock")


def _name(frame: str, lines: bool) -> str:
    """"func (path/file.py:123)" -> "func (file.py)" (by function), or as it is (lines)."""
    frame = frame.strip()
    if lines or not frame.endswith(")") or " (" not in frame:
        return frame
    func, _, where = frame.rpartition(" (")
    return f"{func} ({where.rsplit(':', 1)[0].rsplit('/', 1)[-1]})"


def summarize(paths: list[str], lines: bool = False) -> dict:
    own: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    busy = idle = 0
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.rstrip("\n")
                stack, _, n = line.rpartition(" ")
                if not stack or not n.isdigit():
                    continue
                frames = [x.strip() for x in stack.split(";") if x.strip()]
                if not frames:
                    continue
                if frames[-1].startswith(IDLE):
                    idle += int(n)
                    continue
                frames = [_name(x, lines) for x in frames]
                busy += int(n)
                own[frames[-1]] += int(n)
                for fr in set(frames):
                    incl[fr] += int(n)
    return {"busy_samples": busy, "idle_samples": idle,
            "self": own.most_common(), "inclusive": incl.most_common()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", nargs="+")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--json", default=None)
    p.add_argument("--lines", action="store_true", help="per source line, not per function")
    a = p.parse_args(argv)
    s = summarize(a.raw, a.lines)
    busy = max(1, s["busy_samples"])
    print(f"busy samples {s['busy_samples']}, idle {s['idle_samples']}")
    for title in ("self", "inclusive"):
        print(f"--- {title}")
        for fr, n in s[title][:a.top]:
            print(f"{100.0 * n / busy:6.1f}%  {fr[:140]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**s, "self": s["self"][:200], "inclusive": s["inclusive"][:400]}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
