"""The one place a deployment is assembled from its configuration, for the offline LLM, the
server and the benchmarks alike:

    build(config)                      -> LLMEngine      (in this process: tp 1, backend uni)
                                        | EngineClient   (worker processes: tp > 1 or backend mp)
    build(config, DeploymentArgs(...)) -> Router         (workers of each role behind a router)

All three have the request API of the EngineClient protocol (add_requests, step,
abort_request, has_unfinished_requests, check_integrity, shutdown, ...), so the caller drives
whichever it gets the same way.
"""
from __future__ import annotations

import os
import sys
import time

from .args import DeploymentArgs
from .config import EngineConfig


def build(config: EngineConfig, deployment: DeploymentArgs | None = None,
          startup_timeout_s: float = 900.0):
    """An engine for config: with a deployment, a Router over its workers (one collocated
    worker when it counts none: a router turns a worker's death into errors for its requests
    and restarts it); else an in-process LLMEngine or an EngineClient over worker processes,
    as config.executor_backend says. ValueError for a bad configuration."""
    if deployment is None:
        if config.executor_backend in ("mp", "ray"):
            from .worker.client import EngineClient
            return EngineClient(config, startup_timeout_s)
        from .worker.llm_engine import LLMEngine
        return LLMEngine(config)
    from .routing import RestartPolicy, Router, plan_workers
    restart = RestartPolicy(max_restarts=deployment.worker_restarts,
                            backoff_s=deployment.restart_backoff_s)
    connector = deployment.kv_connector or config.kv_connector or default_kv_connector(
        config, deployment)
    specs = plan_workers(config, *deployment.counts, deployment.prefill_tp,
                         deployment.decode_tp, deployment.collocated_tp, connector,
                         deployment.num_gpus)
    policy = adaptive_policy(config, deployment) if deployment.policy == "adaptive" \
        else deployment.policy
    return Router(specs, policy, startup_timeout_s, restart)


def default_kv_connector(config: EngineConfig, deployment: DeploymentArgs, log=None) -> str:
    """The KV connector when none is named: "shared" (one host; the fastest there). Under Ray
    a worker may be placed, or restarted, on any node, so the two-sided pair, which works
    within a host and across hosts alike: "nccl" on CUDA, "torch-dist" on CPU (said on stderr
    when the deployment has prefill and decode workers)."""
    if config.executor_backend != "ray":
        return "shared"
    name = "nccl" if config.is_cuda else "torch-dist"
    if deployment.prefill:
        (log or (lambda msg: print(msg, file=sys.stderr, flush=True)))(
            f"ray: KV moves between prefill and decode workers over the two-sided {name!r} "
            "connector (Ray may place them on different nodes; --kv-connector overrides)")
    return name


def profile_dir() -> str:
    """Where profiles of this machine are kept for the adaptive policy to find."""
    return os.environ.get("PDSERVE_PROFILE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "pdserve", "profiles")


def adaptive_policy(config: EngineConfig, deployment: DeploymentArgs, log=None):
    """The adaptive routing policy with its cost model: the profile given (a file, a
    CostProfile or its dict; checked to be of this model and machine), else the stored one
    for this model and machine (profile_dir()), else one measured now with `pdserve profile
    --quick`'s row set on this configuration (and stored). Says which on stderr (or log)."""
    from .bench.common import hardware_info
    from .perf.cost_profile import CostProfile, deployment_graph_sizes, model_name
    from .perf.profiler import default_output
    from .routing.adaptive import AdaptivePolicy
    from .routing.cost_model import CostModel
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    model, hw = model_name(config.model), hardware_info()
    given = deployment.cost_model
    if isinstance(given, CostProfile):
        given = given.to_dict()
    if given is not None:
        prof = CostProfile.from_json(given, model=model, hardware=hw)
        how = f"from {given}" if isinstance(given, (str, os.PathLike)) else "as given"
    else:
        stored = os.path.join(profile_dir(), default_output(model, hw))
        if os.path.exists(stored):
            prof, how = CostProfile.from_json(stored, model=model, hardware=hw), f"stored ({stored})"
        else:
            from .perf.profiler import profile_config
            t0 = time.perf_counter()
            prof = profile_config(config, quick=True)
            prof.save(stored)
            how = f"measured at start-up in {time.perf_counter() - t0:.0f} s (saved to {stored})"
    log(f"adaptive routing: cost model of {prof.model} on {prof.hardware_label} {how}; "
        f"SLOs TTFT {deployment.slo_ttft_ms:g} ms, TPOT {deployment.slo_tpot_ms:g} ms")
    # (its steps at this deployment's own CUDA-graph buckets: its budget, eager or not)
    cost = CostModel(prof, config.max_num_batched_tokens,
                     graph_sizes=deployment_graph_sizes(prof, config))
    return AdaptivePolicy(cost, deployment.slo_ttft_ms, deployment.slo_tpot_ms)
