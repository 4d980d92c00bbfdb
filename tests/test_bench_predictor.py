"""`pdserve bench predictor` with a small count: it writes its JSON, its scores of the predictor
agree with the predictor's own prequential stats (lag 0: nothing is learned between a
prediction and its outcome), and its nanoPD baseline behaves as nanoPD's scheme does."""
import json

import pytest

from pdserve.bench.predictor import NanoPDScheme, main, synthetic_workload
from pdserve.cli import main as cli_main


def test_bench_predictor_small_run(tmp_path):
    out = tmp_path / "pred.json"
    rc = cli_main(["bench", "predictor", "--num-requests", "300", "--lag", "0", "--first", "50",
                   "--output", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["command"][:3] == ["pdserve", "bench", "predictor"]
    assert "git_commit" in r and "hardware" in r
    assert set(r["results"]) == {"mixed", "independent", "drift"}
    for res in r["results"].values():
        assert res["requests"] == 300
        sc, st = res["scores"], res["prequential_stats"]
        assert set(sc) == {"predictor", "global_mean", "nanopd", "nanopd_capped"}
        assert st["observations"] == 300
        assert sc["predictor"]["mae"] == pytest.approx(st["mae"])
        assert sc["global_mean"]["mae"] == pytest.approx(st["baseline_mae"])
        assert res["predictor_over_global_mean"] == pytest.approx(
            sc["predictor"]["mae"] / sc["global_mean"]["mae"])
        assert res["predict_us_mean"] > 0 and res["observe_us_mean"] > 0


def test_workload_is_seeded_and_capped():
    a = synthetic_workload("mixed", 500, seed=4)
    assert a == synthetic_workload("mixed", 500, seed=4)
    assert a != synthetic_workload("mixed", 500, seed=5)
    capped = [r for r in a if r.max_tokens is not None]
    assert 100 < len(capped) < 200                      # --capped-share 0.3 of 500
    assert all(r.output_len <= r.max_tokens for r in capped)
    with pytest.raises(ValueError, match="workload"):
        synthetic_workload("nope", 3, 0)


def test_nanopd_scheme_by_hand():
    s = NanoPDScheme()
    assert s.predict(100) == 256                         # nothing seen: its default
    for out in (10, 20, 30, 40):
        s.observe(100, out)                              # bucket (64, 128]
    s.observe(3000, 400)                                 # the last bucket
    assert s.predict(100) == round((10 + 20 + 30 + 40 + 400) / 5)   # 4 < 5 samples: global
    s.observe(70, 50)
    assert s.predict(128) == 30                          # 5 samples: (10+20+30+40+50) / 5
    assert s.predict(129) == round(550 / 6)              # next bucket, empty: global mean


def test_bench_predictor_rejects_bad_counts(capsys):
    assert main(["--num-requests", "0"]) == 2
    assert "--num-requests must be >= 1" in capsys.readouterr().err
