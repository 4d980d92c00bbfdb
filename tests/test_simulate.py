"""The simulator (pdserve/sim): the real engine core and router core on a simulated clock.
Expectations come from outside the simulator: queueing theory (M/D/1, Pollaczek-Khinchine), a
naive queue recursion (Lindley's), the profile's formulas evaluated by hand for a lone request,
and a real CPU engine's scheduler decisions for the same requests."""
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pdserve.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.perf.cost_profile import CostProfile
from pdserve.perf.workload import arrival_times, mixed_requests
from pdserve.routing.adaptive import AdaptivePolicy
from pdserve.routing.cost_model import CostModel
from pdserve.sampling_params import SamplingParams
from pdserve.sim import (CostModelRunner, Deployment, SimClock, SimConversation, SimRequest,
                         Simulator, parse_deployment)
from pdserve.sim.cli import main as simulate_main

from .test_adaptive_routing import profile as _profile


def profile(**over) -> CostProfile:
    """test_adaptive_routing's profile with 0.05 ms per sequence above the knee: prefill
    2 + 0.01 n ms; decode 5 + 0.1 min(b, 8) + 0.05 max(0, b - 8) + 0.001 S ms; mixed + 0.02 ms
    per prompt token; transfer 1 ms + 1 kB per token at 1 GB/s."""
    return _profile(**{"beta_ms": {"per_seq_ms_above": 0.05}, **over})


def simulator(dep="1C", policy=None, prof=None, overhead_ms=0.0, **cfg):
    dep = parse_deployment(dep)
    c = dict(max_num_seqs=64, max_num_batched_tokens=2048, block_size=16)
    c.update(cfg)
    policy = policy or ("disagg" if dep.prefill else "collocated")
    return Simulator(dep, {"default": prof or profile()}, EngineConfig(**c), 4096, 8192, policy,
                     serving_overhead_ms=overhead_ms)


def prompts(n, length, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 30000, size=length).tolist() for _ in range(n)]


def service_ms(p: CostProfile, L: int, O: int) -> tuple[float, list[float]]:
    """A lone request by the profile's formulas: its prompt in one prefill step (the first
    token), then O - 1 decode steps of one sequence whose context is the prompt plus the tokens
    so far (L + k at decode step k)."""
    return p.prefill_ms(L), [p.decode_ms(1, L + k) for k in range(1, O)]


# ---- closed forms -------------------------------------------------------------------------------
def test_one_request_at_a_time_with_poisson_arrivals_is_an_md1_queue():
    """max_num_seqs=1, fixed lengths, no prefix cache (random prompts share first tokens now
    and then): the service time D is deterministic. Every request's wait (e2e - D) equals
    Lindley's recursion on the same arrivals (a sample-path identity), and the mean e2e latency
    is within 3 sigma of Pollaczek-Khinchine's D + rho D / (2 (1 - rho)) (sigma of that sample
    mean at rho = 0.5, N = 5000: 1.7%, measured over 300 seeds of the recursion)."""
    prof = profile()
    L, O, N, rho = 32, 2, 5000, 0.5
    first, rest = service_ms(prof, L, O)
    D = (first + sum(rest)) / 1e3
    offsets = arrival_times(N, rho / D, seed=7)
    sim = simulator(max_num_seqs=1, enable_prefix_caching=False)
    res = sim.run([SimRequest(p, O, float(t)) for p, t in zip(prompts(N, L), offsets)])
    assert all(r.success for r in res.results)
    waits = np.array([r.latency - D for r in res.results])
    lindley = np.zeros(N)
    for i in range(1, N):
        lindley[i] = max(0.0, lindley[i - 1] + D - (offsets[i] - offsets[i - 1]))
    assert np.allclose(waits, lindley, rtol=0, atol=1e-9)
    pk = rho * D / (2 * (1 - rho))
    e2e = np.mean([r.latency for r in res.results])
    print(f"M/D/1 rho={rho} N={N} D={D * 1e3:.3f} ms: mean wait {waits.mean() * 1e3:.4f} ms vs "
          f"P-K {pk * 1e3:.4f} ms ({100 * (waits.mean() / pk - 1):+.2f}%); mean e2e "
          f"{e2e * 1e3:.4f} ms vs {(D + pk) * 1e3:.4f} ms ({100 * (e2e / (D + pk) - 1):+.2f}%)")
    assert e2e == pytest.approx(D + pk, rel=3 * 0.017)
    # and TTFT = wait + the prefill step
    ttft = np.array([r.ttft for r in res.results])
    assert np.allclose(ttft - waits, first / 1e3, atol=1e-9)


@pytest.mark.parametrize("L", [100, 5000])
def test_a_lone_request_takes_the_profiles_step_times(L):
    """TTFT = the prefill steps (5000 tokens in chunks of 2048: 2048, 2048, 904), each ITL =
    one decode step at the context so far."""
    prof = profile()
    O = 6
    sim = simulator()
    r = sim.run([SimRequest(prompts(1, L)[0], O, 0.0)]).results[0]
    chunks = [min(2048, L - i) for i in range(0, L, 2048)]
    assert r.ttft * 1e3 == pytest.approx(sum(prof.prefill_ms(n) for n in chunks), rel=1e-9)
    assert np.array(r.itl) * 1e3 == pytest.approx(service_ms(prof, L, O)[1], rel=1e-9)
    assert r.output_len == O


