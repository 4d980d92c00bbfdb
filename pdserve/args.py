"""Command-line arguments shared by `pdserve generate / chat / serve` and the benchmarks: the
engine's (EngineConfig fields) and the deployment's (how many workers of each role behind a
router). The choices offered come from where each value is validated (EngineConfig's tuples,
the routing-policy registry), so a new backend or policy appears here without an edit.

    parser ──add_engine_args / add_deployment_args──> argparse.Namespace
           ──engine_config(ns)──> EngineConfig        ──deployment_args(ns)──> DeploymentArgs
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from . import config as _config
from .step_shapes import MAX_GRAPH_TOKENS

# flag destinations whose EngineConfig field has another name
_RENAMED = {"kv_transfer_timeout": "kv_transfer_timeout_s"}


def add_engine_args(p: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """EngineConfig's flags (exclude: flag names the caller defines itself, e.g. a benchmark's
    --seed that seeds its workload and the engine alike)."""
    g = _Group(p.add_argument_group("engine"), exclude)
    g.add_argument("--model", default=None,
                   help="HF folder, .gguf file or preset (default: embedded "
                        "SmolLM2-135M-Instruct)")
    g.add_argument("--load-format", default="auto", choices=list(_config.LOAD_FORMATS),
                   help="auto: weights from the model's files; dummy: seeded random weights "
                        "(speed without weights) (default %(default)s)")
    g.add_argument("--dtype", default="auto", choices=["auto", *_config.DTYPES],
                   help="weights' and activations' dtype (default %(default)s: float32 on CPU, "
                        "bfloat16 on CUDA)")
    g.add_argument("--device", default="cpu",
                   help="cpu or cuda[:N] (default %(default)s)")
    g.add_argument("--seed", type=int, default=0,
                   help="the engine's seed: dummy weights, and sampling of requests without a "
                        "seed (default %(default)s)")
    g.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block (default %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="sequences running at once, at most (default %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per step, at most (the chunked-prefill budget) (default "
                        "%(default)s)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context length, "
                        "capped by the KV pool)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="the KV pool in blocks (default: what --kv-cache-memory-gb holds)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="the KV pool's budget in GiB (default: 1 on CPU; on CUDA, what "
                        "--gpu-memory-utilization leaves after the weights)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU's memory each worker may use (weights, KV pool, "
                        "activations); workers sharing a GPU each take their own fraction "
                        "(default %(default)s)")
    g.add_argument("--swap-space", dest="swap_space_gb", type=float, default=0.0, metavar="GiB",
                   help="host memory per worker rank for the KV cache's host tier: swapped-out "
                        "requests and offloaded prefix-cache blocks (pinned on CUDA); 0: no host "
                        "tier (default %(default)s)")
    g.add_argument("--preemption-mode", default=None, choices=list(_config.PREEMPTION_MODES),
                   help="how a preempted request gives up its KV: recompute (freed, computed "
                        "again) or swap (copied to the host tier, needs --swap-space) (default: "
                        "per request, whichever the cost model says is cheaper)")
    g.add_argument("--kv-offload-policy", default="on-eviction",
                   choices=list(_config.KV_OFFLOAD_POLICIES),
                   help="when cached prefixes reach the host tier (--swap-space): on-eviction "
                        "(copied when the GPU pool evicts them) or write-through (copied when "
                        "cached, so eviction frees GPU blocks at once) (default %(default)s)")
    g.add_argument("--attention-backend", default="auto", choices=list(_config.ATTENTION_BACKENDS),
                   help="auto: triton on CUDA, torch on CPU (default %(default)s)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--cuda-graph-max-tokens", type=int, default=None,
                   help="largest step with prefill tokens replayed as a CUDA graph (default: "
                        f"the token budget, at most {MAX_GRAPH_TOKENS}; 0: eager)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="launch the next step while the device runs this one (default on; "
                        "--no-async-scheduling: schedule each step only after the previous "
                        "one's tokens are read)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of cached prompt prefixes (token-granular radix tree; "
                        "default on)")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="no tokenizer (token-id prompts only; for dummy presets)")
    g.add_argument("--tokenizer", default=None,
                   help="the tokenizer to use instead of the model's: an HF folder, a .gguf "
                        "file or a repo id in the local Hugging Face cache")
    g.add_argument("--chat-template", default=None,
                   help="the chat template to use instead of the tokenizer's: a file, or the "
                        "Jinja template itself")
    g.add_argument("--generation-config", default="auto", metavar="{auto,vllm,FOLDER}",
                   help="default sampling values (temperature, top_p, top_k, min_p, "
                        "repetition_penalty; max_new_tokens as max_tokens) for requests that "
                        "leave them out (serve's requests; LLM and AsyncLLM called without "
                        "SamplingParams; generate/chat take their own flags): auto: the model folder's generation_config.json; vllm: "
                        "pdserve's own; FOLDER: that folder's generation_config.json (default "
                        "%(default)s)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks per worker (NCCL on CUDA, gloo on CPU); > 1 runs worker processes "
                        "(default %(default)s)")
    g.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="CUDA TP: NCCL for every all-reduce (no one-shot P2P all-reduce)")
    g.add_argument("--distributed-executor-backend", default="auto",
                   choices=list(_config.EXECUTOR_BACKENDS),
                   help="uni: engine in this process; mp: in worker processes (auto: mp iff tp > "
                        "1); ray: worker processes placed by Ray on a cluster's nodes "
                        "(RAY_ADDRESS or the latest `ray start` here, else a local cluster) "
                        "(default %(default)s)")
    g.add_argument("--ray-placement-strategy", default="STRICT_PACK",
                   choices=list(_config.RAY_PLACEMENT_STRATEGIES),
                   help="ray: how each worker's ranks spread over nodes (a placement group "
                        "strategy, one bundle per rank; STRICT_PACK keeps a TP group on one "
                        "node) (default %(default)s)")


class _Group:
    """An argument group that leaves out the excluded flags."""

    def __init__(self, group, exclude: tuple[str, ...]):
        self.group, self.exclude = group, exclude

    def add_argument(self, *flags, **kwargs) -> None:
        if flags[0] not in self.exclude:
            self.group.add_argument(*flags, **kwargs)


def add_deployment_args(p: argparse.ArgumentParser) -> None:
    from .disagg.connectors import connector_names
    from .routing.policies import POLICIES
    g = p.add_argument_group("P/D disaggregation (several workers behind a router)")
    g.add_argument("--prefill", type=int, default=0, help="prefill workers (default %(default)s)")
    g.add_argument("--decode", type=int, default=0, help="decode workers (default %(default)s)")
    g.add_argument("--collocated", type=int, default=0,
                   help="collocated workers (default %(default)s)")
    g.add_argument("--prefill-tp", type=int, default=None, help="TP of each prefill worker (default -tp)")
    g.add_argument("--decode-tp", type=int, default=None, help="TP of each decode worker (default -tp)")
    g.add_argument("--collocated-tp", type=int, default=None,
                   help="TP of each collocated worker (default -tp)")
    g.add_argument("--num-gpus", type=int, default=None,
                   help="GPUs the workers may use (from --device's); with fewer than their ranks "
                        "need, workers share GPUs (e.g. --prefill 1 --decode 1 --num-gpus 1 "
                        "--gpu-memory-utilization 0.4); default: consecutive GPUs, one per rank")
    g.add_argument("--routing-policy", default=None, choices=list(POLICIES),
                   help="default: disagg with prefill workers, else collocated; adaptive: per "
                        "request, the path a cost model predicts meets the SLOs (--cost-model)")
    g.add_argument("--cost-model", default=None, metavar="FILE",
                   help="adaptive: the profile `pdserve profile` wrote; default: a stored "
                        "profile of this model and machine (PDSERVE_PROFILE_DIR, else "
                        "~/.cache/pdserve/profiles), else one measured at start-up (--quick) "
                        "and stored there")
    g.add_argument("--slo-ttft-ms", type=float, default=500.0,
                   help="adaptive: the time-to-first-token SLO a path must meet (ms) (default "
                        "%(default)s)")
    g.add_argument("--slo-tpot-ms", type=float, default=50.0,
                   help="adaptive: the time-per-output-token SLO a path must meet (ms) (default "
                        "%(default)s)")
    g.add_argument("--kv-connector", default=None,
                   help="how KV moves between prefill and decode workers: a registered connector ("
                        + ", ".join(connector_names()) + "; pdserve/disagg/connectors/base.py "
                        "says what each does) or a package.module:Class plugin path (default: "
                        "shared; with --distributed-executor-backend ray, whose workers may sit "
                        "on different nodes, torch-dist on CPU and nccl on CUDA)")
    g.add_argument("--kv-transfer-mode", default="async", choices=list(_config.KV_TRANSFER_MODES),
                   help="sync: a decode worker pulls inside its step; async: beside its steps "
                        "(default %(default)s)")
    g.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                   help="seconds before a pull is given up and the prompt recomputed (default "
                        "%(default)s)")
    g.add_argument("--worker-restarts", type=int, default=3,
                   help="restarts in a row of a worker that dies (0: none); serve restarts a "
                        "single worker too (default %(default)s)")
    g.add_argument("--restart-backoff", type=float, default=1.0,
                   help="seconds before the first restart of a dead worker (doubling per attempt) "
                        "(default %(default)s)")


def engine_config(ns: argparse.Namespace) -> "_config.EngineConfig":
    """The EngineConfig of the engine flags in ns (the others are ignored). kv_connector is a
    deployment choice (the router sets it on its prefill and decode workers), not taken here."""
    names = {f.name for f in dataclasses.fields(_config.EngineConfig)} - {"kv_connector"}
    values = {_RENAMED.get(k, k): v for k, v in vars(ns).items()}
    return _config.EngineConfig(**{k: v for k, v in values.items() if k in names})


@dataclass(frozen=True)
class DeploymentArgs:
    """Workers behind a router: how many of each role, their TP sizes (None: the engine's
    tensor_parallel_size), the routing policy (None: "disagg" with prefill workers, else
    "collocated"), the KV connector of prefill and decode workers (None: the engine config's,
    else "shared"), how dead workers are restarted, and the adaptive policy's cost model and
    SLOs. With no worker counted, one collocated
    worker. Validated where it is used (plan_workers, RestartPolicy, EngineConfig)."""
    prefill: int = 0
    decode: int = 0
    collocated: int = 0
    prefill_tp: int | None = None
    decode_tp: int | None = None
    collocated_tp: int | None = None
    routing_policy: str | None = None
    kv_connector: str | None = None
    worker_restarts: int = 3
    restart_backoff_s: float = 1.0
    num_gpus: int | None = None     # GPUs to place workers on (None: one per rank, in order)
    cost_model: Any = None          # adaptive: a profile file, a CostProfile or its dict
    slo_ttft_ms: float = 500.0      # adaptive: the SLOs a path must meet
    slo_tpot_ms: float = 50.0

    @property
    def policy(self) -> str:
        return self.routing_policy or ("disagg" if self.prefill else "collocated")

    @property
    def counts(self) -> tuple[int, int, int]:
        """(prefill, decode, collocated) workers to start."""
        if self.prefill + self.decode + self.collocated == 0:
            return 0, 0, 1
        return self.prefill, self.decode, self.collocated


def deployment_args(ns: argparse.Namespace) -> DeploymentArgs:
    return DeploymentArgs(ns.prefill, ns.decode, ns.collocated, ns.prefill_tp, ns.decode_tp,
                          ns.collocated_tp, ns.routing_policy, ns.kv_connector,
                          ns.worker_restarts, ns.restart_backoff, ns.num_gpus, ns.cost_model,
                          ns.slo_ttft_ms, ns.slo_tpot_ms)


# EngineConfig fields without an engine flag that a collocated server ignores: the router sets
# them on its P/D workers (deployment flags)
_ROUTER_SET = ("kv_connector", "kv_transfer_mode", "kv_transfer_timeout_s", "kv_hold_timeout_s",
               "max_kv_loads")


def engine_argv(config: "_config.EngineConfig") -> list[str]:
    """The engine flags (add_engine_args') that give `config` back through engine_config: one
    flag per field that differs from the flag's default. ValueError for a field no flag can
    set to its value (one without a flag, or None where the flag's default is a value)."""
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    names = {f.name: f for f in dataclasses.fields(_config.EngineConfig)}
    out: list[str] = []
    flagged = set()
    for action in p._actions:
        name = _RENAMED.get(action.dest, action.dest)
        if name not in names:
            continue
        flagged.add(name)
        value, default = getattr(config, name), action.default
        if value == default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            out.append(flag)        # (a value other than the default: the flag's own)
        elif value is None:
            raise ValueError(f"engine config: {name}=None has no flag (the flag's default is "
                             f"{default!r})")
        else:
            out += [flag, str(value)]
    for name, f in names.items():
        if name in flagged or name in _ROUTER_SET:
            continue
        if getattr(config, name) != f.default:
            raise ValueError(f"engine config: {name}={getattr(config, name)!r} has no "
                             "command-line flag (a server cannot be started with it)")
    return out
