"""Argument checks shared by the kernel launchers: every failure is a ValueError that names the
kernel and the argument."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_like(kernel: str, name: str, t, shape: tuple[int, ...], ref: torch.Tensor,
               ref_name: str = "x") -> None:
    """`t` is a tensor of exactly `shape` with `ref`'s dtype and device (an out= or residual=)."""
    require(isinstance(t, torch.Tensor), f"{kernel}: {name} must be a torch.Tensor")
    require(tuple(t.shape) == tuple(shape),
            f"{kernel}: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    require(t.dtype == ref.dtype, f"{kernel}: {name} dtype {t.dtype} != {ref_name} dtype {ref.dtype}")
    require(t.device == ref.device, f"{kernel}: {name} is on {t.device}, {ref_name} on {ref.device}")
