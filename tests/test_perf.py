"""pdserve.perf: the workload generators (arrivals, datasets) and the run arithmetic (latency
statistics, percentiles, SLOs, goodput) with hand-computed expectations, and the package's
promise to its importers (a router, a simulator): it imports without torch, zmq, an HTTP client
or server. The same code measured against a live HTTP server: test_bench_serve.py."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from pdserve.bench import datasets as ds
from pdserve.perf import workload as wl
from pdserve.perf.metrics import RequestResult, compute_metrics, latency_stats, percentile_label
from pdserve.perf.slo import meets_slos, parse_goodput

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- metrics arithmetic ------------------------------------------------------------------------
def test_compute_metrics_exact_numbers():
    rs = []
    for i, (ttft, lat, n) in enumerate([(0.1, 1.0, 10), (0.2, 0.5, 4), (0.3, 0.3, 1), (0.4, 2.0, 5)]):
        r = RequestResult(7, n, success=True, output_len=n, ttft=ttft, latency=lat,
                          itl=[(lat - ttft) / max(1, n - 1)] * (n - 1), start=i)
        rs.append(r)
    rs.append(RequestResult(9, 3, error="HTTP 503: busy"))
    m = compute_metrics(rs, 4.0, percentiles=[50, 99.9], goodput={"tpot": 150})
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == \
        (4, 1, 28, 20)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 5.0
    assert m["total_token_throughput"] == 12.0
    assert m["mean_ttft_ms"] == pytest.approx(250) and m["median_ttft_ms"] == pytest.approx(250)
    assert m["std_ttft_ms"] == pytest.approx(np.std([100, 200, 300, 400]))
    assert m["p50_ttft_ms"] == pytest.approx(250)
    assert m["p99.9_ttft_ms"] == pytest.approx(np.percentile([100, 200, 300, 400], 99.9))
    assert "p99_ttft_ms" not in m and "p90_ttft_ms" not in m
    # TPOT: (1.0-0.1)/9 = 0.1, (0.5-0.2)/3 = 0.1, none for one token, (2.0-0.4)/4 = 0.4
    assert m["tpots"][2] is None and m["tpots"][4] is None
    assert [m["tpots"][i] for i in (0, 1, 3)] == pytest.approx([0.1, 0.1, 0.4])
    assert m["mean_tpot_ms"] == pytest.approx(200)
    assert m["num_good_requests"] == 3  # the one-token request has no TPOT: within the SLO
    assert m["mean_e2el_ms"] == pytest.approx(950)
    assert len([g for r in rs for g in r.itl]) == 9 + 3 + 4
    assert m["errors"] == ["", "", "", "", "HTTP 503: busy"]
    empty = compute_metrics([RequestResult(3, 3, error="x")], 1.0)
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None and empty["p99_itl_ms"] is None


# ---- arrivals ----------------------------------------------------------------------------------
def test_per_turn_and_cached_tokens_by_hand():
    # two conversations x two turns; conversation 1's turn 1 failed; conversation 0's turn 0
    # reported no cached count
    spec = [(0, 0, True, 0.1, 10, None), (0, 1, True, 0.3, 30, 10),
            (1, 0, True, 0.2, 12, 4), (1, 1, False, 0.0, 0, None)]
    rs = [RequestResult(n_in, 2, success=ok, output_len=2 if ok else 0, ttft=ttft, latency=1.0,
                        cached_tokens=cached, conversation=c, turn=t)
          for c, t, ok, ttft, n_in, cached in spec]
    m = compute_metrics(rs, 2.0)
    assert m["total_cached_tokens"] == 14 and m["cached_tokens_reported"] == 2
    assert m["cached_token_fraction"] == pytest.approx(14 / 42)  # of the 30 + 12 that reported
    assert m["cached_tokens"] == [None, 10, 4, None]
    assert m["conversation_ids"] == [0, 0, 1, 1] and m["turn_ids"] == [0, 1, 0, 1]
    t0, t1 = m["per_turn"]
    assert (t0["turn"], t0["completed"], t0["failed"]) == (0, 2, 0)
    assert t0["mean_ttft_ms"] == pytest.approx(150) and t0["median_ttft_ms"] == pytest.approx(150)
    assert t0["mean_input_tokens"] == 11 and t0["cached_tokens"] == 4
    assert t0["cached_token_fraction"] == pytest.approx(4 / 12)
    assert (t1["completed"], t1["failed"], t1["cached_tokens"]) == (1, 1, 10)
    assert t1["mean_ttft_ms"] == pytest.approx(300)
    assert t1["cached_token_fraction"] == pytest.approx(1 / 3)
    # no turns, no cached counts: none of these fields
    plain = compute_metrics(
        [RequestResult(5, 2, success=True, output_len=2, ttft=0.1, latency=0.2)], 1.0)
    assert not {"per_turn", "total_cached_tokens", "cached_tokens", "turn_ids"} & set(plain)


def test_multi_turn_conversations_lengths():
    convs = wl.multi_turn_conversations(20, 4, 10, 6, 0.5, 7, 100, seed=3)
    assert len(convs) == 20 and len({c.system for c in convs}) == 1
    assert len(convs[0].system.split()) == 7
    for c in convs:
        assert len(c.user_messages) == len(c.output_lens) == len(c.user_lens) == 4
        assert [len(u.split()) for u in c.user_messages] == c.user_lens
        assert all(5 <= n <= 15 for n in c.user_lens) and all(3 <= n <= 9 for n in c.output_lens)
    assert len({n for c in convs for n in c.user_lens}) > 3  # the range is used
    again = wl.multi_turn_conversations(20, 4, 10, 6, 0.5, 7, 100, seed=3)
    assert [c.user_messages for c in again] == [c.user_messages for c in convs]
    assert wl.multi_turn_conversations(1, 1, 3, 1)[0].system == ""
    for bad in [(0, 1, 3, 1), (1, 0, 3, 1), (1, 1, 0, 1), (1, 1, 3, 0)]:
        with pytest.raises(ValueError, match="multi-turn"):
            wl.multi_turn_conversations(*bad)


def test_multi_turn_think_times():
    """No pause by default; with think_time T each turn after the first waits an exponential
    pause of mean T (the sample mean of 4,000 within 5%: its standard error is T / sqrt(4000),
    1.6%), the first turn none, and the messages and lengths are think time 0's."""
    plain = wl.multi_turn_conversations(1000, 5, 10, 6, 0.5, 7, 100, seed=3)
    assert all(c.think_s == [0.0] * 5 for c in plain)
    think = wl.multi_turn_conversations(1000, 5, 10, 6, 0.5, 7, 100, seed=3, think_time=2.5)
    assert [(c.user_messages, c.output_lens) for c in think] == \
        [(c.user_messages, c.output_lens) for c in plain]
    assert all(c.think_s[0] == 0.0 and len(c.think_s) == 5 for c in think)
    pauses = np.array([t for c in think for t in c.think_s[1:]])
    assert len(pauses) == 4000 and np.all(pauses >= 0)
    assert pauses.mean() == pytest.approx(2.5, rel=0.05)
    assert np.median(pauses) == pytest.approx(2.5 * np.log(2), rel=0.08)   # exponential
    again = wl.multi_turn_conversations(1000, 5, 10, 6, 0.5, 7, 100, seed=3, think_time=2.5)
    assert [c.think_s for c in again] == [c.think_s for c in think]
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="think time"):
            wl.multi_turn_conversations(2, 2, 3, 1, think_time=bad)