@pytest.mark.parametrize("L", [100, 5000])
def test_the_steps_a_lone_request_takes_by_kind(L):
    """The run's steps per kind, as a served run's step counters give them: the prompt's chunks
    of at most 2048 tokens are prefill steps at the profile's prefill cost each (the last one
    samples the first token), then O - 1 decode steps of one sequence at the context so far;
    no mixed step."""
    prof = profile()
    O = 6
    res = simulator().run([SimRequest(prompts(1, L)[0], O, 0.0)])
    chunks = [min(2048, L - i) for i in range(0, L, 2048)]
    decodes = service_ms(prof, L, O)[1]
    steps = res.facts["steps"]
    assert set(steps) == {"prefill", "decode"}
    assert steps["prefill"]["steps"] == len(chunks)
    assert steps["prefill"]["prefill_tokens_per_step"] == pytest.approx(L / len(chunks))
    assert steps["prefill"]["decode_tokens_per_step"] == 0
    assert steps["prefill"]["mean_wall_ms"] == pytest.approx(
        np.mean([prof.prefill_ms(n) for n in chunks]), rel=1e-9)
    assert steps["decode"]["steps"] == O - 1
    assert steps["decode"]["decode_tokens_per_step"] == 1
    assert steps["decode"]["prefill_tokens_per_step"] == 0
    assert steps["decode"]["mean_wall_ms"] == pytest.approx(np.mean(decodes), rel=1e-9)


@pytest.mark.parametrize("L,padded", [(100, [128]), (5000, [2048, 2048, 1024])])
def test_a_profile_fitted_per_graph_shape_costs_steps_at_the_deployments_buckets(L, padded):
    """A profile measured with CUDA graphs (fit_graph_sizes) on a budget of 8192: the simulated
    deployment (budget 2048) pads each prefill chunk to its own graph bucket (the smallest of
    16, 32, ..., 1536, 2048 that holds it: step_shapes.mixed_sizes), as its ModelRunner would;
    decode steps are not padded. The same profile without fit_graph_sizes costs the chunks as
    they are."""
    from pdserve.step_shapes import mixed_sizes
    shaped = profile(fit_graph_sizes=mixed_sizes(8192),
                     engine_config={"device": "cuda", "max_num_batched_tokens": 8192})
    O = 6
    r = simulator(prof=shaped).run([SimRequest(prompts(1, L)[0], O, 0.0)]).results[0]
    assert r.ttft * 1e3 == pytest.approx(sum(shaped.prefill_ms(n) for n in padded), rel=1e-9)
    assert np.array(r.itl) * 1e3 == pytest.approx(service_ms(shaped, L, O)[1], rel=1e-9)
    flat = profile(engine_config={"device": "cuda", "max_num_batched_tokens": 8192})
    r = simulator(prof=flat).run([SimRequest(prompts(1, L)[0], O, 0.0)]).results[0]
    chunks = [min(2048, L - i) for i in range(0, L, 2048)]
    assert r.ttft * 1e3 == pytest.approx(sum(flat.prefill_ms(n) for n in chunks), rel=1e-9)


def test_a_lone_request_pays_the_serving_overhead_before_the_router():
    """Serving overhead 7.5 ms, a request at 0.3 s: by hand, TTFT = 7.5 + the prefill (2 +
    0.01 * 100 = 3 ms), e2e = TTFT + 5 decode steps, the ITLs those steps; it reaches the
    router (and the engine) at 0.3075 s; 0 gives the plain prefill."""
    prof, L, O = profile(), 100, 6
    first, decodes = service_ms(prof, L, O)
    assert first == pytest.approx(3.0)
    for o in (0.0, 7.5):
        sim = simulator(overhead_ms=o)
        seen = []
        add = sim.router.add
        sim.router.add = lambda batch: (seen.append((sim.now, batch[0][0].arrival_time)),
                                        add(batch))[1]
        r = sim.run([SimRequest(prompts(1, L)[0], O, 0.3)]).results[0]
        assert r.start == 0.3 and seen == [(pytest.approx(0.3 + o / 1e3, abs=1e-12),) * 2]
        assert r.ttft * 1e3 == pytest.approx(o + first, rel=1e-9)
        assert r.latency * 1e3 == pytest.approx(o + first + sum(decodes), rel=1e-9)
        assert np.array(r.itl) * 1e3 == pytest.approx(decodes, rel=1e-9)
    for bad in (-1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="serving_overhead_ms must be a finite number"):
            simulator(overhead_ms=bad)


FLOOR = {"fixed_ms": 2.0, "per_seq_ms": 0.5}


