"""The KV connector interface and its registry: how a consumer (decode) rank gets a request's KV
blocks from a producer (prefill) worker. Transports register under a name
(EngineConfig.kv_connector); a name of the form "package.module:ClassName" is a plugin path,
resolved by importing it (how tests bring in their fault-injecting connectors, and how a user
adds a transport without touching this package).

This module imports no torch (the transports do), so checking a connector name, as
EngineConfig does, costs nothing.

Built in:
  "shared"      one-sided, one host (shared_pull.py). CUDA: the producer's pool over CUDA IPC,
                read by a Triton kernel over NVLink where the GPUs have peer access, else
                through pinned host memory (the relay; chosen per producer GPU when it is
                added). CPU: a shared file.
  "relay"       "shared" with the pinned host relay forced.
  "torch-dist"  two-sided send/receive over a per-pair gloo group (CPU; what CI runs).
  "nccl"        the same pairing over NCCL point-to-point (GPUs, across hosts too); on CPU
                its code runs over gloo, blocking, so CI exercises it.
"""
from __future__ import annotations

import abc
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ...protocol import KVLoad, KVLoadDone, KVPair, KVPeer, KVSend


class KVConnector(abc.ABC):
    """One rank's end of KV transfer, over that rank's own KV cache. Every rank of a worker in a
    P/D deployment owns one; the cache layout is [layers, 2 (k, v), blocks, block_size, local KV
    heads, head_dim] on both sides (heads re-sharded by head_plan.py when the TP sizes differ).

        producer rank:  allocate() the cache where peers can reach it; export() a handle for it
        consumer rank:  add_peer(KVPeer)           once per producer worker (its ranks' handles)
                        start_load(KVLoad, sync)   copy blocks, all layers, the heads this rank
                                                   holds
                        poll() -> finished loads   (async: each step; sync loads finish in
                                                   start_load and are reported by the next poll)
                        finish(rid, ok)            the driver's verdict: ok -> make the data
                                                   visible to compute; not ok -> cancel (no
                                                   write after it returns)

        producer rank (two-sided only):  send_blocks(KVSend) when the router asks (SendKV)
        either end (two-sided only):     drop_peer(name) when the router saw that worker die
                                         (DropPeer): the pair is aborted. Without it a
                                         producer gives up a send after
                                         KVPair.send_timeout_s, breaking the pair the same
                                         way, and goes on serving.

    With a one-sided connector a load never involves the producer, so neither side waits for a
    matching send/receive. The driver of the consumer (rank 0) decides when a load is done and
    tells its other ranks in the next step, so all ranks admit the request together. Each load
    goes started -> done -> reported (once, by poll) -> verdict (finish); load_tracker.py keeps
    that bookkeeping for every transport.

    Class attributes are facts about the transport that callers read from the class (the
    router, before any instance exists): `name` (what peers' KVPeer.connector says) and
    `two_sided`. A subclass that wraps a transport (tests' fault injection) keeps them."""

    name: str = ""
    # One-sided: the consumer reads the producer's pool (peers: KVPeer). Two-sided: the
    # producer sends when asked (SendKV) and the consumer receives (peers: KVPair, both ends).
    two_sided: bool = False

    def __init__(self, kv_cache: "torch.Tensor", tp_rank: int, tp_size: int, num_kv_heads: int):
        self.kv = kv_cache
        self.tp_rank, self.tp_size, self.num_kv_heads = tp_rank, tp_size, num_kv_heads

    @classmethod
    def allocate(cls, shape: tuple[int, ...], dtype: "torch.dtype", device: "torch.device",
                 path: str) -> "torch.Tensor":
        """A zeroed KV cache this connector can export (path: a file name the worker owns)."""
        import torch
        return torch.zeros(shape, dtype=dtype, device=device)

    @abc.abstractmethod
    def export(self) -> bytes:
        """This rank's handle for consumers (KVPeer.handles[rank])."""

    @abc.abstractmethod
    def add_peer(self, peer: "KVPeer | KVPair") -> None:
        """Make a peer reachable (idempotent). Every rank of the worker calls it in the same
        step; a two-sided connector joins the pair's process group here."""

    @abc.abstractmethod
    def num_peers(self) -> int:
        """Peers added so far (a two-sided pair that could not be formed counts: it was tried)."""

    def drop_peer(self, worker: str) -> None:
        """Worker `worker` is gone (every rank, in the same step): stop waiting for it. A
        two-sided pair with it is aborted: pending sends are abandoned, later sends skipped,
        loads from it fail. One-sided connectors have nothing that waits for a peer."""

    def num_broken(self) -> int:
        """Peers (of num_peers()) this connector has given up on."""
        return 0

    def check_peer(self, peer: "KVPeer | KVPair") -> None:
        """Rank 0, when a peer is announced: ValueError if it cannot work (before any rank
        commits to it)."""
        self.add_peer(peer)

    def send_blocks(self, send: "KVSend") -> None:
        """Two-sided producers: send blocks to a consumer (asynchronously; the blocks are read
        before this returns, so they may be reused right after)."""
        raise ValueError(f"the {self.name!r} connector does not send")

    @abc.abstractmethod
    def start_load(self, load: "KVLoad", sync: bool) -> None:
        """Begin copying a request's blocks. sync: return only once it is finished (poll()
        reports it). A load without destination blocks is a two-sided receive-and-discard
        (keeps the pair in step): it is nobody's, never reported nor judged. On a GPU the copy
        must come after the work already queued on the device's current stream (the blocks'
        last writers: under async scheduling a step still in flight may write blocks that
        were freed and are now this load's)."""

    @abc.abstractmethod
    def poll(self) -> list["KVLoadDone"]:
        """Loads that finished (or failed) since the last call, each reported once."""

    @abc.abstractmethod
    def finish(self, request_id: str, ok: bool) -> None:
        """The driver's verdict on a load: ok -> the next forward may read its blocks; not ok ->
        cancel it; either way nothing writes to its blocks after this returns. A rank whose own
        copy failed while the driver's succeeded raises (its KV would be wrong)."""

    def close(self) -> None:
        pass


