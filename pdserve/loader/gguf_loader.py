"""Read Llama / Qwen2 / Qwen3 (dense) GGUF files into Hugging-Face-named float32 tensors.

``load_gguf(path)`` parses the file with ``GGUFFile`` (gguf_file.py: the metadata read
directly, the tensors memory-mapped) and returns a ``GGUFModel`` holding

* ``config``  -- a dict shaped like a Hugging Face ``config.json``;
* ``reader``  -- the ``GGUFFile``, so the tokenizer code can read the
  ``tokenizer.*`` metadata without parsing the file again;
* ``tensors()`` -- a generator of ``(hf_name, float32 tensor)`` pairs that
  dequantizes one tensor at a time, in file order.

What it does to the weights
---------------------------
* Names: GGUF names (``blk.N.attn_q.weight`` ...) are mapped to HF names
  (``model.layers.N.self_attn.q_proj.weight`` ...), see ``_LAYER_NAMES`` /
  ``_GLOBAL_NAMES``. Tensors with any other name (e.g. ``rope_freqs.weight``,
  the Llama-3.1 RoPE frequency factors, or ``blk.N.attn_rot_embd``) are
  skipped silently; they do not appear in ``tensors()``.
* Shapes: GGUF lists dimensions fastest-first (``ne0`` = in_features), the
  reader already exposes row-major data, and the result is reshaped to the HF
  shape ``[out_features, in_features]`` (1-D tensors stay 1-D).
* Types: only the types in ``SUPPORTED_GGUF_TYPES`` are dequantized (with
  ``gguf.quants.dequantize``); any other type in a mapped tensor makes
  ``load_gguf`` raise ``ValueError`` naming the tensor and the type.
* RoPE layout: llama.cpp's converter permutes the rows of ``attn_q`` /
  ``attn_k`` for the ``llama`` architecture so that rotary pairs are adjacent
  (GGML "normal" RoPE rotates (x[2i], x[2i+1])). HF Llama uses rotate-half
  (x[i], x[i + d/2]), so those rows are un-permuted here. ``qwen2`` GGUFs are
  *not* permuted: in convert_hf_to_gguf.py ``Qwen2Model`` derives from
  ``TextModel`` (not ``LlamaModel``) and its ``modify_tensors`` only renames,
  and llama.cpp runs ``LLM_ARCH_QWEN2`` with NEOX (rotate-half) RoPE, the same
  pairing as HF. They are returned as stored -- matching transformers, whose
  GGUF loader un-permutes only for ``llama``. ``qwen3`` is the same (its converter
  class derives from the Qwen2 one, llama.cpp runs it with NEOX RoPE); it adds the
  per-head norms ``blk.N.attn_q_norm`` / ``attn_k_norm`` and its head_dim comes
  from ``key_length`` (128 in Qwen3-0.6B, where hidden / heads is 64).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as _QT

from .gguf_file import GGUFFile

__all__ = [
    "GGUFModel",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_GGUF_TYPES",
    "gguf_metadata",
    "load_gguf",
]

# GGUF architecture -> (HF architectures entry, HF model_type)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# Architectures whose q/k rows llama.cpp's converter permutes (see module docstring).
_PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})

# Explicit allow-list: every type here is dequantized by gguf.quants.dequantize
# (F32/F16 natively, the rest through its per-type classes). gguf-py can also
# dequantize the IQ*/TQ*/MXFP4 families, but they are left out until tested.
SUPPORTED_GGUF_TYPES: frozenset[_QT] = frozenset(
    {
        _QT.F32,
        _QT.F16,
        _QT.BF16,
        _QT.Q8_0,
        _QT.Q4_0,
        _QT.Q4_1,
        _QT.Q5_0,
        _QT.Q5_1,
        _QT.Q2_K,
        _QT.Q3_K,
        _QT.Q4_K,
        _QT.Q5_K,
        _QT.Q6_K,
    }
)
_SUPPORTED_TYPE_NAMES = ", ".join(t.name for t in sorted(SUPPORTED_GGUF_TYPES, key=int))

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",   # qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Norms and MLP projections carry weights only; attention projections may have biases (Qwen2: q/k/v).
_BIAS_ALLOWED = frozenset({"attn_q", "attn_k", "attn_v", "attn_output"})

_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_metadata(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """The Python value of metadata field ``key``: str, int, float, bool or list; ``default`` if absent."""
    return reader.values.get(key, default)


@dataclass(frozen=True)
class _Entry:
    hf_name: str
    index: int  # position in reader.tensors
    permute_heads: int | None  # llama q/k: number of heads to un-permute with


@dataclass(frozen=True)
class GGUFModel:
    """A parsed GGUF file: HF-style ``config``, the open ``reader`` and lazy ``tensors()``."""

    config: dict
    reader: GGUFFile = field(repr=False)
    _entries: tuple[_Entry, ...] = field(default=(), repr=False)

    def tensor_names(self) -> list[str]:
        """HF names that ``tensors()`` yields, in the same order."""
        return [e.hf_name for e in self._entries]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)``: float32, HF shape, dequantized one at a time on demand.

        Every tensor is a fresh, writable CPU tensor (it does not alias the memory map).
        Unknown GGUF tensors (e.g. ``rope_freqs.weight``) are not yielded.
        """
        for e in self._entries:
            rt = self.reader.tensors[e.index]
            arr = _dequantize(rt, self.reader)
            if e.permute_heads is not None:
                arr = _unpermute_rows(arr, e.permute_heads)
            yield e.hf_name, torch.from_numpy(arr)


