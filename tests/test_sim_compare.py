"""Validation helpers of the simulator: the measured-vs-simulated comparison (pdserve/sim/
compare.py, `pdserve simulate --compare`), the device-time refit of a profile
(perf/cost_fit.device_time_profile) and the async-scheduling pickup (Simulator(...,
pipelined_pickup=True)). Expectations are hand-computed."""
import json
import math

import pytest

from pdserve.config import EngineConfig
from pdserve.perf.cost_fit import device_time_profile, profile_from_samples
from pdserve.sim import SimRequest, Simulator, parse_deployment
from pdserve.sim.cli import main as simulate_main
from pdserve.sim.compare import compare, format_comparison

from .test_adaptive_routing import profile as _profile


def run(rate, tput, ttft, tpot, lens=(100, 200)):
    return {"request_rate": rate, "request_throughput": tput, "mean_ttft_ms": ttft,
            "mean_tpot_ms": tpot, "p99_ttft_ms": None, "input_lens": list(lens),
            "output_lens": [10, 20]}


MEASURED = {"runs": [run("2", 1.9, 10.0, 2.0), run("50", 30.0, 80.0, 4.0),
                     run("inf", 40.0, 900.0, 8.0)]}
SIMULATED = {"runs": [run("2", 1.9, 10.5, 2.5), run("4", 3.8, 11.0, 2.6),
                      run("50", 29.0, 60.0, 4.2, lens=(100, 201)), run("inf", 37.0, 990.0, 8.0)]}


def test_per_rate_relative_errors_and_targets_by_hand():
    c = compare(SIMULATED, MEASURED)
    assert c["rates_compared"] == ["2", "50", "inf"]
    assert c["rates_only_simulated"] == ["4"] and c["rates_only_measured"] == []
    r2, r50, rinf = c["per_rate"]
    assert r2["mean_ttft_ms"]["rel_err"] == pytest.approx(0.05)       # 10.5 vs 10
    assert r2["mean_tpot_ms"]["rel_err"] == pytest.approx(0.25)       # 2.5 vs 2: missed
    assert r2["p99_ttft_ms"]["rel_err"] is None                       # not measured
    assert r2["below_saturation"] and r2["target_met"] is False
    assert r2["same_requests"] is True and r50["same_requests"] is False
    # 50 req/s offered is above the measured saturation (40 req/s): no target there
    assert not r50["below_saturation"] and "target_met" not in r50
    assert r50["mean_ttft_ms"]["rel_err"] == pytest.approx(-0.25)
    assert not rinf["below_saturation"]
    assert rinf["mean_ttft_ms"]["rel_err"] == pytest.approx(0.1)
    assert c["saturation"]["measured"] == 40.0 and c["saturation"]["simulated"] == 37.0
    assert c["saturation"]["rel_err"] == pytest.approx(-0.075) and c["saturation"]["target_met"]
    assert c["below_saturation_target_met"] is False
    text = format_comparison(c)
    assert "MISSED" in text and "+25%" in text and "other requests" in text
    json.dumps(c, allow_nan=False)


def test_no_common_rate_is_an_error():
    with pytest.raises(ValueError, match="no request rate in common"):
        compare({"runs": [run("4", 1, 1, 1)]}, {"runs": [run("2", 1, 1, 1)]})
    with pytest.raises(ValueError, match="no runs"):
        compare({"x": 1}, MEASURED)


