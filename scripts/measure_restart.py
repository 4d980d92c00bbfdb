"""Kills a running `pdserve serve`'s (first) worker with SIGKILL and measures, from /health, how
long until the router has noticed (status not "ok") and until the restarted worker serves again
(status "ok", one restart more); then one completion must succeed. Prints one JSON line."""
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request

BASE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"


def call(path, body=None):
    req = urllib.request.Request(BASE + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


pid = call("/admin/check")[1]["worker_pids"][0]
os.kill(pid, signal.SIGKILL)
t0 = time.monotonic()
seen, noticed = [], None
while time.monotonic() - t0 < 300:
    code, body = call("/health")
    if not seen or seen[-1][:2] != [code, body.get("status")]:
        seen.append([code, body.get("status"), round(time.monotonic() - t0, 3)])
    if body.get("status") != "ok" and noticed is None:
        noticed = time.monotonic() - t0
    if noticed is not None and body.get("status") == "ok":
        break
    time.sleep(0.02)
up = time.monotonic() - t0
code, out = call("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4})
print(json.dumps({"killed_pid": pid, "noticed_s": None if noticed is None else round(noticed, 3), "serving_again_s": round(up, 2),
                  "health_seen": seen, "completion_after": code,
                  "workers": body.get("workers")}))
