"""KVCacheManager: per-request block tables over a BlockPool, slot allocation, fork and
copy-on-write. Pure Python.

A request's token at position p lives in block table[p // block_size], offset p % block_size:

    positions   0 ........ 15 | 16 ........ 31 | 32 .. 37
    table       [   b7        ,     b2         ,  b9      ]      block_size = 16
    slot(p)     = table[p // 16] * 16 + p % 16

Forking (n > 1) shares every block of the parent; the first write into a shared block copies it
first (copy-on-write), and the copy is returned for the model runner to execute.
"""
from __future__ import annotations

from typing import NamedTuple

from .block_pool import BlockPool


class BlockCopy(NamedTuple):
    src: int
    dst: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _shared_in_range(self, table: list[int], start: int, end: int) -> list[int]:
        """Indices into `table` of blocks that positions [start, end) write and others share."""
        first, last = start // self.block_size, min(len(table), self.blocks_for(end))
        return [i for i in range(first, last) if self.pool.ref_counts[table[i]] > 1]

    def allocate_slots(self, request_id: str, num_computed: int, num_new: int) -> list[BlockCopy] | None:
        """Make room for positions [num_computed, num_computed + num_new). Returns the block
        copies to perform before the forward (possibly empty), or None if the pool is short (then
        nothing changed)."""
        table = self.block_tables.setdefault(request_id, [])
        end = num_computed + num_new
        # Fast path (every decode step): the writes fit in the last block, which nobody shares.
        if (table and end <= len(table) * self.block_size
                and num_computed >= (len(table) - 1) * self.block_size
                and self.pool.ref_counts[table[-1]] == 1):
            return []
        cow = self._shared_in_range(table, num_computed, end)
        grow = max(0, self.blocks_for(end) - len(table))
        if grow + len(cow) > self.pool.num_free_blocks:
            if not table:
                del self.block_tables[request_id]
            return None
        copies = []
        if cow:
            fresh = self.pool.allocate(len(cow))
            for i, dst in zip(cow, fresh):
                copies.append(BlockCopy(table[i], dst))
                self.pool.release([table[i]])
                table[i] = dst
        table.extend(self.pool.allocate(grow))
        return copies

    def fork(self, parent_id: str, child_id: str) -> None:
        table = self.block_tables[parent_id]
        self.pool.incref(table)
        self.block_tables[child_id] = list(table)

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        if table:
            # Release in reverse so the tail of a sequence is reused first (roadmap: prefix cache
            # keeps the head longest).
            self.pool.release(reversed(table))

    def detach(self, request_id: str) -> list[int]:
        """Take a request's table out of the manager with its blocks still allocated: the caller
        owns them now (P/D: kept for a consumer) and gives them back with release()."""
        return self.block_tables.pop(request_id, [])

    def release(self, table: list[int]) -> None:
        """Give back a detached table's blocks (tail first, as free() does)."""
        self.pool.release(reversed(table))

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def check_integrity(self, detached: list[list[int]] = ()) -> None:
        """Every allocated block is referenced exactly as often as the live tables, plus the
        detached ones the caller still owns, name it."""
        self.pool.check_integrity([*self.block_tables.values(), *detached])
