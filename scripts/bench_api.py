"""CPU seconds the API process spends per streamed token and per request, with an engine that
costs nothing: the real app (build_app, AsyncEngine, uvicorn) in a child process, over a fake
EngineProtocol whose step() hands every unfinished request one more token every --step-ms, so
the API process, not the engine, is what a client waits on. The parent drives it with bench
serve's client (rate inf) and reads the child's CPU from /proc (Linux).

    PYTHONPATH=. python scripts/bench_api.py [--streams 128] [--tokens 128] [--step-ms 2]
        [--prompt-len 16] [--reps 3] [--output FILE] [--profile FILE.txt]

What it leaves out: the worker process and the ZMQ channel (the real client's I/O thread
receives and decodes each step's outputs: a part of the API process's CPU that this does not
count). --profile FILE: py-spy (if installed) records the child during the last rep, raw
stacks to FILE. The child's loop and HTTP implementation: BENCH_API_LOOP=uvloop (else
asyncio's), BENCH_API_HTTP=httptools (else h11; `pdserve serve`'s --loop / --http);
BENCH_API_CPROFILE=FILE: cProfile of the child (the event loop's thread) to FILE.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

from pdserve.perf.serving_path import process_cpu_s as cpu_s   # (the profiler's reading)


# ---- the child: the app over a fake engine ----------------------------------------------------
class FakeEngine:
    """EngineProtocol without a model: every step_s each unfinished request gets token 7;
    outputs are cumulative, as the real client's (one token list per request, grown in place,
    as the server's delta decoder does)."""

    def __init__(self, step_s: float):
        from pdserve.protocol import WorkerStats  # noqa: F401 (the real type exists)
        self.step_s = step_s
        self.reqs: dict[str, list] = {}
        self.answers: dict[str, str | None] = {}
        self.next_step = time.monotonic()
        self.tokenizer = None
        self.eos_token_ids = ()
        self.max_model_len = 1 << 15
        self.num_kv_blocks = 1 << 16
        self.info = None
        self.stats = None
        self.pids: list[int] = []
        self.workers: dict = {}

    def add_requests(self, requests):
        for r in requests:
            ids = r.prompt["prompt_token_ids"] if isinstance(r.prompt, dict) else r.prompt
            self.reqs[r.request_id] = [r, list(ids), [], r.params.max_tokens or 16]
        return [None] * len(requests)

    def submit(self, requests):
        """The router's add without waiting (the server's way): every request admitted; the
        answers come from take_answers()."""
        self.add_requests(requests)
        self.answers.update((r.request_id, None) for r in requests)
        return [None] * len(requests)

    def take_answers(self):
        out, self.answers = self.answers, {}
        return out

    def abort_request(self, request_id):
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.reqs.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self, timeout_s=None, wakeup_fd=None):
        from pdserve.outputs import CompletionOutput, RequestOutput
        wait = self.next_step - time.monotonic()
        if not self.reqs:
            wait = timeout_s if timeout_s is not None else 1.0
        if wait > 0:
            select.select([wakeup_fd] if wakeup_fd is not None else [], [], [], wait)
            if not self.reqs or time.monotonic() < self.next_step:
                return []
        self.next_step = time.monotonic() + self.step_s
        outs = []
        for rid, (req, prompt, toks, n) in list(self.reqs.items()):
            toks.append(7)
            done = len(toks) >= n
            outs.append(RequestOutput(rid, None, prompt, [CompletionOutput(
                0, "", toks, None, "length" if done else None, None, [7], "")], done))
            if done:
                del self.reqs[rid]
        return outs

    def health(self):
        return []

    def check_integrity(self):
        return None

    def num_free_blocks(self):
        return self.num_kv_blocks

    def drain(self, timeout_s=60.0):
        return []

    def shutdown(self, timeout_s=30.0):
        self.reqs.clear()


