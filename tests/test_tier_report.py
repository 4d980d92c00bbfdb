"""scripts/tier_report.py on hand-made result files: the ratios and counter deltas below are
computed by hand from the numbers written here."""
import importlib.util
import json
import math

import pytest

spec = importlib.util.spec_from_file_location("tier_report", "scripts/tier_report.py")
tier_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tier_report)

MODEL = 'model_name="m"'


def metrics_text(host, used, out, back, offl, loaded, host_hits, hits, queries, preempt):
    return "\n".join([
        "# HELP pdserve:kv_host_blocks KV blocks in the host tier",
        "# TYPE pdserve:kv_host_blocks gauge",
        f"pdserve:kv_host_blocks{{{MODEL}}} {host}",
        f"pdserve:kv_host_blocks_used{{{MODEL}}} {used}",
        f'pdserve:kv_blocks_swapped_total{{direction="out",{MODEL}}} {out}',
        f'pdserve:kv_blocks_swapped_total{{direction="in",{MODEL}}} {back}',
        f"pdserve:kv_blocks_swapped_created{{direction=\"in\",{MODEL}}} 1.7e9",
        f"pdserve:kv_blocks_offloaded_total{{{MODEL}}} {offl}",
        f"pdserve:kv_blocks_loaded_back_total{{{MODEL}}} {loaded}",
        f"pdserve:prefix_cache_host_hits_total{{{MODEL}}} {host_hits}",
        f"pdserve:prefix_cache_hits_total{{{MODEL}}} {hits}",
        f"pdserve:prefix_cache_queries_total{{{MODEL}}} {queries}",
        f"pdserve:num_preemptions_total{{{MODEL}}} {preempt}",
        f"pdserve:generation_tokens_total{{{MODEL}}} 12345.0",
        ""])


def result(rate, out_tps, goodput, mean_ttft, p99_ttft, completed=2048, failed=0):
    run = {"request_rate": rate, "completed": completed, "failed": failed, "duration": 10.0,
           "output_throughput": out_tps, "request_goodput": goodput,
           "goodput_slos_ms": {"ttft": 500.0}, "mean_ttft_ms": mean_ttft,
           "p99_ttft_ms": p99_ttft, "cached_token_fraction": 0.5}
    return {"benchmark": "serve", "runs": [run], **run}


def write(path, payload):
    path.write_text(json.dumps(payload))
    return str(path)


def test_attach_then_report(tmp_path, capsys):
    # tier side: inf (output 12,000 vs 4,000 tok/s: 3.0x; goodput 150 vs 20: 7.5x) and 16
    # (9,000 vs 6,000: 1.5x; goodput 40 vs 0: inf)
    files = {("tier", "inf"): result("inf", 12000.0, 150.0, 300.0, 900.0),
             ("gpu", "inf"): result("inf", 4000.0, 20.0, 2500.0, 8000.0),
             ("tier", "16"): result("16", 9000.0, 40.0, 80.0, 400.0),
             ("gpu", "16"): result("16", 6000.0, 0.0, 700.0, 1500.0),
             ("gpu", "8"): result("8", 5000.0, 30.0, 50.0, 100.0)}   # no tier side at 8
    paths = {k: write(tmp_path / f"tier-mt-{k[0]}-{k[1]}.json", v) for k, v in files.items()}
    before = tmp_path / "before.txt"
    after = tmp_path / "after.txt"
    # the tier side's inf run: counters 100 -> 1,100 offloaded, 10 -> 610 loaded back, host hits
    # 0 -> 9,600, swapped out 5 -> 25 and in 5 -> 20, preemptions 3 -> 7; gauges after: 56,173
    # host blocks, 4,000 used
    before.write_text(metrics_text(56173, 800, 5, 5, 100, 10, 0, 50, 1000, 3))
    after.write_text(metrics_text(56173, 4000, 25, 20, 1100, 610, 9600, 20050, 51000, 7))
    assert tier_report.main(["attach", paths["tier", "inf"], str(before), str(after)]) == 0
    printed = capsys.readouterr().out
    assert "pdserve:kv_blocks_offloaded_total" in printed and "generation_tokens" not in printed

    summary_path = tmp_path / "summary.json"
    assert tier_report.main(["report", str(tmp_path), "--output", str(summary_path)]) == 0
    s = json.loads(summary_path.read_text())
    assert [r["rate"] for r in s["rates"]] == ["16", "inf"]
    assert s["unpaired_rates"] == {"gpu": ["8"]}
    r16, rinf = s["rates"]
    assert rinf["output_tok_per_s_ratio"] == pytest.approx(3.0)
    assert rinf["goodput_ratio"] == pytest.approx(7.5)
    assert r16["output_tok_per_s_ratio"] == pytest.approx(1.5)
    assert r16["goodput_ratio"] == "inf"      # 40 / 0, strict JSON
    assert (rinf["tier"]["mean_ttft_ms"], rinf["tier"]["p99_ttft_ms"]) == (300.0, 900.0)
    assert (rinf["gpu"]["mean_ttft_ms"], rinf["gpu"]["p99_ttft_ms"]) == (2500.0, 8000.0)
    assert rinf["tier"]["server_metrics"] == {
        "pdserve:kv_host_blocks": 56173.0, "pdserve:kv_host_blocks_used": 4000.0,
        "pdserve:kv_blocks_swapped_total{direction=out}": 20.0,
        "pdserve:kv_blocks_swapped_total{direction=in}": 15.0,
        "pdserve:kv_blocks_offloaded_total": 1000.0,
        "pdserve:kv_blocks_loaded_back_total": 600.0,
        "pdserve:prefix_cache_host_hits_total": 9600.0,
        "pdserve:prefix_cache_hits_total": 20000.0,
        "pdserve:prefix_cache_queries_total": 50000.0,
        "pdserve:num_preemptions_total": 4.0}
    assert rinf["gpu"]["server_metrics"] is None     # not attached
    # the result file itself still holds bench serve's fields
    assert json.loads((tmp_path / "tier-mt-tier-inf.json").read_text())["runs"][0][
        "output_throughput"] == 12000.0


