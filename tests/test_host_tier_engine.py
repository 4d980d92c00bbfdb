"""The KV cache's host tier (issue 21), engine side: swap preemption, prefix-cache offload and
load-back, the per-step KVMoves and their deferred releases.

- hand-computed cases: exact moves, block ids and counts;
- PrefillRate against sums computed by hand;
- a hypothesis state machine over Scheduler + KVCacheManager (both tiers, every preemption
  mode) driven by a shadow runner: it keeps, per device and per host block, which (position,
  token) each slot holds, applies each step's block copies and KVMoves and writes each chunk's
  tokens into its slots. Before writing it asserts that every position a chunk attends to holds
  the request's own token there, and that no chunk touches a block copied between tiers in its
  own step. Its "model" samples a token from what it reads there, so the outputs are compared
  with a naive reference that computes them from the token sequences alone (what an unpressured
  run yields). check_integrity after every step; at the end nothing leaks in either pool.
"""
import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pdserve.engine.kv_cache_manager import KVCacheManager, KVMoves
from pdserve.engine.prefill_rate import PrefillRate
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.sampling_params import SamplingParams

BS = 4
A = list(range(1, 13))


# ---- hand-computed cases -------------------------------------------------------------------
def test_a_two_block_leaf_is_offloaded_then_loaded_back():
    """Pool of 4 device blocks, 4 host blocks, block size 4. a's 8 tokens are cached in device
    blocks [0, 1]; b needs 3 blocks with 2 free: the leaf goes to host blocks [0, 1]
    (to_host (0, 0), (1, 1)), b waits a step (the blocks come free then) and gets [2, 3, 0].
    c matches the 8 host tokens: with one block free the load does not fit (the match stops
    before it, 0); once b is gone it loads into device blocks [1, 0]."""
    kv = KVCacheManager(4, BS, enable_prefix_caching=True, num_host_blocks=4)
    assert kv.allocate_slots("a", 0, 8) == [] and kv.block_tables["a"] == [0, 1]
    kv.free("a", A[:8])
    assert kv.pool.num_free_blocks == 2 and kv.num_cached_blocks == 2
    assert kv.allocate_slots("b", 0, 12) is None
    assert kv.room_arrives("b", 0, 12)
    assert kv.take_moves() == KVMoves([(0, 0), (1, 1)], [])
    assert kv.blocks_offloaded == 2 and kv.num_host_blocks_used == 2
    assert kv.pool.num_free_blocks == 2 and kv.pool.ref_counts[:2] == [1, 1]   # deferred
    kv.check_integrity()
    kv.begin_step()
    assert kv.pool.num_free_blocks == 4 and kv.num_cached_blocks == 0
    assert kv.prefix_cache.num_host_cached_blocks == 2
    assert kv.allocate_slots("b", 0, 12) == [] and kv.block_tables["b"] == [2, 3, 0]
    kv.check_integrity()
    c = A[:8] + [99]
    assert kv.match_prefix("c", c, 8) == 0            # 1 free block: the load does not fit
    assert kv.take_moves() is None and kv.prefix_host_hits == 0
    kv.free("b")
    assert kv.match_prefix("c", c, 8) == 8
    assert kv.block_tables["c"] == [1, 0]
    assert kv.take_moves() == KVMoves([], [(0, 1), (1, 0)])
    assert kv.table_busy("c") and kv.prefix_host_hits == 8 and kv.prefix_hits == 8
    assert kv.blocks_loaded_back == 2 and kv.num_host_blocks_used == 2   # released next step
    kv.check_integrity()
    kv.begin_step()
    assert kv.num_host_blocks_used == 0 and not kv.table_busy("c")
    kv.free("c", c[:8])
    kv.check_integrity()
    assert kv.reset_prefix_cache() == 2 and kv.pool.num_free_blocks == 4


