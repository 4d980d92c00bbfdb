"""Workers on a Ray cluster (distributed_executor_backend="ray"), on CPU.

A local cluster of two simulated nodes (ray.cluster_utils.Cluster: a head that runs nothing,
node A and node B with one CPU each, so that Ray must put one rank or one worker on each):
TP=2 across the nodes and 1P1D with one worker per node both match the single-process engine's
greedy output; a one-host KV connector across nodes is refused by name; a lost node's worker is
a dead worker (its requests follow the router's fault rules) and comes back on a node Ray can
place it on; a rank whose actor dies takes the worker down with it, and no process is left (nor,
once another actor is placed on its node, its directory).
The pure parts (rank sites, liveness across hosts, the plan, flags) are tested without Ray.
"""
import os
import re
import time

import msgspec
import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.worker import ray_launch
from pdserve.worker.launch import RankSite, host_id
from pdserve.worker.worker import _RankPlace

from .test_tp import ENGINE, LLAMA_8Q_2KV, PROMPTS, _assert_same_model, _folder, _generate
from .utils import assert_processes_gone

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
DUMMY = dict(ENGINE, load_format="dummy")


# ---- without Ray -----------------------------------------------------------------------------
def test_cpu_ranks_keep_their_nodes_and_the_configs_device():
    found = [("n1", "10.0.0.1", []), ("n2", "10.0.0.2", [])]
    assert ray_launch.rank_sites(found, cuda=False) == [RankSite("n1", "10.0.0.1"),
                                                        RankSite("n2", "10.0.0.2")]


def test_cuda_ranks_see_their_workers_gpus_on_their_node_and_take_their_own():
    # node A holds GPUs 3 and 10 for this worker (ids sort as numbers: 3 before 10), node B
    # GPU 0: visible sets and indices worked out by hand
    found = [("A", "a", ["10"]), ("B", "b", ["0"]), ("A", "a", ["3"])]
    sites = ray_launch.rank_sites(found, cuda=True)
    assert [(s.device, dict(s.env)["CUDA_VISIBLE_DEVICES"]) for s in sites] == [
        ("cuda:1", "3,10"), ("cuda:0", "0"), ("cuda:0", "3,10")]
    with pytest.raises(RuntimeError, match="not one"):
        ray_launch.rank_sites([("A", "a", ["0", "1"])], cuda=True)


def test_a_rank_is_watched_by_pid_only_where_its_pid_means_it():
    import subprocess
    import sys
    here = _RankPlace(os.getpid(), host_id(), "")
    assert here.alive_check()()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    # an exited process on this host is seen as gone; the same pid "on another host" is not
    # looked up here (it would name nothing, or somebody else): no check there
    assert not _RankPlace(child.pid, host_id(), "").alive_check()()
    assert _RankPlace(child.pid, "another-host/1", "").alive_check()()


def test_the_backend_and_strategy_are_flags_and_checked():
    import argparse

    from pdserve.args import add_engine_args, engine_argv, engine_config
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config(p.parse_args(["--distributed-executor-backend", "ray",
                                      "--ray-placement-strategy", "SPREAD"]))
    assert (cfg.distributed_executor_backend, cfg.ray_placement_strategy) == ("ray", "SPREAD")
    assert cfg.executor_backend == "ray"
    assert engine_config(p.parse_args(engine_argv(cfg))) == cfg
    with pytest.raises(ValueError, match="ray_placement_strategy"):
        EngineConfig(ray_placement_strategy="ANYWHERE")
    with pytest.raises(ValueError, match="gets its GPU from Ray"):
        EngineConfig(device="cuda:1", distributed_executor_backend="ray")


