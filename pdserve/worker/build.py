"""Building one rank's share of an in-process engine: its model shard, its KV pool (sized
here: plan_kv_pool) and the ModelRunner over them; kv_export publishes the pool to P/D peers.
Every TP rank runs build_model_runner (the tp group initialised first); rank 0 then puts an
EngineCore over its runner (worker/llm_engine.py)."""
from __future__ import annotations

import os

import torch

from ..config import EngineConfig
from ..devices import on_device
from ..kv_layout import kv_bytes_per_token
from ..layers.parallel_state import get_tp_group
from ..loader.model_loader import ModelSource, load_model, resolve_source
from ..protocol import KVPeer
from .model_runner import ModelRunner


def plan_kv_pool(config: EngineConfig, model) -> tuple[int, int]:
    """(num_blocks, max_model_len) for this model and budget. Under TP every rank calls it and the
    smallest budget wins, so all ranks build the same pool."""
    mcfg = model.config
    attn = model.layers[0].self_attn   # (this rank's KV heads)
    bytes_per_block = config.block_size * kv_bytes_per_token(
        mcfg.num_layers, attn.num_kv_heads, attn.head_dim, config.torch_dtype.itemsize)
    if config.num_kv_blocks:
        num_blocks = config.num_kv_blocks
    else:
        budget = torch.tensor([_kv_budget_bytes(config)], dtype=torch.int64,
                              device=config.torch_device)
        get_tp_group().all_reduce(budget, op=torch.distributed.ReduceOp.MIN)
        num_blocks = int(budget.item()) // bytes_per_block
        if num_blocks < 1:   # (a pool of one block would cap max_model_len at block_size)
            raise ValueError(_no_room(config, int(budget.item()), bytes_per_block))
    _check_pool_fits(config, num_blocks, bytes_per_block)
    capacity = num_blocks * config.block_size
    if config.max_model_len is not None and config.max_model_len > capacity:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the KV pool "
                         f"({num_blocks} blocks x {config.block_size} = {capacity} tokens)")
    max_model_len = config.max_model_len or min(mcfg.max_position_embeddings, capacity)
    if max_model_len > mcfg.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context "
                         f"length {mcfg.max_position_embeddings}")
    return num_blocks, max_model_len


def kv_block_bytes(config: EngineConfig, model) -> int:
    """Bytes one KV block takes on this rank (every layer, K and V, this rank's heads)."""
    attn = model.layers[0].self_attn   # (this rank's KV heads)
    return config.block_size * kv_bytes_per_token(
        model.config.num_layers, attn.num_kv_heads, attn.head_dim, config.torch_dtype.itemsize)


def plan_host_tier(config: EngineConfig, block_bytes: int) -> int:
    """Blocks of the host tier on this rank: swap_space_gb of host memory in blocks of this
    rank's size (every rank holds as many heads, so every rank gets the same count). A tier
    bigger than the machine's memory is a ValueError naming swap_space_gb."""
    n = int(config.swap_space_gb * 2 ** 30) // block_bytes
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if n * block_bytes > have:
        raise ValueError(f"swap_space_gb={config.swap_space_gb} is more than this machine's "
                         f"memory ({have / 2 ** 30:.1f} GiB)")
    return n


def _check_pool_fits(config: EngineConfig, num_blocks: int, bytes_per_block: int) -> None:
    """A pool the device cannot hold is a ValueError naming what sized it, not an allocator
    error from inside torch. The bound is what certainly fails: all of the machine's memory on
    CPU, the GPU's free memory (after the weights) on CUDA."""
    need = (num_blocks + 1) * bytes_per_block  # + the scratch block
    device = config.torch_device
    if device.type == "cuda":
        have, where = torch.cuda.mem_get_info(device)[0], f"the free memory of {device}"
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        where = "this machine's memory"
    if need <= have:
        return
    if config.num_kv_blocks:
        cause = f"num_kv_blocks={config.num_kv_blocks}"
    elif config.kv_cache_memory_gb is not None:
        cause = f"kv_cache_memory_gb={config.kv_cache_memory_gb}"
    else:  # the default budget, or a block bigger than it (the pool has at least one)
        cause = f"block_size={config.block_size} and the default KV budget"
    raise ValueError(f"the KV pool does not fit: {num_blocks} blocks (+1 scratch) of "
                     f"{config.block_size} tokens take {need / (1 << 30):.1f} GiB, more than "
                     f"{where} ({have / (1 << 30):.1f} GiB); set by {cause}")


