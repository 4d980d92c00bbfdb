"""Outputs cross the worker -> client channel as deltas (worker/output_delta.py): whatever the
engine reports, the client must rebuild exactly the cumulative RequestOutput it made — tokens,
logprobs, prompt logprobs, text with stop strings, n > 1 — after a msgpack round trip, while a
later streaming report carries only the new ids. (A P/D continuation, whose first report already
holds the producer's token, goes through the same path in test_disagg's streaming test.)"""
import copy

import msgspec
import pytest

from pdserve.config import EngineConfig
from pdserve.worker.llm_engine import LLMEngine
from pdserve.protocol import AddRequest
from pdserve.sampling_params import SamplingParams
from pdserve.worker import messages as m
from pdserve.worker.output_delta import DeltaDecoder, DeltaEncoder


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(max_num_batched_tokens=24))


def _wire(out):
    enc = msgspec.msgpack.encode(m.Outputs([out]))
    return msgspec.msgpack.decode(enc, type=m.FromWorker).outputs[0], len(enc)


def test_rebuilt_outputs_equal_the_engines(engine):
    reqs = [
        AddRequest("a", "The capital of France is", SamplingParams(
            temperature=0, max_tokens=20, logprobs=2, prompt_logprobs=1, stop=[" and"])),
        AddRequest("b", "Once upon a time", SamplingParams(
            temperature=0.8, seed=3, max_tokens=12, n=2, logprobs=0)),
        AddRequest("c", {"prompt_token_ids": list(range(300, 360))},
                   SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)),
    ]
    assert engine.add_requests(reqs) == [None, None, None]
    enc, dec = DeltaEncoder(), DeltaDecoder()
    seen = {r.request_id: 0 for r in reqs}
    handed_out = []   # (an output handed out earlier, a deep copy of it then)
    while engine.has_unfinished_requests():
        for out in engine.step():
            wire, size = _wire(enc.encode(out))
            if seen[out.request_id]:  # later reports: no prompt ids, only the new tokens
                assert wire.prompt_token_ids == []
                assert all(len(o.token_ids) <= 1 for o in wire.outputs)
            got = dec.decode(wire)
            assert got == out  # dataclass equality: every field, cumulative
            handed_out.append((got, copy.deepcopy(got)))
            seen[out.request_id] += 1
    # the decoder builds each report in place, but nothing it handed out changed later
    assert all(got == then for got, then in handed_out)
    assert all(n > 3 for n in seen.values())
    assert not enc._sent and not dec._seen  # finished requests leave no state


def test_forget_after_abort_keeps_both_sides_consistent(engine):
    enc, dec = DeltaEncoder(), DeltaDecoder()
    engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True))
    outs = []
    while not outs:   # (async scheduling: the first step's output comes with the next step())
        outs = engine.step()
    dec.decode(_wire(enc.encode(outs[0]))[0])
    engine.abort_request("x")
    enc.forget(["x"])
    dec.forget(["x"])
    assert not enc._sent and not dec._seen
    # the id reused for a new request starts afresh on both sides
    engine.add_request("x", [8, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert dec.decode(_wire(enc.encode(out))[0]) == out