def test_a_lone_batch_takes_the_served_step_floor_where_it_is_longer():
    """16 requests of 10 prompt tokens and 4 output tokens at once, serving_host_ms {2 ms,
    0.5 ms per sequence}: by hand, every step of the 16 sequences has a floor of 2 + 0.5 * 16 =
    10 ms. The prefill step (160 tokens: 2 + 1.6 = 3.6 ms) and the decode steps (5 + 0.1 * 8 +
    0.05 * 8 + 0.001 * 16 * (10 + k) = 6.376, 6.392, 6.408 ms at k = 1, 2, 3) are all shorter:
    TTFT 10 ms, each ITL 10 ms, 4 steps lengthened by (10 - 3.6) + (10 - 6.376) + (10 - 6.392)
    + (10 - 6.408) ms. Without serving_floor (or with a floor below the steps, 0.1 ms per
    sequence: 1.6 ms) the steps take their costs."""
    prof = profile(serving_host_ms=FLOOR)
    decodes = [6.376, 6.392, 6.408]
    reqs = [SimRequest(p, 4, 0.0) for p in prompts(16, 10, seed=4)]
    cfg = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, block_size=16,
                       enable_prefix_caching=False)

    def run(prof, floor):
        sim = Simulator(parse_deployment("1C"), {"default": prof}, cfg, 4096, 8192,
                        "collocated", serving_floor=floor)
        res = sim.run(reqs)
        assert all(r.success for r in res.results)
        return res.results, res.facts["workers"]["c0"]

    results, w = run(prof, True)
    for r in results:
        assert r.ttft * 1e3 == pytest.approx(10.0, rel=1e-9)
        assert np.array(r.itl) * 1e3 == pytest.approx([10.0] * 3, rel=1e-9)
    assert w["served_floor_steps"] == 4 and w["steps"] == 4
    assert w["served_floor_s"] * 1e3 == pytest.approx(6.4 + sum(10 - d for d in decodes),
                                                      rel=1e-9)
    assert w["busy_s"] * 1e3 == pytest.approx(40.0, rel=1e-9)
    for p, floor in ((prof, False), (profile(serving_host_ms={"fixed_ms": 0.0,
                                                              "per_seq_ms": 0.1}), True)):
        results, w = run(p, floor)
        for r in results:
            assert r.ttft * 1e3 == pytest.approx(3.6, rel=1e-9)
            assert np.array(r.itl) * 1e3 == pytest.approx(decodes, rel=1e-9)
        assert w["served_floor_steps"] == 0 and w["served_floor_s"] == 0.0


def test_the_split_term_goes_by_the_steps_longest_sequence():
    """The kernel splits keys once any sequence in the step reaches 512 tokens, whatever the
    mean. Profile: decode 5 + 0.1 b + 0.001 S ms, split_ms 0.5, gamma 0.02 per prompt token. By
    hand:
    - decodes at positions 99 and 699 (contexts 100 and 700, mean 400): 5 + 0.2 + 0.8 + 0.5
      = 6.5 ms (by the mean alone it would be 6.0);
    - two decodes of 100 tokens beside a 50-token prompt chunk ending at position 600: 5 + 0.2
      + 0.2 + 0.5 + 0.02 x 50 = 6.9 ms;
    - the same chunk ending at 500 (every sequence under 512): 6.4 ms."""
    from pdserve.engine.scheduler import ScheduledChunk, SchedulerOutput
    r = CostModelRunner(profile(beta_ms={"split_ms": 0.5}), SimClock(), 16)
    r._prompt_len.update(a=10, b=10, p=600)

    def dec(rid, pos):
        return ScheduledChunk(rid, [0], pos, [], True)

    two = SchedulerOutput(chunks=[dec("a", 99), dec("b", 699)], num_decodes=2)
    assert r.device_ms(two) == pytest.approx(6.5)
    assert r.profile.decode_ms(2, 800) == pytest.approx(6.0)     # the mean's answer
    for end, want in ((600, 6.9), (500, 6.4)):
        mixed = SchedulerOutput(chunks=[dec("a", 99), dec("b", 99),
                                        ScheduledChunk("p", [0] * 50, end - 50, [], end == 600)],
                                num_decodes=2, num_prefill_tokens=50)
        assert r.device_ms(mixed) == pytest.approx(want)


def test_the_floor_counts_every_sequence_a_step_feeds():
    """The runner's floor is per sequence in the step, prefill chunks and decodes alike: a
    step of 3 decodes and 2 prompt chunks has 5 sequences, 2 + 0.5 * 5 = 4.5 ms; a profile
    without the term has none (0)."""
    from types import SimpleNamespace as NS
    r = CostModelRunner(profile(serving_host_ms=FLOOR), SimClock(), 16, serving_floor=True)
    sched = NS(chunks=[object()] * 5)
    assert r.floor_ms(sched) == pytest.approx(4.5)
    assert CostModelRunner(profile(), SimClock(), 16, serving_floor=True).floor_ms(sched) == 0.0
    assert CostModelRunner(profile(serving_host_ms=FLOOR), SimClock(), 16).floor_ms(sched) == 0.0
    assert r.floor_ms(NS(chunks=[])) == 0.0


