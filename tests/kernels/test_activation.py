"""SiLU-and-mul (pdserve.kernels.activation).

CPU runs go through Triton's interpreter: tiny shapes, fp32 and fp16. GPU runs
(@pytest.mark.gpu): bf16 / fp16 at engine shapes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.activation import silu_and_mul, silu_and_mul_ref
from pdserve.layers.activation import SiluAndMul


def _tol(dtype: torch.dtype, ulps: int = 2) -> dict:
    eps = torch.finfo(dtype).eps
    return dict(rtol=ulps * eps, atol=1e-6 if dtype == torch.float32 else 1e-5)


def _f64(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    return F.silu(gate) * up


def _make(t, i, dtype, device, *, pad=0, seed=0, scale=3.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    xb = (torch.randn(t, 2 * i + pad, generator=g) * scale).to(device=device, dtype=dtype)
    return xb[:, pad:], xb                                  # row stride 2I + pad


CPU_SHAPES = [(1, 8), (5, 40), (33, 100), (3, 1100)]        # 1100: two column blocks, masked


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_silu_and_mul(dtype, shape):
    t, i = shape
    x, xb = _make(t, i, dtype, "cpu", pad=3)
    assert x.stride(0) > 2 * i
    xb0 = xb.clone()
    out = torch.full((t, i), float("nan"), dtype=dtype)
    got = silu_and_mul(x, out=out)
    assert got is out
    assert torch.equal(xb, xb0)
    torch.testing.assert_close(got, silu_and_mul_ref(x), **_tol(dtype))
    # the model's module rounds silu(gate) before the multiply: one more rounding
    torch.testing.assert_close(got, SiluAndMul()(x), **_tol(dtype, ulps=3))
    tol64 = dict(rtol=2 * torch.finfo(dtype).eps, atol=1e-6 if dtype == torch.float32 else 1e-4)
    torch.testing.assert_close(got.double(), _f64(x), **tol64)
    got2 = silu_and_mul(x)
    assert got2.is_contiguous() and got2.shape == (t, i) and got2.dtype == dtype
    torch.testing.assert_close(got2, got, rtol=0, atol=0)


def test_silu_and_mul_column_strided_and_strided_out():
    xb = torch.randn(4, 2 * 24 * 2)
    x = xb[:, ::2]                                          # last-dim stride 2
    ob = torch.full((4, 24 * 3), float("nan"))
    out = ob[:, ::3]
    got = silu_and_mul(x, out=out)
    assert got is out
    torch.testing.assert_close(out, silu_and_mul_ref(x), rtol=1e-6, atol=1e-6)
    mask = torch.ones_like(ob, dtype=torch.bool)
    mask[:, ::3] = False
    assert torch.isnan(ob[mask]).all()                      # nothing outside out written


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # interpreter: exp(200) = inf
def test_silu_and_mul_extremes():
    x = torch.tensor([[-200.0, -20.0, 0.0, 20.0, 200.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    got = silu_and_mul(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), _f64(x), rtol=1e-6, atol=1e-6)


def test_silu_and_mul_empty_batch():
    assert silu_and_mul(torch.empty(0, 16)).shape == (0, 8)


@pytest.mark.parametrize("case", ["1d", "3d", "odd", "int", "out_shape", "out_dtype", "list"])
def test_silu_and_mul_rejects_bad_inputs(case):
    x = torch.randn(4, 16)
    args, kw = (x,), {}
    if case == "1d":
        args = (x[0],)
    elif case == "3d":
        args = (x.view(2, 2, 16),)
    elif case == "odd":
        args = (x[:, :15],)
    elif case == "int":
        args = (x.long(),)
    elif case == "out_shape":
        kw = dict(out=torch.empty(4, 16))
    elif case == "out_dtype":
        kw = dict(out=torch.empty(4, 8, dtype=torch.float16))
    elif case == "list":
        args = ([[1.0, 2.0]],)
    with pytest.raises(ValueError, match="silu_and_mul"):
        silu_and_mul(*args, **kw)


# ----------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("i", [8960, 18944])
@pytest.mark.parametrize("t", [1, 7, 512, 4096])
def test_silu_and_mul_gpu(dtype, i, t):
    x, _ = _make(t, i, dtype, "cuda", pad=0, seed=t + i)
    out = torch.full((t, i), float("nan"), dtype=dtype, device="cuda")
    got = silu_and_mul(x, out=out)
    assert got is out and not torch.isnan(got).any()
    torch.testing.assert_close(got, silu_and_mul_ref(x), **_tol(dtype))
    torch.testing.assert_close(got, SiluAndMul()(x), **_tol(dtype, ulps=3))


@pytest.mark.gpu
def test_silu_and_mul_gpu_cuda_graph():
    dtype, t, i = torch.bfloat16, 64, 8960
    x, _ = _make(t, i, dtype, "cuda", seed=5)
    out = torch.empty((t, i), dtype=dtype, device="cuda")
    silu_and_mul(x, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        silu_and_mul(x, out=out)
    x.copy_(torch.randn_like(x) * 3)
    graph.replay()
    torch.testing.assert_close(out, silu_and_mul_ref(x), **_tol(dtype))
