"""The TP step channel (worker/step_broadcast.py): a follower rebuilds exactly the SchedulerOutput
the driver ran — every chunk's block table equal to the live one — through a workload with
chunked prefill, preemption (a small pool), n > 1 forks with copy-on-write, aborts and request-id
reuse, while decode steps send only table deltas."""
import json
import pickle
import time

import pytest
import torch

from pdserve import SamplingParams
from pdserve.config import EngineConfig
from pdserve.worker.llm_engine import LLMEngine
from pdserve.worker.step_broadcast import StepDecoder, StepEncoder

CFG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
       "tie_word_embeddings": True, "eos_token_id": 0}


def test_follower_rebuilds_every_step(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    enc, dec = StepEncoder(), StepDecoder()
    sizes, steps = [], []

    def check(sched):
        payload = enc.encode(sched)
        got = dec.decode(payload)
        assert [(c.request_id, c.token_ids, c.start_pos, c.sample, c.last_pending,
                 list(c.block_table)) for c in got.chunks] == \
               [(c.request_id, c.token_ids, c.start_pos, c.sample, c.last_pending,
                 list(c.block_table)) for c in sched.chunks]
        assert (got.forks, got.block_copies, got.finished_ids) == \
               (sched.forks, sched.block_copies, sched.finished_ids)
        assert [n.request_id for n in got.new_requests] == [n.request_id for n in sched.new_requests]
        sizes.append((len(payload), len(sched.chunks),
                      sum(len(c.block_table) for c in sched.chunks)))
        steps.append(sched)

    eng = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True,
                                 num_kv_blocks=24, block_size=4, max_num_batched_tokens=16),
                    on_schedule=check)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(6):
        eng.add_request(f"r{i}", list(range(1 + i, 12 + 3 * i)), greedy)
    eng.add_request("fork", [5, 6, 7, 8, 9], SamplingParams(n=3, temperature=1.0, seed=1,
                                                            max_tokens=10, ignore_eos=True))
    for step in range(400):
        if step == 5:
            eng.abort_request("r1")
        if step == 12:
            eng.add_request("r1", [9, 9, 9, 9, 9], greedy)  # the aborted id, reused
        if not eng.has_unfinished_requests():
            break
        eng.step()
        eng.check_integrity()
    assert not eng.has_unfinished_requests()
    assert eng.scheduler.num_preemptions > 0  # the pool is small on purpose
    assert any(c.last_pending for s in steps for c in s.chunks)  # (async scheduling)
    assert any(s.block_copies for s in steps) or any(s.forks for s in steps)
    check(eng.scheduler.schedule())  # finished ids travel with the next step (here an empty one)
    assert not enc.mirror and not dec.tables  # finished requests leave no copies behind
    # decode steps send deltas: far fewer bytes than the whole tables would take
    whole = max(len(pickle.dumps([list(c.block_table) for c in s.chunks])) for s in steps)
    decode_sizes = [n for n, chunks, blocks in sizes if chunks and blocks > 4 * chunks]
    assert decode_sizes and min(decode_sizes) < whole


def test_slow_step_log_names_new_kernel_variants(monkeypatch, capsys):
    """PDSERVE_LOG_SLOW_STEP_MS: a step over the limit is reported with the Triton kernels
    that compiled a new variant during it; faster steps and unset env say nothing."""
    from pdserve.worker import worker

    class FakeKernel:   # a JITFunction's per-device caches: (kernel_cache, ...)
        def __init__(self):
            self.fn = lambda: None
            self.fn.__name__ = "_fake_kernel"
            self.device_caches = {0: ({}, None)}

    k = FakeKernel()
    monkeypatch.setattr(worker, "_triton_kernels", lambda: [k])
    monkeypatch.delenv("PDSERVE_LOG_SLOW_STEP_MS", raising=False)
    off = worker._SlowSteps("w0")
    off.start()
    off.end(1, 0)
    monkeypatch.setenv("PDSERVE_LOG_SLOW_STEP_MS", "20")
    log = worker._SlowSteps("w0")
    log.start()
    log.end(3, 0)                                   # fast: nothing
    log.start()
    k.device_caches[0][0]["new-key"] = object()     # a compile during the step
    time.sleep(0.03)
    log.end(5, 2)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "step 2 took" in err[0] and "running 5, waiting 2" in err[0]
    assert "{'_fake_kernel': 1}" in err[0]
    monkeypatch.undo()
    names = {k.fn.__name__ for k in worker._triton_kernels()}
    assert {"_pull_kv_kernel", "_rms_norm_kernel", "_paged_attn_stage1"} <= names


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_warm_up_touches_only_the_scratch_block(tmp_path, backend):
    """ModelRunner.warm_up (run at start-up on GPUs: compiles the attention variants) runs a
    short and a long-context mixed batch that read and write the scratch block only: every
    pool block is as it was, and the engine then serves normally (here on CPU, the Triton
    backend under the interpreter). A 144-token step budget keeps the warm-up's wider chunk
    (the default attention tiles' stand-in) at 143 tokens: the interpreter is slow."""
    (tmp_path / "config.json").write_text(json.dumps(dict(CFG, max_position_embeddings=600)))
    engine = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy",
                                    skip_tokenizer_init=True, num_kv_blocks=64, block_size=16,
                                    max_num_batched_tokens=144, attention_backend=backend))
    runner = engine.runner
    engine.add_request("a", {"prompt_token_ids": list(range(3, 40))},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()                                  # some live KV in the pool
    kv = runner.kv_cache
    before = kv.clone()
    runner.warm_up(600)
    pool = slice(0, runner.scratch_block)
    assert torch.equal(kv[:, :, pool], before[:, :, pool])
    assert not torch.equal(kv[:, :, runner.scratch_block], before[:, :, runner.scratch_block])
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
