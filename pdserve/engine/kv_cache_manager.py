"""KVCacheManager: per-request block tables over a BlockPool, slot allocation, fork and
copy-on-write. Pure Python.

A request's token at position p lives in block table[p // block_size], offset p % block_size:

    positions   0 ........ 15 | 16 ........ 31 | 32 .. 37
    table       [   b7        ,     b2         ,  b9      ]      block_size = 16
    slot(p)     = table[p // 16] * 16 + p % 16

Forking (n > 1) shares every block of the parent; the first write into a shared block copies it
first (copy-on-write), and the copy is returned for the model runner to execute.

With a prefix cache (prefix_cache.py), a new request's table starts as the blocks of its longest
cached prefix (match_prefix), a finished or preempted request's computed tokens go into the cache
(free(id, tokens)), and a pool short of blocks evicts cached ones before it fails. This class is
the one place where the cache's references and the requests' references meet: the pool's count
of a block = the tables that list it + the cache nodes that list it.
"""
from __future__ import annotations

from typing import NamedTuple

from .block_pool import BlockPool
from .prefix_cache import Node, PrefixCache


class BlockCopy(NamedTuple):
    src: int
    dst: int


class KVMoves(NamedTuple):
    """One step's copies between the device pool and the host tier (the runner runs every
    to_host copy, then every to_device copy, beside the step's forward; tier_contract)."""
    to_host: list[tuple[int, int]]     # (device block, host block): copy device -> host
    to_device: list[tuple[int, int]]   # (host block, device block): copy host -> device


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.prefix_cache = PrefixCache(self.pool, block_size) if enable_prefix_caching else None
        # request -> (the cache node its prefix matched, the matched length): locked while the
        # request lives; its insert at the end resumes from there (PrefixCache.insert's known)
        self._locked: dict[str, tuple[Node, int]] = {}
        self.prefix_queries = 0                 # tokens looked up in the cache (metrics)
        self.prefix_hits = 0                    # of them, found

    def match_prefix(self, request_id: str, tokens: list[int], limit: int,
                     whole_blocks: bool = False) -> int:
        """A request without blocks: start its table with the blocks of the longest cached
        prefix of tokens[:limit] (shared, copied on write). Returns the matched length.
        whole_blocks: only the fully matched blocks (the length rounded down to a block), for a
        table whose remaining blocks are written whole (a P/D consumer pulling the rest)."""
        if self.prefix_cache is None or request_id in self.block_tables:
            return 0
        m = self.prefix_cache.match(tokens, limit)
        n = m.num_tokens - m.num_tokens % self.block_size if whole_blocks else m.num_tokens
        self.prefix_queries += len(tokens)
        self.prefix_hits += n
        if n == 0:
            return 0
        blocks = m.blocks[: self.blocks_for(n)]
        self.pool.incref(blocks)
        self.block_tables[request_id] = list(blocks)
        self.prefix_cache.lock(m.node)
        self._locked[request_id] = (m.node, m.num_tokens)
        return n

    def _make_room(self, n: int) -> bool:
        """At least n free blocks, evicting cached ones if needed."""
        short = n - self.pool.num_free_blocks
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        return n <= self.pool.num_free_blocks

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
        if not self._make_room(grow + len(cow)) and request_id in self._locked:
            # Its own match may be what holds the room: copying the matched partial block on
            # write needs a block that only evicting that match frees (then nothing needs a copy).
            self._unlock(request_id)
            self._make_room(grow + len(cow))
            cow = self._shared_in_range(table, num_computed, end)
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

    def free(self, request_id: str, tokens: list[int] = ()) -> None:
        """Give back a request's blocks. `tokens`: the positions [0, len) whose KV its blocks
        hold (computed, or being computed by a step in flight), kept by the prefix cache."""
        table = self.block_tables.pop(request_id, None)
        try:
            if table and tokens and self.prefix_cache is not None:
                self.prefix_cache.insert(tokens, table, self._locked.get(request_id))
        finally:   # (a bad `tokens` raises in insert: the blocks still go back)
            self._unlock(request_id)
            if table:   # in reverse, so the tail of a sequence is reused first
                self.pool.release(reversed(table))

    def _unlock(self, request_id: str) -> None:
        locked = self._locked.pop(request_id, None)
        if locked is not None:
            self.prefix_cache.unlock(locked[0])

    def detach(self, request_id: str, tokens: list[int] = ()) -> list[int]:
        """Take a request's table out of the manager with its blocks still allocated: the caller
        owns them now (P/D: kept for a consumer) and gives them back with release(). `tokens`
        as for free(): the prefix cache keeps them too (the blocks are read-only from here)."""
        table = self.block_tables.get(request_id, [])
        if table and tokens and self.prefix_cache is not None:
            # (first: if it raises, nothing moved)
            self.prefix_cache.insert(tokens, table, self._locked.get(request_id))
        self._unlock(request_id)
        return self.block_tables.pop(request_id, [])

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix no request uses; returns the blocks freed."""
        return 0 if self.prefix_cache is None else self.prefix_cache.reset()

    @property
    def num_cached_blocks(self) -> int:
        """Blocks listed by the prefix cache (some may also be in requests' tables)."""
        return 0 if self.prefix_cache is None else self.prefix_cache.num_cached_blocks

    def release(self, table: list[int]) -> None:
        """Give back a detached table's blocks (tail first, as free() does)."""
        self.pool.release(reversed(table))

    def num_free_blocks(self) -> int:
        """Blocks no request holds: the pool's free list plus cached blocks only the prefix
        cache lists (evicted on demand). O(1)."""
        return self.pool.num_free_blocks + self.pool.num_cache_only

    def check_integrity(self, detached: list[list[int]] = ()) -> None:
        """Every allocated block is referenced exactly as often as the live tables, the
        detached ones the caller still owns and the prefix cache's nodes name it; the cache's
        structure holds and its locks are the live requests' matches."""
        cached: list[list[int]] = []
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
            cached = self.prefix_cache.holders()
            assert self.prefix_cache.root.lock == len(self._locked), "cache locks vs requests"
        assert set(self._locked) <= set(self.block_tables), "a lock without a table"
        self.pool.check_integrity([*self.block_tables.values(), *detached], cached)
