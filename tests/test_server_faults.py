"""`pdserve serve` under a hostile client and an unlucky operator, with real worker processes
(a two-layer dummy model with SmolLM2's real tokenizer, so servers start and restart in
seconds): text that is not Unicode, a worker killed with requests in flight (collocated and
1P1D), prompts of megabytes, bodies over the limit, queued streams, a full queue, and SIGTERM
with streams still running. Every wait has a deadline, so a regression fails instead of
hanging; after every fault: no orphan process and no KV block in use on a live worker."""
import json
import os
import signal
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from .test_server import _start, _stopped_cleanly  # noqa: E402
from .utils import _running, assert_processes_gone, save_tiny_model_with_tokenizer  # noqa: E402

# long enough to outlive every deadline here even on an idle machine (the two-layer model
# makes ~1000 tokens a second on CPU)
LONG = {"prompt": "Tell me a long story", "max_tokens": 8000, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny") / "model")


def _serve(model, *args):
    return _start(["--model", model, "--load-format", "dummy", "--max-model-len", "8192",
                   "--num-kv-blocks", "1024", "--restart-backoff", "0.1", *args])


def _sse_lines(base, body, out: list, timeout=60):
    """Appends (time.monotonic(), line) of one stream's non-empty lines to out (its status
    first)."""
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True},
                      timeout=timeout) as r:
        out.append((time.monotonic(), f"status {r.status_code}"))
        for line in r.iter_lines():
            if line:
                out.append((time.monotonic(), line))


def _wait(pred, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _health(base):
    r = httpx.get(base + "/health", timeout=5)
    return r.status_code, r.json()


def _clean(base):
    """Nothing running and no KV block in use on the live workers."""
    state = httpx.get(base + "/admin/check", timeout=30).json()
    return state["num_kv_blocks_used"] == 0 and state["num_running"] == 0


def _stop(proc, timeout_s=30):
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout_s)
    finally:
        proc.kill()
    return code, time.monotonic() - t0


SURROGATE = [
    ("/v1/completions", {"prompt": "\ud800 hi", "max_tokens": 2}),
    ("/v1/completions", {"prompt": ["fine", "\udfff"], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800 hi"}],
                              "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a\ud83d"}]}], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "\ud800", "content": "hi"}],
                              "max_tokens": 2}),
    ("/tokenize", {"prompt": "\ud800"}),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}),
]


@pytest.fixture(scope="module", params=["single", "1p1d"])
def server(model, request):
    """A collocated and a 1P1D server, each shared by the two tests below (one start-up per
    deployment): (deployment, base URL). At the end it must stop cleanly within 15 s and leave
    no worker process behind, the restarted ones included."""
    extra = ["--prefill", "1", "--decode", "1"] if request.param == "1p1d" else []
    proc, base = _serve(model, *extra)
    pids = httpx.get(base + "/admin/check").json()["worker_pids"]
    try:
        yield request.param, base
        pids = pids + httpx.get(base + "/admin/check").json()["worker_pids"]
    finally:
        code, took = _stop(proc)
    assert _stopped_cleanly(code) and took < 15, (code, took)
    assert_processes_gone(pids)


