"""P/D disaggregation on CPU: KV moved between engines (in-process and as worker processes) must
give exactly what one engine gives; heterogeneous TP re-shards KV heads; failed, hung and aborted
transfers leave no block behind; a dead worker leaves routing."""
import collections
import dataclasses
import os
import signal
import time

import msgspec
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.disagg.connectors.head_plan import HeadCopy, plan_head_copies
from pdserve.routing import DisaggPolicy, RoundRobinPolicy, Router, Unavailable
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_coordinator import KVCoordinator
from pdserve.layers.linear import kv_head_range
from pdserve.worker.llm_engine import LLMEngine
from pdserve.protocol import AddRequest

from .kv_faults import faulty
from .test_tp import LLAMA_8Q_2KV, QWEN2_1KV, _assert_same_model, _folder
from .utils import assert_processes_gone

PROMPTS = [[5, 17, 99, 3], list(range(200, 214)), [42] * 9, list(range(30, 70)), [7]]
ENGINE = dict(skip_tokenizer_init=True, num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=16, load_format="dummy")  # chunked prefill too
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


# ---- head re-sharding plan (pure) ----------------------------------------------------------
HEAD_DIM, HIDDEN = 2, 3


def _kv_shard(monkeypatch, num_kv_heads: int, tp: int, rank: int):
    """The k and v rows TP rank `rank` of `tp` holds, as QKVParallelLinear itself shards them,
    [2 (k, v), local KV heads, head_dim, hidden]. Every value of the full projections is
    distinct, so a shard says exactly which heads (and which of k, v) it holds."""
    from pdserve.layers import parallel_state
    from pdserve.layers.linear import QKVParallelLinear
    monkeypatch.setattr(parallel_state, "_TP", parallel_state.TPGroup(rank, tp))
    layer = QKVParallelLinear(HIDDEN, HEAD_DIM, 4 * num_kv_heads, num_kv_heads)
    rows = num_kv_heads * HEAD_DIM
    full = torch.arange(2 * rows * HIDDEN, dtype=torch.float32).view(2, rows, HIDDEN)
    layer.weight.weight_loader(layer.weight, full[0], "k")
    layer.weight.weight_loader(layer.weight, full[1], "v")
    parts = [layer.weight.data.narrow(0, layer.offsets[s], layer.sizes[s]) for s in ("k", "v")]
    return torch.stack(parts).view(2, -1, HEAD_DIM, HIDDEN)


