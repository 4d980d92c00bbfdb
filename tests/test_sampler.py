"""Tests for SamplingParams validation and the Sampler (penalties, filters, seeding, logprobs)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from pdserve.layers.sampler import Sampler, SamplingBatch, apply_penalties
from pdserve.sampling_params import SamplingParams

SP = SamplingParams


# =================================================================================================
# helpers / float64 references
# =================================================================================================
def build(params, prompts=None, outputs=None, gens=None, V=50, **kw):
    B = len(params)
    prompts = prompts if prompts is not None else [[] for _ in range(B)]
    outputs = outputs if outputs is not None else [[] for _ in range(B)]
    gens = gens if gens is not None else [None] * B
    return SamplingBatch.build(params, prompts, outputs, gens, V, "cpu", **kw)


def ref_penalties(logits: torch.Tensor, params, prompts, outputs) -> np.ndarray:
    """Straightforward per-row float64 reference of repetition + frequency + presence penalties."""
    out = logits.double().numpy().copy()
    V = out.shape[1]
    for r, p in enumerate(params):
        seen = {t for t in list(prompts[r]) + list(outputs[r]) if 0 <= t < V}
        for t in seen:
            if out[r, t] > 0:
                out[r, t] /= p.repetition_penalty
            else:
                out[r, t] *= p.repetition_penalty
        counts = {}
        for t in outputs[r]:
            counts[t] = counts.get(t, 0) + 1
        for t, c in counts.items():
            out[r, t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    return out


def ref_distribution(logits_row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """float64 reference of temperature -> min_p -> top_k -> top_p; returns the final distribution
    (zeros outside the kept set)."""
    x = np.asarray(logits_row, dtype=np.float64) / p.temperature
    V = x.shape[0]
    probs = np.exp(x - x.max()); probs /= probs.sum()
    keep = probs >= p.min_p * probs.max()
    if 0 < p.top_k < V:
        kth = np.sort(np.where(keep, x, -np.inf))[::-1][p.top_k - 1]
        keep &= x >= kth
    probs = np.where(keep, probs, 0.0); probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = 0.0
        keep_p = np.zeros(V, dtype=bool)
        for t in order:              # smallest prefix whose cumulative prob >= top_p
            keep_p[t] = True
            cum += probs[t]
            if cum >= p.top_p:
                break
        probs = np.where(keep_p, probs, 0.0); probs /= probs.sum()
    return probs


def check_empirical(samples: np.ndarray, ref: np.ndarray, label: str):
    """Support ⊆ kept set, and a chi-square goodness of fit (bins with small expectation merged)."""
    n, V = len(samples), len(ref)
    kept = ref > 0
    assert kept[samples].all(), f"{label}: sampled tokens outside the kept set: " \
        f"{sorted(set(samples[~kept[samples]].tolist()))}"
    counts = np.bincount(samples, minlength=V).astype(np.float64)
    exp = ref * n
    big = exp >= 10
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if (kept & ~big).any():
        obs_b.append(counts[kept & ~big].sum()); exp_b.append(exp[kept & ~big].sum())
    obs_b, exp_b = np.array(obs_b), np.array(exp_b)
    chi2 = float(((obs_b - exp_b) ** 2 / np.maximum(exp_b, 1e-12)).sum())
    df = max(len(obs_b) - 1, 1)
    bound = df + 6.0 * math.sqrt(2 * df) + 10.0     # very loose: ~6 sigma
    assert chi2 < bound, f"{label}: chi2 {chi2:.1f} >= {bound:.1f} (df {df})"
    # every kept token with a decent expected count must actually show up
    assert (counts[exp >= 20] > 0).all(), f"{label}: a likely kept token was never sampled"


# =================================================================================================
# SamplingParams validation
# =================================================================================================
BAD_PARAMS = [
    ("n", 0), ("n", -3),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", float("nan")),
    ("top_k", 0), ("top_k", -2), ("top_k", -100),
    ("min_p", -0.01), ("min_p", 1.5), ("min_p", float("nan")),
    ("max_tokens", 0), ("max_tokens", -1),
    ("min_tokens", -1),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", float("nan")),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", float("nan")),
    ("frequency_penalty", 2.01), ("frequency_penalty", -3.0),
    ("logprobs", -1), ("logprobs", 21),
    ("stop", ["ok", 3]), ("stop", [None]), ("stop", 5),
    ("stop_token_ids", [1, -2]), ("stop_token_ids", [-1]),
    ("logit_bias", {3: 101}), ("logit_bias", {3: -100.5}), ("logit_bias", {3: float("nan")}),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {"3": 1.0}), ("logit_bias", {2.5: 1.0}),
    ("logit_bias", [(3, 1.0)]), ("logit_bias", {3: "1"}),
]


@pytest.mark.parametrize("field,value", BAD_PARAMS, ids=[f"{f}={v!r}" for f, v in BAD_PARAMS])
def test_bad_params_raise_naming_field(field, value):
    with pytest.raises(ValueError) as ei:
        SP(**{field: value})
    msg = str(ei.value)
    assert field in msg
    assert repr(value) in msg or str(value) in msg


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SP(max_tokens=4, min_tokens=5)
    SP(max_tokens=4, min_tokens=4)


def test_params_defaults_and_normalisation():
    p = SP()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.min_tokens) == \
        (1, 1.0, 1.0, -1, 0.0, 16, 0)
    assert p.stop == () and p.stop_token_ids == () and p.logprobs is None and p.seed is None
    assert p.skip_special_tokens and not p.ignore_eos and not p.greedy
    assert SP(top_k=None).top_k == -1
    assert SP(stop="x").stop == ("x",)
    assert SP(stop=["a", "b"]).stop == ("a", "b")
    assert SP(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SP(temperature=0).greedy and SP(temperature=1e-6).greedy
    assert not SP(temperature=1e-4).greedy
    assert SP(logprobs=0).logprobs == 0 and SP(logprobs=20).logprobs == 20
    assert SP(top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2).top_p == 1.0
    with pytest.raises(Exception):            # frozen
        p.temperature = 0.5  # type: ignore[misc]
    hash(SP(stop=["a"], stop_token_ids=[1]))  # tuples -> hashable


# =================================================================================================
# Greedy + logprobs
# =================================================================================================
def test_greedy_is_argmax_and_logprobs_match_reference():
    torch.manual_seed(0)
    B, V = 6, 300
    logits = torch.randn(B, V) * 3
    params = [SP(temperature=0, logprobs=k) for k in (0, 1, 5, 20, None, 3)]
    out = Sampler()(logits, build(params, V=V))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    ref = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(out.logprobs.double(), ref.gather(1, out.token_ids[:, None])[:, 0],
                               atol=1e-5, rtol=0)
    assert out.logprobs.dtype == torch.float32 and out.token_ids.dtype == torch.int64
    assert out.topk_ids.shape == (B, 20) and out.topk_logprobs.shape == (B, 20)
    ref_vals, ref_ids = ref.topk(20, -1)
    assert torch.equal(out.topk_ids, ref_ids)
    torch.testing.assert_close(out.topk_logprobs.double(), ref_vals, atol=1e-5, rtol=0)
    assert (out.topk_logprobs[:, :-1] >= out.topk_logprobs[:, 1:]).all()  # sorted descending


def test_no_logprobs_requested_gives_none_and_zero_gives_empty():
    logits = torch.randn(2, 40)
    out = Sampler()(logits, build([SP(), SP(temperature=0)], V=40))
    assert out.topk_ids is None and out.topk_logprobs is None
    out = Sampler()(logits, build([SP(logprobs=0), SP()], V=40))
    assert out.topk_ids.shape == (2, 0)


def test_logprobs_are_raw_despite_penalties_and_temperature():
    torch.manual_seed(1)
    V = 80
    logits = torch.randn(3, V)
    params = [SP(temperature=0.3, repetition_penalty=1.8, frequency_penalty=1.0, logprobs=4),
              SP(temperature=0, presence_penalty=2.0, logprobs=2),
              SP(temperature=1.7, top_k=3, top_p=0.5, logprobs=1)]
    prompts, outputs = [[1, 2, 3], [4], [5]], [[6, 6, 7], [logits[1].argmax().item()], []]
    out = Sampler(torch.Generator().manual_seed(0))(logits, build(params, prompts, outputs, V=V))
    ref = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(out.logprobs.double(), ref.gather(1, out.token_ids[:, None])[:, 0],
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(out.topk_logprobs.double(), ref.topk(4, -1).values, atol=1e-5,
                               rtol=0)


def test_input_logits_not_modified():
    torch.manual_seed(2)
    logits = torch.randn(4, 60)
    before = logits.clone()
    params = [SP(top_k=5, top_p=0.7, min_p=0.1, repetition_penalty=1.5, frequency_penalty=0.5),
              SP(temperature=0), SP(top_k=2), SP(min_p=0.3, presence_penalty=1.0)]
    Sampler()(logits, build(params, [[1, 2]] * 4, [[3, 3]] * 4, V=60, eos_token_ids=[0]))
    assert torch.equal(logits, before)


def test_bf16_logits_accepted():
    logits = torch.randn(3, 64).to(torch.bfloat16)
    out = Sampler()(logits, build([SP(temperature=0, logprobs=2), SP(), SP(top_p=0.5)], V=64))
    assert out.logprobs.dtype == torch.float32
    assert out.token_ids[0] == logits.float().argmax(-1)[0]


# =================================================================================================
# Penalties
# =================================================================================================
def test_penalties_match_reference():
    g = torch.Generator().manual_seed(3)
    B, V = 6, 97
    logits = torch.randn(B, V, generator=g) * 4
    params = [SP(repetition_penalty=1.3),
              SP(repetition_penalty=0.7, frequency_penalty=0.4),
              SP(presence_penalty=1.5, frequency_penalty=-0.3),
              SP(),                                                   # no penalty in a penalty batch
              SP(repetition_penalty=2.0, presence_penalty=-2.0, frequency_penalty=2.0),
              SP(frequency_penalty=0.25, temperature=0)]
    prompts = [[1, 2, 3, 3, 50], [10, 11], [], [5, 6], [0, 96, 96], list(range(20))]
    outputs = [[4, 4, 2], [11, 12, 12, 12], [7, 7, 8, 9, 9, 9], [5], [96, 1, 1], [19, 19, 30]]
    batch = build(params, prompts, outputs, V=V)
    got = apply_penalties(logits, batch)
    ref = ref_penalties(logits, params, prompts, outputs)
    np.testing.assert_allclose(got.double().numpy(), ref, atol=1e-5, rtol=1e-6)
    # only the affected entries changed
    assert torch.equal(got[3], logits[3])


def test_penalties_skipped_and_counts_absent_when_unused():
    batch = build([SP(), SP(temperature=0, top_k=3)], [[1, 2], [3]], [[4], [5]], V=20)
    assert not batch.any_penalty and batch.output_counts is None and batch.prompt_mask is None
    logits = torch.randn(2, 20)
    assert apply_penalties(logits, batch) is logits
    batch = build([SP(frequency_penalty=1.0)], [[1, 2]], [[4]], V=20)
    assert batch.output_counts is not None and batch.prompt_mask is None  # no repetition penalty


def test_out_of_range_token_ids_ignored():
    params = [SP(repetition_penalty=1.5, frequency_penalty=1.0)]
    batch = build(params, [[-1, 2, 25, 1000]], [[3, 20, 999]], V=20)
    assert batch.output_counts.sum().item() == 1.0 and batch.output_counts[0, 3] == 1.0
    assert batch.prompt_mask.sum().item() == 1 and batch.prompt_mask[0, 2]


def test_penalty_changes_greedy_choice():
    V = 10
    logits = torch.zeros(1, V)
    logits[0, 4], logits[0, 5] = 2.0, 1.5
    out = Sampler()(logits, build([SP(temperature=0, repetition_penalty=2.0)], [[4]], [[]], V=V))
    assert out.token_ids.item() == 5     # 2.0 / 2 = 1.0 < 1.5
    out = Sampler()(logits, build([SP(temperature=0, frequency_penalty=0.3)], [[]], [[4, 4]], V=V))
    assert out.token_ids.item() == 5     # 2.0 - 0.6 = 1.4 < 1.5
    out = Sampler()(logits, build([SP(temperature=0, presence_penalty=0.3)], [[]], [[4, 4]], V=V))
    assert out.token_ids.item() == 4     # 2.0 - 0.3 = 1.7 > 1.5


def test_logit_bias_is_added_before_greedy_and_sampling_and_logprobs_stay_raw():
    """Greedy rows: argmax of logits + the row's bias (a float64 reference); a random row with
    temperature 1: its distribution is softmax(logits + bias) (empirical check); every row's
    logprobs are the unbiased model's. Rows without a bias are untouched."""
    V = 40
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, V, generator=g) * 2
    top = logits.argmax(dim=-1).tolist()
    biases = [{top[0]: -100.0, 7: 3.5}, None, {5: 2.0, 9: -1.0, 11: 4.0}, {top[3]: -7.25}]
    params = [SP(temperature=0, logprobs=1, logit_bias=b) for b in biases]
    out = Sampler()(logits, build(params, V=V))
    ref = logits.double().clone()
    for r, b in enumerate(biases):
        for t, v in (b or {}).items():
            ref[r, t] += v
    assert out.token_ids.tolist() == ref.argmax(dim=-1).tolist()
    assert out.token_ids[0].item() != top[0] and out.token_ids[1].item() == top[1]
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs.double().numpy() == pytest.approx(
        raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1).numpy(), abs=1e-5)

    row, n = logits[2], 4000
    p = SP(temperature=1.0, logit_bias=biases[2])
    samples = _sample_configs([p], [row], n, seed=9)[0]
    biased = row.double().clone()
    for t, v in biases[2].items():
        biased[t] += v
    check_empirical(samples, torch.softmax(biased, dim=-1).numpy(), "logit_bias, T=1")


