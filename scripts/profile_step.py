"""Where a step's time goes (issue 15): kernels (torch.profiler over five steps) and host Python
(cProfile over 40 steps) of a lone 256-token prefill and of 32 decodes + a 256-token chunk, through
the public engine API. Writes prof-<model>.txt (kernels) and host-prof-<model>.txt to --out.

    python scripts/profile_step.py --model qwen2.5-1.5b --out /tmp/prof
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

from pdserve import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--out", default=".")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    llm = LLM(a.model, device="cuda", load_format="dummy", skip_tokenizer_init=True,
              gpu_memory_utilization=0.5, async_scheduling=False)   # one step() = one step
    eng = llm.llm_engine
    gen = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
    ids = iter(range(10 ** 9))

    def prompt(n: int) -> list[int]:
        return torch.randint(100, 100000, (n,), generator=gen).tolist()

    def chunk_step() -> None:   # a new 256-token prompt joins the running decodes, then leaves
        rid = f"c{next(ids)}"
        eng.add_request(rid, {"prompt_token_ids": prompt(256)}, sp)
        eng.step()
        eng.abort_request(rid)

    kernels = open(os.path.join(a.out, f"prof-{a.model}.txt"), "w")
    host = open(os.path.join(a.out, f"host-prof-{a.model}.txt"), "w")
    for label, decodes in (("prefill256", 0), ("mixed32+256", 32)):
        running = [f"d{next(ids)}" for _ in range(decodes)]
        for rid in running:
            eng.add_request(rid, {"prompt_token_ids": prompt(1024)}, sp)
        while any(not r.output_token_ids for r in eng.scheduler.requests.values()):
            eng.step()
        for _ in range(3):
            chunk_step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                chunk_step()
            torch.cuda.synchronize()
        kernels.write(f"==== {label}: {decodes} decodes + a 256-token prompt, 5 steps\n")
        kernels.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30,
                                                max_name_column_width=90) + "\n")
        pr = cProfile.Profile()
        for _ in range(40):
            torch.cuda.synchronize()
            pr.enable()
            chunk_step()
            torch.cuda.synchronize()
            pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        host.write(f"==== {label} (40 steps)\n" + s.getvalue())
        eng.abort_request(running)
    kernels.close()
    host.close()


if __name__ == "__main__":
    main()
