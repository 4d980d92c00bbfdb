"""The simulated API process (pdserve/sim/api_process.py): one FIFO server of CPU work in front
of every worker, admitting each request and writing each stream's tokens. Every expectation is
worked by hand from the profile's formulas (test_simulate.profile: prefill 2 + 0.01 n ms,
decode 5 + 0.1 min(b, 8) + 0.05 max(0, b - 8) + 0.001 S ms) and the API's costs: admission a =
per_request_ms + per_prompt_token_ms * prompt tokens, a write w + c (w = per_write_ms, c =
per_output_token_ms), a token joining its stream's write that has not started c more at the
end of the queue, an engine step that sampled tokens s = per_step_ms once, before its tokens;
a step's tokens go to the API in its chunk order (here: the order the requests arrived)."""

import numpy as np
import pytest

from pdserve.config import EngineConfig
from pdserve.sim import SimConversation, SimRequest, Simulator, parse_deployment
from pdserve.sim.api_process import ApiProcess

from .test_simulate import profile, prompts, with_and_without_serving_path


def api(per_request=0.0, per_prompt_token=0.0, per_output_token=0.0, per_write=0.0,
        per_step=0.0):
    """api_cost_ms; per_write 0 is the per-token model files had before per_write_ms, per_step
    0 the model of files before per_step_ms."""
    return {"per_request_ms": per_request, "per_prompt_token_ms": per_prompt_token,
            "per_write_ms": per_write, "per_output_token_ms": per_output_token,
            "per_step_ms": per_step}


def sim(cost, dep="1C", overhead_ms=0.0, policy=None):
    dep = parse_deployment(dep)
    cfg = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, block_size=16,
                       enable_prefix_caching=False)
    return Simulator(dep, {"default": profile()}, cfg, 4096, 8192,
                     policy or ("disagg" if dep.prefill else "collocated"),
                     serving_overhead_ms=overhead_ms, api_cost_ms=cost)


def watch_router(s):
    """(simulated time, arrival_time stamped) of each request as the router core gets it."""
    seen = []
    add = s.router.add

    def spy(batch):
        seen.extend((s.now, req.arrival_time) for req, _ in batch)
        return add(batch)
    s.router.add = spy
    return seen


def ms(xs):
    return [x * 1e3 for x in xs]


def test_a_burst_of_admissions_queues_on_the_one_api():
    """4 requests of 100 prompt tokens at t = 0, a = 1 + 0.01 * 100 = 2 ms each: the k-th
    (from 1) reaches the router at 2k ms, having waited 2 (k - 1) ms for the API. With a 5 ms
    serving overhead the router also waits for what the overhead holds beyond a + c (c = 0.5):
    2k + 2.5 ms. Busy 8 ms of admissions plus 4 x 2 token deliveries (2 output tokens each)."""
    for o, extra in ((0.0, 0.0), (5.0, 2.5)):
        s = sim(api(1.0, 0.01, 0.5), overhead_ms=o)
        seen = watch_router(s)
        res = s.run([SimRequest(p, 2, 0.0) for p in prompts(4, 100)])
        assert all(r.success for r in res.results)
        want = [2.0 * k + extra for k in (1, 2, 3, 4)]
        assert [t * 1e3 for t, _ in seen] == pytest.approx(want, abs=1e-9)
        assert [t * 1e3 for _, t in seen] == pytest.approx(want, abs=1e-9)   # (stamped then)
        f = res.facts["api"]
        assert f["admissions"] == 4 and f["tokens"] == 8
        assert f["admission_wait_ms_mean"] == pytest.approx(3.0)
        assert f["admission_wait_ms_max"] == pytest.approx(6.0)
        assert f["busy_s"] * 1e3 == pytest.approx(8.0 + 8 * 0.5)
        assert f["cost_ms"] == api(1.0, 0.01, 0.5)