def test_logit_bias_of_minus_100_excludes_and_plus_100_forces():
    V = 30
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(4))
    banned = SP(temperature=1.0, seed=1, logit_bias={t: -100 for t in range(V - 1)})
    forced = SP(temperature=1.5, seed=2, logit_bias={17: 100})
    out = Sampler()(logits, build([banned] * 4 + [forced] * 4, V=V,
                                  gens=[torch.Generator().manual_seed(i) for i in range(8)]))
    assert out.token_ids.tolist() == [V - 1] * 4 + [17] * 4


def test_logit_bias_normalised():
    assert SP(logit_bias={}).logit_bias is None
    p = SP(logit_bias={3: 1, 5: -2.5})
    assert p.logit_bias == {3: 1.0, 5: -2.5} and all(type(k) is int for k in p.logit_bias)


def test_min_tokens_bans_stop_and_eos():
    V = 12
    logits = torch.zeros(4, V)
    logits[:, 7] = 10.0       # EOS id 7 would win
    logits[:, 3] = 9.0        # stop token id 3 next
    params = [SP(temperature=0, min_tokens=2, stop_token_ids=[3]),
              SP(temperature=0, min_tokens=2, stop_token_ids=[3], ignore_eos=True),
              SP(temperature=0, min_tokens=1, stop_token_ids=[3]),     # already long enough
              SP(temperature=0, stop_token_ids=[3])]
    outs = [[1], [1], [1], []]
    out = Sampler()(logits, build(params, outputs=outs, V=V, eos_token_ids=[7]))
    assert out.token_ids.tolist()[:2] == [0, 7] and out.token_ids.tolist()[2:] == [7, 7]
    # banned tokens keep their raw logprob in the top-k report (raw logprobs)
    out = Sampler()(logits[:1], build([SP(temperature=0, min_tokens=3, logprobs=1)], V=V,
                                  eos_token_ids=[7]))
    assert out.token_ids.item() == 3 and out.topk_ids[0, 0].item() == 7


