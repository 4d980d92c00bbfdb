"""config.json values pdserve cannot run faithfully are refused with a ValueError that names them
(instead of loading and silently giving other tokens, or failing with a ZeroDivisionError deep
inside), through the paths users take: an HF folder with load_format="dummy" or with weights, and
presets. Config defaults that change the model are checked against transformers' own config
classes."""
import json

import pytest

from pdserve import LLM
from pdserve.models import presets
from pdserve.models.config import ModelConfig

BASE = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=320,
            hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=256, rope_theta=1e6)


def dummy_llm(tmp_path, cfg: dict):
    folder = tmp_path / "cfg"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return LLM(str(folder), load_format="dummy", skip_tokenizer_init=True, num_kv_blocks=16)


def without(d: dict, *keys) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def test_base_config_loads(tmp_path):
    """The cases below differ from this one by the field they name."""
    assert dummy_llm(tmp_path, BASE).llm_engine.model_config.head_dim == 8


NONSENSE = {
    # id: (config, text the message must contain)
    "heads 0": (dict(BASE, num_attention_heads=0), "num_attention_heads"),
    "heads negative": (dict(BASE, num_attention_heads=-8), "num_attention_heads"),
    "heads missing": (without(BASE, "num_attention_heads"), "num_attention_heads"),
    "hidden missing": (without(BASE, "hidden_size"), "hidden_size"),
    "hidden null": (dict(BASE, hidden_size=None), "hidden_size"),
    "hidden text": (dict(BASE, hidden_size="64"), "hidden_size"),
    "hidden 2.5": (dict(BASE, hidden_size=2.5), "hidden_size"),
    "intermediate negative": (dict(BASE, intermediate_size=-128), "intermediate_size"),
    "intermediate missing": (without(BASE, "intermediate_size"), "intermediate_size"),
    "layers 0": (dict(BASE, num_hidden_layers=0), "num_hidden_layers"),
    "vocab 0": (dict(BASE, vocab_size=0), "vocab_size"),
    "vocab missing": (without(BASE, "vocab_size"), "vocab_size"),
    "kv heads 0": (dict(BASE, num_key_value_heads=0), "num_key_value_heads"),
    "kv heads do not divide": (dict(BASE, num_key_value_heads=3), "num_key_value_heads"),
    "heads do not divide hidden": (dict(BASE, num_attention_heads=6, num_key_value_heads=2),
                                   "num_attention_heads"),
    "head_dim 0": (dict(BASE, head_dim=0), "head_dim"),
    "head_dim odd": (dict(BASE, head_dim=7), "head_dim"),
    "max_position 0": (dict(BASE, max_position_embeddings=0), "max_position_embeddings"),
    "eps negative": (dict(BASE, rms_norm_eps=-1e-6), "rms_norm_eps"),
    "eps text": (dict(BASE, rms_norm_eps="small"), "rms_norm_eps"),
    "theta 0": (dict(BASE, rope_theta=0), "rope_theta"),
    "theta in rope_parameters negative": (
        dict(without(BASE, "rope_theta"), rope_parameters={"rope_type": "default",
                                                           "rope_theta": -1.0}), "rope_theta"),
    "mistral window 0": (dict(BASE, architectures=["MistralForCausalLM"], model_type="mistral",
                              sliding_window=0), "sliding_window"),
    "qwen2 window negative": (dict(BASE, use_sliding_window=True, sliding_window=-4,
                                   max_window_layers=0), "sliding_window"),
    "qwen2 layer_types length": (dict(BASE, layer_types=["full_attention"] * 2), "layer_types"),
    "qwen2 layer_types kind": (dict(BASE, use_sliding_window=True, sliding_window=8,
                                    layer_types=["full_attention", "chunked_attention",
                                                 "full_attention"]), "chunked_attention"),
    "qwen2 sliding layers without a window": (
        dict(BASE, layer_types=["full_attention", "sliding_attention", "full_attention"]),
        "sliding_window"),
}


