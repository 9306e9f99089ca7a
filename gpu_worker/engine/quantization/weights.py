"""Quantized weights in one canonical form per scheme, whatever file they came from, and the quantizers.

`Int8Weight`: symmetric, w = q * scale, a scale per output channel (ours) or per group of inputs (GGUF's Q8_0).
`Int4Weight`: asymmetric, group-wise along the input dimension, w = q * scale + offset (q in 0..15). It is
ggml's Q4_1 form (Q4_0 is offset = -8 * scale); GPTQ's and AWQ's s * (q - z) is the same weight with
offset = -s * z. With 16-bit scales every product there is exact in float32, so no file format loses a bit on
the way in.

Weights are [N, K] as in `nn.Linear` (out, in). Scales and offsets are float32 values that are exact in bfloat16
when we quantize (the kernels then keep them in bf16), and whatever the file held when a checkpoint brought
them (fp16 values, which the kernels keep in float32).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class Int8Weight:
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N], or [N, K/G] with group_size G
    group_size: int | None = None  # None: one scale per output channel
    # Multiplied by activations quantized to int8 per token (w8a8, an int8 x int8 matmul) rather than by the
    # bf16 activations themselves: faster at many rows, at a measured cost in quality.
    int8_activations: bool = False

    bits = 8

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def group_scale(self) -> torch.Tensor:
        """The scales as [N, groups]: per channel is one group of K."""
        return self.scale[:, None] if self.group_size is None else self.scale

    def dequantize(self) -> torch.Tensor:
        return self._dequantize_rows(self.q, self.group_scale)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows `ids` (an embedding lookup), float32."""
        return self._dequantize_rows(self.q[ids], self.group_scale[ids])

    def _dequantize_rows(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (q.float().unflatten(-1, (scale.shape[-1], -1)) * scale[..., None]).flatten(-2)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.numel() * 2  # our quantizers' scales are served in 16 bits

    def select_rows(self, ids: torch.Tensor) -> Int8Weight:
        return Int8Weight(self.q[ids], self.scale[ids], self.group_size, self.int8_activations)

    def to(self, device: torch.device) -> Int8Weight:
        return Int8Weight(self.q.to(device), self.scale.to(device), self.group_size, self.int8_activations)


@dataclass
class Int4Weight:
    packed: torch.Tensor  # uint8 [N, K/2]: input k = 2i in the low nibble of byte i, 2i + 1 in the high one
    scale: torch.Tensor  # float32 [N, K/G]
    offset: torch.Tensor  # float32 [N, K/G]: the weight that q = 0 stands for
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
        w = self._dequantize_rows(self.q, self.scale, self.offset)
        if self.input_perm is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.input_perm, w)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.input_perm is not None:
            raise ValueError("an act-order (permuted) weight cannot serve as an embedding")
        return self._dequantize_rows(unpack_nibbles(self.packed[ids]), self.scale[ids], self.offset[ids])

    def _dequantize_rows(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        g = self.group_size
        return q.float() * scale.repeat_interleave(g, 1) + offset.repeat_interleave(g, 1)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + (self.scale.numel() + self.offset.numel()) * 2

    def select_rows(self, ids: torch.Tensor) -> Int4Weight:
        return Int4Weight(self.packed[ids], self.scale[ids], self.offset[ids], self.group_size, self.input_perm)

    def to(self, device: torch.device) -> Int4Weight:
        perm = None if self.input_perm is None else self.input_perm.to(device)
        return Int4Weight(self.packed.to(device), self.scale.to(device), self.offset.to(device), self.group_size,
                          perm)


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

    def select_rows(self, ids: torch.Tensor) -> Fp8Weight:
        return Fp8Weight(self.q[ids], self.scale[ids])

    def to(self, device: torch.device) -> Fp8Weight:
        return Fp8Weight(self.q.to(device), self.scale.to(device))


# e2m1: sign, 2 exponent bits, 1 mantissa bit, by nibble value
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> float32 [..., G * 32], value j of a group from byte
    j // 2's low nibble (j even) or high one (j odd), times 2^(scale - 127)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    nibbles = unpack_nibbles(blocks).int()  # [..., G, 32]
    return torch.ldexp(lut[nibbles], scales.int()[..., None] - 127).flatten(-2)


@dataclass
class Mxfp4Weight:
    """OCP MXFP4 as gpt-oss's checkpoints store its experts: FP4 (e2m1) values, two to a byte (input 2i in byte i's
    low nibble, 2i + 1 in its high one, as `Int4Weight`), and an E8M0 exponent per 32 inputs, w = fp4(q) * 2^(e - 127).
    Served as stored where a kernel takes it (`kernel_choice.CudaLinears`), else dequantized at load."""

    blocks: torch.Tensor  # uint8 [N, K/2]
    scales: torch.Tensor  # uint8 [N, K/32]

    bits = 4
    group_size = 32

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.blocks.shape[0], self.blocks.shape[1] * 2))

    def dequantize(self) -> torch.Tensor:
        return self.rows(slice(None))

    def rows(self, ids) -> torch.Tensor:
        blocks, scales = self.blocks[ids], self.scales[ids]
        return dequantize_mxfp4(blocks.unflatten(-1, (scales.shape[-1], 16)), scales)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.scales.nbytes

    def select_rows(self, ids: torch.Tensor) -> Mxfp4Weight:
        return Mxfp4Weight(self.blocks[ids], self.scales[ids])

    def to(self, device: torch.device) -> Mxfp4Weight:
        return Mxfp4Weight(self.blocks.to(device), self.scales.to(device))


