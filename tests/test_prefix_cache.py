"""Prefix cache (engine/prefix_cache.py) and its bridge in the KV cache manager.

Two kinds of checks:
- hand-computed cases over a BlockPool with block size 4: the tree's blocks, the pool's ref
  counts, LRU eviction order, locks, reset, limit;
- a hypothesis state machine over KVCacheManager with the cache on, against a simulated KV store
  (each slot remembers the token prefix whose KV was written there) and a naive model of the
  cache (the set of inserted sequences). The property that matters: every position a live request
  or a tree node claims holds the KV of its own token prefix, so reused KV is the right KV.
"""
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache_manager import BlockCopy, KVCacheManager
from pdserve.engine.prefix_cache import PrefixCache
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.sampling_params import SamplingParams

BS = 4
A = list(range(1, 11))                     # 10 tokens: blocks of indices 0, 1, 2


def tree(num_blocks=16):
    pool = BlockPool(num_blocks)
    return pool, PrefixCache(pool, BS)


def cached(pc: PrefixCache, tokens, limit=None):
    m = pc.match(tokens, limit)
    return m.num_tokens, m.blocks


def check(pool: BlockPool, pc: PrefixCache, tables=()):
    pc.check_integrity()
    pool.check_integrity(tables, pc.holders())


def insert_released(pool, pc, tokens, table):
    """What free(id, tokens) does: the tree takes its references, the request drops its own."""
    new = pc.insert(tokens, table)
    pool.release(table)
    return new


# ---- hand-computed cases -------------------------------------------------------------------
def test_insert_then_exact_and_partial_matches():
    pool, pc = tree()
    table = pool.allocate(3)                                   # [0, 1, 2]
    assert pc.insert(A, table) == 10
    assert pool.ref_counts[:4] == [2, 2, 2, 0]                 # the request's + the tree's
    assert pc.num_cached_blocks == 3
    check(pool, pc, [table])
    pool.release(table)
    assert pool.ref_counts[:3] == [1, 1, 1] and pool.num_free_blocks == 13
    assert cached(pc, A) == (10, [0, 1, 2])
    assert cached(pc, A + [11, 12]) == (10, [0, 1, 2])
    assert cached(pc, A[:8]) == (8, [0, 1])
    assert cached(pc, A[:5]) == (5, [0, 1])                    # block 1 is shared, partly
    assert cached(pc, [9, 9]) == (0, [])
    assert cached(pc, []) == (0, [])
    check(pool, pc)


def test_match_diverging_mid_block_and_at_block_end():
    pool, pc = tree()
    insert_released(pool, pc, A, pool.allocate(3))
    assert cached(pc, [1, 2, 3, 4, 5, 99]) == (5, [0, 1])      # mid-edge, mid-block
    assert cached(pc, [1, 2, 3, 4, 99]) == (4, [0])            # mid-edge, at a block end
    assert cached(pc, [1, 2, 3, 99]) == (3, [0])
    assert cached(pc, [2, 3]) == (0, [])


def test_split_mid_block():
    """A = 1..10 in blocks [0, 1, 2]; B = 1..6 then 20 21 22 diverges at position 6, inside
    block index 1. B's request matched 6 tokens ([0, 1]), copied block 1 on write (-> 3) and
    took block 4:

        root --(1..6: [0, 1])--+--(7..10: [1, 2])      block 1 listed by both upper and lower
                               +--(20 21 22: [3, 4])
    """
    pool, pc = tree()
    insert_released(pool, pc, A, pool.allocate(3))
    b_table = [0] + pool.allocate(2)                           # [0, 3, 4]
    pool.incref([0])
    b = A[:6] + [20, 21, 22]
    assert insert_released(pool, pc, b, b_table) == 3
    upper = pc.root.children[1]
    assert (upper.tokens, upper.start, upper.blocks) == (A[:6], 0, [0, 1])
    lower, new = upper.children[7], upper.children[20]
    assert (lower.tokens, lower.start, lower.blocks) == ([7, 8, 9, 10], 6, [1, 2])
    assert (new.tokens, new.start, new.blocks) == ([20, 21, 22], 6, [3, 4])
    assert pool.ref_counts[:5] == [1, 2, 1, 1, 1]
    assert pc.num_cached_blocks == 6 and pc.num_cached_tokens() == 13
    check(pool, pc)
    assert cached(pc, b) == (9, [0, 3, 4])
    assert cached(pc, A) == (10, [0, 1, 2])
    assert cached(pc, A[:7]) == (7, [0, 1])
    assert cached(pc, A[:6]) == (6, [0, 1])
    assert cached(pc, A[:6] + [20]) == (7, [0, 3])
    assert cached(pc, A[:6] + [20, 21, 22, 23]) == (9, [0, 3, 4])