def test_queues_form_behind_the_serving_overhead():
    """One sequence at a time (service D per request), the serving overhead o: every request
    reaches the router o after its arrival, so the queue is the one without the overhead
    shifted by o. By hand: requests at 0 and D / 2: the first's e2e is o + D, the second
    starts when the first ends (o + D) and ends at o + 2D: e2e o + 1.5 D (and 1.5 D at o = 0).
    A conversation's next turn is sent when its answer has ended, so each turn pays o again:
    turn 2 starts at 0 + (o + D)."""
    prof, L, O, o = profile(), 64, 3, 4.0
    first, decodes = service_ms(prof, L, O)
    D = (first + sum(decodes)) / 1e3
    p = prompts(2, L)
    res = simulator(overhead_ms=o, max_num_seqs=1, enable_prefix_caching=False).run(
        [SimRequest(p[0], O, 0.0), SimRequest(p[1], O, D / 2)])
    assert [r.latency for r in res.results] == pytest.approx([o / 1e3 + D, o / 1e3 + 1.5 * D],
                                                             rel=1e-9)
    assert res.results[1].ttft == pytest.approx(o / 1e3 + D / 2 + first / 1e3, rel=1e-9)
    conv = SimConversation(0.0, [], [p[0], p[1]], [O, O])
    r1, r2 = simulator(overhead_ms=o, enable_prefix_caching=False).run_conversations(
        [conv]).results
    assert r2.start == pytest.approx(r1.latency, rel=1e-12)
    assert r1.latency == pytest.approx(o / 1e3 + D, rel=1e-9)
    assert r2.ttft * 1e3 == pytest.approx(o + prof.prefill_ms(2 * L + O), rel=1e-9)


def test_the_request_phases_of_a_queue_by_hand():
    """The two requests of the test above (service D each, one at a time, overhead o), their
    phases as the served histograms name them: each reaches the router o after its arrival
    (admission o); the first is scheduled at once and the second when the first ends, D / 2
    after it reached the router (queue 0 and D / 2); each prefill is its prefill step (first);
    the first token's delivery is its prefill after reaching the router, plus its queue. The
    facts hold the means (ms)."""
    prof, L, O, o = profile(), 64, 3, 4.0
    first, decodes = service_ms(prof, L, O)
    D = first + sum(decodes)
    p = prompts(2, L)
    res = simulator(overhead_ms=o, max_num_seqs=1, enable_prefix_caching=False).run(
        [SimRequest(p[0], O, 0.0), SimRequest(p[1], O, D / 2e3)])
    assert res.facts["request_phases"] == pytest.approx(
        {"admission_ms": o, "queue_ms": D / 4, "prefill_ms": first,
         "server_ttft_ms": first + D / 4}, rel=1e-9)


@pytest.mark.parametrize("cache", [True, False])
def test_a_lone_conversation_turn_by_turn(cache):
    """One conversation of three turns on one worker: turn k is sent when turn k - 1's last
    token is out, its prompt is the history (system, messages, the answers' tokens) and its
    message. By hand: with the prefix cache, turn k prefills only what the tree lacks -- the
    last answer's final token (sampled, never fed, so it has no KV) and the new message;
    without it, the whole history. Each answer's tokens then follow as lone decode steps."""
    p = profile()
    system, users, outs = 100, [20, 30, 40], [5, 6, 7]
    rng = np.random.default_rng(3)
    conv = SimConversation(0.25, rng.integers(1, 30000, size=system).tolist(),
                           [rng.integers(1, 30000, size=n).tolist() for n in users], outs)
    res = simulator(enable_prefix_caching=cache).run_conversations([conv])
    assert [(r.conversation, r.turn, r.success) for r in res.results] == \
        [(0, 0, True), (0, 1, True), (0, 2, True)]
    start, history = 0.25, system
    for k, r in enumerate(res.results):
        prompt = history + users[k]
        computed = prompt - (history - 1) if cache and k else prompt
        first, decodes = p.prefill_ms(computed), [p.decode_ms(1, prompt + j)
                                                  for j in range(1, outs[k])]
        assert r.prompt_len == prompt
        assert r.start == pytest.approx(start, abs=1e-12)
        assert r.ttft * 1e3 == pytest.approx(first, rel=1e-9)
        assert r.latency * 1e3 == pytest.approx(first + sum(decodes), rel=1e-9)
        start, history = start + r.latency, prompt + outs[k]


def test_think_times_delay_each_turn_after_its_answer():
    """Think times (0, 0.5, 1.25 s): turn k is sent think_s[k] after turn k - 1's last token,
    so its start is the previous start + latency + think; everything else is the lone
    conversation's hand arithmetic without a cache (the whole history prefilled)."""
    p = profile()
    system, users, outs, think = 100, [20, 30, 40], [5, 6, 7], (0.0, 0.5, 1.25)
    rng = np.random.default_rng(3)
    conv = SimConversation(0.25, rng.integers(1, 30000, size=system).tolist(),
                           [rng.integers(1, 30000, size=n).tolist() for n in users], outs,
                           think)
    res = simulator(enable_prefix_caching=False).run_conversations([conv])
    start, history = 0.25, system
    for k, r in enumerate(res.results):
        prompt = history + users[k]
        first = p.prefill_ms(prompt)
        decodes = [p.decode_ms(1, prompt + j) for j in range(1, outs[k])]
        assert r.start == pytest.approx(start + think[k], abs=1e-12)
        assert r.ttft * 1e3 == pytest.approx(first, rel=1e-9)
        assert r.latency * 1e3 == pytest.approx(first + sum(decodes), rel=1e-9)
        start, history = r.start + r.latency, prompt + outs[k]
    for bad in ((0.0, 1.0), (0.0, -1.0, 0.0)):
        with pytest.raises(ValueError, match="think_s"):
            SimConversation(0.0, [], [[1], [2], [3]], [1, 1, 1], bad)


