"""vLLM's serving conventions on `pdserve serve` without starting an engine: the positional
MODEL, --api-key (Bearer auth on /v1/*), CORS, the start-up summary and the periodic stats
line. The middleware runs in a small ASGI app driven in-process by httpx; expectations are
hand-written (status codes and headers as the RFCs and vLLM's server give them, numbers
computed by hand)."""
import asyncio
import io
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx")
from fastapi import FastAPI  # noqa: E402
from fastapi.middleware.cors import CORSMiddleware  # noqa: E402

from pdserve.config import EngineConfig  # noqa: E402
from pdserve.protocol import WorkerStats  # noqa: E402
from pdserve.server.console import StatsLine, log_stats, startup_summary  # noqa: E402
from pdserve.server.http import BearerAuth, ServeOptions  # noqa: E402
from pdserve.server.main import parse_args, serve_options  # noqa: E402


# ---- flags ---------------------------------------------------------------------------------
def test_positional_model_is_the_model(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    a = parse_args(["/models/qwen"])
    assert a.model == "/models/qwen"
    o = serve_options(a)
    assert o.api_key is None and o.allowed_origins == ("*",) and o.log_stats_interval_s == 10.0
    assert parse_args(["/m", "--model", "/m"]).model == "/m"
    assert parse_args([]).model is None


def test_model_given_twice_differently_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["/a", "--model", "/b"])
    assert e.value.code == 2 and "given twice" in capsys.readouterr().err


