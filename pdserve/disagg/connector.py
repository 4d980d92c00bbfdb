"""KV connectors: how a consumer (decode) rank gets a request's KV blocks from a producer
(prefill) worker. One interface; transports register under a name (EngineConfig.kv_connector).

Every rank of a worker in a P/D deployment owns one connector over its own KV cache:

    producer rank:  allocate() the cache where peers can reach it; export() a handle for it
    consumer rank:  add_peer(KVPeer)           once per producer worker (its ranks' handles)
                    start_load(KVLoad, sync)   copy blocks, all layers, the heads this rank holds
                    poll() -> finished loads   (async: each step; sync loads finish in start_load)
                    finish(rid, ok)            the driver's verdict: ok -> make the data visible
                                               to compute; not ok -> cancel (no write after it)

    producer rank (two-sided only):  send_blocks(KVSend) when the router asks (SendKV)
    either end (two-sided only):     drop_peer(name) when the router saw that worker die
                                     (DropPeer): the pair is aborted. Without it a producer
                                     gives up a send after KVPair.send_timeout_s, breaking
                                     the pair the same way, and goes on serving.

With a one-sided connector a load never involves the producer, so neither side waits for a
matching send/receive. The driver of the consumer (rank 0) decides when a load is done and
tells its other ranks in the next step, so all ranks admit the request together.

Registered:
  "shared"      one-sided, one host. CUDA: the producer's pool over CUDA IPC, read by a Triton
                kernel over NVLink where the GPUs have peer access, else through pinned host
                memory (the relay; chosen per producer GPU when it is added). CPU: a shared file.
  "relay"       "shared" with the pinned host relay forced.
  "torch-dist"  two-sided send/receive over a per-pair gloo group (CPU; what CI runs).
  "nccl"        the same pairing over NCCL point-to-point (GPUs, across hosts too); on CPU
                its code runs over gloo, blocking, so CI exercises it.

Faults for tests: PDSERVE_KV_FAULT=fail makes loads fail (half-way where a transport copies in
parts: CPU layers, relay head ranges; the graphed peer pull copies nothing); =hang makes them
never finish (until cancelled).
"""
from __future__ import annotations

import abc
import datetime
import os
import pickle
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..devices import on_device
from .kv_transfer import HeadCopy, plan_head_copies
from ..protocol import KVLoad, KVLoadDone, KVPair, KVPeer, KVSend

if TYPE_CHECKING:
    from ..kernels.kv_pull import PullGraphs

_CONNECTORS: dict[str, type["KVConnector"]] = {}


def register_connector(cls: type["KVConnector"]) -> type["KVConnector"]:
    _CONNECTORS[cls.name] = cls
    return cls


def connector_names() -> list[str]:
    return sorted(_CONNECTORS)


def get_connector_class(name: str) -> type["KVConnector"]:
    try:
        return _CONNECTORS[name]
    except KeyError:
        raise ValueError(f"unknown kv_connector {name!r}; known: {connector_names()}") from None


class KVConnector(abc.ABC):
    name: str = ""
    # One-sided: the consumer reads the producer's pool (peers: KVPeer). Two-sided: the
    # producer sends when asked (SendKV) and the consumer receives (peers: KVPair, both ends).
    two_sided: bool = False

    def __init__(self, kv_cache: torch.Tensor, tp_rank: int, tp_size: int, num_kv_heads: int):
        self.kv = kv_cache
        self.tp_rank, self.tp_size, self.num_kv_heads = tp_rank, tp_size, num_kv_heads
        self.fault = os.environ.get("PDSERVE_KV_FAULT") or None

    @classmethod
    def allocate(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 path: str) -> torch.Tensor:
        """A zeroed KV cache this connector can export (path: a file name the worker owns)."""
        return torch.zeros(shape, dtype=dtype, device=device)

    @abc.abstractmethod
    def export(self) -> bytes:
        """This rank's handle for consumers (KVPeer.handles[rank])."""

    @abc.abstractmethod
    def add_peer(self, peer: KVPeer | KVPair) -> None:
        """Make a peer reachable (idempotent). Every rank of the worker calls it in the same
        step; a two-sided connector joins the pair's process group here."""

    @abc.abstractmethod
    def num_peers(self) -> int:
        """Peers added so far (a two-sided pair that could not be formed counts: it was tried)."""

    def drop_peer(self, worker: str) -> None:
        """Worker `worker` is gone (every rank, in the same step): stop waiting for it. A
        two-sided pair with it is aborted: pending sends are abandoned, later sends skipped,
        loads from it fail. One-sided connectors have nothing that waits for a peer."""

    def num_broken(self) -> int:
        """Peers (of num_peers()) this connector has given up on."""
        return 0

    def check_peer(self, peer: KVPeer | KVPair) -> None:
        """Rank 0, when a peer is announced: ValueError if it cannot work (before any rank
        commits to it)."""
        self.add_peer(peer)

    def send_blocks(self, send: KVSend) -> None:
        """Two-sided producers: send blocks to a consumer (asynchronously; the blocks are read
        before this returns, so they may be reused right after)."""
        raise ValueError(f"the {self.name!r} connector does not send")

    @abc.abstractmethod
    def start_load(self, load: KVLoad, sync: bool) -> None:
        """Begin copying a request's blocks. sync: return only once it is finished (poll()
        reports it)."""

    @abc.abstractmethod
    def poll(self) -> list[KVLoadDone]:
        """Loads that finished (or failed) since the last call."""

    @abc.abstractmethod
    def finish(self, request_id: str, ok: bool) -> None:
        """The driver's verdict on a load: ok -> the next forward may read its blocks; not ok ->
        cancel it; either way nothing writes to its blocks after this returns."""

    def close(self) -> None:
        pass

    def _report(self, finished: deque, lock: threading.Lock) -> list[KVLoadDone]:
        """Loads queued on `finished` (by whichever thread ended them), each reported once."""
        out = []
        with lock:
            while finished:
                item = finished.popleft()
                if item.reported:
                    continue
                item.reported = True
                out.append(KVLoadDone(item.load.request_id, item.error is None, item.nbytes,
                                      item.end - item.start, item.error))
        return out


