"""The cost-profile fits (pdserve/perf/cost_fit.py) and the profile file (cost_profile.py).

Synthetic step times come from known parameters with seeded multiplicative noise of relative
size SIGMA. A weighted (1 / time) least-squares fit then has residuals ~ the relative noise, so
the coefficients' standard errors are sigma * sqrt(diag((A~^T A~)^-1)) with A~ = A / mu (mu the
noise-free times): computed here from the true parameters and the design alone, and a recovered
coefficient must land within TOL_SE of those standard errors."""
import json
import math

import numpy as np
import pytest

from pdserve.perf import cost_fit
from pdserve.perf.cost_fit import (device_time_profile, fit_decode, fit_mixed, fit_prefill,
                                   fit_serving, fit_serving_api, fit_serving_batch, fit_transfer,
                                   nnls, profile_from_samples, refit)
from pdserve.perf.cost_profile import API_COST_KEYS, CostProfile, hardware_label

SIGMA = 0.02
TOL_SE = 4.0        # a 4-sigma band: fails by chance ~1 in 16k per coefficient
PREFILL_N = [128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192]


def _noisy(mu, seed, sigma=SIGMA):
    rng = np.random.default_rng(seed)
    mu = np.asarray(mu, dtype=float)
    return mu * np.exp(rng.normal(0.0, sigma, size=mu.shape))


def _std_errors(A, mu, sigma=SIGMA):
    At = np.asarray(A, dtype=float) / np.asarray(mu, dtype=float)[:, None]
    return sigma * np.sqrt(np.diag(np.linalg.inv(At.T @ At)))


# ---- prefill ------------------------------------------------------------------------------------
def _prefill_rows(fixed, alpha, quad, seed, sigma=SIGMA, ns=PREFILL_N):
    n = np.array(ns, dtype=float)
    mu = fixed + alpha * n + quad * n * n
    y = _noisy(mu, seed, sigma) if sigma else mu
    return [{"n": int(a), "wall_ms": float(b)} for a, b in zip(n, y)], n, mu


def test_prefill_recovers_fixed_alpha_and_quadratic():
    true = (2.0, 0.006, 1.5e-7)   # at 8192 tokens the quadratic term is 17% of the step
    rows, n, mu = _prefill_rows(*true, seed=1)
    got = fit_prefill(rows)
    se = _std_errors(np.stack([np.ones_like(n), n, n * n], 1), mu)
    assert got["fit"]["quadratic_kept"] is True
    for name, t, s in zip(("prefill_fixed_ms", "alpha_ms_per_token", "prefill_quadratic_ms"),
                          true, se):
        assert abs(got[name] - t) <= TOL_SE * s, (name, got[name], t, s)
    f = got["fit"]
    assert f["n_samples"] == len(PREFILL_N)
    # held-out rows off by about the noise: mean |rel err| of N(0, s) is 0.8 s
    assert f["heldout_mean_abs_rel_err"] < 2.5 * SIGMA
    assert f["heldout_max_abs_rel_err"] >= f["heldout_mean_abs_rel_err"]


def test_prefill_drops_the_quadratic_term_of_a_linear_truth():
    rows, n, mu = _prefill_rows(3.0, 0.007, 0.0, seed=2)
    got = fit_prefill(rows)
    assert got["fit"]["quadratic_kept"] is False and got["prefill_quadratic_ms"] == 0.0
    se = _std_errors(np.stack([np.ones_like(n), n], 1), mu)
    assert abs(got["prefill_fixed_ms"] - 3.0) <= TOL_SE * se[0]
    assert abs(got["alpha_ms_per_token"] - 0.007) <= TOL_SE * se[1]


def test_heldout_error_judges_a_row_by_a_fit_without_it():
    """Noise-free rows of a quadratic truth, one of them measured 1.5x too slow: the fit on the
    other rows is exact, so that row's held-out error is exactly |1 - 1.5| / 1.5 = 1/3 (a fit
    that saw the row would have bent towards it and scored it lower)."""
    rows, _, mu = _prefill_rows(2.0, 0.006, 1.5e-7, seed=0, sigma=0)
    rows[4]["wall_ms"] *= 1.5
    f = fit_prefill(rows)["fit"]
    errs = f["heldout_abs_rel_errs"]
    assert errs[4] == pytest.approx(1 / 3, abs=1e-5)   # (stored to 5 decimals)
    assert f["heldout_max_abs_rel_err"] == pytest.approx(1 / 3, rel=1e-6)


def test_nnls_keeps_every_coefficient_non_negative():
    # concave prefill times: unconstrained least squares wants a negative quadratic term
    n = np.array(PREFILL_N, dtype=float)
    y = 5 + 0.01 * n - 5e-7 * n * n
    A = np.stack([np.ones_like(n), n, n * n], 1)
    free = np.linalg.lstsq(A, y, rcond=None)[0]
    assert free[2] < 0
    rows = [{"n": int(a), "wall_ms": float(b)} for a, b in zip(n, y)]
    got = fit_prefill(rows)
    for k in ("prefill_fixed_ms", "alpha_ms_per_token", "prefill_quadratic_ms"):
        assert got[k] >= 0
    # the subset search equals scipy's active-set NNLS (an independent implementation)
    sp = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(7)
    for _ in range(50):
        A = rng.normal(size=(9, 4))
        y = rng.normal(size=9)
        w = rng.uniform(0.5, 2.0, size=9)
        want, _ = sp.nnls(A * w[:, None], y * w)
        got = nnls(A, y, w)
        assert np.all(got >= 0)
        np.testing.assert_allclose(got, want, atol=1e-8)


# ---- decode -------------------------------------------------------------------------------------
DECODE_B = [1, 4, 8, 16, 32, 64, 128, 256]
DECODE_TRUE = dict(fixed_ms=2.5, per_seq_ms_below=0.01, per_seq_ms_above=0.03,
                   per_context_token_ms=2e-5)
KNEE = 32


def _decode_mu(b, ctx, p=DECODE_TRUE, k=KNEE):
    b, ctx = np.asarray(b, dtype=float), np.asarray(ctx, dtype=float)
    return (p["fixed_ms"] + p["per_seq_ms_below"] * np.minimum(b, k)
            + p["per_seq_ms_above"] * np.maximum(0, b - k) + p["per_context_token_ms"] * ctx)


def _decode_rows(seed, contexts=(512, 2048), sigma=SIGMA):
    b = np.array([x for _ in contexts for x in DECODE_B], dtype=float)
    ctx = np.array([x * c for c in contexts for x in DECODE_B], dtype=float)
    mu = _decode_mu(b, ctx)
    y = _noisy(mu, seed, sigma)
    rows = [{"b": int(x), "ctx_sum": int(c), "wall_ms": float(t)} for x, c, t in zip(b, ctx, y)]
    return rows, b, ctx, mu


def test_a_step_that_splits_its_keys_pays_split_ms():
    """Rows at 256, 1,024 and 4,096 tokens of context per sequence, their times from known
    terms plus a split cost of 0.5 ms for the steps at >= 512 tokens (the paged decode kernel's
    first split: one split below 2 x MIN_KEYS_PER_SPLIT keys): the fit finds the split cost and
    the other terms back exactly (no noise). By hand, b = 4 at 1,024 tokens: 2.5 + 0.01 x 4 +
    2e-5 x 4,096 + 0.5 = 3.12192 ms; b = 4 at 256: 2.5 + 0.04 + 0.02048 = 2.56048 ms. Without the
    term a linear fit of the same rows misses by far more."""
    from pdserve.kernels.paged_attention import MIN_KEYS_PER_SPLIT, default_num_kv_splits
    from pdserve.perf.cost_profile import SPLIT_CONTEXT_TOKENS
    # the threshold is the kernel's own: 1 split below it, more from it on (a short batch)
    assert SPLIT_CONTEXT_TOKENS == 2 * MIN_KEYS_PER_SPLIT
    assert default_num_kv_splits(2, SPLIT_CONTEXT_TOKENS - 1) == 1
    assert default_num_kv_splits(2, SPLIT_CONTEXT_TOKENS) > 1
    contexts = (256, 1024, 4096)
    b = np.array([x for _ in contexts for x in DECODE_B], dtype=float)
    per = np.array([c for c in contexts for _ in DECODE_B], dtype=float)
    mu = _decode_mu(b, b * per) + 0.5 * (per >= 512)
    rows = [{"b": int(x), "ctx_sum": int(x * c), "wall_ms": float(t)}
            for x, c, t in zip(b, per, mu)]
    got = fit_decode(rows)
    assert got["batch_threshold"] == KNEE and got["fit"]["split"] == "fitted"
    want = {**DECODE_TRUE, "split_ms": 0.5}
    assert got["beta_ms"] == {k: pytest.approx(v, rel=1e-6, abs=1e-9) for k, v in want.items()}
    assert cost_fit.decode_predict(got, 4, 4 * 1024) == pytest.approx(3.12192, rel=1e-6)
    assert cost_fit.decode_predict(got, 4, 4 * 256) == pytest.approx(2.56048, rel=1e-6)
    assert got["fit"]["heldout_max_abs_rel_err"] < 1e-6
    # the same rows, all on one side of the threshold: no split term to fit
    above = [r for r in rows if r["ctx_sum"] >= r["b"] * 512]
    one_side = fit_decode(above)
    assert one_side["beta_ms"]["split_ms"] == 0.0
    assert one_side["fit"]["split"].startswith("not fitted")


