"""Sliding-window attention against HF transformers: Mistral (every layer) and Qwen2 with
use_sliding_window (the layers that layer_types marks, or, in configs without layer_types, the
layers from max_window_layers on). Windows of 8 / 5 tokens, prompts several windows long,
prefilled whole and in chunks that end inside and across windows, greedy decoding well past the
window; the torch backend, and the Triton backend under the interpreter. The reference is
transformers reading the same config.json."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.models.config import ModelConfig  # noqa: E402

from .utils import paged_logits, save_tiny_hf_model  # noqa: E402

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
MODELS = {
    # name: (HF model, config overrides, keys removed from the saved config.json)
    "mistral": ("mistral", dict(sliding_window=8), ()),
    "qwen2-layer-types": ("qwen2", dict(use_sliding_window=True, sliding_window=8,
                                        max_window_layers=1), ()),
    "qwen2-max-window-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=5,
                                              max_window_layers=2), ("layer_types",)),
}


def _build(tmp_path_factory, name, **more):
    kind, overrides, dropped = MODELS[name]
    folder = tmp_path_factory.mktemp(name) / "m"
    save_tiny_hf_model(folder, kind, **TINY, **overrides, **more)
    cfg = json.loads((folder / "config.json").read_text())
    for key in dropped:
        del cfg[key]
    (folder / "config.json").write_text(json.dumps(cfg))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf, cfg


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tmp_path_factory):
    return _build(tmp_path_factory, request.param)


def test_sliding_layers_are_the_ones_hf_uses(model):
    _, hf, cfg = model
    ours = ModelConfig.from_hf(cfg)
    if hf.config.model_type == "mistral":   # every layer when sliding_window is set
        want = tuple(range(TINY["num_hidden_layers"]))
    else:
        want = tuple(i for i, t in enumerate(hf.config.layer_types) if t == "sliding_attention")
        assert 0 < len(want) < TINY["num_hidden_layers"]   # full and sliding layers both
    assert ours.sliding_layers == want and ours.sliding_window == hf.config.sliding_window


IDS = torch.randint(2, 320, (40,), generator=torch.Generator().manual_seed(11)).tolist()
PROMPTS = [IDS[:12], IDS[3:26]]   # decoded to 28 and 39 tokens: well past every window


def test_logits_and_greedy_match_hf(model):
    folder, hf, _ = model
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].double()
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=64, block_size=4)
    for chunk in (None, 7):   # whole; chunks shorter (8) or longer (5) than the window
        ours = paged_logits(llm.llm_engine, IDS, chunk).double()
        err = ((ours - ref).norm() / ref.norm()).item()
        assert err < 1e-4, (chunk, err)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # a small token budget: prefill chunks and decodes share forwards
    mixed = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=128, block_size=4,
                max_num_batched_tokens=10)
    outs = mixed.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        want = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                           eos_token_id=-1, pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == want, p
    mixed.llm_engine.check_integrity()


def test_triton_backend_matches_hf(tmp_path_factory):
    """The Triton kernels wired into the model (interpreter on CPU): a Qwen2 with full and
    sliding layers, prefilled in chunks across the window, then decode steps. Its RoPE is yarn
    from position 8 on, whose attention factor reaches the fused RoPE kernel through the table."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
            "rope_theta": 1e4}
    folder, hf, _ = _build(tmp_path_factory, "qwen2-layer-types", rope_parameters=yarn)
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    ids = IDS[:20]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double()
    llm = LLM(str(folder), attention_backend="triton", skip_tokenizer_init=True,
              num_kv_blocks=32, block_size=16)
    ours = paged_logits(llm.llm_engine, ids, 11).double()
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-4
    p = ids[:10]
    out = llm.generate([{"prompt_token_ids": p}],
                       SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    want = hf.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False, eos_token_id=-1,
                       pad_token_id=0)[0, len(p):].tolist()
    assert out.outputs[0].token_ids == want


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False])
def test_gpu_fp32_greedy_matches_hf(tmp_path, eager):
    """On the GPU fast path (Triton kernels; CUDA graphs unless eager): a Qwen2 whose layers 1, 2
    slide over 64 tokens and whose RoPE is yarn past 128, a mixed batch of prompts up to 5
    windows long chunked by a small token budget; fp32 greedy equals HF fp32 greedy on the GPU."""
    folder = tmp_path / "m"
    hf = save_tiny_hf_model(folder, "qwen2", hidden_size=256, num_attention_heads=8,
                            num_key_value_heads=2, num_hidden_layers=3,
                            max_position_embeddings=2048, use_sliding_window=True,
                            sliding_window=64, max_window_layers=1,
                            rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                             "original_max_position_embeddings": 128})
    hf = hf.cuda()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (5, 63, 64, 65, 150, 320)]
    llm = LLM(str(folder), device="cuda", dtype="float32", skip_tokenizer_init=True,
              num_kv_blocks=512, max_num_batched_tokens=96, enforce_eager=eager)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=40,
                               do_sample=False, eos_token_id=-1, pad_token_id=0)
        assert o.outputs[0].token_ids == want[0, len(p):].tolist(), len(p)
    if not eager:
        assert llm.llm_engine.runner.graphs is not None
    llm.llm_engine.check_integrity()
