"""`pdserve bench latency`: decode step time at fixed batch size and context, beside the
roofline measured in the same run.

For each (batch, context): `batch` requests with `context`-token random prompts are prefilled,
then the engine decodes; each `LLMEngine.step()` (schedule + forward + sample + detokenize-free
bookkeeping) is timed with a device sync and the median over `--steps` steps is reported; then
`--steps` more run back to back with one sync at the end (pipelined_step_ms: what a running
engine sustains, the host's next step overlapping the device's under async scheduling).
Batch 1 is also measured as a user sees it: LLM.generate of 1 + --generate-tokens output tokens
against 1 output token, per extra token, beside the weight-read floor.

Roofline: the bytes a decode step must read (all weights once, plus every sequence's KV cache)
divided by the bandwidth of a large device-to-device copy measured here (bytes read + written
per second). Weights-only floor is reported too.

Peer (`--peer hf-static`): HF transformers on the same architecture (random weights of the same
shapes, in the same dtype), generating with a static KV cache and its decode forward under
torch.compile(mode="reduce-overhead") (CUDA graphs), timed the same way as LLM.generate: one
`context`-token prompt, 1 + --generate-tokens new tokens against 1, per extra token.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any

import torch

from ..kv_layout import kv_bytes_per_token
from .common import copy_bandwidth, git_info, hardware_info, random_prompts, sync, write_result


def measure(llm, batch: int, context: int, steps: int, warmup: int, seed: int) -> dict[str, Any]:
    from pdserve import SamplingParams
    eng = llm.llm_engine
    device = eng.config.torch_device
    prompts = random_prompts(batch, context, context + 1, eng.model_config.vocab_size, seed)
    sp = SamplingParams(temperature=0, max_tokens=warmup + 2 * steps + 2, ignore_eos=True)
    ids = [f"lat-{batch}-{context}-{i}" for i in range(batch)]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, {"prompt_token_ids": p}, sp)
    while any(not r.output_token_ids for r in eng.scheduler.requests.values()):
        eng.step()  # prefill (chunked) until every sequence has its first token
    for _ in range(warmup):
        eng.step()
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        eng.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    # back to back, one sync at the end: what a running engine sustains (with async scheduling
    # the host's work for the next step overlaps the device's)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync(device)
    pipelined = (time.perf_counter() - t0) / steps
    eng.abort_request(ids)
    while eng.has_unfinished_requests():   # (a step in flight under async scheduling)
        eng.step()
    running = len(eng.scheduler.running)
    return {"step_ms": statistics.median(times) * 1e3, "step_ms_p10": _pct(times, 10) * 1e3,
            "step_ms_p90": _pct(times, 90) * 1e3, "pipelined_step_ms": pipelined * 1e3,
            "steps": steps, "running_after": running}


def generate_per_token(llm, context: int, tokens: int, seed: int, reps: int = 3) -> dict[str, Any]:
    """Batch-1 decode as a user sees it: LLM.generate of one `context`-token prompt for
    1 + tokens output tokens against 1, per extra token (medians of reps)."""
    from pdserve import SamplingParams
    prompt = random_prompts(1, context, context + 1, llm.llm_engine.model_config.vocab_size, seed)[0]

    def timed(n: int) -> float:
        ts = []
        for _ in range(reps + 1):   # (the first is a warm-up)
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                         use_tqdm=False)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts[1:])

    one, many = timed(1), timed(1 + tokens)
    return {"context": context, "tokens": tokens, "generate_1_ms": one * 1e3,
            "generate_n_ms": many * 1e3, "per_token_ms": (many - one) / tokens * 1e3}


def hf_static_per_token(hf_config: dict, dtype: torch.dtype, device: torch.device, context: int,
                        tokens: int, seed: int, reps: int = 3) -> dict[str, Any]:
    """The peer: HF generate with a static cache and a compiled (reduce-overhead) forward."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.generation.configuration_utils import CompileConfig
    d = {k: v for k, v in hf_config.items() if k not in ("model_type", "quantization_config")}
    config = AutoConfig.for_model(hf_config.get("model_type", "llama"), **d)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    # generate() compiles the decode forward itself when the cache is static (the prefill stays
    # eager); compiling model.forward by hand as well fails in transformers 5 (cudagraph outputs
    # overwritten by the cache update)
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = CompileConfig(mode="reduce-overhead", fullgraph=True)
    prompt = torch.tensor([random_prompts(1, context, context + 1, config.vocab_size, seed)[0]],
                          device=device)

    def timed(n: int) -> float:
        ts = []
        for _ in range(reps + 2):   # (the first two compile and warm up this cache shape)
            sync(device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                               do_sample=False, max_new_tokens=n, min_new_tokens=n,
                               pad_token_id=0)
            sync(device)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts[2:])

    t_compile = time.perf_counter()
    one = timed(1)
    many = timed(1 + tokens)
    out = {"peer": "hf-static", "context": context, "tokens": tokens,
           "generate_1_ms": one * 1e3, "generate_n_ms": many * 1e3,
           "per_token_ms": (many - one) / tokens * 1e3,
           "wall_s_incl_compile": time.perf_counter() - t_compile}
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _model_bytes(eng) -> tuple[int, int]:
    """Weight bytes a step reads (tied weights once) and KV-cache bytes per token."""
    params = {id(p): p for p in eng.model.parameters()}.values()
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    attn = eng.model.layers[0].self_attn
    kv_per_token = kv_bytes_per_token(eng.model_config.num_layers, attn.num_kv_heads,
                                      attn.head_dim, eng.runner.kv_cache.element_size())
    return weight_bytes, kv_per_token


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * p / 100))]


