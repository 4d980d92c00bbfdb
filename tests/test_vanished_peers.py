"""A peer that vanishes blocks nobody alive.

Rank 0 of a worker sends on zmq PUSH sockets (outputs to its client, steps to its other ranks);
zmq queues 1000 messages for a reader that is gone and then blocks the sender for ever. Each
test below hangs on a sender that waits without a bound.

Worker processes run with one intra-op thread (OMP_NUM_THREADS=1): on a loaded 2-core machine
two threads make every step wait for a descheduled one, and the queues must fill in seconds.
"""
import dataclasses
import functools
import json
import os
import signal
import time

import msgspec
import pytest
import zmq

from pdserve import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import AddRequest, LLMEngine
from pdserve.worker import client as client_module
from pdserve.worker.client import EngineClient, EngineDeadError
from pdserve.worker.worker import ClientGone, WorkerConfig, _Outbox

from .utils import _running, assert_processes_gone

MODEL = {  # small, and long enough (4096 positions) for thousands of steps
    "architectures": ["LlamaForCausalLM"], "vocab_size": 301, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "eos_token_id": 0, "bos_token_id": 1}
ENGINE = dict(skip_tokenizer_init=True, load_format="dummy", block_size=4, num_kv_blocks=1200)
PROMPT = [5, 17, 99, 3, 42, 8, 1, 77, 120]
LONG = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def model(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # inherited by the worker processes
    # the workers these tests start give a reader that takes nothing 1 s (default 5 s)
    monkeypatch.setattr(client_module, "WorkerConfig",
                        functools.partial(WorkerConfig, send_timeout_s=1.0))
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(MODEL))
    return str(d)


# ---- the bounded send itself (no processes) ----------------------------------------------------
def test_a_send_to_a_vanished_reader_gives_up(tmp_path):
    """A reader that closed its socket: zmq takes 1000 messages, then the next send waits for
    room; while the reader lives it waits the timeout, once it is dead it stops at once."""
    ctx = zmq.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        pull.bind(f"ipc://{tmp_path}/q")
        push = ctx.socket(zmq.PUSH)
        push.connect(f"ipc://{tmp_path}/q")
        alive = [True]
        box = _Outbox(push, "the reader", lambda: alive[0], 0.5, ClientGone)
        box.send(b"hello")
        assert pull.recv() == b"hello"
        pull.close(linger=0)
        time.sleep(0.3)                        # until zmq has dropped the reader's pipe
        sent = 0
        while box.offer(b"x"):                 # the normal path: no wait at all
            sent += 1
            assert sent < 100_000
        assert sent >= 900
        t0 = time.monotonic()
        with pytest.raises(ClientGone, match="the reader took no message for 0.5 s"):
            box.send(b"x")
        assert 0.5 <= time.monotonic() - t0 < 3
        alive[0] = False
        t0 = time.monotonic()
        with pytest.raises(ClientGone, match="the reader exited"):
            box.send(b"x")
        assert time.monotonic() - t0 < 0.5
    finally:
        ctx.destroy(linger=0)


# ---- rank 0 -> its client ----------------------------------------------------------------------
def test_worker_exits_when_its_client_stops_reading(model):
    """The client's output socket closes without a word while the worker streams (its process
    lives on, so the worker's parent check passes): once 1000 outputs wait unread, the worker
    gives the client send_timeout_s (1 s here) and exits cleanly instead of blocking for
    ever."""
    client = EngineClient(EngineConfig(model=model, **ENGINE))
    try:
        assert client.add_requests([AddRequest("r", PROMPT, LONG)]) == [None]
        client._outputs.close(linger=0)
        t0 = time.monotonic()
        assert_processes_gone(client.pids, timeout_s=60)
        print(f"worker exited {time.monotonic() - t0:.1f} s after its client stopped reading")
        assert client._procs[0].exitcode == 0       # nobody to serve: a clean exit
    finally:
        client.shutdown(5)


def _wait_for_peers(client, n: int) -> None:
    """Until the worker has joined n KV peers (they are added on its next step)."""
    deadline = time.monotonic() + 60
    while client.check_integrity().kv_peers < n:
        assert time.monotonic() < deadline, f"{client.name} did not join its KV peers"
        time.sleep(0.01)


# ---- rank 0 -> its other ranks -----------------------------------------------------------------
@pytest.mark.parametrize("how", ["stop", "kill"])
def test_rank0_gives_up_on_a_rank_that_takes_no_steps(model, monkeypatch, how):
    """A TP=2 P/D consumer whose only request waits for a pull that never ends runs empty steps
    (no collective in them) as fast as it can, and sends each to rank 1. Rank 1 stopped
    (SIGSTOP: its socket open, its queue full) or killed: rank 0 must not block on the full
    queue. Stopped: after send_timeout_s (1 s here) rank 0 reports Failed naming rank 1 and
    exits.
    Killed: rank 0 notices by itself (the client, not asked, kills nobody) and exits."""
    cfg = EngineConfig(model=model, kv_connector="shared", kv_transfer_timeout_s=600, **ENGINE)
    producer = LLMEngine(cfg)
    producer.add_request("a", PROMPT, dataclasses.replace(GREEDY, max_tokens=1), kv_hold=True)
    while producer.has_unfinished_requests():
        out = producer.step()
    source = msgspec.structs.replace(out[0].kv_transfer, worker="p")
    monkeypatch.setenv("PDSERVE_KV_FAULT", "hang")             # the consumer's pull never ends
    client = EngineClient(dataclasses.replace(cfg, tensor_parallel_size=2))
    follower = client.pids[1]
    try:
        assert client.connect_kv([producer.kv_export("p")]) == [None]
        _wait_for_peers(client, 1)
        os.kill(follower, signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        assert client.add_requests([AddRequest("a", PROMPT, GREEDY, kv_source=source)]) == [None]
        t0 = time.monotonic()
        if how == "stop":
            with pytest.raises(EngineDeadError, match=rf"rank 1 \(pid {follower}\) took no "
                                                      r"message for 1 s"):
                while time.monotonic() - t0 < 60:
                    client.step(timeout_s=1)
        else:
            assert_processes_gone([client.pids[0]], timeout_s=60)
            assert client._procs[0].exitcode == 1
        print(f"rank 0 gave up {time.monotonic() - t0:.1f} s after rank 1 stopped taking steps")
    finally:
        if _running(follower):
            os.kill(follower, signal.SIGKILL)
        client.shutdown(5)
    assert_processes_gone(client.pids)
    producer.release_kv(["a"])
