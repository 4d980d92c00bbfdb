"""ModelConfig: the architecture facts the model forward needs, read from an HF-style config dict."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF architecture name -> our family name. Both families share one forward (models/llama.py);
# Qwen2 differs only by the QKV bias.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


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
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = field(default=None, compare=False)
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"model config: {name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_attention_heads ({self.num_heads}) is not a multiple "
                             f"of num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            mt = d.get("model_type")
            family = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}.get(mt)
        if family is None:
            raise ValueError(f"unknown architecture {archs or d.get('model_type')!r}; pdserve supports "
                             f"{sorted(ARCHITECTURES)}")
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            eos = d.get("eos_token_id")
            return cls(
                architecture=family,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta")
                                 or (d.get("rope_parameters") or {}).get("rope_theta") or 10000.0),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=family == "qwen2" or bool(d.get("attention_bias", False)),
                rope_scaling=d.get("rope_scaling"),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            )
        except KeyError as e:
            raise ValueError(f"model config is missing the field {e.args[0]!r}") from None

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

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache elements per token over all layers (multiply by the dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim
