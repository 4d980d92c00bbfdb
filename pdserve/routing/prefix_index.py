"""The router's guess at what each worker has cached: per worker, a radix tree over the token ids
of the prompts (and finished sequences) the router sent there. Pure Python, no clock.

It is approximate by design: the worker's own prefix cache (engine/prefix_cache.py) evicts when
its pool is short, and the router never hears of it. What the index says is "this worker saw
these tokens recently", which is what placement needs (policies.py, cache-aware choice).

    insert(w, tokens)    w will hold tokens' KV (a request placed there, a sequence it finished)
    match(w, tokens)     length of the longest prefix of tokens inserted for w (read-only: a
                         query does not make an entry recent, only an insert does)
    drop(w) / clear()    w died or restarted / every worker's cache was reset

Memory is bounded per worker by a token budget: past it, the least recently inserted leaves are
trimmed from their tails (a leaf's tail is the part no other entry shares), so a worker's tree
never holds more than its budget and the newest entry is the last to go.

    budget 10:  insert a b c d e f        [root]-(a b c d e f)                      6 tokens
                insert a b c x y          [root]-(a b c)-(d e f)                   8 tokens
                                                        \\-(x y)
                insert p q r s            12 > 10: the oldest leaf (d e f) loses 2 tokens
                                          [root]-(a b c)-(d)    -(x y)  -(p q r s)   10 tokens
"""
from __future__ import annotations

import heapq
import itertools
from array import array
from typing import Mapping, Sequence

# Default per-worker budget: a million token ids (4 MB of int32 edges) is more than the KV pool
# of most single-GPU workers holds, so the index forgets before the worker does only when the
# worker's pool is larger still.
PREFIX_INDEX_TOKENS = 1 << 20

_TYPECODE = "i"   # int32 edges: token ids are vocabulary indices


def token_array(tokens: Sequence[int]) -> array:
    """The index's form of a token sequence (int32 array; given back as is when it is one):
    convert a prompt once for several workers' match and insert."""
    try:
        return tokens if isinstance(tokens, array) and tokens.typecode == _TYPECODE \
            else array(_TYPECODE, tokens)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"token ids must be 32-bit integers, got {tokens!r:.80}: {e}") from None


