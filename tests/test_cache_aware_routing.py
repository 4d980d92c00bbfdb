"""Cache-aware placement: the router's per-worker prefix index (routing/prefix_index.py) and the
policies' choice among workers (policies.RoutingPolicy.place), pure, no processes.

Expectations come from independent sources: a naive model of the index (a dict of every held
prefix with the tick of its last insert, evicting one token at a time from the least recently
inserted leaf), hand-computed cases, and the placement rule as the policies' docstring states it
(close = load - min <= 4 or load <= 1.5 * min; the longest match of >= 64 tokens wins)."""
import os
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pdserve.protocol import AddRequest
from pdserve.routing import (DisaggPolicy, PrefixIndex, RoundRobinPolicy, RouteRequest,
                             RouterCore, WorkerView, make_policy)
from pdserve.routing.policies import CollocatedPolicy

from .test_router_core import SP, T0, Deployment

A = list(range(1000, 1100))    # two unrelated 100-token prompts
B = list(range(2000, 2100))


# ---- the index ------------------------------------------------------------------------------
class NaiveIndex:
    """Every held prefix of one worker, as a tuple, with the tick of the last insert that
    covered it. Over budget, the least recently inserted prefix that no held prefix extends
    goes, one token at a time."""

    def __init__(self, budget):
        self.budget, self.held, self.tick = budget, {}, 0

    def insert(self, seq):
        self.tick += 1
        seq = tuple(seq[:self.budget])
        for i in range(1, len(seq) + 1):
            self.held[seq[:i]] = self.tick
        while len(self.held) > self.budget:
            extended = {p[:-1] for p in self.held}
            leaf = min((p for p in self.held if p not in extended), key=self.held.get)
            del self.held[leaf]

    def match(self, seq):
        return max((i for i in range(len(seq) + 1) if i == 0 or tuple(seq[:i]) in self.held))

    def entries(self):
        extended = {p[:-1] for p in self.held}
        return sorted(list(p) for p in self.held if p not in extended)


class IndexMachine(RuleBasedStateMachine):
    """Inserts (often an earlier sequence's prefix plus a tail, over a 3-token alphabet: many
    shared prefixes, splits and trims), queries and drops on two workers, against one
    NaiveIndex per worker."""

    @initialize(budget=st.sampled_from([3, 7, 20, 1000]))
    def setup(self, budget):
        self.budget = budget
        self.index = PrefixIndex(budget)
        self.naive = {w: NaiveIndex(budget) for w in ("w0", "w1")}
        self.known = [[]]

    def _seq(self, data):
        base = data.draw(st.sampled_from(self.known))
        base = base[:data.draw(st.integers(0, len(base)))]
        return base + data.draw(st.lists(st.integers(0, 2), max_size=8))

    @rule(w=st.sampled_from(["w0", "w1"]), data=st.data())
    def insert(self, w, data):
        seq = self._seq(data)
        self.index.insert(w, seq)
        self.naive[w].insert(seq)
        self.known.append(seq)

    @rule(data=st.data())
    def match(self, data):
        seq = self._seq(data)
        for w, naive in self.naive.items():
            assert self.index.match(w, seq) == naive.match(seq), (w, seq)

    @rule(w=st.sampled_from(["w0", "w1"]))
    def drop(self, w):
        self.index.drop(w)
        self.naive[w] = NaiveIndex(self.budget)

    @invariant()
    def agrees(self):
        self.index.check_integrity()
        for w, naive in self.naive.items():
            assert self.index.entries(w) == naive.entries(), w
            assert self.index.num_tokens(w) == len(naive.held) <= self.budget


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(
    max_examples=int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "60")), stateful_step_count=40,
    deadline=None, suppress_health_check=[HealthCheck.too_slow])


def t(letters):
    return [ord(c) for c in letters]


def test_index_hand_computed_lru_trims():
    """The prefix_index docstring's example, then one more insert: budget 10 tokens."""
    index = PrefixIndex(10)
    index.insert("w", t("abcdef"))
    index.insert("w", t("abcxy"))
    assert index.num_tokens("w") == 8
    index.insert("w", t("pqrs"))   # 12 > 10: (d e f), the oldest leaf, loses its tail 'e f'
    assert index.entries("w") == [t("abcd"), t("abcxy"), t("pqrs")]
    assert [index.match("w", t(s)) for s in ("abcdef", "abcxyz", "pqrs")] == [4, 5, 4]
    index.insert("w", t("abcd"))   # a b c d is now the newest: x y is the oldest leaf
    index.insert("w", t("pqrstu"))  # 12 > 10: x y goes
    assert index.entries("w") == [t("abcd"), t("pqrstu")]
    assert index.num_tokens("w") == 10
    # a sequence longer than the budget keeps its first `budget` tokens, alone
    index.insert("w", list(range(15)))
    assert index.entries("w") == [list(range(10))] and index.match("w", t("abcd")) == 0
    index.check_integrity()


