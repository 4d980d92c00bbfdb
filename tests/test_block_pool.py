"""Block pool and KV cache manager: exact block ids, ref counts, fork, copy-on-write."""
import pytest

from pdserve.engine.block_pool import BlockPool, NoFreeBlocksError
from pdserve.engine.kv_cache_manager import BlockCopy, KVCacheManager


def test_pool_allocates_in_order_and_reuses_least_recently_freed():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.release([1])
    pool.release([0])
    assert pool.allocate(2) == [3, 1]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    pool.check_integrity([[2], [3, 1]])
    with pytest.raises(AssertionError):
        pool.check_integrity([[2]])


def test_pool_refcounts():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.incref([b])
    pool.release([b])
    assert pool.num_free_blocks == 1
    pool.release([b])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        pool.release([b])
    with pytest.raises(ValueError):
        BlockPool(0)


def test_pool_counts_blocks_only_the_cache_holds():
    pool = BlockPool(4)
    a, b = pool.allocate(2)                # a request holds a and b
    pool.incref([a, b], cached=True)       # the cache lists both
    assert pool.num_cache_only == 0        # the request still uses them
    pool.release([a])                      # the request lets a go: only the cache has it
    assert pool.num_cache_only == 1 and pool.num_free_blocks == 2
    pool.incref([a])                       # a new request matches a
    assert pool.num_cache_only == 0
    pool.incref([a], cached=True)          # a second cache listing (a split mid-block)
    pool.release([a])                      # the request goes: two cache refs, nobody else
    assert pool.num_cache_only == 1 and pool.ref_counts[a] == 2
    pool.release([a], cached=True)
    assert pool.num_cache_only == 1
    pool.release([a], cached=True)         # evicted: free, not cache-only
    assert pool.num_cache_only == 0 and pool.num_free_blocks == 3
    pool.check_integrity([[b]], [[b]])
    with pytest.raises(AssertionError):    # the cache's reference counted as a request's
        pool.check_integrity([[b], [b]])
    pool.release([b], cached=True)         # the cache drops b: the request still holds it
    assert pool.ref_counts[b] == 1 and pool.num_cache_only == 0
    with pytest.raises(RuntimeError):      # a cached release of a block the cache does not hold
        pool.release([b], cached=True)


def test_allocate_slots_grows_table_by_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 0, 5) == []
    assert kv.block_tables["a"] == [0, 1]
    assert kv.allocate_slots("a", 5, 3) == []      # positions 5..7 fit in block 1
    assert kv.block_tables["a"] == [0, 1]
    assert kv.allocate_slots("a", 8, 1) == []
    assert kv.block_tables["a"] == [0, 1, 2]
    assert kv.allocate_slots("b", 0, 24) is None    # 6 blocks needed, 5 free: nothing changes
    assert "b" not in kv.block_tables and kv.num_free_blocks() == 5
    kv.free("a")
    kv.check_integrity()
    assert kv.num_free_blocks() == 8


def test_fork_shares_blocks_and_copies_on_write():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("p", 0, 6)                    # blocks [0, 1]; block 1 half full
    kv.fork("p", "c")
    assert kv.block_tables["c"] == [0, 1]
    assert kv.pool.ref_counts[:2] == [2, 2]
    kv.check_integrity()
    # the child writes position 6 into the shared block 1: it gets a private copy
    assert kv.allocate_slots("c", 6, 1) == [BlockCopy(1, 2)]
    assert kv.block_tables["c"] == [0, 2]
    # the parent is now the only holder of block 1: it writes in place
    assert kv.allocate_slots("p", 6, 1) == []
    assert kv.block_tables["p"] == [0, 1]
    kv.check_integrity()
    kv.free("p")
    kv.free("c")
    assert kv.num_free_blocks() == 8


def test_fork_at_block_boundary_needs_no_copy():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("p", 0, 8)
    kv.fork("p", "c")
    assert kv.allocate_slots("c", 8, 1) == []
    assert kv.block_tables["c"] == [0, 1, 2]
    kv.check_integrity()