class _HostMark:
    """A CUDA event's stand-in on CPU, where work is done when its call returns."""

    def __init__(self):
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_HostMark") -> float:
        return (end.t - self.t) * 1e3


def _first_line(e: BaseException) -> str:
    """An exception as one line (gloo's messages run on with advice)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _timed_event(stream):
    """A timing event recorded on stream (CUDA), or a host time stamp (stream None: CPU)."""
    if stream is None:
        return _HostMark()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(stream)
    return ev


def _ipc_device(rebuild, args) -> int:
    """The device a CUDA-IPC-exported tensor lives on (as the producer numbered it)."""
    import inspect
    return args[list(inspect.signature(rebuild).parameters).index("storage_device")]


def _open_ipc_here(rebuild, args, device: torch.device | None) -> torch.Tensor:
    """Map a producer's IPC-exported CUDA tensor into THIS process. device=None: in a context on
    the producer's GPU (what torch does; only that GPU's streams may read it). A device: in THIS
    GPU's context (not the producer GPU's, which torch would pick): cudaIpcOpenMemHandle on our
    device with lazy peer access gives a pointer kernels here can read over NVLink. The tensor
    says it is on our device; its bytes live on the producer's."""
    import inspect
    names = list(inspect.signature(rebuild).parameters)
    args = list(args)
    if device is not None:
        args[names.index("storage_device")] = device.index
    args[names.index("event_sync_required")] = False  # we order with our own handshake
    return rebuild(*args)


@dataclass(eq=False)
class _Load:
    load: KVLoad
    start: float
    end: float = 0.0
    nbytes: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    cancel: bool = False
    error: str | None = None
    event: object = None           # CUDA: recorded on the transfer stream after the last copy
    # CUDA: (start, end) event pairs around the copies, each pair on one stream; their sum is
    # the transfer's GPU time (a relay has one span per device)
    spans: list = field(default_factory=list)
    keep: list = field(default_factory=list)  # buffers in use by queued copies
    status: object = None          # two-sided CUDA: the producer's status word (pinned host)
    reported: bool = False


