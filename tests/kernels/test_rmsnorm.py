"""RMSNorm fused with the residual add (pdserve.kernels.rmsnorm).

CPU runs go through Triton's interpreter: tiny shapes, fp32 and fp16. GPU runs
(@pytest.mark.gpu): bf16 / fp16 at engine shapes."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.rmsnorm import rms_norm, rms_norm_ref
from pdserve.layers.norm import RMSNorm

EPS = 1e-6


def _tol(dtype: torch.dtype, ulps: int = 2) -> dict:
    # a few roundings of the output dtype may flip between two fp32 summation orders
    eps = torch.finfo(dtype).eps
    return dict(rtol=ulps * eps, atol=1e-6 if dtype == torch.float32 else 1e-4)


def _make(t, n, dtype, device, *, pad=0, offset=0, seed=0, scale=1.0):
    """x: [T, N] view of a [T, N + pad] buffer starting at column `offset` (row stride > N);
    residual likewise with its own padding; weight random around 1."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    xb = (torch.randn(t, n + pad, generator=g) * scale).to(device=device, dtype=dtype)
    rb = torch.randn(t, n + pad + 3, generator=g).to(device=device, dtype=dtype)
    w = (1.0 + 0.5 * torch.randn(n, generator=g)).to(device=device, dtype=dtype)
    x = xb[:, offset:offset + n]
    r = rb[:, 1:1 + n]
    return x, r, w, xb, rb


def _module(n, w, dtype, device):
    m = RMSNorm(n, EPS).to(device=device, dtype=dtype)
    with torch.no_grad():
        m.weight.copy_(w)
    return m


def _f64(x, w, r=None):
    s = x.double() if r is None else x.double() + r.double()
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


