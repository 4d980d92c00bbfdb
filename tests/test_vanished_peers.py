"""A peer that vanishes blocks nobody alive.

Rank 0 of a worker sends on zmq PUSH sockets (outputs to its client, steps to its other ranks);
zmq queues 1000 messages for a reader that is gone and then blocks the sender for ever. A P/D
producer sends KV to its consumers over a pair group; a consumer that stops receiving must not
stall the producer, its other pairs, or (on NCCL) get it killed by torch's watchdog. Each test
below hangs (or takes a minute) on a sender that waits without a bound.

Worker processes run with one intra-op thread (OMP_NUM_THREADS=1): on a loaded 2-core machine
two threads make every step wait for a descheduled one, and the queues must fill in seconds.
"""
import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import torch
import zmq

from pdserve import SamplingParams
from pdserve.config import EngineConfig
from pdserve.disagg.connectors import get_connector_class
from pdserve.protocol import AddRequest, KVPair, KVSend
from pdserve.worker.llm_engine import LLMEngine
from pdserve.worker import client as client_module
from pdserve.worker import messages
from pdserve.worker.client import EngineClient, EngineDeadError
from pdserve.worker.worker import ClientGone, WorkerConfig, _Outbox

from .kv_faults import faulty
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
                        functools.partial(WorkerConfig, send_timeout_s=1.0, client_timeout_s=1.0))
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
    gives the client client_timeout_s (1 s here) and exits cleanly instead of blocking for
    ever."""
    client = EngineClient(EngineConfig(model=model, **ENGINE))
    try:
        assert client.add_requests([AddRequest("r", PROMPT, LONG)]) == [None]
        client._outputs.close(linger=0)
        t0 = time.monotonic()
        assert_processes_gone(client.pids, timeout_s=60)
        print(f"worker exited {time.monotonic() - t0:.1f} s after its client stopped reading")
        client._procs[0].join(10)          # (a zombie leader may wait for its threads)
        assert client._procs[0].exitcode == 0       # nobody to serve: a clean exit
    finally:
        client.shutdown(5)


# ---- rank 0 -> its other ranks -----------------------------------------------------------------
@pytest.mark.parametrize("how", ["stop", "kill"])
def test_rank0_gives_up_on_a_rank_that_takes_no_steps(model, how):
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
    client = EngineClient(dataclasses.replace(cfg, tensor_parallel_size=2,  # its pull never ends
                                              kv_connector=faulty("shared", "hang")))
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
            client._procs[0].join(10)      # (a zombie leader may wait for its threads)
            assert client._procs[0].exitcode == 1
        print(f"rank 0 gave up {time.monotonic() - t0:.1f} s after rank 1 stopped taking steps")
    finally:
        if _running(follower):
            os.kill(follower, signal.SIGKILL)
        client.shutdown(5)
    assert_processes_gone(client.pids)
    producer.release_kv(["a"])


# ---- P/D: a producer and its consumers ---------------------------------------------------------
def _wait_for_peers(client, n: int) -> None:
    """Until the worker has joined n KV peers (they are added on its next step)."""
    deadline = time.monotonic() + 60
    while client.check_integrity().kv_peers < n:
        assert time.monotonic() < deadline, f"{client.name} did not join its KV peers"
        time.sleep(0.01)


def _collect(client, rid: str, deadline_s: float):
    """The finished output of rid on client, waiting at most deadline_s."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for o in client.step(timeout_s=0.5):
            if o.request_id == rid and o.finished:
                return o
    raise AssertionError(f"{rid} did not finish on {client.name} in {deadline_s} s")


