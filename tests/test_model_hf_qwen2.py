"""Our forward vs HF transformers on small random configs: Qwen2 with QKV bias (untied) and
Llama (tied). Same safetensors weights; fp32 logits within 1e-4 relative error; greedy equal."""
import pytest
import torch

pytest.importorskip("transformers")

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.config import EngineConfig  # noqa: E402
from pdserve.worker.llm_engine import LLMEngine  # noqa: E402

from .utils import paged_logits, save_tiny_hf_model  # noqa: E402


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_logits_match_hf(tmp_path, kind):
    hf = save_tiny_hf_model(tmp_path / kind, kind)
    engine = LLMEngine(EngineConfig(model=str(tmp_path / kind), skip_tokenizer_init=True,
                                    num_kv_blocks=64, block_size=4))
    ids = torch.randint(0, 320, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double()
    for chunk in (None, 5):  # one prefill, and chunked prefill over cached context
        ours = paged_logits(engine, ids, chunk).double()
        err = (ours - ref).norm() / ref.norm()
        assert err < 1e-4, (chunk, err.item())
    engine.check_integrity()


def test_greedy_matches_hf_generate(tmp_path):
    hf = save_tiny_hf_model(tmp_path / "m", "qwen2")
    llm = LLM(str(tmp_path / "m"), skip_tokenizer_init=True, num_kv_blocks=128, block_size=4)
    prompts = [[5, 17, 99, 3], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [42] * 9]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=-1,
                          pad_token_id=0)
        assert o.outputs[0].token_ids == ref[0, len(p):].tolist()


def test_prompt_logprobs_match_hf(tmp_path):
    """SamplingParams.prompt_logprobs: each prompt token's logprob given its prefix (and the
    top-k) equals HF's log_softmax, also when the prompt is prefilled in chunks."""
    hf = save_tiny_hf_model(tmp_path / "m", "qwen2")
    ids = torch.randint(0, 320, (45,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    for budget in (2048, 7):
        llm = LLM(str(tmp_path / "m"), skip_tokenizer_init=True, num_kv_blocks=64, block_size=4,
                  max_num_batched_tokens=budget)
        out = llm.generate([{"prompt_token_ids": ids}],
                           SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
        plp = out.prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        for j in range(1, len(ids)):
            entry = plp[j]
            assert abs(entry[ids[j]].logprob - ref[j - 1, ids[j]].item()) < 1e-4, (budget, j)
            top = sorted(((lp.rank, t) for t, lp in entry.items() if lp.rank <= 3))
            assert [t for _, t in top] == ref[j - 1].topk(3).indices.tolist()
        llm.llm_engine.check_integrity()
