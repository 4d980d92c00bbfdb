"""AsyncEngine: the asyncio face of a Router (one worker or a P/D deployment), for the server.

zmq sockets belong to one thread, so one I/O thread owns the Router. It sends the adds and
aborts that coroutines queue, waits for the workers' outputs (woken early by a pipe when a
command arrives) and hands each request's outputs to that request's asyncio queue. Adds go
out without waiting for a worker's answer (Router.submit; a worker answers between two of its
steps): the adding coroutine waits for it, the I/O thread does not, so a request that arrives
meanwhile is sent at once and can join the worker's next step. A request whose consumer goes
away (client disconnect, cancellation) is aborted, which frees its blocks on the worker at its
next step.

The I/O thread outlives anything a request or a worker can do: a command that raises fails that
command alone; when the whole deployment is gone (every worker dead, no restart left) every
stream ends with EngineDeadError, and later commands are answered with it at once.
"""
from __future__ import annotations

import asyncio
import os
import queue
import select
import threading
import time
from typing import TYPE_CHECKING

from ..protocol import AddRequest
from ..outputs import RequestOutput
from ..routing import Unavailable
from ..worker.client import EngineDeadError

if TYPE_CHECKING:
    from ..routing import Router   # (submit / take_answers: the router's, not EngineProtocol's)


_NUDGE = object()   # (RequestStream.nudge: a keep-alive asked for, no output)


class RequestStream:
    """An admitted request's outputs, in batches: each item is every output that arrived since
    the consumer last asked (one or more engine steps, oldest first), so a consumer that fell
    behind catches up with one write. Raises EngineDeadError when the deployment ends the
    request (its worker died, the server shuts down). aclose() before the final output aborts
    the request (whether iteration started or not). After nudge(), a wait ends with an empty
    batch if no output came meanwhile (a streamed body's keep-alive, without a timer per wait)."""

    def __init__(self, engine: "AsyncEngine", request_id: str, queue_: asyncio.Queue,
                 added: float | None = None):
        self._engine, self.request_id, self._queue = engine, request_id, queue_
        # time.perf_counter() when the request was handed to the engine: its latencies start
        # there, not when a consumer begins to read (a response body starts a little later)
        self.added = time.perf_counter() if added is None else added
        self.finished = False
        self._closed = False
        self._error: BaseException | None = None  # to raise after the outputs before it

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[RequestOutput]:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self.finished or self._closed:
            raise StopAsyncIteration
        batch = [await self._queue.get()]
        while not self._queue.empty():
            batch.append(self._queue.get_nowait())
        if len(batch) == 1:
            if batch[0] is _NUDGE:
                return []
        elif any(item is _NUDGE for item in batch):
            batch = [item for item in batch if item is not _NUDGE]
            if not batch:
                return []
        for i, item in enumerate(batch):
            if isinstance(item, BaseException):
                # what came before the error is delivered first, the error on the next call
                self._end()
                if i:
                    self._error = item
                    return batch[:i]
                raise item
            if item.finished:
                del batch[i + 1:]  # nothing follows a final output
                if item.error is not None:
                    self._end()
                    raise EngineDeadError(item.error)
                self.finished = True
                self._end()
                break
        return batch

    def nudge(self) -> None:
        """Wake the reader: its wait (or next one) ends with an empty batch unless an output or
        an error comes first (then the nudge is dropped)."""
        self._queue.put_nowait(_NUDGE)

    def _end(self) -> None:
        self._engine._streams.pop(self.request_id, None)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._end()
        if not self.finished:
            self._engine._command(("abort", self.request_id))


