"""The import rule: the plain-Python cores (the engine core, the cross-boundary types, the
configuration) import without torch, zmq or the packages above them. Each check runs in a fresh
interpreter whose import system refuses the forbidden modules, so a stray import anywhere
below the listed modules fails here with the chain that reached it.

To hold another core to the rule, add its modules (or packages: every module under them is
imported) to PURE_CORES.
"""
import os
import subprocess
import sys
import textwrap

import pytest

# Forbidden for every pure core: the tensor library, the process transport, and the layers
# that may depend on them.
FORBIDDEN = ["torch", "triton", "zmq", "pdserve.worker", "pdserve.disagg", "pdserve.server",
             "pdserve.routing", "pdserve.entrypoints", "pdserve.kernels", "pdserve.layers",
             "pdserve.models", "pdserve.loader"]

PURE_CORES = {
    "engine": ["pdserve.engine", "pdserve.protocol", "pdserve.config", "pdserve.sampling_params",
               "pdserve.outputs", "pdserve.kv_layout"],
}

_PRELUDE = textwrap.dedent("""
    import importlib, pkgutil, sys
    sys.path.insert(0, {root!r})
    FORBIDDEN = {forbidden!r}

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN):
                raise ImportError(f"forbidden import: {{name}}")
            return None

    assert not any(m.split(".")[0] in ("torch", "zmq") for m in sys.modules)
    sys.meta_path.insert(0, Refuse())

    def import_all(name):
        mod = importlib.import_module(name)
        found = [name]
        if hasattr(mod, "__path__"):
            for info in pkgutil.walk_packages(mod.__path__, name + "."):
                importlib.import_module(info.name)
                found.append(info.name)
        return found
""")


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(body: str, forbidden=FORBIDDEN) -> subprocess.CompletedProcess:
    code = _PRELUDE.format(root=_ROOT, forbidden=forbidden) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("core", sorted(PURE_CORES))
def test_pure_core_imports_without_torch_zmq_or_upper_layers(core):
    r = _run(f"""
        names = []
        for n in {PURE_CORES[core]!r}:
            names += import_all(n)
        print(len(names))
    """)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[-1]) >= len(PURE_CORES[core])


def test_the_guard_catches_a_forbidden_import():
    """The finder really refuses: a module that needs torch fails to import under it."""
    r = _run("import_all('pdserve.worker.step_broadcast')")
    assert r.returncode != 0 and "forbidden import: pdserve.worker" in r.stderr
    r = _run("import_all('pdserve.kv_layout'); import_all('pdserve.devices')")
    assert r.returncode != 0 and "forbidden import: torch" in r.stderr


def test_engine_core_runs_without_torch():
    """Not only imports: the engine core serves a request end to end over a stand-in executor
    (a simulator's position), config validation included, with torch refused."""
    r = _run("""
        from pdserve.config import EngineConfig
        from pdserve.engine.core import EngineCore
        from pdserve.engine.executor import SampledToken
        from pdserve.sampling_params import SamplingParams

        class Echo:   # samples, for every sequence, its position (deterministic)
            def execute(self, sched):
                return {c.request_id: SampledToken(c.start_pos + len(c.token_ids), None, None)
                        for c in sched.chunks if c.sample}
            def take_prompt_logprobs(self): return {}
            def poll_loads(self): return []
            def take_gpu_times(self): return {}

        cfg = EngineConfig(block_size=4, max_num_batched_tokens=4)
        core = EngineCore(cfg, Echo(), num_kv_blocks=8, max_model_len=32, vocab_size=100,
                          eos_token_ids=(0,))
        core.add_request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
        done = []
        while core.has_unfinished_requests():
            done += [o for o in core.step() if o.finished]
            core.check_integrity()
        print(done[0].outputs[0].token_ids)
    """)
    assert r.returncode == 0, r.stderr
    # prompt of 6 in chunks of 4: the first token is sampled at position 6, then 7, 8
    assert r.stdout.split("\n")[-2] == "[6, 7, 8]"
