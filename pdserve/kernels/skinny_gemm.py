"""Linear layers for a few rows: y = x @ w.T (+ bias), x [M, K] with M small (a decode step of a
small batch), w [N, K] the nn.Linear weight. At such M the product is a weight stream: every byte
of w is read once and the arithmetic is free, so what counts is keeping enough loads in flight on
every SM. One program owns BLOCK_N output columns for all M rows and walks K once; x (a few KB) is
re-read by every program from L2.

Optionally the input is the fused [gate | up] projection of a SwiGLU MLP, x [M, 2K], and the
kernel applies silu(gate) * up (fp32, rounded once to x's dtype, as kernels/activation.py does)
while loading it: the down projection then needs no activation kernel before it.

Long K is split across programs (split-K): each split leaves an fp32 partial sum in a workspace
and the last split of a column tile to arrive adds the partials in split order, so results do not
depend on arrival order (run-to-run deterministic, as CUDA graphs and batch-invariance tests need).

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
    x_ptr, w_ptr, b_ptr, o_ptr, ws_ptr, cnt_ptr,
    M, N, K, k_per_split,
    sx_m, sx_k, sw_n, sw_k, so_m, so_n,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # grid (column tiles, splits of K). Split s sums k in [s * k_per_split, (s + 1) * k_per_split).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    x_rows = x_ptr + rm[:, None].to(tl.int64) * sx_m
    w_rows = w_ptr + rn[:, None].to(tl.int64) * sw_n
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < k_hi
        xm = m_ok[:, None] & k_ok[None, :]
        if SILU_MUL:
            g = tl.load(x_rows + kk[None, :] * sx_k, mask=xm, other=0.0).to(tl.float32)
            u = tl.load(x_rows + (kk[None, :] + K) * sx_k, mask=xm, other=0.0).to(tl.float32)
            a = (g / (1.0 + tl.exp(-g)) * u).to(x_ptr.dtype.element_ty)
        else:
            a = tl.load(x_rows + kk[None, :] * sx_k, mask=xm, other=0.0)
        w = tl.load(w_rows + kk[None, :] * sw_k, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(w))
    tile = rm[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    if SPLIT:
        # Each split leaves its partial sum in the workspace; the last of a column tile's splits
        # to finish adds them up in split order (deterministic) and resets the tile's counter.
        n_tiles = tl.num_programs(0)
        splits = tl.num_programs(1)
        tl.store(ws_ptr + (pid_k * n_tiles + pid_n) * BLOCK_M * BLOCK_N + tile, acc)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == splits - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, splits):
                acc += tl.load(ws_ptr + (s * n_tiles + pid_n) * BLOCK_M * BLOCK_N + tile,
                               cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            o = o_ptr + rm[:, None].to(tl.int64) * so_m + rn[None, :] * so_n
            tl.store(o, acc.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
            tl.atomic_xchg(cnt_ptr + pid_n, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        o = o_ptr + rm[:, None].to(tl.int64) * so_m + rn[None, :] * so_n
        tl.store(o, acc.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# Launch configuration: (BLOCK_N, BLOCK_K, num_warps, num_stages, split_k). Rows pad to 16 (the
# smallest tl.dot tile); they cost no memory traffic.
BLOCK_M = 16
MAX_M = 16
TARGET_PROGRAMS = 4 * 132       # enough loads in flight: a few programs per SM of an H100/H200


def pick_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """The launch configuration for an [m, k] x [k, n] product: 32-column tiles, and K split
    until there are about TARGET_PROGRAMS programs, each walking at least 1024 of K."""
    block_n, block_k = 32, 256
    tiles = -(-n // block_n)
    split = max(1, min(-(-TARGET_PROGRAMS // tiles), k // 1024))
    return block_n, block_k, 4, 4, split


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Per-column-tile arrival counters for split-K, zero between launches (the last split of a
    tile resets its own), shared by every launch on the device (launches on one stream run one
    after another). Grown on demand, outside any graph capture in practice (warm-up runs every
    shape first)."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        c = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = c
    return c


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  silu_mul: bool = False, out: torch.Tensor | None = None,
                  config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x: [M, K] (or [M, 2K] = [gate | up] with silu_mul), weight: [N, K], bias: [N] or None, all
    one half dtype on one device; M <= MAX_M. Returns x @ weight.T + bias ([M, N], new unless
    `out` is given). `config` overrides pick_config (the micro-benchmark sweeps it)."""
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
    require(m <= MAX_M, f"skinny_linear: at most {MAX_M} rows, got {m}")
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
    block_n, block_k, warps, stages, split = config or pick_config(m, n, k)
    tiles = triton.cdiv(n, block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
    split = triton.cdiv(k, k_per_split)          # (no empty split)
    if split > 1:
        ws = torch.empty(split * tiles * BLOCK_M * block_n, dtype=torch.float32, device=x.device)
        cnt = _counters(x.device, tiles)
    else:
        ws = cnt = out                            # unused pointers
    _skinny_kernel[(tiles, split)](
        x, weight, bias if bias is not None else weight, out, ws, cnt,
        m, n, k, k_per_split,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SPLIT=split > 1,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
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
