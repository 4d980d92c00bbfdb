"""Prefix caching through the engine: outputs with the cache on equal those with it off (a tiny
random Qwen2, block_size 4 so that prefixes end mid-block, and the embedded SmolLM2), and
num_cached_tokens equals the reused length computed by hand from the earlier requests' tokens."""
import pytest

pytest.importorskip("transformers")

from pdserve import LLM, SamplingParams  # noqa: E402

from .test_engine import model_dir  # noqa: E402,F401  (the tiny random Qwen2: a fixture)


def make_llm(model_dir, cache: bool, **kw):
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLM(model_dir, skip_tokenizer_init=True, enable_prefix_caching=cache, **kw)


def ids(*prompts):
    return [{"prompt_token_ids": list(p)} for p in prompts]


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


SYSTEM = [(i * 37 + 11) % 300 + 3 for i in range(23)]            # 23 tokens: ends mid-block


def run_both(model_dir, batches, sp, **kw):
    """The same sequence of generate() batches on a cache-on and a cache-off engine."""
    got = {}
    for cache in (True, False):
        llm = make_llm(model_dir, cache, **kw)
        outs = []
        for b in batches:
            outs.append(llm.generate(ids(*b), sp, use_tqdm=False))
            llm.llm_engine.check_integrity()
        got[cache] = (llm, outs)
    return got


def test_shared_prefix_multi_turn_and_batches_match_cache_off(model_dir):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = SYSTEM + [41, 42, 43]
    got = run_both(model_dir, [[first]], sp)
    on, off = got[True][0], got[False][0]
    a_out = got[True][1][0][0].outputs[0].token_ids
    assert a_out == got[False][1][0][0].outputs[0].token_ids
    # what the cache holds now: the first prompt + its outputs but the last (never fed)
    cached = first + a_out[:-1]
    turn2 = first + a_out + [60, 61]                              # the next turn of the chat
    batch = [SYSTEM + [90, 91, 92],                               # diverges after 23 (mid-block)
             SYSTEM[:16] + [7, 7, 7, 7, 7],                       # diverges at a block boundary
             turn2,
             [299, 298, 297]]                                     # shares nothing
    outs_on = on.generate(ids(*batch), sp, use_tqdm=False)
    outs_off = off.generate(ids(*batch), sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs_on] == [o.outputs[0].token_ids for o in outs_off]
    # all four were admitted in one step: each sees only the first request's tokens
    assert [o.num_cached_tokens for o in outs_on] == [min(lcp(p, cached), len(p) - 1) for p in batch]
    assert [o.num_cached_tokens for o in outs_on][:3] == [23, 16, len(cached)]
    assert all(o.num_cached_tokens == 0 for o in outs_off)
    # the same prompt again: everything but the last token comes from the cache
    again = on.generate(ids(batch[0]), sp, use_tqdm=False)[0]
    assert again.num_cached_tokens == len(batch[0]) - 1
    assert again.outputs[0].token_ids == outs_off[0].outputs[0].token_ids
    on.llm_engine.check_integrity()
    kv = on.llm_engine.kv
    assert kv.prefix_hits > 0 and kv.num_cached_blocks > 0
    assert kv.num_free_blocks() == kv.pool.num_blocks                # only the cache holds blocks
    freed = on.reset_prefix_cache()
    assert freed > 0 and kv.num_cached_blocks == 0 and kv.pool.num_free_blocks == kv.pool.num_blocks
    assert on.generate(ids(batch[0]), sp, use_tqdm=False)[0].num_cached_tokens == 0
    on.llm_engine.check_integrity()


def test_small_pool_eviction_and_preemption_match_cache_off(model_dir):
    """A pool of 24 blocks x 4 tokens: cached prefixes are evicted for new work and running
    sequences are preempted (and re-admitted from their own cached prefix)."""
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [SYSTEM + [i, i + 1, i + 2] for i in range(6)] + [[5] * 13, SYSTEM[:9]]
    batches = [prompts[:2], prompts, prompts[3:], prompts[:1]]
    got = run_both(model_dir, batches, sp, num_kv_blocks=24, max_num_batched_tokens=16,
                   max_model_len=64)
    on_tokens = [[o.outputs[0].token_ids for o in b] for b in got[True][1]]
    off_tokens = [[o.outputs[0].token_ids for o in b] for b in got[False][1]]
    assert on_tokens == off_tokens
    eng = got[True][0].llm_engine
    assert eng.scheduler.num_preemptions > 0                        # the pool was short
    assert any(o.num_cached_tokens > 0 for b in got[True][1] for o in b)
    eng.check_integrity()
    assert eng.kv.num_free_blocks() == eng.kv.pool.num_blocks


