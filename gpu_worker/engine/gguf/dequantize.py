"""Unpacking GGUF tensors into float32 torch tensors, block by block, for every ggml type we serve.

Each type is decoded from its block layout with vectorized torch ops over all blocks at once. The float32
operations run in the same order as ggml's reference (gguf-py's `gguf.quants.dequantize`), so the results
agree bit for bit: scales are multiplied together before they meet the quants, and an offset is added
(or subtracted) last.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import gguf
import numpy as np
import torch

from services.text.errors import ModelLoadError

GGMLType = gguf.GGMLQuantizationType
_QK_K = 256  # elements in a K-quant super-block
_Q6_K_HIGH_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)


def fp16_values(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 bytes, two per value, as float32: (..., 2k) uint8 -> (..., k)."""
    return raw.contiguous().view(torch.float16).float()


def block_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes -> (..., 2n) values: every low nibble first, then every high nibble."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.float32)


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    # bfloat16 is the top half of a float32, so widening is exact.
    return blocks.view(torch.bfloat16).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """34 bytes: fp16 d, then 32 int8 quants; x = q * d."""
    return blocks[:, 2:].view(torch.int8).float() * fp16_values(blocks[:, :2])


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """18 bytes: fp16 d, then 32 nibbles; x = (q - 8) * d."""
    q = block_nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return q.float() * fp16_values(blocks[:, :2])


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """20 bytes: fp16 d, fp16 m, then 32 nibbles; x = q * d + m."""
    return block_nibbles(blocks[:, 4:]).float() * fp16_values(blocks[:, :2]) + fp16_values(blocks[:, 2:4])


def _k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes holding eight 6-bit scales and eight 6-bit mins (ggml's get_scale_min_k4) -> two (n, 8).

    Sub-blocks 0-3 keep their scale and min in the low 6 bits of bytes 0-3 and 4-7. Sub-blocks 4-7 have
    their low 4 bits in the nibbles of bytes 8-11 and their top 2 bits in the spare top bits of bytes 0-7.
    """
    scale_lo, min_lo, rest = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((scale_lo & 0x3F, (rest & 0x0F) | ((scale_lo >> 6) << 4)), dim=-1)
    mins = torch.cat((min_lo & 0x3F, (rest >> 4) | ((min_lo >> 6) << 4)), dim=-1)
    return scales, mins


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """144 bytes per 256 values: fp16 d, fp16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles.

    Eight sub-blocks of 32; each 32-byte run of nibbles holds two of them (low nibbles, then high).
    x = (d * scale) * q - (dmin * min).
    """
    n = blocks.shape[0]
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    step = (fp16_values(blocks[:, 0:2]) * scales.float()).unsqueeze(-1)
    offset = (fp16_values(blocks[:, 2:4]) * mins.float()).unsqueeze(-1)
    q = block_nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return (step * q - offset).reshape(n, _QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """210 bytes per 256 values: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, fp16 d.

    Each half of 128 values takes 64 bytes of low nibbles (32-value groups 0 and 1 from the low nibbles,
    2 and 3 from the high ones) and 32 bytes whose bit pairs 0-1, 2-3, 4-5, 6-7 complete groups 0-3.
    Every run of 16 values shares a scale; x = (d * scale) * (q - 32).
    """
    n = blocks.shape[0]
    low = block_nibbles(blocks[:, :128].reshape(n, 2, 64)).reshape(n, 2, 4, 32)
    high = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> _Q6_K_HIGH_SHIFTS) & 0x03
    q = ((low | (high << 4)).to(torch.int8) - 32).float().reshape(n, 16, 16)
    step = fp16_values(blocks[:, 208:210]) * blocks[:, 192:208].view(torch.int8).float()
    return (step.unsqueeze(-1) * q).reshape(n, _QK_K)


# Each decoder takes (n_blocks, bytes_per_block) uint8 and returns (n_blocks, values_per_block) float32.
_DECODERS: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.F32: _f32, GGMLType.F16: fp16_values, GGMLType.BF16: _bf16,
    GGMLType.Q8_0: _q8_0, GGMLType.Q4_0: _q4_0, GGMLType.Q4_1: _q4_1,
    GGMLType.Q4_K: _q4_k, GGMLType.Q6_K: _q6_k,
}
SUPPORTED_TYPES: frozenset[GGMLType] = frozenset(_DECODERS)


def dequantize(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """The tensor's values as float32, in torch's orientation (GGUF lists dims innermost first)."""
    return _decode(tensor, tensor.data, [int(n) for n in reversed(tensor.shape)])


def dequantize_experts(tensor: gguf.ReaderTensor) -> Iterator[torch.Tensor]:
    """A stacked [experts, rows, cols] tensor as one float32 matrix per expert, each decoded when it is asked for
    (an expert's rows are contiguous in the file): no float32 copy of the whole stack is held."""
    shape = [int(n) for n in reversed(tensor.shape)]
    for expert in range(shape[0]):
        yield _decode(tensor, tensor.data[expert], shape[1:])


def _decode(tensor: gguf.ReaderTensor, data: np.ndarray, shape: list[int]) -> torch.Tensor:
    decode = _DECODERS.get(tensor.tensor_type)
    if decode is None:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ModelLoadError(
            f"GGUF tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which tokenfleet cannot "
            f"dequantize; supported types: {supported}"
        )
    # A copy: the reader's array is a read-only view of the memory-mapped file, and F32 would alias it.
    raw = torch.from_numpy(np.array(data).reshape(-1).view(np.uint8))
    _, bytes_per_block = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    return decode(raw.view(-1, bytes_per_block)).reshape(shape)
