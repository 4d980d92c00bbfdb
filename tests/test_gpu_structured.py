"""Structured outputs on the GPU: the bitmask applied on the device equals the CPU result, and
constrained generation on CUDA (async scheduling: the mask of a step is computed while its
forward runs) gives outputs that parse and keep the schema's bounds. The engine test needs a
model folder with a tokenizer: `.qwen-text` (scripts/make_dummy_model_dir.py), dummy weights."""
import json
import os

import pytest
import torch

from pdserve.layers.sampler import SamplingBatch, apply_token_bitmask
from pdserve.sampling_params import SamplingParams, StructuredOutputsParams as SO

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MODEL = os.environ.get("PDSERVE_TEXT_MODEL", ".qwen-text")


def test_gpu_bitmask_equals_cpu():
    g = torch.Generator().manual_seed(1)
    B, V = 8, 151936
    mask = torch.randint(-2**31, 2**31 - 1, (B, (V + 31) // 32), generator=g).to(torch.int32)
    logits = torch.randn(B, V, generator=g)
    params = [SamplingParams(temperature=0)] * B
    ref = apply_token_bitmask(logits, SamplingBatch.build(params, [[]] * B, [[]] * B, [None] * B,
                                                          V, "cpu", token_bitmask=mask))
    got = apply_token_bitmask(logits.cuda(), SamplingBatch.build(
        params, [[]] * B, [[]] * B, [None] * B, V, "cuda", token_bitmask=mask.pin_memory()))
    assert torch.equal(got.cpu(), ref)


@pytest.mark.skipif(not os.path.isdir(MODEL), reason=f"no {MODEL} model folder")
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_gpu_constrained_generation_parses(async_scheduling):
    pytest.importorskip("llguidance")
    from pdserve import LLM
    # (an explicit pool: a second LLM in this process would find the first's memory taken)
    llm = LLM(MODEL, load_format="dummy", device="cuda", num_kv_blocks=4096,
              async_scheduling=async_scheduling)
    schema = {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["color", "n", "ok", "tags"], "additionalProperties": False}
    prompts = [f"Item {i}:" for i in range(48)]
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=64,
                             structured_outputs=SO(json=schema)) for i in range(48)]
    params[-1] = SamplingParams(max_tokens=8, structured_outputs=SO(regex="[0-9]{4}"))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o in outs[:-1]:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        v = json.loads(c.text)
        assert set(v) == {"color", "n", "ok", "tags"} and v["color"] in ("red", "green", "blue")
        assert isinstance(v["n"], int) and 0 <= v["n"] <= 99 and isinstance(v["ok"], bool)
        assert len(v["tags"]) <= 3 and set(v["tags"]) <= {"a", "b"}
    last = outs[-1].outputs[0].text
    assert len(last) == 4 and last.isdigit()