def test_index_queries_do_not_refresh_entries():
    """Only an insert makes an entry recent (every worker is queried for every request)."""
    index = PrefixIndex(8)
    index.insert("w", [1, 2, 3, 4])
    index.insert("w", [5, 6, 7, 8])
    assert index.match("w", [1, 2, 3, 4]) == 4
    index.insert("w", [9, 9])          # [1 2 3 4] is still the oldest: it loses 2
    assert index.entries("w") == [[1, 2], [5, 6, 7, 8], [9, 9]]


def test_index_drop_clear_and_bad_input():
    index = PrefixIndex(100, budgets={"off": 0})
    index.insert("a", [1, 2, 3])
    index.insert("b", [1, 2])
    index.insert("off", [1, 2, 3])     # budget 0: nothing kept
    assert (index.match("a", [1, 2, 3, 4]), index.match("b", [1, 2, 3]),
            index.match("off", [1, 2, 3]), index.match("z", [1])) == (3, 2, 0, 0)
    index.drop("a")
    assert index.match("a", [1, 2, 3]) == 0 and index.num_tokens("a") == 0
    assert index.match("b", [1, 2]) == 2
    index.clear()
    assert index.match("b", [1, 2]) == 0 and index.entries("b") == []
    for bad in (["x"], [1.5], [2 ** 40], "abc"):
        with pytest.raises(ValueError, match="token ids"):
            index.insert("a", bad)
        with pytest.raises(ValueError, match="token ids"):
            index.match("b", bad)
    for bad in (-1, 1.0, True, None):
        with pytest.raises(ValueError, match="max_tokens"):
            PrefixIndex(bad)
    with pytest.raises(ValueError, match="budget of w"):
        PrefixIndex(10, budgets={"w": -3})


def test_index_stays_bounded_over_many_inserts():
    """Long shared-prefix traffic (a system prompt and many distinct tails) never holds more
    than the budget, keeps the newest entry whole and the stale-entry heap small."""
    rng = random.Random(0)
    index = PrefixIndex(5000)
    system = list(range(300))
    for i in range(500):
        seq = system + [rng.randrange(50000) for _ in range(rng.randrange(50, 400))]
        index.insert("w", seq)
        assert index.num_tokens("w") <= 5000 and index.match("w", seq) == len(seq)
    index.check_integrity()
    tree = index._trees["w"]
    assert len(tree.heap) <= 2 * tree.nodes + 64 + 1


# ---- the placement rule ---------------------------------------------------------------------
def _views(role, loads, cached, kv=None):
    kv = kv or [0.0] * len(loads)
    return [WorkerView(f"w{i}", role, n, u, None, c)
            for i, (n, c, u) in enumerate(zip(loads, cached, kv))]


@pytest.mark.parametrize("loads,cached,expect", [
    ((2, 0), (100, 0), "w0"),      # 2 - 0 <= 4: close, the cached one
    ((4, 0), (100, 0), "w0"),      # the absolute threshold's edge
    ((5, 0), (100, 0), "w1"),      # 5 > 4 and 5 > 0 * 1.5: least loaded
    ((30, 21), (100, 0), "w0"),    # 9 > 4, but 30 <= 31.5: close
    ((32, 21), (100, 0), "w1"),    # 32 > 31.5 and 11 > 4
    ((3, 1, 0), (80, 90, 0), "w1"),  # both close: the longer match
    ((3, 1, 0), (90, 90, 0), "w1"),  # equal matches: the less loaded of them
    ((2, 0), (63, 0), "w1"),       # below 64 tokens a match counts as none
    ((0, 0), (0, 0), "w0"),        # nothing cached: least loaded (first of equals)
    ((1, 0), (0, 0), "w1"),
])
def test_place_picks_the_cached_worker_only_when_loads_are_close(loads, cached, expect):
    for role in ("collocated", "prefill"):
        assert CollocatedPolicy().place(_views(role, loads, cached), role).name == expect


def test_place_ties_on_load_break_by_kv_usage_and_other_roles_are_ignored():
    views = _views("collocated", (1, 1), (100, 100), kv=(0.5, 0.2))
    views.append(WorkerView("d0", "decode", 0, 0.0, None, 500))
    assert CollocatedPolicy().place(views, "collocated").name == "w1"
    assert CollocatedPolicy().place(views, "prefill") is None


