"""Prefix cache: a token-granular radix tree over the block pool. Pure Python.

The tree's edges are token sequences. A node covers the positions [start, end) of every sequence
that passes through it, and lists the KV blocks of those positions: block indices
start // bs ... (end - 1) // bs. Where a node boundary falls inside a block, that block index is
listed by both nodes, possibly as two different blocks: the one the parent's sequence wrote, and
the one a child's sequence wrote after copying it on write. Both hold the same KV for the
positions they share, since a position's KV depends only on the tokens up to it.

    tokens     a b c d e f | g h          bs = 4, a prompt "abcdefgh" then one "abcdexy"
    node       [root]--(a b c d e)--(f g h)          blocks: (a..e) [b0, b1]   (f g h) [b1, b2]
                                  \\-(x y)                    (x y)   [b1', ...]

A match of L tokens takes, for each block index below ceil(L / bs), the block of the deepest
matched node that lists it. If L is not a multiple of bs, its last block is partly someone
else's: the request shares it, and the pool's copy-on-write copies it at the first write.

References: the tree holds one pool reference per (node, block) listing, taken at insert and
dropped at eviction; requests hold their own. `PrefixCache` is the one place that takes and
drops the tree's references. A node is locked while a request uses the blocks it matched there
(the lock covers the node and its ancestors); only unlocked leaves are evicted, least recently
used first.

Two tiers (a host pool given to the constructor): a node lives on the device (its blocks are
device blocks) or on the host (host blocks, `Node.on_host`); the device part of the tree is closed
under ancestors (a host node's children are host nodes), so a match is a device part, then a host
part. Evicting an unlocked device leaf (a device node without device children) with a host tier
*offloads* it: its KV is copied to fresh host blocks (KVMoves.to_host, in `moves`) and the node
moves to the host; its device blocks come free at the next step (BlockPool: busy blocks). A leaf
whose blocks a request still holds is dropped instead, as without a host tier. A leaf that lists
a block copied this step (loaded back, or shared with a child just offloaded: a node boundary
inside a block) waits in the queue for the next step's eviction (dropping it would lose its
host subtree too). The host tier evicts least recently used host leaves by dropping them.
load_back() turns matched host nodes into device nodes (KVMoves.to_device); an insert that walks
through a host node takes the inserting table's device blocks for it (they hold the same KV).

    device  root --(a b c d e)--(f g h)            host   (f g h) offloaded: [h4, h5]
                              \\-(x y)                      (its shared block index 1 is the
                                                           host's own copy)

Write policy (`write_through`): on eviction (the default) copies a leaf's KV to the host when it
is evicted, so the blocks come free one step later, after the copy. Write-through copies a new
leaf's KV to the host when it is inserted (and keeps the host blocks of a node loaded back or
promoted) as the node's `host_copy`: a device node with a copy is evicted by dropping its device
blocks, which come free at once, and the host tier's LRU may drop a copy (the node stays on the
device) as it drops host leaves. A node whose copy could not be made (the host was full of
locked or busy blocks) is offloaded on eviction as without the policy.
"""
from __future__ import annotations

import heapq
import itertools
import operator
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from .block_pool import BlockPool, KVMoves


@dataclass(eq=False)
class Node:
    tokens: list[int]                       # the edge label: positions [start, start + len)
    start: int                              # position of tokens[0]
    blocks: list[int]                       # blocks of indices start // bs ... (end - 1) // bs
    parent: "Node | None" = None
    children: dict[int, "Node"] = field(default_factory=dict)   # first token -> child
    lock: int = 0                           # requests using this node or a descendant
    last_use: int = 0                       # logical clock of the last match or insert
    on_host: bool = False                   # its blocks are host blocks (host tier)
    host_copy: list[int] | None = None      # a device node's host blocks holding the same KV
                                            # (write-through), one per block

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class Match:
    num_tokens: int         # matched positions [0, num_tokens)
    blocks: list[int]       # their device blocks, one per block index below
                            # ceil(num_device_tokens / bs)
    node: Node              # the deepest matched node (lock / unlock it)
    num_device_tokens: int = 0              # of num_tokens, those matched in device nodes
    host_nodes: tuple[Node, ...] = ()       # the host nodes matched past them, top down


