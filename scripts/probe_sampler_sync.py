"""Which part of SamplingBatch.build waits for the device (GPU only). Each device op that build
uses (one at a time), then build with each sampling kind alone and all together, runs (1)
behind a long queued kernel, reporting whether it returned while that still ran, and (2) under
torch.cuda.set_sync_debug_mode("error"), reporting the first synchronizing call's traceback
tail. `index_put_scalar` (`mask[idx] = True`) is the known waiting op: a control that the probe
sees one. JSON to --output.

    python scripts/probe_sampler_sync.py --output /tmp/sampler-sync.json
"""
from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from pdserve.layers.sampler import SamplingBatch
from pdserve.sampling_params import SamplingParams

V, B = 1000, 4
KINDS = {
    "temperature": dict(temperature=0.8),
    "top_k_top_p": dict(temperature=0.8, top_k=50, top_p=0.9),
    "repetition": dict(temperature=0.8, repetition_penalty=1.2),
    "frequency": dict(temperature=0.8, frequency_penalty=0.5),
    "min_tokens": dict(temperature=0.8, min_tokens=3, stop_token_ids=[7]),
    "logit_bias": dict(temperature=0.8, logit_bias={5: 2.0}),
    "all": dict(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.2,
                frequency_penalty=0.5, min_tokens=3, stop_token_ids=[7], logit_bias={5: 2.0}),
}


def build(kw):
    params = [SamplingParams(**kw) for _ in range(B)]
    return SamplingBatch.build(params, [[1, 2, 3]] * B, [[4]] * B, [None] * B, V, "cuda",
                               eos_token_ids=[2])


def primitives():
    """The device ops build uses, one at a time (idx: a pinned upload of 16 flat indices)."""
    n = B * V
    idx_host = torch.arange(16, dtype=torch.int64).pin_memory()

    def put_scalar():
        m = torch.zeros(n, dtype=torch.bool, device="cuda")
        m[idx_host.to("cuda", non_blocking=True)] = True

    def index_fill():
        m = torch.zeros(n, dtype=torch.bool, device="cuda")
        m.index_fill_(0, idx_host.to("cuda", non_blocking=True), True)

    def index_add():
        c = torch.zeros(n, dtype=torch.float32, device="cuda")
        i = idx_host.to("cuda", non_blocking=True)
        c.index_add_(0, i, torch.ones(i.shape, dtype=torch.float32, device="cuda"))

    def pinned_tensor():
        torch.tensor([[0.5] * B] * 6, dtype=torch.float32, pin_memory=True).to(
            "cuda", non_blocking=True)

    def pin_memory():
        torch.arange(16, dtype=torch.int64).pin_memory().to("cuda", non_blocking=True)

    return {"index_put_scalar": put_scalar, "index_fill_": index_fill, "index_add_": index_add,
            "tensor_pin_memory": pinned_tensor, "pin_memory": pin_memory}


def probe(fn):
    fn()                       # (first use: kernels loaded, pinned blocks cached)
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(300_000_000)
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    busy = not stream.query()
    torch.cuda.synchronize()
    sync_error = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as e:
        sync_error = str(e)[:200] + " | " + " <- ".join(
            f"{f.name}:{f.lineno}" for f in reversed(traceback.extract_tb(e.__traceback__)[-4:]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return {"returned_while_busy": busy, "ms": round(dt * 1e3, 3), "sync_error": sync_error}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output", required=True)
    a = p.parse_args()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "kinds": {}}
    for name, fn in primitives().items():
        out.setdefault("primitives", {})[name] = r = probe(fn)
        print(name, r, flush=True)
    for name, kw in KINDS.items():
        out["kinds"][name] = r = probe(lambda: build(kw))
        print(name, r, flush=True)
    with open(a.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
