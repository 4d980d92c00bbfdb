"""`pdserve bench offline`: offline generation throughput of pdserve and of a peer (Hugging Face
transformers `generate`) on the same weights and the same prompts, in one run.

Both sides run greedy with a fixed output length (pdserve: ignore_eos; HF: no EOS stopping), in
the same process, one after the other, with the same torch thread count. Only generation is
timed, each after a short warm-up. The run also reports how often the two agree on the first 16
greedy tokens of each prompt (fp32 on CPU should agree on nearly all; near-ties may flip a few).

The peer's weights:
  * GGUF file (the default model): `AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`,
    i.e. transformers' own GGUF dequantizer, an independent check of pdserve's loader. If that is
    unavailable (it needs `accelerate`), the peer is built from the GGUF's config and pdserve's
    loaded weights instead, and the JSON says so ("weights_from").
  * HF folder: `from_pretrained(folder)`.
  * load_format=dummy (presets included): the HF model is built from the same config dict and
    pdserve's seeded dummy weights are copied into it (un-fused back to q/k/v, gate/up).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import os
import sys
import time
from typing import Any

import torch

from ..args import add_engine_args, engine_config
from .common import CpuUsage, random_prompts, run_described, write_result

MATCH_PREFIX = 16
PEER_NAME = "hf-transformers-generate"
CONTENDED_LOAD = 0.2   # other processes' average busy cores above which a run is flagged


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve bench offline",
        description="Offline generation throughput of pdserve vs Hugging Face transformers "
                    "generate, on the same weights and prompts.")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=32)
    w.add_argument("--output-len", type=int, default=128, help="output tokens per prompt")
    w.add_argument("--min-input-len", type=int, default=32)
    w.add_argument("--max-input-len", type=int, default=256,
                   help="input lengths are uniform in [min, max)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--prompts-file", default=None,
                   help="text prompts, one per line (tokenized by pdserve's tokenizer, cycled "
                        "to --num-prompts); default: random token ids")
    add_engine_args(p, exclude=("--seed",))  # --seed seeds the workload and the engine
    e = p.add_argument_group("bench")
    e.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (both sides)")
    q = p.add_argument_group("peer")
    q.add_argument("--peer", default="hf", choices=["hf", "hf-cb", "none"],
                   help="hf: transformers generate (padded batches); hf-cb: transformers "
                        "generate_batch (continuous batching, paged attention; GPU)")
    q.add_argument("--peer-batch-size", type=int, default=32)
    q.add_argument("--peer-seq-prompts", type=int, default=8,
                   help="also time HF generate one prompt at a time (batch 1) on this many of "
                        "the prompts (0: skip)")
    o = p.add_argument_group("output")
    o.add_argument("--output", default=None,
                   help="JSON result path (default: bench/results/offline-<device type>.json)")
    return p


# ---- helpers ------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _log(msg: str) -> None:
    print(f"[bench offline] {msg}", file=sys.stderr, flush=True)


def _special_ids(llm, source) -> set[int]:
    ids: set[int] = set()
    tok = llm.get_tokenizer()
    if tok is not None:
        ids.update(tok.special_token_ids)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        v = source.hf_config.get(key)
        for i in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(i, int):
                ids.add(i)
    return ids


def _file_prompts(path: str, num: int, tokenizer) -> list[list[int]]:
    if tokenizer is None:
        raise ValueError("--prompts-file needs pdserve's tokenizer (not with presets or "
                         "--skip-tokenizer-init)")
    with open(path, encoding="utf-8") as f:
        lines = [ln.rstrip("\n") for ln in f if ln.strip()]
    if not lines:
        raise ValueError(f"{path} has no prompts")
    return [tokenizer.encode(lines[i % len(lines)]) for i in range(num)]


def _pdserve_to_hf_state(model) -> dict[str, torch.Tensor]:
    """pdserve's (tp size 1) parameters under HF Llama/Qwen2 names, fused layers split back."""
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if name.startswith("lm_head."):
            out[name] = t[: cfg.vocab_size]
            continue
        hf = "model." + name
        if name == "embed_tokens.weight":
            out[hf] = t[: cfg.vocab_size]
        elif ".qkv_proj." in name:
            q = cfg.num_heads * cfg.head_dim
            kv = cfg.num_kv_heads * cfg.head_dim
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv], dim=0)):
                out[hf.replace("qkv_proj", part)] = piece
        elif ".gate_up_proj." in name:
            gate, up = t.split([cfg.intermediate_size] * 2, dim=0)
            out[hf.replace("gate_up_proj", "gate_proj")] = gate
            out[hf.replace("gate_up_proj", "up_proj")] = up
        else:
            out[hf] = t
    return out