@pytest.mark.parametrize("host", [0, 600])
def test_a_simulated_host_tier_reports_what_a_worker_does(host):
    """The worker stats' host-tier fields, by name, from a simulated engine. 12 conversations of
    3 turns (history 200 + 3 x (60 + 8) tokens, ~26 blocks of 16 each at the end: ~310 in all)
    on a 64-block pool: the histories are ~5x the pool, so earlier turns' prefixes are evicted.
    With a 600-block host tier (room for all of them) they are offloaded there and later turns
    load them back (host hits); without one, the same names report 0."""
    rng = np.random.default_rng(5)
    convs = [SimConversation(0.01 * i, rng.integers(1, 30000, size=200).tolist(),
                             [rng.integers(1, 30000, size=60).tolist() for _ in range(3)],
                             [8, 8, 8]) for i in range(12)]
    c = dict(max_num_seqs=64, max_num_batched_tokens=2048, block_size=16)
    sim = Simulator(parse_deployment("1C"), {"default": profile()}, EngineConfig(**c), 64, 1024,
                    "collocated", num_host_blocks=host)
    res = sim.run_conversations(convs)
    assert all(r.success for r in res.results) and len(res.results) == 36
    (stats,) = sim.worker_stats().values()
    assert stats.num_host_blocks == host and stats.num_kv_blocks == 64
    fields = ("blocks_offloaded", "blocks_loaded_back", "prefix_host_hits")
    if host:
        assert all(getattr(stats, f) > 0 for f in fields), stats
        assert stats.prefix_host_hits <= stats.prefix_cache_hits
        assert 0 < stats.num_host_blocks_used <= host   # (the cached prefixes, nothing running)
    else:
        assert all(getattr(stats, f) == 0 for f in fields + (
            "num_host_blocks_used", "blocks_swapped_out", "blocks_swapped_in")), stats
    with pytest.raises(ValueError, match="num_host_blocks"):
        Simulator(parse_deployment("1C"), {"default": profile()}, EngineConfig(**c), 64, 1024,
                  "collocated", num_host_blocks=-1)


def test_the_turns_after_a_failed_turn_are_not_sent():
    """Turn 1's message alone is longer than max_model_len (8192): it is rejected, and turn 2
    is never sent; the other conversation is untouched."""
    ok = SimConversation(0.0, [], [[5] * 10, [6] * 10, [7] * 10], [3, 3, 3])
    bad = SimConversation(0.0, [], [[5] * 10, [6] * 9000, [7] * 10], [3, 3, 3])
    res = simulator().run_conversations([bad, ok])
    got = [(r.conversation, r.turn, r.success) for r in res.results]
    assert got == [(0, 0, True), (0, 1, False), (0, 2, False),
                   (1, 0, True), (1, 1, True), (1, 2, True)]
    assert "max_model_len" in res.results[1].error
    assert res.results[2].error.startswith("not sent")


def test_deterministic_arrivals_below_capacity_never_queue():
    """Two collocated workers, a request every 0.6 D: each finds a worker free (round trip of
    the least-loaded placement), so every e2e latency is exactly D."""
    prof = profile()
    L, O = 200, 8
    first, rest = service_ms(prof, L, O)
    D = (first + sum(rest)) / 1e3
    reqs = [SimRequest(p, O, i * 0.6 * D) for i, p in enumerate(prompts(40, L))]
    res = simulator("2C", enable_prefix_caching=False).run(reqs)
    assert [r.latency for r in res.results] == pytest.approx([D] * 40, rel=1e-9)


# ---- the real scheduler -------------------------------------------------------------------------
CFG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
       "tie_word_embeddings": True, "eos_token_id": 0}


def _decisions(engine, requests):
    steps = []
    engine._on_schedule = lambda s: steps.append((
        [(c.request_id, len(c.token_ids), c.start_pos, c.sample, list(c.block_table))
         for c in s.chunks], list(s.preempted_ids), list(s.finished_ids)))
    for rid, ids, params in requests:
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = len(o.outputs[0].token_ids)
    return steps, outs


def test_the_simulator_makes_the_real_engines_scheduling_decisions(tmp_path):
    """The same requests (added before any step) on a real CPU engine (a tiny dummy-weight
    Llama) and on an EngineCore over the cost-model runner, same config: the same
    SchedulerOutputs step by step (which sequences, how many tokens from where, their block
    tables, preemptions: the pool is small on purpose, chunked prefill: the budget is 16)."""
    from pdserve.worker.llm_engine import LLMEngine
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    cfg = EngineConfig(model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True,
                       num_kv_blocks=24, block_size=4, max_num_batched_tokens=16, max_num_seqs=6,
                       async_scheduling=False)
    rng = np.random.default_rng(3)
    reqs = [(f"r{i}", rng.integers(1, 300, size=int(rng.integers(3, 30))).tolist(),
             SamplingParams(temperature=0, max_tokens=int(rng.integers(2, 20)), ignore_eos=True))
            for i in range(8)]
    real = LLMEngine(cfg)
    want, want_out = _decisions(real, reqs)
    clock = SimClock()
    sim = EngineCore(cfg, CostModelRunner(profile(), clock, 4), num_kv_blocks=real.num_kv_blocks,
                     max_model_len=real.max_model_len, vocab_size=300, eos_token_ids=(0,),
                     clock=clock)
    got, got_out = _decisions(sim, reqs)
    assert real.scheduler.num_preemptions > 0
    assert len(got) == len(want)
    assert got == want
    assert got_out == want_out == {rid: p.max_tokens for rid, _, p in reqs}
    assert clock.t > 0


