"""The shared pull's CUDA paths on one GPU: the peer kernel and the host relay (forced with
"relay"), with and without injected faults. Two engines in one process on cuda:0; CUDA IPC cannot
open a handle in the process that exported it, so the producer's pool is handed over directly
(test_gpu_disagg.py covers the IPC mapping between processes on two GPUs). Greedy outputs equal
the producer's own; a failed or hung pull is recomputed; no block is left behind.
Run on the device: `python -m pytest -m gpu tests/test_gpu_connectors.py`."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

from pdserve.config import EngineConfig  # noqa: E402
from pdserve.disagg.connectors import shared_pull  # noqa: E402
from pdserve.worker.llm_engine import LLMEngine  # noqa: E402
from pdserve.protocol import AddRequest  # noqa: E402

from .kv_faults import faulty  # noqa: E402
from .test_disagg import GREEDY, PROMPTS, _handoff, _run  # noqa: E402
from .test_tp import LLAMA_8Q_2KV, _folder  # noqa: E402


@pytest.mark.parametrize("connector,fault,mode", [
    ("shared", None, "async"), ("shared", None, "sync"), ("relay", None, "async"),
    ("relay", None, "sync"), ("shared", "fail", "async"), ("relay", "fail", "sync"),
    ("shared", "hang", "async"), ("relay", "hang", "async")])
def test_shared_pull_paths_on_one_gpu(tmp_path, monkeypatch, connector, fault, mode):
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    base = dict(model=path, skip_tokenizer_init=True, num_kv_blocks=64, block_size=16,
                load_format="dummy", dtype="float32", enforce_eager=True, device="cuda:0",
                kv_transfer_mode=mode, kv_transfer_timeout_s=1.0)
    P = LLMEngine(EngineConfig(kv_connector=connector, **base))
    D = LLMEngine(EngineConfig(kv_connector=faulty(connector, fault) if fault else connector,
                               **base))
    monkeypatch.setattr(shared_pull, "open_ipc_here", lambda *a: P.runner.kv_cache)
    D.connect_kv([P.kv_export("p")])
    D.step()
    assert D.runner.connector.paths == {"p": "relay" if connector == "relay" else "peer"}
    for i, prompt in enumerate(PROMPTS):
        ref = _run(P, [AddRequest(f"ref{i}", {"prompt_token_ids": prompt}, GREEDY)])[f"ref{i}"]
        _, out, computed = _handoff(P, D, prompt, GREEDY, f"r{i}")
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        n = len(ref.outputs[0].token_ids) - 1
        assert computed == (n + len(prompt) if fault else n)
    evs = D.take_kv_events()
    assert len(evs) == len(PROMPTS)
    if fault:
        assert all(not e.ok and ("injected" in e.error or "timed out" in e.error) for e in evs)
    else:
        assert all(e.ok and e.nbytes > 0 and e.seconds > 0 for e in evs), evs
    for e in (P, D):
        e.check_integrity()
        assert e.kv.num_free_blocks() == e.kv.pool.num_blocks
    D.runner.release()
    torch.cuda.synchronize()
