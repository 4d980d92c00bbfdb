"""scripts/bench_prefix_match.py, small: each case matches what its construction says it shares
with the tree, the rounds are summarized, and the JSON carries them."""
import importlib.util
import json


def _load():
    spec = importlib.util.spec_from_file_location("bench_prefix_match",
                                                  "scripts/bench_prefix_match.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cases_match_what_they_share_and_rounds_are_summarized(tmp_path):
    """A 256-token prompt: hit = the whole prompt cached, matched up to the limit (len - 1 =
    255); partial = the 192-token long conversation; miss = 0; diverge = the 128 shared tokens.
    Two rounds: each case lists both rounds' medians, and the summary's median is theirs."""
    out = tmp_path / "pm.json"
    assert _load().main(["--conversations", "20", "--conv-tokens", "40", "--systems", "4",
                         "--system-tokens", "16", "--prompt-tokens", "256",
                         "--cached-tokens", "192", "--diverge-at", "128", "--iterations", "5",
                         "--warmup", "1", "--rounds", "2", "--output", str(out)]) == 0
    got = json.loads(out.read_text())
    by_case = {r["case"].split()[0]: r for r in got["results"]}
    assert {c: by_case[c]["matched_tokens"] for c in ("hit", "partial", "miss", "diverge")} == \
        {"hit": 255, "partial": 192, "miss": 0, "diverge": 128}
    assert by_case["manager"]["matched_tokens"] == 192
    for r in got["results"]:
        assert len(r["round_medians_us"]) == 2 and len(r["round_floors_us"]) == 2
        assert r["median_us"] == round(sum(r["round_medians_us"]) / 2, 2)
        assert r["rounds_within_target"] == sum(m <= 50.0 for m in r["round_medians_us"])
    assert got["config"]["rounds"] == 2 and "command" in got and "hardware" in got