def test_write_through_copies_at_insert_and_eviction_frees_at_once():
    """The same pools with write-through. a's leaf (device [0, 1]) is copied to host [0, 1] at
    the next step's start (not between steps: the copy's blocks are busy in the step that
    copies them). One step later b evicts it by dropping the device blocks, which are free at
    once: b gets [2, 3, 0] in that step with no copy. c's load back (host [0, 1] -> device
    [1, 0]) keeps the host blocks as the node's copy, so they stay used after the step."""
    kv = KVCacheManager(4, BS, enable_prefix_caching=True, num_host_blocks=4,
                        kv_offload_policy="write-through")
    assert kv.allocate_slots("a", 0, 8) == [] and kv.block_tables["a"] == [0, 1]
    kv.free("a", A[:8])
    assert kv.take_moves() is None and kv.blocks_offloaded == 0
    kv.begin_step()
    assert kv.take_moves() == KVMoves([(0, 0), (1, 1)], [])
    assert kv.blocks_offloaded == 2 and kv.num_host_blocks_used == 2
    assert kv.prefix_cache.num_host_cached_blocks == 2 and kv.num_cached_blocks == 2
    kv.check_integrity()
    kv.begin_step()
    assert kv.allocate_slots("b", 0, 12) == [] and kv.block_tables["b"] == [2, 3, 0]
    assert kv.take_moves() is None and kv.num_cached_blocks == 0
    kv.check_integrity()
    kv.free("b")
    c = A[:8] + [99]
    assert kv.match_prefix("c", c, 8) == 8 and kv.block_tables["c"] == [1, 0]
    assert kv.take_moves() == KVMoves([], [(0, 1), (1, 0)]) and kv.prefix_host_hits == 8
    kv.check_integrity()
    kv.begin_step()
    assert kv.num_host_blocks_used == 2 and kv.blocks_offloaded == 2   # the copy, no new one
    kv.free("c", c[:8])
    kv.check_integrity()
    assert kv.reset_prefix_cache() == 2 and kv.pool.num_free_blocks == 4
    kv.begin_step()
    assert kv.num_host_blocks_used == 0
    kv.check_integrity()
    with pytest.raises(ValueError, match="kv_offload_policy"):
        KVCacheManager(4, BS, kv_offload_policy="sometimes")


def test_a_parent_sharing_a_block_with_a_child_offloaded_in_the_same_step_is_kept():
    """Issue 21's multi-turn churn: a node boundary inside a block (a next turn diverging from
    the cached prompt + answer at the prompt's end) makes parent and child list the same block.
    Pool of 3 device blocks, 8 host blocks, block size 4. a caches A[:8] in [0, 1]; b's prompt
    A[:6] + [50, 51] matches 6 tokens (copy on write of block 1 into 2) and splits the leaf at
    position 6: U = A[:6] [0, 1], its children D = A[6:8] [1] (the same block 1) and
    N = [50, 51] [2]. c needs all 3 blocks: N, the least recently used leaf (D was locked by
    b's match when N was inserted, and queued at its unlock after), goes to host 0, D to
    host 1 (to_host (2, 0), (1, 1)); then U is a leaf, but its block 1 is read by D's copy
    this step. It is kept (not dropped with D and N): next step it goes to host [2, 3]
    (to_host (0, 2), (1, 3)), and c gets the blocks the step after, [2, 0, 1]. Then all 8
    tokens of b's prompt load back from the host: U into [1, 0], N into [2] (c's blocks freed
    tail first; to_device (2, 1), (3, 0), (0, 2))."""
    kv = KVCacheManager(3, BS, enable_prefix_caching=True, num_host_blocks=8)
    assert kv.allocate_slots("a", 0, 8) == [] and kv.block_tables["a"] == [0, 1]
    kv.free("a", A[:8])
    b = A[:6] + [50, 51]
    assert kv.match_prefix("b", b, 7) == 6 and kv.block_tables["b"] == [0, 1]
    assert kv.allocate_slots("b", 6, 2) == [(1, 2)] and kv.block_tables["b"] == [0, 2]
    kv.free("b", b)
    assert kv.pool.ref_counts == [1, 2, 1] and kv.num_cached_blocks == 4
    kv.check_integrity()
    assert kv.allocate_slots("c", 0, 12) is None
    assert kv.take_moves() == KVMoves([(2, 0), (1, 1)], [])
    assert kv.prefix_cache.num_host_cached_blocks == 2 and kv.num_cached_blocks == 2   # U kept
    assert not kv.room_arrives("c", 0, 12)        # (1 block arrives: 2, N's)
    kv.check_integrity()
    kv.begin_step()
    assert kv.pool.num_free_blocks == 1 and kv.pool.ref_counts == [1, 1, 0]
    assert kv.allocate_slots("c", 0, 12) is None
    assert kv.take_moves() == KVMoves([(0, 2), (1, 3)], [])
    assert kv.room_arrives("c", 0, 12) and kv.blocks_offloaded == 4
    kv.check_integrity()
    kv.begin_step()
    assert kv.allocate_slots("c", 0, 12) == [] and kv.block_tables["c"] == [2, 0, 1]
    assert kv.prefix_cache.num_host_cached_blocks == 4 and kv.num_cached_blocks == 0
    kv.free("c")
    kv.check_integrity()
    assert kv.match_prefix("d", b + [99], 8) == 8 and kv.block_tables["d"] == [1, 2]
    assert kv.take_moves() == KVMoves([], [(2, 1), (3, 0), (0, 2)])
    assert kv.prefix_host_hits == 8 and kv.blocks_loaded_back == 3
    kv.check_integrity()
    kv.begin_step()
    kv.free("d", b)
    kv.check_integrity()
    assert kv.reset_prefix_cache() == 3
    kv.begin_step()
    assert kv.pool.num_free_blocks == 3 and kv.num_host_blocks_used == 0


