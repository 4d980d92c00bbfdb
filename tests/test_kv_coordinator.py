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
    coord.send_held("x", KVSend("X", "d", [0, 0]))     # held, 2 blocks: sent as they are
    coord.send_held("x", KVSend("X", "d", [0, 0]))     # no longer held: filler, not ok
    work = coord.take_work()
    assert [(s.request_id, s.ok) for s in work.sends] == [("X", True), ("X", False)]
    assert work.sends[1].block_ids == [0, 0]
    assert coord.release_held("y") and not coord.release_held("y")
    assert coord.expire_held(now=310.0) == 0 and coord.expire_held(now=310.5) == 1
    assert not coord.held and sched.kv.num_free_blocks() == 8
    sched.check_integrity()
