"""What moves between a producer (prefill) and a consumer (decode) worker, and which KV heads a
consumer rank takes from which producer rank.

A request's KV lives in blocks; both sides hold it at the same token positions, so moving it is
a block-to-block copy in every layer, in table order:

    producer table  [ 7,  3,  9]     tokens 0..15 | 16..31 | 32..37      block_size 16
                      |   |   |
    consumer table  [ 2, 11,  5]     same positions, the consumer's own blocks

KV cache layout on every rank (see ModelRunner): [layers, 2 (k, v), blocks, block_size,
local KV heads, head_dim]. Under tensor parallelism each rank holds the KV heads
layers.linear.kv_head_range gives it (the split QKVParallelLinear shards by): a range, or one
replicated head when tp > KV heads. With different TP on the two sides a consumer rank gathers
its heads from every producer rank that holds some of them:

    4 KV heads   producer tp=2: rank 0 [h0 h1]   rank 1 [h2 h3]
                 consumer tp=4: rank 0 [h0] <- p0   rank 1 [h1] <- p0   rank 2 [h2] <- p1 ...
                 consumer tp=1: rank 0 [h0 h1 h2 h3] <- p0 (h0 h1) + p1 (h2 h3)
    2 KV heads   producer tp=4: rank 0 [h0] rank 1 [h0] rank 2 [h1] rank 3 [h1]  (replicated)
                 consumer tp=1: rank 0 [h0 h1] <- p0 (h0) + p2 (h1)   (the first holder)
"""
from __future__ import annotations

from typing import NamedTuple

from ...layers.linear import kv_head_range


class HeadCopy(NamedTuple):
    src_rank: int      # producer rank to read from
    src_heads: slice   # local head range there
    dst_heads: slice   # local head range here


def plan_head_copies(num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[HeadCopy]:
    """How consumer rank dst_rank fills its heads: runs of consecutive heads held by one producer
    rank (the first rank holding a head when heads are replicated)."""
    mine = kv_head_range(dst_rank, dst_tp, num_kv_heads)
    holder: dict[int, tuple[int, int]] = {}  # head -> (producer rank, local index)
    for r in range(src_tp):
        rng = kv_head_range(r, src_tp, num_kv_heads)
        for i, h in enumerate(rng):
            holder.setdefault(h, (r, i))
    plan: list[HeadCopy] = []
    for j, h in enumerate(mine):
        r, i = holder[h]
        last = plan[-1] if plan else None
        if last is not None and last.src_rank == r and last.src_heads.stop == i \
                and last.dst_heads.stop == j:
            plan[-1] = HeadCopy(r, slice(last.src_heads.start, i + 1),
                                slice(last.dst_heads.start, j + 1))
        else:
            plan.append(HeadCopy(r, slice(i, i + 1), slice(j, j + 1)))
    return plan
