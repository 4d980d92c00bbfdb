"""Host-side profile of the offline workload on the GPU (where does engine time go besides the
forward?). Usage: python3 scripts/profile_offline.py [MODEL]"""
import cProfile
import io
import pstats
import sys
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.common import random_prompts

model = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-1.5b"
llm = LLM(model, load_format="dummy", device="cuda", skip_tokenizer_init=True,
          max_num_batched_tokens=8192)
prompts = [{"prompt_token_ids": p} for p in random_prompts(256, 100, 1024, 151000, 0)]
sp = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
torch.cuda.synchronize()
t = time.perf_counter()
llm.generate(prompts, sp, use_tqdm=False)
torch.cuda.synchronize()
print(f"plain run: {time.perf_counter() - t:.2f} s")
pr = cProfile.Profile()
pr.enable()
t = time.perf_counter()
llm.generate(prompts, sp, use_tqdm=False)
torch.cuda.synchronize()
pr.disable()
print(f"profiled run: {time.perf_counter() - t:.2f} s")
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
print(s.getvalue())
