"""Paged attention over a block-table KV cache (pdserve.kernels.paged_attention).

CPU runs go through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA):
tiny shapes, fp32 and fp16, checked against paged_attention_ref AND an independent float64 dense
reference written here. Every case is built adversarially: the cache is NaN everywhere except the
slots that hold a sequence's tokens (so reading a slot past seq_len, a stale block-table entry or
an unused block poisons the output), unused block-table entries point at a NaN block, q is a
strided slice of a fused qkv tensor, the caches are kv[0] / kv[1] views, and the output is NaN
before the call. Rows past query_start_loc[B] (no sequence) must come back untouched (still NaN).

Sliding windows are checked the same way (the float64 reference keeps keys > p - window), and
keys below the window are poisoned to prove they are never read.

GPU runs (@pytest.mark.gpu): bf16 at Qwen2.5-1.5B / 7B shapes, long contexts, CUDA graphs.
"""
from __future__ import annotations

import math
import os
import textwrap

import pytest
import torch

from pdserve.kernels import paged_attention as pa
from pdserve.kernels.paged_attention import (default_num_kv_splits, paged_attention,
                                             paged_attention_ref)

from ..utils import run_compiled

DEV = "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------------------------
# Case construction and the independent reference
# ----------------------------------------------------------------------------------------------

