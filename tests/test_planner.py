"""pdserve plan (pdserve/sim/planner.py): the deployment search over the simulator. Expectations
are worked by hand from the profile's formulas: a one-at-a-time server with (nearly)
deterministic arrivals and service D sustains exactly the rates up to 1/D, so the goodput is the
rate grid's last point at or below 1/D; a P/D pipeline's bottleneck stage sets its rate; a KV
hand-off that never ends leaves no request within the SLO."""
import math

import pytest

from pdserve.sim.planner import (Candidate, Planner, Unit, main, scale_profile, units)

from .test_adaptive_routing import profile as _profile

# prefill 2 + 0.01 n ms (L = 320: P = 5.2 ms); every decode step 0.5 ms; transfer ~free
L, P_MS, D_MS = 320, 5.2, 0.5


def hand_profile(**over):
    d = dict(prefill_fixed_ms=2.0, alpha_ms_per_token=0.01, prefill_quadratic_ms=0.0,
             beta_ms={"fixed_ms": 0.5, "per_seq_ms_below": 0.0, "per_seq_ms_above": 0.0,
                      "per_context_token_ms": 0.0},
             transfer_fixed_ms=0.0, transfer_gb_per_s=1e6)
    d.update(over)
    return _profile(**d)


def planner(prof, slo_ms, n=120):
    # 2-token requests (a prefill, one decode), one at a time per worker, arrivals all but
    # evenly spaced (gamma shape 1e9: a gap's relative spread 3e-5)
    reqs = [([1 + (7 * i + j) % 30000 for j in range(L)], 2) for i in range(400)]
    return Planner({1: prof}, reqs, {"e2el": slo_ms}, min_requests=n, max_num_seqs=1,
                   burstiness=1e9, num_kv_blocks=512)


def grid_floor(rate):
    """The last point of the planner's grid 2^(k/8) at or below `rate`."""
    return 2.0 ** (math.floor(8 * math.log2(rate)) / 8)


def test_one_at_a_time_goodput_is_the_grid_rate_below_one_over_the_service_time():
    pl = planner(hand_profile(), 1.5 * (P_MS + D_MS))
    g = pl.goodput(Candidate(Unit(collocated=1), 2048, "collocated"))
    # 1C: D = P + d = 5.7 ms -> 175.4 req/s; the grid point below it is 2^(59/8) = 166.0
    assert g.rate == pytest.approx(grid_floor(1e3 / (P_MS + D_MS)))
    assert g.rate == pytest.approx(2 ** (59 / 8))
    assert g.attainment == 1.0 and g.next_attainment < 0.9
    # 1P1D: the prefill stage (5.2 ms) is the bottleneck -> 192.3 req/s: 2^(60/8) = 181.0
    g = pl.goodput(Candidate(Unit(1, 1), 2048, "disagg"))
    assert g.rate == pytest.approx(grid_floor(1e3 / P_MS))
    assert g.per_gpu == pytest.approx(2 ** (60 / 8) / 2)


def test_search_ranks_per_gpu_and_copies_a_unit_over_the_gpus():
    pl = planner(hand_profile(), 1.5 * (P_MS + D_MS))
    cands = [Candidate(u, 2048, "collocated" if u.kind == "collocated" else "disagg")
             for u in units(4, [1], 4, ["collocated", "disagg"])]
    assert [c.unit.label for c in cands] == ["1C", "1P1D", "1P3D", "3P1D"]
    best = pl.search(cands)
    # per GPU: 1C 166.0; every P/D unit is bound by its prefill stage, 192.3 req/s a prefill
    # worker: 1P1D <= 192.3 / 2, 3P1D <= 3 x 192.3 / 4, 1P3D <= 192.3 / 4
    assert best[0].candidate.unit.label == "1C"
    assert best[0].per_gpu == pytest.approx(2 ** (59 / 8))
    bound = {"1P1D": 192.3 / 2, "3P1D": 3 * 192.3 / 4, "1P3D": 192.3 / 4}
    for g in best[1:]:
        assert 0 < g.per_gpu <= bound[g.candidate.unit.label]


def test_a_hand_off_that_never_ends_makes_disaggregation_lose():
    pl = planner(hand_profile(transfer_gb_per_s=1e-6), 1.5 * (P_MS + D_MS), n=40)
    best = pl.search([Candidate(Unit(1, 1), 2048, "disagg"),
                      Candidate(Unit(collocated=1), 2048, "collocated")])
    assert best[0].candidate.unit.label == "1C"
    assert best[1].rate == 0.0              # 1P1D: not one request within the SLO


