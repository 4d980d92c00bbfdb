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

The API process's CPU (the `pdserve serve` process itself: uvicorn, the API, the router and the
engine client's I/O thread, one Python process; not its worker processes): its user + system
seconds are read before and after each timed request and each served batch (process_cpu_s),
so each phase's row says what the API spent on it. A row per prompt length (the sum over its
requests: lengths differ, max_tokens is small), a row per served batch (short prompts, more
output tokens each), and a "long" row: the middle batch size once more with LONG_BATCH_FACTOR
times the tokens (ServedBatches.long_batch; a row for the API alone):
{"phase", "requests", "prompt_tokens", "writes", "output_tokens" (usage's), "steps",
"api_cpu_s", "wall_s"}; api_cpu_s None where the platform does not say. The phases mix
requests, prompt tokens, writes, output tokens and steps in different proportions, which is
what lets cost_fit.fit_serving_api separate the costs.

"steps" is the engine steps the server ran over the same windows: its Prometheus counter
pdserve:engine_steps_total (server/metrics.py, per worker and kind: summed) read from /metrics
just before and just after each window, outside the CPU readings (answering /metrics is the
API's own work); None where /metrics could not be read. The API pays for each step whose
outputs reach it (the engine client's I/O thread receives and decodes the worker's message and
wakes the event loop), whatever the number of streams in it: a lone request pays it per token,
b streams at once share it. The counter counts forwards (the StepRecords that reached the
router), not messages: a worker step that ran no forward is not in it, and a forward with no
output (a prefill chunk short of its prompt's end) is counted though it sends no message of its
own (its record rides with a later one). Over these phases every forward has outputs (each
prompt fits one step's budget), so the two agree: good enough for the fit. Like the CPU, the
count leaves out the pauses between the sequential requests (nothing runs then).

"writes" is the client's count of the SSE writes that carried the phase's tokens (client_writes:
per request, the distinct arrival times of its content chunks). The server writes a stream once
per wake-up with every token that arrived since its last write; a lone request's writes carry
one token each, a batch's several when the API lags, and that difference is what separates the
cost of a write from the cost of a token in it. The client sees reads, not writes: the chunks of
one write arrive in one read (the same arrival time, a gap of exactly 0 in bench serve's ITLs),
but at overload one read may hold several writes, so the count is a lower bound on the writes
(a write split over two reads would count twice; writes are a few hundred bytes, so that is
rare). The admission's comment and the closing usage / [DONE] write carry no content: they
are not counted (per request, they are in per_request_ms).

cost_fit.fit_serving turns the single requests into the serving_overhead_ms term (TTFT less the
profile's own lone-prefill time), cost_fit.fit_serving_batch the batches into serving_host_ms
(the server's host work per step), cost_fit.fit_serving_api the API rows into api_cost_ms. The
module imports no torch.
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
from typing import Any, Awaitable, Callable, NamedTuple, Sequence

STARTUP_TIMEOUT_S = 900.0   # CUDA: weights, then CUDA graphs captured up to the token budget
STOP_TIMEOUT_S = 60.0
PAUSE_S = 0.05              # between requests: the worker is idle when the next one arrives
REQUEST_TIMEOUT_S = 600.0
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Linux's encoding of clock_getcpuclockid(pid) (CPUCLOCK_SCHED of the whole thread group): a
# clock of the process's CPU time at ns resolution, user + system, every thread, children not
# included: the quantity /proc/<pid>/stat's utime + stime counts in clock ticks (10 ms), too
# coarse for a few requests' worth of a fast API
_CPUCLOCK_SCHED = 2


def _cpu_clock_s(pid: int) -> float | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return time.clock_gettime_ns(((~pid) << 3) | _CPUCLOCK_SCHED) / 1e9
    except (OSError, OverflowError):   # (no such process, or a kernel without the clock)
        return None


def _proc_stat_cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # (after the command, which may hold spaces and parentheses)
            rest = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # fields counted from 1: state is the 3rd, utime the 14th, stime the 15th
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float | None:
    """The CPU seconds (user + system, all its threads, none of its child processes) process
    `pid` has used so far: its CPU-time clock where Linux has one (ns), else /proc/<pid>/stat
    (clock ticks); None where neither can be read (another platform, or the process is gone)."""
    t = _cpu_clock_s(pid)
    return _proc_stat_cpu_s(pid) if t is None else t


def process_cpu_source(pid: int) -> str | None:
    """Which reading process_cpu_s(pid) gives (what the file records beside the rows)."""
    if _cpu_clock_s(pid) is not None:
        return "process CPU-time clock (clock_gettime, ns)"
    if _proc_stat_cpu_s(pid) is not None:
        return f"/proc/<pid>/stat utime + stime (1/{os.sysconf('SC_CLK_TCK')} s ticks)"
    return None


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


# pdserve's counter of engine steps (server/metrics.py: labelled by worker and kind)
ENGINE_STEPS = "pdserve:engine_steps_total"


def engine_steps_in(text: str) -> int:
    """The engine steps a /metrics exposition (Prometheus text) counts: ENGINE_STEPS summed
    over its labels; 0 where it has no sample yet (no step run). ValueError where a sample's
    value is not a number."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(ENGINE_STEPS) and line[len(ENGINE_STEPS):][:1] in ("{", " "):
            total += float(line.rsplit(None, 1)[1])
    return round(total)


def engine_steps(base_url: str) -> int | None:
    """The engine steps the server at base_url has run so far (its /metrics), None where that
    cannot be read."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
            return engine_steps_in(r.read().decode())
    except (urllib.error.URLError, OSError, ValueError):   # (no answer, or not a count)
        return None


class Readers(NamedTuple):
    """The server's running totals read around a phase: its API process's CPU seconds so far
    (process_cpu_s) and its engine steps so far (engine_steps); each None where unread."""
    cpu: Callable[[], "float | None"]
    steps: Callable[[], "int | None"]


class Window(NamedTuple):
    """What one measured window cost: the API's CPU seconds, the engine steps run (each None
    where a reading was missing) and the wall seconds."""
    cpu_s: float | None
    steps: int | None
    wall_s: float


def _delta(before, after):
    return None if before is None or after is None else after - before


async def _measured(read: Readers, work: Awaitable) -> tuple[Any, Window]:
    """work's result and its window: the step counter is read outside the CPU readings (a
    /metrics answer is the API's own work, not the window's)."""
    s0 = read.steps()
    c0, t0 = read.cpu(), time.perf_counter()
    res = await work
    wall = time.perf_counter() - t0
    c1 = read.cpu()
    return res, Window(_delta(c0, c1), _delta(s0, read.steps()), wall)


async def _send_sequential(base_url: str, prompts: Sequence[list[int]], max_tokens: int,
                           pause_s: float, read: Readers) -> list[tuple[Any, Window]]:
    """Each request's result and its window; the pauses between requests are in none."""
    from ..bench.serve import Target, _client, send_request   # bench serve's client
    from .workload import SampleRequest
    target = Target(base_url, "/v1/completions", timeout_s=REQUEST_TIMEOUT_S)
    out = []
    async with _client(target, 1) as session:
        for ids in prompts:
            out.append(await _measured(read, send_request(
                session, target, SampleRequest(ids, len(ids), max_tokens))))
            await asyncio.sleep(pause_s)
    return out


class ServedBatches(NamedTuple):
    """The served-batch phase: batch sizes (in the order sent), each request's prompt tokens
    and max_tokens (>= 2: a TPOT needs two tokens)."""
    sizes: Sequence[int]
    prompt_len: int
    max_tokens: int

    def long_batch(self) -> tuple[int, int] | None:
        """The API rows' long batch (b, max_tokens): the middle size again, with
        LONG_BATCH_FACTOR times the tokens (None without sizes)."""
        if not self.sizes:
            return None
        return self.sizes[len(self.sizes) // 2], LONG_BATCH_FACTOR * self.max_tokens


# After the served batches, the middle size once more with this many times their max_tokens,
# for the API's CPU alone (a "long" serving_api row, no serving_batch row): every other phase
# has a fixed number of tokens per request (the sequential max_tokens, the batches'), so a
# request's cost and its tokens' are nearly collinear there. On the H100 (87e52b4) the
# five-cost fit without it gave 3.16 ms a request and 0 a token, where a 320-token request
# costs the API ~14 ms.
LONG_BATCH_FACTOR = 4


class ServingRows(NamedTuple):
    """What measure_serving measured: the single requests' rows, the served batches' rows
    (empty without batches), the setup's facts, and the API process's CPU per phase (a row
    per prompt length of the single requests, then one per served batch, then the long
    batch's)."""
    rows: list[dict]
    batch_rows: list[dict]
    info: dict[str, Any]
    api_rows: list[dict]


async def _send_batches(base_url: str, batches: Sequence[tuple[Sequence[list[int]], int]],
                        pause_s: float, read: Readers) -> list[tuple[list, Window]]:
    """Each batch (its prompts, their max_tokens): its requests sent at once (the next batch
    after the last has ended), their results and the batch's window; up to the first batch
    with a failed request."""
    from ..bench.serve import Target, _client, send_request   # bench serve's client
    from .workload import SampleRequest
    target = Target(base_url, "/v1/completions", timeout_s=REQUEST_TIMEOUT_S)
    out = []
    # (a connection per stream: a smaller pool would queue requests in the client)
    async with _client(target, max((len(b) for b, _ in batches), default=1)) as session:
        for prompts, max_tokens in batches:
            res, window = await _measured(read, asyncio.gather(
                *(send_request(session, target, SampleRequest(ids, len(ids), max_tokens))
                  for ids in prompts)))
            out.append((list(res), window))
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


def client_writes(result) -> int:
    """The SSE writes a streamed request's content reached its client in, as the client can
    tell (the module docstring: a lower bound): its content chunks' distinct arrival times,
    one more than its nonzero token gaps (bench serve stamps every chunk of one read with the
    read's time). 0 for a request without content."""
    if not result.success:
        return 0
    return 1 + sum(1 for g in result.itl if g > 0)


def _api_row(phase: str, results: list, windows: Sequence[Window], **keys) -> dict[str, Any]:
    """The API's CPU over some requests (one phase, measured in `windows`): their counts
    (writes: client_writes, a lower bound), the engine steps, CPU and wall time summed over
    the windows (steps, api_cpu_s None when any reading was missing)."""
    def total(xs):
        return None if any(x is None for x in xs) else sum(xs)
    cpu_s = total([w.cpu_s for w in windows])
    return {"phase": phase, **keys, "requests": len(results),
            "prompt_tokens": sum(r.prompt_len for r in results),
            "writes": sum(client_writes(r) for r in results),
            "output_tokens": sum(r.output_len for r in results),
            "steps": total([w.steps for w in windows]),
            "api_cpu_s": None if cpu_s is None else round(cpu_s, 6),
            "wall_s": round(sum(w.wall_s for w in windows), 6)}


def measure(config, lengths: Sequence[int], reps: int, max_tokens: int, vocab_size: int,
            seed: int, threads: int | None = None) -> tuple[list[dict], dict[str, Any]]:
    """Rows {"n", "ttft_ms", "itl_ms", "e2e_ms", "output_tokens"} (one per timed request) and
    the setup's facts: measure_serving without batches."""
    got = measure_serving(config, lengths, reps, max_tokens, vocab_size, seed, threads)
    return got.rows, got.info


def measure_serving(config, lengths: Sequence[int], reps: int, max_tokens: int,
                    vocab_size: int, seed: int, threads: int | None = None,
                    batches: ServedBatches | None = None) -> ServingRows:
    """The single requests' rows {"n", "ttft_ms", "itl_ms", "e2e_ms", "output_tokens"} (one per
    timed request), then, with batches, one row per batch size {"b", "prompt_len",
    "max_tokens", "tpot_ms", "tpot_ms_p10", "tpot_ms_p90", "ctx_sum", "wall_s", ...}, from
    one server; the setup's facts; the API process's CPU rows (module docstring: one per
    prompt length, then one per batch, then the long batch's). RuntimeError when the server
    cannot start or a request fails (the server is stopped either way)."""
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
    long, long_prompts = None, []
    if sizes:
        long = batches.long_batch()
        info["served_batch"] = {"sizes": sizes, "prompt_len": batches.prompt_len,
                                "max_tokens": batches.max_tokens}
        info["api_long_batch"] = {"b": long[0], "max_tokens": long[1]}
        long_prompts = random_prompts(long[0], batches.prompt_len, batches.prompt_len + 1,
                                      vocab_size, seed * 104729 + 65537 + len(sizes))
    server = ServerProcess(argv, port, env)
    t0 = time.perf_counter()
    try:
        info["startup_s"] = round(server.start(), 2)
        pid = server.proc.pid   # (the API process: Popen runs it directly, no shell between)
        info["api_cpu_source"] = process_cpu_source(pid)
        read = Readers(lambda: process_cpu_s(pid), lambda: engine_steps(server.base_url))
        info["steps_source"] = (f"/metrics {ENGINE_STEPS}" if read.steps() is not None
                                else None)
        gc.collect()
        gc.freeze()     # (as bench serve: no full collection lands in a request's TTFT)
        try:
            sent = asyncio.run(_send_sequential(server.base_url, warm + timed, max_tokens,
                                                PAUSE_S, read))
            results = [r for r, _ in sent]
            bad = [r for r in results if not r.success]
            sent_batches = []
            if sizes and not bad:
                # (the served batches, then the long one: the API rows' alone)
                sent_batches = asyncio.run(_send_batches(
                    server.base_url, [(p, batches.max_tokens) for p in batch_prompts]
                    + [(long_prompts, long[1])], PAUSE_S, read))
        finally:
            gc.unfreeze()
    finally:
        info.update(server.stop())
        info["wall_s"] = round(time.perf_counter() - t0, 2)
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(results)} requests through the server failed: "
                           f"{bad[0].error}")
    batch_results, long_results = sent_batches[:len(sizes)], sent_batches[len(sizes):]
    for b, (res, _) in zip(sizes + ([long[0]] if long else []), sent_batches):
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
    batch_rows = [_batch_row(b, batches, res, window.wall_s)
                  for b, (res, window) in zip(sizes, batch_results)]
    timed_sent = sent[len(warm):]
    api_rows = []
    for i, n in enumerate(lengths):
        mine = timed_sent[i::len(lengths)]      # (timed interleaves the lengths)
        api_rows.append(_api_row("sequential", [r for r, _ in mine], [w for _, w in mine], n=n))
    for b, (res, window) in zip(sizes, batch_results):
        api_rows.append(_api_row("batch", res, [window], b=b))
    for res, window in long_results:
        api_rows.append(_api_row("long", res, [window], b=long[0]))
    return ServingRows(rows, batch_rows, info, api_rows)
