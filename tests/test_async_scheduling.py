"""Async scheduling (EngineConfig.async_scheduling): step() starts step N+1 before it reads step
N's tokens, which stay on the device and feed N+1's pending inputs.

Two kinds of checks:
  - a stand-in executor in plain Python that plays the device (its sampled token depends on the
    token fed, so a pending input it had to take from its own last samples shows): the order of
    starts and reads (N+1 started before N is read), no token past a request's end, a stopped or
    aborted request's in-flight token dropped, the steps that fall back to synchronous; the
    expected tokens come from a naive loop over the same rule, not from the engine;
  - the real engine (embedded SmolLM2; tiny dummy models for TP over gloo and P/D): async and
    sync scheduling of the same configuration give identical outputs (token ids, text, finish
    reasons, logprobs) for greedy, seeded sampling, stops, n > 1, penalties, preemption,
    aborts and length limits.
"""
from __future__ import annotations

import dataclasses

import msgspec
import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.executor import SampledToken
from pdserve.protocol import AddRequest

# ---- a stand-in device -----------------------------------------------------------------------
V, EOS = 53, 0


def next_token(fed: int, pos: int) -> int:
    """The fake model: the token after the one fed at position `pos`."""
    return (fed * 7 + pos * 3 + 1) % V


def naive(prompt: list[int], max_tokens: int, max_model_len: int, ignore_eos: bool = False,
          stop_ids: tuple[int, ...] = ()) -> tuple[list[int], str]:
    """The reference: one token at a time, stops checked after each."""
    toks, out = list(prompt), []
    while True:
        t = next_token(toks[-1], len(toks) - 1)
        toks.append(t)
        out.append(t)
        if (t == EOS and not ignore_eos) or t in stop_ids:
            return out, "stop"
        if len(out) >= max_tokens or len(toks) >= max_model_len:
            return out, "length"


class _Handle:
    def __init__(self, dev, step_id, sampled):
        self.dev, self.step_id, self.sampled = dev, step_id, sampled

    def result(self):
        self.dev.log.append(("read", self.step_id))
        return self.sampled


class FakeDevice:
    """Runs steps in order; a chunk's pending input is the token this device sampled for that
    sequence in the step started just before (what the ModelRunner does on the GPU)."""

    def __init__(self):
        self.log: list[tuple[str, int]] = []
        self.last: dict[str, int] = {}
        self.samples: dict[str, int] = {}     # tokens sampled per sequence, dropped ones too
        self.chunks: list[list[str]] = []     # sequence ids per started step
        self.settled: dict[int, None] = {}

    def _run(self, sched):
        last, self.last = self.last, {}
        out = {}
        for c in sched.chunks:
            fed = c.token_ids[-1]
            if c.last_pending:
                fed = last[c.request_id]      # KeyError: a pending token nobody sampled
            if c.sample:
                out[c.request_id] = next_token(fed, c.start_pos + len(c.token_ids) - 1)
        for f in sched.forks:
            out[f.request_id] = out[f.parent_id]
        for rid in out:
            self.samples[rid] = self.samples.get(rid, 0) + 1
        self.last = out
        if sched.chunks:
            self.chunks.append([c.request_id for c in sched.chunks])
            self.settled[sched.step_id] = None    # (as the ModelRunner on CPU: unmeasured)
        return {k: SampledToken(v, None, None) for k, v in out.items()}

    def execute(self, sched):
        self.log.append(("run", sched.step_id))
        return self._run(sched)

    def take_prompt_logprobs(self):
        return {}

    def poll_loads(self):
        return []

    def take_gpu_times(self):
        out, self.settled = self.settled, {}
        return out


class AsyncFakeDevice(FakeDevice):
    def execute_async(self, sched):
        self.log.append(("start", sched.step_id))
        return _Handle(self, sched.step_id, self._run(sched))


def fake_core(async_scheduling=True, num_kv_blocks=64, max_model_len=64, **cfg):
    cfg.setdefault("block_size", 4)
    cfg.setdefault("max_num_batched_tokens", 16)
    dev = AsyncFakeDevice()
    core = EngineCore(EngineConfig(async_scheduling=async_scheduling, **cfg), dev,
                      num_kv_blocks=num_kv_blocks, max_model_len=max_model_len, vocab_size=V,
                      eos_token_ids=(EOS,))
    return core, dev


