"""pdserve bench grammar on the embedded tokenizer (llguidance only: xgrammar is not a
dependency): the result file has its numbers, every walk that ended validates against its
schema (jsonschema), and the keywords llguidance does not enforce are reported as refused."""
import json

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("jsonschema")


def test_bench_grammar_llguidance(tmp_path):
    from pdserve.bench.grammar import main
    out = tmp_path / "g.json"
    assert main(["--engines", "llguidance", "--schemas", "6", "--max-steps", "48",
                 "--output", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["benchmark"] == "grammar" and d["vocab_size"] == 49152
    (r,) = d["results"]
    assert r["engine"] == "llguidance" and r["schemas"] == 6 and not r["refused"]
    assert r["walks_parsed"] == r["walks_valid"] == r["walks_ended"] > 0
    assert r["tokens_rejected_after_mask"] == 0
    assert r["mask_ms"]["n"] > 0 and r["compile_ms"]["n"] == 6
    assert r["features"]["not"].startswith("refused") and r["features"]["anyOf"] == "compiled"


def test_bench_grammar_bad_args():
    from pdserve.bench.grammar import main
    assert main(["--schemas", "0"]) == 2
