"""CUDAGraphRunner: decode-only forwards captured once per batch-size bucket and replayed.

Every captured graph reads the same static, named buffers (GraphBuffers); a step copies its batch
into the first B rows and pads the bucket with rows that write into the scratch block and attend
only to it, so padding never touches a live sequence's cache. All graphs share one memory pool.
Logits and sampling run after the replay, on the rows that matter.

Graphs are captured per (context tier, batch bucket): the attention kernel sizes its split-K
grid from the captured max_seq_len, so a batch of short sequences replays a graph captured for a
short bound (no split-K, no reduce pass) instead of one sized for max_model_len.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.metadata import AttentionMetadata, forward_context


SHORT_CONTEXT = 511  # below 512 keys the attention kernel runs without split-K


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, 513, 8))
    return [s for s in sizes if s <= max_batch] or [1]


@dataclass
class GraphBuffers:
    input_ids: torch.Tensor        # [max_batch] int64
    positions: torch.Tensor        # [max_batch] int64
    slot_mapping: torch.Tensor     # [max_batch] int64
    block_tables: torch.Tensor     # [max_batch, max_blocks_per_seq] int32
    seq_lens: torch.Tensor         # [max_batch] int32
    query_start_loc: torch.Tensor  # [max_batch + 1] int32, fixed 0..max_batch (one token per row)


class CUDAGraphRunner:
    def __init__(self, model, max_batch: int, max_blocks_per_seq: int, max_seq_len: int,
                 scratch_block: int, block_size: int, device: torch.device):
        self.model = model
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.tiers = sorted({min(SHORT_CONTEXT, max_seq_len), max_seq_len})
        self.scratch_slot = scratch_block * block_size
        n = self.max_batch
        self.buffers = GraphBuffers(
            input_ids=torch.zeros(n, dtype=torch.long, device=device),
            positions=torch.zeros(n, dtype=torch.long, device=device),
            slot_mapping=torch.full((n,), self.scratch_slot, dtype=torch.long, device=device),
            block_tables=torch.full((n, max_blocks_per_seq), scratch_block, dtype=torch.int32,
                                    device=device),
            seq_lens=torch.ones(n, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device))
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None

    def bucket(self, batch: int) -> int | None:
        return next((s for s in self.sizes if s >= batch), None)

    def tier(self, max_seq_len: int) -> int:
        return next(t for t in self.tiers if t >= max_seq_len)

    def _meta(self, bs: int, tier: int) -> AttentionMetadata:
        b = self.buffers
        return AttentionMetadata(slot_mapping=b.slot_mapping[:bs],
                                 query_start_loc=b.query_start_loc[:bs + 1],
                                 seq_lens=b.seq_lens[:bs], block_tables=b.block_tables[:bs],
                                 max_query_len=1, max_seq_len=tier, num_decodes=bs)

    @torch.inference_mode()
    def capture(self) -> None:
        b = self.buffers
        for tier in reversed(self.tiers):
            for bs in reversed(self.sizes):  # largest first: later graphs reuse its pool blocks
                meta = self._meta(bs, tier)
                with forward_context(meta):
                    self.model(b.input_ids[:bs], b.positions[:bs])  # warm-up (autotune, lazy init)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    with forward_context(meta):
                        self.outputs[tier, bs] = self.model(b.input_ids[:bs], b.positions[:bs])
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[tier, bs] = g
        torch.cuda.synchronize()

    def run(self, host: dict[str, torch.Tensor], batch: int, bs: int, max_seq_len: int
            ) -> torch.Tensor:
        """host: padded host tensors for `bs` rows (input_ids, positions, slot_mapping, seq_lens,
        block_tables [bs, nb]). Returns hidden states [batch, hidden] (a view into graph memory,
        valid until the next replay)."""
        b = self.buffers
        b.input_ids[:bs].copy_(host["input_ids"], non_blocking=True)
        b.positions[:bs].copy_(host["positions"], non_blocking=True)
        b.slot_mapping[:bs].copy_(host["slot_mapping"], non_blocking=True)
        b.seq_lens[:bs].copy_(host["seq_lens"], non_blocking=True)
        nb = host["block_tables"].shape[1]
        b.block_tables[:bs, :nb].copy_(host["block_tables"], non_blocking=True)
        key = (self.tier(max_seq_len), bs)
        self.graphs[key].replay()
        return self.outputs[key][:batch]

    def release(self) -> None:
        """Drop the graphs before the process group or the cache they reference goes away."""
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None
