"""The attention-backend seam: the model hands one backend the projected q, k, v of the batch's
new tokens; the backend applies RoPE, stores k/v into the paged cache and attends over cached
context plus the new tokens."""
from __future__ import annotations

import abc

import torch

from .metadata import AttentionMetadata


class AttentionBackend(abc.ABC):
    """Contract: `forward` rotates q and k by RoPE at `positions` (cos_sin: [max_pos, D] float32,
    cos in the first half, sin in the second, rotate-half pairing), writes k and v into
    `kv_cache` at `meta.slot_mapping`, then returns, for every query token, softmax(q·Kᵀ·scale)·V
    over that sequence's cached tokens and its new tokens up to and including itself (causal);
    with `sliding_window` W (None: no window) a token at position p sees only keys at positions
    > p - W (itself and the W - 1 before it), the layer's own setting, constant for a model.
    q: [T, H, D]; k, v: [T, Hkv, D] (possibly strided views) with H a multiple of Hkv;
    kv_cache: [2, num_blocks, block_size, Hkv, D]. It must not touch cache slots outside the
    batch's slot mapping, and must not read host copies of device data when
    `meta.query_start_loc_host` is None (CUDA-graph capture)."""

    name: str
    supports_cuda_graphs: bool = False

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                cos_sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None) -> torch.Tensor: ...


_REGISTRY: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _REGISTRY[cls.name] = cls
    return cls


def get_backend(name: str) -> AttentionBackend:
    from . import torch_paged  # noqa: F401  (registers the reference backend)
    if name == "triton":
        from . import triton_paged  # noqa: F401  (imports triton only when asked for)
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; available: torch, triton")
    return _REGISTRY[name]()