def test_n_samples_seeds_and_stop_strings_free_paths(model_dir):
    sps = [SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=8, ignore_eos=True),
           SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=8, ignore_eos=True),
           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    prompts = [SYSTEM + [1, 2], SYSTEM + [1, 3], SYSTEM + [1, 2, 9]]
    res = {}
    for cache in (True, False):
        llm = make_llm(model_dir, cache)
        warm = llm.generate(ids(SYSTEM + [1]), sps[2], use_tqdm=False)   # something to reuse
        outs = llm.generate(ids(*prompts), sps, use_tqdm=False)
        aborted = llm.llm_engine                                        # abort mid-way, then reuse
        aborted.add_request("x", {"prompt_token_ids": SYSTEM + [4, 4]}, sps[2])
        aborted.step()
        aborted.abort_request("x")
        while aborted.has_unfinished_requests():
            aborted.step()
        later = llm.generate(ids(SYSTEM + [4, 4, 4]), sps[2], use_tqdm=False)
        llm.llm_engine.check_integrity()
        res[cache] = ([[c.token_ids for c in o.outputs] for o in [*warm, *outs, *later]],
                      [o.num_cached_tokens for o in outs])
    assert res[True][0] == res[False][0]
    assert res[True][1][0] == len(SYSTEM) + 1                        # SYSTEM + [1] from `warm`
    assert res[False][1] == [0, 0, 0]


def test_embedded_model_shared_system_prompt():
    from pdserve.loader.model_loader import resolve_source  # noqa: F401  (the embedded model)
    system = "You are a careful assistant. Answer in one short sentence. " * 3
    qs = ["What is the capital of France?", "Name a colour.", "Who wrote Hamlet?"]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    res = {}
    for cache in (True, False):
        llm = LLM(enable_prefix_caching=cache, num_kv_blocks=64, max_num_seqs=4)
        first = llm.generate([system + qs[0]], sp, use_tqdm=False)[0]
        rest = llm.generate([system + q for q in qs[1:]], sp, use_tqdm=False)
        llm.llm_engine.check_integrity()
        res[cache] = ([o.outputs[0].token_ids for o in [first, *rest]],
                      [o.num_cached_tokens for o in rest],
                      [lcp(o.prompt_token_ids, first.prompt_token_ids) for o in rest])
    assert res[True][0] == res[False][0]
    assert res[True][1] == res[True][2] and min(res[True][1]) > 20   # the shared system prompt
    assert res[False][1] == [0, 0]


def test_pd_producer_reuses_its_held_prompts(tmp_path):
    """A prefill worker caches the prompts it holds for consumers: the second hand-off of a
    prompt computes one token there, and both hand-offs decode the same tokens."""
    from pdserve.config import EngineConfig
    from pdserve.worker.llm_engine import LLMEngine

    from .test_disagg import ENGINE, GREEDY, LLAMA_8Q_2KV, _folder, _handoff
    cfg = EngineConfig(model=_folder(tmp_path, LLAMA_8Q_2KV), kv_connector="shared", **ENGINE)
    P, D = LLMEngine(cfg), LLMEngine(cfg)
    D.connect_kv([P.kv_export("p")])
    prompt = list(range(30, 57))                                  # 27 tokens: ends mid-block
    first_p, first_d, _ = _handoff(P, D, prompt, GREEDY, "a")
    again_p, again_d, _ = _handoff(P, D, prompt, GREEDY, "b")
    assert first_p.num_cached_tokens == 0
    assert again_p.num_cached_tokens == len(prompt) - 1
    assert again_d.outputs[0].token_ids == first_d.outputs[0].token_ids
    for e in (P, D):
        e.check_integrity()
        assert e.kv.num_free_blocks() == e.kv.pool.num_blocks


