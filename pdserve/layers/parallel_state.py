"""The tensor-parallel group this process belongs to. Single-process by default; a worker process
calls init_tp_group() before building the model, and every TP layer reads get_tp_group() when it
is constructed."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed process group when size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules and samples; the others follow its decisions."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, op=op, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenation of every rank's x along dim (rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim)


_TP = TPGroup()


def get_tp_group() -> TPGroup:
    return _TP


def set_tp_group(group: TPGroup) -> None:
    global _TP
    _TP = group


def init_tp_group(rank: int, size: int, init_method: str, device: torch.device,
                  timeout_s: float = 600.0) -> TPGroup:
    """Joins the TP group: NCCL between GPUs, gloo between CPU processes. One group per process
    (a worker is one TP group; P/D workers are separate groups with their own init_method)."""
    import datetime
    if size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s), **kw)
        group = TPGroup(rank, size, dist.group.WORLD)
        # The first collective creates the communicator: do it now, not inside a graph capture.
        group.all_reduce(torch.zeros(1, device=device))
    else:
        group = TPGroup()
    set_tp_group(group)
    return group


def destroy_tp_group() -> None:
    """Leaves the group. Release CUDA graphs that captured its collectives first."""
    global _TP
    if _TP.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _TP = TPGroup()
