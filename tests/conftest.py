import os

import torch

# Triton kernels run under Triton's interpreter where there is no GPU; it must be chosen before
# triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def served(args: list[str]):
    """A `pdserve serve` with args, yielding its base URL; afterwards it must still be healthy,
    stop cleanly and leave no worker process behind (a generator for fixtures to yield from)."""
    httpx = pytest.importorskip("httpx")
    from .test_server import _start, _stop, _stopped_cleanly
    from .utils import assert_processes_gone
    proc, base = _start(args)
    pids = httpx.get(base + "/admin/check").json()["worker_pids"]
    yield base
    try:
        health = httpx.get(base + "/health", timeout=10)
        assert health.status_code == 200, f"the engine died during the tests: {health.text}"
    finally:
        assert _stopped_cleanly(_stop(proc))
        assert_processes_gone(pids)


@pytest.fixture(scope="session")
def small_server():
    """One `pdserve serve` (embedded SmolLM2, one worker, 16 sequences, max_model_len 256) shared
    by the request-schema and conformance tests (one start-up instead of two): its base URL.
    At the end it must still be healthy, stop cleanly and leave no worker process behind."""
    yield from served(["--max-num-seqs", "16", "--max-model-len", "256"])


# Qwen2.5's layout, shortened: the tools in the system turn, calls as <tool_call> JSON with
# the arguments written by tojson (so an object, not a string, is what the template wants).
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Write each call as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls is defined %}<|im_start|>assistant
{% for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="session")
def tools_server(tmp_path_factory):
    """One `pdserve serve` (embedded SmolLM2, whose own template ignores tools, so
    HERMES_TEMPLATE is given with --chat-template; Hermes tool-call parser, auto tool choice,
    4 sequences, max_model_len 512) shared by the tool-calling and LangChain tests: its base
    URL."""
    path = tmp_path_factory.mktemp("tools") / "hermes.jinja"
    path.write_text(HERMES_TEMPLATE)
    yield from served(["--max-num-seqs", "4", "--max-model-len", "512",
                       "--chat-template", str(path), "--tool-call-parser", "hermes",
                       "--enable-auto-tool-choice"])


class _NameMapOnly:
    """Just what transformers' ``get_gguf_hf_weights_map`` reads from ``model_to_load``.

    Passing the real (meta) model works too, but that function rebuilds gguf's whole tensor
    name map once per submodule while recursing (~400 times for this model, ~30 s on 2 cores).
    The top-level state-dict names already cover every tensor, so no children are exposed.
    """

    def __init__(self, model):
        self.config = model.config
        self._names = dict.fromkeys(model.state_dict())

    def state_dict(self):
        return self._names

    def named_children(self):
        return iter(())


@pytest.fixture(scope="session")
def hf_smollm2_reference():
    """transformers' own GGUF parse, dequantize and un-permute of the embedded SmolLM2, once per
    run (it takes ~10 s): (a transformers LlamaConfig, {HF name: float32 tensor}).

    ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` does the same for llama
    GGUFs -- ``GgufHfQuantizer.get_state_dict`` calls
    ``modeling_gguf_pytorch_utils.load_gguf_checkpoint`` (llama is not in transformers' newer
    packed-GGUF arch list) -- but parses the file twice and maps names the slow way; we call
    that function directly. It needs a model only to map GGUF names to HF names; a meta-device
    LlamaForCausalLM gives the names. The config dict is transformers' own parse of the file's
    metadata, turned into a real LlamaConfig with ``AutoConfig.for_model``."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from pdserve.loader.default_model import default_gguf_path
    from pdserve.loader.gguf_loader import load_gguf
    try:
        path = default_gguf_path()
    except ValueError as e:
        pytest.skip(str(e))
    c = load_gguf(path).config  # only for the skeleton that names the tensors
    names_cfg = transformers.LlamaConfig(
        hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"], vocab_size=c["vocab_size"],
    )
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(names_cfg)
    parsed = load_gguf_checkpoint(
        path, return_tensors=True, model_to_load=_NameMapOnly(skeleton), torch_dtype=torch.float32
    )
    cfg_dict = dict(parsed["config"])
    cfg = transformers.AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    return cfg, parsed["tensors"]


@pytest.fixture(scope="session")
def hf_smollm2(hf_smollm2_reference):
    """The embedded SmolLM2 as a transformers model (float32, eval): transformers' model code
    with transformers' dequantized weights (hf_smollm2_reference), what
    ``from_pretrained(folder, gguf_file=...)`` builds, without parsing the file again."""
    import transformers
    cfg, tensors = hf_smollm2_reference
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    assert set(missing) <= tied and not unexpected, (missing, unexpected)
    model.tie_weights()
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()
