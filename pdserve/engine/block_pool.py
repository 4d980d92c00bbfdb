"""BlockPool: owns the KV-cache block ids, their reference counts and the free list.

Pure Python, no torch. The free list is ordered (least recently freed first) and supports O(1)
removal of any block.

A block's count is split by holder kind: `cache_refs[b]` of its `ref_counts[b]` references are
the prefix cache's (incref / release with cached=True). A block whose references are all the
cache's is *cache-only*: no request uses it, and evicting it gives it back. The pool keeps the
number of those (num_cache_only) as the counts change, so the engine's free-block figure costs
O(1) per step.

The same class serves both tiers of the KV cache: the device pool and, with a host tier, the host
pool (kv_cache_manager.py). A block copied between the tiers in a step (a KVMoves source or
destination) is *busy* until the next step: the copies run on their own stream beside the step's
forward, so a release of a busy block is deferred (its reference stays counted) until flush(),
which the scheduler calls at the start of the next schedule(). A block is thus never given out
again in the step that copies it.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Iterable, NamedTuple, Sequence


class KVMoves(NamedTuple):
    """One step's copies between the tiers (kv_cache_manager.py re-exports it): the runner runs
    every to_host copy, then every to_device copy, beside the step's forward."""
    to_host: list[tuple[int, int]]     # (device block, host block): copy device -> host
    to_device: list[tuple[int, int]]   # (host block, device block): copy host -> device


def host_runs(host_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first index, first host id, length) of each run of consecutive host ids in host_ids: a
    copy of one run is one DMA (the host tier's copy engine, worker/kv_host_tier.py)."""
    runs = []
    i = 0
    n = len(host_ids)
    while i < n:
        j = i + 1
        while j < n and host_ids[j] == host_ids[j - 1] + 1:
            j += 1
        runs.append((i, host_ids[i], j - i))
        i = j
    return runs


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.cache_refs = [0] * num_blocks      # of ref_counts, the prefix cache's references
        self.num_cache_only = 0                 # blocks with 0 < ref_counts == cache_refs
        self.num_allocated = 0                  # blocks given out since start (demand per step)
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._busy: set[int] = set()                    # copied between tiers this step
        self._deferred: list[tuple[int, bool]] = []     # (block, cached): releases of busy blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int, cached: bool = False) -> list[int]:
        """n fresh blocks with ref count 1 (cached: the prefix cache's reference). Callers check
        num_free_blocks first."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        ids = [self._free.popitem(last=False)[0] for _ in range(n)]
        self.num_allocated += n
        for b in ids:
            self.ref_counts[b] = 1
        if cached:
            for b in ids:
                self.cache_refs[b] = 1
            self.num_cache_only += n
        return ids

    # ---- moves between tiers: busy blocks and deferred releases ---------------------------
    def mark_busy(self, ids: Iterable[int]) -> None:
        """These (allocated) blocks are copied between tiers this step: a release of one of them
        waits for flush()."""
        self._busy.update(ids)

    def is_busy(self, b: int) -> bool:
        return b in self._busy

    def any_busy(self, ids: Iterable[int]) -> bool:
        busy = self._busy
        return bool(busy) and any(b in busy for b in ids)

    def flush(self) -> None:
        """A new step: the previous step's copies are ordered before anything it schedules
        (the runner's contract), so its busy blocks may be given out again: apply the deferred
        releases, in the order they were asked for."""
        deferred, self._deferred = self._deferred, []
        self._busy.clear()
        for b, cached in deferred:
            self.release((b,), cached)

    @property
    def num_arriving(self) -> int:
        """Blocks that flush() will put on the free list (all their references are deferred)."""
        if not self._deferred:
            return 0
        pending = Counter(b for b, _ in self._deferred)
        return sum(1 for b, n in pending.items() if self.ref_counts[b] == n)

    def incref(self, ids: Iterable[int], cached: bool = False) -> None:
        """One more reference to each (allocated) block; cached: the prefix cache's."""
        rc, cc = self.ref_counts, self.cache_refs
        if cached:     # (a block stays cache-only or not: both counts grow)
            for b in ids:
                if rc[b] == 0:
                    raise RuntimeError(f"incref of free block {b}")
                rc[b] += 1
                cc[b] += 1
            return
        for b in ids:
            c = rc[b]
            if c == 0:
                raise RuntimeError(f"incref of free block {b}")
            if c == cc[b]:             # was cache-only: a request uses it now
                self.num_cache_only -= 1
            rc[b] = c + 1

    def release(self, ids: Iterable[int], cached: bool = False) -> None:
        """Drop one reference to each block (cached: one of the prefix cache's); blocks reaching
        zero return to the free list."""
        rc, cc, free = self.ref_counts, self.cache_refs, self._free
        if self._busy:
            ids = list(ids)
            if any(b in self._busy for b in ids):
                for b in ids:   # (checked as release() would, now: a bad release fails here)
                    if (cc[b] <= 0) if cached else (rc[b] <= cc[b]):
                        raise RuntimeError(f"release of block {b}, which is not held that way")
                self._deferred.extend((b, cached) for b in ids if b in self._busy)
                ids = [b for b in ids if b not in self._busy]
        if cached:
            for b in ids:
                if cc[b] <= 0:
                    raise RuntimeError(f"cached release of block {b}, which the cache does not hold")
                rc[b] -= 1
                cc[b] -= 1
                if rc[b] == 0:         # it was cache-only (1 == 1): now free
                    free[b] = None
                    self.num_cache_only -= 1
            return
        for b in ids:
            c = rc[b]
            if c <= cc[b]:
                raise RuntimeError(f"release of free block {b}" if c <= 0 else
                                   f"release of block {b}, which only the prefix cache holds")
            rc[b] = c = c - 1
            if c == 0:
                free[b] = None
            elif c == cc[b]:           # the last request let go: only the cache holds it
                self.num_cache_only += 1

    def check_integrity(self, holders: Iterable[Sequence[int]],
                        cached: Iterable[Sequence[int]] = ()) -> None:
        """free + used = total; every used block's ref count equals the number of holders
        (block tables) and cached holders (prefix-cache nodes) that list it, its cache_refs the
        cached ones (deferred releases count as the holders they were); num_cache_only counts the
        blocks only the cache holds; a deferred block is busy. Raises AssertionError on the first
        violation."""
        in_cache = Counter(b for table in cached for b in table)
        in_cache.update(b for b, c in self._deferred if c)
        held = Counter(b for table in holders for b in table) + in_cache
        held.update(b for b, c in self._deferred if not c)
        assert all(b in self._busy for b, _ in self._deferred), "a deferred release of an idle block"
        free = set(self._free)
        assert len(free) == len(self._free)
        assert len(free) + sum(1 for c in self.ref_counts if c > 0) == self.num_blocks, \
            "free + used != total"
        for b, c in enumerate(self.ref_counts):
            assert (c == 0) == (b in free), f"block {b}: ref count {c} but free={b in free}"
            assert c == held.get(b, 0), f"block {b}: ref count {c}, held by {held.get(b, 0)} tables"
            assert self.cache_refs[b] == in_cache.get(b, 0), \
                f"block {b}: {self.cache_refs[b]} cache references, the cache lists it {in_cache.get(b, 0)} times"
        only = sum(1 for b, c in enumerate(self.ref_counts) if c > 0 and c == self.cache_refs[b])
        assert self.num_cache_only == only, f"num_cache_only {self.num_cache_only}, counted {only}"