def run(args) -> dict[str, Any]:
    from pdserve import LLM
    device = torch.device(args.device)
    results = []
    bw = copy_bandwidth(device)
    generate_rows = []
    peer_rows = []
    for model in args.models:
        if args.peer == "hf-static" and model in (args.peer_models or args.models[:1]):
            from ..loader.model_loader import resolve_source
            dtype = torch.bfloat16 if args.dtype == "auto" else getattr(torch, args.dtype)
            r = hf_static_per_token(resolve_source(model).hf_config, dtype, device,
                                    args.batch1_context, args.generate_tokens, args.seed)
            r["model"] = model
            peer_rows.append(r)
            print(f"{model:>14} HF static cache + torch.compile, batch 1: "
                  f"{r['per_token_ms']:.3f} ms/token", flush=True)
        sizes = sorted({1, *args.batch_sizes})
        llm = LLM(model, load_format=args.load_format, dtype=args.dtype, device=args.device,
                  skip_tokenizer_init=True, max_num_seqs=max(sizes),
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.max_model_len or needed_len(args),
                  enforce_eager=args.enforce_eager, attention_backend=args.attention_backend)
        eng = llm.llm_engine
        weight_bytes, kv_per_token = _model_bytes(eng)
        for bs in sizes:
            ctx = args.batch1_context if bs == 1 else args.context
            r = measure(llm, bs, ctx, args.steps, args.warmup, args.seed)
            kv_bytes = bs * (ctx + args.warmup + args.steps // 2) * kv_per_token
            entry = {"model": model, "batch_size": bs, "context": ctx, **r,
                     "roofline_ms": (weight_bytes + kv_bytes) / bw * 1e3,
                     "weights_only_roofline_ms": weight_bytes / bw * 1e3,
                     "weight_bytes": weight_bytes, "kv_bytes": kv_bytes}
            entry["x_roofline"] = entry["step_ms"] / entry["roofline_ms"]
            entry["pipelined_x_roofline"] = entry["pipelined_step_ms"] / entry["roofline_ms"]
            results.append(entry)
            print(f"{model:>14} bs={bs:<4} ctx={ctx:<5} step {r['step_ms']:8.3f} ms   roofline "
                  f"{entry['roofline_ms']:7.3f} ms   x{entry['x_roofline']:.2f}   back to back "
                  f"{r['pipelined_step_ms']:8.3f} ms x{entry['pipelined_x_roofline']:.2f}",
                  flush=True)
        if args.generate_tokens:
            g = generate_per_token(llm, args.batch1_context, args.generate_tokens, args.seed)
            g.update(model=model, weights_only_roofline_ms=weight_bytes / bw * 1e3)
            g["x_weights_roofline"] = g["per_token_ms"] / g["weights_only_roofline_ms"]
            peer = next((r for r in peer_rows if r["model"] == model), None)
            if peer is not None:
                g["peer_per_token_ms"] = peer["per_token_ms"]
                g["speedup_vs_peer"] = peer["per_token_ms"] / g["per_token_ms"]
            generate_rows.append(g)
            print(f"{model:>14} LLM.generate batch 1: {g['per_token_ms']:.3f} ms/token, "
                  f"x{g['x_weights_roofline']:.2f} the weight floor"
                  + (f", {g['speedup_vs_peer']:.2f}x faster than the peer" if peer else ""),
                  flush=True)
        eng.runner.release()
        del llm, eng
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"benchmark": "latency", "copy_bandwidth_bytes_per_s": bw, "results": results,
            "generate": generate_rows, "peer": peer_rows}


def needed_len(args) -> int:
    """The longest sequence the runs make: the longer context, then its steps or generate."""
    return (max(args.context, args.batch1_context)
            + max(2 * args.steps + args.warmup, args.generate_tokens) + 8)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench latency")
    p.add_argument("--models", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-7b"])
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--context", type=int, default=1024, help="context of batch > 1 runs")
    p.add_argument("--batch1-context", type=int, default=128, help="context of the batch-1 run")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the engine's max_model_len (default: just what the runs need). The "
                        "decode graphs are captured for it, and their attention splits keys by "
                        "it: pass the model's own length (as `pdserve serve` uses by default) "
                        "to time the steps a server runs")
    p.add_argument("--generate-tokens", type=int, default=512,
                   help="batch-1 LLM.generate of 1 + this many tokens vs 1, per token (0: skip)")
    p.add_argument("--peer", default="none", choices=["none", "hf-static"],
                   help="hf-static: HF transformers with a static cache under torch.compile "
                        "(reduce-overhead), batch-1 generate timed the same way (needs "
                        "--generate-tokens)")
    p.add_argument("--peer-models", nargs="+", default=None,
                   help="the models the peer runs for (default: the first of --models)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    if args.peer != "none" and args.generate_tokens <= 0:
        p.error("--peer times batch-1 generate: it needs --generate-tokens > 0")
    if args.max_model_len is not None and args.max_model_len < needed_len(args):
        p.error(f"--max-model-len {args.max_model_len} is shorter than the runs need "
                f"({needed_len(args)} tokens)")
    payload = run(args)
    payload.update(command=["pdserve", "bench", "latency", *(argv if argv is not None else sys.argv[3:])],
                   config=vars(args), hardware=hardware_info(), **git_info())
    out = args.output or f"bench/results/decode-latency-{torch.device(args.device).type}.json"
    print("wrote", write_result(out, payload))
    return 0
