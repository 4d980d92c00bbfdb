"""Prometheus metrics of the server, named `pdserve:...` (vLLM's style). Request latencies are
measured here, at the HTTP front, where a client feels them; running/waiting/KV come from the
worker's stats after its last step."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdserve:request_success", "Finished requests by finish reason",
                                ["finished_reason"], registry=r)
        self.failed = Counter("pdserve:request_failure", "Requests that ended in an error",
                              registry=r)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Tokens generated",
                                         registry=r)
        self.running = Gauge("pdserve:num_requests_running", "Sequences running", registry=r)
        self.waiting = Gauge("pdserve:num_requests_waiting", "Sequences waiting", registry=r)
        self.kv_used = Gauge("pdserve:kv_cache_blocks_used", "KV blocks in use", registry=r)
        self.kv_total = Gauge("pdserve:kv_cache_blocks_total", "KV blocks in the pool", registry=r)
        self.preemptions = Gauge("pdserve:num_preemptions", "Preemptions so far", registry=r)
        # (gauges set from the workers' running totals, as the preemption count is)
        self.prefix_queries = Gauge("pdserve:prefix_cache_queries",
                                    "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Gauge("pdserve:prefix_cache_hits",
                                 "Prompt tokens found in the prefix cache", registry=r)
        self.prefix_blocks = Gauge("pdserve:prefix_cache_blocks",
                                   "KV blocks held by the prefix cache", registry=r)
        self.ttft = Histogram("pdserve:time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve:time_per_output_token_seconds",
                              "(e2e - TTFT) / (output tokens - 1) per request",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve:inter_token_latency_seconds",
                             "Time between two chunks of a stream", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram("pdserve:e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        # P/D deployments (a Router): requests per path, KV hand-offs (totals since start)
        self.path_requests = Gauge("pdserve:requests_by_path", "Requests routed per path",
                                   ["path"], registry=r)
        self.kv_transfers = Gauge("pdserve:kv_transfers", "KV pulls completed", registry=r)
        self.kv_transfer_bytes = Gauge("pdserve:kv_transfer_bytes",
                                       "KV bytes pulled (decode workers' rank 0)", registry=r)
        self.kv_transfer_seconds = Gauge("pdserve:kv_transfer_seconds",
                                         "Time spent in KV pulls", registry=r)
        self.kv_transfer_failures = Gauge("pdserve:kv_transfer_failures",
                                          "KV pulls that failed or timed out (recomputed)",
                                          registry=r)
        self.fault_requests = Gauge("pdserve:requests_after_worker_death",
                                    "Requests caught by a worker's death: routed again, handed "
                                    "off without KV (recomputed) or failed", ["outcome"],
                                    registry=r)

        # the router's models: the output-length predictor, the adaptive policy's cost model
        self.length_mae = Gauge("pdserve:output_length_mae", "Mean absolute error of the output-"
                                "length prediction made before each request ran, and of the "
                                "global mean's", ["predictor"], registry=r)
        self.cost_error = Gauge("pdserve:cost_model_error", "Mean |observed / predicted - 1| "
                                "per term (steps before correction, transfer, TTFT, TPOT)",
                                ["term"], registry=r)
        self.cost_samples = Gauge("pdserve:cost_model_samples", "Observations per term",
                                  ["term"], registry=r)
        self.cost_factor = Gauge("pdserve:cost_model_correction", "Online correction factor "
                                 "per worker and step kind", ["worker", "kind"], registry=r)
        self.decisions = Gauge("pdserve:routing_decisions", "Adaptive policy's choices: a path "
                               "meeting the SLOs (collocated, disagg) or the fallback",
                               ["decision"], registry=r)

        self.worker_up = Gauge("pdserve:worker_up", "1 while a worker serves, 0 while it is dead "
                               "or restarting", ["worker", "role", "state"], registry=r)
        self.worker_restarts = Gauge("pdserve:worker_restarts", "Restarts of a worker so far",
                                     ["worker"], registry=r)

    def update_workers(self, health) -> None:
        """From Router.health(): one series per worker, labelled with its state now."""
        self.worker_up.clear()
        for h in health:
            self.worker_up.labels(h.name, h.role, h.state).set(1 if h.state == "up" else 0)
            self.worker_restarts.labels(h.name).set(h.restarts)

    def update_routes(self, rs) -> None:
        """From a Router's RouterStats."""
        for path, n in rs.requests.items():
            self.path_requests.labels(path).set(n)
        self.kv_transfers.set(rs.transfers)
        self.kv_transfer_bytes.set(rs.transfer_bytes)
        self.kv_transfer_seconds.set(rs.transfer_seconds)
        self.kv_transfer_failures.set(rs.transfer_failures)
        for outcome in ("rerouted", "recomputed", "failed"):
            self.fault_requests.labels(outcome).set(getattr(rs, outcome))

    def update_models(self, ms: dict) -> None:
        """From a Router's model_stats."""
        pred = ms.get("predictor")
        if pred and pred["mae"] is not None:
            self.length_mae.labels("pdserve").set(pred["mae"])
            self.length_mae.labels("global_mean").set(pred["baseline_mae"])
        for term, e in ms.get("cost_errors", {}).items():
            self.cost_error.labels(term).set(e["mean_abs_rel_err"])
            self.cost_samples.labels(term).set(e["n"])
        for key, f in ms.get("cost_factors", {}).items():
            worker, _, kind = key.rpartition(":")
            self.cost_factor.labels(worker, kind).set(f)
        for decision, n in ms.get("decisions", {}).items():
            self.decisions.labels(decision).set(n)

    def update_stats(self, stats) -> None:
        if stats is not None:
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            self.kv_used.set(stats.num_kv_blocks_used)
            self.kv_total.set(stats.num_kv_blocks)
            self.preemptions.set(stats.num_preemptions)
            self.prefix_queries.set(stats.prefix_cache_queries)
            self.prefix_hits.set(stats.prefix_cache_hits)
            self.prefix_blocks.set(stats.prefix_cache_blocks)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One engine request's latencies, fed with each output as it arrives."""

    def __init__(self, metrics: Metrics):
        self.m = metrics
        self.arrival = self.last = time.perf_counter()
        self.first: float | None = None
        self.tokens = 0

    def on_output(self, out) -> None:
        now = time.perf_counter()
        n = sum(len(o.new_token_ids) for o in out.outputs)
        if n:
            if self.first is None:
                self.first = now
                self.m.ttft.observe(now - self.arrival)
            else:
                self.m.itl.observe(now - self.last)
            self.last = now
            self.tokens += n
            self.m.generation_tokens.inc(n)
        if out.finished:
            self.m.prompt_tokens.inc(len(out.prompt_token_ids))
            self.m.e2e.observe(now - self.arrival)
            per_seq = self.tokens / max(1, len(out.outputs))
            if self.first is not None and per_seq > 1:
                self.m.tpot.observe((now - self.first) / (per_seq - 1))
            for o in out.outputs:
                self.m.requests.labels(o.finish_reason or "abort").inc()
