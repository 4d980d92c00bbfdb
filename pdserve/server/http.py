"""HTTP plumbing of the server: OpenAI error bodies, server-sent events, the body-size limit,
the API key check and the options that protect the server and its clients (ServeOptions)."""
from __future__ import annotations

import hmac
import time
from dataclasses import dataclass

import msgspec
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ..checks import check_int, check_number
from .tool_parsers import get_tool_parser

_json = msgspec.json.Encoder()


def sse(obj: dict) -> bytes:
    """One server-sent event carrying obj as JSON."""
    return b"data: " + _json.encode(obj) + b"\n\n"


def error_response(status: int, message: str, param: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status, headers=headers)


def error_event(message: str, code: int = 503) -> bytes:
    return sse({"error": {"message": message, "type": "server_error", "param": None,
                           "code": code}}) + b"data: [DONE]\n\n"


@dataclass(frozen=True)
class ServeOptions:
    """How the HTTP front protects itself and its clients (the `pdserve serve` flags)."""
    max_request_bytes: int = 32 * 2 ** 20  # a larger body is a 413 before it is parsed
    max_queued_requests: int | None = None  # waiting for a first token; beyond: 503
    shutdown_timeout_s: float = 120.0    # SIGTERM: streams get this long to finish
    keepalive_s: float = 10.0            # an SSE comment after this long without an event
    tokenizer_threads: int = 4           # tokenization and chat templates run there
    api_key: str | None = None           # /v1/* needs "Authorization: Bearer <api_key>"
    # CORS (as vLLM: every origin by default); an empty tuple adds no CORS headers
    allowed_origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    log_stats_interval_s: float | None = None  # the console's stats line (None: none)
    # the format of the model's tool calls (tool_parsers); None: the one its chat template writes
    tool_call_parser: str | None = None
    # tool_choice "none": leave the tools out of the prompt (by default they are rendered, as
    # vLLM does, and only the parsing is off)
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self):
        for name in ("max_request_bytes", "tokenizer_threads"):
            check_int(name, getattr(self, name))
        check_int("max_queued_requests", self.max_queued_requests, minimum=0, allow_none=True)
        for name in ("shutdown_timeout_s", "keepalive_s"):
            check_number(name, getattr(self, name))
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string (or None: no authentication)")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            v = getattr(self, name)
            if not isinstance(v, tuple) or not all(isinstance(x, str) and x for x in v):
                raise ValueError(f"{name} must be a tuple of non-empty strings, got {v!r}")
        if self.log_stats_interval_s is not None:
            check_number("log_stats_interval_s", self.log_stats_interval_s)
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)   # ValueError naming the known ones


class Busy(Exception):
    """Too many requests are waiting for their first token (503 with Retry-After)."""


class BodyTooLarge(Exception):
    pass


def too_large(limit: int) -> JSONResponse:
    return error_response(413, f"the request body is larger than the server's limit of {limit} bytes "
                       "(--max-request-bytes)")


def validation_message(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors()[:5]:
        if e.get("type") == "json_invalid":
            return f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))})"
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts) or "invalid request"


class BearerAuth:
    """ASGI middleware: /v1/* answers 401 unless the request carries "Authorization: Bearer
    <api_key>" (compared in constant time). Other paths (health, metrics, tokenize) stay open,
    as in vLLM."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/") \
                and scope.get("method") != "OPTIONS":
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return await error_response(
                    401, "invalid or missing API key (send Authorization: Bearer <key>)",
                    headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        await self.app(scope, receive, send)


ARRIVAL = "pdserve_arrival"    # the request's scope["state"] key (Request.state.pdserve_arrival)


class ArrivalStamp:
    """ASGI middleware, outermost: stamps each HTTP request with time.perf_counter() when the
    app first sees it (its headers parsed, before its body is read), for the admission time."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {})[ARRIVAL] = time.perf_counter()
        return await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is a 413, told by its Content-Length
    before a byte of it is read, or (chunked) once the bytes read pass the limit."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._reject(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge()
            return msg

        await self.app(scope, counted, send)

    async def _reject(self, scope, receive, send):
        await too_large(self.limit)(scope, receive, send)
