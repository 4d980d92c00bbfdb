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


def _f64(x, w, bias=None, silu=False):
    x = x.double()
    if silu:
        g, u = x.chunk(2, dim=-1)
        x = F.silu(g) * u
    y = x @ w.double().T
    return y if bias is None else y + bias.double()


def _check(got, want, dtype, k):
    # one rounding of the output plus fp32 accumulation over k terms; the fused activation is
    # rounded to the input dtype before the product (as the unfused model path does)
    scale = want.abs().max().item()
    tol = 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale)


def _data(m, n, k, dtype, device, *, silu=False, bias=False, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m, 2 * k if silu else k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    return x, w, b


CPU_CASES = [(1, 40, 70), (3, 64, 256), (8, 33, 300), (5, 16, 16), (2, 17, 129)]


@pytest.mark.parametrize("cfg", [WHOLE, SPLIT], ids=["whole_k", "split_k"])
@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("mnk", CPU_CASES, ids=lambda s: "x".join(map(str, s)))
def test_skinny_linear_matches_float64(mnk, bias, silu, cfg):
    m, n, k = mnk
    x, w, b = _data(m, n, k, torch.float16, "cpu", silu=silu, bias=bias)
    x0 = x.clone()
    got = skinny_linear(x, w, b, silu_mul=silu, config=cfg)
    assert got.shape == (m, n) and got.dtype == torch.float16
    assert torch.equal(x, x0)
    _check(got, _f64(x, w, b, silu), torch.float16, k)


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


def test_skinny_linear_default_config_and_empty():
    x, w, b = _data(2, 20, 40, torch.float16, "cpu", bias=True)
    _check(skinny_linear(x, w, b), _f64(x, w, b), torch.float16, 40)
    assert skinny_linear(x[:0], w).shape == (0, 20)
    zero_k = skinny_linear(torch.empty(2, 0, dtype=torch.float16), torch.empty(20, 0, dtype=torch.float16), b)
    assert torch.equal(zero_k, b.expand(2, 20))


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.randn(2, 8)), "dtype"),                                     # fp32: tl.dot would use tf32
    (dict(w=torch.randn(4, 9, dtype=torch.float16)), "columns"),
    (dict(w=torch.randn(4, 8, dtype=torch.bfloat16)), "weight dtype"),
    (dict(b=torch.randn(5, dtype=torch.float16)), "bias"),
    (dict(silu=True), "gate"),
    (dict(x=torch.randn(2, 8, 1, dtype=torch.float16)), "2-D"),
    (dict(out=torch.empty(2, 5, dtype=torch.float16)), "out"),
    (dict(x=torch.randn(17, 8, dtype=torch.float16)), "rows"),
])
def test_skinny_linear_bad_arguments(bad, match):
    args = dict(x=torch.randn(2, 8, dtype=torch.float16), w=torch.randn(4, 8, dtype=torch.float16),
                b=None, silu=False, out=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        skinny_linear(args["x"], args["w"], args["b"], silu_mul=args["silu"], out=args["out"])


# ---- GPU ------------------------------------------------------------------------------------

GPU_SHAPES = [("qkv", 2048, 1536, True, False), ("down", 1536, 8960, False, True),
              ("gate_up", 17920, 1536, False, False), ("down7b", 3584, 18944, False, True),
              ("lm_head", 151936, 1536, False, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: s[0])
def test_skinny_linear_gpu_bf16(shape, m):
    _, n, k, bias, silu = shape
    x, w, b = _data(m, n, k, torch.bfloat16, "cuda", silu=silu, bias=bias)
    got = skinny_linear(x, w, b, silu_mul=silu)
    _check(got, _f64(x, w, b, silu), torch.bfloat16, k)
    # and cuBLAS on the same (activated) input agrees to the output rounding
    a = x
    if silu:
        g, u = x.float().chunk(2, dim=-1)
        a = (F.silu(g) * u).to(x.dtype)
    cub = F.linear(a, w, b)
    scale = cub.float().abs().max().item()
    torch.testing.assert_close(got.float(), cub.float(), rtol=2 ** -6, atol=2 ** -7 * scale)


@pytest.mark.gpu
def test_model_mlp_takes_the_skinny_path_and_matches_float64():
    from pdserve.layers import linear as lin
    from pdserve.models.config import ModelConfig
    from pdserve.models.llama import MLP
    from pdserve.models.presets import PRESETS
    cfg = ModelConfig.from_hf(PRESETS["qwen2.5-0.5b"])
    torch.manual_seed(0)
    mlp = MLP(cfg).to("cuda", torch.bfloat16)
    for p in mlp.parameters():
        p.data.normal_(0, cfg.hidden_size ** -0.5)
    calls = []
    real = lin.linear

    def spy(x, *a, **kw):
        calls.append((x.shape[0], lin.uses_skinny(x), kw.get("silu_mul", False)))
        return real(x, *a, **kw)
    lin.linear = spy
    try:
        x = torch.randn(4, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        got = mlp(x)
        big = mlp(torch.randn(lin.SKINNY_MAX_M + 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16))
    finally:
        lin.linear = real
    assert calls[:2] == [(4, True, False), (4, True, True)]      # gate_up, then down with the activation
    assert calls[2:] == [(lin.SKINNY_MAX_M + 1, False, False)] * 2 and big.shape[0] == lin.SKINNY_MAX_M + 1
    h = x.double() @ mlp.gate_up_proj.weight.double().T
    g, u = h.to(torch.bfloat16).double().chunk(2, dim=-1)
    act = (F.silu(g) * u).to(torch.bfloat16).double()
    want = act @ mlp.down_proj.weight.double().T
    _check(got, want, torch.bfloat16, cfg.intermediate_size)