def test_swap_out_and_in_moves_exact_blocks():
    """a (7 tokens, blocks [0, 1]) and b (5 tokens, [2, 3]) fill a 4-block pool; a's decode
    needs a third block: b, the newest, is swapped (to_host (2, 0), (3, 1)), a waits for the
    step that frees b's blocks, then runs; b comes back when a finishes."""
    kv = KVCacheManager(4, BS, num_host_blocks=4)
    s = Scheduler(kv, 4, 64, preemption_mode="swap")
    a = Request("a", list(range(1, 8)), SamplingParams(max_tokens=3))
    b = Request("b", list(range(1, 6)), SamplingParams(max_tokens=3))
    s.add(a)
    s.add(b)

    def step():
        out = s.schedule()
        got = s.update({c.request_id: 7 for c in out.chunks if c.sample})
        s.check_integrity()
        return out, got

    out, _ = step()
    assert kv.block_tables == {"a": [0, 1], "b": [2, 3]} and out.kv_moves is None
    out, _ = step()       # a: position 7 fits block 1; b: position 5 fits block 3
    assert [c.request_id for c in out.chunks] == ["a", "b"]
    out, _ = step()       # a writes position 8: a new block; b is swapped, a waits
    assert out.preempted_ids == ["b"] and out.chunks == []
    assert out.kv_moves == KVMoves([(2, 0), (3, 1)], [])
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 6
    assert kv.host_tables == {"b": [0, 1]} and s.num_swap_preemptions == 1
    out, _ = step()
    assert [(c.request_id, c.start_pos) for c in out.chunks] == [("a", 8)]
    assert kv.block_tables["a"] == [0, 1, 3] and out.kv_moves is None   # (2 free, 3 reused)
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    # b back: host [0, 1] into fresh device blocks (free list [2] + a's [3, 1, 0], tail
    # first), runs next step
    out, _ = step()
    assert out.chunks == [] and out.kv_moves == KVMoves([], [(0, 2), (1, 3)])
    assert kv.block_tables["b"] == [2, 3] and b.status is RequestStatus.RUNNING
    out, _ = step()
    assert [(c.request_id, c.start_pos, c.token_ids) for c in out.chunks] == [("b", 6, [7])]
    assert kv.blocks_swapped_out == kv.blocks_swapped_in == 2 and kv.num_host_blocks_used == 0


def _run(s, kv, steps=60):
    """Steps until nothing is left (a request ends at max_tokens); the preempted ids, in order."""
    preempted = []
    for _ in range(steps):
        out = s.schedule()
        for r in s.update({c.request_id: 7 for c in out.chunks if c.sample}):
            if len(r.output_token_ids) >= r.params.max_tokens:
                s.finish(r, RequestStatus.FINISHED_LENGTH)
        kv.check_integrity()
        s.check_integrity()
        preempted += out.preempted_ids
        if not s.has_unfinished():
            return preempted
    raise AssertionError("did not finish")


