import os

import torch

# Triton kernels run under Triton's interpreter where there is no GPU; it must be chosen before
# triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def small_server():
    """One `pdserve serve` (embedded SmolLM2, one worker, 16 sequences, max_model_len 256) shared
    by the request-schema and conformance tests (one start-up instead of two): its base URL.
    At the end it must still be healthy, stop cleanly and leave no worker process behind."""
    httpx = pytest.importorskip("httpx")
    from .test_server import _start, _stop, _stopped_cleanly
    from .utils import assert_processes_gone
    proc, base = _start(["--max-num-seqs", "16", "--max-model-len", "256"])
    pids = httpx.get(base + "/admin/check").json()["worker_pids"]
    yield base
    try:
        health = httpx.get(base + "/health", timeout=10)
        assert health.status_code == 200, f"the engine died during the tests: {health.text}"
    finally:
        assert _stopped_cleanly(_stop(proc))
        assert_processes_gone(pids)