def test_units_are_primitive_divide_the_gpus_and_need_tp_profiles():
    labels = [u.label for u in units(4, [1], 4)]
    # hand list: 1C; P/D with gcd 1 and 2 or 4 GPUs; mixed of 4 GPUs (1P1D+1C has 3)
    assert sorted(labels) == sorted(["1C", "1P1D", "1P3D", "3P1D", "1P1D+2C", "1P2D+1C",
                                     "2P1D+1C"])
    assert [u.label for u in units(3, [1], 4, ["collocated", "disagg"])] == ["1C", "1P2D", "2P1D"]
    tp = {u.label for u in units(4, [1, 2], 4, ["collocated", "disagg"])}
    assert {"1C(tp2)", "1P(tp2)1D(tp2)", "2P1D(tp2)", "1P(tp2)2D"} <= tp
    assert not {"1P1D(tp2)", "1P(tp2)1D"} & tp        # 3 GPUs: not a divisor of 4
    assert {"1P1D(tp2)", "1P(tp2)1D"} <= {u.label for u in units(6, [1, 2], 4, ["disagg"])}
    assert Unit(1, 1, 0, 2, 2).gpus == 4


def test_scaled_profile_terms_equal_hand_values():
    p = _profile()   # prefill 2 + 0.01 n; decode 5 + 0.1 b + 0.5 above 8 + 0.001 S; gamma 0.02
    s = scale_profile(p, bandwidth_ratio=2.0, flops_ratio=4.0, interconnect_gb_s=50.0)
    assert s.alpha_ms_per_token == 0.0025 and s.gamma_ms_per_token == 0.005
    assert s.prefill_fixed_ms == 1.0
    assert s.beta_ms == {"fixed_ms": 2.5, "per_seq_ms_below": 0.05, "per_seq_ms_above": 0.25,
                         "per_context_token_ms": 0.0005}
    assert s.transfer_gb_per_s == 50.0 and s.transfer_fixed_ms == 1.0
    assert s.kv_bytes_per_token == 1000 and s.batch_threshold == 8
    assert s.prefill_ms(100) == pytest.approx(1.0 + 0.25)
    assert s.decode_ms(10, 1000) == pytest.approx(2.5 + 0.05 * 8 + 0.25 * 2 + 0.5)
    assert s.transfer_ms(1000) == pytest.approx(1.0 + 1e6 / 50e6)
    for bad in (0, -1, math.inf, math.nan):
        with pytest.raises(ValueError, match="ratio"):
            scale_profile(p, bandwidth_ratio=bad)
    with pytest.raises(ValueError, match="interconnect"):
        scale_profile(p, interconnect_gb_s=0)


@pytest.mark.parametrize("args, message", [
    (["--num-gpus", "0"], "--num-gpus must be an integer from 1 to 64"),
    (["--num-gpus", "65"], "--num-gpus must be an integer from 1 to 64"),
    (["--profile", "no-such-gpu"], "unknown profile 'no-such-gpu'"),
    (["--goodput", "tpot"], "--goodput takes KEY:MS"),
    (["--goodput", "ttft:fast"], "is not a number of ms"),
    (["--flops-ratio", "0"], "flops ratio must be a finite number > 0"),
    (["--tp-profile", "two=x.json"], "--tp-profile takes TP=FILE"),
])
def test_bad_input_is_a_clear_error(args, message, capsys, tmp_path):
    base = {"--num-gpus": "2", "--profile": "h200-qwen2.5-1.5b", "--goodput": "tpot:25"}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    argv = [x for kv in base.items() for x in kv] + ["--result-file", str(tmp_path / "p.json")]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_overloaded_needs_a_shortfall_beyond_the_counts_noise():
    from pdserve.perf.metrics import RequestResult

    def run(n_late_done):
        # 300 arrivals evenly over [0, 3) s; 100 of them in the last third (2, 3]; every
        # request takes 0.5 s except that only n_late_done of those ending in (2, 3] do
        rs = []
        for i in range(300):
            t = 3.0 * (i + 1) / 300
            r = RequestResult(1, 2, success=True, start=t, latency=0.5)
            rs.append(r)
        ending = [r for r in rs if 2 < r.start + r.latency <= 3]
        for r in ending[n_late_done:]:
            r.latency = 10.0
        return rs, len(ending)

    from pdserve.sim.planner import overloaded
    rs, ending = run(10 ** 6)
    assert ending == 100 and not overloaded(rs)
    # 100 arrived in the last third: overloaded below 85 done and below 100 - 3 * 10 = 70
    assert not overloaded(run(71)[0]) and not overloaded(run(70)[0])
    assert overloaded(run(69)[0])