@pytest.mark.parametrize("host", [0, 16])
def test_a_loaded_back_prefix_is_admitted_only_with_room_for_its_tail(host):
    """Pool of 10 blocks (size 4), budget 64. p's 8 tokens (2 blocks) and f's 32 (8 blocks)
    are cached; r (16 tokens, 8 out) takes 4 blocks, pushing both out (to the host, with one),
    and a 5th at its first decode: 5 free. c = p's 8 tokens + 24 new ones needs 2 + 6 blocks:
    with the host tier its prefix loads back (2 blocks, 3 left free), but its 24 tokens (6
    blocks) do not fit until r ends, so it waits, as it does without a host tier (where it has
    no prefix). Before the fix it was admitted with the load and then, the newest, preempted
    itself (swapped out what had just come back) every other step while r ran: 3 times."""
    kv = KVCacheManager(10, BS, enable_prefix_caching=True, num_host_blocks=host)
    s = Scheduler(kv, 8, 64)
    for rid, toks in (("p", A[:8]), ("f", list(range(300, 332)))):
        s.add(Request(rid, toks, SamplingParams(max_tokens=1)))
        assert _run(s, kv) == []
    r = Request("r", list(range(100, 116)), SamplingParams(max_tokens=8))
    s.add(r)

    def step():
        out = s.schedule()
        s.update({ch.request_id: 7 for ch in out.chunks if ch.sample})
        return out
    if host:                            # r waits a step for the offloaded blocks
        assert step().chunks == [] and kv.blocks_offloaded == 10
    assert [(ch.request_id, ch.start_pos) for ch in step().chunks] == [("r", 0)]
    assert len(kv.block_tables["r"]) == 4 and kv.pool.num_free_blocks == 6
    c = Request("c", A[:8] + list(range(200, 224)), SamplingParams(max_tokens=2))
    s.add(c)
    out = step()                        # r's first decode; c's prefix comes back, c waits
    assert [(ch.request_id, ch.start_pos) for ch in out.chunks] == [("r", 16)]
    if host:
        assert len(out.kv_moves.to_device) == 2 and kv.blocks_loaded_back == 2
    assert c.status is RequestStatus.WAITING and "c" not in kv.block_tables
    assert _run(s, kv) == []
    assert s.num_preemptions == 0 and kv.blocks_swapped_out == 0
    assert len(c.output_token_ids) == 2 and len(r.output_token_ids) == 8


@pytest.mark.parametrize("host", [0, 16])
def test_the_next_steps_room_is_offloaded_a_step_ahead(host):
    """Pool of 8 blocks (size 4), budget 16. a (16 tokens) takes blocks [0, 1, 2, 3] in step 1
    and is cached; b (16 other tokens) takes [4, 5, 6, 7] in step 2. Each step took 4 blocks,
    so with the host tier the end of step 2 offloads the least recently used leaf, a's (device
    [0, 1, 2, 3] -> host [0, 1, 2, 3]), and c (16 more) runs in step 3 in those blocks, as it
    does without the tier (where a is dropped then, its blocks freed tail first: [3, 2, 1, 0]).
    Step 3 offloads b's leaf the same way (host [4, 5, 6, 7]). Before the fix c waited a step
    for a's offload to come free."""
    kv = KVCacheManager(8, BS, enable_prefix_caching=True, num_host_blocks=host)
    s = Scheduler(kv, 8, 16)
    moves = []
    for rid, base in (("a", 100), ("b", 200), ("c", 300)):
        s.add(Request(rid, list(range(base, base + 16)), SamplingParams(max_tokens=1)))
        out = s.schedule()
        assert [(ch.request_id, ch.start_pos) for ch in out.chunks] == [(rid, 0)]
        assert kv.block_tables[rid] == {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7],
                                        "c": [0, 1, 2, 3] if host else [3, 2, 1, 0]}[rid]
        moves.append(out.kv_moves)
        for r in s.update({rid: 7}):
            s.finish(r, RequestStatus.FINISHED_LENGTH)
        s.check_integrity()
    if host:
        assert moves == [None, KVMoves(list(zip(range(4), range(4))), []),
                         KVMoves(list(zip(range(4, 8), range(4, 8))), [])]
        assert kv.blocks_offloaded == 8 and kv.prefix_cache.num_host_cached_tokens() == 32
    else:
        assert moves == [None, None, None] and kv.prefix_cache.num_cached_tokens() == 32


def test_a_request_short_of_room_that_arrives_keeps_its_match_locked():
    """Pool of 6 (size 4), 8 host blocks. a's 8 tokens are cached in [0, 1], b's in [2, 3]; m
    matches a's 8 (table [0, 1], locked) and x takes [4, 5]. m's next 4 tokens need a block:
    b's leaf, the only unlocked one, is offloaded (host [0, 1]), its blocks free next step, so
    m waits (room_arrives). Before the fix m then unlocked its match and evicted again: a's
    leaf, which m holds (no offload), was dropped, and the cache kept 8 tokens instead of 16.
    At the next step m gets block 2 and a's leaf is still there, locked by m."""
    kv = KVCacheManager(6, BS, enable_prefix_caching=True, num_host_blocks=8)
    for rid, toks in (("a", A[:8]), ("b", list(range(50, 58)))):
        kv.allocate_slots(rid, 0, 8)
        kv.free(rid, toks)
    assert kv.match_prefix("m", A[:8] + [99], 8) == 8 and kv.block_tables["m"] == [0, 1]
    assert kv.allocate_slots("x", 0, 8) == [] and kv.block_tables["x"] == [4, 5]
    assert kv.allocate_slots("m", 8, 4) is None and kv.room_arrives("m", 8, 4)
    assert kv.take_moves() == KVMoves([(2, 0), (3, 1)], [])
    assert kv.prefix_cache.num_cached_tokens() == 16 and "m" in kv._locked
    kv.check_integrity()
    kv.begin_step()
    assert kv.allocate_slots("m", 8, 4) == [] and kv.block_tables["m"] == [0, 1, 2]
    assert kv.prefix_cache.num_host_cached_tokens() == 8 and kv.num_cached_blocks == 2
    kv.check_integrity()