def make_case(q_lens, ctxs, H, Hkv, D, BS, dtype, *, device=DEV, seed=0, pad_tokens=0,
              strided_q=True, pad_seq_lens=None):
    """A batch of len(q_lens) sequences; sequence b has ctxs[b] cached tokens and q_lens[b] new
    ones (q_len 0: a padding row, with seq_len pad_seq_lens[b] or 0). pad_tokens extra q rows past
    the last sequence belong to no sequence."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B = len(q_lens)
    seq_lens = [c + n if n else 0 for c, n in zip(ctxs, q_lens)]
    if pad_seq_lens is not None:
        seq_lens = [s if n else p for s, n, p in zip(seq_lens, q_lens, pad_seq_lens)]
    nblk = [-(-s // BS) if n else 0 for s, n in zip(seq_lens, q_lens)]
    max_blocks = max(max(nblk) + 2, 1)
    nb = sum(nblk) + 3                      # + unused blocks; the last one is the NaN "stale" block
    kv = torch.full((2, nb, BS, Hkv, D), float("nan"), dtype=torch.float32)
    perm = torch.randperm(nb - 1, generator=g)
    stale = nb - 1
    block_tables = torch.full((B, max_blocks), stale, dtype=torch.int32)
    used = 0
    for b in range(B):
        ids = perm[used:used + nblk[b]]
        used += nblk[b]
        block_tables[b, :nblk[b]] = ids.to(torch.int32)
        if nblk[b]:
            vals = torch.randn(2, seq_lens[b], Hkv, D, generator=g)
            flat = kv[:, ids.long()].reshape(2, nblk[b] * BS, Hkv, D)
            flat[:, :seq_lens[b]] = vals    # slots past seq_len in the last block stay NaN
            kv[:, ids.long()] = flat.view(2, nblk[b], BS, Hkv, D)
    T = sum(q_lens) + pad_tokens
    if strided_q:   # q as the first H heads of a fused [T, H + 2 Hkv, D] qkv projection
        q = torch.randn(T, H + 2 * Hkv, D, generator=g)[:, :H]
    else:
        q = torch.randn(T, H, D, generator=g)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    kv = kv.to(device=device, dtype=dtype)
    q = q.to(device=device, dtype=dtype)
    if strided_q:
        big = torch.zeros(T, H + 2 * Hkv, D, dtype=dtype, device=device)
        big[:, :H] = q
        q = big[:, :H]
    return dict(q=q, kv=kv, k_cache=kv[0], v_cache=kv[1], block_tables=block_tables.to(device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                query_start_loc=qsl.to(device), scale=1.0 / math.sqrt(D),
                max_query_len=max(q_lens) if q_lens else 0, max_seq_len=max(seq_lens + [0]),
                n_real=sum(q_lens), q_lens=list(q_lens), ctxs=list(ctxs))


def dense_ref64(case, window=None) -> torch.Tensor:
    """Independent float64 reference: rebuild each sequence's K/V block by block from the table,
    expand heads by h // G, causal mask offset by the cached context (with a window: only the
    `window` most recent positions up to the query's own), plain softmax."""
    q, kv, bt = case["q"].double().cpu(), case["kv"].double().cpu(), case["block_tables"].cpu()
    T, H, D = q.shape
    BS, Hkv = kv.shape[2], kv.shape[3]
    G = H // Hkv
    out = torch.full((T, H, D), float("nan"), dtype=torch.float64)
    start = 0
    for b, n in enumerate(case["q_lens"]):
        if n == 0:
            continue
        ctx = case["ctxs"][b]
        L = ctx + n
        blocks = [kv[:, int(bt[b, i])] for i in range(-(-L // BS))]   # each [2, BS, Hkv, D]
        kvs = torch.cat(blocks, dim=1)[:, :L]                           # [2, L, Hkv, D]
        heads = torch.arange(H) // G
        k, v = kvs[0][:, heads], kvs[1][:, heads]                       # [L, H, D]
        qq = q[start:start + n]                                         # [n, H, D]
        s = torch.einsum("nhd,lhd->hnl", qq, k) * case["scale"]
        qpos = (ctx + torch.arange(n))[:, None]
        allowed = torch.arange(L)[None, :] <= qpos                      # [n, L]
        if window is not None:
            allowed &= torch.arange(L)[None, :] >= qpos - (window - 1)
        s = s.masked_fill(~allowed[None], float("-inf"))
        out[start:start + n] = torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), v)
        start += n
    return out


def run(case, fn=None, **kw):
    """Call the kernel with a NaN-poisoned out; tuning overrides go to the private launcher."""
    if fn is None:
        private = {"decode_config", "prefill_config", "only_prefill_kernel"}
        fn = pa._paged_attention if private & set(kw) else paged_attention
    out = torch.full(case["q"].shape, float("nan"), dtype=case["q"].dtype, device=case["q"].device)
    kw.setdefault("max_query_len", case["max_query_len"])
    kw.setdefault("max_seq_len", case["max_seq_len"])
    res = fn(case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"],
             case["query_start_loc"], case["scale"], out=out, **kw)
    assert res is out
    return out


TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def check(case, out, dtype, window=None, refs=None):
    """refs: (dense float64, paged_attention_ref) computed beforehand (when the cache has been
    poisoned since)."""
    n = case["n_real"]
    got = out[:n].double().cpu()
    assert not torch.isnan(got).any(), "a query row was left unwritten or read poisoned K/V"
    assert torch.isnan(out[n:]).all(), "rows that belong to no sequence must be left untouched"
    ref64, ref = refs or references(case, window)
    err64 = (got - ref64[:n]).abs().max().item() if n else 0.0
    assert err64 <= TOL[dtype], f"max abs err vs float64 dense reference {err64}"
    err = (got - ref[:n].double().cpu()).abs().max().item() if n else 0.0
    assert err <= TOL[dtype], f"max abs err vs paged_attention_ref {err}"


def references(case, window=None):
    ref = paged_attention_ref(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                              case["seq_lens"], case["query_start_loc"], case["scale"],
                              sliding_window=window)
    return dense_ref64(case, window), ref


# ----------------------------------------------------------------------------------------------
# CPU (interpreter) tests: tiny shapes
# ----------------------------------------------------------------------------------------------

D_CPU, BS_CPU = 16, 16
SMALL_N = {"block_n": 16}            # several key tiles even for contexts of a few dozen tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_matches_dense_float64(dtype):
    case = make_case([1, 3, 0, 5], [20, 0, 0, 37], 4, 2, D_CPU, BS_CPU, dtype, pad_tokens=1)
    ref = paged_attention_ref(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                              case["seq_lens"], case["query_start_loc"], case["scale"])
    n = case["n_real"]
    assert (ref[:n].double() - dense_ref64(case)[:n]).abs().max() <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_batch(dtype):
    case = make_case([1] * 5, [0, 15, 16, 47, 70], 4, 2, D_CPU, BS_CPU, dtype, pad_tokens=2)
    check(case, run(case, decode_config=SMALL_N), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_no_context(dtype):
    case = make_case([9, 20], [0, 0], 4, 2, D_CPU, BS_CPU, dtype)
    check(case, run(case, prefill_config={"block_m": 16, "block_n": 16}), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunked_prefill_with_context(dtype):
    case = make_case([7, 19], [33, 50], 4, 2, D_CPU, BS_CPU, dtype, pad_tokens=1)
    check(case, run(case, prefill_config={"block_m": 16, "block_n": 16}), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_batch_with_padding_rows(dtype):
    # decodes, a short multi-token row (decode launch), prefill chunks, padding rows (q_len 0)
    # with seq_len 0 and with a stale seq_len; then unassigned q rows at the end
    case = make_case([1, 1, 3, 0, 12, 1, 0, 20], [40, 0, 30, 0, 25, 63, 0, 0], 4, 2, D_CPU,
                     BS_CPU, dtype, pad_tokens=3, pad_seq_lens=[0, 0, 0, 0, 0, 0, 57, 0])
    check(case, run(case, decode_config=SMALL_N, prefill_config={"block_m": 16, "block_n": 16}),
          dtype)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (8, 2), (6, 2), (4, 1), (8, 1)])
def test_gqa_group_sizes(H, Hkv):
    # group sizes 1, 2, 4, 3 (tiles hold floor(16 / 3) = 5 tokens), 4 and 8 with one kv head
    case = make_case([1, 1, 6, 11], [29, 3, 17, 20], H, Hkv, D_CPU, BS_CPU, torch.float32,
                     seed=H * 10 + Hkv, pad_tokens=1)
    check(case, run(case, decode_config=SMALL_N, prefill_config={"block_m": 16, "block_n": 16}),
          torch.float32)


@pytest.mark.parametrize("only_prefill_kernel", [False, True])
def test_forced_splits_equal_single_split(only_prefill_kernel):
    case = make_case([1, 1, 1, 2, 9], [70, 5, 48, 30, 40], 4, 2, D_CPU, BS_CPU, torch.float32,
                     seed=3, pad_tokens=1)

    def go(splits):
        # num_kv_splits drives the decode launch; the prefill launch takes its own override
        return run(case, num_kv_splits=splits, decode_config=SMALL_N,
                   prefill_config={"block_m": 16, "block_n": 16, "num_kv_splits": splits},
                   only_prefill_kernel=only_prefill_kernel)

    one = go(1)
    check(case, one, torch.float32)
    for splits in (3, 7):   # 7: some splits of short rows are empty
        many = go(splits)
        check(case, many, torch.float32)
        n = case["n_real"]
        assert torch.allclose(many[:n], one[:n], atol=1e-5, rtol=0)


def test_prefill_kernel_alone_handles_decodes_and_default_tiles():
    # the query-tile launch with its default 64-row tiles, decode rows included, fp16
    case = make_case([1, 17, 1, 30], [33, 10, 0, 20], 4, 2, D_CPU, BS_CPU, torch.float16, seed=5,
                     pad_tokens=2)
    check(case, run(case, only_prefill_kernel=True), torch.float16)


def test_default_configs_and_loose_bounds():
    """Default tiles and heuristics; max_query_len / max_seq_len are only upper bounds (as under
    CUDA-graph capture): loose bounds give the same result as tight ones."""
    case = make_case([1, 1, 5, 18], [80, 600, 9, 30], 4, 2, 32, BS_CPU, torch.float32, seed=7,
                     pad_tokens=1)
    tight = run(case)
    check(case, tight, torch.float32)
    loose = run(case, max_query_len=64, max_seq_len=1024)   # also turns split-K on by default
    assert default_num_kv_splits(4 * 2, 1024) > 1
    check(case, loose, torch.float32)
    n = case["n_real"]
    assert torch.allclose(loose[:n], tight[:n], atol=1e-5, rtol=0)


@pytest.mark.parametrize("max_query_len", [20, 128, 256, 1024])
def test_prefill_tiles_by_chunk_bound(max_query_len):
    """The query-tile launch's tiles follow the step's chunk bound (prefill_config_for: wide key
    tiles for half dtypes at <= 128 and >= 1024 tokens); every bound gives the reference's
    result, in fp16 (where the wide tiles apply) over a context of several of them."""
    case = make_case([1, 20, 7], [300, 150, 0], 4, 2, D_CPU, BS_CPU, torch.float16, seed=3,
                     pad_tokens=1)
    wide = pa.prefill_config_for(max_query_len, torch.float16)
    assert (wide["block_n_elems"] > pa.PREFILL_CONFIG["block_n_elems"]) == (
        max_query_len in (20, 128, 1024))
    assert pa.prefill_config_for(max_query_len, torch.float32) is pa.PREFILL_CONFIG
    check(case, run(case, max_query_len=max_query_len, max_seq_len=1024), torch.float16)


@pytest.fixture
def poisoned_partials(monkeypatch):
    """Every float32 torch.empty (the split partials) comes back NaN-filled: a reduce that reads
    a split no stage-1 program wrote gives NaN, whatever the allocator happened to hold."""
    empty = torch.empty

    def poisoned(*a, **k):
        t = empty(*a, **k)
        return t.fill_(float("nan")) if t.dtype == torch.float32 else t
    monkeypatch.setattr(torch, "empty", poisoned)


# (the sliding window with the default rule only: the interpreter takes ~10 s a case)
@pytest.mark.parametrize("cfg,window", [
    ({"chunk_sqrt": 0}, None), ({}, None), ({}, 1000), ({"min_chunk": 256, "chunk_sqrt": 0}, None)],
    ids=["one-tile", "default-sqrt", "default-sqrt-window", "min-chunk-256"])
def test_splits_follow_each_sequence_under_a_captured_bound(poisoned_partials, window, cfg):
    """Under a CUDA graph max_seq_len is the captured bound (here 32k), so the heuristic launches
    many splits; each sequence uses only the splits its own keys fill (at least one 16-key tile,
    sqrt(16 keys) keys by default for decode, or min_chunk keys) and the reduce reads only those
    (poisoned partials)."""
    # decodes of 1 to ~1,300 keys, a padding row and a prefill chunk over a 2,500-token context
    case = make_case([1, 1, 1, 1, 1, 0, 20], [4, 39, 299, 700, 1290, 0, 2500], 4, 2, D_CPU,
                     BS_CPU, torch.float32, seed=13, pad_tokens=1)
    bound = 32768
    if window is None:
        # 38 decode splits launched (4 x 132 SMs / 14 programs); the 1,291-key row fills 27 of
        # them with one-tile minima (48-key splits: 1,291 / 38 rounded up to 16-key tiles), 9
        # with the default (sqrt(16 * 1,291) = 143.7: 144-key splits), the shorter rows fewer
        assert default_num_kv_splits(7 * 2, bound) == 38
    out = run(case, max_query_len=64, max_seq_len=bound, sliding_window=window,
              decode_config={**SMALL_N, **cfg},
              prefill_config={"block_n": 16, "chunk_sqrt": 16, **cfg})
    check(case, out, torch.float32, window=window)
    # the same with the tight bound (eager: the heuristic sees the real lengths)
    tight = run(case, sliding_window=window, decode_config=SMALL_N,
                prefill_config={"block_n": 16})
    n = case["n_real"]
    assert torch.allclose(out[:n], tight[:n], atol=1e-5, rtol=0)


_HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("dev", [
    pytest.param("cpu", marks=pytest.mark.skipif(_HAS_CUDA, reason="interpreter runs only")),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not _HAS_CUDA, reason="needs CUDA")])])
