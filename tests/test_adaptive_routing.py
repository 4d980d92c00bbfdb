"""The cost model (routing/cost_model.py) and the adaptive policy (routing/adaptive.py): step and
path estimates computed by hand from the profile's formulas, the policy's decisions on
hand-built worker states (the issue's three synthetic profiles and every fallback), the online
correction, and the router core's loads and predictions that feed them (fake workers, as in
test_router_core)."""
import math

import pytest

from pdserve.perf.cost_profile import CostProfile
from pdserve.protocol import AddRequest
from pdserve.routing.adaptive import AdaptivePolicy
from pdserve.routing.cost_model import CORRECTION_BOUNDS, CostModel, WorkerLoad
from pdserve.routing.policies import Path, RouteRequest, WorkerView, make_policy
from pdserve.sampling_params import SamplingParams

from .test_router_core import PROMPT, SP, T0, Deployment

FIT = {t: {"n_samples": 4, "heldout_mean_abs_rel_err": 0.05, "heldout_max_abs_rel_err": 0.1}
       for t in ("prefill", "decode", "mixed", "transfer")}


def profile(**over) -> CostProfile:
    """prefill 2 + 0.01 n ms; decode 5 + 0.1 min(b, 8) + 0.5 max(0, b - 8) + 0.001 S ms;
    gamma 0.02 ms per prompt token in a mixed step; transfer 1 ms + 1 kB per token at 1 GB/s
    (1 us per token)."""
    d = dict(model="m", hardware="hw", engine_config={}, commit="c", alpha_ms_per_token=0.01,
             prefill_fixed_ms=2.0, prefill_quadratic_ms=0.0,
             beta_ms={"fixed_ms": 5.0, "per_seq_ms_below": 0.1, "per_seq_ms_above": 0.5,
                      "per_context_token_ms": 0.001},
             batch_threshold=8, gamma_ms_per_token=0.02, transfer_gb_per_s=1.0,
             transfer_fixed_ms=1.0, kv_bytes_per_token=1000, fit=FIT, samples={})
    beta = over.pop("beta_ms", {})
    d.update(over)
    d["beta_ms"] = {**d["beta_ms"], **beta}
    return CostProfile(**d)


def view(name, role, load=None, cached=0, kv_usage=0.0):
    return WorkerView(name, role, 0, kv_usage, None, cached, load or WorkerLoad())


def req(n=100, max_tokens=11, predicted=None, rid="r", **params):
    return RouteRequest(rid, n, SamplingParams(max_tokens=max_tokens, **params), predicted)


# ---- the cost model, by hand ----------------------------------------------------------------
def test_prefill_run_chunks_the_queue_and_rides_along_the_decodes():
    cm = CostModel(profile(), chunk_tokens=512)
    # nothing decoding: 300 queued + 1000 = 1300 tokens = 2 lone steps of 512 and one of 276
    idle = WorkerLoad(queued_prefill_tokens=300)
    assert cm.prefill_run_ms("w", idle, 1000) == pytest.approx(2 * (2 + 5.12) + (2 + 2.76))
    # 4 decodes at contexts summing to 2000: each step is decode (5 + 0.4 + 2) + 0.02 n
    busy = WorkerLoad(queued_prefill_tokens=300, decodes=4, decode_context_tokens=2000)
    assert cm.prefill_run_ms("w", busy, 1000) == pytest.approx(
        2 * (7.4 + 0.02 * 512) + (7.4 + 0.02 * 276))
    assert cm.prefill_run_ms("w", WorkerLoad(), 0) == pytest.approx(2 + 0.01)  # one token


def test_path_estimates_by_hand():
    cm = CostModel(profile(), chunk_tokens=4096)
    load = WorkerLoad(decodes=10, decode_context_tokens=5000, decode_remaining_tokens=100,
                      prefill_tokens_per_step=50)
    # collocated: TTFT = one mixed step of 10 decodes + 800 tokens; TPOT = 11 decodes at
    # contexts 5000 + 1000 + 10/2, carrying 50 prompt tokens per step
    e = cm.collocated("w", load, prompt=1000, uncached=800, output=10)
    dec10 = 5 + 0.1 * 8 + 0.5 * 2 + 0.001 * 5000
    assert e.ttft_ms == pytest.approx(dec10 + 0.02 * 800)
    assert e.tpot_ms == pytest.approx(5 + 0.8 + 0.5 * 3 + 0.001 * 6005 + 0.02 * 50)
    assert e.transfer_ms == 0 and e.harmed == 0     # (no SLO given: nobody counted)
    # disaggregated: P idle prefills 800 alone; D lacks 1000 - 256 tokens: 1 + 744 us
    p = WorkerLoad()
    d = WorkerLoad(decodes=2, decode_context_tokens=300)
    e = cm.disaggregated("p", p, 800, "d", d, prompt=1000, d_cached=256, output=10)
    assert e.ttft_ms == pytest.approx(2 + 8)
    assert e.transfer_ms == pytest.approx(1 + 0.744)
    step = 5 + 0.3 + 0.001 * (300 + 1000 + 5)
    assert e.tpot_ms == pytest.approx((1.744 + 9 * step) / 9)
    assert cm.disaggregated("p", p, 800, "d", d, 1000, 0, output=1).tpot_ms is None


