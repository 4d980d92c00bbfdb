"""KVHostTier: one rank's host KV pool (the CPU tier of issue 21: swap preemption, prefix-cache
offload) and the copy engine that runs each step's KVMoves between it and the device pool.

The host pool is block-major, so one block's KV (every layer, K and V, this rank's heads) is one
contiguous run of bytes, and a run of consecutive host ids is one copy:

    device  kv_cache[layer, K|V, block, offset, head, dim]       (kv_layout.py)
    host    host[host block, layer, K|V, offset, head, dim]      (pinned on CUDA)

    to_host   kv_cache.permute(block first).index_select(ids) -> staging [n, L, 2, ...] (device)
              staging[i:i+k] -> host[h0:h0+k]                 one DMA per run of host ids
    to_device host[h0:h0+k] -> staging[i:i+k]                 one DMA per run of host ids
              staging -> kv_cache blocks (index_copy_)

Moves are sorted by host id (longest runs) and done in chunks of a fixed device staging buffer
(STAGING_BYTES), so a step moving thousands of blocks allocates nothing.

Streams (the runner's contract, tier_contract.md), on CUDA:

    compute  ... fwd N ──────────┐ wait(ev N) ─ fwd N+1 ...
    copy              wait(compute) ─ to_host* ─ to_device* ─ record ev N
                      (step N's moves; fwd N does not wait for them)

begin_step() makes the compute stream wait for the previous step's copies (so this step may read
what they loaded and overwrite what they saved); apply(moves) queues this step's copies after
everything already queued on the compute stream (under async scheduling the step before may
still be writing a block being saved). On CPU every copy is done when apply() returns.
"""
from __future__ import annotations

import math
import time

import torch

from ..devices import on_device
from ..engine.block_pool import host_runs

# Device staging for one chunk of moves (gathered blocks on their way to or from the host).
STAGING_BYTES = 64 << 20
# The start-up bandwidth probe: this many bytes (at most the host pool) copied each way, REPS times.
_PROBE_BYTES = 64 << 20
_PROBE_REPS = 3