def test_arrival_times_are_poisson_with_the_right_mean():
    n, rate = 20001, 4.0
    t = wl.arrival_times(n, rate, 1.0, seed=0)
    assert t[0] == 0 and np.all(np.diff(t) > 0) and len(t) == n
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.02)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1.0, abs=0.08)  # exponential: CV^2 1
    assert (gaps < gaps.mean()).mean() == pytest.approx(1 - math.exp(-1), abs=0.012)
    assert np.array_equal(t, wl.arrival_times(n, rate, 1.0, seed=0))
    assert not np.array_equal(t, wl.arrival_times(n, rate, 1.0, seed=1))
    assert np.allclose(wl.arrival_times(n, 2 * rate, 1.0, seed=0), t / 2)
    assert np.array_equal(wl.arrival_times(5, math.inf), np.zeros(5))
    assert len(wl.arrival_times(0, rate)) == 0
    with pytest.raises(ValueError):
        wl.arrival_times(3, 0.0)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 2.0, 4.0])
def test_burstiness_sets_the_gamma_variance(burstiness):
    rate = 10.0
    gaps = np.diff(wl.arrival_times(40001, rate, burstiness, seed=7))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # gamma(shape k, mean 1/rate): variance 1 / (k rate^2), i.e. CV^2 = 1 / k
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.1)


