"""The KV cache's host tier (worker/kv_host_tier.py) against a torch reference: a dict of
per-block copies taken from the pool with plain indexing (kv_cache[:, :, b]), one block at a time.
Random pools and random moves with runs and gaps; a to_host then to_device round trip restores
the blocks exactly; in one step the save of a device block reads it before a load overwrites it.
The CUDA tests (marked gpu) check the same against the stream contract: a save of a block that a
forward queued just before writes sees the forward's values, and the next step's compute waits
for the loads."""
import random

import pytest
import torch

from pdserve.engine.kv_cache_manager import KVMoves
from pdserve.engine.block_pool import host_runs
from pdserve.worker.kv_host_tier import KVHostTier

SHAPE = dict(layers=3, block_size=4, heads=2, head_dim=5)


def _pool(num_blocks: int, device="cpu", dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = SHAPE
    # (+1: the scratch block the runner keeps at the end)
    t = torch.randn((s["layers"], 2, num_blocks + 1, s["block_size"], s["heads"], s["head_dim"]),
                    generator=g).to(dtype)
    return t.to(device)


def _random_moves(rng: random.Random, num_dev: int, num_host: int, n: int, runs: bool):
    """n distinct device blocks and n distinct host blocks paired; with runs, the host ids come
    in runs of consecutive ids with gaps between them."""
    dev = rng.sample(range(num_dev), n)
    if runs:
        host, h = [], rng.randrange(3)
        while len(host) < n:
            k = rng.randint(1, 5)
            host.extend(range(h, h + k))
            h += k + rng.randint(1, 3)
        host = host[:n]
        assert max(host) < num_host
        rng.shuffle(host)
    else:
        host = rng.sample(range(num_host), n)
    return list(zip(dev, host))


def test_host_runs_by_hand():
    assert host_runs([]) == []
    assert host_runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert host_runs([1, 3, 5]) == [(0, 1, 1), (1, 3, 1), (2, 5, 1)]


@pytest.mark.parametrize("runs", [True, False])
@pytest.mark.parametrize("chunk", [None, 3])   # 3: moves split over several staging chunks
def test_moves_match_a_per_block_reference(runs, chunk):
    rng = random.Random(1 if runs else 2)
    num_dev, num_host = 40, 64
    kv = _pool(num_dev)
    tier = KVHostTier(kv, num_host, measure=False)
    if chunk is not None:
        tier.chunk_blocks = chunk
    host_ref: dict[int, torch.Tensor] = {}
    for step in range(6):
        before = kv.clone()
        out = _random_moves(rng, num_dev, num_host, rng.randint(1, 12), runs)
        # loads: host blocks written before (the reference knows them), to device blocks not
        # saved this step (the scheduler's rule: a to_host source is not a to_device target)
        saved = {d for d, _ in out}
        known = [h for h in host_ref if h not in {h2 for _, h2 in out}]
        free_dev = [d for d in range(num_dev) if d not in saved]
        k = min(len(known), rng.randint(0, 8))
        back = list(zip(rng.sample(known, k), rng.sample(free_dev, k)))
        tier.apply(KVMoves(out, back))
        # the reference, one block at a time: saves read the pool as it was before the step
        for d, h in out:
            host_ref[h] = before[:, :, d].clone()
        expect = before.clone()
        for h, d in back:
            expect[:, :, d] = host_ref[h]
        assert torch.equal(kv, expect), f"step {step}"
        for h, t in host_ref.items():
            assert torch.equal(tier.host[h], t), f"step {step}, host block {h}"
    assert tier.blocks_to_host > 0 and tier.blocks_to_device > 0


def test_round_trip_restores_blocks_exactly():
    """Save every block, scribble over the pool, load them back (to other device blocks, in a
    permutation): each lands bit for bit, fp16 too; the scratch block is never touched."""
    for dtype in (torch.float32, torch.float16):
        kv = _pool(16, dtype=dtype, seed=3)
        orig = kv.clone()
        tier = KVHostTier(kv, 20, measure=False)
        host = list(range(2, 18))
        tier.apply(KVMoves(list(zip(range(16), host)), []))
        kv[:, :, :16].fill_(7)
        perm = random.Random(5).sample(range(16), 16)
        tier.apply(KVMoves([], [(host[i], perm[i]) for i in range(16)]))
        for i in range(16):
            assert torch.equal(kv[:, :, perm[i]], orig[:, :, i])
        assert torch.equal(kv[:, :, 16], orig[:, :, 16])


def test_a_save_reads_the_block_before_a_load_into_it_in_the_same_step():
    """The order rule: to_host before to_device. Block 3 is saved to host 0 while host 1 is
    loaded into block 3 in the same step: host 0 gets block 3's old KV, block 3 host 1's."""
    kv = _pool(8, seed=4)
    tier = KVHostTier(kv, 4, measure=False)
    tier.apply(KVMoves([(5, 1)], []))
    old3, old5 = kv[:, :, 3].clone(), kv[:, :, 5].clone()
    tier.apply(KVMoves([(3, 0)], [(1, 3)]))
    assert torch.equal(tier.host[0], old3)
    assert torch.equal(kv[:, :, 3], old5)


@pytest.mark.parametrize("moves,match", [
    (KVMoves([(8, 0)], []), "outside the device pool"),     # 8: the scratch block
    (KVMoves([(0, 4)], []), "outside"),
    (KVMoves([], [(-1, 0)]), "outside"),
    (KVMoves([(0, 1), (2, 1)], []), "named twice"),
    (KVMoves([], [(0, 2), (1, 2)]), "named twice")])
def test_bad_moves_are_a_value_error_and_copy_nothing(moves, match):
    kv = _pool(8, seed=6)
    before = kv.clone()
    tier = KVHostTier(kv, 4, measure=False)
    tier.host.fill_(1.5)       # (the pool starts uninitialised)
    host_before = tier.host.clone()
    with pytest.raises(ValueError, match=match):
        tier.apply(moves)
    assert torch.equal(kv, before) and torch.equal(tier.host, host_before)


def test_bandwidth_is_measured_at_start_up_quickly():
    import time
    kv = _pool(8)
    t0 = time.perf_counter()
    tier = KVHostTier(kv, 8)
    assert time.perf_counter() - t0 < 1.0
    assert tier.copy_gb_per_s > 0
    assert tier.block_bytes == 3 * 2 * 4 * 2 * 5 * 4
    assert tier.host.shape == (8, 3, 2, 4, 2, 5)


# ---- CUDA: the stream contract ------------------------------------------------------------


@pytest.mark.parametrize("runs", [True, False])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_moves_match_the_reference(runs):
    rng = random.Random(7)
    kv = _pool(200, "cuda", torch.bfloat16, seed=8)
    tier = KVHostTier(kv, 300, measure=False)
    assert tier.host.is_pinned()
    tier.chunk_blocks = 16
    before = kv.clone()
    out = _random_moves(rng, 200, 300, 100, runs)
    tier.apply(KVMoves(out, []))
    tier.synchronize()
    for d, h in out:
        assert torch.equal(tier.host[h], before[:, :, d].cpu())
    kv.zero_()
    torch.cuda.synchronize()
    dests = rng.sample(range(200), 100)
    with torch.cuda.stream(tier.stream):
        torch.cuda._sleep(200_000_000)   # the copy stream is late: the loads end well after
    tier.apply(KVMoves([], [(h, d) for (_, h), d in zip(out, dests)]))
    tier.begin_step()          # the next step's compute stream waits for the loads
    got = kv.clone()           # (queued on the compute stream: reads zeros without the wait)
    torch.cuda.synchronize()
    for (d0, _), d in zip(out, dests):
        assert torch.equal(got[:, :, d], before[:, :, d0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_save_sees_a_forward_queued_just_before():
    """A "forward" (a long spin on the compute stream, then a write into block 2) is queued
    and the save of block 2 right after, without a sync: the host copy holds what the forward
    wrote, not the block's old KV (the copy stream waited for the compute stream)."""
    kv = _pool(64, "cuda", torch.float32, seed=9)
    tier = KVHostTier(kv, 8, measure=False)
    # A first save allocates pinned memory for its ids (cudaHostAlloc waits for the device,
    # which would hide a missing stream wait); the engine's steps reuse the cached block.
    tier.apply(KVMoves([(1, 4)], []))
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)     # keep the compute stream busy for a while
    kv[:, :, 2].fill_(3.0)
    tier.apply(KVMoves([(2, 5)], []))
    tier.synchronize()
    assert torch.equal(tier.host[5], torch.full_like(tier.host[5], 3.0))


# ---- configuration, CLI, LLM keyword arguments ----------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(swap_space_gb=-1.0), "swap_space_gb"), (dict(swap_space_gb=float("nan")), "swap_space_gb"),
    (dict(swap_space_gb=float("inf")), "swap_space_gb"), (dict(swap_space_gb="4"), "swap_space_gb"),
    (dict(swap_space_gb=True), "swap_space_gb"),
    (dict(preemption_mode="evict"), "preemption_mode"),
    (dict(preemption_mode="swap"), "needs a host tier"),
    (dict(preemption_mode="swap", swap_space_gb=0.0), "needs a host tier")])