class KVHostTier:
    """The host pool of `num_host_blocks` blocks beside `kv_cache` [layers, 2, blocks,
    block_size, heads, head_dim] (its last block, the scratch block, is never moved) and the
    copies between them. measure: time a few large copies each way now (copy_gb_per_s, the
    slower direction; 0.0 when not measured)."""

    def __init__(self, kv_cache: torch.Tensor, num_host_blocks: int, measure: bool = True):
        if num_host_blocks < 1:
            raise ValueError(f"num_host_blocks must be >= 1, got {num_host_blocks}")
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.cuda = self.device.type == "cuda"
        self.num_device_blocks = kv_cache.shape[2] - 1     # (less the scratch block)
        self.num_host_blocks = num_host_blocks
        L, two, _, bs, H, D = kv_cache.shape
        self.block_shape = (L, two, bs, H, D)
        self.block_bytes = L * two * bs * H * D * kv_cache.element_size()
        self.host = torch.empty((num_host_blocks, *self.block_shape), dtype=kv_cache.dtype,
                                pin_memory=self.cuda)
        # the device pool seen block-major: [blocks, layers, 2, offset, heads, dim] (a view)
        self._by_block = kv_cache.permute(2, 0, 1, 3, 4, 5)
        self.chunk_blocks = max(1, min(num_host_blocks, STAGING_BYTES // self.block_bytes))
        self.staging = torch.empty((self.chunk_blocks, *self.block_shape), dtype=kv_cache.dtype,
                                   device=self.device)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._last_event: torch.cuda.Event | None = None   # the previous step's copies
        self.blocks_to_host = 0        # blocks copied since start, each way
        self.blocks_to_device = 0
        self.copy_gb_per_s = self._measure() if measure else 0.0

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    # ---- the per-step contract --------------------------------------------------------------
    def begin_step(self) -> None:
        """Before anything of this step is queued on the compute stream: it waits for the
        previous step's copies (a no-op without them, and on CPU)."""
        if self._last_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._last_event)
            self._last_event = None

    def apply(self, moves) -> None:
        """Queue a step's KVMoves (to_host first, then to_device) on the copy stream after the
        work already queued on the compute stream; on CPU, do them now. ValueError on a block
        id out of range or a destination named twice (nothing is copied then)."""
        to_host = sorted(moves.to_host, key=lambda m: m[1])
        to_device = sorted(moves.to_device, key=lambda m: m[0])
        self._check(to_host, to_device)
        if not to_host and not to_device:
            return
        # (the compute stream is read before the copy stream becomes current: inside the
        # context current_stream() is the copy stream, and waiting for it waits for nothing)
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        with on_device(self.device, self.stream):
            if self.cuda:
                self.stream.wait_stream(compute)
                # (the ids travel on the copy stream: the gathers are ordered after them)
                ids = _to_device([d for d, _ in to_host] + [d for _, d in to_device], self.device)
            else:
                ids = torch.tensor([d for d, _ in to_host] + [d for _, d in to_device],
                                   dtype=torch.long)
            n = len(to_host)
            if to_host:
                self._copy_out(ids[:n], [h for _, h in to_host])
            if to_device:
                self._copy_in([h for h, _ in to_device], ids[n:])
            if self.cuda:
                self._last_event = torch.cuda.Event()
                self._last_event.record(self.stream)
        self.blocks_to_host += len(to_host)
        self.blocks_to_device += len(to_device)

    def synchronize(self) -> None:
        """Wait for every copy queued (tests, shutdown)."""
        if self.stream is not None:
            self.stream.synchronize()

    # ---- copies -----------------------------------------------------------------------------
    def _copy_out(self, dev_ids: torch.Tensor, host_ids: list[int]) -> None:
        step = self.chunk_blocks
        for a in range(0, len(host_ids), step):
            chunk = host_ids[a:a + step]
            stage = self.staging[:len(chunk)]
            torch.index_select(self._by_block, 0, dev_ids[a:a + len(chunk)], out=stage)
            for i, h0, k in host_runs(chunk):
                self.host[h0:h0 + k].copy_(stage[i:i + k], non_blocking=self.cuda)

    def _copy_in(self, host_ids: list[int], dev_ids: torch.Tensor) -> None:
        step = self.chunk_blocks
        for a in range(0, len(host_ids), step):
            chunk = host_ids[a:a + step]
            stage = self.staging[:len(chunk)]
            for i, h0, k in host_runs(chunk):
                stage[i:i + k].copy_(self.host[h0:h0 + k], non_blocking=self.cuda)
            self._by_block.index_copy_(0, dev_ids[a:a + len(chunk)], stage)

    def _check(self, to_host: list, to_device: list) -> None:
        nd, nh = self.num_device_blocks, self.num_host_blocks
        for what, pairs, dev_first in (("to_host", to_host, True), ("to_device", to_device, False)):
            for pair in pairs:
                d, h = pair if dev_first else pair[::-1]
                if not (isinstance(d, int) and 0 <= d < nd and isinstance(h, int) and 0 <= h < nh):
                    raise ValueError(f"{what} move {pair}: a block id outside the device pool "
                                     f"[0, {nd}) or the host pool [0, {nh})")
        for what, dests in (("to_host", [h for _, h in to_host]),
                            ("to_device", [d for _, d in to_device])):
            if len(set(dests)) != len(dests):
                raise ValueError(f"{what}: a destination block is named twice")

    def _measure(self) -> float:
        """GB/s of plain copies between the staging buffer and the host pool, the slower
        direction (best of a few; a few tens of ms at start-up)."""
        n = max(1, min(self.chunk_blocks, self.num_host_blocks, _PROBE_BYTES // self.block_bytes))
        stage, host = self.staging[:n], self.host[:n]
        nbytes = n * self.block_bytes
        rates = []
        with on_device(self.device, self.stream):
            for src, dst in ((stage, host), (host, stage)):
                dst.copy_(src, non_blocking=self.cuda)     # (first touch, warm-up)
                self.synchronize()
                best = math.inf
                for _ in range(_PROBE_REPS):
                    t0 = time.perf_counter()
                    dst.copy_(src, non_blocking=self.cuda)
                    self.synchronize()
                    best = min(best, time.perf_counter() - t0)
                rates.append(nbytes / best / 1e9)
        return min(rates)


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 ids on device through pinned memory, without waiting for the device's queue."""
    t = torch.tensor(values, dtype=torch.long, pin_memory=True)
    return t.to(device, non_blocking=True)
