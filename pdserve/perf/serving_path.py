"""The serving path's share of a request's latency, measured for `pdserve profile`: what a
request costs beyond its engine steps when it goes through `pdserve serve`.

    client ──HTTP──> pdserve serve (uvicorn, the API, the router) ──ZMQ──> worker process
      ^                                                                      │ steps (the
      └──── SSE <──── the API <──── the router <──── ZMQ <──── its output <──┘  profile's)

One `pdserve serve` subprocess with the profile's engine config (args.engine_argv: the same
flags a user would give it), one collocated worker, on a free local port; on CPU its worker
gets the profile's torch threads (OMP_NUM_THREADS). Requests go one at a time through `pdserve
bench serve`'s client (bench.serve.send_request on its session), each after the previous
stream has ended and a short pause, so nothing queues: streaming /v1/completions of token-id
prompts of a few lengths, max_tokens small, ignore_eos, greedy. First one untimed request per
length (first-use paths of the server and the worker), then `reps` per length, the lengths
interleaved (a machine whose speed drifts shifts them alike). Each request's TTFT, ITLs and e2e
are the client's, as bench serve measures them. The server is stopped with SIGTERM (its drain;
killed if it has not exited within STOP_TIMEOUT_S).

Then, on the same server (one start-up), the served batches (measure_serving's `batches`): for
each batch size b in turn, b streaming requests sent at once (fresh seeded random token-id
prompts of one length, one max_tokens, ignore_eos, greedy), the next batch after the last
stream has ended and the same pause. Each request's TPOT is (e2e - TTFT) / (output tokens - 1):
at load the API coalesces several tokens into one SSE chunk, so single token gaps (ITLs) are
not what a step costs, while the time from the first token to the last over the tokens between
is. A row per b: the median TPOT over its b requests (p10 and p90 beside it) and the mean
context sum while they decode, b * (prompt_len + max_tokens / 2).

cost_fit.fit_serving turns the single requests into the serving_overhead_ms term (TTFT less the
profile's own lone-prefill time), cost_fit.fit_serving_batch the batches into serving_host_ms
(the server's host work per step). The module imports no torch.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any, NamedTuple, Sequence

STARTUP_TIMEOUT_S = 900.0   # CUDA: weights, then CUDA graphs captured up to the token budget
STOP_TIMEOUT_S = 60.0
PAUSE_S = 0.05              # between requests: the worker is idle when the next one arrives
REQUEST_TIMEOUT_S = 600.0
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_argv(config, port: int) -> list[str]:
    """The `pdserve serve` command line of `config` (ValueError where no flag expresses it)."""
    from ..args import engine_argv
    return [sys.executable, "-m", "pdserve", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--disable-log-stats", "--worker-restarts", "0", *engine_argv(config)]


class ServerProcess:
    """A `pdserve serve` subprocess: start() waits until /health answers (RuntimeError with
    the end of its log if it exits or does not answer within timeout_s); stop() ends it."""

    def __init__(self, argv: Sequence[str], port: int, env: dict[str, str] | None = None):
        self.argv, self.port = list(argv), port
        self.base_url = f"http://127.0.0.1:{port}"
        self.env = env
        self.proc: subprocess.Popen | None = None
        # stderr to a file, not a pipe: a pipe nobody reads fills up and blocks the server
        self.log = tempfile.TemporaryFile("w+")

    def log_tail(self, chars: int = 2000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-chars:].strip()

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> float:
        """Seconds until the server answered."""
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=self.log,
                                     env=self.env, text=True)
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} before "
                                   f"it answered: {self.log_tail() or '(no output)'}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s: "
                           f"{self.log_tail() or '(no output)'}")

    def stop(self) -> dict[str, Any]:
        """SIGTERM (the server drains, then exits), a kill after STOP_TIMEOUT_S; what
        happened."""
        p = self.proc
        if p is None:
            return {"exit_code": None, "stopped_cleanly": True}
        killed = False
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                killed = True
        code = p.returncode
        self.log.close()
        # uvicorn drains, then re-raises the SIGTERM it caught: the conventional "killed by TERM"
        return {"exit_code": code, "killed": killed,
                "stopped_cleanly": not killed and code in (0, -signal.SIGTERM)}


async def _send_sequential(base_url: str, prompts: Sequence[list[int]], max_tokens: int,
                           pause_s: float) -> list:
    from ..bench.serve import Target, _client, send_request   # bench serve's client
    from .workload import SampleRequest
    target = Target(base_url, "/v1/completions", timeout_s=REQUEST_TIMEOUT_S)
    out = []
    async with _client(target, 1) as session:
        for ids in prompts:
            out.append(await send_request(session, target, SampleRequest(ids, len(ids),
                                                                          max_tokens)))
            await asyncio.sleep(pause_s)
    return out


class ServedBatches(NamedTuple):
    """The served-batch phase: batch sizes (in the order sent), each request's prompt tokens
    and max_tokens (>= 2: a TPOT needs two tokens)."""
    sizes: Sequence[int]
    prompt_len: int
    max_tokens: int


class ServingRows(NamedTuple):
    """What measure_serving measured: the single requests' rows, the served batches' rows
    (empty without batches) and the setup's facts."""
    rows: list[dict]
    batch_rows: list[dict]
    info: dict[str, Any]


