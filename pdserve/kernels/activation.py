"""SiLU-and-mul (the SwiGLU gate) on a fused [gate | up] projection output.

x: [T, 2I] -> silu(x[:, :I]) * x[:, I:], [T, I]. silu and the product are computed in fp32 and
rounded once to x's dtype (the torch module rounds silu(gate) to x's dtype before the multiply,
so in bf16/fp16 the two agree to within one rounding of the output dtype; in fp32 they agree).

Nothing here reads device values on the host (CUDA-graph safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES as _FLOAT_DTYPES
from ._checks import check_like, require


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, o_ptr, I,
    sx_t, sx_n, so_t, so_n,
    BLOCK: tl.constexpr,
):
    # grid: (T, cdiv(I, BLOCK)); one program = BLOCK outputs of one row.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    row = x_ptr + t * sx_t
    g = tl.load(row + cols * sx_n, mask=m, other=0.0).to(tl.float32)
    u = tl.load(row + (cols + I) * sx_n, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(o_ptr + t * so_t + cols * so_n, y.to(o_ptr.dtype.element_ty), mask=m)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, 2I] (any strides) -> silu(gate) * up, [T, I] in x's dtype (new contiguous tensor
    unless `out` is given)."""
    require(isinstance(x, torch.Tensor), f"silu_and_mul: x must be a torch.Tensor, "
                                        f"got {type(x).__name__}")
    require(x.dim() == 2, f"silu_and_mul: x must be [T, 2I], got shape {tuple(x.shape)}")
    t, n2 = x.shape
    require(n2 > 0 and n2 % 2 == 0,
           f"silu_and_mul: last dim must be even and > 0 ([gate | up]), got {n2}")
    require(x.dtype in _FLOAT_DTYPES,
           f"silu_and_mul: x dtype must be one of {_FLOAT_DTYPES}, got {x.dtype}")
    inter = n2 // 2
    if out is None:
        out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    else:
        check_like("silu_and_mul", "out", out, (t, inter), x)
    if t > 0:
        block = min(1024, triton.next_power_of_2(inter))
        num_warps = max(1, min(4, block // 256))   # 8 elements (16 B of bf16) per thread
        _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](
            x, out, inter, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
            BLOCK=block, num_warps=num_warps,
        )
    return out


def silu_and_mul_ref(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The spec, in plain torch (fp32 math, one rounding to x's dtype)."""
    inter = x.shape[-1] // 2
    gate, up = x[:, :inter].float(), x[:, inter:].float()
    y = (gate * torch.sigmoid(gate) * up).to(x.dtype)
    if out is not None:
        out.copy_(y)
        y = out
    return y
