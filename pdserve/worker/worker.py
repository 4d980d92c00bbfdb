"""A worker: one engine spread over a TP group, one process per rank, started by worker_main().

    client ──(zmq, msgspec messages)──> rank 0: LLMEngine (engine core: scheduler, KV manager,
                                        │        output processor) + its model shard
                                        │ each step: the SchedulerOutput, block tables as
                                        ▼ deltas (zmq; step_broadcast.py)
                                   rank 1..N-1: model shard only, same forward
                                        (the all-reduces / logits gather inside meet rank 0's)

Rank 0 decides everything that is not tensor math (which tokens run, which token was sampled),
so ranks cannot diverge: the others learn sampled tokens from the next step's chunks, or,
for a token still pending there (async scheduling), from the driver's broadcast of each
step's sampled tokens (model_runner.py).

Lifecycle: Drain -> rank 0 rejects new requests, finishes the ones in flight, tells the other
ranks to stop, releases CUDA graphs (they captured collectives) before the process group, answers
Drained, and every rank exits. A rank that notices its client is gone exits too.

Rank 0's sends (outputs to the client, steps to the other ranks) never block on a reader that is
gone: zmq keeps queueing for a reader that vanished (up to 1000 messages) and then blocks, so a
send that finds the queue full waits only while the reader lives and at most
WorkerConfig.send_timeout_s (client_timeout_s for the client) (_Outbox). A client that takes
nothing for that long is gone: rank 0 exits cleanly, there is nobody to serve. A rank that takes
no step for that long, or exited, fails the worker (Failed names it).
"""
from __future__ import annotations

import os
import pickle
import select
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable

import msgspec
import zmq

from ..checks import check_int, check_number
from ..config import EngineConfig
from ..kv_layout import kv_bytes_per_token
from .launch import host_id
from .step_broadcast import StepDecoder, StepEncoder

_IDLE_POLL_MS = 500  # how often an idle rank checks that its client is still alive
_SEND_POLL_MS = 100  # how often a send that finds no room looks at its reader
_STOP = b"stop"      # driver -> followers: no more steps (a step is a pickle, never this)
# Only KV pulls in flight (nothing to run until one ends): how long rank 0 waits between steps
# instead of spinning on the connector's poll.
_PULL_WAIT_S = 2e-4
# Step records (StepRecord) travel with the outputs; with no output to carry them, they go on
# their own once this many have piled up, or when the engine goes idle.
_STEP_RECORDS_BATCH = 64


class ClientGone(Exception):
    """Rank 0's client exited or takes no output: nobody to serve, rank 0 exits cleanly."""


class RankGone(RuntimeError):
    """A follower rank exited or takes no step: the worker fails."""


