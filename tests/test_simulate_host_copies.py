"""The simulator's host-tier copy time (sim/runner.py's module docstring): a step's KV moves run
on a copy stream beside its forward, and the next step's forward waits for them.

Numbers by hand from test_simulate's profile: prefill 2 + 0.01 n ms, decode (one sequence)
5 + 0.1 + 0.001 S ms, kv_bytes_per_token 1000, so a 16-token block is 16,000 bytes; at
0.016 GB/s (16,000 bytes per ms) one block takes 1 ms on the copy stream."""
from __future__ import annotations

import json

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.block_pool import KVMoves
from pdserve.engine.scheduler import NewRequestData, ScheduledChunk, SchedulerOutput
from pdserve.sampling_params import SamplingParams
from pdserve.sim import CostModelRunner, SimClock, SimRequest, Simulator, parse_deployment
from pdserve.sim.cli import DEFAULT_HOST_COPY_GBPS
from pdserve.sim.cli import main as simulate_main

from .test_simulate import profile, profile_file, prompts  # noqa: F401 (a fixture)

RATE = 0.016          # GB/s: 1 ms per 16,000-byte block
PREFILL_100 = 3.0     # ms: 2 + 0.01 * 100
DECODE_101 = 5.201    # ms: 5 + 0.1 + 0.001 * 101 (one sequence at position 100)
DECODE_102 = 5.202


def moves(to_host=0, to_device=0) -> KVMoves:
    return KVMoves([(i, i) for i in range(to_host)], [(i, 100 + i) for i in range(to_device)])


def prefill(m: KVMoves | None = None) -> SchedulerOutput:
    """The 100-token prompt of request a in one chunk (samples its first token)."""
    new = NewRequestData("a", [7] * 100, SamplingParams(), None, [])
    return SchedulerOutput(chunks=[ScheduledChunk("a", [7] * 100, 0, [], True)],
                           new_requests=[new], kv_moves=m, step_id=1, num_prefill_tokens=100)


def decode(pos: int, m: KVMoves | None = None, step_id: int = 2) -> SchedulerOutput:
    return SchedulerOutput(chunks=[ScheduledChunk("a", [1], pos, [], True)], kv_moves=m,
                           step_id=step_id, num_decodes=1)


def runner(rate=RATE) -> tuple[CostModelRunner, SimClock]:
    clock = SimClock()
    return CostModelRunner(profile(), clock, 16, host_copy_gb_per_s=rate), clock


def run(r: CostModelRunner, clock: SimClock, *steps: SchedulerOutput) -> list[float]:
    """Each step issued when the one before ended (the simulator's loop): its token's time."""
    ends = []
    for s in steps:
        if r.execute(s):
            assert r.last_sampled == ["a"]
            ends.append(clock.t)
    return ends


def test_copies_longer_than_the_forward_delay_the_next_step_by_the_difference():
    """The prefill (3 ms) carries 8 blocks out (8 ms): its token still comes at 3 ms (the forward
    does not wait for its copies), the decode after it starts when they end, 8 - 3 = 5 ms late."""
    r, clock = runner()
    assert r.copy_ms(prefill(moves(to_host=8))) == pytest.approx(8.0)
    ends = run(r, clock, prefill(moves(to_host=8)), decode(100))
    assert ends == pytest.approx([PREFILL_100 / 1e3, (8.0 + DECODE_101) / 1e3], abs=1e-12)
    free = run(*runner(0.0), prefill(moves(to_host=8)), decode(100))
    assert ends[1] - free[1] == pytest.approx((8.0 - PREFILL_100) / 1e3, abs=1e-12)
    assert r.copy_wait_s == pytest.approx(5e-3) and r.copy_s == pytest.approx(8e-3)
    assert r.blocks_copied == 8


@pytest.mark.parametrize("out,back", [(1, 1), (2, 1), (0, 3)])
def test_copies_no_longer_than_the_forward_cost_nothing(out, back):
    """2 or 3 blocks (to host and to device alike, summed: one stream runs both) beside a 3 ms
    prefill: the decode after it starts when the prefill ends, as with free copies."""
    r, clock = runner()
    ends = run(r, clock, prefill(moves(out, back)), decode(100))
    assert ends == pytest.approx([PREFILL_100 / 1e3, (PREFILL_100 + DECODE_101) / 1e3],
                                 abs=1e-12)
    assert r.copy_wait_s == 0.0 and r.copy_s == pytest.approx((out + back) / 1e3)


def test_a_steps_copies_start_with_its_forward_not_when_it_is_issued():
    """Step 2 is issued at 3 ms but waits for step 1's copies until 8 ms; its own 10 blocks
    (10 ms) start with its forward at 8 ms (the copy stream waits for the compute stream, which
    waited for step 1's copies), so step 3 starts at 18 ms, not at step 2's end (13.201 ms) nor
    at 3 + 10 = 13 ms (copies started when the step was issued)."""
    r, clock = runner()
    ends = run(r, clock, prefill(moves(to_host=8)), decode(100, moves(to_device=10)),
               decode(101, step_id=3))
    assert ends == pytest.approx([0.003, (8.0 + DECODE_101) / 1e3, (18.0 + DECODE_102) / 1e3],
                                 abs=1e-12)
    assert r.copy_wait_s == pytest.approx((8.0 - 3.0 + 18.0 - (8.0 + DECODE_101)) / 1e3)


