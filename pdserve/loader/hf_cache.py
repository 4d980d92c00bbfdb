"""Models in a local Hugging Face cache, found by repo id as vLLM finds them ("Qwen/Qwen3-0.6B");
nothing is downloaded. The cache is huggingface_hub's layout: $HF_HUB_CACHE, else $HF_HOME/hub,
else ~/.cache/huggingface/hub; a repo is the folder models--ORG--NAME, its files under
snapshots/COMMIT/, refs/main naming the commit of the main branch."""
from __future__ import annotations

import os
import re

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_cache_dir() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache",
                                                     "huggingface")
    return os.path.join(home, "hub")


def looks_like_repo_id(spec: str) -> bool:
    return bool(_REPO_ID.match(spec)) and ".." not in spec


def cached_snapshot(repo_id: str, revision: str = "main") -> str | None:
    """The snapshot folder of repo_id at revision (a branch in refs/, or a commit) in the local
    cache; with no refs/<revision>, the only snapshot there is, if there is exactly one. None
    when the cache does not hold it."""
    repo = os.path.join(hub_cache_dir(), "models--" + repo_id.replace("/", "--"))
    snapshots = os.path.join(repo, "snapshots")
    if not os.path.isdir(snapshots):
        return None
    ref = os.path.join(repo, "refs", revision)
    if os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
    else:
        found = sorted(os.listdir(snapshots))
        commit = revision if revision in found else (found[0] if len(found) == 1 else None)
    if not commit:
        return None
    path = os.path.join(snapshots, commit)
    return path if os.path.isdir(path) else None
