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

from .args import DeploymentArgs
from .config import EngineConfig


def build(config: EngineConfig, deployment: DeploymentArgs | None = None,
          startup_timeout_s: float = 900.0):
    """An engine for config: with a deployment, a Router over its workers (one collocated
    worker when it counts none: a router turns a worker's death into errors for its requests
    and restarts it); else an in-process LLMEngine or an EngineClient over worker processes,
    as config.executor_backend says. ValueError for a bad configuration."""
    if deployment is None:
        if config.executor_backend == "mp":
            from .worker.client import EngineClient
            return EngineClient(config, startup_timeout_s)
        from .worker.llm_engine import LLMEngine
        return LLMEngine(config)
    from .routing import RestartPolicy, Router, plan_workers
    restart = RestartPolicy(max_restarts=deployment.worker_restarts,
                            backoff_s=deployment.restart_backoff_s)
    specs = plan_workers(config, *deployment.counts, deployment.prefill_tp,
                         deployment.decode_tp, deployment.collocated_tp,
                         deployment.kv_connector or config.kv_connector or "shared")
    return Router(specs, deployment.policy, startup_timeout_s, restart)