def test_profiles_without_split_ms_cost_decode_steps_as_before():
    """A profile file without beta_ms.split_ms (every one committed before it) loads and costs a
    decode step with the four terms alone, by hand: 2.5 + 0.01 x 8 + 2e-5 x 8,192 = 2.74384 ms;
    with split_ms 0.5 the same step costs 0.5 ms more, and one at 256 tokens a sequence does not."""
    d = _profile_dict()
    d["beta_ms"] = dict(DECODE_TRUE)
    d["batch_threshold"] = KNEE
    p = CostProfile.from_json(d)
    assert "split_ms" not in p.beta_ms
    assert p.decode_ms(8, 8 * 1024) == pytest.approx(2.74384, rel=1e-9)
    q = CostProfile.from_json({**d, "beta_ms": {**DECODE_TRUE, "split_ms": 0.5}})
    assert q.decode_ms(8, 8 * 1024) == pytest.approx(3.24384, rel=1e-9)
    assert q.decode_ms(8, 8 * 256) == pytest.approx(p.decode_ms(8, 8 * 256), rel=1e-12)
    with pytest.raises(ValueError, match="split_ms"):
        CostProfile.from_json({**d, "beta_ms": {**DECODE_TRUE, "split_ms": -1.0}})


def test_decode_finds_the_knee_and_recovers_beta():
    rows, b, ctx, mu = _decode_rows(seed=3)
    got = fit_decode(rows)
    assert got["batch_threshold"] == KNEE
    A = np.stack([np.ones_like(b), np.minimum(b, KNEE), np.maximum(0, b - KNEE), ctx], 1)
    se = _std_errors(A, mu)
    for (k, t), s in zip(DECODE_TRUE.items(), se):
        assert abs(got["beta_ms"][k] - t) <= TOL_SE * s, (k, got["beta_ms"][k], t, s)
    f = got["fit"]
    assert f["n_samples"] == len(rows) and f["heldout_mean_abs_rel_err"] < 2.5 * SIGMA
    assert all(v >= 0 for v in got["beta_ms"].values())


def test_noise_free_timings_are_fitted_exactly():
    """Times computed from the formulas themselves: every term comes back to 1e-6 and every
    held-out row is predicted exactly."""
    pre = fit_prefill(_prefill_rows(2.0, 0.006, 1.5e-7, seed=0, sigma=0)[0])
    for k, v in (("prefill_fixed_ms", 2.0), ("alpha_ms_per_token", 0.006),
                 ("prefill_quadratic_ms", 1.5e-7)):
        assert pre[k] == pytest.approx(v, rel=1e-6)
    rows, *_ = _decode_rows(seed=0, sigma=0)
    dec = fit_decode(rows)
    assert dec["batch_threshold"] == KNEE
    for k, v in DECODE_TRUE.items():
        assert dec["beta_ms"][k] == pytest.approx(v, rel=1e-6), k
    mix = [{"b": b, "ctx_sum": b * 300, "n": n,
            "wall_ms": float(_decode_mu(b, b * 300)) + 0.02 * n} for b, n in ((4, 64), (100, 512))]
    assert fit_mixed(mix, dec)["gamma_ms_per_token"] == pytest.approx(0.02, rel=1e-6)
    faster = [{**r, "wall_ms": r["wall_ms"] - 0.03 * r["n"]} for r in mix]   # below decode
    assert fit_mixed(faster, dec)["gamma_ms_per_token"] == 0.0               # clipped, not < 0
    tr = fit_transfer([{"tokens": t, "bytes": t * 1000, "ms": 0.25 + t * 1000 / 8e6}
                       for t in (10, 100, 1000)])
    assert tr["transfer_fixed_ms"] == pytest.approx(0.25, rel=1e-6)
    assert tr["transfer_gb_per_s"] == pytest.approx(8.0, rel=1e-6)
    for part in (pre, dec, tr):
        assert part["fit"]["heldout_max_abs_rel_err"] < 1e-6


def test_decode_needs_two_contexts():
    rows, *_ = _decode_rows(seed=4, contexts=(1024,))
    with pytest.raises(ValueError, match="2 contexts"):
        fit_decode(rows)


# ---- mixed and transfer ------------------------------------------------------------------------
def test_mixed_recovers_gamma_against_the_decode_model():
    gamma, sigma = 0.012, 0.01
    dec_rows, *_ = _decode_rows(seed=5)
    dec = fit_decode(dec_rows)
    pts = [(8, 256), (32, 512), (64, 1024), (128, 256), (128, 2048)]
    C = 1024
    b = np.array([p[0] for p in pts], dtype=float)
    n = np.array([p[1] for p in pts], dtype=float)
    mu = _decode_mu(b, b * C) + gamma * n
    y = _noisy(mu, 6, sigma)
    rows = [{"b": int(x), "ctx_sum": int(x * C), "n": int(k), "wall_ms": float(t)}
            for x, k, t in zip(b, n, y)]
    got = fit_mixed(rows, dec)
    # gamma's error: the rows' noise plus the decode model's own error at each row, both
    # relative to the row's time (the decode fit's error is bounded by its noise, SIGMA)
    w = 1 / mu
    rel = np.sqrt(sigma ** 2 + SIGMA ** 2)
    se = rel * np.sqrt(np.sum((w * n) ** 2 * (mu * w) ** 2)) / np.sum((w * n) ** 2)
    assert abs(got["gamma_ms_per_token"] - gamma) <= TOL_SE * se, (got, se)
    assert got["fit"]["n_samples"] == len(pts)
    assert got["fit"]["heldout_mean_abs_rel_err"] < 4 * sigma


def test_transfer_recovers_fixed_cost_and_bandwidth():
    kvb, fixed, gbps = 23040, 0.4, 12.0
    tokens = np.array([64, 256, 1024, 4096, 16384], dtype=float)
    mu = fixed + tokens * kvb / (gbps * 1e6)
    y = _noisy(mu, 8)
    rows = [{"tokens": int(t), "bytes": int(t) * kvb, "ms": float(v)} for t, v in zip(tokens, y)]
    got = fit_transfer(rows)
    assert got["kv_bytes_per_token"] == kvb
    A = np.stack([np.ones_like(tokens), tokens * kvb], 1)
    se = _std_errors(A, mu)
    assert abs(got["transfer_fixed_ms"] - fixed) <= TOL_SE * se[0]
    slope = 1 / (gbps * 1e6)
    assert abs(1 / (got["transfer_gb_per_s"] * 1e6) - slope) <= TOL_SE * se[1]
    assert got["fit"]["source"] == "measured" and got["fit"]["n_samples"] == 5


