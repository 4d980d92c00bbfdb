"""ModelConfig: the architecture facts the model forward needs, read from an HF-style config dict.

from_hf reads config.json the way transformers 5 does for Llama, Mistral, Qwen2 and Qwen3 (dense),
including its defaults (checked against transformers 5.24): RoPE scaling from `rope_parameters` or
the older `rope_scaling`, and which layers use sliding-window attention. What pdserve cannot run
faithfully (quantized checkpoints, dynamic NTK, unknown rope types, mixture-of-experts models) is
refused with a ValueError rather than loaded as something else."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..layers.rotary import RopeScaling

# HF architecture name -> the HF model it follows. All share one forward (models/llama.py):
# Qwen2 adds the QKV bias; Qwen3 an RMSNorm over each q and k head (qk_norm), biases only with
# attention_bias (then on o_proj too, as Llama); Mistral, Qwen2 and Qwen3 may have sliding-window
# layers.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2",   # HF model -> our family
            "qwen3": "qwen3"}
# Known relatives whose forward differs (mixture-of-experts MLPs): refused by name.
_UNSUPPORTED = {"Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe"}

# transformers' config defaults for keys a config.json may leave out
_DEFAULT_THETA = 10000.0
_MISTRAL_DEFAULT_WINDOW = 4096
_QWEN2_DEFAULT_WINDOW = 4096
_QWEN2_DEFAULT_MAX_WINDOW_LAYERS = 28   # Qwen3Config's defaults are the same
_QWEN3_DEFAULT_HEAD_DIM = 128           # Qwen3Config.head_dim (not hidden / heads) when absent


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool            # q/k/v projections carry a bias
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Sliding-window layers: a token at position p attends to keys at positions > p - window (its
    # own and the window - 1 before it). None / () when every layer attends to the full context.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    o_proj_bias: bool = False       # the attention output projection carries a bias
    # Qwen3: RMSNorm (weights [head_dim], eps rms_norm_eps) over each head of q and of k, after the
    # projections and before RoPE
    qk_norm: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model config: {name} must be a positive integer, got {v!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v <= 0:
                raise ValueError(f"model config: {name} must be a positive number, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_attention_heads ({self.num_heads}) is not a multiple "
                             f"of num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"model config: rope_scaling must be a RopeScaling or None, got "
                             f"{type(self.rope_scaling).__name__}")
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "yarn" \
                and self.rope_theta <= 1:
            raise ValueError(f"model config: rope_theta must exceed 1 for yarn, got {self.rope_theta}")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"model config: sliding_window must be a positive integer or None, "
                             f"got {w!r}")
        if bool(self.sliding_layers) != (w is not None):
            raise ValueError("model config: sliding_window and sliding_layers must be given together "
                             f"(got window {w!r}, layers {self.sliding_layers!r})")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers) or \
                list(self.sliding_layers) != sorted(set(self.sliding_layers)):
            raise ValueError(f"model config: sliding_layers must be distinct increasing layer indices "
                             f"below {self.num_layers}, got {self.sliding_layers!r}")

    def window_of(self, layer: int) -> int | None:
        """The layer's sliding window (None: it attends to the whole context)."""
        return self.sliding_window if layer in self.sliding_layers else None

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        moe = next((a for a in archs if a in _UNSUPPORTED), None) or \
            (d.get("model_type") if d.get("model_type") in _UNSUPPORTED.values() else None)
        if moe is not None:
            raise ValueError(f"architecture {moe!r} (mixture of experts) is not supported; pdserve "
                             f"supports the dense {sorted(ARCHITECTURES)}")
        hf_model = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if hf_model is None:
            hf_model = d.get("model_type") if d.get("model_type") in FAMILIES else None
        if hf_model is None:
            raise ValueError(f"unknown architecture {archs or d.get('model_type')!r}; pdserve supports "
                             f"{sorted(ARCHITECTURES)}")
        _refuse_quantized(d)
        family = FAMILIES[hf_model]
        hidden = _int_field(d, "hidden_size")
        heads = _int_field(d, "num_attention_heads")
        num_layers = _int_field(d, "num_hidden_layers")
        max_pos = _int_field(d, "max_position_embeddings", 4096)
        head_dim = _int_field(d, "head_dim",
                              _QWEN3_DEFAULT_HEAD_DIM if hf_model == "qwen3" else None)
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"model config: hidden_size ({hidden}) is not a multiple of "
                                 f"num_attention_heads ({heads}) and head_dim is not given")
            head_dim = hidden // heads
        theta, scaling = _rope_from_hf(d, max_pos)
        window, sliding = _sliding_from_hf(d, hf_model, num_layers)
        eos = d.get("eos_token_id")
        return cls(
            architecture=family,
            vocab_size=_int_field(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int_field(d, "intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=_int_field(d, "num_key_value_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=_float_field(d, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(d.get("attention_bias", False)),
            # Llama and Qwen3 put attention_bias on o_proj too; Qwen2's o_proj never has one
            o_proj_bias=family != "qwen2" and bool(d.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            rope_scaling=scaling,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            sliding_window=window,
            sliding_layers=sliding,
        )

    def check_tensor_parallel(self, tp: int) -> None:
        """ValueError unless this model splits over `tp` ranks: query heads and MLP columns divide
        evenly; KV heads divide too, or (tp > KV heads) each KV head is replicated on tp / kv ranks."""
        if self.num_heads % tp:
            raise ValueError(f"the model's {self.num_heads} attention heads do not split over "
                             f"tensor_parallel_size {tp} (it must divide the head count)")
        kv = self.num_kv_heads
        if (kv % tp) if kv >= tp else (tp % kv):
            raise ValueError(f"the model's {kv} KV heads do not split over tensor_parallel_size "
                             f"{tp} (one must divide the other)")
        if self.intermediate_size % tp:
            raise ValueError(f"intermediate_size {self.intermediate_size} does not split over "
                             f"tensor_parallel_size {tp}")


_REQUIRED = object()


def _int_field(d: dict, key: str, default: Any = _REQUIRED, where: str = "model config", *,
               positive: bool = True) -> Any:
    """d[key] as an int, > 0 unless positive=False (a JSON null counts as absent, as
    transformers' configs treat it)."""
    v = d.get(key)
    if v is None:
        if default is _REQUIRED:
            raise ValueError(f"{where} is missing the field {key!r}")
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{where}: {key} must be an integer, got {v!r}")
    if positive and v < 1:
        raise ValueError(f"{where}: {key} must be a positive integer, got {v!r}")
    return v


def _float_field(d: dict, key: str, default: Any = _REQUIRED, where: str = "model config") -> Any:
    v = d.get(key)
    if v is None:
        if default is _REQUIRED:
            raise ValueError(f"{where} is missing the field {key!r}")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{where}: {key} must be a number, got {v!r}")
    return float(v)


def _refuse_quantized(d: dict) -> None:
    """A quantized HF folder would load its packed integer tensors as if they were weights (or fail
    on a name), so it is refused by name. (GGUF files are dequantized by their own loader.)"""
    for key in ("quantization_config", "compression_config"):
        q = d.get(key)
        if q:
            method = q.get("quant_method") if isinstance(q, dict) else None
            raise ValueError(f"{key} with quant_method {method!r} is not supported: pdserve loads "
                             "unquantized checkpoints only (or GGUF files, which it dequantizes)")


def _rope_from_hf(d: dict, max_pos: int) -> tuple[float, RopeScaling | None]:
    """(theta, scaling), as transformers 5 standardizes them: a truthy legacy `rope_scaling` dict
    replaces `rope_parameters`; theta comes from that dict, else the top-level `rope_theta`, else
    10000; the type from `rope_type`, else the legacy `type`, else "default"."""
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"model config: rope_parameters must be a dict, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("model config: per-layer-type rope_parameters (a dict of dicts) are not "
                         "supported")
    theta = params.get("rope_theta")
    if theta is None:
        theta = d.get("rope_theta")
    theta = _float_field({"rope_theta": theta}, "rope_theta", _DEFAULT_THETA)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    where = f"rope_parameters ({kind!r})"
    if kind == "dynamic":
        raise ValueError("rope type 'dynamic' is not supported: dynamic NTK scaling recomputes the "
                         "frequencies from the current sequence length, which a paged KV cache "
                         "holding keys rotated at earlier lengths cannot follow")
    if kind not in ("linear", "llama3", "yarn"):
        raise ValueError(f"rope type {kind!r} is not supported; pdserve supports default, linear, "
                         "llama3, yarn")
    prf = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if prf is not None and prf != 1.0:
        raise ValueError(f"model config: partial_rotary_factor {prf!r} is not supported with rope "
                         f"type {kind!r}")
    if kind == "linear":
        return theta, RopeScaling("linear", _float_field(params, "factor", where=where))
    # transformers takes a top-level original_max_position_embeddings over the dict's, and falls
    # back to max_position_embeddings
    orig = _int_field(d, "original_max_position_embeddings", None)
    if orig is None:
        orig = _int_field(params, "original_max_position_embeddings", max_pos, where)
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3", _float_field(params, "factor", where=where), orig,
            low_freq_factor=_float_field(params, "low_freq_factor", where=where),
            high_freq_factor=_float_field(params, "high_freq_factor", where=where))
    # yarn: "factor" must be present; an explicit null means max_position / original length
    if "factor" not in params:
        raise ValueError(f"{where} is missing the field 'factor'")
    factor = _float_field(params, "factor", max_pos / orig, where)
    attn = _float_field(params, "attention_factor", None, where)
    if attn is None:
        mscale = _float_field(params, "mscale", None, where)
        mscale_all = _float_field(params, "mscale_all_dim", None, where)
        if mscale and mscale_all:
            attn = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attn = _yarn_mscale(factor)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"{where}: truncate must be true or false, got {truncate!r}")
    # `or`: transformers treats a 0 or null beta as unset
    return theta, RopeScaling(
        "yarn", factor, orig,
        beta_fast=_float_field(params, "beta_fast", None, where) or 32.0,
        beta_slow=_float_field(params, "beta_slow", None, where) or 1.0,
        attention_factor=attn, truncate=truncate)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _sliding_from_hf(d: dict, hf_model: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, sliding layer indices) as transformers 5 builds them.

    Mistral: every layer, when sliding_window is set (absent means 4096, MistralConfig's default;
    null means off). Qwen2 and Qwen3: only with use_sliding_window; the layers marked
    "sliding_attention" in layer_types, or when layer_types is absent the layers
    i >= max_window_layers. Llama: never."""
    if hf_model == "mistral":
        window = _int_field(d, "sliding_window", None) if "sliding_window" in d \
            else _MISTRAL_DEFAULT_WINDOW
        return (None, ()) if window is None else (window, tuple(range(num_layers)))
    if hf_model not in ("qwen2", "qwen3"):
        return None, ()
    # Qwen2Config (and Qwen3Config) drops sliding_window unless use_sliding_window is set
    window = None
    if d.get("use_sliding_window", False):
        window = _int_field(d, "sliding_window", None) if "sliding_window" in d \
            else _QWEN2_DEFAULT_WINDOW
    types = d.get("layer_types")
    if types is None:
        first = _int_field(d, "max_window_layers", _QWEN2_DEFAULT_MAX_WINDOW_LAYERS,
                           positive=False)
        sliding = tuple(range(max(first, 0), num_layers)) if window is not None else ()
    else:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ValueError(f"model config: layer_types must list one type per layer "
                             f"({num_layers}), got {types!r}")
        bad = sorted({t for t in types if t not in ("full_attention", "sliding_attention")}, key=str)
        if bad:
            raise ValueError(f"model config: layer_types {bad!r} are not supported (only "
                             "full_attention and sliding_attention)")
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if sliding and window is None:
            raise ValueError("model config: layer_types has sliding_attention layers but "
                             "sliding_window is not set (or use_sliding_window is false)")
    return (window, sliding) if sliding else (None, ())