# ---- device time --------------------------------------------------------------------------------
def _rows():
    """Rows whose wall time follows one exact model and device time another (half of each
    coefficient): prefill wall 2 + 0.01 n, device 1 + 0.005 n; decode wall 4 + 0.002 S,
    device 2 + 0.001 S (no per-sequence term); mixed: + 0.02 / 0.01 ms per chunk token."""
    pre = [{"n": n, "wall_ms": 2 + 0.01 * n, "gpu_ms": 1 + 0.005 * n}
           for n in (100, 200, 400, 800, 1600)]
    dec = [{"b": b, "ctx_sum": b * c, "wall_ms": 4 + 0.002 * b * c, "gpu_ms": 2 + 0.001 * b * c}
           for b in (1, 4, 16) for c in (100, 1000)]
    mix = [{"b": b, "ctx_sum": b * 100, "n": n, "wall_ms": 4 + 0.002 * b * 100 + 0.02 * n,
            "gpu_ms": 2 + 0.001 * b * 100 + 0.01 * n} for b, n in ((4, 256), (16, 512))]
    return {"prefill": pre, "decode": dec, "mixed": mix}


def test_device_time_profile_fits_the_gpu_ms_rows():
    est = {"transfer_fixed_ms": 1.0, "transfer_gb_per_s": 2.0, "kv_bytes_per_token": 100,
           "note": "test"}
    wall = profile_from_samples(_rows(), model="m", hardware="hw", engine_config={}, commit="c",
                                transfer_estimate=est)
    dev = device_time_profile(wall)
    assert wall.prefill_ms(1000) == pytest.approx(12.0, rel=1e-6)
    assert dev.prefill_ms(1000) == pytest.approx(6.0, rel=1e-6)
    assert dev.decode_ms(8, 4000) == pytest.approx(6.0, rel=1e-6)
    assert dev.mixed_ms(8, 800, 300) == pytest.approx(2 + 0.8 + 3.0, rel=1e-6)
    assert dev.transfer_ms(1000) == pytest.approx(wall.transfer_ms(1000))
    assert dev.extra["step_time"].startswith("device")


def test_queued_device_times_replace_the_synced_ones_for_decode_and_mixed_rows():
    """Rows measured queued too (queued_gpu_ms, here a third exact model: 1.5 + 0.001 S for
    decode, + 0.01 ms per chunk token for mixed) are fitted on that; a prefill row's queued
    time is not used (a lone prefill starts on an idle device), nor a queued time that is not
    a positive number."""
    rows = _rows()
    for r in rows["decode"]:
        r["queued_gpu_ms"] = 1.5 + 0.001 * r["ctx_sum"]
    for r in rows["mixed"]:
        r["queued_gpu_ms"] = 1.5 + 0.001 * r["ctx_sum"] + 0.01 * r["n"]
    for r in rows["prefill"]:
        r["queued_gpu_ms"] = 0.5
    est = {"transfer_fixed_ms": 1.0, "transfer_gb_per_s": 2.0, "kv_bytes_per_token": 100,
           "note": "test"}
    dev = device_time_profile(profile_from_samples(rows, model="m", hardware="hw",
                                                   engine_config={}, commit="c",
                                                   transfer_estimate=est))
    assert dev.prefill_ms(1000) == pytest.approx(6.0, rel=1e-6)
    assert dev.decode_ms(8, 4000) == pytest.approx(5.5, rel=1e-6)
    assert dev.mixed_ms(8, 800, 300) == pytest.approx(1.5 + 0.8 + 3.0, rel=1e-6)
    for r in rows["decode"]:
        r["queued_gpu_ms"] = None
    dev = device_time_profile(profile_from_samples(rows, model="m", hardware="hw",
                                                   engine_config={}, commit="c",
                                                   transfer_estimate=est))
    assert dev.decode_ms(8, 4000) == pytest.approx(6.0, rel=1e-6)


