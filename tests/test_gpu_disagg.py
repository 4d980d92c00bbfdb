"""P/D disaggregation on two GPUs: an HF Qwen2 with random weights, fp32; prefill on GPU 0, the
KV pulled over CUDA IPC (peer memory, side streams) into GPU 1, decode there — greedy 32 tokens
identical to HF generate, in sync and async mode, with CUDA graphs on the decode side.
Run on the two-GPU device: `python -m pytest -m gpu tests/test_gpu_disagg.py`."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
transformers = pytest.importorskip("transformers")

from pdserve import LLM, SamplingParams  # noqa: E402

from .test_gpu_model import _prompts, assert_greedy_matches_hf, hf_dir  # noqa: E402,F401


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_1p1d_fp32_greedy_matches_hf(hf_dir, mode):  # noqa: F811
    d, hf = hf_dir
    prompts = _prompts(12, 5, 300, seed=3)
    with LLM(str(d), device="cuda", dtype="float32", skip_tokenizer_init=True,
             num_kv_blocks=1024, max_num_batched_tokens=96, prefill=1, decode=1,
             kv_transfer_mode=mode) as llm:
        sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        router = llm.llm_engine
        assert router.route_stats.transfers == len(prompts)
        assert router.route_stats.transfer_failures == 0
        for stats in router.check_workers().values():
            assert stats.num_kv_blocks_used == 0
        assert [w.client.config.device for w in router.workers.values()] == ["cuda:0", "cuda:1"]
    assert_greedy_matches_hf(hf, prompts, outs, 32)
