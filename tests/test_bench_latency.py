"""`pdserve bench latency`'s engine length: by default just what its runs need, or the model's own
length (--max-model-len) to time the decode graphs a server captures."""
import pytest

import pdserve
from pdserve.bench import latency


class _Built(Exception):
    pass


def test_the_engine_gets_the_length_asked_for_or_just_what_the_runs_need(monkeypatch):
    """By hand: contexts 64 and 16, 5 steps after 2 warm-up steps, no generate: the longest run
    is 64 + max(2 x 5 + 2, 0) + 8 = 84 tokens."""
    seen = []

    def fake_llm(model, **kw):
        seen.append(kw["max_model_len"])
        raise _Built
    monkeypatch.setattr(pdserve, "LLM", fake_llm)
    base = ["--models", "smollm2-135m", "--device", "cpu", "--batch-sizes", "2", "--steps", "5",
            "--warmup", "2", "--context", "64", "--batch1-context", "16", "--generate-tokens", "0"]
    for extra, want in (([], 84), (["--max-model-len", "2048"], 2048), (["--max-model-len", "84"], 84)):
        with pytest.raises(_Built):
            latency.main(base + extra)
        assert seen[-1] == want


def test_a_length_shorter_than_the_runs_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        latency.main(["--models", "smollm2-135m", "--device", "cpu", "--steps", "5", "--warmup",
                      "2", "--context", "64", "--batch1-context", "16", "--generate-tokens", "0",
                      "--max-model-len", "83"])
    assert e.value.code == 2
    assert "--max-model-len 83 is shorter than the runs need (84 tokens)" in capsys.readouterr().err