class _Outbox:
    """Rank 0's PUSH socket to one reader (its client, or one follower rank).

    A message that fits in the queue is sent at once (the normal path: one non-blocking send).
    When it does not fit, the send waits for room while `alive()` holds, at most timeout_s, and
    otherwise raises `gone` naming the reader: zmq would block for ever, as it keeps a queue for
    a reader that has vanished (a connecting socket outlives its peer) and a stopped process
    never drains its own."""

    def __init__(self, sock: zmq.Socket, reader: str, alive: Callable[[], bool],
                 timeout_s: float, gone: type[Exception]):
        self.sock, self.reader, self.alive = sock, reader, alive
        self.timeout_s, self.gone = timeout_s, gone

    def send(self, payload) -> None:
        if self.offer(payload):
            return
        deadline = time.monotonic() + self.timeout_s
        while True:
            if not self.alive():
                raise self.gone(f"{self.reader} exited")
            if time.monotonic() >= deadline:
                raise self.gone(f"{self.reader} took no message for {self.timeout_s:g} s "
                                "(stopped or stuck)")
            if self.sock.poll(_SEND_POLL_MS, zmq.POLLOUT) and self.offer(payload):
                return

    def offer(self, payload) -> bool:
        """Send if the queue has room; False if not (nothing sent)."""
        try:
            self.sock.send(payload, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False


def _process_alive(pid: int) -> Callable[[], bool]:
    """A liveness check for a process that is not our child (a sibling rank): its pidfd turns
    readable once it has exited, zombie or not, and never names a reused pid."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return lambda: False
    return lambda: not select.select([fd], [], [], 0)[0]


class _StepProfiler:
    """With PDSERVE_TORCH_PROFILER_DIR set, each rank records steps [skip, skip + count) with the
    torch profiler and writes a kernel table and a chrome trace there (for finding where a
    step's time goes across ranks). Otherwise a no-op."""

    def __init__(self, rank: int, skip: int = 60, count: int = 30):
        self.dir = os.environ.get("PDSERVE_TORCH_PROFILER_DIR")
        self.rank, self.skip, self.count, self.n, self.prof = rank, skip, count, 0, None

    def step(self) -> None:
        if not self.dir:
            return
        self.n += 1
        if self.n == self.skip:
            import torch
            self.prof = torch.profiler.profile(activities=[
                torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            self.prof.__enter__()
        elif self.n == self.skip + self.count and self.prof is not None:
            self.prof.__exit__(None, None, None)
            os.makedirs(self.dir, exist_ok=True)
            with open(os.path.join(self.dir, f"rank{self.rank}.txt"), "w") as f:
                f.write(self.prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
                f.write("\n")
                f.write(self.prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
            self.prof.export_chrome_trace(os.path.join(self.dir, f"rank{self.rank}.json"))
            self.prof = None


def _triton_kernels() -> list:
    """pdserve's Triton kernels, for counting their compiled variants (under the interpreter
    they compile nothing and count zero)."""
    import importlib

    from triton.runtime.jit import KernelInterface
    found = []
    for mod in ("activation", "kv_pull", "paged_attention", "rmsnorm", "rope_store"):
        m = importlib.import_module(f"pdserve.kernels.{mod}")
        found += [v for v in vars(m).values() if isinstance(v, KernelInterface)]
    return found


def kernel_variants(kernels: list) -> dict[str, int]:
    """How many compiled variants each kernel has in this process (Triton's per-device
    kernel caches; 0 under the interpreter)."""
    return {k.fn.__name__: sum(len(c[0]) for c in getattr(k, "device_caches", {}).values())
            for k in kernels}


class _SlowSteps:
    """With PDSERVE_LOG_SLOW_STEP_MS=N set, every step longer than N ms is written to stderr:
    its duration, the batch, and which Triton kernels compiled a new variant during it (a
    specialization seen for the first time stalls its step for about a second). Otherwise a
    no-op."""

    def __init__(self, name: str):
        v = os.environ.get("PDSERVE_LOG_SLOW_STEP_MS")
        self.limit = None if not v else float(v) / 1e3
        self.name, self.n, self.t0, self.before = name, 0, 0.0, {}
        self.kernels = _triton_kernels() if self.limit is not None else []

    def start(self) -> None:
        if self.limit is not None:
            self.n += 1
            self.before = kernel_variants(self.kernels)
            self.t0 = time.perf_counter()

    def end(self, running: int, waiting: int) -> None:
        if self.limit is None:
            return
        took = time.perf_counter() - self.t0
        if took < self.limit:
            return
        new = {k: v - self.before.get(k, 0) for k, v in kernel_variants(self.kernels).items()
               if v != self.before.get(k, 0)}
        print(f"pdserve worker {self.name}: step {self.n} took {took * 1e3:.1f} ms "
              f"(running {running}, waiting {waiting}; new kernel variants: {new or 'none'})",
              file=sys.stderr, flush=True)


@dataclass(frozen=True)
class WorkerAddresses:
    """Where the processes meet (chosen by whoever starts the worker, never constants)."""
    requests: str               # client -> rank 0 (zmq; the client binds)
    outputs: str                # rank 0 -> client (zmq; the client binds)
    # rank 0 -> rank r for r >= 1 (zmq): rank r binds steps[r - 1] (a `*` port: one picked
    # then) and tells rank 0 the endpoint it got through the TP group's first gather
    steps: tuple[str, ...]
    dist_init_method: str       # torch.distributed rendezvous, e.g. tcp://127.0.0.1:PORT
    # this start's CURVE keypair (public, secret), made by its client: a tcp channel admits
    # only peers that hold it (channel())
    key: tuple[bytes, bytes] | None = field(default=None, repr=False)


def channel(ctx: zmq.Context, kind: int, endpoint: str, key: tuple[bytes, bytes] | None,
            bind: bool) -> zmq.Socket:
    """A socket of one worker's channels, bound to `endpoint` or connected to it. On tcp, given
    the start's key (WorkerAddresses.key), it speaks CURVE, the bound side as the server: a
    peer without this start's key (a rank of an earlier start, such as a stale rank 0 on a
    partitioned node dialling a port that a new client took) fails the handshake and is
    dropped before any message, so it never gets a request (a PUSH deals its messages out among
    every peer it has) and nothing it sends arrives. An ipc endpoint is a file in the client's
    own directory, which no other start reaches: left as it is."""
    sock = ctx.socket(kind)
    if key is not None and endpoint.startswith("tcp://"):
        sock.curve_publickey, sock.curve_secretkey = key
        if bind:
            sock.curve_server = True
        else:
            sock.curve_serverkey = key[0]
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


@dataclass(frozen=True)
class WorkerConfig:
    engine: EngineConfig
    addresses: WorkerAddresses
    # ranks exit when this process, their parent, is gone: the client, or (Ray) the actor that
    # stands for it on the rank's node
    client_pid: int
    workdir: str | None = None  # the worker's own directory (KV pool files of a P/D worker)
    name: str = "worker"        # how P/D peers name this worker
    # a follower rank that takes no step for this long, with rank 0's queue to it full, is gone
    # (_Outbox); so is a client whose process lives on without reading for client_timeout_s
    # (longer: a router may be busy with another worker for seconds, e.g. a restart's KV join)
    send_timeout_s: float = 5.0
    client_timeout_s: float = 60.0
    # CPU: torch threads per rank; None: the host's cores split among this worker's ranks
    cpu_threads: int | None = None
    # each rank's device where the launcher assigned them (Ray); empty: the engine config's
    # (consecutive GPUs from its device, EngineConfig.rank_device)
    rank_devices: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("send_timeout_s", "client_timeout_s"):
            check_number(name, getattr(self, name))
        check_int("cpu_threads", self.cpu_threads, allow_none=True)


def worker_main(wc: WorkerConfig, rank: int) -> None:
    """Entry point of one rank's process."""
    import torch

    from ..layers.parallel_state import destroy_tp_group, get_tp_group, init_tp_group

    tp = wc.engine.tensor_parallel_size
    # This rank's view of the configuration: its own GPU; "mp" is how it was started, and
    # inside the process the engine runs in place.
    device = wc.rank_devices[rank] if wc.rank_devices else str(wc.engine.rank_device(rank))
    cfg = replace(wc.engine, device=device, distributed_executor_backend="mp")
    device = cfg.torch_device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif wc.cpu_threads is not None:  # several workers on this host (the router's share)
        torch.set_num_threads(wc.cpu_threads)
    elif tp > 1:
        # CPU ranks share the cores: oversubscribed threads turn every collective into a wait
        # for a descheduled peer.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // tp))
    ctx = zmq.Context()
    out = None
    try:
        if rank == 0:
            sock = channel(ctx, zmq.PUSH, wc.addresses.outputs, wc.addresses.key, bind=False)
            sock.setsockopt(zmq.LINGER, 5000)
            out = _Outbox(sock, f"the client (pid {wc.client_pid})",
                          lambda: _client_alive(wc.client_pid), wc.client_timeout_s, ClientGone)
        steps = None
        if rank > 0:  # bound before the gather, which tells rank 0 where
            steps = channel(ctx, zmq.PULL, wc.addresses.steps[rank - 1], wc.addresses.key,
                            bind=True)
        init_tp_group(rank, tp, wc.addresses.dist_init_method, device,
                      one_shot=not cfg.disable_custom_all_reduce)
        # rank 0 connects to the others and watches them
        found = get_tp_group().all_gather_object(_RankPlace(
            os.getpid(), host_id(),
            "" if steps is None else steps.getsockopt(zmq.LAST_ENDPOINT).decode()))
        if rank == 0:
            _Driver(cfg, wc, ctx, out, found[1:]).run()
        else:
            _follow(cfg, wc, steps, rank)
    except BaseException as e:  # noqa: BLE001 - report anything, then exit non-zero
        if out is not None:
            from .messages import Failed
            kind = "ValueError" if isinstance(e, ValueError) else type(e).__name__
            # errors that say all there is to say (a bad configuration, a lost rank) travel
            # without their traceback
            plain = isinstance(e, (ValueError, RankGone))
            detail = str(e) if plain else traceback.format_exc()
            try:
                out.send(msgspec.msgpack.encode(Failed(kind, detail)))
            except ClientGone:
                pass                    # nobody left to tell
        else:
            traceback.print_exc()
        ctx.destroy(linger=2000)
        sys.exit(1)
    destroy_tp_group()
    ctx.destroy(linger=2000)


def _client_alive(pid: int) -> bool:
    return os.getppid() == pid


@dataclass(frozen=True)
class _RankPlace:
    """What a rank tells the others when the TP group forms."""
    pid: int
    host: str                   # launch.host_id(): where `pid` means this process
    steps: str                  # the endpoint it takes steps on (rank >= 1)

    def alive_check(self) -> Callable[[], bool]:
        """Seen from this process: a pidfd where the pid means the rank, else no check (the
        rank sits on another host: a full queue to it waits out send_timeout_s)."""
        if self.host != host_id():
            return lambda: True
        return _process_alive(self.pid)


class _Driver:
    """Rank 0: the engine loop. Reads client messages between steps, never during one."""

    def __init__(self, cfg: EngineConfig, wc: WorkerConfig, ctx: zmq.Context, out: _Outbox,
                 followers: list[_RankPlace]):
        from . import messages as m
        from .llm_engine import LLMEngine
        self.m = m
        self.wc = wc
        self.out = out
        self.requests = channel(ctx, zmq.PULL, wc.addresses.requests, wc.addresses.key,
                                bind=False)
        self.followers: list[_Outbox] = []
        for rank, f in enumerate(followers, start=1):
            s = channel(ctx, zmq.PUSH, f.steps, wc.addresses.key, bind=False)
            self.followers.append(_Outbox(s, f"worker rank {rank} (pid {f.pid})",
                                          f.alive_check(), wc.send_timeout_s, RankGone))
        self.step_encoder = StepEncoder()
        # outputs travel as deltas (engine/output_processor.py; the client's DeltaDecoder)
        self.engine = LLMEngine(cfg, on_schedule=self._broadcast if self.followers else None,
                                kv_dir=wc.workdir, delta_outputs=True)
        self.decoder = msgspec.msgpack.Decoder(m.ToWorker)
        self.encoder = msgspec.msgpack.Encoder()
        self.draining = False

    def _broadcast(self, sched) -> None:
        payload = self.step_encoder.encode(sched)
        for s in self.followers:
            s.send(payload)

    def _send(self, msg) -> None:
        self.out.send(self.encoder.encode(msg))

    def run(self) -> None:
        try:
            self._serve()
        except ClientGone:
            return                      # nobody to serve: a clean exit
        finally:
            # (a rank whose queue is full now is stuck or gone: it is not waited for)
            for s in self.followers:
                s.offer(_STOP)
            self.engine.runner.release()

    def _serve(self) -> None:
        m, eng = self.m, self.engine
        attn = eng.model.layers[0].self_attn
        weight_bytes = sum(p.numel() * p.element_size()
                           for p in {id(p): p for p in eng.model.parameters()}.values())
        export = None if eng.runner.connector is None else eng.kv_export(self.wc.name)
        self._send(m.Ready(m.WorkerInfo(
            eng.max_model_len, eng.num_kv_blocks, eng.config.block_size,
            eng.model_config.vocab_size, list(eng.eos_token_ids),
            eng.config.tensor_parallel_size, weight_bytes,
            kv_bytes_per_token(eng.model_config.num_layers, attn.num_kv_heads, attn.head_dim,
                               eng.runner.kv_cache.element_size()), export,
            0 if eng.runner.host_tier is None else eng.runner.host_tier.num_host_blocks)))
        profiler = _StepProfiler(0)
        slow = _SlowSteps(self.wc.name)
        coord = eng.kv_coordinator
        last_expiry = time.monotonic()
        records: list = []
        while True:
            busy = eng.has_work()
            if self.requests.poll(0 if busy else _IDLE_POLL_MS):
                self._read_messages()
            if not _client_alive(self.wc.client_pid):
                return
            if eng.has_work():
                profiler.step()
                slow.start()
                outs = eng.step()
                slow.end(len(eng.scheduler.running), len(eng.scheduler.waiting))
                loads = eng.take_kv_events()
                records += eng.take_step_records()
                if outs or loads or len(records) >= _STEP_RECORDS_BATCH or (
                        records and not eng.has_work()):
                    self._send(m.Outputs(outs, self._stats(), loads, records))
                    records = []
                if eng.only_transfers_in_flight():
                    time.sleep(_PULL_WAIT_S)
            elif self.draining:
                self._send(m.Drained())
                return
            if coord is not None and coord.held and time.monotonic() - last_expiry > 1.0:
                last_expiry = time.monotonic()
                eng.expire_held_kv(last_expiry)

    def _stats(self):
        conn = self.engine.runner.connector
        return self.engine.stats(0 if conn is None else conn.num_peers(),
                                 0 if conn is None else conn.num_broken())

    def _read_messages(self) -> None:
        m, eng = self.m, self.engine
        while True:
            try:
                raw = self.requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self.decoder.decode(raw)
            if isinstance(msg, m.AddRequests):
                if self.draining:
                    errors = ["the worker is draining and accepts no new requests"] * len(msg.requests)
                else:
                    errors = eng.add_requests(msg.requests)
                self._send(m.Accepted(errors))
            elif isinstance(msg, m.Abort):
                eng.abort_request(msg.request_ids)
            elif isinstance(msg, m.CheckIntegrity):
                try:
                    eng.check_integrity()
                    error = None
                except AssertionError as e:
                    error = f"integrity check failed: {e}"
                self._send(m.IntegrityReport(error, self._stats()))
            elif isinstance(msg, m.ResetPrefixCache):
                self._send(m.PrefixCacheReset(eng.reset_prefix_cache()))
            elif isinstance(msg, m.Drain):
                self.draining = True
            elif isinstance(msg, m.ConnectKV):
                errors = []
                for peer in msg.peers:
                    try:
                        eng.connect_kv([peer])
                        errors.append(None)
                    except ValueError as e:
                        errors.append(str(e))
                self._send(m.Accepted(errors))
            elif isinstance(msg, m.ReleaseKV):
                eng.release_kv(msg.request_ids)
            elif isinstance(msg, m.SendKV):
                eng.send_kv(msg.sends)
            elif isinstance(msg, m.DropPeer):
                eng.drop_kv_peer(msg.worker)


def _follow(cfg: EngineConfig, wc: WorkerConfig, steps: zmq.Socket, rank: int) -> None:
    """Ranks >= 1: run every step rank 0 sends (on `steps`) until it sends _STOP, or until the
    client is gone (checked whenever no step came for _IDLE_POLL_MS)."""
    from .build import build_model_runner, kv_export
    runner, _, _ = build_model_runner(cfg, kv_dir=wc.workdir)
    if runner.connector is not None:
        kv_export(runner, wc.name)  # its part of the driver's gather
    decoder = StepDecoder()
    profiler = _StepProfiler(rank)
    try:
        while True:
            if not steps.poll(_IDLE_POLL_MS):
                if not _client_alive(wc.client_pid):
                    return
                continue
            payload = steps.recv()
            if payload == _STOP:
                return
            profiler.step()
            runner.execute(decoder.decode(payload))
    finally:
        runner.release()


if __name__ == "__main__":
    # python -m pdserve.worker.worker CONFIG_PICKLE RANK   (started by EngineClient)
    with open(sys.argv[1], "rb") as f:
        _wc = pickle.load(f)
    try:
        worker_main(_wc, int(sys.argv[2]))
        _code = 0
    except SystemExit as e:     # worker_main's own exit (it has reported and closed what it had)
        _code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    if _wc.workdir and not _client_alive(_wc.client_pid):
        # its owner died without removing it (a SIGKILL): its KV pool files can be GiBs
        shutil.rmtree(_wc.workdir, ignore_errors=True)
    # Everything worker_main opened is closed by now (TP group, zmq context, the runner): skip
    # the interpreter's teardown of torch's modules, about a second of CPU per process that a
    # stop or a restart would wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_code)
