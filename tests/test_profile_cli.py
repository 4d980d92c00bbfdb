"""`pdserve profile --quick` end to end on CPU (a tiny Llama config with dummy weights, so
the run takes seconds): it writes a profile that CostProfile.from_json accepts, whose rows are
the quick row set's, whose KV bytes per token are the model config's (computed here from the
config), whose terms can be refitted from its own samples, whose serving-path term comes from
requests sent through a real `pdserve serve` of the same engine config, and whose transfer and
serving terms fall back to stated values when their deployments cannot start."""
import json
import statistics
import sys

import pytest
import torch

from pdserve.bench.common import hardware_info
from pdserve.cli import main
from pdserve.perf import profiler
from pdserve.perf.cost_fit import refit
from pdserve.perf.cost_profile import CostProfile

from .test_tp import LLAMA_8Q_2KV, _folder
from .utils import frozen_heap

QUICK = profiler.PRESETS["cpu-quick"]


def _profile(args, out):
    threads = torch.get_num_threads()
    try:
        with frozen_heap():
            rc = main(["profile", "--load-format", "dummy", "--device", "cpu", "--threads", "1",
                       "--output", str(out), *args])
    finally:
        torch.set_num_threads(threads)
    return rc


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profile")
    model = _folder(tmp, LLAMA_8Q_2KV)
    out = tmp / "profile.json"
    rc = _profile(["--model", model, "--quick"], out)
    return rc, model, out


def test_quick_profile_loads_and_matches_its_row_set(quick):
    rc, model, out = quick
    assert rc == 0
    p = CostProfile.from_json(out, model=model, hardware=hardware_info())
    d = json.loads(out.read_text())
    assert d["command"][:2] == ["pdserve", "profile"] and d["preset"] == "cpu-quick"
    assert p.commit and p.engine_config["device"] == "cpu"
    assert p.engine_config["async_scheduling"] is False
    assert p.engine_config["enable_prefix_caching"] is False   # every step and pull whole
    s = p.samples
    assert sorted(r["n"] for r in s["prefill"]) == sorted(QUICK["prefill_tokens"])
    assert sorted((r["b"], r["context"]) for r in s["decode"]) == sorted(
        (b, c) for b in QUICK["decode_batches"] for c in QUICK["contexts"])
    assert sorted((r["b"], r["n"]) for r in s["mixed"]) == sorted(
        tuple(map(int, m.split(":"))) for m in QUICK["mixed"])
    assert d["rows_not_used"] == []
    for term, rows in (("prefill", s["prefill"]), ("decode", s["decode"]),
                       ("mixed", s["mixed"]), ("transfer", s["transfer"])):
        f = p.fit[term]
        assert f["n_samples"] == len(rows)
        assert 0 <= f["heldout_mean_abs_rel_err"] <= f["heldout_max_abs_rel_err"]
    # the context the decodes attend over: the prompt plus the tokens decoded so far (>= 1,
    # fewer than the steps a row runs: its prefill steps and its timed and warm-up steps)
    steps = QUICK["reps"] + QUICK["warmup"]
    for r in s["decode"]:
        assert r["b"] * (r["context"] + 1) <= r["ctx_sum"] <= r["b"] * (r["context"] + 40 + steps)
        assert r["wall_ms"] > 0 and len(r["wall_ms_samples"]) == QUICK["reps"]


def test_transfer_was_measured_with_the_models_kv_size(quick):
    _, _, out = quick
    p = CostProfile.from_json(out)
    cfg = LLAMA_8Q_2KV
    # K and V, every layer, every KV head (TP 1), fp32 on CPU
    kvb = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    assert p.kv_bytes_per_token == kvb
    assert p.fit["transfer"]["source"] == "measured"
    rows = p.samples["transfer"]
    assert sorted(r["tokens"] for r in rows) == sorted(QUICK["transfer_tokens"])
    for r in rows:
        assert r["bytes"] == r["tokens"] * kvb      # the whole prompt's KV was pulled
        assert r["ms"] > 0 and r["reps"] == QUICK["transfer_reps"]
    assert p.transfer_gb_per_s > 0


