"""KVCoordinator (the scheduler's side of P/D KV transfer), driven through the Scheduler with
exact expectations: load back-pressure, what an ok / failed / timed-out / dropped load does to
its sequence and to the next step's KV work, and held blocks with their expiry."""
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_coordinator import KVCoordinator
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.protocol import KVLoad, KVLoadDone, KVSend, KVSource
from pdserve.sampling_params import SamplingParams

P = SamplingParams()


def make(num_blocks=8, max_loads=64, **kw):
    kv = KVCacheManager(num_blocks, 4)
    coord = KVCoordinator(kv, max_loads=max_loads, transfer_timeout_s=30.0,
                          hold_timeout_s=300.0, **kw)
    return Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, kv_coordinator=coord), coord


def remote(rid, n_prompt=5):
    """A consumer's sequence: prompt on the producer in blocks [10, 11], its first token 9."""
    r = Request(rid, list(range(1, n_prompt + 1)), P, output_token_ids=[9])
    return r, KVSource("p", rid, [10, 11], n_prompt, [9])


def test_loads_start_under_back_pressure_and_resolve():
    sched, coord = make(max_loads=1)
    (a, sa), (b, sb) = remote("a"), remote("b")
    sched.add_remote(a, sa)
    sched.add_remote(b, sb)
    out = sched.schedule()
    assert out.chunks == [] and out.kv_work.loads == [KVLoad("a", "p", [10, 11], [0, 1])]
    assert a.status is RequestStatus.LOADING_KV and list(coord.waiting) == [b]
    assert sched.schedule().kv_work is None            # b waits: one load at a time
    coord.loads_started(out.kv_work, now=0.0)
    sched.finish_loads(coord.poll([KVLoadDone("a", True, 64, 0.1)], now=1.0))
    assert a.status is RequestStatus.RUNNING and a.num_computed_tokens == 5
    out = sched.schedule()                              # a decodes; b's load starts
    assert [(c.request_id, c.token_ids, c.start_pos) for c in out.chunks] == [("a", [9], 5)]
    assert out.kv_work.verdicts == [("a", True)]
    assert out.kv_work.loads == [KVLoad("b", "p", [10, 11], [2, 3])]
    sched.check_integrity()


def test_a_failed_load_is_recomputed_first_and_cancelled_everywhere():
    sched, coord = make()
    a, sa = remote("a")
    sched.add_remote(a, sa)
    sched.add(Request("w", [1, 2], P))
    out = sched.schedule()
    coord.loads_started(out.kv_work, now=0.0)
    sched.update({"w": 3})
    sched.finish_loads(coord.poll([KVLoadDone("a", False, 0, 0.1, "lost")], now=1.0))
    assert a.status is RequestStatus.WAITING and a.num_computed_tokens == 0
    assert "a" not in sched.kv.block_tables and list(sched.waiting) == [a]
    out = sched.schedule()     # a recomputes its prompt and the producer's token in one chunk
    assert out.kv_work.verdicts == [("a", False)]
    assert [(c.request_id, c.token_ids) for c in out.chunks] == [("w", [3]),
                                                                 ("a", [1, 2, 3, 4, 5, 9])]
    sched.check_integrity()


def test_timeouts_and_stale_reports():
    sched, coord = make()
    a, sa = remote("a")
    sched.add_remote(a, sa)
    coord.loads_started(sched.schedule().kv_work, now=100.0)
    assert coord.poll([KVLoadDone("zzz", True, 1, 0.1)], now=129.0) == []   # not ours
    assert coord.poll([], now=130.0) == []                                   # 30 s: not yet
    (done,) = coord.poll([], now=130.5)
    assert (done.request_id, done.ok, done.error) == ("a", False, "timed out after 30 s")
    sched.finish_loads([done])
    assert coord.poll([KVLoadDone("a", True, 1, 0.1)], now=131.0) == []     # late report
    assert a.status is RequestStatus.WAITING


def test_dropping_a_sequence_cancels_or_discards_its_load():
    sched, coord = make(num_blocks=2, two_sided=True)
    (a, sa), (b, sb) = remote("a"), remote("b")
    sched.add_remote(a, sa)
    sched.add_remote(b, sb)
    out = sched.schedule()                              # a loads into both blocks; b waits
    coord.loads_started(out.kv_work, now=0.0)
    assert [l.request_id for l in out.kv_work.loads] == ["a"]
    sched.finish(a, RequestStatus.FINISHED_ABORTED)     # loading: cancelled, blocks freed
    sched.finish(b, RequestStatus.FINISHED_ABORTED)     # no blocks yet: receive-and-discard
    work = sched.schedule().kv_work
    assert work.verdicts == [("a", False)]
    assert work.loads == [KVLoad("b", "p", [10, 11], [])]
    assert coord.poll([KVLoadDone("a", True, 1, 0.1)], now=1.0) == []
    assert sched.kv.num_free_blocks() == 2 and not sched.has_unfinished()
    sched.check_integrity()


def test_held_blocks_are_sent_released_or_expire():
    sched, coord = make()
    for rid in ("x", "y", "z"):
        r = Request(rid, [1, 2, 3, 4, 5], P, hold_kv=True)
        sched.add(r)
        sched.schedule()
        sched.update({rid: 7})
        assert sched.finish(r, RequestStatus.FINISHED_LENGTH, now=10.0) == \
            coord.held[rid][0]
    assert sched.kv.num_free_blocks() == 8 - 3 * 2
    sched.check_integrity()
    x = list(coord.held["x"][0])
    assert x == [0, 1]                                 # (the pool hands out 0, 1 first)
    coord.send_held("x", KVSend("X", "d", x))          # held, 2 blocks: sent as they are
    coord.send_held("x", KVSend("X", "d", x))          # no longer held: filler, not ok
    work = coord.take_work()
    assert [(s.request_id, s.ok, s.block_ids) for s in work.sends] == [
        ("X", True, [0, 1]), ("X", False, [0, 0])]
    assert coord.release_held("y") and not coord.release_held("y")
    assert coord.expire_held(now=310.0) == 0 and coord.expire_held(now=310.5) == 1
    assert not coord.held and sched.kv.num_free_blocks() == 8
    sched.check_integrity()