# ---- P/D and policies ---------------------------------------------------------------------------
def test_1p1d_moves_the_kv_and_ttft_is_the_prefill_alone():
    """One request on 1P1D: its first token when the prefill worker's step ends; the decode
    worker pulls the prompt's KV (transfer_ms(L) on the clock), then decodes."""
    prof = profile()
    L, O = 300, 4
    sim = simulator("1P1D")
    res = sim.run([SimRequest(prompts(1, L)[0], O, 0.0)])
    r = res.results[0]
    assert r.success and r.output_len == O
    assert r.ttft * 1e3 == pytest.approx(prof.prefill_ms(L), rel=1e-9)
    assert r.itl[0] * 1e3 == pytest.approx(prof.transfer_ms(L) + prof.decode_ms(1, L + 1),
                                           rel=1e-9)
    assert np.array(r.itl[1:]) * 1e3 == pytest.approx(
        [prof.decode_ms(1, L + k) for k in range(2, O)], rel=1e-9)
    f = res.facts
    assert f["transfers"] == 1 and f["transfer_bytes"] == L * prof.kv_bytes_per_token
    assert f["requests"] == {"collocated": 0, "disagg": 1}
    assert f["workers"]["d0"]["kv_loads"] == 1 and f["workers"]["p0"]["steps"] == 1


def test_the_adaptive_policy_places_requests_in_the_simulator():
    """1P1D+1C under the adaptive policy with a cost model over the same profile: every request
    completes, the policy decides each one, its cost model is fed the workers' steps."""
    prof = profile()
    pol = AdaptivePolicy(CostModel(prof, 2048), slo_ttft_ms=200, slo_tpot_ms=30)
    sim = simulator("1P1D+1C", policy=pol)
    reqs = mixed_requests(80, 0.25, 128, 16, 2000, 16, seed=1)
    offs = arrival_times(80, 40.0, seed=1)
    res = sim.run([SimRequest(r.prompt, r.expected_output_len, float(t))
                   for r, t in zip(reqs, offs)])
    assert all(r.success for r in res.results)
    assert sum(pol.decisions.values()) == 80
    assert sum(res.facts["requests"].values()) == 80
    errs = sim.router.model_stats()["cost_errors"]
    assert sum(e["n"] for k, e in errs.items() if k in ("prefill", "decode", "mixed")) > 0
    assert res.facts["transfers"] == res.facts["requests"]["disagg"]


# ---- the command line ---------------------------------------------------------------------------
ARGS = ["--deployment", "1P1D+1C", "--num-prompts", "60", "--request-rate", "20", "inf",
        "--random-input-len", "200", "--random-output-len", "12", "--random-range-ratio", "0.5",
        "--goodput", "ttft:50", "tpot:20", "--seed", "5"]


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory):
    return str(profile().save(tmp_path_factory.mktemp("prof") / "profile.json"))


def test_same_seed_same_json(profile_file, tmp_path, capsys):
    out = str(tmp_path / "r.json")
    texts = []
    for seed in ("5", "5", "6"):
        args = [*ARGS[:-1], seed, "--profile", profile_file, "--result-file", out]
        assert simulate_main(args) == 0
        d = json.load(open(out))
        d.pop("date"), d.pop("simulation_wall")
        texts.append(json.dumps(d))
    assert texts[0] == texts[1] and texts[0] != texts[2]
    d = json.loads(texts[0])
    # bench serve's fields, per rate
    for run in d["runs"]:
        for k in ("duration", "completed", "request_throughput", "output_throughput",
                  "request_goodput", "mean_ttft_ms", "p99_tpot_ms", "median_itl_ms",
                  "mean_e2el_ms", "ttfts", "itls", "start_times"):
            assert k in run
        assert run["completed"] == 60 and run["simulation"]["events"] > 0
    assert "TTFT ms" in capsys.readouterr().out


@pytest.mark.parametrize("host", [0, 600])
def test_the_host_tier_on_the_command_line(profile_file, tmp_path, host):
    """--num-host-blocks gives the simulated worker a host tier: 12 conversations x 3 turns of
    60 + 8 tokens (~13 blocks each at the end, ~150 in all) on a 64-block pool, all at once.
    Their evicted prefixes go to a 600-block tier and come back (offloaded, loaded back, host
    hits in the run's facts); without a tier, none."""
    out = str(tmp_path / "tier.json")
    assert simulate_main(["--dataset-name", "multi-turn", "--multi-turn-conversations", "12",
                          "--multi-turn-turns", "3", "--multi-turn-user-len", "60",
                          "--multi-turn-output-len", "8", "--num-kv-blocks", "64",
                          "--max-model-len", "1024", "--num-host-blocks", str(host),
                          "--profile", profile_file, "--result-file", out]) == 0
    d = json.load(open(out))
    assert d["completed"] == 36 and d["failed"] == 0
    (w,) = d["simulation"]["workers"].values()
    fields = ("blocks_offloaded", "blocks_loaded_back", "prefix_cache_host_hits")
    assert all((w[f] > 0) == bool(host) for f in fields), w


