"""Tool calling on /v1/chat/completions against a live `pdserve serve` (embedded SmolLM2, whose
own template ignores tools, so a small Hermes-style template is given with --chat-template):
tool_choice required and a named function are enforced (the calls' arguments validate against
the tools' parameter schemas with jsonschema), streamed deltas assemble to the non-streamed
message, auto is the parser applied to what the model writes, the official openai client reads
tool_calls objects, the template sees tool_calls' arguments as objects, and bad tools are 400s
after which the server keeps serving."""
import json

import pytest

httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from pdserve.server.tool_parsers import HermesToolParser  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}}
CONVERT = {"type": "function", "function": {
    "name": "convert", "description": "Convert an amount between currencies.",
    "parameters": {"type": "object", "properties": {
        "amount": {"type": "number", "minimum": 0, "maximum": 1000},
        "to": {"enum": ["EUR", "USD", "JPY"]}},
        "required": ["amount", "to"], "additionalProperties": False}}}
TOOLS = [WEATHER, CONVERT]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
ASK_MONEY = [{"role": "user", "content": "How many yen are 20 dollars?"}]


@pytest.fixture
def server(tools_server):
    return tools_server


def _post(base, body, path="/v1/chat/completions"):
    return httpx.post(base + path, json=body, timeout=120)


def _chat(base, **kw):
    r = _post(base, {"max_tokens": 60, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _streamed(base, **kw):
    """The streamed choice assembled as OpenAI clients assemble it."""
    body = {"max_tokens": 60, "temperature": 0, "stream": True, **kw}
    content, calls, finish = "", {}, None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            (choice,) = chunk["choices"]
            delta = choice["delta"]
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls") or ():
                i = piece["index"]
                if i not in calls:   # a call's first piece carries id, type and name
                    assert i == len(calls)
                    assert piece["id"].startswith("call_") and piece["type"] == "function"
                    calls[i] = {"name": piece["function"]["name"], "arguments": ""}
                else:
                    assert set(piece) == {"index", "function"} and "name" not in piece["function"]
                calls[i]["arguments"] += piece["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def _calls(choice):
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in choice["message"]["tool_calls"]]


def _check_valid(calls, names):
    assert calls
    for c in calls:
        assert c["name"] in names
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_named_tool_choice_is_enforced_and_streams_alike(server):
    name, messages = "get_weather", ASK
    choice_field = {"type": "function", "function": {"name": name}}
    choice = _chat(server, messages=messages, tools=TOOLS, tool_choice=choice_field)
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None      # (the stop token is no text)
    calls = _calls(choice)
    assert len(calls) == 1
    _check_valid(calls, {name})
    for c in choice["message"]["tool_calls"]:
        assert c["id"].startswith("call_") and c["type"] == "function"
    content, streamed, finish = _streamed(server, messages=messages, tools=TOOLS,
                                          tool_choice=choice_field)
    assert (content, streamed, finish) == (choice["message"]["content"], calls, "tool_calls")


def test_required_makes_calls_of_the_tools(server):
    choice = _chat(server, messages=ASK, tools=TOOLS, tool_choice="required",
                   parallel_tool_calls=False)
    calls = _calls(choice)
    assert len(calls) == 1 and choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    _check_valid(calls, set(SCHEMAS))
    assert _streamed(server, messages=ASK, tools=TOOLS, tool_choice="required",
                     parallel_tool_calls=False) == (choice["message"]["content"], calls,
                                                    "tool_calls")


def test_auto_is_the_parser_on_the_model_output(server):
    """tool_choice none renders the same prompt (tools included, as vLLM does) and does not
    parse: its text, through the parser, is auto's answer (greedy, so one generation)."""
    short = {"messages": ASK, "tools": TOOLS, "max_tokens": 12}
    raw = _chat(server, **short, tool_choice="none")
    assert "tool_calls" not in raw["message"] and isinstance(raw["message"]["content"], str)
    auto = _chat(server, **short)       # auto: the default with tools
    want = HermesToolParser().extract(raw["message"]["content"])
    assert auto["message"]["content"] == want.content
    assert _calls(auto) == [{"name": c.name, "arguments": c.arguments} for c in want.calls]
    content, calls, _ = _streamed(server, **short, tool_choice="auto")
    assert (content, calls) == (want.content, _calls(auto))


def test_openai_client_reads_tool_calls(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    kw = dict(model="SmolLM2-135M-Instruct", messages=ASK_MONEY, tools=TOOLS, max_tokens=60,
              temperature=0, tool_choice={"type": "function", "function": {"name": "convert"}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "convert"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["convert"])
    # streamed: the client's delta objects, assembled
    name, args, finish = None, "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or ():
            assert d.index == 0
            name = d.function.name or name
            args += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, args, finish) == ("convert", call.function.arguments, "tool_calls")
    # the call and its result go back in, as a client's next turn sends them
    convo = [*ASK_MONEY, msg.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "2900 JPY"}]
    r2 = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=convo,
                                        tools=TOOLS, tool_choice="none", max_tokens=3)
    assert isinstance(r2.choices[0].message.content, str)


def test_template_gets_arguments_as_an_object(server):
    """OpenAI's arguments string reaches the template as an object (rendered by tojson as
    JSON, not as a quoted string)."""
    convo = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    r = _post(server, {"messages": convo, "tools": TOOLS}, "/tokenize")
    assert r.status_code == 200, r.text
    text = _post(server, {"tokens": r.json()["tokens"]}, "/detokenize").json()["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}' in text
    assert "<tool_response>\nrain\n</tool_response>" in text and '"name": "convert"' in text
    bad = [*convo[:1], {**convo[1], "tool_calls": [{**convo[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": "{city"}}]}]
    r = _post(server, {"messages": bad, "max_tokens": 1})
    assert r.status_code == 400 and "arguments is not valid JSON" in r.json()["error"]["message"]


def _named(name):
    return {"type": "function", "function": {"name": name}}


BAD = [
    ({"tools": WEATHER}, "tools"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "name"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "string"}}}]},
     "of an object"),
    ({"tools": [WEATHER, WEATHER]}, "unique"),
    ({"tools": TOOLS, "tool_choice": _named("nope")}, "not among the tools"),
    ({"tool_choice": _named("get_weather")}, "not among the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "no other output constraint"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}],
      "tool_choice": "required"}, "cannot be compiled"),
    ({"functions": [WEATHER["function"]]}, "use tools and tool_choice"),
    ({"function_call": "auto"}, "use tools and tool_choice"),
]


@pytest.mark.parametrize("extra, words", BAD, ids=[w for _, w in BAD])
def test_bad_tools_are_400(server, extra, words):
    r = _post(server, {"messages": ASK, "max_tokens": 1, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and words in err["message"], err
    assert _post(server, {"messages": ASK, "max_tokens": 1}).status_code == 200


def test_tools_are_a_chat_field(server):
    r = _post(server, {"prompt": "Hi", "max_tokens": 1, "tools": TOOLS}, "/v1/completions")
    assert r.status_code == 400 and "chat completions field" in r.json()["error"]["message"]
