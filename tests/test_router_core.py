"""The router core driven directly: fake workers (this file carries out the core's actions and
plays the workers' answers), times chosen by the test, no processes. Expectations come from
the router's documented behaviour (routing/router.py and router_core.py docstrings, the
process-level tests in test_disagg.py): the paths, the hand-off with its KVSource, releases on
load done, reroute-or-fail on a death, Unavailable with no live worker."""
import os
import subprocess
import sys
import textwrap
from collections import deque

import pytest

from pdserve.outputs import CompletionOutput, Logprob, RequestOutput
from pdserve.protocol import AddRequest, KVLoadDone, KVSend, KVSource, StepRecord, WorkerStats
from pdserve.routing import (EngineProtocol, Path, RouterCore, RoutingPolicy, Stage,
                             StepSummary, Unavailable, WorkerClient, disaggregable)
from pdserve.routing import actions as act
from pdserve.sampling_params import SamplingParams

T0 = 1000.0  # the test's clock: arrival times and step times are read from it, never the host's
SP = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PROMPT = [11, 12, 13, 14, 15, 16]


class Deployment:
    """A RouterCore and fake workers. Each worker accepts what it is sent (unless told to refuse
    or to be dead); outputs are played by the test."""

    def __init__(self, roles: dict[str, str], policy="disagg", max_model_len=64,
                 two_sided=False, block_size=None):
        self.core = RouterCore([(n, r, f"{n}.0") for n, r in roles.items()], policy, max_model_len,
                               block_sizes=None if block_size is None else
                               dict.fromkeys(roles, block_size))
        self.core.two_sided = two_sided
        self.on: dict[str, dict[str, AddRequest]] = {n: {} for n in roles}  # what each runs
        self.delivered: list[RequestOutput] = []
        self.released: list[tuple[str, str]] = []
        self.aborted: list[tuple[str, str]] = []
        self.kv_sends: list[tuple[str, KVSend]] = []
        self.dropped: list[tuple[str, str]] = []
        self.rejected: dict[str, str] = {}
        self.dead: set[str] = set()        # died; the core learns it at the next Send there
        self.refuse: dict[str, str] = {}   # worker -> the error its next Send gets per request

    def run(self, actions):
        todo = deque(actions)
        while todo:
            a = todo.popleft()
            more = []
            if isinstance(a, act.Send):
                assert self.core.workers[a.worker].alive, f"sent to dead {a.worker}"
                if a.worker in self.dead:
                    more = self.core.worker_died(a.worker, "its process exited")
                else:
                    err = self.refuse.pop(a.worker, None)
                    if err is None:
                        self.on[a.worker].update({r.request_id: r for r in a.requests})
                    more = self.core.accepted(a.batch, [err] * len(a.requests))
            elif isinstance(a, act.Deliver):
                self.delivered.append(a.output)
            elif isinstance(a, act.Reject):
                self.rejected[a.request_id] = a.error
            elif isinstance(a, act.Release):
                self.released += [(a.worker, r) for r in a.request_ids]
            elif isinstance(a, act.Abort):
                self.aborted += [(a.worker, r) for r in a.request_ids]
                for r in a.request_ids:
                    self.on[a.worker].pop(r, None)
            elif isinstance(a, act.SendKV):
                self.kv_sends += [(a.worker, s) for s in a.sends]
            elif isinstance(a, act.DropPeer):
                self.dropped.append((a.worker, a.peer))
            todo.extendleft(reversed(more))

    # ---- events, as the shell would feed them ----
    def add(self, rid, params=SP, prompt=PROMPT, final_only=False, text="hi"):
        req = AddRequest(rid, {"prompt_token_ids": list(prompt)}, params, final_only=final_only,
                         arrival_time=T0)
        self.run(self.core.add([(req, text)]))
        return self.rejected.get(rid)

    def prefilled(self, worker, rid, token=7, blocks=(3, 4), finish="length"):
        """worker (a prefill worker) reports rid's first token with its KV held."""
        req = self.on[worker].pop(rid)
        assert req.kv_hold and req.params.max_tokens == 1
        n = len(req.prompt["prompt_token_ids"])
        out = RequestOutput(rid, None, req.prompt["prompt_token_ids"], [CompletionOutput(
            0, "x", [token], [{token: Logprob(-0.5, 1)}], finish, None, [token], "x")], True,
            {"arrival": T0, "first_token": T0 + 0.1},
            kv_transfer=KVSource("", rid, list(blocks), n, [token]))
        self.run(self.core.output(worker, out))

    def decoded(self, worker, rid, tokens, finished):
        req = self.on[worker][rid]
        if finished:
            del self.on[worker][rid]
        out = RequestOutput(rid, None, req.prompt["prompt_token_ids"], [CompletionOutput(
            0, "y" * len(tokens), list(tokens), None, "length" if finished else None, None,
            list(tokens[-1:]), "y")], finished, {"arrival": T0 + 5})
        self.run(self.core.output(worker, out))

    def died(self, worker, why="killed"):
        self.dead.add(worker)
        self.run(self.core.worker_died(worker, why))

    def up(self, worker, kv_name):
        self.dead.discard(worker)
        self.on[worker] = {}
        self.run(self.core.worker_up(worker, kv_name))

    def flush(self, exited=()):
        self.run(self.core.flush_handoffs(exited))

    def settled(self):
        """Nothing in flight, no load counted anywhere."""
        assert not self.core.routes and not self.core.handoffs
        assert all(w.outstanding == 0 for w in self.core.workers.values()), self.core.workers
        assert not any(self.core.bound.values())


