"""Structured outputs on the embedded model (SmolLM2-135M-Instruct, CPU): every output parses and
validates (jsonschema, an implementation no one here wrote) against its schema, regexes and
choices hold, also under n > 1, sampling, async scheduling, preemption and a P/D hand-off; the
bitmask is applied as a naive loop over its bits says; a constraint the grammar engine cannot
compile is a ValueError, and other requests are unaffected."""
import dataclasses
import json
import random
import re

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pdserve import LLM, SamplingParams, StructuredOutputsParams as SO
from pdserve.config import EngineConfig
from pdserve.layers.sampler import Sampler, SamplingBatch, apply_token_bitmask
from pdserve.protocol import AddRequest
from pdserve.worker.llm_engine import LLMEngine

from .test_disagg import _run as run_to_end

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=256)


def _texts(outs):
    return [c.text for o in outs for c in o.outputs]


# ---- parameters --------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, words", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1, 2]}, "JSON schema"),
    ({"choice": []}, "choice"),
    ({"choice": "ab"}, "choice"),
    ({"choice": ["a", ""]}, "choice"),
    ({"regex": ""}, "regex"),
    ({"json_object": 1}, "json_object"),
])
def test_bad_params_are_value_errors(kw, words):
    with pytest.raises(ValueError, match=words):
        SO(**kw)


def test_params_from_a_mapping_and_msgspec_round_trip():
    sp = SamplingParams(structured_outputs={"json": PERSON})
    assert isinstance(sp.structured_outputs, SO)
    assert json.loads(sp.structured_outputs.json) == PERSON
    # properties keep their order (it is the order they are generated in)
    assert list(json.loads(sp.structured_outputs.json)["properties"]) == ["name", "age", "tags"]
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams)
    assert back == sp and back.structured_outputs.key == sp.structured_outputs.key
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"json_schema": {}})


# ---- the vocabulary and the mask ---------------------------------------------------------------
@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_token_bytes_spell_the_text(source, tmp_path):
    from pdserve.loader.model_loader import load_tokenizer, resolve_source
    from pdserve.loader.tokenizer import Tokenizer
    tok = load_tokenizer(resolve_source(None))
    if source == "hf":   # the same vocabulary through a Hugging Face folder's tokenizer.json
        (tmp_path / "tokenizer.json").write_text(tok.backend.to_str())
        tok = Tokenizer.from_hf_dir(tmp_path)
    pieces = tok.token_bytes()
    assert len(pieces) == tok.vocab_size
    for text in ['{"a": [1, 2.5e-3, null]}', "Héllo wörld 日本語 🙂", "  tabs\tand\nnewlines "]:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(pieces[i] for i in ids) == text.encode("utf-8")
    assert all(pieces[i] == b"" for i in tok.special_token_ids)


