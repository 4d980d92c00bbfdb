"""Fused RoPE + paged KV store (pdserve.kernels.rope_store).

CPU runs go through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA):
tiny shapes, fp32 and fp16. GPU runs (@pytest.mark.gpu): bf16 / fp16 at engine shapes."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.rope_store import rope_and_store_kv, rope_and_store_kv_ref
from pdserve.layers import rotary as rotary_mod
from pdserve.layers.rotary import RotaryEmbedding, rope_inv_freq

SENTINEL = -640.0  # exact in bf16 (5 * 2**7), fp16, fp32; never produced by rotating small inputs


def _tol(dtype: torch.dtype) -> dict:
    eps = torch.finfo(dtype).eps
    return dict(rtol=2 * eps, atol=1e-5 if dtype != torch.float32 else 1e-6)


def _make_case(t, h, hkv, d, dtype, device, *, nb, bs, max_pos, extra_cols=0, theta=10000.0,
               cache_dtype=None, head_major_cache=False, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    width = (h + 2 * hkv) * d
    fused = torch.randn(t, width + extra_cols, generator=g).to(device=device, dtype=dtype)
    qkv = fused[:, :width]
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)
    rotary = RotaryEmbedding(d, max_pos, theta).to(device)
    positions = torch.randint(0, max_pos, (t,), generator=g).to(device)
    slots = torch.randperm(nb * bs, generator=g)[:t].to(device)
    cdt = cache_dtype or dtype
    if head_major_cache:  # a non-standard layout: [2, NB, Hkv, BS, D] seen as [2, NB, BS, Hkv, D]
        kv = torch.full((2, nb, hkv, bs, d), SENTINEL, dtype=cdt, device=device).transpose(2, 3)
    else:
        kv = torch.full((2, nb, bs, hkv, d), SENTINEL, dtype=cdt, device=device)
    return dict(fused=fused, q=q, k=k, v=v, rotary=rotary, positions=positions, slots=slots, kv=kv)


def _model_rope(rotary: RotaryEmbedding, positions, q, k):
    """The model's own torch rotation (RotaryEmbedding's table + the layer's rotate-half)."""
    if hasattr(rotary_mod, "apply_rope"):
        return rotary_mod.apply_rope(q, k, positions, rotary.cos_sin)
    return rotary(positions, q, k)


def _cache_rows(kv: torch.Tensor, slots: torch.Tensor):
    """(kv[:, slots] as [2, T, Hkv, D], kv at all other slots as [2, S_rest, Hkv, D])."""
    nb, bs = kv.shape[1], kv.shape[2]
    flat = kv.reshape(2, nb * bs, kv.shape[3], kv.shape[4])
    written = torch.zeros(nb * bs, dtype=torch.bool, device=kv.device)
    written[slots] = True
    return flat[:, slots], flat[:, ~written]


def _run_and_check(c, dtype, q_out=None):
    q, k, v, rotary = c["q"], c["k"], c["v"], c["rotary"]
    fused_before = c["fused"].clone()
    kv, kv_ref = c["kv"], c["kv"].clone()
    got = rope_and_store_kv(q, k, v, c["positions"], rotary.cos_sin, kv[0], kv[1], c["slots"],
                            q_out=q_out)
    ref = rope_and_store_kv_ref(q, k, v, c["positions"], rotary.cos_sin, kv_ref[0], kv_ref[1],
                                c["slots"])
    if q_out is not None:
        assert got is q_out
    else:
        assert got.is_contiguous() and got.shape == q.shape and got.dtype == q.dtype
    tol = _tol(dtype)
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(kv, kv_ref, **_tol(kv.dtype))
    # inputs are not modified
    assert torch.equal(c["fused"], fused_before)
    # slots outside slot_mapping are untouched; written slots hold no sentinel
    at, rest = _cache_rows(kv, c["slots"])
    assert (rest == SENTINEL).all()
    assert not (at == SENTINEL).any()
    # v is a plain copy
    torch.testing.assert_close(at[1], v.to(kv.dtype), rtol=0, atol=0)
    return got, at