def test_server_flags_become_options(monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    o = serve_options(parse_args(["--allowed-origins", '["http://a.example"]',
                                  "--allow-credentials", "--allowed-methods", '["GET", "POST"]',
                                  "--disable-log-stats"]))
    assert o.api_key == "from-env" and o.allowed_origins == ("http://a.example",)
    assert o.allow_credentials and o.allowed_methods == ("GET", "POST")
    assert o.log_stats_interval_s is None
    assert serve_options(parse_args(["--api-key", "k2"])).api_key == "k2"


@pytest.mark.parametrize("flag, value", [("--allowed-origins", "http://a"),
                                         ("--allowed-origins", '{"a": 1}'),
                                         ("--allowed-headers", '[""]')])
def test_bad_cors_lists_are_argparse_errors(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args([flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_bad_options_are_value_errors():
    with pytest.raises(ValueError, match="api_key"):
        ServeOptions(api_key="")
    with pytest.raises(ValueError, match="log_stats_interval_s"):
        ServeOptions(log_stats_interval_s=0)


# ---- auth and CORS -------------------------------------------------------------------------
def _app(api_key="sekret", origins=("http://a.example",)):
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"ok": True}

    @app.get("/health")
    async def health():
        return {"ok": True}

    app.add_middleware(BearerAuth, api_key=api_key)
    app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"],
                       allow_headers=["*"])
    return app


def _get(app, path, **kw):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as c:
            return await c.request(kw.pop("method", "GET"), path, **kw)
    return asyncio.run(go())


@pytest.mark.parametrize("header", [None, "Bearer wrong", "sekret", "Bearer sekret2",
                                    "bearer sekret"])
def test_v1_needs_the_bearer_key(header):
    r = _get(_app(), "/v1/models", headers={"Authorization": header} if header else {})
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert err["code"] == 401 and err["type"] == "authentication_error"
    assert "API key" in err["message"]


def test_the_right_key_passes_and_health_stays_open():
    assert _get(_app(), "/v1/models", headers={"Authorization": "Bearer sekret"}).json() == \
        {"ok": True}
    assert _get(_app(), "/health").status_code == 200


def test_cors_preflight_needs_no_key_and_names_the_origin():
    r = _get(_app(), "/v1/models", method="OPTIONS",
             headers={"Origin": "http://a.example", "Access-Control-Request-Method": "POST",
                      "Access-Control-Request-Headers": "authorization"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://a.example"
    r = _get(_app(), "/health", headers={"Origin": "http://other.example"})
    assert "access-control-allow-origin" not in r.headers


# ---- console -------------------------------------------------------------------------------
def _stats(running, waiting, used, total, queries, hits):
    return WorkerStats(running, waiting, used, total, 0, 0, 0, queries, hits, 0)


def test_stats_line_over_the_interval():
    """Between two lines 10 s apart: 5,000 prompt and 1,200 generated tokens -> 500.0 and
    120.0 tok/s; 300 of 400 prompt tokens looked up were cached -> 75.0%; 25 of 200 blocks
    used -> 12.5%. An idle interval prints nothing."""
    t = [100.0]
    counters = {"pdserve:prompt_tokens_total": 1000.0, "pdserve:generation_tokens_total": 50.0}
    stats = [_stats(0, 0, 0, 200, 100, 10)]
    line = StatsLine(counters.get, lambda: stats[0], clock=lambda: t[0])
    t[0] = 110.0
    counters["pdserve:prompt_tokens_total"] += 5000
    counters["pdserve:generation_tokens_total"] += 1200
    stats[0] = _stats(3, 2, 25, 200, 500, 310)
    assert line.line() == ("pdserve: prompt 500.0 tok/s, generation 120.0 tok/s, running 3, "
                           "waiting 2, KV cache 12.5% used, prefix cache hit rate 75.0%")
    t[0] = 120.0
    stats[0] = _stats(0, 0, 0, 200, 500, 310)
    assert line.line() is None


def test_stats_line_without_workers_or_lookups():
    t = [0.0]
    counters = {"pdserve:prompt_tokens_total": 0.0, "pdserve:generation_tokens_total": 0.0}
    line = StatsLine(counters.get, lambda: None, clock=lambda: t[0])
    t[0] = 4.0
    counters["pdserve:generation_tokens_total"] = 10.0
    assert line.line() == ("pdserve: prompt 0.0 tok/s, generation 2.5 tok/s, running 0, "
                           "waiting 0, KV cache 0.0% used, prefix cache hit rate -")


def test_log_stats_prints_each_interval():
    out = io.StringIO()
    lines = iter(["one", None, "two"])
    fake = SimpleNamespace(line=lambda: next(lines))

    async def go():
        task = asyncio.create_task(log_stats(fake, 0.001, out))
        while out.getvalue().count("\n") < 2:
            await asyncio.sleep(0.001)
        task.cancel()
    asyncio.run(go())
    assert out.getvalue() == "one\ntwo\n"


def test_startup_summary_names_each_worker():
    info = SimpleNamespace(num_kv_blocks=1024, block_size=16, tensor_parallel_size=1,
                           kv_bytes_per_token_per_rank=28672)
    worker = SimpleNamespace(spec=SimpleNamespace(name="collocated-0", role="collocated",
                                                  config=EngineConfig(device="cpu")),
                             client=SimpleNamespace(info=info))
    lines = startup_summary(SimpleNamespace(workers={"c": worker}, max_model_len=8192), "m")
    # 1024 x 16 = 16384 tokens x 28672 B = 0.4375 GiB
    assert lines == [
        "pdserve: model 'm', 1 worker, max_model_len 8192",
        "pdserve: default sampling values: pdserve's own (no generation config)",
        "  collocated-0: collocated on cpu (TP 1), float32, KV pool 1024 blocks x 16 = 16384 "
        "tokens (0.44 GiB per rank), no host tier, prefix caching on, no CUDA graphs"]
    lines = startup_summary(SimpleNamespace(workers={}, max_model_len=8192), "m",
                            {"temperature": 0.6, "max_tokens": 5}, "/m/generation_config.json")
    assert lines[1] == ("pdserve: default sampling values from /m/generation_config.json: "
                        "temperature=0.6, max_tokens=5 (a request's own values override them; "
                        "--generation-config vllm ignores the file)")


# ---- metrics as vLLM names them -----------------------------------------------------------
def test_metrics_carry_model_name_and_totals_are_counters():
    """Running totals from the workers become counters that grow by what the totals grew by
    (100 -> 150 queries: 150; a total that fell, a worker gone from the sum, adds nothing and
    counting resumes from it: 1 -> 4 preemptions after 2 -> 1 is 2 + 3 = 5); KV use is
    used / total."""
    from pdserve.server.metrics import Metrics
    from .utils import metric_value
    m = Metrics("my-model")
    for q, h, pre in ((100, 40, 2), (150, 40, 1), (150, 70, 4)):
        m.update_stats(WorkerStats(1, 0, 5, 20, pre, 0, 0, q, h, 3))
    from pdserve.routing.router_core import StepTotals
    steps = {("w0", "mixed"): StepTotals(steps=3, wall_ms=30.0, gpu_steps=2, gpu_ms=12.0,
                                         prefill_tokens=600, decode_tokens=20)}
    m.update_routes(SimpleNamespace(requests={"disagg": 3, "collocated": 1}, transfers=2,
                                    transfer_bytes=10, transfer_seconds=0.5,
                                    transfer_failures=0, rerouted=0, recomputed=1, failed=0,
                                    steps=steps))
    text = m.render().decode()
    w0 = 'worker="w0",kind="mixed"'
    assert metric_value(text, f"pdserve:engine_steps_total{{{w0}}}") == 3
    assert metric_value(text, f"pdserve:engine_step_wall_seconds_total{{{w0}}}") == 0.03
    assert metric_value(text, f"pdserve:engine_step_gpu_seconds_total{{{w0}}}") == 0.012
    assert metric_value(text, f"pdserve:engine_steps_gpu_timed_total{{{w0}}}") == 2
    assert metric_value(text, f'pdserve:engine_step_tokens_total{{{w0},phase="prefill"}}') == 600
    assert metric_value(text, f'pdserve:engine_step_tokens_total{{{w0},phase="decode"}}') == 20
    assert metric_value(text, "pdserve:prefix_cache_queries_total") == 150
    assert metric_value(text, "pdserve:prefix_cache_hits_total") == 70
    assert metric_value(text, "pdserve:num_preemptions_total") == 5
    assert metric_value(text, "pdserve:kv_cache_usage_perc") == 0.25
    assert metric_value(text, 'pdserve:requests_by_path_total{path="disagg"}') == 3
    assert metric_value(
        text, 'pdserve:requests_after_worker_death_total{outcome="recomputed"}') == 1
    assert "# TYPE pdserve:prefix_cache_hits_total counter" in text
    samples = [ln for ln in text.splitlines() if ln.startswith("pdserve:")]
    assert samples and all('model_name="my-model"' in ln for ln in samples)
    assert m.sample("pdserve:prefix_cache_hits_total") == 70


class _Echo:
    """A stand-in executor: samples, for every sequence, its position (never EOS here)."""

    def execute(self, sched):
        from pdserve.engine.executor import SampledToken
        return {c.request_id: SampledToken(c.start_pos + len(c.token_ids), None, None)
                for c in sched.chunks if c.sample}

    def take_prompt_logprobs(self):
        return {}

    def poll_loads(self):
        return []

    def take_gpu_times(self):
        return {}


def test_request_phases_from_the_engines_times():
    """The engine core on a fake clock that reads 10 s per step: one sequence at a time
    (max_num_seqs 1), 6-token prompts (no prefix shared) in chunks of 4, 3 tokens each. "a"
    and "b" arrive at 0.
    a: scheduled at step 1 (t=10, first chunk), first token at step 2 (20), tokens at 30, 40:
    queue 10, prefill 10, decode 20, inference 30. b waits for a's seat: scheduled at step 5
    (50), first token at 60, last at 80: queue 50, prefill 10, decode 20, inference 30. The
    histograms hold these sums (by hand: queue 60, prefill 20, decode 40, inference 60)."""
    from pdserve.engine.core import EngineCore
    from pdserve.sampling_params import SamplingParams
    from pdserve.outputs import RequestPhases, request_phases
    from pdserve.server.metrics import Metrics, RequestTimer
    from .utils import metric_value
    now = [0.0]
    core = EngineCore(EngineConfig(block_size=4, max_num_batched_tokens=4, max_num_seqs=1,
                                   async_scheduling=False),
                      _Echo(), num_kv_blocks=16, max_model_len=32, vocab_size=100,
                      eos_token_ids=(0,), clock=lambda: now[0])
    m = Metrics("m")
    timers = {}
    for rid, prompt in (("a", [1, 2, 3, 4, 5, 6]), ("b", [11, 12, 13, 14, 15, 16])):
        core.add_request(rid, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        timers[rid] = RequestTimer(m)
    done = {}
    while core.has_unfinished_requests():
        now[0] += 10.0
        for out in core.step():
            timers[out.request_id].on_output(out)
            if out.finished:
                done[out.request_id] = out
    assert request_phases(done["a"].metrics) == RequestPhases(10.0, 10.0, 20.0, 30.0)
    assert request_phases(done["b"].metrics) == RequestPhases(50.0, 10.0, 20.0, 30.0)
    text = m.render().decode()
    for name, total in (("queue", 60.0), ("prefill", 20.0), ("decode", 40.0),
                        ("inference", 60.0)):
        assert metric_value(text, f"pdserve:request_{name}_time_seconds_count") == 2
        assert metric_value(text, f"pdserve:request_{name}_time_seconds_sum") == total
    # a request that ended before it was scheduled (no "scheduled") observes no phases
    assert request_phases({"arrival": 1.0, "first_token": 2.0, "finished": 3.0}) is None


def test_the_server_ttft_starts_at_admission_not_at_the_first_read():
    """A stream read 0.2 s after its request was handed to the engine: the TTFT histogram
    counts those 0.2 s (RequestTimer starts at the stream's `added` time, as the server passes
    it), and a timer given no start counts from its creation."""
    import time
    from types import SimpleNamespace

    from pdserve.server.metrics import Metrics, RequestTimer
    from .utils import metric_value
    out = SimpleNamespace(outputs=[SimpleNamespace(new_token_ids=[7])], finished=False)
    m = Metrics("m")
    added = time.perf_counter() - 0.2
    RequestTimer(m, added).on_output(out)
    first = metric_value(m.render().decode(), "pdserve:time_to_first_token_seconds_sum")
    assert 0.2 <= first < 0.3
    RequestTimer(m).on_output(out)
    both = metric_value(m.render().decode(), "pdserve:time_to_first_token_seconds_sum")
    assert 0 <= both - first < 0.05


def test_the_event_loop_flag_picks_the_loop(monkeypatch):
    """--loop: asyncio runs asyncio's own loop; auto and uvloop run uvloop's (a dependency on
    this platform); uvloop when it cannot be imported is a ValueError, auto falls back."""
    import sys

    from pdserve.server.main import parse_args, run_loop

    async def kind():
        return type(asyncio.get_running_loop()).__module__.split(".")[0]
    assert run_loop(kind(), "asyncio") == "asyncio"
    assert run_loop(kind(), "auto") == "uvloop"
    assert run_loop(kind(), "uvloop") == "uvloop"
    monkeypatch.setitem(sys.modules, "uvloop", None)       # (import uvloop raises ImportError)
    assert run_loop(kind(), "auto") == "asyncio"
    coro = kind()
    with pytest.raises(ValueError, match="uvloop is not installed"):
        run_loop(coro, "uvloop")
    coro.close()
    a = parse_args(["--loop", "asyncio", "--http", "h11"])
    assert (a.loop, a.http) == ("asyncio", "h11")