def test_bad_tier_config_is_a_value_error(kwargs, match):
    from pdserve.config import EngineConfig
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_tier_config_defaults_flags_and_llm_kwargs():
    import argparse

    from pdserve.args import add_engine_args, engine_config
    from pdserve.config import EngineConfig
    from pdserve.entrypoints.llm import split_engine_args
    assert (EngineConfig().swap_space_gb, EngineConfig().preemption_mode) == (0.0, None)
    EngineConfig(preemption_mode="recompute")            # recompute needs no host tier
    p = argparse.ArgumentParser()
    add_engine_args(p)
    c = engine_config(p.parse_args([]))
    assert (c.swap_space_gb, c.preemption_mode) == (0.0, None)
    c = engine_config(p.parse_args(["--swap-space", "2.5", "--preemption-mode", "swap"]))
    assert (c.swap_space_gb, c.preemption_mode) == (2.5, "swap")
    with pytest.raises(SystemExit):
        p.parse_args(["--preemption-mode", "evict"])
    with pytest.raises(ValueError, match="needs a host tier"):
        engine_config(p.parse_args(["--preemption-mode", "swap"]))
    c, _ = split_engine_args(None, {"swap_space_gb": 1, "preemption_mode": "recompute"})
    assert (c.swap_space_gb, c.preemption_mode) == (1, "recompute")
    assert EngineConfig().kv_offload_policy == "on-eviction"
    c = engine_config(p.parse_args(["--swap-space", "1", "--kv-offload-policy", "write-through"]))
    assert c.kv_offload_policy == "write-through"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-offload-policy", "later"])
    with pytest.raises(ValueError, match="kv_offload_policy must be one of"):
        EngineConfig(kv_offload_policy="later")


