"""One-sided pull between processes of one host ("shared", "relay"): the consumer reads the
producer's KV pool, which is exported once; the producer never takes part. Three paths, chosen
per producer when it is added:

    "peer"   CUDA, peer access: the pool mapped into the consumer GPU's context; a Triton kernel
             per head range reads it over NVLink (kernels/kv_pull.py), graph-captured once
    "relay"  CUDA, no peer access (or forced): through pinned host memory (host_relay.py)
    "file"   CPU: the pool is a shared file mapping; copied a layer at a time on a thread
"""
from __future__ import annotations

import inspect
import pickle
import threading
from collections import deque
from typing import TYPE_CHECKING

import torch

from ...devices import on_device
from ...protocol import KVLoad, KVLoadDone, KVPeer
from .base import KVConnector, register_connector
from .head_plan import HeadCopy, plan_head_copies
from .host_relay import HostRelay
from .load_tracker import Load, LoadTracker, expect_agreement
from .timing import timed_event

if TYPE_CHECKING:
    from ...kernels.kv_pull import PullGraphs


def _ipc_device(rebuild, args) -> int:
    """The device a CUDA-IPC-exported tensor lives on (as the producer numbered it)."""
    return args[list(inspect.signature(rebuild).parameters).index("storage_device")]


def open_ipc_here(rebuild, args, device: torch.device | None) -> torch.Tensor:
    """Map a producer's IPC-exported CUDA tensor into THIS process. device=None: in a context on
    the producer's GPU (what torch does; only that GPU's streams may read it). A device: in THIS
    GPU's context (not the producer GPU's, which torch would pick): cudaIpcOpenMemHandle on our
    device with lazy peer access gives a pointer kernels here can read over NVLink. The tensor
    says it is on our device; its bytes live on the producer's."""
    names = list(inspect.signature(rebuild).parameters)
    args = list(args)
    if device is not None:
        args[names.index("storage_device")] = device.index
    args[names.index("event_sync_required")] = False  # we order with our own handshake
    return rebuild(*args)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@register_connector
