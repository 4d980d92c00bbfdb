"""Qwen3 dense against HF transformers' Qwen3ForCausalLM on small random checkpoints: per-head
q/k RMSNorm before RoPE, head_dim 32 where hidden / heads is 16, tied embeddings; and a variant
with attention_bias (q/k/v and o_proj biases), untied, its second layer sliding over 8 tokens.
Same safetensors weights; fp32 logits within 1e-4 relative error (one prefill, chunked prefill,
one token at a time through the paged KV cache); greedy tokens equal to HF generate for a batch
sharing forwards; the Triton backend under the interpreter; a qwen3 GGUF of the same tensors.
Config defaults, the preset and the MoE refusal are checked against transformers' config."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.models.config import ModelConfig  # noqa: E402
from pdserve.models.presets import PRESETS  # noqa: E402

from .utils import paged_logits, save_tiny_hf_model  # noqa: E402

TINY = dict(vocab_size=1000, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32)
VARIANTS = {"tied": {},
            # layer 1 slides over 8 tokens (Qwen3Config: layers from max_window_layers on)
            "bias-sliding": dict(attention_bias=True, tie_word_embeddings=False,
                                 use_sliding_window=True, sliding_window=8, max_window_layers=1)}
IDS = torch.randint(2, 1000, (30,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """variant name -> (folder, HF model), built on first use"""
    built = {}

    def get(name):
        if name not in built:
            folder = tmp_path_factory.mktemp(name) / "m"
            built[name] = folder, save_tiny_hf_model(folder, "qwen3", **TINY, **VARIANTS[name])
        return built[name]
    return get


@pytest.fixture(params=list(VARIANTS))
def model(request, models):
    return models(request.param)


@pytest.fixture
def tied(models):
    return models("tied")


def test_logits_match_hf(model):
    folder, hf = model
    ours_cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    assert ours_cfg.qk_norm and ours_cfg.head_dim == 32
    assert ours_cfg.o_proj_bias == ours_cfg.attention_bias == hf.config.attention_bias
    assert ours_cfg.sliding_layers == tuple(i for i, t in enumerate(hf.config.layer_types)
                                            if t == "sliding_attention")
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].double()
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=64, block_size=4)
    for chunk in (None, 7, 1):   # one prefill; chunks over cached context; token by token
        ours = paged_logits(llm.llm_engine, IDS, chunk).double()
        err = ((ours - ref).norm() / ref.norm()).item()
        assert err < 1e-4, (chunk, err)
    llm.llm_engine.check_integrity()


def test_greedy_batch_matches_hf_generate(tied):
    folder, hf = tied
    prompts = [IDS[:4], IDS[2:13], [42] * 9]
    # a small token budget: prefill chunks and decodes share forwards
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=128, block_size=4,
              max_num_batched_tokens=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        want = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                           eos_token_id=-1, pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == want, p
    llm.llm_engine.check_integrity()


def test_triton_backend_matches_hf(tied):
    """The Triton attention kernels (fused RoPE + KV store, paged attention) fed the normed q/k,
    under Triton's interpreter on CPU: chunked prefill, then decode steps."""
    pytest.importorskip("triton")
    folder, hf = tied
    ids = IDS[:12]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double()
    llm = LLM(str(folder), attention_backend="triton", skip_tokenizer_init=True,
              num_kv_blocks=16, block_size=16)
    ours = paged_logits(llm.llm_engine, ids, 7).double()
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-4
    p = ids[:6]
    out = llm.generate([{"prompt_token_ids": p}],
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    want = hf.generate(torch.tensor([p]), max_new_tokens=3, do_sample=False, eos_token_id=-1,
                       pad_token_id=0)[0, len(p):].tolist()
    assert out.outputs[0].token_ids == want


def test_dummy_weights_cover_every_parameter(model):
    """load_format="dummy" on a Qwen3 folder draws the q/k norms (and o_proj bias) too: the
    loader refuses a checkpoint that leaves a parameter unset, so this building at all is the
    check; the norms start at one, as HF initializes them."""
    folder, hf = model
    llm = LLM(str(folder), load_format="dummy", skip_tokenizer_init=True, num_kv_blocks=16)
    attn = llm.llm_engine.model.layers[0].self_attn
    assert torch.equal(attn.q_norm.weight, torch.ones(32))
    assert (attn.o_proj.bias is not None) == hf.config.attention_bias


def _qwen3_dict(**kw):
    return dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=1000,
                hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, **kw)


