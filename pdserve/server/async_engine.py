"""AsyncEngine: the asyncio face of an EngineClient, for the HTTP server.

zmq sockets belong to one thread, so one I/O thread owns the EngineClient. It sends the adds and
aborts that coroutines queue, waits for the worker's outputs (woken early by a pipe when a
command arrives) and hands each request's outputs to that request's asyncio queue. A request
whose consumer goes away (client disconnect, cancellation) is aborted, which frees its blocks on
the worker at its next step.
"""
from __future__ import annotations

import asyncio
import os
import queue
import select
import threading
from typing import AsyncIterator

from ..engine.llm_engine import AddRequest
from ..outputs import RequestOutput
from ..worker.client import EngineClient, EngineDeadError


class AsyncEngine:
    def __init__(self, client: EngineClient, loop: asyncio.AbstractEventLoop):
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
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="pdserve-engine-io", daemon=True)
        self._thread.start()

    @property
    def stats(self):
        return self.client.stats

    # ---- coroutine side ----------------------------------------------------------------------
    async def generate(self, req: AddRequest) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the worker produces them. ValueError if the worker rejects
        it, EngineDeadError if the worker dies. Leaving early aborts the request."""
        gen = self.generate_batches(req)
        try:
            async for batch in gen:
                for out in batch:
                    yield out
        finally:
            await gen.aclose()  # leaving early aborts now, not when the GC finalizes gen

    async def generate_batches(self, req: AddRequest) -> AsyncIterator[list[RequestOutput]]:
        """Like generate(), but each item is every output of the request that has arrived by
        then (one or more engine steps, oldest first): a consumer that fell behind catches up
        with one write instead of one per step."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        stream: asyncio.Queue = asyncio.Queue()
        accepted = self.loop.create_future()
        self._streams[req.request_id] = stream
        self._command(("add", req, accepted))
        try:
            error = await accepted
        except BaseException:
            self._streams.pop(req.request_id, None)
            self._command(("abort", req.request_id))
            raise
        if error is not None:
            self._streams.pop(req.request_id, None)
            raise ValueError(error)
        finished = False
        try:
            while not finished:
                batch = [await stream.get()]
                while not stream.empty():
                    batch.append(stream.get_nowait())
                for i, item in enumerate(batch):
                    if isinstance(item, BaseException):
                        if i:
                            yield batch[:i]
                        raise item
                    if item.finished:
                        finished = True
                        del batch[i + 1:]  # nothing follows a final output
                        break
                yield batch
        finally:
            self._streams.pop(req.request_id, None)
            if not finished:
                self._command(("abort", req.request_id))

    def _command(self, cmd) -> None:
        self._cmds.put(cmd)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    async def check_integrity(self):
        """Runs the worker's invariant checks between two steps; returns its fresh stats
        (AssertionError if an invariant is broken)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        fut = self.loop.create_future()
        self._command(("check", fut))
        error = await fut
        if isinstance(error, str):
            raise AssertionError(error)
        return self.client.stats

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        self._stopping = True
        self._command(("stop", None))
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
    def _resolve(fut: asyncio.Future, value) -> None:
        if not fut.done():
            fut.set_result(value)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            stream = self._streams.get(o.request_id)
            if stream is not None:
                stream.put_nowait(o)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)

    @staticmethod
    def _add_each_or_all(client: EngineClient, reqs: list[AddRequest]) -> list[str | None]:
        """One round trip for the batch; if the batch cannot even be sent (one request that
        does not encode), each request alone, so only the bad one fails."""
        try:
            return client.add_requests(reqs)
        except ValueError:
            errors: list[str | None] = []
            for r in reqs:
                try:
                    errors.extend(client.add_requests([r]))
                except ValueError as e:
                    errors.append(str(e))
            return errors

    def _run(self) -> None:
        client = self.client
        try:
            while True:
                adds, aborts, checks, stop = [], [], [], False
                while True:
                    try:
                        cmd = self._cmds.get_nowait()
                    except queue.Empty:
                        break
                    if cmd[0] == "add":
                        adds.append(cmd)
                    elif cmd[0] == "abort":
                        aborts.append(cmd[1])
                    elif cmd[0] == "check":
                        checks.append(cmd[1])
                    else:
                        stop = True
                if adds:
                    errors = self._add_each_or_all(client, [c[1] for c in adds])
                    for (_, _, fut), err in zip(adds, errors):
                        self._post(self._resolve, fut, err)
                if aborts:
                    client.abort_request(aborts)
                for fut in checks:
                    try:
                        self._post(self._resolve, fut, client.check_integrity())
                    except AssertionError as e:
                        self._post(self._resolve, fut, str(e))
                if stop:
                    return
                if client.has_unfinished_requests():
                    outs = client.step(wakeup_fd=self._wake_r)
                    if outs:
                        self._post(self._deliver, outs)
                else:
                    select.select([self._wake_r], [], [], 1.0)
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
        except EngineDeadError as e:
            self.dead = str(e)
            self._post(self._fail_all, e)
            for cmd in list(adds):
                self._post(self._resolve, cmd[2], f"the engine is dead: {e}")
        except Exception as e:  # noqa: BLE001 - never leave coroutines waiting forever
            self.dead = f"engine I/O thread failed: {type(e).__name__}: {e}"
            self._post(self._fail_all, EngineDeadError(self.dead))
