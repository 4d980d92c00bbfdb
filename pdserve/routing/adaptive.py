"""The adaptive routing policy: per request, the path the cost model says serves it within the
SLO at the least harm to the requests already running.

For a request of L prompt tokens and predicted output O (the router core's length predictor),
every path among the live workers is a candidate:

    whole on W         any worker, of any role (a prefill worker runs a request whole as any
                       engine would; a decode worker too)
    P prefills, D decodes   every prefill worker x every decode worker (only when the request
                       may be disaggregated: policies.disaggregable)

Each gets an Estimate from the cost model (cost_model.py): TTFT, TPOT and how many requests
already decoding there it would push over the TPOT SLO. The choice, in order:

  1. the paths whose own TTFT and TPOT meet the SLOs, scored 1 - harmed (the number of requests
     that meet the SLO with this choice, relative to not serving it), the best score first;
     among equals the one with the most headroom (the smallest max(TTFT / SLO, TPOT / SLO)),
     then the lowest predicted end-to-end latency (TTFT + (O - 1) * TPOT), then whole before
     split and a collocated worker before a decode worker. A whole request on a prefill worker
     takes part here only when no other path meets the SLOs: its decode steps would slow every
     prefill behind it, a cost to later arrivals the estimate does not count;
  2. no path meets them: the lowest predicted end-to-end latency, among every path.

A worker whose KV pool is nearly full (kv_usage >= kv_full) is a candidate only when every
worker is. SLO defaults are the serving benchmark's (TTFT 500 ms, TPOT 50 ms).

The policy keeps each placed request's estimate until the core reports it finished
(observe_request), so /metrics can show predicted against observed TTFT and TPOT; the step and
transfer observations correct the cost model itself (CostModel.observe_step / observe_transfer).
"""
from __future__ import annotations

from collections import Counter, OrderedDict

from ..checks import check_number
from .cost_model import CostModel, Estimate, WorkerLoad
from .policies import Path, PathKind, RouteRequest, RoutingPolicy, WorkerView

DEFAULT_SLO_TTFT_MS = 500.0
DEFAULT_SLO_TPOT_MS = 50.0
KV_FULL = 0.98
_PREDICTIONS_KEPT = 65536     # placed requests whose estimate waits for their outcome
_ROLE_RANK = {"collocated": 0, "decode": 1, "prefill": 2}


class AdaptivePolicy(RoutingPolicy):
    name = "adaptive"
    wants_load = True             # the core fills WorkerView.load and RouteRequest's prediction

    def __init__(self, cost_model: CostModel | None = None,
                 slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS,
                 slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS, kv_full: float = KV_FULL,
                 **thresholds):
        super().__init__(**thresholds)
        if not isinstance(cost_model, CostModel):
            raise ValueError("the adaptive routing policy needs a cost model: a profile from "
                             "`pdserve profile` (--cost-model FILE)")
        check_number("slo_ttft_ms", slo_ttft_ms)
        check_number("slo_tpot_ms", slo_tpot_ms)
        if not 0 < kv_full <= 1:
            raise ValueError(f"kv_full must be in (0, 1], got {kv_full!r}")
        self.cost = cost_model
        self.slo_ttft_ms, self.slo_tpot_ms, self.kv_full = float(slo_ttft_ms), float(slo_tpot_ms), kv_full
        self.decisions: Counter = Counter()       # "collocated" / "disagg" / "fallback"
        self._predicted: OrderedDict[str, tuple[Estimate, float]] = OrderedDict()

    # ---- the choice -------------------------------------------------------------------------
    def candidates(self, req: RouteRequest, workers: list[WorkerView]) -> list[tuple[Path, Estimate]]:
        usable = [w for w in workers if w.kv_usage < self.kv_full] or workers
        n = req.num_prompt_tokens
        out = req.predicted_output_tokens
        if out is None:
            out = float(req.params.max_tokens)
        cm, slo = self.cost, self.slo_tpot_ms

        def uncached(w: WorkerView) -> int:   # (the last prompt token is always computed)
            return n - min(w.cached, n - 1)

        paths = [(Path(PathKind.COLLOCATED, w.name),
                  cm.collocated(w.name, w.load or WorkerLoad(), n, uncached(w), out, slo))
                 for w in usable]
        if req.disaggregable:
            for p in (w for w in usable if w.role == "prefill"):
                for d in (w for w in usable if w.role == "decode"):
                    paths.append((Path(PathKind.DISAGG, d.name, p.name), cm.disaggregated(
                        p.name, p.load or WorkerLoad(), uncached(p), d.name, d.load or WorkerLoad(),
                        n, min(d.cached, n), out, slo)))
        return paths

    def meets(self, est: Estimate) -> bool:
        return est.ttft_ms <= self.slo_ttft_ms and (est.tpot_ms is None or est.tpot_ms <= self.slo_tpot_ms)

    def headroom(self, est: Estimate) -> float:
        return max(est.ttft_ms / self.slo_ttft_ms, (est.tpot_ms or 0.0) / self.slo_tpot_ms)

    def choose(self, req: RouteRequest, workers: list[WorkerView]) -> Path | None:
        paths = self.candidates(req, workers)
        if not paths:
            return None
        out = req.predicted_output_tokens or float(req.params.max_tokens)
        role = {w.name: w.role for w in workers}

        def rank(path: Path) -> int:   # whole on collocated, decode, prefill; split last
            return 3 if path.kind == PathKind.DISAGG else _ROLE_RANK[role[path.worker]]

        ok = [(p, e) for p, e in paths if self.meets(e)]
        preferred = [(p, e) for p, e in ok if rank(p) != _ROLE_RANK["prefill"]]
        ok = preferred or ok
        if ok:
            path, est = min(ok, key=lambda pe: (pe[1].harmed, round(self.headroom(pe[1]), 9),
                                                 round(pe[1].e2e_ms(out), 6), rank(pe[0])))
            self.decisions[PathKind(path.kind).value] += 1
        else:
            path, est = min(paths, key=lambda pe: (pe[1].e2e_ms(out), pe[1].harmed))
            self.decisions["fallback"] += 1
        self._predicted[req.request_id] = (est, out)
        if len(self._predicted) > _PREDICTIONS_KEPT:
            self._predicted.popitem(last=False)
        return path

    # ---- outcomes ---------------------------------------------------------------------------
    def observe_request(self, request_id: str, ttft_ms: float | None, tpot_ms: float | None) -> None:
        """A placed request finished: its observed TTFT / TPOT against the estimate it was
        placed with (a rerouted request's last placement)."""
        kept = self._predicted.pop(request_id, None)
        if kept is None:
            return
        est, _ = kept
        if ttft_ms is not None:
            self.cost.observe_latency("ttft", ttft_ms, est.ttft_ms)
        if tpot_ms is not None and est.tpot_ms is not None:
            self.cost.observe_latency("tpot", tpot_ms, est.tpot_ms)

    def forget(self, request_id: str) -> None:
        self._predicted.pop(request_id, None)
