"""Writing result files (plain Python): JSON replaced atomically, parent folders created."""
from __future__ import annotations

import json
import os
from typing import Any


def write_json(path: str | os.PathLike, payload: Any, allow_nan: bool = True) -> str:
    """Write payload as indented JSON (values JSON cannot hold as their str); a reader never
    sees half a file. Returns the path written."""
    path = os.fspath(path)
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, allow_nan=allow_nan, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path
