"""Result files (plain Python): JSON written atomically with its parent folders, and read back
as an object with errors that name the file."""
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


def read_json_object(path: str | os.PathLike, what: str) -> dict:
    """The JSON object in the file at path; ValueError naming it (`what`: how the caller
    refers to it, e.g. "profile") when it cannot be read, is not JSON or is not an object."""
    where = os.fspath(path)
    try:
        with open(where) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"{where}: cannot read the {what}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a {what} is a JSON object, got {type(data).__name__}")
    return data