def test_split_at_block_boundary_shares_no_block():
    pool, pc = tree()
    insert_released(pool, pc, A, pool.allocate(3))
    c_table = [0, 1] + pool.allocate(1)                        # [0, 1, 3]
    pool.incref([0, 1])
    c = A[:8] + [30, 31]
    assert insert_released(pool, pc, c, c_table) == 2
    upper = pc.root.children[1]
    assert (upper.tokens, upper.blocks) == (A[:8], [0, 1])
    assert (upper.children[9].start, upper.children[9].blocks) == (8, [2])
    assert (upper.children[30].start, upper.children[30].blocks) == (8, [3])
    assert pool.ref_counts[:4] == [1, 1, 1, 1] and pc.num_cached_blocks == 4
    check(pool, pc)
    assert cached(pc, c) == (10, [0, 1, 3])
    assert cached(pc, A[:9]) == (9, [0, 1, 2])


def test_insert_of_a_present_sequence_changes_nothing():
    pool, pc = tree()
    insert_released(pool, pc, A, pool.allocate(3))
    again = pool.allocate(3)                                   # [3, 4, 5], same tokens
    refs = list(pool.ref_counts)
    assert pc.insert(A, again) == 0
    assert pool.ref_counts == refs and pc.num_cached_blocks == 3
    assert pc.num_cached_tokens() == 10
    assert cached(pc, A) == (10, [0, 1, 2])                    # the tree keeps its own blocks
    check(pool, pc, [again])
    # a strict prefix: nothing new either, the matches stay the same
    assert pc.insert(A[:6], again) == 0
    assert pc.num_cached_tokens() == 10
    assert cached(pc, A) == (10, [0, 1, 2]) and cached(pc, A[:6]) == (6, [0, 1])
    check(pool, pc, [again])


def test_limit_is_honoured():
    pool, pc = tree()
    insert_released(pool, pc, A, pool.allocate(3))
    b_table = [0] + pool.allocate(2)
    pool.incref([0])
    insert_released(pool, pc, A[:6] + [20, 21, 22], b_table)
    b = A[:6] + [20, 21, 22]
    assert cached(pc, A, limit=6) == (6, [0, 1])
    assert cached(pc, A, limit=4) == (4, [0])
    assert cached(pc, A, limit=0) == (0, [])
    assert cached(pc, A, limit=100) == (10, [0, 1, 2])
    assert cached(pc, b, limit=7) == (7, [0, 3])
    assert cached(pc, b, limit=8) == (8, [0, 3])
    assert cached(pc, b, limit=9) == (9, [0, 3, 4])


def _three_leaves():
    """X, Y, Z: disjoint 4-token sequences of one block each (blocks 0, 1, 2), inserted in that
    order."""
    pool, pc = tree(8)
    seqs = [[1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]]
    for s in seqs:
        insert_released(pool, pc, s, pool.allocate(1))
    return pool, pc, seqs


def test_evicts_least_recently_used_first():
    pool, pc, (x, y, z) = _three_leaves()
    assert pool.num_free_blocks == 5
    cached(pc, x)                                              # X is now the newest
    assert pc.evict(1) == 1
    assert cached(pc, y) == (0, []) and cached(pc, x) == (4, [0]) and cached(pc, z) == (4, [2])
    assert pool.num_free_blocks == 6 and pool.ref_counts[1] == 0
    # the matches above touched Z last
    assert pc.evict(1) == 1
    assert cached(pc, x) == (0, []) and cached(pc, z) == (4, [2])
    check(pool, pc)
    assert pc.evict(0) == 0 and cached(pc, z) == (4, [2])      # asked for nothing: nothing goes
    check(pool, pc)


