"""GPU attention backend: fused RoPE + KV store, then paged attention over the mixed batch, both
Triton kernels. Graph-safe: reads no host copies of device data."""
from __future__ import annotations

from ..kernels.paged_attention import paged_attention
from ..kernels.rope_store import rope_and_store_kv
from .base import AttentionBackend, register_backend
from .metadata import AttentionMetadata


@register_backend
class TritonPagedAttention(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def forward(self, q, k, v, positions, cos_sin, kv_cache, meta: AttentionMetadata, scale,
                sliding_window=None):
        q = rope_and_store_kv(q, k, v, positions, cos_sin, kv_cache[0], kv_cache[1],
                              meta.slot_mapping)
        return paged_attention(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens,
                               meta.query_start_loc, scale, max_query_len=meta.max_query_len,
                               max_seq_len=meta.max_seq_len, sliding_window=sliding_window)
