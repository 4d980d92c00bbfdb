"""GPU correctness of the whole fast path (Triton kernels, CUDA graphs) against HF transformers
Qwen2ForCausalLM with the same random weights: bf16 logits within 2e-2 relative error of the fp32
reference; fp32 greedy 32 tokens identical, with CUDA graphs on and off, for a mixed batch with
chunked prefill (graphed as mixed steps). Run on the device: `python -m pytest -m gpu tests/test_gpu_model.py`."""
import pytest
import torch

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

from pdserve import LLM, SamplingParams  # noqa: E402

from .utils import paged_logits  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=4096, hidden_size=1536, intermediate_size=4096, num_hidden_layers=4,
        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, eos_token_id=0)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    d = tmp_path_factory.mktemp("qwen2gpu")
    model.save_pretrained(d)
    return d, model.eval().cuda()


def _prompts(n, lo, hi, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(1, 4096, (k,), generator=g).tolist() for k in lens]


def assert_greedy_matches_hf(hf, prompts, outs, max_tokens: int) -> None:
    """Each output's tokens (a RequestOutput's first completion, or a list of token ids) equal
    HF fp32 greedy generate on the same prompt."""
    hf32 = hf.float()
    for p, o in zip(prompts, outs):
        ids = o if isinstance(o, list) else o.outputs[0].token_ids
        with torch.no_grad():
            ref = hf32.generate(torch.tensor([p], device="cuda"), max_new_tokens=max_tokens,
                                do_sample=False, eos_token_id=-1, pad_token_id=0)
        assert ids == ref[0, len(p):].tolist()


@pytest.mark.parametrize("eager", [True, False])
def test_bf16_logits_close_to_fp32_reference(hf_dir, eager):
    d, hf = hf_dir
    llm = LLM(str(d), device="cuda", dtype="bfloat16", skip_tokenizer_init=True,
              num_kv_blocks=512, enforce_eager=eager)
    for ids in _prompts(3, 100, 700):
        with torch.no_grad():
            ref = hf(torch.tensor([ids], device="cuda")).logits[0].double()
        for chunk in (None, 128):
            ours = paged_logits(llm.llm_engine, ids, chunk).double()
            err = ((ours - ref).norm() / ref.norm()).item()
            assert err <= 2e-2, (len(ids), chunk, err)