# ---- paths ----------------------------------------------------------------------------------
def test_collocated_path_runs_the_request_whole_on_one_worker():
    dep = Deployment({"c0": "collocated"}, policy="collocated")
    assert dep.add("r") is None
    sent = dep.on["c0"]["r"]
    assert (sent.params, sent.kv_hold, sent.kv_source) == (SP, False, None)
    assert dep.core.routes["r"].stage is Stage.COLLOCATED
    dep.decoded("c0", "r", [1, 2], finished=False)
    dep.decoded("c0", "r", [1, 2, 3, 4, 5], finished=True)
    assert [o.outputs[0].token_ids for o in dep.delivered] == [[1, 2], [1, 2, 3, 4, 5]]
    assert dep.delivered[-1].finished and dep.delivered[-1].prompt == "hi"
    assert dep.core.stats.requests == {"collocated": 1, "disagg": 0}
    assert dep.released == dep.aborted == []
    dep.settled()


def test_a_batch_is_spread_by_the_load_already_placed():
    dep = Deployment({"c0": "collocated", "c1": "collocated"}, policy="collocated")
    req = [(AddRequest(f"r{i}", {"prompt_token_ids": PROMPT}, SP, arrival_time=T0), None)
           for i in range(5)]
    dep.run(dep.core.add(req))
    assert sorted(len(v) for v in dep.on.values()) == [2, 3]
    # 1P2D: requests still prefilling count for the decode worker they will reach
    dep = Deployment({"p0": "prefill", "d0": "decode", "d1": "decode"})
    for i in range(4):
        dep.add(f"r{i}")
    assert sorted(dep.core.bound.values()) == [2, 2]
    assert {dep.core.routes[f"r{i}"].path.worker for i in range(4)} == {"d0", "d1"}