def test_one_steps_tokens_are_delivered_one_after_another():
    """4 requests of 10 tokens at t = 0, free admission, c = 0.5 ms: one prefill step of 40
    tokens (2.4 ms) samples 4 first tokens, delivered 0.5, 1.0, 1.5, 2.0 ms after it; the API
    is idle again (4.4 ms) before the first decode step ends (2.4 + 5 + 0.4 + 0.001 * 4 * 11 =
    7.844 ms), so each ITL is that step's 5.444 ms, as without the API."""
    s = sim(api(per_output_token=0.5))
    res = s.run([SimRequest(p, 2, 0.0) for p in prompts(4, 10, seed=1)])
    assert ms(r.ttft for r in res.results) == pytest.approx([2.9, 3.4, 3.9, 4.4], abs=1e-9)
    assert ms(r.latency for r in res.results) == pytest.approx(
        [7.844 + 0.5 * k for k in (1, 2, 3, 4)], abs=1e-9)
    for r in res.results:
        assert ms(r.itl) == pytest.approx([5.444], abs=1e-9)
    f = res.facts["api"]
    assert f["delivery_lag_ms_mean"] == pytest.approx(1.25)
    assert f["delivery_lag_ms_max"] == pytest.approx(2.0)
    assert f["writes"] == f["tokens"] == 8 and f["tokens_per_write"] == 1.0


def test_a_lagging_api_delays_tokens_but_not_the_engine():
    """The same 4 requests (streams s1..s4), 3 tokens each, c = 2 ms a token, no per-write cost
    (the per-token model): 8 ms of API work per step, longer than a step. Steps end at 2.4,
    7.844 and 7.844 + 5 + 0.4 + 0.048 = 13.292 ms (the engine's own times: the worker is busy
    13.292 ms). Step 1: a write each, 2.4-4.4, 4.4-6.4, 6.4-8.4, 8.4-10.4. Step 2 (7.844): s1's,
    s2's and s3's writes have started: new ones, 10.4-12.4, 12.4-14.4, 14.4-16.4; s4's (8.4)
    has not: its token joins it, seen at 10.4, and its 2 ms go to the end of the queue (16.4 ->
    18.4). Step 3 (13.292): s1 and s2 new writes 18.4-20.4, 20.4-22.4; s3's (14.4) has not
    started: joined, seen at 16.4 (queue end 24.4); s4's last write started at 8.4: a new one,
    24.4-26.4. The run ends at 26.4 ms, the API busy 24 of them (12 tokens x 2 ms, as
    without joins: the per-token model's cost does not fall), 10 writes."""
    s = sim(api(per_output_token=2.0))
    res = s.run([SimRequest(p, 3, 0.0) for p in prompts(4, 10, seed=1)])
    steps = [2.4, 7.844, 13.292]
    seen = [[4.4, 12.4, 20.4], [6.4, 14.4, 22.4], [8.4, 16.4, 16.4], [10.4, 10.4, 26.4]]
    for r, times in zip(res.results, seen):
        assert r.ttft * 1e3 == pytest.approx(times[0], abs=1e-9)
        assert ms(r.itl) == pytest.approx(np.diff(times).tolist(), abs=1e-9)
        assert r.latency * 1e3 == pytest.approx(times[-1], abs=1e-9)
    assert res.facts["workers"]["c0"]["busy_s"] * 1e3 == pytest.approx(13.292, abs=1e-9)
    assert res.duration * 1e3 == pytest.approx(26.4, abs=1e-9)
    lags = [t - steps[k] for times in seen for k, t in enumerate(times)]
    f = res.facts["api"]
    assert f["delivery_lag_ms_mean"] == pytest.approx(np.mean(lags), abs=1e-9)
    assert f["delivery_lag_ms_max"] == pytest.approx(26.4 - 13.292, abs=1e-9)
    assert f["busy_s"] * 1e3 == pytest.approx(24.0) and f["utilization"] == pytest.approx(
        24.0 / 26.4)
    assert (f["tokens"], f["writes"]) == (12, 10) and f["tokens_per_write"] == pytest.approx(1.2)
    assert s.api.open_streams == 0