def test_split_chunk_rule_against_a_python_reference(dev):
    """_split_chunk's (keys per split, splits holding keys) over key ranges up to 70k, against
    the rule written in Python with math.isqrt: chunk = the range over num_splits rounded up to
    the tile, at least MIN_CHUNK and at least floor(sqrt(16 keys)) rounded up to the tile. On a
    GPU (where tl.sqrt may be approximate) as on the interpreter."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(lo_ptr, hi_ptr, out_ptr, num_splits, BLOCK_N: tl.constexpr,
              MIN_CHUNK: tl.constexpr, CHUNK_SQRT: tl.constexpr):
        i = tl.program_id(0)
        chunk, active = pa._split_chunk(tl.load(lo_ptr + i), tl.load(hi_ptr + i), num_splits,
                                        BLOCK_N, MIN_CHUNK, CHUNK_SQRT)
        tl.store(out_ptr + 2 * i, chunk)
        tl.store(out_ptr + 2 * i + 1, active)

    def ref(n, splits, bn, min_chunk, k):
        chunk = max(-(-(-(-n // splits)) // bn) * bn, min_chunk)
        if k:
            chunk = max(chunk, -(-math.isqrt(k * n) // bn) * bn)
        return chunk, -(-n // chunk)
    gen = torch.Generator().manual_seed(0)
    hi = torch.cat([torch.arange(1, 300), torch.tensor([1291, 4000, 4095, 4096, 4097, 16000,
                                                         65536, 70000]),
                    torch.randint(1, 70000, (200,), generator=gen)]).to(torch.int32)
    lo = torch.where(hi > 2000, hi // 3, 0).to(torch.int32)   # windows start past 0 too
    for splits, bn, min_chunk, k in [(64, 64, 64, 16), (38, 16, 16, 16), (5, 64, 256, 16),
                                     (64, 64, 64, 0)]:
        out = torch.zeros(2 * len(hi), dtype=torch.int32, device=dev)
        probe[(len(hi),)](lo.to(dev), hi.to(dev), out, splits, BLOCK_N=bn, MIN_CHUNK=min_chunk,
                          CHUNK_SQRT=k)
        want = [ref(int(h - l), splits, bn, min_chunk, k) for l, h in zip(lo, hi)]
        assert out.view(-1, 2).tolist() == [list(w) for w in want]


def test_pure_decode_with_decode_bound_only():
    # max_query_len = 1 (a captured decode graph): only the decode launch runs
    case = make_case([1, 1, 0, 1], [5, 44, 0, 16], 8, 2, D_CPU, BS_CPU, torch.float16, seed=9)
    check(case, run(case, max_query_len=1, num_kv_splits=2, decode_config=SMALL_N), torch.float16)


@pytest.mark.parametrize("BS,D,block_n", [(32, 16, 16), (32, 16, 64), (16, 24, 32)])
def test_block_size_32_and_padded_head_dim(BS, D, block_n):
    # key tiles of half a block, of two blocks; D = 24 padded to 32 lanes
    case = make_case([1, 4, 13], [50, 31, 40], 4, 2, D, BS, torch.float32, seed=BS + D)
    check(case, run(case, decode_config={"block_n": block_n},
                    prefill_config={"block_m": 16, "block_n": block_n}), torch.float32)


def test_contiguous_inputs_and_default_out():
    case = make_case([1, 6], [21, 12], 4, 2, D_CPU, BS_CPU, torch.float32, strided_q=False, seed=11)
    q = case["q"].contiguous()
    kc, vc = case["k_cache"].contiguous(), case["v_cache"].contiguous()
    out = paged_attention(q, kc, vc, case["block_tables"], case["seq_lens"],
                          case["query_start_loc"], case["scale"], max_query_len=6, max_seq_len=18)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert (out.double() - dense_ref64(case)).abs().max() <= TOL[torch.float32]


def test_all_padding_and_empty_batches():
    case = make_case([0, 0], [0, 0], 4, 2, D_CPU, BS_CPU, torch.float32, pad_tokens=2)
    out = run(case, max_query_len=0, max_seq_len=0)
    assert torch.isnan(out).all()                      # nothing belongs to a sequence
    q = torch.empty(0, 4, D_CPU)
    kv = torch.zeros(2, 1, BS_CPU, 2, D_CPU)
    z = torch.zeros(1, dtype=torch.int32)
    res = paged_attention(q, kv[0], kv[1], torch.zeros(0, 1, dtype=torch.int32),
                          torch.zeros(0, dtype=torch.int32), z, 1.0, max_query_len=0,
                          max_seq_len=0)
    assert res.shape == (0, 4, D_CPU)


def test_default_num_kv_splits_heuristic():
    assert default_num_kv_splits(2, 256) == 1                  # short context: never split
    assert default_num_kv_splits(128 * 8, 8192) == 1           # grid already full
    s = default_num_kv_splits(1 * 2, 8192)                     # one long sequence, 2 kv heads
    assert s == 8192 // 256                                    # capped by >= 256 keys per split
    s = default_num_kv_splits(8 * 2, 8192)
    assert 16 * s >= 2 * 132 and 8192 // s >= 256
    s = default_num_kv_splits(64 * 2, 8192)
    assert 128 * s >= 2 * 132


def poison_below(case, first_key_read):
    """NaN into every cached key/value of sequence b below position first_key_read[b]: the kernel
    must not read them at all (a masked read would still turn the output into NaN)."""
    BS = case["kv"].shape[2]
    for b, lo in enumerate(first_key_read):
        for p in range(lo):
            case["kv"][:, int(case["block_tables"][b, p // BS]), p % BS] = float("nan")


# a decode with a long context, a short multi-token row (decode launch), a padding row, a
# prefill chunk over cached context and one from scratch, all longer than most windows below
WINDOW_CASE = dict(q_lens=[1, 3, 0, 18, 12], ctxs=[45, 20, 0, 23, 0])
WINDOW_TILES = dict(decode_config=SMALL_N, prefill_config={"block_m": 16, "block_n": 16})


@pytest.mark.parametrize("window,dtype", [(1, torch.float32), (5, torch.float32),
                                          (16, torch.float16), (17, torch.float32),
                                          (22, torch.float32), (45, torch.float32),
                                          (100, torch.float32)])
def test_sliding_window(window, dtype):
    """Each query at position p sees keys (p - window, p]: windows of one key, smaller than a
    key tile, exactly a tile, one past it, longer than any sequence (= no window). 22 and 45 put
    the last row's window edge one key past a tile boundary (the prefill tile at j0 = 8 of the
    ctx-23 row; the decode row at 45): that tile must still be masked."""
    case = make_case(**WINDOW_CASE, H=4, Hkv=2, D=D_CPU, BS=BS_CPU, dtype=dtype, seed=window,
                     pad_tokens=2)
    out = run(case, sliding_window=window, **WINDOW_TILES)
    check(case, out, dtype, window)
    if window == 100:   # a window longer than every sequence changes nothing
        check(case, out, dtype)


@pytest.mark.parametrize("only_prefill_kernel", [False, True])
def test_sliding_window_forced_splits(poisoned_partials, only_prefill_kernel):
    """Split-K over the window's key range (not over [0, seq_len)): same as one split. A row's
    window holds fewer keys than its sequence, so it fills fewer splits: stage 1 and the reduce
    must count them over the window (poisoned partials)."""
    case = make_case(**WINDOW_CASE, H=4, Hkv=2, D=D_CPU, BS=BS_CPU, dtype=torch.float32, seed=2,
                     pad_tokens=1)
    kw = dict(sliding_window=9, only_prefill_kernel=only_prefill_kernel)
    one = run(case, num_kv_splits=1, **kw, **WINDOW_TILES)
    many = run(case, num_kv_splits=3, **kw, decode_config=SMALL_N,
               prefill_config={"block_m": 16, "block_n": 16, "num_kv_splits": 3})
    check(case, many, torch.float32, 9)
    n = case["n_real"]
    assert torch.allclose(many[:n], one[:n], atol=1e-5, rtol=0)


def test_sliding_window_skips_keys_below_the_window():
    """Keys below the first query's window (rounded down to a key tile) are never read: poisoned
    with NaN there, the output is unchanged. Decode rows and a prefill chunk over context."""
    window, block_n = 8, 16
    case = make_case([1, 1, 20], [90, 40, 50], 4, 2, D_CPU, BS_CPU, torch.float32, seed=21)
    refs = references(case, window)
    first = [(max(c + 1 - window, 0) // block_n) * block_n for c in case["ctxs"]]
    assert min(first) >= 32
    poison_below(case, first)
    out = run(case, sliding_window=window, decode_config={"block_n": block_n},
              prefill_config={"block_m": 16, "block_n": block_n, "num_kv_splits": 2},
              num_kv_splits=2)
    check(case, out, torch.float32, window, refs)


def _bad_inputs():
    c = make_case([1, 3], [10, 5], 4, 2, D_CPU, BS_CPU, torch.float32)
    args = dict(q=c["q"], k_cache=c["k_cache"], v_cache=c["v_cache"],
                block_tables=c["block_tables"], seq_lens=c["seq_lens"],
                query_start_loc=c["query_start_loc"], scale=c["scale"])
    kw = dict(max_query_len=3, max_seq_len=8)
    kv_t = c["kv"].transpose(-1, -2).contiguous().transpose(-1, -2)   # same shape, last dim strided
    bad = {
        "q fp64": (dict(q=c["q"].double()), {}),
        "q 2-d": (dict(q=c["q"].reshape(c["q"].shape[0], -1)), {}),
        "cache dtype": (dict(k_cache=c["k_cache"].half(), v_cache=c["v_cache"].half()), {}),
        "k/v shapes": (dict(v_cache=c["v_cache"][:-1]), {}),
        "k/v strides": (dict(v_cache=torch.zeros(*c["v_cache"].shape[:3], 2 * D_CPU)[..., :D_CPU]),
                        {}),
        "H % Hkv": (dict(q=torch.randn(4, 3, D_CPU)), {}),
        "head dim": (dict(q=torch.randn(4, 4, 8)), {}),
        "q last dim": (dict(q=torch.randn(4, D_CPU, 4).transpose(1, 2)), {}),
        "cache last dim": (dict(k_cache=kv_t[0], v_cache=kv_t[1]), {}),
        "int64 table": (dict(block_tables=c["block_tables"].long()), {}),
        "int64 seq_lens": (dict(seq_lens=c["seq_lens"].long()), {}),
        "int64 qsl": (dict(query_start_loc=c["query_start_loc"].long()), {}),
        "qsl length": (dict(query_start_loc=c["query_start_loc"][:-1]), {}),
        "seq_lens length": (dict(seq_lens=c["seq_lens"][:1]), {}),
        "table 1-d": (dict(block_tables=c["block_tables"][0]), {}),
        "scale nan": (dict(scale=float("nan")), {}),
        "negative bound": ({}, dict(max_query_len=-1)),
        "float bound": ({}, dict(max_seq_len=8.0)),
        "tensor bound": ({}, dict(max_query_len=torch.tensor(3))),
        "zero splits": ({}, dict(num_kv_splits=0)),
        "out shape": ({}, dict(out=torch.empty(1, 4, D_CPU))),
        "out dtype": ({}, dict(out=torch.empty(c["q"].shape, dtype=torch.float16))),
        "not a tensor": (dict(seq_lens=[11, 8]), {}),
        "zero window": ({}, dict(sliding_window=0)),
        "float window": ({}, dict(sliding_window=4.0)),
        "tensor window": ({}, dict(sliding_window=torch.tensor(4))),
    }
    for name, (a, k) in bad.items():
        yield pytest.param({**args, **a}, {**kw, **k}, id=name)


@pytest.mark.parametrize("args,kw", list(_bad_inputs()))
def test_bad_inputs_raise_value_error(args, kw):
    with pytest.raises(ValueError):
        paged_attention(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"),
                        args.pop("block_tables"), args.pop("seq_lens"),
                        args.pop("query_start_loc"), args.pop("scale"), **kw)


_PTXAS = os.path.join(os.path.dirname(__import__("triton").__file__), "backends", "nvidia", "bin",
                      "ptxas")


@pytest.mark.skipif(not os.path.exists(_PTXAS), reason="needs the ptxas shipped in the triton wheel")
def test_kernels_compile_for_sm90():
    """The interpreter accepts things the compiler rejects (non-constexpr globals, loop-carried
    type changes, early returns in loops...). Compile every kernel variant ahead of time for
    sm_90 (H100/H200) down to a cubin with the wheel's ptxas: no GPU needed. Runs in a
    subprocess because this process has TRITON_INTERPRET=1."""
    script = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from pdserve.kernels import paged_attention as pa

        def sig_of(fn, dt):
            sig = {}
            for n in fn.arg_names:
                if n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr"): sig[n] = "*" + dt
                elif n in ("bt_ptr", "sl_ptr", "qsl_ptr"): sig[n] = "*i32"
                elif n in ("m_part", "l_part", "acc_part"): sig[n] = "*fp32"
                elif n == "qk_scale": sig[n] = "fp32"
                elif n.isupper(): sig[n] = "constexpr"
                else: sig[n] = "i32"
            return sig

        def build(fn, dt, const, nw, ns):
            div = [i for i, n in enumerate(fn.arg_names) if n.endswith("_ptr") or n.endswith(
                "_part") or n in ("stride_qt", "stride_qh", "stride_ot", "stride_oh",
                                  "stride_cb", "stride_cs", "stride_ch")]
            attrs = {(i,): [["tt.divisibility", 16]] for i in div}
            k = triton.compile(ASTSource(fn, sig_of(fn, dt), const, attrs),
                               target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=nw, num_stages=ns))
            assert k.asm["cubin"]
            return k

        for dt, G, D, one, split, sliding, cfg in [
                ("bf16", 6, 128, True, True, False, pa.DECODE_CONFIG),
                ("bf16", 7, 128, True, False, False, pa.DECODE_CONFIG),
                ("fp16", 1, 64, True, True, False, pa.DECODE_CONFIG),
                ("bf16", 6, 128, False, False, False, pa.PREFILL_CONFIG),
                ("bf16", 7, 96, False, True, False, pa.PREFILL_CONFIG),
                ("bf16", 4, 128, False, True, True, pa.PREFILL_CONFIG),
                ("fp32", 2, 64, False, False, False, pa.PREFILL_CONFIG),
                ("bf16", 6, 128, False, True, False,
                 {**pa.PREFILL_CONFIG, **pa.PREFILL_WIDE_CONFIG}),
                ("fp16", 4, 128, False, False, True,
                 {**pa.PREFILL_CONFIG, **pa.PREFILL_WIDE_CONFIG})]:
            d_pad = 1 << (D - 1).bit_length()
            bm = max(cfg["block_m"], 1 << (G - 1).bit_length(), 16)
            bn = cfg["block_n"] or max(16, min(128, cfg["block_n_elems"] // d_pad))
            if dt == "fp32":
                bn = 32
            const = dict(G=G, D=D, D_PAD=d_pad, BS=16, BLOCK_M=bm, BLOCK_N=bn, TPT=bm // G,
                         ONE_TILE_PER_SEQ=one, SPLIT=split, SLIDING=sliding,
                         DOT_PREC="ieee" if dt == "fp32" else "tf32", MIN_CHUNK=4 * bn,
                         CHUNK_SQRT=cfg["chunk_sqrt"] if split else 0)
            k = build(pa._paged_attn_stage1, dt, const, cfg["num_warps"], cfg["num_stages"])
            # default tiles must leave room for >= 2 programs per SM (228 KB of smem on sm_90),
            # the wide ones for one
            room = 227 if cfg["block_n_elems"] > pa.PREFILL_CONFIG["block_n_elems"] else 112
            assert k.metadata.shared <= room * 1024, (dt, G, D, one, split, sliding,
                                                      k.metadata.shared)
            if split:
                rconst = {n: const[n] for n in ("G", "D", "D_PAD", "BLOCK_M", "BLOCK_N", "TPT",
                                                "ONE_TILE_PER_SEQ", "SLIDING", "MIN_CHUNK",
                                                "CHUNK_SQRT")}
                build(pa._paged_attn_reduce, dt, rconst, 4, 1)
        print("compiled-ok")
    """)
    run_compiled(script)