# ---- two-sided: the router skips the blocks it believes the consumer holds ------------------
def cached(blocks=2, num_blocks=8):
    """A two-sided consumer with prefix caching whose cache holds tokens 1..4*blocks (whole
    blocks of 4, in the pool's first blocks: 0, 1, ...), computed here by an earlier sequence."""
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=True)
    coord = KVCoordinator(kv, two_sided=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, kv_coordinator=coord)
    n = 4 * blocks
    assert kv.allocate_slots("old", 0, n) == [] and kv.block_tables["old"] == list(range(blocks))
    kv.free("old", list(range(1, n + 1)))
    return sched, coord


def tail_remote(rid, skip):
    """A 10-token prompt (1..10: 3 blocks of 4) held on the producer in blocks [20, 21, 22], its
    first token 99, the router having skipped `skip` blocks."""
    r = Request(rid, list(range(1, 11)), P, output_token_ids=[99])
    return r, KVSource("p", rid, [20, 21, 22], 10, [99], skip_blocks=skip)


def test_two_sided_reuses_the_skipped_blocks_and_receives_the_tail():
    sched, coord = cached(blocks=2)
    a, sa = tail_remote("a", skip=2)
    sched.add_remote(a, sa)
    out = sched.schedule()
    (load,) = out.kv_work.loads
    table = sched.kv.block_tables["a"]
    assert table[:2] == [0, 1]                          # positions 0..7: this worker's own
    assert load == KVLoad("a", "p", [22], table[2:]) and len(table) == 3
    assert a.num_cached_tokens == 8 and a.status is RequestStatus.LOADING_KV
    coord.loads_started(out.kv_work, now=0.0)
    sched.finish_loads(coord.poll([KVLoadDone("a", True, 64, 0.1)], now=1.0))
    out = sched.schedule()                              # decodes after the producer's token
    assert [(c.request_id, c.token_ids, c.start_pos) for c in out.chunks] == [("a", [99], 10)]
    # dropped before its load: the tail is still received (and discarded), as it is sent
    b, sb = tail_remote("b", skip=1)
    sched.kv.allocate_slots("hog", 0, 4 * sched.kv.num_free_blocks())   # no room: b waits
    sched.add_remote(b, sb)
    sched.schedule()
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert sched.schedule().kv_work.loads == [KVLoad("b", "p", [21, 22], [])]
    sched.kv.free("hog")
    sched.check_integrity()


def test_two_sided_skipped_blocks_gone_receive_the_tail_and_recompute():
    """The router guessed two cached blocks; only one is still here: the tail the producer sends
    is received and discarded, the sequence is recomputed here from the prompt (reusing the one
    block it does have), then continues after the producer's token; the load is reported
    failed (once, nothing to judge)."""
    sched, coord = cached(blocks=1)
    a, sa = tail_remote("a", skip=2)
    sched.add_remote(a, sa)
    out = sched.schedule()
    assert out.chunks == [] and out.kv_work.loads == [KVLoad("a", "p", [22], [])]
    assert a.status is RequestStatus.WAITING and list(sched.waiting) == [a]
    assert "a" not in sched.kv.block_tables and not coord.sources and not coord.loading
    coord.loads_started(out.kv_work, now=0.0)
    (done,) = coord.poll([], now=0.0)
    assert (done.request_id, done.ok, done.nbytes) == ("a", False, 0)
    assert "no longer cached" in done.error
    sched.finish_loads([done])                          # (not loading: nothing to place)
    assert coord.poll([], now=1.0) == [] and list(sched.waiting) == [a]
    out = sched.schedule()
    assert [(c.request_id, c.token_ids, c.start_pos) for c in out.chunks] == [
        ("a", [5, 6, 7, 8, 9, 10, 99], 4)]
    assert a.num_cached_tokens == 4 and out.kv_work is None
    sched.update({"a": 5})
    sched.check_integrity()


def test_two_sided_producer_sends_a_tail_of_what_it_holds_else_filler():
    sched, coord = make(num_blocks=12)
    tables = {}
    for rid in ("x", "y", "z", "w"):
        r = Request(rid, list(range(1, 10)), P, hold_kv=True)      # 9 tokens: 3 blocks
        sched.add(r)
        sched.schedule()
        sched.update({rid: 7})
        tables[rid] = list(sched.finish(r, RequestStatus.FINISHED_LENGTH, now=0.0))
    x, y, z, w = (tables[r] for r in "xyzw")
    assert len(set(x + y + z + w)) == 12
    coord.send_held("x", KVSend("X", "d", x[1:]))          # its last two blocks: a tail
    coord.send_held("y", KVSend("Y", "d", [y[0], y[2]]))   # not a tail of y's table
    coord.send_held("z", KVSend("Z", "d", [0] + z))        # more blocks than it holds
    coord.send_held("w", KVSend("W", "d", x[1:]))          # another table's tail
    work = coord.take_work()
    assert [(s.request_id, s.ok, s.block_ids) for s in work.sends] == [
        ("X", True, x[1:]), ("Y", False, [0, 0]), ("Z", False, [0] * 4), ("W", False, [0, 0])]
    assert not coord.held and sched.kv.num_free_blocks() == 12
    sched.check_integrity()