def test_the_planner_spends_the_profiles_serving_overhead_as_simulate_does():
    """serving_overhead_ms 5: every probe's request has TTFT and e2e 5 ms longer than with
    serving_overhead=False (the same requests at the same rate, one at a time: by hand, TTFT
    = 5 + P)."""
    import dataclasses
    prof = hand_profile(serving_overhead_ms=5.0)
    cand = Candidate(Unit(collocated=1), 2048, "collocated")
    on = planner(prof, 100.0, n=20)
    off = dataclasses.replace(on, serving_overhead=False, runs=None)
    assert on.serving_overhead_ms == 5.0 and off.serving_overhead_ms == 0.0
    a, b = on.simulate(cand, 10.0), off.simulate(cand, 10.0)
    assert [r.ttft * 1e3 for r in a] == pytest.approx([5.0 + P_MS] * 20, rel=1e-9)
    assert [r.latency - s.latency for r, s in zip(a, b)] == pytest.approx([5e-3] * 20, abs=1e-12)


def test_the_planner_takes_the_served_step_floor_with_the_serving_overhead():
    """serving_host_ms {1 ms, 0.5 ms per sequence}: a lone request's steps (one sequence) have
    a 1.5 ms floor; its prefill (5.2 ms) is longer, its decode step (0.5 ms) is not: e2e 5.2 +
    1.5 = 6.7 ms, against 5.2 + 0.5 with serving_overhead=False."""
    import dataclasses
    prof = hand_profile(serving_host_ms={"fixed_ms": 1.0, "per_seq_ms": 0.5})
    cand = Candidate(Unit(collocated=1), 2048, "collocated")
    on = planner(prof, 100.0, n=20)
    off = dataclasses.replace(on, serving_overhead=False, runs=None)
    assert [r.latency * 1e3 for r in on.simulate(cand, 10.0)] == pytest.approx([6.7] * 20,
                                                                                rel=1e-9)
    assert [r.latency * 1e3 for r in off.simulate(cand, 10.0)] == pytest.approx(
        [P_MS + D_MS] * 20, rel=1e-9)


def test_the_planner_queues_on_the_profiles_api_process_with_the_serving_overhead():
    """api_cost_ms {1 ms per request, 0 per prompt token, 0 per write, 2 ms per token, 0 per
    step}, no overhead: a lone request (rate 10/s: the API is idle when it comes) is admitted in 1 ms,
    prefilled (5.2 ms), its first token delivered 2 ms after (TTFT 8.2 ms); its second token,
    sampled 0.5 ms after the first, waits for the API: e2e 1 + 5.2 + 2 + 2 = 10.2 ms.
    serving_overhead=False: none of it, TTFT P and e2e P + d."""
    import dataclasses
    cost = {"per_request_ms": 1.0, "per_prompt_token_ms": 0.0, "per_write_ms": 0.0,
            "per_output_token_ms": 2.0, "per_step_ms": 0.0}
    prof = hand_profile(api_cost_ms=cost)
    cand = Candidate(Unit(collocated=1), 2048, "collocated")
    on = planner(prof, 100.0, n=20)
    off = dataclasses.replace(on, serving_overhead=False, runs=None)
    assert on.api_cost_ms == cost and off.api_cost_ms == {}
    a, b = on.simulate(cand, 10.0), off.simulate(cand, 10.0)
    assert [r.ttft * 1e3 for r in a] == pytest.approx([8.2] * 20, rel=1e-9)
    assert [r.latency * 1e3 for r in a] == pytest.approx([10.2] * 20, rel=1e-9)
    assert [r.ttft * 1e3 for r in b] == pytest.approx([P_MS] * 20, rel=1e-9)
    assert [r.latency * 1e3 for r in b] == pytest.approx([P_MS + D_MS] * 20, rel=1e-9)
