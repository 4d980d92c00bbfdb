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
    """Views into two packed device tensors, so a step uploads its inputs in two copies:
    tokens [3, max_batch] int64 = (input_ids, positions, slot_mapping) and
    meta [max_batch + max_batch * max_blocks] int32 = (seq_lens, block_tables row-major)."""
    tokens: torch.Tensor
    meta: torch.Tensor
    input_ids: torch.Tensor        # [max_batch] int64
    positions: torch.Tensor        # [max_batch] int64
    slot_mapping: torch.Tensor     # [max_batch] int64
    seq_lens: torch.Tensor         # [max_batch] int32
    block_tables: torch.Tensor     # [max_batch, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [max_batch + 1] int32, fixed 0..max_batch (one token per row)

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device, pin: bool) -> "GraphBuffers":
        tokens = torch.zeros(3, max_batch, dtype=torch.long, device=device, pin_memory=pin)
        meta = torch.zeros(max_batch * (1 + max_blocks), dtype=torch.int32, device=device,
                           pin_memory=pin)
        return cls(tokens, meta, tokens[0], tokens[1], tokens[2], meta[:max_batch],
                   meta[max_batch:].view(max_batch, max_blocks),
                   torch.arange(max_batch + 1, dtype=torch.int32, device=device))


class CUDAGraphRunner:
    def __init__(self, model, max_batch: int, max_blocks_per_seq: int, max_seq_len: int,
                 scratch_block: int, block_size: int, device: torch.device):
        self.model = model
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.tiers = sorted({min(SHORT_CONTEXT, max_seq_len), max_seq_len})
        self.scratch_slot = scratch_block * block_size
        self.block_size = block_size
        n = self.max_batch
        self.max_blocks = max_blocks_per_seq
        self.scratch_block = scratch_block
        self.buffers = GraphBuffers.allocate(n, max_blocks_per_seq, device, pin=False)
        # Pinned host twin: a step fills it with numpy and uploads it asynchronously.
        self.staging = GraphBuffers.allocate(n, max_blocks_per_seq, "cpu", pin=True)
        self.np_tokens = self.staging.tokens.numpy()
        self.np_seq_lens = self.staging.seq_lens.numpy()
        self.np_tables = self.staging.block_tables.numpy()
        self.buffers.slot_mapping.fill_(self.scratch_slot)
        self.buffers.block_tables.fill_(scratch_block)
        self.buffers.seq_lens.fill_(1)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None
        self._staged: torch.cuda.Event | None = None   # recorded after the last upload

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

    def run(self, chunks, bs: int, fix_inputs=None) -> torch.Tensor:
        """Replays the graph for `chunks` (decode rows, one token each) padded to `bs` rows.
        Returns hidden states [len(chunks), hidden] (graph memory, valid until the next replay).
        fix_inputs(input_ids): called on the staged device input_ids before the replay (async
        scheduling writes the previous step's sampled tokens there)."""
        n = len(chunks)
        if self._staged is not None:
            # async scheduling: the previous step's upload may still be queued behind a running
            # step; the host must not refill the pinned staging buffer before it has run
            self._staged.synchronize()
        tok, lens, tables = self.np_tokens, self.np_seq_lens, self.np_tables
        max_len = 1
        for i, c in enumerate(chunks):
            pos = c.start_pos
            tok[0, i] = c.token_ids[0]
            tok[1, i] = pos
            tables[i, : len(c.block_table)] = c.block_table
            tok[2, i] = c.block_table[pos // self.block_size] * self.block_size + pos % self.block_size
            lens[i] = pos + 1
            max_len = max(max_len, pos + 1)
        # padding rows: write to and attend to the scratch slot only
        tok[0, n:bs] = 0
        tok[1, n:bs] = 0
        tok[2, n:bs] = self.scratch_slot
        lens[n:bs] = 1
        tables[n:bs, 0] = self.scratch_block
        b, st = self.buffers, self.staging
        b.tokens[:, :bs].copy_(st.tokens[:, :bs], non_blocking=True)
        end = self.max_batch + bs * self.max_blocks
        b.meta[:end].copy_(st.meta[:end], non_blocking=True)
        self._staged = torch.cuda.Event()
        self._staged.record()
        if fix_inputs is not None:
            fix_inputs(b.input_ids[:n])
        key = (self.tier(max_len), bs)
        self.graphs[key].replay()
        return self.outputs[key][:n]

    def release(self) -> None:
        """Drop the graphs before the process group or the cache they reference goes away."""
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None
