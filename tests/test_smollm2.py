"""The embedded SmolLM2-135M-Instruct GGUF end to end, against HF transformers' model with the
weights transformers' own GGUF loader reads from the same file (it dequantizes and un-permutes on
its own; conftest.hf_smollm2): logits, greedy generation, batch invariance under chunked prefill
and preemption, stop strings, chat."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from pdserve import LLM, SamplingParams  # noqa: E402

from .utils import paged_logits  # noqa: E402

TEXTS = ["The capital of France is", "def fibonacci(n):", "In 1969, 3 astronauts flew to",
         "Les fleurs du jardin sont"]


@pytest.fixture(scope="module")
def hf(hf_smollm2):
    """transformers' model with transformers' own dequantized weights of the same file
    (conftest: built once per run, shared with test_gguf_loader's tensor comparison)."""
    return hf_smollm2


@pytest.fixture(scope="module")
def llm():
    return LLM()


def test_logits_match_hf(hf, llm):
    tok = llm.get_tokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].double()
        ours = paged_logits(llm.llm_engine, ids).double()
        err = ((ours - ref).norm() / ref.norm()).item()
        assert err < 1e-4, (text, err)


def test_greedy_matches_hf_generate(hf, llm):
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True)
               for t in ("What is the capital of France?", "Write a haiku about rain.")]
    prompts.append(tok.encode(TEXTS[1]))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, o in zip(prompts, outs):
        ours = o.outputs[0].token_ids
        assert len(ours) == 32   # ignore_eos: EOS neither stops nor is banned
        with torch.no_grad():
            # HF's greedy continuation, checked in one forward instead of 32 generate steps:
            # greedy picks each token as the argmax after the prompt and the tokens before it,
            # so HF's generate gives exactly `ours` iff every such argmax is the next of `ours`
            logits = hf(torch.tensor([p + ours])).logits[0, len(p) - 1:-1]
        assert logits.argmax(-1).tolist() == ours
        assert o.outputs[0].text == tok.decode(ours)


def test_batch_invariance_with_chunked_prefill_and_preemption(llm):
    prompts = [f"Question {i}: tell me about {topic}." for i, topic in enumerate(
        ["the sea", "mountains", "cats", "rivers", "the moon", "bread", "trains"])]
    # 12 tokens: each sequence then needs 3 of the small pool's 12 blocks of 8 (7 need 21), so
    # the batch still preempts (asserted below) and decodes after its recompute
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    small = LLM(num_kv_blocks=12, block_size=8, max_num_batched_tokens=16, max_model_len=96)
    outs = small.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    eng = small.llm_engine
    assert eng.scheduler.num_preemptions > 0
    eng.check_integrity()
    assert eng.kv.num_free_blocks() == 12


def test_stop_string_cut_and_chat(llm):
    sp = SamplingParams(temperature=0, max_tokens=40)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], sp,
                   use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
    word = "Paris"
    cut = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=40, stop=[word]),
                   use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == word
    assert cut.text == out.text[: out.text.index(word)]
    assert word not in cut.text


def test_the_stopping_token_is_no_text(llm):
    """As in vLLM: the EOS or stop token that ends a sequence is in token_ids, not in the text,
    also with skip_special_tokens=False (which otherwise shows special tokens)."""
    tok = llm.get_tokenizer()
    chat = [{"role": "user", "content": "Say hi."}]
    sp = SamplingParams(temperature=0, max_tokens=40, skip_special_tokens=False)
    out = llm.chat(chat, sp, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == tok.eos_token_id
    assert out.text == tok.decode(out.token_ids[:-1], False)
    assert tok.decode([tok.eos_token_id], False) not in out.text
    stop = out.token_ids[2]
    cut = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop],
                                        skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert cut.stop_reason == stop and cut.token_ids == out.token_ids[:3]
    assert cut.text == tok.decode(out.token_ids[:2], False)


def test_cli_generate_and_chat(capsys, monkeypatch):
    from pdserve import cli
    from pdserve.args import engine_config
    from pdserve.cli import main
    real, made = cli._make_llm, []

    def once(a):
        """The CLI's own LLM, loaded once: chat reuses generate's when the engine arguments
        are the same (an in-process LLM's shutdown at the end of a command frees nothing)."""
        cfg = engine_config(a)
        for c, built in made:
            if c == cfg:
                return built
        made.append((cfg, real(a)))
        return made[-1][1]
    monkeypatch.setattr(cli, "_make_llm", once)
    assert main(["generate", "The capital of France is", "--max-tokens", "8"]) == 0
    out = capsys.readouterr()
    assert "The capital of France is" in out.out and "tokens/s" in out.err
    assert main(["chat", "--message", "Hi!", "--max-tokens", "8"]) == 0
    out = capsys.readouterr()
    assert "> Hi!" in out.out and "tokens/s" in out.err
    assert len(made) == 1   # both commands asked for the same engine
    assert main(["generate", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