QuantizedWeight = Int8Weight | Int4Weight | Fp8Weight | Mxfp4Weight
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def exact_scales(*scales: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The scales in bf16 where that keeps every value (our quantizers make them so: half the bytes), else in
    float32: a checkpoint's fp16 scales (GGUF, GPTQ, AWQ) would lose three bits of mantissa in bf16."""
    compact = tuple(s.to(torch.bfloat16) for s in scales)
    exact = all(torch.equal(c.float(), s.float()) for c, s in zip(compact, scales, strict=True))
    chosen = tuple((c if exact else s.float()).contiguous() for c, s in zip(compact, scales, strict=True))
    return chosen[0] if len(chosen) == 1 else chosen


def with_exact_scales(weight: QuantizedWeight) -> QuantizedWeight:
    """`weight` with its scales (and offsets) as `exact_scales` keeps them: an embedding table that a tied LM head
    shares then holds the very tensors the head's kernel reads, not a float32 copy beside them (an int4 table's
    scales and offsets in groups of 32 are a quarter of its bytes)."""
    if isinstance(weight, Int8Weight):
        return replace(weight, scale=exact_scales(weight.scale))
    if isinstance(weight, Int4Weight):
        scale, offset = exact_scales(weight.scale, weight.offset)
        return replace(weight, scale=scale, offset=offset)
    return weight


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _bf16_exact(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def quantize_int8(w: torch.Tensor, int8_activations: bool = False) -> Int8Weight:
    """Per output channel, symmetric: scale = max|w| / 127."""
    w = w.float()
    scale = _bf16_exact(w.abs().amax(dim=1).clamp(min=1e-8) / 127)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale, int8_activations=int8_activations)


def _int4_grid(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K/G, G] as floats 0..15, scale, offset [N, K/G]): round to nearest, each group's [min, max]
    spanning 0..15."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"input size {k} is not a multiple of the group size {group_size}")
    groups = w.float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = _bf16_exact(((hi - lo) / 15).clamp(min=1e-8))
    offset = _bf16_exact(lo)
    q = torch.round((groups - offset[..., None]) / scale[..., None]).clamp_(0, 15)
    return q, scale, offset


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """Per output channel: each row's max |w| maps to e4m3's largest finite value."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return Fp8Weight((w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale)


def quantize_int4(w: torch.Tensor, group_size: int) -> Int4Weight:
    q, scale, offset = _int4_grid(w, group_size)
    return Int4Weight(pack_nibbles(q.reshape(w.shape)), scale, offset, group_size)


def fake_quantize_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """quantize_int4(w, group_size).dequantize() without packing: what a scale search evaluates many times."""
    q, scale, offset = _int4_grid(w, group_size)
    return (q * scale[..., None] + offset[..., None]).reshape(w.shape)


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Shards of a fused projection (q, k, v or gate, up) stacked along the output dimension."""
    first = weights[0]
    if isinstance(first, Fp8Weight):
        return Fp8Weight(torch.cat([w.q for w in weights]), torch.cat([w.scale for w in weights]))
    if isinstance(first, Mxfp4Weight):
        if any(type(w) is not Mxfp4Weight for w in weights):
            raise ValueError("fused shards must share one quantization scheme")
        return Mxfp4Weight(torch.cat([w.blocks for w in weights]), torch.cat([w.scales for w in weights]))
    if isinstance(first, Int8Weight):
        if any(type(w) is not Int8Weight or w.group_size != first.group_size for w in weights):
            raise ValueError("fused shards must share one quantization scheme")
        return Int8Weight(torch.cat([w.q for w in weights]), torch.cat([w.scale for w in weights]), first.group_size,
                          first.int8_activations)
    perms = [w.input_perm for w in weights]
    if any(type(w) is not Int4Weight or w.group_size != first.group_size for w in weights):
        raise ValueError("fused shards must share one quantization scheme")
    if any((p is None) != (perms[0] is None) or (p is not None and not torch.equal(p, perms[0])) for p in perms):
        raise ValueError("fused shards have different act-order permutations")
    return Int4Weight(torch.cat([w.packed for w in weights]), torch.cat([w.scale for w in weights]),
                      torch.cat([w.offset for w in weights]), first.group_size, perms[0])