@pytest.mark.parametrize("cfg,field", list(NONSENSE.values()), ids=list(NONSENSE))
def test_nonsense_config_is_a_value_error_naming_the_field(tmp_path, cfg, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(cfg)
    with pytest.raises(ValueError, match=field):
        dummy_llm(tmp_path, cfg)


ROPE_REFUSED = {
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, "rope type 'dynamic' is not supported"),
    "dynamic legacy": ({"type": "dynamic", "factor": 2.0}, "rope type 'dynamic' is not supported"),
    "longrope": ({"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                  "original_max_position_embeddings": 64}, "rope type 'longrope'"),
    "proportional": ({"rope_type": "proportional", "factor": 2.0}, "rope type 'proportional'"),
    "unknown": ({"rope_type": "spiral", "factor": 2.0}, "rope type 'spiral'"),
    "linear without factor": ({"rope_type": "linear"}, "factor"),
    "yarn without factor": ({"rope_type": "yarn", "original_max_position_embeddings": 64},
                            "factor"),
    "yarn factor 0": ({"rope_type": "yarn", "factor": 0, "original_max_position_embeddings": 64},
                      "factor"),
    "llama3 without low_freq_factor": ({"rope_type": "llama3", "factor": 8.0,
                                        "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64},
                                       "low_freq_factor"),
    "llama3 high <= low": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                           "high_freq_factor"),
    "partial rotary": ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
                       "partial_rotary_factor"),
    "per layer type": ({"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}},
                       "per-layer-type"),
}


@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("rope,msg", list(ROPE_REFUSED.values()), ids=list(ROPE_REFUSED))
def test_unsupported_rope_is_refused_by_name(tmp_path, layout, rope, msg):
    cfg = dict(without(BASE, "rope_theta"), **{layout: rope})
    with pytest.raises(ValueError, match=msg):
        ModelConfig.from_hf(cfg)
    with pytest.raises(ValueError, match=msg):
        dummy_llm(tmp_path, cfg)


@pytest.mark.parametrize("qcfg,method", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "'gptq'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "'awq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "'fp8'"),
    ({"bits": 4}, "quantization_config"),
])
def test_quantization_config_is_refused(tmp_path, qcfg, method):
    cfg = dict(BASE, quantization_config=qcfg)
    with pytest.raises(ValueError, match=f"quantization_config with quant_method {method}"
                       if method.startswith("'") else method):
        ModelConfig.from_hf(cfg)
    with pytest.raises(ValueError, match="quantization_config"):
        dummy_llm(tmp_path, cfg)


def test_quantized_folder_with_weights_is_refused(tmp_path):
    """A real checkpoint folder (weights present, plain load): refused before any tensor loads."""
    pytest.importorskip("transformers")
    from .utils import save_tiny_hf_model
    folder = tmp_path / "gptq"
    save_tiny_hf_model(folder, "qwen2", num_hidden_layers=1)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported"):
        LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=16)


def test_presets_are_validated_like_folders(monkeypatch):
    for name, cfg in presets.PRESETS.items():
        ModelConfig.from_hf(dict(cfg))   # every shipped preset is valid
    monkeypatch.setitem(presets.PRESETS, "broken", dict(presets.PRESETS["smollm2-135m"],
                                                        num_attention_heads=0))
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM("broken", load_format="dummy", skip_tokenizer_init=True, num_kv_blocks=16)


# ---- defaults: what transformers' config classes make of the same dict ----------------------

DEFAULTS = {
    "mistral, no sliding_window key": dict(BASE, architectures=["MistralForCausalLM"],
                                           model_type="mistral"),
    "mistral, sliding_window null": dict(BASE, architectures=["MistralForCausalLM"],
                                         model_type="mistral", sliding_window=None),
    "qwen2, window without use_sliding_window": dict(BASE, sliding_window=8),
    "qwen2, use_sliding_window, default max_window_layers": dict(
        BASE, use_sliding_window=True, sliding_window=8, num_hidden_layers=30),
    "qwen2, theta in both places": dict(BASE, rope_parameters={"rope_type": "default",
                                                               "rope_theta": 5e4}),
    "llama, no theta": dict(without(BASE, "rope_theta"), architectures=["LlamaForCausalLM"],
                            model_type="llama"),
    "llama3, original length defaulted": dict(
        BASE, architectures=["LlamaForCausalLM"], model_type="llama",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0}),
    "yarn, top-level original length wins": dict(
        BASE, original_max_position_embeddings=32,
        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 64}),
    "yarn, factor null": dict(BASE, rope_scaling={"type": "yarn", "factor": None,
                                                  "original_max_position_embeddings": 64}),
    "rope_scaling over rope_parameters": dict(
        BASE, rope_scaling={"rope_type": "linear", "factor": 2.0},
        rope_parameters={"rope_type": "linear", "factor": 5.0, "rope_theta": 1e6}),
}


@pytest.mark.parametrize("cfg", list(DEFAULTS.values()), ids=list(DEFAULTS))
def test_defaults_follow_transformers(cfg):
    transformers = pytest.importorskip("transformers")
    import math

    from pdserve.layers.rotary import rope_attention_factor
    hf = transformers.AutoConfig.for_model(cfg["model_type"], **without(cfg, "model_type"))
    ours = ModelConfig.from_hf(cfg)
    rope = hf.rope_parameters
    assert ours.rope_theta == rope["rope_theta"]
    if rope["rope_type"] == "default":
        assert ours.rope_scaling is None
    else:
        s = ours.rope_scaling
        assert s.rope_type == rope["rope_type"]
        # transformers resolves a yarn factor of null only when it computes the frequencies
        want = rope["factor"] or hf.max_position_embeddings / rope[
            "original_max_position_embeddings"]
        assert s.factor == want
        if s.rope_type in ("llama3", "yarn"):
            # its model code re-reads a top-level original length over the dict's
            hf.standardize_rope_params()
            assert s.original_max_position_embeddings == \
                hf.rope_parameters["original_max_position_embeddings"]
        if s.rope_type == "yarn":
            assert math.isclose(rope_attention_factor(s), 0.1 * math.log(want) + 1.0)
    if cfg["model_type"] == "mistral":
        want = tuple(range(cfg["num_hidden_layers"])) if hf.sliding_window is not None else ()
    elif cfg["model_type"] == "llama":   # no sliding window in Llama
        want = ()
    else:
        want = tuple(i for i, t in enumerate(hf.layer_types) if t == "sliding_attention")
    assert ours.sliding_layers == want
    assert ours.sliding_window == (hf.sliding_window if want else None)