@pytest.mark.parametrize("policy", ["on-eviction", "write-through"])
def test_the_kv_offload_policy_on_the_command_line(profile_file, tmp_path, policy):
    """--kv-offload-policy reaches the simulated engine: the same 12 conversations x 3 turns on
    a pool that holds them all (1,024 blocks), so nothing is evicted. On eviction nothing goes
    to the 600-block host tier; write-through copies every cached prefix there when it is
    cached. Nothing is loaded back either way (every match is on the device)."""
    out = str(tmp_path / "policy.json")
    assert simulate_main(["--dataset-name", "multi-turn", "--multi-turn-conversations", "12",
                          "--multi-turn-turns", "3", "--multi-turn-user-len", "60",
                          "--multi-turn-output-len", "8", "--num-kv-blocks", "1024",
                          "--max-model-len", "1024", "--num-host-blocks", "600",
                          "--kv-offload-policy", policy,
                          "--profile", profile_file, "--result-file", out]) == 0
    d = json.load(open(out))
    assert d["completed"] == 36 and d["config"]["kv_offload_policy"] == policy
    (w,) = d["simulation"]["workers"].values()
    assert (w["blocks_offloaded"] > 0) == (policy == "write-through"), w
    assert w["blocks_loaded_back"] == 0 and w["prefix_cache_hits"] > 0, w


@pytest.mark.parametrize("retokenized", [False, True])
def test_multi_turn_on_the_command_line(profile_file, tmp_path, capsys, retokenized):
    """bench serve's multi-turn flags: 3 conversations x 4 turns, a 40-token system prompt,
    30-token messages, 5-token answers, conversations far apart (rate 0.001/s). By hand: turn
    k's prompt is 40 + k (30 + 5) + 30 tokens; the cache holds the conversation so far but for
    its last answer's final token, 40 + k (30 + 5) - 1 tokens, for every k >= 1; at turn 0 the
    second and third conversations find the system prompt (40), the first nothing. With the
    answers retokenized (6 other ids in the next turn's history for each 5-token answer), turn
    k's prompt is 40 + k (30 + 6) + 30, and turn k >= 1 finds only turn k - 1's prompt."""
    out = str(tmp_path / "mt.json")
    assert simulate_main(["--dataset-name", "multi-turn", "--multi-turn-conversations", "3",
                          "--multi-turn-turns", "4", "--multi-turn-user-len", "30",
                          "--multi-turn-output-len", "5", "--multi-turn-system-len", "40",
                          "--request-rate", "0.001", "--profile", profile_file,
                          "--result-file", out]
                         + ["--multi-turn-retokenized-answers"] * retokenized) == 0
    d = json.load(open(out))
    assert d["completed"] == 12 and d["failed"] == 0 and d["num_prompts"] == 12
    turns = d["per_turn"]
    turn = 36 if retokenized else 35                  # tokens a turn adds to the history
    assert [t["mean_input_tokens"] for t in turns] == [40 + k * turn + 30 for k in range(4)]
    found = [40 + (k - 1) * 36 + 30 if retokenized else 40 + k * 35 - 1 for k in range(1, 4)]
    assert [t["cached_tokens"] for t in turns] == [80] + [3 * f for f in found]


@pytest.mark.parametrize("args,msg", [
    (["--deployment", "2X"], "unknown deployment"),
    (["--deployment", "2P"], "need decode workers"),
    (["--request-rate", "-1"], "must be > 0"),
    (["--deployment", "1C", "--prefill", "1"], "not both"),
    (["--routing-policy", "nope"], "unknown routing policy"),
    (["--num-prompts", "0"], "num-prompts"),
])
def test_bad_input_is_an_error_not_a_traceback(profile_file, tmp_path, capsys, args, msg):
    rc = simulate_main(["--profile", profile_file, "--num-prompts", "3",
                        "--result-file", str(tmp_path / "x.json"), *args])
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and "Traceback" not in err


def with_and_without_serving_path(tmp_path, path, *args):
    """`pdserve simulate --profile path *args` run with --serving-overhead and with
    --no-serving-overhead: the two result files, parsed (on, off)."""
    runs = []
    for flag in ("--serving-overhead", "--no-serving-overhead"):
        out = str(tmp_path / f"{flag}.json")
        assert simulate_main(["--profile", path, *args, flag, "--result-file", out]) == 0
        with open(out) as f:
            runs.append(json.load(f))
    return tuple(runs)


