"""A copy engine for KV blocks through pinned host memory: the path between GPUs that have no
peer access, and (later) the path of a CPU KV tier. Two halves, each usable alone:

    to_host(pool, ids, heads)        on a stream of ours on the pool's GPU: gather the blocks
                                     (index_select), copy them into fresh pinned host memory
    from_host(staged, pool, ids,     on the caller's stream of the pool's GPU, once the first
              heads, stream)         half is done (an event): copy in, scatter into the blocks

    GPU a (producer's pool) ──gather──> [blocks] ──DMA──> pinned host ──DMA──> GPU b ──scatter──>
          (relay stream on a)                                   (caller's stream on b)

Nothing runs on the pool owner's streams (the producer never takes part). Each half records a
(start, end) pair of timing events: the copies' own GPU time. Tensors a queued copy still reads
are kept on the result until the caller knows the copies are done."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...devices import on_device
from .timing import timed_event


@dataclass(eq=False)
class Staged:
    """Blocks on their way through host memory."""
    host: torch.Tensor             # pinned; valid once `ready` has completed
    ready: object                  # the event that ends the device -> host copy
    spans: list = field(default_factory=list)   # (start, end) timing events, one per half done
    keep: list = field(default_factory=list)    # tensors queued copies still read

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


class HostRelay:
    """Copies between GPU pools and pinned host memory on streams of its own, one per GPU it
    reads from (created on first use)."""

    def __init__(self):
        self._streams: dict[int, torch.cuda.Stream] = {}

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        s = self._streams.get(device.index)
        if s is None:
            s = self._streams[device.index] = torch.cuda.Stream(device)
        return s

    def index(self, device: torch.device, block_ids: list[int]) -> torch.Tensor:
        """Block ids on `device`, copied on the relay's stream there (so the gathers that use
        them are ordered after the copy)."""
        with on_device(device, self.stream(device)):
            return torch.tensor(block_ids, dtype=torch.long).to(device)

    def to_host(self, pool: torch.Tensor, ids: torch.Tensor, heads: slice) -> Staged:
        """Blocks `ids` (from index()) of pool [layers, 2, blocks, block_size, heads, head_dim],
        local heads `heads`, into pinned host memory."""
        stream = self.stream(pool.device)
        with on_device(pool.device, stream):
            t0 = timed_event(stream)
            blocks = pool.index_select(2, ids)[:, :, :, :, heads]
            host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
            host.copy_(blocks, non_blocking=True)
            end = timed_event(stream)
        return Staged(host, end, [(t0, end)], [blocks, host])

    def from_host(self, staged: Staged, pool: torch.Tensor, ids: torch.Tensor, heads: slice,
                  stream: torch.cuda.Stream) -> object:
        """Scatter staged blocks into pool's blocks `ids` (on pool's device), local heads
        `heads`, on `stream` after the host copy is done. Returns the event that ends it."""
        stream.wait_event(staged.ready)
        with on_device(pool.device, stream):
            t1 = timed_event(stream)
            on_dev = staged.host.to(pool.device, non_blocking=True)
            pool[:, :, :, :, heads].index_copy_(2, ids, on_dev)
            end = timed_event(stream)
        staged.spans.append((t1, end))
        staged.keep.append(on_dev)
        return end

    def synchronize(self) -> None:
        """Wait for every copy this relay queued."""
        for s in self._streams.values():
            s.synchronize()