def test_reserve_slots_gives_a_loading_table_its_tail_blocks():
    """Pool of 6 (size 4), 4 host blocks: a's 8 tokens cached then offloaded by b (6 blocks).
    Once b is gone, c (a's 8 + 8 more) loads the 2 blocks back and reserve_slots(c, 8, 8) adds
    2 fresh blocks (not being loaded: only the first 2 are busy); 24 more positions (6 blocks,
    4 free) do not fit and change nothing."""
    kv = KVCacheManager(6, BS, enable_prefix_caching=True, num_host_blocks=4)
    kv.allocate_slots("a", 0, 8)
    kv.free("a", A[:8])
    assert kv.allocate_slots("b", 0, 24) is None      # (a offloaded: its blocks come next step)
    kv.begin_step()
    assert kv.allocate_slots("b", 0, 24) == []
    kv.free("b")
    kv.begin_step()
    c = A[:8] + list(range(50, 58))
    assert kv.match_prefix("c", c, 15) == 8 and kv.table_busy("c")
    loaded = list(kv.block_tables["c"])
    assert len(loaded) == 2 and kv.pool.num_free_blocks == 4
    assert not kv.reserve_slots("c", 8, 24) and kv.block_tables["c"] == loaded
    assert kv.reserve_slots("c", 8, 8)
    table = kv.block_tables["c"]
    assert table[:2] == loaded and len(table) == 4 and kv.pool.num_free_blocks == 2
    assert kv.pool.any_busy(table[:2]) and not kv.pool.any_busy(table[2:])
    kv.check_integrity()
    kv.begin_step()
    assert kv.allocate_slots("c", 8, 8) == [] and kv.block_tables["c"] == table
    kv.free("c", c)
    kv.check_integrity()


def _x_and_y_written_through(evict_x):
    """Pool of 6 device blocks, 16 host blocks, block size 4, write-through. X = A[:4] (device
    [0]) and Y = A[4:12] (device [1, 2], below X) are copied to host [0] and [1, 2] at the next
    step. A step later e's 5 blocks (6 with evict_x) evict Y, then X, at once (their blocks go
    back to the free list): e gets [3, 4, 5, 1, 2] (+ [0]) and frees them tail first. d's 16
    tokens then take 4 of them, cached as Z; 2 blocks stay free with X evicted, 1 without."""
    kv = KVCacheManager(6, BS, enable_prefix_caching=True, num_host_blocks=16,
                        kv_offload_policy="write-through")
    assert kv.allocate_slots("a", 0, 4) == [] and kv.block_tables["a"] == [0]
    kv.free("a", A[:4])
    assert kv.match_prefix("a2", A[:12], 11) == 4
    assert kv.allocate_slots("a2", 4, 8) == [] and kv.block_tables["a2"] == [0, 1, 2]
    kv.free("a2", A[:12])
    kv.begin_step()
    assert kv.take_moves() == KVMoves([(0, 0), (1, 1), (2, 2)], [])
    kv.begin_step()
    n = 6 if evict_x else 5
    assert kv.allocate_slots("e", 0, 4 * n) == [] and kv.take_moves() is None
    assert kv.block_tables["e"] == [3, 4, 5, 1, 2, 0][:n]
    kv.free("e")
    assert kv.prefix_cache.num_host_cached_tokens() == (12 if evict_x else 8)
    assert kv.allocate_slots("d", 0, 16) == []
    z = kv.block_tables["d"]
    assert z == ([0, 2, 1, 5] if evict_x else [2, 1, 5, 4])
    kv.free("d", list(range(100, 116)))
    assert kv.pool.num_free_blocks == (2 if evict_x else 1)
    kv.check_integrity()
    return kv, z


