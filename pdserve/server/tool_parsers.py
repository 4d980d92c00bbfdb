"""Tool calls in generated text: one parser per format behind a small contract, plus a registry
(the server's --tool-call-parser picks one): hermes (<tool_call>{json}</tool_call>: Hermes 2
Pro, Qwen2.5, Qwen3) and llama3_json (the output is the calls' JSON: Llama 3.1 / 3.2).

    parser = get_tool_parser("hermes")
    parser.extract(text)         -> ExtractedToolCalls(content, calls)      (a whole output)
    s = parser.streamer()
    s.feed(new_text)             -> StreamDelta(content, calls)             (as text arrives)
    s.finish()                   -> StreamDelta(...)                        (at the end)
    parser.constraint(tools, name=None, parallel=True) -> StructuredOutputsParams

The contract every parser keeps:

* a call's arguments are the model's own JSON text of the arguments object (not re-encoded), and
  the pieces a streamer gives for a call concatenate to exactly that text;
* content is the text outside the calls, joined, with leading and trailing whitespace removed
  (None when nothing is left); a streamer gives content pieces that concatenate to the same;
* a call whose JSON does not parse is not a call: its text stays in the content (no exception).
  A streamer cannot take back what it sent, so where it had already begun a call whose JSON
  then breaks (or the output ends inside it), the streamed call stands while extract() has
  content: the two agree on every output whose calls are well formed;
* constraint() is what enforces tool_choice "required" or a named function: a grammar for the
  format's own call syntax around each tool's parameters schema (its listed objects closed to
  members the tool does not declare: structured/json_schema.py), so the constrained output is
  parsed by the same extract() / streamer() as a free one.
"""
from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

from ..sampling_params import StructuredOutputsParams
from ..structured.json_schema import closed_objects


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str        # the arguments object's JSON text, as generated


