"""Two-sided P/D: the consumer's receives meet the producer's sends in order. A fake wire, written
from the pairing contract (connectors/pair.py) and not from the coordinator, stands between them:
each producer's sends form a FIFO (the router asks for them in the order it hands the requests
over); every load the consumer's steps carry takes the front send of its producer, which must be
that request's, with as many blocks; what it receives lands in its destination blocks (none: a
receive-and-discard). The scenarios drop, abort or mismatch a request while another from the same
producer is waiting, loading, or admitted before it, and a seeded random walk mixes them all."""
import random
from collections import deque

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_coordinator import KVCoordinator
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.protocol import KVLoadDone, KVSource
from pdserve.sampling_params import SamplingParams

P = SamplingParams()
BS = 4


class Wire:
    """Per producer, the sends not received yet; the consumer's block contents; each receive as
    (the receiving request, the sending request or None: nothing sent, a hang on a real pair)."""

    def __init__(self):
        self.sends: dict[str, deque] = {}
        self.blocks: dict[int, str] = {}
        self.pairs: list[tuple[str, str | None]] = []
        self.sizes_ok = True

    def send(self, src: KVSource) -> None:
        self.sends.setdefault(src.worker, deque()).append(
            (src.request_id, [f"{src.request_id}@{b}" for b in src.sent_block_ids]))

    def carry(self, work) -> None:
        """The step's loads, in the order the connector starts them (model_runner._kv_work)."""
        if work is None:
            return
        for load in work.loads:
            q = self.sends.get(load.worker)
            if not q:
                self.pairs.append((load.request_id, None))
                continue
            rid, payload = q.popleft()
            self.pairs.append((load.request_id, rid))
            self.sizes_ok &= len(payload) == len(load.src_block_ids)
            for dst, data in zip(load.dst_block_ids, payload):
                self.blocks[dst] = data

    def check(self) -> None:
        wrong = [(r, s) for r, s in self.pairs if r != s]
        assert not wrong, f"receives paired with other requests' sends: {wrong}"
        assert self.sizes_ok, "a receive's block count differs from its send's"


def make(num_blocks=8, max_loads=64, max_num_seqs=4, caching=False):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)
    coord = KVCoordinator(kv, max_loads=max_loads, two_sided=True)
    sched = Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                      kv_coordinator=coord)
    return sched, coord, Wire()