def test_the_profile_refits_from_its_samples(quick):
    _, _, out = quick
    p = CostProfile.from_json(out)
    assert refit(p) == p


def test_the_serving_path_was_measured_through_a_server(quick):
    """The quick row set's serving requests (3 lengths x 3, after one untimed each) through a
    `pdserve serve` of the profile's engine config, each with max_tokens tokens (max_tokens - 1
    gaps); the term is the median of TTFT - prefill_ms(n) by the profile's own formulas; the
    server was stopped by its SIGTERM drain."""
    _, _, out = quick
    p = CostProfile.from_json(out)
    rows = p.samples["serving"]
    assert sorted(r["n"] for r in rows) == sorted(QUICK["serving_tokens"] * QUICK["serving_reps"])
    for r in rows:
        assert r["output_tokens"] == QUICK["serving_max_tokens"]
        assert len(r["itl_ms"]) == QUICK["serving_max_tokens"] - 1
        assert 0 < r["ttft_ms"] <= r["e2e_ms"]
    want = max(0.0, statistics.median(r["ttft_ms"] - p.prefill_ms(r["n"]) for r in rows))
    assert p.serving_overhead_ms == pytest.approx(want, rel=1e-9, abs=1e-12)
    f = p.fit["serving"]
    assert f["source"] == "measured" and f["n_samples"] == len(rows)
    assert 0 <= f["heldout_mean_abs_rel_err"] <= f["heldout_max_abs_rel_err"]
    assert f["batch1_itl_samples"] == len(rows) * (QUICK["serving_max_tokens"] - 1)
    setup = p.extra["serving_setup"]
    assert setup["stopped_cleanly"] and setup["warmup_requests"] == len(QUICK["serving_tokens"])
    cmd = setup["command"]
    assert cmd[:2] == ["pdserve", "serve"] and "--no-async-scheduling" in cmd
    assert cmd[cmd.index("--max-num-batched-tokens") + 1] == str(
        p.engine_config["max_num_batched_tokens"])


def test_the_served_batches_were_measured_on_the_same_server(quick):
    """The quick row set's served batches (2 and 8 requests at once, 16 prompt tokens, 6 output
    tokens each) on the server of the single requests: a row per b whose TPOT is the median of
    its b requests' (e2e - TTFT) / 5, its mean context sum while decoding b * (16 + 6 / 2);
    the fit compares each with the profile's own decode_ms and calls it host-bound past 10%."""
    _, _, out = quick
    p = CostProfile.from_json(out)
    rows = p.samples["serving_batch"]
    assert [r["b"] for r in rows] == QUICK["serving_batches"]
    for r in rows:
        assert (r["prompt_len"], r["max_tokens"]) == (QUICK["serving_batch_prompt_tokens"],
                                                      QUICK["serving_batch_max_tokens"])
        assert r["ctx_sum"] == r["b"] * (16 + 6 / 2)
        assert len(r["tpot_ms_samples"]) == r["b"]
        assert r["tpot_ms"] == pytest.approx(statistics.median(r["tpot_ms_samples"]), abs=1e-3)
        # (a request whose tokens all reached the client in one write has a TPOT of 0: a lagging
        # API coalesces them, as the H100's 256-stream batch showed; not every request of a batch)
        assert 0 <= r["tpot_ms_p10"] <= r["tpot_ms"] <= r["tpot_ms_p90"] and r["wall_s"] > 0
        assert max(r["tpot_ms_samples"]) > 0
    f = p.fit["serving_batch"]
    assert f["source"] == "measured" and f["n_samples"] == len(rows)
    assert 0 <= f["heldout_mean_abs_rel_err"] <= f["heldout_max_abs_rel_err"]
    for r, x in zip(rows, f["rows"]):
        d = p.decode_ms(r["b"], r["ctx_sum"])
        assert x["decode_ms"] == pytest.approx(d, abs=1e-5)
        assert x["host_bound"] == (r["tpot_ms"] > 1.1 * d)
    assert set(p.serving_host_ms) == {"fixed_ms", "per_seq_ms"}
    assert p.extra["serving_setup"]["served_batch"] == {
        "sizes": QUICK["serving_batches"], "prompt_len": 16, "max_tokens": 6}
    assert p.extra["row_set"]["serving_batches"] == QUICK["serving_batches"]


