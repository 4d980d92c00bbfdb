"""Linear and embedding layers with the standard tensor-parallel names.

Each parameter carries its own `weight_loader(param, loaded, shard_id=None)`: the loader stays
generic (it hands every checkpoint tensor to the parameter it belongs to) and the sharding rule
lives with the layer. With tp size 1 the rules reduce to plain copies.

A checkpoint tensor handed to a loader is a torch.Tensor or anything with `.shape`, `.narrow()`
and `[:]` that reads lazily (the safetensors reader): a rank then reads only the rows or columns
it keeps.

Fused layouts (rows of the output dimension, per rank):
    QKVParallelLinear:          [ q heads of this rank | k heads | v heads ]
    MergedColumnParallelLinear: [ gate shard | up shard ]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .parallel_state import get_tp_group


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


def kv_head_range(rank: int, tp: int, num_kv_heads: int) -> range:
    """The model KV heads TP rank `rank` of `tp` holds: an even split, or (fewer KV heads than
    ranks) one replicated head, the one this rank's query heads use:

        4 KV heads, tp 2:  rank 0 [h0 h1]  rank 1 [h2 h3]
        2 KV heads, tp 4:  rank 0 [h0]  rank 1 [h0]  rank 2 [h1]  rank 3 [h1]

    QKVParallelLinear shards by it, and P/D's head plan (disagg/connectors/head_plan.py) moves
    KV between ranks by it."""
    if num_kv_heads >= tp:
        n = _divide(num_kv_heads, tp, "number of KV heads")
        return range(rank * n, rank * n + n)
    _divide(tp, num_kv_heads, "tp size vs KV heads")
    start = rank * num_kv_heads // tp
    return range(start, start + 1)


def materialize(loaded) -> torch.Tensor:
    """The whole checkpoint tensor (reads it when it is lazy)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


# A product with at most this many rows (a decode step of a small batch) in a half dtype on CUDA
# goes to the Triton weight-streaming kernel (kernels/skinny_gemm.py) where it was measured faster
# than cuBLAS for that shape on that device (a few percent: bench/RESULTS.md, issue 15).
SKINNY_MAX_M = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias."""
    if x.is_cuda and x.shape[0] <= SKINNY_MAX_M and x.dtype in (torch.float16, torch.bfloat16):
        from ..kernels.skinny_gemm import skinny_linear, tuned_config
        cfg = tuned_config(x.device, weight.shape[0], weight.shape[1])
        if cfg is not None:
            return skinny_linear(x, weight, bias, config=cfg)
    return F.linear(x, weight, bias)


def _copy(param: torch.Tensor, loaded) -> None:
    loaded = materialize(loaded)
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter "
                         f"shape {tuple(param.shape)}")
    param.data.copy_(loaded)


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ColumnParallelLinear(_Linear):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp = get_tp_group()
        super().__init__(in_features, _divide(out_features, self.tp.size, "output features"), bias)

    def weight_loader(self, param, loaded, shard_id=None):
        n = param.shape[0]
        _copy(param, loaded.narrow(0, self.tp.rank * n, n))


class MergedColumnParallelLinear(_Linear):
    """Several column-parallel outputs fused into one matmul (gate and up of the MLP)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.tp = get_tp_group()
        self.shard_sizes = [_divide(s, self.tp.size, "output features") for s in output_sizes]
        super().__init__(in_features, sum(self.shard_sizes), bias)

    def weight_loader(self, param, loaded, shard_id: int):
        n = self.shard_sizes[shard_id]
        dst = param.data.narrow(0, sum(self.shard_sizes[:shard_id]), n)
        _copy(dst, loaded.narrow(0, self.tp.rank * n, n))


class QKVParallelLinear(_Linear):
    """q, k, v projections fused. Query heads split across ranks; KV heads split too, or replicated
    when there are fewer KV heads than ranks (each rank keeps the KV head its query heads use)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        self.tp = get_tp_group()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, self.tp.size, "number of attention heads")
        heads = kv_head_range(self.tp.rank, self.tp.size, num_kv_heads)
        self.num_kv_heads, self.kv_head_start = len(heads), heads.start
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.sizes = {"q": q, "k": kv, "v": kv}
        self.offsets = {"q": 0, "k": q, "v": q + kv}
        super().__init__(hidden_size, q + 2 * kv, bias)

    def weight_loader(self, param, loaded, shard_id: str):
        n = self.sizes[shard_id]
        start = (self.tp.rank * self.num_heads if shard_id == "q" else self.kv_head_start) * self.head_dim
        _copy(param.data.narrow(0, self.offsets[shard_id], n), loaded.narrow(0, start, n))


class RowParallelLinear(_Linear):
    """Input features split across ranks; partial outputs summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp = get_tp_group()
        super().__init__(_divide(in_features, self.tp.size, "input features"), out_features, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # bias: added once, after the reduction
            _copy(param, loaded)
            return
        n = param.shape[1]
        _copy(param, loaded.narrow(1, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows split across ranks; each rank embeds the ids it owns, zeros elsewhere,
    and an all-reduce assembles the result."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp = get_tp_group()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // self.tp.size)
        self.start = self.tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        rows = loaded[self.start:self.start + self.per_rank]
        param.data.zero_()
        _copy(param.data[: rows.shape[0]], rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out.masked_fill_(mask.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over this rank's vocabulary shard, gathered to the full vocabulary."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = self.tp.all_gather(linear(hidden, self.weight), -1)
        return logits[..., : self.vocab_size]