@pytest.mark.parametrize("backend, eager", [("triton", True), ("triton", False), ("torch", True)])
def test_fp32_greedy_matches_hf_mixed_batch(hf_dir, backend, eager):
    d, hf = hf_dir
    prompts = _prompts(12, 5, 300, seed=1)
    # small token budget: long prompts are chunked while earlier ones decode in the same forward
    llm = LLM(str(d), device="cuda", dtype="float32", skip_tokenizer_init=True, num_kv_blocks=1024,
              max_num_batched_tokens=96, enforce_eager=eager, attention_backend=backend)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    graphs = llm.llm_engine.runner.graphs
    assert (graphs is not None) == (not eager and backend == "triton")
    families = []
    if graphs is not None:   # which graph each step replayed
        replay = graphs.replay
        graphs.replay = lambda plan, n: (families.append(plan.key[0]), replay(plan, n))[1]
        assert graphs.mixed_sizes == [16, 32, 48, 64, 96] and graphs.memory_bytes > 0
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert_greedy_matches_hf(hf, prompts, outs, 32)
    if graphs is not None:   # chunked prefill + decodes ran as mixed graphs, then decode graphs
        assert families.count("mixed") >= 10 and families.count("decode") >= 10, families
    llm.llm_engine.check_integrity()


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_no_kernel_compiles_after_start_up(tmp_path, enforce_eager):
    """The start-up warm-up (ModelRunner.warm_up) and graph capture compile every Triton variant
    a serving mix selects: short and long prompts, chunked prefill over long contexts, decode
    batches eager and graphed, mixed steps — none compiles another (each costs ~1 s of stall).
    Eager (no graphs captured), the warm-up alone covers them."""
    from pdserve.config import EngineConfig
    from pdserve.worker.llm_engine import LLMEngine
    from pdserve.worker.worker import _triton_kernels, kernel_variants

    from .test_tp import LLAMA_8Q_2KV, _folder
    cfg = dict(LLAMA_8Q_2KV, max_position_embeddings=4096)
    engine = LLMEngine(EngineConfig(model=_folder(tmp_path, cfg), load_format="dummy",
                                    device="cuda", dtype="bfloat16", skip_tokenizer_init=True,
                                    num_kv_blocks=2048, max_num_batched_tokens=512,
                                    cuda_graph_max_batch=16, enforce_eager=enforce_eager))
    kernels = _triton_kernels()
    before = kernel_variants(kernels)
    assert before["_paged_attn_stage1"] >= 4   # decode and prefill launch, split and not
    g = torch.Generator().manual_seed(0)
    lens = [3, 17, 100, 511, 1500, 3000, 40, 2, 700, 2500, 9, 64, 33, 1024, 5, 2047]
    for i, n in enumerate(lens):
        prompt = torch.randint(2, 500, (n,), generator=g).tolist()
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=8 + 40 * (i % 3),
                                          ignore_eos=True))
        engine.step()   # arrivals spread over steps: mixed prefill + decode batches
    while engine.has_unfinished_requests():
        engine.step()
    # prefix-cache hits that end inside a block: each copies that block on write (kv_pull)
    shared = torch.randint(2, 500, (1001,), generator=g).tolist()
    for i in range(5):
        engine.add_request(f"p{i}", {"prompt_token_ids": shared + [3 + i] * (1 + 7 * i)},
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    assert kernel_variants(kernels) == before


def test_capture_survives_an_unreachable_engine(tmp_path, monkeypatch):
    """An engine dropped in a reference cycle holds CUDA graphs until the garbage collector
    runs; a collection during the next engine's capture destroys them mid-capture, which CUDA
    forbids (the capture fails: seen once in the GPU suite). Here the first engine is still
    alive when the second one's capture begins (automatic collections are held off until
    then), and a collection is forced inside every captured forward: the second engine still
    starts and generates, and the first one's graphs are gone."""
    import gc
    import weakref

    from pdserve.config import EngineConfig
    from pdserve.models.llama import LlamaForCausalLM
    from pdserve.worker.cuda_graph import CUDAGraphRunner
    from pdserve.worker.llm_engine import LLMEngine

    from .test_tp import LLAMA_8Q_2KV, _folder
    cfg = EngineConfig(model=_folder(tmp_path, LLAMA_8Q_2KV), load_format="dummy",
                       device="cuda", skip_tokenizer_init=True, num_kv_blocks=256)
    first = LLMEngine(cfg)
    assert first.runner.graphs is not None and first.runner.graphs.graphs
    old_graphs = weakref.ref(first.runner.graphs)
    first.cycle = first            # unreachable only through the collector
    del first
    forward, capture = LlamaForCausalLM.forward, CUDAGraphRunner.capture
    collections, alive_at_capture = [], []

    def collecting(self, *args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            collections.append(gc.collect())
        return forward(self, *args, **kwargs)

    def watched_capture(self):
        alive_at_capture.append(old_graphs() is not None)
        return capture(self)
    monkeypatch.setattr(LlamaForCausalLM, "forward", collecting)
    monkeypatch.setattr(CUDAGraphRunner, "capture", watched_capture)
    was_enabled = gc.isenabled()
    gc.disable()                   # (the first engine must live until the capture begins)
    try:
        engine = LLMEngine(cfg)
    finally:
        if was_enabled:
            gc.enable()
    monkeypatch.setattr(LlamaForCausalLM, "forward", forward)
    assert alive_at_capture == [True] and collections and old_graphs() is None
    engine.add_request("r", {"prompt_token_ids": list(range(2, 40))},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_records_carry_forward_gpu_times(tmp_path, async_scheduling):
    """Every forward yields a StepRecord whose device time (CUDA events around the forward) is
    measured and fits inside the step's wall time (schedule to tokens applied: the tokens'
    device-to-host copy follows the forward on the stream), with async scheduling or without."""
    from pdserve.config import EngineConfig
    from pdserve.worker.llm_engine import LLMEngine

    from .test_tp import LLAMA_8Q_2KV, _folder
    engine = LLMEngine(EngineConfig(model=_folder(tmp_path, LLAMA_8Q_2KV), load_format="dummy",
                                    device="cuda", skip_tokenizer_init=True, num_kv_blocks=256,
                                    async_scheduling=async_scheduling))
    runner = engine.runner
    forwards = []
    start = runner.execute_async
    runner.execute_async = lambda s: (forwards.append(s.step_id) if s.chunks else None, start(s))[1]
    for i, n in enumerate([5, 300, 40]):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(2, 2 + n))},
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    records = engine.take_step_records()
    assert len(records) == len(forwards) > 0
    assert sum(r.num_prefill_tokens for r in records) == 345
    for r in records:
        assert r.gpu_ms is not None and 0 < r.gpu_ms <= r.wall_ms + 0.05, r


def test_prefix_hits_copy_on_write_greedy_matches_hf(hf_dir):
    """Prompts that share a 101-token prefix, which ends inside a block: each hit shares that
    block and copies it on write (ModelRunner._copy_blocks: one launch of the pull kernel over
    every layer) before writing its own tokens there. fp32 greedy still equals HF's."""
    d, hf = hf_dir
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(1, 4096, (101,), generator=g).tolist()
    prompts = [shared + torch.randint(1, 4096, (k,), generator=g).tolist() for k in (7, 30, 64, 3)]
    llm = LLM(str(d), device="cuda", dtype="float32", skip_tokenizer_init=True, num_kv_blocks=1024)
    runner = llm.llm_engine.runner
    assert runner._copier is not None
    copies, copy = [], runner._copy_blocks
    runner._copy_blocks = lambda pairs: (copies.append(list(pairs)), copy(pairs))[1]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], sp, use_tqdm=False)
    assert [o.num_cached_tokens for o in rest] == [101] * 3
    assert sum(len(c) for c in copies) == 3, copies      # one shared partial block each
    assert_greedy_matches_hf(hf, prompts, first + rest, 16)
    llm.llm_engine.check_integrity()

