"""Rotary position embedding (rotate-half / NeoX pairing, as HF Llama, Mistral and Qwen2 use), with
the config's theta and the `linear`, `llama3` and `yarn` frequency scalings (HF transformers'
definitions, whose defaults models/config.py resolves). The module only owns the cos|sin table; the
attention backend applies it (fused with the KV store on GPU).

YaRN also scales cos and sin by an attention factor (so q·k grows by its square); it is folded
into the table, which is why both backends get it without knowing about it."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

ROPE_TYPES = ("linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """A frequency scaling with every default already resolved. Fields a type does not use keep
    their defaults and are ignored: llama3 reads low/high_freq_factor, yarn beta_fast/beta_slow,
    attention_factor and truncate; both read original_max_position_embeddings."""
    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {self.rope_type!r} is not supported; pdserve supports "
                             f"default, {', '.join(ROPE_TYPES)}")
        for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                     "attention_factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v <= 0:
                raise ValueError(f"rope scaling: {name} must be a positive number, got {v!r}")
        if self.rope_type in ("llama3", "yarn"):
            o = self.original_max_position_embeddings
            if isinstance(o, bool) or not isinstance(o, int) or o < 1:
                raise ValueError(f"rope scaling ({self.rope_type}): original_max_position_embeddings "
                                 f"must be a positive integer, got {o!r}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"rope scaling (llama3): high_freq_factor ({self.high_freq_factor}) must "
                             f"exceed low_freq_factor ({self.low_freq_factor})")


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], float64."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / theta ** exponents
    if scaling is None:
        return inv_freq
    factor = scaling.factor
    if scaling.rope_type == "linear":
        return inv_freq / factor
    if scaling.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        old_len = float(scaling.original_max_position_embeddings)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
        return torch.where(wavelen < old_len / high, inv_freq, out)
    # yarn: dimensions that turn fewer than beta_slow times over the original context are
    # interpolated (divided by factor), those that turn more than beta_fast times are kept, with a
    # linear ramp over the dimension index between the two.
    lo, hi = _yarn_ramp_bounds(head_dim, theta, scaling)
    if lo == hi:
        hi += 0.001  # the ramp's width must not be zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _yarn_ramp_bounds(head_dim: int, theta: float, s: RopeScaling) -> tuple[float, float]:
    """Dimension indices (of the full head_dim) where the ramp starts and ends: the dimension whose
    frequency turns `n` times over the original context is d(n) = D ln(L / 2πn) / 2 ln(θ)."""
    length = s.original_max_position_embeddings

    def dim_of(turns: float) -> float:
        return head_dim * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    return max(lo, 0), min(hi, head_dim - 1)


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by (1 except for yarn)."""
    return scaling.attention_factor if scaling is not None and scaling.rope_type == "yarn" else 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: RopeScaling | None = None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        mscale = rope_attention_factor(scaling)
        # cos|sin table [max_position, head_dim]: first half cos, second half sin, float32.
        table = torch.cat([freqs.cos(), freqs.sin()], -1) * mscale
        self.register_buffer("cos_sin", table.float(), persistent=False)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    """q: [T, H, D], k: [T, Hkv, D]; returns rotated copies in the input dtype."""
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)
