"""The Hermes tool-call parser on hand-written outputs (expected calls written out by hand), and
its streamer fed each text split at every character boundary (and one character at a time)
giving the same calls and content as extract(); its constraint grammar accepts the calls it
describes and refuses others, arguments with members the tool does not declare among them
(checked with llguidance over the embedded tokenizer)."""
import json

import pytest

from pdserve.server.tool_parsers import (ExtractedToolCalls, HermesToolParser,
                                         Llama3JsonToolParser, ToolCall, ToolSpec,
                                         get_tool_parser, parser_for_template)

P = HermesToolParser()

W = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
T = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'
# (text, content, [(name, arguments text)])
CASES = [
    ("Hello there.", "Hello there.", []),
    (f"<tool_call>\n{W}\n</tool_call>", None,
     [("get_weather", '{"city": "Paris", "days": 3}')]),
    (f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>", None,
     [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"tz": "Europe/Paris"}')]),
    (f"Let me check.\n<tool_call>\n{W}\n</tool_call>", "Let me check.",
     [("get_weather", '{"city": "Paris", "days": 3}')]),
    (f"  Before <tool_call>{W}</tool_call> after  ", "Before  after",
     [("get_weather", '{"city": "Paris", "days": 3}')]),
    # compact JSON, nested values, braces and tags inside strings, escapes
    ('<tool_call>{"name":"f","arguments":{"a":[1,{"b":"}{"}],"s":"x\\"y <tool_call>"}}'
     '</tool_call>', None, [("f", '{"a":[1,{"b":"}{"}],"s":"x\\"y <tool_call>"}')]),
    # arguments before the name; no arguments at all
    ('<tool_call>{"arguments": {"q": 1}, "name": "g"}</tool_call>', None, [("g", '{"q": 1}')]),
    ('<tool_call>{"name": "h"}</tool_call>', None, [("h", "{}")]),
    # the output ends without the closing tag, the JSON whole
    (f"<tool_call>\n{W}\n", None, [("get_weather", '{"city": "Paris", "days": 3}')]),
    # malformed calls stay content
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ('<tool_call>{"name": 5, "arguments": {}}</tool_call>',
     '<tool_call>{"name": 5, "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    (f"x <tool_call>oops</tool_call> <tool_call>{T}</tool_call>", "x <tool_call>oops</tool_call>",
     [("get_time", '{"tz": "Europe/Paris"}')]),
    ("a <tool_cal b", "a <tool_cal b", []),
    ("ends with <tool_call", "ends with <tool_call", []),
    ("", None, []),
]
# Broken after the head was read: a streamer has announced the call (see test_stream_of_a_broken_
# announced_call_does_not_crash), extract() keeps it as content.
BROKEN_LATE = [
    ('<tool_call>{"name": "f", "arguments": {}} extra</tool_call>',
     '<tool_call>{"name": "f", "arguments": {}} extra</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": {"a": 1',
     '<tool_call>{"name": "f", "arguments": {"a": 1', []),
]

L = Llama3JsonToolParser()
LW = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
LLAMA = [
    ("Hello there.", "Hello there.", []),
    (LW, None, [("get_weather", '{"city": "Paris", "days": 3}')]),
    (f"  <|python_tag|>{LW}; {T}\n", None,
     [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"tz": "Europe/Paris"}')]),
    ('{"name":"f","parameters":{"s":"}{;"}};{"name":"g","parameters":{}}', None,
     [("f", '{"s":"}{;"}'), ("g", "{}")]),
    ('{"parameters": {"a": 1}, "name": "f"}', None, [("f", '{"a": 1}')]),
    ('{"name": "f"}', None, [("f", "{}")]),
    ("{not json", "{not json", []),
    ('{"name": 5, "parameters": {}}', '{"name": 5, "parameters": {}}', []),
    (f"Sure: {LW}", f"Sure: {LW}", []),
    ("<|python_", "<|python_", []),
    ("  ", None, []),
]
LLAMA_BROKEN_LATE = [
    (f"{LW} trailing", f"{LW} trailing", []),
    ('{"name": "f", "parameters": {"a": 1', '{"name": "f", "parameters": {"a": 1', []),
]
EQUAL = [(P, *c) for c in CASES] + [(L, *c) for c in LLAMA]
ALL = EQUAL + [(P, *c) for c in BROKEN_LATE] + [(L, *c) for c in LLAMA_BROKEN_LATE]


def _ids(cases):
    return [f"{p.name}:{t[:30]!r}" for p, t, *_ in cases]


def _want(content, calls):
    return ExtractedToolCalls(content, tuple(ToolCall(n, a) for n, a in calls))


@pytest.mark.parametrize("parser, text, content, calls", ALL, ids=_ids(ALL))
def test_extract(parser, text, content, calls):
    got = parser.extract(text)
    assert got == _want(content, calls)
    for call in got.calls:
        assert isinstance(json.loads(call.arguments), dict)


def _streamed(pieces, parser=P):
    s = parser.streamer()
    content, calls = [], {}
    for d in [s.feed(p) for p in pieces] + [s.finish()]:
        content.append(d.content)
        for c in d.calls:
            if c.name is not None:
                assert c.index not in calls and c.index == len(calls)   # announced once, in order
                calls[c.index] = [c.name, ""]
            else:
                assert c.index in calls
            calls[c.index][1] += c.arguments
    assert s.num_calls == len(calls)
    return ExtractedToolCalls("".join(content) or None,
                              tuple(ToolCall(n, a) for n, a in calls.values()))


@pytest.mark.parametrize("parser, text, content, calls", EQUAL, ids=_ids(EQUAL))
def test_streamed_equals_extract_at_every_split(parser, text, content, calls):
    want = _want(content, calls)
    assert _streamed(list(text), parser) == want
    for k in range(len(text) + 1):
        assert _streamed([text[:k], text[k:]], parser) == want, k


def test_stream_announces_a_call_before_its_end():
    """The name goes out once the head is read, arguments piece by piece, not at the close."""
    s = P.streamer()
    d = s.feed('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert d.content == "Sure."
    assert [(c.index, c.name, c.arguments) for c in d.calls] == [(0, "get_weather", '{"ci')]
    d = s.feed('ty": "Oslo"}}\n</tool_call>')
    assert [(c.index, c.name, c.arguments) for c in d.calls] == [(0, None, 'ty": "Oslo"}')]
    assert not s.finish()


def test_stream_of_a_broken_announced_call_does_not_crash():
    """Once announced, a call cannot be taken back (the contract says so): the stream goes on."""
    s = P.streamer()
    s.feed('<tool_call>{"name": "f", "arguments": {"a": }')
    d = s.feed("</tool_call> then text")
    assert d.content == "then text" and s.num_calls == 1
    assert P.extract('<tool_call>{"name": "f", "arguments": {"a": }</tool_call> then text') == \
        _want('<tool_call>{"name": "f", "arguments": {"a": }</tool_call> then text', [])


def test_llama3_stream_announces_a_call_before_its_end():
    s = L.streamer()
    d = s.feed('{"name": "f", "parameters": {"x"')
    assert [(c.index, c.name, c.arguments) for c in d.calls] == [(0, "f", '{"x"')]
    d = s.feed(': 1}}; {"name": "g", "parameters": {}}')
    assert [(c.index, c.name, c.arguments) for c in d.calls] == [(0, None, ": 1}"), (1, "g", "{}")]


def test_registry():
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    assert isinstance(get_tool_parser("llama3_json"), Llama3JsonToolParser)
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        get_tool_parser("nope")
    # by the chat template: what Qwen2.5's and Llama 3.1's write, else hermes
    assert parser_for_template('{{- \'<tool_call>\\n{"name": "\' }}') == "hermes"
    assert parser_for_template("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert parser_for_template("{{ messages }}") == parser_for_template(None) == "hermes"
    from pdserve.server.http import ServeOptions
    with pytest.raises(ValueError, match="known: hermes, llama3_json"):
        ServeOptions(tool_call_parser="nope")


# ---- the constraint grammar ---------------------------------------------------------------------
WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city", "days"]})
ADD = ToolSpec("add", {"type": "object", "properties": {"x": {"$ref": "#/$defs/num"}},
                       "required": ["x"], "$defs": {"num": {"type": "integer"}}})


@pytest.fixture(scope="module")
def compiler():
    from pdserve.loader.default_model import default_gguf_path
    from pdserve.loader.tokenizer import Tokenizer
    from pdserve.structured.grammar import GrammarCompiler
    try:
        tok = Tokenizer.from_gguf_file(default_gguf_path())
    except ValueError as e:
        pytest.skip(str(e))
    return tok, GrammarCompiler(tok, tok.vocab_size, [tok.eos_token_id])


def _accepts(compiler, spec, text) -> bool:
    tok, gc = compiler
    m = gc.matcher(spec)
    return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)) \
        and m.accept(tok.eos_token_id)


def test_constraint_named(compiler):
    spec = P.constraint([WEATHER, ADD], name="get_weather")
    ok = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
          '\n</tool_call>')
    assert _accepts(compiler, spec, ok)
    assert P.extract(ok).calls == (ToolCall("get_weather", '{"city": "Oslo", "days": 2}'),)
    extra = ok.replace("2}", '2, "unit": "C"}')   # a member the tool does not declare
    for bad in (ok.replace("get_weather", "add"), ok.replace("2}", '"2"}'),
                ok.replace(', "days": 2', ""), ok + "\n" + ok, "Hi " + ok, extra):
        assert not _accepts(compiler, spec, bad), bad
    # a tool that lets other members in keeps them
    open_weather = ToolSpec("get_weather", {**WEATHER.parameters, "additionalProperties": True})
    assert _accepts(compiler, P.constraint([open_weather], name="get_weather"), extra)


def test_constraint_required(compiler):
    one = '<tool_call>\n{"name": "add", "arguments": {"x": 4}}\n</tool_call>'
    two = one + ('\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "A", "days": 1}}'
                 '\n</tool_call>')
    spec = P.constraint([WEATHER, ADD])
    assert _accepts(compiler, spec, one) and _accepts(compiler, spec, two)
    assert not _accepts(compiler, spec, "")
    assert not _accepts(compiler, spec, one.replace("4", '"four"'))     # the $ref is followed
    single = P.constraint([WEATHER, ADD], parallel=False)
    assert _accepts(compiler, single, one) and not _accepts(compiler, single, two)


def test_constraint_llama3(compiler):
    one = '{"name": "add", "parameters": {"x": 4}}'
    two = one + '; {"name": "get_weather", "parameters": {"city": "A", "days": 1}}'
    spec = L.constraint([WEATHER, ADD])
    assert _accepts(compiler, spec, one) and _accepts(compiler, spec, two)
    assert L.extract(two).calls == (ToolCall("add", '{"x": 4}'),
                                    ToolCall("get_weather", '{"city": "A", "days": 1}'))
    named = L.constraint([WEATHER, ADD], name="add")
    assert _accepts(compiler, named, one) and not _accepts(compiler, named, two)
    assert not _accepts(compiler, named, one.replace("add", "get_weather"))
    assert not _accepts(compiler, named, one.replace("4}", '4, "y": 5}'))
