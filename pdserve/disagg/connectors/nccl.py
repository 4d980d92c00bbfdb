"""The "nccl" connector: two-sided pairs over NCCL point-to-point, on streams (GPUs; on CPU the
same code runs over gloo, blocking, so CI exercises it)."""
from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from ...devices import on_device
from ...protocol import KVLoad, KVLoadDone, KVPair, KVSend
from .base import register_connector
from .load_tracker import Load, expect_agreement
from .pair import PairConnector, first_line
from .timing import timed_event


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
class NcclConnector(PairConnector):
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
        self._inflight: deque[Load] = deque()     # loads whose GPU work may still run
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
                                                f"{first_line(e)}")
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
        item = self.tracker.start(load)
        discard = not item.owned
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
            t0 = timed_event(self._stream)
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
            item.event = timed_event(self._stream)
            item.spans.append((t0, item.event))
        if discard:
            item.cancel = True
        self._inflight.append(item)
        if sync and not discard:
            item.event.synchronize()
            self._prune()

    def _complete(self, item: Load) -> None:
        """Its GPU work is over (or it failed before any): read the producer's status words."""
        held = item.status is None or bool((item.status == 1).all())
        self.tracker.complete(item, None if held else "the producer no longer held the blocks")

    def _prune(self) -> None:
        """Retire GPU work that has finished, in order: sends (their buffers go) and loads."""
        self._retire_sends()
        while self._inflight and self._inflight[0].event.query():
            self._complete(self._inflight.popleft())

    def poll(self) -> list[KVLoadDone]:
        self._prune()
        return self.tracker.report()

    def finish(self, request_id: str, ok: bool) -> None:
        item = self.tracker.verdict(request_id)
        if item is None:
            return
        if item.event is None:                  # failed before anything was enqueued
            return
        if ok:
            if not item.done.is_set() and item.event.query():
                self._complete(item)
            expect_agreement(item, self.tp_rank, "receive")
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