def _hf_from_pdserve_weights(hf_config: dict, model, dtype: torch.dtype, attn: str | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM
    d = {k: v for k, v in hf_config.items() if k not in ("model_type", "quantization_config")}
    config = AutoConfig.for_model(hf_config.get("model_type", "llama"), **d)
    kw = {"attn_implementation": attn} if attn else {}
    with torch.device(next(model.parameters()).device):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype, **kw)
    state = _pdserve_to_hf_state(model)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("inv_freq")
               and not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"copying pdserve weights into the HF model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        hf.tie_weights()
    return hf


@contextlib.contextmanager
def _quiet_gguf_progress():
    """transformers' GGUF dequantizer draws its own tqdm bar; silence it while loading."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
        bar = gguf_utils.tqdm
    except (ImportError, AttributeError):
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def build_peer(args, source, llm, dtype: torch.dtype) -> tuple[Any, str]:
    """The HF model for the peer and where its weights came from."""
    from transformers import AutoModelForCausalLM
    if args.load_format == "dummy":
        attn = None
        if args.peer == "hf-cb":
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
            attn = next((a for a in ("paged|sdpa", "sdpa_paged", "paged_attention")
                         if a in ALL_ATTENTION_FUNCTIONS), "paged|sdpa")
        return (_hf_from_pdserve_weights(source.hf_config, llm.llm_engine.model, dtype, attn),
                "pdserve dummy weights copied into the HF model")
    if source.kind == "gguf":
        folder, name = os.path.split(os.path.abspath(source.path))
        try:
            with _quiet_gguf_progress():
                return (AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype),
                        "transformers GGUF loader")
        except (ImportError, ValueError) as exc:
            if "accelerate" not in str(exc):
                raise
            _log(f"transformers cannot load the GGUF ({exc}); using pdserve's dequantized "
                 "weights for the peer instead")
            return (_hf_from_pdserve_weights(source.hf_config, llm.llm_engine.model, dtype),
                    "pdserve GGUF loader (transformers' needs accelerate)")
    return AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype), "transformers from_pretrained"


def hf_generate(model, prompts: list[list[int]], output_len: int, batch_size: int, pad_id: int,
                device: torch.device) -> list[list[int]]:
    """Greedy, exactly output_len new tokens per prompt, left-padded batches."""
    results: list[list[int]] = []
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b:b + batch_size]
        width = max(len(x) for x in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, x in enumerate(batch):
            ids[i, width - len(x):] = torch.tensor(x, dtype=torch.long)
            mask[i, width - len(x):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 do_sample=False, max_new_tokens=output_len,
                                 min_new_tokens=output_len, pad_token_id=pad_id)
        results.extend(out[:, width:].tolist())
    return results


def _matmul_floor(model, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """The physical floor of this workload on this machine: the FLOPs of its matrix multiplies
    (2 x weight elements of every linear layer, LM head included, per token fed) divided by the
    matmul rate measured here on a representative decode-batch shape. Attention is left out, so
    the floor is optimistic."""
    weights = sum(p.numel() for n, p in model.named_parameters()
                  if p.dim() == 2 and not n.startswith("embed_tokens"))
    if model.config.tie_word_embeddings:
        weights += model.lm_head.weight.numel()
    n_in = sum(len(x) for x in prompts)
    tokens = n_in + len(prompts) * output_len
    flops = 2.0 * weights * tokens
    cfg = model.config
    p0 = next(model.parameters())
    x = torch.randn(min(len(prompts), 64), cfg.hidden_size, device=p0.device, dtype=p0.dtype)
    w = torch.randn(2 * cfg.intermediate_size, cfg.hidden_size, device=p0.device, dtype=p0.dtype)
    for _ in range(3):
        torch.nn.functional.linear(x, w)
    reps = 30
    _sync(p0.device)
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.nn.functional.linear(x, w)
    _sync(p0.device)
    rate = 2.0 * x.shape[0] * w.numel() * reps / (time.perf_counter() - t0)
    floor_s = flops / rate
    return {"linear_flops": flops, "gemm_flops_per_s": rate, "gemm_shape": [x.shape[0], *w.shape],
            "floor_s": floor_s, "floor_output_tok_per_s": len(prompts) * output_len / floor_s}


def hf_generate_batch(model, prompts: list[list[int]], output_len: int, pad_id: int
                      ) -> list[list[int]]:
    """transformers' continuous-batching generate_batch, greedy, no EOS stopping."""
    from transformers import GenerationConfig
    cfg = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1,
                           pad_token_id=pad_id)
    # No inference_mode here: generate_batch updates its tensors from a background thread,
    # which may not touch inference tensors.
    with torch.no_grad():
        outs = model.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
    ordered = [outs[k] for k in sorted(outs, key=lambda k: int(str(k).rsplit("_", 1)[-1])
                                       if str(k).rsplit("_", 1)[-1].isdigit() else str(k))]
    return [list(o.generated_tokens) for o in ordered]