def _dequantize(rt: Any, reader: GGUFFile) -> np.ndarray:
    qtype = _QT(int(rt.tensor_type))
    if qtype not in SUPPORTED_GGUF_TYPES:  # load_gguf already checked; keep the guard local too
        raise ValueError(_unsupported_type_message(rt.name, qtype))
    arr = gguf.quants.dequantize(rt.data, qtype)
    shape = tuple(int(d) for d in reversed(rt.shape.tolist()))
    arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    # F32 "dequantizes" to a read-only view of the memory map: copy so the tensor owns its data.
    if not arr.flags.writeable or np.may_share_memory(arr, reader.data):
        arr = arr.copy()
    return np.ascontiguousarray(arr)


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permute (interleaved rotary pairs -> HF rotate-half layout).

    The converter does ``w.reshape(n_head, 2, r // 2, *rest).swapaxes(1, 2)`` per head
    (r = rows per head); the inverse swaps the other way. Works for 2-D weights and 1-D biases.
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    rest = w.shape[1:]
    return np.ascontiguousarray(w.reshape(n_head, half, 2, *rest).swapaxes(1, 2).reshape(w.shape))


def _unsupported_type_message(name: str, qtype: Any) -> str:
    tname = getattr(qtype, "name", str(qtype))
    return (
        f"tensor {name} has GGUF type {tname}, which pdserve cannot dequantize; "
        f"supported: {_SUPPORTED_TYPE_NAMES}"
    )


def _hf_name(gguf_name: str, n_layers: int) -> tuple[str, str | None] | None:
    """(hf_name, layer component) for a known tensor name, None for one we skip."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name], None
    m = _LAYER_RE.match(gguf_name)
    if m is None:
        return None
    layer, part, kind = int(m.group(1)), m.group(2), m.group(3)
    if part not in _LAYER_NAMES or (kind == "bias" and part not in _BIAS_ALLOWED):
        return None
    if layer >= n_layers:
        raise ValueError(f"tensor {gguf_name} refers to layer {layer}, but the file declares {n_layers} layers")
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}", part


def _open_reader(path: str) -> GGUFFile:
    if not os.path.exists(path):
        raise ValueError(f"model file {path} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"model file {path} is a directory, expected a .gguf file")
    try:
        reader = GGUFFile(path)
    except Exception as e:  # the reader raises ValueError/IndexError/struct.error/... on bad input
        raise ValueError(
            f"model file {path} is not a valid GGUF file (wrong magic, unsupported version, "
            f"or truncated/corrupt): {type(e).__name__}: {e}"
        ) from e
    size = int(reader.data.shape[0])
    for rt in reader.tensors:
        if rt.data_offset + rt.n_bytes > size or rt.data.nbytes != rt.n_bytes:
            raise ValueError(f"model file {path} is truncated: tensor {rt.name} extends past the end of the file")
    return reader


def _required_int(reader: GGUFFile, key: str, path: str) -> int:
    v = gguf_metadata(reader, key)
    if v is None:
        raise ValueError(f"model file {path} lacks required GGUF metadata {key!r}")
    if isinstance(v, list) or isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"GGUF metadata {key!r} in {path} should be a single number, got {v!r}")
    return int(v)


def _rope_scaling(reader: GGUFFile, arch: str) -> dict | None:
    rtype = gguf_metadata(reader, f"{arch}.rope.scaling.type")
    factor = gguf_metadata(reader, f"{arch}.rope.scaling.factor")
    orig = gguf_metadata(reader, f"{arch}.rope.scaling.original_context_length")
    if rtype is None:
        legacy = gguf_metadata(reader, f"{arch}.rope.scale_linear")  # older converter key
        if legacy is not None and float(legacy) != 1.0:
            rtype, factor = "linear", legacy
        elif factor is not None and float(factor) != 1.0:
            rtype = "linear"
    if rtype is None or str(rtype) == "none":
        return None
    out: dict[str, Any] = {"rope_type": str(rtype)}
    if factor is not None:
        out["factor"] = float(factor)
    if orig is not None:
        out["original_max_position_embeddings"] = int(orig)
    return out


def _build_config(reader: GGUFFile, arch: str, path: str, names: set[str]) -> dict:
    hidden = _required_int(reader, f"{arch}.embedding_length", path)
    n_layers = _required_int(reader, f"{arch}.block_count", path)
    n_heads = _required_int(reader, f"{arch}.attention.head_count", path)
    kv = gguf_metadata(reader, f"{arch}.attention.head_count_kv")
    n_kv = n_heads if kv is None else _required_int(reader, f"{arch}.attention.head_count_kv", path)
    intermediate = _required_int(reader, f"{arch}.feed_forward_length", path)
    ctx = _required_int(reader, f"{arch}.context_length", path)
    eps = gguf_metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon")
    if eps is None:
        raise ValueError(f"model file {path} lacks required GGUF metadata '{arch}.attention.layer_norm_rms_epsilon'")
    if n_heads <= 0 or n_kv <= 0 or n_heads % n_kv != 0:
        raise ValueError(f"model file {path} has inconsistent head counts: {n_heads} heads, {n_kv} KV heads")

    # head_dim: key_length is the actual per-head width; rope.dimension_count equals it for llama/qwen2.
    head_dim = gguf_metadata(reader, f"{arch}.attention.key_length")
    if head_dim is None:
        head_dim = gguf_metadata(reader, f"{arch}.rope.dimension_count")
    if head_dim is None:
        if hidden % n_heads != 0:
            raise ValueError(f"model file {path}: hidden size {hidden} is not divisible by {n_heads} heads")
        head_dim = hidden // n_heads

    vocab = gguf_metadata(reader, f"{arch}.vocab_size")
    if vocab is None:
        tok = reader.values.get("tokenizer.ggml.tokens")
        if isinstance(tok, list):
            vocab = len(tok)
    if vocab is None:
        emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if emb is None:
            raise ValueError(f"model file {path}: cannot determine vocab size (no metadata, tokens or token_embd)")
        vocab = int(emb.shape[1]) if len(emb.shape) > 1 else int(emb.shape[0])

    hf_arch, model_type = SUPPORTED_ARCHITECTURES[arch]
    bos = gguf_metadata(reader, "tokenizer.ggml.bos_token_id")
    eos = gguf_metadata(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": int(head_dim),
        "rms_norm_eps": float(eps),
        "rope_theta": float(gguf_metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": ctx,
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "rope_scaling": _rope_scaling(reader, arch),
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "torch_dtype": "float32",
    }


def load_gguf(path: str | os.PathLike) -> GGUFModel:
    """Open a Llama, Qwen2 or Qwen3 GGUF file; metadata is parsed now, tensors are read lazily.

    Raises ValueError for a missing file, a file that is not GGUF or is truncated/corrupt,
    an architecture other than llama/qwen2/qwen3, split (multi-file) GGUFs, and any mapped
    tensor whose type is not in ``SUPPORTED_GGUF_TYPES``.

    Parsing a 50k-token vocabulary takes a fraction of a second, and the last few opened
    files are kept: resolving a model's config and then loading its weights parse it once.
    """
    path = os.path.abspath(os.fspath(path))
    try:
        st = os.stat(path)
        key = (path, st.st_mtime_ns, st.st_size)
    except OSError:
        key = (path, None, None)  # _open_reader reports the missing file
    return _load_gguf_cached(key)


@functools.lru_cache(maxsize=2)
def _load_gguf_cached(key: tuple) -> GGUFModel:
    path = key[0]
    reader = _open_reader(path)

    arch = gguf_metadata(reader, "general.architecture")
    if arch is None:
        raise ValueError(f"model file {path} has no 'general.architecture' metadata")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model file {path} has GGUF architecture {arch!r}, which pdserve does not support; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    split_count = gguf_metadata(reader, "split.count", 1)
    if isinstance(split_count, int) and split_count > 1:
        raise ValueError(f"model file {path} is one part of a {split_count}-file split GGUF; merge it first")

    names = {rt.name for rt in reader.tensors}
    config = _build_config(reader, arch, path, names)

    entries: list[_Entry] = []
    for i, rt in enumerate(reader.tensors):
        mapped = _hf_name(rt.name, config["num_hidden_layers"])
        if mapped is None:
            continue  # unknown tensor (e.g. rope_freqs.weight): skipped on purpose
        hf_name, part = mapped
        try:
            qtype = _QT(int(rt.tensor_type))
        except ValueError:
            qtype = int(rt.tensor_type)
        if qtype not in SUPPORTED_GGUF_TYPES:
            raise ValueError(_unsupported_type_message(rt.name, qtype))
        heads = None
        if arch in _PERMUTED_QK_ARCHITECTURES and part in ("attn_q", "attn_k"):
            heads = config["num_attention_heads"] if part == "attn_q" else config["num_key_value_heads"]
            rows = int(rt.shape[-1]) if len(rt.shape) > 1 else int(rt.shape[0])
            if rows % (2 * heads) != 0:
                raise ValueError(
                    f"tensor {rt.name} has {rows} rows, which cannot be split into {heads} heads of rotary pairs"
                )
        entries.append(_Entry(hf_name, i, heads))

    return GGUFModel(config=config, reader=reader, _entries=tuple(entries))