def test_harm_counts_the_decodes_pushed_over_the_slo():
    cm = CostModel(profile(), chunk_tokens=4096)
    # 4 decodes at step 5.4 ms, 10 tokens left each; a 1000-token chunk adds 20 ms to one step
    # (2 ms per token left) and the new sequence 0.1 ms per step: 5.4 -> 7.4 + 0.1
    load = WorkerLoad(decodes=4, decode_context_tokens=0, decode_remaining_tokens=40)
    assert cm.collocated("w", load, 1000, 1000, 2, slo_tpot_ms=7.0).harmed == 4
    assert cm.collocated("w", load, 1000, 1000, 2, slo_tpot_ms=8.0).harmed == 0
    assert cm.collocated("w", load, 1000, 1000, 2, slo_tpot_ms=5.0).harmed == 0  # missed already


# ---- the policy -----------------------------------------------------------------------------
def policy(prof=None, chunk=4096, **kw):
    return AdaptivePolicy(CostModel(prof or profile(), chunk), **kw)


def test_tiny_bandwidth_keeps_everything_collocated():
    pol = policy(profile(transfer_gb_per_s=1e-4), slo_ttft_ms=1000, slo_tpot_ms=100)
    busy = WorkerLoad(decodes=20, decode_context_tokens=20000, decode_remaining_tokens=2000)
    workers = [view("p", "prefill"), view("d", "decode", busy), view("c", "collocated", busy)]
    for n in (16, 512, 4000):
        assert pol.choose(req(n, max_tokens=64), workers).kind == "collocated"


def test_a_large_gamma_with_a_fast_transfer_splits_loaded_traffic():
    prof = profile(gamma_ms_per_token=0.2, transfer_gb_per_s=1000.0,
                   beta_ms={"per_context_token_ms": 0.0})
    pol = policy(prof, slo_ttft_ms=1000, slo_tpot_ms=12)
    # 16 decodes at 9.8 ms a step, 100 tokens left each: a 2000-token prefill among them adds
    # 400 ms (+4.3 ms per token left: over 12), one more sequence in D's batch 0.3 ms
    busy = WorkerLoad(decodes=16, decode_context_tokens=16000, decode_remaining_tokens=1600)
    workers = [view("p", "prefill"), view("d", "decode", busy), view("c", "collocated", busy)]
    path = pol.choose(req(2000, max_tokens=64), workers)
    assert path == Path("disagg", "d", "p")
    # unloaded, the same request runs whole (no transfer, nothing to harm)
    idle = [view("p", "prefill"), view("d", "decode"), view("c", "collocated")]
    assert pol.choose(req(2000, max_tokens=64), idle) == Path("collocated", "c")


def test_a_one_sided_profile_still_splits_when_a_queue_misses_the_slo():
    """nanoPD's case: a transfer so cheap (and prefill interference so dear) that splitting
    always looks better; a long prefill queue on the prefill worker still sends traffic whole
    when the split path's TTFT would miss the SLO."""
    prof = profile(transfer_gb_per_s=1e6, transfer_fixed_ms=0.0, gamma_ms_per_token=0.5)
    pol = policy(prof, slo_ttft_ms=200, slo_tpot_ms=50)
    busy = WorkerLoad(decodes=2, decode_context_tokens=200, decode_remaining_tokens=400)
    # a 500-token prompt among 2 decodes: one 255 ms mixed step, over the TTFT SLO
    workers = [view("p", "prefill"), view("d", "decode", busy), view("c", "collocated", busy)]
    assert pol.choose(req(500, max_tokens=32), workers) == Path("disagg", "d", "p")
    p_queue = WorkerLoad(queued_prefill_tokens=40000)        # ~425 ms of prefill ahead on p
    workers[0] = view("p", "prefill", p_queue)
    path = pol.choose(req(500, max_tokens=32), workers)
    assert path.kind == "collocated" and path.worker in ("c", "d")
    assert pol.decisions == {"disagg": 1, "fallback": 1}