def test_a_ray_plan_leaves_gpus_to_ray_and_moves_kv_two_sided():
    from pdserve.args import DeploymentArgs
    from pdserve.deploy import default_kv_connector
    from pdserve.routing import plan_workers
    # (under Ray the client's host needs no GPU: each rank checks its own node's)
    base = EngineConfig(device="cuda", distributed_executor_backend="ray")
    specs = plan_workers(base, prefill=1, decode=1, prefill_tp=2, kv_connector="nccl")
    assert [(s.config.device, s.config.tensor_parallel_size, s.config.executor_backend)
            for s in specs] == [("cuda", 2, "ray"), ("cuda", 1, "ray")]
    # CPU: this host's cores say nothing of the nodes' (each rank reserves one CPU there)
    cpu = plan_workers(EngineConfig(distributed_executor_backend="ray"), prefill=1, decode=1)
    assert [s.cpu_threads for s in cpu] == [None, None]
    with pytest.raises(ValueError, match="Ray places them"):
        plan_workers(base, collocated=2, num_gpus=1)
    said = []
    pd = DeploymentArgs(prefill=1, decode=1)
    assert default_kv_connector(base, pd, said.append) == "nccl"
    assert default_kv_connector(EngineConfig(distributed_executor_backend="ray"), pd,
                                said.append) == "torch-dist"
    assert len(said) == 2 and "two-sided" in said[0]
    assert default_kv_connector(EngineConfig(), pd, said.append) == "shared" and len(said) == 2


def test_a_start_that_fails_part_way_leaves_no_rank(monkeypatch, tmp_path):
    """(The local launcher, the contract both share.) Rank 1's process cannot be started: the
    client's start fails with that error, and rank 0, already started, is stopped."""
    from pdserve.worker import launch
    from pdserve.worker.client import EngineClient
    started = []

    class FailingSecond(launch.LocalRank):
        def __init__(self, path, rank):
            if rank == 1:
                raise OSError("no process for rank 1")
            super().__init__(path, rank)
            started.append(self.pid)

    monkeypatch.setattr(launch, "LocalRank", FailingSecond)
    with pytest.raises(OSError, match="no process for rank 1"):
        EngineClient(EngineConfig(_folder(tmp_path, LLAMA_8Q_2KV), tensor_parallel_size=2,
                                  **DUMMY))
    assert len(started) == 1
    assert_processes_gone(started)


def test_an_abandoned_start_ends_at_once_and_leaves_no_rank(monkeypatch, tmp_path):
    """(The local launcher.) A router shut down while a worker starts: abandon() calls the
    start off while it waits for the worker's Ready, and returns once the start has ended
    (StartCancelled) and its rank is stopped, not whenever the worker would have come up."""
    from pdserve.routing.workers import Starting, WorkerSpec
    from pdserve.worker import launch
    started = []

    class Recorded(launch.LocalRank):
        def __init__(self, path, rank):
            super().__init__(path, rank)
            started.append(self.pid)

    monkeypatch.setattr(launch, "LocalRank", Recorded)
    cfg = EngineConfig(_folder(tmp_path, LLAMA_8Q_2KV), **DUMMY)
    st = Starting(WorkerSpec("w", "collocated", cfg), "w", 600)
    deadline = time.monotonic() + 60
    while not started:                  # its rank runs (it takes seconds to get Ready)
        assert time.monotonic() < deadline and not st.done.is_set(), st.error
        time.sleep(0.01)
    t0 = time.monotonic()
    st.abandon()
    assert st.done.is_set() and st.client is None       # (it used to return at once)
    assert type(st.error).__name__ == "StartCancelled", st.error
    assert time.monotonic() - t0 < 5
    assert_processes_gone(started)


def test_a_ranks_directory_is_kept_while_its_actor_or_rank_lives_then_swept(tmp_path,
                                                                            monkeypatch):
    """(What a Ray rank's actor does with its directory, without Ray.) The actor holds the
    directory's lock and its rank inherits it: a sweep keeps the directory while either lives,
    and removes it once both are gone, however they ended."""
    import subprocess
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path, held = ray_launch.rank_dir()
    rank = subprocess.Popen(["sleep", "60"], pass_fds=(held,))
    assert ray_launch.sweep_rank_dirs() == []
    os.close(held)                      # the actor is gone, its rank not yet
    assert ray_launch.sweep_rank_dirs() == [] and os.path.isdir(path)
    rank.kill()
    rank.wait()
    assert ray_launch.sweep_rank_dirs() == [path] and not os.path.exists(path)


