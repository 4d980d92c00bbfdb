"""The skinny linear kernel (pdserve.kernels.skinny_gemm) and the model's use of it.

CPU runs go through Triton's interpreter (fp16: it has no bf16 arithmetic), with K whole and
split across programs. The reference is the product in float64 torch. GPU runs
(@pytest.mark.gpu): bf16 at the Qwen2.5 decode shapes, against float64 and cuBLAS."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.skinny_gemm import skinny_linear

WHOLE = (16, 64, 4, 2, 1)
SPLIT = (16, 32, 4, 2, 3)      # three splits of K (fewer where K is short)


def _f64(x, w, bias=None):
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def _check(got, want, dtype, k):
    # one rounding of the output plus fp32 accumulation over k terms
    scale = want.abs().max().item()
    tol = 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale)


def _data(m, n, k, dtype, device, *, bias=False, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    return x, w, b


CPU_CASES = [(1, 40, 70), (3, 64, 256), (8, 33, 300), (5, 16, 16), (2, 17, 129), (16, 20, 40),
             (17, 24, 100), (32, 20, 40), (48, 40, 130), (64, 17, 64)]   # (32- and 64-row tiles)


@pytest.mark.parametrize("cfg", [WHOLE, SPLIT, None], ids=["whole_k", "split_k", "default"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("mnk", CPU_CASES, ids=lambda s: "x".join(map(str, s)))
def test_skinny_linear_matches_float64(mnk, bias, cfg):
    m, n, k = mnk
    x, w, b = _data(m, n, k, torch.float16, "cpu", bias=bias)
    x0 = x.clone()
    got = skinny_linear(x, w, b, config=cfg)
    assert got.shape == (m, n) and got.dtype == torch.float16
    assert torch.equal(x, x0)
    _check(got, _f64(x, w, b), torch.float16, k)


def test_skinny_linear_strided_input_and_out():
    xb, w, _ = _data(3, 24, 48, torch.float16, "cpu")
    xb = torch.randn(3, 2 * 48, dtype=torch.float16)
    x = xb[:, ::2]                                   # column stride 2
    ob = torch.full((3, 2 * 24), float("nan"), dtype=torch.float16)
    out = ob[:, 1::2]
    got = skinny_linear(x, w, out=out, config=WHOLE)
    assert got is out
    assert torch.isnan(ob[:, 0::2]).all()            # nothing written outside the view
    _check(got, _f64(x, w), torch.float16, 48)


def test_split_k_is_deterministic_and_leaves_counters_reset():
    from pdserve.kernels import skinny_gemm
    x, w, b = _data(4, 40, 300, torch.float16, "cpu", bias=True)
    first = skinny_linear(x, w, b, config=(16, 32, 4, 2, 4))
    assert skinny_gemm._counters(x.device, 1).eq(0).all()       # the last split reset its tile
    again = skinny_linear(x, w, b, config=(16, 32, 4, 2, 4))
    assert torch.equal(first, again)
    _check(first, _f64(x, w, b), torch.float16, 300)


def test_default_config_splits_long_k_only():
    from pdserve.kernels.skinny_gemm import default_config, tuned_config
    assert default_config(2048, 1536)[4] == 1
    # 48 tiles: split while tiles x splits < 264 and K / (2 x split) >= 2048
    assert default_config(1536, 8960)[4] == 4                  # 8960 / 8 < 2048
    assert default_config(1536, 1 << 15)[4] == 8                # 384 programs
    assert default_config(1 << 17, 1 << 15)[4] == 1            # enough tiles already
    assert tuned_config(torch.device("cpu"), 1536, 1536) is None


def test_skinny_linear_empty():
    x, w, b = _data(2, 20, 40, torch.float16, "cpu", bias=True)
    assert skinny_linear(x[:0], w).shape == (0, 20)
    zero_k = skinny_linear(torch.empty(2, 0, dtype=torch.float16), torch.empty(20, 0, dtype=torch.float16), b)
    assert torch.equal(zero_k, b.expand(2, 20))


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.randn(2, 8)), "dtype"),                                     # fp32: tl.dot would use tf32
    (dict(w=torch.randn(4, 9, dtype=torch.float16)), "columns"),
    (dict(w=torch.randn(4, 8, dtype=torch.bfloat16)), "weight dtype"),
    (dict(b=torch.randn(5, dtype=torch.float16)), "bias"),
    (dict(x=torch.randn(2, 8, 1, dtype=torch.float16)), "2-D"),
    (dict(out=torch.empty(2, 5, dtype=torch.float16)), "out"),
    (dict(x=torch.randn(65, 8, dtype=torch.float16)), "rows"),
])
def test_skinny_linear_bad_arguments(bad, match):
    args = dict(x=torch.randn(2, 8, dtype=torch.float16), w=torch.randn(4, 8, dtype=torch.float16),
                b=None, out=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        skinny_linear(args["x"], args["w"], args["b"], out=args["out"])


# ---- GPU ------------------------------------------------------------------------------------

GPU_SHAPES = [("qkv", 2048, 1536, True), ("down", 1536, 8960, False), ("gate_up", 17920, 1536, False),
              ("down7b", 3584, 18944, False), ("lm_head", 151936, 1536, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [None, (32, 128, 4, 4, 8)], ids=["tuned_or_default", "split8"])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 33, 48, 64])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: s[0])
def test_skinny_linear_gpu_bf16(shape, m, cfg):
    _, n, k, bias = shape
    x, w, b = _data(m, n, k, torch.bfloat16, "cuda", bias=bias)
    got = skinny_linear(x, w, b, config=cfg)
    _check(got, _f64(x, w, b), torch.bfloat16, k)
    cub = F.linear(x, w, b)                      # and cuBLAS agrees to the output rounding
    scale = cub.float().abs().max().item()
    torch.testing.assert_close(got.float(), cub.float(), rtol=2 ** -6, atol=2 ** -7 * scale)
    assert torch.equal(skinny_linear(x, w, b, config=cfg), got)      # deterministic


@pytest.mark.gpu
def test_linear_layers_use_the_tuned_shapes_only(monkeypatch):
    """linear() takes the kernel for a shape tuned on this device (and M <= SKINNY_MAX_M), and
    cuBLAS for any other shape or a larger M: counted by wrapping the kernel's launcher."""
    from pdserve.kernels import skinny_gemm
    from pdserve.layers import linear as lin
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(0)
    monkeypatch.setitem(skinny_gemm.TUNED, name, {(96, 64): (32, 64, 4, 2, 1)})
    calls = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    w = torch.randn(96, 64, device=dev, dtype=torch.bfloat16)
    other = torch.randn(80, 64, device=dev, dtype=torch.bfloat16)
    for m, weight, used in ((1, w, True), (lin.SKINNY_MAX_M, w, True), (lin.SKINNY_MAX_M + 1, w, False),
                            (4, other, False)):
        calls.clear()
        x = torch.randn(m, 64, device=dev, dtype=torch.bfloat16)
        got = lin.linear(x, weight)
        assert bool(calls) == used, (m, weight.shape)
        _check(got, _f64(x, weight), torch.bfloat16, 64)
    calls.clear()
    lin.linear(torch.randn(2, 64, device=dev), w.float())       # fp32: cuBLAS (tl.dot would be tf32)
    assert not calls