@dataclass(frozen=True)
class ExtractedToolCalls:
    content: str | None
    calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index`: its first piece carries the name, every piece some arguments
    text (the first may carry "")."""
    index: int
    name: str | None
    arguments: str


@dataclass(frozen=True)
class StreamDelta:
    content: str = ""
    calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def then(self, later: StreamDelta) -> StreamDelta:
        """This delta followed by a later one, as one."""
        return StreamDelta(self.content + later.content, _merged([*self.calls, *later.calls]))


@dataclass(frozen=True)
class ToolSpec:
    """What a parser needs of a request's tool: its name and its parameters' JSON schema."""
    name: str
    parameters: dict[str, Any] | None = None


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolCallStreamer(ABC):
    """One output's incremental parse (not thread-safe; one per choice). Subclasses count the
    calls they begin in `calls`."""

    calls: int = 0

    @abstractmethod
    def feed(self, text: str) -> StreamDelta: ...

    @abstractmethod
    def finish(self) -> StreamDelta: ...

    @property
    def num_calls(self) -> int:
        """Calls begun so far."""
        return self.calls


class ToolParser(ABC):
    """A tool-call format. Stateless: one instance serves every request."""
    name: ClassVar[str]
    # The format's markers may be special tokens, which detokenizing would drop (vLLM's hermes
    # parser asks for them the same way).
    keep_special_tokens: ClassVar[bool] = True
    # text a chat template that renders this format's calls holds (picks the default parser)
    template_marker: ClassVar[str]

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls: ...

    @abstractmethod
    def streamer(self) -> ToolCallStreamer: ...

    @abstractmethod
    def constraint(self, tools: Sequence[ToolSpec], name: str | None = None,
                   parallel: bool = True) -> StructuredOutputsParams:
        """The output constraint for tool_choice "required" (name None: one or more calls, or
        exactly one when not parallel, each of one of the tools) or a named function (exactly
        one call of it)."""


class _Content:
    """Content pieces with the contract's whitespace rule: nothing before the first
    non-whitespace character, and trailing whitespace held until more content follows it (so
    it is dropped at the end)."""

    def __init__(self):
        self.started = False
        self.held = ""

    def add(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        body = text.rstrip()
        if not body:
            self.held += text
            return ""
        out = self.held + body
        self.held = text[len(body):]
        return out


def _suffix_prefix(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag (and is not all of it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---- JSON helpers (the call objects) -----------------------------------------------------------
_decoder = json.JSONDecoder()
_WS = " \t\n\r"


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _object_members(text: str) -> dict[str, tuple[Any, str]] | None:
    """text is exactly one JSON object (whitespace around it allowed): its members as key ->
    (value, the value's JSON text); None when it is not. Walked with json's own raw_decode, so
    each value's text is the model's."""
    i = _skip_ws(text, 0)
    if not text.startswith("{", i):
        return None
    try:
        whole, end = _decoder.raw_decode(text, i)
    except ValueError:
        return None
    if not isinstance(whole, dict) or _skip_ws(text, end) != len(text):
        return None
    out: dict[str, tuple[Any, str]] = {}
    i = _skip_ws(text, i + 1)
    if text[i] == "}":
        return out
    while True:   # valid JSON, so every step below finds what it expects
        key, i = _decoder.raw_decode(text, i)
        i = _skip_ws(text, _skip_ws(text, i) + 1)        # past ':'
        value, j = _decoder.raw_decode(text, i)
        out[key] = (value, text[i:j])
        i = _skip_ws(text, j)
        if text[i] == "}":
            return out
        i = _skip_ws(text, i + 1)                         # past ','


def _call_from_json(body: str) -> ToolCall | None:
    """{"name": "...", "arguments": {...}} -> a call; None when body is anything else."""
    members = _object_members(body)
    if members is None or "name" not in members or not isinstance(members["name"][0], str):
        return None
    args = members.get("arguments")
    if args is None:
        return ToolCall(members["name"][0], "{}")
    if not isinstance(args[0], dict):
        return None
    return ToolCall(members["name"][0], args[1])


_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"')
_PARTIAL_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{0,4})?)*')


def _head(body: str, arg_keys: tuple[str, ...] = ("arguments",)) -> tuple[str, str | None, int]:
    """Reads `{"name": <string>, "<arg key>": {` at the start of body (whitespace anywhere
    JSON allows it): ("partial", ...) while body could still become that, ("fail", ...) once it
    cannot, ("ok", name, index of the arguments' "{") when it is there."""
    i, name = 0, None
    for alts in (("{",), ('"name"',), (":",), None, (",",),
                 tuple(f'"{k}"' for k in arg_keys), (":",)):
        i = _skip_ws(body, i)
        if i == len(body):
            return "partial", None, 0
        if alts is None:
            m = _STRING.match(body, i)
            if m is None:
                part = _PARTIAL_STRING.match(body, i)
                return ("partial" if part is not None and part.end() == len(body) else "fail",
                        None, 0)
            name, i = json.loads(m.group()), m.end()
            continue
        for tok in alts:
            got = body[i:i + len(tok)]
            if got == tok:
                i += len(tok)
                break
            if tok.startswith(got):
                return "partial", None, 0
        else:
            return "fail", None, 0
    i = _skip_ws(body, i)
    if i == len(body):
        return "partial", None, 0
    return ("ok", name, i) if body[i] == "{" else ("fail", None, 0)


class _ObjectScan:
    """Finds where a JSON object that starts at its first character ends, fed piece by piece
    (strings and escapes respected; validity is not checked here)."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of text belong to the object (all of it until it closes)."""
        for k, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return k + 1
        return len(text)


# ---- Hermes / Qwen2.5 ----------------------------------------------------------------------------
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _with_local_refs(schema: Any, base: str) -> Any:
    """schema with its local $refs ("#/...") re-rooted at base, the JSON pointer where it sits
    inside the grammar's schema."""
    if isinstance(schema, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else _with_local_refs(v, base)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_with_local_refs(v, base) for v in schema]
    return schema


def _call_schema(tool: ToolSpec, base: str, key: str = "arguments") -> dict:
    # closed: members the tool does not declare are of no use to it (see closed_objects)
    params = closed_objects(tool.parameters) if tool.parameters is not None else {"type": "object"}
    return {"type": "object",
            "properties": {"name": {"const": tool.name},
                           key: _with_local_refs(params, f"{base}/properties/{key}")},
            "required": ["name", key], "additionalProperties": False}


def _calls_schema(tools: Sequence[ToolSpec], name: str | None, parallel: bool,
                  key: str) -> tuple[dict, bool]:
    """The JSON schema of one call for a constraint (a named tool's, or any of the tools' for
    tool_choice required) and whether calls may repeat (required with parallel calls)."""
    if name is not None:
        (tool,) = [t for t in tools if t.name == name]
        schema, repeat = _call_schema(tool, "#", key), False
    else:
        if not tools:
            raise ValueError("tool_choice 'required' needs tools")
        schema = {"anyOf": [_call_schema(t, f"#/anyOf/{i}", key) for i, t in enumerate(tools)]}
        repeat = parallel
    schema["x-guidance"] = _JSON_STYLE
    return schema, repeat


class HermesToolParser(ToolParser):
    """NousResearch Hermes 2 Pro / Qwen2.5 / Qwen3: each call is

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>

    and calls may follow one another or text. A last call left open when the output ends
    counts when its JSON is whole (a model may stop without the closing tag)."""
    name = "hermes"
    template_marker = "<tool_call>"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def extract(self, text: str) -> ExtractedToolCalls:
        outside, calls, pos = [], [], 0
        for m in self._CALL.finditer(text):
            call = _call_from_json(m.group(1))
            if call is None:
                continue   # stays content
            outside.append(text[pos:m.start()])
            calls.append(call)
            pos = m.end()
        outside.append(text[pos:])
        return ExtractedToolCalls("".join(outside).strip() or None, tuple(calls))

    def streamer(self) -> ToolCallStreamer:
        return _HermesStreamer(self)

    def constraint(self, tools: Sequence[ToolSpec], name: str | None = None,
                   parallel: bool = True) -> StructuredOutputsParams:
        schema, repeat = _calls_schema(tools, name, parallel, "arguments")
        call = (f"call: {json.dumps(self.OPEN + chr(10))} %json "
                f"{json.dumps(schema, ensure_ascii=False)} {json.dumps(chr(10) + self.CLOSE)}")
        start = 'start: call ("\\n" call)*' if repeat else "start: call"
        return StructuredOutputsParams(grammar=f"{start}\n{call}\n")


@dataclass
class _OpenCall:
    body: str = ""
    index: int | None = None             # set once the call is announced (streamed)
    scan: _ObjectScan = field(default_factory=_ObjectScan)
    args_start: int = 0                  # where the arguments object begins in body
    scanned: int = 0                     # body characters scanned as arguments so far


class _HermesStreamer(ToolCallStreamer):
    """Outside a call, content goes out except an end that may begin "<tool_call>". Inside one,
    the call is announced (index, name) once its head `{"name": "...", "arguments": {` is read,
    then the arguments object's characters go out as they come; a call whose head does not
    read so is held until its close and then judged whole, as extract() judges it."""

    def __init__(self, parser: HermesToolParser):
        self.p = parser
        self.buf = ""                        # outside text not yet given out
        self.call: _OpenCall | None = None
        self.content = _Content()
        self.calls = 0

    def feed(self, text: str) -> StreamDelta:
        content, deltas = [], []
        self.buf += text
        while self.buf:
            if self.call is None:
                at = self.buf.find(self.p.OPEN)
                if at < 0:
                    keep = _suffix_prefix(self.buf, self.p.OPEN)
                    content.append(self.content.add(self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                content.append(self.content.add(self.buf[:at]))
                self.buf = self.buf[at + len(self.p.OPEN):]
                self.call = _OpenCall()
                continue
            c = self.call
            at = (c.body + self.buf).find(self.p.CLOSE)
            if at < 0:   # still inside: take all but an end that may begin the close tag
                keep = _suffix_prefix(c.body + self.buf, self.p.CLOSE)
                take = max(0, len(self.buf) - keep)
                c.body, self.buf = c.body + self.buf[:take], self.buf[take:]
                self._advance(c, deltas)
                break
            more = at - len(c.body)
            c.body, self.buf = c.body + self.buf[:more], self.buf[more + len(self.p.CLOSE):]
            self._advance(c, deltas)
            self._close(c, content, deltas, closed=True)
        return StreamDelta("".join(content), _merged(deltas))

    def _advance(self, c: _OpenCall, deltas: list) -> None:
        if c.index is None:
            state, name, start = _head(c.body)
            if state != "ok":
                return
            c.index, c.args_start, c.scanned = self.calls, start, start
            self.calls += 1
            deltas.append(ToolCallDelta(c.index, name, ""))
        if not c.scan.done:
            n = c.scan.feed(c.body[c.scanned:])
            if n:
                deltas.append(ToolCallDelta(c.index, None, c.body[c.scanned:c.scanned + n]))
            c.scanned += n

    def _close(self, c: _OpenCall, content: list, deltas: list, closed: bool) -> None:
        self.call = None
        if c.index is not None:
            return   # announced: it stands (see the module's contract)
        call = _call_from_json(c.body)
        if call is None:
            tail = self.p.CLOSE if closed else ""
            content.append(self.content.add(self.p.OPEN + c.body + tail))
            return
        deltas.append(ToolCallDelta(self.calls, call.name, call.arguments))
        self.calls += 1

    def finish(self) -> StreamDelta:
        content, deltas = [], []
        if self.call is not None:
            c = self.call
            c.body, self.buf = c.body + self.buf, ""
            self._advance(c, deltas)
            self._close(c, content, deltas, closed=False)
        elif self.buf:
            content.append(self.content.add(self.buf))
            self.buf = ""
        return StreamDelta("".join(content), _merged(deltas))


# ---- Llama 3.1 / 3.2 JSON ------------------------------------------------------------------------
def _llama_call(value: Any, text: str) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    members = _object_members(text)
    key = "parameters" if "parameters" in members else "arguments"
    if key not in members:
        return ToolCall(value["name"], "{}")
    return ToolCall(value["name"], members[key][1]) if isinstance(members[key][0], dict) else None


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2's JSON tool calls: the whole output is the calls,

        {"name": "get_weather", "parameters": {"city": "Paris"}}

    (optionally after <|python_tag|>), several separated by ";" ("arguments" is read as
    "parameters"). Output that does not start with "{" (after that tag), or does not parse
    whole so, is content."""
    name = "llama3_json"
    template_marker = "<|python_tag|>"
    TAG = "<|python_tag|>"
    SEP = ";"

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        calls, i = [], 0
        while body.startswith("{", i):
            try:
                value, end = _decoder.raw_decode(body, i)
            except ValueError:
                break
            call = _llama_call(value, body[i:end])
            if call is None:
                break
            calls.append(call)
            i = _skip_ws(body, end)
            if i == len(body):
                return ExtractedToolCalls(None, tuple(calls))
            if not body.startswith(self.SEP, i):
                break
            i = _skip_ws(body, i + len(self.SEP))
        return ExtractedToolCalls(text.strip() or None, ())

    def streamer(self) -> ToolCallStreamer:
        return _Llama3Streamer(self)

    def constraint(self, tools: Sequence[ToolSpec], name: str | None = None,
                   parallel: bool = True) -> StructuredOutputsParams:
        schema, repeat = _calls_schema(tools, name, parallel, "parameters")
        call = f"call: %json {json.dumps(schema, ensure_ascii=False)}"
        start = f'start: call ({json.dumps(self.SEP + " ")} call)*' if repeat else "start: call"
        return StructuredOutputsParams(grammar=f"{start}\n{call}\n")


class _Llama3Streamer(ToolCallStreamer):
    """Undecided until the first character after whitespace and the optional tag: "{" begins
    the calls, anything else makes the whole output content. Calls are announced at their
    head `{"name": "...", "parameters": {` and their arguments go out as they come; a call
    whose head reads otherwise (keys in another order) holds the rest of the output, which is
    then judged whole by extract() at the end."""

    def __init__(self, parser: Llama3JsonToolParser):
        self.p = parser
        self.mode = "start"          # start | content | calls | whole
        self.text = ""               # the whole output so far
        self.pos = 0                 # calls: where the current call (or separator) begins
        self.call: _OpenCall | None = None
        self.content = _Content()
        self.calls = 0

    def feed(self, text: str) -> StreamDelta:
        self.text += text
        deltas: list[ToolCallDelta] = []
        if self.mode == "start":
            head = self.text.lstrip()
            if head.startswith(self.p.TAG):
                head = head[len(self.p.TAG):].lstrip()
            if not head or (self.p.TAG.startswith(head) and head != self.p.TAG):
                return StreamDelta()
            if head.startswith("{"):
                self.mode, self.pos = "calls", len(self.text) - len(head)
            else:
                self.mode = "content"
                return StreamDelta(self.content.add(self.text))
        elif self.mode == "content":
            return StreamDelta(self.content.add(text))
        if self.mode == "calls":
            self._calls(deltas)
        return StreamDelta("", _merged(deltas))

    def _calls(self, deltas: list) -> None:
        while self.mode == "calls":
            if self.call is None:                       # between calls: [";"] ws "{"
                i = _skip_ws(self.text, self.pos)
                if self.calls and self.text.startswith(self.p.SEP, i):
                    i = _skip_ws(self.text, i + len(self.p.SEP))
                elif self.calls:
                    if i < len(self.text):
                        self.mode = "whole"             # not a separator: judged at the end
                    return
                if i == len(self.text):
                    return
                if self.text[i] != "{":
                    self.mode = "whole"
                    return
                self.call, self.pos = _OpenCall(), i
            c = self.call
            c.body = self.text[self.pos:]
            if c.index is None:
                state, name, start = _head(c.body, ("parameters", "arguments"))
                if state == "partial":
                    return
                if state == "fail":
                    self.mode = "whole"
                    return
                c.index, c.args_start, c.scanned = self.calls, start, start
                self.calls += 1
                deltas.append(ToolCallDelta(c.index, name, ""))
            if not c.scan.done:
                n = c.scan.feed(c.body[c.scanned:])
                if n:
                    deltas.append(ToolCallDelta(c.index, None, c.body[c.scanned:c.scanned + n]))
                c.scanned += n
                if not c.scan.done:
                    return
            i = _skip_ws(c.body, c.scanned)            # the call object's closing "}"
            if i == len(c.body):
                return
            if c.body[i] != "}":
                self.mode = "whole"
                return
            self.pos, self.call = self.pos + i + 1, None

    def finish(self) -> StreamDelta:
        if self.mode == "content":
            return StreamDelta()
        if self.mode == "start":
            return StreamDelta(self.content.add(self.text))
        if self.calls == 0:   # nothing announced: the whole output as extract() reads it
            got = self.p.extract(self.text)
            self.calls = len(got.calls)
            return StreamDelta(got.content or "", tuple(
                ToolCallDelta(k, c.name, c.arguments) for k, c in enumerate(got.calls)))
        if self.mode == "whole":   # after announced calls: the rest, if it reads as calls
            rest = self.text[self.pos:].strip()
            if rest.startswith(self.p.SEP):
                rest = rest[len(self.p.SEP):]
            got = self.p.extract(rest) if rest.lstrip().startswith("{") else None
            if got is not None and got.calls:
                start = self.calls
                self.calls += len(got.calls)
                return StreamDelta("", tuple(ToolCallDelta(start + k, c.name, c.arguments)
                                             for k, c in enumerate(got.calls)))
        return StreamDelta()


def _merged(deltas: list[ToolCallDelta]) -> tuple[ToolCallDelta, ...]:
    """Consecutive pieces of one call as one (a chunk carries each call once)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.name is None:
            last = out.pop()
            d = ToolCallDelta(d.index, last.name, last.arguments + d.arguments)
        out.append(d)
    return tuple(out)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


DEFAULT_TOOL_PARSER = HermesToolParser.name


def parser_for_template(template: str | None) -> str:
    """The parser whose calls a chat template writes (its marker is in the template), else the
    default."""
    for name, parser in TOOL_PARSERS.items():
        if template and parser.template_marker in template:
            return name
    return DEFAULT_TOOL_PARSER


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r} (known: "
                         f"{', '.join(sorted(TOOL_PARSERS))})") from None
