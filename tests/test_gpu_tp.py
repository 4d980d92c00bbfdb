"""Tensor parallelism on two GPUs (NCCL): an HF Qwen2 with random weights read per rank from
safetensors, 12 query / 2 KV heads, fp32, greedy 32 tokens identical to HF generate on a mixed
batch with chunked prefill — eagerly and with CUDA graphs that captured the all-reduces (the
one-shot P2P kernel for small sums, and NCCL only).
Run on the two-GPU device: `python -m pytest -m gpu tests/test_gpu_tp.py`."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
transformers = pytest.importorskip("transformers")

from pdserve import LLM, SamplingParams  # noqa: E402

from .test_gpu_model import _prompts, assert_greedy_matches_hf, hf_dir  # noqa: E402,F401


@pytest.mark.parametrize("eager, nccl_only", [(True, False), (False, False), (False, True)],
                         ids=["eager", "graphs", "graphs-nccl-only"])
def test_tp2_fp32_greedy_matches_hf(hf_dir, eager, nccl_only):  # noqa: F811
    d, hf = hf_dir
    prompts = _prompts(12, 5, 300, seed=2)
    with LLM(str(d), device="cuda", dtype="float32", skip_tokenizer_init=True,
             num_kv_blocks=1024, max_num_batched_tokens=96, enforce_eager=eager,
             tensor_parallel_size=2, disable_custom_all_reduce=nccl_only) as llm:
        sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        llm.llm_engine.check_integrity()
    # drained: both ranks released their graphs, left the process group and exited cleanly
    assert [p.exitcode for p in llm.llm_engine._procs] == [0, 0]
    assert_greedy_matches_hf(hf, prompts, outs, 32)
