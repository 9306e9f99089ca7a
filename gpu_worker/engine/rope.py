"""Rotary position embeddings (HF's non-interleaved layout) and the frequency scalings we serve.

`scaling` is the dict `ModelConfig.rope_scaling` holds (empty for plain RoPE), in the form its `rope_type` names:

- "linear", "llama3", "yarn": HF's `rope_parameters` (or older `rope_scaling`) from config.json, computed as
  transformers' `modeling_rope_utils` computes them; GGUF files with `rope.scaling.type` linear or yarn map their
  metadata to the same dicts (`gguf/checkpoint.py`).
- "freq_factors": `factors`, one divisor per frequency. llama.cpp's converter stores Llama 3's scaling so, as the
  `rope_freqs` tensor it computes from the HF llama3 parameters; ggml divides each frequency by its factor.
- "longrope" (Phi-3, Phi-3.5, Phi-4-mini): `short_factor` and `long_factor` divide the frequencies,
  `original_max_position_embeddings` says where the long ones start, and `factor` (which `ModelConfig` fills in
  from max_position_embeddings as transformers does) gives the attention factor unless `attention_factor` is set.
  transformers picks one set for a whole sequence: the long one once it is longer than the original context (a
  longer prompt from its first token; a generation that crosses it drops its cache and prefills again, in Phi-3's
  `prepare_inputs_for_generation`). A cached key must not depend on what comes after it (prefix caching, chunked
  prefill), so we pick per position instead: a token at position p is rotated by the long factors iff
  p >= original_max_position_embeddings. That equals transformers while a sequence stays within the original
  context; past it our keys below the original context stay short, so from there on outputs can differ.

YaRN and longrope also scale cos and sin by an attention factor; every other form leaves them unscaled.

`partial_rotary_factor` < 1 (Phi-4-mini) rotates the first `rotary_dim` dims of each head, pairing dim i with
i + rotary_dim / 2 as transformers' `rotate_half` does. Our kernels rotate whole heads, pairing i with
i + head_dim / 2; the loader reorders q's and k's rows within each head (`head_order`: a q.k product is the same
under one permutation of both), and the dims that are not rotated get frequency 0 (cos 1, sin 0) and no attention
factor.
"""

from __future__ import annotations

import math

import torch

from services.text.errors import ModelLoadError

SUPPORTED = ("default", "linear", "llama3", "yarn", "freq_factors", "longrope")


def rotary_dim(head_dim: int, scaling: dict) -> int:
    """The dims of each head that are rotated: all of them unless `partial_rotary_factor` says less."""
    factor = scaling.get("partial_rotary_factor", 1.0)
    dim = int(head_dim * factor)  # int() as transformers rounds it
    if dim % 2 or not 0 < dim <= head_dim:
        raise ModelLoadError(f"partial_rotary_factor {factor} of head_dim {head_dim} rotates {dim} dims; "
                             "tokenfleet needs an even number of them, at least 2")
    return dim