def test_host_blocks_from_swap_space_by_hand():
    from pdserve.config import EngineConfig
    from pdserve.worker.build import plan_host_tier
    # 0.001 GiB = 1073741 bytes (rounded down) over 2048-byte blocks: 524 blocks
    assert plan_host_tier(EngineConfig(swap_space_gb=0.001), 2048) == 524
    assert plan_host_tier(EngineConfig(), 2048) == 0
    with pytest.raises(ValueError, match="swap_space_gb=1000000.*machine's memory"):
        plan_host_tier(EngineConfig(swap_space_gb=1e6), 2048)


# ---- the model runner: kv_moves of a SchedulerOutput, every rank ----------------------------
CFG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
       "tie_word_embeddings": True, "eos_token_id": 0}


def _engine(tmp_path, **kw):
    import json

    from pdserve.config import EngineConfig
    from pdserve.worker.llm_engine import LLMEngine
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    return LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy",
                                  skip_tokenizer_init=True, num_kv_blocks=32, block_size=4,
                                  async_scheduling=False, enable_prefix_caching=False, **kw))


def test_engine_gets_the_host_tier_from_the_runner(tmp_path):
    # one block: 2 layers x K,V x 4 tokens x 2 heads x 16 dims x 4 bytes = 2048 bytes
    eng = _engine(tmp_path, swap_space_gb=0.001)
    assert eng.kv_block_bytes == 2048
    assert eng.num_host_blocks == 524 == eng.runner.host_tier.num_host_blocks
    assert eng.host_copy_gb_per_s > 0
    none = _engine(tmp_path)
    assert (none.num_host_blocks, none.host_copy_gb_per_s, none.kv_block_bytes) == (0, 0.0, 2048)
    assert none.runner.host_tier is None
    from pdserve.engine.scheduler import SchedulerOutput
    with pytest.raises(ValueError, match="host tier"):
        none.runner.execute(SchedulerOutput(kv_moves=KVMoves([(0, 0)], [])))


