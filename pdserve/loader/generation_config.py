"""The model's default sampling values, from its generation_config.json, as vLLM takes them
(`--generation-config`): "auto" reads the model folder's file, "vllm" ignores it (pdserve's own
defaults), a folder reads that folder's. Of the file, the values vLLM takes: temperature,
top_p, top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens (the default output
length of a request that gives none). A request's own values override them (the server's
protocol.sampling_params, LLM.get_default_sampling_params). Plain Python: no torch."""
from __future__ import annotations

import json
import os

from ..sampling_params import SamplingParams

GENERATION_CONFIG_MODES = ("auto", "vllm")
FILE_NAME = "generation_config.json"
# the file's key -> SamplingParams' field (vLLM's get_diff_sampling_param)
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def _model_folder(model) -> str | None:
    """The folder of an HF checkpoint given as a folder or a cached repo id; None for the
    embedded model, a .gguf file or a preset (no generation_config.json)."""
    if model is None:
        return None
    spec = os.fspath(model)
    if os.path.isdir(spec):
        return spec
    from .hf_cache import cached_snapshot, looks_like_repo_id
    if not os.path.exists(spec) and looks_like_repo_id(spec):
        return cached_snapshot(spec)
    return None


def generation_defaults(generation_config: str, model=None) -> tuple[dict, str | None]:
    """(SamplingParams field -> default value, the file they came from or None). Raises
    ValueError, naming the folder or file, for a folder that does not exist or holds no
    generation_config.json, a file that is not a JSON object, or a value SamplingParams
    refuses. "auto" with a model that has no file gives no defaults."""
    if generation_config == "vllm":
        return {}, None
    if generation_config == "auto":
        folder = _model_folder(model)
        if folder is None or not os.path.isfile(os.path.join(folder, FILE_NAME)):
            return {}, None
    else:
        folder = os.fspath(generation_config)
        if not os.path.isdir(folder):
            raise ValueError(f"generation_config {folder!r} is neither 'auto', 'vllm' nor a "
                             "folder")
        if not os.path.isfile(os.path.join(folder, FILE_NAME)):
            raise ValueError(f"generation_config folder {folder!r} has no {FILE_NAME}")
    path = os.path.join(folder, FILE_NAME)
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
    out = {field: cfg[key] for key, field in _KEYS.items() if cfg.get(key) is not None}
    if out.get("top_k") == 0:   # (Hugging Face's "no top-k"; ours is -1)
        out["top_k"] = -1
    try:
        SamplingParams(**out)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None
    return out, path

