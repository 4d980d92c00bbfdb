"""StepInputs: the input tensors of one forward, staged on the host and uploaded asynchronously.

Every forward reads its inputs from the same static device buffers, eager or a CUDA-graph replay
(graphs capture these addresses), so there is one way to lay a batch out:

    tokens [3, max_tokens] int64:  input_ids | positions | slot_mapping
    meta   int32:                  query_start_loc [max_seqs + 1] | seq_lens [max_seqs]
                                   | block_tables [max_seqs, max_blocks] (row-major)

A step fills a host twin with numpy (pinned on CUDA; on CPU the twin is the buffer itself) and
uploads the first t_pad tokens of each row and the meta up to the last real table row
asynchronously (four copies, each of a contiguous pinned range). Padding to a graph's shape:

    tokens  | real tokens (T)               | pad: id 0, position 0, slot = scratch slot |  t_pad
    seqs    | real sequences (B)            | pad: q_len 0 (query_start_loc stays at T), seq_len 0 | b_pad

A padding sequence reads and writes nothing (the attention kernels skip q_len 0); a padding
token belongs to no sequence (attention leaves its row alone) and stores its K/V in the scratch
block, so padding never touches a live sequence's cache.

Two host twins alternate: with async scheduling the host stages step N+1 while step N's upload may
still wait in the stream, so a twin is refilled only after the upload that last read it has run
(an event each).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, chain

import numpy as np
import torch


def _round_up(x: int, k: int) -> int:
    return -(-x // k) * k


@dataclass
class StagedBatch:
    """The host-side facts of a staged batch (what the eager path's metadata and the caller need)."""
    num_tokens: int
    num_seqs: int
    query_start_loc: list[int]   # [num_seqs + 1], real sequences only
    seq_lens: list[int]          # [num_seqs]
    max_query_len: int
    max_seq_len: int


class _Twin:
    """One set of buffers: the device ones (or, on CPU, the only ones) or a pinned host copy."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device, pin: bool):
        self.q_off = 0
        self.s_off = _round_up(max_seqs + 1, 16)          # 64-byte aligned regions: the kernels
        self.t_off = self.s_off + _round_up(max_seqs, 16)  # specialise on pointer alignment
        self.tokens = torch.zeros(3, max_tokens, dtype=torch.long, device=device, pin_memory=pin)
        self.meta = torch.zeros(self.t_off + max_seqs * max_blocks, dtype=torch.int32,
                                device=device, pin_memory=pin)
        self.query_start_loc = self.meta[: max_seqs + 1]
        self.seq_lens = self.meta[self.s_off: self.s_off + max_seqs]
        self.block_tables = self.meta[self.t_off:].view(max_seqs, max_blocks)
        self.uploaded: torch.cuda.Event | None = None   # the last upload that read this twin
        if self.tokens.device.type == "cpu":   # numpy views: what a step fills
            self.np_tokens, self.np_qsl = self.tokens.numpy(), self.query_start_loc.numpy()
            self.np_seq_lens, self.np_tables = self.seq_lens.numpy(), self.block_tables.numpy()


class StepInputs:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, scratch_block: int,
                 block_size: int, device: torch.device):
        self.max_tokens = _round_up(max_tokens, 16)
        self.max_seqs = max_seqs
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        self.device = device
        self.dev = _Twin(self.max_tokens, max_seqs, max_blocks, device, pin=False)
        self.dev.tokens[2].fill_(self.scratch_slot)
        self.dev.block_tables.fill_(scratch_block)
        if device.type == "cuda":
            self._twins = [_Twin(self.max_tokens, max_seqs, max_blocks, "cpu", pin=True)
                           for _ in range(2)]
            for t in self._twins:
                t.tokens[2].fill_(self.scratch_slot)
                t.block_tables.fill_(scratch_block)
        else:
            self._twins = [self.dev]
        self._next = 0
        d = self.dev   # the views every forward reads
        self.input_ids, self.positions, self.slot_mapping = d.tokens[0], d.tokens[1], d.tokens[2]
        self.query_start_loc, self.seq_lens, self.block_tables = (d.query_start_loc, d.seq_lens,
                                                                  d.block_tables)

    def stage(self, chunks, t_pad: int | None = None, b_pad: int | None = None) -> StagedBatch:
        """Lays `chunks` (ScheduledChunks; decode rows first is usual, any order works) into the
        buffers, padded to t_pad tokens and b_pad sequences (default: no padding), and starts the
        upload. Returns the batch's host-side facts."""
        lens = [len(c.token_ids) for c in chunks]
        T, B = sum(lens), len(chunks)
        t_pad = T if t_pad is None else t_pad
        b_pad = B if b_pad is None else b_pad
        if not (T <= t_pad <= self.max_tokens and B <= b_pad <= self.max_seqs):
            raise ValueError(f"batch of {T} tokens / {B} sequences (padded to {t_pad} / {b_pad}) "
                             f"exceeds the step buffers ({self.max_tokens} / {self.max_seqs})")
        tw = self._twins[self._next]
        self._next = (self._next + 1) % len(self._twins)
        if tw.uploaded is not None:
            tw.uploaded.synchronize()   # (normally long done: two steps ago)
        tok, qsl, seq_lens, tables = tw.np_tokens, tw.np_qsl, tw.np_seq_lens, tw.np_tables
        bs = self.block_size

        starts = [c.start_pos for c in chunks]
        ends = [a + n for a, n in zip(starts, lens)]
        qsl_list = [0, *accumulate(lens)]
        qsl[:B + 1] = qsl_list
        qsl[B + 1:b_pad + 1] = T
        seq_lens[:B] = ends
        seq_lens[B:b_pad] = 0
        for i, c in enumerate(chunks):
            tables[i, :len(c.block_table)] = c.block_table
        if T == B:   # one token per sequence (decodes): per-row scalars, no expansion
            tok[0, :T] = [c.token_ids[0] for c in chunks]
            tok[1, :T] = starts
            tok[2, :T] = [c.block_table[p // bs] * bs + p % bs for c, p in zip(chunks, starts)]
        else:
            tok[0, :T] = list(chain.from_iterable(c.token_ids for c in chunks))
            rows = np.repeat(np.arange(B), lens)
            pos = np.arange(T, dtype=np.int64) + np.asarray(
                [a - q for a, q in zip(starts, qsl_list)], dtype=np.int64)[rows]
            tok[1, :T] = pos
            tok[2, :T] = tables[rows, pos // bs].astype(np.int64) * bs + pos % bs
        tok[0, T:t_pad] = 0
        tok[1, T:t_pad] = 0
        tok[2, T:t_pad] = self.scratch_slot

        if tw is not self.dev:
            d = self.dev
            # one copy per row: each a contiguous pinned range (a [3, t_pad] slice is not, and
            # torch would stage it through a pageable temporary and a strided device copy)
            for r in range(3):
                d.tokens[r, :t_pad].copy_(tw.tokens[r, :t_pad], non_blocking=True)
            end = tw.t_off + B * self.max_blocks   # (padding sequences read no table row)
            d.meta[:end].copy_(tw.meta[:end], non_blocking=True)
            tw.uploaded = torch.cuda.Event()
            tw.uploaded.record()
        return StagedBatch(T, B, qsl_list, ends, max(lens, default=0), max(ends, default=0))
