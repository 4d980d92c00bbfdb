"""`pdserve bench step` on CPU with the embedded model at tiny sizes: each row times the step it
claims. What a step ran is read independently of the benchmark and of the engine's StepRecord,
from the SchedulerOutputs the model runner was given (a wrapper around ModelRunner.execute_async
counts the prompt tokens and decoding sequences of every forward); a timed step is matched to
its forward by time (the forward returns before the step's record time `t`, the next forward
after it)."""
import bisect
import json
import time

import pytest
import torch

from pdserve.cli import main
from pdserve.engine.core import EngineCore
from pdserve.worker.model_runner import ModelRunner

from .utils import frozen_heap

CONTEXT, CHUNK, BUDGET = 32, 16, 32


class ForwardLog:
    """Every forward's (end time, prompt tokens, prompt sequences, decoding sequences, the
    prompt chunks' token ids, the positions the decoding sequences attend over, the chunks fed
    a token the step before sampled and the host has not read yet), counted from the
    scheduler's chunks."""

    def __init__(self):
        self.times: list[float] = []
        self.entries: list[tuple[int, int, int, list[tuple[int, ...]]]] = []
        self.prompt_len: dict[str, int] = {}

    def wrap(self, orig):
        def execute_async(runner, out):
            for d in out.new_requests:
                self.prompt_len[d.request_id] = len(d.prompt_token_ids)
            res = orig(runner, out)
            pre = [c for c in out.chunks if c.start_pos < self.prompt_len[c.request_id]]
            dec = [c for c in out.chunks if c.start_pos >= self.prompt_len[c.request_id]]
            assert all(len(c.token_ids) == 1 for c in dec)
            self.times.append(time.monotonic())
            self.entries.append((sum(len(c.token_ids) for c in pre), len(pre), len(dec),
                                 [tuple(c.token_ids) for c in pre],
                                 sum(c.start_pos + 1 for c in dec),
                                 sum(bool(c.last_pending) for c in out.chunks)))
            return res
        return execute_async

    def at(self, t: float):
        """The forward of the step whose record time is t."""
        i = bisect.bisect_right(self.times, t) - 1
        assert i >= 0
        return self.entries[i]


def _run(tmp_path, name, args, log):
    out = tmp_path / f"{name}.json"
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelRunner, "execute_async", log.wrap(ModelRunner.execute_async))
        try:
            with frozen_heap():
                rc = main(["bench", "step", "--device", "cpu", "--threads", "1",
                           "--skip-bandwidth", "--num-kv-blocks", "64", "--output", str(out),
                           *args])
        finally:
            torch.set_num_threads(threads)
    return rc, json.loads(out.read_text())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    log = ForwardLog()
    rc, payload = _run(tmp_path_factory.mktemp("step"), "main", [
        "--prefill-tokens", "16", "32", "48", "--max-num-batched-tokens", str(BUDGET),
        "--decode-batches", "1", "4", "--mixed-decodes", "2", "--chunk", str(CHUNK),
        "--context", str(CONTEXT), "--reps", "2", "--warmup", "1"], log)
    return rc, payload, log


def _rows(payload, kind):
    return {(r["num_tokens"], r["num_decodes"]): r for r in payload["rows"] if r["kind"] == kind}


def test_writes_the_result(run):
    rc, payload, _ = run
    assert rc == 0
    assert payload["benchmark"] == "step"
    assert payload["command"][:3] == ["pdserve", "bench", "step"]
    assert payload["git_commit"] and "cpu_model" in payload["hardware"]
    (eng,) = payload["engines"]
    assert eng["name"] == "embedded" and eng["model"] is None and eng["device"] == "cpu"
    assert eng["max_num_batched_tokens"] == BUDGET     # the user's budget, kept
    assert len(payload["rows"]) == 3 + 2 + 1
    for r in payload["rows"]:
        assert r["model"] == "embedded" and "error" not in r


def _check_timing(r):
    assert r["reps"] == 2 and len(r["samples"]["wall_ms"]) == 2
    assert r["gpu_ms"] is None and r["host_share"] is None          # CPU: no device time
    assert all(g is None for g in r["samples"]["gpu_ms"])
    assert 0 < r["wall_ms_p10"] <= r["wall_ms"] <= r["wall_ms_p90"]
    # the bench's wall time holds the engine's own step time
    for ours, engine in zip(r["samples"]["wall_ms"], r["samples"]["record_wall_ms"]):
        assert ours >= engine - 1e-3


def test_prefill_rows_time_one_lone_prefill(run):
    _, payload, log = run
    rows = _rows(payload, "prefill")
    done = 0   # forwards before this row (the prefill rows run first)
    for n in (16, 32):
        r = rows[(n, 0)]
        assert r["context"] == 0 and "skipped" not in r
        _check_timing(r)
        prompts = []
        for t in r["samples"]["t"]:
            tokens, seqs, decodes, chunks, *_ = log.at(t)
            assert (tokens, seqs, decodes) == (n, 1, 0)
            prompts.append(chunks[0])
        assert len(set(prompts)) == len(prompts)   # a fresh prompt every rep
        # the row's forwards: one warm-up step (not counted) and the two timed ones
        end = bisect.bisect_right(log.times, r["samples"]["t"][-1])
        assert [e[:3] for e in log.entries[done:end]] == [(n, 1, 0)] * 3
        done = end


