"""The "torch-dist" connector: two-sided pairs over gloo between CPU processes, each pair's
sends and receives on threads of their own."""
from __future__ import annotations

import datetime
import threading
import time
from collections import deque

import torch

from ...protocol import KVLoad, KVLoadDone, KVSend
from .base import register_connector
from .load_tracker import Load, expect_agreement
from .pair import PairConnector, first_line


@register_connector
class TorchDistConnector(PairConnector):
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
            self._break(pair.consumer, f"pair with {pair.consumer} broke: {first_line(e)}")

    # ---- consumer ----------------------------------------------------------------------------
    def start_load(self, load: KVLoad, sync: bool) -> None:
        if load.worker not in self.from_producer:
            raise ValueError(f"no KV peer {load.worker!r} (ConnectKV first)")
        item = self.tracker.start(load)
        if not item.owned:
            item.cancel = True                  # receive and discard (keeps the pair in step)
        self._push(("recv", load.worker), self._recv_one, item)
        if sync and item.owned:
            item.done.wait()

    def _recv_one(self, item: Load) -> None:
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
            with self._lock:
                if not item.cancel and item.error is None:
                    dst = torch.tensor(load.dst_block_ids, dtype=torch.long)
                    for hc, buf in parts:
                        self.kv[:, :, :, :, hc.dst_heads].index_copy_(2, dst, buf)
        except Exception as e:  # noqa: BLE001 - a broken pair fails its loads; they recompute
            item.error = first_line(e)
            self._break(load.worker, f"pair with {load.worker} broke: {item.error}")
        self.tracker.complete(item)

    def poll(self) -> list[KVLoadDone]:
        return self.tracker.report()

    def finish(self, request_id: str, ok: bool) -> None:
        item = self.tracker.verdict(request_id)
        if item is None:
            return
        if ok:
            item.done.wait()  # the driver's receive is done; this rank's may still be running
            expect_agreement(item, self.tp_rank, "receive")
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
