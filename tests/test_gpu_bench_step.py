"""`pdserve bench step` on a GPU (Qwen2.5-1.5B shapes, dummy weights): every decode and mixed
row is also timed queued, and the queued device time is that of the same steps without the
idle gaps a synced step leaves while the host stages inputs and sets up sampling, so it is at
most the synced bracket (10% allowed for run-to-run noise) and never zero."""
import json

import pytest

pytestmark = pytest.mark.gpu


def test_queued_rows_on_the_gpu(tmp_path):
    from pdserve.cli import main
    out = tmp_path / "step.json"
    rc = main(["bench", "step", "--device", "cuda", "--models", "qwen2.5-1.5b",
               "--load-format", "dummy", "--prefill-tokens", "64", "--decode-batches", "1", "16",
               "--mixed-decodes", "4", "--chunk", "128", "--context", "256", "--reps", "5",
               "--warmup", "2", "--skip-bandwidth", "--num-kv-blocks", "512",
               "--output", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    queued = [r for r in rows if r["kind"] in ("decode", "mixed")]
    assert len(queued) == 3
    for r in queued:
        assert "error" not in r and "queued_error" not in r, r
        assert r["queued_reps"] == 7
        assert all(g is not None and g > 0 for g in r["queued_samples"]["gpu_ms"])
        assert 0 < r["queued_gpu_ms"] <= 1.1 * r["gpu_ms"]
        assert r["queued_wall_ms"] > 0
    (pre,) = [r for r in rows if r["kind"] == "prefill"]
    assert "queued_gpu_ms" not in pre       # a lone prefill is timed synced only
