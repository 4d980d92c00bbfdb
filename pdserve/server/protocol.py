"""The OpenAI-compatible request bodies (pydantic; they make the OpenAPI schema) and how each
becomes SamplingParams. Unknown fields are ignored, as OpenAI clients send extras."""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..sampling_params import SamplingParams

# Requests cross to the worker processes through msgspec, which only carries 64-bit integers: a
# larger one must be a 400 here, not an OverflowError that kills the engine's I/O thread.
Int64 = Annotated[int, Field(ge=-2 ** 63, le=2 ** 63 - 1)]
# n sequences are forked per prompt on the worker; without a cap one request could ask for
# billions of them (OpenAI's own limit is 128).
MAX_N = 128


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    n: Annotated[int, Field(le=MAX_N)] = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[Int64] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[Int64]] = None
    seed: Optional[Int64] = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: Optional[StreamOptions] = None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """ValueError (-> HTTP 400) for any bad value, from SamplingParams' own checks."""
        kw = dict(n=self.n, max_tokens=max_tokens, logprobs=logprobs, seed=self.seed,
                  stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                  min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = v
        return SamplingParams(**kw)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[Int64], list[list[Int64]]]
    max_tokens: Optional[Int64] = 16
    logprobs: Optional[Int64] = None
    echo: bool = False
    best_of: Optional[Int64] = None
    suffix: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Optional[Union[str, list[dict]]] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[Int64] = None
    max_completion_tokens: Optional[Int64] = None
    logprobs: bool = False
    top_logprobs: Optional[Int64] = None
    add_generation_prompt: bool = True


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    tokens: list[int]


class ErrorBody(BaseModel):
    message: str
    type: Literal["invalid_request_error", "server_error", "not_found_error"]
    param: Optional[str] = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody
