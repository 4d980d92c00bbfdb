"""Where does a P/D KV pull's time go? Two GPUs, two processes, the real IPC path.

A producer process allocates a KV pool on GPU 0 (qwen2.5-1.5b's layout by default) and exports
it (CUDA IPC, as the prefill worker does); this process (the decode side) maps it on GPU 1 the
way SharedPullConnector does and measures, per request size (median of --reps):

  host_checked_us  wall time of one pull_kv_blocks call (argument checks + launch)
  host_us          wall time of one launch of a KVPull built once (what the connector does)
  host_idle_us     host_us after 20 ms of sleep (a cold host thread, as between one-at-a-time requests)
  window_ms        start event, then the launch, then end event: what `bench pd` reports (the
                   GPU idles between the start event and the kernel while the host launches)
  window_idle_ms   window_ms after 20 ms of an idle GPU (as in `bench pd`: one request at a time)
  kernel_idle_ms   kernel_ms after 20 ms of an idle GPU
  kernel_ms        the same with the stream held busy (torch.cuda._sleep) until the launch is
                   queued: the kernel alone
  kernel_local_ms  the kernel alone reading a pool this process allocated on GPU 0 (no IPC)
  copy_ipc_ms      one contiguous torch copy_ of the same byte count out of the IPC mapping
  copy_local_ms    the same out of the local GPU 0 tensor
and checks that the pulled blocks equal the producer's. JSON to --output.
"""
from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp


def _producer(shape, dtype, q_out, q_in):
    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda:0").manual_seed(0)
    pool = torch.randint(-30000, 30000, shape, dtype=torch.int16, device="cuda:0",
                         generator=g).view(dtype)
    torch.cuda.synchronize()
    from torch.multiprocessing.reductions import reduce_tensor
    q_out.put(pickle.dumps(reduce_tensor(pool)))
    q_in.get()          # keep the pool alive until the consumer is done


def add_layout_args(p: argparse.ArgumentParser, num_blocks: int) -> None:
    """The KV pool's layout (qwen2.5-1.5b's by default); scripts/profile_launch.py uses it too."""
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=num_blocks)


def _median_ms(fn, reps):
    out = []
    for _ in range(reps):
        out.append(fn())
    return statistics.median(out)


def main(argv=None) -> int:
    from pdserve.disagg.connectors.shared_pull import open_ipc_here
    from pdserve.kernels import kv_pull

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layout_args(p, num_blocks=2048)
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--tile-bytes", type=int, nargs="+", default=[16384])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--output", default=None)
    a = p.parse_args(argv)

    dtype = torch.bfloat16
    shape = (a.layers, 2, a.num_blocks, a.block_size, a.kv_heads, a.head_dim)
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_producer, args=(shape, dtype, q_out, q_in), daemon=True)
    proc.start()
    spec = pickle.loads(q_out.get(timeout=300))
    dev = torch.device("cuda:1")
    torch.cuda.set_device(dev)
    ipc = open_ipc_here(*spec, dev)               # as the connector's "peer" path does
    with torch.cuda.device(0):
        local = torch.randn(shape, device="cuda:0").to(dtype)
    dst = torch.zeros(shape, dtype=dtype, device=dev)
    stream = torch.cuda.Stream(dev)
    results = []
    gen = torch.Generator().manual_seed(1)
    for tokens in a.tokens:
        n = tokens // a.block_size
        src_ids = torch.randperm(a.num_blocks, generator=gen)[:n].to(dev)
        dst_ids = torch.randperm(a.num_blocks, generator=gen)[:n].to(dev)
        nbytes = a.layers * 2 * n * a.block_size * a.kv_heads * a.head_dim * 2
        for tile in a.tile_bytes:
            kv_pull.TILE_BYTES = tile
            row = {"tokens": tokens, "blocks": n, "bytes": nbytes, "tile_bytes": tile}

            prepared = {id(ipc): kv_pull.KVPull(ipc, dst), id(local): kv_pull.KVPull(local, dst)}

            def pull(src):
                prepared[id(src)](src_ids, dst_ids)

            with torch.cuda.device(dev), torch.cuda.stream(stream):
                dst.zero_()
                pull(ipc)
                stream.synchronize()
                got = dst[:, :, dst_ids].view(torch.int16).cpu()
                want = ipc[:, :, src_ids].view(torch.int16).cpu()
                row["exact"] = bool(torch.equal(got, want))

                def host(fn=pull, idle: float = 0.0):
                    stream.synchronize()
                    time.sleep(idle)
                    t0 = time.perf_counter()
                    fn(ipc)
                    t = time.perf_counter() - t0
                    stream.synchronize()
                    return t * 1e6

                def timed(src, gate: bool, fn=None, idle: float = 0.0):
                    stream.synchronize()
                    time.sleep(idle)
                    if gate:
                        torch.cuda._sleep(2_000_000)   # ~1 ms of spinning: launch lands first
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    e0.record(stream)
                    (fn or pull)(src)
                    e1.record(stream)
                    e1.synchronize()
                    return e0.elapsed_time(e1)

                flat_dst = dst.view(-1)[: nbytes // 2]
                row["host_checked_us"] = _median_ms(lambda: host(
                    lambda s: kv_pull.pull_kv_blocks(s, dst, src_ids, dst_ids)), a.reps)
                row["host_us"] = _median_ms(host, a.reps)
                row["host_idle_us"] = _median_ms(lambda: host(idle=0.02), a.reps)
                row["kernel_idle_ms"] = _median_ms(lambda: timed(ipc, True, idle=0.02), a.reps)
                row["window_ms"] = _median_ms(lambda: timed(ipc, False), a.reps)
                row["window_idle_ms"] = _median_ms(lambda: timed(ipc, False, idle=0.02), a.reps)
                row["kernel_ms"] = _median_ms(lambda: timed(ipc, True), a.reps)
                row["kernel_local_ms"] = _median_ms(lambda: timed(local, True), a.reps)
                row["copy_ipc_ms"] = _median_ms(lambda: timed(
                    ipc, True, lambda s: flat_dst.copy_(s.view(-1)[: nbytes // 2])), a.reps)
                row["copy_local_ms"] = _median_ms(lambda: timed(
                    local, True, lambda s: flat_dst.copy_(s.view(-1)[: nbytes // 2])), a.reps)
            for k in ("window_ms", "window_idle_ms", "kernel_ms", "kernel_idle_ms", "kernel_local_ms", "copy_ipc_ms", "copy_local_ms"):
                row[k.replace("_ms", "_gbps")] = nbytes / (row[k] * 1e-3) / 1e9
            results.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                              for k, v in row.items()}), flush=True)
    q_in.put(None)
    proc.join(timeout=30)
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"shape": shape, "dtype": str(dtype), "rows": results,
                       "device": torch.cuda.get_device_name(dev)}, f, indent=1)
    return 0 if all(r["exact"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
