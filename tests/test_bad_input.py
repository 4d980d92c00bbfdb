"""Bad input raises ValueError saying what is wrong, and the engine keeps serving."""
import json
import os

import pytest

pytest.importorskip("transformers")

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.config import EngineConfig  # noqa: E402

from .utils import save_tiny_hf_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "qwen2"
    save_tiny_hf_model(d, "qwen2")
    return d


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), skip_tokenizer_init=True, num_kv_blocks=64, block_size=4,
               max_model_len=32)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"),
    (dict(min_p=2.0), "min_p"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": list(range(40))}, "max_model_len"),
    ({"prompt_token_ids": [1, 2, 99999]}, "vocabulary"),
    ({"prompt_token_ids": ["a"]}, "integers"),
    ({"nothing": 1}, "prompt_token_ids"),
    ("text without a tokenizer", "tokenizer"),
])
def test_bad_prompts_rejected_and_engine_keeps_serving(llm, prompt, match):
    good = {"prompt_token_ids": [3, 4, 5]}
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match=match):
        llm.generate([good, prompt], sp, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([good], sp, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.kv.num_free_blocks() == 64


@pytest.mark.parametrize("stop_token_ids", [[320], [5, 10 ** 6]])  # the tiny model's vocab: 320
def test_stop_token_ids_outside_the_vocabulary(llm, stop_token_ids):
    good = {"prompt_token_ids": [3, 4, 5]}
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    bad = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=stop_token_ids)
    with pytest.raises(ValueError, match=r"stop_token_ids: token id \d+ is outside the vocabulary"):
        llm.generate([good, good], [sp, bad], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    last = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop_token_ids=[319])
    assert len(llm.generate([good], last, use_tqdm=False)[0].outputs[0].token_ids) >= 1
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.kv.num_free_blocks() == 64


def test_empty_string_prompt_with_tokenizer():
    llm = LLM(num_kv_blocks=16)
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(num_kv_blocks=4, block_size=4, max_model_len=64)


def test_missing_and_corrupt_model_files(tmp_path, model_dir):
    with pytest.raises(ValueError, match="neither a file"):
        LLM(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError):
        LLM(str(tmp_path / "missing.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError):
        LLM(str(junk))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        LLM(str(bad))
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    (trunc / "config.json").write_text((model_dir / "config.json").read_text())
    data = (model_dir / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError):
        LLM(str(trunc), skip_tokenizer_init=True)
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(empty), skip_tokenizer_init=True)


def test_unknown_architecture(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                               "model_type": "gpt2", "n_embd": 64}))
    with pytest.raises(ValueError, match="unknown architecture"):
        LLM(str(d), load_format="dummy", skip_tokenizer_init=True)


def test_bad_engine_args():
    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=0)
    with pytest.raises(ValueError, match="load_format"):
        LLM(load_format="pickle")
    with pytest.raises(ValueError, match="preset"):
        LLM("qwen2.5-7b")  # a preset has no weights without load_format="dummy"


@pytest.mark.parametrize("kwargs, match", [
    (dict(device="meta"), "device must be cpu or cuda"),
    (dict(device="cuda:99"), "device 'cuda:99'"),
    (dict(block_size=10 ** 6), "block_size must be at most 1024"),
    (dict(num_kv_blocks=2 ** 31), "num_kv_blocks must be at most"),
    (dict(cuda_graph_max_batch=0), "cuda_graph_max_batch"),
    (dict(cuda_graph_max_batch=-3), "cuda_graph_max_batch"),
    (dict(seed=True), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(seed=2 ** 64), "seed"),
    (dict(kv_cache_memory_gb=float("inf")), "kv_cache_memory_gb"),
    (dict(kv_cache_memory_gb="1"), "kv_cache_memory_gb"),
    (dict(kv_cache_memory_gb=True), "kv_cache_memory_gb"),
    (dict(gpu_memory_utilization="0.9"), "gpu_memory_utilization"),
    (dict(enforce_eager="no"), "enforce_eager"),
    (dict(async_scheduling=1), "async_scheduling"),
    (dict(skip_tokenizer_init=1), "skip_tokenizer_init"),
    (dict(model=5), "model"),
])
def test_bad_engine_config(kwargs, match):
    """Caught on construction, before a model is loaded (each used to fail later, in torch or
    in the allocator, or to be taken as something else)."""
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_cuda_device_without_that_gpu():
    import torch
    n = torch.cuda.device_count()
    for device in [f"cuda:{n}"] + (["cuda"] if n == 0 else []):
        with pytest.raises(ValueError, match=f"device '{device}'"):
            EngineConfig(device=device)
    with pytest.raises(ValueError, match="device"):
        LLM(device=f"cuda:{n}", load_format="dummy")


def test_kv_pool_bigger_than_the_machine(model_dir):
    """A pool no machine here holds is a ValueError naming what sized it, not an allocator
    error (10**9 blocks of this model: 1.5 TB; 10**6 GiB)."""
    kw = dict(skip_tokenizer_init=True, block_size=4)
    with pytest.raises(ValueError, match="KV pool does not fit.*num_kv_blocks=1000000000"):
        LLM(str(model_dir), num_kv_blocks=10 ** 9, **kw)
    with pytest.raises(ValueError, match="KV pool does not fit.*kv_cache_memory_gb=1000000"):
        LLM(str(model_dir), kv_cache_memory_gb=10 ** 6, **kw)


def test_kv_budget_smaller_than_one_block(model_dir):
    """A budget that holds no block is a ValueError saying what to change, not a pool of one
    block that silently caps max_model_len at block_size (1e-9 GiB is ~1 byte)."""
    with pytest.raises(ValueError, match="no room for the KV cache: kv_cache_memory_gb=1e-09"):
        LLM(str(model_dir), kv_cache_memory_gb=1e-9, skip_tokenizer_init=True, block_size=4)


def test_dummy_config_folder_takes_token_ids(tmp_path, model_dir):
    d = tmp_path / "cfgonly"
    d.mkdir()
    (d / "config.json").write_text((model_dir / "config.json").read_text())
    llm = LLM(str(d), load_format="dummy", skip_tokenizer_init=True, num_kv_blocks=32)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    llm2 = LLM("smollm2-135m", load_format="dummy", skip_tokenizer_init=True, num_kv_blocks=16)
    p1 = next(llm.llm_engine.model.parameters())
    assert p1.abs().sum() > 0
    assert llm2.llm_engine.model_config.num_layers == 30
