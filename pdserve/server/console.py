"""What `pdserve serve` prints to its console (stderr): a start-up summary of the deployment
(model, dtype, devices, KV pools, CUDA graphs), then every --log-stats-interval seconds while
there is traffic a stats line, as vLLM's engine logs one: prompt and generation throughput over
the interval, sequences running and waiting, KV use and the prefix cache's hit rate over the
interval. The line reads the server's own Prometheus counters and the workers' last stats."""
from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Callable, TextIO


def startup_summary(router, model_name: str, sampling_defaults: dict | None = None,
                    defaults_source: str | None = None) -> list[str]:
    """One line for the model, one for the default sampling values requests get (from
    defaults_source, a generation_config.json), one per worker: role, device and TP, dtype,
    KV pool, its host tier, graphs."""
    ws = list(router.workers.values())
    lines = [f"pdserve: model {model_name!r}, {len(ws)} worker{'s' * (len(ws) != 1)}, "
             f"max_model_len {router.max_model_len}"]
    if sampling_defaults:
        values = ", ".join(f"{k}={v}" for k, v in sampling_defaults.items())
        lines.append(f"pdserve: default sampling values from {defaults_source}: {values} (a "
                     "request's own values override them; --generation-config vllm ignores "
                     "the file)")
    else:
        lines.append("pdserve: default sampling values: pdserve's own (no generation config)")
    for w in ws:
        cfg, info = w.spec.config, w.client.info
        tokens = info.num_kv_blocks * info.block_size
        graphs = (f"CUDA graphs on (prefill steps <= {cfg.graph_max_tokens} tokens)"
                  if cfg.use_cuda_graphs else "no CUDA graphs")
        lines.append(
            f"  {w.spec.name}: {w.spec.role} on {cfg.device} (TP {info.tensor_parallel_size}), "
            f"{str(cfg.torch_dtype).removeprefix('torch.')}, KV pool {info.num_kv_blocks} blocks "
            f"x {info.block_size} = {tokens} tokens "
            f"({info.kv_bytes_per_token_per_rank * tokens / 2 ** 30:.2f} GiB per rank), "
            f"{_host_tier(info)}, "
            f"prefix caching {'on' if cfg.enable_prefix_caching else 'off'}, {graphs}")
    return lines


def _host_tier(info) -> str:
    n = getattr(info, "num_host_blocks", 0)
    if not n:
        return "no host tier"
    block = info.kv_bytes_per_token_per_rank * info.block_size
    return f"host tier {n} blocks ({n * block / 2 ** 30:.2f} GiB per rank)"


@dataclass
class _Snapshot:
    t: float
    prompt_tokens: float
    generation_tokens: float
    prefix_queries: int
    prefix_hits: int


class StatsLine:
    """The stats line of the interval since the previous call of `line` (None when nothing
    happened in it and nothing is running or waiting: an idle server stays quiet).
    counter(name) reads a counter of the server's registry; stats() the workers' summed
    WorkerStats (or None)."""

    def __init__(self, counter: Callable[[str], float], stats: Callable[[], object],
                 clock: Callable[[], float] = time.monotonic):
        self.counter, self.stats, self.clock = counter, stats, clock
        self.last = self._snapshot(self.stats())

    def _snapshot(self, s) -> _Snapshot:
        return _Snapshot(self.clock(), self.counter("pdserve:prompt_tokens_total"),
                         self.counter("pdserve:generation_tokens_total"),
                         s.prefix_cache_queries if s else 0, s.prefix_cache_hits if s else 0)

    def line(self) -> str | None:
        s = self.stats()
        now, prev = self._snapshot(s), self.last
        self.last = now
        dt = max(now.t - prev.t, 1e-9)
        running, waiting = (s.num_running, s.num_waiting) if s else (0, 0)
        prompt = now.prompt_tokens - prev.prompt_tokens
        gen = now.generation_tokens - prev.generation_tokens
        if not (prompt or gen or running or waiting):
            return None
        kv = 100.0 * s.num_kv_blocks_used / s.num_kv_blocks if s and s.num_kv_blocks else 0.0
        queries = now.prefix_queries - prev.prefix_queries
        hits = now.prefix_hits - prev.prefix_hits
        rate = f"{100.0 * hits / queries:.1f}%" if queries > 0 else "-"
        return (f"pdserve: prompt {prompt / dt:.1f} tok/s, generation {gen / dt:.1f} tok/s, "
                f"running {running}, waiting {waiting}, KV cache {kv:.1f}% used, "
                f"prefix cache hit rate {rate}")


async def log_stats(line: StatsLine, interval_s: float, out: TextIO = sys.stderr) -> None:
    """Print line.line() every interval_s seconds (when it has something to say), forever."""
    while True:
        await asyncio.sleep(interval_s)
        text = line.line()
        if text is not None:
            print(text, file=out, flush=True)
