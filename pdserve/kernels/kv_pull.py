"""Pull a request's KV blocks from a source KV pool into a destination pool, one launch.

P/D disaggregation: the decode worker copies the blocks the prefill worker filled. On GPU the
source pool is normally another GPU's memory (CUDA IPC mapping, or just a tensor on another
device of this process); the kernel runs on the DESTINATION GPU and reads the peer memory
directly over NVLink: no temporaries, no gather / copy / scatter.

Both pools: [L, 2, NB, BS, H, D], contiguous (NB and H may differ between src and dst)::

    src[l, kv, src_blocks[i]]                 dst[l, kv, dst_blocks[i]]
    one block = BS token rows of H*D elems    one block = BS token rows of H'*D elems
          h0*D   (h0+nh)*D                          g0*D   (g0+nh)*D
    t=0  |....|###########|......|           t=0  |.|###########|..|
    t=1  |....|###########|......|   ---->   t=1  |.|###########|..|
    ...                                       ...
          \\ src_heads = h0:h0+nh              \\ dst_heads = g0:g0+nh
    (full heads on both sides: the block is one contiguous run of BS*H*D elements)

Effect, for every l, kv in {0, 1}, i < n:
    dst[l, kv, dst_blocks[i], :, dst_heads, :] = src[l, kv, src_blocks[i], :, src_heads, :]

Launch grid (n, L*2, tiles per block): one program per (block pair i, layer-and-kv, tile). A
block's copy is a [ROWS, COLS] matrix: ROWS = BS token rows of COLS = nh*D contiguous elements
(row strides H*D and H'*D), or, when both sides copy all their heads, ROWS = 1 row of
COLS = BS*H*D elements (the whole block is contiguous on both sides). Tiles are
[BLOCK_R, BLOCK_C] power-of-two boxes of about 16 KB with masks at the edges; every access runs
along the contiguous row, so loads and stores vectorize to 16 bytes when D is a multiple of
16 / itemsize. With a device-side count (KVPull's `count`, BOUNDED), programs whose block
pair i is past it return at once: one captured grid serves any smaller count (PullGraphs).
All element offsets are int64 (a pool may exceed 2**31 elements). Data are moved
as integers of the element's width (bit-exact for any dtype, fp8 included).

The typical request (28 layers x 2 x 128 blocks x 16 tokens x 2 heads x 128 dims, bf16, 58 MB)
is 7168 programs of 8 KB each. Measured on two H200s (NVLink), peer pull: 58 MB in 165 us
(356 GB/s; a contiguous 58 MB torch peer copy_: 354 GB/s), 470 MB at 372 GB/s (copy_ of 1 GB:
391 GB/s); same device: ~1.9 TB/s of copied data. Tile size (4-64 KB) and num_warps (2-16) made
no difference there.

Cross-device: the kernel is launched on dst's device (its current stream) with src's raw
pointer. Triton's launcher only checks that each pointer is a device pointer
(cuPointerGetAttribute), which a peer allocation or an IPC mapping is under unified
addressing; what makes the peer read legal is peer access from dst's device to src's device.
A CUDA-IPC mapping opened by torch (cudaIpcMemLazyEnablePeerAccess) has it; for a tensor of
another device of this process, pull_kv_blocks enables it once per device pair (through torch,
see _enable_peer_access). Without it the launcher refuses the pointer ("Pointer argument (at 0)
cannot be accessed from Triton (cpu tensor?)", checked on an H200 pair). Ordering: the caller
makes sure src's writes are complete (e.g. an event the prefill side recorded, or a host-side
handshake after its synchronize).

Nothing here reads device values on the host: block ids that live on the GPU are NOT
range-checked (out-of-range ids are undefined behaviour, as in any gather); ids given as CPU
tensors are checked. Ids on another device than dst's are copied there first (ordered on the
current streams; nothing waits on the host). The source and destination regions must not
overlap (src may be dst only with disjoint block sets).
"""
from __future__ import annotations

import bisect

import torch
import triton
import triton.language as tl

from ..devices import on_device
from ..kv_layout import kv_bytes_per_token
from ._checks import require

_INDEX_DTYPES = (torch.int64, torch.int32)
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
TILE_BYTES = 16384          # one program's tile (at most); 8 warps at this size, fewer below
_NAME = "pull_kv_blocks"