def test_a_tcp_channel_admits_only_the_ranks_of_its_own_start(monkeypatch, tmp_path):
    """(The local launcher on tcp, as under Ray.) A rank of an earlier start, such as a stale
    rank 0 on a partitioned node, may dial the ports a new client took. A peer without this
    start's key, unkeyed or keyed for another start, fails the handshake: it gets no request
    (a PUSH deals its messages out among every peer it has) and what it sends never arrives,
    while the worker (TP=2: its steps channel is tcp too) serves as usual."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from pdserve.protocol import AddRequest
    from pdserve.worker import launch
    from pdserve.worker import messages as m
    from pdserve.worker.client import EngineClient
    monkeypatch.setattr(launch.ProcessLauncher, "endpoint",
                        lambda self, address, name: "tcp://127.0.0.1:*")
    client = EngineClient(EngineConfig(_folder(tmp_path, LLAMA_8Q_2KV), tensor_parallel_size=2,
                                       **DUMMY))
    ctx = zmq.Context()
    try:
        stale, monitors = [], []
        for keyed in (False, True):     # a stale rank 0's two sockets
            for kind, sock in ((zmq.PULL, client._requests), (zmq.PUSH, client._outputs)):
                s = ctx.socket(kind)
                if keyed:
                    public, secret = zmq.curve_keypair()
                    s.curve_serverkey, s.curve_publickey, s.curve_secretkey = \
                        public, public, secret
                monitors.append(s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED))
                s.connect(sock.getsockopt(zmq.LAST_ENDPOINT))
                stale.append(s)
        deadline = time.monotonic() + 1.0
        for mon in monitors:            # (the real rank's handshake takes milliseconds)
            assert not mon.poll(max(0, int((deadline - time.monotonic()) * 1000))), \
                recv_monitor_message(mon)
        for s in stale[1::2]:           # a forged failure: it would end the worker
            try:
                s.send(msgspec.msgpack.encode(m.Failed("RuntimeError", "stale")), zmq.NOBLOCK)
            except zmq.Again:           # (the refused connection is gone: nowhere to queue it)
                pass
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        ids = [f"r{i}" for i in range(4)]
        assert client.add_requests([AddRequest(i, {"prompt_token_ids": [5, 6, 7]}, params)
                                    for i in ids]) == [None] * 4
        done = set()
        while client.has_unfinished_requests():
            done |= {o.request_id for o in client.step(timeout_s=30) if o.finished}
        assert done == set(ids)
        assert not any(s.poll(0) for s in stale[0::2])
    finally:
        ctx.destroy(linger=0)
        client.shutdown()


def test_without_ray_the_backend_is_refused_by_name(monkeypatch, tmp_path):
    monkeypatch.setattr(ray_launch, "ray", None)
    with pytest.raises(ValueError, match="needs Ray"):
        LLM(_folder(tmp_path, LLAMA_8Q_2KV), distributed_executor_backend="ray", **DUMMY)


# ---- on a local two-node cluster -------------------------------------------------------------
ray = ray_launch.ray   # (None without Ray: the cluster fixture skips what needs it)


@pytest.fixture(scope="module")
def cluster():
    """Head (runs nothing) + nodes A and B of one CPU each; this process is its driver."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        c.add_node(num_cpus=1)
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()
    # Cluster writes its address where `ray.init()` looks for the latest `ray start`: leave
    # no dead cluster there for a later ray.init() to wait on
    latest = "/tmp/ray/ray_current_cluster"
    try:
        with open(latest) as f:
            if f.read().strip() == c.address:
                os.remove(latest)
    except OSError:
        pass


def _worker_nodes(c) -> set[str]:
    return {n.node_id for n in c.list_all_nodes() if n is not c.head_node}


