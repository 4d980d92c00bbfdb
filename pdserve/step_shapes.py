"""The token counts a GPU step runs at: CUDA graphs are captured for a fixed set of token
counts (buckets), and a step with prefill tokens is padded up to the smallest bucket that holds
it; past the largest, or without graphs, it runs eagerly at its own count. Padding tokens are
computed like any other (their KV goes to the scratch block), so a step costs what its bucket
costs. Plain Python: one source for what worker/cuda_graph.py captures and for the cost model's
step shapes (perf/cost_fit.py fits on them, sim/runner.py evaluates steps at them).

    mixed_sizes(max_tokens)    the buckets of steps with prefill tokens, up to max_tokens
    uses_cuda_graphs(config)   whether a configuration (EngineConfig, or a profile's
                               engine_config dict) runs CUDA graphs
    graph_max_tokens(config)   its largest graphed step with prefill tokens
    graph_bucket(t, sizes)     the bucket a step of t tokens replays (None: eager)
    padded_tokens(t, sizes)    the tokens a step of t tokens runs at

Decode-only steps are padded too (to CUDAGraphRunner's decode batch sizes, 8 apart); the cost
model leaves that out, a few sequences' worth of a decode step.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Any, Mapping, Sequence

# Default bound on the steps with prefill tokens that CUDA graphs cover: past ~8k tokens a step's
# GPU time (tens of ms) dwarfs its launch overhead, and graph memory grows with the tokens.
MAX_GRAPH_TOKENS = 8192
# Mixed-step token buckets: ~1.5x apart, so padding wastes at most a third of a step's work.
MIXED_SIZES = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
               6144, 8192)


def mixed_sizes(max_tokens: int) -> list[int]:
    """Token buckets for steps with prefill tokens, up to max_tokens (the step's token budget,
    itself a bucket so that a full step is graphed too). Empty for max_tokens 0."""
    if max_tokens <= 0:
        return []
    sizes = [s for s in MIXED_SIZES if s < max_tokens]
    return sizes + [max_tokens]


def _getter(config: Any):
    if isinstance(config, Mapping):
        return config.get
    return lambda k, default=None: getattr(config, k, default)


def resolve_attention_backend(backend: str, cuda: bool) -> str:
    """The attention backend a configuration runs: "auto" is Triton on CUDA, torch elsewhere."""
    if backend == "auto":
        return "triton" if cuda else "torch"
    return backend


def uses_cuda_graphs(config: Any) -> bool:
    """Whether a configuration runs CUDA graphs: an EngineConfig, or a mapping of its fields (a
    profile's engine_config; a missing field takes EngineConfig's default). They need CUDA, no
    enforce_eager and the Triton attention backend."""
    get = _getter(config)
    device = get("device", "cpu")
    cuda = isinstance(device, str) and device.startswith("cuda")
    return (cuda and not get("enforce_eager", False)
            and resolve_attention_backend(get("attention_backend", "auto"), cuda) == "triton")


def graph_max_tokens(config: Any) -> int:
    """The largest step with prefill tokens that runs as a CUDA graph under a configuration (as
    uses_cuda_graphs takes it; 0: none): the token budget, at most cuda_graph_max_tokens when
    that is set, else at most MAX_GRAPH_TOKENS."""
    if not uses_cuda_graphs(config):
        return 0
    get = _getter(config)
    budget = get("max_num_batched_tokens", 2048)
    cap = get("cuda_graph_max_tokens", None)
    return min(budget, MAX_GRAPH_TOKENS if cap is None else cap)


def graph_bucket(num_tokens: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the sorted buckets `sizes` that holds a step of num_tokens (>= 1), or
    None when none does (the step runs eagerly)."""
    i = bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None


def padded_tokens(num_tokens: int, sizes: Sequence[int]) -> int:
    """The tokens a step of num_tokens runs at: its graph bucket, or num_tokens itself (eager,
    or an empty step) when there is none."""
    if num_tokens <= 0:
        return num_tokens
    bucket = graph_bucket(num_tokens, sizes)
    return num_tokens if bucket is None else bucket