@triton.jit
def _pull_kv_kernel(
    src_ptr, dst_ptr, sblk_ptr, dblk_ptr, n_ptr,
    s_lkv, s_blk, s_row, s_off,
    d_lkv, d_blk, d_row, d_off,
    s_sblk, s_dblk,
    ROWS: tl.constexpr, COLS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, TILES_C: tl.constexpr, EVEN: tl.constexpr,
    BOUNDED: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    if BOUNDED:   # the block count lives on the device: programs past it have nothing to copy
        if i >= tl.load(n_ptr):
            return
    lkv = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2)
    tr = tile // TILES_C
    tc = tile % TILES_C
    sb = tl.load(sblk_ptr + i * s_sblk).to(tl.int64)
    db = tl.load(dblk_ptr + i * s_dblk).to(tl.int64)

    r = tr * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tc * BLOCK_C + tl.arange(0, BLOCK_C)
    r64 = r.to(tl.int64)[:, None]
    src = src_ptr + (lkv * s_lkv + sb * s_blk + s_off) + r64 * s_row + c[None, :]
    dst = dst_ptr + (lkv * d_lkv + db * d_blk + d_off) + r64 * d_row + c[None, :]
    if EVEN:
        tl.store(dst, tl.load(src))
    else:
        m = (r < ROWS)[:, None] & (c < COLS)[None, :]
        tl.store(dst, tl.load(src, mask=m), mask=m)


def _head_range(name: str, s, num_heads: int) -> tuple[int, int]:
    """(start, stop) of a step-1 slice over num_heads heads; None means all heads."""
    if s is None:
        return 0, num_heads
    require(isinstance(s, slice), f"{_NAME}: {name} must be a slice, got {type(s).__name__}")
    require(s.step in (None, 1), f"{_NAME}: {name} must have step 1, got {s}")
    for v in (s.start, s.stop):
        require(v is None or isinstance(v, int), f"{_NAME}: {name} bounds must be ints, got {s}")
    start = 0 if s.start is None else s.start
    stop = num_heads if s.stop is None else s.stop
    start += num_heads if start < 0 else 0
    stop += num_heads if stop < 0 else 0
    require(0 <= start < stop <= num_heads,
            f"{_NAME}: {name} {s} is not a non-empty range within {num_heads} heads")
    return start, stop


def _validate_pools(src, dst, src_heads, dst_heads):
    for name, x in (("src", src), ("dst", dst)):
        require(isinstance(x, torch.Tensor),
                f"{_NAME}: {name} must be a torch.Tensor, got {type(x).__name__}")
        require(x.dim() == 6 and x.shape[1] == 2,
                f"{_NAME}: {name} must be [num_layers, 2, num_blocks, block_size, num_heads, "
                f"head_dim], got shape {tuple(x.shape)}")
        require(x.is_contiguous(), f"{_NAME}: {name} must be contiguous")
        require(x.element_size() in _BITS_DTYPE and not x.is_complex(),
                f"{_NAME}: unsupported dtype {x.dtype} for {name}")
    require(src.dtype == dst.dtype, f"{_NAME}: src dtype {src.dtype} != dst dtype {dst.dtype}")
    for dim, what in ((0, "num_layers"), (3, "block_size"), (5, "head_dim")):
        require(src.shape[dim] == dst.shape[dim],
                f"{_NAME}: src {what} {src.shape[dim]} != dst {what} {dst.shape[dim]} (src "
                f"{tuple(src.shape)}, dst {tuple(dst.shape)})")
    require(src.device.type == dst.device.type,
            f"{_NAME}: src is on {src.device}, dst on {dst.device}")
    hs = _head_range("src_heads", src_heads, src.shape[4])
    hd = _head_range("dst_heads", dst_heads, dst.shape[4])
    require(hs[1] - hs[0] == hd[1] - hd[0],
            f"{_NAME}: src_heads {hs[0]}:{hs[1]} and dst_heads {hd[0]}:{hd[1]} differ in length")
    return hs, hd


