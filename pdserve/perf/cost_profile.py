"""A calibrated step-cost profile: what `pdserve profile` measured and fitted on one model and
one machine, and the formulas a cost model evaluates from it. Plain Python (no torch).

All times are milliseconds. With n prompt tokens in a step, b decoding sequences whose contexts
(prompt + output tokens so far) sum to ctx_sum, and a KV hand-off of `tokens` tokens:

    prefill_ms(n)           = prefill_fixed_ms + alpha_ms_per_token*n + prefill_quadratic_ms*n^2
    decode_ms(b, ctx_sum)   = beta_ms["fixed_ms"]
                              + beta_ms["per_seq_ms_below"] * min(b, batch_threshold)
                              + beta_ms["per_seq_ms_above"] * max(0, b - batch_threshold)
                              + beta_ms["per_context_token_ms"] * ctx_sum
                              + (beta_ms["split_ms"] where longest >= SPLIT_CONTEXT_TOKENS,
                                 else 0)                                          (b >= 1)
                            split_ms is optional (absent in files made before it: 0); longest
                            is the step's longest sequence (prompt chunks included), when the
                            caller knows it, else the mean context ctx_sum / b
    mixed_ms(b, ctx_sum, n) = decode_ms(b, ctx_sum) + gamma_ms_per_token*n  (b == 0: prefill_ms(n))
    transfer_ms(tokens)     = transfer_fixed_ms
                              + tokens*kv_bytes_per_token / (transfer_gb_per_s*1e6)
    fit_graph_sizes         the CUDA-graph token buckets (step_shapes.py) the measuring engine
                            padded its steps with prefill tokens to, which the fit took as the
                            rows' shapes (cost_fit.py); then n above is a step's shape, padding
                            included (graph_padded), and a caller costs a step at its own
                            deployment's buckets (step_cost_ms). Empty: n is the step's own
                            token count. Optional (empty in files made before it: they keep
                            their meaning; scripts/refit_profile.py refits one per shape).
    serving_overhead_ms     what a request spends outside the engine's steps when it is served
                            (HTTP, the router, IPC to and from the worker, SSE, the client):
                            a request reaches the router this long after the client sends it.
                            Optional (0 in files made before it was measured).
    served_step_floor_ms(seqs)
                            = serving_host_ms["fixed_ms"] + serving_host_ms["per_seq_ms"]*seqs
                            the served engine's host work per step that grows with the
                            sequences in it (output processing, detokenizing and streaming
                            each one's token, IPC) and that the device's time does not cover:
                            a served step of seqs sequences (prefill chunks and decodes alike)
                            takes max(its step cost, this). Fitted on b streams served at once
                            (cost_fit.fit_serving_batch). Optional: serving_host_ms {} (files
                            made before it, or no served-batch rows) is 0; measured with no
                            host-bound row, both terms are 0.
    api_cost_ms             the serving front's own CPU: `pdserve serve`'s process (uvicorn,
                            the API, the router, the engine client's I/O thread: one Python
                            process, one GIL, in front of every worker), which admits each
                            request and streams its tokens in SSE writes:
                              admitting a request   per_request_ms
                                                    + per_prompt_token_ms * prompt tokens
                              an engine step whose  per_step_ms (the engine client's I/O
                              outputs reach it      thread receives and decodes the worker's
                                                    message, wakes the event loop, the router
                                                    books it: once per step, whatever the
                                                    number of streams in it)
                              one SSE write         per_write_ms
                                                    + per_output_token_ms * its tokens
                            A stream gets one write per wake-up of the API, holding every
                            token that arrived since its last write (server/serving.py): when
                            the API lags, a write carries several tokens and the cost per token
                            falls, which no single per-token cost can follow. Its work is
                            serial (one process), so at load it queues: the simulator runs it
                            as one FIFO server that coalesces a stream's tokens into its
                            pending write (sim/api_process.py). Fitted on the API's CPU
                            seconds over the serving path's phases (cost_fit.fit_serving_api).
                            Optional: {} (files made before it, a platform that does not report
                            the process's CPU, or rows that cannot separate the costs) is no
                            API model. Files made before per_step_ms (the other four keys)
                            load with per_step_ms 0, and files made before per_write_ms too
                            (three keys) with per_write_ms 0 as well: no step was costed, and
                            each token alone, which is what they meant (api_cost_from_file).

The JSON file holds these terms at top level, with `version` (1), `model`, `hardware` (the
measuring machine: bench.common.hardware_info's dict, or a plain label), `engine_config`,
`commit`, `fit` (per term "prefill" / "decode" / "mixed" / "transfer", "serving" where
the file has serving_overhead_ms, "serving_batch" where it has serving_host_ms and
"serving_api" where it has api_cost_ms: n_samples,
heldout_mean_abs_rel_err, heldout_max_abs_rel_err, and whatever else the fit reports) and
`samples` (the measured rows, so a profile can be refit). Other top-level keys are kept in
`extra`. CostProfile.from_json checks every term (ValueError naming the field and the file).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..step_shapes import graph_max_tokens, mixed_sizes, padded_tokens
from .files import read_json_object, write_json

VERSION = 1
BETA_KEYS = ("fixed_ms", "per_seq_ms_below", "per_seq_ms_above", "per_context_token_ms")
# beta_ms["split_ms"]: what a decode step pays once its sequences are long enough for the paged
# decode kernel to split their keys (kernels/paged_attention.py default_num_kv_splits: one split
# below 2 * MIN_KEYS_PER_SPLIT keys, then 2, 4, ... and a second kernel that merges the parts).
# The device time steps up there (H100, batch 1: 2.14 ms at 256 tokens of context, 2.68 at
# 1,024, 2.75 at 4,096) instead of growing with the context, which a per-token term spreads over
# the whole range. The kernel splits once the step's longest sequence reaches the threshold (its
# graph's bound, or its eager max_seq_len); a caller that knows only ctx_sum passes none, and
# the mean context per sequence stands for the longest (the profile's rows are uniform: the two
# agree there).
# Optional: files made before it have none (0: they keep their meaning).
SPLIT_CONTEXT_TOKENS = 512
FIT_TERMS = ("prefill", "decode", "mixed", "transfer")
OPTIONAL_FIT_TERMS = ("serving", "serving_batch", "serving_api")
SERVING_HOST_KEYS = ("fixed_ms", "per_seq_ms")
API_COST_KEYS = ("per_request_ms", "per_prompt_token_ms", "per_write_ms", "per_output_token_ms",
                 "per_step_ms")
# api_cost_ms as files wrote it before per_step_ms, and before per_write_ms (api_cost_from_file)
API_COST_KEYS_BEFORE_STEPS = ("per_request_ms", "per_prompt_token_ms", "per_write_ms",
                              "per_output_token_ms")
API_COST_KEYS_BEFORE_WRITES = ("per_request_ms", "per_prompt_token_ms", "per_output_token_ms")
FIT_KEYS = ("n_samples", "heldout_mean_abs_rel_err", "heldout_max_abs_rel_err")
# coefficients that may be 0 but not negative
_NONNEG = ("alpha_ms_per_token", "prefill_fixed_ms", "prefill_quadratic_ms", "gamma_ms_per_token",
           "transfer_fixed_ms")
_REQUIRED = ("version", "model", "hardware", "engine_config", "commit", *_NONNEG, "beta_ms",
             "batch_threshold", "transfer_gb_per_s", "kv_bytes_per_token", "fit", "samples")


EMBEDDED = "embedded"


def model_name(model: str | None) -> str:
    """The `model` a profile of EngineConfig.model records (and is matched against): the
    --model string as given (a preset, a folder, a .gguf file), "embedded" for the embedded
    SmolLM2 (model None)."""
    return EMBEDDED if model is None else model


def hardware_label(hardware: Any) -> str:
    """A short name of a machine for matching profiles: the GPU's name where hardware_info saw
    one, else "cpu: <cpu model>"; a string is its own label."""
    if isinstance(hardware, str):
        return hardware
    if isinstance(hardware, Mapping):
        if hardware.get("gpu"):
            return str(hardware["gpu"])
        return f"cpu: {hardware.get('cpu_model', 'unknown')}"
    raise ValueError("hardware must be a label or a hardware_info dict, got "
                     f"{type(hardware).__name__}")


def api_cost_from_file(api: Any) -> Any:
    """A file's api_cost_ms in today's five keys: one written before per_step_ms (exactly
    API_COST_KEYS_BEFORE_STEPS) gets per_step_ms 0, one written before per_write_ms (exactly
    API_COST_KEYS_BEFORE_WRITES) per_write_ms 0 too, which keeps their meaning (no engine step
    cost the API anything; every token cost per_output_token_ms, written alone or not);
    anything else is returned as it is, for _validate to judge."""
    if isinstance(api, Mapping) and set(api) in (set(API_COST_KEYS_BEFORE_STEPS),
                                                 set(API_COST_KEYS_BEFORE_WRITES)):
        return {k: api.get(k, 0.0) for k in API_COST_KEYS}
    return api


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class CostProfile:
    model: str
    hardware: Any                       # hardware_info dict (or a label)
    engine_config: dict
    commit: str
    alpha_ms_per_token: float
    prefill_fixed_ms: float
    prefill_quadratic_ms: float
    beta_ms: dict                       # the four BETA_KEYS (and split_ms, optional)
    batch_threshold: int
    gamma_ms_per_token: float
    transfer_gb_per_s: float
    transfer_fixed_ms: float
    kv_bytes_per_token: int
    serving_overhead_ms: float = 0.0
    serving_host_ms: dict = field(default_factory=dict)   # {} or the two SERVING_HOST_KEYS
    api_cost_ms: dict = field(default_factory=dict)       # {} or the five API_COST_KEYS
    fit_graph_sizes: list = field(default_factory=list)
    fit: dict = field(default_factory=dict)
    samples: dict = field(default_factory=dict)
    version: int = VERSION
    extra: dict = field(default_factory=dict)   # other top-level keys of the file, kept

    def __post_init__(self):
        _validate(self.to_dict(), "<CostProfile>")

    @property
    def graph_padded(self) -> bool:
        """Whether the terms are per step shape (fitted on CUDA-graph buckets)."""
        return bool(self.fit_graph_sizes)

    # ---- formulas ----------------------------------------------------------------------------
    @staticmethod
    def _count(name: str, v: Any, least: int) -> None:
        if not _is_number(v) or not math.isfinite(v) or v < least:
            raise ValueError(f"{name} must be a finite number >= {least}, got {v!r}")

    def prefill_ms(self, n: float) -> float:
        """One step prefilling n prompt tokens, nothing else in it."""
        self._count("n", n, 0)
        return (self.prefill_fixed_ms + self.alpha_ms_per_token * n
                + self.prefill_quadratic_ms * n * n)

    def decode_ms(self, b: float, ctx_sum: float, longest: float | None = None) -> float:
        """One decode-only step of b >= 1 sequences whose contexts sum to ctx_sum tokens (the
        longest of the step's sequences: `longest`, when known)."""
        self._count("b", b, 1)
        self._count("ctx_sum", ctx_sum, 0)
        return decode_cost_ms(self.beta_ms, self.batch_threshold, b, ctx_sum, longest)

    def mixed_ms(self, b: float, ctx_sum: float, n: float, longest: float | None = None) -> float:
        """One step of b decodes and an n-token prompt chunk (b == 0: a lone prefill)."""
        self._count("b", b, 0)
        self._count("n", n, 0)
        if b == 0:
            return self.prefill_ms(n)
        return self.decode_ms(b, ctx_sum, longest) + self.gamma_ms_per_token * n

    def transfer_ms(self, tokens: float) -> float:
        """One KV hand-off of `tokens` tokens between a prefill and a decode worker."""
        self._count("tokens", tokens, 0)
        return (self.transfer_fixed_ms
                + tokens * self.kv_bytes_per_token / (self.transfer_gb_per_s * 1e6))

    def served_step_floor_ms(self, seqs: float) -> float:
        """The least time a served step of `seqs` >= 1 sequences takes: the server's host work
        per step (0.0 without the term)."""
        self._count("seqs", seqs, 1)
        h = self.serving_host_ms
        if not h:
            return 0.0
        return h["fixed_ms"] + h["per_seq_ms"] * seqs

    # ---- files -------------------------------------------------------------------------------
    @property
    def hardware_label(self) -> str:
        return hardware_label(self.hardware)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out = {"version": d.pop("version"), **d}
        for k, v in self.extra.items():
            out.setdefault(k, v)
        return out

    def save(self, path: str | os.PathLike) -> str:
        """Write the profile as JSON (replaced atomically); returns the path."""
        return write_json(path, self.to_dict(), allow_nan=False)

    @classmethod
    def from_json(cls, source: str | os.PathLike | Mapping, *, model: str | None = None,
                  hardware: Any = None) -> "CostProfile":
        """A profile from a JSON file (or an already-parsed dict), checked: every term present,
        of its type, finite and in range; when model / hardware are given (a label or a
        hardware_info dict), the profile must be of that model (model_name(config.model)) and
        machine (hardware_label). ValueError naming the field and the file otherwise. An
        api_cost_ms of the four keys files had before per_step_ms loads with per_step_ms 0, one
        of the three they had before per_write_ms with per_write_ms 0 too
        (api_cost_from_file)."""
        if isinstance(source, Mapping):
            where, data = "<dict>", dict(source)
        else:
            where, data = os.fspath(source), read_json_object(source, "profile")
        if "api_cost_ms" in data:
            data["api_cost_ms"] = api_cost_from_file(data["api_cost_ms"])
        _validate(data, where)
        if model is not None and data["model"] != model:
            raise ValueError(f"{where}: model is {data['model']!r}, but this deployment runs "
                             f"{model!r} (a profile of another model)")
        if hardware is not None:
            want, have = hardware_label(hardware), hardware_label(data["hardware"])
            if want != have:
                raise ValueError(f"{where}: hardware is {have!r}, but this machine is {want!r} "
                                 "(a profile measured elsewhere)")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(**{k: data[k] for k in names if k in data},
                   extra={k: v for k, v in data.items() if k not in names})


def _validate(d: Mapping, where: str) -> None:
    def bad(name: str, why: str) -> ValueError:
        return ValueError(f"{where}: {name} {why}")

    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise bad(missing[0], "is missing" + (f" (also missing: {', '.join(missing[1:])})"
                                               if len(missing) > 1 else ""))
    if d["version"] != VERSION or isinstance(d["version"], bool):
        raise bad("version", f"must be {VERSION}, got {d['version']!r}")
    for name in ("model", "commit"):
        if not isinstance(d[name], str) or not d[name]:
            raise bad(name, f"must be a non-empty string, got {d[name]!r}")
    if not isinstance(d["hardware"], (str, dict)) or not d["hardware"]:
        raise bad("hardware", f"must be a label or a hardware_info object, got {d['hardware']!r}")
    for name in ("engine_config", "fit", "samples"):
        if not isinstance(d[name], dict):
            raise bad(name, f"must be an object, got {type(d[name]).__name__}")

    def number(name: str, v: Any, *, positive: bool = False) -> None:
        if not _is_number(v):
            raise bad(name, f"must be a number, got {v!r}")
        if not math.isfinite(v):
            raise bad(name, f"must be finite, got {v!r}")
        if positive and v <= 0:
            raise bad(name, f"must be > 0, got {v!r}")
        if v < 0:
            raise bad(name, f"must be >= 0 (a cost cannot be negative), got {v!r}")

    for name in _NONNEG:
        number(name, d[name])
    number("transfer_gb_per_s", d["transfer_gb_per_s"], positive=True)
    if "serving_overhead_ms" in d:      # (optional: files older than the term load with 0)
        number("serving_overhead_ms", d["serving_overhead_ms"])
    def costs(name: str, keys: tuple[str, ...]) -> None:
        """An optional term of named costs: {} (no term) or exactly `keys`, each a cost."""
        v = d[name]
        if not isinstance(v, dict):
            raise bad(name, f"must be an object ({{}}: no term), got {v!r}")
        unknown = sorted(set(v) - set(keys))
        if unknown:
            raise bad(name, f"has unknown keys {unknown} (it takes {', '.join(keys)})")
        for k in keys if v else ():
            if k not in v:
                raise bad(f"{name}.{k}", "is missing")
            number(f"{name}.{k}", v[k])

    # (optional: files older than them load with {})
    for name, keys in (("serving_host_ms", SERVING_HOST_KEYS), ("api_cost_ms", API_COST_KEYS)):
        if name in d:
            costs(name, keys)
    if "fit_graph_sizes" in d:          # (optional too: files older than it load with [])
        sizes = d["fit_graph_sizes"]
        if (not isinstance(sizes, list) or any(not isinstance(x, int) or isinstance(x, bool)
                                               or x < 1 for x in sizes)
                or sizes != sorted(set(sizes))):
            raise bad("fit_graph_sizes", "must be a list of increasing token counts >= 1, got "
                      f"{sizes!r}")
    for name, least in (("batch_threshold", 1), ("kv_bytes_per_token", 1)):
        v = d[name]
        if not isinstance(v, int) or isinstance(v, bool):
            raise bad(name, f"must be an integer, got {v!r}")
        if v < least:
            raise bad(name, f"must be >= {least}, got {v!r}")
    beta = d["beta_ms"]
    if not isinstance(beta, dict):
        raise bad("beta_ms", f"must be an object with {', '.join(BETA_KEYS)}, got {beta!r}")
    for k in BETA_KEYS:
        if k not in beta:
            raise bad(f"beta_ms.{k}", "is missing")
        number(f"beta_ms.{k}", beta[k])
    if "split_ms" in beta:
        number("beta_ms.split_ms", beta["split_ms"])
    for term in FIT_TERMS + OPTIONAL_FIT_TERMS:
        entry = d["fit"].get(term)
        if entry is None and term in OPTIONAL_FIT_TERMS:
            continue
        if not isinstance(entry, dict):
            raise bad(f"fit.{term}", f"must be an object with {', '.join(FIT_KEYS)}, got {entry!r}")
        for k in FIT_KEYS:
            if k not in entry:
                raise bad(f"fit.{term}.{k}", "is missing")
        n = entry["n_samples"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise bad(f"fit.{term}.n_samples", f"must be an integer >= 0, got {n!r}")
        for k in FIT_KEYS[1:]:
            # None: no held-out error (a term that was estimated, not fitted; the fit says why)
            if entry[k] is not None:
                number(f"fit.{term}.{k}", entry[k])


# ---- a step at its shape ------------------------------------------------------------------------
def deployment_graph_sizes(profile: Any, config: Any = None,
                           max_num_batched_tokens: int | None = None) -> list[int]:
    """The graph buckets (step_shapes.mixed_sizes) that step_cost_ms pads a deployment's steps
    to: empty unless the profile's terms are per step shape (graph_padded; a cost source without
    the attribute counts as not padded). config: the deployment's (an EngineConfig, or a mapping
    of its fields); None: the profile's own engine_config, with max_num_batched_tokens when
    given (a deployment like the measured one on another budget: the simulator's)."""
    if not getattr(profile, "graph_padded", False):
        return []
    if config is None:
        ec = profile.engine_config if isinstance(profile.engine_config, Mapping) else {}
        config = dict(ec) if max_num_batched_tokens is None else {
            **ec, "max_num_batched_tokens": max_num_batched_tokens}
    return mixed_sizes(graph_max_tokens(config))


def step_kind(b: int, n: int) -> str | None:
    """The kind of a step of b decodes and n prompt tokens, as the cost terms are named: prompt
    tokens only ("prefill"), decodes only ("decode"), both ("mixed"); None when it fed neither."""
    if n > 0:
        return "mixed" if b > 0 else "prefill"
    return "decode" if b > 0 else None


def splits_keys(b: float, ctx_sum: float, longest: float | None = None) -> bool:
    """Whether a decode step pays split_ms: its longest sequence reaches SPLIT_CONTEXT_TOKENS
    (unknown: its mean context per sequence stands for it)."""
    if longest is not None:
        return longest >= SPLIT_CONTEXT_TOKENS
    return ctx_sum >= b * SPLIT_CONTEXT_TOKENS


def decode_cost_ms(beta: Mapping[str, float], batch_threshold: float, b: float,
                   ctx_sum: float, longest: float | None = None) -> float:
    """decode_ms (the module docstring) from beta_ms and batch_threshold: the one formula the
    profile and its fit (cost_fit.decode_predict) evaluate."""
    k = batch_threshold
    return (beta["fixed_ms"] + beta["per_seq_ms_below"] * min(b, k)
            + beta["per_seq_ms_above"] * max(0, b - k)
            + beta["per_context_token_ms"] * ctx_sum
            + (beta.get("split_ms", 0.0) if splits_keys(b, ctx_sum, longest) else 0.0))


def step_cost_ms(costs: Any, b: int, ctx_sum: float, n: int,
                 sizes: "list[int] | tuple[int, ...]" = (),
                 longest: int | None = None) -> tuple[str, float]:
    """One step of b decodes (contexts summing to ctx_sum) and n prompt tokens: its kind
    ("prefill": b == 0, "decode": n == 0, else "mixed") and its time from `costs` (prefill_ms /
    decode_ms / mixed_ms) at its shape: sizes are the deployment's graph buckets
    (deployment_graph_sizes; empty: every step at its own token count), a lone prefill runs at
    padded_tokens(n) and a mixed step's chunk at padded_tokens(b + n) - b. longest: the step's
    longest sequence in tokens, prompt chunks included (None: unknown; the decode part's split
    term then goes by the mean context)."""
    kind = step_kind(b, n) or "prefill"
    if kind == "prefill":
        return kind, costs.prefill_ms(padded_tokens(n, sizes))
    if kind == "decode":
        return kind, costs.decode_ms(b, ctx_sum, longest)
    return kind, costs.mixed_ms(b, ctx_sum, padded_tokens(b + n, sizes) - b, longest)