def test_transfer_fallbacks():
    # times that fall as transfers grow: no per-byte cost >= 0 explains them, so the fit goes
    # through the origin: argmin sum(((s x - y) / y)^2) = sum(x / y) / sum(x^2 / y^2)
    x = np.array([1e6, 2e6, 4e6])
    y = np.array([2.0, 1.5, 1.0])
    rows = [{"tokens": int(b // 100), "bytes": int(b), "ms": float(t)} for b, t in zip(x, y)]
    got = fit_transfer(rows)
    s = np.sum(x / y) / np.sum(x * x / (y * y))
    assert got["transfer_fixed_ms"] == 0.0 and "origin" in got["fit"]["note"]
    assert got["transfer_gb_per_s"] == pytest.approx(1 / (s * 1e6), rel=1e-9)
    # rows carrying the engine's KV bytes per token: that figure is used, not the bytes moved
    # (a pull of whole blocks moves more than the prompt's tokens)
    rows = [{"tokens": t, "bytes": -(-t // 16) * 16 * 50, "ms": 0.1 + t * 50 / 1e6,
             "kv_bytes_per_token": 50} for t in (10, 100, 1000)]
    got = fit_transfer(rows)
    assert got["kv_bytes_per_token"] == 50
    assert got["transfer_gb_per_s"] == pytest.approx(1.0, rel=1e-6)


def test_fit_rows_are_checked():
    with pytest.raises(ValueError, match="prefill fit: needs >= 3 rows"):
        fit_prefill([{"n": 1, "wall_ms": 1.0}])
    with pytest.raises(ValueError, match="finite number 'wall_ms'"):
        fit_prefill([{"n": 1, "wall_ms": 1.0}, {"n": 2, "wall_ms": float("nan")},
                     {"n": 3, "wall_ms": 2.0}])
    with pytest.raises(ValueError, match="> 0"):
        fit_prefill([{"n": 1, "wall_ms": 1.0}, {"n": 2, "wall_ms": -1.0}, {"n": 3, "wall_ms": 2.0}])


# ---- the profile ------------------------------------------------------------------------------
def _profile_dict():
    return {
        "version": 1, "model": "qwen2.5-1.5b", "hardware": {"gpu": "NVIDIA H200", "cpu_model": "x"},
        "engine_config": {"max_num_batched_tokens": 8192}, "commit": "abc123",
        "alpha_ms_per_token": 0.005, "prefill_fixed_ms": 2.0, "prefill_quadratic_ms": 1e-7,
        "beta_ms": {"fixed_ms": 2.5, "per_seq_ms_below": 0.01, "per_seq_ms_above": 0.03,
                    "per_context_token_ms": 2e-5},
        "batch_threshold": 64, "gamma_ms_per_token": 0.012, "transfer_gb_per_s": 20.0,
        "transfer_fixed_ms": 0.5, "kv_bytes_per_token": 28672,
        "fit": {t: {"n_samples": 3, "heldout_mean_abs_rel_err": 0.02,
                    "heldout_max_abs_rel_err": 0.05} for t in ("prefill", "decode", "mixed",
                                                                "transfer")},
        "samples": {"prefill": []}, "notes": ["kept as an extra"]}


def test_formulas_by_hand():
    p = CostProfile.from_json(_profile_dict())
    assert p.prefill_ms(1000) == pytest.approx(2.0 + 5.0 + 0.1)
    # b = 100 over a knee of 64: 2.5 + 0.01*64 + 0.03*36 + 2e-5*50000 = 2.5+0.64+1.08+1.0
    assert p.decode_ms(100, 50_000) == pytest.approx(5.22)
    assert p.decode_ms(10, 0) == pytest.approx(2.6)
    assert p.mixed_ms(100, 50_000, 256) == pytest.approx(5.22 + 3.072)
    assert p.mixed_ms(0, 0, 1000) == pytest.approx(7.1)
    # 2048 tokens * 28672 B = 58.72 MB at 20 GB/s = 2.936 ms, + 0.5
    assert p.transfer_ms(2048) == pytest.approx(0.5 + 2.9360128)
    with pytest.raises(ValueError, match="b must be"):
        p.decode_ms(0, 0)
    assert p.hardware_label == "NVIDIA H200"


def test_profile_round_trips_through_a_file(tmp_path):
    p = CostProfile.from_json(_profile_dict())
    path = p.save(tmp_path / "p.json")
    q = CostProfile.from_json(path, model="qwen2.5-1.5b", hardware="NVIDIA H200")
    assert q == p and q.extra == {"notes": ["kept as an extra"]}
    # (a file made before the serving terms and the step shapes is written with their defaults)
    assert json.loads((tmp_path / "p.json").read_text()) == {**_profile_dict(),
                                                              "serving_overhead_ms": 0.0,
                                                              "serving_host_ms": {},
                                                              "api_cost_ms": {},
                                                              "fit_graph_sizes": []}


def _set(d, path, value):
    *head, last = path.split(".")
    for k in head:
        d = d[k]
    if value is KeyError:
        del d[last]
    else:
        d[last] = value


BAD = [
    ("alpha_ms_per_token", KeyError, "alpha_ms_per_token is missing"),
    ("beta_ms.per_seq_ms_above", KeyError, "beta_ms.per_seq_ms_above is missing"),
    ("fit.mixed", KeyError, "fit.mixed must be an object"),
    ("fit.decode.heldout_max_abs_rel_err", KeyError,
     "fit.decode.heldout_max_abs_rel_err is missing"),
    ("gamma_ms_per_token", "0.1", "gamma_ms_per_token must be a number"),
    ("prefill_fixed_ms", True, "prefill_fixed_ms must be a number"),
    ("prefill_quadratic_ms", -1e-9, "prefill_quadratic_ms must be >= 0"),
    ("beta_ms.fixed_ms", -0.1, "beta_ms.fixed_ms must be >= 0"),
    ("alpha_ms_per_token", float("nan"), "alpha_ms_per_token must be finite"),
    ("transfer_fixed_ms", float("inf"), "transfer_fixed_ms must be finite"),
    ("transfer_gb_per_s", 0.0, "transfer_gb_per_s must be > 0"),
    ("batch_threshold", 0, "batch_threshold must be >= 1"),
    ("batch_threshold", 32.0, "batch_threshold must be an integer"),
    ("kv_bytes_per_token", 0, "kv_bytes_per_token must be >= 1"),
    ("version", 2, "version must be 1"),
    ("model", "", "model must be a non-empty string"),
    ("engine_config", [], "engine_config must be an object"),
    ("fit.prefill.n_samples", -1, "fit.prefill.n_samples must be an integer >= 0"),
    ("fit.transfer.heldout_mean_abs_rel_err", float("nan"),
     "fit.transfer.heldout_mean_abs_rel_err must be finite"),
    ("serving_overhead_ms", -0.5, "serving_overhead_ms must be >= 0"),
    ("serving_overhead_ms", float("nan"), "serving_overhead_ms must be finite"),
    ("serving_overhead_ms", float("inf"), "serving_overhead_ms must be finite"),
    ("serving_overhead_ms", "3", "serving_overhead_ms must be a number"),
    ("serving_overhead_ms", False, "serving_overhead_ms must be a number"),
    ("fit_graph_sizes", 16, "fit_graph_sizes must be a list of increasing token counts"),
    ("fit_graph_sizes", [32, 16], "fit_graph_sizes must be a list of increasing token counts"),
    ("fit_graph_sizes", [0, 16], "fit_graph_sizes must be a list of increasing token counts"),
    ("fit_graph_sizes", [16, True], "fit_graph_sizes must be a list of increasing token counts"),
    ("fit.serving", [], "fit.serving must be an object"),
    ("fit.serving", {"n_samples": 3}, "fit.serving.heldout_mean_abs_rel_err is missing"),
    ("serving_host_ms", [], "serving_host_ms must be an object"),
    ("serving_host_ms", 0.5, "serving_host_ms must be an object"),
    ("serving_host_ms", {"fixed_ms": 1.0}, "serving_host_ms.per_seq_ms is missing"),
    ("serving_host_ms", {"fixed_ms": -1.0, "per_seq_ms": 0.1},
     "serving_host_ms.fixed_ms must be >= 0"),
    ("serving_host_ms", {"fixed_ms": 1.0, "per_seq_ms": float("nan")},
     "serving_host_ms.per_seq_ms must be finite"),
    ("serving_host_ms", {"fixed_ms": 1.0, "per_seq_ms": float("inf")},
     "serving_host_ms.per_seq_ms must be finite"),
    ("serving_host_ms", {"fixed_ms": 1.0, "per_seq_ms": "0.1"},
     "serving_host_ms.per_seq_ms must be a number"),
    ("serving_host_ms", {"fixed_ms": 1.0, "per_seq_ms": 0.1, "per_token_ms": 0.2},
     "serving_host_ms has unknown keys ['per_token_ms']"),
    ("fit.serving_batch", [], "fit.serving_batch must be an object"),
    ("api_cost_ms", [], "api_cost_ms must be an object"),
    ("api_cost_ms", None, "api_cost_ms must be an object"),
    ("api_cost_ms", {"per_request_ms": 1.0, "per_output_token_ms": 0.08},
     "api_cost_ms.per_prompt_token_ms is missing"),
    ("api_cost_ms", {"per_request_ms": -1.0, "per_prompt_token_ms": 0.0,
                     "per_output_token_ms": 0.08}, "api_cost_ms.per_request_ms must be >= 0"),
    ("api_cost_ms", {"per_request_ms": 1.0, "per_prompt_token_ms": float("nan"),
                     "per_output_token_ms": 0.08},
     "api_cost_ms.per_prompt_token_ms must be finite"),
    ("api_cost_ms", {"per_request_ms": 1.0, "per_prompt_token_ms": 0.0,
                     "per_output_token_ms": float("inf")},
     "api_cost_ms.per_output_token_ms must be finite"),
    ("api_cost_ms", {"per_request_ms": 1.0, "per_prompt_token_ms": 0.0,
                     "per_output_token_ms": "0.08"},
     "api_cost_ms.per_output_token_ms must be a number"),
    ("api_cost_ms", {"per_request_ms": 1.0, "per_prompt_token_ms": 0.0,
                     "per_output_token_ms": 0.08, "per_byte_ms": 1e-6},
     "api_cost_ms has unknown keys ['per_byte_ms']"),
    ("api_cost_ms", {"per_request_ms": 1.0, "per_prompt_token_ms": 0.0, "per_write_ms": -0.1,
                     "per_output_token_ms": 0.08}, "api_cost_ms.per_write_ms must be >= 0"),
    ("api_cost_ms", {"per_request_ms": 1.0, "per_prompt_token_ms": 0.0, "per_write_ms": 0.1,
                     "per_output_token_ms": 0.08, "per_step_ms": -0.3},
     "api_cost_ms.per_step_ms must be >= 0"),
    ("fit.serving_api", [], "fit.serving_api must be an object"),
]


@pytest.mark.parametrize("field,value,message", BAD, ids=[f"{b[0]}={b[1]}" for b in BAD])
def test_bad_profile_files_are_refused_naming_the_field_and_the_file(tmp_path, field, value,
                                                                     message):
    d = _profile_dict()
    _set(d, field, value)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))       # NaN / Infinity written as JSON's extension
    with pytest.raises(ValueError) as e:
        CostProfile.from_json(path)
    assert message in str(e.value) and str(path) in str(e.value)


def test_another_models_or_machines_profile_is_refused(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile_dict()))
    with pytest.raises(ValueError, match=f"{path}: model is 'qwen2.5-1.5b'.*'qwen2.5-7b'"):
        CostProfile.from_json(path, model="qwen2.5-7b")
    with pytest.raises(ValueError, match="hardware is 'NVIDIA H200'.*'cpu: Xeon'"):
        CostProfile.from_json(path, hardware={"cpu_model": "Xeon"})
    with pytest.raises(ValueError, match="not JSON"):
        (tmp_path / "broken.json").write_text("{")
        CostProfile.from_json(tmp_path / "broken.json")
    with pytest.raises(ValueError, match="cannot read"):
        CostProfile.from_json(tmp_path / "absent.json")
    assert hardware_label({"cpu_model": "Xeon"}) == "cpu: Xeon"


def _small_samples():
    """Prefill and decode rows from the synthetic truths, two mixed rows, and a transfer
    estimate (no transfer rows)."""
    pre, *_ = _prefill_rows(2.0, 0.006, 1.5e-7, seed=9)
    dec, *_ = _decode_rows(seed=10)
    mix = [{"b": 32, "ctx_sum": 32 * 1024, "n": 256, "wall_ms": 6.0},
           {"b": 64, "ctx_sum": 64 * 1024, "n": 512, "wall_ms": 9.0}]
    est = {"transfer_fixed_ms": 0.0, "transfer_gb_per_s": 5.0, "kv_bytes_per_token": 100,
           "note": "no second worker: the device copy bandwidth"}
    return pre, dec, mix, est


def test_profile_from_samples_and_refit():
    pre, dec, mix, est = _small_samples()
    p = profile_from_samples({"prefill": pre, "decode": dec, "mixed": mix}, model="m",
                             hardware="cpu: x", engine_config={}, commit="c",
                             transfer_estimate=est)
    assert p.fit["transfer"]["source"] == "estimate" and p.fit["transfer"]["n_samples"] == 0
    assert p.fit["transfer"]["note"].startswith("no second worker")
    again = refit(CostProfile.from_json(p.to_dict()))
    assert again == p
    with pytest.raises(ValueError, match="say where"):
        profile_from_samples({"prefill": pre, "decode": dec, "mixed": mix}, model="m",
                             hardware="cpu: x", engine_config={}, commit="c",
                             transfer_estimate={**est, "note": ""})
    assert cost_fit.MIN_ROWS["decode"] == 4 and math.isfinite(p.gamma_ms_per_token)


# ---- the serving path ---------------------------------------------------------------------------
def test_the_serving_overhead_is_optional_and_older_files_load_with_zero():
    import glob
    import os
    d = _profile_dict()
    assert CostProfile.from_json(d).serving_overhead_ms == 0.0
    p = CostProfile.from_json({**d, "serving_overhead_ms": 3.5})
    assert p.serving_overhead_ms == 3.5 and CostProfile.from_json(p.to_dict()) == p
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "bench", "results")
    committed = sorted(glob.glob(os.path.join(root, "profile-*.json")))
    old = [p for p in committed if "serving_overhead_ms" not in json.loads(open(p).read())]
    assert old          # profiles made before the term existed are committed and still load
    for path in old:
        assert CostProfile.from_json(path).serving_overhead_ms == 0.0
    for path in set(committed) - set(old):      # and those made after carry a measured value
        assert CostProfile.from_json(path).serving_overhead_ms > 0.0