def drain(core, abort_at: dict[int, str] | None = None):
    """Steps until nothing is left; {step number: request id} aborts before that step."""
    done, streamed, n = {}, {}, 0
    while core.has_unfinished_requests():
        n += 1
        if abort_at and n in abort_at:
            core.abort_request(abort_at[n])
        for o in core.step():
            for c in o.outputs:
                streamed.setdefault((o.request_id, c.index), []).extend(c.new_token_ids)
            if o.finished:
                done[o.request_id] = o
        core.check_integrity()
    for (rid, i), toks in streamed.items():   # the stream adds up to the final output
        if rid in done:
            assert toks == done[rid].outputs[i].token_ids
    assert core.kv.num_free_blocks() == core.num_kv_blocks
    return done


PROMPTS = [[3, 9, 4], [11, 12, 13, 14, 15, 16, 17], [5] * 13, [40, 2], [8, 1, 30, 22, 6]]


def _expected(prompts, params, max_model_len=64):
    return [naive(p, params.max_tokens, max_model_len, params.ignore_eos, params.stop_token_ids)
            for p in prompts]


def _got(done, n):
    return [(done[f"r{i}"].outputs[0].token_ids, done[f"r{i}"].outputs[0].finish_reason)
            for i in range(n)]


def test_next_step_starts_before_the_last_is_read():
    core, dev = fake_core()
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", p, sp)
    done = drain(core)
    assert _got(done, len(PROMPTS)) == _expected(PROMPTS, sp)
    # every read of step k comes after step k+1 started (the last one drains); no sync step
    starts = [k for e, k in dev.log if e == "start"]
    reads = [k for e, k in dev.log if e == "read"]
    assert reads == starts and core.num_sync_steps == 0
    for k, k1 in zip(starts, starts[1:]):
        assert dev.log.index(("start", k1)) < dev.log.index(("read", k)), k
    assert dev.log[-1] == ("read", starts[-1])
    # one record per step with a forward, in order
    recs = core.take_step_records()
    assert len(recs) == len(starts) and [r.t for r in recs] == sorted(r.t for r in recs)
    # pending inputs were used: decode chunks were started before their token was read
    assert sum(len(c) for c in dev.chunks) > len(starts)


def test_sync_mode_reads_each_step_before_the_next():
    core, dev = fake_core(async_scheduling=False)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", p, sp)
    done = drain(core)
    assert _got(done, len(PROMPTS)) == _expected(PROMPTS, sp)
    assert {e for e, _ in dev.log} == {"run"}


def _stopping_prompt(stop_ids=(), at_least=2):
    """A prompt whose naive run stops (EOS or a stop id) after >= at_least tokens."""
    for a in range(V):
        for b in range(V):
            toks, why = naive([a, b], 30, 64, stop_ids=stop_ids)
            if why == "stop" and at_least <= len(toks) < 30:
                return [a, b]
    raise AssertionError("no stopping prompt")


@pytest.mark.parametrize("stop_ids", [(), (17,)], ids=["eos", "stop_token_ids"])
def test_a_stopped_request_never_shows_its_in_flight_token(stop_ids):
    prompt = _stopping_prompt(stop_ids, at_least=3)
    core, dev = fake_core()
    sp = SamplingParams(max_tokens=30, stop_token_ids=list(stop_ids))
    core.add_request("r0", prompt, sp)
    core.add_request("r1", PROMPTS[1], SamplingParams(max_tokens=20, ignore_eos=True))
    done = drain(core)
    want = naive(prompt, 30, 64, stop_ids=stop_ids)
    assert _got(done, 1) == [want]
    if stop_ids:
        assert done["r0"].outputs[0].stop_reason == stop_ids[0]
    # the device did sample one token past the stop (the step in flight): dropped
    assert dev.samples["r0#0"] == len(want[0]) + 1


def test_no_chunk_past_a_requests_end():
    """max_tokens and max_model_len: the device never samples a token the request cannot have."""
    core, dev = fake_core(max_model_len=20)
    sp = SamplingParams(max_tokens=9, ignore_eos=True)
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", p, long if i == 2 else sp)
    done = drain(core)
    want = [naive(p, (long if i == 2 else sp).max_tokens, 20, True) for i, p in enumerate(PROMPTS)]
    assert _got(done, len(PROMPTS)) == want
    assert done["r2"].outputs[0].finish_reason == "length"
    assert len(PROMPTS[2]) + len(done["r2"].outputs[0].token_ids) == 20   # max_model_len
    for i in range(len(PROMPTS)):
        assert dev.samples[f"r{i}#0"] == len(want[i][0])


