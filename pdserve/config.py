"""EngineConfig: everything `LLM(...)` / the CLI accept, frozen and validated on construction."""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LOAD_FORMATS = ("auto", "dummy")


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
    attention_backend: str = "auto"     # "auto": triton on CUDA, torch on CPU
    enforce_eager: bool = False         # CUDA: no CUDA graphs
    cuda_graph_max_batch: int = 512     # largest captured decode batch (capped by max_num_seqs)
    tensor_parallel_size: int = 1       # ranks per worker (NCCL on CUDA, gloo on CPU)
    # "uni": the engine runs in the caller's process (tp 1 only); "mp": in worker processes the
    # caller talks to over messages; "auto": uni for tp 1, mp otherwise.
    distributed_executor_backend: str = "auto"
    disable_custom_all_reduce: bool = False  # CUDA TP: NCCL for every all-reduce (no one-shot P2P)
    # P/D disaggregation (set by the router for its workers): how KV moves between workers
    # (a registered connector name, pdserve/disagg/connector.py), whether a consumer's pull runs
    # inside its step ("sync") or beside its steps ("async"), how long a pull may take before
    # the request is recomputed locally, and how long a producer keeps unclaimed KV.
    kv_connector: str | None = None
    kv_transfer_mode: str = "async"
    kv_transfer_timeout_s: float = 30.0
    kv_hold_timeout_s: float = 300.0
    max_kv_loads: int = 64              # consumer: pulls in flight at once

    def __post_init__(self):
        def positive(name, allow_none=False):
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            positive(name)
        positive("num_kv_blocks", allow_none=True)
        positive("max_model_len", allow_none=True)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError("attention_backend must be auto, torch or triton, got "
                             f"{self.attention_backend!r}")
        if self.distributed_executor_backend not in ("auto", "uni", "mp"):
            raise ValueError("distributed_executor_backend must be auto, uni or mp, got "
                             f"{self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size > 1 needs worker processes "
                             "(distributed_executor_backend 'mp' or 'auto')")
        if self.kv_connector is not None:
            from .disagg.connector import get_connector_class
            get_connector_class(self.kv_connector)
        if self.kv_transfer_mode not in ("sync", "async"):
            raise ValueError(f"kv_transfer_mode must be sync or async, got {self.kv_transfer_mode!r}")
        for name in ("kv_transfer_timeout_s", "kv_hold_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        positive("max_kv_loads")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"bad device {self.device!r}: {e}") from None

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend == "auto":
            return "uni" if self.tensor_parallel_size == 1 else "mp"
        return self.distributed_executor_backend

    def rank_device(self, rank: int) -> torch.device:
        """The device of TP rank `rank`: on CUDA, consecutive GPUs from the configured one."""
        d = self.torch_device
        if d.type != "cuda":
            return d
        return torch.device("cuda", (d.index or 0) + rank)

    @property
    def resolved_attention_backend(self) -> str:
        if self.attention_backend == "auto":
            return "triton" if self.torch_device.type == "cuda" else "torch"
        return self.attention_backend

    @property
    def use_cuda_graphs(self) -> bool:
        return (self.torch_device.type == "cuda" and not self.enforce_eager
                and self.resolved_attention_backend == "triton")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]