def test_text_that_is_not_unicode_is_a_400_and_breaks_nothing(server):
    """A lone surrogate (valid JSON, not valid Unicode) anywhere a text goes: 400 naming the
    problem; on the 1P1D server it once killed the engine's I/O thread for good."""
    _, base = server
    for path, body in SURROGATE:
        # json.dumps writes a lone surrogate as the escape \ud800: valid JSON
        r = httpx.post(base + path, content=json.dumps(body).encode(),
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert any(w in err["message"] for w in ("surrogate", "role")), err
        assert _health(base)[0] == 200
        ok = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                        timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert _clean(base)


def test_a_killed_worker_ends_its_requests_and_comes_back(server):
    """kill -9 the collocated (or the decode) worker with streams in flight: every stream
    ends within seconds with an error event and [DONE]; /health and the metrics say which
    worker is down; new requests get a 503 (single) or run whole on the prefill worker
    (1P1D); the worker is restarted and serves again; SIGTERM then exits promptly (`server`)."""
    deployment, base = server
    pids = httpx.get(base + "/admin/check").json()["worker_pids"]
    victim = pids[-1]   # collocated-0, or decode-0 (started after prefill-0)
    streams = [[] for _ in range(4)]
    threads = [threading.Thread(target=_sse_lines, args=(base, LONG, out)) for out in streams]
    for t in threads:
        t.start()
    _wait(lambda: all(sum(line.startswith("data: {\"id\"") for _, line in out) >= 2
                      for out in streams), 60, "tokens on every stream")
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(max(0.1, killed + 15 - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a stream did not end after the kill"
    for out in streams:
        assert out[-1][1] == "data: [DONE]" and '"error"' in out[-2][1], out[-3:]
        assert "died" in out[-2][1]
    # the truth about the deployment while the worker is down (or already back)
    code, body = _health(base)
    states = {w["name"]: w for w in body.get("workers", [])}
    name = "collocated-0" if deployment == "single" else "decode-0"
    if states[name]["state"] != "up":
        assert body["status"] == ("unavailable" if deployment == "single" else "degraded")
        assert code == (503 if deployment == "single" else 200)
        metrics = httpx.get(base + "/metrics").text
        assert any(line.startswith("pdserve:worker_up{") and
                   f'role="{states[name]["role"]}"' in line and 'state="' in line
                   for line in metrics.splitlines()), metrics
        assert any(line.startswith("pdserve:worker_up") and f'worker="{name}"' in line
                   and line.endswith(" 0.0") for line in metrics.splitlines()), metrics
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                       timeout=30)
        if deployment == "single":
            assert r.status_code in (200, 503), r.text
            if r.status_code == 503:
                assert r.headers.get("retry-after") and "collocated-0" in r.text
        else:  # served whole by the prefill worker (unless decode-0 came back meanwhile)
            assert r.status_code == 200, r.text
    _wait(lambda: _health(base)[1]["status"] == "ok", 60, "the restarted worker")
    code, body = _health(base)
    assert code == 200 and {w["name"]: w["restarts"] for w in body["workers"]}[name] == 1
    assert "-9" in {w["name"]: w["error"] for w in body["workers"]}[name]
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 5},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    if deployment == "1p1d":   # the hand-off works again, with the new decode worker
        before = _metric(base, "pdserve:kv_transfers_total")
        httpx.post(base + "/v1/completions", json={"prompt": "hello", "max_tokens": 4},
                   timeout=30)
        assert _metric(base, "pdserve:kv_transfers_total") == before + 1
    _wait(lambda: _clean(base), 10, "no KV in use")


def _metric(base, query):
    from .utils import metric_value
    return metric_value(httpx.get(base + "/metrics").text, query)


def test_admission_limits_and_the_drain_deadline(model):
    """One server, --max-num-seqs 1: a huge prompt is refused at once without stalling a
    running stream; a body over the limit is a 413; a queued stream gets its headers and
    keep-alive comments before its first token; past --max-queued-requests, a 503 with
    Retry-After; SIGTERM lets a short stream finish, ends a long one at the deadline with an
    error event and [DONE], and the process exits a few seconds later."""
    proc, base = _serve(model, "--max-num-seqs", "1", "--max-queued-requests", "1",
                        "--keepalive", "0.3", "--max-request-bytes", "8000000",
                        "--shutdown-timeout", "4")
    pids = httpx.get(base + "/admin/check").json()["worker_pids"]
    try:
        running = []
        t_run = threading.Thread(target=_sse_lines, args=(base, LONG, running))
        t_run.start()
        _wait(lambda: len(running) >= 3, 30, "the first stream's tokens")
        # 6 MB of text: refused from its head, and the running stream keeps streaming
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/completions", json={"prompt": "word " * 1_200_000,
                                                        "max_tokens": 2}, timeout=60)
        took = time.monotonic() - t0
        assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"], r.text
        assert took < 5, took
        gaps = [b[0] - a[0] for a, b in zip(running, running[1:]) if b[0] > t0]
        assert gaps and max(gaps) < 2.0, gaps
        # over the body limit: 413 before parsing
        r = httpx.post(base + "/v1/completions", content=b'{"prompt": "' + b"x" * 9_000_000 + b'"}',
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
        # a queued stream: headers and comments now, tokens once the first stream is done
        queued = []
        t_q = threading.Thread(target=_sse_lines, args=(base, {"prompt": "hi", "max_tokens": 3},
                                                        queued))
        t_q.start()
        _wait(lambda: sum(line == ": keep-alive" for _, line in queued) >= 2, 10,
              "keep-alive comments on the queued stream")
        assert queued[0][1] == "status 200" and queued[1][1] == ": admitted"
        assert not any(line.startswith("data:") for _, line in queued)
        # one is queued already: the next is turned away
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "max-queued-requests" in r.json()["error"]["message"]
        # SIGTERM: the long stream ends at the deadline; the queued one too (it never ran)
        proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        t_run.join(15)
        t_q.join(15)
        assert not t_run.is_alive() and not t_q.is_alive()
        for out in (running, queued):
            assert out[-1][1] == "data: [DONE]" and "shutting down" in out[-2][1], out[-3:]
        assert running[-1][0] - t_term > 3.5   # it ran on until the deadline (4 s)
        code = proc.wait(15)
        assert _stopped_cleanly(code) and time.monotonic() - t_term < 4 + 8
    finally:
        proc.kill()
    assert_processes_gone(pids)


def test_sigterm_lets_a_short_stream_finish(model):
    """The drain deadline only ends what outlives it: a stream that finishes within it ends
    normally, and the exit follows at once."""
    proc, base = _serve(model, "--shutdown-timeout", "30")
    pids = httpx.get(base + "/admin/check").json()["worker_pids"]
    try:
        out = []
        t = threading.Thread(target=_sse_lines, args=(base, {"prompt": "hi", "max_tokens": 60,
                                                             "ignore_eos": True}, out))
        t.start()
        _wait(lambda: len(out) >= 4, 30, "tokens")
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert out[-1][1] == "data: [DONE]" and '"error"' not in out[-2][1]
        assert sum(line.startswith("data: {") for _, line in out) == 60
        assert _stopped_cleanly(proc.wait(20)) and time.monotonic() - t_term < 20
    finally:
        proc.kill()
    assert_processes_gone(pids)
    assert not any(_running(p) for p in pids)
