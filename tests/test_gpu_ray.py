"""The Ray backend on GPUs: Ray gives each rank one GPU, the rank sees its worker's GPUs on its
node (CUDA_VISIBLE_DEVICES) and takes its own by index (ray_launch.rank_sites); greedy fp32
tokens equal HF generate. One GPU: a TP=1 worker placed by Ray. Two GPUs: TP=2 (STRICT_PACK,
NCCL all-reduces) and 1P1D over the default connector under Ray (nccl).
Run on the device: `python -m pytest -m gpu tests/test_gpu_ray.py` (Ray is not on the GPU image:
its wheel must be carried)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")
ray = pytest.importorskip("ray")

from pdserve import LLM, SamplingParams  # noqa: E402

from .test_gpu_model import _prompts, assert_greedy_matches_hf, hf_dir  # noqa: E402,F401


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _run(d, **kw):
    prompts = _prompts(8, 5, 200, seed=3)
    with LLM(str(d), device="cuda", dtype="float32", skip_tokenizer_init=True,
             num_kv_blocks=512, max_num_batched_tokens=96, gpu_memory_utilization=0.3,
             distributed_executor_backend="ray", **kw) as llm:
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        engine = llm.llm_engine
    return prompts, outs, engine


def test_a_worker_placed_by_ray_on_a_gpu_matches_hf(hf_dir, local_ray):  # noqa: F811
    d, hf = hf_dir
    prompts, outs, client = _run(d)
    assert [p.exitcode for p in client._procs] == [0]
    assert_greedy_matches_hf(hf, prompts, outs, 24)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_and_1p1d_placed_by_ray_match_hf(hf_dir, local_ray):  # noqa: F811
    d, hf = hf_dir
    prompts, outs, client = _run(d, tensor_parallel_size=2)
    assert [p.exitcode for p in client._procs] == [0, 0]
    assert_greedy_matches_hf(hf, prompts, outs, 24)
    prompts, outs, router = _run(d, prefill=1, decode=1)
    assert router.route_stats.transfers == len(prompts)
    assert_greedy_matches_hf(hf, prompts, outs, 24)