def test_a_lagging_api_joins_a_streams_next_token_into_its_pending_write():
    """As above with w = 1.5 ms a write and c = 0.5 ms a token (2 ms for a write of one token,
    as above). Step 1: writes 2.4-4.4, 4.4-6.4, 6.4-8.4, 8.4-10.4. Step 2 (7.844): s1..s3 new
    writes 10.4-12.4, 12.4-14.4, 14.4-16.4; s4 joins its write (starts 8.4 > 7.844), seen at
    10.4, adding only c: the queue ends at 16.9. Step 3 (13.292): s1 18.4 -> 16.9-18.9, s2
    18.9-20.9 (its write started at 12.4), s3 joins (14.4 > 13.292): seen 16.4, queue end 21.4;
    s4 a new write 21.4-23.4. The run ends at 23.4 ms (not 26.4: a joined token costs c, not w +
    c), the API busy 10 x 2 + 2 x 0.5 = 21 ms."""
    s = sim(api(per_write=1.5, per_output_token=0.5))
    res = s.run([SimRequest(p, 3, 0.0) for p in prompts(4, 10, seed=1)])
    seen = [[4.4, 12.4, 18.9], [6.4, 14.4, 20.9], [8.4, 16.4, 16.4], [10.4, 10.4, 23.4]]
    for r, times in zip(res.results, seen):
        assert ms([r.ttft, r.latency]) == pytest.approx([times[0], times[-1]], abs=1e-9)
        assert ms(r.itl) == pytest.approx(np.diff(times).tolist(), abs=1e-9)
    assert res.facts["workers"]["c0"]["busy_s"] * 1e3 == pytest.approx(13.292, abs=1e-9)
    assert res.duration * 1e3 == pytest.approx(23.4, abs=1e-9)
    f = res.facts["api"]
    assert f["busy_s"] * 1e3 == pytest.approx(21.0, abs=1e-9)
    assert (f["tokens"], f["writes"]) == (12, 10)
    assert f["delivery_lag_ms_max"] == pytest.approx(23.4 - 13.292, abs=1e-9)
    assert f["queue_end_after_last_delivery_ms"] == pytest.approx(0.0, abs=1e-9)


def test_a_token_joins_only_its_own_streams_write_and_only_before_it_starts():
    """w = 1 ms, c = 0.5 ms, on the queue alone. a at 0: a write 0-1.5; b at 0: 1.5-3.0. b at
    1.5: b's write starts at 1.5, not after: started, so a new write 3.0-4.5. a at 2.0: a's
    write has started (0), and b's pending one is not a's: a new write 4.5-6.0. b at 2.0: joins
    b's 3.0-4.5 write, seen at 4.5, its 0.5 ms at the queue's end (6.5). a at 2.5: joins
    4.5-6.0, seen 6.0 (queue end 7.0). Closed, a stream's pending write is forgotten: a's next
    token (a new request of the same id) is a write of its own, 7.0-8.5."""
    q = ApiProcess(api(per_write=1.0, per_output_token=0.5))
    got = [q.deliver(t, st) for t, st in ((0.0, "a"), (0.0, "b"), (1.5e-3, "b"),
                                          (2.0e-3, "a"), (2.0e-3, "b"), (2.5e-3, "a"))]
    assert ms(got) == pytest.approx([1.5, 3.0, 4.5, 6.0, 4.5, 6.0], abs=1e-9)
    assert q.free_at * 1e3 == pytest.approx(7.0, abs=1e-9)
    assert (q.writes, q.tokens, q.open_streams) == (4, 6, 2)
    assert q.busy_s * 1e3 == pytest.approx(4 * 1.5 + 2 * 0.5, abs=1e-9)
    # (the two joined tokens' 0.5 ms each, charged after the last delivery at 6.0 ms)
    assert q.facts(7e-3)["queue_end_after_last_delivery_ms"] == pytest.approx(1.0, abs=1e-9)
    q.close("a")
    assert q.deliver(3.0e-3, "a") * 1e3 == pytest.approx(8.5, abs=1e-9)
    assert q.writes == 5
    q.close("a"), q.close("b"), q.close("never written")
    assert q.open_streams == 0