@pytest.mark.parametrize("connector", ["torch-dist", "nccl"])
def test_producer_outlives_a_consumer_that_stops_then_dies(model, connector):
    """1 producer, 2 consumers, two-sided. Consumer d1 stops (SIGSTOP: its connection stays open
    and silent, as a dead peer looks to NCCL) with a send to it pending; the producer gives
    that send up after the pair's send_timeout_s (2 s), marks the pair broken, and meanwhile
    or right after serves a plain request and its send to d2, exactly. Then d1 is killed: the
    producer stays up, skips sends to d1, serves whole requests, and holds no KV block. A
    DropPeer for d2 (alive) breaks that pair too."""
    import torch.distributed as dist
    base = EngineConfig(model=model, kv_connector=connector, **ENGINE)
    reference = LLMEngine(EngineConfig(model=model, **ENGINE))
    reference.add_request("ref", PROMPT, GREEDY)
    while reference.has_unfinished_requests():
        for o in reference.step():
            ref = o.outputs[0].token_ids
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with ThreadPoolExecutor(3) as pool:
        clients = list(pool.map(lambda n: EngineClient(base, name=n), ["p", "d1", "d2"]))
    P, D1, D2 = clients
    try:
        pair = dict(producer="p", producer_tp=1, consumer_tp=1,
                    num_kv_heads=MODEL["num_key_value_heads"], store=f"127.0.0.1:{store.port}",
                    send_timeout_s=2.0)
        assert P.connect_kv([KVPair(**pair, consumer=d, side="producer")
                             for d in ("d1", "d2")]) == [None, None]
        for name, d in (("d1", D1), ("d2", D2)):
            assert d.connect_kv([KVPair(**pair, consumer=name, side="consumer")]) == [None]
        for c, n in ((P, 2), (D1, 1), (D2, 1)):
            _wait_for_peers(c, n)

        sources = {}
        for rid in ("a", "b"):                      # prefilled on P, their KV held there
            P.add_requests([AddRequest(rid, PROMPT, dataclasses.replace(GREEDY, max_tokens=1),
                                       kv_hold=True)])
            out = _collect(P, rid, 30)
            assert out.outputs[0].token_ids == ref[:1]
            sources[rid] = msgspec.structs.replace(out.kv_transfer, worker="p")
        os.kill(D1.pids[0], signal.SIGSTOP)
        assert D2.add_requests([AddRequest("b", PROMPT, GREEDY, kv_source=sources["b"])]) == [None]
        P.send_kv([KVSend("a", "d1", sources["a"].block_ids),   # pending: d1 takes nothing
                   KVSend("b", "d2", sources["b"].block_ids)])
        t0 = time.monotonic()
        P.add_requests([AddRequest("c", PROMPT, GREEDY)])
        assert _collect(P, "c", 15).outputs[0].token_ids == ref   # not stalled behind d1
        assert _collect(D2, "b", 15).outputs[0].token_ids == ref  # nor is the other pair
        assert [(e.request_id, e.ok) for e in D2.kv_events] == [("b", True)]  # pulled, not
        print(f"served beside the stuck pair in {time.monotonic() - t0:.1f} s")  # recomputed
        while P.check_integrity().kv_broken == 0:
            assert time.monotonic() - t0 < 15, "the send to the stopped consumer never gave up"
            time.sleep(0.1)

        os.kill(D1.pids[0], signal.SIGKILL)          # and now it is dead
        D1._procs[0].join(10)
        P._send(messages.DropPeer("d1"))   # what the router sends when it sees that (no-op now)
        P.add_requests([AddRequest("e", PROMPT, dataclasses.replace(GREEDY, max_tokens=1),
                                   kv_hold=True)])
        held = _collect(P, "e", 30).kv_transfer
        P.send_kv([KVSend("e", "d1", held.block_ids)])     # skipped at once: the pair is broken
        P.add_requests([AddRequest("f", PROMPT, GREEDY)])
        assert _collect(P, "f", 15).outputs[0].token_ids == ref
        stats = P.check_integrity()
        assert (stats.kv_peers, stats.kv_broken) == (2, 1)
        assert stats.num_kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
        assert not P.exited()
        P._send(messages.DropPeer("d2"))   # reaches every rank's connector with the next step
        t0 = time.monotonic()
        while P.check_integrity().kv_broken < 2:
            assert time.monotonic() - t0 < 10, "DropPeer did not break the pair with d2"
            time.sleep(0.01)
    finally:
        for c in clients:
            c.shutdown(10)
    assert P._procs[0].exitcode == 0 and D2._procs[0].exitcode == 0
    assert_processes_gone([p for c in clients for p in c.pids])


# ---- the pair connectors, in this process and a consumer process ------------------------------
_CONSUMER = """
import sys, time, torch
from pdserve.disagg.connectors import get_connector_class
from pdserve.protocol import KVPair
port, name = sys.argv[1], sys.argv[2]
conns = []
for consumer in ("d1", "d2"):
    c = get_connector_class(name)(torch.zeros(2, 2, 8, 4, 2, 8), 0, 1, 2)
    c.add_peer(KVPair("p", consumer, 1, 1, 2, f"127.0.0.1:{port}", "consumer", 2.0))
    conns.append(c)
print("joined", flush=True)
time.sleep(600)                  # joined, and never receives
"""


@pytest.mark.parametrize("connector", ["torch-dist", "nccl"])
def test_a_producer_abandons_sends_to_a_dead_or_dropped_consumer(connector):
    """Pairs p->d1 and p->d2 with a consumer process that never receives. d2 is dropped (as the
    router does for a dead worker): sends to it are skipped at once (the nccl connector on CPU
    would otherwise wait its 2 s send timeout). Then the consumer process is killed with a send
    to d1 pending: the send fails at once (gloo sees the connection close), the pair is broken
    and later sends to d1 return at once."""
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    consumer = subprocess.Popen([sys.executable, "-c", _CONSUMER, str(store.port), connector],
                                stdout=subprocess.PIPE, text=True, cwd=root,
                                env=dict(os.environ, PYTHONPATH=root))
    kv = torch.arange(2 * 2 * 8 * 4 * 2 * 8, dtype=torch.float32).view(2, 2, 8, 4, 2, 8)
    producer = get_connector_class(connector)(kv, 0, 1, 2)
    try:
        for d in ("d1", "d2"):
            producer.add_peer(KVPair("p", d, 1, 1, 2, f"127.0.0.1:{store.port}", "producer", 2.0))
        assert consumer.stdout.readline().strip() == "joined"
        producer.drop_peer("d2")
        t0 = time.monotonic()
        producer.send_blocks(KVSend("r0", "d2", [4, 5], True))
        assert time.monotonic() - t0 < 0.5
        assert "dropped" in producer.broken["d2"]

        def kill_soon():
            time.sleep(0.5)
            consumer.kill()
        with ThreadPoolExecutor(1) as pool:
            pool.submit(kill_soon)
            t0 = time.monotonic()
            producer.send_blocks(KVSend("r1", "d1", [0, 1], True))  # (nccl on CPU: blocks here)
            while "d1" not in producer.broken:
                assert time.monotonic() - t0 < 1.9, "the dead consumer was not noticed at once"
                time.sleep(0.01)
        assert "closed" in producer.broken["d1"].lower()
        t0 = time.monotonic()
        producer.send_blocks(KVSend("r2", "d1", [2, 3], True))
        assert time.monotonic() - t0 < 0.5
        assert producer.num_broken() == 2
    finally:
        consumer.kill()
        consumer.wait()
        t0 = time.monotonic()
        producer.close()
        assert time.monotonic() - t0 < 10
