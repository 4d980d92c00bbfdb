"""AsyncLLM, the asyncio API, on the embedded SmolLM2 (one worker process behind a Router):
concurrent generate() streams, each cumulative and ending finished, whose greedy tokens are
transformers' own argmax (teacher-forced, conftest.hf_smollm2); leaving a stream early and
abort() stop a request while the others go on; bad input is a ValueError; shutdown ends it."""
import asyncio

import pytest
import torch

from pdserve import AsyncLLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def llm():
    loop = asyncio.new_event_loop()
    llm = AsyncLLM(max_num_seqs=8, max_model_len=256)
    yield llm, loop
    loop.run_until_complete(llm.shutdown())
    loop.close()


async def _collect(llm, prompt, params, **kw):
    outs = []
    async for out in llm.generate(prompt, params, **kw):
        outs.append(out)
    return outs


def test_concurrent_streams_match_transformers_greedy(llm, hf_smollm2):
    llm, loop = llm
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(_collect(llm, p, params) for p in PROMPTS))
    results = loop.run_until_complete(main())
    tok = llm.get_tokenizer()
    for prompt, outs in zip(PROMPTS, results):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        seen: list[int] = []
        for o in outs:   # cumulative, new_token_ids what each adds
            c = o.outputs[0]
            assert c.token_ids == seen + c.new_token_ids
            seen = list(c.token_ids)
        final = outs[-1].outputs[0]
        assert len(final.token_ids) == 8 and final.finish_reason == "length"
        assert final.text == tok.decode(final.token_ids)
        ids = outs[-1].prompt_token_ids + final.token_ids
        with torch.no_grad():
            logits = hf_smollm2(torch.tensor([ids])).logits[0]
        n = len(outs[-1].prompt_token_ids)
        assert logits[n - 1:-1].argmax(-1).tolist() == final.token_ids


def test_break_and_abort_stop_a_request_and_others_finish(llm):
    llm, loop = llm
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def first_two(prompt):
        n = 0
        async for _ in llm.generate(prompt, long):
            n += 1
            if n == 2:
                break     # leaving early aborts it
        return n

    async def aborted():
        task = asyncio.ensure_future(_collect(llm, PROMPTS[1], long, request_id="stop-me"))
        while not llm._engine or not llm._engine.is_open("stop-me"):
            await asyncio.sleep(0.01)
        assert await llm.abort("stop-me") is True
        assert await llm.abort("stop-me") is False
        return await task

    async def main():
        return await asyncio.gather(first_two(PROMPTS[0]), aborted(),
                                    _collect(llm, PROMPTS[2], short))
    n, stopped, done = loop.run_until_complete(main())
    assert n == 2
    assert all(not o.finished for o in stopped) and len(stopped) < 200
    assert done[-1].finished and len(done[-1].outputs[0].token_ids) == 6

    async def idle():   # every request left the engine: nothing keeps running there
        for _ in range(200):
            stats = await llm._engine.check_integrity()
            if stats.num_running == 0 and stats.num_waiting == 0:
                return True
            await asyncio.sleep(0.05)
        return False
    assert loop.run_until_complete(idle())


def test_bad_input_is_a_value_error_and_the_engine_goes_on(llm):
    llm, loop = llm

    async def main():
        with pytest.raises(ValueError, match="sampling params"):
            await _collect(llm, "Hi", {"max_tokens": 3})
        with pytest.raises(ValueError, match="max_model_len"):
            await _collect(llm, list(range(300)), SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="stop_token_ids"):
            await _collect(llm, "Hi", SamplingParams(stop_token_ids=[10 ** 7]))
        return await _collect(llm, "Hi", SamplingParams(max_tokens=3, ignore_eos=True))
    outs = loop.run_until_complete(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