@pytest.mark.parametrize("max_waits", [Scheduler.MAX_LOAD_WAITS, 0])
@pytest.mark.parametrize("evict_x", [True, False])
def test_a_load_back_stopped_for_room_the_next_step_brings_waits_for_it(evict_x, max_waits):
    """Write-through; c = A[:12] + [99], 4 tokens a step, matches X and Y on the host
    (evict_x), or X on the device and Y on the host. Its first step starts by copying Z (d's
    leaf, inserted since the last step) to host [3, 4, 5, 6]. With evict_x X loads into the
    free block 4 (host 0 -> 4). Y needs 2 blocks with 1 free: evicting Z frees its 4 blocks
    only at the next step (Z's copy reads them), so the load stops there. c's first chunk
    fits (1 block: 3), so before the rule c ran with 4 of its 12 cached tokens (max_waits 0:
    with its waits spent, it still does). With the rule it waits, its blocks given back (3 at
    once): the next step Y loads into [3, 0] (evict_x) or [3, 2] (block 3, then Z's blocks
    tail first) and c is admitted with all 12 tokens and the block of its last position (2,
    or 1), and runs a step later."""
    kv, z = _x_and_y_written_through(evict_x)
    s = Scheduler(kv, 8, 4)
    s.MAX_LOAD_WAITS = max_waits
    c = Request("c", A[:12] + [99], SamplingParams(max_tokens=1))
    s.add(c)
    out = s.schedule()
    x = [4] if evict_x else [0]
    assert out.kv_moves == KVMoves(list(zip(z, [3, 4, 5, 6])), [(0, 4)] if evict_x else [])
    assert kv.pool.num_arriving == 4
    if not max_waits:           # admitted with the part that loaded, as before the rule
        assert c.num_cached_tokens == 4 and c.status is RequestStatus.RUNNING
        assert kv.block_tables["c"] == x + [3] and c.num_load_waits == 0
        if evict_x:
            assert out.chunks == []                       # (X loads this step)
            out = s.schedule()
        assert [(ch.request_id, ch.start_pos, ch.token_ids) for ch in out.chunks] == [
            ("c", 4, A[4:8])]
        return
    assert out.chunks == [] and c.status is RequestStatus.WAITING and c.num_load_waits == 1
    assert "c" not in kv.block_tables and kv.pool.num_free_blocks == 1
    s.check_integrity()
    out = s.schedule()
    y = [3, 0] if evict_x else [3, 2]
    assert out.kv_moves == KVMoves([], [(1, y[0]), (2, y[1])]) and out.chunks == []
    assert c.num_cached_tokens == 12 and c.status is RequestStatus.RUNNING
    assert kv.block_tables["c"] == x + y + ([2] if evict_x else [1])
    assert kv.blocks_loaded_back == (3 if evict_x else 2)
    assert kv.prefix_host_hits == (12 if evict_x else 8)
    s.check_integrity()
    out = s.schedule()
    assert [(ch.request_id, ch.start_pos, ch.token_ids) for ch in out.chunks] == [
        ("c", 12, [99])]
    assert out.kv_moves is None and c.num_load_waits == 1


def test_a_load_back_stopped_for_room_that_does_not_come_does_not_wait():
    """Pool of 3 (block size 4), write-through: X = A[:4] and Y = A[4:12] are copied to the
    host, then r's 3 blocks evict both at once ([1, 2, 0]); r keeps [0, 2]. c's match loads X
    into the free block 1 and stops at Y: nothing else can be evicted (X is c's own), so no
    room arrives and load_room_arrives says no. Once r is gone Y loads into [2, 0]."""
    kv = KVCacheManager(3, BS, enable_prefix_caching=True, num_host_blocks=8,
                        kv_offload_policy="write-through")
    kv.allocate_slots("a", 0, 4)
    kv.free("a", A[:4])
    kv.match_prefix("a2", A[:12], 11)
    kv.allocate_slots("a2", 4, 8)
    kv.free("a2", A[:12])
    kv.begin_step()
    assert kv.take_moves() == KVMoves([(0, 0), (1, 1), (2, 2)], [])
    kv.begin_step()
    assert kv.allocate_slots("r", 0, 12) == [] and kv.block_tables["r"] == [1, 2, 0]
    kv.free("r")
    assert kv.allocate_slots("r", 0, 8) == [] and kv.block_tables["r"] == [0, 2]
    c = A[:12] + [99]
    assert kv.match_prefix("c", c, 12) == 4 and kv.block_tables["c"] == [1]
    assert kv.take_moves() == KVMoves([], [(0, 1)])
    assert kv.pool.num_arriving == 0 and not kv.load_room_arrives("c")
    kv.free("c")
    kv.begin_step()
    kv.free("r")
    assert kv.match_prefix("c", c, 12) == 12 and kv.block_tables["c"] == [1, 2, 0]
    assert kv.take_moves() == KVMoves([], [(1, 2), (2, 0)])
    assert not kv.load_room_arrives("c")
    kv.check_integrity()


