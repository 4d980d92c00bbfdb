"""Linear layers for a few rows: y = x @ w.T (+ bias), x [M, K] with M <= 64 (a decode step of a
small batch, a short prompt chunk), w [N, K] the nn.Linear weight. At such M the product is a
weight stream: every byte of w is read once and the arithmetic is nearly free, so what counts is
keeping enough loads in flight on every SM. One program owns BLOCK_N output columns for all rows
(padded to 16, 32 or 64: the smallest tl.dot tile that holds them) over one split of K; x (a few
KB) is re-read by every program from L2.

Long K is split across programs (split-K): each split leaves an fp32 partial sum in a workspace
and the last split of a column tile to arrive adds the partials in split order, so results do not
depend on arrival order (run-to-run deterministic, as CUDA graphs and batch-invariance tests need).

Where this beats cuBLAS depends on the shape and the device, by a few percent: `tuned_config`
knows the shapes measured faster on a device (`python -m pdserve.kernels.bench --skinny`), and
the model's linear layers use cuBLAS for everything else (layers/linear.py).

Numerics: products accumulate in fp32 and round once to the output dtype (bias added in fp32
before the rounding), like cuBLAS; only the summation order differs. Half types only (bf16,
fp16): in fp32 tl.dot would use tf32.

Nothing here reads device values on the host (CUDA-graph safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _interpreter  # noqa: F401  (the CPU test path: loop bounds)
from ._checks import check_like, require

HALF_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, o_ptr, ws_ptr, cnt_ptr,
    M, N, K, k_per_split,
    sx_m, sx_k, sw_n, sw_k, so_m, so_n,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
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
        a = tl.load(x_rows + kk[None, :] * sx_k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
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


MAX_M = 64


def block_m(m: int) -> int:
    """Tile rows for m rows: 16, 32 or 64."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


# Launch configuration: (BLOCK_N, BLOCK_K, num_warps, num_stages, split_k).
# The shapes (N, K) where a configuration beat cuBLAS at every M in 1..16, by device name: the
# best of `python -m pdserve.kernels.bench --skinny` (bench/results/skinny-sweep-h200.json).
# Qwen2.5-1.5B and -7B: o_proj, gate_up_proj, down_proj, lm_head; their qkv_proj stays on
# cuBLAS (it tied at 1.5B and lost by 7% at 7B).
TUNED: dict[str, dict[tuple[int, int], tuple[int, int, int, int, int]]] = {
    "NVIDIA H200": {
        (1536, 1536): (16, 256, 4, 4, 1),      # 1.5B o       5.1 vs 5.3-6.6 us
        (17920, 1536): (64, 128, 4, 4, 1),     # 1.5B gate_up 17.0-17.8 vs 17.5-18.0
        (1536, 8960): (32, 128, 4, 4, 8),      # 1.5B down    11.2-11.6 vs 12.0-12.4
        (151936, 1536): (64, 128, 4, 4, 1),    # 1.5B lm_head 106-112 vs 110-114
        (3584, 3584): (32, 256, 4, 4, 1),      # 7B o         10.3-10.5 vs 11.5-11.9
        (37888, 3584): (64, 128, 4, 4, 1),     # 7B gate_up   65.5-67.0 vs 70.0-71.1
        (3584, 18944): (64, 256, 4, 4, 2),     # 7B down      37.3-37.9 vs 39.4-41.0
        (152064, 3584): (64, 128, 4, 4, 1),    # 7B lm_head   240-248 vs 248-254
    },
}
_DEVICE_NAMES: dict[int, str] = {}


def tuned_config(device: torch.device, n: int, k: int) -> tuple[int, int, int, int, int] | None:
    """The measured-faster configuration for an [M <= 16, k] x [k, n] product on `device`,
    or None (use cuBLAS)."""
    if device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    name = _DEVICE_NAMES.get(idx)
    if name is None:
        name = _DEVICE_NAMES[idx] = torch.cuda.get_device_name(idx)
    return TUNED.get(name, {}).get((n, k))


def default_config(n: int, k: int) -> tuple[int, int, int, int, int]:
    """A configuration for any shape (correct everywhere, tuned nowhere): 32-column tiles, K
    split while there are fewer than ~2 programs per SM and each split keeps >= 2048 of K."""
    tiles = -(-n // 32)
    split = 1
    while tiles * split < 264 and k // (2 * split) >= 2048:
        split *= 2
    return 32, 256, 4, 4, split


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
                  out: torch.Tensor | None = None,
                  config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x: [M, K], weight: [N, K], bias: [N] or None, all one half dtype on one device; M <= MAX_M.
    Returns x @ weight.T + bias ([M, N], new unless `out` is given). `config`: a launch
    configuration (default: the tuned one for this shape and device, else default_config)."""
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
    require(kx == k, f"skinny_linear: x has {kx} columns, weight [N, K={k}] needs {k}")
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
    block_n, block_k, warps, stages, split = (config or tuned_config(x.device, n, k)
                                              or default_config(n, k))
    tiles = triton.cdiv(n, block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
    split = triton.cdiv(k, k_per_split)          # (no empty split)
    if split > 1:
        ws = torch.empty(split * tiles * block_m(m) * block_n, dtype=torch.float32,
                         device=x.device)
        cnt = _counters(x.device, tiles)
    else:
        ws = cnt = out                            # unused pointers
    _skinny_kernel[(tiles, split)](
        x, weight, bias if bias is not None else weight, out, ws, cnt,
        m, n, k, k_per_split,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, SPLIT=split > 1,
        BLOCK_M=block_m(m), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )
    return out


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The spec in plain torch: fp32 products and sums, one rounding."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