def test_ratio_edges():
    assert tier_report.ratio(0.0, 0.0) is None
    assert tier_report.ratio(3.0, 0.0) == math.inf
    assert tier_report.ratio(None, 2.0) is None
    assert tier_report.ratio(1.0, 4.0) == 0.25


def test_report_without_a_side_is_an_error(tmp_path, capsys):
    write(tmp_path / "tier-mt-tier-inf.json", result("inf", 1.0, 1.0, 1.0, 1.0))
    assert tier_report.main(["report", str(tmp_path)]) == 2
    assert "gpu" in capsys.readouterr().err


def test_bundle_results_keeps_every_file_once(tmp_path):
    """scripts/bundle_results.py: one file keyed by the inputs' names, the inputs removed, a
    missing input skipped."""
    spec = importlib.util.spec_from_file_location("bundle_results", "scripts/bundle_results.py")
    bundle_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bundle_results)
    a, b = tmp_path / "serve-mt-chat-on-8.json", tmp_path / "tier-report.json"
    a.write_text(json.dumps({"output_throughput": 1.5}))
    b.write_text(json.dumps({"rates": []}))
    out = tmp_path / "bundle.json"
    bundle_results.bundle(str(out), [str(a), str(b), str(tmp_path / "never-written.json")])
    assert json.loads(out.read_text()) == {"serve-mt-chat-on-8": {"output_throughput": 1.5},
                                           "tier-report": {"rates": []}}
    assert not a.exists() and not b.exists()


def test_bundle_results_drops_the_per_token_gaps_only(tmp_path):
    """A serving result's runs lose "itls" (counted: 2 + 1 + 0 gaps), and so does the result
    itself (a one-rate result repeats its run at top level: 1 gap); every other per-request list
    stays; a result without runs is kept as it is."""
    spec = importlib.util.spec_from_file_location("bundle_results", "scripts/bundle_results.py")
    bundle_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bundle_results)
    run = {"request_rate": "inf", "ttfts": [0.1, 0.2, 0.3], "itls": [[0.01, 0.02], [0.03], []]}
    a, b = tmp_path / "tier-mt-gpu-inf.json", tmp_path / "tier-report.json"
    a.write_text(json.dumps({"runs": [run], "config": {"num_prompts": 3}, "itls": [[0.5]]}))
    b.write_text(json.dumps({"rates": [{"itls": "kept: not a run"}]}))
    out = tmp_path / "bundle.json"
    bundle_results.bundle(str(out), [str(a), str(b)])
    got = json.loads(out.read_text())
    assert got["tier-mt-gpu-inf"] == {"runs": [{"request_rate": "inf", "ttfts": [0.1, 0.2, 0.3],
                                                "itls_dropped": 3}],
                                      "config": {"num_prompts": 3}, "itls_dropped": 1}
    assert got["tier-report"] == {"rates": [{"itls": "kept: not a run"}]}