CPU_SHAPES = [  # (T, H, Hkv, D, NB, BS)
    (1, 2, 1, 8, 2, 4),
    (7, 4, 2, 16, 4, 4),
    (13, 3, 3, 24, 5, 8),     # non power-of-two heads and half dim (masking)
    (9, 6, 2, 32, 3, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rope_store_matches_reference_and_model(dtype, shape):
    t, h, hkv, d, nb, bs = shape
    c = _make_case(t, h, hkv, d, dtype, "cpu", nb=nb, bs=bs, max_pos=64)
    q_out = torch.full((t, h, d), float("nan"), dtype=dtype)
    got, at = _run_and_check(c, dtype, q_out=q_out)
    # default allocation path gives the same values
    kv = c["kv"]
    fresh = rope_and_store_kv(c["q"], c["k"], c["v"], c["positions"], c["rotary"].cos_sin,
                              kv[0], kv[1], c["slots"])
    assert fresh.is_contiguous() and torch.equal(fresh, got)

    # the model's own rotary module on the same inputs
    mq, mk = _model_rope(c["rotary"], c["positions"], c["q"], c["k"])
    tol = _tol(dtype)
    torch.testing.assert_close(got, mq, **tol)
    torch.testing.assert_close(at[0], mk, **tol)

    # an independent float64 computation straight from theta
    inv = rope_inv_freq(d, 10000.0, None)                         # float64 [D/2]
    ang = c["positions"].double()[:, None] * inv[None, :]          # [T, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]

    def rot64(x):
        x1, x2 = x.double().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    tol64 = dict(rtol=2 * torch.finfo(dtype).eps, atol=1e-5 if dtype == torch.float32 else 2e-3)
    torch.testing.assert_close(got.double(), rot64(c["q"]), **tol64)
    torch.testing.assert_close(at[0].double(), rot64(c["k"]), **tol64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_store_strided_q_out_and_odd_layouts(dtype):
    # fused qkv with padding columns (row stride > (H + 2Hkv) D), head-major cache layout,
    # poisoned q_out that is itself a strided view
    t, h, hkv, d = 6, 4, 2, 16
    c = _make_case(t, h, hkv, d, dtype, "cpu", nb=3, bs=4, max_pos=32, extra_cols=5,
                   head_major_cache=True, seed=1)
    assert not c["kv"][0].is_contiguous()
    big = torch.full((t, h + 1, d), float("nan"), dtype=dtype)
    q_out = big[:, 1:]                                # strided: row stride (H+1) D
    _run_and_check(c, dtype, q_out=q_out)
    assert torch.isnan(big[:, 0]).all()               # nothing outside q_out was written


def test_rope_store_large_theta_and_positions():
    # Qwen2-style theta and positions near the end of the table
    t, h, hkv, d, max_pos = 5, 2, 1, 16, 32768
    c = _make_case(t, h, hkv, d, torch.float32, "cpu", nb=2, bs=4, max_pos=max_pos,
                   theta=1_000_000.0, seed=2)
    c["positions"] = torch.tensor([0, 1, 4097, max_pos - 2, max_pos - 1])
    got, at = _run_and_check(c, torch.float32)
    mq, mk = _model_rope(c["rotary"], c["positions"], c["q"], c["k"])
    torch.testing.assert_close(got, mq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(at[0], mk, rtol=1e-6, atol=1e-6)


def test_rope_store_cache_dtype_and_int32_strided_indices():
    # fp16 activations into an fp32 cache; int32 positions and slots, both strided views
    t, h, hkv, d = 5, 2, 2, 8
    c = _make_case(t, h, hkv, d, torch.float16, "cpu", nb=2, bs=4, max_pos=16,
                   cache_dtype=torch.float32, seed=3)
    pos2 = torch.stack([c["positions"], torch.full_like(c["positions"], 10 ** 6)], 1).int()
    slot2 = torch.stack([torch.full_like(c["slots"], 10 ** 6), c["slots"]], 1).int()
    c["positions"], c["slots"] = pos2[:, 0], slot2[:, 1]
    assert c["positions"].stride(0) == 2 and c["slots"].stride(0) == 2
    _run_and_check(c, torch.float16)


def test_rope_store_in_place_q():
    t, h, hkv, d = 4, 2, 1, 8
    c = _make_case(t, h, hkv, d, torch.float32, "cpu", nb=2, bs=4, max_pos=16, seed=4)
    expect = rope_and_store_kv_ref(c["q"], c["k"], c["v"], c["positions"], c["rotary"].cos_sin,
                                   c["kv"].clone()[0], c["kv"].clone()[1], c["slots"])
    kv = c["kv"]
    got = rope_and_store_kv(c["q"], c["k"], c["v"], c["positions"], c["rotary"].cos_sin, kv[0],
                            kv[1], c["slots"], q_out=c["q"])
    assert got is c["q"]
    torch.testing.assert_close(c["q"], expect, rtol=1e-6, atol=1e-6)


def test_rope_store_empty_batch():
    c = _make_case(0, 2, 1, 8, torch.float32, "cpu", nb=2, bs=4, max_pos=16)
    kv = c["kv"]
    out = rope_and_store_kv(c["q"], c["k"], c["v"], c["positions"], c["rotary"].cos_sin, kv[0],
                            kv[1], c["slots"])
    assert out.shape == (0, 2, 8)
    assert (kv == SENTINEL).all()


def _bad_cases():
    def base():
        c = _make_case(3, 2, 1, 8, torch.float32, "cpu", nb=2, bs=4, max_pos=16)
        return dict(q=c["q"], k=c["k"], v=c["v"], positions=c["positions"],
                    cos_sin=c["rotary"].cos_sin, k_cache=c["kv"][0], v_cache=c["kv"][1],
                    slot_mapping=c["slots"])

    def with_(**kw):
        a = base()
        a.update({k: (f(a) if callable(f) else f) for k, f in kw.items()})
        return a

    return {
        "q_2d": with_(q=lambda a: a["q"].reshape(3, 16)),
        "odd_head_dim": with_(q=lambda a: a["q"][..., :7], k=lambda a: a["k"][..., :7],
                              v=lambda a: a["v"][..., :7]),
        "k_wrong_T": with_(k=lambda a: a["k"][:2]),
        "v_shape": with_(v=lambda a: torch.zeros(3, 2, 8)),
        "kv_dtype_mismatch": with_(k=lambda a: a["k"].half()),
        "q_int": with_(q=lambda a: a["q"].long()),
        "positions_float": with_(positions=lambda a: a["positions"].float()),
        "positions_len": with_(positions=lambda a: a["positions"][:2]),
        "slots_2d": with_(slot_mapping=lambda a: a["slot_mapping"][:, None]),
        "slots_float": with_(slot_mapping=lambda a: a["slot_mapping"].float()),
        "cos_sin_width": with_(cos_sin=lambda a: a["cos_sin"][:, :4]),
        "cos_sin_fp16": with_(cos_sin=lambda a: a["cos_sin"].half()),
        "cache_heads": with_(k_cache=lambda a: torch.zeros(2, 4, 2, 8),
                             v_cache=lambda a: torch.zeros(2, 4, 2, 8)),
        "cache_3d": with_(k_cache=lambda a: a["k_cache"][0]),
        "cache_shapes_differ": with_(v_cache=lambda a: torch.zeros(3, 4, 1, 8)),
        "cache_dtypes_differ": with_(v_cache=lambda a: a["v_cache"].half()),
        "q_out_shape": dict(base(), q_out=torch.empty(3, 2, 4)),
        "q_out_dtype": dict(base(), q_out=torch.empty(3, 2, 8, dtype=torch.float16)),
        "not_a_tensor": with_(positions=[0, 1, 2]),
    }


@pytest.mark.parametrize("case", list(_bad_cases().keys()))
def test_rope_store_rejects_bad_inputs(case):
    args = _bad_cases()[case]
    with pytest.raises(ValueError, match="rope_and_store_kv"):
        rope_and_store_kv(**args)


# ----------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 7, 512, 4096])
def test_rope_store_gpu(dtype, t):
    h, hkv, d, bs = 12, 2, 128, 16
    nb = t // bs + 8
    c = _make_case(t, h, hkv, d, dtype, "cuda", nb=nb, bs=bs, max_pos=32768, theta=1e6,
                   seed=100 + t)
    q_out = torch.full((t, h, d), float("nan"), dtype=dtype, device="cuda")
    got, at = _run_and_check(c, dtype, q_out=q_out)
    torch.cuda.synchronize()
    assert not torch.isnan(got).any()
    mq, mk = _model_rope(c["rotary"], c["positions"], c["q"], c["k"])
    torch.testing.assert_close(got, mq, rtol=3 * torch.finfo(dtype).eps, atol=1e-4)
    torch.testing.assert_close(at[0], mk, rtol=3 * torch.finfo(dtype).eps, atol=1e-4)


@pytest.mark.gpu
def test_rope_store_gpu_cuda_graph():
    dtype, t, h, hkv, d, bs = torch.bfloat16, 64, 12, 2, 128, 16
    c = _make_case(t, h, hkv, d, dtype, "cuda", nb=t // bs + 4, bs=bs, max_pos=4096, seed=7)
    kv, cs = c["kv"], c["rotary"].cos_sin
    q_out = torch.empty((t, h, d), dtype=dtype, device="cuda")
    args = (c["q"], c["k"], c["v"], c["positions"], cs, kv[0], kv[1], c["slots"])
    rope_and_store_kv(*args, q_out=q_out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rope_and_store_kv(*args, q_out=q_out)
    # new inputs in the same buffers, replay
    c["fused"].copy_(torch.randn_like(c["fused"]))
    c["positions"].copy_(torch.randint(0, 4096, (t,), device="cuda"))
    c["slots"].copy_(torch.randperm(kv.shape[1] * bs, device="cuda")[:t])
    kv.fill_(SENTINEL)
    kv_ref = kv.clone()
    graph.replay()
    ref = rope_and_store_kv_ref(*args[:5], kv_ref[0], kv_ref[1], c["slots"])
    torch.testing.assert_close(q_out, ref, rtol=3 * torch.finfo(dtype).eps, atol=1e-4)
    torch.testing.assert_close(kv, kv_ref, rtol=3 * torch.finfo(dtype).eps, atol=1e-4)
