"""`pdserve serve` on a GPU: the server's whole path (HTTP, the AsyncEngine, adds sent without
waiting for each worker's answer, the worker's fast path with CUDA graphs and async scheduling,
and, in 1P1D on one GPU, the hand-off of KV between two worker processes) against HF
transformers' fp32 greedy generate on the same random weights. Many requests at once, some
streamed, of lengths that chunk and mix with decodes. Run on the device:
`python -m pytest -m gpu tests/test_gpu_server.py`."""
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
transformers = pytest.importorskip("transformers")

from .test_gpu_model import _prompts, assert_greedy_matches_hf, hf_dir  # noqa: E402,F401
from .utils import assert_processes_gone, start_server, stop_server, stopped_cleanly  # noqa: E402

MAX_TOKENS = 24


def _completion(base: str, prompt: list[int], stream: bool) -> list[int]:
    """The completion's token ids, read from its logprobs tokens (with no tokenizer a token's
    text is its id); streamed: from every chunk's."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "stream": stream}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        if not stream:
            return [int(t) for t in json.loads(r.read())["choices"][0]["logprobs"]["tokens"]]
        ids: list[int] = []
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            for c in json.loads(line[5:])["choices"]:
                ids += [int(t) for t in (c.get("logprobs") or {}).get("tokens", [])]
        return ids


@pytest.mark.parametrize("deployment", ["single", "1p1d"])
def test_concurrent_requests_match_hf_greedy(hf_dir, deployment):
    d, hf = hf_dir
    extra = ["--prefill", "1", "--decode", "1", "--num-gpus", "1"] if deployment == "1p1d" else []
    # a 256-token budget: the longer prompts chunk, and their chunks share steps with decodes
    proc, base = start_server(["--model", str(d), "--skip-tokenizer-init", "--device", "cuda",
                               "--dtype", "float32", "--max-model-len", "1024",
                               "--max-num-batched-tokens", "256", "--num-kv-blocks", "512",
                               *extra], timeout_s=400)
    try:
        with urllib.request.urlopen(base + "/admin/check", timeout=60) as r:
            pids = json.loads(r.read())["worker_pids"]
        prompts = _prompts(24, 20, 700, seed=1)
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda ip: _completion(base, ip[1], ip[0] % 2 == 1),
                                 enumerate(prompts)))
        assert all(len(o) == MAX_TOKENS for o in outs), [len(o) for o in outs]
        assert_greedy_matches_hf(hf, prompts, outs, MAX_TOKENS)
        with urllib.request.urlopen(base + "/admin/check", timeout=60) as r:
            check = json.loads(r.read())
        assert check["ok"] and check["num_running"] == 0 and check["num_waiting"] == 0, check
    except BaseException:
        proc.log.seek(0)
        print(proc.log.read()[-4000:])
        raise
    finally:
        code = stop_server(proc)
    assert stopped_cleanly(code)
    assert_processes_gone(pids)
