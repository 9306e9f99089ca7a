"""GGUF matrices whose ggml type is one of our quantized forms, served as they are stored (no round trip
through bf16): Q8_0 as int8 with a scale per 32 inputs, Q4_0 and Q4_1 as int4 in groups of 32, MXFP4 (gpt-oss's
experts) as MXFP4; a mixture's stacked experts as one such weight per expert.

Each block of 32 inputs holds an fp16 scale d (Q4_1 also an fp16 min m) and its quants. Q8_0: w = q * d.
Q4_0: w = (q - 8) * d, our offset -8d. Q4_1: w = q * d + m, our offset m. ggml keeps a block's 32 nibbles as
16 bytes with input j in the low nibble of byte j and input j + 16 in its high nibble; `Int4Weight` keeps
inputs 2i and 2i + 1 in byte i, so the nibbles are re-packed once here. MXFP4's block is its E8M0 exponent, then its
32 FP4 nibbles in that same order. Dequantizing these weights gives ggml's values bit for bit (every product of a
quant and a 16-bit scale, or a power of two, is exact in float32).
"""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import numpy as np
import torch

from ..quantization.weights import Int4Weight, Int8Weight, Mxfp4Weight, QuantizedWeight, pack_nibbles
from .dequantize import block_nibbles, fp16_values

GGMLType = gguf.GGMLQuantizationType
BLOCK = 32  # inputs per ggml block of these types
NATIVE_TYPES = frozenset({GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.MXFP4})


def native_weight(tensor: gguf.ReaderTensor) -> QuantizedWeight | None:
    """The matrix as our quantized weight, [N, K] as in `nn.Linear`; None for other types and shapes."""
    if tensor.tensor_type not in NATIVE_TYPES or len(tensor.shape) != 2:
        return None
    return _weight(tensor.tensor_type, tensor.data, *(int(d) for d in reversed(tensor.shape)))


def native_experts(tensor: gguf.ReaderTensor) -> Iterator[QuantizedWeight] | None:
    """A stacked [experts, N, K] tensor (a mixture's `ffn_*_exps`) as one quantized weight per expert, each made
    when it is asked for from that expert's rows (contiguous in the file); None for other types and shapes."""
    if tensor.tensor_type not in NATIVE_TYPES or len(tensor.shape) != 3:
        return None
    k, n, experts = (int(d) for d in tensor.shape)  # GGUF lists dimensions innermost first
    return (_weight(tensor.tensor_type, tensor.data[expert], n, k) for expert in range(experts))


def _weight(tensor_type: GGMLType, data: np.ndarray, n: int, k: int) -> QuantizedWeight:
    """[N, K] from its N rows of blocks, as the reader maps them from the file."""
    _, bytes_per_block = gguf.GGML_QUANT_SIZES[tensor_type]
    blocks = torch.from_numpy(np.array(data).reshape(-1).view(np.uint8)).view(n, k // BLOCK, bytes_per_block)
    if tensor_type == GGMLType.MXFP4:
        return Mxfp4Weight(pack_nibbles(block_nibbles(blocks[..., 1:]).reshape(n, k)), blocks[..., 0].contiguous())
    scale = fp16_values(blocks[..., :2]).squeeze(-1)
    if tensor_type == GGMLType.Q8_0:
        return Int8Weight(blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k), scale, group_size=BLOCK)
    quants = blocks[..., 4:] if tensor_type == GGMLType.Q4_1 else blocks[..., 2:]
    q = block_nibbles(quants).reshape(n, k)
    offset = fp16_values(blocks[..., 2:4]).squeeze(-1) if tensor_type == GGMLType.Q4_1 else -8 * scale
    return Int4Weight(pack_nibbles(q), scale, offset, BLOCK)