def _free_cpus() -> float:
    return ray.available_resources().get("CPU", 0)


def _wait_free(cpus: float, timeout_s: float = 20) -> None:
    """Every placement group removed, and the cluster's CPUs free again."""
    from ray.util import placement_group_table
    deadline = time.monotonic() + timeout_s
    while _free_cpus() < cpus or any(g["state"] != "REMOVED"
                                     for g in placement_group_table().values()):
        assert time.monotonic() < deadline, (ray.available_resources(), placement_group_table())
        time.sleep(0.1)


def _rank_dirs() -> set[str]:
    """The Ray ranks' directories on this host (every node of the test cluster runs here)."""
    import glob
    import tempfile
    return set(glob.glob(os.path.join(tempfile.gettempdir(), ray_launch._RANK_DIR_PREFIX + "*")))


def _greedy(llm) -> list[list[int]]:
    """Greedy token ids of PROMPTS (no prompt logprobs: those run a request whole, not split)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The model folder and one in-process engine's outputs on it: _generate's (logprobs, for
    TP) and _greedy's (for P/D)."""
    path = _folder(tmp_path_factory.mktemp("ray"), LLAMA_8Q_2KV)
    llm = LLM(path, **DUMMY)
    return path, _generate(llm), _greedy(llm)


def test_tp2_across_two_nodes_equals_one_process(cluster, model):
    path, ref, _ = model
    llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray",
              ray_placement_strategy="STRICT_SPREAD", **DUMMY)
    client = llm.llm_engine
    assert set(client.nodes) == _worker_nodes(cluster)     # one rank on each node
    _assert_same_model(ref, _generate(llm))
    pids = client.pids
    llm.shutdown()
    assert [p.exitcode for p in client._procs] == [0, 0]   # drained, exited by themselves
    assert_processes_gone(pids)
    _wait_free(2)


def test_1p1d_one_worker_per_node_equals_one_engine(cluster, model, capfd):
    path, _, ref = model
    with LLM(path, prefill=1, decode=1, distributed_executor_backend="ray", **DUMMY) as llm:
        router = llm.llm_engine
        nodes = {n: w.client.nodes for n, w in router.workers.items()}
        assert {n for ns in nodes.values() for n in ns} == _worker_nodes(cluster), nodes
        assert "two-sided 'torch-dist' connector" in capfd.readouterr().err
        assert _greedy(llm) == ref
        assert router.route_stats.requests == {"collocated": 0, "disagg": len(PROMPTS)}
        assert router.route_stats.transfers == len(PROMPTS)
        assert router.route_stats.transfer_failures == 0
        pids = router.pids
    assert_processes_gone(pids)
    _wait_free(2)


def test_a_one_host_connector_across_nodes_is_refused(cluster, model):
    path, *_ = model
    with pytest.raises(ValueError, match="'shared' KV connector works within one host"):
        LLM(path, prefill=1, decode=1, distributed_executor_backend="ray", kv_connector="shared",
            **DUMMY)
    _wait_free(2)


def test_a_placement_the_cluster_cannot_give_is_a_clear_error(cluster, model, monkeypatch,
                                                             capfd):
    from pdserve.worker.client import EngineClient
    path, *_ = model
    monkeypatch.setattr(ray_launch, "_PLACE_NOTICE_S", 0.5)
    cfg = EngineConfig(path, tensor_parallel_size=4, distributed_executor_backend="ray",
                       ray_placement_strategy="STRICT_SPREAD", **DUMMY)
    with pytest.raises(RuntimeError, match="could not place 4 rank"):
        EngineClient(cfg, startup_timeout_s=2)
    # while it waited, it said so (Ray keeps an impossible placement pending, silently)
    assert re.search(r"waiting \d+ s so far for Ray to place 4 rank\(s\)", capfd.readouterr().err)
    _wait_free(2)                       # the placement group was given back