def test_pd_consumer_pulls_only_the_blocks_it_lacks(tmp_path):
    """A decode worker that cached a conversation's earlier turn pulls only the new blocks of
    the next turn's prompt: the whole blocks it has stay, the rest (from the block where the
    cached part ends) come from the producer, and the decoded tokens equal a collocated run."""
    from pdserve.config import EngineConfig
    from pdserve.worker.llm_engine import LLMEngine

    from pdserve.protocol import AddRequest

    from .test_disagg import ENGINE, GREEDY, LLAMA_8Q_2KV, _folder, _handoff, _run
    cfg = EngineConfig(model=_folder(tmp_path, LLAMA_8Q_2KV), kv_connector="shared", **ENGINE)
    P, D = LLMEngine(cfg), LLMEngine(cfg)
    D.connect_kv([P.kv_export("p")])
    turn1 = list(range(30, 49))                                   # 19 tokens
    _, out1, _ = _handoff(P, D, turn1, GREEDY, "t1")
    # D now caches turn1 + its outputs but the last: 19 + 11 = 30 positions (7 whole blocks of 4)
    turn2 = turn1 + list(out1.outputs[0].token_ids) + [5, 6, 7]
    ref = _run(P, [AddRequest("ref", {"prompt_token_ids": turn2}, GREEDY)])["ref"]
    sched_loads = []
    orig = D.kv_coordinator.take_work

    def spy():
        w = orig()
        if w is not None:
            sched_loads.extend(w.loads)
        return w
    D.kv_coordinator.take_work = spy
    first, out2, computed = _handoff(P, D, turn2, GREEDY, "t2")
    assert out2.outputs[0].token_ids == ref.outputs[0].token_ids
    (load,) = [ld for ld in sched_loads if ld.request_id.startswith("t2")]
    cached_blocks = (len(turn1) + len(out1.outputs[0].token_ids) - 1) // 4     # 7
    assert len(load.src_block_ids) == -(-len(turn2) // 4) - cached_blocks
    assert out2.num_cached_tokens == cached_blocks * 4
    for e in (P, D):
        e.check_integrity()
        assert e.kv.num_free_blocks() == e.kv.pool.num_blocks


def test_prompt_logprobs_bypass_the_cache(model_dir):
    """A request that asks for its prompt's logprobs computes every prompt position (no cached
    prefix): the logprobs exist for all of them and equal a cache-off engine's."""
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = SYSTEM + [9, 9]
    res = {}
    for cache in (True, False):
        llm = make_llm(model_dir, cache)
        llm.generate(ids(prompt), plain, use_tqdm=False)              # now cached (cache on)
        out = llm.generate(ids(prompt), sp, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        assert out.prompt_logprobs[0] is None and all(e is not None for e in out.prompt_logprobs[1:])
        res[cache] = [{t: round(v.logprob, 4) for t, v in e.items()} for e in out.prompt_logprobs[1:]]
        llm.llm_engine.check_integrity()
    assert res[True] == res[False]


def test_pd_two_sided_sends_only_the_tail_and_recomputes_a_wrong_guess():
    """1P1D over torch-dist (two-sided: the producer sends what the router asks), the embedded
    SmolLM2. Turn 2 of a conversation moves only the blocks past those the decode worker cached
    from turn 1 (hand-counted: its prompt and outputs but the last token, whole blocks of 8);
    then the decode worker's cache is emptied behind the router's back: turn 3's skipped blocks
    are gone there, so the tail is received and discarded and the prompt recomputed. Every
    turn's greedy tokens equal a single collocated engine's (prefix caching off)."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    bs = 8
    kw = dict(num_kv_blocks=64, block_size=bs, max_num_seqs=4)
    # SmolLM2: 30 layers, k and v, 3 KV heads of 64, float32 on CPU
    block_bytes = 30 * 2 * 3 * 64 * 4 * bs
    blocks = lambda n: -(-n // bs)  # noqa: E731
    ref = LLM(enable_prefix_caching=False, **kw)
    tok = ref.get_tokenizer()
    with LLM(prefill=1, decode=1, kv_connector="torch-dist", **kw) as llm:
        router = llm.llm_engine
        stats = router.route_stats
        turns, outs = [tok.encode("The three primary colours are")], []
        for k, more in enumerate([" Name one more.", " And another?"]):
            before = stats.transfer_bytes
            (o,) = llm.generate(ids(turns[-1]), sp, use_tqdm=False)
            (r,) = ref.generate(ids(turns[-1]), sp, use_tqdm=False)
            assert o.outputs[0].token_ids == r.outputs[0].token_ids
            outs.append((o, stats.transfer_bytes - before))
            turns.append(turns[-1] + list(o.outputs[0].token_ids) + tok.encode(more))
        router.workers["decode-0"].client.reset_prefix_cache()   # (the index still has it)
        (o3,) = llm.generate(ids(turns[-1]), sp, use_tqdm=False)
        (r3,) = ref.generate(ids(turns[-1]), sp, use_tqdm=False)
        assert o3.outputs[0].token_ids == r3.outputs[0].token_ids
        (o1, b1), (o2, b2) = outs
        assert b1 == blocks(len(turns[0])) * block_bytes and o1.num_cached_tokens == 0
        cached = (len(turns[0]) + len(o1.outputs[0].token_ids) - 1) // bs
        assert cached >= 1
        assert b2 == (blocks(len(turns[1])) - cached) * block_bytes
        assert o2.num_cached_tokens == cached * bs
        assert (stats.transfers, stats.transfer_failures) == (2, 1)
        assert o3.num_cached_tokens == 0
        for name, s in router.check_workers().items():
            assert s.num_kv_blocks_used == 0 and s.num_running == s.num_waiting == 0, name