def test_disagg_path_prefill_handoff_decode_release():
    dep = Deployment({"p0": "prefill", "d0": "decode"}, two_sided=True)
    assert dep.add("r") is None
    first = dep.on["p0"]["r"]
    assert first.kv_hold and first.final_only and first.params.max_tokens == 1
    assert dep.core.routes["r"].stage is Stage.PREFILL
    dep.prefilled("p0", "r", token=7, blocks=(3, 4))
    # streamed at once: the first token, from the prefill worker
    (o,) = dep.delivered
    assert not o.finished and o.outputs[0].new_token_ids == [7] and o.prompt == "hi"
    assert dep.core.routes["r"].stage is Stage.HANDOFF and not dep.on["d0"]
    dep.flush()
    sent = dep.on["d0"]["r"]
    assert sent.params == SP and not sent.kv_hold
    assert sent.kv_source == KVSource("p0.0", "r", [3, 4], len(PROMPT), [7])
    assert dep.kv_sends == [("p0", KVSend("r", "d0.0", [3, 4]))]  # two-sided: P sends it
    assert dep.core.routes["r"].stage is Stage.DECODE
    dep.decoded("d0", "r", [7, 8, 9, 10, 11], finished=True)
    last = dep.delivered[-1]
    assert last.finished and last.outputs[0].token_ids == [7, 8, 9, 10, 11]
    assert last.metrics["arrival"] == T0 and last.metrics["first_token"] == T0 + 0.1
    assert dep.released == []            # the KV is held until the decode worker reports its load
    dep.run(dep.core.loads_done([KVLoadDone("r", True, 4096, 0.25)]))
    assert dep.released == [("p0", "r")]
    s = dep.core.stats
    assert (s.requests, s.transfers, s.transfer_bytes, s.transfer_seconds) == (
        {"collocated": 0, "disagg": 1}, 1, 4096, 0.25)
    dep.settled()


def test_first_token_logprobs_lead_the_decode_workers():
    dep = Deployment({"p0": "prefill", "d0": "decode"})
    dep.add("r", SamplingParams(temperature=0, max_tokens=3, logprobs=0), final_only=True)
    dep.prefilled("p0", "r", token=7)
    assert dep.delivered == []            # final_only: nothing streamed
    dep.flush()
    out = RequestOutput("r", None, PROMPT, [CompletionOutput(
        0, "abc", [7, 8, 9], [{8: Logprob(-1.0, 1)}, {9: Logprob(-2.0, 1)}], "length")], True)
    dep.run(dep.core.output("d0", out))
    assert [list(lp) for lp in dep.delivered[0].outputs[0].logprobs] == [[7], [8], [9]]


@pytest.mark.parametrize("finish,max_model_len", [("stop", 64), ("abort", 64), ("length", 7)])
def test_a_request_done_at_its_first_token_ends_on_the_prefill_worker(finish, max_model_len):
    """A stop at the first token, an abort, or max_model_len reached (6 prompt + 1 token):
    nothing to hand off; the held KV is released at once."""
    dep = Deployment({"p0": "prefill", "d0": "decode"}, max_model_len=max_model_len)
    dep.add("r")
    dep.prefilled("p0", "r", finish=finish)
    assert [o.finished for o in dep.delivered] == [True]
    assert dep.released == [("p0", "r")] and not dep.core.handoffs
    dep.settled()


# ---- two-sided hand-offs send only what the decode worker lacks ---------------------------
class Pinned(RoutingPolicy):
    """Disaggregated, on the decode worker the test names; place() (cache-aware, matches of 4
    tokens count) is the base class's, as a redirect uses it."""
    name = "pinned"

    def __init__(self, decode="d0"):
        super().__init__(min_cached_tokens=4)
        self.decode = decode

    def choose(self, req, workers):
        return Path("disagg", self.decode, "p0")


def _turn(dep, rid, prompt, blocks, decode, out):
    """rid prefilled on p0 (its KV in `blocks`), handed off, decoded to `out` on `decode`."""
    dep.add(rid, prompt=prompt)
    dep.prefilled("p0", rid, token=out[0], blocks=blocks)
    dep.flush()
    dep.decoded(decode, rid, out, finished=True)


@pytest.mark.parametrize("two_sided,block_size", [(True, 4), (False, 4), (True, None)],
                         ids=["two-sided", "one-sided", "no-block-size"])