# =================================================================================================
# Filters (top-k / top-p / min-p / temperature) vs float64 reference, empirically
# =================================================================================================
FILTER_CONFIGS = [
    SP(top_k=5),
    SP(top_p=0.6),
    SP(min_p=0.1),
    SP(temperature=0.7, top_k=12, top_p=0.8, min_p=0.02),
    SP(temperature=1.6),
    SP(temperature=0.5, top_p=0.95),
    SP(top_k=1),
    SP(top_p=1e-3),
    SP(min_p=1.0),
]


def _sample_configs(configs, logits_rows, n_draws, seed):
    """One big batch: each config replicated n_draws times over its own logits row."""
    params = [c for c in configs for _ in range(n_draws)]
    logits = torch.cat([row.expand(n_draws, -1) for row in logits_rows])
    V = logits.shape[1]
    out = Sampler(torch.Generator().manual_seed(seed))(logits, build(params, V=V))
    return out.token_ids.view(len(configs), n_draws).numpy()


@pytest.mark.parametrize("variant", ["mixed_sort_path", "topk_only_path"])
def test_filters_support_and_frequencies(variant):
    V, n = 64, 3000
    g = torch.Generator().manual_seed(11)
    if variant == "mixed_sort_path":
        configs = FILTER_CONFIGS
    else:   # no top_p anywhere: exercises the partial top-k path, with a disabled row mixed in
        configs = [SP(top_k=5), SP(top_k=20, temperature=0.8), SP(), SP(top_k=2, min_p=0.2)]
    rows = [torch.randn(V, generator=g) * 2 for _ in configs]
    samples = _sample_configs(configs, rows, n, seed=5)
    for i, (cfg, row) in enumerate(zip(configs, rows)):
        ref = ref_distribution(row.double().numpy(), cfg)
        check_empirical(samples[i], ref, f"{variant}[{i}] {cfg}")