def test_fallbacks():
    pol = policy(slo_ttft_ms=1.0, slo_tpot_ms=1.0)          # nothing can meet these
    workers = [view("p", "prefill", WorkerLoad(queued_prefill_tokens=10000)),
               view("d", "decode"), view("c", "collocated", WorkerLoad(queued_prefill_tokens=500))]
    path = pol.choose(req(100), workers)
    assert path == Path("collocated", "d") and pol.decisions["fallback"] == 1   # lowest e2e
    assert pol.choose(req(100), []) is None
    # a request that may not be split: only whole paths
    ok = policy(slo_ttft_ms=1e6, slo_tpot_ms=1e6)
    split_only = [view("p", "prefill"), view("d", "decode")]
    assert ok.choose(req(100, max_tokens=1), split_only).kind == "collocated"
    assert ok.choose(req(100, prompt_logprobs=0), split_only).kind == "collocated"
    # a nearly full KV pool is avoided while another worker has room, used when all are full
    full = [view("c", "collocated", kv_usage=0.99), view("c2", "collocated", WorkerLoad(
        queued_prefill_tokens=3000))]
    assert ok.choose(req(100), full) == Path("collocated", "c2")
    assert ok.choose(req(100), [view("c", "collocated", kv_usage=0.99)]) == Path("collocated", "c")
    # whole on a prefill worker only when nothing else meets the SLO
    tight = policy(slo_ttft_ms=50, slo_tpot_ms=50)
    queued = WorkerLoad(queued_prefill_tokens=10000)        # 102 ms of prefill ahead
    assert tight.choose(req(100), [view("p", "prefill"), view("d", "decode", queued)]) \
        == Path("disagg", "d", "p")
    assert tight.choose(req(100, max_tokens=1), [view("p", "prefill"), view("d", "decode", queued)]) \
        == Path("collocated", "p")


def test_bad_arguments():
    with pytest.raises(ValueError, match="cost model"):
        make_policy("adaptive")
    with pytest.raises(ValueError):
        policy(slo_ttft_ms=-1)
    with pytest.raises(ValueError):
        policy(kv_full=0)
    with pytest.raises(ValueError):
        CostModel(profile(), chunk_tokens=0)
    with pytest.raises(ValueError):
        CostModel(profile(), 16, correction_weight=1.5)
    with pytest.raises(ValueError):
        CostModel(profile(), 16).observe_latency("e2e", 1.0, 1.0)


def test_online_correction_moves_toward_observed_and_stays_bounded():
    cm = CostModel(profile(), chunk_tokens=4096)
    raw = profile().decode_ms(4, 400)
    for _ in range(200):   # the worker's decode steps take twice the profile's time
        cm.observe_step("w", 0, 4, 400, 2 * raw)
    assert cm.factors[("w", "decode")] == pytest.approx(2.0, rel=1e-3)
    assert cm.step_ms("w", 4, 400, 0) == pytest.approx(2 * raw, rel=1e-3)
    assert cm.step_ms("other", 4, 400, 0) == pytest.approx(raw)       # per worker
    assert ("w", "prefill") not in cm.factors                         # per kind
    err = cm.error_stats()["decode"]
    assert err["n"] == 200 and 0 < err["mean_abs_rel_err"] < 1.0      # shrinking as it learns
    for _ in range(500):
        cm.observe_step("w", 0, 4, 400, 1000 * raw)
    assert cm.factors[("w", "decode")] == CORRECTION_BOUNDS[1]
    cm.observe_transfer_bytes("d", 1_000_000, 3 * profile().transfer_ms(1000))
    assert cm.factors[("d", "transfer")] == pytest.approx(1 + 0.05 * 2)
    cm.observe_latency("ttft", 30.0, 20.0)
    assert cm.error_stats()["ttft"] == {"n": 1, "mean_abs_rel_err": 0.5, "mean_ratio": 1.5}
    fixed = CostModel(profile(), chunk_tokens=4096, correction_weight=0.0)
    fixed.observe_step("w", 0, 4, 400, 2 * raw)
    assert fixed.factors[("w", "decode")] == 1.0 and fixed.error_stats()["decode"]["n"] == 1
    cm.observe_step("w", 0, 0, 0, 5.0)                                # an empty step: ignored
    cm.observe_step("w", 10, 0, 0, math.nan)                          # an unusable sample
    assert ("w", "prefill") not in cm.factors


