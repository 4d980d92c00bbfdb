"""RoPE scaling against HF transformers: linear, llama3 and yarn, each written in the
transformers-5 layout (`rope_parameters`, theta inside) and in the older one (`rope_scaling` with
`type` / `rope_type`, top-level `rope_theta`). The reference is transformers reading the same
config.json file; prompts run past original_max_position_embeddings (32 here), where the scalings
differ from plain RoPE. fp32 logits (one prefill and chunked) and greedy tokens must match."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.models.config import ModelConfig  # noqa: E402

from .utils import paged_logits, save_tiny_hf_model  # noqa: E402

ORIG = 32
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            max_position_embeddings=256)
THETA = 1e4   # with head_dim 16 and ORIG 32, llama3 keeps, blends and slows some frequencies each

CASES = {
    # name: (HF model, the rope dict without theta, which layout config.json gets)
    "linear-new": ("llama", {"rope_type": "linear", "factor": 3.0}, "rope_parameters"),
    "linear-old": ("qwen2", {"type": "linear", "factor": 2.5}, "rope_scaling"),
    "llama3-new": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": ORIG},
                   "rope_parameters"),
    "llama3-old": ("llama", {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0,
                             "high_freq_factor": 8.0, "original_max_position_embeddings": ORIG},
                   "rope_scaling"),
    # yarn: defaults (attention factor from `factor`); other betas without truncation; the
    # attention factor from mscale / mscale_all_dim; an explicit attention factor
    "yarn-new": ("qwen2", {"rope_type": "yarn", "factor": 4.0,
                           "original_max_position_embeddings": ORIG}, "rope_parameters"),
    # (beta_fast 2: at ORIG 32 any beta_fast above ~5 puts the ramp's start at dimension 0)
    "yarn-new-betas": ("qwen2", {"rope_type": "yarn", "factor": 6.0, "beta_fast": 2.0,
                                 "beta_slow": 0.25, "truncate": False,
                                 "original_max_position_embeddings": ORIG}, "rope_parameters"),
    "yarn-old-mscale": ("llama", {"type": "yarn", "factor": 4.0, "mscale": 2.0,
                                  "mscale_all_dim": 1.0, "original_max_position_embeddings": ORIG},
                        "rope_scaling"),
    "yarn-old-attn": ("qwen2", {"rope_type": "yarn", "factor": 3.0, "attention_factor": 1.3,
                                "original_max_position_embeddings": ORIG}, "rope_scaling"),
}


def write_layout(folder, rope: dict, layout: str) -> None:
    """Rewrite config.json so that the scaling is only in `layout`."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        cfg.pop(key, None)
    if layout == "rope_parameters":
        cfg["rope_parameters"] = dict(rope, rope_theta=THETA)
    else:
        cfg["rope_scaling"] = dict(rope)
        cfg["rope_theta"] = THETA
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("name", list(CASES))
def test_rope_scaling_matches_hf(tmp_path, name):
    kind, rope, layout = CASES[name]
    folder = tmp_path / name
    save_tiny_hf_model(folder, kind, **TINY)
    write_layout(folder, rope, layout)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rope_type = rope.get("rope_type", rope.get("type"))
    assert hf.config.rope_parameters["rope_type"] == rope_type   # HF read it too
    assert ModelConfig.from_hf(json.loads((folder / "config.json").read_text())) \
        .rope_scaling.rope_type == rope_type

    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=64, block_size=8)
    ids = torch.randint(2, 320, (3 * ORIG,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double()
    for chunk in (None, 23):
        ours = paged_logits(llm.llm_engine, ids, chunk).double()
        err = ((ours - ref).norm() / ref.norm()).item()
        assert err < 1e-4, (chunk, err)

    prompt = ids[:ORIG + 8]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                       eos_token_id=-1, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == want
    llm.llm_engine.check_integrity()