# ----------------------------------------------------------------------------------------------
# GPU tests (bf16, engine shapes)
# ----------------------------------------------------------------------------------------------

def _gpu_case(q_lens, ctxs, H, Hkv, D=128, BS=16, dtype=torch.bfloat16, seed=0, pad_tokens=0,
              num_blocks=None, max_blocks=None):
    """Like make_case but built on the GPU directly (large contexts): random blocks, NaN in every
    slot no sequence owns, unused table entries on a NaN block (the last one)."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    B = len(q_lens)
    seq_lens = [c + n if n else 0 for c, n in zip(ctxs, q_lens)]
    nblk = [-(-s // BS) for s in seq_lens]
    nb = num_blocks or sum(nblk) + 2
    assert nb >= sum(nblk) + 1
    kv = torch.randn(2, nb, BS, Hkv, D, generator=g, device=dev, dtype=torch.float32).to(dtype)
    kv[:, nb - 1] = float("nan")
    perm = torch.randperm(nb - 1, generator=g, device=dev)
    block_tables = torch.full((B, max_blocks or max(nblk) + 1), nb - 1, dtype=torch.int32,
                              device=dev)
    used = 0
    for b in range(B):
        ids = perm[used:used + nblk[b]]
        used += nblk[b]
        block_tables[b, :nblk[b]] = ids.int()
        tail = seq_lens[b] % BS
        if nblk[b] and tail:
            kv[:, ids[-1], tail:] = float("nan")
    T = sum(q_lens) + pad_tokens
    fused = torch.randn(T, H + 2 * Hkv, D, generator=g, device=dev).to(dtype)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    return dict(q=fused[:, :H], kv=kv, k_cache=kv[0], v_cache=kv[1], block_tables=block_tables,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
                scale=D ** -0.5, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                n_real=sum(q_lens), q_lens=q_lens, ctxs=ctxs)


def _gpu_check(case, out, tol=2e-2, window=None):
    n = case["n_real"]
    assert not torch.isnan(out[:n]).any()
    assert torch.isnan(out[n:]).all()
    ref = paged_attention_ref(case["q"].float(), case["k_cache"].float(), case["v_cache"].float(),
                              case["block_tables"], case["seq_lens"], case["query_start_loc"],
                              case["scale"], sliding_window=window)
    err = (out[:n].float() - ref[:n]).abs().max().item()
    assert err <= tol, f"max abs err {err} vs float32 reference"
    return err


MODELS = [pytest.param(12, 2, id="qwen2.5-1.5b"), pytest.param(28, 4, id="qwen2.5-7b")]


@pytest.mark.gpu
@pytest.mark.parametrize("H,Hkv", MODELS)
@pytest.mark.parametrize("batch,max_ctx", [(1, 8192), (8, 8192), (64, 4096), (64, 8192)])
def test_gpu_decode(H, Hkv, batch, max_ctx):
    g = torch.Generator().manual_seed(batch)
    ctxs = torch.randint(1, max_ctx, (batch,), generator=g).tolist()
    ctxs[0] = max_ctx - 1
    case = _gpu_case([1] * batch, ctxs, H, Hkv, seed=batch, pad_tokens=3)
    _gpu_check(case, run(case))
    _gpu_check(case, run(case, num_kv_splits=1))


@pytest.mark.gpu
@pytest.mark.parametrize("H,Hkv", MODELS)
def test_gpu_mixed_batch(H, Hkv):
    q_lens = [1] * 16 + [512, 512, 300, 0, 2]
    ctxs = [100 * i + 7 for i in range(16)] + [1024, 3000, 0, 0, 4000]
    case = _gpu_case(q_lens, ctxs, H, Hkv, seed=1, pad_tokens=5)
    _gpu_check(case, run(case))
    _gpu_check(case, run(case, num_kv_splits=4))
    _gpu_check(case, run(case, max_query_len=2048, max_seq_len=16384))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,D,H,Hkv,BS", [(torch.float16, 128, 12, 2, 16),
                                              (torch.float32, 64, 8, 8, 16),
                                              (torch.bfloat16, 64, 32, 4, 32),
                                              (torch.bfloat16, 96, 16, 2, 16),
                                              (torch.bfloat16, 128, 8, 1, 16)])
def test_gpu_other_shapes(dtype, D, H, Hkv, BS):
    case = _gpu_case([1, 1, 1, 37, 200], [5000, 17, 900, 700, 0], H, Hkv, D, BS, dtype, seed=D,
                     pad_tokens=1)
    _gpu_check(case, run(case), tol=1e-3 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("H,Hkv", MODELS)
@pytest.mark.parametrize("window", [1, 100, 4096])
def test_gpu_sliding_window(H, Hkv, window):
    """bf16 at engine shapes, decodes and prefill chunks longer than the window: default
    heuristics (split-K on the decode rows), forced splits, loose (graph-style) bounds."""
    q_lens = [1] * 8 + [512, 300, 0, 2, 700]
    ctxs = [700 * i + 5 for i in range(8)] + [1024, 3000, 0, 6000, 0]
    case = _gpu_case(q_lens, ctxs, H, Hkv, seed=window, pad_tokens=3)
    _gpu_check(case, run(case, sliding_window=window), window=window)
    _gpu_check(case, run(case, sliding_window=window, num_kv_splits=4), window=window)
    _gpu_check(case, run(case, sliding_window=window, max_query_len=2048, max_seq_len=16384),
               window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 256])
def test_gpu_cuda_graph_replay_with_new_metadata(window):
    """Capture once with static buffers and static upper bounds (max_query_len = T,
    max_seq_len = MAXB * BS); replay with other lengths, q_lens (decodes, chunks, padding rows,
    unassigned tail rows), block tables and cache contents. The window is fixed at capture."""
    H, Hkv, D, BS = 12, 2, 128, 16
    T, B, MAXB, NB = 64, 8, 256, 1200
    scenarios = [([1] * 6 + [40, 0], [300, 7, 1000, 64, 4000, 2, 500, 0]),
                 ([1] * 8, [3000, 1, 2, 3, 100, 200, 3500, 50]),
                 ([10, 1, 0, 0, 1, 30, 1, 1], [0, 2000, 0, 0, 60, 250, 1, 3900])]
    cases = [_gpu_case(q, c, H, Hkv, D, BS, seed=10 + i, pad_tokens=T - sum(q), num_blocks=NB,
                       max_blocks=MAXB) for i, (q, c) in enumerate(scenarios)]
    static = dict(q=torch.zeros(T, H + 2 * Hkv, D, dtype=torch.bfloat16, device="cuda")[:, :H],
                  kv=torch.zeros(2, NB, BS, Hkv, D, dtype=torch.bfloat16, device="cuda"),
                  block_tables=torch.zeros(B, MAXB, dtype=torch.int32, device="cuda"),
                  seq_lens=torch.zeros(B, dtype=torch.int32, device="cuda"),
                  query_start_loc=torch.zeros(B + 1, dtype=torch.int32, device="cuda"),
                  out=torch.empty(T, H, D, dtype=torch.bfloat16, device="cuda"))

    def fill(case):
        for name in ("q", "kv", "block_tables", "seq_lens", "query_start_loc"):
            static[name].copy_(case[name])
        static["out"].fill_(float("nan"))

    def step():
        paged_attention(static["q"], static["kv"][0], static["kv"][1], static["block_tables"],
                        static["seq_lens"], static["query_start_loc"], D ** -0.5,
                        max_query_len=T, max_seq_len=MAXB * BS, out=static["out"],
                        sliding_window=window)

    fill(cases[0])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()   # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for case in cases:
        fill(case)
        graph.replay()
        torch.cuda.synchronize()
        _gpu_check(case, static["out"], window=window)


@pytest.mark.gpu
def test_gpu_bench_decode_helper_runs():
    from pdserve.kernels.bench import bench_decode
    r = bench_decode(4, 2048, 12, 2, 128, 16, iters=5, warmup=2, copy_bytes=1 << 26)
    assert r["time_us"] > 0 and r["kv_gbps"] > 0 and r["copy_gbps"] > 0
    assert r["graph_error"] is None, r["graph_error"]    # the launcher captures in a CUDA graph
    from pdserve.kernels.bench import bench_prefill
    r = bench_prefill(1, 128, 1024, 12, 2, 128, 16, num_decodes=4, decode_context=300, iters=3,
                      warmup=1)
    assert r["time_us"] > 0 and r["tflops"] > 0