def test_bitmask_masks_exactly_its_zero_bits():
    g = torch.Generator().manual_seed(0)
    B, V = 3, 77
    words = torch.randint(-2**31, 2**31 - 1, (B, (V + 31) // 32), generator=g, dtype=torch.int64)
    mask = words.to(torch.int32)
    logits = torch.randn(B, V, generator=g)
    batch = SamplingBatch.build([SamplingParams(temperature=0)] * B, [[]] * B, [[]] * B,
                                [None] * B, V, "cpu", token_bitmask=mask)
    out = apply_token_bitmask(logits, batch)
    for i in range(B):
        for t in range(V):
            allowed = (int(words[i, t // 32]) >> (t % 32)) & 1
            assert out[i, t].item() == (logits[i, t].item() if allowed else float("-inf"))
    # greedy takes the best allowed token: the argmax over the allowed ids, found by hand
    got = Sampler()(logits, batch).token_ids.tolist()
    for i in range(B):
        ok = [t for t in range(V) if (int(words[i, t // 32]) >> (t % 32)) & 1]
        assert got[i] == max(ok, key=lambda t: logits[i, t].item())
    with pytest.raises(ValueError, match="token_bitmask"):
        SamplingBatch.build([SamplingParams()] * B, [[]] * B, [[]] * B, [None] * B, V, "cpu",
                            token_bitmask=mask[:, :1])


# ---- generation ---------------------------------------------------------------------------------
def _leaf():
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 10)),
        st.builds(lambda lo, w: {"type": "integer", "minimum": lo, "maximum": lo + w},
                  st.integers(-50, 50), st.integers(0, 500)),
        st.just({"type": "boolean"}),
        st.builds(lambda xs: {"enum": xs}, st.lists(
            st.one_of(st.sampled_from(["red", "green", "blue", "x y"]), st.integers(0, 9),
                      st.none()), min_size=1, max_size=4, unique=True)),
        st.builds(lambda p: {"type": "string", "pattern": p},
                  st.sampled_from(["^[a-z]{1,6}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no)$"])),
    )


def _schema():
    names = st.sampled_from(["name", "id", "city", "kind", "note", "ok", "n", "value"])

    def extend(children):
        obj = st.builds(
            lambda props, pick, closed: {
                "type": "object", "properties": props,
                "required": [k for k, r in zip(props, pick) if r],
                **({"additionalProperties": False} if closed else {})},
            st.dictionaries(names, children, min_size=1, max_size=3),
            st.lists(st.booleans(), min_size=3, max_size=3), st.booleans())
        arr = st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n},
                        children, st.integers(1, 3))
        return st.one_of(obj, arr)
    return st.recursive(_leaf(), extend, max_leaves=6)


@settings(max_examples=1, deadline=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck), derandomize=True)
@given(schemas=st.lists(_schema(), min_size=200, max_size=200))
def test_200_random_schemas_parse_and_validate(llm, schemas):
    """200 generated schemas in one batch, greedy: each output parses and validates. (Bounded
    strings, numbers and arrays: every value the grammar allows fits the token budget.)"""
    prompts = [f"Reply with JSON for this schema: {json.dumps(s)}" for s in schemas]
    params = [SamplingParams(temperature=0, max_tokens=160, structured_outputs=SO(json=s))
              for s in schemas]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for s, o in zip(schemas, outs):
        c = o.outputs[0]
        assert c.finish_reason == "stop", (s, c.text)
        jsonschema.validate(json.loads(c.text), s)


def test_regex_choice_and_grammars_hold_under_sampling(llm):
    """Seeded sampling at temperature 1, four samples each: every sample matches (the checks
    are Python's re, written apart from the constraints)."""
    phone = r"\(?[0-9]{3}\)? [0-9]{3}-[0-9]{4}"
    cases = [
        (SO(regex=phone), lambda t: re.fullmatch(phone, t)),
        (SO(choice=["positive", "negative", "not sure"]),
         lambda t: t in ("positive", "negative", "not sure")),
        (SO(grammar='start: "(" NUM ("+" NUM)? ("+" NUM)? ")"\nNUM: /[1-9][0-9]?/'),
         lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?){0,2}\)", t)),
        (SO(grammar='root ::= "a" [b-d] [b-d]? [b-d]? "e"'),      # GBNF
         lambda t: re.fullmatch(r"a[b-d]{1,3}e", t)),
    ]
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=seed, n=4, max_tokens=32,
                             structured_outputs=so) for seed, (so, _) in enumerate(cases)]
    outs = llm.generate(["Answer: "] * len(cases), params, use_tqdm=False)
    for o, (_, ok) in zip(outs, cases):
        assert len(o.outputs) == 4
        for c in o.outputs:
            assert c.finish_reason == "stop" and ok(c.text), c.text


def test_json_object_greedy_and_sampled(llm):
    prompt = "Describe a red car as a JSON object with a few fields."
    outs = llm.generate([prompt] * 2, [
        SamplingParams(temperature=0, max_tokens=96, structured_outputs=SO(json_object=True)),
        SamplingParams(temperature=0.7, seed=3, n=3, max_tokens=96,
                       structured_outputs=SO(json_object=True))], use_tqdm=False)
    for c in (c for o in outs for c in o.outputs):
        if c.finish_reason == "stop":     # (a sampled object may run past the budget)
            assert isinstance(json.loads(c.text), dict), c.text
        else:
            assert c.text.startswith("{"), c.text
    assert outs[0].outputs[0].finish_reason == "stop"


