"""User-facing results (vLLM-compatible shapes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .protocol import KVSource


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int                      # 1 = most likely token
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None   # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # What this step added (streaming): the tokens and the text not yet reported.
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # The engine's times of this request (s, one clock: time.monotonic in a served engine):
    # arrival, scheduled (first handed to the runner), first_token, finished.
    metrics: dict[str, float] = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (it has
    # no prefix); each the token's logprob given the tokens before it, plus the top-k.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # P/D producer (a kv_hold request): where its prompt KV waits for a consumer.
    kv_transfer: KVSource | None = None
    # Prompt tokens whose KV was found cached instead of computed (the OpenAI usage's
    # prompt_tokens_details.cached_tokens); 0 until a prefix cache finds some.
    num_cached_tokens: int = 0
    # Set when the deployment, not the request, ended it (its worker died with it, the server
    # shut down): why. The outputs then finish with finish_reason "abort".
    error: str | None = None


class RequestPhases(NamedTuple):
    """A finished request's phases (s), as vLLM's request_*_time_seconds measure them."""
    queue: float       # arrival -> first scheduled
    prefill: float     # first scheduled -> first token
    decode: float      # first token -> last token
    inference: float   # first scheduled -> last token


def request_phases(times: dict[str, float]) -> RequestPhases | None:
    """From a finished RequestOutput's metrics (the engine's times, one clock; in P/D the
    router's arrival and the prefill worker's scheduled and first token); None when one is
    missing (the request ended before it was scheduled or before its first token)."""
    try:
        arrival, scheduled = times["arrival"], times["scheduled"]
        first, last = times["first_token"], times["finished"]
    except KeyError:
        return None
    return RequestPhases(scheduled - arrival, first - scheduled, last - first, last - scheduled)
