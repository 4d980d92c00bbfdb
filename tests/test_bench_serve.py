"""`pdserve bench serve` against a synthetic OpenAI-compatible server with known delays (a
Starlette app under uvicorn in a subprocess): the measured TTFT, ITL, TPOT and e2e
latency match the delays, throughput matches the concurrency limit and the Poisson schedule,
goodput counts only requests within the SLOs, HTTP 500s and error chunks are failures with
their text, the arrival generator has the gamma moments, each dataset has the lengths asked for,
and main() writes vLLM's field names."""
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
from pdserve.bench.datasets import SampleRequest  # noqa: E402

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
    m = bs.compute_metrics(results, duration)
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
    m = bs.compute_metrics(results, duration)
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
    want = bs.arrival_times(n, rate, 1.0, seed)
    got = np.array([r.start for r in results])
    assert np.all(got >= want - 1e-3) and np.all(got <= want + TOL_MS / 1e3), got - want
    assert all(r.success for r in results)
    last = results[-1]
    assert duration == pytest.approx(max(r.start + r.latency for r in results), abs=TOL_MS / 1e3)
    assert duration >= want[-1] + last.latency
    # throughput is the schedule's: n requests over the span of the arrivals (plus the last one)
    assert bs.compute_metrics(results, duration)["request_throughput"] == pytest.approx(
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
        m = bs.compute_metrics(results, duration, goodput=slos)
        assert m["num_good_requests"] == good, slos
        assert m["request_goodput"] == pytest.approx(good / duration)
        assert [bs.meets_slos(r, slos) for r in results][:4] == [good > 0] * 4
    assert "request_goodput" not in bs.compute_metrics(results, duration)
    assert bs.parse_goodput(["ttft:200", "TPOT:50.5", "e2el:1000"]) == {
        "ttft": 200.0, "tpot": 50.5, "e2el": 1000.0}
    for bad in (["ttft"], ["itl:5"], ["ttft:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            bs.parse_goodput(bad)


def test_failed_requests_are_counted_with_their_errors(server):
    words = ["ok", "fail", "ok", "midfail", "fail", "ok"]
    results, duration = _run(bs.Target(server), _reqs(words, 5))
    m = bs.compute_metrics(results, duration)
    assert m["completed"] == 3 and m["failed"] == 3
    errs = m["errors"]
    assert errs[0] == errs[2] == errs[5] == ""
    assert errs[1] == errs[4] == "HTTP 500: synthetic failure"
    assert errs[3] == "error in stream: engine died"
    assert m["ttfts"][1] is None and m["itls"][1] == [] and m["output_lens"][3] == 0
    assert m["total_output_tokens"] == 15 and m["request_throughput"] == pytest.approx(3 / duration)


# ---- metrics arithmetic ------------------------------------------------------------------------
def test_compute_metrics_exact_numbers():
    rs = []
    for i, (ttft, lat, n) in enumerate([(0.1, 1.0, 10), (0.2, 0.5, 4), (0.3, 0.3, 1), (0.4, 2.0, 5)]):
        r = bs.RequestResult(7, n, success=True, output_len=n, ttft=ttft, latency=lat,
                             itl=[(lat - ttft) / max(1, n - 1)] * (n - 1), start=i)
        rs.append(r)
    rs.append(bs.RequestResult(9, 3, error="HTTP 503: busy"))
    m = bs.compute_metrics(rs, 4.0, percentiles=[50, 99.9], goodput={"tpot": 150})
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == \
        (4, 1, 28, 20)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 5.0
    assert m["total_token_throughput"] == 12.0
    assert m["mean_ttft_ms"] == pytest.approx(250) and m["median_ttft_ms"] == pytest.approx(250)
    assert m["std_ttft_ms"] == pytest.approx(np.std([100, 200, 300, 400]))
    assert m["p50_ttft_ms"] == pytest.approx(250)
    assert m["p99.9_ttft_ms"] == pytest.approx(np.percentile([100, 200, 300, 400], 99.9))
    assert "p99_ttft_ms" not in m and "p90_ttft_ms" not in m
    # TPOT: (1.0-0.1)/9 = 0.1, (0.5-0.2)/3 = 0.1, none for one token, (2.0-0.4)/4 = 0.4
    assert m["tpots"][2] is None and m["tpots"][4] is None
    assert [m["tpots"][i] for i in (0, 1, 3)] == pytest.approx([0.1, 0.1, 0.4])
    assert m["mean_tpot_ms"] == pytest.approx(200)
    assert m["num_good_requests"] == 3  # the one-token request has no TPOT: within the SLO
    assert m["mean_e2el_ms"] == pytest.approx(950)
    assert len([g for r in rs for g in r.itl]) == 9 + 3 + 4
    assert m["errors"] == ["", "", "", "", "HTTP 503: busy"]
    empty = bs.compute_metrics([bs.RequestResult(3, 3, error="x")], 1.0)
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None and empty["p99_itl_ms"] is None


# ---- arrivals ----------------------------------------------------------------------------------
def test_arrival_times_are_poisson_with_the_right_mean():
    n, rate = 20001, 4.0
    t = bs.arrival_times(n, rate, 1.0, seed=0)
    assert t[0] == 0 and np.all(np.diff(t) > 0) and len(t) == n
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.02)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1.0, abs=0.08)  # exponential: CV^2 1
    assert (gaps < gaps.mean()).mean() == pytest.approx(1 - math.exp(-1), abs=0.012)
    assert np.array_equal(t, bs.arrival_times(n, rate, 1.0, seed=0))
    assert not np.array_equal(t, bs.arrival_times(n, rate, 1.0, seed=1))
    assert np.allclose(bs.arrival_times(n, 2 * rate, 1.0, seed=0), t / 2)
    assert np.array_equal(bs.arrival_times(5, math.inf), np.zeros(5))
    assert len(bs.arrival_times(0, rate)) == 0
    with pytest.raises(ValueError):
        bs.arrival_times(3, 0.0)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 2.0, 4.0])
