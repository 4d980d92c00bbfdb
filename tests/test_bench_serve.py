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

from .utils import free_port  # noqa: E402

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
# client). A text prompt's (chat: the last message's) first word picks the behaviour: slowfirst
# (TTFT 300 ms), slowdecode (ITL 60 ms), fail (HTTP 500), midfail (an error chunk after 2
# chunks), nousage (no usage chunk), double (2 tokens per chunk); anything else, and token-id
# prompts: normal (TTFT 100 ms, ITL 20 ms). ttft_ms / itl_ms in the body override the delays. GET /received lists the bodies seen
# since the last DELETE /received, GET /answered what was done with them (wall-clock receive and
# [DONE] times, the answer's text, cached_tokens). Text answers are distinct words (request r's
# chunk i: " a<r>x<i>"). cached_tokens models a naive prefix cache: the word count of the longest
# earlier prompt (since the last DELETE) that the prompt starts with; a chat prompt is its
# messages' contents joined by newlines.
SERVER_SRC = r"""
import asyncio, json, math, sys, time
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

TTFT_MS, ITL_MS, SLOW_TTFT_MS, SLOW_ITL_MS = (float(x) for x in sys.argv[2:6])
RECEIVED = []
ANSWERED = []
PROMPTS = []


def sse(obj):
    return f"data: {json.dumps(obj)}\n\n"


async def handle(request, chat):
    t_recv = time.time()
    body = await request.json()
    rid = len(RECEIVED)
    RECEIVED.append(body)
    prompt = body["messages"][-1]["content"] if chat else body["prompt"]  # the last message
    flat = "\n".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
    cached = max((len(p.split()) if isinstance(p, str) else len(p) for p in PROMPTS
                  if type(p) is type(flat) and len(p) <= len(flat) and flat[:len(p)] == p),
                 default=0)
    PROMPTS.append(flat)
    log = {"recv": t_recv, "cached_tokens": cached, "text": ""}
    ANSWERED.append(log)
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
    usage = {"prompt_tokens": len(flat) if isinstance(flat, list) else len(flat.split()),
             "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": cached}}

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
            text = "" if isinstance(prompt, list) else f" a{rid}x{i}"  # token ids: no tokenizer
            log["text"] += text
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
        log["done"] = time.time()
        yield "data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream")


async def completions(request):
    return await handle(request, False)


async def chat(request):
    return await handle(request, True)


async def received(request):
    if request.method == "DELETE":
        RECEIVED.clear()
        ANSWERED.clear()
        PROMPTS.clear()
        return Response(status_code=204)
    return JSONResponse(RECEIVED)


async def answered(request):
    return JSONResponse(ANSWERED)


app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                        Route("/v1/chat/completions", chat, methods=["POST"]),
                        Route("/received", received, methods=["GET", "DELETE"]),
                        Route("/answered", answered, methods=["GET"])])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", lifespan="off")
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    script = tmp_path_factory.mktemp("fake_server") / "server.py"
    script.write_text(SERVER_SRC)
    port = free_port()
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


def _run(target, requests, rate=math.inf, runner=None, **kw):
    return asyncio.run((runner or bs.run_benchmark)(target, requests, rate, **kw))


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
                  "--result-file", str(out), "--disable-tqdm", "--ignore-eos"])
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


def test_vllm_flags_backend_result_dir_and_eos_default(server, tmp_path):
    """vLLM's bench flags: --backend openai-chat is the chat endpoint, --result-dir and
    --result-filename name the file, and ignore_eos is not sent unless asked for."""
    _clear_received(server)
    rc = bs.main(["--base-url", server, "--backend", "openai-chat", "--num-prompts", "2",
                  "--random-input-len", "8", "--random-output-len", "3", "--no-token-ids",
                  "--skip-preflight", "--disable-tqdm", "--save-result",
                  "--result-dir", str(tmp_path / "d"), "--result-filename", "r.json"])
    assert rc == 0
    res = json.loads((tmp_path / "d" / "r.json").read_text())
    assert res["endpoint"] == "/v1/chat/completions" and res["completed"] == 2
    received = _received(server)
    assert len(received) == 2
    assert all("messages" in b and "ignore_eos" not in b for b in received)


def test_percentile_metrics_choose_whose_percentiles_are_reported(server, tmp_path, capsys):
    out = tmp_path / "pm.json"
    assert bs.main(["--base-url", server, "--num-prompts", "3", "--random-input-len", "8",
                    "--random-output-len", "3", "--skip-preflight", "--disable-tqdm",
                    "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99",
                    "--result-file", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {"p50_ttft_ms", "p99_ttft_ms", "p50_e2el_ms", "p99_e2el_ms"} <= set(res)
    assert not {"p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms"} & set(res)
    assert "mean_tpot_ms" in res   # means and medians stay
    with pytest.raises(SystemExit) as e:
        bs.main(["--percentile-metrics", "ttft,latency"])
    assert e.value.code == 2 and "--percentile-metrics" in capsys.readouterr().err


def test_result_file_and_result_dir_together_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        bs.main(["--result-file", "a.json", "--result-dir", "d"])
    assert e.value.code == 2 and "not both" in capsys.readouterr().err


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
    base = f"http://127.0.0.1:{free_port()}"
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
                "--dataset-name", "--random-prefix-len", "--plot", "--metric-percentiles",
                "--multi-turn-conversations", "--multi-turn-system-len", "multi-turn"):
        assert opt in r.stdout


# ---- --tokenizer (vLLM's flag) -----------------------------------------------------------------
@pytest.fixture(scope="module")
def tok_folder(tmp_path_factory):
    """A folder with the embedded SmolLM2's tokenizer (tokenizer.json), and that tokenizer
    read by the `tokenizers` library itself: the independent count."""
    import os

    import tokenizers

    from .utils import save_tiny_model_with_tokenizer
    path = save_tiny_model_with_tokenizer(tmp_path_factory.mktemp("bench_tok") / "m")
    raw = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    return path, lambda text: len(raw.encode(text, add_special_tokens=False).ids)


def test_tokenizer_counts_prompts_and_outputs_without_usage(server, tok_folder, tmp_path):
    """With --tokenizer: a text prompt's length is its token count; a stream without usage
    counts its answer's tokens (the synthetic answer " a0x0 a0x1 ..." is more tokens than
    chunks); ShareGPT's lengths are token counts; token ids come from its vocabulary."""
    from pdserve.loader.tokenizer import tokenizer_from_spec
    path, count = tok_folder
    tok = tokenizer_from_spec(path)
    ns = bs.build_parser().parse_args(["--num-prompts", "3", "--random-input-len", "12",
                                       "--no-token-ids", "--vocab-size", "32000"])
    reqs = bs.build_requests(ns, False, tok)
    assert [r.prompt_len for r in reqs] == [count(r.prompt) for r in reqs]
    assert [r.prompt_len for r in bs.build_requests(ns, False)] == [12, 12, 12]  # approximate
    sg = tmp_path / "sg.json"
    ds.main(["make-sharegpt", str(sg), "--num", "20", "--seed", "0"])
    ns = bs.build_parser().parse_args(["--dataset-name", "sharegpt", "--dataset-path", str(sg),
                                       "--num-prompts", "3"])
    for r in bs.build_requests(ns, True, tok):
        assert r.prompt_len == count(r.prompt)
    results, _ = _run(bs.Target(server, count_tokens=count), _reqs(["nousage"], 5))
    (r,) = results
    assert r.success and r.generated_text.strip()
    assert r.output_len == count(r.generated_text) != 5
    _clear_received(server)
    assert bs.main(["--base-url", server, "--tokenizer", path, "--num-prompts", "4",
                    "--random-input-len", "16", "--random-output-len", "2", "--skip-preflight",
                    "--disable-tqdm", "--result-file", str(tmp_path / "t.json")]) == 0
    ids = [t for b in _received(server) for t in b["prompt"]]
    assert max(ids) >= 32000 and max(ids) < tok.vocab_size   # its vocabulary, not 32000's