PREFILL = {"prefill_fixed_ms": 2.0, "alpha_ms_per_token": 0.01, "prefill_quadratic_ms": 0.0}
DECODE = {"beta_ms": {"fixed_ms": 1.0, "per_seq_ms_below": 0.1, "per_seq_ms_above": 0.0,
                      "per_context_token_ms": 0.001}, "batch_threshold": 8}


def test_serving_overhead_is_the_median_ttft_past_the_lone_prefill_by_hand():
    """Prefill 2 + 0.01 n: 3, 4, 5 ms at n = 100, 200, 300; TTFTs 7, 9, 11 ms: overheads 4, 5,
    6, median 5. Held out: row 0 by the others' median 5.5 (3 + 5.5 = 8.5 vs 7), row 1 by 5
    (9 vs 9), row 2 by 4.5 (9.5 vs 11). ITL overhead: decode 1.1 + 0.001 ctx at b = 1; gaps of
    the n = 100 request at contexts 101 and 102: 2.0 - 1.201 and 2.5 - 1.202, median 1.0485."""
    rows = [{"n": 100, "ttft_ms": 7.0, "itl_ms": [2.0, 2.5]}, {"n": 200, "ttft_ms": 9.0},
            {"n": 300, "ttft_ms": 11.0, "itl_ms": []}]
    r = fit_serving(rows, PREFILL, DECODE)
    assert r["serving_overhead_ms"] == pytest.approx(5.0)
    f = r["fit"]
    assert f["n_samples"] == 3 and f["source"] == "measured"
    assert f["heldout_abs_rel_errs"] == pytest.approx([1.5 / 7, 0.0, 1.5 / 11], abs=1e-5)
    assert f["heldout_mean_abs_rel_err"] == pytest.approx((1.5 / 7 + 1.5 / 11) / 3)
    assert f["heldout_max_abs_rel_err"] == pytest.approx(1.5 / 7)
    assert f["overhead_ms_by_prompt_len"] == {"100": 4.0, "200": 5.0, "300": 6.0}
    assert f["batch1_itl_overhead_ms"] == pytest.approx((0.799 + 1.298) / 2)
    assert f["batch1_itl_samples"] == 2
    # requests faster than the profile's prefill: clipped at 0, and said
    fast = fit_serving([{"n": 100, "ttft_ms": 2.0}, {"n": 100, "ttft_ms": 2.5}], PREFILL, DECODE)
    assert fast["serving_overhead_ms"] == 0.0 and "clipped at 0" in fast["fit"]["note"]
    with pytest.raises(ValueError, match="serving fit: needs >= 2 rows"):
        fit_serving(rows[:1], PREFILL, DECODE)
    with pytest.raises(ValueError, match="ttft_ms > 0"):
        fit_serving([{"n": 100, "ttft_ms": 0.0}, *rows], PREFILL, DECODE)


def test_profile_from_samples_fits_the_serving_term_against_its_own_prefill_fit():
    """The term subtracts the prefill fit of the same samples (CostProfile.prefill_ms of the
    result), survives a refit and a file; without serving rows it is 0 and says why."""
    import statistics
    pre, *_ = _prefill_rows(2.0, 0.006, 1.5e-7, seed=9)
    dec, *_ = _decode_rows(seed=10)
    mix = [{"b": 32, "ctx_sum": 32 * 1024, "n": 256, "wall_ms": 6.0}]
    serving = [{"n": n, "ttft_ms": 2.0 + 0.006 * n + 1.5e-7 * n * n + 3.0 + 0.1 * k,
                "itl_ms": [4.0, 4.1]} for k, n in enumerate([256, 1024, 2048, 256, 1024])]
    est = {"transfer_fixed_ms": 0.0, "transfer_gb_per_s": 5.0, "kv_bytes_per_token": 100,
           "note": "estimate"}
    kw = dict(model="m", hardware="cpu: x", engine_config={}, commit="c", transfer_estimate=est)
    p = profile_from_samples({"prefill": pre, "decode": dec, "mixed": mix, "serving": serving},
                             **kw)
    want = statistics.median(r["ttft_ms"] - p.prefill_ms(r["n"]) for r in serving)
    assert p.serving_overhead_ms == pytest.approx(want, rel=1e-12)
    assert 2.9 < p.serving_overhead_ms < 3.5       # the +3.0..3.4 ms put in, through a fit
    assert p.fit["serving"]["n_samples"] == 5 and p.samples["serving"] == serving
    assert refit(CostProfile.from_json(p.to_dict())) == p
    q = profile_from_samples({"prefill": pre, "decode": dec, "mixed": mix}, **kw,
                             serving_note="not measured (--no-serving-overhead)")
    assert q.serving_overhead_ms == 0.0 and q.fit["serving"]["source"] == "not measured"
    assert q.fit["serving"]["note"] == "not measured (--no-serving-overhead)"
    assert refit(CostProfile.from_json(q.to_dict())) == q


# ---- step shapes (CUDA graph buckets) -----------------------------------------------------------
def _small_profile(engine_config, **kw):
    """_small_samples' profile of a machine with this engine_config (kw: profile_from_samples')."""
    pre, dec, mix, est = _small_samples()
    return profile_from_samples({"prefill": pre, "decode": dec, "mixed": mix}, model="m",
                                hardware="NVIDIA H200", engine_config=engine_config, commit="c",
                                transfer_estimate=est, **kw)


def test_rows_are_fitted_at_their_graph_shapes():
    """Mixed rows whose true cost is the decode model plus gamma per token of the step's graph
    bucket (padding included): fitted at their shapes, gamma comes back exactly; fitted at their
    own token counts it does not (these rows pad by different fractions)."""
    from pdserve.perf.cost_fit import decode_predict, shaped_rows
    from pdserve.step_shapes import mixed_sizes
    gamma = 0.005
    sizes = mixed_sizes(8192)
    dec_rows, *_ = _decode_rows(seed=11, sigma=0)
    dec = fit_decode(dec_rows)
    # (b, n) -> bucket: 8+256=264 -> 384, 100+284=384 -> 384, 32+1024 -> 1536,
    # 64+1984=2048 -> 2048, 128+2048 -> 3072
    pts = [(8, 256, 384), (100, 284, 384), (32, 1024, 1536), (64, 1984, 2048), (128, 2048, 3072)]
    rows = [{"b": b, "ctx_sum": b * 1024, "n": n,
             "wall_ms": decode_predict(dec, b, b * 1024) + gamma * (t - b)} for b, n, t in pts]
    shaped = shaped_rows({"mixed": rows}, sizes)["mixed"]
    assert [r["n"] for r in shaped] == [376, 284, 1504, 1984, 2944]
    assert [r["n"] for r in rows] == [256, 284, 1024, 1984, 2048]      # (the rows are not changed)
    assert fit_mixed(shaped, dec)["gamma_ms_per_token"] == pytest.approx(gamma, rel=1e-9)
    assert abs(fit_mixed(rows, dec)["gamma_ms_per_token"] - gamma) > 0.0005
    # prefill rows: a lone step of n tokens at its bucket
    pre = shaped_rows({"prefill": [{"n": 100, "wall_ms": 1.0}, {"n": 128, "wall_ms": 1.0},
                                   {"n": 9000, "wall_ms": 9.0}]}, sizes)["prefill"]
    assert [r["n"] for r in pre] == [128, 128, 9000]
    assert shaped_rows({"mixed": rows}, []) == {"mixed": rows}