def child(port: int, step_ms: float) -> None:
    import uvicorn

    from pdserve.server.api import build_app
    from pdserve.server.async_engine import AsyncEngine
    from pdserve.server.http import ServeOptions

    async def serve():
        engine = AsyncEngine(FakeEngine(step_ms / 1e3), asyncio.get_running_loop())
        app = build_app(engine, "fake", ServeOptions(log_stats_interval_s=None), {})
        await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                            http=os.environ.get("BENCH_API_HTTP", "h11"))).serve()
    if os.environ.get("BENCH_API_LOOP") == "uvloop":
        import uvloop
        uvloop.run(serve())
    else:
        asyncio.run(serve())


# ---- the parent -------------------------------------------------------------------------------
async def burst(base_url: str, streams: int, tokens: int, prompt_len: int, seed: int):
    from pdserve.bench.serve import Target, _client, send_request
    from pdserve.perf.workload import SampleRequest
    import random
    rng = random.Random(seed)
    target = Target(base_url, "/v1/completions", timeout_s=600)
    reqs = [SampleRequest([rng.randrange(1000, 30000) for _ in range(prompt_len)], prompt_len,
                          tokens) for _ in range(streams)]
    async with _client(target, streams) as session:
        return await asyncio.gather(*(send_request(session, target, r) for r in reqs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--step-ms", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--output", default=None)
    p.add_argument("--profile", default=None)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        if os.environ.get("BENCH_API_CPROFILE"):    # the event loop's thread, profiled
            import cProfile
            import signal as sg
            prof = cProfile.Profile()
            sg.signal(sg.SIGTERM, lambda *_: (prof.disable(),
                                              prof.dump_stats(os.environ["BENCH_API_CPROFILE"]),
                                              os._exit(0)))
            prof.enable()
        child(a.child, a.step_ms)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        x for x in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    os.environ.get("PYTHONPATH")) if x))
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", str(port),
                             "--step-ms", str(a.step_ms)], env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        asyncio.run(burst(base, 8, 8, a.prompt_len, 99))    # (first-use paths)
        rows = []
        spy = None
        for rep in range(a.reps):
            if a.profile and rep == a.reps - 1:
                spy = subprocess.Popen(["py-spy", "record", "-p", str(proc.pid), "-r", "1000",
                                        "-f", "raw", "-o", a.profile, "--nonblocking"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            c0, t0 = cpu_s(proc.pid), time.perf_counter()
            res = asyncio.run(burst(base, a.streams, a.tokens, a.prompt_len, rep))
            wall, cpu = time.perf_counter() - t0, cpu_s(proc.pid) - c0
            bad = [r for r in res if not r.success]
            if bad:
                raise RuntimeError(f"{len(bad)} requests failed: {bad[0].error}")
            toks = sum(r.output_len for r in res)
            chunks = sum(1 + sum(1 for g in r.itl if g > 0) for r in res)
            rows.append({"wall_s": wall, "api_cpu_s": cpu, "output_tokens": toks,
                         "writes_seen": chunks, "us_per_token": cpu / toks * 1e6,
                         "tok_per_s": toks / wall,
                         "median_ttft_ms": statistics.median(r.ttft for r in res) * 1e3})
            print(f"rep {rep}: {toks} tokens in {wall:.2f} s ({toks / wall:,.0f} tok/s), API CPU "
                  f"{cpu:.2f} s = {cpu / toks * 1e6:.1f} us/token, ~{chunks} writes "
                  f"({toks / chunks:.1f} tokens each), median TTFT "
                  f"{rows[-1]['median_ttft_ms']:.0f} ms", flush=True)
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
    finally:
        proc.terminate()
        proc.wait(30)
    out = {"streams": a.streams, "tokens": a.tokens, "prompt_len": a.prompt_len,
           "step_ms": a.step_ms, "reps": rows,
           "us_per_token_median": statistics.median(r["us_per_token"] for r in rows)}
    print(f"median {out['us_per_token_median']:.1f} us of API CPU per token")
    if a.output:
        with open(a.output, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
