"""`pdserve bench preemption` on the embedded model (CPU, float32): a quick run's JSON, with
preemption certain on the oversubscribed sides, and its argument errors. The expected pool sizes
and prompt tokens are worked out here from the prompts themselves (the shared seeded helper)."""
import json
import math

import pytest
import torch

from pdserve import cli
from pdserve.bench import preemption
from pdserve.bench.common import random_prompts

# four short prompts, 16 outputs, 4-token blocks, in a pool of a third of their demand: the
# prompts fit at once, their decodes do not, so they must preempt one another
QUICK = ["--num-prompts", "4", "--min-input-len", "8", "--max-input-len", "13",
         "--output-len", "16", "--block-size", "4", "--modes", "recompute", "swap",
         "--threads", "1", "--seed", "3"]
SMOLLM2_VOCAB = 49152


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_quick_run(tmp_path, one_thread):
    out = tmp_path / "p.json"
    assert cli.main(["bench", "preemption", *QUICK, "--output", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["benchmark"] == "preemption"
    assert d["command"][:3] == ["pdserve", "bench", "preemption"]
    assert {"git_commit", "hardware", "config", "timestamp"} <= d.keys()
    assert list(d["sides"]) == ["reference", "recompute", "swap"]

    lengths = [len(p) for p in random_prompts(4, 8, 13, SMOLLM2_VOCAB, 3)]
    need = [math.ceil((n + 16) / 4) for n in lengths]
    assert d["workload"]["prompt_tokens"] == sum(lengths)
    assert d["pool"] == {"demand_blocks": sum(need), "longest_request_blocks": max(need),
                         "pressured_blocks": max(max(need), math.ceil(sum(need) / 3)),
                         "reference_blocks": sum(need) + 4}

    ref, rec, swap = (d["sides"][k] for k in ("reference", "recompute", "swap"))
    for s in (ref, rec, swap):
        assert s["output_tokens"] == 4 * 16
        assert s["wall_s"] > 0 and s["output_tok_per_s"] > 0
        assert s["total_tok_per_s"] > s["output_tok_per_s"]
    assert ref["preemptions"] == 0 and ref["num_kv_blocks"] == sum(need) + 4
    assert ref["prefill_tokens_computed"] == sum(lengths)

    assert rec["num_kv_blocks"] == swap["num_kv_blocks"] == d["pool"]["pressured_blocks"]
    assert rec["preemptions"] > 0 and rec["recompute_preemptions"] == rec["preemptions"]
    assert rec["swap_preemptions"] == 0 and rec["blocks_swapped_out"] == 0
    assert rec["host_blocks"] == 0
    assert rec["prefill_tokens_computed"] > sum(lengths)     # the victims' tokens again

    assert swap["host_blocks"] > 0
    assert swap["preemptions"] > 0 and swap["swap_preemptions"] == swap["preemptions"]
    assert swap["blocks_swapped_out"] == swap["blocks_swapped_in"] > 0
    assert swap["prefill_tokens_computed"] == sum(lengths)   # nothing computed twice

    assert rec["outputs_differ"] == 0 and swap["outputs_differ"] == 0
    assert rec["first_divergence"] == [] == swap["first_divergence"]
    s = d["summary"]
    assert s["recompute_also_differs"] is False and s["swap_outputs_differ"] == 0
    assert s["swap_over_recompute_output_tok_per_s"] == pytest.approx(
        swap["output_tok_per_s"] / rec["output_tok_per_s"], rel=1e-3)


def test_plan_pool_by_hand():
    # 10 + 6 tokens: 4 blocks of 4; 30 + 6: 9 blocks; demand 13, a third of it 5 < 9
    assert preemption.plan_pool([10, 30], 6, 4, 3.0, None) == {
        "demand_blocks": 13, "longest_request_blocks": 9, "pressured_blocks": 9,
        "reference_blocks": 15}
    assert preemption.plan_pool([10, 30], 6, 4, 1.0, None)["pressured_blocks"] == 13
    assert preemption.plan_pool([10, 30], 6, 4, 3.0, 11)["pressured_blocks"] == 11
    with pytest.raises(ValueError, match="cannot hold the longest request"):
        preemption.plan_pool([10, 30], 6, 4, 3.0, 8)


@pytest.mark.parametrize("flags, says", [
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--output-len", "-3"], "--output-len must be >= 1"),
    (["--min-input-len", "50", "--max-input-len", "20"], "--max-input-len (20) must be >="),
    (["--oversubscription", "0.5"], "--oversubscription must be"),
    (["--num-kv-blocks", "0"], "--num-kv-blocks must be >= 1"),
    (["--swap-space", "-1"], "--swap-space must be"),
    (["--modes", "swap", "swap"], "--modes lists a side twice"),
])
def test_bad_arguments_exit_2(flags, says, capsys, tmp_path):
    assert cli.main(["bench", "preemption", *flags, "--output", str(tmp_path / "x.json")]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_pool_too_small_for_one_request(capsys, tmp_path):
    args = preemption.build_parser().parse_args([*QUICK, "--num-kv-blocks", "2"])
    with pytest.raises(ValueError, match="--num-kv-blocks 2 cannot hold the longest request"):
        preemption.run(args)
    # the command line says so and writes nothing (before any engine is built)
    out = tmp_path / "x.json"
    assert preemption.main([*QUICK, "--num-kv-blocks", "2", "--output", str(out)]) == 1
    assert "cannot hold the longest request" in capsys.readouterr().err
    assert not out.exists()