def test_a_profile_of_a_graphed_engine_is_fitted_per_shape_and_costed_per_shape():
    """profile_from_samples pads by the measuring engine's buckets (its engine_config) and says
    so (fit_graph_sizes); refits keep it; step_cost_ms then pads a step by the deployment's
    buckets, by hand."""
    from pdserve.perf.cost_profile import deployment_graph_sizes, step_cost_ms
    from pdserve.step_shapes import mixed_sizes
    cfg = {"device": "cuda", "max_num_batched_tokens": 8192}
    p = _small_profile(cfg)
    flat = _small_profile({**cfg, "device": "cpu"})
    assert p.fit_graph_sizes == mixed_sizes(8192) and p.graph_padded and not flat.graph_padded
    # 32 + 256 = 288 -> 384: 352 chunk tokens; 64 + 512 = 576 -> 768: 704 (each 1.375x n)
    assert p.gamma_ms_per_token == pytest.approx(flat.gamma_ms_per_token / 1.375)
    assert refit(CostProfile.from_json(p.to_dict())) == p
    # an older file (no fit_graph_sizes) keeps its meaning through refit; refitting it per
    # shape is asked for
    old = CostProfile.from_json({**flat.to_dict(), "engine_config": cfg})
    assert refit(old).fit_graph_sizes == [] and refit(old) == old
    assert refit(old, mixed_sizes(8192)).gamma_ms_per_token == pytest.approx(p.gamma_ms_per_token)
    # costing: the deployment's budget 2048 -> buckets up to 2048
    sizes = deployment_graph_sizes(p, None, 2048)
    assert sizes == mixed_sizes(2048) and deployment_graph_sizes(flat, None, 2048) == []
    assert deployment_graph_sizes(p) == mixed_sizes(8192)
    assert deployment_graph_sizes(p, {**cfg, "enforce_eager": True}) == []
    assert deployment_graph_sizes(p, {**cfg, "cuda_graph_max_tokens": 512}) == mixed_sizes(512)
    d = p.decode_ms(40, 40_000)
    # 40 decodes + 300 prompt tokens = 340 -> 384: the chunk is costed at 344 tokens
    assert step_cost_ms(p, 40, 40_000, 300, sizes) == ("mixed", pytest.approx(
        d + p.gamma_ms_per_token * 344))
    assert step_cost_ms(p, 40, 40_000, 300, []) == ("mixed", pytest.approx(
        d + p.gamma_ms_per_token * 300))
    assert step_cost_ms(p, 0, 0, 100, sizes) == ("prefill", pytest.approx(p.prefill_ms(128)))
    assert step_cost_ms(p, 0, 0, 3000, sizes) == ("prefill", pytest.approx(p.prefill_ms(3000)))
    assert step_cost_ms(p, 40, 40_000, 0, sizes) == ("decode", pytest.approx(d))


