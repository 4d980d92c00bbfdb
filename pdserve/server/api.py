"""`pdserve serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

    POST /v1/completions, /v1/chat/completions (SSE when stream=true)
    GET  /v1/models, /health, /metrics (Prometheus), /tokenizer_info
    POST /tokenize, /detokenize

The engine runs in worker processes (an EngineClient driven through AsyncEngine); this process
only parses, tokenizes chat templates, formats and streams. Every client mistake is a 400 with an
OpenAI-style error body; a dropped connection aborts its requests.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import sys
import time
from typing import Any, AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.llm_engine import AddRequest
from ..outputs import RequestOutput
from ..worker.client import EngineDeadError
from .async_engine import AsyncEngine
from .metrics import Metrics, RequestTimer
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       ErrorResponse, TokenizeRequest)

_ids = itertools.count()
_json = msgspec.json.Encoder()


def _sse(obj: dict) -> bytes:
    """One server-sent event carrying obj as JSON."""
    return b"data: " + _json.encode(obj) + b"\n\n"


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors()[:5]:
        if e.get("type") == "json_invalid":
            return f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))})"
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts) or "invalid request"


class _Server:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.metrics = Metrics()
        self.created = int(time.time())

    # ---- helpers -------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ValueError(f"model {name!r} is not served here (this server has "
                             f"{self.model_name!r})")

    def tokenizer(self):
        if self.engine.tokenizer is None:
            raise ValueError("this server has no tokenizer (started with skip_tokenizer_init)")
        return self.engine.tokenizer

    async def run(self, rid: str, prompt: Any, params) -> AsyncIterator[list[RequestOutput]]:
        """The request's outputs in batches: all that have arrived since the consumer last
        asked (see AsyncEngine.generate_batches)."""
        timer = RequestTimer(self.metrics)
        # Closed explicitly: an abandoned async generator would abort its request only when
        # the garbage collector finalizes it.
        gen = self.engine.generate_batches(AddRequest(rid, prompt, params))
        try:
            async for batch in gen:
                for out in batch:
                    timer.on_output(out)
                self.metrics.update_stats(self.engine.stats)
                yield batch
        except (ValueError, GeneratorExit, asyncio.CancelledError):
            raise
        except BaseException:
            self.metrics.failed.inc()
            raise
        finally:
            await gen.aclose()

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
                "prompt_tokens_details": {"cached_tokens": 0}}

    def token_text(self, tid: int) -> str:
        tok = self.engine.tokenizer
        return str(tid) if tok is None else tok.decode([tid], False)

    # ---- completions ---------------------------------------------------------------------------
    def completion_prompts(self, req: CompletionRequest) -> list[Any]:
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
        if req.max_tokens is None or (req.max_tokens < 1 and not score_only):
            raise ValueError(f"max_tokens must be at least 1 (0 only with echo), got {req.max_tokens}")
        params = req.sampling_params(1 if score_only else req.max_tokens, req.logprobs)
        if prompt_lp:
            params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
        prompts = self.completion_prompts(req)
        cid = f"cmpl-{next(_ids)}"
        gens = [self.run(f"{cid}-{i}", p, params) for i, p in enumerate(prompts)]
        n = params.n
        if req.stream:
            offsets: dict = {}
            return await self.stream(
                gens, lambda i, out: self.completion_chunks(cid, req, n, i, out, offsets, score_only),
                cid, "text_completion", req, score_only=score_only)
        finals = await self.collect(gens, raw)
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
    def chat_prompt(self, req: ChatCompletionRequest) -> dict:
        tok = self.tokenizer()
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content
                                  if isinstance(p, dict) and p.get("type") == "text")
            messages.append({**(m.model_extra or {}), "role": m.role, "content": content or ""})
        ids = tok.apply_chat_template(messages, req.add_generation_prompt, tokenize=True)
        return {"prompt_token_ids": ids}

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
        prompt = self.chat_prompt(req)
        if max_tokens is None:
            max_tokens = max(1, self.engine.max_model_len - len(prompt["prompt_token_ids"]))
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        k = req.top_logprobs or 0
        if req.top_logprobs is not None and not req.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        params = req.sampling_params(max_tokens, k if req.logprobs else None)
        cid = f"chatcmpl-{next(_ids)}"
        gens = [self.run(cid, prompt, params)]
        if req.stream:
            return await self.stream(gens, lambda i, out: self.chat_chunks(cid, req, out),
                                     cid, "chat.completion.chunk", req, first=self.chat_role_chunks(cid, params.n))
        (out,) = await self.collect(gens, raw)
        choices = [{"index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": (self.chat_logprobs(c, c.token_ids, c.logprobs or [], k)
                                 if req.logprobs else None),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for c in out.outputs]
        return {"id": cid, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": self.usage([out])}

    def chat_role_chunks(self, cid: str, n: int) -> list[dict]:
        return [{"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                 "model": self.model_name,
                 "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]} for i in range(n)]

    def chat_chunks(self, cid: str, req: ChatCompletionRequest, out: RequestOutput) -> list[dict]:
        chunks = []
        for c in out.outputs:
            if not c.new_token_ids and not c.finished:
                continue
            lp = None
            if req.logprobs:
                k = len(c.new_token_ids)
                lp = self.chat_logprobs(c, c.new_token_ids, (c.logprobs or [])[-k:] if k else [],
                                        req.top_logprobs or 0)
            chunks.append({"id": cid, "object": "chat.completion.chunk",
                           "created": int(time.time()), "model": self.model_name,
                           "choices": [{"index": c.index, "delta": {"content": c.new_text},
                                        "logprobs": lp, "finish_reason": c.finish_reason}]})
        return chunks

    # ---- running requests ----------------------------------------------------------------------
    async def collect(self, gens, raw: Request) -> list[RequestOutput]:
        """Final outputs of every request; aborts them all if the client hangs up first."""
        finals: list[RequestOutput | None] = [None] * len(gens)

        async def consume():
            async for i, batch in self.merged(gens):
                if batch[-1].finished:
                    finals[i] = batch[-1]

        task = asyncio.create_task(consume())
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise asyncio.CancelledError("client disconnected")
        task.result()  # re-raise ValueError / EngineDeadError
        return finals  # type: ignore[return-value]

    async def stream(self, gens, to_chunks, cid: str, obj: str, req, first: list | None = None,
                     score_only: bool = False):
        """An SSE response. The first output is awaited before answering, so a request the
        engine rejects still gets a plain 400."""
        it = self.merged(gens).__aiter__()
        try:
            head = await it.__anext__()
        except StopAsyncIteration:
            head = None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def body():
            # One write per batch of outputs (every event of every step that arrived since the
            # last write), each event encoded by msgspec: per-event cost is what caps a stream
            # server's tokens/s.
            finals = {}
            try:
                if first:
                    yield b"".join(_sse(ch) for ch in first)
                pending = [head] if head is not None else []
                while True:
                    if pending:
                        i, batch = pending.pop()
                    else:
                        try:
                            i, batch = await it.__anext__()
                        except StopAsyncIteration:
                            break
                    if batch[-1].finished:
                        finals[i] = batch[-1]
                    data = b"".join(_sse(ch) for out in batch for ch in to_chunks(i, out))
                    if data:
                        yield data
                tail = b""
                if include_usage:
                    tail = _sse({"id": cid, "object": obj, "created": int(time.time()),
                                 "model": self.model_name, "choices": [],
                                 "usage": self.usage(list(finals.values()), score_only)})
                yield tail + b"data: [DONE]\n\n"
            except (ValueError, EngineDeadError) as e:
                yield _sse({"error": {"message": str(e), "type": "server_error", "param": None,
                                      "code": 500}})
            finally:
                await it.aclose()

        return StreamingResponse(body(), media_type="text/event-stream")


def build_app(engine: AsyncEngine, model_name: str) -> FastAPI:
    srv = _Server(engine, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await engine.shutdown()  # uvicorn has let in-flight requests finish (SIGTERM drains)

    app = FastAPI(title="pdserve", version="0.1", lifespan=lifespan,
                  responses={400: {"model": ErrorResponse}})
    app.state.server = srv

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request, exc: RequestValidationError):
        return _error(400, _validation_message(exc))

    @app.exception_handler(ValueError)
    async def _bad_value(request, exc: ValueError):
        return _error(400, str(exc))

    @app.exception_handler(EngineDeadError)
    async def _dead(request, exc: EngineDeadError):
        return _error(503, f"the engine is not available: {exc}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await srv.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        return await srv.chat(req, raw)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": srv.created, "owned_by": "pdserve",
            "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health():
        if engine.dead is not None:
            return _error(503, engine.dead)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        if engine.dead is None:  # fresh worker state (running, waiting, KV blocks)
            with contextlib.suppress(EngineDeadError, AssertionError):
                srv.metrics.update_stats(await engine.check_integrity())
        routes = getattr(engine.client, "route_stats", None)
        if routes is not None:
            srv.metrics.update_routes(routes)
        return Response(srv.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/admin/check")
    async def admin_check():
        """The worker's invariants (block pool, scheduler) and its KV use, between two steps."""
        try:
            stats = await engine.check_integrity()
        except AssertionError as e:
            return _error(500, str(e))
        return {"ok": True, "num_running": stats.num_running, "num_waiting": stats.num_waiting,
                "num_kv_blocks_used": stats.num_kv_blocks_used,
                "num_kv_blocks": stats.num_kv_blocks, "worker_pids": engine.client.pids}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        srv.check_model(req.model)
        tok = srv.tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            ids = tok.apply_chat_template([m.model_dump() for m in req.messages],
                                          req.add_generation_prompt, tokenize=True)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        srv.check_model(req.model)
        tok = srv.tokenizer()
        bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {tok.vocab_size})")
        return {"prompt": tok.decode(req.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tok = srv.tokenizer()
        return {"tokenizer_class": "pdserve.Tokenizer", "vocab_size": tok.vocab_size,
                "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                "model_max_length": engine.max_model_len, "chat_template": tok.chat_template}

    return app


def main(argv: list[str] | None = None) -> int:
    from ..cli import _deployment_args, _engine_args, engine_config
    p = argparse.ArgumentParser(prog="pdserve serve")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model value or the file name)")
    p.add_argument("--log-level", default="warning")
    _engine_args(p)
    _deployment_args(p)
    a = p.parse_args(argv)
    import os

    import uvicorn

    from ..worker.client import EngineClient
    config = engine_config(a)
    make_client = lambda: EngineClient(config)  # noqa: E731
    if a.prefill or a.decode or a.collocated:  # several workers behind a router (P/D)
        from ..disagg.router import Router, plan_workers
        specs = plan_workers(config, a.prefill, a.decode, a.collocated, a.prefill_tp,
                             a.decode_tp, a.collocated_tp, a.kv_connector)
        policy = a.routing_policy or ("disagg" if a.prefill else "collocated")
        make_client = lambda: Router(specs, policy)  # noqa: E731
    name = a.served_model_name or (os.path.basename(os.path.normpath(a.model)) if a.model
                                   else "SmolLM2-135M-Instruct")

    async def serve():
        client = await asyncio.to_thread(make_client)
        engine = AsyncEngine(client, asyncio.get_running_loop())
        app = build_app(engine, name)
        server = uvicorn.Server(uvicorn.Config(app, host=a.host, port=a.port,
                                               log_level=a.log_level, timeout_graceful_shutdown=60))
        print(f"pdserve: serving {name!r} on http://{a.host}:{a.port}", file=sys.stderr, flush=True)
        await server.serve()

    try:
        asyncio.run(serve())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