def test_two_sided_hand_off_skips_the_whole_blocks_the_decode_worker_holds(two_sided, block_size):
    """Turn 1 (PROMPT, 6 tokens) decodes 7..11 on d0, which then caches PROMPT + 7..10 (the
    last token has no KV): 10 tokens, 2 whole blocks of 4. Turn 2 (that + 11, 20, 21: 13
    tokens, 4 blocks) skips those 2 blocks; a prompt the index covers whole (PROMPT + 7, 8: 8
    tokens, 2 blocks) still sends its last block. One-sided (the consumer matches its own
    cache) or with no block size known: nothing is skipped."""
    dep = Deployment({"p0": "prefill", "d0": "decode"}, two_sided=two_sided,
                     block_size=block_size)
    _turn(dep, "t1", PROMPT, (3, 4), "d0", [7, 8, 9, 10, 11])
    _turn(dep, "t2", PROMPT + [7, 8, 9, 10, 11, 20, 21], (30, 31, 32, 33), "d0", [1, 2, 3, 4, 5])
    _turn(dep, "t3", PROMPT + [7, 8], (40, 41), "d0", [1, 2, 3, 4, 5])
    sent = {s.request_id: s.block_ids for _, s in dep.kv_sends}
    if two_sided and block_size:
        assert sent == {"t1": [3, 4], "t2": [32, 33], "t3": [41]}
    elif two_sided:
        assert sent == {"t1": [3, 4], "t2": [30, 31, 32, 33], "t3": [40, 41]}
    else:
        assert sent == {}
    dep.settled()


def test_hand_off_skip_follows_the_request_as_sent():
    """The KVSource the decode worker gets says what was skipped (and the SendKV matches it)."""
    dep = Deployment({"p0": "prefill", "d0": "decode"}, two_sided=True, block_size=4)
    _turn(dep, "t1", PROMPT, (3, 4), "d0", [7, 8, 9, 10, 11])
    dep.add("t2", prompt=PROMPT + [7, 8, 9, 10, 11, 20, 21])
    dep.prefilled("p0", "t2", token=1, blocks=(30, 31, 32, 33))
    dep.flush()
    src = dep.on["d0"]["t2"].kv_source
    assert (src.block_ids, src.skip_blocks, src.sent_block_ids) == ([30, 31, 32, 33], 2, [32, 33])
    assert dep.kv_sends[-1] == ("p0", KVSend("t2", "d0.0", [32, 33]))


@pytest.mark.parametrize("held", [True, False], ids=["index-holds-it", "nobody-holds-it"])
def test_a_dead_decode_workers_hand_off_goes_where_the_conversation_is(held):
    """d0 dies at the hand-off; d2 decoded the conversation's turn 1 (the index says it holds
    it) and has one request more than d1 (within the balance threshold). The conversation's
    turn 2 goes to d2 and skips the blocks d2 holds (not d0's: the destination changed); a
    prompt nobody holds goes to the least loaded decode worker, d1."""
    policy = Pinned("d2")
    dep = Deployment({"p0": "prefill", "d0": "decode", "d1": "decode", "d2": "decode"},
                     policy=policy, two_sided=True, block_size=4)
    _turn(dep, "t1", PROMPT, (3, 4), "d2", [7, 8, 9, 10, 11])
    dep.add("busy", prompt=[50, 51, 52, 53, 54])         # bound for d2: one more request there
    policy.decode = "d0"
    prompt = PROMPT + [7, 8, 9, 10, 11, 20, 21] if held else [60, 61, 62, 63, 64, 65, 66]
    dep.add("t2", prompt=prompt)
    dep.prefilled("p0", "t2", token=1, blocks=(30, 31, 32, 33) if held else (30, 31))
    dep.dead.add("d0")                                   # found dead by the hand-off's send
    dep.flush()
    target = "d2" if held else "d1"
    assert list(dep.on[target]) == ["t2"] and dep.core.routes["t2"].path.worker == target
    src = dep.on[target]["t2"].kv_source
    if held:
        assert src.skip_blocks == 2
        assert dep.kv_sends[-1] == ("p0", KVSend("t2", "d2.0", [32, 33]))
    else:
        assert src.skip_blocks == 0
        assert dep.kv_sends[-1] == ("p0", KVSend("t2", "d1.0", [30, 31]))
    assert dep.core.stats.failed == 0 and dep.released == []
    dep.decoded(target, "t2", [1, 2, 3], finished=True)
    assert dep.delivered[-1].error is None


# ---- the P/D eligibility rule --------------------------------------------------------------
INELIGIBLE = [SamplingParams(n=2, max_tokens=5), SamplingParams(prompt_logprobs=1, max_tokens=5),
              SamplingParams(max_tokens=1)]


