"""--generation-config (vLLM's): the default sampling values a model folder's
generation_config.json gives requests that leave them out; "vllm" ignores the file, a folder
reads that folder's. Expectations are the file's own values written here (and pdserve's
SamplingParams defaults for what the file leaves out)."""
import json
import os

import pytest

from pdserve import LLM, SamplingParams
from pdserve.loader.generation_config import generation_defaults

from .utils import save_tiny_model_with_tokenizer

FILE = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_new_tokens": 5, "do_sample": True,
        "bos_token_id": 1, "transformers_version": "4.51.0"}
WANT = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_tokens": 5}


def _write(folder, cfg) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        f.write(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(folder)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = save_tiny_model_with_tokenizer(tmp_path_factory.mktemp("gen") / "model")
    _write(path, FILE)
    return path


def test_auto_reads_the_model_folder_vllm_ignores_it(model_dir, tmp_path):
    assert generation_defaults("auto", model_dir) == (
        WANT, os.path.join(model_dir, "generation_config.json"))
    assert generation_defaults("vllm", model_dir) == ({}, None)
    other = _write(tmp_path / "other", {"temperature": 0.3, "top_k": 0})
    # a folder given wins over the model's; top_k 0 is Hugging Face's "off" (ours -1)
    assert generation_defaults(other, model_dir)[0] == {"temperature": 0.3, "top_k": -1}
    # no file, a .gguf / preset / the embedded model: no defaults
    assert generation_defaults("auto", tmp_path) == ({}, None)
    assert generation_defaults("auto", None) == ({}, None)
    assert generation_defaults("auto", "qwen2.5-1.5b") == ({}, None)


@pytest.mark.parametrize("content, msg", [(None, "no generation_config.json"),
                                          ("{not json", "not valid JSON"),
                                          ("[1, 2]", "JSON object"),
                                          ({"temperature": -1}, "temperature"),
                                          ({"max_new_tokens": 0}, "max_tokens")])
def test_bad_folders_are_value_errors(tmp_path, content, msg):
    folder = tmp_path / "g"
    os.makedirs(folder)
    if content is not None:
        _write(folder, content)
    with pytest.raises(ValueError, match=msg):
        generation_defaults(str(folder))
    with pytest.raises(ValueError, match="neither 'auto', 'vllm' nor a folder"):
        generation_defaults(str(tmp_path / "missing"))


def test_requests_take_the_defaults_and_keep_their_own():
    pytest.importorskip("pydantic")
    from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest
    msgs = [{"role": "user", "content": "hi"}]
    got = CompletionRequest(prompt="x").sampling_params(None, None, WANT)
    assert (got.temperature, got.top_p, got.top_k, got.min_p, got.repetition_penalty,
            got.max_tokens) == (0.6, 0.9, 20, 0.05, 1.1, 5)
    own = CompletionRequest(prompt="x", temperature=0, top_p=0.5, top_k=3, min_p=0.0,
                            repetition_penalty=1.0, max_tokens=7)
    got = own.sampling_params(own.max_tokens, None, WANT)
    assert (got.temperature, got.top_p, got.top_k, got.min_p, got.repetition_penalty,
            got.max_tokens) == (0.0, 0.5, 3, 0.0, 1.0, 7)
    # without defaults: pdserve's (SamplingParams') own, OpenAI's 16 for completions, the
    # chat endpoint's fallback (what the context leaves)
    d = SamplingParams()
    got = CompletionRequest(prompt="x").sampling_params(None, None, {})
    assert (got.temperature, got.top_p, got.top_k, got.max_tokens) == (
        d.temperature, d.top_p, d.top_k, 16)
    chat = ChatCompletionRequest(messages=msgs)
    assert chat.sampling_params(None, None, {}, 100).max_tokens == 100
    assert chat.sampling_params(None, None, WANT, 100).max_tokens == 5


def test_llm_without_sampling_params_uses_the_file(model_dir, tmp_path):
    llm = LLM(model_dir, load_format="dummy", max_model_len=128)
    assert llm.get_default_sampling_params() == SamplingParams(**WANT)
    out = llm.generate(["Hello"], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"   # max_new_tokens
    assert LLM(model_dir, load_format="dummy", max_model_len=128,
               generation_config="vllm").get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="no generation_config.json"):
        LLM(model_dir, load_format="dummy", generation_config=str(tmp_path))


@pytest.mark.parametrize("mode", ["auto"])   # ("vllm": the unit tests above; a start costs 6 s)
def test_served_defaults(model_dir, mode):
    """A completion without max_tokens gets the file's max_new_tokens (auto) or OpenAI's 16
    (vllm); one with max_tokens keeps it; the start-up log names the values."""
    httpx = pytest.importorskip("httpx")
    from .test_server import _start, _stop
    proc, base = _start([model_dir, "--load-format", "dummy", "--max-model-len", "128",
                         "--generation-config", mode])
    try:
        def n_tokens(**kw):
            r = httpx.post(base + "/v1/completions",
                           json={"prompt": "Hello", "ignore_eos": True, **kw}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["completion_tokens"]
        assert n_tokens() == (5 if mode == "auto" else 16)
        assert n_tokens(max_tokens=2) == 2
        r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
        if mode == "auto":
            assert r.json()["usage"]["completion_tokens"] == 5
    finally:
        _stop(proc)
    proc.log.seek(0)
    log = proc.log.read()
    if mode == "auto":
        assert "default sampling values from " in log and "temperature=0.6" in log
    else:
        assert "default sampling values: pdserve's own" in log


def test_serve_refuses_a_bad_folder(tmp_path, capsys):
    from pdserve.server.main import main
    assert main(["--generation-config", str(tmp_path / "nope")]) == 2
    assert "generation_config" in capsys.readouterr().err


def test_async_llm_without_sampling_params_uses_the_file(model_dir):
    import asyncio

    from pdserve import AsyncLLM

    async def go():
        llm = AsyncLLM(model_dir, load_format="dummy", max_model_len=128)
        try:
            assert llm.get_default_sampling_params() == SamplingParams(**WANT)
            outs = [o async for o in llm.generate("Hello")]
            return outs[-1].outputs[0]
        finally:
            await llm.shutdown()
    out = asyncio.run(go())
    assert len(out.token_ids) == 5 and out.finish_reason == "length"   # max_new_tokens