# ---- registry ------------------------------------------------------------------------------
_CONNECTORS: dict[str, type[KVConnector]] = {}
# Built-in names -> the module (in this package) that registers them when imported: importing
# a transport means importing torch, which a name check should not need.
_BUILT_IN = {"shared": "shared_pull", "relay": "shared_pull", "torch-dist": "torch_dist",
             "nccl": "nccl"}


def register_connector(cls: type[KVConnector]) -> type[KVConnector]:
    """Class decorator: make `cls` available as kv_connector=cls.name."""
    _CONNECTORS[cls.name] = cls
    return cls


def connector_names() -> list[str]:
    """The registered names (built-in and registered so far); plugin paths are not listed."""
    return sorted(set(_BUILT_IN) | set(_CONNECTORS))


def is_plugin_path(name: str) -> bool:
    """"package.module:ClassName"."""
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr.isidentifier())


def check_connector_name(name: str) -> None:
    """ValueError unless `name` is a known connector or a plugin path that resolves to one.
    A built-in name is checked without importing its transport."""
    if name in _BUILT_IN or name in _CONNECTORS:
        return
    get_connector_class(name)


def get_connector_class(name: str) -> type[KVConnector]:
    """The connector class registered as `name`, or the class a plugin path names (which is
    not registered: it may be a subclass of a built-in that keeps the built-in's name)."""
    if name in _CONNECTORS:
        return _CONNECTORS[name]
    if name in _BUILT_IN:
        importlib.import_module(f"{__package__}.{_BUILT_IN[name]}")
        return _CONNECTORS[name]
    if not is_plugin_path(name):
        raise ValueError(f"unknown kv_connector {name!r}; known: {connector_names()} or a "
                         "plugin path 'package.module:ClassName'")
    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"kv_connector {name!r} does not resolve: {type(e).__name__}: {e}") \
            from None
    if not (isinstance(cls, type) and issubclass(cls, KVConnector)):
        raise ValueError(f"kv_connector {name!r} is not a KVConnector subclass")
    return cls
