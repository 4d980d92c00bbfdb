"""`pdserve` command line: generate, chat, serve, bench, profile, simulate, plan."""
from __future__ import annotations

import argparse
import sys
import time


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None)


def _make_llm(a):
    import dataclasses

    from . import LLM
    from .args import engine_config
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
        from .server.main import main as serve
        return serve(argv[1:])
    if argv[:1] == ["profile"]:
        from .perf.profiler import main as profile
        return profile(argv[1:])
    if argv[:1] == ["simulate"]:
        from .sim.cli import main as simulate
        return simulate(argv[1:])
    if argv[:1] == ["plan"]:
        from .sim.planner import main as plan
        return plan(argv[1:])
    if argv[:1] == ["bench"]:
        sub = argv[1:2]
        if sub == ["offline"]:
            from .bench.offline import main as bench_offline
            return bench_offline(argv[2:])
        if sub == ["latency"]:
            from .bench.latency import main as bench_latency
            return bench_latency(argv[2:])
        if sub == ["step"]:
            from .bench.step import main as bench_step
            return bench_step(argv[2:])
        if sub == ["serve"]:
            from .bench.serve import main as bench_serve
            return bench_serve(argv[2:])
        if sub == ["tp"]:
            from .bench.tp import main as bench_tp
            return bench_tp(argv[2:])
        if sub == ["pd"]:
            from .bench.pd import main as bench_pd
            return bench_pd(argv[2:])
        if sub == ["prefix"]:
            from .bench.prefix import main as bench_prefix
            return bench_prefix(argv[2:])
        if sub == ["grammar"]:
            from .bench.grammar import main as bench_grammar
            return bench_grammar(argv[2:])
        if sub == ["kv-tier"]:
            from .bench.kv_tier import main as bench_kv_tier
            return bench_kv_tier(argv[2:])
        if sub == ["preemption"]:
            from .bench.preemption import main as bench_preemption
            return bench_preemption(argv[2:])
        if sub == ["predictor"]:
            from .bench.predictor import main as bench_predictor
            return bench_predictor(argv[2:])
        print("usage: pdserve bench {offline,latency,step,tp,pd,serve,prefix,predictor,grammar,kv-tier,preemption} [options]   (pdserve bench offline --help)",
              file=sys.stderr)
        return 2
    from .args import add_engine_args
    p = argparse.ArgumentParser(prog="pdserve")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="complete one or more prompts")
    g.add_argument("prompts", nargs="+")
    add_engine_args(g)
    _sampling_args(g)
    c = sub.add_parser("chat", help="chat with the model (interactive, or --message for one turn)")
    c.add_argument("--message", action="append", help="a user turn (repeatable); omit for a REPL")
    c.add_argument("--system", default=None)
    add_engine_args(c)
    _sampling_args(c)
    sub.add_parser("bench", help="benchmarks: pdserve bench offline --help")
    sub.add_parser("serve", help="OpenAI-compatible HTTP server: pdserve serve --help")
    sub.add_parser("profile", help="measure step and KV transfer costs, fit the cost model: "
                                   "pdserve profile --help")
    sub.add_parser("simulate", help="a serving benchmark on the simulator: pdserve simulate --help")
    sub.add_parser("plan", help="search deployments for the best goodput per GPU under SLOs "
                                "(simulated): pdserve plan --help")
    a = p.parse_args(argv)
    try:
        return {"generate": cmd_generate, "chat": cmd_chat}[a.cmd](a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
