"""Fault injection for KV transfers, kept out of the connectors: subclasses of the real
transports that fail or hang their loads, reached through the connector registry's plugin path.

    EngineConfig(kv_connector=faulty("shared", "fail"))   # "tests.kv_faults:SharedFail"

Worker processes build their connector from the config, so they get the faulty one too; they
import this module as `tests.kv_faults` because the repository root is on their sys.path (the
worker client puts the root of the pdserve it runs on PYTHONPATH; the tests run from that
checkout). A faulty class keeps its transport's class attributes (name, two_sided: the router
pairs the workers by them), and the producer side is untouched: only a consumer's loads fail.

    "fail"  every load ends failed (KVLoadDone.ok False, "injected" in its error). One-sided
            transports copy only the first half of the blocks before the failure (the
            consumer's blocks hold a partial copy, as after a fault half-way); two-sided ones
            receive the whole message (or the pair would fall out of step) and then fail.
    "hang"  no load is ever reported; the engine's transfer timeout or an abort ends it, with a
            verdict (finish(ok=False)) that the transport honours as for a slow copy.
"""
from __future__ import annotations

import msgspec

from pdserve.disagg.connectors import connector_names, get_connector_class
from pdserve.protocol import KVLoad

INJECTED = "injected KV transfer fault (tests/kv_faults.py)"
FAULTS = ("fail", "hang")


def faulty(connector: str, fault: str) -> str:
    """The kv_connector plugin path of `connector` with `fault` injected."""
    return f"{__name__}:{_class_name(connector, fault)}"


def _class_name(connector: str, fault: str) -> str:
    return "".join(p.title() for p in connector.split("-")) + fault.title()


def _failing(base):
    class Failing(base):
        def start_load(self, load: KVLoad, sync: bool) -> None:
            if not self.two_sided and load.dst_block_ids:
                half = (len(load.dst_block_ids) + 1) // 2
                load = load._replace(src_block_ids=load.src_block_ids[:half],
                                     dst_block_ids=load.dst_block_ids[:half])
            super().start_load(load, sync)

        def poll(self):
            return [msgspec.structs.replace(d, ok=False, error=INJECTED) if d.ok else d
                    for d in super().poll()]
    return Failing


def _hanging(base):
    class Hanging(base):
        def poll(self):
            super().poll()    # the transport's own bookkeeping runs; nothing is reported
            return []
    return Hanging


for _name in connector_names():
    _base = get_connector_class(_name)
    for _fault, _make in (("fail", _failing), ("hang", _hanging)):
        _cls = _make(_base)
        _cls.__name__ = _cls.__qualname__ = _class_name(_name, _fault)
        globals()[_cls.__name__] = _cls
del _name, _base, _fault, _make, _cls
