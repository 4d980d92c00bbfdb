"""Models by Hugging Face repo id from a local cache (huggingface_hub's layout, built here by
hand: models--ORG--NAME/refs/main naming a snapshot folder), as vLLM resolves them; nothing is
downloaded, and a repo the cache lacks is a ValueError that says so."""
import os

import pytest

from pdserve import LLM, SamplingParams
from pdserve.loader.hf_cache import cached_snapshot, hub_cache_dir
from pdserve.loader.model_loader import resolve_source

from .utils import save_tiny_hf_model


def _repo(cache, repo_id, commits, main=None):
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for c in commits:
        (repo / "snapshots" / c).mkdir(parents=True)
    if main is not None:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(main + "\n")
    return repo


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == str(tmp_path / "home" / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub_cache_dir() == str(tmp_path / "c")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HF_HOME")
    assert hub_cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub")


def test_snapshot_by_ref_or_the_only_one(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    repo = _repo(tmp_path, "org/a", ["c1", "c2"], main="c2")
    assert cached_snapshot("org/a") == str(repo / "snapshots" / "c2")
    assert cached_snapshot("org/a", "c1") == str(repo / "snapshots" / "c1")
    repo = _repo(tmp_path, "org/b", ["only"])
    assert cached_snapshot("org/b") == str(repo / "snapshots" / "only")
    _repo(tmp_path, "org/c", ["x", "y"])          # two snapshots, no ref: ambiguous
    assert cached_snapshot("org/c") is None
    _repo(tmp_path, "org/d", ["x"], main="gone")  # the ref names a missing snapshot
    assert cached_snapshot("org/d") is None
    assert cached_snapshot("org/none") is None


def test_a_cached_repo_loads_like_its_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = _repo(tmp_path / "hub", "tiny-org/tiny-qwen2", ["abc123"], main="abc123")
    snap = repo / "snapshots" / "abc123"
    save_tiny_hf_model(snap, "qwen2")
    src = resolve_source("tiny-org/tiny-qwen2")
    assert src.kind == "hf" and src.path == str(snap)
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 13, 2]}
    by_id = LLM("tiny-org/tiny-qwen2", skip_tokenizer_init=True).generate(prompt, p, use_tqdm=False)
    by_path = LLM(str(snap), skip_tokenizer_init=True).generate(prompt, p, use_tqdm=False)
    assert by_id[0].outputs[0].token_ids == by_path[0].outputs[0].token_ids


def test_a_repo_the_cache_lacks_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="downloads nothing.*huggingface-cli download org/x"):
        resolve_source("org/x")
    with pytest.raises(ValueError, match="neither a file, a folder nor a preset"):
        resolve_source("not-a-repo-or-preset")
