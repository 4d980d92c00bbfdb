"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral), Qwen2 (the same with QKV bias) and Qwen3
dense (per-head RMSNorm on q and k before RoPE), with per-layer sliding-window attention where the
config asks for it (Mistral, Qwen2, Qwen3),
written on torch ops. forward() takes tensors only; batch layout arrives through
attention.metadata.forward_context. The model never mentions ranks: the TP layers do."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..attention.base import AttentionBackend
from ..attention.metadata import get_attention_metadata
from ..layers.activation import SiluAndMul
from ..layers.linear import (MergedColumnParallelLinear, materialize, ParallelLMHead, QKVParallelLinear,
                             RowParallelLinear, VocabParallelEmbedding)
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from .config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 backend: AttentionBackend):
        super().__init__()
        self.layer_idx = layer_idx
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size,
                                        bias=cfg.o_proj_bias)
        # Qwen3: one RMSNorm over each head's head_dim values (weights shared by the heads)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.rotary = rotary
        self.backend = backend
        self.sliding_window = cfg.window_of(layer_idx)   # None: attends to the whole context
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, Hkv, D], bound by the runner

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
             self.num_kv_heads * self.head_dim], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:   # rows of [T * heads, head_dim] (a copy out of the fused qkv)
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(t, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(t, self.num_kv_heads, self.head_dim)
        o = self.backend.forward(q, k, v.view(t, self.num_kv_heads, self.head_dim), positions,
                                 self.rotary.cos_sin, self.kv_cache, get_attention_metadata(),
                                 self.scale, self.sliding_window)
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)
        self.act = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, idx, rotary, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, positions, x, residual):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fused parameter, shard id)
    stacked_params = [("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"),
                      ("v_proj", "qkv_proj", "v"), ("gate_proj", "gate_up_proj", 0),
                      ("up_proj", "gate_up_proj", 1)]

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                 cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, backend)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """kv_cache: [num_layers, 2, num_blocks, block_size, Hkv, D]; each layer gets its view."""
        for i, layer in enumerate(self.layers):
            layer.self_attn.kv_cache = kv_cache[i]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Takes HF-named tensors; returns the names of parameters that were loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            shard = None
            for frag, fused, sid in self.stacked_params:
                if f".{frag}." in name:
                    name, shard = name.replace(frag, fused), sid
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
            with torch.no_grad():
                loader = getattr(param, "weight_loader", None)
                if loader is None:
                    tensor = materialize(tensor)
                    if param.shape != tensor.shape:
                        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                         f"expected {tuple(param.shape)}")
                    param.data.copy_(tensor)
                else:
                    loader(param, tensor, shard)
            loaded.add(name)
        return loaded
