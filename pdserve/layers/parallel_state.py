"""The tensor-parallel group this process belongs to. Single-process by default; worker processes
(a later issue) call set_tp_group() before building the model."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed process group when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x


_TP = TPGroup()


def get_tp_group() -> TPGroup:
    return _TP


def set_tp_group(group: TPGroup) -> None:
    global _TP
    _TP = group