def test_the_constraint_changes_the_output_and_other_requests_do_not_change(llm):
    """The same prompt, with and without a constraint: only the constrained row changes
    (it is a JSON value where the free one is prose), batched or alone."""
    prompt = "Tell me about a person called Ann."
    free = SamplingParams(temperature=0, max_tokens=24)
    tied = dataclasses.replace(free, max_tokens=80, structured_outputs=SO(json=PERSON))
    alone_free = _texts(llm.generate([prompt], free, use_tqdm=False))[0]
    alone_tied = _texts(llm.generate([prompt], tied, use_tqdm=False))[0]
    both = _texts(llm.generate([prompt, prompt], [free, tied], use_tqdm=False))
    assert both == [alone_free, alone_tied]
    jsonschema.validate(json.loads(alone_tied), PERSON)
    with pytest.raises(ValueError):
        json.loads(alone_free)


def test_uncompilable_constraint_is_a_value_error_and_the_engine_goes_on(llm):
    for so in (SO(json={"not": {"type": "string"}}), SO(regex="(["),
               SO(grammar="start: missing"), SO(json={"$ref": "#/$defs/nowhere"})):
        with pytest.raises(ValueError, match="cannot be compiled"):
            llm.generate(["x"], SamplingParams(structured_outputs=so), use_tqdm=False)
    out = llm.generate(["x"], SamplingParams(max_tokens=8, structured_outputs=SO(choice=["ok"])),
                       use_tqdm=False)
    assert _texts(out) == ["ok"]


def test_no_tokenizer_is_a_clear_error():
    llm = LLM(skip_tokenizer_init=True, num_kv_blocks=32)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                     SamplingParams(structured_outputs=SO(choice=["a"])), use_tqdm=False)


def _run(engine, reqs):
    done = run_to_end(engine, reqs)
    engine.check_integrity()
    return done


def _requests(n=12, seed=0):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        sp = SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=80,
                            structured_outputs=SO(json=PERSON))
        reqs.append(AddRequest(f"r{i}", f"Person number {i}, {rng.choice(['a', 'b'])}, as JSON:",
                               sp))
    return reqs


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_preemption_and_async_scheduling_keep_the_grammar(async_scheduling):
    """A pool too small for the batch preempts sequences mid-answer: their outputs still
    validate and equal those of a pool big enough for all (greedy and seeded rows)."""
    common = dict(async_scheduling=async_scheduling, max_num_batched_tokens=64, block_size=4)
    big = LLMEngine(EngineConfig(num_kv_blocks=1024, **common))
    ref = _run(big, _requests(8))
    small = LLMEngine(EngineConfig(num_kv_blocks=40, **common))
    got = _run(small, _requests(8))
    assert small.scheduler.num_preemptions > 0 and big.scheduler.num_preemptions == 0
    for rid, o in ref.items():
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
        assert got[rid].outputs[0].text == o.outputs[0].text, rid


def test_pd_hand_off_continues_the_grammar(tmp_path):
    """Prefill (and the first token) on P, the rest on D after the KV pull: the same JSON as one
    engine, and the decode side's first tokens were constrained by the producer's state."""
    cfg = EngineConfig(kv_connector="shared", num_kv_blocks=256, block_size=4)
    P, D = LLMEngine(cfg), LLMEngine(cfg)
    D.connect_kv([P.kv_export("p")])
    for i, req in enumerate(_requests(2, seed=1)):
        ref = _run(P, [dataclasses.replace(req, request_id=f"ref{i}")])[f"ref{i}"]
        first = _run(P, [dataclasses.replace(
            req, params=dataclasses.replace(req.params, max_tokens=1), kv_hold=True)])[
            req.request_id]
        src = msgspec.structs.replace(first.kv_transfer, worker="p")
        out = _run(D, [dataclasses.replace(req, kv_source=src)])[req.request_id]
        P.release_kv([req.request_id])
        assert out.outputs[0].text == ref.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
