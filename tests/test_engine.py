"""Engine-level behaviour on a tiny random Qwen2: seeds, n > 1, stops, logprobs, streaming,
abort, preemption; check_integrity after every scenario."""
import collections

import pytest
import torch

pytest.importorskip("transformers")

from pdserve import LLM, SamplingParams  # noqa: E402

from .utils import paged_logits, save_tiny_hf_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "qwen2"
    save_tiny_hf_model(d, "qwen2")
    return str(d)


def make_llm(model_dir, **kw):
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLM(model_dir, skip_tokenizer_init=True, **kw)


def ids(*prompts):
    return [{"prompt_token_ids": p} for p in prompts]


PROMPTS = [[7, 8, 9], [100, 101, 102, 103, 104, 105], [5] * 13, [250, 3], [11, 12, 13, 14, 15],
           [300, 299, 298, 297], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [77]]


def test_seeded_sampling_same_alone_and_in_any_batch(model_dir):
    llm = make_llm(model_dir)
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12,
                        ignore_eos=True)
    alone = llm.generate(ids(PROMPTS[1]), sp, use_tqdm=False)[0].outputs[0].token_ids
    mixed = [SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
             sp, SamplingParams(temperature=0.7, seed=9, max_tokens=5, ignore_eos=True,
                                presence_penalty=0.5)] * 2
    outs = llm.generate(ids(*[PROMPTS[1]] * 8), mixed, use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone
    assert outs[6].outputs[0].token_ids == alone
    unseeded = llm.generate(ids(PROMPTS[1]), SamplingParams(temperature=1.0, max_tokens=12,
                                                            ignore_eos=True), use_tqdm=False)
    assert len(unseeded[0].outputs[0].token_ids) == 12
    llm.llm_engine.check_integrity()


def test_greedy_batch_invariance_with_chunking_and_preemption(model_dir):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = [make_llm(model_dir).generate(ids(p), sp, use_tqdm=False)[0].outputs[0].token_ids
           for p in PROMPTS]
    llm = make_llm(model_dir, num_kv_blocks=24, max_num_batched_tokens=6, max_model_len=64)
    outs = llm.generate(ids(*PROMPTS), sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.llm_engine.scheduler.num_preemptions > 0
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.kv.num_free_blocks() == 24


def test_n_shares_prompt_blocks(model_dir):
    llm = make_llm(model_dir)
    eng = llm.llm_engine
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    eng.add_request("x", {"prompt_token_ids": PROMPTS[6]}, sp)  # 17 tokens: 5 blocks of 4
    eng.step()
    tables = [eng.kv.block_tables[f"x#{i}"] for i in range(3)]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]
    assert all(eng.kv.pool.ref_counts[b] == 3 for b in tables[0][:4])
    eng.check_integrity()
    while eng.has_unfinished_requests():
        outs = eng.step()
        eng.check_integrity()
    (out,) = outs
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 6 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # different seeds per sample
    assert eng.kv.num_free_blocks() == 256


@pytest.mark.parametrize("seed", [None, 21])
def test_n_children_equal_independent_runs(model_dir, seed):
    """Each of n samples is the run it would be alone: greedy, every child is the greedy run;
    seeded, child i is the n=1 run with seed + i. The prompt ends 7 tokens into its last block,
    which the children share after the fork: each child's first write copies it (copy-on-write),
    so a child whose copy lost those 7 positions' KV attends to something else. A request run
    before puts other KV in the pool blocks the copies land in."""
    prompt = PROMPTS[6][:15]                       # 15 tokens, block size 8: 7 in the last block
    n, temp = 3, (0.0 if seed is None else 1.0)

    def params(**kw):
        return SamplingParams(temperature=temp, max_tokens=10, ignore_eos=True, logprobs=1, **kw)

    alone = make_llm(model_dir, block_size=8)
    if seed is None:
        ref = [alone.generate(ids(prompt), params(), use_tqdm=False)[0].outputs[0]] * n
    else:
        ref = [alone.generate(ids(prompt), params(seed=seed + i), use_tqdm=False)[0].outputs[0]
               for i in range(n)]
    llm = make_llm(model_dir, num_kv_blocks=16, block_size=8)
    llm.generate(ids(PROMPTS[1] * 4), params(seed=3), use_tqdm=False)   # stale KV in the pool
    (out,) = llm.generate(ids(prompt), params(n=n, seed=seed), use_tqdm=False)
    assert [o.token_ids for o in out.outputs] == [r.token_ids for r in ref]
    for o, r in zip(out.outputs, ref):   # the same distributions, not only the same draws
        for got, want in zip(o.logprobs, r.logprobs):
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-5 for t in want)
    if seed is not None:
        assert len({tuple(r.token_ids) for r in ref}) > 1    # the seeds make a difference
    llm.llm_engine.check_integrity()


