"""Outputs cross the worker -> client channel as deltas: a worker's engine reports them
(OutputProcessor with deltas=True) and the client's DeltaDecoder (worker/output_delta.py) must
rebuild, report by report, exactly the cumulative RequestOutputs an in-process engine makes —
tokens, logprobs, prompt logprobs, text with stop strings, n > 1, metrics, cached tokens — after
a msgpack round trip, while a later report carries no prompt ids and only the new tokens. The
reference is a second engine, the same model in cumulative mode, driven in lockstep on one
clock. (A P/D continuation through real workers goes this way in test_disagg's streaming test.)"""
import copy

import msgspec
import pytest

from pdserve.config import EngineConfig
from pdserve.engine.executor import SampledToken
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.request import Request, RequestStatus, sequence_id
from pdserve.outputs import RequestOutput
from pdserve.protocol import AddRequest
from pdserve.sampling_params import SamplingParams
from pdserve.worker import messages as m
from pdserve.worker.llm_engine import LLMEngine
from pdserve.worker.output_delta import DeltaDecoder

PROMPT_C = list(range(300, 360))


class _Clock:
    """One time for both engines: their metrics must be equal, not just close."""
    t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def engines():
    clock = _Clock()
    cfg = EngineConfig(max_num_batched_tokens=24)
    ref, delta = LLMEngine(cfg), LLMEngine(cfg, delta_outputs=True)
    for e in (ref, delta):
        e._now = clock   # (the arrival and output times; EngineCore(clock=...) without a model)
    return ref, delta, clock


def _wire(outs: list[RequestOutput]) -> list[RequestOutput]:
    """Through the channel as the worker sends them."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(m.Outputs(outs)),
                                  type=m.FromWorker).outputs


def _lockstep(engines, dec: DeltaDecoder) -> tuple[dict, list]:
    """Steps both engines until they finish; checks every decoded report against the
    reference's. Returns the reports per request and the outputs handed out."""
    ref, delta, clock = engines
    reports: dict[str, list[RequestOutput]] = {}
    handed_out = []   # (an output handed out, a deep copy of it then)
    while ref.has_unfinished_requests() or delta.has_unfinished_requests():
        clock.t += 0.5
        want, sent = ref.step(), delta.step()
        assert [o.request_id for o in sent] == [o.request_id for o in want]
        for w, wire in zip(want, _wire(sent)):
            rid = w.request_id
            if reports.get(rid):  # a later report: no prompt ids, only the new tokens
                assert wire.prompt_token_ids == []
                assert all(len(o.token_ids) <= 1 for o in wire.outputs)
                assert wire.prompt_logprobs in (None, [])
            got = dec.decode(wire)
            assert got == w  # dataclass equality: every field, cumulative
            reports.setdefault(rid, []).append(w)
            handed_out.append((got, copy.deepcopy(got)))
    return reports, handed_out


