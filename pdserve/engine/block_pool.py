"""BlockPool: owns the KV-cache block ids, their reference counts and the free list.

Pure Python, no torch. The free list is ordered (least recently freed first) and supports O(1)
removal of any block, which the prefix cache (roadmap) will use for LRU eviction.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Iterable, Sequence


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with ref count 1. Callers check num_free_blocks first."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        ids = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in ids:
            self.ref_counts[b] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        for b in ids:
            if self.ref_counts[b] == 0:
                raise RuntimeError(f"incref of free block {b}")
            self.ref_counts[b] += 1

    def release(self, ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching zero return to the free list."""
        for b in ids:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"release of free block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None

    def check_integrity(self, holders: Iterable[Sequence[int]]) -> None:
        """free + used = total, and every used block's ref count equals the number of holders
        (block tables) that list it. Raises AssertionError on the first violation."""
        held = Counter(b for table in holders for b in table)
        free = set(self._free)
        assert len(free) == len(self._free)
        assert len(free) + sum(1 for c in self.ref_counts if c > 0) == self.num_blocks, \
            "free + used != total"
        for b, c in enumerate(self.ref_counts):
            assert (c == 0) == (b in free), f"block {b}: ref count {c} but free={b in free}"
            assert c == held.get(b, 0), f"block {b}: ref count {c}, held by {held.get(b, 0)} tables"