def test_stop_token_ids_max_tokens_and_finish_reasons(model_dir):
    llm = make_llm(model_dir)
    greedy = llm.generate(ids(PROMPTS[0]), SamplingParams(temperature=0, max_tokens=10,
                                                          ignore_eos=True), use_tqdm=False)[0]
    toks = greedy.outputs[0].token_ids
    assert greedy.outputs[0].finish_reason == "length" and len(toks) == 10
    stop_tok = toks[4]
    out = llm.generate(ids(PROMPTS[0]), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                       stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    o = out.outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop_tok
    assert o.token_ids == toks[: toks.index(stop_tok) + 1]


def test_logprobs_match_reference(model_dir):
    llm = make_llm(model_dir)
    p = PROMPTS[1]
    out = llm.generate(ids(p), SamplingParams(temperature=0, max_tokens=3, logprobs=4,
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
    full = p + out.token_ids
    ref = torch.log_softmax(paged_logits(llm.llm_engine, full).double(), -1)
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(p) - 1 + i]
        top = torch.topk(row, 4)
        assert list(entry)[:4] == top.indices.tolist()
        for rank, (tid, lp) in enumerate(entry.items(), start=1):
            assert abs(lp.logprob - row[tid].item()) < 1e-4
            assert lp.rank == rank
        assert tok in entry and tok == top.indices[0].item()


def test_streaming_deltas_and_abort(model_dir):
    llm = make_llm(model_dir)
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:4]):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    streamed: dict[str, list[int]] = {}
    final = {}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            streamed.setdefault(out.request_id, []).extend(out.outputs[0].new_token_ids)
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 3:
            eng.abort_request("r2")
        eng.check_integrity()
    assert set(final) == {"r0", "r1", "r3"}
    for rid, toks in final.items():
        assert streamed[rid] == toks and len(toks) == 8
    assert eng.kv.num_free_blocks() == 256
    eng.abort_request("no-such-request")  # unknown ids are ignored


def test_bad_request_mid_flight_leaves_others_running(model_dir):
    llm = make_llm(model_dir, max_model_len=64)
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eng.add_request("a", {"prompt_token_ids": PROMPTS[0]}, sp)
    eng.step()
    with pytest.raises(ValueError):
        eng.add_request("b", {"prompt_token_ids": list(range(100))}, sp)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("a", {"prompt_token_ids": PROMPTS[1]}, sp)
    n = eng.config.max_num_seqs + 1  # could never be admitted at once: it used to wait forever
    with pytest.raises(ValueError, match="max_num_seqs"):
        eng.add_request("c", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(n=n, max_tokens=2))
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in done] == ["a"] and len(done[0].outputs[0].token_ids) == 6
    eng.check_integrity()


def test_step_records_count_what_each_step_ran(model_dir):
    """One StepRecord per step with a forward. max_num_seqs=1 keeps b waiting behind a; a's
    13-token prompt runs in chunks of 6, 6 and 1 (a prompt token: prefill, though one token),
    then a decodes once; b's 2-token prompt, then its decode. On CPU nothing is timed on a
    device (gpu_ms None)."""
    llm = make_llm(model_dir, max_num_seqs=1, max_num_batched_tokens=6)
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    eng.add_request("a", {"prompt_token_ids": PROMPTS[2]}, sp)
    eng.add_request("b", {"prompt_token_ids": PROMPTS[3]}, sp)
    while eng.has_unfinished_requests():
        eng.step()
    recs = eng.take_step_records()
    assert [(r.num_prefill_tokens, r.num_decode_tokens, r.num_prefill_seqs, r.num_decode_seqs,
             r.num_waiting) for r in recs] == [
        (6, 0, 1, 0, 1), (6, 0, 1, 0, 1), (1, 0, 1, 0, 1), (0, 1, 0, 1, 1),
        (2, 0, 1, 0, 0), (0, 1, 0, 1, 0)]
    assert all(r.gpu_ms is None and r.wall_ms > 0 for r in recs)
    assert [r.t for r in recs] == sorted(r.t for r in recs)
    assert eng.take_step_records() == []       # taken once
    eng.step()                                 # nothing to run: no record
    assert eng.take_step_records() == []


def test_gpu_times_settle_in_order_without_waiting():
    """ModelRunner.take_gpu_times reads only the forwards whose end event has completed, oldest
    first, and never waits: a later forward that completed waits behind an earlier one still
    running (events complete in stream order; a gap would mean a wait). Fake events stand in
    for CUDA's."""
    from pdserve.worker.model_runner import ModelRunner

    class Event:
        def __init__(self, t, done=True):
            self.t, self.done = t, done

        def query(self):
            return self.done

        def elapsed_time(self, end):
            assert self.done and end.done     # read only once complete
            return end.t - self.t

    runner = object.__new__(ModelRunner)       # only the timing state, no model
    runner._gpu_settled = {}
    slow = Event(5.0, done=False)
    runner._gpu_pending = collections.deque([(1, Event(0.0), Event(2.5)), (2, Event(3.0), slow),
                                             (3, Event(6.0), Event(7.0))])
    assert runner.take_gpu_times() == {1: 2.5}
    assert runner.take_gpu_times() == {}
    slow.done = True
    assert runner.take_gpu_times() == {2: 2.0, 3: 1.0}


@pytest.mark.parametrize("budget,max_model_len", [(512, 512), (200, 512), (128, 512), (512, 130)])
def test_warm_up_runs_each_prefill_tile_kind_a_step_can_need(model_dir, budget, max_model_len,
                                                              monkeypatch):
    """ModelRunner.warm_up (run at start-up on CUDA) must compile every attention variant the
    steps can select. The query-tile launch's tiles follow the step's longest chunk
    (prefill_config_for), so for every chunk length a step can carry, some warm-up forward ran a
    chunk that selects the same tiles."""
    from pdserve.kernels.paged_attention import prefill_config_for
    from pdserve.worker import model_runner as mr

    llm = make_llm(model_dir, max_num_batched_tokens=budget, max_model_len=max_model_len)
    runner = llm.llm_engine.runner
    ran = []   # each warm-up forward's longest chunk
    forward = mr.ModelRunner._forward

    def recorded(self, chunks, pending=None):
        ran.append(max(len(c.token_ids) for c in chunks))
        return forward(self, chunks, pending)
    monkeypatch.setattr(mr.ModelRunner, "_forward", recorded)
    runner.warm_up(max_model_len)
    kinds = {tuple(sorted(prefill_config_for(n, torch.bfloat16).items())) for n in ran}
    for n in range(2, min(budget, max_model_len) + 1):
        assert tuple(sorted(prefill_config_for(n, torch.bfloat16).items())) in kinds, n
