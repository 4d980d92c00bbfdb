"""The OpenAI endpoints' work behind the routes: admission (all-or-none, the queue limit),
tokenization off the event loop, completions and chat responses (tool calls through the
server's tool-call parser), streaming with keep-alives."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from ..outputs import RequestOutput
from ..protocol import AddRequest
from ..worker.client import EngineDeadError
from .async_engine import AsyncEngine, RequestStream
from .http import ARRIVAL, Busy, ServeOptions, error_event, sse
from .metrics import Metrics, RequestTimer
from .protocol import ChatCompletionRequest, CompletionRequest, ToolMode
from .tool_parsers import (StreamDelta, ToolParser, ToolSpec, get_tool_parser, new_call_id,
                           parser_for_template)

_ids = itertools.count()

# A text with more characters than this many per token of the context is judged from its head
# first (tokenizing a whole 10 MB prompt takes seconds, only to reject it); and the head's count
# may exceed the whole text's by a few tokens cut at its end.
_HEAD_CHARS_PER_TOKEN = 16
_HEAD_MARGIN = 16


def _arrival(raw: Request) -> float | None:
    """The HTTP request's arrival stamp (http.ArrivalStamp); None in an app built without it."""
    return getattr(raw.state, ARRIVAL, None)


def _template_tool_calls(calls, where: str):
    """An assistant message's tool_calls as chat templates take them: function.arguments as
    an object, not OpenAI's JSON string (transformers' documented form, which tool templates
    such as Qwen2.5's write with `tojson`; vLLM converts the same way)."""
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}.tool_calls.{j} needs function.name (a string)")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise ValueError(f"{where}.tool_calls.{j}.function.arguments is not valid JSON: "
                                 f"{e}") from None
        elif args is None:
            args = {}
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def _tool_calls_json(calls) -> list[dict]:
    return [{"id": new_call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def _tool_message(extracted, finish_reason: str | None, single: bool) -> tuple[dict, str | None]:
    """The chat message of a parsed output (single: only its first call) and its
    finish_reason ("tool_calls" when the model stopped after making calls)."""
    calls = extracted.calls[:1] if single else extracted.calls
    message = {"role": "assistant", "content": extracted.content,
               "tool_calls": _tool_calls_json(calls)}
    return message, "tool_calls" if calls and finish_reason == "stop" else finish_reason


class _StreamedCalls:
    """One streamed chat request's tool-call parsing: a streamer per choice; each step's text
    becomes an OpenAI delta (content, tool_calls pieces). Without a parser the text is the
    content, as it is."""

    def __init__(self, parser: ToolParser | None, single: bool):
        self.parser, self.single = parser, single
        self.streamers: dict[int, object] = {}

    def delta(self, choice: int, text: str, finished: bool,
              finish_reason: str | None) -> tuple[dict, str | None]:
        if self.parser is None:
            return {"content": text}, finish_reason
        st = self.streamers.get(choice)
        if st is None:
            st = self.streamers[choice] = self.parser.streamer()
        d: StreamDelta = st.feed(text)
        if finished:
            d = d.then(st.finish())
        delta: dict = {}
        if d.content:
            delta["content"] = d.content
        pieces = []
        for call in d.calls:
            if self.single and call.index > 0:
                continue
            if call.name is not None:
                pieces.append({"index": call.index, "id": new_call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
            else:
                pieces.append({"index": call.index, "function": {"arguments": call.arguments}})
        if pieces:
            delta["tool_calls"] = pieces
        if finished and st.num_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return delta, finish_reason


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, options: ServeOptions,
                 sampling_defaults: dict | None = None):
        self.engine = engine
        self.model_name = model_name
        self.options = options
        self.sampling_defaults = dict(sampling_defaults or {})   # --generation-config's
        self.metrics = Metrics(model_name)
        self.created = int(time.time())
        self.pool = ThreadPoolExecutor(options.tokenizer_threads,
                                       thread_name_prefix="pdserve-tokenize")
        self.waiting: set[RequestStream] = set()  # admitted, no output yet
        # the streams of open streamed bodies, each with its body's time of last write: one task
        # nudges a body quiet for keepalive_s (a keep-alive comment), instead of a timer per wait
        self._quiet: dict[RequestStream, list[float]] = {}
        self._keepalive_task: asyncio.Task | None = None
        self.draining = False   # a shutdown has begun
        self.tool_parser: ToolParser = get_tool_parser(
            options.tool_call_parser or parser_for_template(
                None if engine.tokenizer is None else engine.tokenizer.chat_template_for(True)))

    # ---- helpers -------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ValueError(f"model {name!r} is not served here (this server has "
                             f"{self.model_name!r})")

    def tokenizer(self):
        if self.engine.tokenizer is None:
            raise ValueError("this server has no tokenizer (started with skip_tokenizer_init)")
        return self.engine.tokenizer

    async def off_loop(self, fn: Callable, *args):
        """fn(*args) on the tokenizer threads. Whatever it raises is the request's fault (a
        ValueError: a 400), named, never the server's."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - a template's or a tokenizer's error on input
            raise ValueError(f"the request cannot be tokenized: {type(e).__name__}: {e}") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids (runs on the tokenizer threads); ValueError when it cannot fit
        the context, judged from its head when it is far longer than the context holds."""
        tok = self.tokenizer()
        limit = self.engine.max_model_len
        head = _HEAD_CHARS_PER_TOKEN * limit
        if len(text) > head:
            n = len(tok.encode(text[:head], add_special_tokens))
            if n > limit + _HEAD_MARGIN:
                raise ValueError(f"the prompt has more than {n - _HEAD_MARGIN} tokens (counted in "
                                 f"its first {head} of {len(text)} characters); max_model_len "
                                 f"is {limit}")
        return tok.encode(text, add_special_tokens)

    def check_length(self, num_prompt: int, max_tokens: int) -> None:
        limit = self.engine.max_model_len
        if num_prompt >= limit:
            raise ValueError(f"the prompt has {num_prompt} tokens; max_model_len is {limit} "
                             "(room for at least one generated token is needed)")
        if num_prompt + max_tokens > limit:
            raise ValueError(f"max_tokens {max_tokens} is more than the context leaves: the "
                             f"prompt has {num_prompt} tokens and max_model_len is {limit}, so "
                             f"at most {limit - num_prompt} can be generated")

    async def admit(self, reqs: list[AddRequest], arrival: float | None = None
                    ) -> list[RequestStream]:
        """Admits every engine request of one HTTP request, or none: the first rejection is
        raised (ValueError: 400; EngineDeadError: 503) and the admitted ones are aborted.
        Each admitted stream counts as waiting until its first output or its close().
        arrival: the HTTP request's time.perf_counter() stamp (http.ArrivalStamp), for the
        admission time of each admitted request."""
        if self.draining:
            raise EngineDeadError("the server is shutting down")
        limit = self.options.max_queued_requests
        if limit is not None and len(self.waiting) >= limit:
            raise Busy(f"{len(self.waiting)} requests are waiting for their first token "
                        f"(--max-queued-requests {limit}); retry later")
        got = await asyncio.gather(*(self.engine.add(r) for r in reqs), return_exceptions=True)
        streams = [g for g in got if isinstance(g, RequestStream)]
        self.waiting.update(streams)
        if arrival is not None:
            for st in streams:
                self.metrics.admission.observe(st.added - arrival)
        error = next((g for g in got if isinstance(g, BaseException)), None)
        if error is not None:
            await self.close(streams)
            raise error
        return streams

    async def close(self, streams: list[RequestStream]) -> None:
        """Idempotent: aborts the streams' requests unless they finished."""
        for st in streams:
            self.waiting.discard(st)
            await st.aclose()

    async def outputs(self, stream: RequestStream) -> AsyncIterator[list[RequestOutput]]:
        """An admitted request's output batches, timed for the metrics; leaving early aborts
        the request."""
        timer = RequestTimer(self.metrics, stream.added)
        try:
            async for batch in stream:
                if batch:        # (empty: a keep-alive nudge)
                    self.waiting.discard(stream)
                for out in batch:
                    timer.on_output(out)
                # (the workers' gauges are refreshed where they are read, by /metrics; once per
                # stream and output batch they cost ~5 us each, a few % of a streamed write)
                yield batch
        except (ValueError, GeneratorExit, asyncio.CancelledError):
            raise
        except BaseException:
            self.metrics.failed.inc()
            raise
        finally:
            await self.close([stream])

    async def merged(self, gens: list[AsyncIterator[list[RequestOutput]]]
                     ) -> AsyncIterator[tuple[int, list[RequestOutput]]]:
        """(index of the generator, batch of outputs) from several requests as they come."""
        if len(gens) == 1:
            try:
                async for out in gens[0]:
                    yield 0, out
            finally:
                await gens[0].aclose()
            return
        q: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i, gen):
            try:
                async for out in gen:
                    await q.put((i, out))
            except BaseException as e:  # noqa: BLE001 - hand it to the consumer
                await q.put((i, e))
            finally:
                await q.put((i, done))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        try:
            left = len(gens)
            while left:
                i, item = await q.get()
                if item is done:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for g in gens:
                with contextlib.suppress(BaseException):
                    await g.aclose()

    def usage(self, finals: list[RequestOutput], score_only: bool = False) -> dict:
        """score_only: the one token generated to score a prompt (max_tokens 0) is not counted."""
        prompt = sum(len(o.prompt_token_ids) for o in finals)
        completion = 0 if score_only else sum(len(c.token_ids) for o in finals for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {
                    "cached_tokens": sum(o.num_cached_tokens for o in finals)}}

    def token_text(self, tid: int) -> str:
        tok = self.engine.tokenizer
        return str(tid) if tok is None else tok.decode([tid], False)

    # ---- completions ---------------------------------------------------------------------------
    async def completion_prompts(self, req: CompletionRequest) -> list[dict]:
        """Each prompt as {"prompt_token_ids", and "prompt" for a text}: texts are tokenized
        off the event loop."""
        p = req.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [{"prompt_token_ids": list(p)}]
        elif p and all(isinstance(x, str) for x in p):
            prompts = list(p)
        elif p and all(isinstance(x, list) for x in p):
            prompts = [{"prompt_token_ids": x} for x in p]
        else:
            raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                             "or a list of token-id lists, and not empty")
        if any(isinstance(x, str) and not x for x in prompts):
            raise ValueError("prompt is empty")
        texts = [x for x in prompts if isinstance(x, str)]
        if texts:
            self.tokenizer()  # (a clear error first when there is none)
            ids = iter(await asyncio.gather(*(self.off_loop(self.encode, t) for t in texts)))
            prompts = [{"prompt": x, "prompt_token_ids": next(ids)} if isinstance(x, str) else x
                       for x in prompts]
        return prompts

    def completion_logprobs(self, token_ids: list[int], entries: list, start_offset: int,
                            k: int, first_is_none: bool = False) -> dict:
        """The legacy completions logprobs object; with first_is_none (echoed prompt) the first
        token has no logprob."""
        tokens, lps, tops, offsets = [], [], [], []
        off = start_offset
        for j, tid in enumerate(token_ids):
            text = self.token_text(tid)
            entry = entries[j] if j < len(entries) else None
            tokens.append(text)
            if entry is None:
                lps.append(None)
                tops.append(None)
            else:
                lps.append(entry[tid].logprob if tid in entry else None)
                ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:k]
                tops.append({self.token_text(t): lp.logprob for t, lp in ranked})
            offsets.append(off)
            off += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": offsets}

    async def completions(self, req: CompletionRequest, raw: Request):
        self.check_model(req.model)
        if req.suffix is not None:
            raise ValueError("suffix is not supported")
        if req.best_of is not None and req.best_of != req.n:
            raise ValueError("best_of other than n is not supported")
        prompt_lp = req.echo and req.logprobs is not None
        # max_tokens 0 scores the prompt only (echo): one token is generated and dropped
        score_only = req.echo and req.max_tokens == 0
        if req.max_tokens is not None and req.max_tokens < 1 and not score_only:
            raise ValueError(f"max_tokens must be at least 1 (0 only with echo), got {req.max_tokens}")
        params = req.sampling_params(1 if score_only else req.max_tokens, req.logprobs,
                                     self.sampling_defaults)
        if prompt_lp:
            params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
        prompts = await self.completion_prompts(req)
        for prompt in prompts:
            self.check_length(len(prompt["prompt_token_ids"]), params.max_tokens)
        cid = f"cmpl-{next(_ids)}"
        streams = await self.admit([AddRequest(f"{cid}-{i}", p, params)
                                    for i, p in enumerate(prompts)], _arrival(raw))
        n = params.n
        if req.stream:
            offsets: dict = {}
            return self.stream(
                streams, lambda i, out: self.completion_chunks(cid, req, n, i, out, offsets, score_only),
                cid, "text_completion", req, score_only=score_only)
        finals = await self.collect(streams, raw)
        choices = []
        tok = self.engine.tokenizer
        for i, out in enumerate(finals):
            prefix = ""
            if req.echo:
                prefix = out.prompt if out.prompt is not None else (
                    tok.decode(out.prompt_token_ids) if tok is not None else "")
            for c in out.outputs:
                gen_ids, gen_lp, text = c.token_ids, c.logprobs or [], c.text
                if score_only:
                    gen_ids, gen_lp, text = [], [], ""
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self.completion_logprobs(gen_ids, gen_lp, len(prefix), req.logprobs)
                    if prompt_lp:
                        head = self.completion_logprobs(out.prompt_token_ids,
                                                        out.prompt_logprobs or [], 0, req.logprobs)
                        logprobs = {key: head[key] + logprobs[key] for key in logprobs}
                choices.append({"index": i * n + c.index, "text": prefix + text,
                                "logprobs": logprobs, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
        return {"id": cid, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": self.usage(finals, score_only)}

    def completion_chunks(self, cid: str, req: CompletionRequest, n: int, i: int,
                          out: RequestOutput, offsets: dict, score_only: bool) -> list[dict]:
        """Stream chunks of one engine step. The first chunk of an echoed choice carries the
        prompt (and, with logprobs, the prompt's logprobs, the first null); text_offset counts
        from the start of the choice's whole text (offsets: characters sent so far per choice)."""
        chunks = []
        k = req.logprobs
        for c in out.outputs:
            if not c.new_token_ids and not c.finished:
                continue
            key = (i, c.index)
            first = key not in offsets
            text, lp = "", None
            if req.echo and first:
                tok = self.engine.tokenizer
                text = out.prompt if out.prompt is not None else (
                    tok.decode(out.prompt_token_ids) if tok is not None else "")
                if k is not None:
                    lp = self.completion_logprobs(out.prompt_token_ids, out.prompt_logprobs or [],
                                                  0, k)
            if not score_only:
                if k is not None:
                    new = len(c.new_token_ids)
                    entries = (c.logprobs or [])[len(c.logprobs or []) - new:] if new else []
                    part = self.completion_logprobs(c.new_token_ids, entries,
                                                    offsets.get(key, 0) + len(text), k)
                    lp = part if lp is None else {f: lp[f] + part[f] for f in lp}
                text += c.new_text
            offsets[key] = offsets.get(key, 0) + len(text)
            if score_only and not first and not c.finished:
                continue  # the scoring run's one generated token is not shown
            # otherwise a chunk per step with new tokens, even with no text (no tokenizer, or
            # an incomplete UTF-8 sequence): clients count chunks as token arrivals
            chunks.append({"id": cid, "object": "text_completion", "created": int(time.time()),
                           "model": self.model_name,
                           "choices": [{"index": i * n + c.index, "text": text, "logprobs": lp,
                                        "finish_reason": c.finish_reason,
                                        "stop_reason": c.stop_reason}]})
        return chunks

    # ---- chat ----------------------------------------------------------------------------------
    @staticmethod
    def chat_messages(messages) -> list[dict]:
        out = []
        for i, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):  # content parts: the text ones
                content = "".join(p.get("text", "") for p in content
                                  if isinstance(p, dict) and p.get("type") == "text")
            extra = dict(m.model_extra or {})
            if "tool_calls" in extra:
                extra["tool_calls"] = _template_tool_calls(extra["tool_calls"], f"messages.{i}")
            out.append({**extra, "role": m.role, "content": content or ""})
        return out

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool,
                 tools: list[dict] | None = None) -> list[int]:
        """The rendered chat's token ids (on the tokenizer threads): the template writes BOS
        where the model wants it; tools (OpenAI's JSON) go to the template as `tools`."""
        kw = {} if tools is None else {"tools": tools}
        text = self.tokenizer().apply_chat_template(messages, add_generation_prompt, **kw)
        return self.encode(text, add_special_tokens=False)

    def chat_logprobs(self, c, token_ids: list[int], entries: list, k: int) -> dict:
        content = []
        for tid, entry in zip(token_ids, entries):
            text = self.token_text(tid)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:k]
            content.append({
                "token": text, "logprob": entry[tid].logprob if tid in entry else None,
                "bytes": list(text.encode()),
                "top_logprobs": [{"token": self.token_text(t), "logprob": lp.logprob,
                                  "bytes": list(self.token_text(t).encode())} for t, lp in ranked]})
        return {"content": content}

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        self.check_model(req.model)
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        self.tokenizer()
        mode = req.tool_mode()
        tools = req.tool_dicts()
        if not mode.parse and self.options.exclude_tools_when_tool_choice_none:
            tools = None
        ids = await self.off_loop(self.chat_ids, self.chat_messages(req.messages),
                                  req.add_generation_prompt, tools)
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        k = req.top_logprobs or 0
        if req.top_logprobs is not None and not req.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        params = self.tool_params(req, mode, req.sampling_params(
            max_tokens, k if req.logprobs else None, self.sampling_defaults,
            max(1, self.engine.max_model_len - len(ids))))
        self.check_length(len(ids), params.max_tokens)
        parser = self.tool_parser if mode.parse else None
        cid = f"chatcmpl-{next(_ids)}"
        streams = await self.admit([AddRequest(cid, {"prompt_token_ids": ids}, params)],
                                   _arrival(raw))
        if req.stream:
            calls = _StreamedCalls(parser, req.parallel_tool_calls is False)
            return self.stream(streams, lambda i, out: self.chat_chunks(cid, req, out, calls),
                               cid, "chat.completion.chunk", req,
                               first=self.chat_role_chunks(cid, params.n))
        (out,) = await self.collect(streams, raw)
        choices = []
        for c in out.outputs:
            message, finish = {"role": "assistant", "content": c.text}, c.finish_reason
            if parser is not None:
                message, finish = _tool_message(parser.extract(c.text), finish,
                                                req.parallel_tool_calls is False)
            choices.append({"index": c.index, "message": message,
                            "logprobs": (self.chat_logprobs(c, c.token_ids, c.logprobs or [], k)
                                         if req.logprobs else None),
                            "finish_reason": finish, "stop_reason": c.stop_reason})
        return {"id": cid, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": self.usage([out])}

    def tool_params(self, req: ChatCompletionRequest, mode: ToolMode, params):
        """The sampling parameters a tool mode needs: the parser's special tokens kept; for
        tool_choice required or a named function, the parser's grammar of its calls."""
        if not mode.parse:
            return params
        if self.tool_parser.keep_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        if mode.constrain:
            if params.structured_outputs is not None:
                raise ValueError("tool_choice 'required' or a named function constrains the output "
                                 "itself; give no other output constraint (response_format, "
                                 "structured_outputs, guided_*) with it")
            specs = [ToolSpec(t.function.name, t.function.parameters) for t in req.tools]
            params = dataclasses.replace(params, structured_outputs=self.tool_parser.constraint(
                specs, mode.name, parallel=req.parallel_tool_calls is not False))
        return params

    def chat_role_chunks(self, cid: str, n: int) -> list[dict]:
        return [{"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                 "model": self.model_name,
                 "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]} for i in range(n)]

    def chat_chunks(self, cid: str, req: ChatCompletionRequest, out: RequestOutput,
                    calls: _StreamedCalls) -> list[dict]:
        chunks = []
        for c in out.outputs:
            if not c.new_token_ids and not c.finished:
                continue
            lp = None
            if req.logprobs:
                k = len(c.new_token_ids)
                lp = self.chat_logprobs(c, c.new_token_ids, (c.logprobs or [])[-k:] if k else [],
                                        req.top_logprobs or 0)
            delta, finish = calls.delta(c.index, c.new_text, c.finished, c.finish_reason)
            if not delta and lp is None and not c.finished:
                continue   # text the tool-call parser holds (a tag begun, a call's head)
            chunks.append({"id": cid, "object": "chat.completion.chunk",
                           "created": int(time.time()), "model": self.model_name,
                           "choices": [{"index": c.index, "delta": delta,
                                        "logprobs": lp, "finish_reason": finish}]})
        return chunks

    # ---- running requests ----------------------------------------------------------------------
    async def collect(self, streams: list[RequestStream], raw: Request) -> list[RequestOutput]:
        """Final outputs of every request; aborts them all if the client hangs up first."""
        finals: list[RequestOutput | None] = [None] * len(streams)

        async def consume():
            async for i, batch in self.merged([self.outputs(st) for st in streams]):
                if batch[-1].finished:
                    finals[i] = batch[-1]

        task = asyncio.create_task(consume())
        try:
            while not task.done():
                await asyncio.wait([task], timeout=0.5)
                if not task.done() and await raw.is_disconnected():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    raise asyncio.CancelledError("client disconnected")
            task.result()  # re-raise ValueError / EngineDeadError
        finally:
            if not task.done():
                task.cancel()
            await self.close(streams)
        return finals  # type: ignore[return-value]

    def stream(self, streams: list[RequestStream], to_chunks, cid: str, obj: str, req,
               first: list | None = None, score_only: bool = False) -> StreamingResponse:
        """The SSE response of admitted requests: headers and a comment at once, a comment
        after every keepalive_s without an event, and a terminal event whatever happens (the
        outputs' end, an error event + [DONE] when the deployment ends the requests)."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def body():
            # One write per batch of outputs (every event of every step that arrived since the
            # last write), each event encoded by msgspec: per-event cost is what caps a stream
            # server's tokens/s.
            finals = {}
            it = self.merged([self.outputs(st) for st in streams])
            # Read in place, without a task and a timer per wait (half of the API's CPU per
            # streamed token under load: scripts/bench_api.py): the keep-alive task nudges a
            # stream of this body when none was written for keepalive_s (an empty batch).
            last = self._watch_quiet(streams)
            try:
                yield b": admitted\n\n" + b"".join(sse(ch) for ch in first or ())
                async for i, batch in it:
                    if not batch:                # the keep-alive task's nudge
                        yield b": keep-alive\n\n"
                        continue
                    last[0] = time.monotonic()
                    if batch[-1].finished:
                        finals[i] = batch[-1]
                        self._quiet.pop(streams[i], None)   # (a nudge to it would wake no one)
                    data = b"".join(sse(ch) for out in batch for ch in to_chunks(i, out))
                    if data:
                        yield data
                tail = b""
                if include_usage:
                    tail = sse({"id": cid, "object": obj, "created": int(time.time()),
                                 "model": self.model_name, "choices": [],
                                 "usage": self.usage(list(finals.values()), score_only)})
                yield tail + b"data: [DONE]\n\n"
            except ValueError as e:
                yield error_event(str(e), 400)
            except EngineDeadError as e:
                yield error_event(str(e), 503)
            except Exception as e:  # noqa: BLE001 - a stream always ends with a terminal event
                yield error_event(f"internal error: {type(e).__name__}: {e}", 500)
            finally:
                for st in streams:
                    self._quiet.pop(st, None)
                await it.aclose()
                await self.close(streams)

        # (the background task also runs when the client left before the body started)
        return StreamingResponse(body(), media_type="text/event-stream",
                                 background=BackgroundTask(self.close, streams))

    def _watch_quiet(self, streams: list[RequestStream]) -> list[float]:
        """Keep-alives for a streamed body: the body sets [0] to the time of each write (one
        list for all its streams); the keep-alive task nudges one of them when keepalive_s
        passed without a write. The body unregisters a stream when it finishes."""
        last = [time.monotonic()]
        for st in streams:
            self._quiet[st] = last
        if self._keepalive_task is None or self._keepalive_task.done():
            self._keepalive_task = asyncio.create_task(self._keep_alive())
        return last

    async def _keep_alive(self) -> None:
        """While streamed bodies are open: every keepalive_s / 4, nudge a stream of each body
        without a write for keepalive_s (the body then writes a keep-alive comment; its time
        counts as a write, so its other streams are passed over). Ends when none is left (the
        next body starts it again: no await between the check and the end)."""
        period = self.options.keepalive_s
        while self._quiet:
            await asyncio.sleep(period / 4)
            now = time.monotonic()
            for stream, last in list(self._quiet.items()):
                if now - last[0] >= period:
                    last[0] = now
                    stream.nudge()
        self._keepalive_task = None

    # ---- shutdown ------------------------------------------------------------------------------
    def begin_shutdown(self) -> None:
        """The first SIGTERM/SIGINT (on the event loop): no new requests; the ones in flight
        have shutdown_timeout_s to finish, then end with an error (see end_in_flight)."""
        if self.draining:
            return
        self.draining = True
        asyncio.get_running_loop().call_later(self.options.shutdown_timeout_s, self.end_in_flight)

    def end_in_flight(self) -> None:
        n = self.engine.end_all(f"the server is shutting down: the drain timeout "
                                f"({self.options.shutdown_timeout_s:g} s) has passed")
        if n:
            print(f"pdserve: ended {n} request(s) still running at the drain deadline",
                  file=sys.stderr, flush=True)
