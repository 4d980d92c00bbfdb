"""Worker processes and tensor parallelism on CPU (gloo, 2 ranks).

TP=2 must be the same model as TP=1: greedy tokens identical and the top logprobs (log-softmax of
the logits) within fp32 tolerance, on dummy weights drawn unsharded (config.json-only folders) and
on safetensors read per rank. A killed rank makes the client fail fast; drain and shutdown leave
no process behind.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq

from pdserve import LLM, SamplingParams
from pdserve.protocol import AddRequest
from pdserve.worker.client import EngineClient, EngineDeadError
from pdserve.config import EngineConfig

from .utils import assert_processes_gone

LLAMA_8Q_2KV = {  # KV heads split over ranks; odd vocab (the last vocab shard is padded)
    "architectures": ["LlamaForCausalLM"], "vocab_size": 501, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "eos_token_id": 0, "bos_token_id": 1}
QWEN2_1KV = {  # QKV bias, one KV head: replicated on both ranks (tp > num_kv_heads)
    "architectures": ["Qwen2ForCausalLM"], "vocab_size": 400, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 1, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "rope_theta": 1e6, "tie_word_embeddings": False, "eos_token_id": 0, "bos_token_id": 1}
QWEN3_BIAS = {  # q/k norms (replicated), head_dim 32 != 64 / 4, q/k/v and o_proj biases
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 400, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "attention_bias": True,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "tie_word_embeddings": True, "eos_token_id": 0, "bos_token_id": 1}

PROMPTS = [[5, 17, 99, 3], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [42] * 9,
           list(range(30, 70))]
ENGINE = dict(skip_tokenizer_init=True, num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=16)  # chunked prefill too


def _folder(tmp_path, cfg) -> str:
    d = tmp_path / cfg["architectures"][0]
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _generate(llm):
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5,
                        prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    for o, p in zip(outs, PROMPTS):  # prompt logprobs: computed on rank 0, gathered from all
        assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] is None
        o.outputs[0].logprobs.extend(o.prompt_logprobs[1:])  # compared like the others
    return [o.outputs[0] for o in outs]


def _assert_same_model(ref, got):
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids
        for lr, lg in zip(r.logprobs, g.logprobs):
            assert lr.keys() == lg.keys()
            for tid in lr:
                assert abs(lr[tid].logprob - lg[tid].logprob) < 1e-4, (tid, lr[tid], lg[tid])


@pytest.mark.parametrize("cfg", [LLAMA_8Q_2KV, QWEN2_1KV, QWEN3_BIAS],
                         ids=["llama-8q2kv", "qwen2-1kv", "qwen3-bias"])
def test_tp2_equals_tp1_dummy(tmp_path, cfg):
    path = _folder(tmp_path, cfg)
    ref = _generate(LLM(path, load_format="dummy", **ENGINE))
    with LLM(path, load_format="dummy", tensor_parallel_size=2, **ENGINE) as llm:
        assert llm.llm_engine.info.tensor_parallel_size == 2
        got = _generate(llm)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.num_free_blocks() == 64
        pids = llm.llm_engine.pids
    _assert_same_model(ref, got)
    assert_processes_gone(pids)


def test_tp2_equals_tp1_safetensors(tmp_path):
    pytest.importorskip("transformers")
    from .utils import save_tiny_hf_model
    save_tiny_hf_model(tmp_path / "m", "qwen2")  # 8 query / 2 KV heads, QKV bias, untied
    ref = _generate(LLM(str(tmp_path / "m"), **ENGINE))
    with LLM(str(tmp_path / "m"), tensor_parallel_size=2, **ENGINE) as llm:
        got = _generate(llm)
    _assert_same_model(ref, got)


def test_heads_not_divisible_is_a_clear_error(tmp_path):
    cfg = dict(LLAMA_8Q_2KV, num_attention_heads=9, num_key_value_heads=3, head_dim=16)
    with pytest.raises(ValueError, match="9 attention heads do not split"):
        LLM(_folder(tmp_path, cfg), load_format="dummy", tensor_parallel_size=2, **ENGINE)
    with pytest.raises(ValueError, match="worker processes"):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend="uni")


@pytest.mark.parametrize("victim", [0, 1], ids=["rank0", "rank1"])
def test_killed_rank_fails_fast(tmp_path, victim):
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    client = EngineClient(EngineConfig(model=path, load_format="dummy", tensor_parallel_size=2,
                                       **dict(ENGINE, num_kv_blocks=512)))
    sp = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
    errors = client.add_requests([AddRequest(f"r{i}", {"prompt_token_ids": p}, sp)
                                  for i, p in enumerate(PROMPTS)])
    assert errors == [None] * len(PROMPTS)
    while not client.step():  # generating
        pass
    os.kill(client.pids[victim], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match=f"rank {victim} .* exited with code -9"):
        while True:
            client.step()
    assert time.monotonic() - t0 < 5.0
    assert not client.has_unfinished_requests()
    with pytest.raises(EngineDeadError):  # and it stays dead, clearly
        client.add_requests([AddRequest("late", [1, 2, 3], sp)])
    assert_processes_gone(client.pids)


def test_abort_frees_blocks_on_the_worker(tmp_path):
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    with EngineClient(EngineConfig(model=path, load_format="dummy", tensor_parallel_size=2,
                                   **ENGINE)) as client:
        sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        client.add_requests([AddRequest("a", [1, 2, 3, 4, 5], sp), AddRequest("b", [7, 8, 9], sp)])
        while not client.step():
            pass
        assert client.num_free_blocks() < 64
        client.abort_request("a")
        out = client.step()
        assert all(o.request_id == "b" for o in out)  # nothing more from the aborted one
        client.abort_request("b")
        assert not client.has_unfinished_requests()
        client.check_integrity()
        assert client.num_free_blocks() == 64


def test_workers_exit_when_their_client_is_killed(tmp_path):
    path = _folder(tmp_path, QWEN2_1KV)
    script = (
        "import sys, time\n"
        "from pdserve.config import EngineConfig\n"
        "from pdserve.worker.client import EngineClient\n"
        f"c = EngineClient(EngineConfig(model={path!r}, load_format='dummy', "
        "tensor_parallel_size=2, skip_tokenizer_init=True, num_kv_blocks=16))\n"
        "print(c._tmp, *c.pids, flush=True)\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        workdir, *pids = proc.stdout.readline().split()
        pids = [int(p) for p in pids]
        assert len(pids) == 2 and os.path.isdir(workdir)
        proc.kill()  # no chance to clean up: the workers must notice by themselves
        proc.wait()
        assert_processes_gone(pids, timeout_s=10.0)
        assert not os.path.exists(workdir)      # (the client's directory: the ranks removed it)
    finally:
        proc.kill()


def test_drain_finishes_in_flight_then_exits(tmp_path):
    path = _folder(tmp_path, QWEN2_1KV)
    client = EngineClient(EngineConfig(model=path, load_format="dummy", tensor_parallel_size=2,
                                       **ENGINE))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    client.add_requests([AddRequest(f"r{i}", {"prompt_token_ids": p}, sp, final_only=True)
                         for i, p in enumerate(PROMPTS)])
    finished = client.drain(timeout_s=60)
    assert sorted(o.request_id for o in finished) == [f"r{i}" for i in range(len(PROMPTS))]
    assert all(len(o.outputs[0].token_ids) == 8 for o in finished)
    # the worker's step records came along: every prompt token once, then 7 fed-back tokens
    # per request (the 8th is sampled, never fed)
    recs = list(client.step_records)
    assert sum(r.num_prefill_tokens for r in recs) == sum(map(len, PROMPTS))
    assert sum(r.num_decode_tokens for r in recs) == 7 * len(PROMPTS)
    assert all(r.num_prefill_tokens + r.num_decode_tokens <= 16 for r in recs)
    assert [p.exitcode for p in client._procs] == [0, 0]  # exited by themselves, cleanly
    assert not os.path.exists(client._tmp)
    with pytest.raises(EngineDeadError, match="shut down"):
        client.add_requests([AddRequest("late", [1, 2, 3], sp)])


def _within(seconds: float, fn):
    """fn() in a daemon thread: its exception (or None) if it returned in time; fails if not."""
    box = []
    def run():
        try:
            fn()
            box.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert box, f"{fn} still blocked after {seconds} s"
    return box[0]


@pytest.mark.parametrize("call", ["shutdown", "abort"])
def test_messages_to_an_exited_worker_never_block(tmp_path, call):
    """A zmq PUSH socket with no connected peer blocks a send forever. Once rank 0 has exited,
    its socket is gone: shutdown (after drain, where CI once hung) and fire-and-forget calls must
    still return, and the next wait must report the death."""
    path = _folder(tmp_path, QWEN2_1KV)
    client = EngineClient(EngineConfig(model=path, load_format="dummy", **ENGINE))
    sp = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    client.add_requests([AddRequest("a", [1, 2, 3], sp)])
    os.kill(client.pids[0], signal.SIGKILL)
    client._procs[0].join(10)
    deadline = time.monotonic() + 10  # until zmq has dropped the dead peer's pipe
    while client._requests.poll(0, zmq.POLLOUT) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not client._requests.poll(0, zmq.POLLOUT)
    if call == "shutdown":
        assert _within(10, client.shutdown) is None
    else:
        assert _within(10, lambda: client.abort_request("a")) is None
        err = _within(10, lambda: client.add_requests([AddRequest("b", [4], sp)]))
        assert isinstance(err, EngineDeadError) and "exited with code -9" in str(err)
    assert_processes_gone(client.pids)


def test_bad_request_keeps_worker_serving(tmp_path):
    path = _folder(tmp_path, QWEN2_1KV)
    with LLM(path, load_format="dummy", distributed_executor_backend="mp", **ENGINE) as llm:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [10_000]}],
                         use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
        with pytest.raises(ValueError, match="cannot be sent"):
            llm.generate([{"prompt_token_ids": [complex(1, 2)]}], use_tqdm=False)
        with pytest.raises(ValueError, match="cannot be sent"):  # over 64 bits: msgpack can't
            llm.generate([{"prompt_token_ids": [2 ** 70]}], use_tqdm=False)
        out = llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=3),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