def test_the_engine_steps_over_a_run_from_the_servers_own_exposition(tmp_path):
    """The step counters as pdserve's /metrics writes them (Metrics.update_routes), before and
    after a run of two workers: per kind over the run, by hand. mixed: c0 went 10 -> 30 steps
    (20) and c1 0 -> 5 (5): 25 steps; host 0.1 -> 0.5 s and 0 -> 0.1 s: 0.5 s / 25 = 20 ms;
    device 0.05 -> 0.25 s over 8 -> 28 timed steps and 0 -> 0.05 s over 5: 0.25 s / 25 = 10 ms;
    prompt tokens 1,000 + 500 over 25 = 60 a step, decode 100 + 25 = 5 a step. decode (c0
    only, no device time): 4 steps, 2 ms each."""
    from types import SimpleNamespace

    from pdserve.routing.router_core import StepTotals
    from pdserve.server.metrics import Metrics

    def exposition(m, steps):
        m.update_routes(SimpleNamespace(requests={}, transfers=0, transfer_bytes=0,
                                        transfer_seconds=0.0, transfer_failures=0, rerouted=0,
                                        recomputed=0, failed=0, steps=steps))
        return m.render().decode()
    m = Metrics("m")
    before = exposition(m, {("c0", "mixed"): StepTotals(10, 100.0, 8, 50.0, 1000, 200)})
    after = exposition(m, {("c0", "mixed"): StepTotals(30, 500.0, 28, 250.0, 2000, 300),
                           ("c1", "mixed"): StepTotals(5, 100.0, 5, 50.0, 500, 25),
                           ("c0", "decode"): StepTotals(4, 8.0, 0, 0.0, 0, 40)})
    path = write(tmp_path / "tier-mt-tier-inf.json", result("inf", 1.0, 1.0, 1.0, 1.0))
    (tmp_path / "b.txt").write_text(before)
    (tmp_path / "a.txt").write_text(after)
    assert tier_report.main(["attach", path, str(tmp_path / "b.txt"), str(tmp_path / "a.txt")]) == 0
    steps = tier_report.side_summary(json.loads(open(path).read()))["steps"]
    assert steps["mixed"] == pytest.approx({"steps": 25, "mean_wall_ms": 20.0,
                                            "mean_gpu_ms": 10.0, "prefill_tokens_per_step": 60.0,
                                            "decode_tokens_per_step": 5.0})
    assert steps["decode"] == pytest.approx({"steps": 4, "mean_wall_ms": 2.0, "mean_gpu_ms": None,
                                             "prefill_tokens_per_step": 0.0,
                                             "decode_tokens_per_step": 10.0})


def test_proc_cpu_counts_a_process_tree_and_attaches_its_growth(tmp_path, capsys):
    """scripts/proc_cpu.py: a child that spins for 0.3 s of CPU is found under this process,
    and its CPU seconds grow by about that much (a loose upper bound: its start-up counts)."""
    import os
    import subprocess
    import sys
    import time
    spec = importlib.util.spec_from_file_location("proc_cpu", "scripts/proc_cpu.py")
    proc_cpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(proc_cpu)
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nsys.stdin.readline()\n"
                              "t = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
                              "print('spun', flush=True)\nsys.stdin.readline()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.2)
        before = tmp_path / "before.json"
        assert proc_cpu.main([str(os.getpid())]) == 0
        before.write_text(capsys.readouterr().out)
        assert str(child.pid) in json.loads(before.read_text())
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "spun\n"     # (0.3 s of CPU spent, now it waits)
        result = write(tmp_path / "r.json", {"benchmark": "serve"})
        assert proc_cpu.main([str(os.getpid()), "--since", str(before), "--attach", result]) == 0
        grown = json.loads(open(result).read())["process_cpu_s"]
        assert 0.25 <= grown[str(child.pid)]["cpu_s"] <= 1.0
        assert "time.process_time" in grown[str(child.pid)]["cmd"]
    finally:
        child.stdin.write("end\n")
        child.stdin.flush()
        child.wait(timeout=10)


def test_the_servers_request_phases_over_a_run(tmp_path):
    """The request-phase histograms as pdserve's /metrics writes them, before and after a run;
    their means over the run, by hand. TTFT: 10 and 30 ms before, then 50 and 110 ms: (50 + 110)
    / 2 = 80 ms; queue: 20 and 40 ms, all in the run: 30 ms; prefill: never observed: None;
    admission: one 4 ms observation."""
    from pdserve.server.metrics import Metrics

    m = Metrics("m")
    for s in (0.010, 0.030):
        m.ttft.observe(s)
    before = m.render().decode()
    for s in (0.050, 0.110):
        m.ttft.observe(s)
    for s in (0.020, 0.040):
        m.queue_time.observe(s)
    m.admission.observe(0.004)
    after = m.render().decode()
    path = write(tmp_path / "tier-mt-gpu-24.json", result("24", 1.0, 1.0, 1.0, 1.0))
    (tmp_path / "b.txt").write_text(before)
    (tmp_path / "a.txt").write_text(after)
    assert tier_report.main(["attach", path, str(tmp_path / "b.txt"), str(tmp_path / "a.txt")]) == 0
    phases = tier_report.side_summary(json.loads(open(path).read()))["request_phases"]
    assert phases["server_ttft_ms"] == pytest.approx(80.0)
    assert phases["queue_ms"] == pytest.approx(30.0)
    assert phases["prefill_ms"] is None
    assert phases["admission_ms"] == pytest.approx(4.0)