def test_inner_node_goes_after_its_children():
    pool, pc = tree()
    insert_released(pool, pc, A, pool.allocate(3))             # lower 7..10: [1, 2]
    b_table = [0] + pool.allocate(2)
    pool.incref([0])
    insert_released(pool, pc, A[:6] + [20, 21, 22], b_table)   # new 20..22: [3, 4]
    cached(pc, A)                                              # lower is newer than new
    assert pc.evict(1) == 2                                    # new leaf: blocks 3 and 4
    assert cached(pc, A[:6] + [20]) == (6, [0, 1])
    assert pc.evict(1) == 1                                    # lower: only block 2 (upper keeps 1)
    assert pool.ref_counts[:3] == [1, 1, 0]
    assert cached(pc, A) == (6, [0, 1])
    assert pc.evict(1) == 2                                    # upper, a leaf now
    assert pc.root.children == {} and pool.num_free_blocks == 16
    check(pool, pc)


class Reads(list):
    """A token list that records which positions are read."""
    def __init__(self, tokens):
        super().__init__(tokens)
        self.positions = set()

    def __getitem__(self, i):
        self.positions.update(range(len(self))[i] if isinstance(i, slice) else [i % len(self)])
        return super().__getitem__(i)


def test_insert_resumes_from_a_match_across_later_splits():
    """insert(known=(node, n)) skips the n matched tokens, also after the matched edge was split
    above n (the walk climbs to the part holding n) or exactly at n."""
    for cut_at in (3, 6):                            # a split above the match point, then at it
        pool, pc = tree()
        insert_released(pool, pc, A, pool.allocate(3))          # edge 1..10
        prompt = A[:6] + [50, 51, 52]                            # diverges after 6 tokens
        m = pc.match(prompt)
        assert m.num_tokens == 6
        pc.lock(m.node)
        other = A[:cut_at] + [90]                                # splits the edge at cut_at
        insert_released(pool, pc, other, pool.allocate(len(other) // BS + 1))
        table = m.blocks[:1] + pool.allocate(2)                  # block 1 copied on write
        pool.incref(m.blocks[:1])
        read = Reads(prompt)
        assert pc.insert(read, table, known=(m.node, m.num_tokens)) == 3
        # the matched 6 are not compared again: at most one of them is read (a child's key)
        assert len({p for p in read.positions if p < 6}) <= 1, sorted(read.positions)
        pool.release(table)
        pc.unlock(m.node)
        check(pool, pc)
        for seq in (A, other, prompt):                           # all three fully cached
            assert cached(pc, seq)[0] == len(seq)
        assert pc.num_cached_tokens() == 10 + 1 + 3              # A, the 90 branch, 50 51 52


def test_locked_nodes_are_never_evicted():
    pool, pc, (x, y, z) = _three_leaves()
    mx = pc.match(x[:2])                                       # mid-edge: locks X's node
    pc.lock(mx.node)
    assert pc.evict(10) == 2                                   # Y and Z; X stays
    assert cached(pc, x) == (4, [0]) and cached(pc, y) == (0, [])
    assert pc.reset() == 0 and cached(pc, x) == (4, [0])
    check(pool, pc)
    pc.unlock(mx.node)
    assert pc.evict(10) == 1 and pool.num_free_blocks == 8
    with pytest.raises(RuntimeError):
        pc.unlock(mx.node)


def test_lock_covers_ancestors_not_siblings():
    pool, pc = tree()
    insert_released(pool, pc, A, pool.allocate(3))
    b_table = [0] + pool.allocate(2)
    pool.incref([0])
    insert_released(pool, pc, A[:6] + [20, 21, 22], b_table)
    m = pc.match(A)
    pc.lock(m.node)                                            # lower (7..10) and upper
    assert pc.evict(100) == 2                                  # only the 20..22 leaf can go
    assert cached(pc, A) == (10, [0, 1, 2])
    assert cached(pc, A[:6] + [20]) == (6, [0, 1])
    check(pool, pc)
    pc.unlock(m.node)
    assert pc.reset() == 3 and pool.num_free_blocks == 16


def test_an_inner_node_locked_by_a_shorter_match_outlives_its_children():
    pool, pc = tree()
    insert_released(pool, pc, A, pool.allocate(3))
    b_table = [0] + pool.allocate(2)
    pool.incref([0])
    insert_released(pool, pc, A[:6] + [20, 21, 22], b_table)
    m = pc.match(A[:3])                                        # ends inside the upper node
    pc.lock(m.node)
    assert pc.evict(100) == 3                                  # both leaves: blocks 2, 3, 4
    assert cached(pc, A) == (6, [0, 1]) and pool.ref_counts[:2] == [1, 1]
    check(pool, pc)
    pc.unlock(m.node)
    assert pc.evict(100) == 2 and pool.num_free_blocks == 16


def test_evict_counts_only_blocks_that_went_free():
    pool, pc = tree(8)
    x, y = [1, 1, 1, 1], [2, 2, 2, 2]
    x_table = pool.allocate(1)
    pc.insert(x, x_table)                                      # X's request keeps its block
    insert_released(pool, pc, y, pool.allocate(1))
    free = pool.num_free_blocks
    assert pc.evict(1) == 1                                    # X (oldest) frees nothing, then Y
    assert pool.num_free_blocks == free + 1
    assert cached(pc, x) == (0, []) and cached(pc, y) == (0, [])
    assert pool.ref_counts[x_table[0]] == 1
    check(pool, pc, [x_table])


def test_reset_drops_everything_unlocked():
    pool, pc = tree()
    insert_released(pool, pc, A, pool.allocate(3))
    b_table = [0] + pool.allocate(2)
    pool.incref([0])
    insert_released(pool, pc, A[:6] + [20, 21, 22], b_table)
    assert pc.reset() == 5
    assert pc.root.children == {} and pc.num_cached_blocks == 0 and pool.num_free_blocks == 16
    assert cached(pc, A) == (0, [])
    check(pool, pc)
    assert pc.reset() == 0


def test_check_integrity_catches_a_wrong_count():
    pool, pc = tree()
    insert_released(pool, pc, A, pool.allocate(3))
    check(pool, pc)
    pc.num_cached_blocks += 1
    with pytest.raises(AssertionError):
        pc.check_integrity()
    pc.num_cached_blocks -= 1
    pc.root.children[1].start = 1
    with pytest.raises(AssertionError):
        pc.check_integrity()


def test_insert_rejects_a_short_table():
    pool, pc = tree()
    with pytest.raises(ValueError, match="need 3 blocks"):
        pc.insert(A, pool.allocate(2))


def test_manager_matches_then_copies_the_shared_block_on_write():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    assert kv.allocate_slots("a", 0, 6) == []                  # [0, 1]
    kv.free("a", A[:6])
    assert kv.pool.num_free_blocks == 6 and kv.num_cached_blocks == 2
    assert kv.match_prefix("b", A[:6] + [7, 8], 7) == 6
    assert kv.block_tables["b"] == [0, 1] and kv.pool.ref_counts[:2] == [2, 2]
    kv.check_integrity()
    assert kv.allocate_slots("b", 6, 2) == [BlockCopy(1, 2)]
    assert kv.block_tables["b"] == [0, 2]
    kv.check_integrity()
    kv.free("b", A[:6] + [7, 8])
    assert kv.reset_prefix_cache() == 3 and kv.pool.num_free_blocks == 8


# ---- bugs these tests found: they fail on the cache as first committed (693003f) ----------
def test_tokens_as_a_tuple_match_like_a_list():
    """PrefixCache takes Sequence[int]; a tuple must match what the same list matches."""
    pool, pc = tree()
    insert_released(pool, pc, A, pool.allocate(3))
    assert cached(pc, tuple(A)) == cached(pc, A) == (10, [0, 1, 2])


def test_insert_of_a_tuple_terminates():
    """In a child interpreter with a memory cap: insert of a tuple that shares a first token with
    a cached list must return (the bug: it splits the same edge at 0 forever)."""
    code = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        sys.path.insert(0, {os.getcwd()!r})
        from pdserve.engine.block_pool import BlockPool
        from pdserve.engine.prefix_cache import PrefixCache
        pool = BlockPool(8)
        pc = PrefixCache(pool, 4)
        pc.insert(list(range(1, 7)), pool.allocate(2))
        assert pc.insert(tuple(range(1, 9)), pool.allocate(2)) == 2
        pc.check_integrity()
        print("ok")
    """)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=5)
    except subprocess.TimeoutExpired:
        pytest.fail("PrefixCache.insert(tuple) did not return within 5 s")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_free_with_too_many_tokens_leaks_nothing():
    """Bad input to free() is a ValueError, and the manager stays consistent."""
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    kv.allocate_slots("a", 0, 4)
    with pytest.raises(ValueError):
        kv.free("a", list(range(9)))                           # 9 tokens, the table has 1 block
    kv.check_integrity()
    kv.free("a")
    assert kv.pool.num_free_blocks == 4


def test_own_cached_prefix_does_not_stop_a_request_that_fits_alone():
    """Pool of 2 blocks of 4. b (6 tokens) finishes: the tree keeps [0, 1]. d = b's 6 tokens
    + 1 fits the pool alone (2 blocks) and runs without the cache. With it, d matches 6
    tokens, shares block 1 and must copy it: the copy needs a third block, and the only node
    that could be evicted is the one d itself locks."""
    kv = KVCacheManager(2, BS, enable_prefix_caching=True)
    kv.allocate_slots("b", 0, 6)
    kv.free("b", A[:6])
    assert kv.match_prefix("d", A[:7], 6) == 6
    assert kv.allocate_slots("d", 6, 1) is not None


def test_scheduler_finishes_a_request_that_fits_alone_with_the_cache_on():
    """The same case through the scheduler. d (7 prompt tokens, 2 output tokens: 8 positions,
    the whole pool) finishes in 2 steps without the cache (the reference run); with the cache
    on it must finish too (it stays waiting forever: every step matches, fails to allocate the
    copy, frees and retries)."""
    outputs = {}
    for cache in (False, True):
        s = Scheduler(KVCacheManager(2, BS, enable_prefix_caching=cache), 4, 64)
        b = Request("b", A[:6], SamplingParams(max_tokens=1))
        d = Request("d", A[:7], SamplingParams(max_tokens=2))
        s.add(b)
        for r in (b, d):
            if r is d:
                s.add(d)
            for _ in range(10):
                out = s.schedule()
                for got in s.update({c.request_id: 7 for c in out.chunks if c.sample}):
                    if len(got.output_token_ids) >= got.params.max_tokens:
                        s.finish(got, RequestStatus.FINISHED_LENGTH)
                s.check_integrity()
                if r.status.finished:
                    break
        outputs[cache] = (d.status, d.output_token_ids)
    assert outputs[False] == (RequestStatus.FINISHED_LENGTH, [7, 7])
    assert outputs[True] == outputs[False]


# ---- the state machine --------------------------------------------------------------------
EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "60"))   # deeper: set it (CI budget)
TOKENS = st.integers(0, 2)                 # a tiny alphabet, so prefixes collide


def lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Seq:
    def __init__(self, tokens, computed, matched=0):
        self.tokens = list(tokens)
        self.computed = computed           # positions [0, computed) hold KV
        self.matched = matched             # found in the cache at admission: stays cached


def cached_length(pc: PrefixCache, tokens) -> int:
    """How much of tokens the tree holds, read off its edges (no LRU side effect)."""
    node, pos = pc.root, 0
    while pos < len(tokens) and tokens[pos] in node.children:
        node = node.children[tokens[pos]]
        n = lcp(node.tokens, tokens[pos:])
        pos += n
        if n < len(node.tokens):
            break
    return pos


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random admissions (often a prefix of an earlier sequence plus a tail), growth, forks,
    finishes, preemptions and readmissions, aborts, detaches, evictions and resets."""

    @initialize(bs=st.sampled_from([1, 2, 4]), capacity=st.integers(12, 48))
    def setup(self, bs, capacity):
        num_blocks = capacity // bs            # a pool of 12 to 48 positions
        self.bs, self.num_blocks = bs, num_blocks
        self.kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=True)
        self.store = [[None] * bs for _ in range(num_blocks)]   # slot -> token prefix written
        self.live: dict[str, Seq] = {}
        self.preempted: list[list[int]] = []
        self.detached: list[list[int]] = []
        self.known: list[list[int]] = []      # every sequence seen: bases for new prompts
        self.inserted: set[tuple] = set()     # the naive cache: every sequence given to free()
        self.exact = True                     # nothing evicted since `inserted` was last exact
        self.n = 0

    # -- the simulated device ----------------------------------------------------------------
    def _copy(self, copies):
        saved = [list(self.store[c.src]) for c in copies]      # copies run as one batch
        for c, slots in zip(copies, saved):
            self.store[c.dst] = slots

    def _write(self, rid, start, end):
        s, table = self.live[rid], self.kv.block_tables[rid]
        for p in range(start, end):
            self.store[table[p // self.bs]][p % self.bs] = tuple(s.tokens[:p + 1])

    def _naive_match(self, tokens, limit):
        head = tokens[:max(limit, 0)]
        return max((lcp(head, s) for s in self.inserted), default=0)

    def _allocate(self, rid, start, n):
        """allocate_slots for positions [start, start + n); on success copy and write them."""
        before_table = list(self.kv.block_tables.get(rid, []))
        before_cached = self.kv.prefix_cache.num_cached_tokens()
        copies = self.kv.allocate_slots(rid, start, n)
        if self.kv.prefix_cache.num_cached_tokens() < before_cached:
            self.exact = False
        if copies is None:                                     # nothing changed
            event("pool short")
            assert self.kv.block_tables.get(rid, []) == before_table
            return False
        table = self.kv.block_tables[rid]
        assert len(table) == -(-(start + n) // self.bs)
        for c in copies:
            i = before_table.index(c.src)
            assert table[i] == c.dst and self.kv.pool.ref_counts[c.dst] == 1
        if copies:
            event("copy on write")
        self._copy(copies)
        self.live[rid].computed = start + n
        self._write(rid, start, start + n)
        return True

    def _admit(self, tokens, drop, chunk):
        rid = f"r{self.n}"
        self.n += 1
        limit = len(tokens) - 1 - drop         # the scheduler's limit is len - 1
        want = self._naive_match(tokens, limit)
        got = self.kv.match_prefix(rid, tokens, limit)
        if self.exact:
            assert got == want, f"matched {got}, the naive cache has {want}"
        else:
            assert got <= want, f"matched {got}, only {want} were ever cached"
        assert got <= max(limit, 0)
        event("matched " + ("nothing" if not got else "mid-block" if got % self.bs else
                            "whole blocks") + ("" if self.exact else " (after evictions)"))
        assert len(self.kv.block_tables.get(rid, [])) == -(-got // self.bs)
        self.live[rid] = Seq(tokens, got, matched=got)
        self.known.append(list(tokens))
        self.check_kv()                        # the matched KV is this prompt's KV
        if not self._allocate(rid, got, min(len(tokens) - got, chunk)):
            self.kv.free(rid)                  # as the scheduler does: matched again later
            del self.live[rid]

    def _pick(self, i):
        ids = sorted(self.live)
        return ids[i % len(ids)]

    # -- rules -------------------------------------------------------------------------------
    @rule(source=st.sampled_from(["cached", "seen", "none"]), base=st.integers(0, 1 << 16),
          cut=st.integers(0, 16), tail=st.lists(TOKENS, max_size=5), drop=st.integers(0, 2),
          chunk=st.integers(1, 24))
    def new(self, source, base, cut, tail, drop, chunk):
        """A prompt: a prefix of a cached or of any earlier sequence (or nothing) + a tail."""
        bases = sorted(self.inserted) if source == "cached" else self.known
        prefix = list(bases[base % len(bases)][:cut]) if bases and source != "none" else []
        tokens = prefix + tail or [base % 3]
        self._admit(tokens, drop, chunk)

    @precondition(lambda self: self.preempted)
    @rule(i=st.integers(0, 1 << 16), chunk=st.integers(1, 24))
    def readmit(self, i, chunk):
        self._admit(self.preempted.pop(i % len(self.preempted)), 0, chunk)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1 << 16), extra=st.lists(TOKENS, max_size=4), chunk=st.integers(1, 8))
    def grow(self, i, extra, chunk):
        rid = self._pick(i)
        s = self.live[rid]
        s.tokens += extra
        n = min(len(s.tokens) - s.computed, chunk)
        if n:
            self._allocate(rid, s.computed, n)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1 << 16))
    def fork(self, i):
        pid = self._pick(i)
        p = self.live[pid]
        if p.computed == 0:
            return
        cid = f"r{self.n}"
        self.n += 1
        self.kv.fork(pid, cid)
        self.live[cid] = Seq(p.tokens[:p.computed], p.computed)

    def _free_with_tokens(self, rid):
        s = self.live.pop(rid)
        done = s.tokens[:s.computed]
        self.kv.free(rid, done)
        if done:
            self.inserted.add(tuple(done))
        return s

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1 << 16))
    def finish(self, i):
        self.known.append(self._free_with_tokens(self._pick(i)).tokens)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1 << 16))
    def preempt(self, i):
        self.preempted.append(self._free_with_tokens(self._pick(i)).tokens)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1 << 16))
    def abort(self, i):
        rid = self._pick(i)
        del self.live[rid]
        self.kv.free(rid)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1 << 16))
    def detach(self, i):
        rid = self._pick(i)
        del self.live[rid]
        self.detached.append(self.kv.detach(rid))

    @precondition(lambda self: self.detached)
    @rule(i=st.integers(0, 1 << 16))
    def release_detached(self, i):
        self.kv.release(self.detached.pop(i % len(self.detached)))

    def _unlocked_leaves(self):
        pc = self.kv.prefix_cache
        return [n for n in pc.nodes() if n is not pc.root and not n.children and n.lock == 0]

    @rule(n=st.integers(0, 6))
    def evict(self, n):
        pc = self.kv.prefix_cache
        free, tokens = self.kv.pool.num_free_blocks, pc.num_cached_tokens()
        freed = pc.evict(n)
        assert freed == self.kv.pool.num_free_blocks - free
        if freed < n:
            assert not self._unlocked_leaves(), "evict stopped early"
        if n == 0:
            assert pc.num_cached_tokens() == tokens
        if pc.num_cached_tokens() < tokens:
            self.exact = False

    @rule()
    def reset(self):
        pc = self.kv.prefix_cache
        free, tokens = self.kv.pool.num_free_blocks, pc.num_cached_tokens()
        assert self.kv.reset_prefix_cache() == self.kv.pool.num_free_blocks - free
        assert all(n.lock > 0 for n in pc.nodes() if n is not pc.root), "unlocked node kept"
        if not self.live:                      # nobody locks anything: the cache is empty
            assert pc.root.children == {} and self.kv.num_cached_blocks == 0
            self.inserted.clear()
            self.exact = True
        elif pc.num_cached_tokens() < tokens:
            self.exact = False

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def integrity(self):
        self.kv.check_integrity(self.detached)

    @invariant()
    def check_kv(self):
        """Every live position holds its own prefix's KV, in the block its table names."""
        for rid, s in self.live.items():
            table = self.kv.block_tables.get(rid, [])
            assert len(table) == -(-s.computed // self.bs), f"{rid}: table length"
            for p in range(s.computed):
                got = self.store[table[p // self.bs]][p % self.bs]
                assert got == tuple(s.tokens[:p + 1]), f"{rid}: position {p} holds {got}"

    @invariant()
    def matched_prefixes_stay(self):
        """A live request's matched prefix is locked: no eviction drops it (unless the request
        gave its lock up to make room for itself: allocate_slots under a full pool)."""
        for rid, s in self.live.items():
            if rid not in self.kv._locked:
                continue
            assert cached_length(self.kv.prefix_cache, s.tokens[:s.matched]) == s.matched, rid

    @invariant()
    def tree_kv(self):
        """Every position a tree node claims holds the KV of the node's path up to it."""
        stack = [(self.kv.prefix_cache.root, ())]
        while stack:
            node, path = stack.pop()
            path = path + tuple(node.tokens)
            first = node.start // self.bs
            for p in range(node.start, node.end):
                got = self.store[node.blocks[p // self.bs - first]][p % self.bs]
                assert got == path[:p + 1], f"tree: position {p} of {path} holds {got}"
            stack.extend((c, path) for c in node.children.values())

    @invariant()
    def tree_size(self):
        """With nothing evicted, the tree holds exactly the distinct prefixes inserted."""
        if not self.exact:
            return
        prefixes = {s[:i] for s in self.inserted for i in range(1, len(s) + 1)}
        assert self.kv.prefix_cache.num_cached_tokens() == len(prefixes)

    def teardown(self):
        for rid in list(self.live):
            self._free_with_tokens(rid)
        for table in self.detached:
            self.kv.release(table)
        self.detached = []
        self.kv.check_integrity()
        self.tree_kv()
        self.kv.reset_prefix_cache()
        assert self.kv.pool.num_free_blocks == self.num_blocks
        assert self.kv.num_cached_blocks == 0 and self.kv.prefix_cache.root.children == {}
        self.kv.check_integrity()


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 600), st.integers(0, 40), st.integers(0, 40), st.integers(0, 700),
       st.integers(0, 3), st.randoms(use_true_random=False))
def test_common_prefix_length_equals_a_naive_scan(shared, a0, b0, limit, tail, rnd):
    """_common against a token-by-token scan, for mismatches at every offset, either side
    running out first and limits inside or past the shared part."""
    from pdserve.engine.prefix_cache import _common
    common = [rnd.randrange(50) for _ in range(shared)]
    a = [rnd.randrange(50) for _ in range(a0)] + common + [100 + rnd.randrange(5) for _ in range(tail)]
    b = [rnd.randrange(50) for _ in range(b0)] + common + [200 + rnd.randrange(5) for _ in range(tail)]
    n = 0
    while (n < limit and a0 + n < len(a) and b0 + n < len(b)
           and a[a0 + n] == b[b0 + n]):
        n += 1
    assert _common(a, a0, b, limit, b0) == n


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 1), max_size=400), st.lists(st.integers(0, 1), max_size=400),
       st.integers(0, 3), st.integers(0, 3), st.integers(0, 450))
