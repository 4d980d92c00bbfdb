"""AsyncLLM: the asyncio API (vLLM's AsyncLLM shape): `generate()` is an async iterator of a
request's outputs as they are produced, many requests run at once from one event loop.

    async with AsyncLLM() as llm:
        async for out in llm.generate("The sea is", SamplingParams(max_tokens=16)):
            print(out.outputs[0].new_text, end="", flush=True)

The engine runs in worker processes behind a Router (one collocated worker by default; the
same deployment keywords as LLM: prefill=, decode=, collocated=, routing_policy=, ...), driven
by the server's AsyncEngine (an I/O thread owns the Router; each request's outputs reach its
coroutine through a queue). Each output is cumulative (all the tokens and text so far), with
`new_token_ids` / `new_text` holding what it adds. Leaving the iteration early (break, an
exception, cancellation) aborts the request. Bad input is a ValueError from generate(); a
deployment that can no longer serve (every worker gone) an EngineDeadError."""
from __future__ import annotations

import asyncio
import itertools
from typing import Any, AsyncIterator

from ..args import DeploymentArgs
from ..deploy import build
from ..loader.generation_config import generation_defaults
from ..outputs import RequestOutput
from ..protocol import AddRequest, Prompt
from ..sampling_params import SamplingParams
from ..server.async_engine import AsyncEngine
from .llm import split_engine_args


class _Aborted(Exception):
    """Ends an aborted request's generate() (never seen by its caller)."""


class AsyncLLM:
    """AsyncLLM(model=None, **engine_args): the arguments of LLM. The workers start here (this
    call blocks until they are up: build it before the event loop, or in a thread); the I/O
    thread starts with the first request, on the event loop that makes it."""

    def __init__(self, model: str | None = None, **engine_args: Any):
        config, deployment = split_engine_args(model, engine_args)
        self._default_sampling = generation_defaults(config.generation_config, config.model)[0]
        self.client = build(config, deployment or DeploymentArgs())   # always a Router
        self._engine: AsyncEngine | None = None
        self._ids = itertools.count()
        self._closed = False

    @property
    def tokenizer(self):
        return self.client.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() uses when given no SamplingParams: as LLM's."""
        return SamplingParams(**self._default_sampling)

    def get_tokenizer(self):
        return self.client.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    def _async_engine(self) -> AsyncEngine:
        if self._closed:
            raise RuntimeError("this AsyncLLM is shut down")
        loop = asyncio.get_running_loop()
        if self._engine is None:
            self._engine = AsyncEngine(self.client, loop)
        elif self._engine.loop is not loop:
            raise RuntimeError("an AsyncLLM serves the event loop of its first request only")
        return self._engine

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come (cumulative; the last one has finished=True).
        prompt: a string, a list of token ids, or {"prompt": ...} / {"prompt_token_ids": ...}."""
        params = (self.get_default_sampling_params() if sampling_params is None
                  else sampling_params)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        rid = f"async-{next(self._ids)}" if request_id is None else str(request_id)
        engine = self._async_engine()
        if engine.is_open(rid):
            raise ValueError(f"request id {rid!r} is already running")
        stream = await engine.add(AddRequest(rid, prompt, params))
        try:
            async for batch in stream:
                for out in batch:
                    yield out
        except _Aborted:
            return
        finally:
            await stream.aclose()   # (a no-op once finished: else the request is aborted)

    async def abort(self, request_id: str) -> bool:
        """Stops a running request: its generate() ends (no finished output); False when no
        such request runs."""
        return self._async_engine().end(request_id, _Aborted(request_id))

    async def reset_prefix_cache(self) -> int:
        return await self._async_engine().reset_prefix_cache()

    async def shutdown(self) -> None:
        """Stops the workers (requests still running end with EngineDeadError)."""
        if self._closed:
            return
        self._closed = True
        if self._engine is not None:
            self._engine.end_all("the AsyncLLM was shut down")
            await self._engine.shutdown(5.0)
        else:
            self.client.shutdown(5.0)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.shutdown()
