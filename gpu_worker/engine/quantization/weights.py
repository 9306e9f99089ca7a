"""Quantized weights in one canonical form per scheme, whatever file they came from, and the quantizers.

`Int8Weight`: per-output-channel symmetric, w = q * scale.
`Int4Weight`: asymmetric, group-wise along the input dimension, w = (q - 8) * scale + zero: the convention of
torch's int4 kernels. GPTQ's and AWQ's s * (q - z) is the same weight with zero = s * (8 - z), and in float32
that product and the dequantized weight are exact, so no file format loses a bit on the way in.

Weights are [N, K] as in `nn.Linear` (out, in). Scales and zeros are float32 values that are exact in bfloat16
when we quantize (the kernels take bf16 scales), and whatever the file held when a checkpoint brought them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_OFFSET = 8  # the midpoint of 0..15 that `zero` is measured from


@dataclass
class Int8Weight:
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N]

    bits = 8

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows `ids` (an embedding lookup), float32."""
        return self.q[ids].float() * self.scale[ids, None]

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.numel() * 2  # scales are served in 16 bits

    def to(self, device: torch.device) -> Int8Weight:
        return Int8Weight(self.q.to(device), self.scale.to(device))


@dataclass
class Int4Weight:
    packed: torch.Tensor  # uint8 [N, K/2]: input k = 2i in the low nibble of byte i, 2i + 1 in the high one
    scale: torch.Tensor  # float32 [N, K/G]
    zero: torch.Tensor  # float32 [N, K/G]
    group_size: int
    # GPTQ act-order: column k of `packed` holds input channel input_perm[k], which makes each group contiguous;
    # kernels read x[:, input_perm]. None: the identity.
    input_perm: torch.Tensor | None = None

    bits = 4

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], self.packed.shape[1] * 2))

    @property
    def q(self) -> torch.Tensor:
        """uint8 [N, K] values 0..15, in `packed` column order."""
        return unpack_nibbles(self.packed)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] in the original input order."""
        w = self._dequantize_rows(self.q, self.scale, self.zero)
        if self.input_perm is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.input_perm, w)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.input_perm is not None:
            raise ValueError("an act-order (permuted) weight cannot serve as an embedding")
        return self._dequantize_rows(unpack_nibbles(self.packed[ids]), self.scale[ids], self.zero[ids])

    def _dequantize_rows(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        g = self.group_size
        return (q.float() - INT4_OFFSET) * scale.repeat_interleave(g, 1) + zero.repeat_interleave(g, 1)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + (self.scale.numel() + self.zero.numel()) * 2

    def to(self, device: torch.device) -> Int4Weight:
        perm = None if self.input_perm is None else self.input_perm.to(device)
        return Int4Weight(self.packed.to(device), self.scale.to(device), self.zero.to(device), self.group_size, perm)


@dataclass
class Fp8Weight:
    """float8 e4m3 values with a scale per output channel, w = q * scale (served on GPUs with FP8 matmuls)."""

    q: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [N]

    bits = 8

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q[ids].float() * self.scale[ids, None]

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def to(self, device: torch.device) -> Fp8Weight:
        return Fp8Weight(self.q.to(device), self.scale.to(device))


QuantizedWeight = Int8Weight | Int4Weight | Fp8Weight
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _bf16_exact(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Per output channel, symmetric: scale = max|w| / 127."""
    w = w.float()
    scale = _bf16_exact(w.abs().amax(dim=1).clamp(min=1e-8) / 127)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale)


def _int4_grid(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K/G, G] as floats 0..15, scale, zero [N, K/G]): round to nearest, each group's [min, max] spanning
    0..15."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"input size {k} is not a multiple of the group size {group_size}")
    groups = w.float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = _bf16_exact(((hi - lo) / 15).clamp(min=1e-8))
    zero = _bf16_exact(lo + INT4_OFFSET * scale)
    q = torch.round((groups - zero[..., None]) / scale[..., None] + INT4_OFFSET).clamp_(0, 15)
    return q, scale, zero


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """Per output channel: each row's max |w| maps to e4m3's largest finite value."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return Fp8Weight((w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale)


def quantize_int4(w: torch.Tensor, group_size: int) -> Int4Weight:
    q, scale, zero = _int4_grid(w, group_size)
    return Int4Weight(pack_nibbles(q.reshape(w.shape)), scale, zero, group_size)


def fake_quantize_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """quantize_int4(w, group_size).dequantize() without packing: what a scale search evaluates many times."""
    q, scale, zero = _int4_grid(w, group_size)
    return ((q - INT4_OFFSET) * scale[..., None] + zero[..., None]).reshape(w.shape)


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Shards of a fused projection (q, k, v or gate, up) stacked along the output dimension."""
    first = weights[0]
    if isinstance(first, Int8Weight | Fp8Weight):
        return type(first)(torch.cat([w.q for w in weights]), torch.cat([w.scale for w in weights]))
    perms = [w.input_perm for w in weights]
    if any(type(w) is not Int4Weight or w.group_size != first.group_size for w in weights):
        raise ValueError("fused shards must share one quantization scheme")
    if any((p is None) != (perms[0] is None) or (p is not None and not torch.equal(p, perms[0])) for p in perms):
        raise ValueError("fused shards have different act-order permutations")
    return Int4Weight(torch.cat([w.packed for w in weights]), torch.cat([w.scale for w in weights]),
                      torch.cat([w.zero for w in weights]), first.group_size, perms[0])
