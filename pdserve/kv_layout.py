"""The paged KV cache's layout, stated once (the model runner allocates it, the pool planner
sizes it, the workers report it, the KV pull copies slices of it):

    kv_cache[layer, 0 (K) | 1 (V), block, offset in block, KV head, head_dim]

A block id means the same slots in every layer, so a token takes, over the whole cache,
2 x layers x KV heads x head_dim elements. Under tensor parallelism each rank holds only its
KV heads (replicated when there are more ranks than heads): count the heads one rank holds.
Pure arithmetic: no imports, so every layer (kernels included) may use it.
"""


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of K and V one token takes over all layers, for `num_kv_heads` heads (the heads
    one rank holds, or the heads a copy moves) of `itemsize`-byte elements."""
    return 2 * num_layers * num_kv_heads * head_dim * itemsize
