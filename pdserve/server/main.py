"""`pdserve serve`: its flags, the deployment behind it (always a Router, one collocated worker
by default) and uvicorn, whose first SIGTERM/SIGINT starts the drain."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Callable

from .api import build_app
from .async_engine import AsyncEngine
from .console import startup_summary
from .http import ServeOptions


def _json_list(text: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's form: '["http://a.example", "http://b.example"]')."""
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise argparse.ArgumentTypeError(f"expected a JSON list of non-empty strings, got {text!r}")
    return v


def _uvicorn_server(config, on_exit: Callable[[], None]):
    """A uvicorn server whose first SIGTERM/SIGINT also starts our drain clock (uvicorn's own
    graceful timeout is set a few seconds longer, for the terminal events to go out)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                on_exit()
            super().handle_exit(sig, frame)

    return Server(config)


def build_parser() -> argparse.ArgumentParser:
    from ..args import add_deployment_args, add_engine_args
    p = argparse.ArgumentParser(prog="pdserve serve")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model to serve, as vLLM takes it (the same as --model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000,
                   help="port to listen on (default %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model value or the file "
                        "name)")
    p.add_argument("--log-level", default="warning",
                   help="uvicorn's log level (default %(default)s)")
    p.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                   help="the event loop, as uvicorn's --loop: auto takes uvloop where it is "
                        "installed (default %(default)s)")
    p.add_argument("--http", choices=["auto", "h11", "httptools"], default="auto",
                   help="the HTTP protocol implementation, as uvicorn's --http: auto takes "
                        "httptools where it is installed (default %(default)s)")
    d = ServeOptions()
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout_s,
                   help="seconds SIGTERM lets in-flight requests finish; the rest then end with "
                        "an error event (streams) or a 503 (default %(default)s)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="answer 503 (Retry-After) while this many requests wait for a first "
                        "token (default: no limit)")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="a larger request body is answered 413 (default %(default)s)")
    p.add_argument("--keepalive", type=float, default=d.keepalive_s,
                   help="seconds of silence after which a stream gets an SSE comment (default "
                        "%(default)s)")
    p.add_argument("--tokenizer-threads", type=int, default=d.tokenizer_threads,
                   help="threads that tokenize prompts and render chat templates (default "
                        "%(default)s)")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="clients of /v1/* must send 'Authorization: Bearer KEY' (default: "
                        "$PDSERVE_API_KEY; unset: no key)")
    p.add_argument("--allowed-origins", type=_json_list, default=["*"],
                   help='CORS: origins allowed, a JSON list (default ["*"]; [] sends no CORS '
                        "headers)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--allowed-methods", type=_json_list, default=["*"],
                   help='CORS: methods allowed, a JSON list (default ["*"])')
    p.add_argument("--allowed-headers", type=_json_list, default=["*"],
                   help='CORS: headers allowed, a JSON list (default ["*"])')
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between the console's stats lines (throughput, running and "
                        "waiting, KV use, prefix cache hit rate), printed while there is traffic "
                        "(default %(default)s)")
    p.add_argument("--disable-log-stats", action="store_true", help="no stats lines")
    from .tool_parsers import TOOL_PARSERS
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=d.tool_call_parser,
                   help="the format the model writes tool calls in (hermes: <tool_call>{json}"
                        "</tool_call>, Hermes 2 Pro / Qwen2.5 / Qwen3; llama3_json: the output "
                        "is the calls' JSON, Llama 3.1 / 3.2); default: the one the chat "
                        "template writes, else hermes")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM command lines: tool_choice 'auto' is always on here")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="with tool_choice 'none' leave the tools out of the prompt (default: "
                        "rendered, as vLLM does, but not parsed)")
    add_engine_args(p)
    add_deployment_args(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with the positional MODEL (vLLM's `serve MODEL`) moved into --model."""
    p = build_parser()
    a = p.parse_args(argv)
    if a.model_tag is not None:
        if a.model is not None and a.model != a.model_tag:
            p.error(f"the model is given twice: {a.model_tag!r} and --model {a.model!r}")
        a.model = a.model_tag
    return a


def serve_options(a: argparse.Namespace) -> ServeOptions:
    return ServeOptions(
        a.max_request_bytes, a.max_queued_requests, a.shutdown_timeout, a.keepalive,
        a.tokenizer_threads, a.api_key or None, tuple(a.allowed_origins), a.allow_credentials,
        tuple(a.allowed_methods), tuple(a.allowed_headers),
        None if a.disable_log_stats else a.log_stats_interval, a.tool_call_parser,
        a.exclude_tools_when_tool_choice_none)


def run_loop(coro, loop: str = "auto"):
    """Runs `coro` on the event loop `loop` names (--loop). uvloop is a dependency where it
    builds (not on Windows); auto falls back to asyncio's own loop where it is missing. With
    httptools in place of h11 (--http auto) the API process spent ~73 us of CPU per streamed
    write against ~131 on asyncio's loop and h11 (scripts/bench_api.py, 2-core CPU, one token
    a write, medians of 3 runs): httptools gave most of that, uvloop the rest."""
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                raise ValueError("--loop uvloop: uvloop is not installed") from None
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(coro)
    return asyncio.run(coro)


def main(argv: list[str] | None = None) -> int:
    from ..args import deployment_args, engine_config
    a = parse_args(argv)
    import uvicorn

    from ..deploy import build
    from ..loader.generation_config import generation_defaults
    try:
        options = serve_options(a)
        config, deployment = engine_config(a), deployment_args(a)
        defaults, source = generation_defaults(config.generation_config, config.model)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # (a path's last part; a repo id or preset as given, as vLLM names it)
    name = a.served_model_name or (
        "SmolLM2-135M-Instruct" if not a.model else
        os.path.basename(os.path.normpath(a.model)) if os.path.exists(a.model) else a.model)

    async def serve():
        # always behind a router, one worker too: it turns a worker's death into errors for
        # its requests and restarts it
        client = await asyncio.to_thread(build, config, deployment)
        loop = asyncio.get_running_loop()
        engine = AsyncEngine(client, loop)
        app = build_app(engine, name, options, defaults)
        srv = app.state.server
        server = _uvicorn_server(
            uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level, http=a.http,
                           timeout_graceful_shutdown=options.shutdown_timeout_s + 5),
            lambda: loop.call_soon_threadsafe(srv.begin_shutdown))
        for line in startup_summary(client, name, defaults, source):
            print(line, file=sys.stderr)
        print(f"pdserve: serving {name!r} on http://{a.host}:{a.port}", file=sys.stderr, flush=True)
        await server.serve()

    try:
        run_loop(serve(), a.loop)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