def test_simulate_takes_the_profiles_serving_overhead_unless_told_not_to(tmp_path):
    """A profile with serving_overhead_ms 7.5: every request's TTFT and e2e are 7.5 ms longer
    than with --no-serving-overhead (one request at a time: rate 0.01/s, 5 requests), its ITLs
    the same; the file says which overhead was used."""
    path = str(profile(serving_overhead_ms=7.5).save(tmp_path / "p.json"))
    on, off = with_and_without_serving_path(tmp_path, path, "--num-prompts", "5",
                                            "--request-rate", "0.01", "--random-input-len",
                                            "100", "--random-output-len", "4")
    assert on["profile"]["serving_overhead_ms"] == 7.5
    assert off["profile"]["serving_overhead_ms"] == 0.0
    assert np.array(on["ttfts"]) - np.array(off["ttfts"]) == pytest.approx([7.5e-3] * 5,
                                                                            abs=1e-12)
    assert on["mean_e2el_ms"] - off["mean_e2el_ms"] == pytest.approx(7.5, abs=1e-9)
    for a, b in zip(on["itls"], off["itls"]):
        assert a == pytest.approx(b, abs=1e-12)


def test_no_serving_overhead_turns_the_served_step_floor_off_too(tmp_path, capsys):
    """A profile with serving_host_ms {2 ms, 0.5 ms per sequence} and no serving overhead: 16
    requests of 10 prompt tokens and 4 output tokens at once (rate inf). By hand (as in
    test_a_lone_batch_takes_the_served_step_floor_where_it_is_longer): with the serving path
    every step takes the 10 ms floor; with --no-serving-overhead the steps' costs, 3.6 ms then
    6.376, 6.392, 6.408 ms. The file says which floor was used, and the worker's facts how many
    steps it lengthened."""
    path = str(profile(serving_host_ms=FLOOR).save(tmp_path / "p.json"))
    on, off = with_and_without_serving_path(tmp_path, path, "--num-prompts", "16",
                                            "--request-rate", "inf", "--random-input-len", "10",
                                            "--random-output-len", "4",
                                            "--no-enable-prefix-caching")
    assert on["profile"]["serving_host_ms"] == FLOOR and off["profile"]["serving_host_ms"] == {}
    assert on["ttfts"] == pytest.approx([10e-3] * 16, rel=1e-9)
    assert off["ttfts"] == pytest.approx([3.6e-3] * 16, rel=1e-9)
    for a, b in zip(on["itls"], off["itls"]):
        assert a == pytest.approx([10e-3] * 3, rel=1e-9)
        assert b == pytest.approx([6.376e-3, 6.392e-3, 6.408e-3], rel=1e-9)
    won, woff = on["simulation"]["workers"]["c0"], off["simulation"]["workers"]["c0"]
    assert won["served_floor_steps"] == 4 and woff["served_floor_steps"] == 0
    assert won["served_floor_s"] > 0 and woff["served_floor_s"] == 0
    assert "served-step floor 2.000 ms + 0.5000 ms per sequence" in capsys.readouterr().out


def test_a_profile_missing_a_term_is_an_error(tmp_path, capsys):
    d = profile().to_dict()
    del d["gamma_ms_per_token"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    rc = simulate_main(["--profile", str(path), "--num-prompts", "3"])
    assert rc == 2 and "gamma_ms_per_token is missing" in capsys.readouterr().err


def test_deployment_strings():
    assert parse_deployment("2P2D") == Deployment(2, 2, 0)
    assert parse_deployment("4c") == Deployment(0, 0, 4)
    assert parse_deployment("1P1D+2C") == Deployment(1, 1, 2)
    assert parse_deployment("1P1D+2C").label == "1P1D+2C"
    for bad in ("", "P2", "2P2D+", "2PD", "0C", "2D"):
        with pytest.raises(ValueError):
            parse_deployment(bad)


def test_the_simulator_imports_without_torch_or_zmq():
    code = textwrap.dedent("""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "zmq", "aiohttp"):
                    raise ImportError("blocked " + name)
        sys.meta_path.insert(0, Block())
        import pdserve.sim, pdserve.sim.cli
        from pdserve.sim.cli import simulate
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=".")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_a_serving_overhead_measured_on_another_scheduling_is_said(tmp_path):
    """The profile says on which server its serving path was measured (serving_setup's
    async_scheduling, or its command's flag in files made before the field); a run that
    schedules otherwise gets a note naming both, a matching run none."""
    import argparse
    import dataclasses

    from pdserve.sim.cli import serving_path_async, serving_path_note
    import pathlib
    committed = CostProfile.from_json(pathlib.Path(__file__).resolve().parents[1] / "bench"
                                      / "results" / "profile-h200-qwen2.5-1.5b-54eafc8.json")
    assert "--no-async-scheduling" in committed.extra["serving_setup"]["command"]
    assert serving_path_async(committed) is False               # (from the command)
    said = dataclasses.replace(committed, extra={**committed.extra, "serving_setup": {
        **committed.extra["serving_setup"], "async_scheduling": True}})
    assert serving_path_async(said) is True                     # (the field wins)
    unsaid = dataclasses.replace(committed, extra={})
    assert serving_path_async(unsaid) is None
    sync_run, async_run = argparse.Namespace(async_scheduling=False), argparse.Namespace(
        async_scheduling=True)
    assert serving_path_note(sync_run, committed, 5.27) is None
    note = serving_path_note(async_run, committed, 5.27)
    assert note and "synchronous server" in note and "asynchronously" in note
    assert "--serving-args" in note
    assert serving_path_note(sync_run, said, 5.27) and not serving_path_note(async_run, said, 5.27)
    assert serving_path_note(async_run, committed, 0.0) is None  # (no overhead added)
    assert serving_path_note(async_run, unsaid, 5.27) is None