def test_a_steps_charge_comes_once_before_its_writes():
    """s = 2 ms, w = 1 ms, c = 0.5 ms, on the queue alone. A step at 0 with tokens for a and b:
    one charge 0-2, then a's write 2-3.5 and b's 3.5-5.0 (two streams, one charge). A step at
    1 ms with no token: nothing (no charge, no time). A step at 2.5 ms with b's token: its
    charge 5.0-7.0 at the end of the queue; b's write (3.5-5.0) has not started by 2.5: the
    token joins it, seen at 5.0, its 0.5 ms at the queue's end (7.5). A step at 6 ms with a's
    token: charge 7.5-9.5, a's write has started, so a write of its own 9.5-11.0. Busy: 3
    charges (6) + 3 writes (4.5) + a joined token (0.5) = 11 ms."""
    q = ApiProcess(api(per_write=1.0, per_output_token=0.5, per_step=2.0))
    assert ms(q.step(0.0, ["a", "b"])) == pytest.approx([3.5, 5.0], abs=1e-9)
    assert (q.steps, q.writes, q.busy_s * 1e3) == (1, 2, pytest.approx(5.0, abs=1e-9))
    assert q.step(1e-3, []) == []
    assert (q.steps, q.free_at * 1e3) == (1, pytest.approx(5.0, abs=1e-9))
    assert ms(q.step(2.5e-3, ["b"])) == pytest.approx([5.0], abs=1e-9)
    assert q.free_at * 1e3 == pytest.approx(7.5, abs=1e-9)
    assert ms(q.step(6e-3, ["a"])) == pytest.approx([11.0], abs=1e-9)
    f = q.facts(11e-3)
    assert (f["steps"], f["tokens"], f["writes"]) == (3, 4, 3)
    assert f["busy_s"] * 1e3 == pytest.approx(11.0, abs=1e-9)
    assert f["cost_ms"]["per_step_ms"] == 2.0


def test_each_workers_step_is_a_charge_of_its_own():
    """2C, s = 1 ms, c = 0.5 ms: two 100-token requests at 0 go to the two workers, whose
    prefills (2 + 0.01 * 100 = 3 ms) end together: two messages, two charges. The first
    worker's: charge 3-4, write 4-4.5; the second's: charge 4.5-5.5, write 5.5-6.0 (TTFTs 4.5
    and 6.0 ms). Each worker's decode step (5.201 ms) ends at 8.201 ms: 8.201-9.201 and its
    write 9.201-9.701, 9.701-10.701 and 10.701-11.201. 4 steps charged, busy 4 x 1.5 ms."""
    s = sim(api(per_output_token=0.5, per_step=1.0), "2C", policy="round-robin")
    res = s.run([SimRequest(p, 2, 0.0) for p in prompts(2, 100, seed=3)])
    assert sorted(ms(r.ttft for r in res.results)) == pytest.approx([4.5, 6.0], abs=1e-9)
    assert sorted(ms(r.latency for r in res.results)) == pytest.approx([9.701, 11.201],
                                                                        abs=1e-9)
    f = res.facts["api"]
    assert (f["steps"], f["tokens"]) == (4, 4)
    assert f["busy_s"] * 1e3 == pytest.approx(6.0, abs=1e-9)


def test_no_stream_state_outlives_its_request():
    """10,000 requests of 3 tokens each on the queue, every one closed at its end: no stream
    left. Through the simulator (one worker, and P/D where a stream's first token comes from
    another worker than the rest), 200 requests at once (the API lags: tokens join writes):
    every stream closed by the run's end, every token delivered."""
    q = ApiProcess(api(per_write=0.1, per_output_token=0.05))
    t = 0.0
    for i in range(10_000):
        for _ in range(3):
            q.deliver(t, i)
            t += 1e-5
        q.close(i)
    assert q.open_streams == 0 and q.tokens == 30_000
    for dep, policy in (("1C", None), ("1P1D", "disagg")):
        s = sim(api(per_write=0.2, per_output_token=0.05), dep, policy=policy)
        res = s.run([SimRequest(p, 4, 0.0) for p in prompts(200, 16, seed=4)])
        assert all(r.success for r in res.results)
        f = res.facts["api"]
        assert f["tokens"] == 800 and f["writes"] < 800
        assert s.api.open_streams == 0