def _heads_in(shard) -> list[int]:
    """The model KV heads a shard from _kv_shard holds (decoded from its k values)."""
    return [int(shard[0, j, 0, 0]) // (HEAD_DIM * HIDDEN) for j in range(shard.shape[1])]


def test_kv_head_ranges_match_the_qkv_split(monkeypatch):
    for heads, tp, want in [(4, 2, [[0, 1], [2, 3]]), (2, 4, [[0], [0], [1], [1]]),
                            (1, 2, [[0], [0]]), (8, 4, [[0, 1], [2, 3], [4, 5], [6, 7]])]:
        assert [_heads_in(_kv_shard(monkeypatch, heads, tp, r)) for r in range(tp)] == want
        assert [list(kv_head_range(r, tp, heads)) for r in range(tp)] == want


HEAD_GRID = [(h, s, d) for h in (1, 2, 4, 8) for s in (1, 2, 4) for d in (1, 2, 4)]
assert {(2, 4, 4), (2, 4, 1), (2, 1, 4), (2, 4, 2), (2, 2, 4)} <= set(HEAD_GRID)


@pytest.mark.parametrize("heads,src_tp,dst_tp", HEAD_GRID)
def test_head_plan_reassembles_each_consumer_ranks_shard(monkeypatch, heads, src_tp, dst_tp):
    """Copying per plan_head_copies from the producer ranks' shards (as the sharding layer
    builds them) gives exactly the shard the layer builds for each consumer rank, every local
    head written once."""
    producers = [_kv_shard(monkeypatch, heads, src_tp, r) for r in range(src_tp)]
    for dst in range(dst_tp):
        want = _kv_shard(monkeypatch, heads, dst_tp, dst)
        got = torch.full_like(want, float("nan"))
        writes = [0] * want.shape[1]
        for hc in plan_head_copies(heads, src_tp, dst_tp, dst):
            got[:, hc.dst_heads] = producers[hc.src_rank][:, hc.src_heads]
            for j in range(*hc.dst_heads.indices(want.shape[1])):
                writes[j] += 1
        assert torch.equal(got, want), (dst, _heads_in(got), _heads_in(want))
        assert writes == [1] * want.shape[1]


def test_head_plan_takes_runs_from_the_first_holder():
    # 4 heads, producer tp 2 -> consumer tp 1: [h0 h1] from rank 0, [h2 h3] from rank 1
    assert plan_head_copies(4, 2, 1, 0) == [HeadCopy(0, slice(0, 2), slice(0, 2)),
                                             HeadCopy(1, slice(0, 2), slice(2, 4))]
    # 2 heads replicated over producer tp 4 (h0 h0 h1 h1) -> tp 1: h0 from rank 0, h1 from 2
    assert plan_head_copies(2, 4, 1, 0) == [HeadCopy(0, slice(0, 1), slice(0, 1)),
                                             HeadCopy(2, slice(0, 1), slice(1, 2))]


# ---- block holding (pure) ------------------------------------------------------------------
def test_held_blocks_count_until_released():
    kv = KVCacheManager(8, 4)
    coord = KVCoordinator(kv)
    kv.allocate_slots("a", 0, 9)
    table = coord.hold("a", kv.detach("a"), now=1.0)
    assert len(table) == 3 and kv.num_free_blocks() == 5
    kv.check_integrity(coord.held_tables())
    assert coord.release_held("a") and not coord.release_held("a")
    assert kv.num_free_blocks() == 8
    kv.check_integrity(coord.held_tables())


# ---- two engines in one process ------------------------------------------------------------
def _run(engine, reqs):
    engine.add_requests(reqs)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return done


def _handoff(P, D, prompt, params, rid="x"):
    """Prefill on P (one token, KV held), pull into D, decode there. Returns D's output and the
    number of tokens D computed."""
    first = _run(P, [AddRequest(rid, {"prompt_token_ids": prompt}, _one(params),
                                kv_hold=True)])[rid]
    src = msgspec.structs.replace(first.kv_transfer, worker="p")
    computed = []
    real = D.runner.execute_async   # (every step passes here: execute calls it)
    D.runner.execute_async = lambda s: (computed.append(s.num_tokens), real(s))[1]
    try:
        out = _run(D, [AddRequest(rid, {"prompt_token_ids": prompt}, params, kv_source=src)])[rid]
    finally:
        del D.runner.execute_async
    P.release_kv([rid])
    return first, out, sum(computed)


def _one(params):
    return dataclasses.replace(params, max_tokens=1)


@pytest.mark.parametrize("mode,connector", [("sync", "shared"), ("async", "shared"),
                                            ("async", "relay")])  # (on CPU: the shared file)
def test_handoff_between_engines_equals_one_engine(tmp_path, mode, connector):
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    cfg = EngineConfig(model=path, kv_connector=connector, kv_transfer_mode=mode, **ENGINE)
    P, D = LLMEngine(cfg), LLMEngine(cfg)
    D.connect_kv([P.kv_export("p")])
    for i, prompt in enumerate(PROMPTS):
        ref = _run(P, [AddRequest(f"ref{i}", {"prompt_token_ids": prompt}, GREEDY)])[f"ref{i}"]
        first, out, computed = _handoff(P, D, prompt, GREEDY, f"r{i}")
        assert first.outputs[0].token_ids == ref.outputs[0].token_ids[:1]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        # D ran only the decode tokens: the prompt's KV came over, not recomputed
        assert computed == len(ref.outputs[0].token_ids) - 1
        for a, b in zip(ref.outputs[0].logprobs[1:], out.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
    assert [e.ok for e in D.take_kv_events()] == [True] * len(PROMPTS)
    for e in (P, D):
        e.check_integrity()
        assert e.kv.num_free_blocks() == e.kv.pool.num_blocks


def test_seeded_sampling_continues_across_the_handoff(tmp_path):
    """A seeded random request gives the same tokens through P -> D as on one engine: the decode
    side's generator resumes where the producer's stopped."""
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    cfg = EngineConfig(model=path, kv_connector="shared", **ENGINE)
    P, D = LLMEngine(cfg), LLMEngine(cfg)
    D.connect_kv([P.kv_export("p")])
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    ref = _run(P, [AddRequest("ref", PROMPTS[3], sp)])["ref"].outputs[0].token_ids
    _, out, _ = _handoff(P, D, PROMPTS[3], sp)
    assert out.outputs[0].token_ids == ref
    other = dataclasses.replace(sp, seed=8)  # and the seed matters (the test can fail)
    assert _run(P, [AddRequest("o", PROMPTS[3], other)])["o"].outputs[0].token_ids != ref


def test_lost_kv_is_recomputed_after_the_producers_tokens(tmp_path):
    """A kv_source without worker and blocks (its producer died): the consumer recomputes the
    prompt and the producer's token, then continues exactly as one engine would."""
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    cfg = EngineConfig(model=path, kv_connector="shared", **ENGINE)
    P, D = LLMEngine(cfg), LLMEngine(cfg)
    for i, prompt in enumerate(PROMPTS[:3]):
        ref = _run(P, [AddRequest(f"ref{i}", {"prompt_token_ids": prompt}, GREEDY)])[f"ref{i}"]
        first = _run(P, [AddRequest(f"r{i}", {"prompt_token_ids": prompt}, _one(GREEDY),
                                    kv_hold=True)])[f"r{i}"]
        P.release_kv([f"r{i}"])
        lost = msgspec.structs.replace(first.kv_transfer, worker="", block_ids=[])
        out = _run(D, [AddRequest(f"r{i}", {"prompt_token_ids": prompt}, GREEDY,
                                  kv_source=lost)])[f"r{i}"]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert D.take_kv_events() == []  # nothing was pulled
    for e in (P, D):
        e.check_integrity()
        assert e.kv.num_free_blocks() == e.kv.pool.num_blocks


def test_bad_kv_source_is_a_clear_error(tmp_path):
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    cfg = EngineConfig(model=path, kv_connector="shared", **ENGINE)
    P, D = LLMEngine(cfg), LLMEngine(cfg)
    D.connect_kv([P.kv_export("p")])
    first = _run(P, [AddRequest("a", [1, 2, 3, 4, 5], _one(GREEDY), kv_hold=True)])["a"]
    src = msgspec.structs.replace(first.kv_transfer, worker="p")
    with pytest.raises(ValueError, match="covers 5 tokens"):
        D.add_request("b", [1, 2, 3], GREEDY, kv_source=src)
    with pytest.raises(ValueError, match="blocks for"):
        D.add_request("b", [1, 2, 3, 4, 5], GREEDY,
                      kv_source=msgspec.structs.replace(src, block_ids=src.block_ids[:1]))
    for skip in (2, -1):   # (2 blocks: at most 1 skipped, the last one is always sent)
        with pytest.raises(ValueError, match=f"skip_blocks is {skip}"):
            D.add_request("b", [1, 2, 3, 4, 5], GREEDY,
                          kv_source=msgspec.structs.replace(src, skip_blocks=skip))
    with pytest.raises(ValueError, match="n=1"):
        D.add_request("b", [1, 2, 3, 4, 5], SamplingParams(n=2), kv_source=src)
    plain = LLMEngine(EngineConfig(model=path, **ENGINE))
    with pytest.raises(ValueError, match="no kv_connector"):
        plain.add_request("b", [1, 2, 3, 4, 5], GREEDY, kv_source=src)
    with pytest.raises(ValueError, match="unknown kv_connector"):
        EngineConfig(model=path, kv_connector="carrier-pigeon", **ENGINE)
    assert not D.has_unfinished_requests()
    P.release_kv(["a"])
    P.check_integrity()
    assert P.kv.num_free_blocks() == P.kv.pool.num_blocks


@pytest.mark.parametrize("fault,mode", [("fail", "sync"), ("fail", "async"), ("hang", "async")])
def test_failed_or_hung_pull_is_recomputed_on_the_decode_engine(tmp_path, fault, mode):
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    cfg = EngineConfig(model=path, kv_connector="shared", kv_transfer_mode=mode,
                       kv_transfer_timeout_s=0.5, **ENGINE)
    P = LLMEngine(cfg)
    D = LLMEngine(dataclasses.replace(cfg, kv_connector=faulty("shared", fault)))
    D.connect_kv([P.kv_export("p")])
    prompt = PROMPTS[3]
    ref = _run(P, [AddRequest("ref", prompt, GREEDY)])["ref"]
    _, out, computed = _handoff(P, D, prompt, GREEDY)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert computed == len(prompt) + len(ref.outputs[0].token_ids) - 1  # recomputed here
    (ev,) = D.take_kv_events()
    assert not ev.ok and ("injected" in ev.error or "timed out" in ev.error)
    for e in (P, D):
        e.check_integrity()
        assert e.kv.num_free_blocks() == e.kv.pool.num_blocks


def test_abort_while_waiting_for_or_loading_kv_frees_blocks(tmp_path):
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    cfg = EngineConfig(model=path, kv_connector="shared", kv_transfer_mode="async",
                       kv_transfer_timeout_s=60, **ENGINE)
    P = LLMEngine(cfg)
    # the pull stays in flight
    D = LLMEngine(dataclasses.replace(cfg, kv_connector=faulty("shared", "hang")))
    D.connect_kv([P.kv_export("p")])
    first = _run(P, [AddRequest("a", PROMPTS[3], _one(GREEDY), kv_hold=True)])["a"]
    src = msgspec.structs.replace(first.kv_transfer, worker="p")
    D.add_request("a", PROMPTS[3], GREEDY, kv_source=src)
    D.step()
    assert "a#0" in D.kv_coordinator.loading and D.kv.pool.num_used_blocks > 0
    D.abort_request("a")
    D.step()                                   # the cancel verdict reaches the runner
    assert not D.runner.connector.loads
    D.check_integrity()
    assert D.kv.num_free_blocks() == D.kv.pool.num_blocks
    P.release_kv(["a"])
    assert P.kv.num_free_blocks() == P.kv.pool.num_blocks


def test_unclaimed_kv_expires_on_the_producer(tmp_path):
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    P = LLMEngine(EngineConfig(model=path, kv_connector="shared", kv_hold_timeout_s=5, **ENGINE))
    _run(P, [AddRequest("a", PROMPTS[3], _one(GREEDY), kv_hold=True)])
    assert P.kv.pool.num_used_blocks > 0
    assert P.expire_held_kv(time.monotonic() + 1) == 0
    assert P.expire_held_kv(time.monotonic() + 10) == 1
    P.check_integrity()
    assert P.kv.num_free_blocks() == P.kv.pool.num_blocks


# ---- worker processes behind the router ------------------------------------------------------
def _outputs(llm, params=GREEDY, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _assert_clean(router):
    for name, stats in router.check_workers().items():
        assert stats.num_kv_blocks_used == 0, name
        assert stats.num_running == stats.num_waiting == 0, name


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One engine's greedy outputs for each model config (in-process, TP=1)."""
    tmp = tmp_path_factory.mktemp("ref")
    refs = {}
    for cfg in (LLAMA_8Q_2KV, QWEN2_1KV):
        path = _folder(tmp, cfg)
        refs[cfg["architectures"][0]] = _outputs(LLM(path, **ENGINE))
    return refs


# one-sided pull (a shared file here) / gloo send-receive on threads / the NCCL connector's
# own code, over gloo on CPU
CONNECTORS = ["shared", "torch-dist", "nccl"]


@pytest.mark.parametrize("connector", CONNECTORS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_1p1d_equals_collocated(tmp_path, reference, mode, connector):
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    with LLM(path, prefill=1, decode=1, kv_transfer_mode=mode, kv_connector=connector,
             **ENGINE) as llm:
        router = llm.llm_engine
        _assert_same_model(reference["LlamaForCausalLM"], _outputs(llm))
        assert router.route_stats.requests == {"collocated": 0, "disagg": len(PROMPTS)}
        assert router.route_stats.transfers == len(PROMPTS) and router.route_stats.transfer_failures == 0
        assert router.route_stats.transfer_bytes > 0
        _assert_clean(router)
        pids = router.pids
    assert all(p.exitcode == 0 for w in router.workers.values() for p in w.client._procs)
    assert_processes_gone(pids)


def test_submitted_requests_are_answered_with_later_steps(tmp_path, reference):
    """Router.submit, the server's way of adding: it sends without waiting for the workers'
    answers (a worker gives them between two of its steps). Right after it no answer is known;
    they come with later steps: None for each request a worker queued, the worker's own error
    for one it rejected (n above max_num_seqs: the engine checks that, not the router). A
    request aborted before its answer never streams and is aborted once admitted. Hand-offs to
    the decode worker do not wait either (1P1D). Outputs equal one engine's; nothing is left."""
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    with LLM(path, prefill=1, decode=1, max_num_seqs=8, **ENGINE) as llm:
        router = llm.llm_engine
        reqs = [AddRequest(f"r{i}", {"prompt_token_ids": p}, GREEDY) for i, p in enumerate(PROMPTS)]
        bad = AddRequest("bad", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(n=9, max_tokens=2))
        gone = AddRequest("gone", {"prompt_token_ids": PROMPTS[3]},
                          SamplingParams(max_tokens=200, ignore_eos=True))
        assert router.submit(reqs + [bad, gone]) == [None] * (len(reqs) + 2)
        assert router.take_answers() == {}
        router.abort_request("gone")
        answers, finals = {}, {}
        while router.has_unfinished_requests():
            # (a call that waits for a reply keeps what comes meanwhile, answers and outputs,
            # for step() to hand on in the order they came: an output before its request's
            # answer would find no route and be dropped)
            router.check_workers()
            outs = router.step(timeout_s=5)
            answers.update(router.take_answers())
            for o in outs:
                assert o.request_id != "gone"
                if o.finished:
                    finals[o.request_id] = o.outputs[0]
        assert set(answers) == {r.request_id for r in reqs} | {"bad", "gone"}
        assert all(answers[r.request_id] is None for r in reqs) and answers["gone"] is None
        assert "n=9" in answers["bad"] and "max_num_seqs=8" in answers["bad"]
        assert sorted(finals) == sorted(r.request_id for r in reqs)
        _assert_same_model(reference["LlamaForCausalLM"], [finals[r.request_id] for r in reqs])
        assert router.route_stats.transfers in (len(reqs), len(reqs) + 1)  # (+ gone's, if it was
        _assert_clean(router)                                  # prefilled before the abort)


def _kill_unnoticed(router, name):
    """Kills worker `name`'s process and waits until it is gone; the router is not told."""
    client = router.workers[name].client
    os.kill(client.pids[0], signal.SIGKILL)
    client._procs[0].join(10)


def test_submitted_requests_to_a_worker_that_died_unanswered_go_to_another(tmp_path, reference):
    """The prefill worker is killed before the router knows; requests submitted then go to it
    and are never answered. Its death is found by a later step: they are placed again (on the
    decode worker, whole), admitted there, and give one engine's outputs."""
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    with LLM(path, prefill=1, decode=1, worker_restarts=0, **ENGINE) as llm:
        router = llm.llm_engine
        _kill_unnoticed(router, "prefill-0")
        reqs = [AddRequest(f"r{i}", {"prompt_token_ids": q}, GREEDY) for i, q in enumerate(PROMPTS)]
        assert router.submit(reqs) == [None] * len(reqs)
        answers, finals = {}, {}
        while router.has_unfinished_requests():
            outs = router.step(timeout_s=5)
            answers.update(router.take_answers())
            finals.update({o.request_id: o.outputs[0] for o in outs if o.finished})
        assert not router.workers["prefill-0"].alive
        assert answers == {r.request_id: None for r in reqs}
        _assert_same_model(reference["LlamaForCausalLM"], [finals[r.request_id] for r in reqs])
        assert router.route_stats.requests["collocated"] == len(reqs)
        _assert_clean(router)


def test_a_submitted_request_is_answered_unavailable_when_no_worker_is_left(tmp_path):
    """One worker, killed before the router knows, with a restart to come: a request
    submitted then is placed again when a step finds the death, finds no live worker and is
    answered Unavailable at once (not left waiting for the restart, nor forever)."""
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    with LLM(path, collocated=1, worker_restarts=1, restart_backoff_s=30.0, **ENGINE) as llm:
        router = llm.llm_engine
        _kill_unnoticed(router, "collocated-0")
        assert router.submit([AddRequest("r", {"prompt_token_ids": PROMPTS[0]}, GREEDY)]) == [None]
        router.step(timeout_s=10)
        answers = router.take_answers()
        assert list(answers) == ["r"] and isinstance(answers["r"], Unavailable)
        assert not router.has_unfinished_requests()


class _Recording(DisaggPolicy):
    def __init__(self):
        self.paths = []

    def choose(self, req, workers):
        self.paths.append(super().choose(req, workers))
        return self.paths[-1]


@pytest.mark.parametrize("connector", CONNECTORS)
def test_two_prefill_two_decode_workers_share_the_load(tmp_path, reference, connector):
    """2P2D: every (prefill, decode) pair exchanges KV (two-sided: four pair groups); a batch
    added at once is spread over both workers of each role (least-loaded counts the requests
    already placed, including those still prefilling for a decode worker); outputs as one
    engine's."""
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    policy = _Recording()
    with LLM(path, prefill=2, decode=2, kv_connector=connector, routing_policy=policy,
             **ENGINE) as llm:
        router = llm.llm_engine
        _assert_same_model(reference["LlamaForCausalLM"], _outputs(llm))
        for role in ("prefill", "worker"):
            counts = collections.Counter(getattr(p, role) for p in policy.paths)
            assert len(counts) == 2 and max(counts.values()) - min(counts.values()) <= 1, counts
        assert router.route_stats.transfers == len(PROMPTS)
        _assert_clean(router)
        assert all(w.outstanding == 0 for w in router.workers.values())
        assert not any(router.core.bound.values())


@pytest.mark.parametrize("cfg,ptp,dtp", [(LLAMA_8Q_2KV, 2, 1), (LLAMA_8Q_2KV, 1, 2),
                                         (QWEN2_1KV, 2, 1)],
                         ids=["llama-p2d1", "llama-p1d2", "qwen2-1kv-p2d1"])
@pytest.mark.parametrize("connector", CONNECTORS)
def test_heterogeneous_tp_equals_collocated(tmp_path, reference, cfg, ptp, dtp, connector):
    path = _folder(tmp_path, cfg)
    with LLM(path, prefill=1, decode=1, prefill_tp=ptp, decode_tp=dtp, kv_connector=connector,
             **ENGINE) as llm:
        _assert_same_model(reference[cfg["architectures"][0]], _outputs(llm))
        assert llm.llm_engine.route_stats.transfers == len(PROMPTS)
        _assert_clean(llm.llm_engine)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_router_round_robin_streaming_abort(tmp_path, reference, connector):
    """One deployment (1 prefill, 1 decode, 1 collocated) through several situations."""
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    with LLM(path, prefill=1, decode=1, collocated=1, routing_policy="round-robin",
             kv_connector=connector, **ENGINE) as llm:
        router = llm.llm_engine
        _assert_same_model(reference["LlamaForCausalLM"], _outputs(llm))
        assert router.route_stats.requests["disagg"] == 3 and router.route_stats.requests["collocated"] == 2

        # streaming through P then D: the first token comes from P, the rest from D, in order
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        router.policy = RoundRobinPolicy()  # a fresh turn: disagg first
        router.add_requests([AddRequest("s", {"prompt_token_ids": PROMPTS[1]}, sp)])
        streamed, final = [], None
        while router.has_unfinished_requests():
            for o in router.step():
                streamed += o.outputs[0].new_token_ids
                final = o
        assert streamed == final.outputs[0].token_ids == reference["LlamaForCausalLM"][1].token_ids

        # aborts at every stage leave nothing behind
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        for n_steps in (0, 1, 3, 6):
            router.policy = RoundRobinPolicy()
            router.add_requests([AddRequest(f"a{n_steps}", {"prompt_token_ids": PROMPTS[3]},
                                            long)])
            for _ in range(n_steps):
                router.step(timeout_s=2)
            router.abort_request(f"a{n_steps}")
            assert not router.has_unfinished_requests()
        _assert_clean(router)
        if connector == CONNECTORS[0]:   # (one deployment start for both policies)
            _adaptive_takes_both_paths(llm, reference["LlamaForCausalLM"])


def _adaptive_takes_both_paths(llm, ref):
    """The adaptive policy on the same 1P1D1C deployment: PROMPTS at once, with a profile of
    10 ms per prompt token and a 450 ms TTFT SLO, are placed (by the cost model's arithmetic,
    test_adaptive_routing.py) whole on c0, whole on d0, split, whole on c0, split; outputs as
    one engine's, and the policy then learns from what ran."""
    from pdserve.routing.adaptive import AdaptivePolicy
    from pdserve.routing.cost_model import CostModel
    from .test_adaptive_routing import profile
    router = llm.llm_engine
    llm.reset_prefix_cache()     # (placement reads the prefix index: start both from empty)
    before = dict(router.route_stats.requests)
    prof = profile(alpha_ms_per_token=10.0, prefill_fixed_ms=0.0)
    # (uncorrected: the earlier steps' records, observed when these are added, would otherwise
    # scale the estimates by how fast this machine ran them)
    cost = CostModel(prof, ENGINE["max_num_batched_tokens"], correction_weight=0.0)
    router.policy = policy = AdaptivePolicy(cost, slo_ttft_ms=450, slo_tpot_ms=1e6)
    _assert_same_model(ref, _outputs(llm))
    assert policy.decisions == {"collocated": 3, "disagg": 2}
    after = router.route_stats.requests
    assert after["collocated"] - before["collocated"] == 3 and after["disagg"] - before["disagg"] == 2
    ms = router.model_stats
    assert ms["predictor"]["observations"] >= len(PROMPTS)
    assert ms["cost_errors"]["ttft"]["n"] == len(PROMPTS)           # every request scored
    assert any(e["n"] for k, e in ms["cost_errors"].items() if k in ("prefill", "decode", "mixed"))
    _assert_clean(router)


def test_dead_workers_leave_routing(tmp_path, reference):
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    with LLM(path, prefill=1, decode=1, worker_restarts=0, **ENGINE) as llm:
        router = llm.llm_engine
        # the prefill worker dies: requests go to the decode worker as collocated ones
        os.kill(router.workers["prefill-0"].client.pids[0], signal.SIGKILL)
        got = _outputs(llm)
        _assert_same_model(reference["LlamaForCausalLM"], got)
        assert not router.workers["prefill-0"].alive
        # the decode worker dies mid-generation: its requests fail fast, nothing hangs
        sp = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        router.add_requests([AddRequest("d", {"prompt_token_ids": PROMPTS[0]}, sp)])
        router.step(timeout_s=5)
        os.kill(router.workers["decode-0"].client.pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(Exception, match="every worker is gone"):
            while router.has_unfinished_requests():
                router.step(timeout_s=10)
        assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("connector", CONNECTORS)
def test_hand_off_to_a_dead_decode_worker_goes_to_another(tmp_path, reference, connector):
    """1P2D, one decode worker killed before the router knows: the requests placed on it are
    handed (with the KV the prefill worker still holds) to the other, none is lost."""
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    with LLM(path, prefill=1, decode=2, kv_connector=connector, worker_restarts=0,
             **ENGINE) as llm:
        router = llm.llm_engine
        victim = router.workers["decode-1"].client
        os.kill(victim.pids[0], signal.SIGKILL)
        victim._procs[0].join(10)
        _assert_same_model(reference["LlamaForCausalLM"], _outputs(llm))
        assert not router.workers["decode-1"].alive
        stats = router.route_stats
        assert (stats.transfers, stats.failed, stats.rerouted) == (len(PROMPTS), 0, 0)
        _assert_clean(router)


def test_prefill_worker_dead_at_the_hand_off_is_recomputed(tmp_path, reference, monkeypatch):
    """The prefill worker dies with requests prefilled and not yet handed off: their KV died
    with it, so the decode worker recomputes them (never pulls from a dead worker's memory);
    those still prefilling are routed again; none is lost."""
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    real = Router._flush_handoffs

    def kill_at_first_hand_off(self, results):
        victim = self.workers["prefill-0"].client
        if self.core.handoffs and not victim.exited():
            os.kill(victim.pids[0], signal.SIGKILL)
            victim._procs[0].join(10)
        return real(self, results)

    monkeypatch.setattr(Router, "_flush_handoffs", kill_at_first_hand_off)
    with LLM(path, prefill=1, decode=1, worker_restarts=0, **ENGINE) as llm:
        router = llm.llm_engine
        _assert_same_model(reference["LlamaForCausalLM"], _outputs(llm))
        s = router.route_stats
        assert s.recomputed >= 1 and (s.transfers, s.failed) == (0, 0)
        assert s.recomputed + s.rerouted == len(PROMPTS)
        _assert_clean(router)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_failing_transfers_fall_back_through_the_router(tmp_path, reference, connector):
    """Every transfer fails (the worker processes build the faulty connector their config
    names): each request is recomputed on the decode worker, outputs are still exact, and no
    block is left on either side."""
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    with LLM(path, prefill=1, decode=1, kv_connector=faulty(connector, "fail"), **ENGINE) as llm:
        router = llm.llm_engine
        _assert_same_model(reference["LlamaForCausalLM"], _outputs(llm))
        assert router.route_stats.transfer_failures == len(PROMPTS)
        assert router.route_stats.transfers == 0
        _assert_clean(router)


def test_two_sided_abort_before_the_load_still_receives():
    """With a two-sided connector the producer sends regardless: a request dropped while it
    waits for blocks must still get a receive-and-discard load, or every later receive from that
    producer would take the wrong message."""
    from pdserve.protocol import KVSource
    from pdserve.engine.request import Request, RequestStatus
    from pdserve.engine.scheduler import Scheduler
    kv = KVCacheManager(4, 4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64,
                      kv_coordinator=KVCoordinator(kv, two_sided=True))
    kv.allocate_slots("hog", 0, 16)                 # the pool is full: loads must wait
    a, b = (Request(r, [1, 2, 3, 4, 5], GREEDY, output_token_ids=[9]) for r in ("a#0", "b#0"))
    sched.add_remote(a, KVSource("p", "a", [3, 4], 5, [9]))
    sched.add_remote(b, KVSource("p", "b", [5, 6], 5, [9]))
    assert sched.schedule().kv_work is None         # no room yet: no loads (no KV work at all)
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    kv.free("hog")
    loads = sched.schedule().kv_work.loads
    assert [(l.request_id, l.dst_block_ids == []) for l in loads] == [("a#0", True),
                                                                      ("b#0", False)]
    assert loads[1].src_block_ids == [5, 6]


@pytest.mark.parametrize("connector", ["torch-dist", "nccl"])
def test_a_pair_that_cannot_form_fails_its_loads_not_the_worker(monkeypatch, connector):
    """Two-sided: when the other worker never joins (it died first), the pair is marked broken
    after the join timeout; the worker goes on: loads from that producer fail (the scheduler
    recomputes them) and sends to that consumer are skipped."""
    from pdserve.disagg.connectors import get_connector_class
    from pdserve.protocol import KVLoad, KVPair, KVSend
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pair = dict(producer="p", consumer="d", producer_tp=1, consumer_tp=1, num_kv_heads=2,
                store=f"127.0.0.1:{store.port}")
    kv = torch.zeros(2, 2, 4, 4, 2, 8)
    cls = get_connector_class(connector)
    monkeypatch.setattr(cls, "join_timeout_s", 1.0)
    consumer = cls(kv, 0, 1, 2)
    producer = cls(kv.clone(), 0, 1, 2)
    try:
        consumer.add_peer(KVPair(**pair, side="consumer"))   # nobody else comes: 1 s, then
        assert "could not be formed" in consumer.broken["p"]  # broken, not raised
        assert consumer.num_peers() == 1
        consumer.start_load(KVLoad("r", "p", [0, 1], [2, 3]), sync=True)
        [done] = consumer.poll()
        assert (done.request_id, done.ok) == ("r", False) and "could not be formed" in done.error
        producer.add_peer(KVPair(**pair, side="producer"))
        producer.send_blocks(KVSend("r", "d", [0, 1], True))  # skipped: returns at once
        assert kv.abs().sum() == 0                            # nothing landed anywhere
    finally:
        consumer.close()
        producer.close()


def _wait_up(router, name, timeout_s=120):
    """Steps the idle router until `name` is back in routing (restarted)."""
    deadline = time.monotonic() + timeout_s
    while router.workers[name].state != "up":
        assert time.monotonic() < deadline, router.health()
        router.step(timeout_s=0.2)


# every connector loses its consumer; a lost producer (re-pairing from the other side) on the
# one-sided and on one two-sided connector (torch-dist and nccl share PairConnector's pairing)
@pytest.mark.parametrize("connector,victim", [(c, "decode-0") for c in CONNECTORS]
                         + [("shared", "prefill-0"), ("nccl", "prefill-0")])
def test_a_dead_worker_is_restarted_and_exchanges_kv_again(tmp_path, reference, connector,
                                                           victim):
    """kill -9 a prefill or a decode worker of a 1P1D deployment: while it is down requests
    run whole on the other (a role with no live worker), it is restarted under a new KV name
    and connected to its peers again (one-sided: mapped anew; two-sided: new pair groups), and
    then every request is handed off with its KV once more, outputs as one engine's."""
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    with LLM(path, prefill=1, decode=1, kv_connector=connector, restart_backoff_s=0.1,
             **ENGINE) as llm:
        router = llm.llm_engine
        dead = router.workers[victim].client
        os.kill(dead.pids[0], signal.SIGKILL)
        dead._procs[0].join(10)
        _assert_same_model(reference["LlamaForCausalLM"], _outputs(llm))
        assert router.route_stats.failed == 0
        _wait_up(router, victim)
        assert router.workers[victim].client.name == f"{victim}.1"
        assert [h.restarts for h in router.health() if h.name == victim] == [1]
        before = router.route_stats.transfers
        _assert_same_model(reference["LlamaForCausalLM"], _outputs(llm))
        assert router.route_stats.transfers == before + len(PROMPTS)
        assert router.route_stats.transfer_failures == 0
        _assert_clean(router)
        pids = router.pids
    assert_processes_gone(pids + dead.pids)


def test_restarts_stop_after_the_budget(tmp_path):
    """A worker that keeps dying is restarted max_restarts times in a row, then left out
    (state "failed"); meanwhile requests are refused as Unavailable (the server's 503), and the
    router raises only once no attempt is left."""
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    with LLM(path, collocated=1, worker_restarts=1, restart_backoff_s=0.5, **ENGINE) as llm:
        router = llm.llm_engine
        w = router.workers["collocated-0"]
        gone = list(w.client.pids)
        os.kill(w.client.pids[0], signal.SIGKILL)
        w.client._procs[0].join(10)
        while w.state == "up":   # noticed at the next step
            router.step(timeout_s=0.2)
        errors = router.add_requests([AddRequest("r", [1, 2, 3], SamplingParams(max_tokens=2))])
        assert isinstance(errors[0], Unavailable) and "collocated-0" in errors[0]
        _wait_up(router, "collocated-0")
        assert router.add_requests([AddRequest("s", [1, 2], SamplingParams(max_tokens=2))]) == [None]
        gone += w.client.pids
        os.kill(w.client.pids[0], signal.SIGKILL)
        with pytest.raises(Exception, match="every worker is gone"):
            for _ in range(100):
                router.step(timeout_s=0.2)
        assert [h.state for h in router.health()] == ["failed"]
    assert_processes_gone(gone)


# ---- deployment plan: CPU workers share the cores ---------------------------------------------
def test_cpu_workers_get_an_equal_share_of_the_cores():
    from pdserve.routing import plan_workers
    from pdserve.worker.worker import WorkerAddresses, WorkerConfig
    cores = len(os.sched_getaffinity(0))
    base = EngineConfig(**ENGINE)
    # one worker of one rank: torch's own default, as an LLM in this process would have
    assert [s.cpu_threads for s in plan_workers(base, collocated=1)] == [None]
    # 1P1D: two ranks on this host; a TP-2 prefill worker and a decode worker: three ranks
    assert [s.cpu_threads for s in plan_workers(base, 1, 1)] == [max(1, cores // 2)] * 2
    specs = plan_workers(base, 1, 1, prefill_tp=2)
    assert [s.config.tensor_parallel_size for s in specs] == [2, 1]
    assert [s.cpu_threads for s in specs] == [max(1, cores // 3)] * 2
    assert [s.cpu_threads for s in plan_workers(base, 2, 2)] == [max(1, cores // 4)] * 4
    addrs = WorkerAddresses("ipc://a", "ipc://b", (), "tcp://127.0.0.1:1")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="cpu_threads"):
            WorkerConfig(base, addrs, os.getpid(), cpu_threads=bad)


def test_workers_share_gpus_when_num_gpus_is_fewer_than_their_ranks(monkeypatch):
    """GPU placement (CPU machine: torch is told it sees 8 GPUs; no GPU is touched)."""
    from pdserve.routing import plan_workers
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    base = EngineConfig(device="cuda", load_format="dummy", model="qwen2.5-1.5b")
    assert [s.config.device for s in plan_workers(base, 1, 1)] == ["cuda:0", "cuda:1"]
    assert [s.config.device for s in plan_workers(base, 1, 1, num_gpus=1)] == ["cuda:0"] * 2
    specs = plan_workers(base, 2, 1, collocated=2, prefill_tp=2, num_gpus=4)
    # TP-2 prefill on 0-1 and 2-3, then wrap: decode on 0, collocated on 1 and 2
    assert [s.config.device for s in specs] == ["cuda:0", "cuda:2", "cuda:0", "cuda:1", "cuda:2"]
    with pytest.raises(ValueError, match="TP 2"):
        plan_workers(base, 1, 1, prefill_tp=2, num_gpus=1)
    with pytest.raises(ValueError, match="num_gpus"):
        plan_workers(base, 1, 1, num_gpus=0)
