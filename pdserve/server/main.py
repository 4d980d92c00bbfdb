"""`pdserve serve`: its flags, the deployment behind it (always a Router, one collocated worker
by default) and uvicorn, whose first SIGTERM/SIGINT starts the drain."""
from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Callable

from .api import build_app
from .async_engine import AsyncEngine
from .http import ServeOptions


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


def main(argv: list[str] | None = None) -> int:
    from ..args import add_deployment_args, add_engine_args, deployment_args, engine_config
    p = argparse.ArgumentParser(prog="pdserve serve")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model value or the file name)")
    p.add_argument("--log-level", default="warning")
    d = ServeOptions()
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout_s,
                   help="seconds SIGTERM lets in-flight requests finish; the rest then end with "
                        "an error event (streams) or a 503")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="answer 503 (Retry-After) while this many requests wait for a first "
                        "token (default: no limit)")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="a larger request body is answered 413")
    p.add_argument("--keepalive", type=float, default=d.keepalive_s,
                   help="seconds of silence after which a stream gets an SSE comment")
    p.add_argument("--tokenizer-threads", type=int, default=d.tokenizer_threads,
                   help="threads that tokenize prompts and render chat templates")
    add_engine_args(p)
    add_deployment_args(p)
    a = p.parse_args(argv)
    import os

    import uvicorn

    from ..deploy import build
    try:
        options = ServeOptions(a.max_request_bytes, a.max_queued_requests, a.shutdown_timeout,
                               a.keepalive, a.tokenizer_threads)
        config, deployment = engine_config(a), deployment_args(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = a.served_model_name or (os.path.basename(os.path.normpath(a.model)) if a.model
                                   else "SmolLM2-135M-Instruct")

    async def serve():
        # always behind a router, one worker too: it turns a worker's death into errors for
        # its requests and restarts it
        client = await asyncio.to_thread(build, config, deployment)
        loop = asyncio.get_running_loop()
        engine = AsyncEngine(client, loop)
        app = build_app(engine, name, options)
        srv = app.state.server
        server = _uvicorn_server(
            uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level,
                           timeout_graceful_shutdown=options.shutdown_timeout_s + 5),
            lambda: loop.call_soon_threadsafe(srv.begin_shutdown))
        print(f"pdserve: serving {name!r} on http://{a.host}:{a.port}", file=sys.stderr, flush=True)
        await server.serve()

    try:
        asyncio.run(serve())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
