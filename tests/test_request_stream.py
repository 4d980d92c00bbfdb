"""RequestStream's reads: what arrived since the last read in one batch, the end and errors in
order, and nudge() (the streamed body reads a stream in place, without a task and a keepalive
timer, and a keep-alive task nudges it when it is quiet)."""
import asyncio

import pytest

from pdserve.outputs import RequestOutput
from pdserve.server.async_engine import RequestStream
from pdserve.worker.client import EngineDeadError


class _Engine:
    def __init__(self):
        self._streams = {}
        self.commands = []

    def _command(self, cmd):
        self.commands.append(cmd)


def _out(finished=False, error=None):
    return RequestOutput("r", None, [1], [], finished, error=error)


def _stream():
    eng = _Engine()
    st = RequestStream(eng, "r", asyncio.Queue())
    eng._streams["r"] = st
    return eng, st


async def _returns_at_once(st):
    """The next read, and whether it finished without yielding to the loop."""
    task = asyncio.ensure_future(st.__anext__())
    await asyncio.sleep(0)   # one pass of the loop: a read that waits is still pending
    done = task.done()
    if not done:
        task.cancel()
        return False, None
    try:
        return True, task.result()
    except BaseException as e:  # noqa: BLE001
        return True, e


def test_reads_batch_what_arrived_and_know_the_end_at_once():
    async def main():
        eng, st = _stream()
        assert (await _returns_at_once(st))[0] is False      # nothing queued: it waits
        a, b = _out(), _out()
        st._queue.put_nowait(a)
        st._queue.put_nowait(b)
        done, batch = await _returns_at_once(st)
        assert done and batch == [a, b]                       # both, in order, in one read
        assert (await _returns_at_once(st))[0] is False
        fin = _out(finished=True)
        st._queue.put_nowait(fin)
        assert (await _returns_at_once(st)) == (True, [fin])
        assert st.finished                                    # the end is known at once
        done, e = await _returns_at_once(st)
        assert done and isinstance(e, StopAsyncIteration)
        assert "r" not in eng._streams
    asyncio.run(main())


def test_reads_after_an_error_and_after_close():
    async def main():
        eng, st = _stream()
        before = _out()
        st._queue.put_nowait(before)
        st._queue.put_nowait(EngineDeadError("gone"))
        assert (await _returns_at_once(st)) == (True, [before])
        done, e = await _returns_at_once(st)                  # the held error is next
        assert done and isinstance(e, EngineDeadError)

        eng2, st2 = _stream()
        await st2.aclose()
        assert eng2.commands == [("abort", "r")]
        with pytest.raises(StopAsyncIteration):
            await st2.__anext__()
    asyncio.run(main())


def test_a_nudge_ends_a_wait_with_an_empty_batch_unless_something_came():
    """The streamed body's keep-alive: a nudge alone ends the wait (already waiting, or the
    next one) with []; with outputs or an error around it, it is dropped and they come as
    without it."""
    async def main():
        eng, st = _stream()
        waiting = asyncio.ensure_future(st.__anext__())
        await asyncio.sleep(0)
        assert not waiting.done()
        st.nudge()
        assert await waiting == []
        st.nudge()
        assert (await _returns_at_once(st)) == (True, [])
        a, b = _out(), _out()
        for item in (a, _NUDGE_OF(st), b):
            st._queue.put_nowait(item)
        assert (await _returns_at_once(st)) == (True, [a, b])
        st.nudge()
        st.nudge()
        assert (await _returns_at_once(st)) == (True, [])       # (two nudges: one wake)
        st.nudge()
        st._queue.put_nowait(EngineDeadError("gone"))
        done, e = await _returns_at_once(st)
        assert done and isinstance(e, EngineDeadError)
    asyncio.run(main())


def _NUDGE_OF(st):
    """What nudge() queues (to place one between outputs)."""
    st.nudge()
    return st._queue.get_nowait()


