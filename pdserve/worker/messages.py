"""Typed messages between a client (the offline LLM, the server, later the router) and a worker's
rank 0, encoded as msgpack by msgspec. SamplingParams and RequestOutput travel as the dataclasses
they are (msgspec re-runs SamplingParams' validation on arrival).

    client ── AddRequests / Abort / CheckIntegrity / Drain / ConnectKV / ReleaseKV / SendKV /
              DropPeer ─> worker rank 0
    client <── Ready / Accepted / Outputs / IntegrityReport / Drained / Failed ── worker rank 0

Every AddRequests (and ConnectKV) is answered by exactly one Accepted (one error or None per request, in order)
and every CheckIntegrity by one IntegrityReport; Outputs arrive once per engine step that
advanced a request.
"""
from __future__ import annotations

from typing import Union

import msgspec

from ..protocol import AddRequest, KVLoadDone, KVPair, KVPeer, KVSend, StepRecord, WorkerStats
from ..outputs import RequestOutput


class AddRequests(msgspec.Struct, tag=True):
    requests: list[AddRequest]


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class ConnectKV(msgspec.Struct, tag=True):
    """P/D: the peers this worker exchanges KV with (one-sided: producers' pools to pull from;
    two-sided: the pairs it is in, either end). Answered by Accepted (an error or None per
    peer)."""
    peers: list[Union[KVPeer, KVPair]]


class SendKV(msgspec.Struct, tag=True):
    """Two-sided P/D producer: send held KV to consumers, in this order."""
    sends: list[KVSend]


class DropPeer(msgspec.Struct, tag=True):
    """P/D: worker `worker` is gone (its process died). Two-sided connectors abort the pair with
    it on every rank: pending sends to it are abandoned, later SendKV to it are skipped, loads
    from it fail (and are recomputed). Without this message the same happens once a send has
    waited KVPair.send_timeout_s; with it, at the next step. No reply; harmless for a worker
    that was never paired with `worker`, or already dropped it."""
    worker: str


class ReleaseKV(msgspec.Struct, tag=True):
    """P/D producer: drop the KV held for these (finished kv_hold) requests."""
    request_ids: list[str]


class CheckIntegrity(msgspec.Struct, tag=True):
    """Run the engine's invariant checks (block pool, scheduler) between steps; answered by
    IntegrityReport."""


class ResetPrefixCache(msgspec.Struct, tag=True):
    """Drop the cached prefixes no request uses; answered by PrefixCacheReset."""


class PrefixCacheReset(msgspec.Struct, tag=True):
    num_blocks_freed: int


class Drain(msgspec.Struct, tag=True):
    """No more requests: finish what is in flight, report Drained, exit."""


class WorkerInfo(msgspec.Struct):
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    eos_token_ids: list[int]
    tensor_parallel_size: int
    weight_bytes_per_rank: int     # parameter bytes on rank 0 (tied weights once)
    kv_bytes_per_token_per_rank: int
    kv_export: Union[KVPeer, None] = None  # with a kv_connector: how consumers reach its pools
    num_host_blocks: int = 0       # the KV cache's host tier per rank (swap_space_gb; 0: none)


class Ready(msgspec.Struct, tag=True):
    info: WorkerInfo


class Accepted(msgspec.Struct, tag=True):
    errors: list[Union[str, None]]  # per request of the AddRequests: None = queued


class Outputs(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]
    stats: Union[WorkerStats, None] = None
    kv_loads: list[KVLoadDone] = []   # P/D consumer: pulls that ended this step
    steps: list[StepRecord] = []      # the engine steps since the last Outputs


class Drained(msgspec.Struct, tag=True):
    pass


class IntegrityReport(msgspec.Struct, tag=True):
    error: Union[str, None]         # None: every invariant holds
    stats: WorkerStats


class Failed(msgspec.Struct, tag=True):
    """The worker hit an error it cannot serve past and is exiting."""
    error_type: str                 # "ValueError" for bad configuration, else the exception's type
    message: str


ToWorker = Union[AddRequests, Abort, CheckIntegrity, Drain, ConnectKV, ReleaseKV, SendKV,
                 DropPeer, ResetPrefixCache]
FromWorker = Union[Ready, Accepted, Outputs, IntegrityReport, Drained, Failed, PrefixCacheReset]