def test_prefill_above_the_budget_is_skipped_and_said(run):
    _, payload, log = run
    r = _rows(payload, "prefill")[(48, 0)]
    assert "max_num_batched_tokens" in r["skipped"] and r["wall_ms"] is None
    assert not any(e[0] == 48 for e in log.entries)   # never run
    assert any("skipped" in note for note in payload["notes"])


def test_decode_rows_time_decode_only_steps(run):
    _, payload, log = run
    rows = _rows(payload, "decode")
    for b in (1, 4):
        r = rows[(0, b)]
        assert r["context"] == CONTEXT
        _check_timing(r)
        for t, ctx in zip(r["samples"]["t"], r["samples"]["ctx_sum"]):
            assert log.at(t)[:3] == (0, 0, b)
            assert log.at(t)[4] == ctx     # the context the row says its decodes attended over
        assert CONTEXT * b < r["ctx_sum"] == sum(r["samples"]["ctx_sum"]) / 2


def _check_queued(log, r, shape):
    """The row's queued steps are the three forwards after its last synced one (then one
    more, a synchronous decode step that applies the last): each the step meant; all but the first started
    before the host read the step before's tokens (their decodes fed the pending token, which
    no synced step does); each one's record made only after the next forward had started."""
    assert "queued_error" not in r and r["queued_reps"] == 3
    assert r["queued_wall_ms"] > 0 and r["queued_gpu_ms"] is None      # CPU: no device time
    synced = r["samples"]["t"][-1]
    last = bisect.bisect_right(log.times, synced) - 1
    assert log.entries[last][5] == 0
    queued = log.entries[last + 1:last + 5]
    assert [e[:3] for e in queued] == [shape] * 3 + [(0, 0, shape[2])]   # (then a decode step)
    assert [e[5] for e in queued] == [0] + [shape[2]] * 3
    ts = r["queued_samples"]["t"]
    assert [bisect.bisect_right(log.times, t) - 1 for t in ts] == [last + 2, last + 3, last + 4]


def test_decode_rows_also_run_queued(run):
    _, payload, log = run
    rows = _rows(payload, "decode")
    for b in (1, 4):
        _check_queued(log, rows[(0, b)], (0, 0, b))
    for t in rows[(0, 4)]["samples"]["t"]:   # the synced steps fed no pending token
        assert log.at(t)[5] == 0


def test_mixed_rows_also_run_queued(run):
    _, payload, log = run
    _check_queued(log, _rows(payload, "mixed")[(CHUNK, 2)], (CHUNK, 1, 2))


def test_mixed_row_times_decodes_plus_one_chunk(run):
    _, payload, log = run
    r = _rows(payload, "mixed")[(CHUNK, 2)]
    _check_timing(r)
    for t, ctx in zip(r["samples"]["t"], r["samples"]["ctx_sum"]):
        assert log.at(t)[:3] == (CHUNK, 1, 2)
        assert log.at(t)[4] == ctx
    for t in r["decode_samples"]["t"]:                # the decode-only steps beside them
        assert log.at(t)[:3] == (0, 0, 2)
    assert r["decode_wall_ms"] > 0 and r["decode_gpu_ms"] is None


def test_default_budget_and_a_step_that_is_not_the_one_meant(tmp_path):
    """Without --max-num-batched-tokens the budget admits the biggest prefill (48 tokens here).
    Work the benchmark did not submit (a request queued before its second prompt) makes the
    row an error, not a measurement."""
    log = ForwardLog()
    calls = []
    orig_add = EngineCore.add_request

    def add_request(eng, request_id, prompt, params=None, **kw):
        calls.append(request_id)
        if len(calls) == 2:   # queued just before the benchmark's second prompt
            orig_add(eng, "intruder", {"prompt_token_ids": [5] * 8}, params)
        orig_add(eng, request_id, prompt, params, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EngineCore, "add_request", add_request)
        rc, payload = _run(tmp_path, "default", [
            "--prefill-tokens", "48", "--decode-batches", "--mixed-decodes",
            "--reps", "2", "--warmup", "0"], log)
    assert rc == 1
    assert payload["engines"][0]["max_num_batched_tokens"] == 48
    (r,) = payload["rows"]
    assert "skipped" not in r and r["wall_ms"] is None
    assert r["error"].startswith("rep 1:")
    # what really ran: rep 0 alone, then the intruder alone (max_num_seqs is 1, sized to the
    # rows): the benchmark's prompt stayed queued
    assert [e[:3] for e in log.entries] == [(48, 1, 0), (8, 1, 0)]
    assert log.entries[1][3] == [(5,) * 8]
    assert "num_prefill_tokens=8" in r["error"] and "num_waiting=1" in r["error"]
    assert payload["engines"][0]["max_num_seqs"] == 1


def test_bad_arguments_are_refused(capsys):
    assert main(["bench", "step", "--reps", "0"]) == 2
    assert "--reps" in capsys.readouterr().err
