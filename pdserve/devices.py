"""Which GPU (and stream) is current. Triton launches on the current device, so code that may
share a process with engines on other GPUs (P/D in one process, a consumer reading another GPU's
pool) makes its own device current around GPU work."""
from __future__ import annotations

import contextlib

import torch


def on_device(device: torch.device, stream=None) -> contextlib.ExitStack:
    """A context making `device` (and `stream`, if given) current for CUDA work; nothing on CPU."""
    ctx = contextlib.ExitStack()
    if device.type == "cuda":
        ctx.enter_context(torch.cuda.device(device))
        if stream is not None:
            ctx.enter_context(torch.cuda.stream(stream))
    return ctx
