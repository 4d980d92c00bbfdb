"""Timing marks around copies: CUDA events on a stream, or host time stamps on CPU (where work
is done when its call returns), with one interface (query / synchronize / elapsed_time)."""
from __future__ import annotations

import time

import torch


class HostMark:
    """A CUDA event's stand-in on CPU."""

    def __init__(self):
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "HostMark") -> float:
        return (end.t - self.t) * 1e3


def timed_event(stream: "torch.cuda.Stream | None"):
    """A timing event recorded on stream (CUDA), or a host time stamp (stream None: CPU)."""
    if stream is None:
        return HostMark()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(stream)
    return ev