def test_a_step_of_moves_only_takes_no_time_but_the_next_forward_waits():
    """No chunks, 4 blocks back (4 ms): the clock stays at 0, the prefill then runs 4-7 ms."""
    r, clock = runner()
    assert r.execute(SchedulerOutput(kv_moves=moves(to_device=4))) == {} and clock.t == 0.0
    assert r.num_steps == 0
    assert run(r, clock, prefill()) == pytest.approx([(4.0 + PREFILL_100) / 1e3], abs=1e-12)


def test_runs_of_consecutive_host_ids_are_counted_per_step_and_direction():
    """Out: host ids 5, 3, 4, 9 -> runs 3-5 and 9 (2); back: 7, 8 -> one run, 20 -> another (2);
    the next step's 6 is consecutive with nothing of its own step (1): 5 runs, 8 blocks."""
    r, clock = runner(0.0)
    out_back = KVMoves([(0, 5), (1, 3), (2, 4), (3, 9)], [(7, 10), (8, 11), (20, 12)])
    run(r, clock, prefill(out_back), decode(100, KVMoves([(4, 6)], [])))
    assert (r.blocks_copied, r.copy_runs) == (8, 5)


def test_rate_zero_is_free_and_a_bad_rate_is_an_error():
    r, clock = runner(0.0)
    assert r.copy_ms(prefill(moves(100, 100))) == 0.0
    assert run(r, clock, prefill(moves(100, 100)), decode(100)) == pytest.approx(
        [PREFILL_100 / 1e3, (PREFILL_100 + DECODE_101) / 1e3], abs=1e-12)
    assert r.blocks_copied == 200 and r.copy_s == 0.0
    for bad in (-1.0, float("inf"), float("nan"), True, "30"):
        with pytest.raises(ValueError, match="host_copy_gb_per_s"):
            CostModelRunner(profile(), SimClock(), 16, host_copy_gb_per_s=bad)


# ---- swap preemption through the simulator --------------------------------------------------
def swap_run(rate: float):
    """8 requests of 48 prompt + 40 output tokens (3 then 6 blocks each, 48 at the end) on a
    24-block pool with a 200-block host tier, swap preemption, all at 0 s: sequences are
    swapped out and back in. (Step 2 is a step of moves only: every sequence is short of a
    block and the newest is swapped out; the simulator used to stop the worker there.)"""
    c = EngineConfig(max_num_seqs=8, max_num_batched_tokens=2048, block_size=16,
                     enable_prefix_caching=False, preemption_mode="swap",
                     swap_space_gb=1.0)   # (a config check; the tier is num_host_blocks)
    sim = Simulator(parse_deployment("1C"), {"default": profile()}, c, 24, 1024, "collocated",
                    num_host_blocks=200, host_copy_gb_per_s=rate)
    res = sim.run([SimRequest(p, 40, 0.0) for p in prompts(8, 48, seed=3)])
    assert all(r.success and r.output_len == 40 for r in res.results)
    return sim, res


def test_swap_moves_take_copy_time_too():
    """Every block a swap moves out or in is charged 1 ms on the copy stream; the schedule is
    the same as with free copies (swap mode, all requests at 0 s), and the worker never idles, so
    the run ends later by exactly the time forwards waited for copies."""
    sim, res = swap_run(RATE)
    free_sim, free = swap_run(0.0)
    (w,) = res.facts["workers"].values()
    (fw,) = free.facts["workers"].values()
    (st,) = sim.worker_stats().values()
    assert st.blocks_swapped_out > 0 and st.blocks_swapped_in == st.blocks_swapped_out
    assert w["blocks_copied"] == st.blocks_swapped_out + st.blocks_swapped_in
    assert w["host_copy_s"] == pytest.approx(w["blocks_copied"] * 1e-3)
    assert (w["steps"], w["preemptions"]) == (fw["steps"], fw["preemptions"])
    assert fw["host_copy_s"] == 0.0 and fw["host_copy_wait_s"] == 0.0
    assert w["host_copy_wait_s"] > 0
    assert res.duration - free.duration == pytest.approx(w["host_copy_wait_s"], abs=1e-9)
    # the engine's swap-or-recompute rule sees the rate and the block's bytes
    (core,) = (x.core for x in sim.workers.values())
    assert core.host_copy_gb_per_s == RATE and core.kv_block_bytes == 16 * 1000


def test_the_copy_rate_on_the_command_line(profile_file, tmp_path):  # noqa: F811
    """--host-copy-gbps reaches the runner (the facts' copy time is blocks * 16,000 bytes over
    it); the default is the H200's scattered-id rate; a negative rate is an error."""
    assert DEFAULT_HOST_COPY_GBPS == 30.0
    base = ["--dataset-name", "multi-turn", "--multi-turn-conversations", "12",
            "--multi-turn-turns", "3", "--multi-turn-user-len", "60",
            "--multi-turn-output-len", "8", "--num-kv-blocks", "64", "--max-model-len", "1024",
            "--num-host-blocks", "600", "--profile", profile_file]
    out = str(tmp_path / "c.json")
    for rate in ("0.016", None):
        args = base + ["--result-file", out] + (["--host-copy-gbps", rate] if rate else [])
        assert simulate_main(args) == 0
        d = json.load(open(out))
        assert d["completed"] == 36
        (w,) = d["simulation"]["workers"].values()
        assert w["blocks_copied"] == w["blocks_offloaded"] + w["blocks_loaded_back"] > 0
        gbps = float(rate) if rate else 30.0
        assert w["host_copy_s"] == pytest.approx(w["blocks_copied"] * 16000 / (gbps * 1e9))
    assert simulate_main(base + ["--result-file", out, "--host-copy-gbps", "-1"]) == 2