def _validate_ids(src, dst, src_blocks, dst_blocks):
    for name, b in (("src_blocks", src_blocks), ("dst_blocks", dst_blocks)):
        require(isinstance(b, torch.Tensor),
                f"{_NAME}: {name} must be a torch.Tensor, got {type(b).__name__}")
        require(b.dim() == 1, f"{_NAME}: {name} must be 1-D, got shape {tuple(b.shape)}")
        require(b.dtype in _INDEX_DTYPES, f"{_NAME}: {name} must be int64 or int32, got {b.dtype}")
    require(src_blocks.shape[0] == dst_blocks.shape[0],
            f"{_NAME}: len(src_blocks) {src_blocks.shape[0]} != len(dst_blocks) "
            f"{dst_blocks.shape[0]}")
    for name, b, pool in (("src_blocks", src_blocks, src), ("dst_blocks", dst_blocks, dst)):
        if b.device.type == "cpu" and b.numel():  # host ids: cheap to check; device ids: never
            lo, hi = int(b.min()), int(b.max())
            require(0 <= lo and hi < pool.shape[2],
                    f"{_NAME}: {name} ids must be in [0, {pool.shape[2]}), got [{lo}, {hi}]")


def _validate(src, dst, src_blocks, dst_blocks, src_heads, dst_heads):
    hs, hd = _validate_pools(src, dst, src_heads, dst_heads)
    _validate_ids(src, dst, src_blocks, dst_blocks)
    return hs, hd


_peer_enabled: set[tuple[int, int]] = set()


def _enable_peer_access(dev: torch.device, peer: torch.device) -> None:
    """Lets kernels running on `dev` access memory of `peer` (cudaDeviceEnablePeerAccess with
    `dev` current), once per pair. torch has no public call for it; its device-to-device copy
    enables access from the copy's SOURCE device to its DESTINATION device
    (at::cuda::get_p2p_access(src, dst), which also maps expandable segments), so a one-element
    copy from `dev` to `peer` does it."""
    key = (dev.index, peer.index)
    if key in _peer_enabled:
        return
    require(torch.cuda.can_device_access_peer(dev, peer),
            f"{_NAME}: {dev} cannot access {peer}'s memory (no peer access between them)")
    with torch.cuda.device(peer):
        sink = torch.empty(1, dtype=torch.uint8, device=peer)
    with torch.cuda.device(dev):
        sink.copy_(torch.zeros(1, dtype=torch.uint8, device=dev))
        torch.cuda.current_stream(dev).synchronize()
    _peer_enabled.add(key)