def test_abort_while_its_step_is_in_flight():
    sp = SamplingParams(max_tokens=14, ignore_eos=True)
    core, dev = fake_core()
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", p, sp)
    done = drain(core, abort_at={4: "r1"})
    # r1's chunks were in the step in flight when it was aborted
    assert any("r1#0" in c for c in dev.chunks[2:4])
    assert "r1" not in done
    want = _expected(PROMPTS, sp)
    assert [done[f"r{i}"].outputs[0].token_ids for i in (0, 2, 3, 4)] == \
        [want[i][0] for i in (0, 2, 3, 4)]


def test_preemption_with_pending_tokens():
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    core, dev = fake_core(num_kv_blocks=10)
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", p, sp)
    done = drain(core)
    assert core.scheduler.num_preemptions > 0
    assert _got(done, len(PROMPTS)) == _expected(PROMPTS, sp)


def test_forks_take_their_first_token_from_the_device():
    core, dev = fake_core()
    sp = SamplingParams(n=3, max_tokens=8, ignore_eos=True)
    core.add_request("x", PROMPTS[4], sp)
    (out,) = drain(core).values()
    want = naive(PROMPTS[4], 8, 64, True)[0]
    assert [o.token_ids for o in out.outputs] == [want] * 3
    assert core.num_sync_steps == 0


@pytest.mark.parametrize("params", [dict(repetition_penalty=1.2), dict(presence_penalty=0.5),
                                    dict(min_tokens=4)],
                         ids=["repetition", "presence", "min_tokens"])
def test_history_dependent_sampling_reads_the_step_first(params):
    """Penalties and min_tokens read a sequence's output history on the host: while a
    penalised sequence has a token in flight, and when the token in flight is the one that lifts
    a min_tokens ban, the next step waits for it (read before the next start)."""
    core, dev = fake_core()
    core.add_request("p", PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True, **params))
    core.add_request("q", PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True))
    done = drain(core)
    assert _got({"r0": done["p"], "r1": done["q"]}, 2) == _expected(
        PROMPTS[:2], SamplingParams(max_tokens=6, ignore_eos=True))
    assert core.num_sync_steps > 0
    starts = [k for e, k in dev.log if e == "start"]
    synced = [k for k, k1 in zip(starts, starts[1:])
              if dev.log.index(("read", k)) < dev.log.index(("start", k1))]
    assert synced
    if "min_tokens" in params:   # only the step after the 4th token is sampled
        assert len(synced) == 1


def test_the_last_step_drains():
    core, dev = fake_core()
    core.add_request("a", PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True))
    while core.has_unfinished_requests():
        core.step()
    assert not core.has_work() and core._in_flight is None
    assert dev.log[-1][0] == "read"
    # abort everything with a step in flight: the next step reads (and drops) it
    core.add_request("b", PROMPTS[1], SamplingParams(max_tokens=30, ignore_eos=True))
    core.step()
    core.step()
    core.abort_request("b")
    assert core.has_unfinished_requests()      # the step in flight
    assert core.step() == []
    assert not core.has_unfinished_requests()
    core.check_integrity()
    assert core.kv.num_free_blocks() == core.num_kv_blocks


def test_an_executor_without_execute_async_runs_synchronously():
    dev = FakeDevice()
    core = EngineCore(EngineConfig(block_size=4), dev, num_kv_blocks=16, max_model_len=32,
                      vocab_size=V, eos_token_ids=(EOS,))
    assert not core.async_scheduling
    core.add_request("r0", PROMPTS[0], SamplingParams(max_tokens=5, ignore_eos=True))
    assert _got(drain(core), 1) == _expected(PROMPTS[:1], SamplingParams(max_tokens=5,
                                                                         ignore_eos=True))
    assert {e for e, _ in dev.log} == {"run"}