def test_burstiness_sets_the_gamma_variance(burstiness):
    rate = 10.0
    gaps = np.diff(bs.arrival_times(40001, rate, burstiness, seed=7))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # gamma(shape k, mean 1/rate): variance 1 / (k rate^2), i.e. CV^2 = 1 / k
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.1)


# ---- datasets ----------------------------------------------------------------------------------
def test_random_dataset_lengths_and_prefix():
    reqs = ds.random_requests(500, 100, 20, range_ratio=0.5, vocab_size=1000, seed=0)
    ins = [r.prompt_len for r in reqs]
    outs = [r.expected_output_len for r in reqs]
    assert min(ins) == 50 and max(ins) == 150 and min(outs) == 10 and max(outs) == 30
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    assert all(0 <= i < 1000 for r in reqs for i in r.prompt)
    assert abs(np.mean(ins) - 100) < 4
    fixed = ds.random_requests(20, 64, 16, vocab_size=49152, seed=1)
    assert {r.prompt_len for r in fixed} == {64} and {r.expected_output_len for r in fixed} == {16}
    assert fixed == ds.random_requests(20, 64, 16, vocab_size=49152, seed=1)
    pre = ds.random_requests(50, 40, 8, range_ratio=0.25, prefix_len=16, vocab_size=5000, seed=2)
    head = pre[0].prompt[:16]
    assert all(r.prompt[:16] == head for r in pre)
    assert all(16 + 30 <= r.prompt_len == len(r.prompt) <= 16 + 50 for r in pre)
    assert len({tuple(r.prompt[16:]) for r in pre}) == 50
    text = ds.random_requests(10, 30, 5, token_ids=False, seed=3)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 30 for r in text)
    assert ds.length_range(10, 0.0) == (10, 10) and ds.length_range(1, 0.9) == (1, 1)
    with pytest.raises(ValueError):
        ds.length_range(10, 1.0)


def test_prefix_repetition_groups():
    reqs = ds.prefix_repetition_requests(50, 3, 32, 8, 7, vocab_size=1000, seed=0)
    assert len(reqs) == 50
    assert all(r.prompt_len == len(r.prompt) == 40 and r.expected_output_len == 7 for r in reqs)
    prefixes = {}
    for r in reqs:
        prefixes.setdefault(tuple(r.prompt[:32]), set()).add(r.group)
    assert len(prefixes) == 3 and all(len(g) == 1 for g in prefixes.values())
    sizes = sorted(sum(r.group == g for r in reqs) for g in range(3))
    assert sizes == [16, 17, 17]
    assert len({tuple(r.prompt[32:]) for r in reqs}) == 50
    assert [r.group for r in reqs] != [i % 3 for i in range(50)]  # shuffled


def _expected_valid(data, fixed_out=None):
    """The ShareGPT filters, written out again: (prompt, output tokens) of entries that pass."""
    out = []
    for e in data:
        c = e["conversations"]
        if len(c) < 2:
            continue
        p, o = c[0]["value"], c[1]["value"]
        pl = max(len(p.split()), len(p) // 4)
        ol = max(len(o.split()), len(o) // 4) if fixed_out is None else fixed_out
        if pl < 4 or (fixed_out is None and ol < 4) or pl > 1024 or pl + ol > 2048:
            continue
        out.append((p, ol))
    return out


def test_sharegpt_generator_and_loader_round_trip(tmp_path):
    path = tmp_path / "sg.json"
    assert ds.main(["make-sharegpt", str(path), "--num", "400", "--seed", "5"]) == 0
    data = json.loads(path.read_text())
    assert len(data) == 400 and all(e["conversations"][0]["from"] == "human" for e in data)
    assert data == ds.make_sharegpt(400, 5)
    valid = _expected_valid(data)
    assert 250 < len(valid) < 390  # the generator makes some of each kind the filters drop
    assert any(len(e["conversations"]) == 1 for e in data)
    loaded = ds.load_sharegpt(path, 50, seed=0)
    assert len(loaded) == 50 and len({r.prompt for r in loaded}) == 50
    vmap = dict(valid)
    assert all(r.prompt in vmap and r.expected_output_len == vmap[r.prompt] for r in loaded)
    assert all(r.prompt_len == ds.approx_tokens(r.prompt) for r in loaded)
    everything = ds.load_sharegpt(path, 10_000, seed=0, oversample=False)
    assert sorted(r.prompt for r in everything) == sorted(p for p, _ in valid)
    assert ds.load_sharegpt(path, 50, seed=0) == loaded
    assert ds.load_sharegpt(path, 50, seed=1) != loaded
    fixed = ds.load_sharegpt(path, 10_000, seed=0, output_len=100, oversample=False)
    assert len(fixed) == len(_expected_valid(data, 100)) > len(valid)  # short replies now pass
    assert {r.expected_output_len for r in fixed} == {100}
    over = ds.load_sharegpt(path, len(valid) + 20, seed=0)
    assert len(over) == len(valid) + 20


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
    want = ds.random_requests(6, 16, 5, 0.2, 0, 49152, 4)
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