def test_a_sequence_saved_scribbled_over_and_loaded_back_generates_the_same(tmp_path):
    """A request's blocks go to the host through an empty step's kv_moves (as a swap-out),
    the device blocks are overwritten, and come back (to the same ids) through another: its
    greedy tokens equal an undisturbed run's."""
    from pdserve import SamplingParams
    from pdserve.engine.scheduler import SchedulerOutput
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(3, 21))}

    def run(disturb: bool):
        eng = _engine(tmp_path, swap_space_gb=0.001)
        eng.add_request("r", prompt, greedy)
        out, step = None, 0
        while eng.has_unfinished_requests():
            outs = eng.step()
            step += 1
            out = outs[-1] if outs else out
            if disturb and step == 4:
                table = list(eng.kv.block_tables["r#0"])
                host = list(range(100, 100 + len(table)))
                eng.runner.execute(SchedulerOutput(kv_moves=KVMoves(list(zip(table, host)), [])))
                eng.runner.kv_cache[:, :, table] = 0.0
                eng.runner.execute(SchedulerOutput(kv_moves=KVMoves([], list(zip(host, table)))))
        return out.outputs[0].token_ids

    assert run(True) == run(False)


def test_a_copy_on_write_reads_its_source_before_a_load_into_it(tmp_path):
    """The runner's order rule for copies: a step's copy-on-write copies run before its host
    tier moves. Block 5 is a copy's source and, given back by that copy, a load's destination
    in the same step: the copy's destination gets block 5's old KV, block 5 the host's."""
    from pdserve.engine.kv_cache_manager import BlockCopy
    from pdserve.engine.scheduler import SchedulerOutput
    eng = _engine(tmp_path, swap_space_gb=0.001)
    kv, host = eng.runner.kv_cache, eng.runner.host_tier.host
    g = torch.Generator().manual_seed(1)
    kv[:, :, 5] = torch.randn(kv[:, :, 5].shape, generator=g)
    host[2] = torch.randn(host[2].shape, generator=g)
    old5, h2 = kv[:, :, 5].clone(), host[2].clone()
    eng.runner.execute(SchedulerOutput(block_copies=[BlockCopy(5, 0)],
                                       kv_moves=KVMoves([], [(2, 5)])))
    assert torch.equal(kv[:, :, 0], old5)
    assert torch.equal(kv[:, :, 5], h2)


def test_kv_moves_reach_the_other_ranks():
    from pdserve.engine.scheduler import SchedulerOutput
    from pdserve.worker.step_broadcast import StepDecoder, StepEncoder
    moves = KVMoves([(3, 0), (4, 1)], [(7, 2)])
    got = StepDecoder().decode(StepEncoder().encode(SchedulerOutput(kv_moves=moves)))
    assert got.kv_moves == moves and isinstance(got.kv_moves, KVMoves)
    assert StepDecoder().decode(StepEncoder().encode(SchedulerOutput())).kv_moves is None