# ---- the router core's loads and predictions --------------------------------------------------
def test_the_core_builds_each_workers_load_from_its_routes():
    pol = policy(slo_ttft_ms=1e6, slo_tpot_ms=1e6)
    dep = Deployment({"p0": "prefill", "d0": "decode", "c0": "collocated"}, policy=pol)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    assert dep.add("a", sp, final_only=True) is None            # whole on c0 (rank: collocated)
    assert dep.core.routes["a"].path == Path("collocated", "c0")
    assert dep.on["c0"]["a"].final_only is False                 # followed step by step
    loads = dep.core.loads()
    assert loads["c0"] == WorkerLoad(queued_prefill_tokens=len(PROMPT))
    dep.decoded("c0", "a", [1, 2], finished=False)               # past its first token
    assert dep.delivered == []                                   # final-only: not delivered
    load = dep.core.loads()["c0"]
    predicted = dep.core.routes["a"].predicted
    assert predicted == 5                                        # the predictor's prior, capped
    assert load == WorkerLoad(0, 1, len(PROMPT) + 2, predicted - 2)
    dep.decoded("c0", "a", [1, 2, 3, 4, 5], finished=True)
    assert [o.request_id for o in dep.delivered] == ["a"]
    assert dep.core.predictor.stats().observations == 1
    assert dep.core.loads() == {}


def test_the_batch_sees_its_own_queue_and_the_split_path_is_taken():
    """Four requests at once, with a TTFT SLO that one queued prompt ahead breaks: whole on the
    collocated worker, whole on the decode worker, then split (the prefill worker is idle)."""
    prof = profile(alpha_ms_per_token=10.0, prefill_fixed_ms=0.0)   # 60 ms per prompt
    pol = policy(prof, slo_ttft_ms=100, slo_tpot_ms=1e3)
    dep = Deployment({"p0": "prefill", "d0": "decode", "c0": "collocated"}, policy=pol)
    # (distinct prompts: a shared one would be a cache hit on the worker that took it first)
    reqs = [(AddRequest(f"r{i}", {"prompt_token_ids": [i + 1] * len(PROMPT)}, SP,
                        arrival_time=T0), None) for i in range(4)]
    dep.run(dep.core.add(reqs))
    paths = [dep.core.routes[f"r{i}"].path for i in range(4)]
    assert paths[:3] == [Path("collocated", "c0"), Path("collocated", "d0"),
                         Path("disagg", "d0", "p0")]
    assert pol.decisions == {"collocated": 2, "disagg": 1, "fallback": 1}


# ---- start-up: the profile the deployment is given ----------------------------------------------
def _here(**over) -> dict:
    """A profile dict of the embedded model on this machine."""
    from pdserve.bench.common import hardware_info
    return {**profile(model="embedded", hardware=hardware_info()).to_dict(), **over}


def test_the_adaptive_policy_takes_a_profile_of_this_model_and_machine(tmp_path, capsys):
    import json

    from pdserve.args import DeploymentArgs
    from pdserve.config import EngineConfig
    from pdserve.deploy import adaptive_policy
    cfg = EngineConfig(max_num_batched_tokens=256)
    f = tmp_path / "p.json"
    f.write_text(json.dumps(_here()))
    pol = adaptive_policy(cfg, DeploymentArgs(routing_policy="adaptive", cost_model=str(f),
                                              slo_ttft_ms=300, slo_tpot_ms=20))
    assert isinstance(pol, AdaptivePolicy) and (pol.slo_ttft_ms, pol.slo_tpot_ms) == (300, 20)
    assert pol.cost.chunk_tokens == 256
    assert f"from {f}" in capsys.readouterr().err            # it says where the model came from
    # a stored profile for this model and machine is found without a file
    from pdserve.perf.profiler import default_output
    store = tmp_path / "store"
    store.mkdir()
    d = _here()
    (store / default_output("embedded", d["hardware"])).write_text(json.dumps(d))
    import os
    os.environ["PDSERVE_PROFILE_DIR"] = str(store)
    try:
        assert isinstance(adaptive_policy(cfg, DeploymentArgs(routing_policy="adaptive")),
                          AdaptivePolicy)
    finally:
        del os.environ["PDSERVE_PROFILE_DIR"]
    assert "stored" in capsys.readouterr().err


@pytest.mark.parametrize("bad,match", [
    ({"gamma_ms_per_token": None}, "gamma_ms_per_token"),                 # missing (None: popped)
    ({"alpha_ms_per_token": -1.0}, "alpha_ms_per_token"),
    ({"transfer_gb_per_s": float("nan")}, "transfer_gb_per_s"),
    ({"model": "qwen2.5-7b"}, "another model"),
    ({"hardware": "NVIDIA H200"}, "measured elsewhere"),
])
def test_a_bad_profile_is_a_clear_error_at_start_up(tmp_path, bad, match):
    """Through the public API: the error comes before any worker starts."""
    import json

    from pdserve import LLM
    d = _here(**bad)
    d = {k: v for k, v in d.items() if v is not None}
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(d, allow_nan=True))
    with pytest.raises(ValueError, match=match):
        LLM(prefill=1, decode=1, routing_policy="adaptive", cost_model=str(f))