def test_an_admission_after_a_step_waits_for_that_steps_deliveries():
    """a = 1 ms, c = 3 ms, 100-token prompts, 2 output tokens. A at 0: admitted 0-1 ms,
    prefill 1-4 ms, its first token delivered 4-7 ms. B arrives at 5 ms, while the API still
    delivers A's token: admitted 7-8 ms, so it reaches the router at 8 ms (not 6). A's decode
    step (4 to 4 + 5.201 = 9.201 ms) is delivered 9.201-12.201; B's prefill runs after it,
    9.201-12.201, its token delivered 12.201-15.201 and its decode (12.201-17.402) at 20.402."""
    s = sim(api(1.0, 0.0, 3.0))
    seen = watch_router(s)
    a, b = s.run([SimRequest(p, 2, t) for p, t in zip(prompts(2, 100, seed=2),
                                                       (0.0, 0.005))]).results
    assert [t * 1e3 for t, _ in seen] == pytest.approx([1.0, 8.0], abs=1e-9)
    assert (a.ttft * 1e3, a.latency * 1e3) == pytest.approx((7.0, 12.201), abs=1e-9)
    assert (b.ttft * 1e3, b.latency * 1e3) == pytest.approx((15.201 - 5, 20.402 - 5), abs=1e-9)


@pytest.mark.parametrize("o,w,st,ttft", [(7.5, 0.0, 0.0, 7.5 + 3.0),
                                         (1.0, 0.0, 0.0, 2.0 + 0.5 + 3.0),
                                         (7.5, 1.0, 0.0, 7.5 + 3.0),
                                         (3.0, 1.0, 0.0, 2.0 + 1.5 + 3.0),
                                         (7.5, 1.0, 2.0, 7.5 + 3.0),
                                         (3.0, 1.0, 2.0, 2.0 + 2.0 + 1.5 + 3.0)])
def test_a_lone_request_keeps_the_measured_ttft(o, w, st, ttft):
    """The overhead o was measured on a lone request and holds its admission (a = 1 + 0.01 *
    100 = 2 ms), its prefill step's charge (s) and its first token's write (one token: w + c,
    c = 0.5 ms): TTFT = max(o, a + s + w + c) + the 3 ms prefill (o = 3, s = 2, w = 1: the
    overhead is short of 2 + 2 + 1.5, so 5.5 + 3). ITLs are the decode steps (the API keeps
    up: a charge and a write of one token each, 3.5 ms at most, after each 5.2 ms step). A
    conversation's next turn leaves when its answer's last token is delivered."""
    cost = api(1.0, 0.01, 0.5, per_write=w, per_step=st)
    r = sim(cost, overhead_ms=o).run([SimRequest(prompts(1, 100)[0], 4, 0.3)]).results[0]
    assert r.ttft * 1e3 == pytest.approx(ttft, abs=1e-9)
    assert ms(r.itl) == pytest.approx([profile().decode_ms(1, 100 + k) for k in (1, 2, 3)],
                                      abs=1e-9)
    p = prompts(2, 50)
    r1, r2 = sim(cost, overhead_ms=o).run_conversations(
        [SimConversation(0.0, [], [p[0], p[1]], [3, 3])]).results
    assert r2.start == pytest.approx(r1.start + r1.latency, abs=1e-12)