def test_rebuilt_outputs_equal_the_in_process_engines(engines):
    ref, delta, _ = engines
    reqs = [
        AddRequest("greedy", "The capital of France is", SamplingParams(
            temperature=0, max_tokens=14)),
        AddRequest("n2", "Once upon a time", SamplingParams(
            temperature=0.8, seed=3, max_tokens=12, n=2)),
        AddRequest("lp", "The capital of France is", SamplingParams(
            temperature=0, max_tokens=10, logprobs=3, prompt_logprobs=2)),
        AddRequest("stop", "Once upon a time", SamplingParams(
            temperature=0, max_tokens=40, stop=[" metropolis", "never seen"])),
        AddRequest("len", {"prompt_token_ids": PROMPT_C},
                   SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)),
    ]
    assert ref.add_requests(reqs) == delta.add_requests(reqs) == [None] * len(reqs)
    dec = DeltaDecoder()
    reports, handed_out = _lockstep(engines, dec)
    # the same prompt again: its prefix is cached (num_cached_tokens > 0)
    again = [AddRequest("cached", {"prompt_token_ids": PROMPT_C},
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))]
    assert ref.add_requests(again) == delta.add_requests(again) == [None]
    more, more_handed_out = _lockstep(engines, dec)
    reports.update(more)
    handed_out += more_handed_out
    # nothing handed out changed later (the decoder builds each report in place)
    assert all(got == then for got, then in handed_out)
    assert all(len(r) > 3 for rid, r in reports.items() if rid != "cached")
    final = {rid: r[-1] for rid, r in reports.items()}
    # the cases the test means to cover did happen
    s = final["stop"].outputs[0]
    assert (s.finish_reason, s.stop_reason) == ("stop", " metropolis")
    assert s.text.endswith("was a thriving")
    assert final["len"].outputs[0].finish_reason == "length"
    assert len(final["n2"].outputs) == 2
    assert final["n2"].outputs[0].token_ids != final["n2"].outputs[1].token_ids
    assert len(final["lp"].prompt_logprobs) == len(final["lp"].prompt_token_ids)
    assert all(len(e) >= 3 for e in final["lp"].outputs[0].logprobs)
    assert final["cached"].num_cached_tokens > 0
    assert all(o.metrics.keys() >= {"arrival", "scheduled", "first_token", "finished"}
               for o in final.values())
    # finished requests leave no state on either side
    assert not dec._seen and len(delta.outputs) == 0


def test_abort_forgets_on_both_sides(engines):
    ref, delta, _ = engines
    dec = DeltaDecoder()
    req = AddRequest("x", {"prompt_token_ids": [5, 6, 7]},
                     SamplingParams(max_tokens=30, ignore_eos=True))
    ref.add_requests([req]), delta.add_requests([req])
    got = []
    while not got:   # (async scheduling: the first step's output comes with the next step())
        want, got = ref.step(), _wire(delta.step())
    assert dec.decode(got[0]) == want[0]
    for e in (ref, delta):
        e.abort_request("x")
    dec.forget(["x"])
    assert not dec._seen and len(delta.outputs) == 0
    # the id reused for a new request starts afresh on both sides
    req = AddRequest("x", {"prompt_token_ids": [8, 9]}, SamplingParams(max_tokens=2, ignore_eos=True))
    ref.add_requests([req]), delta.add_requests([req])
    reports, _ = _lockstep(engines, dec)
    assert reports["x"][0].prompt_token_ids == [8, 9]


def test_pd_fields_and_producer_tokens_without_a_tokenizer():
    """The processor alone, as a P/D consumer (the producer's token already in the output, not
    reported as new) and producer (kv_transfer on the final report), token ids only."""
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1)
    cum, delta = (OutputProcessor(None, (), 1 << 20, deltas=d) for d in (False, True))
    dec, reqs = DeltaDecoder(), {}
    for proc in (cum, delta):
        req = Request(sequence_id("c", 0), [1, 2, 3], params, output_token_ids=[77],
                      hold_kv=True)
        proc.add("c", None, [1, 2, 3], params, [req], False, 0.0, done_ids=[77])
        reqs[proc] = req
    for t, tok in enumerate([10, 11, 12]):
        for proc, req in reqs.items():
            req.append_output(tok)
            stop = proc.append(req, SampledToken(tok, -0.25, [(tok, -0.25)]), float(t))
            if stop is not None:
                req.status = stop.status
                proc.finish(req, stop, held=[4, 5])
        want, sent = cum.take_outputs(float(t)), _wire(delta.take_outputs(float(t)))
        assert dec.decode(sent[0]) == want[0]
        assert want[0].outputs[0].new_token_ids == [tok]
        if t == 0:
            assert sent[0].outputs[0].token_ids == [77, 10]
            assert len(sent[0].outputs[0].logprobs) == 1
    assert want[0].finished and want[0].kv_transfer.block_ids == [4, 5]
    assert want[0].outputs[0].finish_reason == "length"
    assert want[0].outputs[0].token_ids == [77, 10, 11, 12]
    assert not dec._seen and len(delta) == 0 and len(cum) == 0
    assert reqs[delta].status is RequestStatus.FINISHED_LENGTH
