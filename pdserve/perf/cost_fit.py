"""Fitting a CostProfile's terms to measured step times (plain Python + numpy).

Rows (one per measured point; a row's time is the median of its reps):
    prefill   {"n", "wall_ms"}                        a lone prefill of n prompt tokens
    decode    {"b", "ctx_sum", "wall_ms"}             b decodes, contexts summing to ctx_sum
    mixed     {"b", "ctx_sum", "n", "wall_ms"}        b decodes + an n-token chunk
    transfer  {"tokens", "bytes", "ms"}               one KV hand-off
    serving   {"n", "ttft_ms", "itl_ms"}              one request through `pdserve serve`,
                                                      alone (perf/serving_path.py)
    serving_batch {"b", "ctx_sum", "tpot_ms"}         b streaming requests sent at once to
                                                      the same server: their median TPOT,
                                                      ctx_sum their mean context sum while
                                                      they decode
    serving_api {"requests", "prompt_tokens",         the `pdserve serve` process's own CPU
                 "writes", "output_tokens", "steps",  over one phase of the serving path
                 "api_cpu_s"}                         (perf/serving_path.py)
Extra keys are ignored (kept in the profile's samples).

Every fit is least squares with non-negative coefficients, each row weighted by 1 / its
measured time, so the fit minimises relative error (what the held-out error reports, and what
matters from 3 ms steps to 60 ms ones alike):

    prefill   wall ~ [1, n, n^2]. The quadratic term is kept only when it lowers the
              leave-one-out mean relative error (computed on the rows it is fitted on) by at
              least QUADRATIC_GAIN (5%) against [1, n], and there are >= 5 distinct n.
    decode    wall ~ [1, min(b, k), max(0, b - k), ctx_sum, split] for each knee k among the
              measured b values; the k with the smallest weighted squared error wins (the
              largest b means no knee). The context column needs rows whose context per
              sequence differs (>= 1.5x between the smallest and the largest). split is 1 for
              a row at >= SPLIT_CONTEXT_TOKENS of context per sequence (the decode kernel
              splits its keys there, cost_profile.py), its coefficient split_ms; it is fitted
              only with rows on both sides (else split_ms 0, said in fit["split"]).
    mixed     gamma = LS over rows of (wall - decode model at (b, ctx_sum)) on n (no
              intercept), clipped at 0.
    transfer  ms ~ [1, tokens * kv_bytes_per_token] (the rows' own kv_bytes_per_token where they
              carry it, else the median bytes moved per token); GB/s = 1 / (ms per byte * 1e6).
              If the per-byte coefficient
              comes out 0 the fit is redone through the origin (no fixed cost; said in "note").
    serving   serving_overhead_ms = median over requests of (ttft_ms - prefill_ms(n)), with
              prefill_ms the prefill fit of the same samples (the profile's own lone-prefill
              time), clipped at 0. Reported beside it, not a term: the batch-1 ITL overhead,
              the median over a request's token gaps j = 1.. of (itl_ms[j-1] - decode_ms(1,
              n + j)) (the decode producing token j + 1 attends over n + j positions).
    serving_batch  a served step of b sequences ~ max(decode_ms(b, ctx_sum), host_ms(b)),
              host_ms(b) = fixed_ms + per_seq_ms * b (the server's host work per step, which
              the profile's decode terms, timed on a bare engine, do not hold). A row is
              host-bound when its TPOT exceeds decode_ms(b, ctx_sum) (the decode fit of the
              same samples) by more than HOST_BOUND_MARGIN (10%); host_ms ~ [1, b] on the
              host-bound rows when they hold >= 2 distinct b; with one b, through the origin
              (one row: per_seq_ms = tpot / b); with none, both 0 (the server kept up with the
              device). Rows within the margin say nothing about host_ms but that it is below
              them: they are left out of its fit and bound it (host_ms(b_j) <= tpot_j, a
              constrained least squares), so a line through large host-bound batches cannot
              put a floor over a small batch's measured TPOT.
    serving_api  api_cpu_s * 1e3 ~ [requests, prompt_tokens, writes, output_tokens, steps] (no
              intercept: an idle API costs nothing), the coefficients per_request_ms,
              per_prompt_token_ms, per_write_ms, per_output_token_ms and per_step_ms (writes:
              the client's count of the SSE writes, a lower bound; steps: the engine steps the
              server counted during the phase; perf/serving_path.py). A lone stream pays a
              step's cost for each of its tokens, a batch of b streams shares it b ways: the
              sequential rows (a step per token) and the batches (b tokens a step) tell it
              from a token's. Where a row has no step count (None: the server's /metrics was
              not read; absent: measured before steps were counted) the fit is on the other
              four with per_step_ms 0, and the note says so. Rows without a CPU
              reading (None: the platform does not say) or with none seen (0) are left out and
              counted in the note. A write's cost is told apart from its tokens' only where
              the rows' tokens per write differ (a lone request's writes carry one token, a
              batch's several when the API lags): by at least MIN_WRITE_SPREAD (25%) between
              the rows, with as many rows as columns, all independent. Otherwise (e.g.
              every write of every row one token: writes == output tokens) the fit is without
              output_tokens, per_output_token_ms 0, and the note says
              so: a token costs its write's, exact at one token a write (what was measured),
              too little where a lagging API joins tokens. Fewer than 3 rows left, or rows
              whose columns are still not independent (e.g. every row with the same tokens
              per request), cannot separate the costs: then the term is empty ({}) and the
              note says why. Rows measured before writes were counted (no "writes") are fitted
              on [requests, prompt_tokens, output_tokens] with per_write_ms 0 (and
              per_step_ms 0), as then.

Step shapes (step_shapes.py): on a GPU with CUDA graphs a step with prefill tokens runs at its
graph bucket, padding included, so its cost follows the bucket's token count, not the step's.
When the rows ran in graphs (a new profile of a graphed engine: its engine_config's buckets,
kept in the profile's fit_graph_sizes so that a refit uses the same ones), every row is fitted at
its shape: a lone prefill's n (and a served request's, in the serving term's prefill
time) at padded_tokens(n), a mixed row's n at padded_tokens(b + n) - b (the decodes fill b of
the bucket's tokens). The terms are then per token of a step's shape, and a caller pads the
steps it costs the same way (cost_profile.step_cost_ms). Without graphs (a CPU profile), and in
files made before fit_graph_sizes, nothing is padded.

Held-out error: leave-one-out over the rows. Each row is predicted by the whole procedure
(model choice and knee search included) run on the other rows, so it is never tuned on the
point it is judged on. mixed's held-out rows use the decode model of all decode rows (they are
separate measurements); so do serving's, with the prefill fit of all prefill rows and the
median of the other requests' overheads (the term's TTFT model: prefill_ms(n) + overhead);
serving_batch's, with the decode fit of all decode rows, the max model with host_ms fitted on
the other rows; serving_api's, the costs of the columns chosen on all rows fitted on the other
rows.
Reported per term as mean and max |predicted - measured| / measured.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Sequence

import numpy as np

from ..step_shapes import graph_max_tokens, mixed_sizes, padded_tokens
from .cost_profile import API_COST_KEYS, SPLIT_CONTEXT_TOKENS, decode_cost_ms, splits_keys

QUADRATIC_GAIN = 0.05
HOST_BOUND_MARGIN = 0.10
MIN_ROWS = {"prefill": 3, "decode": 4, "mixed": 1, "transfer": 2, "serving": 2,
            "serving_batch": 1, "serving_api": 3}
# serving_api's columns, in the order of their costs (cost_profile.API_COST_KEYS); rows without
# step counts are fitted without "steps" (per_step_ms 0), rows measured before writes were
# counted on the three of then (per_write_ms 0 too)
API_COLUMNS = ("requests", "prompt_tokens", "writes", "output_tokens", "steps")
API_COLUMNS_BEFORE_WRITES = ("requests", "prompt_tokens", "output_tokens")
# a write's cost is told apart from its tokens' only by rows whose tokens per write differ
# (lone requests: 1; a lagging API's batch: several); the split rests on the tokens beyond one
# a write, and below this spread (max / min - 1) of tokens per write it would be mostly the
# rows' noise
MIN_WRITE_SPREAD = 0.25


# ---- least squares with non-negative coefficients ----------------------------------------------
def nnls(A: np.ndarray, y: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """argmin ||diag(w) (A x - y)|| subject to x >= 0, exactly, for a handful of columns: the
    best unconstrained least-squares solution over every subset of columns whose coefficients
    are all >= 0 (the optimum is one of them). Columns are scaled to unit norm first."""
    A = np.asarray(A, dtype=float)
    y = np.asarray(y, dtype=float)
    if A.ndim != 2 or A.shape[0] != y.shape[0]:
        raise ValueError(f"nnls: A is {A.shape}, y is {y.shape}")
    if A.shape[1] > 8:
        raise ValueError("nnls: the subset search is for at most 8 columns")
    if w is not None:
        w = np.asarray(w, dtype=float)
        A, y = A * w[:, None], y * w
    norms = np.linalg.norm(A, axis=0)
    live = [j for j in range(A.shape[1]) if norms[j] > 0]
    best, best_err = np.zeros(A.shape[1]), float(np.dot(y, y))
    for r in range(1, len(live) + 1):
        for cols in itertools.combinations(live, r):
            sub = A[:, cols] / norms[list(cols)]
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            res = sub @ coef - y
            err = float(np.dot(res, res))
            if err < best_err - 1e-12 * max(1.0, best_err):
                best_err = err
                best = np.zeros(A.shape[1])
                best[list(cols)] = coef / norms[list(cols)]
    return best


def _rel_weights(y: np.ndarray) -> np.ndarray:
    if np.any(~np.isfinite(y)) or np.any(y <= 0):
        raise ValueError(f"measured times must be finite and > 0, got {y.tolist()}")
    return 1.0 / y


def _rel_errors(pred: Sequence[float], meas: Sequence[float]) -> list[float]:
    return [abs(p - m) / m for p, m in zip(pred, meas)]


def _heldout(rows: list[dict], fit: Callable[[list[dict]], Callable[[dict], float]],
             measured: Callable[[dict], float]) -> dict[str, Any]:
    """Leave-one-out: each row predicted by fit() on the others."""
    errs = []
    for i in range(len(rows)):
        predict = fit(rows[:i] + rows[i + 1:])
        errs.append(_rel_errors([predict(rows[i])], [measured(rows[i])])[0])
    return {"heldout_mean_abs_rel_err": float(np.mean(errs)) if errs else None,
            "heldout_max_abs_rel_err": float(np.max(errs)) if errs else None,
            "heldout_abs_rel_errs": [round(e, 5) for e in errs]}


def _check_rows(term: str, rows: list[dict], keys: tuple[str, ...]) -> None:
    if len(rows) < MIN_ROWS[term]:
        raise ValueError(f"{term} fit: needs >= {MIN_ROWS[term]} rows, got {len(rows)}")
    for r in rows:
        for k in keys:
            v = r.get(k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"{term} fit: row {r} has no finite number {k!r}")


# ---- prefill ------------------------------------------------------------------------------------
def _prefill_design(rows: list[dict], quadratic: bool) -> np.ndarray:
    n = np.array([r["n"] for r in rows], dtype=float)
    cols = [np.ones_like(n), n] + ([n * n] if quadratic else [])
    return np.stack(cols, axis=1)


def _prefill_coef(rows: list[dict], quadratic: bool) -> np.ndarray:
    y = np.array([r["wall_ms"] for r in rows], dtype=float)
    c = nnls(_prefill_design(rows, quadratic), y, _rel_weights(y))
    return c if quadratic else np.append(c, 0.0)


def _loo_mean(rows: list[dict], quadratic: bool) -> float:
    errs = []
    for i in range(len(rows)):
        c = _prefill_coef(rows[:i] + rows[i + 1:], quadratic)
        n = rows[i]["n"]
        errs.append(abs(c[0] + c[1] * n + c[2] * n * n - rows[i]["wall_ms"]) / rows[i]["wall_ms"])
    return float(np.mean(errs))


def _prefill_procedure(rows: list[dict]) -> tuple[np.ndarray, dict[str, Any]]:
    """(fixed, alpha, quadratic) and how the quadratic term was decided."""
    distinct = len({r["n"] for r in rows})
    info: dict[str, Any] = {"quadratic_rule": f"kept iff >= 5 distinct n and its leave-one-out "
                                              f"mean rel. error is >= {QUADRATIC_GAIN:.0%} "
                                              "below the linear fit's"}
    use_quad = False
    if distinct >= 5:
        lin, quad = _loo_mean(rows, False), _loo_mean(rows, True)
        info.update(selection_loo_linear=lin, selection_loo_quadratic=quad)
        use_quad = quad < lin * (1 - QUADRATIC_GAIN)
    info["quadratic_kept"] = use_quad
    return _prefill_coef(rows, use_quad), info


def fit_prefill(rows: list[dict]) -> dict[str, Any]:
    _check_rows("prefill", rows, ("n", "wall_ms"))
    c, info = _prefill_procedure(rows)

    def fit(train):
        cc, _ = _prefill_procedure(train)
        return lambda r: cc[0] + cc[1] * r["n"] + cc[2] * r["n"] ** 2
    return {"prefill_fixed_ms": float(c[0]), "alpha_ms_per_token": float(c[1]),
            "prefill_quadratic_ms": float(c[2]),
            "fit": {"n_samples": len(rows), **_heldout(rows, fit, lambda r: r["wall_ms"]), **info}}


# ---- decode -------------------------------------------------------------------------------------
def _split(rows: list[dict]) -> np.ndarray:
    """1.0 where a row's decode step splits its keys (cost_profile.splits_keys: a row's
    sequences are of one length, so its mean context is its longest)."""
    return np.array([1.0 if splits_keys(r["b"], r["ctx_sum"]) else 0.0 for r in rows])


def split_identifiable(rows: list[dict]) -> bool:
    """The split term can be fitted: rows on both sides of the split context."""
    s = _split(rows)
    return bool(s.any()) and not bool(s.all())


def _decode_design(rows: list[dict], k: float, split: bool) -> np.ndarray:
    b = np.array([r["b"] for r in rows], dtype=float)
    ctx = np.array([r["ctx_sum"] for r in rows], dtype=float)
    cols = [np.ones_like(b), np.minimum(b, k), np.maximum(0.0, b - k), ctx]
    return np.stack(cols + ([_split(rows)] if split else []), axis=1)


def decode_predict(p: dict[str, Any], b: float, ctx_sum: float) -> float:
    return decode_cost_ms(p["beta_ms"], p["batch_threshold"], b, ctx_sum)


def _decode_procedure(rows: list[dict]) -> dict[str, Any]:
    """The knee k and beta_ms; split_ms is fitted where split_identifiable (else 0: every row on
    one side of the split context, where a constant would only move into fixed_ms)."""
    y = np.array([r["wall_ms"] for r in rows], dtype=float)
    w = _rel_weights(y)
    split = split_identifiable(rows)
    best = None
    for k in sorted({int(r["b"]) for r in rows}):
        A = _decode_design(rows, k, split)
        c = nnls(A, y, w)
        res = (A @ c - y) * w
        err = float(np.dot(res, res))
        if best is None or err < best[0] - 1e-12 * max(1.0, best[0]):
            best = (err, k, c)
    _, k, c = best
    return {"batch_threshold": int(k),
            "beta_ms": {"fixed_ms": float(c[0]), "per_seq_ms_below": float(c[1]),
                        "per_seq_ms_above": float(c[2]), "per_context_token_ms": float(c[3]),
                        "split_ms": float(c[4]) if split else 0.0}}


def fit_decode(rows: list[dict]) -> dict[str, Any]:
    _check_rows("decode", rows, ("b", "ctx_sum", "wall_ms"))
    if any(r["b"] < 1 for r in rows):
        raise ValueError("decode fit: every row needs b >= 1")
    # the context column is separable from the batch columns only if the context per sequence
    # varies between rows: ask for rows whose mean contexts differ by >= 1.5x
    per_seq = [r["ctx_sum"] / r["b"] for r in rows]
    if min(per_seq) <= 0 or max(per_seq) / min(per_seq) < 1.5:
        raise ValueError(f"decode fit: needs rows at >= 2 contexts at least 1.5x apart (context "
                         f"per sequence {min(per_seq):.0f}..{max(per_seq):.0f}): the context "
                         "term is not identifiable otherwise")
    p = _decode_procedure(rows)

    def fit(train):
        pp = _decode_procedure(train)
        return lambda r: decode_predict(pp, r["b"], r["ctx_sum"])
    held = _heldout(rows, fit, lambda r: r["wall_ms"])
    knees = [_decode_procedure(rows[:i] + rows[i + 1:])["batch_threshold"]
             for i in range(len(rows))]
    info = {"n_samples": len(rows), **held, "heldout_knees": knees,
            "knee_candidates": sorted({int(r["b"]) for r in rows}),
            "split": "fitted" if split_identifiable(rows) else
            f"not fitted (0): no rows on both sides of {SPLIT_CONTEXT_TOKENS} tokens of context "
            "per sequence"}
    return {**p, "fit": info}


# ---- mixed --------------------------------------------------------------------------------------
def _gamma(rows: list[dict], decode: dict[str, Any]) -> float:
    n = np.array([r["n"] for r in rows], dtype=float)
    y = np.array([r["wall_ms"] for r in rows], dtype=float)
    extra = y - np.array([decode_predict(decode, r["b"], r["ctx_sum"]) for r in rows])
    w = _rel_weights(y)
    den = float(np.sum((w * n) ** 2))
    if den == 0:
        raise ValueError("mixed fit: every row has a 0-token chunk")
    return max(0.0, float(np.sum(w * w * n * extra)) / den)


def fit_mixed(rows: list[dict], decode: dict[str, Any]) -> dict[str, Any]:
    """decode: fit_decode's result (the decode model the chunk's cost is measured against)."""
    _check_rows("mixed", rows, ("b", "ctx_sum", "n", "wall_ms"))
    if any(r["b"] < 1 or r["n"] < 1 for r in rows):
        raise ValueError("mixed fit: every row needs b >= 1 decodes and an n >= 1 token chunk")
    g = _gamma(rows, decode)
    info: dict[str, Any] = {"n_samples": len(rows)}
    if len(rows) >= 2:
        def fit(train):
            gg = _gamma(train, decode)
            return lambda r: decode_predict(decode, r["b"], r["ctx_sum"]) + gg * r["n"]
        info.update(_heldout(rows, fit, lambda r: r["wall_ms"]))
    else:
        info.update(heldout_mean_abs_rel_err=None, heldout_max_abs_rel_err=None,
                    note="one mixed row: nothing to hold out")
    # beside the model-based gamma: each row's own paired decode-only time, where measured
    paired = [(r["wall_ms"] - r["decode_wall_ms"]) / r["n"] for r in rows
              if isinstance(r.get("decode_wall_ms"), (int, float))]
    if paired:
        info["gamma_paired_ms_per_token"] = [round(x, 6) for x in paired]
    return {"gamma_ms_per_token": g, "fit": info}


# ---- transfer -----------------------------------------------------------------------------------
def _transfer_coef(rows: list[dict]) -> tuple[float, float, str | None]:
    """(fixed ms, ms per byte, note)."""
    x = np.array([r["bytes"] for r in rows], dtype=float)
    y = np.array([r["ms"] for r in rows], dtype=float)
    w = _rel_weights(y)
    c = nnls(np.stack([np.ones_like(x), x], axis=1), y, w)
    if c[1] > 0:
        return float(c[0]), float(c[1]), None
    slope = float(np.sum(w * w * x * y) / np.sum((w * x) ** 2))
    return 0.0, slope, ("the [1, bytes] fit found no per-byte cost; refitted through the "
                        "origin (no fixed cost)")


def fit_transfer(rows: list[dict]) -> dict[str, Any]:
    _check_rows("transfer", rows, ("tokens", "bytes", "ms"))
    if any(r["bytes"] <= 0 or r["tokens"] <= 0 for r in rows):
        raise ValueError("transfer fit: every row needs tokens > 0 and bytes > 0")
    if len({r["bytes"] for r in rows}) < 2:
        raise ValueError("transfer fit: needs transfers of >= 2 sizes")
    per_token = [r["bytes"] / r["tokens"] for r in rows]
    given = {r.get("kv_bytes_per_token") for r in rows}
    if len(given) == 1 and isinstance(next(iter(given)), int) and next(iter(given)) > 0:
        kvb = next(iter(given))           # the engine's own figure, recorded on every row
    else:
        kvb = int(round(float(np.median(per_token))))
    # regress on tokens * kv_bytes_per_token: what transfer_ms(tokens) evaluates
    rows = [{**r, "bytes": r["tokens"] * kvb, "bytes_moved": r["bytes"]} for r in rows]
    fixed, per_byte, note = _transfer_coef(rows)

    def fit(train):
        f, s, _ = _transfer_coef(train)
        return lambda r: f + s * r["bytes"]
    info: dict[str, Any] = {"n_samples": len(rows), **_heldout(rows, fit, lambda r: r["ms"]),
                            "source": "measured"}
    if note:
        info["note"] = note
    info["bytes_moved_per_token"] = [round(min(per_token), 2), round(max(per_token), 2)]
    return {"transfer_fixed_ms": fixed, "transfer_gb_per_s": 1.0 / (per_byte * 1e6),
            "kv_bytes_per_token": kvb, "fit": info}


# ---- serving path -------------------------------------------------------------------------------
def prefill_predict(p: dict[str, Any], n: float) -> float:
    return p["prefill_fixed_ms"] + p["alpha_ms_per_token"] * n + p["prefill_quadratic_ms"] * n * n


def _median(xs: Sequence[float]) -> float:
    return float(np.median(np.asarray(xs, dtype=float)))


def fit_serving(rows: list[dict], prefill: dict[str, Any], decode: dict[str, Any],
                graph_sizes: Sequence[int] = ()) -> dict[str, Any]:
    """prefill / decode: fit_prefill's and fit_decode's results (the profile's own step
    times, subtracted from what the client measured); a request's prefill at its step shape
    (graph_sizes: the profile's graph buckets, empty without graphs)."""
    _check_rows("serving", rows, ("n", "ttft_ms"))
    if any(r["n"] < 1 or r["ttft_ms"] <= 0 for r in rows):
        raise ValueError("serving fit: every row needs n >= 1 and ttft_ms > 0")

    def lone(n: float) -> float:
        return prefill_predict(prefill, padded_tokens(_tokens("serving", n), graph_sizes)
                               if graph_sizes else n)
    over = [r["ttft_ms"] - lone(r["n"]) for r in rows]
    value = max(0.0, _median(over))

    def fit(train):
        o = max(0.0, _median([t["ttft_ms"] - lone(t["n"]) for t in train]))
        return lambda r: lone(r["n"]) + o
    info: dict[str, Any] = {"n_samples": len(rows), **_heldout(rows, fit, lambda r: r["ttft_ms"]),
                            "source": "measured",
                            "overhead_ms_samples": [round(x, 4) for x in over]}
    if _median(over) < 0:
        info["note"] = (f"the median overhead came out {_median(over):.4g} ms (requests faster "
                        "than the profile's lone prefill); clipped at 0")
    by_n: dict[int, list[float]] = {}
    for r, x in zip(rows, over):
        by_n.setdefault(int(r["n"]), []).append(x)
    info["overhead_ms_by_prompt_len"] = {str(n): round(_median(v), 4)
                                         for n, v in sorted(by_n.items())}
    gaps, itls = [], []
    for r in rows:
        for j, itl in enumerate(r.get("itl_ms") or (), start=1):
            itls.append(itl)
            gaps.append(itl - decode_predict(decode, 1, r["n"] + j))
    if gaps:
        info["batch1_itl_overhead_ms"] = _median(gaps)
        info["batch1_itl_median_ms"] = _median(itls)
        info["batch1_itl_samples"] = len(gaps)
        info["batch1_itl_note"] = ("reported, not a term: median ITL less the profile's "
                                   "decode_ms(1, context) per token gap")
    return {"serving_overhead_ms": value, "fit": info}


# ---- served batches: the server's host work per step ---------------------------------------------
def _host_bound(rows: list[dict], decode: dict[str, Any]) -> list[bool]:
    return [r["tpot_ms"] > decode_predict(decode, r["b"], r["ctx_sum"]) * (1 + HOST_BOUND_MARGIN)
            for r in rows]


def _lsq_line_below(b: np.ndarray, y: np.ndarray, w: np.ndarray,
                    caps: Sequence[tuple[float, float]],
                    through_origin: bool) -> tuple[float, float]:
    """(f, s) minimizing sum (w * (f + s * b - y))^2 subject to f >= 0, s >= 0 (f = 0 when
    through_origin) and f + s * b_j <= t_j for each (b_j, t_j) in caps. The problem is convex,
    so its optimum is the unconstrained one when that is feasible, else the best point of some
    constraint's line: each line's 1-D optimum, clipped to the part of the line that every
    other constraint allows (its ends are the feasible region's vertices)."""
    cons = [(-1.0, 0.0, 0.0), (0.0, -1.0, 0.0)] + [(1.0, float(bj), float(tj)) for bj, tj in caps]
    if through_origin:
        cons.append((1.0, 0.0, 0.0))
    A = np.stack([np.ones_like(b), b], axis=1) * w[:, None]
    yw = y * w

    def err(x):
        r = A @ x - yw
        return float(r @ r)

    def feasible(x):
        return all(g0 * x[0] + g1 * x[1] <= h + 1e-9 * max(1.0, abs(h)) for g0, g1, h in cons)
    cands = []
    if len(set(b.tolist())) >= 2 and not through_origin:
        x, *_ = np.linalg.lstsq(A, yw, rcond=None)
        cands.append(x)
    for k, (g0, g1, h) in enumerate(cons):
        p0 = np.array([h / g0, 0.0]) if g0 else np.array([0.0, h / g1])
        d = np.array([-g1, g0])        # the line g . x = h is p0 + t d
        ad = A @ d
        t = 0.0 if not ad @ ad > 0 else float(ad @ (yw - A @ p0) / (ad @ ad))
        lo, hi = -np.inf, np.inf
        for j, (c0, c1, hj) in enumerate(cons):
            if j == k:
                continue
            gd, gp = c0 * d[0] + c1 * d[1], c0 * p0[0] + c1 * p0[1]
            if abs(gd) < 1e-15:
                if gp > hj + 1e-9 * max(1.0, abs(hj)):
                    lo, hi = np.inf, -np.inf     # the whole line is outside
                continue
            if gd > 0:
                hi = min(hi, (hj - gp) / gd)
            else:
                lo = max(lo, (hj - gp) / gd)
        if lo <= hi:
            cands.append(p0 + min(max(t, lo), hi) * d)
    best = min((x for x in cands if feasible(x)), key=err)   # (0, 0) is always feasible
    return max(0.0, float(best[0])), max(0.0, float(best[1]))


def _host_coef(rows: list[dict], decode: dict[str, Any]) -> tuple[float, float]:
    """(fixed_ms, per_seq_ms) of host_ms(b), fitted on the host-bound ones of rows, and kept
    at or below each other row's TPOT (a step that kept up with the device says the host's
    work per step is below it: a line through high-b host-bound rows alone could put the
    floor above the measured TPOT of a small batch)."""
    bound = _host_bound(rows, decode)
    hb = [r for r, h in zip(rows, bound) if h]
    if not hb:
        return 0.0, 0.0
    b = np.array([r["b"] for r in hb], dtype=float)
    y = np.array([r["tpot_ms"] for r in hb], dtype=float)
    caps = [(float(r["b"]), float(r["tpot_ms"])) for r, h in zip(rows, bound) if not h]
    # one batch size cannot split a fixed part from a per-sequence one: all per sequence
    return _lsq_line_below(b, y, _rel_weights(y), caps, len(set(b.tolist())) < 2)


def fit_serving_batch(rows: list[dict], decode: dict[str, Any]) -> dict[str, Any]:
    """decode: fit_decode's result (what the bare engine's decode step costs); the module
    docstring says how host_ms is fitted."""
    _check_rows("serving_batch", rows, ("b", "ctx_sum", "tpot_ms"))
    if any(r["b"] < 1 or r["tpot_ms"] <= 0 or r["ctx_sum"] < 0 for r in rows):
        raise ValueError("serving_batch fit: every row needs b >= 1, ctx_sum >= 0 and "
                         "tpot_ms > 0")
    fixed, per_seq = _host_coef(rows, decode)
    bound = _host_bound(rows, decode)

    def fit(train):
        f, s = _host_coef(train, decode)
        return lambda r: max(decode_predict(decode, r["b"], r["ctx_sum"]), f + s * r["b"])
    per_row = []
    for r, h in zip(rows, bound):
        d = decode_predict(decode, r["b"], r["ctx_sum"])
        per_row.append({"b": r["b"], "tpot_ms": r["tpot_ms"], "decode_ms": round(d, 6),
                        "ratio": round(r["tpot_ms"] / d, 5) if d > 0 else None,
                        "host_bound": h})
    info: dict[str, Any] = {"n_samples": len(rows),
                            **_heldout(rows, fit, lambda r: r["tpot_ms"]),
                            "source": "measured", "host_bound_margin": HOST_BOUND_MARGIN,
                            "model": "max(decode_ms(b, ctx_sum), fixed_ms + per_seq_ms * b)",
                            "rows": per_row}
    n_bound = sum(bound)
    if n_bound == 0:
        info["note"] = (f"no row's TPOT is more than {HOST_BOUND_MARGIN:.0%} over the profile's "
                        "decode_ms: the server kept up with the device (no floor)")
    elif len({r["b"] for r, h in zip(rows, bound) if h}) == 1:
        info["note"] = ("host-bound rows at one batch size only: host_ms taken proportional to "
                        "b (no fixed part)")
    return {"serving_host_ms": {"fixed_ms": fixed, "per_seq_ms": per_seq}, "fit": info}


# ---- the API process's CPU -----------------------------------------------------------------------
def _api_design(rows: list[dict], cols: Sequence[str]) -> np.ndarray:
    return np.array([[float(r[k]) for k in cols] for r in rows], dtype=float)


def _api_coef(rows: list[dict], cols: Sequence[str]) -> np.ndarray:
    y = np.array([r["api_cpu_s"] * 1e3 for r in rows], dtype=float)
    return nnls(_api_design(rows, cols), y, _rel_weights(y))


def _independent(A: np.ndarray) -> bool:
    """Whether A's columns are linearly independent (judged at unit column norms: tokens and
    requests differ by orders of magnitude)."""
    norms = np.linalg.norm(A, axis=0)
    if np.any(norms == 0):
        return False
    return int(np.linalg.matrix_rank(A / norms)) == A.shape[1]


def _api_model(used: list[dict], has_writes: bool, has_steps: bool
               ) -> tuple[tuple[str, ...] | None, list[str]]:
    """The columns the rows can be fitted on (None: none) and what the fit must say about the
    costs left out."""
    if not has_writes:
        cols = API_COLUMNS_BEFORE_WRITES
        said = ["rows without write counts (measured before pdserve profile counted writes "
                "and steps): per_write_ms and per_step_ms 0, every token costed alone"]
        if len(used) < len(cols) or not _independent(_api_design(used, cols)):
            return None, said
        return cols, said
    said = [] if has_steps else [
        "rows without engine step counts (the server's /metrics not read, or measured before "
        "pdserve profile counted steps): per_step_ms 0, a step's cost spread over the others"]
    full = tuple(k for k in API_COLUMNS if has_steps or k != "steps")
    per_write = [r["output_tokens"] / r["writes"] for r in used if r["writes"]]
    if len(used) < len(full):
        why = f"{len(used)} usable row(s), {len(full)} costs need >= {len(full)}"
    elif not per_write or max(per_write) < (1 + MIN_WRITE_SPREAD) * min(per_write):
        why = (f"the rows' tokens per write differ by less than {MIN_WRITE_SPREAD:.0%} (no "
               "phase made the API write several tokens at once)")
    elif not _independent(_api_design(used, full)):
        why = f"the rows' {len(full)} columns are not independent"
    else:
        return full, said
    # writes and output tokens cannot be told apart: a write's tokens cost it per write, which
    # is exact where every write of the rows carried one token (what the rows measured)
    cols = tuple(k for k in full if k != "output_tokens")
    said.insert(0, f"per_output_token_ms 0: {why}, so a token's cost is not told apart from "
                   "its write's (all of it per write)")
    if len(used) < len(cols) or not _independent(_api_design(used, cols)):
        return None, said
    return cols, said


def fit_serving_api(rows: list[dict]) -> dict[str, Any]:
    """api_cost_ms {per_request_ms, per_prompt_token_ms, per_write_ms, per_output_token_ms,
    per_step_ms} from the API process's CPU per phase (the module docstring): the five costs;
    per_step_ms 0 and a note where a row has no step count; per_output_token_ms 0 and a note
    where the rows cannot tell a token from its write; or {} with a note where they cannot
    separate even those. fit["per_step"] says whether per_step_ms was fitted."""
    has_writes = any("writes" in r for r in rows)
    if has_writes and not all("writes" in r for r in rows):
        raise ValueError("serving_api fit: rows with and without 'writes' (measured by "
                         "different versions): refit them apart")
    counts = [k for k in API_COLUMNS if k != "steps"] if has_writes else API_COLUMNS_BEFORE_WRITES
    for r in rows:
        for k in counts:
            v = r.get(k)
            if not _is_count(v) or v < 0:
                raise ValueError(f"serving_api fit: row {r} needs an integer {k!r} >= 0")
        v = r.get("steps")
        if v is not None and (not _is_count(v) or v < 0):
            raise ValueError(f"serving_api fit: row {r} needs 'steps' an integer >= 0 or None "
                             "(not read)")
        c = r.get("api_cpu_s")
        if c is not None and (not isinstance(c, (int, float)) or isinstance(c, bool)
                              or not math.isfinite(c) or c < 0):
            raise ValueError(f"serving_api fit: row {r} needs api_cpu_s a finite number >= 0 "
                             "or None (not read)")
    unread = sum(r.get("api_cpu_s") is None for r in rows)
    unseen = sum(r.get("api_cpu_s") == 0 for r in rows)
    used = [r for r in rows if r.get("api_cpu_s")]
    has_steps = all(r.get("steps") is not None for r in used)
    left_out = []
    if unread:
        left_out.append(f"{unread} row(s) without a CPU reading (the platform does not report "
                        "the API process's CPU)")
    if unseen:
        left_out.append(f"{unseen} row(s) with no CPU seen (below the reading's resolution)")
    cols, said = _api_model(used, has_writes, has_steps)
    cost_of = dict(zip(API_COLUMNS, API_COST_KEYS))
    model = "api_cpu_ms = " + " + ".join(f"{cost_of[k]} * {k}" for k in API_COLUMNS)
    info: dict[str, Any] = {"n_samples": len(used), "source": "measured", "model": model,
                            "per_step": ("fitted" if cols is not None and "steps" in cols else
                                         "0: rows without engine step counts")}
    if cols is None:
        why = (f"{len(used)} usable row(s): the costs need >= {MIN_ROWS['serving_api']}"
               if len(used) < MIN_ROWS["serving_api"] else
               "the rows' requests, prompt tokens and writes (or output tokens) are not "
               "independent (each phase with the same mix): the costs cannot be told apart")
        info.update(heldout_mean_abs_rel_err=None, heldout_max_abs_rel_err=None,
                    note="; ".join([f"no term: {why}", *said, *left_out]))
        return {"api_cost_ms": {}, "fit": info}
    c = _api_coef(used, cols)
    coef = dict(zip(cols, c.tolist()))

    def fit(train):
        cc = _api_coef(train, cols)
        return lambda r: float(_api_design([r], cols)[0] @ cc)
    info.update(_heldout(used, fit, lambda r: r["api_cpu_s"] * 1e3))
    info["columns"] = list(cols)
    info["rows"] = [{"phase": r.get("phase"), **{k: r[k] for k in API_COLUMNS if k in r},
                     "api_cpu_ms": round(r["api_cpu_s"] * 1e3, 4),
                     "predicted_ms": round(float(_api_design([r], cols)[0] @ c), 4)}
                    for r in used]
    if said or left_out:
        info["note"] = "; ".join(said + left_out)
    cost = {key: float(coef.get(col, 0.0)) for key, col in zip(API_COST_KEYS, API_COLUMNS)}
    return {"api_cost_ms": cost, "fit": info}


# ---- all terms ----------------------------------------------------------------------------------
def shaped_rows(samples: dict[str, list[dict]], graph_sizes: Sequence[int]
                ) -> dict[str, list[dict]]:
    """The prefill and mixed rows at their step shapes (module docstring): copies whose n is
    the bucket's (padding included); the other terms' rows as they are."""
    if not graph_sizes:
        return samples
    out = dict(samples)
    if samples.get("prefill"):
        _check_rows("prefill", samples["prefill"], ("n", "wall_ms"))
        out["prefill"] = [{**r, "n": padded_tokens(_tokens("prefill", r["n"]), graph_sizes)}
                          for r in samples["prefill"]]
    if samples.get("mixed"):
        _check_rows("mixed", samples["mixed"], ("b", "ctx_sum", "n", "wall_ms"))
        out["mixed"] = [{**r, "n": padded_tokens(_tokens("mixed", r["b"])
                                                 + _tokens("mixed", r["n"]), graph_sizes) - r["b"]}
                        for r in samples["mixed"]]
    return out


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tokens(term: str, v: float) -> int:
    """A row's token count as a whole number (a step's shape is one); ValueError otherwise."""
    if v != int(v):
        raise ValueError(f"{term} fit: a row's token count must be a whole number to take its "
                         f"graph shape, got {v!r}")
    return int(v)


def fit_all(samples: dict[str, list[dict]], graph_sizes: Sequence[int] = (),
            serving_graph_sizes: Sequence[int] | None = None) -> dict[str, Any]:
    """Every term from samples {"prefill": rows, "decode": rows, "mixed": rows, "transfer":
    rows, "serving": rows, "serving_batch": rows, "serving_api": rows}: the profile's terms at
    top level and "fit" per term. Without transfer rows the caller supplies the transfer terms
    (and says where they came from); without serving rows there is no serving_overhead_ms
    (profile_from_samples: 0), without serving_batch rows no serving_host_ms, without
    serving_api rows no api_cost_ms (profile_from_samples: {} for both).
    graph_sizes: the measuring engine's graph buckets (step_shapes.mixed_sizes; empty: none),
    the shapes its prefill and mixed rows ran at (module docstring); serving_graph_sizes: those
    of the server the serving rows were measured on (None: graph_sizes)."""
    for term in ("prefill", "decode", "mixed"):
        if not samples.get(term):
            raise ValueError(f"no {term} rows to fit")
    samples = shaped_rows(samples, graph_sizes)
    pre = fit_prefill(samples["prefill"])
    dec = fit_decode(samples["decode"])
    mix = fit_mixed(samples["mixed"], dec)
    out: dict[str, Any] = {}
    fit: dict[str, Any] = {}
    for name, part in (("prefill", pre), ("decode", dec), ("mixed", mix)):
        fit[name] = part.pop("fit")
        out.update(part)
    if samples.get("transfer"):
        tr = fit_transfer(samples["transfer"])
        fit["transfer"] = tr.pop("fit")
        out.update(tr)
    if samples.get("serving"):
        sv = fit_serving(samples["serving"], out, out,
                         graph_sizes if serving_graph_sizes is None else serving_graph_sizes)
        fit["serving"] = sv.pop("fit")
        out.update(sv)
    if samples.get("serving_batch"):
        sb = fit_serving_batch(samples["serving_batch"], out)
        fit["serving_batch"] = sb.pop("fit")
        out.update(sb)
    if samples.get("serving_api"):
        sa = fit_serving_api(samples["serving_api"])
        fit["serving_api"] = sa.pop("fit")
        out.update(sa)
    out["fit"] = fit
    return out


def profile_from_samples(samples: dict[str, list[dict]], *, model: str, hardware: Any,
                         engine_config: dict, commit: str,
                         transfer_estimate: dict[str, Any] | None = None,
                         extra: dict[str, Any] | None = None,
                         serving_note: str = "no serving-path rows",
                         graph_sizes: Sequence[int] | None = None,
                         serving_batch_note: str | None = None,
                         serving_api_note: str | None = None):
    """A CostProfile fitted from samples. transfer_estimate: the transfer terms to use when
    samples hold no transfer rows ({"transfer_fixed_ms", "transfer_gb_per_s",
    "kv_bytes_per_token", "note": where they come from}); the profile's fit says "estimate".
    serving_note: why there are no serving rows, when there are none (serving_overhead_ms is
    then 0 and its fit says "not measured"); serving_batch_note: the same for the served-batch
    rows (None: serving_note; serving_host_ms is then {}), serving_api_note for the API
    process's CPU rows (None: serving_note; api_cost_ms is then {}). graph_sizes: the buckets
    the rows ran at (the profile's fit_graph_sizes; empty: fit on the rows' own token counts);
    None: those of engine_config (a new measurement). The serving rows' own server may have had other
    buckets: extra's serving_setup["graph_max_tokens"] says so, where recorded."""
    from .cost_profile import CostProfile
    sizes = (mixed_sizes(graph_max_tokens(engine_config)) if graph_sizes is None
             else list(graph_sizes))
    setup = (extra or {}).get("serving_setup")
    serving_sizes = sizes
    if sizes and isinstance(setup, dict) and _is_count(setup.get("graph_max_tokens")):
        serving_sizes = mixed_sizes(setup["graph_max_tokens"])
    terms = fit_all(samples, sizes, serving_sizes)
    # the serving path's terms without rows: each at its empty value, its fit saying why
    for key, term, empty, note in (
            ("serving_overhead_ms", "serving", 0.0, serving_note),
            ("serving_host_ms", "serving_batch", {},
             serving_note if serving_batch_note is None else serving_batch_note),
            ("api_cost_ms", "serving_api", {},
             serving_note if serving_api_note is None else serving_api_note)):
        if key not in terms:
            terms[key] = empty
            terms["fit"][term] = {"n_samples": 0, "heldout_mean_abs_rel_err": None,
                                  "heldout_max_abs_rel_err": None, "source": "not measured",
                                  "note": note}
    if "transfer_gb_per_s" not in terms:
        if transfer_estimate is None:
            raise ValueError("no transfer rows and no transfer estimate")
        est = dict(transfer_estimate)
        note = est.pop("note", None)
        if not note:
            raise ValueError("a transfer estimate must say where it comes from (note)")
        for k in ("transfer_fixed_ms", "transfer_gb_per_s", "kv_bytes_per_token"):
            terms[k] = est.pop(k)
        terms["fit"]["transfer"] = {"n_samples": 0, "heldout_mean_abs_rel_err": None,
                                    "heldout_max_abs_rel_err": None, "source": "estimate",
                                    "note": note, **est}
    return CostProfile(model=model, hardware=hardware, engine_config=dict(engine_config),
                       commit=commit, samples={k: list(v) for k, v in samples.items()},
                       fit_graph_sizes=sizes, extra=dict(extra or {}), **terms)


def refit(profile, graph_sizes: Sequence[int] | None = None):
    """The profile's terms fitted afresh from its own samples (e.g. after a fit change), at the
    step shapes it was fitted at (its fit_graph_sizes), or at graph_sizes when given
    (scripts/refit_profile.py: an older file refitted per CUDA-graph shape). An api_cost_ms
    without serving_api rows to refit it from (set by hand) is carried over as it is."""
    return _refitted(profile, profile.samples, profile.extra,
                     profile.fit_graph_sizes if graph_sizes is None else graph_sizes,
                     "carried over from the profile refitted")


# what a refit's fit says of a serving-path term the profile has no rows for, where the
# profile's own fit says nothing
_NO_ROWS_NOTES = {
    "serving": "the profile has no serving-path measurement (made before pdserve profile had "
               "one)",
    "serving_batch": "the profile has no served-batch measurement (made before pdserve profile "
                     "had one)",
    "serving_api": "the profile has no measurement of the API process's CPU (made before "
                   "pdserve profile had one)"}


def _refitted(profile, samples: dict[str, list[dict]], extra: dict,
              graph_sizes: Sequence[int], transfer_note: str):
    """profile_from_samples over `samples` with `profile`'s identity: its transfer terms where
    samples have no transfer rows (their note, else transfer_note), each serving-path term's
    note where it has no rows, and its api_cost_ms carried over where that has none."""
    est = None
    if not samples.get("transfer"):
        est = {"transfer_fixed_ms": profile.transfer_fixed_ms,
               "transfer_gb_per_s": profile.transfer_gb_per_s,
               "kv_bytes_per_token": profile.kv_bytes_per_token,
               "note": profile.fit.get("transfer", {}).get("note") or transfer_note}
    note = {term: profile.fit.get(term, {}).get("note") or default
            for term, default in _NO_ROWS_NOTES.items()}
    return _carry_api_cost(profile, profile_from_samples(
        samples, model=profile.model, hardware=profile.hardware,
        engine_config=profile.engine_config, commit=profile.commit, transfer_estimate=est,
        extra=extra, serving_note=note["serving"], serving_batch_note=note["serving_batch"],
        serving_api_note=note["serving_api"], graph_sizes=graph_sizes))


def _carry_api_cost(old, new):
    """new with old's api_cost_ms where old has the term but no serving_api rows to fit it
    from (a term set by hand, or measured elsewhere), which a refit would otherwise drop."""
    import dataclasses
    if old.samples.get("serving_api") or not old.api_cost_ms:
        return new
    entry = {"n_samples": 0, "heldout_mean_abs_rel_err": None, "heldout_max_abs_rel_err": None,
             "source": "carried over", "note": "no serving_api rows: the profile's api_cost_ms "
                                               "(set by hand or measured elsewhere) as it was"}
    return dataclasses.replace(new, api_cost_ms=dict(old.api_cost_ms),
                               fit={**new.fit, "serving_api": entry})


def device_time_profile(profile):
    """The profile refitted on its rows' device time ("gpu_ms": the CUDA-event bracket of
    the forward through sampling; in profiles made before that change, of the forward alone,
    which leaves out the LM head and the sampler) in place of their synced wall time: the step
    period when async scheduling hides the host's part of a step behind the device's (the
    host's work per step is shorter than the device's, and a server runs steps back to back).
    The bracket includes the input staging done after its start event, so it is an upper bound
    of the device's time. Transfer terms are carried over. The serving overhead is refitted
    against the device-time prefill (its definition: the measured TTFT less the profile's own
    lone-prefill time), so a lone request's TTFT stays the measured one: the host's part of
    that first step, which nothing hides for a request that finds the worker idle, moves into
    the overhead. The served-batch floor (serving_host_ms) is refitted against the
    device-time decode terms the same way: the served TPOTs stay what was measured, and a step
    the device no longer explains is the host's. The API process's CPU (api_cost_ms) is no
    step time: its rows are refitted as they are (a term without rows is carried over).
    A decode or mixed row measured queued as well (queued_gpu_ms: its steps run back to back
    under async scheduling, each bracket opening when the step before ends on the device)
    gives that time instead: a synced step's bracket also holds the device's idle time while
    the host stages the step's inputs and sets up its sampling, which a busy server hides.
    ValueError when a prefill, decode or mixed row has no gpu_ms (a CPU profile: nothing runs
    beside the host there)."""
    samples: dict[str, list[dict]] = {}
    for term in ("prefill", "decode", "mixed"):
        rows = []
        for i, r in enumerate(profile.samples.get(term) or ()):
            g = r.get("gpu_ms")
            if not isinstance(g, (int, float)) or not g > 0:
                raise ValueError(f"profile {term} row {i} has no gpu_ms (device time): "
                                 "--step-time device needs a GPU profile")
            q = r.get("queued_gpu_ms")
            if term != "prefill" and isinstance(q, (int, float)) and q > 0:
                g = q
            row = {k: v for k, v in r.items() if k not in ("wall_ms_samples", "decode_wall_ms")}
            row["wall_ms"], row["synced_wall_ms"] = float(g), r["wall_ms"]
            rows.append(row)
        samples[term] = rows
    for term in ("transfer", "serving", "serving_batch", "serving_api"):
        if profile.samples.get(term):
            samples[term] = list(profile.samples[term])
    extra = dict(profile.extra)
    extra["step_time"] = "device (gpu_ms rows; queued_gpu_ms where measured)"
    return _refitted(profile, samples, extra, profile.fit_graph_sizes,
                     "carried over from the profile")