# ---- metrics and the start-up line ---------------------------------------------------------
def test_host_tier_metrics_are_exported():
    from pdserve.protocol import WorkerStats
    from pdserve.server.metrics import Metrics

    from .utils import metric_value
    m = Metrics("m")
    m.update_stats(WorkerStats(0, 0, 0, 10, 0, num_host_blocks=64, num_host_blocks_used=9,
                               blocks_swapped_out=5, blocks_swapped_in=2, blocks_offloaded=7,
                               blocks_loaded_back=3, prefix_host_hits=48))
    m.update_stats(WorkerStats(0, 0, 0, 10, 0, num_host_blocks=64, num_host_blocks_used=4,
                               blocks_swapped_out=6, blocks_swapped_in=6, blocks_offloaded=7,
                               blocks_loaded_back=4, prefix_host_hits=64))
    text = m.render().decode()
    assert metric_value(text, "pdserve:kv_host_blocks") == 64
    assert metric_value(text, "pdserve:kv_host_blocks_used") == 4
    assert metric_value(text, 'pdserve:kv_blocks_swapped_total{direction="out"}') == 6
    assert metric_value(text, 'pdserve:kv_blocks_swapped_total{direction="in"}') == 6
    assert metric_value(text, "pdserve:kv_blocks_offloaded_total") == 7
    assert metric_value(text, "pdserve:kv_blocks_loaded_back_total") == 4
    assert metric_value(text, "pdserve:prefix_cache_host_hits_total") == 64
    for name in ("kv_blocks_swapped_total", "kv_blocks_offloaded_total",
                 "kv_blocks_loaded_back_total", "prefix_cache_host_hits_total"):
        assert f"# TYPE pdserve:{name} counter" in text
    assert "# TYPE pdserve:kv_host_blocks gauge" in text


def test_startup_summary_names_the_host_tier():
    from types import SimpleNamespace

    from pdserve.config import EngineConfig
    from pdserve.server.console import startup_summary
    info = SimpleNamespace(num_kv_blocks=1024, block_size=16, tensor_parallel_size=1,
                           kv_bytes_per_token_per_rank=28672, num_host_blocks=4096)
    worker = SimpleNamespace(spec=SimpleNamespace(name="c0", role="collocated",
                                                  config=EngineConfig(swap_space_gb=2.0)),
                             client=SimpleNamespace(info=info))
    line = startup_summary(SimpleNamespace(workers={"c": worker}, max_model_len=8192), "m")[2]
    # 4096 blocks x 16 tokens x 28672 B = 1.75 GiB
    assert "(0.44 GiB per rank), host tier 4096 blocks (1.75 GiB per rank), prefix" in line


def test_tp_ranks_each_build_their_host_tier(tmp_path):
    """TP 2 in worker processes (gloo): every rank builds its own host tier over its own heads,
    and the worker reports the per-rank count: LLAMA_8Q_2KV holds 1 KV head per rank, so one
    block is 4 tokens x 2 (K, V) x 3 layers x 1 head x 16 dims x 4 bytes = 1536 bytes, and
    0.001 GiB (1073741 bytes) holds 699 of them (TP 1, both heads: 3072 bytes, 349)."""
    from pdserve import LLM, SamplingParams

    from .test_tp import LLAMA_8Q_2KV, _folder
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    engine = dict(skip_tokenizer_init=True, num_kv_blocks=32, block_size=4,
                  load_format="dummy", swap_space_gb=0.001)
    assert LLM(path, **engine).llm_engine.num_host_blocks == 349
    with LLM(path, tensor_parallel_size=2, **engine) as llm:
        assert llm.llm_engine.info.num_host_blocks == 699
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
