"""`pdserve bench serve` against a synthetic OpenAI-compatible server with known delays (a
Starlette app under uvicorn in a subprocess): the measured TTFT, ITL, TPOT and e2e
latency match the delays, throughput matches the concurrency limit and the Poisson schedule,
goodput counts only requests within the SLOs, HTTP 500s and error chunks are failures with
their text, and main() writes vLLM's field names. The arithmetic alone (metrics, arrivals,
datasets): test_perf.py."""
import asyncio
import importlib.util
import json
import math
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from pdserve.bench import datasets as ds  # noqa: E402
from pdserve.bench import serve as bs  # noqa: E402
from pdserve.perf import slo, workload as wl  # noqa: E402
from pdserve.perf.metrics import compute_metrics  # noqa: E402
from pdserve.perf.workload import SampleRequest  # noqa: E402

TTFT_MS = 100.0    # the synthetic server's default first-chunk delay
ITL_MS = 20.0      # and gap between chunks
SLOW_TTFT_MS = 300.0
SLOW_ITL_MS = 60.0
# Lower bounds are tight (a client cannot see a token before the server sends it); upper bounds
# leave room for a noisy 2-core CI machine (scheduler hiccups, a first connection), and still
# catch a clock that counts the wrong interval.
TOL_MS = 60.0      # slack on TTFT / e2e
ITL_TOL_MS = 10.0  # on a mean or median ITL / TPOT