@dataclass(eq=False)
class _Sending:
    """A two-sided producer's send whose GPU work may still run (NcclConnector on CUDA)."""
    works: list                    # its torch.distributed Work objects
    keep: list                     # the buffers they read
    since: float                   # when it could start: issued, or its predecessor done
    timeout_s: float               # the pair's send_timeout_s

    def done(self) -> bool:
        try:
            return all(w.is_completed() for w in self.works)
        except Exception:  # noqa: BLE001 - a failed send is over too
            return True


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
    """

    name = "shared"
    force_relay = False
    GRAPH_MAX_BLOCKS = 4096      # pulls of up to this many blocks replay a CUDA graph

    def __init__(self, kv_cache: torch.Tensor, tp_rank: int, tp_size: int, num_kv_heads: int):
        super().__init__(kv_cache, tp_rank, tp_size, num_kv_heads)
        self._path: str | None = None
        self.peers: dict[str, tuple[list[torch.Tensor], list[HeadCopy]]] = {}
        self.paths: dict[str, str] = {}          # producer -> "peer" | "relay" | "file"
        self._pulls: dict[str, PullGraphs] = {}  # "peer" path: the plan's KVPulls, graphed
        self._relay_streams: dict[int, torch.cuda.Stream] = {}
        self.loads: dict[str, _Load] = {}
        self._finished: deque[_Load] = deque()
        self._lock = threading.Lock()
        self.cuda = kv_cache.device.type == "cuda"
        # High priority: under load the pull shares the GPU with decode steps, and a request
        # waits for its KV (the block scheduler takes the pull's programs first; a decode step
        # gives up ~0.2 ms per 58 MB pulled).
        self._stream = torch.cuda.Stream(kv_cache.device, priority=-1) if self.cuda else None
        self._queue: deque[_Load] = deque()     # CPU async loads, run by one thread in order
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False

    @classmethod
    def allocate(cls, shape, dtype, device, path):
        if device.type == "cuda":
            return torch.zeros(shape, dtype=dtype, device=device)
        numel = 1
        for s in shape:
            numel *= s
        t = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
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
                here = self.kv.device.index
                theirs = _ipc_device(*spec[1])
                direct = not self.force_relay and (
                    theirs == here or torch.cuda.can_device_access_peer(here, theirs))
                pool = None
                if direct:
                    try:
                        pool = _open_ipc_here(*spec[1], self.kv.device)
                    except RuntimeError:  # peer access reported but the mapping refused
                        direct = False
                if pool is None:
                    pool = _open_ipc_here(*spec[1], None)
                paths.add("peer" if direct else "relay")
                pools.append(pool)
            else:
                paths.add("file")
                _, path, shape, dtype = spec
                dtype = getattr(torch, dtype.removeprefix("torch."))
                numel = 1
                for s in shape:
                    numel *= s
                pools.append(torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape))
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
            from ..kernels.kv_pull import KVPull, PullGraphs
            with on_device(self.kv.device):
                self._pulls[peer.worker] = PullGraphs(
                    [KVPull(pools[hc.src_rank], self.kv, hc.src_heads, hc.dst_heads)
                     for hc in plan], min(self.kv.shape[2], self.GRAPH_MAX_BLOCKS))

    # ---- loads -----------------------------------------------------------------------------
    def start_load(self, load: KVLoad, sync: bool) -> None:
        if load.worker not in self.peers:
            raise ValueError(f"no KV peer {load.worker!r} (ConnectKV first)")
        item = _Load(load, time.perf_counter())
        self.loads[load.request_id] = item
        if self.fault == "hang":
            return                                     # never finishes; finish(ok=False) ends it
        if self.cuda:
            self._launch_cuda(item)
            if sync:
                item.event.synchronize()
                self._complete(item)
        elif sync:
            self._copy_cpu(item)
            self._complete(item)
        else:
            with self._lock:
                self._queue.append(item)
                self._wake.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._cpu_loop, daemon=True,
                                                name="kv-pull")
                self._thread.start()

    def _copy_cpu(self, item: _Load) -> None:
        pools, plan = self.peers[item.load.worker]
        src_idx = torch.tensor(item.load.src_block_ids, dtype=torch.long)
        dst_idx = torch.tensor(item.load.dst_block_ids, dtype=torch.long)
        try:
            for layer in range(self.kv.shape[0]):       # a layer at a time: cancel between them
                if item.cancel:
                    item.error = "cancelled"
                    return
                if self.fault == "fail" and layer == self.kv.shape[0] // 2:
                    raise RuntimeError("injected KV transfer fault (PDSERVE_KV_FAULT=fail)")
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
            self._complete(item)

    def _launch_cuda(self, item: _Load) -> None:
        """One kernel per head range, on this GPU's transfer stream, reading the producer's GPU
        memory directly (peer access through the IPC mapping; pdserve/kernels/kv_pull.py),
        launched as one CUDA-graph replay; or the relay's copies."""
        pools, plan = self.peers[item.load.worker]
        load = item.load
        dev = self.kv.device
        self._stream.wait_stream(torch.cuda.current_stream(dev))
        with on_device(dev, self._stream):
            if self.fault == "fail":
                item.error = "injected KV transfer fault (PDSERVE_KV_FAULT=fail)"
                plan = plan[: len(plan) // 2]
            if self.paths[load.worker] == "relay":
                dst_ids = torch.tensor(load.dst_block_ids, dtype=torch.long)
                self._launch_relay(item, pools, plan, dst_ids.to(dev, non_blocking=True))
                return
            graphed = self._pulls[load.worker]
            if item.error is not None:    # the injected fault: this path pulls nothing
                item.event = _timed_event(self._stream)
                return
            graphed.stage(load.src_block_ids, load.dst_block_ids)   # ids: before the window
            t0 = _timed_event(self._stream)
            graphed.launch()         # one graph replay between the two events
            item.event = _timed_event(self._stream)
        item.spans.append((t0, item.event))
        item.nbytes = graphed.bytes_per_block * len(load.src_block_ids)

    def _launch_relay(self, item: _Load, pools, plan, dst_idx) -> None:
        """No peer access: per head range, gather on the producer's GPU (a stream of ours
        there) and copy to pinned host memory; then, on our transfer stream once that is done,
        copy in and scatter into our blocks. Timed per device (one span each)."""
        dev = self.kv.device
        src_ids: dict[int, torch.Tensor] = {}     # the ids on each producer GPU, copied once
        for hc in plan:
            src = pools[hc.src_rank]
            stream = self._relay_streams.get(src.device.index)
            if stream is None:
                stream = self._relay_streams[src.device.index] = torch.cuda.Stream(src.device)
            with on_device(src.device, stream):
                t0 = _timed_event(stream)
                idx = src_ids.get(src.device.index)
                if idx is None:
                    idx = src_ids[src.device.index] = torch.tensor(
                        item.load.src_block_ids, dtype=torch.long).to(src.device)
                blocks = src.index_select(2, idx)[:, :, :, :, hc.src_heads]
                host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
                host.copy_(blocks, non_blocking=True)
                out = _timed_event(stream)
            item.spans.append((t0, out))
            self._stream.wait_event(out)
            with on_device(dev, self._stream):
                t1 = _timed_event(self._stream)
                on_dev = host.to(dev, non_blocking=True)
                self.kv[:, :, :, :, hc.dst_heads].index_copy_(2, dst_idx, on_dev)
                item.event = _timed_event(self._stream)
            item.spans.append((t1, item.event))
            item.keep += [blocks, host, on_dev]   # until the copies are done
            item.nbytes += host.numel() * host.element_size()
        if item.event is None:                   # nothing to copy (an injected fault)
            item.event = _timed_event(self._stream)

    def _complete(self, item: _Load) -> None:
        if item.spans:  # the copies' own duration on the GPU(s)
            item.end = item.start + sum(a.elapsed_time(b) for a, b in item.spans) / 1e3
        else:
            item.end = time.perf_counter()
        item.keep.clear()
        item.done.set()
        with self._lock:
            self._finished.append(item)

    def poll(self) -> list[KVLoadDone]:
        if self.cuda:
            for item in self.loads.values():
                if not item.done.is_set() and item.event is not None and item.event.query():
                    self._complete(item)
        return self._report(self._finished, self._lock)

    def finish(self, request_id: str, ok: bool) -> None:
        item = self.loads.pop(request_id, None)
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
            if item.error is not None:  # ranks disagree: this rank's KV is wrong, stop here
                raise RuntimeError(f"KV pull of {request_id} failed on rank {self.tp_rank} "
                                   f"only: {item.error}")
            return
        item.cancel = True
        with self._lock:
            if item in self._queue:
                self._queue.remove(item)
                return
        if self.fault != "hang":
            item.done.wait()                   # CPU copies end at the next layer boundary

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if self.cuda:  # let the producers' IPC allocations go before this process exits
            torch.cuda.synchronize(self.kv.device)
            for stream in self._relay_streams.values():
                stream.synchronize()
        self.loads.clear()
        self.peers.clear()
        self._pulls.clear()


@register_connector
class RelayConnector(SharedPullConnector):
    """The "shared" connector with the pinned host-memory relay taken even where peer access
    exists (to measure it, or where reported peer access misbehaves). On CPU it is "shared"."""

    name = "relay"
    force_relay = True


class _PairConnector(KVConnector):
    """Two-sided transfers over torch.distributed point-to-point. Each producer/consumer pair of
    workers forms its own process group (both workers' ranks, producer first), created from a
    TCPStore the router hosts, so a worker's TP group and other pairs are untouched.

    Order is the contract: the router asks the producer to send (SendKV) in the same order as it
    hands the requests to the consumer, and the consumer's scheduler emits their loads in that
    order (a request aborted before its load still gets a receive-and-discard load), so every
    send meets its receive. Each message is a status word (1: the producer still held the blocks)
    then one [layers, 2, blocks, block_size, heads, head_dim] tensor per producer rank that holds
    heads this consumer rank needs. A pair that cannot form, or breaks, is marked broken for
    good: its loads fail (and are recomputed), its sends are skipped.

    A pair breaks when its transport fails (gloo notices a dead peer's closed connection at
    once), when a send has waited KVPair.send_timeout_s (a stopped peer; a dead one over NCCL,
    which notices nothing by itself), or when the router drops the peer (drop_peer). The
    producer abandons that pair's pending sends and goes on serving its other pairs: the blocks
    were copied out of its pool when the send was issued, so its KV is not held by them."""

    two_sided = True
    join_timeout_s = 60.0

    def __init__(self, kv_cache: torch.Tensor, tp_rank: int, tp_size: int, num_kv_heads: int):
        super().__init__(kv_cache, tp_rank, tp_size, num_kv_heads)
        self.to_consumer: dict[str, tuple[object, KVPair]] = {}
        self.from_producer: dict[str, tuple[object, KVPair]] = {}
        self.broken: dict[str, str] = {}        # the other worker -> why its pair is unusable
        self._aborted: set[str] = set()         # pairs whose group was torn down already
        self.loads: dict[str, _Load] = {}
        self._finished: deque[_Load] = deque()
        self._lock = threading.Lock()

    def export(self) -> bytes:
        return b""                              # peers meet through the router's store

    def num_peers(self) -> int:
        return len(self.to_consumer) + len(self.from_producer)

    def num_broken(self) -> int:
        return len(self.broken)

    def drop_peer(self, worker: str) -> None:
        if worker in self.to_consumer or worker in self.from_producer:
            self._break(worker, f"pair with {worker} dropped: that worker is gone")

    def _break(self, other: str, why: str) -> None:
        """Mark the pair with `other` broken (the first reason stays). Any thread may call it."""
        self.broken.setdefault(other, why)

    def _group(self, other: str):
        """The process group of the pair with `other` (None: never formed)."""
        entry = self.to_consumer.get(other) or self.from_producer.get(other)
        return None if entry is None else entry[0]

    def check_peer(self, peer) -> None:
        if not isinstance(peer, KVPair):
            raise ValueError(f"the {self.name} connector pairs workers with KVPair")
        if peer.side not in ("producer", "consumer"):
            raise ValueError(f"bad KVPair side {peer.side!r}")

    def add_peer(self, peer) -> None:
        import torch.distributed as dist
        self.check_peer(peer)
        table = self.to_consumer if peer.side == "producer" else self.from_producer
        other = peer.consumer if peer.side == "producer" else peer.producer
        if other in table:
            return
        host, port = peer.store.rsplit(":", 1)
        timeout = datetime.timedelta(seconds=self.join_timeout_s)
        rank = self.tp_rank + (0 if peer.side == "producer" else peer.producer_tp)
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
            prefixed = dist.PrefixStore(f"{peer.producer}->{peer.consumer}", store)
            pg = self._new_group(prefixed, rank, peer.producer_tp + peer.consumer_tp, timeout,
                                 peer)
        except Exception as e:  # noqa: BLE001 - e.g. the other worker died before joining
            self.broken[other] = f"pair with {other} could not be formed: {type(e).__name__}: {e}"
            pg = None
        table[other] = (pg, peer)

    def _new_group(self, store, rank: int, size: int, timeout, pair: KVPair):
        import torch.distributed as dist
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    def _outgoing(self, pair: KVPair, blocks: torch.Tensor):
        """(consumer's rank in the pair group, this rank's part of blocks for it), for each
        consumer rank that needs heads this producer rank holds (one run of heads at most)."""
        for dst in range(pair.consumer_tp):
            for hc in plan_head_copies(pair.num_kv_heads, pair.producer_tp, pair.consumer_tp,
                                       dst):
                if hc.src_rank == self.tp_rank:
                    yield pair.producer_tp + dst, blocks[:, :, :, :, hc.src_heads].contiguous()

    def _incoming(self, pair: KVPair, num_blocks: int):
        """(head copy, receive buffer shape) for each part this consumer rank receives."""
        shape = list(self.kv.shape)
        shape[2] = num_blocks
        for hc in plan_head_copies(pair.num_kv_heads, pair.producer_tp, pair.consumer_tp,
                                   self.tp_rank):
            shape[4] = hc.dst_heads.stop - hc.dst_heads.start
            yield hc, tuple(shape)

    def _close_groups(self, abort: bool = False) -> None:
        # gloo's own threads must stop before the interpreter exits (else: abort at exit); a
        # broken pair's group may still have work queued: never wait for it
        for other, (pg, _) in [*self.to_consumer.items(), *self.from_producer.items()]:
            if pg is None or other in self._aborted:
                continue
            try:
                pg.abort() if abort or other in self.broken else pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
        self.to_consumer.clear()
        self.from_producer.clear()


@register_connector
class TorchDistConnector(_PairConnector):
    """Pairs over gloo between CPU processes (the path for hosts without shared memory). Sends
    and receives run on a thread per pair and direction (a gloo Work completes only through
    wait(), so a stuck peer holds up only its own pair's thread); each wait is bounded by the
    pair's send_timeout_s (gloo then closes the pair's connection, so the other end fails at
    once too). The received data is scattered into the blocks under a lock that a cancel
    takes too, so nothing lands after a cancel returns. On CUDA use "nccl" (the same pairing
    and order, on streams instead of threads)."""

    name = "torch-dist"

    def __init__(self, kv_cache: torch.Tensor, tp_rank: int, tp_size: int, num_kv_heads: int):
        super().__init__(kv_cache, tp_rank, tp_size, num_kv_heads)
        if kv_cache.device.type != "cpu":
            raise ValueError("the torch-dist connector runs on CPU (gloo); on GPUs use "
                             "kv_connector='nccl' (or 'shared' / 'relay' on one host)")
        # ("send", consumer) / ("recv", producer) -> that pair's jobs in order, each queue
        # worked by its own thread
        self._queues: dict[tuple[str, str], deque] = {}
        self._threads: list[threading.Thread] = []
        self._wake = threading.Condition()
        self._closed = False

    # ---- producer ----------------------------------------------------------------------------
    def send_blocks(self, send: KVSend) -> None:
        pg, pair = self.to_consumer[send.consumer]
        if pg is None or send.consumer in self.broken:
            return                              # no pair with that consumer (broken)
        blocks = self.kv.index_select(2, torch.tensor(send.block_ids, dtype=torch.long))
        for dst, t in self._outgoing(pair, blocks):
            self._push(("send", send.consumer), self._send_one, (pg, pair, dst, t, send.ok))

    def _send_one(self, job) -> None:
        pg, pair, dst, t, ok = job
        if pair.consumer in self.broken:
            return                              # abandoned with its pair
        timeout = datetime.timedelta(seconds=pair.send_timeout_s)
        try:
            pg.send([torch.tensor([1 if ok else 0], dtype=torch.int64)], dst, 0).wait(timeout)
            pg.send([t], dst, 0).wait(timeout)
        except Exception as e:  # noqa: BLE001 - the consumer is gone (closed) or stuck (timeout)
            self._break(pair.consumer, f"pair with {pair.consumer} broke: {_first_line(e)}")

    # ---- consumer ----------------------------------------------------------------------------
    def start_load(self, load: KVLoad, sync: bool) -> None:
        if load.worker not in self.from_producer:
            raise ValueError(f"no KV peer {load.worker!r} (ConnectKV first)")
        item = _Load(load, time.perf_counter())
        if load.dst_block_ids:
            self.loads[load.request_id] = item
        else:
            item.cancel = True                  # receive and discard (keeps the pair in step)
        self._push(("recv", load.worker), self._recv_one, item)
        if sync and load.dst_block_ids and self.fault != "hang":
            item.done.wait()

    def _recv_one(self, item: _Load) -> None:
        load = item.load
        why = self.broken.get(load.worker)
        pg, pair = self.from_producer[load.worker]
        try:
            if why is not None:
                raise RuntimeError(why)
            parts = []
            timeout = datetime.timedelta(seconds=pair.send_timeout_s)
            for hc, shape in self._incoming(pair, len(load.src_block_ids)):
                status = torch.zeros(1, dtype=torch.int64)
                pg.recv([status], hc.src_rank, 0).wait(timeout)
                buf = torch.empty(shape, dtype=self.kv.dtype)
                pg.recv([buf], hc.src_rank, 0).wait(timeout)
                if int(status) != 1:
                    item.error = "the producer no longer held the blocks"
                parts.append((hc, buf))
                item.nbytes += buf.numel() * buf.element_size()
            if self.fault == "fail":
                item.error = "injected KV transfer fault (PDSERVE_KV_FAULT=fail)"
            elif self.fault == "hang":
                while not item.cancel:
                    time.sleep(0.01)
            with self._lock:
                if not item.cancel and item.error is None:
                    dst = torch.tensor(load.dst_block_ids, dtype=torch.long)
                    for hc, buf in parts:
                        self.kv[:, :, :, :, hc.dst_heads].index_copy_(2, dst, buf)
        except Exception as e:  # noqa: BLE001 - a broken pair fails its loads; they recompute
            item.error = _first_line(e)
            self._break(load.worker, f"pair with {load.worker} broke: {item.error}")
        item.end = time.perf_counter()
        item.done.set()
        if load.dst_block_ids:
            with self._lock:
                self._finished.append(item)

    def poll(self) -> list[KVLoadDone]:
        return self._report(self._finished, self._lock)

    def finish(self, request_id: str, ok: bool) -> None:
        item = self.loads.pop(request_id, None)
        if item is None:
            return
        if ok:
            item.done.wait()  # the driver's receive is done; this rank's may still be running
            if item.error is not None:
                raise RuntimeError(f"KV receive of {request_id} failed on rank {self.tp_rank} "
                                   f"only: {item.error}")
            return
        with self._lock:      # from here on the receive thread drops the data
            item.cancel = True

    # ---- plumbing ----------------------------------------------------------------------------
    def _push(self, key: tuple[str, str], handle, job) -> None:
        with self._wake:
            q = self._queues.get(key)
            if q is None:
                q = self._queues[key] = deque()
                t = threading.Thread(target=self._loop, args=(q, handle), daemon=True,
                                     name=f"kv-{key[0]}-{key[1]}")
                t.start()
                self._threads.append(t)
            q.append(job)
            self._wake.notify_all()

    def _loop(self, q: deque, handle) -> None:
        while True:
            with self._wake:
                while not q and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                job = q.popleft()
            handle(job)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        deadline = time.monotonic() + 5.0
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        # a thread still waiting (at most send_timeout_s) must not meet a shut-down group
        self._close_groups(abort=any(t.is_alive() for t in self._threads))


@register_connector
class NcclConnector(_PairConnector):
    """Two-sided transfers between GPUs over NCCL point-to-point (torch.distributed's
    ProcessGroupNCCL): the path across hosts, or where CUDA IPC is not available. Pairing and
    order are torch-dist's (a process group per producer/consumer pair of workers, from the
    router's store; sends in hand-off order; receive-and-discard for dropped requests); what
    differs is that nothing blocks a thread. The producer gathers a send's blocks on its compute
    stream (so the blocks can be reused right after) and enqueues the sends; the consumer
    enqueues the receives and the scatter on its transfer stream and an event marks the end:
    NCCL works on its own streams, overlapping compute on both sides.

    NCCL notices no dead peer by itself, and a hung NCCL operation cannot be cancelled: only
    its communicator can be torn down (ProcessGroupNCCL.abort(), one pair's group; the TP group
    and other pairs are untouched). So a pair is aborted
      - consumer: when a load is given up (kv_transfer_timeout_s) and its transfer still does
        not arrive within cancel_grace_s; that cancel waits no longer, and later loads from
        that producer fail at once (their prompts are recomputed);
      - producer: when its oldest send has not completed send_timeout_s (KVPair) after it
        could start, checked by a watcher thread (the step loop may be idle); its buffers go,
        later sends to that consumer are skipped;
      - either end: when the router says the other worker died (drop_peer).
    torch's own watchdog would end the whole process once a pair's operation outlived the
    group's timeout: that timeout is set well above send_timeout_s, so the pair is aborted
    first.

    On CPU the same code runs over gloo, so CI exercises it; there every send and receive
    blocks its caller until the other side takes part (the router's single hand-off order
    keeps that from deadlocking; a send waits at most send_timeout_s), which is fine for
    tests, not for serving: "torch-dist" is the CPU connector."""

    name = "nccl"
    cancel_grace_s = 5.0
    watch_interval_s = 0.5      # how often the producer's watcher looks at pending sends
    group_timeout_factor = 4    # the pair group's (torch watchdog) timeout, in send_timeout_s

    def __init__(self, kv_cache: torch.Tensor, tp_rank: int, tp_size: int, num_kv_heads: int):
        super().__init__(kv_cache, tp_rank, tp_size, num_kv_heads)
        self.cuda = kv_cache.device.type == "cuda"
        self._inflight: deque[_Load] = deque()     # loads whose GPU work may still run
        # consumer -> its pair's sends whose GPU work may still run, in order
        self._sending: dict[str, deque[_Sending]] = {}
        self._stream = torch.cuda.Stream(kv_cache.device) if self.cuda else None
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None

    def _new_group(self, store, rank: int, size: int, timeout, pair: KVPair):
        import torch.distributed as dist
        if not self.cuda:
            return super()._new_group(store, rank, size, timeout, pair)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = max(timeout, datetime.timedelta(
            seconds=self.group_timeout_factor * pair.send_timeout_s))
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        pg.eager_connect_single_device(self.kv.device)  # the communicator, now, on all ranks
        return pg

    # ---- producer ----------------------------------------------------------------------------
    def send_blocks(self, send: KVSend) -> None:
        pg, pair = self.to_consumer[send.consumer]
        if pg is None or send.consumer in self.broken:
            return                              # no pair with that consumer (broken)
        dev = self.kv.device
        timeout = datetime.timedelta(seconds=pair.send_timeout_s)
        with on_device(dev):
            idx = torch.tensor(send.block_ids, dtype=torch.long).to(dev, non_blocking=True)
            blocks = self.kv.index_select(2, idx)
            status = torch.tensor([1 if send.ok else 0], dtype=torch.int64).to(dev)
            works, keep = [], [blocks, status]
            try:
                for dst, t in self._outgoing(pair, blocks):
                    # NCCL's stream waits for this (compute) stream at each send, no more
                    sent = [pg.send([status], dst, 0), pg.send([t], dst, 0)]
                    if not self.cuda:
                        for w in sent:   # gloo: a send completes only through wait()
                            w.wait(timeout)
                    works += sent
                    keep.append(t)
            except Exception as e:  # noqa: BLE001 - the consumer is gone: stop sending to it
                self._abort_pair(send.consumer, f"pair with {send.consumer} broke: "
                                                f"{_first_line(e)}")
        if self.cuda and works and send.consumer not in self.broken:
            with self._lock:
                self._sending.setdefault(send.consumer, deque()).append(
                    _Sending(works, keep, time.monotonic(), pair.send_timeout_s))
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, daemon=True,
                                                 name="kv-send-watch")
                self._watcher.start()
        self._prune()

    def _retire_sends(self) -> None:
        """Drop finished sends, pair by pair in order (their buffers go); abort a pair whose
        oldest send has not finished send_timeout_s after it could start (the one before it
        done): its consumer is dead or stuck."""
        now, stale = time.monotonic(), []
        with self._lock:
            for consumer, q in self._sending.items():
                while q and q[0].done():
                    q.popleft()
                    if q:
                        q[0].since = max(q[0].since, now)
                if q and now - q[0].since > q[0].timeout_s:
                    stale.append((consumer, q[0].timeout_s))
        for consumer, limit in stale:
            self._abort_pair(consumer, f"pair with {consumer} aborted: a send did not complete "
                                       f"in {limit:g} s")

    def _watch(self) -> None:
        while not self._closed.wait(self.watch_interval_s):
            self._retire_sends()

    # ---- consumer ----------------------------------------------------------------------------
    def start_load(self, load: KVLoad, sync: bool) -> None:
        if load.worker not in self.from_producer:
            raise ValueError(f"no KV peer {load.worker!r} (ConnectKV first)")
        item = _Load(load, time.perf_counter())
        discard = not load.dst_block_ids
        if not discard:
            self.loads[load.request_id] = item
        why = self.broken.get(load.worker)
        if why is not None:
            item.error = why
            self._complete(item)
            return
        pg, pair = self.from_producer[load.worker]
        dev = self.kv.device
        if self.cuda:  # the blocks' last readers first
            self._stream.wait_stream(torch.cuda.current_stream(dev))
        with on_device(dev, self._stream):
            t0 = _timed_event(self._stream)
            dst = None if discard else torch.tensor(load.dst_block_ids, dtype=torch.long).to(dev)
            statuses = []
            try:
                for hc, shape in self._incoming(pair, len(load.src_block_ids)):
                    status = torch.zeros(1, dtype=torch.int64, device=dev)
                    buf = torch.empty(shape, dtype=self.kv.dtype, device=dev)
                    # .wait(): on CUDA our stream waits for NCCL's; on CPU (gloo) we wait
                    pg.recv([status], hc.src_rank, 0).wait()
                    pg.recv([buf], hc.src_rank, 0).wait()
                    if not discard:
                        self.kv[:, :, :, :, hc.dst_heads].index_copy_(2, dst, buf)
                    statuses.append(status)
                    item.keep += [buf, status]
                    item.nbytes += buf.numel() * buf.element_size()
            except Exception as e:  # noqa: BLE001 - a broken pair fails its loads (recompute)
                item.error = f"{type(e).__name__}: {e}"
                self.broken.setdefault(load.worker, f"pair with {load.worker} broke: {e}")
            if statuses and self.cuda:
                item.status = torch.empty(len(statuses), dtype=torch.int64, pin_memory=True)
                item.status.copy_(torch.cat(statuses), non_blocking=True)
            elif statuses:
                item.status = torch.cat(statuses)
            item.event = _timed_event(self._stream)
            item.spans.append((t0, item.event))
        if discard:
            item.cancel = True
        self._inflight.append(item)
        if sync and not discard and self.fault != "hang":
            item.event.synchronize()
            self._prune()

    def _complete(self, item: _Load) -> None:
        if item.done.is_set():
            return
        if item.error is None and item.status is not None and not bool((item.status == 1).all()):
            item.error = "the producer no longer held the blocks"
        if item.error is None and self.fault == "fail":
            item.error = "injected KV transfer fault (PDSERVE_KV_FAULT=fail)"
        if item.spans:
            item.end = item.start + sum(a.elapsed_time(b) for a, b in item.spans) / 1e3
        else:
            item.end = time.perf_counter()
        item.keep.clear()
        item.done.set()
        if item.load.dst_block_ids:   # (a receive-and-discard is nobody's load)
            with self._lock:
                self._finished.append(item)

    def _prune(self) -> None:
        """Retire GPU work that has finished, in order: sends (their buffers go) and loads."""
        self._retire_sends()
        while self._inflight and self._inflight[0].event.query():
            item = self._inflight[0]
            if self.fault == "hang" and not item.cancel:
                return                                   # injected hang: never reported
            self._complete(self._inflight.popleft())

    def poll(self) -> list[KVLoadDone]:
        self._prune()
        return self._report(self._finished, self._lock)

    def finish(self, request_id: str, ok: bool) -> None:
        item = self.loads.pop(request_id, None)
        if item is None:
            return
        if item.event is None:                  # failed before anything was enqueued
            return
        if ok:
            if not item.done.is_set() and item.event.query():
                self._complete(item)
            if item.error is not None:
                raise RuntimeError(f"KV receive of {request_id} failed on rank {self.tp_rank} "
                                   f"only: {item.error}")
            if self.cuda:
                torch.cuda.current_stream(self.kv.device).wait_event(item.event)
            return
        # cancel: the blocks are freed after this returns, so the scatter must be over. It ends
        # once the producer's send arrives; if it does not come, the pair is torn down.
        item.cancel = True
        deadline = time.monotonic() + self.cancel_grace_s
        while not item.event.query():
            if time.monotonic() > deadline:
                self._abort_pair(item.load.worker, f"pair with {item.load.worker} aborted: a "
                                                   "transfer did not arrive")
                break
            time.sleep(0.001)
        item.event.synchronize()

    def drop_peer(self, worker: str) -> None:
        if worker in self.to_consumer or worker in self.from_producer:
            self._abort_pair(worker, f"pair with {worker} dropped: that worker is gone")

    def _abort_pair(self, other: str, why: str) -> None:
        """Break the pair with `other` and tear its communicator down, once: NCCL work queued on
        it ends (there is no other way to end a hung send or receive). Any thread may call it;
        the pair's send buffers go after the abort."""
        with self._lock:
            self._break(other, why)
            if other in self._aborted:
                return
            self._aborted.add(other)
        pg = self._group(other)
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - best effort: the communicator may already be gone
                pass
        with self._lock:
            self._sending.pop(other, None)

    def close(self) -> None:
        self._closed.set()
        if self._watcher is not None:
            self._watcher.join(5.0)
        self._prune()
        # work still queued is never waited for: its groups are aborted
        self._close_groups(abort=bool(self._inflight or any(self._sending.values())))
        self._inflight.clear()
        self._sending.clear()