@pytest.mark.parametrize("cfg", [
    _qwen3_dict(),                                             # no head_dim: Qwen3Config's 128
    _qwen3_dict(head_dim=16, sliding_window=8),                # a window, but not used
    _qwen3_dict(head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=2),
    dict(PRESETS["qwen3-0.6b"]),
], ids=["no-head-dim", "window-unused", "sliding-from-max-window-layers", "preset-0.6b"])
def test_config_follows_transformers(cfg):
    hf = transformers.AutoConfig.for_model("qwen3", **{k: v for k, v in cfg.items()
                                                       if k != "model_type"})
    ours = ModelConfig.from_hf(cfg)
    assert (ours.head_dim, ours.num_heads, ours.num_kv_heads, ours.hidden_size) == \
        (hf.head_dim, hf.num_attention_heads, hf.num_key_value_heads, hf.hidden_size)
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.rope_theta == hf.rope_parameters["rope_theta"] and ours.rope_scaling is None
    want = tuple(i for i, t in enumerate(hf.layer_types) if t == "sliding_attention")
    assert ours.sliding_layers == want
    assert ours.sliding_window == (hf.sliding_window if want else None)


@pytest.mark.parametrize("cfg", [
    _qwen3_dict(head_dim=16) | dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe"),
    _qwen3_dict(head_dim=16) | dict(architectures=[], model_type="qwen3_moe"),
])
def test_qwen3_moe_is_refused_by_name(tmp_path, cfg):
    with pytest.raises(ValueError, match=r"'(Qwen3MoeForCausalLM|qwen3_moe)'.*mixture of experts"):
        ModelConfig.from_hf(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, num_kv_blocks=16)


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False])
def test_gpu_fp32_greedy_matches_hf(tmp_path, eager):
    """The GPU fast path (Triton RMSNorm over the [tokens * heads, head_dim] q/k rows, Triton
    attention; CUDA graphs unless eager) on a Qwen3 with head_dim 128 over hidden 256 / 8 heads:
    a mixed batch chunked by a small token budget; fp32 greedy equals HF fp32 greedy on the GPU."""
    folder = tmp_path / "m"
    hf = save_tiny_hf_model(folder, "qwen3", hidden_size=256, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=128, num_hidden_layers=3,
                            max_position_embeddings=2048).cuda()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (5, 40, 130, 300)]
    llm = LLM(str(folder), device="cuda", dtype="float32", skip_tokenizer_init=True,
              num_kv_blocks=512, max_num_batched_tokens=96, enforce_eager=eager)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=32,
                               do_sample=False, eos_token_id=-1, pad_token_id=0)
        assert o.outputs[0].token_ids == want[0, len(p):].tolist(), len(p)
    assert (llm.llm_engine.runner.graphs is not None) == (not eager)
    llm.llm_engine.check_integrity()


def test_gguf_qwen3_matches_hf(tied, tmp_path):
    """A GGUF of arch "qwen3" written with gguf.GGUFWriter from the HF model's tensors (F32, names
    as llama.cpp's converter writes them: blk.N.attn_q_norm / attn_k_norm, q/k rows not permuted,
    head_dim in key_length, tied embeddings as no output.weight) gives HF's logits."""
    gguf = pytest.importorskip("gguf")
    folder, hf = tied
    c = hf.config
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    path = tmp_path / "tiny-qwen3.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    names = 0
    for name, p in hf.state_dict().items():
        if name == "lm_head.weight":
            continue   # tied
        name = name.removeprefix("model.")
        if name.startswith("layers."):
            _, n, rest = name.split(".", 2)
            part, kind = rest.rsplit(".", 1)
            gname = f"blk.{n}.{parts[part]}.{kind}"
        else:
            gname = {"embed_tokens.weight": "token_embd.weight",
                     "norm.weight": "output_norm.weight"}[name]
        w.add_tensor(gname, p.detach().numpy().astype("float32"))
        names += 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert names == 2 + 11 * c.num_hidden_layers   # embed, final norm; 11 per layer
    llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=32, block_size=4)
    assert llm.llm_engine.model.config.qk_norm
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].double()
    ours = paged_logits(llm.llm_engine, IDS, 11).double()
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-4