def test_the_eligibility_rule():
    assert disaggregable(SamplingParams(max_tokens=2))
    assert not any(disaggregable(p) for p in INELIGIBLE)


@pytest.mark.parametrize("params", INELIGIBLE, ids=["n2", "prompt_logprobs", "max_tokens1"])
@pytest.mark.parametrize("policy", ["disagg", "round-robin"])
def test_ineligible_requests_go_collocated(params, policy):
    dep = Deployment({"p0": "prefill", "d0": "decode", "c0": "collocated"}, policy=policy)
    for i in range(2):  # (round-robin: both turns)
        dep.add(f"r{i}", params)
        assert dep.on["c0"][f"r{i}"].params == params
    assert not dep.on["p0"] and dep.core.stats.requests == {"collocated": 2, "disagg": 0}
    # no collocated worker: whole on the decode worker, never split
    dep = Deployment({"p0": "prefill", "d0": "decode"}, policy=policy)
    dep.add("r", params)
    assert list(dep.on["d0"]) == ["r"] and not dep.on["d0"]["r"].kv_hold and not dep.on["p0"]
    assert dep.core.routes["r"].stage is Stage.COLLOCATED


def test_a_policy_breaking_the_constraint_is_overruled():
    class AlwaysSplit(RoutingPolicy):
        def choose(self, req, workers):
            return Path("disagg", "d0", "p0")

    dep = Deployment({"p0": "prefill", "d0": "decode", "c0": "collocated"}, policy=AlwaysSplit())
    dep.add("a", INELIGIBLE[0])
    dep.add("b")
    assert list(dep.on["c0"]) == ["a"] and list(dep.on["p0"]) == ["b"]


# ---- faults ---------------------------------------------------------------------------------
def test_prefill_worker_dies_before_its_output():
    """A request still prefilling produced nothing: it is routed again (whole on the decode
    worker, the only role left), nothing fails."""
    dep = Deployment({"p0": "prefill", "d0": "decode"}, two_sided=True)
    dep.add("r")
    dep.died("p0")
    assert dep.dropped == [("d0", "p0.0")]    # two-sided: the pair is aborted now
    sent = dep.on["d0"]["r"]
    assert sent.params == SP and sent.kv_source is None and not sent.kv_hold
    assert dep.core.routes["r"].stage is Stage.COLLOCATED
    assert (dep.core.stats.rerouted, dep.core.stats.failed) == (1, 0)
    dep.decoded("d0", "r", [1, 2, 3, 4, 5], finished=True)
    assert dep.delivered[-1].error is None
    dep.settled()


@pytest.mark.parametrize("how", ["died", "exited", "restarted"])
def test_prefill_worker_gone_after_its_output_is_recomputed(how):
    """Prefilled, not yet handed off, and the prefill worker's KV is gone (it died, its process
    exited unnoticed, or it came back as a new incarnation): the decode worker gets the request
    without KV (recomputes), after the producer's token; nothing is released to the new one."""
    dep = Deployment({"p0": "prefill", "d0": "decode"})
    dep.add("r")
    dep.prefilled("p0", "r", token=7)
    exited = ()
    if how == "died":
        dep.died("p0")
    elif how == "exited":
        exited = ("p0",)
    else:
        dep.died("p0")
        dep.up("p0", "p0.1")
    dep.flush(exited)
    src = dep.on["d0"]["r"].kv_source
    assert src.lost and src.block_ids == [] and src.output_token_ids == [7]
    assert (dep.core.stats.recomputed, dep.core.stats.rerouted, dep.core.stats.failed) == (1, 0, 0)
    dep.decoded("d0", "r", [7, 8, 9, 10, 11], finished=True)
    assert dep.released == [] and dep.delivered[-1].error is None
    dep.settled()


