"""`pdserve bench prefix` end to end on a tiny random Qwen2 (CPU): every case runs with the
cache on and off, the cache-on side reuses what the case says it shares, the off side nothing."""
import json

import pytest

pytest.importorskip("transformers")

from pdserve.bench.prefix import main  # noqa: E402

from .utils import frozen_heap, save_tiny_hf_model  # noqa: E402


def test_bench_prefix_cases(tmp_path):
    model = tmp_path / "qwen2"
    save_tiny_hf_model(model, "qwen2")
    out = tmp_path / "prefix.json"
    with frozen_heap():
        rc = main(["--model", str(model), "--device", "cpu", "--max-model-len", "512",
                   "--system-len", "60", "--questions", "2", "--conversations", "3", "--turns",
                   "3", "--turn-output", "3", "--random-prompts", "3", "--random-output", "2",
                   "--random-max-len", "200", "--output", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    on, off = r["results"]["on"], r["results"]["off"]
    # warm: everything but the question (30-50 tokens) and at least one token came cached
    assert on["system"]["mean_cached_tokens"] >= 60
    assert off["system"]["mean_cached_tokens"] == 0
    # turn t > 0 reuses the whole history: well over a third of all prompt tokens
    assert on["multi_turn"]["cached_fraction_of_prompt_tokens"] > 0.3
    assert off["multi_turn"]["cached_fraction_of_prompt_tokens"] == 0
    assert on["zero_reuse"]["cached_tokens"] == off["zero_reuse"]["cached_tokens"] == 0
    # two rounds per side (the default), each on an engine of its own
    assert len(on["zero_reuse"]["rounds_tok_per_s"]) == len(off["zero_reuse"]["rounds_tok_per_s"]) == 2
    assert r["results"]["zero_reuse_warmup_engine_tok_per_s"] > 0
    loss = 1 - (sum(on["zero_reuse"]["rounds_tok_per_s"]) / sum(off["zero_reuse"]["rounds_tok_per_s"]))
    assert r["summary"]["zero_reuse_loss"] == pytest.approx(loss)
    assert set(r["summary"]) == {"system_warm_over_cold", "multi_turn_speedup", "zero_reuse_loss"}
    assert r["command"][:3] == ["pdserve", "bench", "prefix"]


def test_zero_reuse_rounds_put_each_side_first_as_often_as_second():
    from pdserve.bench.prefix import zero_reuse_order
    on, off = True, False
    assert zero_reuse_order(1) == [on, off]
    assert zero_reuse_order(2) == [on, off, off, on]
    assert zero_reuse_order(3) == [on, off, off, on, on, off]


def test_bench_prefix_rejects_bad_counts(capsys):
    assert main(["--turns", "0"]) == 2
    assert "--turns must be >= 1" in capsys.readouterr().err
    assert main(["--zero-reuse-rounds", "0"]) == 2
    assert "--zero-reuse-rounds must be >= 1" in capsys.readouterr().err