def _no_room(config: EngineConfig, budget: int, bytes_per_block: int) -> str:
    gib = 1 << 30
    if config.kv_cache_memory_gb is not None:
        why = f"kv_cache_memory_gb={config.kv_cache_memory_gb}"
    elif config.torch_device.type == "cuda":
        why = (f"gpu_memory_utilization={config.gpu_memory_utilization} of the GPU, less what "
               f"this process already holds ({torch.cuda.memory_reserved(config.torch_device) / gib:.1f} "
               "GiB: the weights, and any other engine built in this process) and "
               f"{ACTIVATION_RESERVE_BYTES / gib:.0f} GiB for activations")
    else:
        why = "the default KV budget"
    return (f"no room for the KV cache: {why} leaves {max(0, budget) / gib:.2f} GiB, less than "
            f"one block ({bytes_per_block / gib:.4f} GiB); raise gpu_memory_utilization (or "
            "kv_cache_memory_gb), free the other engine, or pass num_kv_blocks")


def _kv_budget_bytes(cfg: EngineConfig) -> int:
    if cfg.kv_cache_memory_gb is not None:
        return int(cfg.kv_cache_memory_gb * (1 << 30))
    if cfg.torch_device.type == "cuda":
        return cuda_kv_budget_bytes(cfg.gpu_memory_utilization,
                                    *torch.cuda.mem_get_info(cfg.torch_device),
                                    torch.cuda.memory_reserved(cfg.torch_device))
    return 1 << 30


# Room left for activations and CUDA graphs: they are not in the budget yet.
ACTIVATION_RESERVE_BYTES = 2 << 30


def cuda_kv_budget_bytes(utilization: float, free: int, total: int, own: int) -> int:
    """The KV budget of one worker on a GPU: its share of the GPU (utilization x total, as
    vLLM's per-instance gpu_memory_utilization) less what this process already holds (`own`:
    the weights, and what loading left in torch's cache) and the activation reserve, and never
    more than the GPU has free (less the reserve). Workers sharing a GPU each take their own
    share: what the others hold bounds a worker's pool only through `free`."""
    share = int(total * utilization) - own - ACTIVATION_RESERVE_BYTES
    return max(0, min(share, free - ACTIVATION_RESERVE_BYTES))


def build_model_runner(config: EngineConfig, eos_token_ids: tuple[int, ...] = (),
                       source: ModelSource | None = None, kv_dir: str | None = None
                       ) -> tuple[ModelRunner, int, int]:
    """Loads this rank's shard of the model and builds its runner and KV pool (every TP rank
    runs this; the tp group must be initialised first). kv_dir: where a KV connector may put
    files (CPU pools shared with other workers). Returns (runner, num_blocks, max_model_len);
    the host tier (swap_space_gb, plan_host_tier) is runner.host_tier."""
    source = source or resolve_source(config.model)
    device, dtype = config.torch_device, config.torch_dtype
    with on_device(device):  # Triton kernels (loading, warm-up, graph capture) run there
        model = load_model(source, config.load_format, dtype, device,
                           config.resolved_attention_backend, config.seed)
        num_blocks, max_model_len = plan_kv_pool(config, model)
        num_host_blocks = plan_host_tier(config, kv_block_bytes(config, model))
        runner = ModelRunner(
            model, num_blocks, config.block_size, dtype, device, config.seed, eos_token_ids,
            max_model_len,
            min(config.cuda_graph_max_batch, config.max_num_seqs) if config.use_cuda_graphs else 0,
            is_driver=get_tp_group().is_driver, kv_connector=config.kv_connector,
            kv_path=None if kv_dir is None else f"{kv_dir}/kv-rank{get_tp_group().rank}",
            kv_sync=config.kv_transfer_mode == "sync",
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, cuda_graph_max_tokens=config.graph_max_tokens,
            share_sampled=config.async_scheduling and get_tp_group().size > 1,
            num_host_blocks=num_host_blocks)
    return runner, num_blocks, max_model_len


def kv_export(runner: ModelRunner, worker: str) -> KVPeer:
    """This worker's KV pools as a consumer needs them (every TP rank calls it: the handles are
    gathered from all ranks)."""
    tp = get_tp_group()
    handles = tp.all_gather_object(runner.connector.export())
    return KVPeer(worker, runner.connector.name, tp.size, runner.model.config.num_kv_heads, handles)
