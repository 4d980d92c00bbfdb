"""Reference attention over the paged KV cache in plain torch: the CPU backend, and the
`--attention-backend torch` choice on GPU. Decode rows are batched into one call; prefill chunks
run one sequence at a time with a causal mask offset by their cached context."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttentionBackend, register_backend
from .metadata import AttentionMetadata


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    _, _, _, hkv, d = kv_cache.shape
    kv_cache[0].view(-1, hkv, d).index_copy_(0, slots, k)
    kv_cache[1].view(-1, hkv, d).index_copy_(0, slots, v)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int):
    """K and V of one sequence's first `length` tokens: [length, Hkv, D] each."""
    block_size = kv_cache.shape[2]
    kv = gather_blocks(kv_cache, block_table[: -(-length // block_size)])
    return kv[0].flatten(0, 1)[:length], kv[1].flatten(0, 1)[:length]


def gather_blocks(kv_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """K and V of the given blocks in one copy: [2, *blocks.shape, block_size, Hkv, D].
    (index_select is several times faster than advanced indexing for this on CPU.)"""
    out = kv_cache.index_select(1, blocks.reshape(-1))
    return out.view(2, *blocks.shape, *kv_cache.shape[2:])


@register_backend
class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float):
        store_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, scale)
        qsl, lens = meta.query_start_loc, meta.seq_lens
        for i in range(nd, len(lens)):
            s, e = qsl[i], qsl[i + 1]
            kk, vv = gather_kv(kv_cache, meta.block_tables[i], lens[i])
            out[s:e] = _attend(q[s:e], kk, vv, lens[i] - (e - s), scale)
        return out

    @staticmethod
    def _decode(q, kv_cache, meta: AttentionMetadata, scale: float):
        nd = meta.num_decodes
        block_size = kv_cache.shape[2]
        max_len = max(meta.seq_lens[:nd])
        blocks = meta.block_tables[:nd, : -(-max_len // block_size)]
        kv = gather_blocks(kv_cache, blocks)
        k, v = kv[0].flatten(1, 2), kv[1].flatten(1, 2)  # [nd, L, Hkv, D]
        pos = torch.arange(k.shape[1], device=q.device)
        mask = (pos[None, :] < meta.decode_seq_lens[:, None])[:, None, None, :]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(2)


def _attend(q, k, v, ctx: int, scale: float):
    """q: [n, H, D] new tokens at positions ctx..ctx+n-1; k, v: [ctx+n, Hkv, D]."""
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if ctx == 0:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        n = q.shape[0]
        mask = torch.arange(ctx + n, device=q.device)[None, :] <= (
            torch.arange(n, device=q.device)[:, None] + ctx)
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)