def _common(a: array, b: array) -> int:
    """Length of the common prefix of a and b: one compare when the shorter is a prefix of the
    longer, else a bisection whose windows halve (about two passes over the prefix in all)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n              # a[:lo] == b[:lo]; a[lo:hi] != b[lo:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("key", "parent", "children", "tick")

    def __init__(self, key: array, parent: "_Node | None", tick: int):
        self.key = key                          # the edge label
        self.parent = parent
        self.children: dict[int, _Node] = {}    # first token -> child
        self.tick = tick                        # last insert through this node


class _Tree:
    """One worker's entries. `heap` holds (tick, seq, leaf) for eviction, at least one entry
    per leaf; an entry is stale once its node's tick moved on, it got children, or it left the
    tree (parent None)."""

    def __init__(self):
        self.root = _Node(array(_TYPECODE), None, 0)
        self.tokens = 0
        self.nodes = 0            # below the root
        self.heap: list[tuple[int, int, _Node]] = []

    def leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                yield node


class PrefixIndex:
    def __init__(self, max_tokens: int = PREFIX_INDEX_TOKENS,
                 budgets: Mapping[str, int] | None = None):
        """max_tokens: each worker's token budget (0: the index keeps nothing); budgets: a
        worker's own budget where it differs (a worker without prefix caching: 0)."""
        self.max_tokens = self._check_budget("max_tokens", max_tokens)
        self.budgets = {w: self._check_budget(f"budget of {w}", b)
                        for w, b in (budgets or {}).items()}
        self._trees: dict[str, _Tree] = {}
        self._tick = itertools.count(1)
        self._seq = itertools.count()

    @staticmethod
    def _check_budget(what: str, v) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{what} must be a non-negative integer (tokens), got {v!r}")
        return v

    def budget(self, worker: str) -> int:
        return self.budgets.get(worker, self.max_tokens)

    # ---- queries ----------------------------------------------------------------------------
    def match(self, worker: str, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` were inserted for worker (0 if none)."""
        q = token_array(tokens)
        tree = self._trees.get(worker)
        if tree is None:
            return 0
        node, pos = tree.root, 0
        while pos < len(q):
            child = node.children.get(q[pos])
            if child is None:
                break
            k = _common(child.key, q[pos:pos + len(child.key)])
            pos += k
            if k < len(child.key):
                break
            node = child
        return pos

    def num_tokens(self, worker: str) -> int:
        """Tokens held for worker (at most its budget)."""
        tree = self._trees.get(worker)
        return 0 if tree is None else tree.tokens

    def entries(self, worker: str) -> list[list[int]]:
        """Every root-to-leaf token sequence held for worker (for tests and debugging)."""
        tree = self._trees.get(worker)
        if tree is None:
            return []
        out = []
        for leaf in tree.leaves():
            parts, node = [], leaf
            while node is not tree.root:
                parts.append(node.key)
                node = node.parent
            out.append([t for part in reversed(parts) for t in part])
        return sorted(out)

    # ---- updates ----------------------------------------------------------------------------
    def insert(self, worker: str, tokens: Sequence[int]) -> None:
        """worker holds (or will hold) the KV of tokens: they become its most recent entry.
        Beyond the budget only the first `budget` tokens are kept."""
        budget = self.budget(worker)
        q = token_array(tokens)[:budget]
        if not q:
            return
        tree = self._trees.get(worker)
        if tree is None:
            tree = self._trees[worker] = _Tree()
        tick = next(self._tick)
        node, pos = tree.root, 0
        while pos < len(q):
            node.tick = tick
            child = node.children.get(q[pos])
            if child is None:   # a new leaf for the rest
                leaf = _Node(q[pos:], node, tick)
                node.children[q[pos]] = leaf
                tree.tokens += len(leaf.key)
                tree.nodes += 1
                node = leaf
                break
            k = _common(child.key, q[pos:pos + len(child.key)])
            if k < len(child.key):   # split child after its first k tokens
                mid = _Node(child.key[:k], node, tick)
                child.key = child.key[k:]
                child.parent = mid
                mid.children[child.key[0]] = child
                node.children[q[pos]] = mid
                tree.nodes += 1
                child = mid
            pos += k
            node = child
        node.tick = tick
        if not node.children:
            self._push(tree, node)
        self._evict(tree, budget)
        if len(tree.heap) > 2 * tree.nodes + 64:   # mostly stale entries: rebuild (amortised:
            self._rebuild(tree)                   # after as many inserts as there are nodes)

    def drop(self, worker: str) -> None:
        """Forget everything held for worker (it died, restarted, or dropped its cache)."""
        self._trees.pop(worker, None)

    def clear(self) -> None:
        """Forget every worker's entries (their caches were reset)."""
        self._trees.clear()

    def check_integrity(self) -> None:
        """Every tree's invariants (AssertionError): counts, links, edges keyed by their first
        token, no empty edge, the budget, and a live heap entry for every leaf."""
        for worker, tree in self._trees.items():
            tokens = nodes = 0
            live = {id(n) for tick, _, n in tree.heap if n.tick == tick}
            stack = [tree.root]
            while stack:
                node = stack.pop()
                for first, child in node.children.items():
                    assert child.parent is node and len(child.key) > 0, worker
                    assert child.key[0] == first, (worker, first, child.key[0])
                    assert child.tick <= node.tick or node is tree.root, worker
                    tokens += len(child.key)
                    nodes += 1
                    stack.append(child)
                if not node.children and node is not tree.root:
                    assert id(node) in live, (worker, "a leaf without a heap entry")
            assert (tokens, nodes) == (tree.tokens, tree.nodes), (worker, tokens, nodes)
            assert tree.tokens <= self.budget(worker), worker

    # ---- internals --------------------------------------------------------------------------
    def _push(self, tree: _Tree, leaf: _Node) -> None:
        heapq.heappush(tree.heap, (leaf.tick, next(self._seq), leaf))

    def _evict(self, tree: _Tree, budget: int) -> None:
        """Trim the least recently inserted leaves until the tree holds at most budget tokens."""
        while tree.tokens > budget:
            tick, _, leaf = heapq.heappop(tree.heap)
            if leaf.parent is None or leaf.children or leaf.tick != tick:
                continue   # stale: gone, no longer a leaf, or pushed again since
            excess = tree.tokens - budget
            if excess < len(leaf.key):   # its tail is enough
                leaf.key = leaf.key[:len(leaf.key) - excess]
                tree.tokens -= excess
                self._push(tree, leaf)
                break
            tree.tokens -= len(leaf.key)
            tree.nodes -= 1
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            leaf.parent = None
            if parent is not tree.root and not parent.children:
                self._push(tree, parent)

    def _rebuild(self, tree: _Tree) -> None:
        tree.heap = [(leaf.tick, next(self._seq), leaf) for leaf in tree.leaves()]
        heapq.heapify(tree.heap)
