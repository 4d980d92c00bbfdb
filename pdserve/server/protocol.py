"""The OpenAI-compatible request bodies (pydantic; they make the OpenAPI schema) and how each
becomes SamplingParams.

JSON types are taken at their word: an integer field takes a JSON integer (true is not 1 and "5"
is not 5), a boolean field only true or false, a number field any JSON number. Chat roles and
content parts are OpenAI's. Unknown fields are ignored, as OpenAI clients send extras (user,
metadata, store, ...), except those that ask for something pdserve does not do (audio, beam
search, the legacy functions / function_call, ...): they are refused by name (_REFUSED), never
dropped.

Tool calling (chat only): tools are OpenAI function tools, checked here (names, a parameters
object, tool_choice naming one of them); ChatCompletionRequest.tool_mode() says what the request
asks of the server's tool-call parser.

Structured outputs come three ways, each becoming one StructuredOutputsParams: OpenAI's
response_format (json_object, json_schema), vLLM's structured_outputs object and vLLM's older
guided_json / guided_regex / guided_choice / guided_grammar fields. A request gives one of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Mapping, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, StrictBool,
                      StrictFloat, Tag, model_validator)
from pydantic_core import PydanticCustomError
from typing_extensions import TypedDict

from ..sampling_params import SamplingParams, StructuredOutputsParams


def _json_int(v: Any) -> Any:
    # pydantic's lax int takes true as 1 and "5" as 5; its strict int refuses 5.0, which JSON
    # Schema, and so the published schema, counts as an integer. Between the two: no bools, no
    # strings; an integral float passes (a fractional one fails the int validation after this).
    if isinstance(v, (bool, str)):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return v


# Requests cross to the worker processes through msgspec, which only carries 64-bit integers: a
# larger one must be a 400 here, not an OverflowError that kills the engine's I/O thread.
Int64 = Annotated[int, Field(ge=-2 ** 63, le=2 ** 63 - 1), BeforeValidator(_json_int)]
Number = StrictFloat  # a JSON number, integers included; not a string or a bool
# n sequences are forked per prompt on the worker; without a cap one request could ask for
# billions of them (OpenAI's own limit is 128).
MAX_N = 128


def _unsupported(message: str) -> PydanticCustomError:
    """A validation error whose text is exactly `message` (a ValueError would get pydantic's
    "Value error, " prefix)."""
    return PydanticCustomError("unsupported", "{message}", {"message": message})


def _short(v: Any, limit: int = 40) -> str:
    s = v if isinstance(v, str) else repr(v)
    return s if len(s) <= limit else s[:limit] + "..."


# ---- refused fields ----------------------------------------------------------------------------
_LEGACY = "the legacy function-calling fields are not supported; use tools and tool_choice"
# field -> (values that ask for nothing, why any other value is refused). None asks for nothing.
_REFUSED: dict[str, tuple[tuple, str]] = {
    "functions": (([],), f"functions: {_LEGACY}"),
    "function_call": (("none",), f"function_call: {_LEGACY}"),
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "modalities other than ['text'] are not supported"),
    "prompt_logprobs": ((), "prompt_logprobs is not supported; for the logprobs of a prompt use "
                            "/v1/completions with echo=true and logprobs"),
    # vLLM's extensions
    "guided_whitespace_pattern": ((), "guided_whitespace_pattern is not supported (JSON is "
                                      "generated without free whitespace)"),
    "use_beam_search": ((False,), "use_beam_search is not supported"),
    "include_stop_str_in_output": ((False,), "include_stop_str_in_output is not supported"),
    "allowed_token_ids": ((), "allowed_token_ids is not supported"),
    "bad_words": (([],), "bad_words is not supported"),
    "logits_processors": (([],), "logits_processors is not supported"),
    "truncate_prompt_tokens": ((), "truncate_prompt_tokens is not supported"),
}
# vLLM's chat extensions (echo and add_special_tokens are completions and /tokenize fields).
_REFUSED_IN_CHAT: dict[str, tuple[tuple, str]] = {
    "continue_final_message": ((False,), "continue_final_message is not supported"),
    "echo": ((False,), "echo is not supported in chat (it is in /v1/completions)"),
    "add_special_tokens": ((False,), "add_special_tokens is not supported in chat (the chat "
                                     "template writes the special tokens)"),
    "chat_template": ((), "chat_template is not supported (the model's own template is used)"),
    "chat_template_kwargs": (({},), "chat_template_kwargs is not supported"),
}


def _refuse(data: Any, table: dict[str, tuple[tuple, str]]) -> None:
    if not isinstance(data, dict):
        return  # the model's own validation says what is wrong
    for name, (neutral, why) in table.items():
        v = data.get(name)
        # (types compared too: 0 is not False)
        if v is not None and not any(type(v) is type(n) and v == n for n in neutral):
            raise _unsupported(why)


# ---- requests ----------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    name: Optional[str] = None
    description: Optional[str] = None
    # (the JSON field is "schema", which pydantic's BaseModel keeps for itself)
    json_schema: Optional[Union[dict[str, Any], bool]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    def structured(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None or self.json_schema.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema")
        return StructuredOutputsParams(json=self.json_schema.json_schema)


# vLLM's older request fields, each one kind of StructuredOutputsParams
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    n: Annotated[int, Field(ge=1, le=MAX_N), BeforeValidator(_json_int)] = 1
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    top_k: Optional[Int64] = None
    min_p: Optional[Number] = None
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[Int64]] = None  # the engine checks them against the vocabulary
    seed: Optional[Int64] = None
    ignore_eos: StrictBool = False
    min_tokens: Int64 = 0
    skip_special_tokens: StrictBool = True
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    response_format: Optional[ResponseFormat] = None
    # vLLM's: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} |
    # {"json_object": true} (StructuredOutputsParams checks the fields)
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None   # accepted and unused: one engine (llguidance)
    # OpenAI's: token ids as JSON object keys (strings of digits) -> a bias in [-100, 100]
    logit_bias: Optional[dict[str, Number]] = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        _refuse(data, _REFUSED)
        return data

    def structured(self) -> StructuredOutputsParams | None:
        """The request's one output constraint (ValueError when it gives more than one)."""
        found = []
        if self.response_format is not None and self.response_format.type != "text":
            found.append(("response_format", self.response_format.structured()))
        if self.structured_outputs is not None:
            found.append(("structured_outputs",
                          StructuredOutputsParams.from_mapping(self.structured_outputs)))
        for name, kind in _GUIDED.items():
            v = getattr(self, name)
            if v is not None:
                found.append((name, StructuredOutputsParams(**{kind: v})))
        if len(found) > 1:
            raise ValueError("give one output constraint, not " + " and ".join(n for n, _ in found))
        return found[0][1] if found else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: Mapping[str, Any] | None = None,
                        fallback_max_tokens: int = 16) -> SamplingParams:
        """The one place a request's defaults are filled in, as vLLM's to_sampling_params:
        each sampling value it leaves out (None) comes from `defaults` (the model's generation
        config, --generation-config), else SamplingParams' own; max_tokens None (the request
        gives none) from the defaults' max_tokens, else fallback_max_tokens (the endpoint's:
        OpenAI's 16 for completions, what the context leaves for chat). ValueError (-> HTTP
        400) for any bad value, from SamplingParams' own checks."""
        defaults = defaults or {}
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens", fallback_max_tokens)
        kw = dict(n=self.n, max_tokens=max_tokens, logprobs=logprobs, seed=self.seed,
                  stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                  min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if v is None:
                v = defaults.get(name)
            if v is not None:
                kw[name] = v
        if self.logit_bias:
            kw["logit_bias"] = _token_id_keys(self.logit_bias)
        kw["structured_outputs"] = self.structured()
        return SamplingParams(**kw)


def _token_id_keys(bias: dict[str, float]) -> dict[int, float]:
    """logit_bias's keys as token ids: strings of decimal digits (as OpenAI takes them), small
    enough for the engine's 64-bit messages (the engine checks them against the vocabulary)."""
    out = {}
    for k, v in bias.items():
        if not (k.isascii() and k.isdigit()) or len(k) > 18:
            raise ValueError(f"logit_bias keys must be token ids (decimal integers >= 0); "
                             f"{_short(k)!r} is not")
        out[int(k)] = v
    return out


def _prompt_kind(v: Any) -> str | None:
    # Picks the one reading a bad prompt is checked against, so its error says what is wrong
    # with it ("prompt.token_ids.0: Input should be a valid integer"), not with every reading.
    if isinstance(v, list):
        return {str: "texts", list: "token_id_lists"}.get(type(v[0]) if v else None, "token_ids")
    return "text" if isinstance(v, str) else None


Prompt = Annotated[Union[Annotated[str, Tag("text")], Annotated[list[str], Tag("texts")],
                         Annotated[list[Int64], Tag("token_ids")],
                         Annotated[list[list[Int64]], Tag("token_id_lists")]],
                   Discriminator(_prompt_kind, custom_error_type="prompt_type",
                                 custom_error_message="Input should be a string, a list of "
                                 "strings, a list of token ids or a list of token-id lists")]


_CHAT_ONLY = "is a chat completions field (/v1/chat/completions)"
_REFUSED_IN_COMPLETIONS: dict[str, tuple[tuple, str]] = {
    "tools": (([],), f"tools {_CHAT_ONLY}"),
    "tool_choice": (("none",), f"tool_choice {_CHAT_ONLY}"),
    "parallel_tool_calls": ((), f"parallel_tool_calls {_CHAT_ONLY}"),
}


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: Optional[Int64] = None   # None: the generation config's, else 16 (OpenAI's)
    logprobs: Optional[Int64] = None
    echo: StrictBool = False
    best_of: Optional[Int64] = None
    suffix: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_chat_fields(cls, data: Any) -> Any:
        _refuse(data, _REFUSED_IN_COMPLETIONS)
        return data


# ---- chat messages -----------------------------------------------------------------------------
class TextPart(TypedDict):
    type: Literal["text"]
    text: str


Content = Union[str, list[TextPart]]


class _Message(BaseModel):
    # name, tool_calls, tool_call_id, ... travel on to the chat template
    model_config = ConfigDict(extra="allow")
    content: Content

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        # By name, before the schema's "type should be 'text'": an image the model never saw
        # must not pass for an answer about it.
        content = data.get("content") if isinstance(data, dict) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise _unsupported(f"{_short(kind)} content parts are not supported (text only)")
        return data


class SystemMessage(_Message):
    role: Literal["system"]


class DeveloperMessage(_Message):
    role: Literal["developer"]


class UserMessage(_Message):
    role: Literal["user"]


class ToolMessage(_Message):
    role: Literal["tool"]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    # OpenAI lets an assistant message that made tool calls have no content. It renders as an
    # empty message, made "" here so that chat and /tokenize render it alike.
    content: Optional[Content] = None

    @model_validator(mode="after")
    def _empty_content(self) -> AssistantMessage:
        if self.content is None:
            self.content = ""
        return self


ChatMessage = Annotated[Union[SystemMessage, DeveloperMessage, UserMessage, AssistantMessage,
                              ToolMessage], Field(discriminator="role")]


# ---- tools -------------------------------------------------------------------------------------
# OpenAI's rule for function names
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDefinition(BaseModel):
    name: FunctionName
    description: Optional[str] = None
    # a JSON schema of the arguments object (OpenAI: omitted means no arguments)
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    name: FunctionName


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: ToolChoiceFunction


@dataclass(frozen=True)
class ToolMode:
    """What a chat request asks of the tool-call parser: parse (tool_choice auto, required or a
    named function), constrain (required: `name` None; named: that function) or neither
    (no tools, or tool_choice none)."""
    parse: bool
    constrain: bool
    name: Optional[str] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[Int64] = None
    max_completion_tokens: Optional[Int64] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[Int64] = None
    add_generation_prompt: StrictBool = True
    tools: Optional[list[ChatTool]] = None
    # default: "auto" with tools, "none" without (OpenAI's)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    # false: at most one call (enforced where the output is constrained; with auto, the first
    # call is kept)
    parallel_tool_calls: Optional[StrictBool] = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported_in_chat(cls, data: Any) -> Any:
        _refuse(data, _REFUSED_IN_CHAT)
        return data

    @model_validator(mode="after")
    def _tools_consistent(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or ()]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise _unsupported(f"tools: function names must be unique; {dup} repeat")
        for t in self.tools or ():
            p = t.function.parameters
            if p is not None and p.get("type", "object") != "object":
                raise _unsupported(f"tools: the parameters of {t.function.name!r} must be a JSON "
                                   f"schema of an object (type 'object'), got type "
                                   f"{_short(p.get('type'))}")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise _unsupported(f"tool_choice names function {choice.function.name!r}, which is "
                               f"not among the tools ({', '.join(names) or 'none given'})")
        if choice == "required" and not names:
            raise _unsupported("tool_choice 'required' needs tools")
        return self

    def tool_mode(self) -> ToolMode:
        choice = self.tool_choice
        if not self.tools or choice == "none":
            return ToolMode(parse=False, constrain=False)
        if isinstance(choice, NamedToolChoice):
            return ToolMode(parse=True, constrain=True, name=choice.function.name)
        return ToolMode(parse=True, constrain=choice == "required")

    def tool_dicts(self) -> list[dict] | None:
        """The tools as the chat template sees them (OpenAI's JSON, unset fields left out)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    tools: Optional[list[ChatTool]] = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    tokens: list[Int64]


class ErrorBody(BaseModel):
    message: str
    type: Literal["invalid_request_error", "server_error", "not_found_error"]
    param: Optional[str] = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody
