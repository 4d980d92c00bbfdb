"""The output-length predictor (routing/length_predictor.py): hand-computed bucket means,
shrinkage weights, the empirical-Bayes prior strength, the cap (E[min(L, cap)]), censored
samples, bounded windows, the prequential scores, argument checks; and its accuracy against the
global mean on seeded synthetic workloads, with and without a dependence on the prompt."""
import math
import os
import random
import subprocess
import sys
import textwrap

import pytest

from pdserve.routing.length_predictor import K_MAX, K_MIN, LengthPredictor


def ref_predict(bucket: list[int], glob: list[int], k: float, cap: int | None = None) -> float:
    """The scheme written out naively: the shrunk mean of min(x, cap)."""
    def m(xs):
        return sum(x if cap is None else min(x, cap) for x in xs) / len(xs)
    if not bucket:
        return m(glob)
    w = len(bucket) / (len(bucket) + k)
    return w * m(bucket) + (1 - w) * m(glob)


def test_imports_without_torch_or_numpy():
    code = textwrap.dedent("""
        import sys
        class Refuse:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "numpy", "zmq"):
                    raise ImportError("forbidden import: " + name)
        sys.meta_path.insert(0, Refuse())
        from pdserve.routing.length_predictor import LengthPredictor
        LengthPredictor().observe(10, 5)
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": root})
    assert r.returncode == 0, r.stderr


# ---- the scheme, by hand ---------------------------------------------------------------------

def test_prior_before_any_observation():
    p = LengthPredictor(default=300)
    assert p.predict(50) == 300
    assert p.predict(50, max_tokens=120) == 120
    assert p.baseline() == 300 and p.baseline(40) == 40
    s = p.stats()
    assert s.observations == 0 and s.mae is None and s.baseline_mae is None


def test_bucket_means_and_shrinkage_weights():
    p = LengthPredictor(prior_strength=2)
    for prompt, out in [(20, 10), (20, 30), (100, 100)]:
        p.observe(prompt, out)
    g = (10 + 30 + 100) / 3
    # bucket [16, 32): two samples, mean 20, weight 2 / (2 + 2)
    assert p.predict(20) == pytest.approx(0.5 * 20 + 0.5 * g)
    assert p.predict(31) == pytest.approx(0.5 * 20 + 0.5 * g)      # same bucket
    # bucket [64, 128): one sample, weight 1 / 3
    assert p.predict(100) == pytest.approx(100 / 3 + 2 / 3 * g)
    # empty buckets fall back to the global mean exactly
    assert p.predict(32) == pytest.approx(g)
    assert p.predict(1000) == pytest.approx(g)
    # the fallback weight grows with the bucket's samples: 1/(1+k), 2/(2+k), ...
    q = LengthPredictor(prior_strength=10)
    q.observe(5000, 1000)          # the global mean starts at 1000
    q.observe(20, 0)
    assert q.predict(20) == pytest.approx(1 / 11 * 0 + 10 / 11 * 500)


def test_log2_buckets():
    p = LengthPredictor(prior_strength=0)       # k = 0: a non-empty bucket's own mean
    for prompt, out in [(0, 1), (16, 2), (2 ** 19, 3)]:
        p.observe(prompt, out)
    assert p.predict(15) == 1                    # 0..15 share the lowest bucket
    assert p.predict(31) == 2                    # 16..31
    assert p.predict(10 ** 9) == 3               # everything >= 2^19 shares the top one
    assert p.stats().buckets == 3


def test_cap_uses_expected_capped_length():
    # answers of 50 or 500 tokens (mean 275) asked with a cap of 100 generate 75 on average
    p = LengthPredictor(prior_strength=0)
    for _ in range(10):
        p.observe(40, 50)
        p.observe(40, 500)
    assert p.predict(40) == pytest.approx(275)
    assert p.predict(40, max_tokens=100) == pytest.approx(75)
    assert p.predict(40, max_tokens=40) == 40
    assert p.predict(40, max_tokens=1000) == pytest.approx(275)
    # with shrinkage: both terms capped (hand values: bucket [10, 30] and global [10, 30, 100])
    q = LengthPredictor(prior_strength=2)
    for prompt, out in [(20, 10), (20, 30), (100, 100)]:
        q.observe(prompt, out)
    assert q.predict(20, max_tokens=20) == pytest.approx(0.5 * 15 + 0.5 * 50 / 3)
    assert q.baseline(20) == 20 and q.baseline() == pytest.approx(140 / 3)


def test_prediction_never_exceeds_the_cap():
    rng = random.Random(3)
    p = LengthPredictor(window=16, global_window=64)
    for _ in range(400):
        prompt = rng.randrange(0, 5000)
        cap = rng.choice([None, 1, 2, 7, 64, 300])
        out = rng.randrange(0, 1000)
        if cap is not None:
            out = min(out, cap)
            guess = p.predict(prompt, cap)
            assert 0 <= guess <= cap
        p.observe(prompt, out, cap)


def test_censored_samples_are_imputed_not_taken_at_face_value():
    p = LengthPredictor(prior_strength=2)
    for prompt, out in [(20, 10), (20, 30), (100, 100)]:
        p.observe(prompt, out)
    # stopped at max_tokens=5, below every sample: E[L | L >= 5] is the shrunk mean,
    # 0.5 * 20 + 0.5 * 140/3 = 33.3 -> stored as 33
    p.observe(20, 5, max_tokens=5)
    bucket, glob = [10, 30, 33], [10, 30, 100, 33]
    assert p.predict(20) == pytest.approx(ref_predict(bucket, glob, 2))
    # stopped at 25: the samples >= 25 are [30, 33] in the bucket (n = 3, w = 3/5) and
    # [30, 100, 33] overall: 0.6 * 31.5 + 0.4 * 163/3 = 40.63 -> 41
    p.observe(20, 25, max_tokens=25)
    bucket, glob = [10, 30, 33, 41], [10, 30, 100, 33, 41]
    assert p.predict(20) == pytest.approx(ref_predict(bucket, glob, 2))
    # stopped at 500, beyond every sample: only the lower bound is known
    p.observe(20, 500, max_tokens=500)
    bucket, glob = bucket + [500], glob + [500]
    assert p.predict(20) == pytest.approx(ref_predict(bucket, glob, 2))
    assert p.predict(20, max_tokens=7) == pytest.approx(ref_predict(bucket, glob, 2, cap=7))
    # output == max_tokens counts as censored; below the cap it does not
    p.observe(20, 3, max_tokens=4)
    assert p.stats().censored == 3 and p.stats().observations == 7 and p.stats().scored == 7


def test_caller_says_whether_a_request_was_cut():
    p = LengthPredictor(prior_strength=0)
    for out in (40, 60, 80):
        p.observe(300, out)
    # ended on EOS at exactly its max_tokens: taken at face value (and scored)
    p.observe(300, 50, max_tokens=50, censored=False)
    assert p.predict(300) == pytest.approx((40 + 60 + 80 + 50) / 4)
    # aborted after 45 tokens, no cap: >= 45, imputed from the samples >= 45 (50, 60, 80), and
    # not scored (what it generated is not what was predicted)
    before = p.stats()
    p.observe(300, 45, censored=True)
    assert p.predict(300) == pytest.approx((40 + 60 + 80 + 50 + 63) / 5)
    after = p.stats()
    assert (after.observations, after.censored, after.scored) == (5, 1, before.scored)
    assert after.mae == before.mae
    for bad in (1, "yes", 0.0):
        with pytest.raises(ValueError, match="censored"):
            p.observe(300, 5, censored=bad)


def test_flood_of_cut_requests_does_not_drag_the_estimate_down():
    p = LengthPredictor(window=64)
    rng = random.Random(0)
    for _ in range(200):
        p.observe(300, rng.randrange(80, 121))
    before = p.predict(300)
    for _ in range(500):
        p.observe(300, 1, max_tokens=1)
    assert p.predict(300) == pytest.approx(before, rel=0.1)    # taken at face value: ~1
    assert p.predict(300, max_tokens=1) == 1
    assert p.stats().censored == 500


def test_windows_are_bounded_and_follow_drift():
    p = LengthPredictor(window=3, global_window=4, prior_strength=0)
    for out in range(1, 11):
        p.observe(20, out)
    assert p.predict(20) == pytest.approx((8 + 9 + 10) / 3)
    assert p.predict(5000) == pytest.approx((7 + 8 + 9 + 10) / 4)   # empty bucket: global
    q = LengthPredictor(window=64)
    for _ in range(500):
        q.observe(700, 100)
    for _ in range(500):
        q.observe(700, 300)
    assert q.predict(700) > 290


# ---- the empirical-Bayes prior strength, by hand ------------------------------------------------

def test_prior_strength_estimated_by_method_of_moments():
    p = LengthPredictor()
    for out in (10, 30, 50):
        p.observe(20, out)
    for out in (30, 50, 70):
        p.observe(100, out)
    # MSW = (800 + 800) / (6 - 2) = 400; MSB = 3 * (100 + 100) / 1 = 600; n0 = (6 - 18/6) / 1 = 3
    # tau^2 = (600 - 400) / 3 = 66.7; k = 400 / 66.7 = 6
    assert p.prior_strength() == pytest.approx(6.0)
    assert p.predict(20) == pytest.approx(3 / 9 * 30 + 6 / 9 * 40)
    assert p.stats().prior_strength == pytest.approx(6.0)
    # unequal buckets: [10, 30, 50] and [40, 60]: MSW = (800 + 200) / 3, MSB = 3 * 8^2 + 2 * 12^2
    # = 480, n0 = 5 - 13/5 = 2.4, tau^2 = (480 - 1000/3) / 2.4: k = 60/11
    q = LengthPredictor()
    for prompt, out in [(20, 10), (20, 30), (20, 50), (100, 40), (100, 60)]:
        q.observe(prompt, out)
    assert q.prior_strength() == pytest.approx(60 / 11)


def test_prior_strength_limits():
    one = LengthPredictor()
    for out in (10, 90, 50):
        one.observe(20, out)
    assert one.prior_strength() == K_MAX                 # one bucket: nothing to compare
    same = LengthPredictor()
    for prompt, out in [(20, 10), (20, 50), (100, 20), (100, 40)]:
        same.observe(prompt, out)
    assert same.prior_strength() == K_MAX                # equal bucket means: tau^2 <= 0
    apart = LengthPredictor()
    for prompt, out in [(20, 10), (20, 20), (20, 30), (100, 100), (100, 110), (100, 120)]:
        apart.observe(prompt, out)
    # MSW = 100, tau^2 = (12150 - 100) / 3: k = 0.025, held at K_MIN
    assert apart.prior_strength() == K_MIN
    assert LengthPredictor(prior_strength=3.5).prior_strength() == 3.5


def test_prior_strength_tracks_the_windows_over_many_observations():
    # the incremental sums behind k agree with a from-scratch computation after the windows
    # have turned over many times (and past the periodic exact recomputation)
    rng = random.Random(7)
    p = LengthPredictor(window=64)
    windows: dict[int, list[int]] = {}
    for _ in range(5000):       # 5000-token prompts are rare: that window never fills
        prompt = rng.choices([20, 100, 1000, 5000], weights=[30, 30, 30, 0.3])[0]
        out = rng.randrange(0, 400) + (prompt // 20)
        p.observe(prompt, out)
        w = windows.setdefault(prompt, [])
        w.append(out)
        del w[:-64]
    groups = list(windows.values())
    assert 0 < min(map(len, groups)) < 64
    N = sum(map(len, groups))
    grand = sum(map(sum, groups)) / N
    msw = sum((x - sum(g) / len(g)) ** 2 for g in groups for x in g) / (N - len(groups))
    msb = sum(len(g) * (sum(g) / len(g) - grand) ** 2 for g in groups) / (len(groups) - 1)
    n0 = (N - sum(len(g) ** 2 for g in groups) / N) / (len(groups) - 1)
    tau2 = (msb - msw) / n0
    expect = K_MAX if tau2 <= 0 else min(K_MAX, max(K_MIN, msw / tau2))
    assert p.prior_strength() == pytest.approx(expect, rel=1e-9)


# ---- the prequential scores ---------------------------------------------------------------------

def test_prequential_mae_by_hand():
    p = LengthPredictor(default=100, prior_strength=1)
    for prompt, out in [(20, 50), (20, 70), (100, 10), (20, 60)]:
        p.observe(prompt, out)
    # predicted before each outcome: 100 (prior), 50 (bucket [50] w=1/2, global 50),
    # 60 (empty bucket: global [50, 70]), 2/3 * 60 + 1/3 * 130/3 (bucket [50, 70], global
    # [50, 70, 10]); the baseline: 100, 50, 60, 130/3
    errs = [50, 20, 50, abs(2 / 3 * 60 + 1 / 3 * 130 / 3 - 60)]
    base = [50, 20, 50, abs(130 / 3 - 60)]
    s = p.stats()
    assert s.observations == 4 and s.censored == 0
    assert s.mae == pytest.approx(sum(errs) / 4)
    assert s.baseline_mae == pytest.approx(sum(base) / 4)


def test_censored_requests_are_scored_against_what_they_generated():
    p = LengthPredictor(default=100)
    p.observe(20, 30, max_tokens=30)        # predicted min(100, 30) = 30: exact
    assert p.stats().mae == 0 and p.stats().baseline_mae == 0


# ---- argument checks -----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [-1, True, 1.5, "3", None])
def test_bad_prompt_len(bad):
    p = LengthPredictor()
    with pytest.raises(ValueError, match="prompt_len"):
        p.predict(bad)
    with pytest.raises(ValueError, match="prompt_len"):
        p.observe(bad, 3)


@pytest.mark.parametrize("bad", [0, -2, False, 2.0, "8"])
def test_bad_max_tokens(bad):
    p = LengthPredictor()
    with pytest.raises(ValueError, match="max_tokens"):
        p.predict(10, bad)
    with pytest.raises(ValueError, match="max_tokens"):
        p.observe(10, 0, bad)
    with pytest.raises(ValueError, match="max_tokens"):
        p.baseline(bad)


def test_bad_observations_change_nothing():
    p = LengthPredictor()
    for args in [(10, -1), (10, True), (10, 3.0), (10, 9, 8)]:
        with pytest.raises(ValueError):
            p.observe(*args)
    with pytest.raises(ValueError, match="exceeds max_tokens"):
        p.observe(10, 9, 8)
    assert p.stats().observations == 0 and p.predict(10) == 256


@pytest.mark.parametrize("kwargs", [
    {"default": -1}, {"default": 1.5}, {"window": 0}, {"global_window": 0}, {"window": True},
    {"prior_strength": -1}, {"prior_strength": math.inf}, {"prior_strength": math.nan},
    {"prior_strength": True}, {"prior_strength": "2"}, {"min_bucket_log2": -1},
    {"min_bucket_log2": 8, "max_bucket_log2": 7}])
def test_bad_construction(kwargs):
    with pytest.raises(ValueError):
        LengthPredictor(**kwargs)


# ---- accuracy on synthetic workloads -------------------------------------------------------------

def _dependent(rng: random.Random) -> tuple[int, int]:
    """Three regimes of prompt length with their own answer lengths."""
    u = rng.random()
    if u < 0.4:
        return rng.randint(8, 60), max(1, round(rng.gauss(30, 8)))
    if u < 0.7:
        return rng.randint(200, 600), max(1, round(rng.gauss(300, 60)))
    return rng.randint(2000, 6000), max(1, round(rng.gauss(120, 30)))


def _independent(rng: random.Random) -> tuple[int, int]:
    """Prompts of 8..8000 tokens (log-uniform), answers ~150 tokens whatever the prompt."""
    prompt = round(math.exp(rng.uniform(math.log(8), math.log(8000))))
    return prompt, max(1, round(150 * math.exp(rng.gauss(0, 0.7))))


def _replay(draw, seed: int, n: int = 3000) -> tuple[float, float]:
    """Prequential MAE of the predictor and of the global-mean baseline, both computed here
    from the predictions made on arrival (the predictor's own stats must agree)."""
    rng = random.Random(seed)
    p = LengthPredictor()
    err = base = 0.0
    for _ in range(n):
        prompt, natural = draw(rng)
        cap = rng.choice([50, 100, 200]) if rng.random() < 0.2 else None
        out = natural if cap is None else min(natural, cap)
        err += abs(p.predict(prompt, cap) - out)
        base += abs(p.baseline(cap) - out)
        p.observe(prompt, out, cap)
    s = p.stats()
    assert s.mae == pytest.approx(err / n) and s.baseline_mae == pytest.approx(base / n)
    return err / n, base / n


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beats_the_global_mean_when_length_depends_on_the_prompt(seed):
    mae, base = _replay(_dependent, seed)
    assert mae <= 0.7 * base, (mae, base)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_worse_than_the_global_mean_when_it_does_not(seed):
    mae, base = _replay(_independent, seed)
    assert mae <= 1.05 * base, (mae, base)
