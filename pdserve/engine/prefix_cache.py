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
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from .block_pool import BlockPool


@dataclass(eq=False)
class Node:
    tokens: list[int]                       # the edge label: positions [start, start + len)
    start: int                              # position of tokens[0]
    blocks: list[int]                       # blocks of indices start // bs ... (end - 1) // bs
    parent: "Node | None" = None
    children: dict[int, "Node"] = field(default_factory=dict)   # first token -> child
    lock: int = 0                           # requests using this node or a descendant
    last_use: int = 0                       # logical clock of the last match or insert

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class Match:
    num_tokens: int         # matched positions [0, num_tokens)
    blocks: list[int]       # their blocks, one per block index below ceil(num_tokens / bs)
    node: Node              # the deepest matched node (lock / unlock it)


def _common(a: list[int], a0: int, b: list[int], limit: int, b0: int = 0) -> int:
    """Length of the common prefix of a[a0:] and b[b0:b0 + limit]. Compares slices (C loops),
    growing them while they match and shrinking them around a mismatch, so a long match costs
    about one pass and a mismatch a few short compares."""
    n = min(len(a) - a0, len(b) - b0, limit)
    i, m = 0, 64
    while i < n:
        m = min(m, n - i)
        if a[a0 + i:a0 + i + m] == b[b0 + i:b0 + i + m]:
            i += m
            m *= 4
        elif m > 8:
            m //= 8
        else:
            while a[a0 + i] == b[b0 + i]:     # (a mismatch lies within these m)
                i += 1
            return i
    return n


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.root = Node([], 0, [])
        self._clock = 0
        self.num_cached_blocks = 0          # (node, block) listings = the tree's references
        # Eviction candidates, least recently used first: (last_use, seq, node), pushed whenever
        # a node may have become an unlocked leaf or was used; an entry is checked when popped
        # (still attached, a leaf, unlocked, not used since) and skipped otherwise.
        self._lru: list[tuple[int, int, Node]] = []
        self._seq = itertools.count()
        self._num_nodes = 0

    # ---- matching -----------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int | None = None) -> Match:
        """The longest cached prefix of tokens[:limit] (no side effects beyond LRU time)."""
        tokens = tokens if isinstance(tokens, list) else list(tokens)   # (edges are lists)
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        self._clock += 1
        bs = self.block_size
        node, pos = self.root, 0
        blocks: list[int] = []
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common(tokens, pos, child.tokens, limit - pos)
            # the child's blocks from the first index that is not already final in `blocks`
            first = child.start // bs
            del blocks[first:]
            blocks.extend(child.blocks[: (pos + n - 1) // bs - first + 1])
            child.last_use = self._clock
            node, pos = child, pos + n
            if n < len(child.tokens):
                break
        self._offer(node)
        return Match(pos, blocks, node)

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

    # ---- insertion ----------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], table: Sequence[int],
               known: tuple[Node, int] | None = None) -> int:
        """Cache the KV of positions [0, len(tokens)), which live in `table` (a request's block
        table, at least ceil(len / bs) long). Positions the tree already has keep the tree's
        blocks. Returns how many positions were new.

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
            if n < len(child.tokens):
                if pos + n == len(tokens):   # ends inside this edge: nothing new to keep
                    self._offer(child)
                    return 0
                lower = child
                child = self._split(child, n)
                self._offer(lower)            # (used just now: its queued entry is stale)
            node, pos = child, pos + n
        if pos == len(tokens):
            self._offer(node)
            return 0
        first, last = pos // bs, (len(tokens) - 1) // bs
        new = table[first:last + 1]
        self.pool.incref(new, cached=True)
        self.num_cached_blocks += len(new)
        leaf = Node(list(tokens[pos:]), pos, list(new), parent=node, last_use=self._clock)
        node.children[tokens[pos]] = leaf
        self._num_nodes += 1
        self._offer(leaf)
        return len(tokens) - pos

    def _split(self, node: Node, n: int) -> Node:
        """Cut node's edge after n tokens; returns the new upper part (the parent of `node`)."""
        bs = self.block_size
        cut = node.start + n
        first = node.start // bs
        upper_blocks = node.blocks[: (cut - 1) // bs - first + 1]
        lower_blocks = node.blocks[cut // bs - first:]
        upper = Node(node.tokens[:n], node.start, upper_blocks, parent=node.parent,
                     lock=node.lock, last_use=node.last_use)
        node.parent.children[node.tokens[0]] = upper
        self._num_nodes += 1
        shared = len(upper_blocks) + len(lower_blocks) - len(node.blocks)   # 1 if cut is mid-block
        if shared:
            self.pool.incref(node.blocks[cut // bs - first: (cut - 1) // bs - first + 1], cached=True)
            self.num_cached_blocks += shared
        node.tokens, node.start, node.blocks, node.parent = node.tokens[n:], cut, lower_blocks, upper
        upper.children[node.tokens[0]] = node
        return upper

    # ---- eviction -----------------------------------------------------------------------
    def _offer(self, node: Node) -> None:
        if node is not self.root and not node.children and node.lock == 0:
            heapq.heappush(self._lru, (node.last_use, next(self._seq), node))
            if len(self._lru) > 4 * self._num_nodes + 64:   # mostly stale: rebuild
                self._lru = [(n.last_use, next(self._seq), n) for n in self.evictable_leaves()]
                heapq.heapify(self._lru)

    def _evictable(self, node: Node, last_use: int) -> bool:
        parent = node.parent
        return (parent is not None and parent.children.get(node.tokens[0]) is node
                and not node.children and node.lock == 0 and node.last_use == last_use)

    def evictable_leaves(self) -> Iterator[Node]:
        return (n for n in self.nodes() if not n.children and n.lock == 0 and n is not self.root)

    def evict(self, num_blocks: int) -> int:
        """Drop least recently used unlocked leaves until num_blocks blocks went back to the
        pool's free list (or nothing is left to drop). Returns the blocks freed."""
        freed = 0
        while self._lru and freed < num_blocks:
            last_use, _, leaf = heapq.heappop(self._lru)
            if not self._evictable(leaf, last_use):
                continue
            parent = leaf.parent
            before = self.pool.num_free_blocks
            self._remove(leaf)
            freed += self.pool.num_free_blocks - before
            self._offer(parent)
        return freed

    def _remove(self, leaf: Node) -> None:
        del leaf.parent.children[leaf.tokens[0]]
        self.pool.release(reversed(leaf.blocks), cached=True)
        self.num_cached_blocks -= len(leaf.blocks)
        self._num_nodes -= 1
        leaf.blocks = []
        leaf.parent = None

    def reset(self) -> int:
        """Drop every unlocked node (all of them when no request uses the cache); returns the
        blocks freed."""
        return self.evict(self.pool.num_blocks + self.num_cached_blocks)

    # ---- checks -------------------------------------------------------------------------
    def nodes(self) -> Iterator[Node]:
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def holders(self) -> list[list[int]]:
        """The tree's references, one list per node (for BlockPool.check_integrity)."""
        return [n.blocks for n in self.nodes() if n.blocks]

    def num_evictable_blocks(self) -> int:
        """Blocks only the tree holds (no request lists them): what eviction can give back once
        their nodes are unlocked. O(1): the pool keeps the count (BlockPool.num_cache_only)."""
        return self.pool.num_cache_only

    def num_cached_tokens(self) -> int:
        return sum(len(n.tokens) for n in self.nodes())

    def check_integrity(self) -> None:
        """Structure: edges non-empty and contiguous, children keyed by their first token,
        block lists of the right length, lock counts = sum over children + own, the reference
        count matches the listings."""
        bs = self.block_size
        listed = 0
        for n in self.nodes():
            listed += len(n.blocks)
            for tok, c in n.children.items():
                assert c.parent is n and c.tokens and c.tokens[0] == tok, "child key / parent"
                assert c.start == n.end, f"child starts at {c.start}, parent ends at {n.end}"
                assert len(c.blocks) == (c.end - 1) // bs - c.start // bs + 1, "block count"
            assert n.lock >= sum(c.lock for c in n.children.values()), "lock below children's"
        assert listed == self.num_cached_blocks, "cached block count"
        assert sum(1 for _ in self.nodes()) == self._num_nodes + 1, "node count"
        queued = {id(n) for u, _, n in self._lru if self._evictable(n, u)}
        assert all(id(n) in queued for n in self.evictable_leaves()), "an evictable leaf not queued"