def test_bad_tokenizer_is_a_clear_error(tmp_path, capsys):
    assert bs.main(["--tokenizer", str(tmp_path / "none"), "--skip-preflight"]) == 2
    assert "--tokenizer" in capsys.readouterr().err


# ---- multi-turn conversations ------------------------------------------------------------------
def _answered(base: str) -> list[dict]:
    return httpx.get(base + "/answered", timeout=5).json()


def _expected_completion_prompt(system: str, users: list[str], answers: list[str]) -> str:
    """What turn len(users)-1's prompt must be, written out from the format the module docstring
    states, with the answers the server logged."""
    text = system + "\n\n" if system else ""
    for j, u in enumerate(users):
        text += f"User: {u}\nAssistant:"
        if j < len(answers):
            text += answers[j] + "\n"
    return text


def test_multi_turn_waits_for_answers_and_carries_them(server):
    n_conv, turns = 3, 3
    convs = wl.multi_turn_conversations(n_conv, turns, 6, 3, 0.0, 5, 49152, seed=1)
    t = bs.Target(server, extra_body={"ttft_ms": 40, "itl_ms": 5})
    _clear_received(server)
    results, duration = _run(t, convs, runner=bs.run_multi_turn)
    bodies, logs = _received(server), _answered(server)
    assert len(bodies) == len(logs) == n_conv * turns
    assert [(r.conversation, r.turn) for r in results] == \
        [(i, k) for i in range(n_conv) for k in range(turns)]
    assert all(r.success for r in results), [r.error for r in results]
    # which server log entry is which (conversation, turn): the prompt ends with that turn's message
    where = {}
    for idx, b in enumerate(bodies):
        hits = [(i, k) for i, c in enumerate(convs) for k, u in enumerate(c.user_messages)
                if b["prompt"].endswith(f"User: {u}\nAssistant:")]
        assert len(hits) == 1, b["prompt"]
        where[hits[0]] = idx
    for i, c in enumerate(convs):
        logged = [logs[where[i, k]] for k in range(turns)]
        for k in range(turns):
            r, body, log = results[i * turns + k], bodies[where[i, k]], logged[k]
            # the prompt: the system prompt, the earlier messages and the server's answers verbatim
            assert body["prompt"] == _expected_completion_prompt(
                c.system, c.user_messages[:k + 1], [x["text"] for x in logged[:k]])
            assert body["max_tokens"] == c.output_lens[k]
            assert r.generated_text == log["text"]
            assert r.prompt_len == len(body["prompt"].split())  # the server's prompt_tokens
            # the naive prefix cache: turn k reuses all of turn k-1's prompt, turn 0 nothing
            want_cached = len(bodies[where[i, k - 1]]["prompt"].split()) if k else 0
            assert log["cached_tokens"] == want_cached == r.cached_tokens
            if k:  # sent only after the previous answer's last byte
                assert log["recv"] >= logged[k - 1]["done"]
                prev = results[i * turns + k - 1]
                assert r.start >= prev.start + prev.latency
            assert 40 - 2 <= r.ttft * 1e3 <= 40 + TOL_MS
    # rate inf: every conversation starts at once, so all first turns arrive before any second one
    assert max(logs[where[i, 0]]["recv"] for i in range(n_conv)) < \
        min(logs[where[i, 1]]["recv"] for i in range(n_conv))

    m = compute_metrics(results, duration)
    total_prompt = sum(len(b["prompt"].split()) for b in bodies)
    total_cached = sum(x["cached_tokens"] for x in logs)
    assert total_cached > 0
    assert m["total_input_tokens"] == total_prompt and m["total_cached_tokens"] == total_cached
    assert m["cached_token_fraction"] == pytest.approx(total_cached / total_prompt)
    assert m["cached_tokens_reported"] == n_conv * turns
    assert m["conversation_ids"] == [i for i in range(n_conv) for _ in range(turns)]
    assert m["turn_ids"] == [k for _ in range(n_conv) for k in range(turns)]
    assert [p["turn"] for p in m["per_turn"]] == list(range(turns))
    for k, p in enumerate(m["per_turn"]):
        ttfts = [results[i * turns + k].ttft * 1e3 for i in range(n_conv)]
        prompts = [len(bodies[where[i, k]]["prompt"].split()) for i in range(n_conv)]
        cached = sum(logs[where[i, k]]["cached_tokens"] for i in range(n_conv))
        assert p["completed"] == n_conv and p["failed"] == 0
        assert p["mean_ttft_ms"] == pytest.approx(sum(ttfts) / n_conv)
        assert p["median_ttft_ms"] == pytest.approx(sorted(ttfts)[n_conv // 2])
        assert p["mean_input_tokens"] == pytest.approx(sum(prompts) / n_conv)
        assert p["cached_tokens"] == cached
        assert p["cached_token_fraction"] == pytest.approx(cached / sum(prompts))
    assert m["per_turn"][0]["cached_tokens"] == 0
    assert m["per_turn"][1]["mean_input_tokens"] < m["per_turn"][2]["mean_input_tokens"]


def test_multi_turn_starts_follow_the_schedule(server):
    n, rate, seed = 8, 25.0, 5
    convs = wl.multi_turn_conversations(n, 2, 4, 2, seed=seed)
    t = bs.Target(server, extra_body={"ttft_ms": 10, "itl_ms": 2})
    results, _ = _run(t, convs, rate, runner=bs.run_multi_turn, seed=seed)
    want = wl.arrival_times(n, rate, 1.0, seed)
    first = np.array([r.start for r in results if r.turn == 0])
    assert np.all(first >= want - 1e-3) and np.all(first <= want + TOL_MS / 1e3), first - want
    assert all(r.success for r in results)


def test_multi_turn_think_time_pauses_after_each_answer(server):
    """A 0.3 s pause before the second turn: it is sent no sooner than 0.3 s after the first
    answer's end (and not much later), while the first turn goes at the start."""
    conv = wl.Conversation("", ["hello there", "and again"], [3, 3], [2, 2], [0.0, 0.3])
    t = bs.Target(server, extra_body={"ttft_ms": 10, "itl_ms": 2})
    results, _ = _run(t, [conv], runner=bs.run_multi_turn)
    assert all(r.success for r in results)
    first, second = results
    gap = second.start - (first.start + first.latency)
    assert 0.3 - 1e-3 <= gap <= 0.3 + TOL_MS / 1e3, gap


def test_multi_turn_failed_turn_ends_its_conversation(server):
    convs = [wl.Conversation("", ["hello there", "fail now", "never sent"], [3, 3, 3], [2, 2, 2]),
             wl.Conversation("", ["one", "two", "three"], [2, 2, 2], [1, 1, 1])]
    t = bs.Target(server, "/v1/chat/completions", extra_body={"ttft_ms": 10, "itl_ms": 2})
    _clear_received(server)
    results, duration = _run(t, convs, runner=bs.run_multi_turn)
    assert len(_received(server)) == 5  # the third turn of the first conversation is not sent
    assert [r.success for r in results] == [True, False, False, True, True, True]
    assert results[1].error == "HTTP 500: synthetic failure"
    assert results[2].error == "not sent: turn 1 of this conversation failed"
    m = compute_metrics(results, duration)
    assert m["completed"] == 4 and m["failed"] == 2
    assert [(p["completed"], p["failed"]) for p in m["per_turn"]] == [(2, 0), (1, 1), (1, 1)]


def test_main_multi_turn_chat(server, tmp_path, capsys):
    out = tmp_path / "mt.json"
    _clear_received(server)
    rc = bs.main(["--base-url", server, "--endpoint", "/v1/chat/completions",
                  "--dataset-name", "multi-turn", "--multi-turn-conversations", "2",
                  "--multi-turn-turns", "3", "--multi-turn-user-len", "5",
                  "--multi-turn-output-len", "2", "--multi-turn-range-ratio", "0.4",
                  "--multi-turn-system-len", "4", "--max-concurrency", "1", "--seed", "2",
                  "--request-rate", "100", "--extra-body", '{"ttft_ms": 15, "itl_ms": 3}',
                  "--result-file", str(out), "--disable-tqdm"])
    assert rc == 0
    res = json.loads(out.read_text())
    bodies, logs = _received(server), _answered(server)
    assert len(bodies) == 1 + 6  # the preflight (turn 0 of conversation 0), then 2 x 3 turns
    convs = wl.multi_turn_conversations(2, 3, 5, 2, 0.4, 4, 32000, seed=2)
    assert bodies[0]["messages"] == [{"role": "system", "content": convs[0].system},
                                     {"role": "user", "content": convs[0].user_messages[0]}]
    answers: dict[int, list[str]] = {0: [], 1: []}
    for body, log in zip(bodies[1:], logs[1:]):
        msgs = body["messages"]
        i = next(i for i, c in enumerate(convs) if msgs[-1]["content"] in c.user_messages)
        k = len(answers[i])
        c = convs[i]
        want = [{"role": "system", "content": c.system}]
        for j in range(k):
            want += [{"role": "user", "content": c.user_messages[j]},
                     {"role": "assistant", "content": answers[i][j]}]
        want.append({"role": "user", "content": c.user_messages[k]})
        assert msgs == want and body["max_tokens"] == c.output_lens[k]
        answers[i].append(log["text"])
    # --max-concurrency 1: one request in flight at a time
    for a, b in zip(logs, logs[1:]):
        assert b["recv"] >= a["done"]
    assert res["completed"] == 6 and res["num_prompts"] == 6
    assert res["num_conversations"] == 2 and res["turns"] == 3
    assert res["total_cached_tokens"] == sum(x["cached_tokens"] for x in logs[1:])
    assert res["total_cached_tokens"] > 0  # the preflight cached turn 0 of conversation 0 at least
    assert len(res["per_turn"]) == 3 and res["turn_ids"] == [0, 1, 2, 0, 1, 2]
    printed = capsys.readouterr().out
    assert "cached prompt tokens" in printed and "TTFT mean" in printed


@pytest.mark.parametrize("args, message", [
    (["--multi-turn-turns", "0"], "need >= 1 conversation and >= 1 turn"),
    (["--multi-turn-conversations", "0"], "need >= 1 conversation and >= 1 turn"),
    (["--multi-turn-user-len", "0"], "need user and output len >= 1"),
    (["--multi-turn-output-len", "-3"], "need user and output len >= 1"),
    (["--multi-turn-system-len", "-1"], "system len >= 0"),
    (["--multi-turn-range-ratio", "1.5"], "range ratio must be in [0, 1)"),
    (["--multi-turn-think-time", "-1"], "think time must be"),
    (["--token-ids"], "multi-turn sends text"),
])
def test_multi_turn_bad_arguments(tmp_path, capsys, args, message):
    rc = bs.main(["--base-url", f"http://127.0.0.1:{free_port()}", "--dataset-name", "multi-turn",
                  "--result-file", str(tmp_path / "x.json"), *args])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