def test_common_prefix_length_when_the_sequences_agree_again(a, b, a0, b0, limit):
    """Two-letter sequences agree again after they part, at any offset: the bisection's guess is
    wrong as often as not, and the answer must still be a naive scan's."""
    from pdserve.engine.prefix_cache import _common
    b = a[:len(b)] if len(b) % 3 == 0 else b        # (often a long shared part first)
    n = 0
    while (n < limit and a0 + n < len(a) and b0 + n < len(b)
           and a[a0 + n] == b[b0 + n]):
        n += 1
    assert _common(a, a0, b, limit, b0) == n


def test_common_prefix_length_at_every_mismatch_offset():
    """Every mismatch offset up to past the second galloping step (64 + 256 + 1024), against
    the offset it was built with."""
    from pdserve.engine.prefix_cache import _common
    base = list(range(1000, 2400))
    for k in range(0, 1400):
        other = [7, 7, 7] + base[:k] + [-1] + base[k + 1:]
        assert _common(other, 3, base, 5000) == k, k
        assert _common(base, 0, other, 5000, 3) == k, k
    assert _common(base, 0, base[:900], 5000) == 900           # one side ends
    assert _common(base, 10, base, 5000, 10) == len(base) - 10
    assert _common(base, 0, base, 333) == 333                   # the limit
