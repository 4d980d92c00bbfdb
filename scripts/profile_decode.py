"""Where a batch-1 decode step's time goes, on the GPU: graph replay alone vs the whole engine
step, the host-side profile (cProfile) and the device kernels (torch.profiler).
Usage: python3 scripts/profile_decode.py MODEL [BATCH]"""
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

from pdserve import LLM, SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-1.5b"
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
llm = LLM(model, load_format="dummy", device="cuda", skip_tokenizer_init=True, max_num_seqs=max(8, batch),
          max_model_len=2048)
eng = llm.llm_engine
sp = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
for i in range(batch):
    eng.add_request(f"r{i}", {"prompt_token_ids": list(range(100, 228))}, sp)
for _ in range(30):
    eng.step()


def timed(fn, n=100):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


g = eng.runner.graphs
key = g.plan(batch, batch, 1, 160).key
print(f"{model} batch {batch}: graph replay {timed(g.graphs[key].replay):.3f} ms, "
      f"engine step {timed(eng.step):.3f} ms")
pr = cProfile.Profile()
pr.enable()
for _ in range(100):
    eng.step()
pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
print(s.getvalue())
from torch.profiler import ProfilerActivity, profile  # noqa: E402
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        eng.step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        g.graphs[key].replay()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