def test_a_start_abandoned_while_ray_cannot_place_it_gives_the_placement_back(cluster, model):
    """A worker restarting when the router shuts down, waiting for a placement Ray cannot
    make: abandon() ends the wait and the placement group is removed before it returns (it
    used to stay pending for the rest of the start-up timeout)."""
    from ray.util import placement_group_table

    from pdserve.routing.workers import Starting, WorkerSpec
    path, *_ = model
    cfg = EngineConfig(path, tensor_parallel_size=4, distributed_executor_backend="ray",
                       ray_placement_strategy="STRICT_SPREAD", **DUMMY)
    st = Starting(WorkerSpec("w", "collocated", cfg), "w", 600)
    deadline = time.monotonic() + 30
    while not any(g["state"] == "PENDING" for g in placement_group_table().values()):
        assert time.monotonic() < deadline and not st.done.is_set(), st.error
        time.sleep(0.05)
    t0 = time.monotonic()
    st.abandon()
    _wait_free(2, timeout_s=1)          # the group is removed (it was left pending)
    assert time.monotonic() - t0 < 5
    assert st.done.is_set() and st.client is None
    assert type(st.error).__name__ == "StartCancelled", st.error


def test_a_rank_whose_actor_dies_takes_its_worker_down(cluster, model):
    """A rank's actor killed: its rank ends with it (Ray ends an actor's children; the rank
    also watches its parent), and the client fails the worker naming the rank and what Ray
    said."""
    from pdserve.protocol import AddRequest
    from pdserve.worker.client import EngineClient, EngineDeadError
    path, *_ = model
    before = _rank_dirs()
    client = EngineClient(EngineConfig(path, tensor_parallel_size=2, **DUMMY,
                                       distributed_executor_backend="ray",
                                       ray_placement_strategy="STRICT_SPREAD"))
    pids = client.pids
    dirs = _rank_dirs() - before
    assert len(dirs) == 2
    client.add_requests([AddRequest("r", {"prompt_token_ids": [5, 6, 7]},
                                    SamplingParams(max_tokens=10_000, ignore_eos=True))])
    ray.kill(client._procs[1].actor)
    with pytest.raises(EngineDeadError, match="worker rank 1 .*ActorDiedError"):
        for _ in range(100_000):
            client.step(timeout_s=5)
    assert_processes_gone(pids)
    client.shutdown()
    _wait_free(2)
    # rank 1's directory is left (Ray SIGKILLed its actor and the rank: nobody was left to
    # remove it); the next actor placed on its node removes it
    assert len(dirs & _rank_dirs()) == 1
    launcher = ray_launch.RayLauncher(EngineConfig(path, distributed_executor_backend="ray",
                                                   ray_placement_strategy="STRICT_SPREAD"))
    launcher.place(2, "next")
    launcher.close()
    assert not dirs & _rank_dirs()
    _wait_free(2)


def test_serve_with_prefill_and_decode_on_two_nodes(cluster, monkeypatch):
    """`pdserve serve` joins the cluster through RAY_ADDRESS; its router reaches workers on both
    nodes; a completion equals the in-process engine's; SIGTERM still stops it cleanly."""
    httpx = pytest.importorskip("httpx")
    from .test_server import _start, _stop, _stopped_cleanly
    from .utils import metric_value
    prompt = "The capital of France is"
    ref = LLM(max_model_len=256).generate([prompt], SamplingParams(temperature=0, max_tokens=8),
                                          use_tqdm=False)[0].outputs[0].text
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    proc, base = _start(["--distributed-executor-backend", "ray", "--prefill", "1", "--decode",
                         "1", "--max-model-len", "256", "--max-num-seqs", "8"])
    try:
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref
        metrics = httpx.get(base + "/metrics").text
        for worker in ("prefill-0", "decode-0"):
            assert metric_value(metrics, f'pdserve:worker_up{{worker="{worker}"}}') == 1
        assert _free_cpus() == 0                       # a worker on each node
        ranks = httpx.get(base + "/admin/check").json()["worker_ranks"]
        nodes = {w: {r["node"] for r in rs} for w, rs in ranks.items()}
        assert set(nodes) == {"prefill-0", "decode-0"} and all(len(n) == 1 for n in nodes.values())
        assert nodes["prefill-0"] != nodes["decode-0"]  # (the two Ray nodes, by their ids)
    finally:
        assert _stopped_cleanly(_stop(proc))
    proc.log.seek(0)
    assert "two-sided 'torch-dist' connector" in proc.log.read()
    _wait_free(2)


