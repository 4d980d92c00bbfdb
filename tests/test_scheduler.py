"""Scheduler: exact expectations for chunked prefill, budgets, preemption and forks, plus a
hypothesis state machine (random add / step / abort / finish) that checks integrity every step."""
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.sampling_params import SamplingParams

P = SamplingParams()


def make(num_blocks=16, block_size=4, max_seqs=8, budget=16):
    return Scheduler(KVCacheManager(num_blocks, block_size), max_seqs, budget)


def req(rid, n_prompt, siblings=0):
    r = Request(rid, list(range(1, n_prompt + 1)), P)
    for i in range(siblings):
        s = Request(f"{rid}.{i}", r.prompt_token_ids, P, status=RequestStatus.FORK_PENDING)
        r.siblings.append(s)
    return r


def step(s: Scheduler, token=7):
    out = s.schedule()
    got = s.update({c.request_id: token for c in out.chunks if c.sample}
                   | {f.request_id: token for f in out.forks})
    s.check_integrity()
    return out, got


def test_chunked_prefill_mixes_with_decode():
    s = make(budget=8)
    s.add(req("a", 3))
    s.add(req("b", 20))
    out, got = step(s)
    assert [(c.request_id, len(c.token_ids), c.sample) for c in out.chunks] == [
        ("a", 3, True), ("b", 5, False)]
    assert [r.request_id for r in got] == ["a"]
    out, _ = step(s)  # a decodes one token, b gets the rest of the budget
    assert [(c.request_id, len(c.token_ids), c.start_pos) for c in out.chunks] == [
        ("a", 1, 3), ("b", 7, 5)]
    assert out.chunks[0].token_ids == [7]


def test_max_num_seqs_limits_admission():
    s = make(max_seqs=2)
    for i in range(3):
        s.add(req(str(i), 2))
    out, _ = step(s)
    assert [c.request_id for c in out.chunks] == ["0", "1"]
    assert [r.request_id for r in s.waiting] == ["2"]


def test_preempts_newest_and_recomputes_later():
    s = make(num_blocks=4, block_size=4, budget=64)
    a, b = req("a", 8), req("b", 7)
    s.add(a)
    s.add(b)
    step(s)                        # a: blocks 0,1 (full); b: blocks 2,3 (3 of 4 used)
    assert s.kv.num_free_blocks() == 0
    step(s)                        # a needs block 4 -> b preempted
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids == [7] and b.num_preemptions == 1
    assert list(s.waiting) == [b]
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    out, _ = step(s)               # b recomputes prompt + its generated token in one chunk
    assert [(c.request_id, c.token_ids, c.sample) for c in out.chunks] == [
        ("b", [1, 2, 3, 4, 5, 6, 7, 7], True)]
    assert b.output_token_ids == [7, 7]


def test_preempted_requests_go_to_the_front_of_the_queue_oldest_first():
    """Three 4-token prompts fill a 3-block pool (block size 4) while a fourth waits for a
    sequence slot. Their first decode needs a fifth position, a new block each: a takes the
    newest's (c is preempted), then b, with nothing left to take, is preempted itself. A
    preempted request was admitted before anything still waiting, so both go ahead of w, and
    in their admission order: b, c, w. Once a finishes, b (two blocks) runs first."""
    s = make(num_blocks=3, block_size=4, max_seqs=3, budget=64)
    a, b, c, w = req("a", 4), req("b", 4), req("c", 4), req("w", 4)
    for r in (a, b, c, w):
        s.add(r)
    out, _ = step(s)
    assert [ch.request_id for ch in out.chunks] == ["a", "b", "c"] and list(s.waiting) == [w]
    out, _ = step(s)
    assert out.preempted_ids == ["c", "b"]
    assert [ch.request_id for ch in out.chunks] == ["a"]
    assert list(s.waiting) == [b, c, w]
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    out, _ = step(s)    # b: 5 tokens in 2 blocks; c would need 2 more of the 1 left
    assert [ch.request_id for ch in out.chunks] == ["b"]
    assert list(s.waiting) == [c, w]


def test_fork_shares_prompt_blocks():
    s = make(num_blocks=16, block_size=4)
    s.add(req("p", 6, siblings=2))
    out, got = step(s)
    assert [f.request_id for f in out.forks] == ["p.0", "p.1"]
    assert {r.request_id for r in got} == {"p", "p.0", "p.1"}
    assert s.kv.block_tables["p.0"] == s.kv.block_tables["p"]
    assert s.kv.pool.ref_counts[s.kv.block_tables["p"][0]] == 3
    out, _ = step(s)               # each child writes position 6 into the shared block -> copies
    assert len(out.block_copies) == 2


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.s = make(num_blocks=12, block_size=4, max_seqs=6, budget=10)
        self.n = 0
        self.max_tokens: dict[str, int] = {}

    @rule(n_prompt=st.integers(1, 20), max_tokens=st.integers(1, 12), siblings=st.integers(0, 2))
    def add(self, n_prompt, max_tokens, siblings):
        r = req(f"r{self.n}", n_prompt, siblings)
        self.n += 1
        for x in [r, *r.siblings]:
            self.max_tokens[x.request_id] = max_tokens
        if n_prompt + max_tokens + 1 <= 12 * 4:  # the engine guarantees a sequence fits alone
            self.s.add(r)

    @rule()
    def step(self):
        out = self.s.schedule()
        assert out.num_tokens <= self.s.max_num_batched_tokens
        for c in out.chunks:   # every written slot is covered by the chunk's block table
            assert c.start_pos + len(c.token_ids) <= len(c.block_table) * 4
        got = self.s.update({c.request_id: 3 for c in out.chunks if c.sample}
                            | {f.request_id: 3 for f in out.forks})
        for r in got:
            if len(r.output_token_ids) >= self.max_tokens[r.request_id]:
                self.s.finish(r, RequestStatus.FINISHED_LENGTH)

    @rule(data=st.data())
    def abort(self, data):
        live = [r for r in self.s.requests.values() if r.status is not RequestStatus.FORK_PENDING]
        if live:
            self.s.finish(data.draw(st.sampled_from(live)), RequestStatus.FINISHED_ABORTED)

    @invariant()
    def integrity(self):
        self.s.check_integrity()

    def teardown(self):
        for _ in range(2000):       # drain: everything finishes, nothing deadlocks or leaks
            if not self.s.has_unfinished():
                break
            self.step()
        assert not self.s.has_unfinished()
        assert self.s.kv.num_free_blocks() == 12
        assert not self.s.kv.block_tables


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
