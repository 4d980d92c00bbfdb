"""The life of a consumer's load, the same for every transport:

    started ──> done ──> reported ──> verdict
    start()     complete()  report()     verdict()
    (transport  (any thread; (poll: each   (finish: the driver's ok / not ok; the
     begins the  once; its    done load     transport then exposes or cancels the data)
     copy)       duration)    once)

A load without destination blocks is a two-sided receive-and-discard: it is started and
completed like any other (it keeps a pair in step) but belongs to no request, so it is neither
reported nor judged. A verdict may come before the load is done (a timeout, an abort): the
transport's finish() then cancels it; the load may still complete later, and is reported then
(the engine ignores reports of loads it already gave up).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ...protocol import KVLoad, KVLoadDone


@dataclass(eq=False)
class Load:
    """One load in flight. The tracker sets `done`, `end` and `reported`; the transport fills the
    rest."""
    load: KVLoad
    start: float                   # time.perf_counter() when it was started
    end: float = 0.0
    nbytes: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    cancel: bool = False           # the verdict was "not ok" before the copy ended
    error: str | None = None
    event: object = None           # CUDA: recorded on the transfer stream after the last copy
    # CUDA: (start, end) event pairs around the copies, each pair on one stream; their sum is
    # the transfer's GPU time (a relay has one span per device)
    spans: list = field(default_factory=list)
    keep: list = field(default_factory=list)  # buffers in use by queued copies
    status: object = None          # two-sided: the producer's status words (1: blocks held)
    reported: bool = False

    @property
    def owned(self) -> bool:
        """A request's load (not a receive-and-discard)."""
        return bool(self.load.dst_block_ids)


class LoadTracker:
    """A connector's loads, from start to verdict. `loads` holds the loads awaiting a verdict,
    by request id."""

    def __init__(self):
        self.loads: dict[str, Load] = {}
        self._finished: deque[Load] = deque()
        self._lock = threading.Lock()

    def start(self, load: KVLoad) -> Load:
        item = Load(load, time.perf_counter())
        if item.owned:
            self.loads[load.request_id] = item
        return item

    def complete(self, item: Load, error: str | None = None) -> bool:
        """The copy ended (error: why it failed, unless an earlier error was recorded): set its
        duration (the GPU time of its spans, else the wall time since it started), let its
        buffers go, wake who waits for it and queue it for report(). Any thread; only the
        first call counts (returns False after)."""
        with self._lock:
            if item.done.is_set():
                return False
            if item.error is None:
                item.error = error
            if item.spans:
                item.end = item.start + sum(a.elapsed_time(b) for a, b in item.spans) / 1e3
            else:
                item.end = time.perf_counter()
            item.keep.clear()
            item.done.set()
            if item.owned:
                self._finished.append(item)
        return True

    def report(self) -> list[KVLoadDone]:
        """Loads completed since the last call, each reported once."""
        out = []
        with self._lock:
            while self._finished:
                item = self._finished.popleft()
                if item.reported:
                    continue
                item.reported = True
                out.append(KVLoadDone(item.load.request_id, item.error is None, item.nbytes,
                                      item.end - item.start, item.error))
        return out

    def verdict(self, request_id: str) -> Load | None:
        """The load the driver judged (None: not one of ours, or judged already)."""
        return self.loads.pop(request_id, None)

    def pending(self) -> list[Load]:
        """Loads awaiting a verdict that are not done yet."""
        return [item for item in self.loads.values() if not item.done.is_set()]

    def clear(self) -> None:
        self.loads.clear()


def expect_agreement(item: Load, tp_rank: int, what: str) -> None:
    """The driver said ok: this rank's own copy must have succeeded too (call once it is done).
    Ranks that disagree mean this rank's KV is wrong: stop here rather than compute on it."""
    if item.error is not None:
        raise RuntimeError(f"KV {what} of {item.load.request_id} failed on rank {tp_rank} "
                           f"only: {item.error}")