# ---- the embedded SmolLM2: async and sync scheduling, the same configuration -----------------
# A small pool (24 blocks of 8) so that the mixed batch below preempts; max_model_len 64 so the
# chat prompts (~40 tokens) can run into it.
SMOL = dict(block_size=8, num_kv_blocks=24, max_model_len=64, max_num_batched_tokens=64)
TEXTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "The sun is a"]
CHATS = ["What is 2+2? Answer with a number only.", "Is the sky blue? Yes or no."]


@pytest.fixture(scope="module")
def smol():
    """{async_scheduling: LLM} over the same configuration."""
    return {a: LLM(async_scheduling=a, **SMOL) for a in (False, True)}


def _chat_ids(llm, q):
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": q}],
                                                   tokenize=True, add_generation_prompt=True)


def _assert_same_outputs(ref, got):
    assert len(got) == len(ref)
    for r, g in zip(ref, got):   # (in prompt order; LLM numbers requests per engine)
        assert g.prompt_token_ids == r.prompt_token_ids
        assert g.finished and r.finished
        assert len(g.outputs) == len(r.outputs)
        for cr, cg in zip(r.outputs, g.outputs):
            assert (cg.token_ids, cg.text, cg.finish_reason, cg.stop_reason) == \
                (cr.token_ids, cr.text, cr.finish_reason, cr.stop_reason), r.request_id
            _assert_same_logprobs(cr.logprobs, cg.logprobs)
        _assert_same_logprobs(r.prompt_logprobs, g.prompt_logprobs)


def _assert_same_logprobs(ref, got):
    if ref is None:
        assert got is None
        return
    assert len(got) == len(ref)
    for a, b in zip(ref, got):
        if a is None:
            assert b is None
            continue
        assert list(a) == list(b)
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 and a[t].rank == b[t].rank for t in a)


def _generate_both(smol, prompts, params):
    outs = {}
    for a, llm in smol.items():
        before = llm.llm_engine.scheduler.num_preemptions
        outs[a] = llm.generate(prompts, params, use_tqdm=False)
        eng = llm.llm_engine
        eng.check_integrity()
        assert eng.kv.num_free_blocks() == SMOL["num_kv_blocks"]
        outs[a, "preemptions"] = eng.scheduler.num_preemptions - before
    _assert_same_outputs(outs[False], outs[True])
    return outs