def test_a_profile_without_device_times_is_refused(tmp_path, capsys):
    p = _profile(samples={"prefill": [{"n": 16, "wall_ms": 3.0}]})
    with pytest.raises(ValueError, match="no gpu_ms"):
        device_time_profile(p)
    path = str(p.save(tmp_path / "cpu.json"))
    rc = simulate_main(["--profile", path, "--num-prompts", "2", "--async-scheduling",
                        "--result-file", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "no gpu_ms" in err and "Traceback" not in err


# ---- async pickup -------------------------------------------------------------------------------
def _constant_profile():
    """Every step with a prompt chunk alone: 10 ms; any step with decodes: 4 ms (no per-token
    or per-sequence terms, gamma 0)."""
    return _profile(alpha_ms_per_token=0.0, prefill_fixed_ms=10.0, gamma_ms_per_token=0.0,
                    beta_ms={"fixed_ms": 4.0, "per_seq_ms_below": 0.0, "per_seq_ms_above": 0.0,
                             "per_context_token_ms": 0.0})


@pytest.mark.parametrize("pickup,ttft_b_ms", [(False, 6.0), (True, 10.0)])
def test_a_request_reaching_a_busy_worker_joins_the_step_after_next(pickup, ttft_b_ms):
    # A arrives at 0: its prefill runs 0-10 ms, decodes 10-14, 14-18, ... B arrives at 12 ms,
    # mid-step. Sync: B's prompt joins the 14 ms step (with A's decode: 4 ms), first token at
    # 18 ms: TTFT 6 ms. Async: the 14 ms step was scheduled when it launched... B joins the step
    # after it (18-22 ms): TTFT 10 ms. A's tokens are the same in both: 10, 14, 18, ...
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=2048, block_size=16)
    sim = Simulator(parse_deployment("1C"), {"default": _constant_profile()}, cfg, 256, 4096,
                    "collocated", pipelined_pickup=pickup)
    res = sim.run([SimRequest(list(range(1, 33)), 6, 0.0), SimRequest(list(range(1, 33)), 3, 0.012)])
    a, b = res.results
    assert a.success and b.success
    assert a.ttft * 1e3 == pytest.approx(10.0)
    assert a.itl == pytest.approx([0.004] * 5)
    assert b.ttft * 1e3 == pytest.approx(ttft_b_ms)
    assert b.itl == pytest.approx([0.004, 0.004])


def test_compare_flag_stores_and_prints_the_comparison(tmp_path, capsys):
    prof = str(_profile().save(tmp_path / "p.json"))
    args = ["--profile", prof, "--num-prompts", "6", "--random-input-len", "64",
            "--random-output-len", "4", "--request-rate", "inf"]
    first = str(tmp_path / "a.json")
    assert simulate_main([*args, "--result-file", first]) == 0
    # the same run as the "measured" file: every relative error is 0
    out = str(tmp_path / "b.json")
    assert simulate_main([*args, "--compare", first, "--result-file", out]) == 0
    c = json.load(open(out))["comparison"]
    row = c["per_rate"][0]
    assert row["same_requests"] is True
    assert all(row[f]["rel_err"] == 0 for f in c["fields"] if row[f]["rel_err"] is not None)
    assert c["saturation"]["rel_err"] == 0 and "relative error" in capsys.readouterr().out
    rc = simulate_main([*args, "--compare", str(tmp_path / "missing.json"),
                        "--result-file", out])
    assert rc == 2 and "cannot read" in capsys.readouterr().err
    assert math.isfinite(c["saturation"]["measured"])


def test_the_validation_script_maps_a_bench_serve_config_to_simulate_flags():
    import importlib.util
    spec = importlib.util.spec_from_file_location("sim_validation", "scripts/sim_validation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = {"num_prompts": 200, "seed": 0, "dataset_name": "random", "vocab_size": 151936,
           "random_input_len": 1280, "request_rate": [2.0, "inf"], "goodput": ["ttft:500"],
           "max_concurrency": None, "burstiness": 1.0}
    args = mod.workload_args(cfg)
    a = __import__("pdserve.sim.cli", fromlist=["x"]).build_parser().parse_args(
        ["--profile", "p.json", *args])
    assert (a.num_prompts, a.vocab_size, a.random_input_len) == (200, 151936, 1280)
    assert a.request_rate == [2.0, math.inf] and a.goodput == ["ttft:500"]
    with pytest.raises(ValueError, match="max-concurrency"):
        mod.workload_args({**cfg, "max_concurrency": 8})