def test_refit_script_fits_an_older_file_per_shape(tmp_path, capsys):
    """scripts/refit_profile.py: an older file of a graphed engine (no fit_graph_sizes) refitted
    with --graph-shapes gets the buckets and the per-shape gamma (as profile_from_samples would
    make it today); a CPU profile has no shapes to take."""
    import importlib.util

    from pdserve.step_shapes import mixed_sizes
    spec = importlib.util.spec_from_file_location("refit_profile", "scripts/refit_profile.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    cfg = {"device": "cuda", "max_num_batched_tokens": 8192}
    today, older = _small_profile(cfg), _small_profile(cfg, graph_sizes=[])
    src, out = tmp_path / "old.json", tmp_path / "new.json"
    older.save(src)
    assert script.main([str(src), str(out), "--graph-shapes"]) == 0
    assert "gamma_ms_per_token" in capsys.readouterr().out
    new = CostProfile.from_json(out)
    assert new.fit_graph_sizes == mixed_sizes(8192)
    assert new.gamma_ms_per_token == pytest.approx(today.gamma_ms_per_token)
    assert script.main([str(src), str(out)]) == 0          # as fitted: unchanged
    assert CostProfile.from_json(out).gamma_ms_per_token == pytest.approx(older.gamma_ms_per_token)
    cpu = tmp_path / "cpu.json"
    CostProfile.from_json({**older.to_dict(), "engine_config": {}}).save(cpu)
    assert script.main([str(cpu), str(out), "--graph-shapes"]) == 2
    assert "ran no CUDA graphs" in capsys.readouterr().err


# ---- served batches: the server's host work per step ---------------------------------------------
# DECODE by hand: decode_ms(b, S) = 1 + 0.1 min(b, 8) + 0.001 S
#   b = 1,  S = 40:    1 + 0.1 + 0.04 = 1.14
#   b = 16, S = 640:   1 + 0.8 + 0.64 = 2.44
#   b = 64, S = 2560:  1 + 0.8 + 2.56 = 4.36
#   b = 8,  S = 20000: 1 + 0.8 + 20   = 21.8   (context-heavy: the device is the bound)
def _batch(b, ctx, tpot):
    return {"b": b, "ctx_sum": ctx, "tpot_ms": tpot}


def test_served_batches_on_a_host_line_give_that_line_back():
    """TPOTs max(decode, 2 + 0.05 b): 2.05, 2.8, 5.2 ms at b = 1, 16, 64 (each > 1.1 x decode:
    host-bound), 21.8 at b = 8 (decode-bound: ratio 1). The host-bound rows lie on the line, so
    it comes back exactly, and every row is predicted exactly by a fit without it (any two
    host-bound rows give the line; the decode-bound row is the decode's)."""
    rows = [_batch(1, 40, 2.05), _batch(16, 640, 2.8), _batch(64, 2560, 5.2),
            _batch(8, 20000, 21.8)]
    r = fit_serving_batch(rows, DECODE)
    assert r["serving_host_ms"] == {"fixed_ms": pytest.approx(2.0, abs=1e-9),
                                    "per_seq_ms": pytest.approx(0.05, abs=1e-12)}
    f = r["fit"]
    assert f["n_samples"] == 4 and f["source"] == "measured" and "note" not in f
    assert [x["host_bound"] for x in f["rows"]] == [True, True, True, False]
    assert [x["decode_ms"] for x in f["rows"]] == pytest.approx([1.14, 2.44, 4.36, 21.8])
    assert [x["ratio"] for x in f["rows"]] == pytest.approx(
        [2.05 / 1.14, 2.8 / 2.44, 5.2 / 4.36, 1.0], abs=1e-5)
    assert f["heldout_abs_rel_errs"] == pytest.approx([0, 0, 0, 0], abs=1e-9)


def test_served_batch_heldout_errors_are_the_max_model_fitted_without_the_row():
    """The b = 64 row at 5.6 ms (off the line). Held out, each host-bound row is predicted by
    the line through the other two: b = 1 by (16, 2.8)-(64, 5.6): 1.866667 + 0.058333 = 1.925
    (> decode 1.14); b = 16 by (1, 2.05)-(64, 5.6): slope 3.55 / 63, 2.05 + 15 * 3.55 / 63 =
    2.895238; b = 64 by (1, 2.05)-(16, 2.8): 2 + 0.05 * 64 = 5.2. The decode-bound row stays
    the decode's 21.8 (the host line is ~2.5 ms there). The full fit is weighted least squares
    on [1, b] with weights 1 / tpot, checked against numpy's lstsq."""
    rows = [_batch(1, 40, 2.05), _batch(16, 640, 2.8), _batch(64, 2560, 5.6),
            _batch(8, 20000, 21.8)]
    f = fit_serving_batch(rows, DECODE)
    want = [abs(1.925 - 2.05) / 2.05, abs(2.05 + 15 * 3.55 / 63 - 2.8) / 2.8, 0.4 / 5.6, 0.0]
    assert f["fit"]["heldout_abs_rel_errs"] == pytest.approx(want, abs=1e-5)
    assert f["fit"]["heldout_mean_abs_rel_err"] == pytest.approx(sum(want) / 4, abs=1e-5)
    assert f["fit"]["heldout_max_abs_rel_err"] == pytest.approx(max(want), abs=1e-5)
    y = np.array([2.05, 2.8, 5.6])
    A = np.array([[1, 1], [1, 16], [1, 64]], dtype=float) / y[:, None]
    c, *_ = np.linalg.lstsq(A, y / y, rcond=None)
    assert f["serving_host_ms"]["fixed_ms"] == pytest.approx(c[0], rel=1e-9)
    assert f["serving_host_ms"]["per_seq_ms"] == pytest.approx(c[1], rel=1e-9)


def test_a_server_that_keeps_up_with_the_device_has_no_floor():
    """Every TPOT within 10% of decode_ms (1.09x; 1.11x would count): both terms 0, said in
    the fit; held out, each row is predicted by decode_ms alone (error 0.09 / 1.09)."""
    rows = [_batch(1, 40, 1.14 * 1.09), _batch(16, 640, 2.44 * 1.09),
            _batch(64, 2560, 4.36 * 1.09)]
    r = fit_serving_batch(rows, DECODE)
    assert r["serving_host_ms"] == {"fixed_ms": 0.0, "per_seq_ms": 0.0}
    assert "kept up with the device" in r["fit"]["note"]
    assert not any(x["host_bound"] for x in r["fit"]["rows"])
    assert r["fit"]["heldout_abs_rel_errs"] == pytest.approx([0.09 / 1.09] * 3, abs=1e-5)
    r = fit_serving_batch([_batch(16, 640, 2.44 * 1.11)], DECODE)
    assert r["fit"]["rows"][0]["host_bound"] is True


def test_one_host_bound_row_gives_a_floor_proportional_to_b():
    """One host-bound row (b = 16 at 4.0 ms > 1.1 x 2.44): per_seq_ms = 4.0 / 16 = 0.25, no
    fixed part; two at the same b (4.0 and 5.0 ms): the weighted line through the origin,
    sum(b / y) / sum(b^2 / y^2) = (4 + 3.2) / (16 + 10.24)."""
    rows = [_batch(1, 40, 1.14), _batch(16, 640, 4.0), _batch(8, 20000, 21.8)]
    r = fit_serving_batch(rows, DECODE)
    assert r["serving_host_ms"] == {"fixed_ms": 0.0, "per_seq_ms": pytest.approx(0.25)}
    assert "one batch size" in r["fit"]["note"]
    # held out, the b = 16 row has no host-bound row left: predicted by decode (2.44)
    assert r["fit"]["heldout_abs_rel_errs"][1] == pytest.approx(1.56 / 4.0, abs=1e-5)
    r = fit_serving_batch([_batch(16, 640, 4.0), _batch(16, 640, 5.0)], DECODE)
    assert r["serving_host_ms"]["per_seq_ms"] == pytest.approx(7.2 / 26.24)
    assert r["serving_host_ms"]["fixed_ms"] == 0.0


def test_a_floor_stays_below_the_rows_that_kept_up_with_the_device():
    """Host-bound rows on the line 2 + 0.05 b (b = 16: 2.8 ms, 64: 5.2 ms), and b = 1 at
    1.14 ms = its decode_ms (kept up). The line gives 2.05 ms at b = 1, over that TPOT, so the
    fit keeps f + s <= 1.14; on that edge (f = 1.14 - s) the weighted residuals are
    (1.14 - y_i + s (b_i - 1)) / y_i, least at s = sum (b_i - 1)(y_i - 1.14) / y_i^2 / sum
    (b_i - 1)^2 / y_i^2 (an H100 profile's floor, fitted on b = 128 and 256 only, had put
    2.68 ms under every step where batch 1 measured 1.94)."""
    rows = [_batch(1, 40, 1.14), _batch(16, 640, 2.8), _batch(64, 2560, 5.2)]
    r = fit_serving_batch(rows, DECODE)
    assert [x["host_bound"] for x in r["fit"]["rows"]] == [False, True, True]
    num = 15 * 1.66 / 2.8 ** 2 + 63 * 4.06 / 5.2 ** 2
    den = 15 ** 2 / 2.8 ** 2 + 63 ** 2 / 5.2 ** 2
    host = r["serving_host_ms"]
    assert host["per_seq_ms"] == pytest.approx(num / den, rel=1e-9)
    assert host["fixed_ms"] == pytest.approx(1.14 - num / den, rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_constrained_host_line_against_a_grid(seed):
    """Random host-bound points and caps: the fit is feasible and no point of a fine grid
    over the feasible (f, s) beats its weighted squared error (a naive search)."""
    from pdserve.perf.cost_fit import _lsq_line_below
    rng = np.random.default_rng(seed)
    b = rng.choice([1.0, 4, 16, 64, 128, 256], size=4)
    y = rng.uniform(1.0, 6.0, size=4)
    w = 1 / y
    caps = [(float(rng.choice([1, 8, 32, 96])), float(rng.uniform(0.5, 4.0))) for _ in range(2)]
    through = bool(seed % 3 == 0)
    f, s = _lsq_line_below(b, y, w, caps, through)

    def err(f, s):
        return np.sum((w * (f + s * b - y)) ** 2, axis=-1)
    assert f >= 0 and s >= 0 and all(f + s * bj <= tj + 1e-9 for bj, tj in caps)
    if through:
        assert f == 0
    F, S = np.meshgrid(np.linspace(0, 0 if through else 6, 1 if through else 601),
                       np.linspace(0, 0.5, 2001), indexing="ij")
    ok = np.ones_like(F, dtype=bool)
    for bj, tj in caps:
        ok &= F + S * bj <= tj
    grid = err(F[..., None], S[..., None])[ok]
    assert err(f, s) <= grid.min() + 1e-9


def test_served_batch_rows_are_checked():
    with pytest.raises(ValueError, match="serving_batch fit: needs >= 1 rows"):
        fit_serving_batch([], DECODE)
    with pytest.raises(ValueError, match="no finite number 'tpot_ms'"):
        fit_serving_batch([{"b": 4, "ctx_sum": 10}], DECODE)
    with pytest.raises(ValueError, match="b >= 1"):
        fit_serving_batch([_batch(0, 10, 1.0)], DECODE)
    with pytest.raises(ValueError, match="tpot_ms > 0"):
        fit_serving_batch([_batch(4, 10, 0.0)], DECODE)


def test_the_served_step_floor_is_optional_and_older_files_load_without_it():
    """No serving_host_ms (most committed profiles): the floor is 0. With the term
    {fixed 1.5, per_seq 0.02}: 1.5 + 0.02 * 100 = 3.5 ms at 100 sequences; it survives a
    file. Every committed profile loads: without the term its floor is 0, with it the sum."""
    import glob
    import os
    d = _profile_dict()
    p = CostProfile.from_json(d)
    assert p.serving_host_ms == {} and p.served_step_floor_ms(100) == 0.0
    q = CostProfile.from_json({**d, "serving_host_ms": {"fixed_ms": 1.5, "per_seq_ms": 0.02}})
    assert q.served_step_floor_ms(100) == pytest.approx(3.5)
    assert q.served_step_floor_ms(1) == pytest.approx(1.52)
    assert CostProfile.from_json(q.to_dict()) == q
    with pytest.raises(ValueError, match="seqs must be"):
        q.served_step_floor_ms(0)
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "bench", "results")
    for path in sorted(glob.glob(os.path.join(root, "profile-*.json"))):
        with open(path) as f:
            term = json.load(f).get("serving_host_ms") or {}
        want = term.get("fixed_ms", 0.0) + term.get("per_seq_ms", 0.0) * 256 if term else 0.0
        assert CostProfile.from_json(path).served_step_floor_ms(256) == pytest.approx(want), path


def _tpot_rows(p, factor, bs=(1, 16, 64)):
    """Served-batch rows whose TPOT is `factor` x p's own decode_ms at each b (contexts of 32
    tokens a sequence)."""
    return [_batch(b, 32 * b, factor * p.decode_ms(b, 32 * b)) for b in bs]


def test_profile_from_samples_fits_the_floor_against_its_own_decode_fit():
    """TPOTs 1.5x the profile's own decode_ms: every row host-bound, a floor that is the
    term of the file (a refit and a file keep it); without served-batch rows the term is {} and
    its fit says why."""
    pre, dec, mix, est = _small_samples()
    kw = dict(model="m", hardware="cpu: x", engine_config={}, commit="c", transfer_estimate=est)
    base = profile_from_samples({"prefill": pre, "decode": dec, "mixed": mix}, **kw,
                                serving_note="not measured (--no-serving-overhead)")
    assert base.serving_host_ms == {} and base.fit["serving_batch"]["source"] == "not measured"
    assert base.fit["serving_batch"]["note"] == "not measured (--no-serving-overhead)"
    assert refit(CostProfile.from_json(base.to_dict())) == base
    rows = _tpot_rows(base, 1.5)
    p = profile_from_samples({"prefill": pre, "decode": dec, "mixed": mix,
                              "serving_batch": rows}, **kw)
    assert p.samples["serving_batch"] == rows and p.fit["serving_batch"]["n_samples"] == 3
    assert all(x["host_bound"] for x in p.fit["serving_batch"]["rows"])
    assert p.serving_host_ms["per_seq_ms"] > 0
    # the floor is what the measured TPOTs say a served step takes, not the bare decode
    for r in rows:
        served = max(p.decode_ms(r["b"], r["ctx_sum"]), p.served_step_floor_ms(r["b"]))
        assert served == pytest.approx(r["tpot_ms"], rel=0.25)
    assert refit(CostProfile.from_json(p.to_dict())) == p


def test_the_device_time_profile_refits_the_floor_on_device_time_decode():
    """Device time half of every step's wall time: the device profile's decode_ms is half the
    wall profile's. TPOTs 1.05x the wall decode_ms are not host-bound against it (no floor,
    "kept up"), but are 2.1x the device's: all host-bound there, a floor > 0. The rows are
    carried over unchanged."""
    pre, dec, mix, est = _small_samples()
    pre, dec, mix = ([{**r, "gpu_ms": r["wall_ms"] / 2} for r in rows] for rows in (pre, dec, mix))
    kw = dict(model="m", hardware="NVIDIA H200", engine_config={}, commit="c",
              transfer_estimate=est)
    wall = profile_from_samples({"prefill": pre, "decode": dec, "mixed": mix}, **kw)
    rows = _tpot_rows(wall, 1.05)
    wall = profile_from_samples({"prefill": pre, "decode": dec, "mixed": mix,
                                 "serving_batch": rows}, **kw)
    assert wall.serving_host_ms == {"fixed_ms": 0.0, "per_seq_ms": 0.0}
    assert "kept up" in wall.fit["serving_batch"]["note"]
    dev = device_time_profile(wall)
    assert dev.decode_ms(16, 512) == pytest.approx(wall.decode_ms(16, 512) / 2, rel=1e-6)
    assert dev.samples["serving_batch"] == rows
    assert all(x["host_bound"] for x in dev.fit["serving_batch"]["rows"])
    assert dev.serving_host_ms["per_seq_ms"] > 0 or dev.serving_host_ms["fixed_ms"] > 0


# ---- the API process's CPU ----------------------------------------------------------------------
API_TRUE = {"per_request_ms": 1.2, "per_prompt_token_ms": 4e-4, "per_write_ms": 0.12,
            "per_output_token_ms": 0.02, "per_step_ms": 0.3}
API_PER_TOKEN = {"per_request_ms": 1.2, "per_prompt_token_ms": 4e-4,
                 "per_output_token_ms": 0.08}   # (api_cost_ms as files had it before writes)
API_FIT = {**API_PER_TOKEN, "per_write_ms": 0.0, "per_step_ms": 0.0}
API_COLUMN_OF = {"per_request_ms": "requests", "per_prompt_token_ms": "prompt_tokens",
                 "per_write_ms": "writes", "per_output_token_ms": "output_tokens",
                 "per_step_ms": "steps"}
# tokens per write in the served batches of b = 1, 16, 64, 128 streams (a lagging API joins them)
BATCH_TOKENS_PER_WRITE = {1: 1, 16: 2, 64: 4, 128: 8}


def _api_rows(cost=API_TRUE, seed=None, lengths=(256, 1024, 2048, 4096), batches=(1, 16, 64, 128),
              per_write=BATCH_TOKENS_PER_WRITE):
    """The serving path's phases (perf/serving_path.py's GPU preset): 10 requests of n prompt
    tokens and 16 output tokens each per length, a write per token, 170 engine steps (17 a
    request: a plausible count, the fit only needs it known); then b requests of 16 prompt
    tokens and 64 output tokens at once, per_write[b] tokens a write, 65 steps; their CPU from
    `cost` (2% noise with a seed)."""
    rows = [{"phase": "sequential", "n": n, "requests": 10, "prompt_tokens": 10 * n,
             "writes": 160, "output_tokens": 160, "steps": 170} for n in lengths]
    rows += [{"phase": "batch", "b": b, "requests": b, "prompt_tokens": 16 * b,
              "writes": round(64 * b / per_write[b]), "output_tokens": 64 * b, "steps": 65}
             for b in batches]
    keys = [k for k in API_COLUMN_OF if k in cost]
    A = np.array([[r[API_COLUMN_OF[k]] for k in keys] for r in rows], float)
    mu = A @ np.array([cost[k] for k in keys])
    y = mu if seed is None else _noisy(mu, seed)
    for r, ms in zip(rows, y):
        r["api_cpu_s"], r["wall_s"] = float(ms) / 1e3, 1.0
    return rows, A, mu


def test_the_five_api_costs_come_back_from_the_phases_cpu():
    """Noise-free rows: the five costs exactly, every row predicted exactly held out (by hand:
    the first row is 10 x 1.2 + 2560 x 4e-4 + 160 writes x 0.12 + 160 tokens x 0.02 + 170
    steps x 0.3 = 12 + 1.024 + 19.2 + 3.2 + 51 = 86.424 ms; the 64-stream batch 64 x 1.2 +
    1024 x 4e-4 + 1024 x 0.12 + 4096 x 0.02 + 65 x 0.3 = 76.8 + 0.4096 + 122.88 + 81.92 + 19.5
    = 301.5096 ms). The sequential rows alone have writes == tokens; the batches, whose writes
    carry 2, 4 and 8 tokens, tell them apart, and their tokens per step (b) tell a step from a
    token. With 2% noise, each cost within TOL_SE standard errors of the truth."""
    rows, A, mu = _api_rows()
    assert mu[0] == pytest.approx(86.424) and mu[-2] == pytest.approx(301.5096)
    r = fit_serving_api(rows)
    assert r["api_cost_ms"] == {k: pytest.approx(v, rel=1e-9) for k, v in API_TRUE.items()}
    f = r["fit"]
    assert f["n_samples"] == 8 and f["source"] == "measured" and "note" not in f
    assert f["per_step"] == "fitted"
    assert f["columns"] == ["requests", "prompt_tokens", "writes", "output_tokens", "steps"]
    assert f["heldout_abs_rel_errs"] == pytest.approx([0.0] * 8, abs=1e-9)
    assert [x["predicted_ms"] for x in f["rows"]] == pytest.approx(mu.tolist(), abs=1e-4)
    assert [x["writes"] for x in f["rows"]] == [160] * 4 + [64, 512, 1024, 1024]
    se = _std_errors(A, mu)
    for seed in (1, 2, 3):
        rows, _, _ = _api_rows(seed=seed)
        got = fit_serving_api(rows)["api_cost_ms"]
        for k, s_e in zip(API_TRUE, se):
            assert abs(got[k] - API_TRUE[k]) <= TOL_SE * s_e, (seed, k, got[k], s_e)


def test_api_costs_stay_non_negative():
    """A truth with no per-prompt-token cost and rows 10% cheaper where prompts are long (an
    unconstrained fit would give that column a negative coefficient): it comes out 0."""
    rows, _, _ = _api_rows({**API_TRUE, "per_prompt_token_ms": 0.0})
    for r in rows:
        if r["prompt_tokens"] >= 10 * 2048:
            r["api_cpu_s"] *= 0.9
    c = fit_serving_api(rows)["api_cost_ms"]
    assert c["per_prompt_token_ms"] == 0.0 and c["per_request_ms"] > 0
    assert c["per_write_ms"] > 0


# the H200 profile's serving-path phases (2026-12, its serving_api rows): 10 lone requests of
# n = 256, 1024, 2048 prompt tokens, 16 output tokens each, a write per token; then b = 1, 16,
# 64, 128, 256 requests of 16 prompt and 64 output tokens at once, in the writes the client
# counted; with plausible step counts (17 a lone request, 64-66 a batch)
H200_PHASES = [(10, 2560, 160, 160, 170), (10, 10240, 160, 160, 170), (10, 20480, 160, 160, 170),
               (1, 16, 64, 64, 64), (16, 256, 1024, 1024, 65), (64, 1024, 2783, 4096, 66),
               (128, 2048, 2241, 8192, 66), (256, 4096, 3686, 16384, 66)]
# costs chosen by hand near what those rows measured: a step 0.375 ms, a request 2.1 ms, a
# prompt token 0.9 us, a write 8 us, a token 12 us
API_H200 = {"per_request_ms": 2.1, "per_prompt_token_ms": 9e-4, "per_write_ms": 0.008,
            "per_output_token_ms": 0.012, "per_step_ms": 0.375}


def test_a_per_step_cost_comes_back_from_phases_shaped_as_the_h200_profiles():
    """Rows of the H200 profile's shape, their CPU from API_H200 (by hand: the lone 1-stream
    batch 2.1 + 16 x 9e-4 + 64 x 0.008 + 64 x 0.012 + 64 x 0.375 = 2.1 + 0.0144 + 0.512 +
    0.768 + 24 = 27.3944 ms, what it measured was 27.15; the first sequential row 21 + 2.304 +
    1.28 + 1.92 + 63.75 = 90.254 ms, measured 90.49): the fit gives back the five costs, a
    step's in the 0.3-0.45 ms the measured rows suggest; with 2% noise, each within TOL_SE
    standard errors. The same rows without step counts fit four costs with per_step_ms 0 and
    say so."""
    keys = list(API_COLUMN_OF)
    rows = [{"phase": "sequential" if i < 3 else "batch", **dict(zip(API_COLUMN_OF.values(), x))}
            for i, x in enumerate(H200_PHASES)]
    A = np.array(H200_PHASES, float)
    mu = A @ np.array([API_H200[k] for k in keys])
    assert mu[3] == pytest.approx(27.3944) and mu[0] == pytest.approx(90.254)
    for r, ms in zip(rows, mu):
        r["api_cpu_s"] = float(ms) / 1e3
    r = fit_serving_api(rows)
    assert r["api_cost_ms"] == {k: pytest.approx(v, rel=1e-9) for k, v in API_H200.items()}
    assert 0.3 <= r["api_cost_ms"]["per_step_ms"] <= 0.45
    se = _std_errors(A, mu)
    for seed in (1, 2, 3):
        noisy = [{**x, "api_cpu_s": float(ms) / 1e3} for x, ms in zip(rows, _noisy(mu, seed))]
        got = fit_serving_api(noisy)["api_cost_ms"]
        for k, s_e in zip(keys, se):
            assert abs(got[k] - API_H200[k]) <= TOL_SE * s_e, (seed, k, got[k], s_e)
    unread = [{**x, "steps": None} if x["phase"] == "batch" else x for x in rows]
    r = fit_serving_api(unread)
    assert r["api_cost_ms"]["per_step_ms"] == 0.0 and r["api_cost_ms"]["per_request_ms"] > 0
    assert r["fit"]["columns"] == ["requests", "prompt_tokens", "writes", "output_tokens"]
    assert r["fit"]["per_step"] == "0: rows without engine step counts"
    assert r["fit"]["note"].startswith("rows without engine step counts")


def test_writes_that_all_carry_one_token_fit_with_no_per_token_cost_and_say_so():
    """Every write one token (the batches too: the API kept up), so writes == output tokens
    in every row: the two columns are one. The fit is on [requests, prompt tokens, writes]
    with per_output_token_ms 0, a write of one token costing what a write and a token cost
    together (0.12 + 0.02 = 0.14 ms, exactly, on noise-free rows), and its note says so. The
    same with batch writes of 1.2 tokens (< 25% more than the sequential rows' 1: too little
    to split on), and with 3 rows (four costs need 4)."""
    ones = {1: 1, 16: 1, 64: 1, 128: 1}
    rows, _, mu = _api_rows(per_write=ones)
    r = fit_serving_api(rows)
    assert r["api_cost_ms"] == {"per_request_ms": pytest.approx(1.2, rel=1e-9),
                                "per_prompt_token_ms": pytest.approx(4e-4, rel=1e-9),
                                "per_write_ms": pytest.approx(0.14, rel=1e-9),
                                "per_output_token_ms": 0.0,
                                "per_step_ms": pytest.approx(0.3, rel=1e-9)}
    f = r["fit"]
    assert f["columns"] == ["requests", "prompt_tokens", "writes", "steps"]
    assert f["note"].startswith("per_output_token_ms 0: the rows' tokens per write differ by "
                                "less than 25%")
    assert f["heldout_abs_rel_errs"] == pytest.approx([0.0] * 8, abs=1e-9)
    rows, _, _ = _api_rows(batches=(20, 60), per_write={20: 1, 60: 1.2})   # 64 * 60 / 1.2 = 3200
    assert rows[-1]["writes"] == 3200
    r = fit_serving_api(rows)
    assert r["api_cost_ms"]["per_output_token_ms"] == 0.0
    assert "differ by less than 25%" in r["fit"]["note"]
    rows, _, _ = _api_rows(lengths=(256, 4096), batches=(1, 16))
    r = fit_serving_api(rows)
    assert r["api_cost_ms"]["per_output_token_ms"] == 0.0 and r["api_cost_ms"]["per_write_ms"] > 0
    assert r["fit"]["note"].startswith("per_output_token_ms 0: 4 usable row(s), 5 costs need")


def test_rows_that_cannot_separate_the_costs_give_no_term_and_say_why():
    """Two rows: too few. Every phase with the same mix (k requests of 100 prompt and 10 output
    tokens in 10 writes): the columns are proportional, no term. Rows without a reading (None)
    or with none seen (0) are left out and counted; left with too few, no term."""
    rows, _, _ = _api_rows()
    r = fit_serving_api(rows[:2])
    assert r["api_cost_ms"] == {} and r["fit"]["n_samples"] == 2
    assert r["fit"]["heldout_mean_abs_rel_err"] is None
    assert "no term: 2 usable row(s)" in r["fit"]["note"]
    same = [{"requests": k, "prompt_tokens": 100 * k, "writes": 10 * k, "output_tokens": 10 * k,
             "api_cpu_s": 0.002 * k} for k in (1, 2, 4, 8)]
    r = fit_serving_api(same)
    assert r["api_cost_ms"] == {} and "not independent" in r["fit"]["note"]
    unread = [{**x, "api_cpu_s": None} for x in rows]
    r = fit_serving_api(unread)
    assert r["api_cost_ms"] == {} and r["fit"]["n_samples"] == 0
    assert "8 row(s) without a CPU reading" in r["fit"]["note"]
    mixed = rows[:4] + [{**x, "api_cpu_s": None} for x in rows[4:6]] + [
        {**x, "api_cpu_s": 0.0} for x in rows[6:]]
    r = fit_serving_api(mixed)     # (the four sequential rows alone: 10 requests each)
    assert r["api_cost_ms"] == {} and "not independent" in r["fit"]["note"]
    assert "2 row(s) without a CPU reading" in r["fit"]["note"]
    assert "2 row(s) with no CPU seen" in r["fit"]["note"]
    r = fit_serving_api(rows[:7] + [{**rows[7], "api_cpu_s": None}])
    assert r["api_cost_ms"] == {k: pytest.approx(v, rel=1e-9) for k, v in API_TRUE.items()}
    assert r["fit"]["n_samples"] == 7 and r["fit"]["note"] == ("1 row(s) without a CPU reading "
                                                               "(the platform does not report "
                                                               "the API process's CPU)")


def test_rows_measured_before_writes_were_counted_fit_the_per_token_model():
    """Rows without "writes" (a profile measured before): the three costs of then, exactly,
    with per_write_ms 0 and a note; rows with and without writes together are refused."""
    rows, _, _ = _api_rows(API_PER_TOKEN)
    old = [{k: v for k, v in r.items() if k not in ("writes", "steps")} for r in rows]
    r = fit_serving_api(old)
    assert r["api_cost_ms"] == {k: pytest.approx(v, rel=1e-9) for k, v in API_FIT.items()}
    assert r["fit"]["columns"] == ["requests", "prompt_tokens", "output_tokens"]
    assert r["fit"]["note"].startswith("rows without write counts")
    with pytest.raises(ValueError, match="rows with and without 'writes'"):
        fit_serving_api(old[:3] + rows[3:])


def test_api_rows_are_checked():
    rows, _, _ = _api_rows()
    for bad, said in (({"requests": -1}, "integer 'requests' >= 0"),
                      ({"output_tokens": 1.5}, "integer 'output_tokens' >= 0"),
                      ({"writes": None}, "integer 'writes' >= 0"),
                      ({"steps": -1}, "'steps' an integer >= 0 or None"),
                      ({"steps": 2.5}, "'steps' an integer >= 0 or None"),
                      ({"api_cpu_s": float("nan")}, "api_cpu_s a finite number >= 0"),
                      ({"api_cpu_s": -0.1}, "api_cpu_s a finite number >= 0")):
        with pytest.raises(ValueError, match=said):
            fit_serving_api([{**rows[0], **bad}, *rows[1:]])


def test_the_api_cost_is_optional_and_older_files_load_without_it():
    """No api_cost_ms (the committed profiles made before the term): {}, no API model; a
    committed file with the term (four keys, before per_step_ms) loads it with per_step_ms 0;
    with the term it survives a file. profile_from_samples fits it from serving_api rows (a refit and a device-
    time profile keep the rows and the term); without rows it is {} and its fit says why."""
    import glob
    import os
    d = _profile_dict()
    assert CostProfile.from_json(d).api_cost_ms == {}
    q = CostProfile.from_json({**d, "api_cost_ms": dict(API_TRUE)})
    assert q.api_cost_ms == API_TRUE and CostProfile.from_json(q.to_dict()) == q
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "bench", "results")
    with_term = 0
    for path in sorted(glob.glob(os.path.join(root, "profile-*.json"))):
        raw = json.loads(open(path).read()).get("api_cost_ms")
        got = CostProfile.from_json(path).api_cost_ms
        if not raw:
            assert got == {}, path
        else:
            with_term += 1
            assert set(got) == set(API_COST_KEYS), path
            assert all(got[k] == raw.get(k, 0.0) for k in API_COST_KEYS), path
    assert with_term      # (013686e's H200 profile: four keys, per_step_ms 0 when loaded)
    pre, dec, mix, est = _small_samples()
    kw = dict(model="m", hardware="NVIDIA H200", engine_config={}, commit="c",
              transfer_estimate=est)
    base = profile_from_samples({"prefill": pre, "decode": dec, "mixed": mix}, **kw,
                                serving_note="not measured (--no-serving-overhead)")
    assert base.api_cost_ms == {} and base.fit["serving_api"]["source"] == "not measured"
    assert base.fit["serving_api"]["note"] == "not measured (--no-serving-overhead)"
    assert refit(CostProfile.from_json(base.to_dict())) == base
    rows, _, _ = _api_rows()
    p = profile_from_samples({"prefill": pre, "decode": dec, "mixed": mix, "serving_api": rows},
                             **kw)
    assert p.api_cost_ms == {k: pytest.approx(v, rel=1e-9) for k, v in API_TRUE.items()}
    assert p.fit["serving_api"]["n_samples"] == 8
    assert refit(CostProfile.from_json(p.to_dict())) == p
    pre, dec, mix = ([{**r, "gpu_ms": r["wall_ms"] / 2} for r in x] for x in (pre, dec, mix))
    p = profile_from_samples({"prefill": pre, "decode": dec, "mixed": mix, "serving_api": rows},
                             **kw)
    dev = device_time_profile(p)
    assert dev.samples["serving_api"] == rows and dev.api_cost_ms == p.api_cost_ms
    # a term set by hand (no rows to refit it from) survives a refit and the device-time view
    hand = CostProfile.from_json({**base.to_dict(), "api_cost_ms": dict(API_TRUE)})
    assert refit(hand).api_cost_ms == API_TRUE
    assert refit(hand).fit["serving_api"]["source"] == "carried over"
    p = profile_from_samples({"prefill": pre, "decode": dec, "mixed": mix}, **kw)
    hand = CostProfile.from_json({**p.to_dict(), "api_cost_ms": dict(API_TRUE)})
    dev = device_time_profile(hand)
    assert dev.api_cost_ms == API_TRUE and dev.fit["serving_api"]["source"] == "carried over"


