"""Routing: which worker runs each request, and the router that drives a deployment.

    policies.py     RoutingPolicy (contract in its docstring) and the registry; the P/D
                    eligibility rule (disaggregable)
    prefix_index.py PrefixIndex: the router's per-worker guess at the workers' prefix caches
    router_core.py  the pure core: request stages, hand-offs, held KV, faults (events in,
                    actions out)
    client.py       EngineProtocol / WorkerClient: what front ends and the router drive
    workers.py      the deployment plan (WorkerSpec, plan_workers), RestartPolicy, worker slots
    router.py       Router: the shell over EngineClients (processes, zmq, KV pairing, restarts)

The pure names import at once; the shell's (Router, WorkerSpec, plan_workers, RestartPolicy,
WorkerHealth) on first use, so that importing the core pulls in neither torch nor zmq.
"""
from .client import EngineProtocol, WorkerClient
from .policies import (POLICIES, ROLES, CollocatedPolicy, DisaggPolicy, Path, PathKind,
                       RoundRobinPolicy, RouteRequest, RoutingPolicy, StepSummary, WorkerView,
                       disaggregable, make_policy)
from .prefix_index import PrefixIndex
from .router_core import RouterCore, RouterStats, Stage, Unavailable

_SHELL = {"Router": "router", "WorkerSpec": "workers", "plan_workers": "workers",
          "RestartPolicy": "workers", "WorkerHealth": "workers"}

__all__ = ["EngineProtocol", "WorkerClient", "POLICIES", "ROLES", "CollocatedPolicy",
           "DisaggPolicy", "Path", "PathKind", "RoundRobinPolicy", "RouteRequest",
           "RoutingPolicy", "StepSummary", "WorkerView", "disaggregable", "make_policy",
           "PrefixIndex", "RouterCore", "RouterStats", "Stage", "Unavailable", *_SHELL]


def __getattr__(name: str):
    if name in _SHELL:
        import importlib
        return getattr(importlib.import_module(f".{_SHELL[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
