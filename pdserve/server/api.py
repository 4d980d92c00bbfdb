"""`pdserve serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

    POST /v1/completions, /v1/chat/completions (SSE when stream=true)
    GET  /v1/models, /health, /metrics (Prometheus), /tokenizer_info
    POST /tokenize, /detokenize
With --api-key, /v1/* needs "Authorization: Bearer KEY" (else 401); CORS headers as
--allowed-origins says (every origin by default, as vLLM).

The engine runs in worker processes behind a Router (one collocated worker, or a P/D
deployment), driven through AsyncEngine; this process parses, tokenizes and renders chat
templates (on a thread pool, never on the event loop), formats and streams.

What a client can see go wrong, and how:
    its own mistake (bad field, prompt too long, text that is not Unicode)   400 + error body
    a body over --max-request-bytes                                          413
    --max-queued-requests requests already waiting for a first token         503 + Retry-After
    no live worker now (one is restarting), or its worker died mid-request   503, or in a stream
    the drain deadline of a shutdown                                         an error event + [DONE]
    anything unexpected                                                      500 + error body
A stream answers with its headers (and an SSE comment) as soon as the request is admitted, then
sends a comment after every --keepalive seconds of silence; a dropped connection aborts its
requests.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..worker.client import EngineDeadError
from .async_engine import AsyncEngine
from .console import StatsLine, log_stats
from .http import (ArrivalStamp, BearerAuth, BodyLimit, BodyTooLarge, Busy, ServeOptions,
                   error_response, too_large, validation_message)
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       ErrorResponse, TokenizeRequest)
from .serving import OpenAIServing


def build_app(engine: AsyncEngine, model_name: str, options: ServeOptions | None = None,
              sampling_defaults: dict | None = None) -> FastAPI:
    """sampling_defaults: the values a request leaves out (SamplingParams fields; the model's
    generation config, loader/generation_config.py)."""
    options = options or ServeOptions()
    srv = OpenAIServing(engine, model_name, options, sampling_defaults)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        stats_task = None
        if options.log_stats_interval_s is not None:
            line = StatsLine(srv.metrics.sample, lambda: engine.stats)
            stats_task = asyncio.create_task(log_stats(line, options.log_stats_interval_s))
        yield
        if stats_task is not None:
            stats_task.cancel()
        # uvicorn has let in-flight requests finish (or end at the drain deadline)
        await engine.shutdown(5.0)
        srv.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="pdserve", version="0.1", lifespan=lifespan,
                  responses={400: {"model": ErrorResponse}})
    app.state.server = srv
    app.add_middleware(BodyLimit, limit=options.max_request_bytes)
    if options.api_key is not None:
        app.add_middleware(BearerAuth, api_key=options.api_key)
    if options.allowed_origins:   # (added after the key: outside it, so preflights need none)
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                           allow_credentials=options.allow_credentials,
                           allow_methods=list(options.allowed_methods),
                           allow_headers=list(options.allowed_headers))
    app.add_middleware(ArrivalStamp)   # (added last: outermost)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request, exc: RequestValidationError):
        return error_response(400, validation_message(exc))

    @app.exception_handler(ValueError)
    async def _bad_value(request, exc: ValueError):
        return error_response(400, str(exc))

    @app.exception_handler(EngineDeadError)
    async def _dead(request, exc: EngineDeadError):
        return error_response(503, f"the engine is not available: {exc}", headers={"Retry-After": "1"})

    @app.exception_handler(Busy)
    async def _busy(request, exc: Busy):
        return error_response(503, str(exc), headers={"Retry-After": "1"})

    @app.exception_handler(BodyTooLarge)
    async def _chunked_too_large(request, exc: BodyTooLarge):
        return too_large(options.max_request_bytes)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        # a bug, never the client's fault; still an OpenAI error body, never plain text
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

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

    def workers() -> list[dict]:
        # a snapshot read from the event loop while the I/O thread runs the router: plain
        # attribute reads, no step boundary to wait for (health must answer at once)
        return [dataclasses.asdict(h) for h in engine.client.health()]

    @app.get("/health")
    async def health():
        """200 while requests can be served (the body names any worker that is not up:
        "degraded"); 503 when none can (every worker down or restarting, the engine gone,
        a shutdown begun)."""
        if engine.dead is not None:
            return JSONResponse({"status": "dead", "reason": engine.dead}, status_code=503)
        if srv.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        ws = workers()
        up = [w for w in ws if w["state"] == "up"]
        if not up:
            return JSONResponse({"status": "unavailable", "workers": ws}, status_code=503)
        if len(up) < len(ws):
            return JSONResponse({"status": "degraded", "workers": ws})
        return JSONResponse({"status": "ok", "workers": ws})

    @app.get("/metrics")
    async def metrics():
        if engine.dead is None:  # fresh worker state (running, waiting, KV blocks)
            with contextlib.suppress(EngineDeadError, AssertionError):
                srv.metrics.update_stats(await engine.check_integrity())
        srv.metrics.update_routes(engine.client.route_stats)
        srv.metrics.update_models(engine.client.model_stats)
        srv.metrics.update_workers(engine.client.health())
        return Response(srv.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/admin/check")
    async def admin_check():
        """The workers' invariants (block pool, scheduler) and their KV use, between two steps."""
        try:
            stats = await engine.check_integrity()
        except AssertionError as e:
            return error_response(500, str(e))
        return {"ok": True, "num_running": stats.num_running, "num_waiting": stats.num_waiting,
                "num_kv_blocks_used": stats.num_kv_blocks_used,
                "num_kv_blocks": stats.num_kv_blocks, "worker_pids": engine.client.pids,
                "worker_ranks": engine.client.worker_ranks(), "workers": workers()}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Forget the workers' cached prompt prefixes (those no request in flight uses)."""
        return {"num_blocks_freed": await engine.reset_prefix_cache()}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        srv.check_model(req.model)
        tok = srv.tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if req.prompt is not None:
            ids = await srv.off_loop(tok.encode, req.prompt, req.add_special_tokens)
        else:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = await srv.off_loop(srv.chat_ids, srv.chat_messages(req.messages),
                                     req.add_generation_prompt, tools)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        srv.check_model(req.model)
        tok = srv.tokenizer()
        bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {tok.vocab_size})")
        return {"prompt": await srv.off_loop(tok.decode, req.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tok = srv.tokenizer()
        return {"tokenizer_class": "pdserve.Tokenizer", "vocab_size": tok.vocab_size,
                "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                "model_max_length": engine.max_model_len, "chat_template": tok.chat_template}

    return app