# ---- datasets ----------------------------------------------------------------------------------
def test_random_dataset_lengths_and_prefix():
    reqs = wl.random_requests(500, 100, 20, range_ratio=0.5, vocab_size=1000, seed=0)
    ins = [r.prompt_len for r in reqs]
    outs = [r.expected_output_len for r in reqs]
    assert min(ins) == 50 and max(ins) == 150 and min(outs) == 10 and max(outs) == 30
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    assert all(0 <= i < 1000 for r in reqs for i in r.prompt)
    assert abs(np.mean(ins) - 100) < 4
    fixed = wl.random_requests(20, 64, 16, vocab_size=49152, seed=1)
    assert {r.prompt_len for r in fixed} == {64} and {r.expected_output_len for r in fixed} == {16}
    assert fixed == wl.random_requests(20, 64, 16, vocab_size=49152, seed=1)
    pre = wl.random_requests(50, 40, 8, range_ratio=0.25, prefix_len=16, vocab_size=5000, seed=2)
    head = pre[0].prompt[:16]
    assert all(r.prompt[:16] == head for r in pre)
    assert all(16 + 30 <= r.prompt_len == len(r.prompt) <= 16 + 50 for r in pre)
    assert len({tuple(r.prompt[16:]) for r in pre}) == 50
    text = wl.random_requests(10, 30, 5, token_ids=False, seed=3)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 30 for r in text)
    assert wl.length_range(10, 0.0) == (10, 10) and wl.length_range(1, 0.9) == (1, 1)
    with pytest.raises(ValueError):
        wl.length_range(10, 1.0)


def test_prefix_repetition_groups():
    reqs = wl.prefix_repetition_requests(50, 3, 32, 8, 7, vocab_size=1000, seed=0)
    assert len(reqs) == 50
    assert all(r.prompt_len == len(r.prompt) == 40 and r.expected_output_len == 7 for r in reqs)
    prefixes = {}
    for r in reqs:
        prefixes.setdefault(tuple(r.prompt[:32]), set()).add(r.group)
    assert len(prefixes) == 3 and all(len(g) == 1 for g in prefixes.values())
    sizes = sorted(sum(r.group == g for r in reqs) for g in range(3))
    assert sizes == [16, 17, 17]
    assert len({tuple(r.prompt[32:]) for r in reqs}) == 50
    assert [r.group for r in reqs] != [i % 3 for i in range(50)]  # shuffled


def test_mixed_dataset_two_kinds_in_one_stream():
    reqs = wl.mixed_requests(2000, 0.25, 16, 8, 400, 20, range_ratio=0.5, vocab_size=100, seed=1)
    longs = [r for r in reqs if r.group == 1]
    shorts = [r for r in reqs if r.group == 0]
    assert len(longs) + len(shorts) == 2000
    assert abs(len(longs) / 2000 - 0.25) < 0.03        # binomial: sd ~ 0.0097
    assert all(8 <= r.prompt_len == len(r.prompt) <= 24 and 4 <= r.expected_output_len <= 12
               for r in shorts)
    assert all(200 <= r.prompt_len <= 600 and 10 <= r.expected_output_len <= 30 for r in longs)
    assert [r.group for r in reqs[:40]] != sorted(r.group for r in reqs[:40])   # interleaved
    assert wl.mixed_requests(5, 0.5, 4, 4, 8, 4, seed=2) == wl.mixed_requests(5, 0.5, 4, 4, 8, 4, seed=2)
    assert {r.group for r in wl.mixed_requests(20, 0.0, 4, 4, 8, 4)} == {0}
    assert {r.group for r in wl.mixed_requests(20, 1.0, 4, 4, 8, 4)} == {1}
    with pytest.raises(ValueError):
        wl.mixed_requests(5, 1.5, 4, 4, 8, 4)
    with pytest.raises(ValueError):
        wl.mixed_requests(5, 0.5, 0, 4, 8, 4)