def test_decode_worker_dies_mid_stream():
    """Its requests without a token are routed again; those with tokens end with an error
    (finish_reason abort), the tokens they had, and the producer's held KV released."""
    dep = Deployment({"p0": "prefill", "d0": "decode", "d1": "decode"})
    dep.add("b", SamplingParams(n=2, max_tokens=5))  # whole on d0 (the first of equals)
    dep.add("x")                                     # disagg, to d1 (the less loaded)
    dep.add("a")                                     # disagg, to d0 (a tie again)
    assert "b" in dep.on["d0"]
    assert [dep.core.routes[r].path.worker for r in "xa"] == ["d1", "d0"]
    dep.prefilled("p0", "x")
    dep.prefilled("p0", "a", token=7)
    dep.flush()
    dep.decoded("d0", "a", [7, 8], finished=False)
    dep.died("d0", "exit code -9")
    (failed,) = [o for o in dep.delivered if o.finished]
    assert failed.request_id == "a" and failed.outputs[0].finish_reason == "abort"
    assert "d0 died" in failed.error and "exit code -9" in failed.error
    assert dep.released == [("p0", "a")]             # its held KV
    assert "b" in dep.on["d1"] and dep.core.routes["b"].stage is Stage.COLLOCATED
    assert dep.core.routes["x"].stage is Stage.DECODE  # d1's own: untouched
    assert (dep.core.stats.rerouted, dep.core.stats.failed) == (1, 1) and dep.rejected == {}


def test_hand_off_to_a_dead_decode_worker_goes_to_another_with_its_kv():
    dep = Deployment({"p0": "prefill", "d0": "decode", "d1": "decode"})
    dep.add("r")
    target = dep.core.routes["r"].path.worker
    other = ({"d0", "d1"} - {target}).pop()
    dep.prefilled("p0", "r", blocks=(5, 6))
    dep.dead.add(target)                      # found dead by the hand-off's send
    dep.flush()
    assert dep.on[other]["r"].kv_source == KVSource("p0.0", "r", [5, 6], len(PROMPT), [7])
    assert dep.released == [] and dep.core.stats.failed == 0
    dep.run(dep.core.loads_done([KVLoadDone("r", False, 0, 1.0, "timed out")]))
    assert dep.released == [("p0", "r")] and dep.core.stats.transfer_failures == 1


def test_no_decode_worker_left_at_the_hand_off_runs_it_whole_elsewhere():
    dep = Deployment({"p0": "prefill", "d0": "decode", "c0": "collocated"})
    dep.add("r")
    dep.prefilled("p0", "r", token=7)
    dep.dead.add("d0")
    dep.flush()
    src = dep.on["c0"]["r"].kv_source
    assert src.lost and src.output_token_ids == [7]
    assert dep.released == [("p0", "r")]      # the producer drops what it held
    dep.decoded("c0", "r", [7, 8, 9, 10, 11], finished=True)
    assert dep.delivered[-1].error is None
    dep.settled()


def test_a_worker_found_dead_while_adding_leaves_routing_and_its_share_goes_elsewhere():
    dep = Deployment({"c0": "collocated", "c1": "collocated"}, policy="collocated")
    dep.dead.add("c0")
    req = [(AddRequest(f"r{i}", {"prompt_token_ids": PROMPT}, SP, arrival_time=T0), None)
           for i in range(4)]
    dep.run(dep.core.add(req))
    assert dep.rejected == {} and sorted(dep.on["c1"]) == ["r0", "r1", "r2", "r3"]
    assert not dep.core.workers["c0"].alive


def test_no_live_worker_is_unavailable():
    dep = Deployment({"c0": "collocated"}, policy="collocated")
    dep.add("r")
    dep.died("c0")
    # an admitted request with nowhere to go fails (an output); a new one is refused
    (out,) = dep.delivered
    assert out.finished and "c0 died" in out.error and "no live worker" in out.error
    err = dep.add("s")
    assert isinstance(err, Unavailable) and "c0" in err
    dep.up("c0", "c0.1")
    assert dep.add("t") is None and "t" in dep.on["c0"]


def test_a_rejected_request_is_the_requests_error():
    dep = Deployment({"p0": "prefill", "d0": "decode"})
    dep.refuse["p0"] = "prompt too long"
    err = dep.add("r")
    assert err == "prompt too long" and not isinstance(err, Unavailable)
    dep.settled()
    # a decode worker refusing the hand-off: the request fails, the held KV is released
    dep.add("s")
    dep.prefilled("p0", "s")
    dep.refuse["d0"] = "no room"
    dep.flush()
    assert "decode worker rejected the request: no room" in dep.delivered[-1].error
    assert dep.released == [("p0", "s")]
    dep.settled()


