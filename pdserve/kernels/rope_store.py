"""Fused rotary embedding (rotate-half / NeoX pairing) + paged KV-cache store.

One launch per attention layer replaces: rotate q, rotate k, scatter k and v into the paged cache.

Layout (what the engine passes):
  q [T, H, D], k / v [T, Hkv, D]   views of the fused qkv projection (row stride (H + 2 Hkv) D)
  positions [T]                    int64 (int32 accepted) token positions
  cos_sin [max_pos, D] float32     first D/2 columns cos(pos * inv_freq), last D/2 sin
                                   (the table pdserve.layers.rotary.RotaryEmbedding builds)
  k_cache / v_cache [NB, BS, Hkv, D]  views kv[0], kv[1] of a per-layer [2, NB, BS, Hkv, D] tensor
  slot_mapping [T]                 int64 (int32 accepted), slot = block * BS + offset; every slot
                                   is valid (padding tokens point into a scratch block)

Effect: rot(k) and v are written to the caches at their slots (cast to the cache dtype), rot(q)
is returned as a new contiguous [T, H, D] tensor (or written into `q_out`). Rotation in fp32.

Nothing here reads device values on the host (CUDA-graph safe); consequently positions and slots
are NOT range-checked: an out-of-range position or slot is undefined behaviour, as in any gather.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FLOAT_DTYPES as _FLOAT_DTYPES
from ._checks import require
_INDEX_DTYPES = (torch.int64, torch.int32)


@triton.jit
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, qo_ptr,
    sq_t, sq_h, sq_d,
    sk_t, sk_h, sk_d,
    sv_t, sv_h, sv_d,
    scs_p, scs_d,
    skc_b, skc_s, skc_h, skc_d,
    svc_b, svc_s, svc_h, svc_d,
    sqo_t, sqo_h, sqo_d,
    spos, sslot, BS,
    H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One program per token: all of its q heads, k heads and v heads. cos/sin are loaded once.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t * spos).to(tl.int64)
    slot = tl.load(slot_ptr + t * sslot).to(tl.int64)
    blk = slot // BS
    off = slot % BS

    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    cos = tl.load(cs_ptr + pos * scs_p + d * scs_d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * scs_p + (d + HALF) * scs_d, mask=d_ok, other=0.0).to(tl.float32)
    cos = cos[None, :]
    sin = sin[None, :]
    dd = d[None, :]

    # ---- q: rotate, write to q_out ----
    hq = tl.arange(0, BLOCK_H)[:, None]
    mq = (hq < H) & d_ok[None, :]
    q_base = q_ptr + t * sq_t + hq * sq_h
    q1 = tl.load(q_base + dd * sq_d, mask=mq, other=0.0).to(tl.float32)
    q2 = tl.load(q_base + (dd + HALF) * sq_d, mask=mq, other=0.0).to(tl.float32)
    qo_base = qo_ptr + t * sqo_t + hq * sqo_h
    tl.store(qo_base + dd * sqo_d, (q1 * cos - q2 * sin).to(qo_ptr.dtype.element_ty), mask=mq)
    tl.store(qo_base + (dd + HALF) * sqo_d, (q2 * cos + q1 * sin).to(qo_ptr.dtype.element_ty),
             mask=mq)

    # ---- k: rotate, store at the slot; v: copy to the slot ----
    hk = tl.arange(0, BLOCK_HKV)[:, None]
    mk = (hk < HKV) & d_ok[None, :]
    k_base = k_ptr + t * sk_t + hk * sk_h
    k1 = tl.load(k_base + dd * sk_d, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(k_base + (dd + HALF) * sk_d, mask=mk, other=0.0).to(tl.float32)
    kc_base = kc_ptr + blk * skc_b + off * skc_s + hk * skc_h
    tl.store(kc_base + dd * skc_d, (k1 * cos - k2 * sin).to(kc_ptr.dtype.element_ty), mask=mk)
    tl.store(kc_base + (dd + HALF) * skc_d, (k2 * cos + k1 * sin).to(kc_ptr.dtype.element_ty),
             mask=mk)

    v_base = v_ptr + t * sv_t + hk * sv_h
    vc_base = vc_ptr + blk * svc_b + off * svc_s + hk * svc_h
    v1 = tl.load(v_base + dd * sv_d, mask=mk, other=0.0)
    v2 = tl.load(v_base + (dd + HALF) * sv_d, mask=mk, other=0.0)
    tl.store(vc_base + dd * svc_d, v1.to(vc_ptr.dtype.element_ty), mask=mk)
    tl.store(vc_base + (dd + HALF) * svc_d, v2.to(vc_ptr.dtype.element_ty), mask=mk)


def _validate(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, q_out):
    tensors = dict(q=q, k=k, v=v, positions=positions, cos_sin=cos_sin, k_cache=k_cache,
                   v_cache=v_cache, slot_mapping=slot_mapping)
    for name, x in tensors.items():
        require(isinstance(x, torch.Tensor), f"rope_and_store_kv: {name} must be a torch.Tensor, "
                                            f"got {type(x).__name__}")
    require(q.dim() == 3, f"rope_and_store_kv: q must be [T, H, D], got shape {tuple(q.shape)}")
    t, h, d = q.shape
    require(d % 2 == 0 and d > 0, f"rope_and_store_kv: head_dim must be even and > 0, got {d}")
    require(k.dim() == 3 and k.shape[0] == t and k.shape[2] == d,
           f"rope_and_store_kv: k must be [T={t}, Hkv, D={d}], got shape {tuple(k.shape)}")
    hkv = k.shape[1]
    require(hkv > 0 and h > 0, f"rope_and_store_kv: need at least one head (H={h}, Hkv={hkv})")
    require(tuple(v.shape) == tuple(k.shape),
           f"rope_and_store_kv: v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    require(q.dtype in _FLOAT_DTYPES, f"rope_and_store_kv: q dtype must be one of "
                                     f"{_FLOAT_DTYPES}, got {q.dtype}")
    require(k.dtype == q.dtype and v.dtype == q.dtype,
           f"rope_and_store_kv: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    require(positions.dim() == 1 and positions.shape[0] == t,
           f"rope_and_store_kv: positions must be [T={t}], got shape {tuple(positions.shape)}")
    require(positions.dtype in _INDEX_DTYPES,
           f"rope_and_store_kv: positions must be int64 or int32, got {positions.dtype}")
    require(slot_mapping.dim() == 1 and slot_mapping.shape[0] == t,
           f"rope_and_store_kv: slot_mapping must be [T={t}], got shape "
           f"{tuple(slot_mapping.shape)}")
    require(slot_mapping.dtype in _INDEX_DTYPES,
           f"rope_and_store_kv: slot_mapping must be int64 or int32, got {slot_mapping.dtype}")
    require(cos_sin.dim() == 2 and cos_sin.shape[1] == d and cos_sin.shape[0] > 0,
           f"rope_and_store_kv: cos_sin must be [max_pos, D={d}], got shape "
           f"{tuple(cos_sin.shape)}")
    require(cos_sin.dtype == torch.float32,
           f"rope_and_store_kv: cos_sin must be float32, got {cos_sin.dtype}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        require(c.dim() == 4 and c.shape[2] == hkv and c.shape[3] == d and c.shape[0] > 0
               and c.shape[1] > 0,
               f"rope_and_store_kv: {name} must be [NB, BS, Hkv={hkv}, D={d}], got shape "
               f"{tuple(c.shape)}")
        require(c.dtype in _FLOAT_DTYPES,
               f"rope_and_store_kv: {name} dtype must be one of {_FLOAT_DTYPES}, got {c.dtype}")
    require(tuple(k_cache.shape) == tuple(v_cache.shape),
           f"rope_and_store_kv: k_cache {tuple(k_cache.shape)} and v_cache "
           f"{tuple(v_cache.shape)} differ in shape")
    require(k_cache.dtype == v_cache.dtype,
           f"rope_and_store_kv: k_cache and v_cache dtypes differ ({k_cache.dtype}, "
           f"{v_cache.dtype})")
    if q_out is not None:
        require(isinstance(q_out, torch.Tensor), "rope_and_store_kv: q_out must be a torch.Tensor")
        require(tuple(q_out.shape) == tuple(q.shape),
               f"rope_and_store_kv: q_out must have q's shape {tuple(q.shape)}, got "
               f"{tuple(q_out.shape)}")
        require(q_out.dtype == q.dtype,
               f"rope_and_store_kv: q_out dtype must be {q.dtype}, got {q_out.dtype}")
        tensors["q_out"] = q_out
    dev = q.device
    for name, x in tensors.items():
        require(x.device == dev, f"rope_and_store_kv: {name} is on {x.device}, q on {dev}")


def rope_and_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, *, q_out: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Rotates q and k (NeoX pairing, fp32 math), writes rot(k) and v into the paged caches at
    `slot_mapping`, returns rot(q) ([T, H, D], contiguous unless `q_out` is given). All inputs may
    be strided views; nothing is copied. q_out may be q itself (in-place rotation)."""
    _validate(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, q_out)
    t, h, d = q.shape
    hkv = k.shape[1]
    if q_out is None:
        q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    half = d // 2
    block_half = triton.next_power_of_2(half)
    block_h = triton.next_power_of_2(h)
    block_hkv = triton.next_power_of_2(hkv)
    # Per token: (H + 2 Hkv) * D elements; 12+4 heads x 128 = 2048 -> 4 warps (16 elems/thread).
    elems = (block_h + 2 * block_hkv) * 2 * block_half
    num_warps = 1 if elems <= 256 else 2 if elems <= 1024 else 4 if elems <= 4096 else 8
    _rope_store_kernel[(t,)](
        q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, q_out,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        cos_sin.stride(0), cos_sin.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        q_out.stride(0), q_out.stride(1), q_out.stride(2),
        positions.stride(0), slot_mapping.stride(0), k_cache.shape[1],
        H=h, HKV=hkv, HALF=half,
        BLOCK_H=block_h, BLOCK_HKV=block_hkv, BLOCK_HALF=block_half,
        num_warps=num_warps,
    )
    return q_out


def rope_and_store_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                          q_out: torch.Tensor | None = None) -> torch.Tensor:
    """The spec, in plain torch (fp32 math). Same arguments and effects as rope_and_store_kv."""
    half = q.shape[-1] // 2
    cs = cos_sin[positions.long()].float()            # [T, D]
    cos = cs[:, None, :half]                          # [T, 1, D/2]
    sin = cs[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:     # fp32 result
        x1, x2 = x.float()[..., :half], x.float()[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    slots = slot_mapping.long()
    block_size = k_cache.shape[1]
    blk, off = slots // block_size, slots % block_size
    k_cache[blk, off] = rotate(k).to(k_cache.dtype)   # advanced indexing writes through the view
    v_cache[blk, off] = v.to(v_cache.dtype)
    q_rot = rotate(q).to(q.dtype)
    if q_out is None:
        return q_rot
    q_out.copy_(q_rot)
    return q_out
