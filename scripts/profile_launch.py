"""Why is a KV pull's launch slow after the host idles? One GPU, host-side launch costs.

`bench pd` hands requests off one at a time, so the decode worker's thread has idled ~20 ms
when a pull is launched; scripts/profile_pull.py measured that launch at ~200 us of host time
against 14 us back to back. This script separates the candidates on one GPU (the pull reads a
pool of the same GPU: the launch path is the same as a peer pull's):

  launch kinds  kvpull  KVPull's direct compiled-kernel launch (what the connector does)
                graph   the same pull captured once in a CUDA graph, replayed
                pullgraphs    PullGraphs.launch (the connector's path), n blocks
                pullgraphs+1  the same at n + 1 blocks (the next graph width: idle programs)
                torch   a tiny torch op (x.add_(1)): the framework's own launch path
  idle kinds    hot     back to back (after a synchronize)
                sleep   after time.sleep(20 ms)
                spin    after a 20 ms Python busy loop (the thread never leaves the CPU)
                busy    after sleeping 20 ms while the GPU runs a 30 ms spin kernel (a loaded
                        decode GPU; host_us only: the window would include the spin)

For each pair: host_us (wall time of the launch call, median of --reps) and window_ms (start
event, launch, end event on the GPU: what `bench pd` counts). Checks that the graph's pull and
the direct pull copy the same bytes. JSON to --output.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main(argv=None) -> int:
    from pdserve.kernels.kv_pull import KVPull, PullGraphs
    from profile_pull import add_layout_args   # (this script's folder is on sys.path)

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layout_args(p, num_blocks=1024)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--idle-ms", type=float, default=20.0)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--output", default=None)
    a = p.parse_args(argv)

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    shape = (a.layers, 2, a.num_blocks, a.block_size, a.kv_heads, a.head_dim)
    src = torch.randn(shape, device=dev).to(torch.bfloat16)
    dst = torch.zeros_like(src)
    n = a.tokens // a.block_size
    g = torch.Generator().manual_seed(0)
    src_ids = torch.randperm(a.num_blocks, generator=g)[:n].to(dev)
    dst_ids = torch.randperm(a.num_blocks, generator=g)[:n].to(dev)
    stream = torch.cuda.Stream(dev)
    pull = KVPull(src, dst)
    small = torch.zeros(16, device=dev)

    with torch.cuda.stream(stream):
        pull(src_ids, dst_ids)          # compile + cache the launcher
        stream.synchronize()
        want = dst.clone()
        dst.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(dev)):
            pull(src_ids, dst_ids)
        torch.cuda.synchronize()
        graph.replay()
        stream.synchronize()
        exact = bool(torch.equal(dst.view(torch.int16), want.view(torch.int16)))

        # PullGraphs as the connector uses it (ids staged before the window, one replay in
        # it), at n blocks (a graph exactly n wide) and n + 1 (the next width: idle programs)
        staged = {}
        for extra in (0, 1):
            pg = PullGraphs([pull], max_blocks=4096)
            ids = torch.randperm(a.num_blocks, generator=g)[:2 * (n + extra)].tolist()
            pg.stage(ids[: n + extra], ids[n + extra:])
            staged[extra] = pg
        launches = {"kvpull": lambda: pull(src_ids, dst_ids), "graph": graph.replay,
                    "pullgraphs": staged[0].launch, "pullgraphs+1": staged[1].launch,
                    "torch": lambda: small.add_(1)}
        idles = {"hot": lambda: None, "sleep": lambda: time.sleep(a.idle_ms / 1e3),
                 "spin": lambda: _spin(a.idle_ms / 1e3),
                 "busy": lambda: (torch.cuda._sleep(int(a.idle_ms * 3e6)),
                                  time.sleep(a.idle_ms / 1e3))}
        rows = []
        for lname, launch in launches.items():
            for iname, idle in idles.items():
                host, window = [], []
                for _ in range(a.reps):
                    stream.synchronize()
                    idle()
                    t0 = time.perf_counter()
                    launch()
                    host.append((time.perf_counter() - t0) * 1e6)
                    stream.synchronize()
                    if iname == "busy":
                        continue
                    idle()
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    e0.record(stream)
                    launch()
                    e1.record(stream)
                    e1.synchronize()
                    window.append(e0.elapsed_time(e1))
                row = {"launch": lname, "idle": iname,
                       "host_us": round(statistics.median(host), 1),
                       "host_us_p90": round(sorted(host)[int(0.9 * len(host))], 1),
                       "window_ms": round(statistics.median(window), 4) if window else None}
                if lname != "torch" and window:
                    blocks = n + (lname == "pullgraphs+1")
                    row["window_gbps"] = round(pull.bytes_per_block * blocks / row["window_ms"]
                                               / 1e6, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = {"exact_graph_vs_direct": exact, "tokens": a.tokens, "idle_ms": a.idle_ms,
           "bytes": pull.bytes_per_block * n, "device": torch.cuda.get_device_name(dev),
           "rows": rows}
    print("graph replay copies the same bytes:", exact)
    if a.output:
        with open(a.output, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