class SharedPullConnector(KVConnector):
    """One-sided pull between processes of one host. The producer's KV pool is exported once:
    on CUDA as an IPC handle, on CPU as a shared file mapping. The producer never takes part.

    CUDA, per producer GPU, chosen when the peer is added (torch.cuda.can_device_access_peer):
      "peer":  the consumer maps the producer GPU's memory into its own GPU's context and one
               kernel per head range, on its own GPU and a dedicated stream, reads the blocks
               straight over NVLink (pdserve/kernels/kv_pull.py); an event marks the end. The
               kernels are captured once per peer as CUDA graphs (PullGraphs): a hand-off's
               host work in the timed window is one graph replay.
      "relay": no peer access. The consumer maps the pool on the producer's GPU (its own context
               there), gathers the blocks on a stream of that GPU, copies them to pinned host
               memory, and its own GPU copies them in and scatters them: two DMA hops through
               the host, ordered by an event, nothing on the producer's streams.
    CPU: loads run in order on one thread, a layer at a time, so a cancel takes effect at the
    next layer boundary.
    """

    name = "shared"
    force_relay = False
    GRAPH_MAX_BLOCKS = 4096      # pulls of up to this many blocks replay a CUDA graph

    def __init__(self, kv_cache: torch.Tensor, tp_rank: int, tp_size: int, num_kv_heads: int):
        super().__init__(kv_cache, tp_rank, tp_size, num_kv_heads)
        self.peers: dict[str, tuple[list[torch.Tensor], list[HeadCopy]]] = {}
        self.paths: dict[str, str] = {}          # producer -> "peer" | "relay" | "file"
        self._pulls: dict[str, PullGraphs] = {}  # "peer" path: the plan's KVPulls, graphed
        self.tracker = LoadTracker()
        self.cuda = kv_cache.device.type == "cuda"
        self._relay = HostRelay() if self.cuda else None
        # High priority: under load the pull shares the GPU with decode steps, and a request
        # waits for its KV (the block scheduler takes the pull's programs first; a decode step
        # gives up ~0.2 ms per 58 MB pulled).
        self._stream = torch.cuda.Stream(kv_cache.device, priority=-1) if self.cuda else None
        self._lock = threading.Lock()
        self._queue: deque[Load] = deque()      # CPU async loads, run by one thread in order
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def loads(self) -> dict[str, Load]:
        """Loads awaiting the driver's verdict, by request id."""
        return self.tracker.loads

    @classmethod
    def allocate(cls, shape, dtype, device, path):
        if device.type == "cuda":
            return torch.zeros(shape, dtype=dtype, device=device)
        t = torch.from_file(path, shared=True, size=_numel(shape), dtype=dtype).view(shape)
        t._pdserve_path = path  # noqa: SLF001 - export() needs it
        return t

    def num_peers(self) -> int:
        return len(self.peers)

    def export(self) -> bytes:
        if self.cuda:
            from torch.multiprocessing.reductions import reduce_tensor
            return pickle.dumps(("cuda", reduce_tensor(self.kv)))
        path = getattr(self.kv, "_pdserve_path", None)
        if path is None:
            raise ValueError("this KV cache was not allocated by the shared connector")
        return pickle.dumps(("file", path, tuple(self.kv.shape), str(self.kv.dtype)))

    def add_peer(self, peer: KVPeer) -> None:
        if peer.worker in self.peers:
            return
        pools, paths = [], set()
        for h in peer.handles:
            spec = pickle.loads(h)
            if spec[0] == "cuda":
                pool, path = self._map_cuda(spec[1])
            else:
                _, file, shape, dtype = spec
                dtype = getattr(torch, dtype.removeprefix("torch."))
                pool, path = torch.from_file(file, shared=True, size=_numel(shape),
                                             dtype=dtype).view(shape), "file"
            pools.append(pool)
            paths.add(path)
        mine = self.kv.shape
        for p in pools:
            if p.shape[0] != mine[0] or p.shape[3] != mine[3] or p.shape[5] != mine[5] \
                    or p.dtype != self.kv.dtype:
                raise ValueError(f"worker {peer.worker}'s KV layout {tuple(p.shape)} {p.dtype} "
                                 f"does not match this one's {tuple(mine)} {self.kv.dtype}")
        plan = plan_head_copies(peer.num_kv_heads, peer.tp, self.tp_size, self.tp_rank)
        self.peers[peer.worker] = (pools, plan)
        self.paths[peer.worker] = "relay" if "relay" in paths else paths.pop()
        if self.paths[peer.worker] == "peer":   # checked, laid out and graph-captured once
            from ...kernels.kv_pull import KVPull, PullGraphs
            with on_device(self.kv.device):
                self._pulls[peer.worker] = PullGraphs(
                    [KVPull(pools[hc.src_rank], self.kv, hc.src_heads, hc.dst_heads)
                     for hc in plan], min(self.kv.shape[2], self.GRAPH_MAX_BLOCKS))

    def _map_cuda(self, ipc) -> tuple[torch.Tensor, str]:
        """A producer rank's IPC-exported pool, mapped for the peer path where this GPU can read
        the producer's, else on the producer's GPU for the relay."""
        here = self.kv.device.index
        theirs = _ipc_device(*ipc)
        if not self.force_relay and (theirs == here
                                     or torch.cuda.can_device_access_peer(here, theirs)):
            try:
                return open_ipc_here(*ipc, self.kv.device), "peer"
            except RuntimeError:  # peer access reported but the mapping refused
                pass
        return open_ipc_here(*ipc, None), "relay"

    # ---- loads -----------------------------------------------------------------------------
    def start_load(self, load: KVLoad, sync: bool) -> None:
        if load.worker not in self.peers:
            raise ValueError(f"no KV peer {load.worker!r} (ConnectKV first)")
        item = self.tracker.start(load)
        if self.cuda:
            self._launch_cuda(item)
            if sync:
                item.event.synchronize()
                self.tracker.complete(item)
        elif sync:
            self._copy_cpu(item)
            self.tracker.complete(item)
        else:
            with self._lock:
                self._queue.append(item)
                self._wake.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._cpu_loop, daemon=True,
                                                name="kv-pull")
                self._thread.start()

    def _copy_cpu(self, item: Load) -> None:
        pools, plan = self.peers[item.load.worker]
        src_idx = torch.tensor(item.load.src_block_ids, dtype=torch.long)
        dst_idx = torch.tensor(item.load.dst_block_ids, dtype=torch.long)
        try:
            for layer in range(self.kv.shape[0]):       # a layer at a time: cancel between them
                if item.cancel:
                    item.error = "cancelled"
                    return
                for hc in plan:
                    src = pools[hc.src_rank][layer].index_select(1, src_idx)[:, :, :, hc.src_heads]
                    self.kv[layer][:, :, :, hc.dst_heads].index_copy_(1, dst_idx, src)
                    item.nbytes += src.numel() * src.element_size()
        except Exception as e:  # noqa: BLE001 - reported as a failed load, the engine recovers
            item.error = f"{type(e).__name__}: {e}"

    def _cpu_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                item = self._queue.popleft()
            self._copy_cpu(item)
            self.tracker.complete(item)

    def _launch_cuda(self, item: Load) -> None:
        """One kernel per head range, on this GPU's transfer stream, reading the producer's GPU
        memory directly (peer access through the IPC mapping; pdserve/kernels/kv_pull.py),
        launched as one CUDA-graph replay; or the relay's copies."""
        pools, plan = self.peers[item.load.worker]
        load = item.load
        dev = self.kv.device
        self._stream.wait_stream(torch.cuda.current_stream(dev))
        with on_device(dev, self._stream):
            if self.paths[load.worker] == "relay":
                dst_ids = torch.tensor(load.dst_block_ids, dtype=torch.long)
                self._launch_relay(item, pools, plan, dst_ids.to(dev, non_blocking=True))
                return
            graphed = self._pulls[load.worker]
            graphed.stage(load.src_block_ids, load.dst_block_ids)   # ids: before the window
            t0 = timed_event(self._stream)
            graphed.launch()         # one graph replay between the two events
            item.event = timed_event(self._stream)
        item.spans.append((t0, item.event))
        item.nbytes = graphed.bytes_per_block * len(load.src_block_ids)

    def _launch_relay(self, item: Load, pools, plan, dst_idx) -> None:
        """No peer access: per head range, the relay gathers on the producer's GPU (a stream of
        ours there) into pinned host memory, then our transfer stream copies in and scatters
        into our blocks. Timed per device (one span each)."""
        src_ids: dict[int, torch.Tensor] = {}     # the ids on each producer GPU, copied once
        for hc in plan:
            src = pools[hc.src_rank]
            idx = src_ids.get(src.device.index)
            if idx is None:
                idx = src_ids[src.device.index] = self._relay.index(src.device,
                                                                    item.load.src_block_ids)
            staged = self._relay.to_host(src, idx, hc.src_heads)
            item.event = self._relay.from_host(staged, self.kv, dst_idx, hc.dst_heads,
                                               self._stream)
            item.spans += staged.spans
            item.keep += staged.keep              # until the copies are done
            item.nbytes += staged.nbytes
        if item.event is None:                    # nothing to copy
            item.event = timed_event(self._stream)

    def poll(self) -> list[KVLoadDone]:
        if self.cuda:
            for item in self.tracker.pending():
                if item.event is not None and item.event.query():
                    self.tracker.complete(item)
        return self.tracker.report()

    def finish(self, request_id: str, ok: bool) -> None:
        item = self.tracker.verdict(request_id)
        if item is None:
            return
        if self.cuda:
            if item.event is not None:
                if ok:
                    torch.cuda.current_stream(self.kv.device).wait_event(item.event)
                else:
                    item.event.synchronize()   # GPU copies always end; wait so none lands later
            return
        if ok:
            item.done.wait()   # the driver's copy is done; this rank's may still be running
            expect_agreement(item, self.tp_rank, "pull")
            return
        item.cancel = True
        with self._lock:
            if item in self._queue:
                self._queue.remove(item)
                return
        item.done.wait()                       # CPU copies end at the next layer boundary

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if self.cuda:  # let the producers' IPC allocations go before this process exits
            torch.cuda.synchronize(self.kv.device)
            self._relay.synchronize()
        self.tracker.clear()
        self.peers.clear()
        self._pulls.clear()


@register_connector
class RelayConnector(SharedPullConnector):
    """The "shared" connector with the pinned host-memory relay taken even where peer access
    exists (to measure it, or where reported peer access misbehaves). On CPU it is "shared"."""

    name = "relay"
    force_relay = True