def test_filter_kept_sets_exact():
    """Deterministic check of the kept set: with enough draws every kept token of a flat-ish
    distribution shows up and nothing else does."""
    V, n = 40, 4000
    g = torch.Generator().manual_seed(21)
    row = torch.randn(V, generator=g) * 0.7
    configs = [SP(top_k=7), SP(top_p=0.3), SP(min_p=0.6), SP(top_k=10, top_p=0.5)]
    samples = _sample_configs(configs, [row] * len(configs), n, seed=9)
    for i, cfg in enumerate(configs):
        ref = ref_distribution(row.double().numpy(), cfg)
        assert set(np.unique(samples[i]).tolist()) == set(np.flatnonzero(ref > 0).tolist()), cfg


def test_top_k_keeps_ties():
    logits = torch.tensor([[3.0, 1.0, 3.0, 0.0, 2.0]])
    n = 2000
    params = [SP(top_k=1)] * n
    out = Sampler(torch.Generator().manual_seed(0))(logits.expand(n, -1), build(params, V=5))
    assert set(out.token_ids.tolist()) == {0, 2}


def test_extreme_temperatures():
    torch.manual_seed(4)
    V = 100
    logits = torch.randn(8, V)
    params = [SP(temperature=1e-4)] * 4 + [SP(temperature=1e-6)] * 4   # near-greedy / greedy
    out = Sampler()(logits, build(params, V=V))
    assert torch.equal(out.token_ids, logits.argmax(-1))


