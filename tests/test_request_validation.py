"""The server's request schema against a live `pdserve serve` (embedded SmolLM2, one worker):
values of the wrong JSON type are 400s, not coerced (true is no token id, "yes" no boolean);
chat roles and content parts are OpenAI's; stop_token_ids outside the vocabulary are the
engine's 400; fields pdserve cannot honour (audio, beam search, legacy functions, ...) are
refused by name instead of ignored, tool fields are accepted (tests/test_tool_calling.py tests
what they do), and an output constraint the grammar engine cannot compile is a 400
with its reason. Every 400 carries the OpenAI error body, and the
server keeps answering normal requests after each."""
import pytest

httpx = pytest.importorskip("httpx")

VOCAB = 49152  # SmolLM2's
USER = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(small_server):
    return small_server   # (conftest.py: one server for this module and the conformance tests)


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120)


def _assert_still_serving(base: str) -> None:
    r = _post(base, "/v1/completions", {"prompt": "Hello", "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


def _chat(**kw) -> dict:
    return {"messages": USER, "max_tokens": 1, **kw}


def _cmpl(**kw) -> dict:
    return {"prompt": "Hi", "max_tokens": 1, **kw}


# (path, body, words the error message must contain)
COERCED = [
    # token ids and integer fields: a JSON bool or a numeric string is not an integer
    ("/v1/completions", {"prompt": [True, False], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [[5, True]], "max_tokens": 1}, "prompt"),
    ("/v1/completions", _cmpl(stop_token_ids=[True]), "stop_token_ids"),
    ("/v1/completions", _cmpl(stop_token_ids=["7"]), "stop_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", _cmpl(n="2"), "n"),
    ("/v1/completions", _cmpl(n=True), "n"),
    ("/v1/completions", _cmpl(logprobs=True), "logprobs"),
    ("/v1/completions", _cmpl(logprobs="2"), "logprobs"),
    ("/v1/completions", _cmpl(seed="3"), "seed"),
    ("/v1/completions", _cmpl(seed=False), "seed"),
    ("/v1/completions", _cmpl(min_tokens=True), "min_tokens"),
    ("/v1/completions", _cmpl(top_k="5"), "top_k"),
    ("/v1/completions", _cmpl(best_of=True), "best_of"),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs="2"), "top_logprobs"),
    ("/v1/chat/completions", _chat(max_completion_tokens=True), "max_completion_tokens"),
    ("/detokenize", {"tokens": [True, 5]}, "tokens"),
    ("/detokenize", {"tokens": ["5"]}, "tokens"),
    # floats take numbers (ints too), not strings or bools
    ("/v1/completions", _cmpl(temperature="0.5"), "temperature"),
    ("/v1/completions", _cmpl(top_p=True), "top_p"),
    # booleans: only true / false
    ("/v1/completions", _cmpl(stream="yes"), "stream"),
    ("/v1/completions", _cmpl(stream=1), "stream"),
    ("/v1/completions", _cmpl(echo="true"), "echo"),
    ("/v1/completions", _cmpl(ignore_eos=1), "ignore_eos"),
    ("/v1/completions", _cmpl(skip_special_tokens="no"), "skip_special_tokens"),
    ("/v1/completions", _cmpl(stream=True, stream_options={"include_usage": "yes"}),
     "include_usage"),
    ("/v1/chat/completions", _chat(logprobs="yes"), "logprobs"),
    ("/v1/chat/completions", _chat(add_generation_prompt=0), "add_generation_prompt"),
    ("/v1/chat/completions", _chat(stream="false"), "stream"),
    ("/tokenize", {"prompt": "Hi", "add_special_tokens": "false"}, "add_special_tokens"),
    ("/tokenize", {"messages": USER, "add_generation_prompt": 1}, "add_generation_prompt"),
]