# ---- aborts ---------------------------------------------------------------------------------
def test_abort_during_prefill():
    dep = Deployment({"p0": "prefill", "d0": "decode"})
    dep.add("r")
    dep.run(dep.core.abort(["r", "unknown"]))
    # the prefill may have finished with its output on the way: its KV is released too
    assert dep.aborted == [("p0", "r")] and dep.released == [("p0", "r")]
    dep.settled()
    dep.on["p0"]["r"] = AddRequest("r", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1),
                                   kv_hold=True)
    dep.prefilled("p0", "r")                   # (late: ignored)
    assert dep.delivered == [] and not dep.core.handoffs


def test_abort_during_decode_releases_the_held_kv():
    dep = Deployment({"p0": "prefill", "d0": "decode"})
    dep.add("r")
    dep.prefilled("p0", "r")
    dep.flush()
    dep.decoded("d0", "r", [7, 8], finished=False)
    dep.run(dep.core.abort(["r"]))
    assert dep.aborted == [("d0", "r")] and dep.released == [("p0", "r")]
    dep.run(dep.core.loads_done([KVLoadDone("r", True, 10, 0.1)]))  # reported later
    assert dep.released == [("p0", "r")]      # released once
    dep.settled()


# ---- the router's data: recent steps --------------------------------------------------------
def _rec(t, prefill, decode, wall, gpu=None):
    return StepRecord(t, prefill, decode, 1 if prefill else 0, decode, 0, wall, gpu)


def test_workers_recent_steps_are_kept_and_summarised():
    dep = Deployment({"c0": "collocated", "c1": "collocated"}, policy="collocated")
    assert [w.steps for w in dep.core.live()] == [None, None]
    dep.core.observe("c0", WorkerStats(1, 0, 3, 12, 0),
                     [_rec(T0, 5, 1, 10.0), _rec(T0 + 1, 0, 2, 20.0, 4.0)])
    view = next(w for w in dep.core.live() if w.name == "c0")
    assert view.kv_usage == 0.25
    # 2 steps, (10 + 20) / 2 ms, gpu only where measured, (6 + 2) / 2 tokens, 30 ms / 8 tokens,
    # (5 + 0) / 2 prompt tokens
    assert view.steps == StepSummary(2, 15.0, 4.0, 4.0, 3.75, T0 + 1, 2.5)
    dep.core.observe("c0", steps=[_rec(T0 + 2 + i, 0, 1, 1.0) for i in range(100)])
    w = dep.core.workers["c0"]
    assert len(w.steps) == 102 and w.steps[-1].t == T0 + 101
    assert w.summary == StepSummary(64, 1.0, None, 1.0, 1.0, T0 + 101, 0.0)  # the newest 64
    assert StepSummary.of([_rec(T0, 0, 0, 2.0)]).wall_ms_per_token is None


def test_workers_steps_are_totalled_by_kind_for_the_metrics():
    """RouterStats.steps: per worker and kind, the steps' count, host and device time (device
    only where measured) and tokens, summed by hand; a step that fed nothing is not counted."""
    from pdserve.routing.router_core import StepTotals
    dep = Deployment({"c0": "collocated", "c1": "collocated"}, policy="collocated")
    dep.core.observe("c0", steps=[_rec(T0, 5, 1, 10.0, 6.0), _rec(T0 + 1, 0, 2, 20.0, 4.0),
                                  _rec(T0 + 2, 7, 0, 3.0), _rec(T0 + 3, 0, 0, 1.0)])
    dep.core.observe("c0", steps=[_rec(T0 + 4, 0, 3, 5.0, 2.5)])
    dep.core.observe("c1", steps=[_rec(T0, 2, 4, 8.0, 7.0)])
    assert dep.core.stats.steps == {
        ("c0", "mixed"): StepTotals(1, 10.0, 1, 6.0, 5, 1),
        ("c0", "decode"): StepTotals(2, 25.0, 2, 6.5, 0, 5),
        ("c0", "prefill"): StepTotals(1, 3.0, 0, 0.0, 7, 0),
        ("c1", "mixed"): StepTotals(1, 8.0, 1, 7.0, 2, 4)}