# =================================================================================================
# Seeds: per-request reproducibility independent of batch composition
# =================================================================================================
def _run_steps(reqs, steps, V, shared_seed):
    """reqs: list of (params, prompt, logits_fn(step) -> [V]). Returns generated tokens per req.
    Each request gets its own generator (from its seed) created once, as an engine would."""
    sampler = Sampler(torch.Generator().manual_seed(shared_seed))
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None
            for p, _, _ in reqs]
    outputs = [[] for _ in reqs]
    for step in range(steps):
        logits = torch.stack([fn(step) for _, _, fn in reqs])
        batch = SamplingBatch.build([p for p, _, _ in reqs], [pr for _, pr, _ in reqs],
                                    outputs, gens, V, "cpu")
        ids = sampler(logits, batch).token_ids.tolist()
        for o, t in zip(outputs, ids):
            o.append(t)
    return outputs


def _logits_fn(key, V):
    def fn(step):
        g = torch.Generator().manual_seed(1000 * key + step)
        return torch.randn(V, generator=g)
    return fn


def test_same_seed_same_tokens_alone_or_in_any_batch():
    V, steps = 200, 6
    target = (SP(seed=1234, temperature=1.3, top_k=50, top_p=0.95, frequency_penalty=0.5,
                 repetition_penalty=1.1), [1, 2, 3], _logits_fn(0, V))
    alone = _run_steps([target], steps, V, shared_seed=0)[0]
    others = [
        (SP(seed=7), [4], _logits_fn(1, V)),
        (SP(), [5, 6], _logits_fn(2, V)),                                   # unseeded
        (SP(temperature=0, presence_penalty=1.0), [7], _logits_fn(3, V)),   # greedy
        (SP(seed=1234, temperature=0.9), [8], _logits_fn(4, V)),             # same seed, other req
        (SP(top_p=0.5), [9], _logits_fn(5, V)),
        (SP(temperature=0, seed=99), [], _logits_fn(6, V)),                  # seeded greedy
        (SP(min_p=0.05, seed=3), [1], _logits_fn(7, V)),
    ]
    for pos, shared_seed in ((0, 1), (3, 2), (7, 3)):
        reqs = others[:pos] + [target] + others[pos:]
        got = _run_steps(reqs, steps, V, shared_seed)[pos]
        assert got == alone, f"target at position {pos}"
    # and the seed matters: a different seed gives a different sequence
    other_seed = (SP(seed=4321, temperature=1.3, top_k=50, top_p=0.95, frequency_penalty=0.5,
                     repetition_penalty=1.1), [1, 2, 3], _logits_fn(0, V))
    assert _run_steps([other_seed], steps, V, 0)[0] != alone