def _expected_valid(data, fixed_out=None):
    """The ShareGPT filters, written out again: (prompt, output tokens) of entries that pass."""
    out = []
    for e in data:
        c = e["conversations"]
        if len(c) < 2:
            continue
        p, o = c[0]["value"], c[1]["value"]
        pl = max(len(p.split()), len(p) // 4)
        ol = max(len(o.split()), len(o) // 4) if fixed_out is None else fixed_out
        if pl < 4 or (fixed_out is None and ol < 4) or pl > 1024 or pl + ol > 2048:
            continue
        out.append((p, ol))
    return out


def test_sharegpt_generator_and_loader_round_trip(tmp_path):
    path = tmp_path / "sg.json"
    assert ds.main(["make-sharegpt", str(path), "--num", "400", "--seed", "5"]) == 0
    data = json.loads(path.read_text())
    assert len(data) == 400 and all(e["conversations"][0]["from"] == "human" for e in data)
    assert data == wl.make_sharegpt(400, 5)
    valid = _expected_valid(data)
    assert 250 < len(valid) < 390  # the generator makes some of each kind the filters drop
    assert any(len(e["conversations"]) == 1 for e in data)
    loaded = wl.load_sharegpt(path, 50, seed=0)
    assert len(loaded) == 50 and len({r.prompt for r in loaded}) == 50
    vmap = dict(valid)
    assert all(r.prompt in vmap and r.expected_output_len == vmap[r.prompt] for r in loaded)
    assert all(r.prompt_len == wl.approx_tokens(r.prompt) for r in loaded)
    everything = wl.load_sharegpt(path, 10_000, seed=0, oversample=False)
    assert sorted(r.prompt for r in everything) == sorted(p for p, _ in valid)
    assert wl.load_sharegpt(path, 50, seed=0) == loaded
    assert wl.load_sharegpt(path, 50, seed=1) != loaded
    fixed = wl.load_sharegpt(path, 10_000, seed=0, output_len=100, oversample=False)
    assert len(fixed) == len(_expected_valid(data, 100)) > len(valid)  # short replies now pass
    assert {r.expected_output_len for r in fixed} == {100}
    over = wl.load_sharegpt(path, len(valid) + 20, seed=0)
    assert len(over) == len(valid) + 20


# ---- hand-computed percentiles and goodput -----------------------------------------------------
def test_latency_stats_by_hand():
    """Percentiles interpolate linearly between order statistics: for sorted x_0..x_{n-1},
    p -> rank r = p/100 * (n-1), x_floor(r) + frac(r) * (x_ceil(r) - x_floor(r))."""
    s = latency_stats([0.1, 0.2, 0.3, 0.4], "ttft", [0, 25, 90, 99.9, 100])
    assert s["mean_ttft_ms"] == pytest.approx(250) and s["median_ttft_ms"] == pytest.approx(250)
    # population std: deviations 150, 50, 50, 150 -> sqrt((2 * 22500 + 2 * 2500) / 4)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(12500))
    assert s["p0_ttft_ms"] == pytest.approx(100) and s["p100_ttft_ms"] == pytest.approx(400)
    assert s["p25_ttft_ms"] == pytest.approx(175)       # rank 0.75: 100 + 0.75 * 100
    assert s["p90_ttft_ms"] == pytest.approx(370)       # rank 2.7: 300 + 0.7 * 100
    assert s["p99.9_ttft_ms"] == pytest.approx(399.7)   # rank 2.997
    # an outlier: interpolation, not nearest rank (which would say 1000 for p90)
    s = latency_stats([0.03, 0.01, 1.0, 0.04, 0.02], "itl", [50, 90])
    assert s["median_itl_ms"] == pytest.approx(30) and s["p50_itl_ms"] == pytest.approx(30)
    assert s["p90_itl_ms"] == pytest.approx(616)        # rank 3.6: 40 + 0.6 * 960
    assert s["mean_itl_ms"] == pytest.approx(220)
    assert set(s) == {"mean_itl_ms", "median_itl_ms", "std_itl_ms", "p50_itl_ms", "p90_itl_ms"}
    assert set(latency_stats([], "e2el", [99]).values()) == {None}
    assert [percentile_label(p) for p in (50, 99.0, 99.9)] == ["50", "99", "99.9"]


def _done(ttft, latency, n_out, prompt_len=10):
    return RequestResult(prompt_len, n_out, success=True, output_len=n_out, ttft=ttft,
                         latency=latency, itl=[(latency - ttft) / (n_out - 1)] * (n_out - 1)
                         if n_out > 1 else [])


def test_goodput_by_hand():
    """Times are binary fractions, so the ms values are exact and the boundary (a request at
    exactly its SLO meets it, as in vLLM's benchmark) is tested as written."""
    rs = [_done(0.125, 0.5, 4),     # TTFT 125, TPOT (500-125)/3 = 125, e2e 500
          _done(0.25, 1.0, 4),      # TTFT 250, TPOT 250, e2e 1000
          _done(0.0625, 1.0625, 5),  # TTFT 62.5, TPOT 250, e2e 1062.5
          _done(0.5, 0.5, 1),       # TTFT 500, no TPOT (one token), e2e 500
          RequestResult(10, 4, error="HTTP 500: x")]
    assert [r.tpot for r in rs] == [0.125, 0.25, 0.25, None, None]
    cases = [({"ttft": 250}, [True, True, True, False, False]),      # 250 meets 250
             ({"ttft": 249.9}, [True, False, True, False, False]),
             ({"tpot": 125}, [True, False, False, True, False]),      # no TPOT: meets
             ({"e2el": 1000}, [True, True, False, True, False]),
             ({"ttft": 300, "tpot": 250, "e2el": 1000}, [True, True, False, False, False]),
             ({}, [True, True, True, True, False])]
    for slos, want in cases:
        assert [meets_slos(r, slos) for r in rs] == want, slos
        if slos:
            m = compute_metrics(rs, 2.0, goodput=slos)
            assert m["num_good_requests"] == sum(want)
            assert m["request_goodput"] == sum(want) / 2.0
            assert m["goodput_slos_ms"] == slos
    m = compute_metrics(rs, 2.0, percentiles=[50], goodput={"ttft": 250})
    assert (m["completed"], m["failed"]) == (4, 1)
    assert m["total_input_tokens"] == 40 and m["total_output_tokens"] == 4 + 4 + 5 + 1
    assert m["request_throughput"] == 2.0 and m["output_throughput"] == 7.0
    assert m["total_token_throughput"] == (40 + 14) / 2.0
    assert m["mean_tpot_ms"] == pytest.approx((125 + 250 + 250) / 3)
    assert m["median_e2el_ms"] == pytest.approx(750)     # 500 500 | 1000 1062.5
    assert m["p50_ttft_ms"] == pytest.approx((125 + 250) / 2)   # 62.5 125 | 250 500
    assert compute_metrics(rs, 0.0)["request_throughput"] == 0.0
    assert parse_goodput(["TTFT:250", "e2el:1e3"]) == {"ttft": 250.0, "e2el": 1000.0}


# ---- what the package may import ---------------------------------------------------------------
BLOCKED = ("torch", "triton", "zmq", "msgspec", "httpx", "aiohttp", "fastapi", "uvicorn",
           "starlette", "pydantic")

_IMPORT_SCRIPT = """
import importlib, importlib.abc, pkgutil, sys, types
blocked = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ImportError(f"{name} is blocked")
        return None

sys.meta_path.insert(0, Block())
try:
    import torch  # noqa: F401
    raise SystemExit("the blocker let torch through")
except ImportError:
    pass
# pdserve/__init__.py imports the LLM entry point (torch): load the package shell only, so this
# checks what pdserve.perf itself needs
pkg = types.ModuleType("pdserve")
pkg.__path__ = [sys.argv[2]]
sys.modules["pdserve"] = pkg
import pdserve.perf
names = [m.name for m in pkgutil.walk_packages(pdserve.perf.__path__, "pdserve.perf.")]
for name in names:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in blocked)
assert not loaded, loaded
print("imported", ",".join(sorted(names)))
"""


def test_perf_imports_without_torch_zmq_or_http():
    res = subprocess.run([sys.executable, "-c", _IMPORT_SCRIPT, ",".join(BLOCKED),
                          os.path.join(ROOT, "pdserve")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    imported = res.stdout.split("imported", 1)[1].strip().split(",")
    assert {"pdserve.perf.metrics", "pdserve.perf.slo", "pdserve.perf.workload"} <= set(imported)