async def _send_batches(base_url: str, batches: Sequence[Sequence[list[int]]], max_tokens: int,
                        pause_s: float) -> list[tuple[list, float]]:
    """Each batch's requests sent at once (the next batch after the last has ended): their
    results and the batch's wall time (s); up to the first batch with a failed request."""
    from ..bench.serve import Target, _client, send_request   # bench serve's client
    from .workload import SampleRequest
    target = Target(base_url, "/v1/completions", timeout_s=REQUEST_TIMEOUT_S)
    out = []
    # (a connection per stream: a smaller pool would queue requests in the client)
    async with _client(target, max((len(b) for b in batches), default=1)) as session:
        for prompts in batches:
            t0 = time.perf_counter()
            res = await asyncio.gather(*(send_request(session, target,
                                                      SampleRequest(ids, len(ids), max_tokens))
                                         for ids in prompts))
            out.append((list(res), time.perf_counter() - t0))
            if not all(r.success for r in res):
                break       # (the caller raises: no point loading the server further)
            await asyncio.sleep(pause_s)
    return out


def _batch_row(b: int, spec: ServedBatches, results: list, wall_s: float) -> dict[str, Any]:
    import numpy as np
    tpot = []
    for r in results:
        if r.output_len < 2:
            raise RuntimeError(f"a request of the {b}-stream batch returned {r.output_len} "
                               "token(s): its TPOT needs two")
        tpot.append((r.latency - r.ttft) / (r.output_len - 1) * 1e3)
    p10, p50, p90 = np.percentile(tpot, [10, 50, 90])
    return {"b": b, "prompt_len": spec.prompt_len, "max_tokens": spec.max_tokens,
            "tpot_ms": float(p50), "tpot_ms_p10": float(p10), "tpot_ms_p90": float(p90),
            "ctx_sum": b * (spec.prompt_len + spec.max_tokens / 2), "wall_s": round(wall_s, 4),
            "ttft_ms_median": float(np.median([r.ttft for r in results])) * 1e3,
            "tpot_ms_samples": [round(x, 4) for x in tpot]}


def measure(config, lengths: Sequence[int], reps: int, max_tokens: int, vocab_size: int,
            seed: int, threads: int | None = None) -> tuple[list[dict], dict[str, Any]]:
    """Rows {"n", "ttft_ms", "itl_ms", "e2e_ms", "output_tokens"} (one per timed request) and
    the setup's facts: measure_serving without batches."""
    rows, _, info = measure_serving(config, lengths, reps, max_tokens, vocab_size, seed, threads)
    return rows, info


def measure_serving(config, lengths: Sequence[int], reps: int, max_tokens: int,
                    vocab_size: int, seed: int, threads: int | None = None,
                    batches: ServedBatches | None = None) -> ServingRows:
    """The single requests' rows {"n", "ttft_ms", "itl_ms", "e2e_ms", "output_tokens"} (one per
    timed request), then, with batches, one row per batch size {"b", "prompt_len",
    "max_tokens", "tpot_ms", "tpot_ms_p10", "tpot_ms_p90", "ctx_sum", "wall_s", ...}, from
    one server; and the setup's facts. RuntimeError when the server cannot start or a request
    fails (the server is stopped either way)."""
    import gc

    from ..bench.common import random_prompts
    port = _free_port()
    argv = server_argv(config, port)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    if threads is not None and not str(config.device).startswith("cuda"):
        env["OMP_NUM_THREADS"] = str(threads)
    info: dict[str, Any] = {"command": ["pdserve", *argv[3:]], "max_tokens": max_tokens,
                            "pause_s": PAUSE_S, "reps": reps, "lengths": list(lengths),
                            "omp_num_threads": env.get("OMP_NUM_THREADS")}
    per_len = {n: random_prompts(reps + 1, n, n + 1, vocab_size, seed * 104729 + i)
               for i, n in enumerate(lengths)}
    warm = [per_len[n][0] for n in lengths]
    timed = [per_len[n][j] for j in range(1, reps + 1) for n in lengths]
    sizes = list(batches.sizes) if batches is not None else []
    # (seeds apart from the single requests': no prompt of a batch repeats one of theirs)
    batch_prompts = [random_prompts(b, batches.prompt_len, batches.prompt_len + 1, vocab_size,
                                    seed * 104729 + 65537 + i) for i, b in enumerate(sizes)]
    if sizes:
        info["served_batch"] = {"sizes": sizes, "prompt_len": batches.prompt_len,
                                "max_tokens": batches.max_tokens}
    server = ServerProcess(argv, port, env)
    t0 = time.perf_counter()
    try:
        info["startup_s"] = round(server.start(), 2)
        gc.collect()
        gc.freeze()     # (as bench serve: no full collection lands in a request's TTFT)
        try:
            results = asyncio.run(_send_sequential(server.base_url, warm + timed, max_tokens,
                                                   PAUSE_S))
            bad = [r for r in results if not r.success]
            batch_results = []
            if sizes and not bad:
                batch_results = asyncio.run(_send_batches(server.base_url, batch_prompts,
                                                          batches.max_tokens, PAUSE_S))
        finally:
            gc.unfreeze()
    finally:
        info.update(server.stop())
        info["wall_s"] = round(time.perf_counter() - t0, 2)
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(results)} requests through the server failed: "
                           f"{bad[0].error}")
    for b, (res, _) in zip(sizes, batch_results):
        failed = [r for r in res if not r.success]
        if failed:
            raise RuntimeError(f"{len(failed)} of the {b} requests sent at once through the "
                               f"server failed: {failed[0].error}")
    rows = []
    for r in results[len(warm):]:
        rows.append({"n": r.prompt_len, "ttft_ms": r.ttft * 1e3,
                     "itl_ms": [round(x * 1e3, 4) for x in r.itl], "e2e_ms": r.latency * 1e3,
                     "output_tokens": r.output_len})
    info["warmup_requests"] = len(warm)
    batch_rows = [_batch_row(b, batches, res, wall)
                  for b, (res, wall) in zip(sizes, batch_results)]
    return ServingRows(rows, batch_rows, info)
