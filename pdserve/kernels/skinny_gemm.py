"""Linear layers for a few rows: y = x @ w.T (+ bias), x [M, K] with M small (a decode step of a
small batch), w [N, K] the nn.Linear weight. At such M the product is a weight stream: every byte
of w is read once and the arithmetic is free, so what counts is keeping enough loads in flight on
every SM. One program owns BLOCK_N output columns for all M rows and walks K once; x (a few KB) is
re-read by every program from L2.

Optionally the input is the fused [gate | up] projection of a SwiGLU MLP, x [M, 2K], and the
kernel applies silu(gate) * up (fp32, rounded once to x's dtype, as kernels/activation.py does)
while loading it: the down projection then needs no activation kernel before it.

Numerics: products accumulate in fp32 and round once to the output dtype (bias added in fp32
before the rounding), like cuBLAS; only the summation order differs. Half types only (bf16,
fp16): in fp32 tl.dot would use tf32.

Nothing here reads device values on the host (CUDA-graph safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _interpreter  # noqa: F401  (the CPU test path's loop-bound fix)
from ._checks import check_like, require

HALF_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, o_ptr,
    M, N, K,
    sx_m, sx_k, sw_n, sw_k, so_m, so_n,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    x_rows = x_ptr + rm[:, None].to(tl.int64) * sx_m
    w_rows = w_ptr + rn[:, None].to(tl.int64) * sw_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        xm = m_ok[:, None] & k_ok[None, :]
        if SILU_MUL:
            g = tl.load(x_rows + kk[None, :] * sx_k, mask=xm, other=0.0).to(tl.float32)
            u = tl.load(x_rows + (kk[None, :] + K) * sx_k, mask=xm, other=0.0).to(tl.float32)
            a = (g / (1.0 + tl.exp(-g)) * u).to(x_ptr.dtype.element_ty)
        else:
            a = tl.load(x_rows + kk[None, :] * sx_k, mask=xm, other=0.0)
        w = tl.load(w_rows + kk[None, :] * sw_k, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if USE_DOT:
            acc += tl.dot(a, tl.trans(w))
        else:   # [M, 1, K] * [1, N, K] summed over K: CUDA-core FMAs, no MMA layout
            acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    o = o_ptr + rm[:, None].to(tl.int64) * so_m + rn[None, :] * so_n
    tl.store(o, acc.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# Launch configurations: (BLOCK_N, BLOCK_K, num_warps, num_stages, use_dot) by the row count.
# tl.dot needs BLOCK_M >= 16; below that the FMA form avoids padding rows.
MAX_M = 8            # the model uses this kernel for M <= MAX_M (layers/linear.py)
CONFIGS = {
    "fma": (32, 256, 4, 4, False),
    "dot": (32, 256, 4, 4, True),
}


def pick_config(m: int, n: int, k: int) -> tuple[int, int, int, int, bool]:
    """The launch configuration for an [m, k] x [k, n] product."""
    return CONFIGS["fma" if m <= 2 else "dot"]


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  silu_mul: bool = False, out: torch.Tensor | None = None,
                  config: tuple[int, int, int, int, bool] | None = None) -> torch.Tensor:
    """x: [M, K] (or [M, 2K] = [gate | up] with silu_mul), weight: [N, K], bias: [N] or None, all
    one half dtype on one device. Returns x @ weight.T + bias ([M, N], new unless `out` is given).
    `config` overrides pick_config (the micro-benchmark sweeps it)."""
    for name, tns in (("x", x), ("weight", weight)):
        require(isinstance(tns, torch.Tensor),
                f"skinny_linear: {name} must be a torch.Tensor, got {type(tns).__name__}")
    require(x.dim() == 2 and weight.dim() == 2,
            f"skinny_linear: x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
    require(x.dtype in HALF_DTYPES, f"skinny_linear: x dtype must be one of {HALF_DTYPES}, got {x.dtype}")
    require(weight.dtype == x.dtype, f"skinny_linear: weight dtype {weight.dtype} != x dtype {x.dtype}")
    require(weight.device == x.device, f"skinny_linear: weight is on {weight.device}, x on {x.device}")
    m, kx = x.shape
    n, k = weight.shape
    want = 2 * k if silu_mul else k
    require(kx == want, f"skinny_linear: x has {kx} columns, weight [N, K={k}] needs {want}"
                        + (" ([gate | up])" if silu_mul else ""))
    if bias is not None:
        require(isinstance(bias, torch.Tensor) and bias.shape == (n,),
                f"skinny_linear: bias must be a [{n}] tensor")
        require(bias.dtype == x.dtype and bias.device == x.device,
                "skinny_linear: bias must have x's dtype and device")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        check_like("skinny_linear", "out", out, (m, n), x)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    block_n, block_k, warps, stages, use_dot = config or pick_config(m, n, k)
    block_m = max(16 if use_dot else 1, triton.next_power_of_2(m))
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out,
        m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, USE_DOT=use_dot,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )
    return out


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                      silu_mul: bool = False) -> torch.Tensor:
    """The spec in plain torch: fp32 products and sums, one rounding (the activation, when fused,
    rounded to x's dtype first, as the unfused model path does)."""
    if silu_mul:
        k = x.shape[1] // 2
        g, u = x[:, :k].float(), x[:, k:].float()
        x = (g * torch.sigmoid(g) * u).to(x.dtype)
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
