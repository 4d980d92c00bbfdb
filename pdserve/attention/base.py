"""The attention-backend seam: the model calls one backend, which stores the new K/V into the
paged cache and attends over cached context plus the new tokens."""
from __future__ import annotations

import abc

import torch

from .metadata import AttentionMetadata


class AttentionBackend(abc.ABC):
    """Contract: `forward` writes k/v of the batch's new tokens into `kv_cache` at
    `meta.slot_mapping`, then returns, for every query token, softmax(q·Kᵀ·scale)·V over that
    sequence's cached tokens and its new tokens up to and including itself (causal). q: [T, H, D];
    k, v: [T, Hkv, D] with H a multiple of Hkv (grouped-query); kv_cache: [2, num_blocks,
    block_size, Hkv, D]. It must not touch cache slots outside the batch's block tables."""

    name: str

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


_REGISTRY: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _REGISTRY[cls.name] = cls
    return cls


def get_backend(name: str) -> AttentionBackend:
    from . import torch_paged  # noqa: F401  (registers the reference backend)
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()
