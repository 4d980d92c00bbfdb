"""RMSNorm, optionally fused with the residual add that precedes it.

Numerics follow Hugging Face Llama (and pdserve.layers.norm.RMSNorm):
  s   = x + residual                 rounded to the input dtype (as the torch add would)
  var = mean(float32(s) ** 2)        in fp32
  y   = (float32(s) * rsqrt(var + eps)) rounded to the input dtype, then * weight
        (for fp32 input there is no intermediate rounding)

Nothing here reads device values on the host (CUDA-graph safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES as _FLOAT_DTYPES
from ._checks import check_like, require


@triton.jit(do_not_specialize=["T"])   # the row count changes every step: one variant for all
def _rms_norm_kernel(
    x_ptr, w_ptr, r_ptr, o_ptr,
    T, N, eps,
    sx_t, sx_n, sr_t, sr_n, so_t, so_n, sw_n,
    HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # ROWS rows per program, each row held whole in registers ([ROWS, BLOCK_N] tile).
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < T
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    r2 = rows[:, None]
    c2 = cols[None, :]

    x = tl.load(x_ptr + r2 * sx_t + c2 * sx_n, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(r_ptr + r2 * sr_t + c2 * sr_n, mask=mask, other=0.0)
        # the add in fp32 rounded once to the input dtype == the torch add in that dtype
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(r_ptr + r2 * sr_t + c2 * sr_n, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / N                 # masked lanes are 0
    inv = tl.rsqrt(var + eps)
    normed = (xf * inv[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols * sw_n, mask=col_ok, other=0.0).to(tl.float32)
    y = normed * w[None, :]
    tl.store(o_ptr + r2 * so_t + c2 * so_n, y.to(o_ptr.dtype.element_ty), mask=mask)


def _launch_config(n: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS per program, num_warps). A row stays whole in registers; small rows are
    packed several to a program so that each program moves at least ~2K elements."""
    block_n = triton.next_power_of_2(n)
    rows = max(1, min(16, 2048 // block_n))
    elems = rows * block_n
    # ~8 elements (16 B of bf16) per thread; 16 warps only for very long rows
    num_warps = max(1, min(16 if block_n > 4096 else 8, elems // 256))
    return block_n, rows, num_warps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, out: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [T, N] (any strides), weight: [N] (x's dtype). Without residual returns norm(x) * weight.
    With residual [T, N]: residual <- x + residual (in place), returns (norm(residual) * weight,
    residual). `out` ([T, N], x's dtype) receives the normed result if given; it may alias x."""
    for name, tns in (("x", x), ("weight", weight)):
        require(isinstance(tns, torch.Tensor),
               f"rms_norm: {name} must be a torch.Tensor, got {type(tns).__name__}")
    require(x.dim() == 2, f"rms_norm: x must be [T, N], got shape {tuple(x.shape)}")
    t, n = x.shape
    require(n > 0, "rms_norm: hidden size N must be > 0")
    require(x.dtype in _FLOAT_DTYPES, f"rms_norm: x dtype must be one of {_FLOAT_DTYPES}, "
                                     f"got {x.dtype}")
    require(weight.dim() == 1 and weight.shape[0] == n,
           f"rms_norm: weight must be [N={n}], got shape {tuple(weight.shape)}")
    require(weight.dtype == x.dtype, f"rms_norm: weight dtype {weight.dtype} != x dtype {x.dtype}")
    require(weight.device == x.device, f"rms_norm: weight is on {weight.device}, x on {x.device}")
    require(isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0,
           f"rms_norm: eps must be a non-negative float, got {eps!r}")
    if residual is not None:
        check_like("rms_norm", "residual", residual, (t, n), x)
    if out is None:
        out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    else:
        check_like("rms_norm", "out", out, (t, n), x)
    if t > 0:
        block_n, rows, num_warps = _launch_config(n)
        r = residual if residual is not None else x      # dummy pointer when unused
        _rms_norm_kernel[(triton.cdiv(t, rows),)](
            x, weight, r, out,
            t, n, float(eps),
            x.stride(0), x.stride(1), r.stride(0), r.stride(1), out.stride(0), out.stride(1),
            weight.stride(0),
            HAS_RESIDUAL=residual is not None, ROWS=rows, BLOCK_N=block_n,
            num_warps=num_warps,
        )
    return out if residual is None else (out, residual)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, *, out: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The spec, in plain torch; same arguments and effects as rms_norm."""
    dtype = x.dtype
    if residual is not None:
        s = (x.float() + residual.float()).to(dtype)   # == x + residual in x's dtype
        residual.copy_(s)
        x = s
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (normed.to(dtype).float() * weight.float()).to(dtype)
    if out is not None:
        out.copy_(y)
        y = out
    return y if residual is None else (y, residual)
