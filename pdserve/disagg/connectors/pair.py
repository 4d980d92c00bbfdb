"""What the two-sided connectors ("torch-dist", "nccl") share: a process group per
producer/consumer pair of workers, formed at a store the router hosts; which head ranges go from
which producer rank to which consumer rank; broken pairs; closing the groups."""
from __future__ import annotations

import datetime
import threading

import torch

from ...protocol import KVPair
from .base import KVConnector
from .head_plan import HeadCopy, plan_head_copies
from .load_tracker import Load, LoadTracker


def first_line(e: BaseException) -> str:
    """An exception as one line (gloo's messages run on with advice)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class PairConnector(KVConnector):
    """Two-sided transfers over torch.distributed point-to-point. Each producer/consumer pair of
    workers forms its own process group (both workers' ranks, producer first), created from a
    TCPStore the router hosts, so a worker's TP group and other pairs are untouched.

        pair group ranks:  0 .. producer_tp-1             the producer's TP ranks
                           producer_tp .. +consumer_tp-1  the consumer's TP ranks

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
        self.tracker = LoadTracker()
        self._lock = threading.Lock()           # the transports' own state (see each)

    @property
    def loads(self) -> dict[str, Load]:
        """Loads awaiting the driver's verdict, by request id."""
        return self.tracker.loads

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

    def _incoming(self, pair: KVPair, num_blocks: int) -> "list[tuple[HeadCopy, tuple]]":
        """(head copy, receive buffer shape) for each part this consumer rank receives."""
        shape = list(self.kv.shape)
        shape[2] = num_blocks
        out = []
        for hc in plan_head_copies(pair.num_kv_heads, pair.producer_tp, pair.consumer_tp,
                                   self.tp_rank):
            shape[4] = hc.dst_heads.stop - hc.dst_heads.start
            out.append((hc, tuple(shape)))
        return out

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
