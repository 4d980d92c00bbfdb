"""Per-forward batch metadata, set for the duration of one forward and read by attention layers.

A batch is a flat run of T tokens from B sequences; decode rows (one new token) come first.

    tokens:          | d0 | d1 | p0 p0 p0 p0 | p1 p1 |         query_start_loc = [0, 1, 2, 6, 8]
    seq_lens:          ctx+1  ctx+1  ctx+4    ctx+2           (cached tokens + new tokens)
    slot_mapping[t] = block_table[pos // block_size] * block_size + pos % block_size

Tensors live on the model's device; under CUDA graphs they are the graph's static buffers and
the host-side lists are None.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64: where each new token's K/V is stored
    query_start_loc: torch.Tensor   # [B + 1] int32
    seq_lens: torch.Tensor          # [B] int32: context length after this step (cached + new)
    block_tables: torch.Tensor      # [B, max_blocks] int32, padded with the scratch block
    max_query_len: int              # upper bounds over the batch (static under CUDA graphs)
    max_seq_len: int
    num_decodes: int                # rows [0, num_decodes) have exactly one query token
    query_start_loc_host: list[int] | None = None
    seq_lens_host: list[int] | None = None


_CURRENT: AttentionMetadata | None = None


@contextmanager
def forward_context(meta: AttentionMetadata):
    global _CURRENT
    _CURRENT = meta
    try:
        yield
    finally:
        _CURRENT = None


def get_attention_metadata() -> AttentionMetadata:
    if _CURRENT is None:
        raise RuntimeError("attention called outside forward_context()")
    return _CURRENT
