"""Structured outputs through a live `pdserve serve` (embedded SmolLM2), as a client sends them:
response_format json_schema on chat (non-streamed, streamed, n > 1), vLLM's structured_outputs
and guided_choice on completions, the official openai client (create, the pydantic parse
helper, extra_body), and an uncompilable schema as a 400 after which the server keeps serving.
What is checked comes from outside pdserve: jsonschema validates, Python's re matches."""
import json
import re

import pytest

httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "SmolLM2-135M-Instruct"
# small bounds keep the outputs to a dozen tokens (a CPU test); required and closed, so a
# valid output is exactly these two members
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 2, "maxLength": 8},
    "age": {"type": "integer", "minimum": 18, "maximum": 99}},
    "required": ["name", "age"], "additionalProperties": False}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture
def server(small_server):
    return small_server


def _post(base, body, path="/v1/chat/completions"):
    r = httpx.post(base + path, json={"max_tokens": 40, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _valid_person(text):
    value = json.loads(text)
    jsonschema.validate(value, PERSON)
    return value


def test_json_schema_chat_streams_the_same_valid_object(server):
    (choice,) = _post(server, {"messages": ASK, "response_format": PERSON_FORMAT})["choices"]
    assert choice["finish_reason"] == "stop", choice
    content = choice["message"]["content"]
    _valid_person(content)
    streamed, finish = "", None
    body = {"messages": ASK, "response_format": PERSON_FORMAT, "max_tokens": 40,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            (c,) = json.loads(line[6:])["choices"]
            streamed += c["delta"].get("content") or ""
            finish = c["finish_reason"] or finish
    assert (streamed, finish) == (content, "stop")


def test_json_schema_holds_for_each_of_n_sampled_choices(server):
    out = _post(server, {"messages": ASK, "response_format": PERSON_FORMAT, "n": 3,
                         "temperature": 1.0, "seed": 11})
    assert len(out["choices"]) == 3
    for c in out["choices"]:
        assert c["finish_reason"] == "stop", c
        _valid_person(c["message"]["content"])


# (field, prompt, the constraint, the pattern its text must match in full): a code the model
# would not write unprompted, and choices that are not its greedy continuation
COMPLETIONS = [
    ("structured_outputs", "The licence plate reads", {"regex": r"[A-Z]{2}-[0-9]{3}"},
     r"[A-Z]{2}-[0-9]{3}"),
    ("structured_outputs", "The sky is", {"choice": ["purple", "green"]}, r"purple|green"),
    ("guided_choice", "My favourite fruit is", ["kiwi", "plum", "fig"], r"kiwi|plum|fig"),
]


@pytest.mark.parametrize("field, prompt, constraint, pattern", COMPLETIONS,
                         ids=["regex", "choice", "guided_choice"])
def test_completions_text_matches_the_constraint(server, field, prompt, constraint, pattern):
    (choice,) = _post(server, {"prompt": prompt, field: constraint, "max_tokens": 12},
                      "/v1/completions")["choices"]
    assert re.fullmatch(pattern, choice["text"]), choice
    assert choice["finish_reason"] == "stop"


def test_openai_client_structured_outputs(server):
    openai = pytest.importorskip("openai")
    from pydantic import BaseModel, Field
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    r = client.chat.completions.create(model=MODEL, messages=ASK, response_format=PERSON_FORMAT,
                                       max_tokens=40, temperature=0)
    _valid_person(r.choices[0].message.content)

    class City(BaseModel):
        name: str = Field(min_length=2, max_length=10)
        population: int = Field(ge=1, le=999)

    # the pydantic helper (chat.completions.parse in openai >= 1.92, beta.chat before) sends
    # the model's strict schema and parses the reply into the model
    helper = (client.chat.completions if hasattr(client.chat.completions, "parse")
              else client.beta.chat.completions)
    r = helper.parse(model=MODEL, response_format=City, max_tokens=40, temperature=0,
              messages=[{"role": "user", "content": "Name a city and its population."}])
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and 2 <= len(city.name) <= 10 and 1 <= city.population <= 999
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=5,
        temperature=0, extra_body={"structured_outputs": {"choice": ["maybe", "never"]}})
    assert r.choices[0].message.content in ("maybe", "never")


def test_uncompilable_schema_is_a_400_and_the_server_keeps_serving(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, response_format=bad,
                                       max_tokens=5)
    assert e.value.status_code == 400 and "cannot be compiled" in e.value.message
    r = httpx.post(server + "/v1/completions", timeout=60, json={
        "prompt": "x", "max_tokens": 1, "structured_outputs": {"json": {"not": {}}}})
    assert r.status_code == 400 and "cannot be compiled" in r.json()["error"]["message"], r.text
    (choice,) = _post(server, {"prompt": "x", "max_tokens": 3, "guided_choice": ["ok", "no"]},
                      "/v1/completions")["choices"]
    assert choice["text"] in ("ok", "no")