def test_greedy_row_does_not_consume_its_generator():
    V = 50
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    logits = torch.randn(1, V)
    Sampler()(logits, build([SP(temperature=0, seed=5)], gens=[g1], V=V))
    assert torch.equal(g1.get_state(), g2.get_state())


# =================================================================================================
# Mixed batch
# =================================================================================================
def test_mixed_batch_each_row_own_semantics():
    V = 120
    g = torch.Generator().manual_seed(31)
    logits = torch.randn(6, V, generator=g) * 2
    params = [SP(temperature=0),                                             # plain greedy
              SP(temperature=0, repetition_penalty=1.7, frequency_penalty=0.8),  # penalised greedy
              SP(top_k=1, presence_penalty=2.0),                             # random, = argmax
              SP(top_k=4, seed=3),                                           # random, seeded
              SP(top_p=0.4, temperature=0.8, repetition_penalty=1.2),        # random + penalty
              SP(min_p=0.5)]                                                 # random
    prompts = [[1, 2], [int(logits[1].argmax()), 3], [4], [], [int(logits[4].argmax())], [6]]
    outputs = [[7], [8, 8, int(logits[1].argmax())], [int(logits[2].argmax())] * 2, [9], [], []]
    gens = [None, None, None, torch.Generator().manual_seed(3), None, None]
    batch = build(params, prompts, outputs, gens, V=V)
    assert not batch.all_greedy and not batch.all_random and batch.any_penalty
    pen = ref_penalties(logits, params, prompts, outputs)
    for trial in range(20):
        out = Sampler(torch.Generator().manual_seed(trial))(logits, batch)
        ids = out.token_ids.tolist()
        assert ids[0] == int(logits[0].argmax())                 # penalties not applied to row 0
        assert ids[1] == int(np.argmax(pen[1]))
        assert ids[2] == int(np.argmax(pen[2]))
        for r in (3, 4, 5):
            ref = ref_distribution(pen[r], params[r])
            assert ref[ids[r]] > 0, (r, ids[r])
    assert int(np.argmax(pen[1])) != int(logits[1].argmax())   # the penalty did matter


