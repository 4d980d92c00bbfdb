"""`pdserve bench kv-tier` on CPU: its host-id patterns (hand-listed) and one tiny run's file
(no speed asserted: a benchmark measures, tests check what it measures)."""
import json

import pytest

from pdserve.bench import kv_tier


def test_host_id_patterns():
    assert kv_tier.host_ids("runs", 3) == [0, 1, 2]
    assert kv_tier.host_ids("scattered", 3) == [0, 2, 4]
    assert kv_tier.host_ids("runs:3", 7) == [0, 1, 2, 4, 5, 6, 8]
    assert kv_tier.host_ids("runs:1", 3) == [0, 2, 4]          # (scattered, by another name)
    assert kv_tier.host_ids("runs:16", 16) == list(range(16))
    for pattern in ("runs", "scattered", "runs:1", "runs:5"):
        for n in (1, 7, 64):
            ids = kv_tier.host_ids(pattern, n)
            assert len(set(ids)) == n and max(ids) < 2 * n      # (the bench's pool: 2n blocks)


@pytest.mark.parametrize("bad", ["runs:0", "runs:", "runs:x", "dense"])
def test_a_bad_pattern_is_refused(bad, capsys):
    with pytest.raises(SystemExit) as e:
        kv_tier.build_parser().parse_args(["--patterns", bad])
    assert e.value.code == 2 and "runs:K" in capsys.readouterr().err


def test_a_tiny_run_writes_every_point(tmp_path):
    out = tmp_path / "kv.json"
    assert kv_tier.main(["--device", "cpu", "--blocks", "3", "8", "--layers", "2", "--kv-heads",
                         "1", "--head-dim", "8", "--block-size", "4", "--dtype", "float32",
                         "--patterns", "runs", "runs:2", "--reps", "1", "--output", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["block_bytes"] == 2 * 2 * 4 * 1 * 8 * 4
    got = sorted((p["blocks"], p["pattern"], p["direction"]) for p in d["points"])
    assert got == sorted((n, pat, dr) for n in (3, 8) for pat in ("runs", "runs:2")
                         for dr in ("to_host", "to_device"))
    for p in d["points"]:
        assert p["bytes"] == p["blocks"] * d["block_bytes"] and p["gb_per_s"] > 0