# ---- the synthetic server ----------------------------------------------------------------------
# A Starlette app under uvicorn in a process of its own (like a real server: no GIL shared with the
# client). A text prompt's first word picks the behaviour: slowfirst (TTFT 300 ms), slowdecode
# (ITL 60 ms), fail (HTTP 500), midfail (an error chunk after 2 chunks), nousage (no usage chunk),
# double (2 tokens per chunk); anything else, and token-id prompts: normal (TTFT 100 ms, ITL 20
# ms). ttft_ms / itl_ms in the body override the delays. GET /received lists the bodies seen
# since the last DELETE /received.
SERVER_SRC = r"""
import asyncio, json, math, sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

TTFT_MS, ITL_MS, SLOW_TTFT_MS, SLOW_ITL_MS = (float(x) for x in sys.argv[2:6])
RECEIVED = []


def sse(obj):
    return f"data: {json.dumps(obj)}\n\n"


async def handle(request, chat):
    body = await request.json()
    RECEIVED.append(body)
    prompt = body["messages"][0]["content"] if chat else body["prompt"]
    word = prompt.split()[0] if isinstance(prompt, str) and prompt.split() else ""
    if word == "fail":
        return JSONResponse({"error": {"message": "synthetic failure", "type": "server_error",
                                       "code": 500}}, status_code=500)
    n = int(body["max_tokens"])
    ttft = body.get("ttft_ms", TTFT_MS) / 1e3
    itl = body.get("itl_ms", ITL_MS) / 1e3
    if word == "slowfirst":
        ttft = SLOW_TTFT_MS / 1e3
    if word == "slowdecode":
        itl = SLOW_ITL_MS / 1e3
    per_chunk = 2 if word == "double" else 1
    n_chunks = math.ceil(n / per_chunk)
    text = "" if isinstance(prompt, list) else " tok"  # no tokenizer: empty text
    usage = {"prompt_tokens": len(prompt) if isinstance(prompt, list) else len(prompt.split()),
             "completion_tokens": n}

    async def gen():
        if chat:  # the role announcement comes at once; it is not a token
            yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None}]})
        await asyncio.sleep(ttft)
        for i in range(n_chunks):
            if i:
                await asyncio.sleep(itl)
            if word == "midfail" and i == 2:
                yield sse({"error": {"message": "engine died", "code": 500}})
                return
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
            else:
                choice = {"index": 0, "text": text,
                          "finish_reason": "length" if i == n_chunks - 1 else None}
            yield sse({"id": "x", "choices": [choice]})
        if chat:  # a bare finish chunk: not a token either
            yield sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        if word != "nousage" and body.get("stream_options", {}).get("include_usage"):
            yield sse({"id": "x", "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream")


async def completions(request):
    return await handle(request, False)


async def chat(request):
    return await handle(request, True)


async def received(request):
    if request.method == "DELETE":
        RECEIVED.clear()
        return Response(status_code=204)
    return JSONResponse(RECEIVED)


app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                        Route("/v1/chat/completions", chat, methods=["POST"]),
                        Route("/received", received, methods=["GET", "DELETE"])])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", lifespan="off")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    script = tmp_path_factory.mktemp("fake_server") / "server.py"
    script.write_text(SERVER_SRC)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(script), str(port), str(TTFT_MS), str(ITL_MS),
                             str(SLOW_TTFT_MS), str(SLOW_ITL_MS)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"synthetic server exited: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "synthetic server did not start"
            try:
                if httpx.get(base + "/received", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        warm = bs.Target(base, extra_body={"ttft_ms": 1, "itl_ms": 1})
        assert asyncio.run(bs.preflight(warm, SampleRequest("hello", 1, 2))).success
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _received(base: str) -> list[dict]:
    return httpx.get(base + "/received", timeout=5).json()


def _clear_received(base: str) -> None:
    httpx.delete(base + "/received", timeout=5)


def _run(target, requests, rate=math.inf, **kw):
    return asyncio.run(bs.run_benchmark(target, requests, rate, **kw))


def _reqs(words: list[str], out_len: int) -> list[SampleRequest]:
    return [SampleRequest(f"{w} request {i}", 3, out_len) for i, w in enumerate(words)]


# ---- timing against known delays ---------------------------------------------------------------
def test_latencies_match_the_server_delays(server):
    n_out, n = 6, 4  # two at a time: little queueing in the client or the server
    results, duration = _run(bs.Target(server), _reqs(["normal"] * n, n_out), max_concurrency=2)
    m = compute_metrics(results, duration)
    assert m["completed"] == n and m["failed"] == 0 and m["errors"] == [""] * n
    assert m["output_lens"] == [n_out] * n and m["total_output_tokens"] == n * n_out
    assert m["input_lens"] == [3] * n  # the server's usage.prompt_tokens
    e2e = TTFT_MS + (n_out - 1) * ITL_MS
    for r in results:
        assert TTFT_MS - 2 <= r.ttft * 1e3 <= TTFT_MS + TOL_MS, r.ttft
        assert len(r.itl) == n_out - 1
        assert ITL_MS - 1 <= r.tpot * 1e3 <= ITL_MS + ITL_TOL_MS, r.tpot
        assert e2e - 2 <= r.latency * 1e3 <= e2e + TOL_MS + ITL_TOL_MS, r.latency
        assert r.tpot == pytest.approx((r.latency - r.ttft) / (n_out - 1))
        assert sum(r.itl) == pytest.approx(r.latency - r.ttft)
    assert TTFT_MS - 2 <= m["mean_ttft_ms"] <= TTFT_MS + TOL_MS * 0.6
    for key in ("median_itl_ms", "mean_itl_ms", "mean_tpot_ms", "median_tpot_ms"):
        assert ITL_MS - 1 <= m[key] <= ITL_MS + ITL_TOL_MS, key
    assert e2e - 2 <= m["mean_e2el_ms"] <= e2e + TOL_MS + ITL_TOL_MS
    assert m["p99_ttft_ms"] >= m["p90_ttft_ms"] >= m["median_ttft_ms"] - 1e-9
    # two waves of two requests
    assert 2 * e2e / 1e3 <= duration <= 2 * (e2e + TOL_MS) / 1e3
    assert m["request_throughput"] == pytest.approx(n / duration)
    assert m["output_throughput"] == pytest.approx(n * n_out / duration)
    assert m["total_token_throughput"] == pytest.approx(n * (n_out + 3) / duration)


def test_output_tokens_from_usage_else_chunks(server):
    reqs = _reqs(["double", "nousage"], 8)
    results, _ = _run(bs.Target(server), reqs)
    double, nousage = results
    assert double.success and double.output_len == 8 and len(double.itl) == 3  # 4 chunks
    assert double.tpot == pytest.approx((double.latency - double.ttft) / 7)
    assert nousage.success and nousage.output_len == 8 and len(nousage.itl) == 7
    assert nousage.prompt_len == 3  # the dataset's, with no usage chunk


def test_max_concurrency_one_serializes_requests(server):
    t = bs.Target(server, extra_body={"ttft_ms": 50, "itl_ms": 10})
    results, duration = _run(t, _reqs(["normal"] * 5, 4), max_concurrency=1)
    m = compute_metrics(results, duration)
    assert m["completed"] == 5
    for a, b in zip(results, results[1:]):  # each starts after the one before has finished
        assert b.start >= a.start + a.latency
    assert 80 - 2 <= m["median_e2el_ms"] <= 80 + TOL_MS  # median: one slow first connection
    # one at a time: throughput = 1 / (time per request), within what connection reuse costs
    assert m["request_throughput"] * m["mean_e2el_ms"] / 1e3 == pytest.approx(1.0, rel=0.15)
    results2, duration2 = _run(t, _reqs(["normal"] * 5, 4), max_concurrency=5)
    assert duration2 < duration / 3  # all five overlap


def test_send_times_follow_the_poisson_schedule(server):
    rate, n, seed = 20.0, 30, 3
    t = bs.Target(server, extra_body={"ttft_ms": 10, "itl_ms": 5})
    results, duration = _run(t, _reqs(["normal"] * n, 2), rate, seed=seed)
    want = wl.arrival_times(n, rate, 1.0, seed)
    got = np.array([r.start for r in results])
    assert np.all(got >= want - 1e-3) and np.all(got <= want + TOL_MS / 1e3), got - want
    assert all(r.success for r in results)
    last = results[-1]
    assert duration == pytest.approx(max(r.start + r.latency for r in results), abs=TOL_MS / 1e3)
    assert duration >= want[-1] + last.latency
    # throughput is the schedule's: n requests over the span of the arrivals (plus the last one)
    assert compute_metrics(results, duration)["request_throughput"] == pytest.approx(
        n / (want[-1] + 0.015), rel=0.05)


def test_goodput_counts_only_requests_within_every_slo(server):
    words = ["fast"] * 4 + ["slowfirst"] * 3 + ["slowdecode"] * 3
    results, duration = _run(bs.Target(server), _reqs(words, 4))
    assert all(r.success for r in results)
    # fast: TTFT 100, TPOT 20, e2e 160; slowfirst: TTFT 300, e2e 360; slowdecode: TPOT 60, e2e 280
    cases = [({"ttft": 200, "tpot": 40}, 4), ({"ttft": 200}, 7), ({"tpot": 40}, 7),
             ({"e2el": 250}, 4), ({"e2el": 320}, 7), ({"ttft": 1000, "tpot": 1000}, 10),
             ({"ttft": 50}, 0)]
    for slos, good in cases:
        m = compute_metrics(results, duration, goodput=slos)
        assert m["num_good_requests"] == good, slos
        assert m["request_goodput"] == pytest.approx(good / duration)
        assert [slo.meets_slos(r, slos) for r in results][:4] == [good > 0] * 4
    assert "request_goodput" not in compute_metrics(results, duration)
    assert slo.parse_goodput(["ttft:200", "TPOT:50.5", "e2el:1000"]) == {
        "ttft": 200.0, "tpot": 50.5, "e2el": 1000.0}
    for bad in (["ttft"], ["itl:5"], ["ttft:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            slo.parse_goodput(bad)


def test_failed_requests_are_counted_with_their_errors(server):
    words = ["ok", "fail", "ok", "midfail", "fail", "ok"]
    results, duration = _run(bs.Target(server), _reqs(words, 5))
    m = compute_metrics(results, duration)
    assert m["completed"] == 3 and m["failed"] == 3
    errs = m["errors"]
    assert errs[0] == errs[2] == errs[5] == ""
    assert errs[1] == errs[4] == "HTTP 500: synthetic failure"
    assert errs[3] == "error in stream: engine died"
    assert m["ttfts"][1] is None and m["itls"][1] == [] and m["output_lens"][3] == 0
    assert m["total_output_tokens"] == 15 and m["request_throughput"] == pytest.approx(3 / duration)


# ---- the command line --------------------------------------------------------------------------
VLLM_FIELDS = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
               "request_throughput", "output_throughput", "total_token_throughput",
               "request_goodput", "input_lens", "output_lens", "ttfts", "itls", "errors"] + [
    f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
    for s in ("mean", "median", "std", "p50", "p90", "p99")]


def test_main_rate_sweep_end_to_end(server, tmp_path, capsys):
    out = tmp_path / "res.json"
    _clear_received(server)
    rc = bs.main(["--base-url", server, "--num-prompts", "6", "--random-input-len", "16",
                  "--random-output-len", "5", "--random-range-ratio", "0.2", "--vocab-size",
                  "49152", "--request-rate", "40", "inf", "--max-concurrency", "4",
                  "--goodput", "ttft:1000", "tpot:1000", "--model", "fake-model",
                  "--extra-body", '{"ttft_ms": 30, "itl_ms": 5}', "--seed", "4",
                  "--result-file", str(out), "--disable-tqdm"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["request_rate"] for r in res["runs"]] == ["40", "inf"]
    want = wl.random_requests(6, 16, 5, 0.2, 0, 49152, 4)
    for run in res["runs"]:
        missing = [f for f in VLLM_FIELDS if f not in run]
        assert not missing
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["request_goodput"] == pytest.approx(6 / run["duration"])
        assert run["input_lens"] == [r.prompt_len for r in want]
        assert run["output_lens"] == [r.expected_output_len for r in want]
        assert run["max_concurrency"] == 4 and run["burstiness"] == 1.0
        assert 28 <= run["mean_ttft_ms"] <= 30 + TOL_MS
    assert res["command"][:3] == ["pdserve", "bench", "serve"]
    assert res["config"]["request_rate"] == [40.0, "inf"] and "hardware" in res
    assert "git_commit" in res and "duration" not in res  # a sweep: metrics only under runs
    received = _received(server)
    assert len(received) == 1 + 12  # the preflight, then both runs
    for body in received[1:7]:
        assert body["model"] == "fake-model" and body["ignore_eos"] is True
        assert body["temperature"] == 0 and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert isinstance(body["prompt"], list) and all(isinstance(i, int) for i in body["prompt"])
    assert sorted(b["max_tokens"] for b in received[1:7]) == \
        sorted(r.expected_output_len for r in want)
    assert received[0]["max_tokens"] <= 8
    printed = capsys.readouterr().out
    assert "TTFT ms" in printed and "goodput" in printed and str(out) in printed


def test_main_chat_sharegpt_single_run(server, tmp_path):
    path = tmp_path / "sg.json"
    ds.main(["make-sharegpt", str(path), "--num", "40", "--seed", "0"])
    out = tmp_path / "chat.json"
    _clear_received(server)
    rc = bs.main(["--base-url", server, "--endpoint", "/v1/chat/completions",
                  "--dataset-name", "sharegpt", "--dataset-path", str(path),
                  "--sharegpt-output-len", "4", "--num-prompts", "5", "--no-ignore-eos",
                  "--temperature", "0.5", "--result-file", str(out), "--disable-tqdm",
                  "--skip-preflight", "--metric-percentiles", "50,95", "--max-concurrency", "2"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 5 and len(res["runs"]) == 1  # a single run: also at the top level
    assert "p95_ttft_ms" in res and "p99_ttft_ms" not in res
    # the role chunk (sent at once) and the bare finish chunk are not tokens
    assert all(TTFT_MS - 2 <= t * 1e3 <= TTFT_MS + TOL_MS for t in res["ttfts"]), (res["ttfts"], res["start_times"])
    assert all(len(gaps) == 3 for gaps in res["itls"])
    received = _received(server)
    assert len(received) == 5
    for body in received:
        assert body["messages"][0]["role"] == "user" and isinstance(body["messages"][0]["content"], str)
        assert "ignore_eos" not in body and body["temperature"] == 0.5 and "model" not in body
    assert bs.main(["--base-url", server, "--endpoint", "/v1/chat/completions", "--token-ids",
                    "--num-prompts", "2"]) == 2


def test_refused_connection_is_a_clear_error(tmp_path, capsys):
    base = f"http://127.0.0.1:{_free_port()}"
    assert bs.main(["--base-url", base, "--num-prompts", "3", "--disable-tqdm",
                    "--result-file", str(tmp_path / "x.json")]) == 1
    err = capsys.readouterr().err
    assert "cannot connect to" in err and "is the server running?" in err
    assert not (tmp_path / "x.json").exists()
    # without the test request: every request fails with that error; the run still reports
    assert bs.main(["--base-url", base, "--num-prompts", "3", "--disable-tqdm", "--skip-preflight",
                    "--random-input-len", "8", "--result-file", str(tmp_path / "y.json")]) == 1
    res = json.loads((tmp_path / "y.json").read_text())
    assert res["completed"] == 0 and res["failed"] == 3
    assert all(e.startswith(f"cannot connect to {base}/v1/completions") for e in res["errors"])
    assert "no request completed" in capsys.readouterr().err


def test_plot_or_clear_error(server, tmp_path, capsys):
    png = tmp_path / "plot.png"
    args = ["--base-url", server, "--num-prompts", "4", "--random-input-len", "8",
            "--random-output-len", "3", "--request-rate", "50", "inf", "--extra-body",
            '{"ttft_ms": 5, "itl_ms": 2}', "--goodput", "ttft:100", "--disable-tqdm",
            "--result-file", str(tmp_path / "p.json"), "--plot", str(png)]
    if importlib.util.find_spec("matplotlib") is None:
        assert bs.main(args) == 2
        assert "--plot needs matplotlib" in capsys.readouterr().err
        assert not (tmp_path / "p.json").exists()  # refused before running anything
    else:
        assert bs.main(args) == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_help():
    r = subprocess.run([sys.executable, "-m", "pdserve", "bench", "serve", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for opt in ("--request-rate", "--burstiness", "--max-concurrency", "--goodput",
                "--dataset-name", "--random-prefix-len", "--plot", "--metric-percentiles"):
        assert opt in r.stdout
