"""GGUF key/value metadata for the tokenizer: a direct parser of a file's key/value section
(:class:`GGUFMetadata`, no tensor data touched) and :func:`gguf_get`, one accessor over it and over
a ``gguf.GGUFReader``."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["GGUFMetadata", "gguf_get"]

# ---------------------------------------------------------------------------------------------
# GGUF metadata access
# ---------------------------------------------------------------------------------------------

def _field_value(field: Any) -> Any:
    """Python value of a gguf ReaderField (scalar, string, or array of either)."""
    contents = getattr(field, "contents", None)
    if callable(contents):
        return contents()
    # Older gguf-py: decode parts by hand.
    import gguf  # local import: only needed for the type enum

    types = list(field.types)
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) > 1 and types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def gguf_get(reader: Any, key: str, default: Any = None) -> Any:
    """The value of metadata ``key`` (str, int, float, bool or list) from a :class:`GGUFMetadata`
    or a ``gguf.GGUFReader``; ``default`` if absent."""
    if isinstance(reader, GGUFMetadata):
        return reader.values.get(key, default)
    field = reader.fields.get(key)
    if field is None:
        return default
    return _field_value(field)


# GGUF value type -> struct format character (tokenizer arrays are read with numpy).
_GGUF_SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class GGUFMetadata:
    """Key/value metadata of a GGUF file, parsed directly (tensor data is never touched).

    ``gguf.GGUFReader`` builds numpy views for every element of every array, which takes
    seconds for a 50k-token vocabulary; reading the key/value section with ``struct``/numpy
    takes a fraction of that.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        import mmap
        import struct

        import numpy as np

        self.values: dict[str, Any] = {}
        self.types: dict[str, int] = {}  # key -> its GGUF value type
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise ValueError(f"{str(path)!r} is not a GGUF file")
            (version,) = struct.unpack_from("<I", buf, 4)
            end = "<" if version & 0xFFFF else ">"  # a big-endian file reads as a huge version
            (version,) = struct.unpack_from(end + "I", buf, 4)
            if version < 2:
                raise ValueError(f"GGUF version {version} is not supported")
            self.version, self.byte_order = version, end
            self.tensor_count, kv_count = struct.unpack_from(end + "QQ", buf, 8)
            pos = 24
            u64 = struct.Struct(end + "Q")
            u32 = struct.Struct(end + "I")

            def read_str(pos: int) -> tuple[str, int]:
                (n,) = u64.unpack_from(buf, pos)
                pos += 8
                return buf[pos:pos + n].decode("utf-8", errors="replace"), pos + n

            def read_value(vtype: int, pos: int) -> tuple[Any, int]:
                if vtype == _GGUF_STRING:
                    return read_str(pos)
                if vtype == _GGUF_ARRAY:
                    (itype,) = u32.unpack_from(buf, pos)
                    (count,) = u64.unpack_from(buf, pos + 4)
                    pos += 12
                    if itype == _GGUF_STRING:
                        items = []
                        for _ in range(count):
                            item, pos = read_str(pos)
                            items.append(item)
                        return items, pos
                    if itype in _GGUF_SCALAR_FMT:
                        dtype = np.dtype(_GGUF_SCALAR_FMT[itype]).newbyteorder(end)
                        arr = np.frombuffer(buf, dtype=dtype, count=count, offset=pos)
                        return arr.tolist(), pos + count * dtype.itemsize
                    items = []
                    for _ in range(count):
                        item, pos = read_value(itype, pos)
                        items.append(item)
                    return items, pos
                fmt = _GGUF_SCALAR_FMT.get(vtype)
                if fmt is None:
                    raise ValueError(f"unknown GGUF value type {vtype}")
                (value,) = struct.unpack_from(end + fmt, buf, pos)
                return value, pos + struct.calcsize(fmt)

            for _ in range(kv_count):
                key, pos = read_str(pos)
                (vtype,) = u32.unpack_from(buf, pos)
                value, pos = read_value(vtype, pos + 4)
                self.values[key] = value
                self.types[key] = vtype
            self.kv_end = pos  # where the tensor infos start
