"""The Triton attention backend (fused RoPE + KV store, paged attention) wired into the model,
run on CPU under Triton's interpreter: same logits and greedy tokens as the torch backend for a
mixed batch with chunked prefill over cached context."""
import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers")

from pdserve import LLM, SamplingParams  # noqa: E402

from .utils import paged_logits, save_tiny_hf_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "qwen2"
    # head_dim 16, 2 query heads per KV head
    save_tiny_hf_model(d, "qwen2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=2)
    return str(d)


def test_triton_backend_matches_torch_backend(model_dir):
    # max_num_batched_tokens=24: chunks and decodes share forwards in the generate below; the
    # logits probes call the runner directly (its input buffers hold >= 128 tokens), so the
    # same two engines serve both checks
    kw = dict(skip_tokenizer_init=True, num_kv_blocks=64, block_size=16, max_num_batched_tokens=24)
    ref = LLM(model_dir, attention_backend="torch", **kw)
    tri = LLM(model_dir, attention_backend="triton", **kw)
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    for chunk in (None, 17):
        a = paged_logits(ref.llm_engine, ids, chunk)
        b = paged_logits(tri.llm_engine, ids, chunk)
        assert ((a - b).norm() / a.norm()).item() < 1e-4
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7], ids[:33], [9] * 20, ids[5:12])]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, sp, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in tri.generate(prompts, sp, use_tqdm=False)]
    assert got == want
