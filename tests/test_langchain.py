"""LangChain's ChatOpenAI against a live `pdserve serve` (the tools server: embedded SmolLM2 with
a Hermes-style chat template): with_structured_output by json_schema (response_format) and by
function_calling (tools + a named tool_choice) returns the pydantic model, and bind_tools
(a python function by name, a pydantic tool with "any") returns AIMessage.tool_calls whose
arguments validate against the tool's schema. Nothing here counts tokens, so tiktoken (which
ChatOpenAI imports) is never asked for an encoding, which it would fetch from the network."""
import pytest

pytest.importorskip("langchain_openai")
jsonschema = pytest.importorskip("jsonschema")

from langchain_core.utils.function_calling import convert_to_openai_tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
ASK_CITY = "Name a city and its population in thousands."
ASK_WEATHER = "What is the weather in Paris for the next 3 days?"


class City(BaseModel):
    """A city and how many thousand people live there."""
    name: str = Field(description="the city's name", min_length=2, max_length=10)
    population: int = Field(description="thousands of people", ge=1, le=999)


class GetWeather(BaseModel):
    """The weather forecast for a city."""
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


def get_weather(city: str, days: int) -> str:
    """The weather forecast for a city.

    Args:
        city: the city's name
        days: how many days ahead
    """
    raise AssertionError("a tool the model calls is not run by bind_tools")


@pytest.fixture
def llm(tools_server, monkeypatch):
    # counting tokens would fetch an encoding from the network (none in CI): fail plainly
    tiktoken = pytest.importorskip("tiktoken")

    def fetch(*a, **kw):
        raise AssertionError("ChatOpenAI asked tiktoken for an encoding")
    monkeypatch.setattr(tiktoken, "get_encoding", fetch)
    monkeypatch.setattr(tiktoken, "encoding_for_model", fetch)
    return ChatOpenAI(base_url=tools_server + "/v1", api_key="none", model=MODEL,
                      temperature=0, max_tokens=60, max_retries=0, timeout=120)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_model(llm, method):
    out = llm.with_structured_output(City, method=method, include_raw=True).invoke(ASK_CITY)
    assert out["parsing_error"] is None, out
    city = out["parsed"]
    assert isinstance(city, City), out
    jsonschema.validate(city.model_dump(), City.model_json_schema())
    raw = out["raw"]
    if method == "function_calling":   # one call of the tool named after the model
        assert [c["name"] for c in raw.tool_calls] == ["City"], raw
        assert raw.response_metadata["finish_reason"] == "tool_calls", raw
    else:
        assert not raw.tool_calls and raw.response_metadata["finish_reason"] == "stop", raw


@pytest.mark.parametrize("tool, choice, name", [(get_weather, "get_weather", "get_weather"),
                                                (GetWeather, "any", "GetWeather")],
                         ids=["function-named", "pydantic-any"])
def test_bind_tools_makes_the_call(llm, tool, choice, name):
    # "any" is OpenAI's "required", which allows several calls: one is asked for, since
    # greedy SmolLM2 repeats its call until max_tokens
    msg = llm.bind_tools([tool], tool_choice=choice, parallel_tool_calls=False).invoke(
        ASK_WEATHER)
    assert msg.response_metadata["finish_reason"] == "tool_calls", msg
    (call,) = msg.tool_calls
    assert call["name"] == name and call["id"].startswith("call_")
    jsonschema.validate(call["args"], convert_to_openai_tool(tool)["function"]["parameters"])
    if tool is GetWeather:
        GetWeather(**call["args"])     # its bounds (pydantic's own check)
    assert not msg.invalid_tool_calls
