"""RMSNorm, optionally fused with the residual add that precedes it (a Triton kernel on CUDA)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: returns norm(x). With residual: returns (norm(x + residual),
        x + residual), the sum written into `residual` on CUDA, so the caller carries the
        un-normed sum to the next layer (one pass, no extra temporary)."""
        if x.is_cuda:
            from ..kernels.rmsnorm import rms_norm
            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (xf.to(dtype)) * self.weight if dtype != torch.float32 else xf * self.weight
        return out if residual is None else (out, residual)