CPU_SHAPES = [(1, 8), (5, 48), (17, 100), (3, 1000), (4, 2100)]  # several rows/program .. 1 row


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_rms_norm_no_residual(dtype, shape):
    t, n = shape
    x, _, w, xb, _ = _make(t, n, dtype, "cpu", pad=5, offset=2)
    assert x.stride(0) > n
    xb_before = xb.clone()
    out = torch.full((t, n), float("nan"), dtype=dtype)
    got = rms_norm(x, w, EPS, out=out)
    assert got is out
    assert torch.equal(xb, xb_before)                     # input untouched
    torch.testing.assert_close(got, rms_norm_ref(x, w, EPS), **_tol(dtype))
    torch.testing.assert_close(got, _module(n, w, dtype, "cpu")(x), **_tol(dtype))
    tol64 = dict(rtol=3 * torch.finfo(dtype).eps, atol=1e-5 if dtype == torch.float32 else 1e-3)
    torch.testing.assert_close(got.double(), _f64(x, w), **tol64)
    # default allocation path
    got2 = rms_norm(x, w, EPS)
    assert got2.is_contiguous() and got2.dtype == dtype
    torch.testing.assert_close(got2, got, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_rms_norm_with_residual(dtype, shape):
    t, n = shape
    x, r, w, xb, rb = _make(t, n, dtype, "cpu", pad=7, seed=1)
    x0, r0, rb0 = x.clone(), r.clone(), rb.clone()
    out = torch.full((t, n), float("nan"), dtype=dtype)
    got, res = rms_norm(x, w, EPS, r, out=out)
    assert got is out and res is r                         # residual updated in place
    # s = x + residual in the input dtype, written into residual (and nowhere else)
    assert torch.equal(r, x0 + r0)
    rb_expect = rb0.clone()
    rb_expect[:, 1:1 + n] = x0 + r0
    assert torch.equal(rb, rb_expect)
    assert torch.equal(x, x0)
    # reference
    r_ref = r0.clone()
    ref, res_ref = rms_norm_ref(x0, w, EPS, r_ref)
    assert res_ref is r_ref and torch.equal(res_ref, r)
    torch.testing.assert_close(got, ref, **_tol(dtype))
    # the model's module
    m_out, m_res = _module(n, w, dtype, "cpu")(x0, r0.clone())
    assert torch.equal(m_res, r)
    torch.testing.assert_close(got, m_out, **_tol(dtype))
    # float64, from the unrounded sum
    tol64 = dict(rtol=3 * torch.finfo(dtype).eps, atol=1e-5 if dtype == torch.float32 else 2e-3)
    torch.testing.assert_close(got.double(), _f64(x0, w, r0), **tol64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_ref_is_the_model_module_bitwise(dtype):
    # the torch reference (no Triton) reproduces pdserve.layers.norm.RMSNorm bit for bit
    x, r, w, _, _ = _make(9, 160, dtype, "cpu", pad=4, seed=5, scale=5.0)
    m = _module(160, w, dtype, "cpu")
    assert torch.equal(rms_norm_ref(x, w, EPS), m(x))
    r1, r2 = r.clone(), r.clone()
    ref, ref_res = rms_norm_ref(x, w, EPS, r1)
    m_out, m_res = m(x, r2)
    assert torch.equal(ref, m_out) and torch.equal(ref_res, m_res)


def test_rms_norm_fp32_matches_module_tightly():
    x, r, w, _, _ = _make(6, 200, torch.float32, "cpu", seed=2, scale=30.0)
    m = _module(200, w, torch.float32, "cpu")
    torch.testing.assert_close(rms_norm(x, w, EPS), m(x), rtol=1e-6, atol=1e-6)
    r2 = r.clone()
    got, _ = rms_norm(x, w, EPS, r)
    m_out, _ = m(x, r2)
    torch.testing.assert_close(got, m_out, rtol=1e-6, atol=1e-6)


def test_rms_norm_out_aliases_x_and_strided_weight():
    x, r, _, _, _ = _make(5, 48, torch.float32, "cpu", seed=3)
    wb = 1.0 + torch.randn(96)
    w = wb[::2]                                           # weight with stride 2
    x0, r0 = x.clone(), r.clone()
    ref, _ = rms_norm_ref(x0, w, EPS, r0.clone())
    got, res = rms_norm(x, w, EPS, r, out=x)              # normalize in place
    assert got is x and res is r
    torch.testing.assert_close(x, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(r, x0 + r0)


def test_rms_norm_empty_batch():
    x = torch.empty(0, 16)
    r = torch.empty(0, 16)
    w = torch.ones(16)
    assert rms_norm(x, w, EPS).shape == (0, 16)
    out, res = rms_norm(x, w, EPS, r)
    assert out.shape == (0, 16) and res is r


def _bad_cases():
    x, r, w = torch.randn(4, 8), torch.randn(4, 8), torch.ones(8)
    return {
        "x_1d": (x[0], w, EPS, None, None),
        "x_3d": (x.view(2, 2, 8), w, EPS, None, None),
        "x_int": (x.long(), w.long(), EPS, None, None),
        "weight_len": (x, torch.ones(7), EPS, None, None),
        "weight_2d": (x, w[None], EPS, None, None),
        "weight_dtype": (x, w.half(), EPS, None, None),
        "residual_shape": (x, w, EPS, r[:3], None),
        "residual_dtype": (x, w, EPS, r.half(), None),
        "out_shape": (x, w, EPS, None, torch.empty(4, 7)),
        "out_dtype": (x, w, EPS, None, torch.empty(4, 8, dtype=torch.float16)),
        "eps_negative": (x, w, -1.0, None, None),
        "eps_tensor": (x, w, torch.tensor(1e-6), None, None),
    }


@pytest.mark.parametrize("case", list(_bad_cases().keys()))
def test_rms_norm_rejects_bad_inputs(case):
    x, w, eps, r, out = _bad_cases()[case]
    with pytest.raises(ValueError, match="rms_norm"):
        rms_norm(x, w, eps, r, out=out)


# ----------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [128, 1536, 3584])   # 128: Qwen3 q/k norm rows (head_dim)
@pytest.mark.parametrize("t", [1, 7, 512, 4096])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_gpu(dtype, n, t, with_residual):
    x, r, w, _, _ = _make(t, n, dtype, "cuda", pad=64, offset=0, seed=t + n)
    x0, r0 = x.clone(), r.clone()
    out = torch.full((t, n), float("nan"), dtype=dtype, device="cuda")
    m = _module(n, w, dtype, "cuda")
    if with_residual:
        got, res = rms_norm(x, w, EPS, r, out=out)
        assert res is r
        ref, res_ref = rms_norm_ref(x0, w, EPS, r0.clone())
        m_out, m_res = m(x0, r0.clone())
        torch.testing.assert_close(r, res_ref, rtol=0, atol=0)
        torch.testing.assert_close(r, m_res, rtol=0, atol=0)
    else:
        got = rms_norm(x, w, EPS, out=out)
        ref, m_out = rms_norm_ref(x0, w, EPS), m(x0)
    assert got is out and not torch.isnan(got).any()
    torch.testing.assert_close(got, ref, **_tol(dtype, ulps=3))
    torch.testing.assert_close(got, m_out, **_tol(dtype, ulps=3))


@pytest.mark.gpu
def test_rms_norm_gpu_cuda_graph():
    dtype, t, n = torch.bfloat16, 64, 1536
    x, r, w, _, _ = _make(t, n, dtype, "cuda", seed=9)
    out = torch.empty((t, n), dtype=dtype, device="cuda")
    rms_norm(x, w, EPS, r, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rms_norm(x, w, EPS, r, out=out)
    x.copy_(torch.randn_like(x))
    r.copy_(torch.randn_like(r))
    x0, r0 = x.clone(), r.clone()
    graph.replay()
    ref, res_ref = rms_norm_ref(x0, w, EPS, r0)
    torch.testing.assert_close(out, ref, **_tol(dtype, ulps=3))
    torch.testing.assert_close(r, res_ref, rtol=0, atol=0)
