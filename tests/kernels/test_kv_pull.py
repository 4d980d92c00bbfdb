"""KV block pull between pools (pdserve.kernels.kv_pull).

CPU runs go through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA):
tiny fp32 pools, compared bit for bit with the torch reference. GPU runs (@pytest.mark.gpu): bf16
at engine shapes, same device and, with two GPUs, src on cuda:0 pulled by cuda:1 (peer reads)."""
from __future__ import annotations

import os
import textwrap

import pytest
import torch

from pdserve.kernels import kv_pull
from pdserve.kernels.kv_pull import pull_kv_blocks, pull_kv_blocks_ref

from ..utils import run_compiled


def _pool(layers, nb, bs, h, d, *, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(layers, 2, nb, bs, h, d, generator=g).to(device=device, dtype=dtype)


def _ids(nb, n, seed, dtype=torch.int64):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randperm(nb, generator=g)[:n].to(dtype)


def _pull_and_check(src, dst, sb, db, sh=None, dh=None):
    """Runs the kernel and the reference on copies; checks equality, that src is unchanged and
    that nothing outside dst[:, :, db, :, dh] moved."""
    src_before, dst_before = src.clone(), dst.clone()
    ref = dst.clone()
    pull_kv_blocks_ref(src, ref, sb, db, sh, dh)
    pull_kv_blocks(src, dst, sb, db, sh, dh)
    if dst.is_cuda:
        torch.cuda.synchronize(dst.device)
    assert torch.equal(dst.view(torch.uint8), ref.view(torch.uint8))  # bit-exact (NaNs too)
    assert torch.equal(src.view(torch.uint8), src_before.view(torch.uint8))
    written = torch.zeros(dst.shape[2], dst.shape[4], dtype=torch.bool, device=dst.device)
    dh = dh or slice(None)
    written[db.to(dst.device).long(), dh] = True
    untouched = ~written[None, None, :, None, :, None].expand(dst.shape)
    assert torch.equal(dst[untouched], dst_before[untouched])
    return dst


# ----------------------------------------------------------------------------------- interpreter

@pytest.mark.parametrize("bs", [4, 3])                      # 3: not a power of two (masks)
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_full_heads(bs, idx_dtype):
    src = _pool(2, 7, bs, 2, 8, seed=1)
    dst = _pool(2, 9, bs, 2, 8, seed=2)
    _pull_and_check(src, dst, _ids(7, 5, 3, idx_dtype), _ids(9, 5, 4, idx_dtype))


@pytest.mark.parametrize("case", [
    # (src heads, dst heads, src slice, dst slice)
    (4, 2, slice(1, 3), slice(0, 2)),      # src rank holds more heads than dst
    (4, 2, slice(2, 4), slice(None)),
    (1, 2, slice(0, 1), slice(1, 2)),      # dst rank holds more heads than src
    (2, 4, slice(None), slice(2, 4)),
    (3, 3, slice(0, 2), slice(1, 3)),      # same head count, shifted range
    (4, 4, slice(-2, None), slice(0, -2)),
], ids=lambda c: f"{c[0]}to{c[1]}_{c[2].start}_{c[2].stop}_{c[3].start}_{c[3].stop}")
def test_head_ranges(case):
    hs, hd, sh, dh = case
    src = _pool(2, 6, 4, hs, 8, seed=5)
    dst = _pool(2, 8, 4, hd, 8, seed=6)
    _pull_and_check(src, dst, _ids(6, 6, 7), _ids(8, 6, 8), sh, dh)


def test_head_range_odd_block_size_int32_strided_ids():
    src = _pool(2, 9, 5, 4, 8, seed=9)
    dst = _pool(2, 5, 5, 2, 8, seed=10)
    sb = torch.stack([_ids(9, 5, 11), torch.full((5,), 10 ** 6)], 1).int()[:, 0]  # stride 2
    db = _ids(5, 5, 12).int()
    assert sb.stride(0) == 2
    _pull_and_check(src, dst, sb, db, slice(1, 3), slice(0, 2))


@pytest.mark.parametrize("tile_bytes", [64, 256])
def test_multi_tile_paths(monkeypatch, tile_bytes):
    # tiny tiles force several programs per block: ragged row and column tiles, both layouts
    monkeypatch.setattr(kv_pull, "TILE_BYTES", tile_bytes)
    src = _pool(2, 6, 3, 3, 8, seed=13)
    dst = _pool(2, 7, 3, 3, 8, seed=14)
    _pull_and_check(src, dst, _ids(6, 4, 15), _ids(7, 4, 16))                    # flat rows
    _pull_and_check(src, dst, _ids(6, 4, 17), _ids(7, 4, 18), slice(0, 3), slice(0, 3))
    _pull_and_check(src, dst, _ids(6, 4, 19), _ids(7, 4, 20), slice(1, 3), slice(0, 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_other_dtypes_bit_exact(dtype):
    src = _pool(2, 5, 4, 2, 8, seed=21).to(dtype)
    src.view(torch.uint8)[0, 0, 1, 0, 0, :4] = 0xFF   # NaN patterns survive (copied as bits)
    dst = _pool(2, 6, 4, 4, 8, seed=22).to(dtype)
    _pull_and_check(src, dst, torch.tensor([1, 3, 0]), torch.tensor([5, 0, 2]), slice(0, 2),
                    slice(2, 4))


def test_within_one_pool_and_empty():
    pool = _pool(2, 8, 4, 2, 8, seed=23)
    ref = pool.clone()
    sb, db = torch.tensor([0, 1, 2]), torch.tensor([7, 5, 6])
    pull_kv_blocks(pool, pool, sb, db)
    pull_kv_blocks_ref(ref, ref, sb, db)
    assert torch.equal(pool, ref)
    before = pool.clone()
    empty = torch.empty(0, dtype=torch.int64)
    pull_kv_blocks(pool, pool, empty, empty)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("pairs", [[(0, 7)], [(0, 7), (3, 5)], [(3, 5), (3, 8), (1, 6)]])
@pytest.mark.parametrize("pull", [True, False])
def test_model_runner_copy_on_write(pairs, pull):
    """ModelRunner._copy_blocks (copy-on-write): with the pull kernel, one launch for every
    pair and layer (the ids padded to an even row); without it (CPU), pool indexing. Both equal
    copying each block by hand."""
    from types import SimpleNamespace

    from pdserve.worker.model_runner import ModelRunner
    pool = _pool(3, 9, 4, 2, 8, seed=5)
    ref = pool.clone()
    calls = []
    copier = None
    if pull:
        prepared = kv_pull.KVPull(pool, pool)
        copier = lambda sb, db: (calls.append((sb.tolist(), db.tolist())), prepared(sb, db))[1]  # noqa: E731
    ModelRunner._copy_blocks(SimpleNamespace(kv_cache=pool, _copier=copier, device=pool.device),
                             pairs)
    for src, dst in pairs:
        ref[:, :, dst] = ref[:, :, src]
    assert torch.equal(pool, ref)
    assert calls == ([([s for s, _ in pairs], [d for _, d in pairs])] if pull else [])


@pytest.mark.parametrize("heads", [None, (slice(1, 3), slice(0, 2))])
def test_prepared_pull_reused_across_requests(heads):
    """KVPull (checked once per pool pair, as the P/D connector uses it) gives the reference's
    bytes for several id lists in a row, including an empty one; bad pools are refused at
    construction, where the per-call checks used to be."""
    sh, dh = heads or (None, None)
    src = _pool(2, 9, 4, 4 if heads else 2, 8, seed=31)
    dst = _pool(2, 11, 4, 2, 8, seed=32)
    ref = dst.clone()
    pull = kv_pull.KVPull(src, dst, sh, dh)
    assert pull.bytes_per_block == 2 * 2 * 4 * 2 * 8 * 4
    for seed, n in ((1, 3), (2, 0), (3, 6)):
        sb, db = _ids(9, n, seed), _ids(11, n, seed + 10)
        pull(sb, db)
        pull_kv_blocks_ref(src, ref, sb, db, sh, dh)
        assert torch.equal(dst, ref)
    with pytest.raises(ValueError, match="differ in length"):
        kv_pull.KVPull(src, dst, slice(0, 1), slice(0, 2))


def test_device_side_count():
    """KVPull with `count`: only the first n id pairs are copied, n read from a tensor."""
    src = _pool(2, 9, 4, 2, 8, seed=33)
    dst = _pool(2, 11, 4, 2, 8, seed=34)
    ref = dst.clone()
    pull = kv_pull.KVPull(src, dst)
    sb, db = _ids(9, 6, 1), _ids(11, 6, 2)
    for n in (4, 0, 6):
        pull(sb, db, torch.tensor([n]))
        pull_kv_blocks_ref(src, ref, sb[:n], db[:n])
        assert torch.equal(dst, ref)


@pytest.mark.parametrize("heads", [None, ((slice(0, 1), slice(1, 2)), (slice(2, 3), slice(0, 1)))])
def test_pull_graphs_any_block_count(heads):
    """PullGraphs (eager on CPU: same staging, widths and bounded kernels as the CUDA graphs):
    loads of several sizes in a row, at and past width edges, empty, and past max_blocks (the
    direct path), each equal to the reference; one or two head ranges per load."""
    src = _pool(2, 80, 2, 3 if heads else 2, 4, seed=35)
    dst = _pool(2, 90, 2, 2, 4, seed=36)
    ref = dst.clone()
    ranges = heads or ((None, None),)
    pulls = kv_pull.PullGraphs([kv_pull.KVPull(src, dst, sh, dh) for sh, dh in ranges],
                               max_blocks=40)
    assert pulls.widths == [16, 32, 48] and not pulls.graphs
    assert pulls.bytes_per_block == len(ranges) * 2 * 2 * 2 * (1 if heads else 2) * 4 * 4
    for seed, n in ((1, 3), (2, 16), (3, 0), (4, 17), (5, 48), (6, 70), (7, 5)):
        sb, db = _ids(80, n, seed), _ids(90, n, seed + 10)
        pulls.stage(sb.tolist(), db.tolist())
        pulls.launch()
        for sh, dh in ranges:
            pull_kv_blocks_ref(src, ref, sb, db, sh, dh)
        assert torch.equal(dst, ref), n
    with pytest.raises(ValueError, match="3 src ids but 2 dst ids"):
        pulls.stage([1, 2, 3], [4, 5])


def _bad_cases():
    src = _pool(2, 5, 4, 4, 8)
    dst = _pool(2, 6, 4, 2, 8)
    sb, db = torch.tensor([0, 1]), torch.tensor([2, 3])
    ok = dict(src=src, dst=dst, src_blocks=sb, dst_blocks=db, src_heads=slice(0, 2),
              dst_heads=slice(0, 2))
    return {
        "dtype": (dict(ok, dst=dst.half()), "dtype"),
        "head_dim": (dict(ok, dst=_pool(2, 6, 4, 2, 16)), "head_dim"),
        "layers": (dict(ok, dst=_pool(3, 6, 4, 2, 8)), "num_layers"),
        "block_size": (dict(ok, dst=_pool(2, 6, 8, 2, 8)), "block_size"),
        "slice_lengths": (dict(ok, src_heads=slice(0, 3)), "differ in length"),
        "slice_step": (dict(ok, src_heads=slice(0, 4, 2)), "step 1"),
        "slice_out_of_range": (dict(ok, dst_heads=slice(1, 3)), "within 2 heads"),
        "slice_empty": (dict(ok, src_heads=slice(2, 2), dst_heads=slice(0, 0)), "non-empty"),
        "not_a_slice": (dict(ok, src_heads=(0, 2)), "must be a slice"),
        "n_mismatch": (dict(ok, dst_blocks=torch.tensor([2, 3, 4])), "len"),
        "ids_float": (dict(ok, src_blocks=sb.float()), "int64 or int32"),
        "ids_2d": (dict(ok, dst_blocks=db[:, None]), "1-D"),
        "ids_out_of_range": (dict(ok, dst_blocks=torch.tensor([2, 6])), r"\[0, 6\)"),
        "ids_negative": (dict(ok, src_blocks=torch.tensor([-1, 0])), r"\[0, 5\)"),
        "pool_5d": (dict(ok, src=src[0]), "must be \\[num_layers"),
        "pool_not_kv": (dict(ok, src=src[:, :1]), "must be \\[num_layers"),
        "non_contiguous": (dict(ok, src=_pool(2, 5, 4, 8, 8)[:, :, :, :, ::2]), "contiguous"),
        "not_a_tensor": (dict(ok, src_blocks=[0, 1]), "torch.Tensor"),
    }


@pytest.mark.parametrize("case", list(_bad_cases().keys()))
def test_rejects_bad_inputs(case):
    args, msg = _bad_cases()[case]
    with pytest.raises(ValueError, match=msg):
        pull_kv_blocks(**args)
    with pytest.raises(ValueError, match="pull_kv_blocks"):
        pull_kv_blocks_ref(**args)


_PTXAS = os.path.join(os.path.dirname(__import__("triton").__file__), "backends", "nvidia", "bin",
                      "ptxas")


@pytest.mark.skipif(not os.path.exists(_PTXAS),
                    reason="needs the ptxas shipped in the triton wheel")
def test_kernel_compiles_for_sm90_with_16_byte_accesses():
    """Compiles the kernel for sm_90 (no GPU needed) at the engine's shapes, with the launcher's
    usual specialization (pointers and multiples of 16 marked divisible by 16), and checks that
    every global access is a 16-byte vector (ld/st.global.v4.b32) in both layouts."""
    script = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from pdserve.kernels import kv_pull as kp

        fn = kp._pull_kv_kernel
        sig = {n: ("*i16" if n in ("src_ptr", "dst_ptr")
                   else "*i64" if n.endswith("blk_ptr") or n == "n_ptr"
                   else "constexpr" if n.isupper() else "i64" if n.endswith("lkv") else "i32")
               for n in fn.arg_names}
        div = [i for i, n in enumerate(fn.arg_names)
               if n.endswith("_ptr") or n in ("s_lkv", "s_blk", "s_row", "s_off", "d_lkv",
                                               "d_blk", "d_row", "d_off")]
        attrs = {(i,): [["tt.divisibility", 16]] for i in div}
        # bf16 bits, 2-head rows of 128 dims, BS 16: whole blocks / a head range
        # (BOUNDED: the block count read on the device, as PullGraphs launches it)
        for rows, cols, bounded in ((1, 16 * 2 * 128, False), (16, 2 * 128, False),
                                    (16, 3 * 128, False), (1, 16 * 2 * 128, True)):
            br, bc, nw = kp._tiles(rows, cols, 2)
            const = dict(ROWS=rows, COLS=cols, BLOCK_R=br, BLOCK_C=bc,
                         TILES_C=triton.cdiv(cols, bc),
                         EVEN=rows % br == 0 and cols % bc == 0, BOUNDED=bounded)
            k = triton.compile(ASTSource(fn, sig, const, attrs),
                               target=GPUTarget("cuda", 90, 32), options=dict(num_warps=nw))
            assert k.asm["cubin"]
            ptx = k.asm["ptx"]
            lines = [l for l in ptx.splitlines() if "ld.global" in l or "st.global" in l]
            data = [l for l in lines if ".b64" not in l or ".v" in l]   # not the 2 id loads
            assert data and all(".v4.b32" in l for l in data), (rows, cols, data[:4])
        print("compiled-ok")
    """)
    run_compiled(script)


# ------------------------------------------------------------------------------------------ GPU

def _gpu_request(src_dev, dst_dev, *, hs=2, hd=2, sh=None, dh=None, n=128, seed=0):
    """28 layers x 2 x n blocks x 16 tokens x heads x 128 dims bf16 (a Qwen2.5-7B request)."""
    src = _pool(28, n + 37, 16, hs, 128, dtype=torch.bfloat16, device=src_dev, seed=seed)
    dst = _pool(28, n + 53, 16, hd, 128, dtype=torch.bfloat16, device=dst_dev, seed=seed + 1)
    sb = _ids(n + 37, n, seed + 2).to(src_dev)
    db = _ids(n + 53, n, seed + 3).to(dst_dev)
    return src, dst, sb, db, sh, dh


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(2, 2, None, None), (4, 2, slice(2, 4), slice(None)),
                                   (1, 2, slice(None), slice(1, 2)), (3, 3, None, None)],
                         ids=["full", "4to2", "1to2", "full3"])
def test_gpu_same_device(heads):
    hs, hd, sh, dh = heads
    src, dst, sb, db, sh, dh = _gpu_request("cuda:0", "cuda:0", hs=hs, hd=hd, sh=sh, dh=dh)
    _pull_and_check(src, dst, sb, db, sh, dh)
    _pull_and_check(src, dst, sb.cpu().int(), db.cpu().int(), sh, dh)   # host int32 ids


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("heads", [(2, 2, None, None), (4, 2, slice(0, 2), slice(None)),
                                   (1, 2, slice(None), slice(1, 2))],
                         ids=["full", "4to2", "1to2"])
def test_gpu_peer_pull(heads):
    # src on cuda:0, kernel on cuda:1 reading cuda:0's memory (peer), while cuda:0 is current
    hs, hd, sh, dh = heads
    src, dst, sb, db, sh, dh = _gpu_request("cuda:0", "cuda:1", hs=hs, hd=hd, sh=sh, dh=dh,
                                            seed=40)
    torch.cuda.synchronize("cuda:0")
    with torch.cuda.device(0):
        _pull_and_check(src, dst, sb.to("cuda:1"), db, sh, dh)
    # and the other way round
    src2, dst2 = dst.clone(), src.clone()
    _pull_and_check(src2, dst2, db, sb, dh, sh)


@pytest.mark.gpu
def test_gpu_prepared_pull_relaunch():
    """A KVPull launched many times (later launches reuse the compiled kernel directly): ids as
    rows of one [2, n] tensor (the connector's layout; odd n puts the second row off 16-byte
    alignment), int32 ids, a strided id view, each bit-exact against the reference."""
    dev = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    src = _pool(3, 40, 16, 4, 32, dtype=torch.bfloat16, device="cuda:0", seed=51)
    dst = _pool(3, 50, 16, 2, 32, dtype=torch.bfloat16, device=dev, seed=52)
    ref = dst.clone()
    pull = kv_pull.KVPull(src, dst, slice(2, 4), None)
    cases = []
    for n in (8, 5, 8, 5, 1):
        ids = torch.stack([_ids(40, n, n), _ids(50, n, n + 1)]).to(dev)
        cases.append((ids[0], ids[1]))
    ids = torch.stack([_ids(40, 6, 9), _ids(50, 6, 10)]).to(dev)
    cases += [(ids[0].int(), ids[1].int()), (ids[0, ::2], ids[1, ::2])]
    with torch.cuda.device(dev):
        for sb, db in cases:
            pull(sb, db)
            pull_kv_blocks_ref(src, ref, sb, db, slice(2, 4), None)
            torch.cuda.synchronize(dev)
            assert torch.equal(dst.view(torch.int16), ref.view(torch.int16))
    assert len(pull._compiled) >= 3   # aligned / unaligned / int32 / strided variants


@pytest.mark.gpu
def test_gpu_pull_graphs_back_to_back():
    """PullGraphs with its CUDA graphs (peer pull with two GPUs): eight loads of varied sizes
    staged and replayed back to back on one stream with no host wait between them (the id
    buffer is reused in stream order), one per width edge and one past max_blocks, then
    compared with the reference applied in the same order."""
    dev = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    src = _pool(28, 300, 16, 4, 128, dtype=torch.bfloat16, device="cuda:0", seed=61)
    dst = _pool(28, 320, 16, 2, 128, dtype=torch.bfloat16, device=dev, seed=62)
    ref = dst.clone()
    with torch.cuda.device(dev):
        pulls = kv_pull.PullGraphs([kv_pull.KVPull(src, dst, slice(0, 1), slice(1, 2)),
                                    kv_pull.KVPull(src, dst, slice(3, 4), slice(0, 1))],
                                   max_blocks=256)
        assert sorted(pulls.graphs) == pulls.widths and pulls.cap == 256
        stream = torch.cuda.Stream()
        loads = [(_ids(300, n, n), _ids(320, n, n + 1))
                 for n in (128, 1, 129, 0, 256, 17, 290, 64)]
        with torch.cuda.stream(stream):
            for sb, db in loads:
                pulls.stage(sb.tolist(), db.tolist())
                pulls.launch()
        for sb, db in loads:
            pull_kv_blocks_ref(src, ref, sb, db, slice(0, 1), slice(1, 2))
            pull_kv_blocks_ref(src, ref, sb, db, slice(3, 4), slice(0, 1))
        stream.synchronize()
        assert torch.equal(dst.view(torch.int16), ref.view(torch.int16))


@pytest.mark.gpu
def test_gpu_offsets_past_2_to_the_31():
    # a 1-byte pool of more than 2**31 elements: the last blocks sit past int32 offsets
    nb, bs, h, d = 1 << 15, 16, 8, 512                        # 2 * 2**15 * 2**16 = 2**32 B
    pool = torch.zeros(1, 2, nb, bs, h, d, dtype=torch.uint8, device="cuda")
    assert pool.numel() > 2 ** 31
    pool[0, 0, :4] = torch.arange(1, 5, dtype=torch.uint8, device="cuda")[:, None, None, None]
    pool[0, 1, :4] = 9
    sb = torch.tensor([0, 1, 2, 3], device="cuda")
    db = torch.tensor([nb - 1, nb - 2, nb - 3, nb - 4], device="cuda")
    pull_kv_blocks(pool, pool, sb, db)
    pull_kv_blocks(pool, pool, sb, db, slice(2, 4), slice(6, 8))
    torch.cuda.synchronize()
    for j in range(4):
        assert (pool[0, 0, nb - 1 - j] == j + 1).all() and (pool[0, 1, nb - 1 - j] == 9).all()
