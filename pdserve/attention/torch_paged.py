"""Reference attention over the paged KV cache in plain torch: the CPU backend, and the
`--attention-backend torch` choice on GPU. Decode rows are batched into one call; prefill chunks
run one sequence at a time with a causal mask offset by their cached context (and, for a
sliding-window layer, cut below the window)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layers.rotary import apply_rope
from .base import AttentionBackend, register_backend
from .metadata import AttentionMetadata


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    _, _, _, hkv, d = kv_cache.shape
    kv_cache[0].view(-1, hkv, d).index_copy_(0, slots, k)
    kv_cache[1].view(-1, hkv, d).index_copy_(0, slots, v)


def gather_blocks(kv_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """K and V of the given blocks in one copy: [2, *blocks.shape, block_size, Hkv, D].
    (index_select is several times faster than advanced indexing for this on CPU.)"""
    out = kv_cache.index_select(1, blocks.reshape(-1))
    return out.view(2, *blocks.shape, *kv_cache.shape[2:])


@register_backend
class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, positions, cos_sin, kv_cache, meta: AttentionMetadata, scale,
                sliding_window=None):
        q, k = apply_rope(q, k, positions, cos_sin)
        store_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        block_size = kv_cache.shape[2]
        lens = meta.seq_lens_host
        if nd:
            blocks = meta.block_tables[:nd, : -(-max(lens[:nd]) // block_size)]
            kv = gather_blocks(kv_cache, blocks)
            kk, vv = kv[0].flatten(1, 2), kv[1].flatten(1, 2)  # [nd, L, Hkv, D]
            pos = torch.arange(kk.shape[1], device=q.device)[None, :]
            seen = pos < meta.seq_lens[:nd, None]             # the query sits at seq_len - 1
            if sliding_window is not None:
                seen &= pos >= meta.seq_lens[:nd, None] - sliding_window
            o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), kk.transpose(1, 2),
                                               vv.transpose(1, 2), attn_mask=seen[:, None, None, :],
                                               scale=scale, enable_gqa=True)
            out[:nd] = o.squeeze(2)
        qsl = meta.query_start_loc_host
        for i in range(nd, len(lens)):
            s, e, n = qsl[i], qsl[i + 1], lens[i]
            kv = gather_blocks(kv_cache, meta.block_tables[i, : -(-n // block_size)])
            kk, vv = kv[0].flatten(0, 1)[:n], kv[1].flatten(0, 1)[:n]
            out[s:e] = _attend(q[s:e], kk, vv, n - (e - s), scale, sliding_window)
        return out


def _attend(q, k, v, ctx: int, scale: float, window: int | None):
    """q: [n, H, D] new tokens at positions ctx..ctx+n-1; k, v: [ctx+n, Hkv, D]."""
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if ctx == 0 and window is None:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        n = q.shape[0]
        kpos = torch.arange(ctx + n, device=q.device)[None, :]
        qpos = torch.arange(n, device=q.device)[:, None] + ctx
        seen = kpos <= qpos
        if window is not None:
            seen &= kpos > qpos - window
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=seen, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)
