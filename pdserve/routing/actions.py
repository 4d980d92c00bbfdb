"""What the router core asks its shell to do (router_core.py returns these, in order; the
shell carries each out before the next, and feeds back what it learns):

    Send(batch, worker, requests)   add_requests on worker; answer core.accepted(batch, errors),
                                    or core.worker_died(worker, ...) when it turned out dead
    Abort(worker, request_ids)      the worker drops these requests
    Release(worker, request_ids)    a producer drops the KV it holds for these
    SendKV(worker, sends)           two-sided producer: send held blocks (hand-off order)
    DropPeer(worker, peer)          two-sided: the peer incarnation `peer` is gone
    Deliver(output)                 an output for the user (a failure is a finished output with
                                    finish_reason "abort" and error set)
    Reject(request_id, error)       a request of this add not admitted (error: why)

An action for a worker the core has since seen die is moot: the shell skips it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..outputs import RequestOutput
from ..protocol import AddRequest, KVSend


@dataclass(frozen=True)
class Send:
    batch: int
    worker: str
    requests: list[AddRequest]


@dataclass(frozen=True)
class Abort:
    worker: str
    request_ids: list[str]


@dataclass(frozen=True)
class Release:
    worker: str
    request_ids: list[str]


@dataclass(frozen=True)
class SendKV:
    worker: str
    sends: list[KVSend]


@dataclass(frozen=True)
class DropPeer:
    worker: str
    peer: str                     # the dead incarnation's KV name


@dataclass(frozen=True)
class Deliver:
    output: RequestOutput


@dataclass(frozen=True)
class Reject:
    request_id: str
    error: str


Action = Send | Abort | Release | SendKV | DropPeer | Deliver | Reject