def rotary_parameters(head_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] in float32, the factor cos and sin are multiplied by), in
    transformers' layout; for longrope, the short factors' frequencies."""
    dim = rotary_dim(head_dim, scaling)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling), 1.0
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    if rope_type == "yarn":
        return _yarn(dim, theta, scaling)
    if rope_type == "longrope":
        short, _, attention_factor = longrope_parameters(dim, theta, scaling)
        return short, attention_factor
    raise ModelLoadError(f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED)}")


def longrope_parameters(dim: int, theta: float, s: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(short frequencies, long frequencies, attention factor): transformers' `_compute_longrope_parameters`,
    operation for operation, over the `dim` rotated dims."""
    original, factor = s.get("original_max_position_embeddings"), s.get("factor")
    if original is None or factor is None or "short_factor" not in s or "long_factor" not in s:
        raise ModelLoadError("longrope rope scaling needs `short_factor`, `long_factor`, `factor` and "
                             f"`original_max_position_embeddings`; got {s}")
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short, long = (torch.tensor(s[key], dtype=torch.float32) for key in ("short_factor", "long_factor"))
    if short.shape != (dim // 2,) or long.shape != (dim // 2,):
        raise ModelLoadError(f"longrope needs {dim // 2} short and long factors (one per rotated frequency); got "
                             f"{tuple(short.shape)} and {tuple(long.shape)}")
    return 1.0 / (short * theta**shape), 1.0 / (long * theta**shape), float(attention_factor)


def head_order(head_dim: int, scaling: dict) -> torch.Tensor | None:
    """Which of transformers' dims each of ours holds, within a q or k head, so that its rotary pairs (i,
    i + r/2), i < r/2, sit on our kernels' pairs (i, i + head_dim/2), the dims not rotated filling the rest, half
    on each side. None where the whole head is rotated (no reordering)."""
    r = rotary_dim(head_dim, scaling)
    if r == head_dim:
        return None
    rest = (head_dim - r) // 2
    return torch.cat([torch.arange(0, r // 2), torch.arange(r, r + rest), torch.arange(r // 2, r),
                      torch.arange(r + rest, head_dim)])


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dim: int, theta: float, s: dict) -> tuple[torch.Tensor, float]:
    """transformers' `_compute_yarn_parameters` (5.x), operation for operation so that float32 rounding agrees.

    Where transformers versions differ, this follows 5.x: `truncate` (absent before 4.56, which always rounded the
    correction range outwards as the default True does), and an attention factor from `mscale` / `mscale_all_dim`
    (absent before 4.45, which used 0.1 ln(factor) + 1 alone). transformers fills a missing `factor` or
    `original_max_position_embeddings` from `max_position_embeddings`, which this dict does not carry: such a
    config is refused rather than guessed at.
    """
    factor, original = s.get("factor"), s.get("original_max_position_embeddings")
    if factor is None or original is None:
        raise ModelLoadError("yarn rope scaling needs `factor` and `original_max_position_embeddings` in the "
                             f"model's rope parameters; got {s}")
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        """The dimension whose frequency turns `rotations` times over the original context."""
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does, against a division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1 for the fast dimensions, which keep their frequencies

    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction, eq. 21 of the paper: 0.1 * mscale * ln(factor) + 1, none below factor 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RotaryEmbedding(torch.nn.Module):
    """cos and sin [T, head_dim] for our kernels' layout: frequency j pairs dims j and j + head_dim / 2."""

    def __init__(self, head_dim: int, theta: float, scaling: dict):
        super().__init__()
        inv_freq, self.attention_factor = rotary_parameters(head_dim, theta, scaling)
        unrotated = head_dim // 2 - inv_freq.shape[0]  # partial rotary: frequency 0 leaves those dims be
        self.register_buffer("inv_freq", _padded(inv_freq, unrotated), persistent=False)
        self.long_from = None  # longrope: the first position rotated by the long factors
        if scaling.get("rope_type") == "longrope":
            _, long, _ = longrope_parameters(rotary_dim(head_dim, scaling), theta, scaling)
            self.register_buffer("long_inv_freq", _padded(long, unrotated), persistent=False)
            self.long_from = scaling["original_max_position_embeddings"]
        # The attention factor scales the rotated dims alone, as transformers leaves the rest as they are.
        half = torch.cat([torch.full((inv_freq.shape[0],), self.attention_factor), torch.ones(unrotated)])
        self.register_buffer("scale", torch.cat((half, half)), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Computed in float32 per step, as HF does, so that bf16 rounding matches the reference.
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        if self.long_from is not None:  # per position, so a key never changes once cached (module docstring)
            long = positions.float()[:, None] * self.long_inv_freq[None, :]
            freqs = torch.where(positions[:, None] >= self.long_from, long, freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:  # YaRN's or longrope's, applied in float32 as HF does
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)  # [T, head_dim]


def _padded(inv_freq: torch.Tensor, zeros: int) -> torch.Tensor:
    return torch.cat([inv_freq, torch.zeros(zeros)])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