class AsyncEngine:
    def __init__(self, client: "Router", loop: asyncio.AbstractEventLoop):
        self.client = client
        self.tokenizer = client.tokenizer
        self.max_model_len = client.max_model_len
        self.loop = loop
        self.dead: str | None = None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._streams: dict[str, asyncio.Queue] = {}
        self._awaiting: dict[str, asyncio.Future] = {}   # (I/O thread) sent, answer to come
        self._thread = threading.Thread(target=self._run, name="pdserve-engine-io", daemon=True)
        self._thread.start()

    @property
    def stats(self):
        return self.client.stats

    # ---- coroutine side ----------------------------------------------------------------------
    async def add(self, req: AddRequest) -> RequestStream:
        """Admits one request: ValueError if it is rejected (the request's fault),
        EngineDeadError if nothing can serve it (no live worker, the engine is gone)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        stream: asyncio.Queue = asyncio.Queue()
        accepted = self.loop.create_future()
        self._streams[req.request_id] = stream
        added = time.perf_counter()
        self._command(("add", req, accepted))
        try:
            error = await accepted
        except BaseException:
            self._streams.pop(req.request_id, None)
            self._command(("abort", req.request_id))
            raise
        if error is not None:
            self._streams.pop(req.request_id, None)
            if isinstance(error, Unavailable):
                raise EngineDeadError(error)
            raise ValueError(error)
        return RequestStream(self, req.request_id, stream, added)

    def end_all(self, why: str) -> int:
        """Ends every stream now with EngineDeadError(why) and aborts its request (the drain
        deadline of a shutdown); returns how many were ended."""
        ids = list(self._streams)
        for rid in ids:
            self._streams.pop(rid).put_nowait(EngineDeadError(why))
        if ids:
            self._command(("abort", ids))
        return len(ids)

    def end(self, request_id: str, why: BaseException) -> bool:
        """Ends request_id's stream now, raising `why` to its consumer, and aborts the request;
        False when no such stream is open."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        stream.put_nowait(why)
        self._command(("abort", request_id))
        return True

    def is_open(self, request_id: str) -> bool:
        return request_id in self._streams

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def _command(self, cmd) -> None:
        self._cmds.put(cmd)
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the pipe is full of wake-ups already, or closed (shut down: nobody reads)

    async def call(self, fn, *args):
        """Runs fn(client, *args) on the I/O thread between two steps; its result (or its
        exception, raised here)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        fut = self.loop.create_future()
        self._command(("call", fut, fn, args))
        return await fut

    async def check_integrity(self):
        """Runs the workers' invariant checks between two steps; returns their fresh stats
        (AssertionError if an invariant is broken)."""
        return await self.call(lambda c: c.check_integrity())

    async def reset_prefix_cache(self) -> int:
        return await self.call(lambda c: c.reset_prefix_cache())

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        self._command(("stop",))
        await asyncio.to_thread(self._thread.join, drain_timeout_s + 5)
        await asyncio.to_thread(self.client.shutdown, drain_timeout_s)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---- I/O thread --------------------------------------------------------------------------
    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the event loop is closed: nobody is waiting any more

    @staticmethod
    def _resolve(fut: asyncio.Future, value, error: BaseException | None = None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            stream = self._streams.get(o.request_id)
            if stream is not None:
                stream.put_nowait(o)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)

    def _die(self, why: str) -> None:
        self.dead = why
        self._post(self._fail_all, EngineDeadError(why))
        self._fail_awaiting(why)

    def _fail_awaiting(self, why: str) -> None:
        """Adds still waiting for their answer get none: EngineDeadError(why)."""
        awaiting, self._awaiting = self._awaiting, {}
        for fut in awaiting.values():
            self._post(self._resolve, fut, None, EngineDeadError(why))

    def _add(self, adds: list) -> None:
        """Sends the adds without waiting for the workers' answers (a worker answers between
        two of its steps; requests that come meanwhile are sent at once, not after it): a
        request's future is resolved when its answer comes (_answered), or now if the router
        rejects it at once."""
        try:
            errors = self.client.submit([c[1] for c in adds])
        except EngineDeadError as e:
            self._die(str(e))
            errors = [e] * len(adds)
        except Exception as e:  # noqa: BLE001 - a bug reached by one request's content must
            # not end the others: the batch fails, the engine stays
            errors = [f"the request could not be added: {type(e).__name__}: {e}"] * len(adds)
        for (_, req, fut), err in zip(adds, errors):
            if isinstance(err, BaseException):
                self._post(self._resolve, fut, None, EngineDeadError(str(err)))
            elif err is not None:
                self._post(self._resolve, fut, err)
            else:
                self._awaiting[req.request_id] = fut
        self._answered()

    def _answered(self) -> None:
        for rid, err in self.client.take_answers().items():
            fut = self._awaiting.pop(rid, None)
            if fut is not None:
                self._post(self._resolve, fut, err)

    def _run(self) -> None:
        client = self.client
        while True:
            adds, aborts, calls, stop = [], [], [], False
            while True:
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] == "add":
                    adds.append(cmd)
                elif cmd[0] == "abort":
                    aborts += [cmd[1]] if isinstance(cmd[1], str) else cmd[1]
                elif cmd[0] == "call":
                    calls.append(cmd)
                else:
                    stop = True
            if self.dead is not None:  # answer at once: nothing will serve these
                for _, _, fut in adds:
                    self._post(self._resolve, fut, None, EngineDeadError(self.dead))
                for _, fut, _, _ in calls:
                    self._post(self._resolve, fut, None, EngineDeadError(self.dead))
                if stop:
                    return
                select.select([self._wake_r], [], [], 1.0)
                self._drain_wakeups()
                continue
            try:
                if adds:
                    self._add(adds)
                if aborts:
                    client.abort_request(aborts)
                for _, fut, fn, args in calls:
                    try:
                        self._post(self._resolve, fut, fn(client, *args))
                    except EngineDeadError:
                        raise
                    except Exception as e:  # noqa: BLE001 - the caller's to handle
                        self._post(self._resolve, fut, None, e)
                if stop:
                    self._fail_awaiting("the engine is shutting down")
                    return
                # idle: still wait on the workers (a death, a restart) but at most a second
                outs = client.step(timeout_s=None if client.has_unfinished_requests() else 1.0,
                                   wakeup_fd=self._wake_r)
                self._answered()   # (before the outputs: a stream exists once admitted)
                if outs:
                    self._post(self._deliver, outs)
            except EngineDeadError as e:
                self._die(str(e))
            except Exception as e:  # noqa: BLE001 - never leave coroutines waiting forever
                self._die(f"engine I/O thread failed: {type(e).__name__}: {e}")
            self._drain_wakeups()

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
