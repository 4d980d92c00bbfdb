"""EngineConfig: everything `LLM(...)` / the CLI accept, frozen and validated on construction.

Importing it needs no torch (the engine core, plain Python, reads it)."""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .checks import check_int, check_number, is_int, is_number
from .step_shapes import graph_max_tokens, resolve_attention_backend, uses_cuda_graphs

if TYPE_CHECKING:
    import torch

# Importing this module must not import torch: the engine core (pure Python) reads the config.
# torch is imported where a torch object is made (torch_device, torch_dtype) or a GPU is counted.
DTYPES = ("float32", "float16", "bfloat16")
_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")
LOAD_FORMATS = ("auto", "dummy")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
EXECUTOR_BACKENDS = ("auto", "uni", "mp", "ray")
RAY_PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
KV_TRANSFER_MODES = ("sync", "async")
PREEMPTION_MODES = ("recompute", "swap")
KV_OFFLOAD_POLICIES = ("on-eviction", "write-through")
# No kernel assumes a block size: paged attention gathers a block id per key (no power of two, no
# multiple of its key tile; it compiles once per size) and the KV pull masks its boxes (its tests
# use 3). The cap is a sanity bound: a block is the least KV a sequence holds, so a larger block
# only wastes pool (up to block_size - 1 slots a sequence), and 10**6 would make even a
# one-block pool tens of GB.
MAX_BLOCK_SIZE = 1024
# Block ids travel as int32 (block tables), the scratch block included (id num_kv_blocks).
MAX_NUM_KV_BLOCKS = 2 ** 31 - 2


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None            # HF folder, .gguf file, preset name; None = embedded SmolLM2
    load_format: str = "auto"           # "auto" (weights from the files) or "dummy" (seeded random)
    dtype: str = "auto"                 # "auto": float32 on CPU, bfloat16 on CUDA
    device: str = "cpu"
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None    # explicit KV pool size; else from kv_cache_memory_gb
    kv_cache_memory_gb: float | None = None  # KV pool budget (CPU default 1 GiB)
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of GPU memory for weights + KV pool
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    max_model_len: int | None = None    # default: the model's context length, capped by the pool
    skip_tokenizer_init: bool = False
    tokenizer: str | None = None        # another tokenizer: HF folder, .gguf or cached repo id
    chat_template: str | None = None    # the chat template: a file, or the Jinja text itself
    # default sampling values (vLLM's --generation-config): "auto" from the model folder's
    # generation_config.json, "vllm" pdserve's own, else a folder holding that file
    # (loader/generation_config.py reads it; requests' own values override)
    generation_config: str = "auto"
    attention_backend: str = "auto"     # "auto": triton on CUDA, torch on CPU
    enforce_eager: bool = False         # CUDA: no CUDA graphs
    # Async scheduling: step() schedules and launches step N+1 before it reads step N's sampled
    # tokens (they stay on the device and feed N+1's inputs), so the host's work (stops,
    # detokenization, the next schedule) overlaps the device's. The tokens reach the caller
    # exactly as without it; steps that need the host to know the tokens first run in order
    # (penalties, min_tokens: engine/core.py). On CPU too (nothing overlaps there, the same
    # code runs). False: every step waits for its tokens before the next is scheduled.
    async_scheduling: bool = True
    # Prefix caching (engine/prefix_cache.py): KV of finished and preempted sequences stays in a
    # token-granular radix tree over the block pool, evicted least recently used when the pool
    # is short; a new sequence starts from its longest cached prefix.
    enable_prefix_caching: bool = True
    cuda_graph_max_batch: int = 512     # largest captured decode batch (capped by max_num_seqs)
    # largest step with prefill tokens replayed as a CUDA graph (None: the token budget, at most
    # step_shapes.MAX_GRAPH_TOKENS; 0: such steps run eagerly, decode graphs stay)
    cuda_graph_max_tokens: int | None = None
    tensor_parallel_size: int = 1       # ranks per worker (NCCL on CUDA, gloo on CPU)
    # "uni": the engine runs in the caller's process (tp 1 only); "mp": in worker processes the
    # caller talks to over messages; "ray": the same worker processes, each rank placed by Ray
    # on the cluster's nodes (worker/ray_launch.py); "auto": uni for tp 1, mp otherwise.
    distributed_executor_backend: str = "auto"
    # "ray": how a worker's ranks are spread over nodes (a Ray placement group strategy, one
    # bundle per rank): STRICT_PACK keeps a TP group on one node
    ray_placement_strategy: str = "STRICT_PACK"
    disable_custom_all_reduce: bool = False  # CUDA TP: NCCL for every all-reduce (no one-shot P2P)
    # P/D disaggregation (set by the router for its workers): how KV moves between workers
    # (a registered connector name, pdserve/disagg/connectors/), whether a consumer's pull runs
    # inside its step ("sync") or beside its steps ("async"), how long a pull may take before
    # the request is recomputed locally, and how long a producer keeps unclaimed KV.
    kv_connector: str | None = None
    kv_transfer_mode: str = "async"
    kv_transfer_timeout_s: float = 30.0
    kv_hold_timeout_s: float = 300.0
    max_kv_loads: int = 64              # consumer: pulls in flight at once
    # The KV cache's host tier (vLLM's --swap-space): GiB of host memory per worker rank for
    # swapped-out requests and offloaded prefix-cache blocks (pinned on CUDA); 0 = no host tier.
    swap_space_gb: float = 0.0
    # How a preempted request gives up its blocks: "recompute" (freed, its prompt computed
    # again), "swap" (copied to the host tier, copied back when it resumes; needs
    # swap_space_gb > 0), None: per victim, whichever the cost model says is cheaper.
    preemption_mode: str | None = None
    # When the prefix cache's KV reaches the host tier: "on-eviction" (copied when the device
    # pool evicts it; its blocks come free a step later) or "write-through" (copied when it is
    # cached; evicting it frees its device blocks at once). Needs swap_space_gb > 0 to matter.
    kv_offload_policy: str = "on-eviction"

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "cuda_graph_max_batch", "max_kv_loads"):
            check_int(name, getattr(self, name))
        check_int("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        check_int("max_model_len", self.max_model_len, allow_none=True)
        check_int("cuda_graph_max_tokens", self.cuda_graph_max_tokens, minimum=0, allow_none=True)
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be at most {MAX_BLOCK_SIZE}, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks > MAX_NUM_KV_BLOCKS:
            raise ValueError(f"num_kv_blocks must be at most {MAX_NUM_KV_BLOCKS} (block ids are "
                             f"int32), got {self.num_kv_blocks}")
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"model must be a path or a preset name, got {self.model!r}")
        for name in ("tokenizer", "chat_template"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (str, os.PathLike)) or not os.fspath(v)):
                raise ValueError(f"{name} must be None or a non-empty string, got {v!r}")
        if not isinstance(self.generation_config, (str, os.PathLike)) or not os.fspath(
                self.generation_config):
            raise ValueError("generation_config must be 'auto', 'vllm' or a folder, got "
                             f"{self.generation_config!r}")
        # torch.Generator.manual_seed takes [-2**63, 2**64)
        if not is_int(self.seed) or not -2 ** 63 <= self.seed < 2 ** 64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        for name in ("skip_tokenizer_init", "enforce_eager", "disable_custom_all_reduce",
                     "async_scheduling", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_memory_gb is not None and not (
                is_number(self.kv_cache_memory_gb) and 0 < self.kv_cache_memory_gb < math.inf):
            raise ValueError("kv_cache_memory_gb must be a positive finite number, got "
                             f"{self.kv_cache_memory_gb!r}")
        if not (is_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError("attention_backend must be auto, torch or triton, got "
                             f"{self.attention_backend!r}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError("distributed_executor_backend must be one of "
                             f"{EXECUTOR_BACKENDS}, got {self.distributed_executor_backend!r}")
        if self.ray_placement_strategy not in RAY_PLACEMENT_STRATEGIES:
            raise ValueError(f"ray_placement_strategy must be one of {RAY_PLACEMENT_STRATEGIES}, "
                             f"got {self.ray_placement_strategy!r}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size > 1 needs worker processes "
                             "(distributed_executor_backend 'mp' or 'auto')")
        if self.kv_connector is not None:
            from .disagg.connectors import check_connector_name
            check_connector_name(self.kv_connector)
        if self.kv_transfer_mode not in KV_TRANSFER_MODES:
            raise ValueError(f"kv_transfer_mode must be sync or async, got {self.kv_transfer_mode!r}")
        for name in ("kv_transfer_timeout_s", "kv_hold_timeout_s"):
            check_number(name, getattr(self, name))
        if not (is_number(self.swap_space_gb) and 0 <= self.swap_space_gb < math.inf):
            raise ValueError("swap_space_gb must be a finite number >= 0, got "
                             f"{self.swap_space_gb!r}")
        if self.preemption_mode is not None and self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be None or one of {PREEMPTION_MODES}, got "
                             f"{self.preemption_mode!r}")
        if self.preemption_mode == "swap" and not self.swap_space_gb:
            raise ValueError("preemption_mode 'swap' needs a host tier: set swap_space_gb > 0")
        if self.kv_offload_policy not in KV_OFFLOAD_POLICIES:
            raise ValueError(f"kv_offload_policy must be one of {KV_OFFLOAD_POLICIES}, got "
                             f"{self.kv_offload_policy!r}")
        self._check_device()

    def _check_device(self) -> None:
        m = _DEVICE.fullmatch(self.device) if isinstance(self.device, str) else None
        if m is None:
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        # (Ray: the GPUs are the ranks' nodes', each rank checks its own)
        if m.group(1) == "cuda" and self.distributed_executor_backend == "ray":
            if m.group(2) is not None:
                raise ValueError(f"device {self.device!r}: under Ray each rank gets its GPU "
                                 "from Ray; give device 'cuda'")
            return
        if m.group(1) == "cuda":
            import torch
            # (device_count asks NVML where it can: it leaves CUDA uninitialised in this process)
            n = torch.cuda.device_count()
            index = None if m.group(2) is None else int(m.group(2))
            if n == 0:
                raise ValueError(f"device {self.device!r}: no CUDA GPU is visible "
                                 "(torch.cuda.device_count() is 0)")
            if index is not None and index >= n:
                raise ValueError(f"device {self.device!r}: only {n} CUDA GPU(s) are visible "
                                 f"(cuda:0 to cuda:{n - 1})")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def torch_device(self) -> "torch.device":
        import torch
        return torch.device(self.device)

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend == "auto":
            return "uni" if self.tensor_parallel_size == 1 else "mp"
        return self.distributed_executor_backend

    def rank_device(self, rank: int) -> "torch.device":
        """The device of TP rank `rank`: on CUDA, consecutive GPUs from the configured one."""
        import torch
        d = self.torch_device
        if d.type != "cuda":
            return d
        return torch.device("cuda", (d.index or 0) + rank)

    @property
    def resolved_attention_backend(self) -> str:
        return resolve_attention_backend(self.attention_backend, self.is_cuda)

    @property
    def use_cuda_graphs(self) -> bool:
        return uses_cuda_graphs(self)

    @property
    def graph_max_tokens(self) -> int:
        """The largest step with prefill tokens that runs as a CUDA graph (0: none;
        step_shapes.graph_max_tokens)."""
        return graph_max_tokens(self)

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch
        name = self.dtype if self.dtype != "auto" else ("bfloat16" if self.is_cuda else "float32")
        return getattr(torch, name)
