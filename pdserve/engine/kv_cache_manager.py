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

A host tier (num_host_blocks > 0) adds a second BlockPool of host blocks, used two ways:
- swap preemption: swap_out(id, n) copies a request's computed blocks to fresh host blocks and
  gives its device blocks back; the request then holds a host table (host_tables) until
  swap_in(id) copies it back into fresh device blocks;
- prefix-cache offload: evicted cached prefixes move to the host and load back on a match
  (prefix_cache.py); with kv_offload_policy "write-through" they are copied when cached, by
  begin_step() (so the copies are that step's moves), and an eviction then frees at once.
Each copy is listed in this step's KVMoves (take_moves()); its source and destination blocks are
busy until the next step (begin_step()): their releases are deferred, so no block is given out
again in the step that copies it. A table that lists a busy block must not be read or written by
this step's forward (table_busy(): the scheduler runs such a request from the next step on).

    step N   swap_out(r):  to_host (d7 -> h2), (d3 -> h5)   d7, d3 released at N+1's begin_step
    step M   swap_in(r):   to_device (h2 -> d1), (h5 -> d9) r runs from M+1; h2, h5 freed at M+1

Offloading on eviction thus makes room one step late: evicting only when an allocation falls
short would make every request that needs room wait a step (and admission behind it), where
GPU-only caching drops the leaf and goes on. So at the end of each step's scheduling
offload_ahead() offloads least recently used leaves until the free blocks and those arriving
cover the most blocks one of the last OFFLOAD_AHEAD_STEPS steps took: the next step's room is
already there (the leaves are the ones that GPU-only caching would evict next).
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

from .block_pool import BlockPool, KVMoves
from .prefix_cache import Node, PrefixCache

__all__ = ["BlockCopy", "KVCacheManager", "KVMoves"]


class BlockCopy(NamedTuple):
    src: int
    dst: int


class KVCacheManager:
    OFFLOAD_AHEAD_STEPS = 8     # offload_ahead(): the steps whose largest demand it keeps ready

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_host_blocks: int = 0, kv_block_bytes: int = 0,
                 kv_offload_policy: str = "on-eviction"):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        if kv_block_bytes < 0:
            raise ValueError(f"kv_block_bytes must be >= 0, got {kv_block_bytes}")
        if kv_offload_policy not in ("on-eviction", "write-through"):
            raise ValueError("kv_offload_policy must be on-eviction or write-through, got "
                             f"{kv_offload_policy!r}")
        self.block_size = block_size
        self.kv_block_bytes = kv_block_bytes    # one block's KV on this rank (0: unknown)
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks > 0 else None
        self.block_tables: dict[str, list[int]] = {}
        self.host_tables: dict[str, list[int]] = {}    # swapped-out requests' host blocks
        self.prefix_cache = (PrefixCache(self.pool, block_size, self.host_pool, write_through=(
            kv_offload_policy == "write-through" and self.host_pool is not None))
                             if enable_prefix_caching else None)
        self._moves = KVMoves([], []) if self.prefix_cache is None else self.prefix_cache.moves
        self.blocks_swapped_out = 0             # counters since start (metrics)
        self.blocks_swapped_in = 0
        self.prefix_host_hits = 0               # of prefix_hits, tokens loaded from the host
        # request -> (the cache node its prefix matched, the matched length): locked while the
        # request lives; its insert at the end resumes from there (PrefixCache.insert's known)
        self._locked: dict[str, tuple[Node, int]] = {}
        # the last match_prefix: (its request, the blocks of the host node its load-back stopped
        # at for lack of device room), or None (it loaded all it matched, or nothing to load)
        self._load_short: tuple[str, int] | None = None
        self.prefix_queries = 0                 # tokens looked up in the cache (metrics)
        self.prefix_hits = 0                    # of them, found
        # offload_ahead(): blocks the pool had given out at the last call, and the blocks each of
        # the last OFFLOAD_AHEAD_STEPS steps took
        self._allocated_mark = 0
        self._step_demand: deque[int] = deque(maxlen=self.OFFLOAD_AHEAD_STEPS)

    def match_prefix(self, request_id: str, tokens: list[int], limit: int,
                     whole_blocks: bool = False) -> int:
        """A request without blocks: start its table with the blocks of the longest cached
        prefix of tokens[:limit] (shared, copied on write). Returns the matched length.
        whole_blocks: only the fully matched blocks (the length rounded down to a block), for a
        table whose remaining blocks are written whole (a P/D consumer pulling the rest).
        A host part is loaded back while the device has room for it; where it stops for lack
        of room, load_room_arrives() says whether waiting a step would bring that room."""
        self._load_short = None
        if self.prefix_cache is None or request_id in self.block_tables:
            return 0
        pc = self.prefix_cache
        m = pc.match(tokens, limit)
        from_host = None       # with host nodes matched: positions from here were loaded
        if m.host_nodes:   # load what fits back to the device (the request runs next step)
            from_host = m.num_device_tokens

            def make_room(k: int) -> bool:
                if self._make_room(k):
                    return True
                self._load_short = (request_id, k)   # (load_back stops there)
                return False
            loaded = pc.load_back(m.host_nodes, make_room)
            device_end = m.host_nodes[loaded - 1].end if loaded else m.num_device_tokens
            m = pc.match(tokens, min(limit, device_end))
        n = m.num_tokens - m.num_tokens % self.block_size if whole_blocks else m.num_tokens
        self.prefix_queries += len(tokens)
        self.prefix_hits += n
        if from_host is not None:
            self.prefix_host_hits += max(0, n - from_host)
        if n == 0:
            return 0
        blocks = m.blocks[: self.blocks_for(n)]
        self.pool.incref(blocks)
        self.block_tables[request_id] = list(blocks)
        self.prefix_cache.lock(m.node)
        self._locked[request_id] = (m.node, m.num_tokens)
        return n

    def load_room_arrives(self, request_id: str) -> bool:
        """The last match_prefix, this request's, stopped loading its cached prefix back from
        the host for lack of device room (the rest of the match stays on the host, and the
        request would run with part of it), and the blocks released this step make that room
        at the next (evicting for it freed blocks copied this step: a write-through copy, a
        load-back, an offload). The request may wait a step for the rest rather than compute
        it again."""
        short = self._load_short
        if short is None or short[0] != request_id:
            return False
        return short[1] - self.pool.num_free_blocks <= self.pool.num_arriving

    def _make_room(self, n: int) -> bool:
        """At least n free blocks, evicting cached ones if needed (with a host tier they are
        offloaded: their blocks come free at the next step, and this returns False now)."""
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
        need = grow + len(cow)
        if (not self._make_room(need) and request_id in self._locked
                and need - self.pool.num_free_blocks > self.pool.num_arriving):
            # Its own match may be what holds the room: copying the matched partial block on
            # write needs a block that only evicting that match frees (then nothing needs a copy).
            # Not when the room arrives at the next step (offloaded leaves): it would unlock the
            # match for good and evict as much again, past the room it waits for.
            self._unlock(request_id)
            self._make_room(need)
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

    def reserve_slots(self, request_id: str, num_computed: int, num_new: int) -> bool:
        """A request whose table is loaded back this step (table_busy) runs from the next one:
        give it now the fresh blocks of positions [num_computed, num_computed + num_new), so the
        room it runs in is its own then (admitted without it, it would preempt for it). The copy
        on write of a block it shares waits for that step's allocate_slots (the block is still
        being loaded), but its room counts here. False (nothing changed) when the pool cannot
        give the room now, evicting cached blocks included (offloaded ones come free only at
        the next step)."""
        table = self.block_tables[request_id]
        end = num_computed + num_new
        grow = max(0, self.blocks_for(end) - len(table))
        if not self._make_room(grow + len(self._shared_in_range(table, num_computed, end))):
            return False
        table.extend(self.pool.allocate(grow))
        return True

    def fork(self, parent_id: str, child_id: str) -> None:
        table = self.block_tables[parent_id]
        self.pool.incref(table)
        self.block_tables[child_id] = list(table)

    def free(self, request_id: str, tokens: list[int] = ()) -> None:
        """Give back a request's blocks (and a swapped request's host blocks). `tokens`: the
        positions [0, len) whose KV its blocks hold (computed, or being computed by a step in
        flight), kept by the prefix cache."""
        host = self.host_tables.pop(request_id, None)
        if host:
            self.host_pool.release(reversed(host))
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

    # ---- the host tier ----------------------------------------------------------------------
    @property
    def num_host_blocks(self) -> int:
        return 0 if self.host_pool is None else self.host_pool.num_blocks

    @property
    def num_host_blocks_used(self) -> int:
        """Host blocks held by swapped requests or cached prefixes (or released this step)."""
        return 0 if self.host_pool is None else self.host_pool.num_used_blocks

    @property
    def blocks_offloaded(self) -> int:
        return 0 if self.prefix_cache is None else self.prefix_cache.blocks_offloaded

    @property
    def blocks_loaded_back(self) -> int:
        return 0 if self.prefix_cache is None else self.prefix_cache.blocks_loaded_back

    def begin_step(self) -> None:
        """A new step (the start of schedule()): the previous step's copies are ordered before
        it, so the blocks they used may be given out again."""
        self.pool.flush()
        if self.host_pool is not None:
            self.host_pool.flush()
            if self.prefix_cache is not None and self.prefix_cache.write_through:
                self.prefix_cache.write_pending()

    def offload_ahead(self) -> int:
        """The end of a step's scheduling (before take_moves()), with a host tier that offloads
        on eviction: offload least recently used cached leaves until the free blocks plus those
        arriving at the next step cover the most blocks one of the last OFFLOAD_AHEAD_STEPS
        steps took (this one included), so that the next step finds its room free rather than
        waiting a step for it (see the module docstring). Returns the blocks evicted."""
        pc = self.prefix_cache
        if pc is None or self.host_pool is None or pc.write_through:
            return 0        # (eviction frees at once: nothing to make ahead)
        allocated = self.pool.num_allocated
        self._step_demand.append(allocated - self._allocated_mark)
        self._allocated_mark = allocated
        short = max(self._step_demand) - self.pool.num_free_blocks - self.pool.num_arriving
        return pc.evict(short) if short > 0 else 0

    def take_moves(self) -> KVMoves | None:
        """This step's copies between the tiers (None: none), once per schedule()."""
        m = self._moves
        if not m.to_host and not m.to_device:
            return None
        out = KVMoves(list(m.to_host), list(m.to_device))
        m.to_host.clear()
        m.to_device.clear()
        return out

    def table_busy(self, request_id: str) -> bool:
        """The request's table lists a block copied between tiers this step (loaded back for
        it, or being saved): it may not run in this step."""
        return self.pool.any_busy(self.block_tables.get(request_id, ()))

    def swap_blocks(self, request_id: str, num_tokens: int) -> int:
        """How many blocks swap_out(request_id, num_tokens) would save, or 0 if it cannot:
        no host tier, nothing computed, a block another request shares (a fork: the caller
        recomputes instead), or not enough host room even after dropping cached host
        prefixes."""
        table = self.block_tables.get(request_id)
        k = self.blocks_for(num_tokens)
        if self.host_pool is None or not table or k == 0 or k > len(table):
            return 0
        rc, cc, pool = self.pool.ref_counts, self.pool.cache_refs, self.pool
        if any(rc[b] != 1 + cc[b] or pool.is_busy(b) for b in table[:k]):
            return 0
        room = self.host_pool.num_free_blocks + (
            0 if self.prefix_cache is None else self.host_pool.num_cache_only)
        return k if room >= k else 0

    def swap_out(self, request_id: str, num_tokens: int) -> bool:
        """Save positions [0, num_tokens) of the request to fresh host blocks (KVMoves.to_host)
        and give its device blocks back (those copied: at the next step). The request then holds
        a host table. False (nothing changed) if swap_blocks() says it cannot."""
        k = self.swap_blocks(request_id, num_tokens)
        host = self.host_pool
        if k and host.num_free_blocks < k:
            self.prefix_cache.evict_host(k - host.num_free_blocks)
        if not k or host.num_free_blocks < k:
            return False
        table = self.block_tables.pop(request_id)
        dst = host.allocate(k)
        self._moves.to_host.extend(zip(table[:k], dst))
        self.pool.mark_busy(table[:k])
        host.mark_busy(dst)
        self.host_tables[request_id] = dst
        self._unlock(request_id)
        self.pool.release(reversed(table))
        self.blocks_swapped_out += k
        return True

    def swap_in(self, request_id: str) -> bool:
        """Copy a swapped request's host blocks into fresh device blocks (KVMoves.to_device):
        its table again, readable from the next step on. False (nothing changed) when the pool
        is short."""
        host = self.host_tables[request_id]
        k = len(host)
        if not self._make_room(k):
            return False
        dst = self.pool.allocate(k)
        self._moves.to_device.extend(zip(host, dst))
        self.pool.mark_busy(dst)
        self.host_pool.mark_busy(host)
        self.block_tables[request_id] = dst
        del self.host_tables[request_id]
        self.host_pool.release(reversed(host))
        self.blocks_swapped_in += k
        return True

    def room_arrives(self, request_id: str, num_computed: int, num_new: int) -> bool:
        """allocate_slots() failed for these positions, but the blocks it lacks come free at the
        next step (released this step, deferred): the request may wait a step instead of
        preempting anyone."""
        arriving = self.pool.num_arriving
        if not arriving:
            return False
        table = self.block_tables.get(request_id, [])
        end = num_computed + num_new
        need = (max(0, self.blocks_for(end) - len(table))
                + len(self._shared_in_range(table, num_computed, end)))
        return need - self.pool.num_free_blocks <= arriving

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
        """Every allocated block (both tiers) is referenced exactly as often as the live tables
        (device: block_tables; host: the swapped requests' host_tables), the detached ones the
        caller still owns, the prefix cache's nodes of that tier and the deferred releases name
        it; the cache's structure holds and its locks are the live requests' matches."""
        cached: list[list[int]] = []
        host_cached: list[list[int]] = []
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
            cached = self.prefix_cache.holders()
            host_cached = self.prefix_cache.host_holders()
            assert self.prefix_cache.root.lock == len(self._locked), "cache locks vs requests"
        assert set(self._locked) <= set(self.block_tables), "a lock without a table"
        assert not set(self.host_tables) & set(self.block_tables), "swapped and resident"
        self.pool.check_integrity([*self.block_tables.values(), *detached], cached)
        if self.host_pool is not None:
            self.host_pool.check_integrity(list(self.host_tables.values()), host_cached)
        else:
            assert not self.host_tables and not host_cached, "host blocks without a host tier"
