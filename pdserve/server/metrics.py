"""Prometheus metrics of the server, named `pdserve:...` (vLLM's style, each with a model_name
label; totals are counters, levels gauges). Request latencies are measured here, at the HTTP
front, where a client feels them; the phases of a request (queue, prefill, decode, inference)
from the engine's own times of it, which only the engine knows (when it was first scheduled);
running/waiting/KV come from the worker's stats after its last step, the P/D and routing
totals from the router."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..outputs import request_phases

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _Labelled:
    """A metric with labels of its own, bound to one model_name: labels(*values) adds it."""

    def __init__(self, metric, model_name: str):
        self._metric, self._model = metric, model_name

    def labels(self, *values):
        return self._metric.labels(*values, self._model)

    def clear(self) -> None:
        self._metric.clear()


class _Total:
    """A Prometheus counter fed with a running total that lives elsewhere (a worker's or the
    router's): set_total(v) adds what v grew by since the last call. A total that went down
    (a worker died or restarted: its count left the sum) adds nothing; counting resumes from it."""

    def __init__(self, counter):
        self._counter, self._last = counter, 0.0

    def set_total(self, v: float) -> None:
        if v > self._last:
            self._counter.inc(v - self._last)
        self._last = v


class Metrics:
    """Every series carries model_name (the served name), as vLLM's do. Totals are counters
    (exposed with _total), levels are gauges."""

    def __init__(self, model_name: str = "pdserve"):
        self.model_name = model_name
        r = self.registry = CollectorRegistry()

        def metric(kind, name, doc, labels=(), **kw):
            m = kind(name, doc, [*labels, "model_name"], registry=r, **kw)
            return _Labelled(m, model_name) if labels else m.labels(model_name)

        def total(name, doc, labels=()):
            if not labels:
                return _Total(metric(Counter, name, doc))
            m = metric(Counter, name, doc, labels)
            totals: dict = {}

            def by(*values):
                if values not in totals:
                    totals[values] = _Total(m.labels(*values))
                return totals[values]
            return by

        self.requests = metric(Counter, "pdserve:request_success",
                               "Finished requests by finish reason", ["finished_reason"])
        self.failed = metric(Counter, "pdserve:request_failure", "Requests that ended in an error")
        self.prompt_tokens = metric(Counter, "pdserve:prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = metric(Counter, "pdserve:generation_tokens", "Tokens generated")
        self.running = metric(Gauge, "pdserve:num_requests_running", "Sequences running")
        self.waiting = metric(Gauge, "pdserve:num_requests_waiting", "Sequences waiting")
        self.kv_used = metric(Gauge, "pdserve:kv_cache_blocks_used", "KV blocks in use")
        self.kv_total = metric(Gauge, "pdserve:kv_cache_blocks_total", "KV blocks in the pool")
        self.kv_usage = metric(Gauge, "pdserve:kv_cache_usage_perc",
                               "Fraction of the KV pool in use (1 = full), as vLLM's")
        self.preemptions = total("pdserve:num_preemptions", "Preemptions")
        self.prefix_queries = total("pdserve:prefix_cache_queries",
                                    "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = total("pdserve:prefix_cache_hits",
                                 "Prompt tokens found in the prefix cache")
        self.prefix_blocks = metric(Gauge, "pdserve:prefix_cache_blocks",
                                    "KV blocks held by the prefix cache")
        # the KV cache's host tier (--swap-space)
        self.host_total = metric(Gauge, "pdserve:kv_host_blocks", "KV blocks in the host tier")
        self.host_used = metric(Gauge, "pdserve:kv_host_blocks_used",
                                "Host-tier KV blocks held by swapped-out requests or cached "
                                "prefixes")
        self.swapped = total("pdserve:kv_blocks_swapped", "KV blocks copied by swap preemption, "
                             "out to the host tier or back in", ["direction"])
        self.offloaded = total("pdserve:kv_blocks_offloaded",
                               "Prefix-cache KV blocks evicted from the device into the host tier")
        self.loaded_back = total("pdserve:kv_blocks_loaded_back",
                                 "Prefix-cache KV blocks copied back from the host tier")
        self.prefix_host_hits = total("pdserve:prefix_cache_host_hits",
                                      "Prompt tokens found in the prefix cache's host tier (also "
                                      "counted in prefix_cache_hits)")
        self.ttft = metric(Histogram, "pdserve:time_to_first_token_seconds",
                           "Time to first token", buckets=_LATENCY_BUCKETS)
        self.tpot = metric(Histogram, "pdserve:time_per_output_token_seconds",
                           "(e2e - TTFT) / (output tokens - 1) per request",
                           buckets=_LATENCY_BUCKETS)
        self.itl = metric(Histogram, "pdserve:inter_token_latency_seconds",
                          "Time between two chunks of a stream", buckets=_LATENCY_BUCKETS)
        self.e2e = metric(Histogram, "pdserve:e2e_request_latency_seconds",
                          "Arrival to last token", buckets=_LATENCY_BUCKETS)
        self.admission = metric(Histogram, "pdserve:request_admission_seconds",
                                "HTTP request received (headers read) to its engine request "
                                "added: the body, parsing, checks, tokenizing and templates",
                                buckets=_LATENCY_BUCKETS)
        # vLLM's request phases, from the engine's times (RequestOutput.metrics)
        self.queue_time = metric(Histogram, "pdserve:request_queue_time_seconds",
                                 "Arrival to first scheduled (time in the waiting queue)",
                                 buckets=_LATENCY_BUCKETS)
        self.prefill_time = metric(Histogram, "pdserve:request_prefill_time_seconds",
                                   "First scheduled to first token", buckets=_LATENCY_BUCKETS)
        self.decode_time = metric(Histogram, "pdserve:request_decode_time_seconds",
                                  "First token to last token", buckets=_LATENCY_BUCKETS)
        self.inference_time = metric(Histogram, "pdserve:request_inference_time_seconds",
                                     "First scheduled to last token", buckets=_LATENCY_BUCKETS)
        # P/D deployments (a Router): requests per path, KV hand-offs
        self.path_requests = total("pdserve:requests_by_path", "Requests routed per path",
                                   ["path"])
        self.kv_transfers = total("pdserve:kv_transfers", "KV pulls completed")
        self.kv_transfer_bytes = total("pdserve:kv_transfer_bytes",
                                       "KV bytes pulled (decode workers' rank 0)")
        self.kv_transfer_seconds = total("pdserve:kv_transfer_seconds", "Time spent in KV pulls")
        self.kv_transfer_failures = total("pdserve:kv_transfer_failures",
                                          "KV pulls that failed or timed out (recomputed)")
        # every worker's engine steps by kind (prefill, decode, mixed: the cost model's terms)
        self.steps = total("pdserve:engine_steps", "Engine steps (forwards) per worker and kind: "
                           "prompt tokens only (prefill), decodes only (decode), or both (mixed)",
                           ["worker", "kind"])
        self.step_wall = total("pdserve:engine_step_wall_seconds", "Host time of those steps "
                               "(schedule to tokens applied)", ["worker", "kind"])
        self.step_gpu = total("pdserve:engine_step_gpu_seconds", "Device time of those steps "
                              "(CUDA events from the forward through sampling; GPU workers "
                              "only)", ["worker", "kind"])
        self.step_gpu_steps = total("pdserve:engine_steps_gpu_timed", "Steps whose device time "
                                    "was measured (the denominator of engine_step_gpu_seconds)",
                                    ["worker", "kind"])
        self.step_tokens = total("pdserve:engine_step_tokens", "Tokens fed by those steps, prompt "
                                 "(prefill) or one per decoding sequence (decode)",
                                 ["worker", "kind", "phase"])
        self.fault_requests = total("pdserve:requests_after_worker_death",
                                    "Requests caught by a worker's death: routed again, handed "
                                    "off without KV (recomputed) or failed", ["outcome"])

        # the router's models: the output-length predictor, the adaptive policy's cost model
        self.length_mae = metric(Gauge, "pdserve:output_length_mae", "Mean absolute error of the "
                                 "output-length prediction made before each request ran, and "
                                 "of the global mean's", ["predictor"])
        self.cost_error = metric(Gauge, "pdserve:cost_model_error", "Mean |observed / predicted - "
                                 "1| per term (steps before correction, transfer, TTFT, TPOT)",
                                 ["term"])
        self.cost_samples = metric(Gauge, "pdserve:cost_model_samples", "Observations per term",
                                   ["term"])
        self.cost_factor = metric(Gauge, "pdserve:cost_model_correction", "Online correction "
                                  "factor per worker and step kind", ["worker", "kind"])
        self.decisions = total("pdserve:routing_decisions", "Adaptive policy's choices: a path "
                               "meeting the SLOs (collocated, disagg) or the fallback",
                               ["decision"])

        self.worker_up = metric(Gauge, "pdserve:worker_up", "1 while a worker serves, 0 while it "
                                "is dead or restarting", ["worker", "role", "state"])
        self.worker_restarts = metric(Gauge, "pdserve:worker_restarts",
                                      "Restarts of a worker so far", ["worker"])

    def sample(self, name: str, **labels) -> float | None:
        """A sample's value by its exposed name (e.g. pdserve:prompt_tokens_total), None if none."""
        return self.registry.get_sample_value(name, {**labels, "model_name": self.model_name})

    def update_workers(self, health) -> None:
        """From Router.health(): one series per worker, labelled with its state now."""
        self.worker_up.clear()
        for h in health:
            self.worker_up.labels(h.name, h.role, h.state).set(1 if h.state == "up" else 0)
            self.worker_restarts.labels(h.name).set(h.restarts)

    def update_routes(self, rs) -> None:
        """From a Router's RouterStats."""
        for path, n in rs.requests.items():
            self.path_requests(path).set_total(n)
        self.kv_transfers.set_total(rs.transfers)
        self.kv_transfer_bytes.set_total(rs.transfer_bytes)
        self.kv_transfer_seconds.set_total(rs.transfer_seconds)
        self.kv_transfer_failures.set_total(rs.transfer_failures)
        for outcome in ("rerouted", "recomputed", "failed"):
            self.fault_requests(outcome).set_total(getattr(rs, outcome))
        for (worker, kind), t in rs.steps.items():
            self.steps(worker, kind).set_total(t.steps)
            self.step_wall(worker, kind).set_total(t.wall_ms / 1e3)
            self.step_gpu(worker, kind).set_total(t.gpu_ms / 1e3)
            self.step_gpu_steps(worker, kind).set_total(t.gpu_steps)
            self.step_tokens(worker, kind, "prefill").set_total(t.prefill_tokens)
            self.step_tokens(worker, kind, "decode").set_total(t.decode_tokens)

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
            self.decisions(decision).set_total(n)

    def update_stats(self, stats) -> None:
        if stats is not None:
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            self.kv_used.set(stats.num_kv_blocks_used)
            self.kv_total.set(stats.num_kv_blocks)
            self.kv_usage.set(stats.num_kv_blocks_used / stats.num_kv_blocks
                              if stats.num_kv_blocks else 0.0)
            self.preemptions.set_total(stats.num_preemptions)
            self.prefix_queries.set_total(stats.prefix_cache_queries)
            self.prefix_hits.set_total(stats.prefix_cache_hits)
            self.prefix_blocks.set(stats.prefix_cache_blocks)
            self.host_total.set(stats.num_host_blocks)
            self.host_used.set(stats.num_host_blocks_used)
            self.swapped("out").set_total(stats.blocks_swapped_out)
            self.swapped("in").set_total(stats.blocks_swapped_in)
            self.offloaded.set_total(stats.blocks_offloaded)
            self.loaded_back.set_total(stats.blocks_loaded_back)
            self.prefix_host_hits.set_total(stats.prefix_host_hits)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One engine request's latencies, fed with each output as it arrives."""

    def __init__(self, metrics: Metrics, start: float | None = None):
        """start: time.perf_counter() of the request's admission (default: now)."""
        self.m = metrics
        self.arrival = self.last = time.perf_counter() if start is None else start
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
            phases = request_phases(out.metrics)
            if phases is not None:
                self.m.queue_time.observe(phases.queue)
                self.m.prefill_time.observe(phases.prefill)
                self.m.decode_time.observe(phases.decode)
                self.m.inference_time.observe(phases.inference)