def _tiles(rows: int, cols: int, itemsize: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps) for a [rows, cols] copy of itemsize-byte elements."""
    tile = TILE_BYTES // itemsize
    block_c = min(triton.next_power_of_2(cols), tile)
    block_r = min(triton.next_power_of_2(rows), max(1, tile // block_c))
    nbytes = block_r * block_c * itemsize
    num_warps = max(1, min(8, nbytes // 2048))
    return block_r, block_c, num_warps


class KVPull:
    """pull_kv_blocks for one (src pool, dst pool, head ranges), checked and laid out once: a
    P/D consumer builds one per producer pool and head range when the peer is added, so a
    request's pull costs the host only the launch (the per-call checks and layout arithmetic
    were most of the ~80 us the call took on an H200 host: scripts/profile_pull.py).

    __call__(src_blocks, dst_blocks): ids already on dst's device, int64 or int32, equal
    lengths; NOT checked (device ids never are, see the module note). Launches on dst's device
    and its current stream; the caller makes dst's device current. Asynchronous."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, src_heads: slice | None = None,
                 dst_heads: slice | None = None):
        hs, hd = _validate_pools(src, dst, src_heads, dst_heads)
        L, _, _, bs, h_src, d = src.shape
        nh = hs[1] - hs[0]
        if nh == h_src and nh == dst.shape[4]:   # whole blocks on both sides: one contiguous run
            rows, cols = 1, bs * nh * d
        else:
            rows, cols = bs, nh * d
        block_r, block_c, self.num_warps = _tiles(rows, cols, src.element_size())
        tiles_r, tiles_c = triton.cdiv(rows, block_r), triton.cdiv(cols, block_c)
        self.grid_yz = (L * 2, tiles_r * tiles_c)
        self.empty = src.numel() == 0
        bits = _BITS_DTYPE[src.element_size()]
        self.src, self.dst = src.view(bits), dst.view(bits)
        self.strides = (src.stride(1), src.stride(2), src.stride(3), hs[0] * d,
                        dst.stride(1), dst.stride(2), dst.stride(3), hd[0] * d)
        self.meta = dict(ROWS=rows, COLS=cols, BLOCK_R=block_r, BLOCK_C=block_c,
                         TILES_C=tiles_c, EVEN=rows % block_r == 0 and cols % block_c == 0)
        self.bytes_per_block = bs * kv_bytes_per_token(L, nh, d, src.element_size())
        self._compiled: dict[tuple, object] = {}
        if dst.is_cuda and src.device != dst.device:
            _enable_peer_access(dst.device, src.device)

    def __call__(self, src_blocks: torch.Tensor, dst_blocks: torch.Tensor,
                 count: torch.Tensor | None = None) -> None:
        """count: None, or a one-element int64 tensor on dst's device holding n <= len(ids);
        then only the first n pairs are copied (n is read on the device: CUDA-graph replays
        with a varying block count, see PullGraphs)."""
        n = src_blocks.shape[0]
        if n == 0 or self.empty:
            return
        grid = (n, *self.grid_yz)
        bounded = count is not None
        args = (self.src, self.dst, src_blocks, dst_blocks,
                count if bounded else src_blocks, *self.strides,
                src_blocks.stride(0), dst_blocks.stride(0))
        # Everything Triton specializes this kernel on that varies per call: the ids' dtypes,
        # strides and 16-byte alignment (the pools, strides and offsets are fixed per KVPull).
        key = (src_blocks.dtype, dst_blocks.dtype, args[-2], args[-1],
               src_blocks.data_ptr() % 16, dst_blocks.data_ptr() % 16, bounded,
               bounded and count.data_ptr() % 16)
        compiled = self._compiled.get(key)
        if compiled is not None:   # the compiled kernel's own launcher: no re-dispatch
            compiled[grid](*args, *self.meta.values(), bounded)
            return
        compiled = _pull_kv_kernel[grid](*args, **self.meta, BOUNDED=bounded,
                                         num_warps=self.num_warps)
        if self.src.is_cuda:   # (the interpreter returns no compiled kernel)
            self._compiled[key] = compiled