_DRIVER = """
import json, sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False)
from pdserve.config import EngineConfig
from pdserve.worker.client import EngineClient
client = EngineClient(EngineConfig(sys.argv[2], tensor_parallel_size=2, load_format="dummy",
                                   skip_tokenizer_init=True, num_kv_blocks=64, block_size=4,
                                   distributed_executor_backend="ray",
                                   ray_placement_strategy="STRICT_SPREAD"))
print(json.dumps(client.pids), flush=True)
time.sleep(600)
"""


def test_a_client_killed_leaves_no_rank_behind(cluster, model):
    """kill -9 the client's process: Ray ends the actors it owned, and with them their ranks
    (each rank also watches its actor, its parent), on whichever node they run."""
    import json
    import signal
    import subprocess
    import sys
    path, *_ = model
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, cluster.address, path],
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(driver.stdout.readline())
        assert len(pids) == 2
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
        assert_processes_gone(pids, timeout_s=60)
        _wait_free(2, timeout_s=60)
    finally:
        driver.kill()
        driver.wait()


def test_a_lost_node_is_a_dead_worker_restarted_where_ray_can_place_it(cluster, model):
    """1P1D, one worker per node; the decode worker's node is lost while requests decode
    there. Those requests end (finish_reason "abort" with the error, or whole on the prefill
    worker if they had not begun there), nothing hangs, new requests run whole on the prefill
    worker; once a node joins, the decode worker is started there and hand-offs resume with
    one engine's outputs."""
    path, _, ref = model
    with LLM(path, prefill=1, decode=1, distributed_executor_backend="ray",
             restart_backoff_s=0.1, **DUMMY) as llm:
        router = llm.llm_engine
        lost = router.workers["decode-0"].client
        node = next(n for n in cluster.list_all_nodes() if n.node_id == lost.nodes[0])
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        from pdserve.protocol import AddRequest
        ids = [f"r{i}" for i in range(len(PROMPTS))]
        assert router.add_requests([AddRequest(i, {"prompt_token_ids": p}, long)
                                    for i, p in zip(ids, PROMPTS)]) == [None] * len(PROMPTS)
        done, started = {}, set()
        while len(started) < len(ids):            # every request decodes on the decode worker
            for o in router.step(timeout_s=10):
                started.add(o.request_id)
        cluster.remove_node(node)
        deadline = time.monotonic() + 60
        while router.has_unfinished_requests():
            assert time.monotonic() < deadline, router.health()
            for o in router.step(timeout_s=1):
                if o.finished:
                    done[o.request_id] = o
        assert set(done) == set(ids)
        for o in done.values():                   # began on the lost worker: aborted, said why
            assert o.outputs[0].finish_reason == "abort" and "decode-0" in (o.error or ""), o
        health = {h.name: h for h in router.health()}
        assert health["decode-0"].state != "up" and "node" in health["decode-0"].error
        assert_processes_gone(lost.pids)
        # meanwhile requests run whole on the prefill worker
        assert _greedy(llm) == ref
        cluster.add_node(num_cpus=1)
        deadline = time.monotonic() + 120
        while router.workers["decode-0"].state != "up":
            assert time.monotonic() < deadline, router.health()
            router.step(timeout_s=0.2)
        back = router.workers["decode-0"].client
        assert back.name == "decode-0.1" and back.nodes[0] not in (lost.nodes[0],)
        before = router.route_stats.transfers
        assert _greedy(llm) == ref
        assert router.route_stats.transfers == before + len(PROMPTS)
        pids = router.pids
    assert_processes_gone(pids)
    _wait_free(2)