def test_smollm2_mixed_batch_same_as_sync(smol):
    """Greedy (logprobs, prompt logprobs), seeded sampling, n > 1, penalties, EOS, max_tokens and
    max_model_len in one batch that the pool cannot hold at once (preemptions)."""
    llm = smol[True]
    chats = [{"prompt_token_ids": _chat_ids(llm, q)} for q in CHATS]
    G = dict(temperature=0, max_tokens=12)
    prompts, params = [], []
    for t in TEXTS:                       # greedy, with logprobs and prompt logprobs
        prompts.append(t)
        params.append(SamplingParams(logprobs=2, prompt_logprobs=1, ignore_eos=True, **G))
    for i, t in enumerate(TEXTS[:3]):     # seeded sampling
        prompts.append(t)
        params.append(SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=100 + i,
                                     max_tokens=12, logprobs=1))
    prompts += [TEXTS[0], TEXTS[1]]       # n > 1: seeded, and greedy
    params += [SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8),
               SamplingParams(n=2, max_tokens=8, temperature=0)]
    # penalties (synchronous steps); after "1 1 ... 1" the model repeats its last token unless
    # that token is penalised, so a history one token short (the one in flight) would show
    prompts += [TEXTS[3], "1 1 1 1 1 1 1 1 1 1"]
    params += [SamplingParams(temperature=0.8, seed=3, presence_penalty=0.6,
                              frequency_penalty=0.4, max_tokens=12),
               SamplingParams(repetition_penalty=1.3, **G)]
    # EOS; and EOS banned until min_tokens, lifted right where the model wants it (the step
    # that lifts it must count the token in flight)
    prompts += chats + chats[1:]
    params += [SamplingParams(max_tokens=16, temperature=0)] * 2
    params.append(SamplingParams(max_tokens=16, temperature=0, min_tokens=2))
    prompts.append(chats[0])              # max_model_len (64) before max_tokens
    params.append(SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    outs = _generate_both(smol, prompts, params)
    ref = outs[False]
    # the batch covers what it claims (in the reference run)
    eos, banned = ref[-4:-2], ref[-2]
    assert [o.outputs[0].finish_reason for o in eos] == ["stop", "stop"]
    assert all(o.outputs[0].stop_reason is None for o in eos)                # EOS
    assert banned.outputs[0].token_ids == eos[1].outputs[0].token_ids
    assert len(banned.outputs[0].token_ids) == 3 and banned.outputs[0].finish_reason == "stop"
    assert len(ref[-1].prompt_token_ids) + len(ref[-1].outputs[0].token_ids) == 64
    assert outs[False, "preemptions"] > 0 and outs[True, "preemptions"] > 0
    assert len({tuple(c.token_ids) for c in ref[7].outputs}) > 1           # seeds per sample
    assert smol[True].llm_engine.num_sync_steps > 0                        # the penalties


def test_smollm2_stop_strings_and_token_ids_same_as_sync(smol):
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    base = smol[False].generate(TEXTS[:2], greedy, use_tqdm=False)
    text, toks = base[0].outputs[0].text, base[1].outputs[0].token_ids
    stop_str = text[len(text) // 2: len(text) // 2 + 3]  # cut mid-output
    assert stop_str.strip()
    params = [dataclasses.replace(greedy, stop=["never in it", stop_str]),
              dataclasses.replace(greedy, stop_token_ids=[toks[4]])]
    outs = _generate_both(smol, [TEXTS[0], TEXTS[1]], params)
    assert [o.outputs[0].finish_reason for o in outs[False]] == ["stop", "stop"]
    assert outs[False][0].outputs[0].stop_reason == stop_str
    assert outs[False][1].outputs[0].stop_reason == toks[4]


def test_smollm2_abort_mid_stream_leaves_the_others_unchanged(smol):
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    got = {}
    for a, llm in smol.items():
        eng = llm.llm_engine
        for i, t in enumerate(TEXTS[:3]):
            eng.add_request(f"r{i}", t, sp)
        got[a] = drain(eng, abort_at={4: "r1"})
        assert "r1" not in got[a]
    for rid in ("r0", "r2"):
        _assert_same_outputs([got[False][rid]], [got[True][rid]])


# ---- TP over gloo and P/D: tiny dummy models (tests/test_tp.py, tests/test_disagg.py) --------
TINY = dict(skip_tokenizer_init=True, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
            load_format="dummy")
TINY_PROMPTS = [[5, 17, 99, 3], list(range(200, 214)), [42] * 9, list(range(30, 70))]


def _tiny_params():
    return [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
            SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True,
                           logprobs=1),
            SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)]


def test_tp2_async_same_as_sync(tmp_path):
    """Rank 1 takes each pending token from rank 0's broadcast: a wrong one would change the
    activations both ranks sum, so the outputs show it."""
    from .test_tp import LLAMA_8Q_2KV, _folder
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]
    outs = {}
    for a in (False, True):
        with LLM(path, tensor_parallel_size=2, async_scheduling=a, **TINY) as llm:
            outs[a] = llm.generate(prompts, _tiny_params(), use_tqdm=False)
            llm.llm_engine.check_integrity()
            assert llm.llm_engine.num_free_blocks() == TINY["num_kv_blocks"]
    _assert_same_outputs(outs[False], outs[True])


def test_1p1d_async_same_as_sync(tmp_path):
    """Prefill on P (KV held: never scheduled past its prompt), pull into D, decode there; D
    starts pulls while a decode is in flight."""
    from pdserve.worker.llm_engine import LLMEngine

    from .test_disagg import _run
    from .test_tp import LLAMA_8Q_2KV, _folder
    path = _folder(tmp_path, LLAMA_8Q_2KV)
    params = _tiny_params()[:2] * 2
    got = {}
    for a in (False, True):
        cfg = EngineConfig(model=path, kv_connector="shared", async_scheduling=a, **TINY)
        P, D = LLMEngine(cfg), LLMEngine(cfg)
        D.connect_kv([P.kv_export("p")])
        firsts = _run(P, [AddRequest(f"r{i}", {"prompt_token_ids": p},
                                     dataclasses.replace(sp, max_tokens=1), kv_hold=True)
                          for i, (p, sp) in enumerate(zip(TINY_PROMPTS, params))])
        reqs = []
        for i, (p, sp) in enumerate(zip(TINY_PROMPTS, params)):
            src = msgspec.structs.replace(firsts[f"r{i}"].kv_transfer, worker="p")
            assert src.num_tokens == len(p)
            reqs.append(AddRequest(f"r{i}", {"prompt_token_ids": p}, sp, kv_source=src))
        D.add_requests(reqs[:1])
        r0 = D.scheduler.requests["r0#0"]
        while len(r0.output_token_ids) < 4:  # r0 decoding when the others' pulls start
            D.step()
        assert D.has_unfinished_requests() and (D._in_flight is not None) == a
        got[a] = _run(D, reqs[1:])
        P.release_kv([f"r{i}" for i in range(len(TINY_PROMPTS))])
        assert [e.ok for e in D.take_kv_events()] == [True] * len(TINY_PROMPTS)
        for e in (P, D):
            e.check_integrity()
            assert e.kv.num_free_blocks() == e.kv.pool.num_blocks
    assert sorted(got[True]) == sorted(got[False]) == ["r0", "r1", "r2", "r3"]
    _assert_same_outputs([got[False][k] for k in sorted(got[False])],
                         [got[True][k] for k in sorted(got[True])])