def handoff(sched, wire, rid, producer="p", n_prompt=5, skip=0):
    """The router hands `rid` to the consumer and asks its producer to send (in that order). The
    prompt is 1..n_prompt, held on the producer in blocks 100.. (one per 4 tokens)."""
    nb = -(-n_prompt // BS)
    r = Request(rid, list(range(1, n_prompt + 1)), P, output_token_ids=[9])
    src = KVSource(producer, rid, list(range(100, 100 + nb)), n_prompt, [9], skip_blocks=skip)
    sched.add_remote(r, src)
    wire.send(src)
    return r


def step(sched, coord, wire, now=0.0):
    work = sched.schedule()
    wire.carry(work.kv_work)
    coord.loads_started(work.kv_work, now)
    return work


def land(sched, coord, wire, req, now=1.0):
    """req's load reports ok; its received blocks must hold its own KV, block for block."""
    table = list(sched.kv.block_tables[req.request_id])
    sched.finish_loads(coord.poll([KVLoadDone(req.request_id, True, 1, 0.1)], now))
    assert req.status is RequestStatus.RUNNING
    k = req.num_cached_tokens // BS
    assert [wire.blocks.get(b) for b in table[k:]] == \
        [f"{req.request_id}@{100 + i}" for i in range(k, len(table))]


def hog(sched):
    """Take every free block (nothing can start loading until `unhog`)."""
    sched.kv.allocate_slots("hog", 0, BS * sched.kv.num_free_blocks())


def unhog(sched):
    sched.kv.free("hog")


def test_dropping_a_later_waiting_request_waits_for_the_earlier_ones_receive():
    """A and B from p wait for blocks; B is aborted; B's receive-and-discard must not be issued
    before A's receive (it would take A's send, and A B's)."""
    sched, coord, wire = make()
    hog(sched)
    a = handoff(sched, wire, "a")
    b = handoff(sched, wire, "b", n_prompt=9)       # (3 blocks: the sizes differ too)
    step(sched, coord, wire)
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    step(sched, coord, wire)                        # a still has no blocks
    unhog(sched)
    step(sched, coord, wire)
    wire.check()
    assert wire.pairs == [("a", "a"), ("b", "b")]
    land(sched, coord, wire, a)
    sched.check_integrity()


def test_an_abort_right_after_hand_off_keeps_the_order_within_one_step():
    """The router hands over A and B, then B's abort (the client left meanwhile) arrives before
    the consumer's next step: that step carries A's load, then B's discard."""
    sched, coord, wire = make()
    a = handoff(sched, wire, "a")
    b = handoff(sched, wire, "b")
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    work = step(sched, coord, wire)
    assert [(l.request_id, bool(l.dst_block_ids)) for l in work.kv_work.loads] == [
        ("a", True), ("b", False)]
    wire.check()
    land(sched, coord, wire, a)
    sched.check_integrity()


def test_aborting_the_earlier_request_discards_it_first():
    sched, coord, wire = make()
    hog(sched)
    a = handoff(sched, wire, "a")
    b = handoff(sched, wire, "b")
    step(sched, coord, wire)
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    step(sched, coord, wire)                        # a's discard need not wait for anything
    assert wire.pairs == [("a", "a")]
    unhog(sched)
    step(sched, coord, wire)
    wire.check()
    assert wire.pairs == [("a", "a"), ("b", "b")]
    land(sched, coord, wire, b)
    sched.check_integrity()


def test_aborts_while_an_earlier_request_is_loading():
    """A loads (its receive is issued); B and C wait behind back-pressure. C, then A, abort: A's
    load is cancelled, C's discard waits for B's receive."""
    sched, coord, wire = make(max_loads=1)
    a = handoff(sched, wire, "a")
    b = handoff(sched, wire, "b")
    c = handoff(sched, wire, "c")
    step(sched, coord, wire)
    assert a.status is RequestStatus.LOADING_KV and wire.pairs == [("a", "a")]
    sched.finish(c, RequestStatus.FINISHED_ABORTED)
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    work = step(sched, coord, wire)
    assert work.kv_work.verdicts == [("a", False)]
    wire.check()
    assert wire.pairs == [("a", "a"), ("b", "b"), ("c", "c")]
    assert coord.poll([KVLoadDone("a", True, 1, 0.1)], 1.0) == []   # cancelled: not news
    land(sched, coord, wire, b)
    assert not coord.waiting and not sched.kv.block_tables.keys() - {"b"}
    sched.check_integrity()


def test_another_producers_discard_is_not_held_back():
    """Only the same producer's order binds: q's send must not wait (and time out) behind p's
    request that has no blocks yet."""
    sched, coord, wire = make()
    hog(sched)
    a = handoff(sched, wire, "a", producer="p")
    b = handoff(sched, wire, "b", producer="q")
    step(sched, coord, wire)
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    step(sched, coord, wire)
    assert wire.pairs == [("b", "b")]
    unhog(sched)
    step(sched, coord, wire)
    wire.check()
    land(sched, coord, wire, a)
    sched.check_integrity()


def test_a_mismatch_discard_after_a_dropped_later_request():
    """A's skipped blocks are gone here (discard + recompute, a 1-block tail); B behind it from
    the same producer was aborted before the consumer's step (a 3-block send)."""
    sched, coord, wire = make(caching=True)
    a = handoff(sched, wire, "a", n_prompt=10, skip=2)
    b = handoff(sched, wire, "b", n_prompt=10)
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    step(sched, coord, wire)
    wire.check()
    assert wire.pairs == [("a", "a"), ("b", "b")]
    assert a.status is RequestStatus.WAITING       # recomputed here
    sched.check_integrity()


def test_random_walk_keeps_every_receive_paired_with_its_send():
    rng = random.Random(16)
    for trial in range(150):
        sched, coord, wire = make(num_blocks=rng.choice([3, 6, 10]),
                                  max_loads=rng.choice([1, 2, 8]),
                                  max_num_seqs=rng.choice([1, 2, 4]))
        live, n, now = [], 0, 0.0
        for _ in range(40):
            op = rng.random()
            if op < 0.35:
                n += 1
                live.append(handoff(sched, wire, f"r{n}", producer=rng.choice("pq"),
                                    n_prompt=rng.randint(1, 9)))
            elif op < 0.55 and live:
                r = live.pop(rng.randrange(len(live)))
                sched.finish(r, RequestStatus.FINISHED_ABORTED)
            elif op < 0.7:
                loading = list(coord.started)
                if loading:
                    rid = rng.choice(loading)
                    req = coord.loading[rid]
                    land(sched, coord, wire, req, now)
                    sched.finish(req, RequestStatus.FINISHED_ABORTED)   # done: make room
                    live.remove(req)
            else:
                now += 1.0
                step(sched, coord, wire, now)
                for r in list(live):
                    if r.status is RequestStatus.RUNNING:
                        live.remove(r)
                        sched.finish(r, RequestStatus.FINISHED_ABORTED)
            sched.check_integrity()
        for r in list(live):
            sched.finish(r, RequestStatus.FINISHED_ABORTED)
        step(sched, coord, wire, now + 1)
        wire.check()
        assert not any(wire.sends.values()), f"trial {trial}: sends never received"
