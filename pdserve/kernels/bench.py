"""GPU micro-benchmarks for the Triton kernels (not tests: they need CUDA and report numbers).

    python -m pdserve.kernels.bench         # decode table vs copy bandwidth, prefill TFLOP/s
    python -m pdserve.kernels.bench --tune  # also sweep DECODE_CONFIG / PREFILL_CONFIG variants
    python -m pdserve.kernels.bench --skinny --output f.json
                                            # skinny_linear configs vs cuBLAS at decode shapes
    python -m pdserve.kernels.bench --extend --output f.json
                                            # a prompt chunk over cached context (a prefix hit's
                                            # step) as a mixed graph runs it, per prefill config
    python -m pdserve.kernels.bench --splits --output f.json [--old FILE]
                                            # decode under a captured 32k bound: split minimums
                                            # (and an older paged_attention.py, FILE) compared

Target (issue): decode attention reads K/V at >= 80% of the device-to-device copy bandwidth once
the KV read is >= 256 MB.
"""
from __future__ import annotations

import argparse
import statistics

import torch


def _median_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _captured(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph of fn(), run once first on a side stream (compiles and allocates outside
    the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 50, warmup: int = 5,
                   device: str = "cuda") -> float:
    """GB/s of a device-to-device copy of nbytes, counting bytes read + bytes written."""
    from ..bench.common import copy_bandwidth as bytes_per_s
    return bytes_per_s(device, nbytes, iters) / 1e9


def bench_decode(batch: int, context: int, H: int, Hkv: int, D: int, BS: int,
                 dtype: torch.dtype = torch.bfloat16, *, iters: int = 100, warmup: int = 20,
                 num_kv_splits: int | None = None, decode_config: dict | None = None,
                 cuda_graph: bool = True, copy_bytes: int = 1 << 30, seed: int = 0,
                 bound: int | None = None, impl=None) -> dict:
    """Time one decode step of paged attention (batch sequences, each `context` tokens long with
    its last token as the query) and compare its K/V read rate with the device copy bandwidth.

    Returns time_us (median of `iters` CUDA-event timed eager calls after `warmup`), graph_time_us
    (same, replaying a CUDA graph of one call: no launch overhead; None if capture failed, with the
    error in graph_error), kv_bytes (K and V bytes the step must read), kv_gbps (kv_bytes / the
    better of the two times), copy_gbps (bytes read + written / time of a copy_bytes d2d copy,
    measured in this call) and frac_of_copy = kv_gbps / copy_gbps. bound: the max_seq_len passed
    (default `context`; a CUDA graph passes its captured bound); impl: another module with the
    same _paged_attention (an older kernel, for an A/B in one process); copy_bytes 0: no copy."""
    from . import paged_attention as pa
    impl = impl or pa

    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = -(-context // BS)
    nb = batch * blocks_per_seq
    kv = torch.randn(2, nb, BS, Hkv, D, dtype=dtype, device=dev)
    block_tables = torch.randperm(nb, generator=g).view(batch, blocks_per_seq).to(
        dev, torch.int32)
    q = torch.randn(batch, H, D, dtype=dtype, device=dev)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    scale = D ** -0.5

    def step():
        impl._paged_attention(q, kv[0], kv[1], block_tables, seq_lens, qsl, scale,
                              max_query_len=1, max_seq_len=bound or context, out=out,
                              num_kv_splits=num_kv_splits, decode_config=decode_config)

    ms = _median_ms(step, iters, warmup)
    graph_ms, graph_error = None, None
    if cuda_graph:
        try:
            graph_ms = _median_ms(_captured(step).replay, iters, warmup)
        except Exception as e:  # report, don't hide the eager number
            graph_error = f"{type(e).__name__}: {e}"
    elem = torch.tensor([], dtype=dtype).element_size()
    kv_bytes = 2 * batch * context * Hkv * D * elem
    best_ms = min(ms, graph_ms) if graph_ms is not None else ms
    kv_gbps = kv_bytes / (best_ms * 1e-3) / 1e9
    copy_gbps = copy_bandwidth(copy_bytes) if copy_bytes else float("nan")
    splits = num_kv_splits or pa.default_num_kv_splits(batch * Hkv, bound or context,
                                                       pa._num_sms(dev))
    return dict(batch=batch, context=context, H=H, Hkv=Hkv, D=D, BS=BS, dtype=str(dtype),
                num_kv_splits=splits, decode_config={**pa.DECODE_CONFIG, **(decode_config or {})},
                time_us=ms * 1e3, graph_time_us=None if graph_ms is None else graph_ms * 1e3,
                graph_error=graph_error, kv_bytes=kv_bytes, kv_gbps=kv_gbps,
                copy_gbps=copy_gbps, frac_of_copy=kv_gbps / copy_gbps)


def bench_prefill(num_seqs: int, chunk: int, context: int, H: int, Hkv: int, D: int, BS: int,
                  dtype: torch.dtype = torch.bfloat16, *, num_decodes: int = 0,
                  decode_context: int = 0, iters: int = 30, warmup: int = 5,
                  prefill_config: dict | None = None, seed: int = 0) -> dict:
    """Time one mixed step: num_seqs prefill chunks of `chunk` new tokens over `context` cached
    tokens each (plus num_decodes decode rows over decode_context), eager, CUDA-event median.
    Reports time_us and the attention FLOP rate (4 * H * D per (query, visible key) pair)."""
    from . import paged_attention as pa

    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(seed)
    lens = [decode_context + 1] * num_decodes + [context + chunk] * num_seqs
    q_lens = [1] * num_decodes + [chunk] * num_seqs
    blocks = [-(-n // BS) for n in lens]
    nb = sum(blocks)
    kv = torch.randn(2, nb, BS, Hkv, D, dtype=dtype, device=dev)
    perm = torch.randperm(nb, generator=g)
    bt = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        bt[i, :n] = perm[used:used + n].int()
        used += n
    T = sum(q_lens)
    q = torch.randn(T, H, D, dtype=dtype, device=dev)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                       device=dev)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    bt = bt.to(dev)
    out = torch.empty_like(q)

    def step():
        pa._paged_attention(q, kv[0], kv[1], bt, seq_lens, qsl, D ** -0.5,
                            max_query_len=max(q_lens), max_seq_len=max(lens), out=out,
                            prefill_config=prefill_config)

    ms = _median_ms(step, iters, warmup)
    pairs = num_seqs * (chunk * context + chunk * (chunk + 1) // 2) + num_decodes * (
        decode_context + 1)
    flops = 4 * H * D * pairs
    return dict(num_seqs=num_seqs, chunk=chunk, context=context, num_decodes=num_decodes,
                H=H, Hkv=Hkv, D=D, BS=BS, dtype=str(dtype), time_us=ms * 1e3,
                tflops=flops / (ms * 1e-3) / 1e12,
                prefill_config={**pa.prefill_config_for(max(q_lens), dtype),
                                **(prefill_config or {})})


# (BLOCK_N, BLOCK_K, num_warps, num_stages, split_k) variants the --skinny sweep times, beside
# the configuration the model would use ("auto": tuned_config, else default_config)
SKINNY_CANDIDATES = [(bn, bk, 4, 4, sp) for bn in (16, 32, 64) for bk in (128, 256)
                     for sp in (1, 2, 4, 8)]


def skinny_shapes(preset: str) -> list[tuple[str, int, int, bool, bool]]:
    """(name, N, K, bias) of one decoder layer's projections and the LM head."""
    from ..models.config import ModelConfig
    from ..models.presets import PRESETS
    c = ModelConfig.from_hf(PRESETS[preset])
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return [("qkv", q + 2 * kv, c.hidden_size, c.attention_bias),
            ("o", c.hidden_size, q, c.o_proj_bias),
            ("gate_up", 2 * c.intermediate_size, c.hidden_size, False),
            ("down", c.hidden_size, c.intermediate_size, False),
            ("lm_head", c.vocab_size, c.hidden_size, False)]


def _graph_us(fns, replays: int) -> float:
    """Median GPU time of one fn, timed as a CUDA graph of all of them in turn (no launch gaps
    from the host; every fn reads its own weight, so weights come from HBM as in a model)."""
    def all_fns():
        for fn in fns:
            fn()
    graph = _captured(all_fns)
    ms = _median_ms(graph.replay, replays, 3)
    del graph
    return ms * 1e3 / len(fns)


def bench_skinny(presets=("qwen2.5-1.5b", "qwen2.5-7b"), ms=(1, 4, 8, 16),
                 candidates=None, replays: int = 20, stream_bytes: int = 256 << 20) -> dict:
    """Every candidate config of kernels/skinny_gemm.py and cuBLAS on each preset's layer shapes
    at each row count.
    Each row: us per product, weight GB/s, and the max error against an fp32 reference relative
    to the reference's largest magnitude (None where a candidate failed, with the error)."""
    from .skinny_gemm import skinny_linear
    dev, dtype = torch.device("cuda"), torch.bfloat16
    candidates = candidates or SKINNY_CANDIDATES
    rows = []
    for preset in presets:
        for name, n, k, has_bias in skinny_shapes(preset):
            wbytes = n * k * 2
            copies = max(2, min(28, -(-stream_bytes // wbytes)))
            ws = [torch.randn(n, k, device=dev, dtype=dtype) * k ** -0.5 for _ in range(copies)]
            bias = torch.randn(n, device=dev, dtype=dtype) if has_bias else None
            for m in ms:
                x = torch.randn(m, k, device=dev, dtype=dtype)
                ref = x.float() @ ws[0].float().T + (bias.float() if has_bias else 0)
                scale = ref.abs().max().item()
                outs = [torch.empty(m, n, device=dev, dtype=dtype) for _ in ws]

                def cublas(w, o):
                    if bias is None:
                        return lambda: torch.matmul(x, w.T, out=o)
                    return lambda: torch.addmm(bias, x, w.T, out=o)
                us = _graph_us([cublas(w, o) for w, o in zip(ws, outs)], replays)
                err = (outs[0].float() - ref).abs().max().item() / scale
                base = dict(model=preset, shape=name, N=n, K=k, M=m)
                rows.append(dict(base, impl="cublas", us=us, gbps=wbytes / us / 1e3, err=err))
                for cfg in [None, *candidates]:
                    try:
                        fns = [(lambda w=w, o=o: skinny_linear(x, w, bias, out=o, config=cfg))
                               for w, o in zip(ws, outs)]
                        us = _graph_us(fns, replays)
                        err = (outs[0].float() - ref).abs().max().item() / scale
                        rows.append(dict(base, impl=list(cfg) if cfg else "auto", us=us,
                                         gbps=wbytes / us / 1e3, err=err))
                    except Exception as e:   # report, keep sweeping
                        rows.append(dict(base, impl=list(cfg) if cfg else "auto", us=None,
                                         gbps=None, err=None,
                                         error=f"{type(e).__name__}: {e}"[:300]))
            del ws
            torch.cuda.empty_cache()
    best = {}
    for r in rows:
        if r["us"] is None or r["impl"] == "cublas" or r["err"] > 2 ** -6:
            continue
        key = (r["model"], r["shape"], r["M"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    cub = {(r["model"], r["shape"], r["M"]): r for r in rows if r["impl"] == "cublas"}
    auto = {(r["model"], r["shape"], r["M"]): r for r in rows if r["impl"] == "auto"}
    summary = [dict(model=k[0], shape=k[1], M=k[2], cublas_us=cub[k]["us"], best_us=b["us"],
                    best_impl=b["impl"], speedup=cub[k]["us"] / b["us"], best_gbps=b["gbps"],
                    auto_us=auto.get(k, {}).get("us"))
               for k, b in best.items()]
    return {"rows": rows, "summary": summary, "copy_gbps": copy_bandwidth()}


def load_kernel_file(path: str):
    """An older paged_attention.py as a module beside this one (its relative imports resolve in
    pdserve.kernels)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("pdserve.kernels._paged_attention_other", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bench_splits(old: str | None = None, H: int = 12, Hkv: int = 2, bound: int = 32768,
                 batches=(1, 2, 4, 8, 16, 64), contexts=(600, 1300, 4000, 16000),
                 min_chunks=(128, 256, 512)) -> dict:
    """Decode attention as a CUDA graph captured with max_seq_len = bound (the server's decode
    graphs: the model's max length) for real contexts well below it: graph replay us per
    (batch, context) for the default (splits of sqrt(16 keys) at least), splits of one 64-key
    tile at least (chunk_sqrt=0), fixed per-split minimums (decode_config min_chunk, no sqrt
    term), and the kernel in `old` when given. Qwen2.5-1.5B heads."""
    other = load_kernel_file(old) if old else None
    rows = []
    for batch in batches:
        for ctx in contexts:
            row = {"batch": batch, "context": ctx, "bound": bound, "H": H, "Hkv": Hkv}
            variants = ([("default", None, None), ("one-tile", {"chunk_sqrt": 0}, None)]
                        + [(f"min_chunk={m}", {"min_chunk": m, "chunk_sqrt": 0}, None)
                           for m in min_chunks])
            if other is not None:
                variants.append(("old", None, other))
            for name, cfg, impl in variants:
                r = bench_decode(batch, ctx, H, Hkv, 128, 16, iters=50, warmup=10,
                                 decode_config=cfg, bound=bound, impl=impl, copy_bytes=0)
                if r["graph_time_us"] is None:   # (an eager time carries launch overhead)
                    row[name] = None
                    row[f"{name} eager"] = r["time_us"]
                    row[f"{name} graph_error"] = r["graph_error"]
                else:
                    row[name] = r["graph_time_us"]
                row["num_kv_splits"] = r["num_kv_splits"]
            rows.append(row)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()), flush=True)
    return {"rows": rows, "device": torch.cuda.get_device_name(0), "bound": bound}


def bench_extend(chunk: int, context: int, H: int = 12, Hkv: int = 2, D: int = 128, BS: int = 16,
                 *, max_seqs: int = 256, max_model_len: int = 32768, prefill_config: dict | None = None,
                 iters: int = 50, warmup: int = 10, seed: int = 0) -> dict:
    """One prompt chunk of `chunk` new tokens over `context` cached ones, as the server's mixed
    CUDA graph runs its attention (worker/cuda_graph.py): the step padded to its token bucket T
    (step_shapes.mixed_sizes), min(T, max_seqs) sequences of which all but one are padding
    (q_len 0), max_query_len T, max_seq_len the captured context tier. A prefix-cache hit's step
    (a question after a cached system prompt) and a long prompt's later chunks have this shape.
    Graph replay median us, and the K/V bytes the chunk must read once at least."""
    from ..step_shapes import graph_bucket, mixed_sizes
    from ..worker.cuda_graph import MIXED_TIER_RATIO, context_tiers
    from . import paged_attention as pa
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    T = graph_bucket(chunk, mixed_sizes(8192))
    tier = next(t for t in context_tiers(max_model_len, MIXED_TIER_RATIO) if t >= context + chunk)
    B = min(T, max_seqs)
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = -(-(context + chunk) // BS)
    kv = torch.randn(2, n + 1, BS, Hkv, D, dtype=dtype, device=dev)
    bt = torch.zeros(B, -(-tier // BS), dtype=torch.int32)
    bt[0, :n] = (torch.randperm(n, generator=g) + 1).int()
    bt = bt.to(dev)
    q = torch.randn(T, H, D, dtype=dtype, device=dev)
    qsl = torch.tensor([0] + [chunk] * B, dtype=torch.int32, device=dev)
    seq_lens = torch.tensor([context + chunk] + [0] * (B - 1), dtype=torch.int32, device=dev)
    out = torch.empty_like(q)

    cfg = dict(prefill_config or {})
    only_prefill = bool(cfg.pop("only_prefill_kernel", False))   # (no decode launch at all)

    def step():
        pa._paged_attention(q, kv[0], kv[1], bt, seq_lens, qsl, D ** -0.5, max_query_len=T,
                            max_seq_len=tier, out=out, prefill_config=cfg or None,
                            only_prefill_kernel=only_prefill)

    ref = pa.paged_attention_ref(q[:chunk], kv[0], kv[1], bt[:1], seq_lens[:1], qsl[:2], D ** -0.5)
    graph = _captured(step)   # (its first, uncaptured run fills out)
    err = (out[:chunk].float() - ref.float()).abs().max().item()
    us = _median_ms(graph.replay, iters, warmup) * 1e3
    kv_bytes = 2 * (context + chunk) * Hkv * D * 2
    return dict(chunk=chunk, context=context, T=T, tier=tier, seqs=B, H=H, Hkv=Hkv, D=D,
                graph_us=us, max_abs_err=err, kv_bytes=kv_bytes,
                prefill_config={**pa.prefill_config_for(T, dtype), **cfg},
                only_prefill_kernel=only_prefill)


EXTEND_SHAPES = ((42, 2083), (42, 8000), (128, 2048), (512, 4096), (76, 2048), (2048, 0))
EXTEND_VARIANTS = ({}, {"num_kv_splits": 1}, {"num_kv_splits": 2}, {"num_kv_splits": 4},
                   {"block_n": 64}, {"block_n": 64, "num_kv_splits": 4},
                   {"block_n": 64, "num_stages": 2}, {"num_warps": 8, "block_n": 64},
                   {"block_m": 128, "num_warps": 8}, {"block_m": 128, "num_warps": 8, "block_n": 64},
                   {"only_prefill_kernel": True}, {"num_kv_splits": 8}, {"num_kv_splits": 16},
                   {"num_kv_splits": 16, "block_n": 64}, {"block_m": 32, "num_kv_splits": 8},
                   {"block_m": 32, "num_kv_splits": 16},
                   {"num_kv_splits": 16, "only_prefill_kernel": True})


def bench_extends(shapes=EXTEND_SHAPES, variants=EXTEND_VARIANTS) -> dict:
    """bench_extend for each (chunk, context) shape and PREFILL_CONFIG variant ("only_prefill_kernel":
    the decode launch and its reduce left out, every sequence through the query-tile launch)."""
    rows = []
    for chunk, ctx in shapes:
        for cfg in variants:
            try:
                r = bench_extend(chunk, ctx, prefill_config=cfg or None)
            except Exception as e:   # report, keep sweeping
                r = dict(chunk=chunk, context=ctx, prefill_config=cfg,
                         error=f"{type(e).__name__}: {e}"[:300])
            r["variant"] = cfg
            rows.append(r)
            print(f"chunk {chunk:5d} over {ctx:6d}: "
                  + (f"{r['graph_us']:8.1f} us  err {r['max_abs_err']:.3g}  T {r['T']} tier {r['tier']}"
                     if "graph_us" in r else r["error"]) + f"  {cfg}", flush=True)
    return {"rows": rows, "device": torch.cuda.get_device_name(0)}


def _row(r: dict) -> str:
    gt = "-" if r["graph_time_us"] is None else f"{r['graph_time_us']:9.1f}"
    return (f"{r['batch']:5d} {r['context']:6d} {r['H']:3d}/{r['Hkv']:<2d} {r['D']:4d} "
            f"{r['num_kv_splits']:3d} {r['kv_bytes'] / 1e6:9.1f} {r['time_us']:9.1f} {gt:>9} "
            f"{r['kv_gbps']:8.0f} {r['copy_gbps']:8.0f} {100 * r['frac_of_copy']:6.1f}%")


def _write(path: str, res: dict, argv) -> None:
    """The rows, with the command, the commit (PDSERVE_GIT_COMMIT on the device) and the
    hardware that produced them."""
    import sys

    from ..bench.common import git_info, hardware_info, write_result
    args = sys.argv[1:] if argv is None else list(argv)
    write_result(path, {"command": " ".join(["python -m pdserve.kernels.bench", *args]),
                        **git_info(), "hardware": hardware_info(), **res})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tune", action="store_true", help="sweep tile / stage / warp variants")
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--skinny", action="store_true",
                    help="only the skinny_linear sweep (kernels/skinny_gemm.py) against cuBLAS")
    ap.add_argument("--skinny-m", type=int, nargs="+", default=[1, 4, 8, 16],
                    help="--skinny: the row counts (at most 64)")
    ap.add_argument("--skinny-presets", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-7b"],
                    help="--skinny: the models whose layer shapes are timed")
    ap.add_argument("--splits", action="store_true",
                    help="only decode under a captured 32k bound, per split minimum")
    ap.add_argument("--old", default=None, help="--splits: an older paged_attention.py to compare")
    ap.add_argument("--extend", action="store_true",
                    help="only prompt chunks over cached context as a mixed CUDA graph runs them, "
                         "per PREFILL_CONFIG variant")
    ap.add_argument("--shapes", default=None,
                    help="--extend: CHUNKxCONTEXT,... instead of the default shapes")
    ap.add_argument("--variants", default=None,
                    help="--extend: a JSON list of PREFILL_CONFIG overrides ({} is the default) "
                         "instead of the default variants")
    ap.add_argument("--output", default=None,
                    help="--skinny / --splits / --extend: write the rows as JSON")
    args = ap.parse_args(argv)
    if args.extend:
        import json
        shapes, variants = EXTEND_SHAPES, EXTEND_VARIANTS
        try:
            if args.shapes:
                shapes = tuple(tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))
                if any(len(s) != 2 or s[0] < 1 or s[1] < 0 for s in shapes):
                    raise ValueError(args.shapes)
            if args.variants:
                variants = tuple(json.loads(args.variants))
                if not all(isinstance(v, dict) for v in variants):
                    raise ValueError(args.variants)
        except ValueError as e:
            ap.error(f"--shapes takes CHUNKxCONTEXT,... (chunk >= 1, context >= 0) and --variants "
                     f"a JSON list of objects: {e}")
        res = bench_extends(shapes, variants)
        if args.output:
            _write(args.output, res, argv)
        return
    if args.splits:
        res = bench_splits(args.old)
        if args.output:
            _write(args.output, res, argv)
        return
    if args.skinny:
        if not all(1 <= m <= 64 for m in args.skinny_m):
            ap.error(f"--skinny-m takes row counts from 1 to 64, got {args.skinny_m}")
        from ..models.presets import PRESETS
        unknown = [p for p in args.skinny_presets if p not in PRESETS]
        if unknown:
            ap.error(f"--skinny-presets: unknown {unknown}; known: {sorted(PRESETS)}")
        res = bench_skinny(tuple(args.skinny_presets), tuple(args.skinny_m))
        for r in res["summary"]:
            print(f"{r['model']:>13} {r['shape']:>8} M={r['M']:<3} cublas {r['cublas_us']:7.1f} us  "
                  f"best {r['best_us']:7.1f} us ({r['best_gbps']:5.0f} GB/s) x{r['speedup']:.2f} "
                  f"{r['best_impl']}  auto {r['auto_us'] or float('nan'):7.1f} us", flush=True)
        if args.output:
            _write(args.output, res, argv)
        return
    head = (f"{'batch':>5} {'ctx':>6} {'H/Hkv':>6} {'D':>4} {'spl':>3} {'KV MB':>9} "
            f"{'eager us':>9} {'graph us':>9} {'KV GB/s':>8} {'copyGB/s':>8} {'%copy':>7}")
    print(head)
    for H, Hkv in ((12, 2), (28, 4)):
        for batch, ctx in ((1, 8192), (8, 8192), (64, 1024), (64, 8192), (128, 4096),
                           (256, 2048), (16, 32768)):
            r = bench_decode(batch, ctx, H, Hkv, 128, args.bs)
            print(_row(r), r["graph_error"] or "", flush=True)
    print(f"\n{'seqs':>4} {'chunk':>5} {'ctx':>6} {'dec':>4} {'H/Hkv':>6} {'us':>9} {'TFLOP/s':>8}")
    for H, Hkv in ((12, 2), (28, 4)):
        for seqs, chunk, ctx, dec in ((1, 512, 0, 0), (1, 512, 8192, 0), (4, 512, 4096, 0),
                                      (2, 512, 2048, 64), (1, 4096, 0, 0)):
            r = bench_prefill(seqs, chunk, ctx, H, Hkv, 128, args.bs, num_decodes=dec,
                              decode_context=4096)
            print(f"{seqs:4d} {chunk:5d} {ctx:6d} {dec:4d} {H:3d}/{Hkv:<2d} {r['time_us']:9.1f} "
                  f"{r['tflops']:8.1f}", flush=True)
    if args.tune:
        for cfg in ({"block_n": 32, "num_stages": 3}, {"block_n": 32, "num_stages": 4},
                    {"block_n": 64, "num_stages": 2}, {"block_n": 64, "num_stages": 4},
                    {"block_n": 128, "num_stages": 2, "num_warps": 8},
                    {"block_n": 64, "num_stages": 3, "num_warps": 8}):
            for batch, ctx in ((64, 8192), (8, 8192)):
                r = bench_decode(batch, ctx, 28, 4, 128, args.bs, decode_config=cfg)
                print(_row(r), cfg, flush=True)
        for cfg in ({"block_n": 64, "num_stages": 2}, {"block_n": 64, "num_stages": 3},
                    {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2},
                    {"block_m": 128, "block_n": 32, "num_warps": 8, "num_stages": 3}):
            r = bench_prefill(1, 512, 8192, 28, 4, 128, args.bs, prefill_config=cfg)
            print(f"prefill 1x512 over 8192, 28/4: {r['time_us']:9.1f} us "
                  f"{r['tflops']:6.1f} TFLOP/s", cfg, flush=True)


if __name__ == "__main__":
    main()
