"""`pdserve` command line: generate, chat, bench."""
from __future__ import annotations

import argparse
import sys
import time


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF folder, .gguf file or preset (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument("--dtype", default="auto")
    g.add_argument("--device", default="cpu")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory-gb", type=float, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="no tokenizer (token-id prompts only; for dummy presets)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks per worker (NCCL on CUDA, gloo on CPU); > 1 runs worker processes")
    g.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="CUDA TP: NCCL for every all-reduce (no one-shot P2P all-reduce)")
    g.add_argument("--distributed-executor-backend", default="auto", choices=["auto", "uni", "mp"],
                   help="uni: engine in this process; mp: in worker processes (auto: mp iff tp > 1)")


def _deployment_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("P/D disaggregation (several workers behind a router)")
    g.add_argument("--prefill", type=int, default=0, help="prefill workers")
    g.add_argument("--decode", type=int, default=0, help="decode workers")
    g.add_argument("--collocated", type=int, default=0, help="collocated workers")
    g.add_argument("--prefill-tp", type=int, default=None, help="TP of each prefill worker (default -tp)")
    g.add_argument("--decode-tp", type=int, default=None, help="TP of each decode worker (default -tp)")
    g.add_argument("--collocated-tp", type=int, default=None,
                   help="TP of each collocated worker (default -tp)")
    g.add_argument("--routing-policy", default=None, choices=["disagg", "collocated", "round-robin"],
                   help="default: disagg with prefill workers, else collocated")
    g.add_argument("--kv-connector", default="shared",
                   help="how KV moves: shared (CUDA IPC peer reads, or a pinned host relay "
                        "without peer access; a shared file on CPU), relay, nccl, torch-dist (CPU)")
    g.add_argument("--kv-transfer-mode", default="async", choices=["sync", "async"],
                   help="sync: a decode worker pulls inside its step; async: beside its steps")
    g.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                   help="seconds before a pull is given up and the prompt recomputed")
    g.add_argument("--worker-restarts", type=int, default=3,
                   help="restarts in a row of a worker that dies (0: none); serve restarts a "
                        "single worker too")
    g.add_argument("--restart-backoff", type=float, default=1.0,
                   help="seconds before the first restart of a dead worker (doubling per attempt)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None)


def engine_config(a):
    from .config import EngineConfig
    return EngineConfig(
        model=a.model, load_format=a.load_format, dtype=a.dtype, device=a.device, seed=a.seed,
        block_size=a.block_size, max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
        num_kv_blocks=a.num_kv_blocks, kv_cache_memory_gb=a.kv_cache_memory_gb,
        gpu_memory_utilization=a.gpu_memory_utilization, attention_backend=a.attention_backend,
        enforce_eager=a.enforce_eager, tensor_parallel_size=a.tensor_parallel_size,
        disable_custom_all_reduce=a.disable_custom_all_reduce,
        distributed_executor_backend=a.distributed_executor_backend,
        skip_tokenizer_init=a.skip_tokenizer_init,
        **({"kv_transfer_mode": a.kv_transfer_mode, "kv_transfer_timeout_s": a.kv_transfer_timeout}
           if hasattr(a, "kv_transfer_mode") else {}))


def _make_llm(a):
    import dataclasses

    from . import LLM
    return LLM(**dataclasses.asdict(engine_config(a)))


def _params(a):
    from . import SamplingParams
    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                          top_k=a.top_k, min_p=a.min_p, repetition_penalty=a.repetition_penalty,
                          seed=a.sampling_seed)


def _report(outs, elapsed):
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"[{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tokens/s]", file=sys.stderr)


def cmd_generate(a) -> int:
    with _make_llm(a) as llm:
        return _generate(llm, a)


def _generate(llm, a) -> int:
    params = _params(a)
    t = time.perf_counter()
    outs = llm.generate(a.prompts, params, use_tqdm=len(a.prompts) > 1)
    elapsed = time.perf_counter() - t
    for o in outs:
        print(f"--- {o.prompt!r}\n{o.outputs[0].text}")
    _report(outs, elapsed)
    return 0


def cmd_chat(a) -> int:
    with _make_llm(a) as llm:
        return _chat(llm, a)


def _chat(llm, a) -> int:
    params = _params(a)
    history = [{"role": "system", "content": a.system}] if a.system else []
    turns = list(a.message) if a.message else None
    while True:
        if turns is not None:
            if not turns:
                return 0
            user = turns.pop(0)
            print(f"> {user}")
        else:
            try:
                user = input("> ")
            except EOFError:
                return 0
            if user.strip() in ("/exit", "/quit"):
                return 0
            if not user.strip():
                continue
        history.append({"role": "user", "content": user})
        t = time.perf_counter()
        out = llm.chat(history, params, use_tqdm=False)[0]
        text = out.outputs[0].text
        print(text)
        _report([out], time.perf_counter() - t)
        history.append({"role": "assistant", "content": text})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from .server.api import main as serve
        return serve(argv[1:])
    if argv[:1] == ["bench"]:
        sub = argv[1:2]
        if sub == ["offline"]:
            from .bench.offline import main as bench_offline
            return bench_offline(argv[2:])
        if sub == ["latency"]:
            from .bench.latency import main as bench_latency
            return bench_latency(argv[2:])
        if sub == ["serve"]:
            from .bench.serve import main as bench_serve
            return bench_serve(argv[2:])
        if sub == ["tp"]:
            from .bench.tp import main as bench_tp
            return bench_tp(argv[2:])
        if sub == ["pd"]:
            from .bench.pd import main as bench_pd
            return bench_pd(argv[2:])
        print("usage: pdserve bench {offline,latency,tp,pd,serve} [options]   (pdserve bench offline --help)",
              file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(prog="pdserve")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="complete one or more prompts")
    g.add_argument("prompts", nargs="+")
    _engine_args(g)
    _sampling_args(g)
    c = sub.add_parser("chat", help="chat with the model (interactive, or --message for one turn)")
    c.add_argument("--message", action="append", help="a user turn (repeatable); omit for a REPL")
    c.add_argument("--system", default=None)
    _engine_args(c)
    _sampling_args(c)
    sub.add_parser("bench", help="benchmarks: pdserve bench offline --help")
    sub.add_parser("serve", help="OpenAI-compatible HTTP server: pdserve serve --help")
    a = p.parse_args(argv)
    try:
        return {"generate": cmd_generate, "chat": cmd_chat}[a.cmd](a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