# ---- the boundaries -------------------------------------------------------------------------
def test_router_core_and_policies_import_without_torch_zmq_worker_server():
    """The core is what tests and a simulator drive without processes: it must not pull in
    torch, zmq, the worker or the server. (pdserve/__init__ imports the LLM entrypoint, i.e.
    torch, so the package is stood in for by a bare module over the same folder.)"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = textwrap.dedent(f"""
        import importlib.abc, sys, types
        BLOCKED = ("torch", "zmq", "pdserve.worker", "pdserve.server", "pdserve.engine",
                   "pdserve.config", "pdserve.disagg", "pdserve.routing.router",
                   "pdserve.routing.workers")
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        pkg = types.ModuleType("pdserve")
        pkg.__path__ = [{os.path.join(root, "pdserve")!r}]
        sys.modules["pdserve"] = pkg
        import pdserve.routing.router_core, pdserve.routing.policies, pdserve.routing.client
        from pdserve.routing import RouterCore, make_policy, Unavailable
        core = RouterCore([("c0", "collocated", "c0.0")], make_policy("collocated"), 64)
        assert not any(m == b or m.startswith(b + ".") for m in sys.modules for b in BLOCKED)
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
    # and the blocker works: the shell does need zmq
    res = subprocess.run([sys.executable, "-c", code.replace(
        "import pdserve.routing.router_core,", "import pdserve.routing.router,")],
        capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "blocked" in res.stderr


def test_router_and_engine_client_satisfy_the_protocol():
    """Both serve whatever drives an EngineProtocol (checked on the classes: every member is
    defined there or set by __init__)."""
    import inspect

    from pdserve.routing import Router
    from pdserve.worker.client import EngineClient

    def members(proto):
        return {n for n in dir(proto) if not n.startswith("_")} | {"__enter__", "__exit__"}

    for cls, proto in ((Router, EngineProtocol), (EngineClient, WorkerClient)):
        init = inspect.getsource(cls.__init__)
        missing = [n for n in members(proto)
                   if not hasattr(cls, n) and f"self.{n} =" not in init
                   and f"self.{n}:" not in init]
        assert missing == [], (cls.__name__, missing)
    assert not hasattr(Router, "get_num_unfinished_requests")
    assert not hasattr(EngineClient, "get_num_unfinished_requests")


def test_starts_called_off_together_are_waited_for_together(monkeypatch):
    """Starts stuck in a step that does not look at the cancel (1 s, say a tokenizer loading):
    abandon_all calls them all off, then waits for them together, up to its wait in all (not
    per start), and a start that completes after it was called off keeps no client."""
    import time

    from pdserve.routing import workers

    class Stuck:
        made = []

        def __init__(self, config, timeout_s, name, cpu_threads, cancel):
            time.sleep(1.0)
            assert cancel.is_set()
            Stuck.made.append(self)
            self.stopped = False

        def shutdown(self, timeout_s):
            self.stopped = True

    monkeypatch.setattr(workers, "EngineClient", Stuck)
    spec = workers.WorkerSpec("w", "collocated", None)
    starts = [workers.Starting(spec, f"w{i}", 60) for i in range(2)]
    t0 = time.monotonic()
    workers.abandon_all(starts, wait_s=10)
    took = time.monotonic() - t0
    assert all(st.done.is_set() for st in starts) and 0.8 < took < 1.6, took
    assert len(Stuck.made) == 2 and all(c.stopped for c in Stuck.made)   # (shut down at once)
    assert all(st.client is None for st in starts)
    late = [workers.Starting(spec, f"late{i}", 60) for i in range(3)]
    t0 = time.monotonic()
    workers.abandon_all(late, wait_s=0.3)      # (one wait each would take 0.9 s)
    assert time.monotonic() - t0 < 0.6 and not any(st.done.is_set() for st in late)
    for st in late:
        assert st.done.wait(5) and st.client is None
