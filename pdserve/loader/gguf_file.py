"""A GGUF file opened for loading: its key/value metadata (parsed by :class:`GGUFMetadata`) and
its tensors as numpy views into a read-only memory map.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array, which takes
seconds for a 50k-token vocabulary and its merges (about 3.5 s for the embedded SmolLM2, once in
every process that loads it: the server and each of its workers). This reads the same layout
directly: the header, the key/value section, the tensor infos, the alignment padding, then the
data section. Tensors come in file order as :class:`GGUFTensor`, with the fields of gguf's
``ReaderTensor`` that the loader reads and the same ``data`` view (quantized types as bytes,
[rows..., bytes per row]; F16/F32/F64/I* typed, shape reversed from GGUF's fastest-first dims).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .gguf_kv import GGUFMetadata

__all__ = ["GGUFFile", "GGUFTensor"]

_SUPPORTED_VERSIONS = (2, 3)  # what gguf.GGUFReader reads
_DEFAULT_ALIGNMENT = 32
_UINT32 = 4  # GGUF value type of general.alignment

# unquantized types: their numpy element type (every other type is viewed as bytes)
_PLAIN = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # GGUF dims, fastest first (ne0 = in_features), uint64
    n_elements: int
    n_bytes: int
    data_offset: int   # in the file
    data: np.ndarray   # a view into the memory map (see the module docstring), read-only


class GGUFFile(GGUFMetadata):
    """``values`` / ``types`` (the key/value metadata), ``tensors`` and ``data`` (the whole file,
    memory-mapped read-only). Raises ValueError for a file that is not GGUF, a version other
    than 2 or 3, a bad alignment, an unknown tensor type or a duplicated tensor name; a
    truncated file raises whatever reading past its end raises (struct.error, IndexError,
    ValueError), or gives tensors whose ``data`` is shorter than ``n_bytes``."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        if self.version not in _SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {self.version} is not supported")
        self.data = np.memmap(path, mode="r")
        end = self.byte_order
        u32, u64 = np.dtype(end + "u4"), np.dtype(end + "u8")
        # plain ndarray views: numpy ops on memmap views pay a memmap __array_finalize__ each,
        # a third of the time gguf.quants.dequantize takes over a whole model
        buf = self.data.view(np.ndarray)

        def read(pos: int, dtype: np.dtype, count: int = 1) -> np.ndarray:
            if pos + dtype.itemsize * count > buf.shape[0]:
                raise ValueError("the file ends inside its tensor infos")
            return np.frombuffer(buf, dtype=dtype, count=count, offset=pos)

        infos = []
        pos = self.kv_end
        for _ in range(self.tensor_count):
            n = int(read(pos, u64)[0])
            if pos + 8 + n > buf.shape[0]:
                raise ValueError("the file ends inside its tensor infos")
            name = bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8")
            pos += 8 + n
            n_dims = int(read(pos, u32)[0])
            dims = read(pos + 4, u64, n_dims).astype(np.uint64)
            pos += 4 + 8 * n_dims
            raw_type = int(read(pos, u32)[0])
            offset = int(read(pos + 4, u64)[0])
            pos += 12
            infos.append((name, dims, raw_type, offset))

        self.alignment = _DEFAULT_ALIGNMENT
        if "general.alignment" in self.values:
            if self.types["general.alignment"] != _UINT32:
                raise ValueError("bad type for general.alignment")
            self.alignment = int(self.values["general.alignment"])
            if self.alignment == 0 or self.alignment & (self.alignment - 1):
                raise ValueError("invalid alignment: must be a non-zero power of two")
        pos += -pos % self.alignment
        self.data_offset = pos

        self.tensors: list[GGUFTensor] = []
        seen: set[str] = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise ValueError(f"duplicated tensor {name}")
            seen.add(name)
            qtype = GGMLQuantizationType(raw_type)  # ValueError for a type gguf does not know
            n_elements = int(np.prod(dims))
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            n_bytes = n_elements * type_size // block_size
            start = pos + offset
            np_dims: tuple[int, ...] = tuple(int(d) for d in reversed(dims.tolist()))
            if qtype in _PLAIN:
                dtype, count = np.dtype(_PLAIN[qtype]).newbyteorder(end), n_elements
            else:
                dtype, count = np.dtype(np.uint8), n_bytes
                if np_dims:
                    if np_dims[-1] % block_size:
                        raise ValueError(f"tensor {name}: a row of {np_dims[-1]} is not a "
                                         f"whole number of {qtype.name} blocks")
                    np_dims = (*np_dims[:-1], np_dims[-1] // block_size * type_size)
            # past the end: a shorter view (the caller's truncation check compares with n_bytes)
            stop = min(buf.shape[0], start + count * dtype.itemsize)
            data = buf[min(start, stop):stop].view(np.uint8)
            data = data[:len(data) // dtype.itemsize * dtype.itemsize].view(dtype)
            if data.shape[0] == count:
                data = data.reshape(np_dims)
            self.tensors.append(GGUFTensor(name, qtype, dims, n_elements, n_bytes, start, data))