def graph_widths(max_blocks: int, step: int = 16) -> list[int]:
    """PullGraphs' capacities: multiples of `step`, about four per doubling, from `step` up to
    the first one >= max_blocks (a load of n blocks runs in the smallest width >= n, so at
    most ~1/5 of a graph's programs find nothing to copy)."""
    out, k = [], 0
    while not out or out[-1] < max_blocks:
        w = -(-int(step * 2 ** (k / 4)) // step) * step
        if not out or w > out[-1]:
            out.append(w)
        k += 1
    return out


class PullGraphs:
    """The KVPulls of one P/D producer (one per head range, all into this pool) launched
    together by replaying one CUDA graph, for any block count up to max_blocks.

    Why: a pull's host launch sits inside the hand-off. KVPull's Triton launch costs ~20 us
    back to back but ~140 us once the thread has slept 20 ms (an idle decode worker); a graph
    replay costs ~3 us and ~50 us (scripts/profile_launch.py, H200 hosts).

    The ids go through one device buffer, [n | src ids (cap) | dst ids (cap)]. The kernels
    read n on the device (KVPull's `count`), so the graph captured with grid width w serves
    every n <= w: one graph per graph_widths(max_blocks). stage() writes n and the ids into a
    pinned host buffer and copies them into the device buffer on the current stream;
    launch() then replays the narrowest graph that fits. Use one stream for both, every time
    (the buffer is reused in stream order). More than max_blocks blocks: direct KVPull
    launches. On CPU (the interpreter) launch() runs the same bounded kernels eagerly.

        pulls = PullGraphs([KVPull(src, dst)], max_blocks=4096)
        with torch.cuda.stream(s):
            pulls.stage(src_ids, dst_ids)   # host lists
            pulls.launch()
    """

    def __init__(self, pulls: list[KVPull], max_blocks: int):
        require(len(pulls) > 0 and max_blocks > 0, f"{_NAME}: PullGraphs needs pulls and "
                f"max_blocks > 0, got {len(pulls)} pulls, max_blocks={max_blocks}")
        self.pulls = pulls
        self.device = pulls[0].dst.device
        self.widths = graph_widths(max_blocks)
        cap = self.cap = self.widths[-1]
        cuda = self.device.type == "cuda"
        self._host = torch.zeros(1 + 2 * cap, dtype=torch.int64, pin_memory=cuda)
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(1 + 2 * cap, dtype=torch.int64, device=self.device)
        self._count, self._src, self._dst = self._dev[:1], self._dev[1:1 + cap], self._dev[1 + cap:]
        self._copied: torch.cuda.Event | None = None   # the last staging copy has read _host
        self._n = 0
        self._direct: tuple[torch.Tensor, torch.Tensor] | None = None   # a load past cap
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if cuda:
            self._capture()

    def _run(self, width: int) -> None:
        for p in self.pulls:
            p(self._src[:width], self._dst[:width], self._count)

    def _capture(self) -> None:
        stream = torch.cuda.Stream(self.device)
        with on_device(self.device, stream):
            self._run(self.cap)        # compiles outside the capture (n is 0: copies nothing)
            stream.synchronize()
            for w in self.widths:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
                    self._run(w)
                self.graphs[w] = g

    def stage(self, src_ids, dst_ids) -> None:
        """Block ids (host sequences of ints, equal lengths, NOT range-checked) for the next
        launch(), copied to the device on the current stream."""
        n = len(src_ids)
        require(len(dst_ids) == n, f"{_NAME}: {n} src ids but {len(dst_ids)} dst ids")
        self._n = n
        if n > self.cap:
            ids = torch.tensor([list(src_ids), list(dst_ids)], dtype=torch.int64)
            self._direct = tuple(ids.to(self.device, non_blocking=True).unbind(0))
            return
        self._direct = None
        if self._copied is not None:
            self._copied.synchronize()   # (long done: it ran before the previous pull)
        h, cap = self._host_np, self.cap
        h[0] = n
        h[1:1 + n] = src_ids
        h[1 + cap:1 + cap + n] = dst_ids
        self._dev[:1 + n].copy_(self._host[:1 + n], non_blocking=True)
        self._dst[:n].copy_(self._host[1 + cap:1 + cap + n], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def launch(self) -> None:
        """The pulls of the last stage()d ids, on the current stream. Asynchronous."""
        if self._direct is not None:
            for p in self.pulls:
                p(*self._direct)
            return
        if self._n == 0:
            return
        w = self.widths[bisect.bisect_left(self.widths, self._n)]   # the narrowest that fits
        g = self.graphs.get(w)
        if g is not None:
            g.replay()
        else:
            self._run(w)

    @property
    def bytes_per_block(self) -> int:
        return sum(p.bytes_per_block for p in self.pulls)


def pull_kv_blocks(src: torch.Tensor, dst: torch.Tensor, src_blocks: torch.Tensor,
                   dst_blocks: torch.Tensor, src_heads: slice | None = None,
                   dst_heads: slice | None = None) -> None:
    """dst[l, kv, dst_blocks[i], :, dst_heads, :] = src[l, kv, src_blocks[i], :, src_heads, :]
    for all l, kv, i, in one launch on dst's device and its current stream (src may live on
    another GPU). Heads slices: step 1, equal lengths; None means all heads. Asynchronous.
    Checks everything on every call; KVPull is the same copy checked once."""
    pull = KVPull(src, dst, src_heads, dst_heads)
    _validate_ids(src, dst, src_blocks, dst_blocks)
    with on_device(dst.device):   # (CPU tensors: the interpreter)
        pull(src_blocks.to(dst.device, non_blocking=True),
             dst_blocks.to(dst.device, non_blocking=True))


def pull_kv_blocks_ref(src: torch.Tensor, dst: torch.Tensor, src_blocks: torch.Tensor,
                       dst_blocks: torch.Tensor, src_heads: slice | None = None,
                       dst_heads: slice | None = None) -> None:
    """The spec, in plain torch: gather on src's device, copy to dst's, scatter."""
    hs, hd = _validate(src, dst, src_blocks, dst_blocks, src_heads, dst_heads)
    sb = src_blocks.to(src.device).long()
    db = dst_blocks.to(dst.device).long()
    rows = src[:, :, sb, :, hs[0]:hs[1], :].to(dst.device)    # [L, 2, n, BS, nh, D]
    view = dst[:, :, :, :, hd[0]:hd[1], :]
    view[:, :, db] = rows                                        # index_put on a view: in place