def test_forked_victims_and_p_d_holders_are_recomputed():
    kv = KVCacheManager(8, BS, num_host_blocks=8)
    s = Scheduler(kv, 4, 64, preemption_mode="swap")
    kv.allocate_slots("p", 0, 6)
    kv.fork("p", "c")
    assert kv.swap_blocks("p", 6) == 0          # shared with its sibling
    kv.allocate_slots("q", 0, 6)
    assert kv.swap_blocks("q", 6) == 2
    r = Request("q", [1] * 6, SamplingParams(), hold_kv=True, num_computed_tokens=6)
    assert not s._should_swap(r)
    with pytest.raises(ValueError):
        Scheduler(KVCacheManager(8, BS), 4, 64, preemption_mode="swap")
    with pytest.raises(ValueError):
        Scheduler(kv, 4, 64, preemption_mode="later")
    with pytest.raises(ValueError):
        KVCacheManager(8, BS, num_host_blocks=-1)


def test_cost_rule_compares_the_round_trip_with_the_measured_prefill():
    """A 2-block victim of 8 computed tokens, 1 MB per block, 10 GB/s: out and back 0.4 ms.
    Prefill measured at 1 ms / 20 tokens = 50 us per token -> 0.4 ms for 8: not cheaper, recompute;
    at 100 us per token (0.8 ms) swap."""
    kv = KVCacheManager(8, BS, num_host_blocks=8, kv_block_bytes=10**6)
    s = Scheduler(kv, 4, 64, host_copy_gb_per_s=10.0)
    kv.allocate_slots("v", 0, 8)
    v = Request("v", [1] * 8, SamplingParams(), num_computed_tokens=8)
    assert s._should_swap(v)                    # nothing measured yet: swap
    s.prefill_rate.add(20, 1e-3)
    assert not s._should_swap(v)
    s.prefill_rate.add(20, 3e-3)                # 4 ms / 40 tokens = 100 us per token
    assert s._should_swap(v)
    s.preemption_mode = "recompute"
    assert not s._should_swap(v)


def test_prefill_rate_is_a_ratio_of_sums_over_a_window():
    r = PrefillRate(window=2)
    assert r.seconds_per_token() is None
    r.add(0, 5.0)                               # no prefill: ignored
    r.add(10, float("nan"))                     # not a time: ignored
    assert r.seconds_per_token() is None
    r.add(100, 1.0)
    r.add(300, 1.0)
    assert r.seconds_per_token() == pytest.approx(2.0 / 400)
    r.add(100, 3.0)                             # the first step leaves the window
    assert r.seconds_per_token() == pytest.approx(4.0 / 400)
    with pytest.raises(ValueError):
        PrefillRate(0)


# ---- the state machine with a shadow runner ------------------------------------------------
V = 3                                           # tiny vocabulary: prefixes collide


def model(seq) -> int:
    """The fake model's next token after `seq` (what the reference computes from tokens)."""
    return (sum((i + 1) * t for i, t in enumerate(seq)) * 7 + len(seq)) % V


def reference(prompt, max_tokens):
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(model(seq))
    return seq[len(prompt):]