# ---- the scheduler with a step in flight (random interleavings) -------------------------------
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402

from pdserve.engine.kv_cache_manager import KVCacheManager  # noqa: E402
from pdserve.engine.request import Request, RequestStatus  # noqa: E402
from pdserve.engine.scheduler import Scheduler  # noqa: E402


class InFlightMachine(RuleBasedStateMachine):
    """Schedules the next step before the previous one is updated (the engine core's order),
    finishes sequences by length when their tokens arrive and aborts at random: integrity holds,
    no chunk reaches past max_tokens, a pending input is always the previous step's sample."""

    def __init__(self):
        super().__init__()
        self.s = Scheduler(KVCacheManager(12, 4), 6, 10)
        self.n = 0
        self.unread: list = []            # SchedulerOutputs scheduled, not updated (oldest first)

    @rule(n_prompt=st.integers(1, 20), max_tokens=st.integers(1, 8), siblings=st.integers(0, 2))
    def add(self, n_prompt, max_tokens, siblings):
        sp = SamplingParams(max_tokens=max_tokens)
        r = Request(f"r{self.n}", list(range(1, n_prompt + 1)), sp, max_model_len=48)
        for i in range(siblings):
            r.siblings.append(Request(f"r{self.n}.{i}", r.prompt_token_ids, sp, max_model_len=48,
                                      status=RequestStatus.FORK_PENDING))
        self.n += 1
        if n_prompt + max_tokens + 1 <= 48:
            self.s.add(r)

    @rule()
    def step(self):
        out = self.s.schedule()
        prev = self.unread[-1] if self.unread else None
        sampled_before = set() if prev is None else (
            {c.request_id for c in prev.chunks if c.sample} | {f.request_id for f in prev.forks})
        for c in out.chunks:
            assert c.start_pos + len(c.token_ids) <= len(c.block_table) * 4
            if c.last_pending:
                assert c.request_id in sampled_before
            req = self.s.requests[c.request_id]
            assert len(req.output_token_ids) + req.num_pending <= req.params.max_tokens
        if out.chunks:
            self.unread.append(out)
        if len(self.unread) > 1 or not out.chunks:
            self._update()

    def _update(self):
        if not self.unread:
            return
        out = self.unread.pop(0)
        got = self.s.update({c.request_id: 3 for c in out.chunks if c.sample}
                            | {f.request_id: 3 for f in out.forks})
        for r in got:
            if len(r.output_token_ids) >= r.params.max_tokens:
                self.s.finish(r, RequestStatus.FINISHED_LENGTH)

    @rule(data=st.data())
    def abort(self, data):
        live = [r for r in self.s.requests.values() if r.status is not RequestStatus.FORK_PENDING]
        if live:
            self.s.finish(data.draw(st.sampled_from(live)), RequestStatus.FINISHED_ABORTED)

    @invariant()
    def integrity(self):
        self.s.check_integrity()

    def teardown(self):
        for _ in range(2000):
            if not self.s.has_unfinished() and not self.unread:
                break
            self.step()
        assert not self.s.has_unfinished()
        assert self.s.kv.num_free_blocks() == 12


TestInFlightMachine = InFlightMachine.TestCase
TestInFlightMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