class _Past:
    """Placed after the last token of a query slice: no token equals it, and a lexicographic
    compare that reaches it returns it (its __lt__), which tells "every token before agreed"
    without copying the other side (_agrees)."""
    __slots__ = ()

    def __lt__(self, other):
        return self


_PAST = _Past()


def _agrees(a: list[int], a0: int, b: list[int], k: int) -> bool:
    """a[a0:a0 + k] == b[:k], for k < len(b), copying only the query's k tokens: list < list
    compares pairs until the first that differs and then returns that pair's own compare."""
    s = a[a0:a0 + k]
    s.append(_PAST)
    return (s < b) is _PAST


def _common(a: list[int], a0: int, b: list[int], limit: int, b0: int = 0) -> int:
    """Length of the common prefix of a[a0:] and b[b0:b0 + limit].

    Reading a token costs more than anything else here (each is an int object compared by
    value), so this reads each about once:
    - if the last tokens of the range agree, the whole range is compared at once (the common
      case: a whole edge matches); only the query's part is copied (where b0 = 0: a range
      ending inside the edge is compared by _agrees);
    - otherwise single tokens are probed by bisection for where the two stop agreeing (after
      two token sequences part, their tokens at equal positions rarely agree again), and that
      guess g is checked: a[:g] == b[:g] (_agrees where b0 = 0), so g is the answer (a[g] !=
      b[g] is known);
    - if the check fails (they agreed again somewhere), the range before g is compared in
      slices growing 4x from 64 tokens, the one that differs is scanned 64 tokens at a time,
      and those 64 pairwise (in C)."""
    n = min(len(a) - a0, len(b) - b0, limit)
    if n <= 0:
        return 0
    if a[a0 + n - 1] == b[b0 + n - 1]:
        if b0 == 0:
            if a[a0:a0 + n] == b if n == len(b) else _agrees(a, a0, b, n):
                return n
        elif a[a0:a0 + n] == b[b0:b0 + n]:
            return n
    else:
        lo, hi = -1, n - 1                     # a[hi] != b[hi]; a[lo] == b[lo] (or lo = -1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if a[a0 + mid] == b[b0 + mid]:
                lo = mid
            else:
                hi = mid
        if _agrees(a, a0, b, hi) if b0 == 0 else a[a0:a0 + hi] == b[b0:b0 + hi]:
            return hi
        n = hi                                 # a mismatch lies before the guess
    i, m = 0, 64
    while i < n:
        m = min(m, n - i)
        if a[a0 + i:a0 + i + m] == b[b0 + i:b0 + i + m]:
            i += m
            m *= 4
            continue
        end = i + m                            # a mismatch lies in [i, end)
        while end - i > 64 and a[a0 + i:a0 + i + 64] == b[b0 + i:b0 + i + 64]:
            i += 64
        k = min(64, end - i)
        differs = map(operator.ne, a[a0 + i:a0 + i + k], b[b0 + i:b0 + i + k])
        return i + next(itertools.compress(itertools.count(), differs))
    return n


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, host_pool: BlockPool | None = None,
                 write_through: bool = False):
        if write_through and host_pool is None:
            raise ValueError("prefix cache: write-through needs a host tier")
        self.pool = pool
        self.host_pool = host_pool               # None: one tier, evicted leaves are forgotten
        self.write_through = write_through
        self.block_size = block_size
        self.root = Node([], 0, [])
        self._clock = 0
        self.num_cached_blocks = 0          # (node, block) listings of device nodes
        self.num_host_cached_blocks = 0     # of host nodes and device nodes' host copies
        # Eviction candidates, least recently used first: (last_use, seq, node), pushed whenever
        # a node may have become an unlocked leaf of its tier or was used; an entry is checked
        # when popped (still attached, a leaf of that tier, unlocked, not used since) and
        # skipped otherwise. _lru: device leaves; _host_lru: host leaves and device nodes with
        # a host copy.
        self._lru: list[tuple[int, int, Node]] = []
        self._host_lru: list[tuple[int, int, Node]] = []
        self._seq = itertools.count()
        self._num_nodes = 0
        self.moves = KVMoves([], [])        # this step's copies (the KV manager takes them)
        self._to_write: list[Node] = []     # write-through: leaves inserted since the last step
        self.blocks_offloaded = 0           # counters since start (metrics): copied to the host
        self.blocks_loaded_back = 0

    def _pool(self, node: Node) -> BlockPool:
        return self.host_pool if node.on_host else self.pool

    def _count(self, node: Node, n: int) -> None:
        if node.on_host:
            self.num_host_cached_blocks += n
        else:
            self.num_cached_blocks += n

    # ---- matching -----------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int | None = None) -> Match:
        """The longest cached prefix of tokens[:limit], through both tiers (no side effects
        beyond LRU time)."""
        tokens = tokens if isinstance(tokens, list) else list(tokens)   # (edges are lists)
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        self._clock += 1
        bs = self.block_size
        node, pos, device_pos = self.root, 0, 0
        blocks: list[int] = []
        host: list[Node] = []
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common(tokens, pos, child.tokens, limit - pos)
            if child.on_host:
                if not host and node is not self.root:
                    self._offer(node)         # (a device leaf above host nodes, used now)
                host.append(child)
            else:
                # the child's blocks from the first index that is not already final in `blocks`
                first = child.start // bs
                k = (pos + n - 1) // bs - first + 1
                blocks[first:] = child.blocks if k == len(child.blocks) else child.blocks[:k]
                device_pos = pos + n
            child.last_use = self._clock
            if child.host_copy is not None:      # (its queued copy entry is stale now)
                self._offer(child)
            node, pos = child, pos + n
            if n < len(child.tokens):
                break
        self._offer(node)
        return Match(pos, blocks, node, device_pos, tuple(host))

    def lock(self, node: Node) -> None:
        while node is not None:
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        deepest = node
        while node is not None:
            if node.lock <= 0:
                raise RuntimeError("prefix cache: unlock of an unlocked node")
            node.lock -= 1
            node = node.parent
        self._offer(deepest)

    def load_back(self, nodes: Sequence[Node], make_room) -> int:
        """Move matched host nodes (Match.host_nodes, top down) to the device, while
        make_room(n) gives n free device blocks: fresh device blocks, KVMoves.to_device, the host
        blocks released (deferred: they are read this step). Returns how many were loaded (a
        prefix of `nodes`). The loaded blocks are busy this step: whoever reads them runs from
        the next step on."""
        if not nodes or self.host_pool is None:
            return 0
        anchor = nodes[0].parent          # (device: the tree is closed under ancestors)
        self.lock(anchor)                 # make_room must not evict the path being loaded
        done = 0
        try:
            for node in nodes:
                if not node.on_host or node.parent is None:   # (changed under us: stop)
                    break
                k = len(node.blocks)
                if not make_room(k) or node.parent is None:   # (room made by dropping it)
                    break
                dev = self.pool.allocate(k, cached=True)
                self.moves.to_device.extend(zip(node.blocks, dev))
                self.pool.mark_busy(dev)
                self.host_pool.mark_busy(node.blocks)
                if self.write_through:           # (the host blocks stay, as its copy)
                    node.host_copy = node.blocks
                else:
                    self.host_pool.release(node.blocks, cached=True)
                    self.num_host_cached_blocks -= k
                self.num_cached_blocks += k
                node.blocks, node.on_host = dev, False
                self.blocks_loaded_back += k
                node.lock += 1            # (the next make_room must not offload it again)
                done += 1
        finally:
            for node in nodes[:done]:
                node.lock -= 1
            self.unlock(anchor)
            for node in nodes[:done]:
                self._offer(node)
        return done

    # ---- insertion ----------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], table: Sequence[int],
               known: tuple[Node, int] | None = None) -> int:
        """Cache the KV of positions [0, len(tokens)), which live in `table` (a request's device
        block table, at least ceil(len / bs) long). Positions the tree already has keep the
        tree's blocks, except on the host: a host node the walk goes through takes the table's
        device blocks (the tree stays closed under ancestors on the device). Returns how many
        positions were new.

        known = (node, n): tokens[:n] are known to be cached along the path to `node`, which is
        still in the tree (a request's match at admission, locked since: Match.node and
        Match.num_tokens). The walk resumes there instead of comparing those n tokens again;
        an edge split since the match is followed up to the part that holds position n."""
        bs = self.block_size
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        if len(table) < -(-len(tokens) // bs):
            raise ValueError(f"prefix cache: {len(tokens)} tokens need {-(-len(tokens) // bs)} "
                             f"blocks, the table has {len(table)}")
        self._clock += 1
        node, pos, done = self.root, 0, 0    # done: tokens of the next edge known to match
        if known is not None:
            at, n = known[0], min(known[1], len(tokens))
            while at is not self.root and at.start >= n:
                at = at.parent
            if n == at.end:
                node, pos = at, n
            else:                             # n lies inside at's edge
                node, pos, done = at.parent, at.start, n - at.start
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = done + _common(tokens, pos + done, child.tokens, len(child.tokens) - done, done)
            done = 0
            child.last_use = self._clock
            if child.host_copy is not None:
                self._offer(child)
            if n < len(child.tokens):
                if pos + n == len(tokens):   # ends inside this edge: nothing new to keep
                    self._offer(child)
                    self._offer(node)         # (a device leaf above a host child: used now)
                    return 0
                lower = child
                child = self._split(child, n)
                self._offer(lower)            # (used just now: its queued entry is stale)
            if child.on_host:
                self._promote(child, table)
            node, pos = child, pos + n
        if pos == len(tokens):
            self._offer(node)
            return 0
        first, last = pos // bs, (len(tokens) - 1) // bs
        new = table[first:last + 1]
        if not isinstance(new, list):
            new = list(new)
        self.pool.incref(new, cached=True)
        self.num_cached_blocks += len(new)
        leaf = Node(tokens[pos:], pos, new, parent=node, last_use=self._clock)
        node.children[tokens[pos]] = leaf
        self._num_nodes += 1
        if self.write_through:
            self._to_write.append(leaf)
        self._offer(leaf)
        return len(tokens) - pos

    def write_pending(self) -> int:
        """Write-through, at the start of a step (after the pools' flush, so the copies are this
        step's moves and their blocks busy in it): copy the leaves inserted since the last step
        to the host (_write_copy). Returns the blocks copied."""
        pending, self._to_write = self._to_write, []
        n = 0
        for node in pending:
            if node.parent is not None and not node.on_host and node.host_copy is None:
                n += len(node.blocks) if self._write_copy(node) else 0
        return n

    def _write_copy(self, node: Node) -> bool:
        """Write-through: copy a device node's KV to fresh host blocks (KVMoves.to_host), kept
        as its host_copy; the host's least recently used leaves and copies make room. False
        (no copy: it is offloaded on eviction instead) if the host has no room, or a block is
        in a live table (a fork's sibling, a P/D producer's held table: a table may not list a
        busy block)."""
        rc, cc = self.pool.ref_counts, self.pool.cache_refs
        if any(rc[b] != cc[b] for b in node.blocks):
            return False
        dst = self._copy_to_host(node.blocks)
        if dst is None:
            return False
        node.host_copy = dst
        self._offer(node)
        return True

    def _copy_to_host(self, blocks: list[int]) -> list[int] | None:
        """Fresh host blocks (the cache's references) that this step's KVMoves.to_host fills
        from `blocks`, both sides busy for the step; the host's least recently used leaves and
        copies make room. None (nothing changed) if the host has no room."""
        host, k = self.host_pool, len(blocks)
        if host.num_free_blocks < k:
            self.evict_host(k - host.num_free_blocks)
        if host.num_free_blocks < k:
            return None
        dst = host.allocate(k, cached=True)
        self.moves.to_host.extend(zip(blocks, dst))
        self.pool.mark_busy(blocks)               # (a release waits for the copy)
        host.mark_busy(dst)
        self.num_host_cached_blocks += k
        self.blocks_offloaded += k
        return dst

    def _promote(self, node: Node, table: Sequence[int]) -> None:
        """A host node whose positions `table` holds too (its parent is on the device): it takes
        the table's device blocks, its host blocks go back."""
        bs = self.block_size
        new = list(table[node.start // bs:(node.end - 1) // bs + 1])
        self.pool.incref(new, cached=True)
        if self.write_through:                   # (the host blocks stay, as its copy)
            node.host_copy = node.blocks
        else:
            self.host_pool.release(node.blocks, cached=True)
            self.num_host_cached_blocks -= len(node.blocks)
        self.num_cached_blocks += len(new)
        node.blocks, node.on_host = new, False
        self._offer(node)

    def _split(self, node: Node, n: int) -> Node:
        """Cut node's edge after n tokens; returns the new upper part (the parent of `node`),
        in node's tier."""
        bs = self.block_size
        cut = node.start + n
        first = node.start // bs
        upper_blocks = node.blocks[: (cut - 1) // bs - first + 1]
        lower_blocks = node.blocks[cut // bs - first:]
        edge = node.tokens                       # (a node's own list: cut it, copying the
        if n >= len(edge) - n:                   # shorter part)
            upper_tokens, lower_tokens = edge, edge[n:]
            del edge[n:]
        else:
            upper_tokens, lower_tokens = edge[:n], edge
            del edge[:n]
        upper = Node(upper_tokens, node.start, upper_blocks, parent=node.parent,
                     lock=node.lock, last_use=node.last_use, on_host=node.on_host)
        node.parent.children[upper_tokens[0]] = upper
        self._num_nodes += 1
        shared = len(upper_blocks) + len(lower_blocks) - len(node.blocks)   # 1 if cut is mid-block
        mid = slice(cut // bs - first, (cut - 1) // bs - first + 1)        # (the shared index)
        if shared:
            self._pool(node).incref(node.blocks[mid], cached=True)
            self._count(node, shared)
        if node.host_copy is not None:           # (the copy splits as the blocks do)
            copy = node.host_copy
            upper.host_copy = copy[:len(upper_blocks)]
            node.host_copy = copy[cut // bs - first:]
            if shared:
                self.host_pool.incref(copy[mid], cached=True)
                self.num_host_cached_blocks += shared
        node.tokens, node.start, node.blocks, node.parent = lower_tokens, cut, lower_blocks, upper
        upper.children[node.tokens[0]] = node
        if upper.host_copy is not None:
            self._offer(upper)
        return upper

    # ---- eviction -----------------------------------------------------------------------
    @staticmethod
    def _device_leaf(node: Node) -> bool:
        return (not node.on_host and node.lock == 0
                and not any(not c.on_host for c in node.children.values()))

    @staticmethod
    def _host_droppable(node: Node) -> bool:
        """What the host tier's LRU drops: a host leaf, or a device node's host copy."""
        return not node.children if node.on_host else node.host_copy is not None

    def _offer(self, node: Node) -> None:
        if node is self.root:
            return
        if self._host_droppable(node):
            heapq.heappush(self._host_lru, (node.last_use, next(self._seq), node))
            if len(self._host_lru) > 4 * self._num_nodes + 64:
                self._host_lru = [(n.last_use, next(self._seq), n) for n in self.nodes()
                                  if n is not self.root and self._host_droppable(n)]
                heapq.heapify(self._host_lru)
        if node.on_host:
            return
        if (not node.children and node.lock == 0) or self._device_leaf(node):   # (a leaf: at once)
            heapq.heappush(self._lru, (node.last_use, next(self._seq), node))
            if len(self._lru) > 4 * self._num_nodes + 64:   # mostly stale: rebuild
                self._lru = [(n.last_use, next(self._seq), n) for n in self.evictable_leaves()]
                heapq.heapify(self._lru)

    def _attached(self, node: Node, last_use: int) -> bool:
        parent = node.parent
        return (parent is not None and parent.children.get(node.tokens[0]) is node
                and node.last_use == last_use)

    def _evictable(self, node: Node, last_use: int) -> bool:
        return self._attached(node, last_use) and self._device_leaf(node)

    def evictable_leaves(self) -> Iterator[Node]:
        """Unlocked device nodes without device children (evict() takes them)."""
        return (n for n in self.nodes() if n is not self.root and self._device_leaf(n))

    def evict(self, num_blocks: int, offload: bool = True) -> int:
        """Evict least recently used unlocked device leaves until num_blocks blocks went back
        to the pool's free list or will at the next step (or nothing is left to evict). With a
        host tier (and offload) a leaf whose blocks only the tree holds is offloaded (its
        device blocks come free at the next step); otherwise it is dropped, with its host
        descendants. A leaf without a host copy that lists a block copied between the tiers
        this step (loaded back just now, or the block it shares with a child offloaded just
        now, when a node boundary falls inside a block) cannot be offloaded in this step: with
        offload it is skipped, and stays queued, rather than dropped, which would lose its KV
        and its host descendants to free its blocks one step sooner.
        Returns the blocks freed (now or at the next step)."""
        freed = 0
        rc = self.pool.ref_counts
        tiered = offload and self.host_pool is not None
        skipped = []
        while self._lru and freed < num_blocks:
            entry = heapq.heappop(self._lru)
            last_use, _, leaf = entry
            if not self._evictable(leaf, last_use):
                continue
            if tiered and leaf.host_copy is None and self.pool.any_busy(leaf.blocks):
                skipped.append(entry)      # (offloadable from the next step on)
                continue
            parent = leaf.parent
            freed += sum(1 for b in leaf.blocks if rc[b] == 1)   # (only this listing holds it)
            if not (offload and (self._to_copy(leaf) or self._offload(leaf))):
                self._drop(leaf)
            self._offer(parent)
        for entry in skipped:
            heapq.heappush(self._lru, entry)
        return freed

    def _to_copy(self, leaf: Node) -> bool:
        """Write-through: a device leaf with a host copy moves to the host by dropping its device
        blocks (free at once, unless copied this step) and taking the copy as its blocks."""
        copy = leaf.host_copy
        if copy is None:
            return False
        self.pool.release(leaf.blocks, cached=True)
        self.num_cached_blocks -= len(leaf.blocks)
        leaf.blocks, leaf.host_copy, leaf.on_host = copy, None, True
        self._offer(leaf)
        return True

    def _offload(self, leaf: Node) -> bool:
        """Copy a device leaf's KV to the host and move the node there, if only the tree holds
        its blocks, none is being loaded this step and the host has room (after dropping host
        leaves)."""
        pool = self.pool
        if self.host_pool is None or any(pool.ref_counts[b] != pool.cache_refs[b]
                                         or pool.is_busy(b) for b in leaf.blocks):
            return False
        dst = self._copy_to_host(leaf.blocks)
        if dst is None:
            return False
        pool.release(leaf.blocks, cached=True)          # (deferred: busy)
        self.num_cached_blocks -= len(leaf.blocks)
        leaf.blocks, leaf.on_host = dst, True
        self._offer(leaf)
        return True

    def evict_host(self, num_blocks: int) -> int:
        """Drop least recently used host leaves and device nodes' host copies until num_blocks
        host blocks went free (or will at the next step). Returns the host blocks freed."""
        freed = 0
        if self.host_pool is None:
            return 0
        rc = self.host_pool.ref_counts
        while self._host_lru and freed < num_blocks:
            last_use, _, node = heapq.heappop(self._host_lru)
            if not (self._attached(node, last_use) and self._host_droppable(node)):
                continue
            if not node.on_host:                 # a copy: the node stays on the device
                copy, node.host_copy = node.host_copy, None
                freed += sum(1 for b in copy if rc[b] == 1)
                self.host_pool.release(reversed(copy), cached=True)
                self.num_host_cached_blocks -= len(copy)
                continue
            parent = node.parent
            freed += sum(1 for b in node.blocks if rc[b] == 1)
            self._drop(node)
            self._offer(parent)
        return freed

    def _drop(self, node: Node) -> None:
        """Forget a node and its subtree (host nodes below an evicted device leaf)."""
        del node.parent.children[node.tokens[0]]
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            self._pool(n).release(reversed(n.blocks), cached=True)
            self._count(n, -len(n.blocks))
            if n.host_copy is not None:
                self.host_pool.release(reversed(n.host_copy), cached=True)
                self.num_host_cached_blocks -= len(n.host_copy)
                n.host_copy = None
            self._num_nodes -= 1
            n.blocks = []
            n.parent = None
            n.children = {}

    def reset(self) -> int:
        """Drop every unlocked node (all of them when no request uses the cache), both tiers;
        returns the device blocks freed."""
        freed = self.evict(self.pool.num_blocks + self.num_cached_blocks, offload=False)
        if self.host_pool is not None:
            self.evict_host(self.host_pool.num_blocks + self.num_host_cached_blocks)
        return freed

    # ---- checks -------------------------------------------------------------------------
    def nodes(self) -> Iterator[Node]:
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def holders(self) -> list[list[int]]:
        """The tree's device references, one list per node (for BlockPool.check_integrity)."""
        return [n.blocks for n in self.nodes() if n.blocks and not n.on_host]

    def host_holders(self) -> list[list[int]]:
        """The tree's host references, one list per host node or host copy."""
        return [n.blocks if n.on_host else n.host_copy for n in self.nodes()
                if (n.blocks and n.on_host) or n.host_copy]

    def num_evictable_blocks(self) -> int:
        """Blocks only the tree holds (no request lists them): what eviction can give back once
        their nodes are unlocked. O(1): the pool keeps the count (BlockPool.num_cache_only)."""
        return self.pool.num_cache_only

    def num_cached_tokens(self) -> int:
        """Positions the tree holds, both tiers."""
        return sum(len(n.tokens) for n in self.nodes())

    def num_host_cached_tokens(self) -> int:
        return sum(len(n.tokens) for n in self.nodes() if n.on_host)

    def check_integrity(self) -> None:
        """Structure: edges non-empty and contiguous, children keyed by their first token,
        block lists of the right length, lock counts = sum over children + own, the reference
        counts match the listings per tier, host nodes only below host nodes or device nodes
        (never above a device node) and never locked, every evictable leaf queued."""
        bs = self.block_size
        listed = host_listed = 0
        for n in self.nodes():
            if n.on_host:
                host_listed += len(n.blocks)
                assert self.host_pool is not None, "a host node without a host tier"
                assert n.lock == 0, "a locked host node"
                assert n.host_copy is None, "a host node with a host copy"
            else:
                listed += len(n.blocks)
                if n.host_copy is not None:
                    assert self.write_through, "a host copy without write-through"
                    assert len(n.host_copy) == len(n.blocks), "host copy length"
                    host_listed += len(n.host_copy)
            for tok, c in n.children.items():
                assert c.parent is n and c.tokens and c.tokens[0] == tok, "child key / parent"
                assert c.start == n.end, f"child starts at {c.start}, parent ends at {n.end}"
                assert len(c.blocks) == (c.end - 1) // bs - c.start // bs + 1, "block count"
                assert c.on_host or not n.on_host, "a device node below a host node"
            assert n.lock >= sum(c.lock for c in n.children.values()), "lock below children's"
        assert listed == self.num_cached_blocks, "cached block count"
        assert host_listed == self.num_host_cached_blocks, "host cached block count"
        assert sum(1 for _ in self.nodes()) == self._num_nodes + 1, "node count"
        queued = {id(n) for u, _, n in self._lru if self._evictable(n, u)}
        assert all(id(n) in queued for n in self.evictable_leaves()), "an evictable leaf not queued"
        hq = {id(n) for u, _, n in self._host_lru if self._attached(n, u)}
        assert all(id(n) in hq for n in self.nodes() if n is not self.root
                   and self._host_droppable(n)), "a host leaf or copy not queued"
