"""P/D disaggregation on two GPUs: an HF Qwen2 with random weights, fp32; prefill on GPU 0, the
KV moved into GPU 1 by each GPU connector ("shared": CUDA IPC + peer reads; "relay": through
pinned host memory; "nccl": NCCL send/receive), decode there with CUDA graphs — greedy 32 tokens
identical to HF generate, in sync and async mode; transfers that fail fall back to recompute.
In one process, the shared connector picks the peer path or, without peer access, the relay.
Run on the two-GPU device: `python -m pytest -m gpu tests/test_gpu_disagg.py`."""
import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
transformers = pytest.importorskip("transformers")

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.config import EngineConfig  # noqa: E402
from pdserve.disagg.connectors import shared_pull  # noqa: E402
from pdserve.worker.llm_engine import LLMEngine  # noqa: E402

from .kv_faults import faulty  # noqa: E402
from .test_disagg import GREEDY, PROMPTS, _handoff, _run  # noqa: E402
from .test_gpu_model import _prompts, hf_dir  # noqa: E402,F401
from .test_tp import LLAMA_8Q_2KV, _folder  # noqa: E402
from pdserve.protocol import AddRequest  # noqa: E402

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def hf_reference(hf_dir):  # noqa: F811
    """Prompts and HF fp32 greedy continuations (computed once for every variant)."""
    d, hf = hf_dir
    prompts = _prompts(12, 5, 300, seed=3)
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = hf.float().generate(torch.tensor([p], device="cuda"), max_new_tokens=MAX_TOKENS,
                                      do_sample=False, eos_token_id=-1, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return d, prompts, refs


@pytest.mark.parametrize("connector,mode,fault", [
    ("shared", "sync", None), ("shared", "async", None), ("relay", "sync", None),
    ("relay", "async", None), ("nccl", "sync", None), ("nccl", "async", None),
    ("shared", "async", "fail"), ("relay", "async", "fail"), ("nccl", "async", "fail")])
def test_1p1d_fp32_greedy_matches_hf(hf_reference, connector, mode, fault):
    d, prompts, refs = hf_reference
    with LLM(str(d), device="cuda", dtype="float32", skip_tokenizer_init=True,
             num_kv_blocks=1024, max_num_batched_tokens=96, prefill=1, decode=1,
             kv_transfer_mode=mode,
             kv_connector=faulty(connector, fault) if fault else connector) as llm:
        sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        router = llm.llm_engine
        stats = router.route_stats
        if fault:   # every pull failed: the decode worker recomputed the prompts
            assert (stats.transfers, stats.transfer_failures) == (0, len(prompts))
        else:
            assert (stats.transfers, stats.transfer_failures) == (len(prompts), 0)
            assert stats.transfer_bytes > 0 and stats.transfer_seconds > 0
        for s in router.check_workers().values():
            assert s.num_kv_blocks_used == 0
        assert [w.client.config.device for w in router.workers.values()] == ["cuda:0", "cuda:1"]
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_1p1d_seeded_sampling_matches_one_engine(hf_reference):
    """Seeded random sampling through P -> D gives one engine's tokens on the GPU too: the
    decode worker's CUDA generator is advanced past the producer's draws (Philox offsets)."""
    d, prompts, _ = hf_reference
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)
    args = dict(device="cuda", dtype="float32", skip_tokenizer_init=True, num_kv_blocks=1024)
    batch = [{"prompt_token_ids": p} for p in prompts[:4]]
    with LLM(str(d), **args) as one:
        ref = [o.outputs[0].token_ids for o in one.generate(batch, sp, use_tqdm=False)]
        other = one.generate(batch[:1], dataclasses.replace(sp, seed=12),
                             use_tqdm=False)[0].outputs[0].token_ids
    assert other != ref[0]  # the seed matters (the test can fail)
    with LLM(str(d), prefill=1, decode=1, **args) as pd:
        got = [o.outputs[0].token_ids for o in pd.generate(batch, sp, use_tqdm=False)]
        assert pd.llm_engine.route_stats.transfers == len(batch)
    assert got == ref


@pytest.mark.parametrize("access", ["peer", "relay"])
def test_shared_connector_detects_peer_access(tmp_path, monkeypatch, access):
    """Engines on cuda:0 (producer) and cuda:1 (consumer) in one process: with peer access the
    pull reads GPU 0 directly; where the GPUs report none, the relay is chosen and the KV still
    arrives exactly."""
    if access == "relay":
        monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    elif not torch.cuda.can_device_access_peer(1, 0):
        pytest.skip("these GPUs have no peer access")
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    base = dict(model=path, kv_connector="shared", skip_tokenizer_init=True, num_kv_blocks=64,
                block_size=16, load_format="dummy", dtype="float32", enforce_eager=True)
    P = LLMEngine(EngineConfig(device="cuda:0", **base))
    D = LLMEngine(EngineConfig(device="cuda:1", **base))
    # CUDA IPC cannot open a handle in the process that exported it: hand over the pool itself
    # (on GPU 0; the worker-process tests above cover the IPC mapping)
    monkeypatch.setattr(shared_pull, "open_ipc_here", lambda *a: P.runner.kv_cache)
    D.connect_kv([P.kv_export("p")])
    D.step()  # the peer is added on the next step
    assert D.runner.connector.paths == {"p": access}
    for i, prompt in enumerate(PROMPTS):
        ref = _run(P, [AddRequest(f"ref{i}", {"prompt_token_ids": prompt}, GREEDY)])[f"ref{i}"]
        _, out, computed = _handoff(P, D, prompt, GREEDY, f"r{i}")
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert computed == len(ref.outputs[0].token_ids) - 1  # the KV came over
    assert all(e.ok and e.nbytes > 0 for e in D.take_kv_events())
    for e in (P, D):
        e.check_integrity()
        assert e.kv.num_free_blocks() == e.kv.pool.num_blocks
