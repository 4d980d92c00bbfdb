"""From a model spec (folder, .gguf, preset, or nothing) to a model with weights and a tokenizer.

    spec                       config from              weights from             tokenizer from
    None                       embedded SmolLM2 GGUF    the GGUF                 GGUF metadata
    path/to/x.gguf             GGUF metadata            the GGUF                 GGUF metadata
    HF folder                  config.json              *.safetensors / dummy    tokenizer.json
    HF repo id ("org/name")    the folder of its snapshot in the local Hugging Face cache
    preset name (dummy only)   models/presets.py        dummy                    none
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from ..attention.base import get_backend
from ..models.config import ModelConfig
from ..models.llama import LlamaForCausalLM
from ..models.presets import PRESETS
from .default_model import default_gguf_path


@dataclass(frozen=True)
class ModelSource:
    kind: str                   # "gguf" | "hf" | "preset"
    path: str | None
    hf_config: dict


def resolve_source(spec: str | None) -> ModelSource:
    if spec is None:
        spec = default_gguf_path()
    spec = os.fspath(spec)
    if spec in PRESETS:
        return ModelSource("preset", None, dict(PRESETS[spec]))
    if spec.endswith(".gguf") or os.path.isfile(spec):
        from .gguf_loader import load_gguf
        return ModelSource("gguf", spec, load_gguf(spec).config)
    if os.path.isdir(spec):
        cfg_path = os.path.join(spec, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"model folder {spec!r} has no config.json")
        try:
            with open(cfg_path) as f:
                return ModelSource("hf", spec, json.load(f))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
    from .hf_cache import cached_snapshot, hub_cache_dir, looks_like_repo_id
    if looks_like_repo_id(spec):
        snapshot = cached_snapshot(spec)
        if snapshot is not None:
            return resolve_source(snapshot)
        raise ValueError(f"model {spec!r} is not a file, a folder or a preset, and the Hugging "
                         f"Face cache ({hub_cache_dir()}) does not hold it; pdserve downloads "
                         f"nothing: fetch it first (huggingface-cli download {spec})")
    raise ValueError(f"model {spec!r} is neither a file, a folder nor a preset "
                     f"(presets: {', '.join(sorted(PRESETS))})")


class _LazyTensor:
    """A safetensors tensor not read yet: a TP rank's weight loader narrows it first and reads
    only its shard (valid while the file is open, i.e. during the loader call)."""

    def __init__(self, sl):
        self._sl = sl
        self.shape = torch.Size(sl.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        idx = [slice(None)] * len(self.shape)
        idx[dim] = slice(start, start + length)
        return self._sl[tuple(idx)]

    def __getitem__(self, idx) -> torch.Tensor:
        return self._sl[idx]


def _safetensors_weights(folder: str) -> Iterator[tuple[str, "_LazyTensor"]]:
    from safetensors import SafetensorError, safe_open
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model folder {folder!r} has no *.safetensors weights "
                         "(use load_format='dummy' for random weights)")
    for fname in files:
        try:
            with safe_open(os.path.join(folder, fname), framework="pt") as f:
                for name in f.keys():
                    yield name, _LazyTensor(f.get_slice(name))
        except SafetensorError as e:
            raise ValueError(f"cannot read {fname}: {e}") from None


def dummy_checkpoint(cfg: ModelConfig, seed: int, device: torch.device
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random weights as an HF-named checkpoint: every tensor drawn whole (unsharded), in a
    fixed order, on `device`, so any sharding of the same model sees the same values. Norms are
    1, everything else N(0, 0.02)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg.vocab_size, h))]
    for n in range(cfg.num_layers):
        pre = f"model.layers.{n}."
        shapes.append((pre + "input_layernorm.weight", (h,)))
        for proj, rows in (("q", cfg.num_heads * d), ("k", cfg.num_kv_heads * d),
                           ("v", cfg.num_kv_heads * d)):
            shapes.append((pre + f"self_attn.{proj}_proj.weight", (rows, h)))
            if cfg.attention_bias:
                shapes.append((pre + f"self_attn.{proj}_proj.bias", (rows,)))
        if cfg.qk_norm:
            shapes += [(pre + "self_attn.q_norm.weight", (d,)),
                       (pre + "self_attn.k_norm.weight", (d,))]
        shapes.append((pre + "self_attn.o_proj.weight", (h, cfg.num_heads * d)))
        if cfg.o_proj_bias:
            shapes.append((pre + "self_attn.o_proj.bias", (h,)))
        shapes += [(pre + "post_attention_layernorm.weight", (h,)),
                   (pre + "mlp.gate_proj.weight", (i, h)), (pre + "mlp.up_proj.weight", (i, h)),
                   (pre + "mlp.down_proj.weight", (h, i))]
    shapes.append(("model.norm.weight", (h,)))
    if not cfg.tie_word_embeddings:
        shapes.append(("lm_head.weight", (cfg.vocab_size, h)))
    for name, shape in shapes:
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, device=device)
        else:
            yield name, torch.randn(shape, generator=gen, device=device).mul_(0.02)


def load_model(source: ModelSource, load_format: str, dtype: torch.dtype, device: torch.device,
               attention_backend: str, seed: int) -> LlamaForCausalLM:
    cfg = ModelConfig.from_hf(source.hf_config)
    if source.kind == "preset" and load_format != "dummy":
        raise ValueError("a preset name has no weights here; pass load_format='dummy'")
    backend = get_backend(attention_backend)
    # Parameters are created in their final dtype on their final device (the RoPE table makes
    # itself float32); checkpoint tensors are cast and sharded by each parameter's loader.
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg, backend)
    finally:
        torch.set_default_dtype(old)
    if load_format == "dummy":
        weights = dummy_checkpoint(cfg, seed, device)
    elif source.kind == "gguf":
        from .gguf_loader import load_gguf
        weights = load_gguf(source.path).tensors()
    else:
        weights = _safetensors_weights(source.path)
    loaded = model.load_weights(weights)
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
    return model.eval()


def engine_tokenizer(config, source: ModelSource):
    """The tokenizer an engine with `config` uses: None with skip_tokenizer_init; else
    config.tokenizer's (an HF folder with tokenizer.json, a .gguf file, or a repo id in the
    local Hugging Face cache) or the model's, with config.chat_template (a file, or the template
    text) in place of its own. ValueError when one of them cannot be had."""
    if config.skip_tokenizer_init:
        return None
    from .tokenizer import tokenizer_from_spec
    tok = (tokenizer_from_spec(config.tokenizer) if config.tokenizer is not None
           else load_tokenizer(source))
    if config.chat_template is not None:
        tok.chat_template = read_chat_template(os.fspath(config.chat_template))
    return tok


def read_chat_template(spec: str) -> str:
    """A chat template from a file, or spec itself when it is Jinja text (vLLM's rule)."""
    if os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            return f.read()
    if "{{" in spec or "{%" in spec:
        return spec
    raise ValueError(f"chat_template {spec[:60]!r} is neither a file nor a Jinja template")


def load_tokenizer(source: ModelSource):
    from .tokenizer import Tokenizer
    if source.kind == "gguf":
        return Tokenizer.from_gguf_file(source.path)
    if source.kind == "hf":
        return Tokenizer.from_hf_dir(source.path)
    raise ValueError("a preset has no tokenizer; pass skip_tokenizer_init=True and token-id prompts")