def test_a_file_from_before_per_write_loads_with_per_write_0(tmp_path):
    """api_cost_ms as files wrote it before per_write_ms (three keys: every token costed
    alone) loads with per_write_ms 0 and per_step_ms 0, which means the same (a write of k
    tokens: 0 + 0.08 k ms, no step costed); saved again it has the five keys. Two keys, or the
    five less another than per_step_ms, are refused."""
    d = _profile_dict()
    path = tmp_path / "old.json"
    path.write_text(json.dumps({**d, "api_cost_ms": dict(API_PER_TOKEN)}))
    p = CostProfile.from_json(path)
    assert p.api_cost_ms == {"per_request_ms": 1.2, "per_prompt_token_ms": 4e-4,
                             "per_write_ms": 0.0, "per_output_token_ms": 0.08,
                             "per_step_ms": 0.0}
    assert CostProfile.from_json(p.to_dict()) == p
    assert json.loads(open(p.save(tmp_path / "new.json")).read())["api_cost_ms"] == p.api_cost_ms
    no_prompt = {k: v for k, v in API_TRUE.items() if k != "per_prompt_token_ms"}
    with pytest.raises(ValueError, match="api_cost_ms.per_prompt_token_ms is missing"):
        CostProfile.from_json({**d, "api_cost_ms": no_prompt})
    with pytest.raises(ValueError, match="api_cost_ms.per_write_ms is missing"):
        CostProfile(**{**CostProfile.from_json(d).__dict__, "api_cost_ms": dict(API_PER_TOKEN)})


def test_a_file_from_before_per_step_loads_with_per_step_0(tmp_path):
    """api_cost_ms as files wrote it before per_step_ms (four keys) loads with per_step_ms 0,
    which means the same (no engine step cost the API anything); saved again it has the five
    keys."""
    d = _profile_dict()
    four = {k: v for k, v in API_TRUE.items() if k != "per_step_ms"}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({**d, "api_cost_ms": four}))
    p = CostProfile.from_json(path)
    assert p.api_cost_ms == {"per_request_ms": 1.2, "per_prompt_token_ms": 4e-4,
                             "per_write_ms": 0.12, "per_output_token_ms": 0.02,
                             "per_step_ms": 0.0}
    assert json.loads(open(p.save(tmp_path / "new.json")).read())["api_cost_ms"] == p.api_cost_ms
    with pytest.raises(ValueError, match="api_cost_ms.per_step_ms is missing"):
        CostProfile(**{**CostProfile.from_json(d).__dict__, "api_cost_ms": four})
