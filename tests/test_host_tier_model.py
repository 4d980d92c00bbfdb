"""The KV host tier end to end on the embedded model (CPU): greedy outputs with swap preemption
forced, and with prefixes offloaded to the host tier and loaded back, equal those of an engine
with a pool large enough that nothing is preempted or evicted (the reference)."""
import pytest

from pdserve import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [(i * 37 + j * 11) % 4000 + 10 for j in range(60 + i * 7)]}
           for i in range(6)]
GREEDY = SamplingParams(max_tokens=24, temperature=0)


def _tokens(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(device="cpu", num_kv_blocks=256, enable_prefix_caching=False)
    return _tokens(llm)


@pytest.mark.parametrize("mode", ["swap", None])
def test_swap_preemption_keeps_outputs(reference, mode):
    # 30 blocks of 16 hold about four of the six sequences (6-8 blocks each): preemption is certain
    llm = LLM(device="cpu", num_kv_blocks=30, swap_space_gb=0.05, preemption_mode=mode,
              enable_prefix_caching=False)
    assert _tokens(llm) == reference
    core = llm.llm_engine
    assert core.scheduler.num_swap_preemptions > 0
    assert core.kv.blocks_swapped_out > 0
    assert core.kv.blocks_swapped_in == core.kv.blocks_swapped_out
    assert core.kv.num_host_blocks_used == 0      # every swapped request came back and finished
    core.scheduler.check_integrity()


@pytest.mark.parametrize("policy", ["on-eviction", "write-through"])
def test_prefix_offload_and_load_back_keep_outputs(reference, policy):
    llm = LLM(device="cpu", num_kv_blocks=30, swap_space_gb=0.05, kv_offload_policy=policy)
    first = _tokens(llm)
    assert first == reference
    # the same prompts again: their prefixes were pushed to the host tier by the later ones
    kv = llm.llm_engine.kv
    assert kv.blocks_offloaded > 0
    hits0 = kv.prefix_host_hits
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert kv.blocks_loaded_back > 0 and kv.prefix_host_hits > hits0
    assert sum(o.num_cached_tokens for o in outs) >= kv.prefix_host_hits - hits0
    llm.llm_engine.scheduler.check_integrity()