def test_the_api_processs_cpu_was_measured_per_phase(quick):
    """A row per serving prompt length (its 3 timed requests of max_tokens 4: 3 n prompt and
    12 output tokens) and one per served batch (b requests of 16 prompt and 6 output tokens),
    each with the `pdserve serve` process's CPU seconds during it (> 0 on Linux: the API did
    parse, route and stream them), the writes its tokens came in, the engine steps the server
    counted (at least one a token of a lone request's, one a token of a batch's longest
    stream) and its wall time; the fit took them all, its term empty, or per_output_token_ms
    0, only with a note saying why."""
    _, _, out = quick
    p = CostProfile.from_json(out)
    rows = p.samples["serving_api"]
    reps, k = QUICK["serving_reps"], QUICK["serving_max_tokens"]
    want = [("sequential", reps, reps * n, reps * k) for n in QUICK["serving_tokens"]]
    want += [("batch", b, b * QUICK["serving_batch_prompt_tokens"],
              b * QUICK["serving_batch_max_tokens"]) for b in QUICK["serving_batches"]]
    # then the long batch: the middle size again, 4x the tokens each (hand-counted from the
    # preset: batches [2, 8], 16 prompt and 6 output tokens -> 8 requests of 24 tokens)
    assert QUICK["serving_batches"] == [2, 8] and QUICK["serving_batch_max_tokens"] == 6
    want += [("long", 8, 8 * 16, 8 * 24)]
    assert [(r["phase"], r["requests"], r["prompt_tokens"], r["output_tokens"])
            for r in rows] == want
    assert all(r["wall_s"] > 0 for r in rows)
    # (the client's count of writes: at least one a request, at most one a token)
    assert all(r["requests"] <= r["writes"] <= r["output_tokens"] for r in rows), rows
    assert all(r["steps"] >= (r["output_tokens"] if r["phase"] == "sequential"
                              else r["output_tokens"] // r["requests"]) for r in rows), rows
    assert p.extra["serving_setup"]["api_long_batch"] == {"b": 8, "max_tokens": 24}
    assert p.extra["serving_setup"]["steps_source"] == "/metrics pdserve:engine_steps_total"
    if sys.platform.startswith("linux"):
        assert all(r["api_cpu_s"] > 0 for r in rows), rows
        assert p.extra["serving_setup"]["api_cpu_source"].startswith("process CPU-time clock")
    f = p.fit["serving_api"]
    assert f["source"] == "measured" and f["n_samples"] == len(rows)
    if p.api_cost_ms:
        assert 0 <= f["heldout_mean_abs_rel_err"] <= f["heldout_max_abs_rel_err"]
        assert all(v >= 0 for v in p.api_cost_ms.values())
        assert "steps" in f["columns"] and f["per_step"] == "fitted"
        if "output_tokens" not in f["columns"]:
            assert p.api_cost_ms["per_output_token_ms"] == 0.0
            assert f["note"].startswith("per_output_token_ms 0")
    else:
        assert f["note"].startswith("no term")


def test_served_batch_sizes_must_fit_the_measured_server():
    """Each b within the server's max_num_seqs, and b prompts prefilled within
    MAX_BATCH_PREFILL_STEPS (4) steps of its budget: a preset size beyond is left out, a given
    one is an error naming the limit."""
    from types import SimpleNamespace as NS
    server = NS(max_num_seqs=9, max_num_batched_tokens=32)     # 4 steps: 128 prompt tokens
    ns = profiler.resolve(profiler.build_parser().parse_args([]), "cpu")
    assert ns.serving_batches == [1, 4, 8, 16] and ns.serving_batch_prompt_tokens == 16
    assert profiler.served_batch_sizes(ns, server) == ([1, 4, 8], [16])
    ns = profiler.resolve(profiler.build_parser().parse_args(
        ["--serving-batches", "2", "16"]), "cpu")
    with pytest.raises(ValueError, match="max_num_seqs 9"):
        profiler.served_batch_sizes(ns, server)
    ns = profiler.resolve(profiler.build_parser().parse_args(
        ["--serving-batches", "8", "--serving-batch-prompt-tokens", "17"]), "cpu")
    with pytest.raises(ValueError, match="more than 4 steps of the measured server's 32-token"):
        profiler.served_batch_sizes(ns, server)
    ns = profiler.resolve(profiler.build_parser().parse_args(["--quick"]), "cpu")
    with pytest.raises(ValueError, match="no served batch size of the preset"):
        profiler.served_batch_sizes(ns, NS(max_num_seqs=1, max_num_batched_tokens=32))
    for args, said in ((["--serving-batch-max-tokens", "1"], "--serving-batch-max-tokens must "
                                                             "be >= 2"),
                       (["--serving-batches", "0", "4"], "--serving-batches values must be >= 1"),
                       (["--serving-batches", "4", "4"], "a size twice"),
                       (["--serving-batch-prompt-tokens", "0"], "must be >= 1")):
        with pytest.raises(ValueError, match=said):
            profiler.resolve(profiler.build_parser().parse_args(args), "cpu")


def test_serving_rows_default_to_lengths_the_prefill_fit_covers():
    ns = profiler.build_parser().parse_args(["--prefill-tokens", "8", "16", "40"])
    assert profiler.resolve(ns, "cpu").serving_tokens == [16]       # cpu's 16, 64, 128, 256
    ns = profiler.build_parser().parse_args(["--prefill-tokens", "2", "4", "8"])
    assert profiler.resolve(ns, "cpu").serving_tokens == [2, 4, 8]  # none fit: the prefill's
    ns = profiler.build_parser().parse_args(["--serving-tokens", "4096"])
    with pytest.raises(ValueError, match="--serving-tokens must lie within"):
        profiler.resolve(ns, "cpu")


def test_transfer_and_server_failures_fall_back_to_stated_values(tmp_path, monkeypatch):
    """The two-worker deployment refuses to start, and so does the server (a command that
    exits at once): the profile still comes out, its transfer terms an estimate that says why,
    its serving overhead 0 "not measured" with the server's last words, the errors in the
    file."""
    import pdserve.routing as routing
    from pdserve.perf import serving_path
    tried = []

    def server_argv(cfg, port):
        tried.append(cfg)
        return [sys.executable, "-c", "import sys; sys.exit('no room for a server')"]
    monkeypatch.setattr(serving_path, "server_argv", server_argv)

    class NoSecondWorker:
        def __init__(self, *a, **kw):
            raise RuntimeError("no room for a second worker")
    monkeypatch.setattr(routing, "Router", NoSecondWorker)
    model = _folder(tmp_path, LLAMA_8Q_2KV)
    out = tmp_path / "p.json"
    rc = _profile(["--model", model, "--prefill-tokens", "8", "16", "24", "--decode-batches",
                   "1", "2", "3", "--contexts", "8", "24", "--mixed", "2:8", "--mixed-context", "8",
                   "--transfer-tokens", "8", "16", "32", "--reps", "1", "--warmup", "0",
                   "--serving-args", "--async-scheduling --max-num-batched-tokens 16"], out)
    assert rc == 0
    # the server it tried was the profile's engine with --serving-args' flags on top
    assert [(c.async_scheduling, c.max_num_batched_tokens, c.device) for c in tried] == [
        (True, 16, "cpu")]
    p = CostProfile.from_json(out)
    assert p.engine_config["async_scheduling"] is False       # (the steps' engine: unchanged)
    assert p.extra["row_set"]["serving_tokens"] == [16]       # (within the server's budget)
    f = p.fit["transfer"]
    assert f["source"] == "estimate" and f["n_samples"] == 0
    assert "no room for a second worker" in f["note"] and f["heldout_mean_abs_rel_err"] is None
    assert "no room for a second worker" in p.extra["transfer_setup"]["error"]
    assert p.transfer_gb_per_s > 0 and "transfer" not in p.samples
    f = p.fit["serving"]
    assert p.serving_overhead_ms == 0.0 and "serving" not in p.samples
    assert f["source"] == "not measured" and f["n_samples"] == 0
    assert "no room for a server" in f["note"] and "exited with code 1" in f["note"]
    # (the served batches ran on that server: not measured either, for the same reason)
    f = p.fit["serving_batch"]
    assert p.serving_host_ms == {} and "serving_batch" not in p.samples
    assert f["source"] == "not measured" and "no room for a server" in f["note"]
    f = p.fit["serving_api"]
    assert p.api_cost_ms == {} and "serving_api" not in p.samples
    assert f["source"] == "not measured" and "no room for a server" in f["note"]
    assert "no room for a server" in p.extra["serving_setup"]["error"]


def test_serving_args_are_engine_flags_over_the_profiles_own():
    from pdserve.config import EngineConfig
    cfg = EngineConfig(device="cpu", async_scheduling=False, max_num_batched_tokens=8192,
                       max_num_seqs=17, enable_prefix_caching=False, skip_tokenizer_init=True)
    assert profiler.serving_config(cfg, "") is cfg
    got = profiler.serving_config(cfg, "--async-scheduling --max-num-batched-tokens 2048")
    assert (got.async_scheduling, got.max_num_batched_tokens) == (True, 2048)
    assert (got.device, got.max_num_seqs, got.enable_prefix_caching) == ("cpu", 17, False)
    for bad, said in (("--no-such-flag", "unrecognized arguments: --no-such-flag"),
                      ("--max-num-batched-tokens many", "invalid int value: 'many'"),
                      ("--block-size '16", "No closing quotation")):
        with pytest.raises(ValueError, match="--serving-args") as e:
            profiler.serving_config(cfg, bad)
        assert said in str(e.value)


def test_bad_arguments_are_refused_before_any_engine(capsys, monkeypatch):
    monkeypatch.setattr(profiler, "_step_rows", None)   # never reached
    assert main(["profile", "--device", "cpu", "--contexts", "16"]) == 2
    assert "--contexts needs >= 2" in capsys.readouterr().err
    assert main(["profile", "--device", "cpu", "--mixed", "4x16"]) == 2
    assert "B:N" in capsys.readouterr().err
    assert main(["profile", "--device", "cpu", "--kv-connector", "no-such-connector"]) == 2
    assert "no-such-connector" in capsys.readouterr().err
    assert main(["profile", "--device", "cpu", "--serving-args", "--bogus 1"]) == 2
    assert "--serving-args: unrecognized arguments: --bogus 1" in capsys.readouterr().err
    # a serving prompt longer than the measured server's budget takes two steps, not one
    assert main(["profile", "--device", "cpu", "--serving-tokens", "16", "64",
                 "--serving-args", "--max-num-batched-tokens 32"]) == 2
    assert "token budget is 32" in capsys.readouterr().err
    # more requests at once than the measured server has sequence slots
    assert main(["profile", "--device", "cpu", "--serving-batches", "64",
                 "--serving-args", "--max-num-seqs 32"]) == 2
    assert "max_num_seqs 32" in capsys.readouterr().err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and Linux's "
                    "process CPU clock")
def test_the_api_cpu_reading_counts_the_process_and_its_threads_not_its_children():
    """A process that spins 0.2 s of CPU in a second thread while a child process of its own
    spins 0.3 s: process_cpu_s counts the thread (>= 0.2 s, plus its start-up) and not the
    child (< 0.5 s); the ns clock and /proc/<pid>/stat's ticks agree within two ticks."""
    import os
    import subprocess
    import textwrap

    from pdserve.perf import serving_path as sp
    code = textwrap.dedent("""
        import subprocess, sys, threading, time
        def spin(s):
            t = time.thread_time()
            while time.thread_time() - t < s:
                pass
        kid = subprocess.Popen([sys.executable, "-c", "import time\\nt = time.process_time()\\n"
                                "while time.process_time() - t < 0.3: pass"])
        th = threading.Thread(target=spin, args=(0.2,))
        th.start(); th.join(); kid.wait()
        print("done", flush=True)
        sys.stdin.read()
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "done"
        clock, ticks = sp.process_cpu_s(p.pid), sp._proc_stat_cpu_s(p.pid)
        assert 0.2 <= clock < 0.45
        assert abs(clock - ticks) <= 2 / os.sysconf("SC_CLK_TCK") + 1e-3
        assert sp.process_cpu_source(p.pid).startswith("process CPU-time clock")
    finally:
        p.stdin.close()
        p.wait()
    assert sp.process_cpu_s(p.pid) is None      # (gone: nothing to read)


def test_the_client_counts_a_write_per_distinct_arrival_time():
    """bench serve stamps every chunk of one read with the read's time, so a gap of exactly 0
    is a token of the same write: gaps [0.01, 0, 0, 0.02, 0] are 5 + 1 tokens in 3 writes (1;
    2, 3, 4; 5, 6). A lone token is one write; a failed request none. The phase's row sums
    them (its "writes")."""
    from pdserve.perf import serving_path as sp
    from pdserve.perf.metrics import RequestResult

    def res(itl, ok=True):
        return RequestResult(8, len(itl) + 1, success=ok, output_len=len(itl) + 1, itl=itl)
    got = [res([0.01, 0.0, 0.0, 0.02, 0.0]), res([]), res([0.01], ok=False)]
    assert [sp.client_writes(r) for r in got] == [3, 1, 0]
    row = sp._api_row("batch", got[:2], [sp.Window(0.001, 7, 0.5)], b=2)
    assert (row["requests"], row["writes"], row["output_tokens"]) == (2, 4, 7)


def test_a_phase_counts_the_engine_steps_the_servers_metrics_grew_by():
    """The steps column is what pdserve:engine_steps_total (summed over worker and kind) grew
    by around the phase: read from the server's own exposition (Metrics), 10 + 5 steps before,
    40 + 5 + 4 after: 34 steps. The counter is read outside the CPU window (a /metrics
    answer is the API's own work): the order of the readings says so. A phase of several
    windows sums them; a missing reading (None: /metrics unread) makes the column None."""
    import asyncio
    from types import SimpleNamespace

    from pdserve.perf import serving_path as sp
    from pdserve.perf.metrics import RequestResult
    from pdserve.routing.router_core import StepTotals
    from pdserve.server.metrics import Metrics

    m = Metrics("m")

    def exposition(steps):
        m.update_routes(SimpleNamespace(requests={}, transfers=0, transfer_bytes=0,
                                        transfer_seconds=0.0, transfer_failures=0, rerouted=0,
                                        recomputed=0, failed=0, steps=steps))
        return m.render().decode()
    assert sp.engine_steps_in(exposition({})) == 0
    texts = [exposition({("c0", "decode"): StepTotals(10), ("c1", "mixed"): StepTotals(5)}),
             exposition({("c0", "decode"): StepTotals(40), ("c1", "mixed"): StepTotals(5),
                         ("c0", "prefill"): StepTotals(4)})]
    assert "pdserve:engine_steps_gpu_timed_total" in texts[0]     # (not counted as steps)
    assert [sp.engine_steps_in(t) for t in texts] == [15, 49]
    order = []

    def steps():
        order.append("steps")
        return sp.engine_steps_in(texts[order.count("steps") - 1])

    def cpu():
        order.append("cpu")
        return 0.5 * order.count("cpu")

    async def work():
        order.append("work")
        return "done"
    res, w = asyncio.run(sp._measured(sp.Readers(cpu, steps), work()))
    assert res == "done" and (w.cpu_s, w.steps) == (0.5, 34) and w.wall_s >= 0
    assert order == ["steps", "cpu", "work", "cpu", "steps"]
    one = RequestResult(8, 3, success=True, output_len=3, itl=[0.01, 0.01])
    row = sp._api_row("sequential", [one, one], [w, sp.Window(0.25, 17, 1.0)], n=8)
    assert (row["steps"], row["api_cpu_s"]) == (51, 0.75)
    row = sp._api_row("sequential", [one, one], [w, sp.Window(0.25, None, 1.0)], n=8)
    assert row["steps"] is None and row["api_cpu_s"] == 0.75
    assert sp.engine_steps("http://127.0.0.1:9") is None     # (nothing answers there)
