"""--tokenizer and --chat-template (vLLM's flags): another tokenizer than the model's, and a
chat template from a file or given inline, through EngineConfig to the engine's tokenizer.
Expectations: the embedded SmolLM2 tokenizer's own encoding, and templates rendered by hand."""
import os

import pytest

from pdserve import LLM
from pdserve.config import EngineConfig
from pdserve.loader.model_loader import engine_tokenizer, load_tokenizer, resolve_source

from .utils import save_tiny_model_with_tokenizer

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}:{{ m['content'] }}>{% endfor %}"
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


@pytest.fixture(scope="module")
def tok_folder(tmp_path_factory):
    path = save_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tok"))
    os.remove(os.path.join(path, "config.json"))   # a tokenizer-only folder
    return path


def test_another_tokenizer_for_a_preset_model(tok_folder):
    embedded = load_tokenizer(resolve_source(None))
    tok = engine_tokenizer(EngineConfig(model="qwen2.5-1.5b", load_format="dummy",
                                        tokenizer=tok_folder), resolve_source("qwen2.5-1.5b"))
    text = "The capital of France is Paris."
    assert tok.encode(text) == embedded.encode(text)
    assert tok.vocab_size == embedded.vocab_size


@pytest.mark.parametrize("as_file", [False, True])
def test_chat_template_inline_or_from_a_file(tmp_path, as_file):
    spec = TEMPLATE
    if as_file:
        spec = str(tmp_path / "t.jinja")
        with open(spec, "w") as f:
            f.write(TEMPLATE)
    tok = engine_tokenizer(EngineConfig(chat_template=spec), resolve_source(None))
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False,
                                   tokenize=False) == "<user:hi><assistant:yo>"


def test_skip_tokenizer_init_wins():
    assert engine_tokenizer(EngineConfig(skip_tokenizer_init=True, chat_template=TEMPLATE),
                            resolve_source(None)) is None


@pytest.mark.parametrize("kw, msg", [({"chat_template": "just words"}, "neither a file nor"),
                                     ({"tokenizer": "no/such-tokenizer"}, "tokenizer"),
                                     ({"tokenizer": ""}, "non-empty"),
                                     ({"chat_template": 5}, "chat_template")])
def test_bad_values_are_value_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        engine_tokenizer(EngineConfig(**kw), resolve_source(None))


def test_llm_takes_them(tok_folder, tmp_path):
    model = save_tiny_model_with_tokenizer(tmp_path / "m")
    llm = LLM(model, load_format="dummy", tokenizer=tok_folder, chat_template=TEMPLATE,
              max_model_len=128)
    tok = llm.get_tokenizer()
    assert tok.chat_template == TEMPLATE
    out = llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False,
                   add_generation_prompt=False)
    assert out[0].prompt_token_ids == tok.encode("<user:hi>")
