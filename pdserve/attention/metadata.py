"""Per-forward batch metadata, set for the duration of one forward and read by attention layers.

A batch is a flat run of T tokens from B sequences; decode rows (one new token) come first.

    tokens:          | d0 | d1 | p0 p0 p0 p0 | p1 p1 |         query_start_loc = [0, 1, 2, 6, 8]
    seq_lens:          ctx+1  ctx+1  ctx+4    ctx+2           (cached tokens + new tokens)
    slot_mapping[t] = block_table[pos // block_size] * block_size + pos % block_size
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64: where each new token's K/V is stored
    query_start_loc: list[int]      # [B + 1] token offsets of each sequence in the batch
    seq_lens: list[int]             # [B] context length after this step (cached + new)
    block_tables: torch.Tensor      # [B, max_blocks] int64, zero-padded
    num_decodes: int                # rows [0, num_decodes) have exactly one query token
    decode_seq_lens: torch.Tensor   # [num_decodes] int64 (device), for the batched decode path


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