def _match(a: list[list[int]], b: list[list[int]], k: int) -> tuple[float, float, list[dict]]:
    prefix = full = 0
    mismatches = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x[:k] == y[:k]:
            prefix += 1
        if x == y:
            full += 1
        else:
            first = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            mismatches.append({"prompt": i, "first_diff_at": first})
    n = max(1, len(a))
    return prefix / n, full / n, mismatches


# ---- main -------------------------------------------------------------------------------------
def run(args) -> dict[str, Any]:
    from pdserve import LLM, SamplingParams
    from pdserve.loader.model_loader import resolve_source

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    source = resolve_source(args.model)
    skip_tok = args.skip_tokenizer_init or source.kind == "preset"
    config = dataclasses.replace(engine_config(args), skip_tokenizer_init=skip_tok)
    _log(f"loading pdserve ({source.kind}: {source.path or args.model})")
    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(config))
    pd_load_s = time.perf_counter() - t0
    dtype = llm.llm_engine.config.torch_dtype
    vocab = llm.llm_engine.model_config.vocab_size

    if args.prompts_file:
        prompts = _file_prompts(args.prompts_file, args.num_prompts, llm.get_tokenizer())
    else:
        prompts = random_prompts(args.num_prompts, args.min_input_len, args.max_input_len, vocab,
                                 args.seed, exclude_ids=_special_ids(llm, source))
    n_in = sum(len(x) for x in prompts)
    n_out = len(prompts) * args.output_len

    # pdserve: warm-up, then the timed run
    _log("pdserve warm-up")
    warm = [{"prompt_token_ids": x[:16]} for x in prompts[:2]]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    _sync(device)
    _log(f"pdserve: {len(prompts)} prompts, {n_in} input tokens, {args.output_len} output each")
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with CpuUsage() as pd_cpu:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": x} for x in prompts], params, use_tqdm=False)
        _sync(device)
        pd_elapsed = time.perf_counter() - t0
    pd_tokens = [list(o.outputs[0].token_ids) for o in outs]
    got = sum(len(t) for t in pd_tokens)
    if got != n_out:
        _log(f"warning: pdserve produced {got} output tokens, expected {n_out}")
    result: dict[str, Any] = {
        "engine": "pdserve",
        "output_tok_per_s": got / pd_elapsed,
        "total_tok_per_s": (n_in + got) / pd_elapsed,
        "elapsed_s": pd_elapsed,
        "num_prompts": len(prompts),
        "input_tokens": n_in,
        "output_tokens": got,
        "load_s": pd_load_s,
        "cpu_usage": pd_cpu.result(),
    }
    _log(f"pdserve: {pd_elapsed:.2f} s, {got / pd_elapsed:.1f} output tok/s")

    payload: dict[str, Any] = {"results": result, "peer": None, "speedup": None,
                               "greedy_match_fraction": None,
                               "floor": _matmul_floor(llm.llm_engine.model, prompts, args.output_len)}
    if args.peer in ("hf", "hf-cb"):
        import transformers
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        _log("loading the HF peer")
        t0 = time.perf_counter()
        hf, weights_from = build_peer(args, source, llm, dtype)
        llm.llm_engine.runner.release()
        del llm, outs
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        hf = hf.to(device).eval()
        # ignore_eos semantics: no stopping at EOS (pdserve does not mask it either)
        hf.generation_config.eos_token_id = None
        pad = source.hf_config.get("pad_token_id")
        if not isinstance(pad, int):
            eos = source.hf_config.get("eos_token_id")
            pad = eos[0] if isinstance(eos, (list, tuple)) else eos
        pad = pad if isinstance(pad, int) else 0
        hf_load_s = time.perf_counter() - t0
        bs = max(1, args.peer_batch_size)
        if args.peer == "hf-cb":
            def peer_run(ps, n):
                return hf_generate_batch(hf, ps, n, pad)
        else:
            def peer_run(ps, n):
                return hf_generate(hf, ps, n, bs, pad, device)
        _log("HF warm-up")
        peer_run([x[:16] for x in prompts[:2]], 4)
        _sync(device)
        _log(f"HF {args.peer}, batch size {bs}")
        with CpuUsage() as hf_cpu:
            t0 = time.perf_counter()
            hf_tokens = peer_run(prompts, args.output_len)
            _sync(device)
            hf_elapsed = time.perf_counter() - t0
        hf_out = sum(len(t) for t in hf_tokens)
        _log(f"HF: {hf_elapsed:.2f} s, {hf_out / hf_elapsed:.1f} output tok/s")
        k = min(MATCH_PREFIX, args.output_len)
        frac, full, mismatches = _match(pd_tokens, hf_tokens, k)
        payload["peer"] = {
            "name": PEER_NAME if args.peer == "hf" else "hf-transformers-generate_batch",
            "version": transformers.__version__,
            "output_tok_per_s": hf_out / hf_elapsed,
            "total_tok_per_s": (n_in + hf_out) / hf_elapsed,
            "elapsed_s": hf_elapsed,
            "batch_size": bs,
            "output_tokens": hf_out,
            "load_s": hf_load_s,
            "weights_from": weights_from,
            "attn_implementation": getattr(hf.config, "_attn_implementation", None),
            "cpu_usage": hf_cpu.result(),
        }
        if hf_out == 0:
            raise RuntimeError("the peer produced no tokens; see its log above")
        payload["speedup"] = result["output_tok_per_s"] / payload["peer"]["output_tok_per_s"]
        if args.peer_seq_prompts > 0 and args.peer == "hf":
            m = min(args.peer_seq_prompts, len(prompts))
            _log(f"HF generate, batch size 1, {m} prompts")
            with CpuUsage() as seq_cpu:
                t0 = time.perf_counter()
                seq_tokens = hf_generate(hf, prompts[:m], args.output_len, 1, pad, device)
                _sync(device)
                seq_elapsed = time.perf_counter() - t0
            seq_out = sum(len(t) for t in seq_tokens)
            payload["peer_batch1"] = {
                "name": PEER_NAME + " (one prompt at a time)", "num_prompts": m,
                "output_tok_per_s": seq_out / seq_elapsed, "elapsed_s": seq_elapsed,
                "cpu_usage": seq_cpu.result()}
            payload["speedup_vs_batch1"] = result["output_tok_per_s"] / (seq_out / seq_elapsed)
        payload["greedy_match_fraction"] = frac
        payload["greedy_match_prefix_tokens"] = k
        payload["full_output_match_fraction"] = full
        payload["mismatches"] = mismatches
    return payload