class ShadowRunner:
    def __init__(self, kv: KVCacheManager, bs: int):
        self.bs = bs
        self.dev = [[None] * bs for _ in range(kv.pool.num_blocks)]
        self.host = [[None] * bs for _ in range(kv.num_host_blocks)]

    def run(self, sched: Scheduler, out) -> dict[str, int]:
        bs = self.bs
        moves = out.kv_moves or KVMoves([], [])
        busy_dev = {d for d, _ in moves.to_host} | {d for _, d in moves.to_device}
        busy_host = {h for _, h in moves.to_host} | {h for h, _ in moves.to_device}
        # a block is moved at most once a step, and a freed busy block is not reused in it
        assert len(busy_dev) == len(moves.to_host) + len(moves.to_device), moves
        # (a host block saved this step may be loaded back in it: to_host copies run first)
        assert len({h for _, h in moves.to_host}) == len(moves.to_host), moves
        # (a host block may be read twice: write-through keeps a loaded node's host blocks as
        # its copy, so one evicted and matched again in the step loads from them again)
        for c in out.block_copies:   # (a copy may read a block being saved: both only read;
            # and one loaded into: the runner copies first, as done here)
            assert c.dst not in busy_dev, (c, moves)
        saved = [list(self.dev[c.src]) for c in out.block_copies]
        for c, slots in zip(out.block_copies, saved):
            self.dev[c.dst] = slots
        for d, h in moves.to_host:
            self.host[h] = list(self.dev[d])
        for h, d in moves.to_device:
            self.dev[d] = list(self.host[h])
        sampled = {}
        for ch in out.chunks:
            req = sched.requests[ch.request_id]
            end = ch.start_pos + len(ch.token_ids)
            table = ch.block_table
            seq = req.token_slice(0, end)
            assert ch.token_ids == seq[ch.start_pos:], ch
            used = table[:-(-end // bs)]
            assert not set(used) & busy_dev, f"{ch.request_id} touches a block moved this step"
            for p in range(ch.start_pos):
                got = self.dev[table[p // bs]][p % bs]
                assert got == (p, seq[p]), f"{ch.request_id}: position {p} holds {got}"
            for p in range(ch.start_pos, end):
                self.dev[table[p // bs]][p % bs] = (p, seq[p])
            if ch.sample:   # the model reads its context from the store
                ctx = [self.dev[table[p // bs]][p % bs][1] for p in range(end)]
                sampled[ch.request_id] = model(ctx)
        for f in out.forks:
            sampled[f.request_id] = sampled[f.parent_id]
        return sampled


class HostTierMachine(RuleBasedStateMachine):
    @initialize(bs=st.sampled_from([2, 4]), num_blocks=st.integers(6, 12),
                host=st.integers(0, 12), cache=st.booleans(),
                mode=st.sampled_from([None, "swap", "recompute"]), budget=st.integers(4, 12),
                policy=st.sampled_from(["on-eviction", "write-through"]))
    def setup(self, bs, num_blocks, host, cache, mode, budget, policy):
        if mode == "swap" and host == 0:
            mode = None
        self.bs, self.num_blocks = bs, num_blocks
        self.kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=cache,
                                 num_host_blocks=host, kv_offload_policy=policy)
        self.s = Scheduler(self.kv, 4, budget, preemption_mode=mode)
        self.runner = ShadowRunner(self.kv, bs)
        self.n = 0
        self.done: dict[str, tuple[list[int], list[int], int]] = {}
        self.bases = [[0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2], [1, 1, 1, 1, 2, 2, 2, 2, 0, 0]]

    @rule(base=st.integers(0, 1), cut=st.integers(0, 12), tail=st.lists(st.integers(0, 2),
          max_size=4), max_tokens=st.integers(1, 8), siblings=st.integers(0, 1))
    def add(self, base, cut, tail, max_tokens, siblings):
        prompt = self.bases[base][:cut] + tail or [base]
        if len(prompt) + max_tokens + 1 > self.num_blocks * self.bs:
            return                          # (the engine guarantees a sequence fits alone)
        p = SamplingParams(max_tokens=max_tokens)
        r = Request(f"r{self.n}", prompt, p)
        for i in range(siblings):
            r.siblings.append(Request(f"r{self.n}.{i}", prompt, p,
                                      status=RequestStatus.FORK_PENDING))
        self.n += 1
        self.s.add(r)

    @rule()
    def step(self):
        out = self.s.schedule()
        sampled = self.runner.run(self.s, out)
        for r in self.s.update(sampled):
            if len(r.output_token_ids) >= r.params.max_tokens:
                self.done[r.request_id] = (r.prompt_token_ids, list(r.output_token_ids),
                                           r.params.max_tokens)
                self.s.finish(r, RequestStatus.FINISHED_LENGTH)

    @rule(data=st.data())
    def abort(self, data):
        live = [r for r in self.s.requests.values() if r.status is not RequestStatus.FORK_PENDING]
        if live:
            self.s.finish(data.draw(st.sampled_from(live)), RequestStatus.FINISHED_ABORTED)

    @rule()
    def reset_cache(self):
        self.kv.reset_prefix_cache()

    @invariant()
    def integrity(self):
        self.s.check_integrity()

    @invariant()
    def outputs_match_the_reference(self):
        for rid, (prompt, got, max_tokens) in self.done.items():
            assert got == reference(prompt, max_tokens), rid
        self.done.clear()

    def teardown(self):
        for _ in range(500):
            if not self.s.has_unfinished():
                break
            self.step()
            self.s.check_integrity()
        assert not self.s.has_unfinished()
        self.outputs_match_the_reference()
        self.kv.begin_step()
        self.kv.reset_prefix_cache()
        self.kv.begin_step()
        self.kv.check_integrity()
        assert self.kv.pool.num_free_blocks == self.num_blocks, "device blocks leaked"
        if self.kv.host_pool is not None:
            assert self.kv.host_pool.num_free_blocks == self.kv.num_host_blocks, "host leaked"
        assert not self.kv.block_tables and not self.kv.host_tables


TestHostTierMachine = HostTierMachine.TestCase
TestHostTierMachine.settings = settings(
    max_examples=int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "80")), stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