MESSAGES = [
    ([{"role": "wizard", "content": "x"}], "role"),
    ([{"role": "function", "content": "x"}], "role"),
    ([{"content": "no role"}], "role"),
    ([{"role": 5, "content": "x"}], "role"),
    ([{"role": "user"}], "content"),
    ([{"role": "user", "content": None}], "content"),
    ([{"role": "system", "content": None}, *USER], "content"),
    ([{"role": "user", "content": 5}], "content"),
    ([{"role": "user", "content": [{"type": "image_url",
                                    "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
     "image_url content parts are not supported"),
    ([{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                   {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
     "image_url content parts are not supported"),
    ([{"role": "user", "content": [{"type": "input_audio",
                                    "input_audio": {"data": "AAAA", "format": "wav"}}]}],
     "input_audio content parts are not supported"),
    ([{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}],
     "file content parts are not supported"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "text"),
    ([{"role": "user", "content": [{"type": "text"}]}], "text"),
    ([{"role": "user", "content": [{"text": "no type"}]}], "type"),
    ([{"role": "user", "content": ["a bare string"]}], "content"),
]
ROLES_AND_CONTENT = [("/v1/chat/completions", _chat(messages=m), w) for m, w in MESSAGES] + [
    ("/tokenize", {"messages": m}, w) for m, w in MESSAGES]

OUT_OF_VOCAB = [
    ("/v1/completions", _cmpl(stop_token_ids=[VOCAB]), "stop_token_ids"),
    ("/v1/completions", _cmpl(stop_token_ids=[2, 10 ** 6]), "stop_token_ids"),
    ("/v1/completions", _cmpl(stop_token_ids=[-1]), "stop_token_ids"),
    ("/v1/chat/completions", _chat(stop_token_ids=[10 ** 6]), "stop_token_ids"),
    ("/v1/completions", _cmpl(stop_token_ids=[VOCAB], stream=True), "stop_token_ids"),
    ("/v1/completions", _cmpl(logit_bias={str(VOCAB): 5}), "logit_bias: token id 49152 is "
                                                           "outside the vocabulary"),
    ("/v1/chat/completions", _chat(logit_bias={str(10 ** 12): -1}), "outside the vocabulary"),
    ("/v1/chat/completions", _chat(logit_bias={"9" * 30: -1}), "logit_bias keys"),
    ("/v1/completions", _cmpl(logit_bias={"-3": 5}), "logit_bias keys"),
    ("/v1/completions", _cmpl(logit_bias={"tok": 5}), "logit_bias keys"),
    ("/v1/completions", _cmpl(logit_bias={"50": 101}), "[-100, 100]"),
    ("/v1/chat/completions", _chat(logit_bias={"50": "5"}), "logit_bias"),
    ("/v1/chat/completions", _chat(logit_bias=[50]), "logit_bias"),
]


def test_logit_bias_forces_a_token(server):
    """A +100 bias outweighs any logit of the model: greedy output is that token, repeated; on
    another token, that one (so the bias, not the prompt, decides)."""
    for tok in (1234, 777):
        r = _post(server, "/v1/completions", _cmpl(prompt="The sea is", max_tokens=3,
                                                  logit_bias={str(tok): 100}))
        assert r.status_code == 200, r.text
        want = _post(server, "/detokenize", {"tokens": [tok] * 3}).json()["prompt"]
        assert r.json()["choices"][0]["text"] == want

TOOL = {"type": "function", "function": {"name": "get_weather",
                                         "parameters": {"type": "object", "properties": {}}}}
REFUSED = [
    # the legacy function-calling fields (tools and tool_choice replace them)
    ("/v1/chat/completions", _chat(functions=[TOOL["function"]]), "functions"),
    ("/v1/chat/completions", _chat(function_call="auto"), "function_call"),
    ("/v1/chat/completions", _chat(tool_choice={"type": "function",
                                                "function": {"name": "get_weather"}}),
     "not among the tools"),
    ("/v1/completions", _cmpl(tools=[TOOL]), "chat completions field"),
    # output constraints that cannot be honoured: the grammar engine's reason, or ours
    ("/v1/chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"not": {"type": "string"}}}}), "cannot be compiled"),
    ("/v1/completions", _cmpl(structured_outputs={"json": {"type": "integer", "minimum": 5,
                                                           "maximum": 1}}), "cannot be compiled"),
    ("/v1/completions", _cmpl(guided_regex="([a-z"), "cannot be compiled"),
    ("/v1/completions", _cmpl(structured_outputs={"grammar": "start: missing_rule"}),
     "cannot be compiled"),
    ("/v1/completions", _cmpl(structured_outputs={"regex": "a", "choice": ["b"]}),
     "exactly one of"),
    ("/v1/completions", _cmpl(structured_outputs={"json_schema": {}}), "unsupported fields"),
    ("/v1/completions", _cmpl(structured_outputs={"choice": []}), "choice"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_schema"}), "json_schema"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_object"},
                                   guided_choice=["a"]), "one output constraint"),
    ("/v1/chat/completions", _chat(response_format={"type": "xml"}), "response_format"),
    ("/v1/completions", _cmpl(prompt_logprobs=1), "prompt_logprobs"),
    ("/v1/chat/completions", _chat(prompt_logprobs=1), "prompt_logprobs"),
    ("/v1/chat/completions", _chat(continue_final_message=True), "continue_final_message"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), "image_url"),
    # more output pdserve would not produce
    ("/v1/chat/completions", _chat(modalities=["text", "audio"]), "modalities"),
    ("/v1/chat/completions", _chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
    ("/v1/completions", _cmpl(guided_whitespace_pattern=" "), "guided_whitespace_pattern"),
    ("/v1/completions", _cmpl(use_beam_search=True), "use_beam_search"),
    ("/v1/completions", _cmpl(include_stop_str_in_output=True), "include_stop_str_in_output"),
    ("/v1/completions", _cmpl(allowed_token_ids=[1, 2]), "allowed_token_ids"),
    ("/v1/completions", _cmpl(bad_words=["x"]), "bad_words"),
    ("/v1/completions", _cmpl(logits_processors=["m.P"]), "logits_processors"),
    ("/v1/completions", _cmpl(truncate_prompt_tokens=4), "truncate_prompt_tokens"),
    ("/v1/chat/completions", _chat(echo=True), "echo"),
    ("/v1/chat/completions", _chat(add_special_tokens=True), "add_special_tokens"),
    ("/v1/chat/completions", _chat(chat_template="{{ messages }}"), "chat_template"),
    ("/v1/chat/completions", _chat(chat_template_kwargs={"enable_thinking": False}),
     "chat_template_kwargs"),
]

BAD = COERCED + ROLES_AND_CONTENT + OUT_OF_VOCAB + REFUSED


@pytest.mark.parametrize("path, body, words", BAD,
                         ids=[f"{i}:{p}:{w[:40]}" for i, (p, _, w) in enumerate(BAD)])
def test_rejected_with_openai_error(server, path, body, words):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and err["code"] == 400, err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert words in err["message"], err["message"]
    _assert_still_serving(server)


def _chat_text(base: str, **kw) -> str:
    r = _post(base, "/v1/chat/completions", {"max_tokens": 2, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_neutral_values_and_client_extras_accepted(server):
    plain = _chat_text(server, messages=USER)
    for extra in ({"response_format": {"type": "text"}}, {"tool_choice": "none"},
                  {"tools": [], "tool_choice": "none"}, {"logit_bias": {}},
                  {"continue_final_message": False}, {"parallel_tool_calls": None},
                  {"modalities": ["text"], "echo": False, "add_special_tokens": False,
                   "use_beam_search": False, "chat_template_kwargs": {}},
                  {"user": "u-1", "metadata": {"k": "v"}, "store": False,
                   "service_tier": "auto"}):
        assert _chat_text(server, messages=USER, **extra) == plain, extra
    r = _post(server, "/v1/completions", _cmpl(response_format={"type": "text"}, user="u-1",
                                              logit_bias={}))
    assert r.status_code == 200, r.text


def test_tool_fields_accepted(server):
    """The embedded model's template ignores tools, so its prompt is the plain one: with
    tool_choice auto its text comes back parsed (no call in a two-token answer); required and
    a named function are constrained outputs (here cut at max_tokens)."""
    plain = _chat_text(server, messages=USER)
    for extra in ({"tools": [TOOL]}, {"tools": [TOOL], "tool_choice": "auto",
                                      "parallel_tool_calls": True}):
        r = _post(server, "/v1/chat/completions", {"max_tokens": 2, "temperature": 0,
                                                   "messages": USER, **extra})
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["tool_calls"] == [] and msg["content"] == (plain.strip() or None), extra
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = _post(server, "/v1/chat/completions", _chat(tools=[TOOL], tool_choice=choice,
                                                        max_tokens=2))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"


def test_text_content_parts_are_the_text(server):
    plain = _chat_text(server, messages=USER)
    parts = [{"role": "user", "content": [{"type": "text", "text": USER[0]["content"]}]}]
    assert _chat_text(server, messages=parts) == plain
    tok = [_post(server, "/tokenize", {"messages": m}).json()["tokens"] for m in (USER, parts)]
    assert tok[0] == tok[1]


def test_openai_roles_accepted(server):
    convo = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function",
                  "function": {"name": "weather", "arguments": "{}"}}]},
             {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
             {"role": "system", "content": "Answer in one word."},
             {"role": "user", "content": "So?"}]
    assert isinstance(_chat_text(server, messages=convo), str)
    # an assistant message without content renders as an empty one, in chat and in /tokenize
    empty = [*USER, {"role": "assistant", "content": ""}, *USER]
    null = [*USER, {"role": "assistant", "content": None}, *USER]
    assert _chat_text(server, messages=null) == _chat_text(server, messages=empty)
    counts = [_post(server, "/tokenize", {"messages": m}) for m in (empty, null)]
    assert [c.status_code for c in counts] == [200, 200], [c.text for c in counts]
    assert counts[0].json()["tokens"] == counts[1].json()["tokens"]


def test_numbers_json_schema_allows(server):
    """An integral float is an integer to JSON Schema (and to the schema the server publishes);
    an int is a number."""
    assert _post(server, "/reset_prefix_cache", {}).status_code == 200   # (cached_tokens: 0)
    r = _post(server, "/v1/completions", {"prompt": [1, 2, 3.0], "max_tokens": 2.0,
                                          "temperature": 0, "top_p": 1, "seed": 7.0,
                                          "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
    r = _post(server, "/v1/completions", _cmpl(stop_token_ids=[VOCAB - 1]))
    assert r.status_code == 200, r.text


def test_schema_states_the_constraints(server):
    """The constraints are in /openapi.json, where schema-driven clients and fuzzers see them."""
    spec = httpx.get(server + "/openapi.json").json()
    schemas = spec["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["stream"]["type"] == "boolean"
    roles = set()
    for ref in chat["messages"]["items"]["oneOf"]:
        roles |= {schemas[ref["$ref"].rsplit("/", 1)[1]]["properties"]["role"]["const"]}
    assert roles == {"system", "developer", "user", "assistant", "tool"}
    fmt = schemas[chat["response_format"]["anyOf"][0]["$ref"].rsplit("/", 1)[1]]
    assert set(fmt["properties"]["type"]["enum"]) == {"text", "json_object", "json_schema"}


def _metric(base: str, query: str) -> float:
    from .utils import metric_value
    text = httpx.get(base + "/metrics", timeout=30).text
    assert query.partition("{")[0] in text, f"{query} is not exposed"
    return metric_value(text, query)


def test_prefix_cache_usage_metrics_and_reset(server):
    """The second of two chat requests with one long system prompt reports the shared prompt
    tokens as cached, on both endpoints' usage; the metrics count them; a reset empties it."""
    system = {"role": "system", "content": "You are a meticulous assistant for prefix tests. " * 4}
    body = lambda q: {"messages": [system, {"role": "user", "content": q}],   # noqa: E731
                      "max_tokens": 2, "temperature": 0}
    assert _post(server, "/reset_prefix_cache", {}).status_code == 200
    hits0 = _metric(server, "pdserve:prefix_cache_hits_total")
    first = _post(server, "/v1/chat/completions", body("One?")).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = _post(server, "/v1/chat/completions", body("Two?")).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 30 < cached < second["usage"]["prompt_tokens"]
    assert _metric(server, "pdserve:prefix_cache_hits_total") >= hits0 + cached
    assert _metric(server, "pdserve:prefix_cache_blocks") > 0
    prompt = "Completions share the cache too: " + "a fixed preamble, " * 12
    _post(server, "/v1/completions", {"prompt": prompt + "x", "max_tokens": 1, "temperature": 0})
    again = _post(server, "/v1/completions", {"prompt": prompt + "y", "max_tokens": 1, "temperature": 0})
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 20
    reset = _post(server, "/reset_prefix_cache", {})
    assert reset.status_code == 200 and reset.json()["num_blocks_freed"] > 0
    assert _metric(server, "pdserve:prefix_cache_blocks") == 0
    after = _post(server, "/v1/chat/completions", body("Two?")).json()
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _assert_still_serving(server)