def _print_table(payload: dict[str, Any]) -> None:
    r, peer = payload["results"], payload["peer"]
    rows = [("pdserve", r["elapsed_s"], r["output_tok_per_s"], r["total_tok_per_s"])]
    if peer:
        rows.append((peer["name"], peer["elapsed_s"], peer["output_tok_per_s"],
                     peer["total_tok_per_s"]))
    print(f"{r['num_prompts']} prompts, {r['input_tokens']} input tokens, "
          f"{r['output_tokens']} output tokens")
    print(f"{'engine':<26}{'elapsed s':>11}{'output tok/s':>14}{'total tok/s':>13}")
    for name, el, o, t in rows:
        print(f"{name:<26}{el:>11.2f}{o:>14.1f}{t:>13.1f}")
    for name, side in (("pdserve", r), (peer and peer["name"], peer)):
        load = (side or {}).get("cpu_usage", {}).get("other_load")
        if load is not None and load > CONTENDED_LOAD:
            print(f"warning: other processes kept {load:.2f} cores busy during the {name} run; "
                  "its numbers are not clean")
    if peer:
        print(f"speedup (output tok/s): {payload['speedup']:.2f}x   greedy match, first "
              f"{payload['greedy_match_prefix_tokens']} tokens: "
              f"{payload['greedy_match_fraction']:.3f} (full output: "
              f"{payload['full_output_match_fraction']:.3f})")
    seq = payload.get("peer_batch1")
    if seq:
        print(f"{seq['name']}: {seq['output_tok_per_s']:.1f} output tok/s over "
              f"{seq['num_prompts']} prompts; speedup {payload['speedup_vs_batch1']:.2f}x")
    f = payload.get("floor")
    if f:
        print(f"matmul floor: {f['floor_s']:.1f} s ({f['floor_output_tok_per_s']:.1f} output tok/s) "
              f"at {f['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s measured here")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    for name in ("num_prompts", "output_len", "min_input_len", "max_num_seqs",
                 "max_num_batched_tokens", "peer_batch_size"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    output = args.output or f"bench/results/offline-{torch.device(args.device).type}.json"
    payload = run_described("offline", run, args, argv, output)
    if payload is None:
        return 1
    _print_table(payload)
    print(f"wrote {os.path.abspath(write_result(output, payload))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
