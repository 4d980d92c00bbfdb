"""The KV connector registry (built-in names, plugin paths, what a wrapper reports) and the load
tracker's lifecycle, without processes."""
import os
import subprocess
import sys
import time

import pytest

from pdserve.disagg.connectors import KVConnector, connector_names, get_connector_class
from pdserve.disagg.connectors.load_tracker import LoadTracker, expect_agreement
from pdserve.protocol import KVLoad

from . import kv_faults

BUILT_IN = {"shared": False, "relay": False, "torch-dist": True, "nccl": True}  # -> two_sided


def test_built_in_names_resolve_to_their_transport():
    assert set(BUILT_IN) <= set(connector_names())
    for name, two_sided in BUILT_IN.items():
        cls = get_connector_class(name)
        assert issubclass(cls, KVConnector) and (cls.name, cls.two_sided) == (name, two_sided)


def test_a_name_check_imports_no_transport():
    """EngineConfig checks kv_connector by name: the registry alone must not import the
    transports (nor torch, through them)."""
    code = ("import sys; from pdserve.disagg.connectors import base; base.check_connector_name("
            "'nccl'); print(sorted(m for m in sys.modules if 'connectors.' in m))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=root, env=dict(os.environ, PYTHONPATH=root))
    assert out.stdout.strip() == "['pdserve.disagg.connectors.base']"


@pytest.mark.parametrize("name", sorted(BUILT_IN))
@pytest.mark.parametrize("fault", kv_faults.FAULTS)
def test_a_plugin_wrapper_reports_its_transports_attributes(name, fault):
    path = kv_faults.faulty(name, fault)
    assert path.startswith("tests.kv_faults:")
    cls = get_connector_class(path)
    base = get_connector_class(name)
    assert cls is not base and issubclass(cls, base)
    assert (cls.name, cls.two_sided) == (base.name, base.two_sided)
    assert get_connector_class(name) is base        # the plugin did not take the name over
    assert path not in connector_names()


@pytest.mark.parametrize("bad,why", [("carrier-pigeon", "unknown kv_connector"),
                                     ("tests.kv_faults:Nope", "does not resolve"),
                                     ("no_such_module_x:Cls", "does not resolve"),
                                     ("os:getcwd", "not a KVConnector subclass")])
def test_bad_connector_names_are_clear_errors(bad, why):
    with pytest.raises(ValueError, match=why):
        get_connector_class(bad)


def test_load_tracker_lifecycle():
    t = LoadTracker()
    a = t.start(KVLoad("a", "p", [1, 2], [3, 4]))
    b = t.start(KVLoad("b", "p", [5], [6]))
    discard = t.start(KVLoad("x", "p", [7], []))     # a receive-and-discard: nobody's load
    assert set(t.loads) == {"a", "b"} and t.pending() == [a, b]
    assert t.report() == []
    time.sleep(0.01)
    assert t.complete(a) and not t.complete(a, "late")      # once; a later error is ignored
    assert t.complete(discard)
    assert t.complete(b, "boom")
    done = t.report()
    assert [(d.request_id, d.ok, d.error) for d in done] == [("a", True, None),
                                                             ("b", False, "boom")]
    assert done[0].seconds >= 0.01
    assert t.report() == []                                  # each reported once
    assert t.pending() == []
    assert t.verdict("a") is a and t.verdict("a") is None    # judged once
    expect_agreement(a, 1, "pull")
    with pytest.raises(RuntimeError, match="KV pull of b failed on rank 1 only: boom"):
        expect_agreement(t.verdict("b"), 1, "pull")
    assert t.loads == {}