class _Unanswering:
    """A router whose workers never answer (each is between two long steps): submit sends,
    step waits until woken, no answer ever comes."""
    tokenizer = None
    max_model_len = 64

    def __init__(self):
        self.submitted, self.aborted = [], []

    def submit(self, requests):
        self.submitted += [r.request_id for r in requests]
        return [None] * len(requests)

    def take_answers(self):
        return {}

    def has_unfinished_requests(self):
        return bool(self.submitted)

    def step(self, timeout_s=None, wakeup_fd=None):
        import select
        select.select([wakeup_fd], [], [], timeout_s)
        return []

    def abort_request(self, ids):
        self.aborted += [ids] if isinstance(ids, str) else ids

    def shutdown(self, timeout_s=0.0):
        pass


def test_an_add_still_waiting_for_its_answer_at_shutdown_gets_engine_dead():
    """The I/O thread sends adds without waiting for the worker's answer; the adding coroutine
    waits for it. A shutdown before the answer comes ends that wait with EngineDeadError
    instead of leaving it waiting forever."""
    from pdserve.protocol import AddRequest
    from pdserve.sampling_params import SamplingParams
    from pdserve.server.async_engine import AsyncEngine

    async def main():
        router = _Unanswering()
        engine = AsyncEngine(router, asyncio.get_running_loop())
        add = asyncio.ensure_future(engine.add(AddRequest("r", [1, 2], SamplingParams())))
        for _ in range(200):   # until the I/O thread has sent it
            if router.submitted:
                break
            await asyncio.sleep(0.01)
        assert router.submitted == ["r"] and not add.done()
        await engine.shutdown(1.0)
        with pytest.raises(EngineDeadError, match="shutting down"):
            await asyncio.wait_for(add, 5)

    asyncio.run(main())


def test_a_streamed_body_of_two_requests_gets_keep_alives_until_both_finish():
    """OpenAIServing.stream over two streams (n = 2), keepalive 0.05 s: quiet, the body writes
    keep-alive comments; after the first stream's final output, still (for the second); after
    both, the events and [DONE], and no stream is left for the keep-alive task."""
    from types import SimpleNamespace

    from pdserve.server.http import ServeOptions
    from pdserve.server.serving import OpenAIServing

    async def main():
        eng = _Engine()
        eng.tokenizer = None
        srv = OpenAIServing(eng, "m", ServeOptions(keepalive_s=0.05))
        streams = []
        for rid in ("a", "b"):
            st = RequestStream(eng, rid, asyncio.Queue())
            eng._streams[rid] = st
            streams.append(st)
        resp = srv.stream(streams, lambda i, out: [{"choice": i}], "c", "x",
                          SimpleNamespace(stream_options=None))
        body = resp.body_iterator

        async def until(pred):
            got = []
            while not pred(got):
                got.append(await asyncio.wait_for(body.__anext__(), 2))
            return got

        assert (await body.__anext__()).startswith(b": admitted")
        assert await until(lambda g: len(g) == 2) == [b": keep-alive\n\n"] * 2
        streams[0]._queue.put_nowait(RequestOutput("a", None, [1], [], True))
        got = await until(lambda g: b'"choice":0' in b"".join(g))
        assert streams[0] not in srv._quiet and streams[1] in srv._quiet
        assert (await until(lambda g: len(g) == 2)) == [b": keep-alive\n\n"] * 2
        streams[1]._queue.put_nowait(RequestOutput("b", None, [1], [], True))
        got = await until(lambda g: g and g[-1].endswith(b"data: [DONE]\n\n"))
        assert b'"choice":1' in b"".join(got)
        with pytest.raises(StopAsyncIteration):
            await body.__anext__()
        assert not srv._quiet and eng.commands == []          # both finished: no abort
        for _ in range(200):                                  # nothing left to watch: it ends
            if srv._keepalive_task is None:
                break
            await asyncio.sleep(0.01)
        assert srv._keepalive_task is None
        srv.pool.shutdown()
    asyncio.run(main())