def test_thresholds_are_policy_arguments():
    views = _views("collocated", (5, 0), (100, 0))
    assert CollocatedPolicy().place(views, "collocated").name == "w1"
    assert CollocatedPolicy(balance_abs=5).place(views, "collocated").name == "w0"
    assert CollocatedPolicy(min_cached_tokens=101, balance_abs=5).place(
        views, "collocated").name == "w1"
    views = _views("collocated", (4, 1), (100, 0))
    assert CollocatedPolicy(balance_abs=0, balance_rel=4).place(views, "collocated").name == "w0"
    assert CollocatedPolicy(balance_abs=0, balance_rel=3.9).place(views, "collocated").name == "w1"
    assert RoundRobinPolicy(balance_abs=9).balance_abs == 9
    for bad in (dict(balance_abs=-1), dict(balance_abs=1.5), dict(balance_rel=0.9),
                dict(balance_rel=float("nan")), dict(balance_rel="2"),
                dict(min_cached_tokens=-5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DisaggPolicy(**bad)


def test_policies_keep_their_paths_and_place_by_cache():
    """Disagg: the prefill and the decode worker by cache (a one-sided consumer pulls only what
    it lacks); collocated: by cache; round-robin: still alternates the two paths."""
    views = (_views("prefill", (1, 0), (100, 0))
             + [WorkerView("d0", "decode", 1, 0.0, None, 100),
                WorkerView("d1", "decode", 0, 0.0, None, 0),
                WorkerView("c0", "collocated", 2, 0.0, None, 0),
                WorkerView("c1", "collocated", 3, 0.0, None, 100)])
    req = RouteRequest("r", 100, SP)
    assert make_policy("disagg").choose(req, views) == ("disagg", "d0", "w0")
    assert make_policy("collocated").choose(req, views) == ("collocated", "c1", None)
    rr = make_policy("round-robin")
    assert [rr.choose(req, views) for _ in range(3)] == [
        ("disagg", "d0", "w0"), ("collocated", "c1", None), ("disagg", "d0", "w0")]
    # no collocated worker: a whole request goes to a decode worker, by cache too
    whole = [v for v in views if v.role != "collocated"]
    assert make_policy("collocated").choose(req, whole) == ("collocated", "d0", None)


# ---- through the router core ----------------------------------------------------------------
def _add(dep, rid, prompt):
    assert dep.add(rid, prompt=prompt) is None
    dep.core.prefix.check_integrity()
    return dep.core.routes[rid].path


def test_core_sends_a_shared_prefix_where_it_was_sent_until_loads_diverge():
    dep = Deployment({"c0": "collocated", "c1": "collocated"}, policy="collocated")
    assert _add(dep, "a", A).worker == "c0"            # equal loads: the first
    assert _add(dep, "b", B).worker == "c1"            # least loaded
    # loads 1 / 1: least-loaded would take c0; the B prefix is on c1
    assert _add(dep, "b2", B + [1, 2, 3]).worker == "c1"
    # loads 1 / 2: still close
    assert _add(dep, "b3", B + [4]).worker == "c1"
    # c1 takes B requests while its load is at most 1 + 4: at 3, 4 and 5, then c0 at 6
    workers = [_add(dep, f"b{i}", B + [i]).worker for i in range(4, 8)]
    assert workers == ["c1", "c1", "c1", "c0"]
    assert dep.core.workers["c1"].outstanding == 6
    # and the prompt of the last one is now c0's too
    assert dep.core.prefix.match("c0", B + [7]) == len(B) + 1


def test_core_records_a_finished_sequence_for_its_worker():
    """A finished request's prompt and its output tokens but the last (its engine caches what
    it computed), for the worker it finished on: a next turn matches the whole history."""
    dep = Deployment({"c0": "collocated", "c1": "collocated"}, policy="collocated")
    _add(dep, "t1", A)
    dep.decoded("c0", "t1", [7, 8, 9, 10, 11], finished=True)
    turn2 = A + [7, 8, 9, 10, 11, 12]
    assert dep.core.prefix.match("c0", turn2) == len(A) + 4
    assert dep.core.prefix.match("c1", turn2) == 0


def test_core_disagg_places_prefill_by_cache_and_decode_by_its_history():
    dep = Deployment({"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"},
                     max_model_len=4096)
    assert _add(dep, "a", A) == ("disagg", "d0", "p0")
    assert _add(dep, "b", B) == ("disagg", "d1", "p1")
    # prefill loads 1 / 1, decode loads (bound) 1 / 1: B's prefix is on p1; d0 by load
    assert _add(dep, "b2", B + [5]) == ("disagg", "d0", "p1")
    # the prompt is the prefill worker's, not the decode worker's
    assert dep.core.prefix.match("p1", B) == len(B)
    assert dep.core.prefix.match("d0", B) == dep.core.prefix.match("d1", B) == 0
    # b's decode ends on d1 (hand-off from p1): d1 holds b's history, so b's next turn decodes
    # there although d0 has the same load
    dep.prefilled("p1", "b", token=7)
    dep.flush()                                        # the hand-off reaches d1
    dep.decoded("d1", "b", [7, 8, 9], finished=True)
    assert dep.core.prefix.match("d1", B + [7, 8, 9]) == len(B) + 2
    # two short unrelated prompts even the decode loads out (d0: a, b2; d1: c1, c2), so that
    # least-loaded alone would take d0 (the first of equals)
    assert [_add(dep, f"c{i}", [5000 + i, 1, 2]).worker for i in (1, 2)] == ["d1", "d1"]
    assert dep.core.workers["d0"].outstanding == dep.core.workers["d1"].outstanding
    assert _add(dep, "b-next", B + [7, 8, 9, 1]).worker == "d1"


def test_a_dead_or_restarted_workers_entries_are_gone():
    dep = Deployment({"c0": "collocated", "c1": "collocated"}, policy="collocated")
    _add(dep, "a", A)
    dep.decoded("c0", "a", [1, 2], finished=True)
    _add(dep, "u", B)                                  # c0 (equal loads): loads now 1 / 0
    # while c0 is up, an A request goes there though c1 is less loaded
    assert _add(dep, "a2", A + [3]).worker == "c0"
    dep.decoded("c0", "a2", [1], finished=True)
    dep.died("c0")                                     # u is placed again: on c1
    assert dep.core.prefix.match("c0", A) == 0 and dep.core.prefix.num_tokens("c0") == 0
    assert dep.core.routes["u"].path.worker == "c1"
    assert dep.core.prefix.match("c1", B) == len(B)    # (the rerouted prompt is c1's now)
    dep.up("c0", "c0.1")
    # short prompts (no match counts) by load: c0, c0 (equal: the first), c1, c0
    assert [_add(dep, f"s{i}", [5 + i] * 3).worker for i in range(4)] == ["c0", "c0", "c1", "c0"]
    # loads 3 / 2, close: had c0 kept A, this would go there; it goes by load, to c1
    assert _add(dep, "a3", A + [4]).worker == "c1"
    # a worker that restarts is forgotten too (the shell calls worker_up once it is back)
    dep = Deployment({"c0": "collocated"}, policy="collocated")
    _add(dep, "a", A)
    dep.decoded("c0", "a", [1], finished=True)
    assert dep.core.prefix.num_tokens("c0") == len(A)
    dep.run(dep.core.worker_up("c0", "c0.1"))
    assert dep.core.prefix.num_tokens("c0") == 0


def test_reset_prefix_index_forgets_every_worker():
    dep = Deployment({"c0": "collocated", "c1": "collocated"}, policy="collocated")
    _add(dep, "a", A)
    _add(dep, "b", B)
    dep.core.reset_prefix_index()
    assert dep.core.prefix.match("c0", A) == dep.core.prefix.match("c1", B) == 0
    # loads 1 / 1 and nothing cached: the first, c0, even for B
    assert _add(dep, "b2", B + [1]).worker == "c0"


def test_router_shell_reset_clears_the_index():
    """Router.reset_prefix_cache (POST /reset_prefix_cache) goes through the core's hook. A
    Router with no worker processes: only its core (the method's other half sums the live
    workers' answers, none here)."""
    from pdserve.routing import Router
    router = Router.__new__(Router)
    router.core = RouterCore([("c0", "collocated", "c0.0")], "collocated", 64)
    router.workers = {}
    router.core.prefix.insert("c0", A)
    assert router.reset_prefix_cache() == 0
    assert router.core.prefix.num_tokens("c0") == 0


def test_core_prefix_budgets():
    core = RouterCore([("c0", "collocated", "c0.0"), ("c1", "collocated", "c1.0")],
                      "collocated", 64, prefix_tokens={"c0": 50, "c1": 0})
    req = [(AddRequest(f"r{i}", {"prompt_token_ids": A}, SP, arrival_time=T0), None)
           for i in range(2)]
    core.add(req)
    assert core.prefix.num_tokens("c0") == 50 and core.prefix.num_tokens("c1") == 0
    with pytest.raises(ValueError, match="unknown workers"):
        RouterCore([("c0", "collocated", "c0.0")], "collocated", 64, prefix_tokens={"z": 1})
    with pytest.raises(ValueError, match="max_tokens"):
        RouterCore([("c0", "collocated", "c0.0")], "collocated", 64, prefix_tokens=-1)