# =================================================================================================
# Property test: never out of range, never NaN
# =================================================================================================
param_strategy = st.builds(
    SP,
    temperature=st.sampled_from([0.0, 1e-6, 1e-3, 0.3, 1.0, 2.0, 10.0]),
    top_k=st.sampled_from([-1, 1, 2, 5, 1000]),
    top_p=st.sampled_from([1e-6, 0.1, 0.5, 0.9, 1.0]),
    min_p=st.sampled_from([0.0, 0.01, 0.5, 1.0]),
    repetition_penalty=st.sampled_from([0.5, 1.0, 1.3, 5.0]),
    presence_penalty=st.sampled_from([-2.0, 0.0, 2.0]),
    frequency_penalty=st.sampled_from([-2.0, 0.0, 0.7, 2.0]),
    seed=st.one_of(st.none(), st.integers(0, 2**32)),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), B=st.integers(1, 5), V=st.integers(1, 120),
       scale=st.sampled_from([1e-3, 1.0, 30.0, 1e3, 1e5]), seed=st.integers(0, 2**31 - 1),
       with_neg_inf=st.booleans())
def test_property_valid_ids_and_finite_logprobs(data, B, V, scale, seed, with_neg_inf):
    params = data.draw(st.lists(param_strategy, min_size=B, max_size=B))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * scale
    if with_neg_inf and V > 1:
        mask = torch.rand(B, V, generator=g) < 0.5
        mask[:, 0] = False                                   # keep a finite logit per row
        logits = logits.masked_fill(mask, float("-inf"))
    prompts = [torch.randint(0, V, (int(torch.randint(0, 6, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(B)]
    outputs = [torch.randint(0, V, (int(torch.randint(0, 6, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(B)]
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    batch = SamplingBatch.build(params, prompts, outputs, gens, V, "cpu")
    out = Sampler(torch.Generator().manual_seed(seed))(logits, batch)
    assert out.token_ids.shape == (B,) and out.token_ids.dtype == torch.int64
    assert ((out.token_ids >= 0) & (out.token_ids < V)).all()
    assert out.logprobs is None or torch.isfinite(out.logprobs).all()
    assert torch.isfinite(logits.gather(1, out.token_ids[:, None])).all()   # never a -inf token
    if batch.max_num_logprobs is not None:
        assert out.topk_ids.shape == (B, min(batch.max_num_logprobs, V))
        assert not torch.isnan(out.topk_logprobs).any()
        assert ((out.topk_ids >= 0) & (out.topk_ids < V)).all()


# =================================================================================================
# Top-p boundary: a token whose cumulative probability is exactly top_p
# =================================================================================================
TIE_PROBS = (0.5, 0.25, 0.125, 0.125)   # exact binary fractions: every partial sum is exact


def _exact_logits(probs, order, V=8):
    """Logits [V] whose float32 softmax is exactly ``probs`` placed at token ids ``order`` (the
    other ids get -inf, probability exactly 0). log of a power of two and exp back round-trip
    exactly in float32; asserted, so a platform where they do not fails here, not silently."""
    row = torch.full((V,), float("-inf"))
    row[list(order)] = torch.tensor(probs, dtype=torch.float32).log()
    want = torch.zeros(V)
    want[list(order)] = torch.tensor(probs, dtype=torch.float32)
    assert torch.equal(row.softmax(-1), want), "precondition: an exact softmax"
    return row


# (top_p, kept ranks) worked out by hand from TIE_PROBS, rule: keep the smallest set of the most
# likely tokens whose cumulative probability reaches top_p, i.e. rank i is kept iff the mass of
# ranks before it is < top_p (the mass up to and including it may equal top_p and it stays).
#   p = 0.5  : rank 0 alone reaches 0.5 -> {0}; rank 1 has 0.5 before it (= p) -> dropped
#   p = 0.625: 0.5 < p, 0.75 >= p      -> {0, 1}
#   p = 0.75 : 0.5 + 0.25 = 0.75 = p   -> {0, 1}; rank 2 has exactly 0.75 before it -> dropped
TOP_P_TIES = [(0.5, {0}), (0.625, {0, 1}), (0.75, {0, 1})]


@pytest.mark.parametrize("top_p,kept_ranks", TOP_P_TIES)
@pytest.mark.parametrize("with_top_k", [False, True], ids=["top_p", "top_k+top_p"])
def test_top_p_boundary_at_exactly_p(top_p, kept_ranks, with_top_k):
    """vLLM's top_p is "the cumulative probability of the top tokens to consider": vLLM
    (apply_top_k_top_p) and HF (TopPLogitsWarper) sort ascending and drop a token when the
    cumulative probability up to and including it is <= 1 - top_p, always keeping the most likely
    one. In descending order that is: keep a token iff the probability strictly before it is
    < top_p -- the smallest prefix whose cumulative probability is >= top_p. A token whose own
    cumulative probability equals p is kept; the next one (whose mass *before* it equals p) is not.

    Both the kept set (the filter on the sort path, exact -inf pattern) and the sampled support
    (through Sampler, many draws) are checked. The sampler has one top-p implementation (the
    torch sort path; no Triton kernel): once alone, once behind a top-k of 4, which keeps all four
    tokens and takes the sort path's top-k branch."""
    from pdserve.layers.sampler import _apply_top_k_top_p
    order = (5, 1, 6, 2)            # token ids by descending probability (not id order)
    row = _exact_logits(TIE_PROBS, order)
    want_ids = {order[r] for r in kept_ranks}
    top_k = torch.tensor([4 if with_top_k else 8])
    kept = _apply_top_k_top_p(row.clone()[None], top_k if with_top_k else None,
                              torch.tensor([top_p]))[0]
    assert set(torch.isfinite(kept).nonzero().flatten().tolist()) == want_ids
    assert torch.equal(kept[list(want_ids)], row[list(want_ids)])   # kept logits untouched

    n = 400
    params = [SP(top_p=top_p, top_k=4 if with_top_k else -1)] * n
    out = Sampler(torch.Generator().manual_seed(0))(row.expand(n, -1), build(params, V=8))
    # renormalised over the kept set the rarest kept token has probability >= 1/3: 400 draws see
    # it (miss chance < 1e-70); a wrongly kept rank 2 (0.125 / 0.875) would show up as surely
    assert set(out.token_ids.tolist()) == want_ids


def test_top_p_boundary_per_row_in_a_mixed_batch():
    """The boundary holds per row when rows with other top_p values (and a top_p = 1 row, which
    the filter leaves alone) share the batch and the sort."""
    from pdserve.layers.sampler import _apply_top_k_top_p
    rows = torch.stack([_exact_logits(TIE_PROBS, (0, 1, 2, 3)),
                        _exact_logits(TIE_PROBS, (3, 2, 1, 0)),
                        _exact_logits(TIE_PROBS, (7, 4, 5, 6)),
                        _exact_logits(TIE_PROBS, (1, 3, 5, 7))])
    top_p = torch.tensor([0.75, 0.5, 1.0, 0.625])
    kept = _apply_top_k_top_p(rows.clone(), None, top_p)
    got = [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in kept]
    assert got == [{0, 1}, {3}, {7, 4, 5, 6}, {1, 3}]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_build_does_not_wait_for_queued_device_work():
    """The runner builds a step's sampling batch right after queueing its forward: building one
    with every upload kind (temperatures, penalties, logit_bias, min_tokens bans) must not wait
    for the device. A long spin is queued first; when build returns, it is still running
    (a pageable upload would have waited for it)."""
    V, B = 1000, 4
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.2,
                             frequency_penalty=0.5, min_tokens=3, stop_token_ids=[7],
                             logit_bias={5: 2.0}) for _ in range(B)]
    args = (params, [[1, 2, 3]] * B, [[4]] * B, [None] * B, V, "cuda")
    SamplingBatch.build(*args, eos_token_ids=[2])     # (the pinned allocator's first blocks)
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(500_000_000)                    # a few hundred ms of device work
    batch = SamplingBatch.build(*args, eos_token_ids=[2])
    still_busy = not stream.query()
    torch.cuda.synchronize()
    assert still_busy, "SamplingBatch.build waited for the device"
    assert batch.banned_mask[0, 7] and batch.banned_mask[0, 2] and batch.bias_index is not None