@pytest.mark.parametrize("dep,policy", [("2C", "round-robin"), ("1P1D", "disagg")])
def test_several_workers_share_one_api(dep, policy):
    """2C: two 100-token requests at 0 go to the two workers, whose prefills (3 ms) end
    together; one API delivers their first tokens c = 0.5 and 1.0 ms after. 1P1D: one request,
    its first token from the prefill worker and the rest from the decode worker all through
    the same API (3 tokens delivered, each 0.5 ms after its step: the API keeps up)."""
    s = sim(api(per_output_token=0.5), dep, policy=policy)
    if dep == "2C":
        res = s.run([SimRequest(p, 2, 0.0) for p in prompts(2, 100, seed=3)])
        assert {w["steps"] for w in res.facts["workers"].values()} == {2}
        assert sorted(ms(r.ttft for r in res.results)) == pytest.approx([3.5, 4.0], abs=1e-9)
        assert res.facts["api"]["tokens"] == 4
    else:
        res = s.run([SimRequest(prompts(1, 100)[0], 3, 0.0)])
        (r,) = res.results
        assert r.success and res.facts["api"]["tokens"] == 3
        assert res.facts["api"]["delivery_lag_ms_max"] == pytest.approx(0.5)
        plain = sim(None, dep, policy=policy).run([SimRequest(prompts(1, 100)[0], 3, 0.0)])
        assert r.ttft == pytest.approx(plain.results[0].ttft + 0.5e-3, abs=1e-12)
        assert r.itl == pytest.approx(plain.results[0].itl, abs=1e-12)


def test_the_api_queue_refuses_work_out_of_time_order_and_bad_costs():
    q = ApiProcess(api(1.0, 0.0, 0.5))
    assert q.admit(1.0, 10, 0.0) == pytest.approx(1.001)
    with pytest.raises(RuntimeError, match="time order"):
        q.deliver(0.5, "s")
    assert q.deliver(1.0, "s") == pytest.approx(1.0015)
    with pytest.raises(RuntimeError, match="time order"):   # (joining a write, too)
        q.deliver(0.9, "s")
    with pytest.raises(ValueError, match="needs exactly"):
        ApiProcess({"per_request_ms": 1.0})
    with pytest.raises(ValueError, match="needs exactly"):   # (the file's loader adds it)
        ApiProcess({k: v for k, v in api().items() if k != "per_write_ms"})
    with pytest.raises(ValueError, match="needs exactly"):   # (so does this one)
        ApiProcess({k: v for k, v in api().items() if k != "per_step_ms"})
    with pytest.raises(ValueError, match="per_step_ms must be a finite number >= 0"):
        ApiProcess(api(per_step=-1.0))
    with pytest.raises(ValueError, match="per_write_ms must be a finite number >= 0"):
        ApiProcess(api(per_write=float("nan")))
    with pytest.raises(ValueError, match="per_output_token_ms must be a finite number >= 0"):
        ApiProcess(api(1.0, 0.0, -0.5))


def test_no_serving_overhead_turns_the_api_off_too(tmp_path, capsys):
    """A profile with an overhead (7.5 ms), a floor and API costs (a = 2 ms for 100 tokens, c
    = 0.5 ms): 5 requests of 100 prompt and 4 output tokens at once. Without the serving path
    they run as the bare steps: TTFT 2 + 0.01 * 500 = 7 ms (one prefill step of 500 tokens);
    with it, the first admissions queue (2 ms each: the k-th reaches the router at 2k + 5 ms)
    and the file says which API model ran and what it did; off, none ("api": null)."""
    prof = profile(serving_overhead_ms=7.5, serving_host_ms={"fixed_ms": 0.0, "per_seq_ms": 0.0},
                   api_cost_ms=api(1.0, 0.01, 0.5))
    path = str(prof.save(tmp_path / "p.json"))
    on, off = with_and_without_serving_path(tmp_path, path, "--num-prompts", "5",
                                            "--request-rate", "inf", "--random-input-len", "100",
                                            "--random-output-len", "4",
                                            "--no-enable-prefix-caching")
    assert on["profile"]["api_cost_ms"] == api(1.0, 0.01, 0.5)
    assert off["profile"]["api_cost_ms"] == {} and off["simulation"]["api"] is None
    assert off["ttfts"] == pytest.approx([7e-3] * 5, abs=1e-12)
    a = on["simulation"]["api"]
    assert a["admissions"] == 5 and a["tokens"] == 20 and a["busy_s"] == pytest.approx(0.02)
    assert a["admission_wait_ms_max"] == pytest.approx(8.0)
    assert min(on["ttfts"]) > 7.5e-3 + 3e-3
    out = capsys.readouterr().out
    assert "one API process: 1.000 ms + 0.01000 ms per prompt token" in out
    assert "API process: busy 0.020 s" in out
    assert "no API process model" in out
