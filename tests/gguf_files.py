"""Small GGUF files for tests, written from an HF checkpoint the way llama.cpp's convert_hf_to_gguf.py does.

`write_gguf(model_dir, out, tensor_type)` takes a directory as the `make_checkpoint` fixture writes it
(Llama or Qwen2, a byte-level BPE tokenizer with a chat template) and writes one GGUF file: the
`{arch}.*` hyper-parameters, the tokenizer as `tokenizer.ggml.*` metadata, and the tensors under gguf's
own names, with Llama's q/k rows permuted as the converter permutes them. 1-D tensors (norms, biases) stay
F32; every 2-D weight is stored in `tensor_type`.

gguf-py has no quantizer for the K-quants (Q4_K, Q6_K). For those the weights are random but valid blocks
(seeded by tensor name, scaled to roughly the weight's std), so the file's values are NOT the checkpoint's:
tests compare our engine with HF transformers loading the same file, never with the original checkpoint.
A K-quant needs rows of a multiple of 256 values; a weight whose rows are shorter or ragged stays in Q8_0,
as does any weight whose rows do not fit `tensor_type`'s block.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig

GGMLType = gguf.GGMLQuantizationType
ARCHITECTURES = {"LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA, "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2}


def write_gguf(model_dir: Path, out: Path, tensor_type: GGMLType) -> Path:
    config = AutoConfig.from_pretrained(model_dir)
    arch = ARCHITECTURES[config.architectures[0]]
    if config.rope_parameters.get("rope_type", "default") != "default":
        raise ValueError(f"{model_dir}: rope scaling {config.rope_parameters} is not written to GGUF here")
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    _add_hyperparameters(writer, config, arch)
    _add_tokenizer(writer, model_dir)
    for name, array, stored_as in _tensors(model_dir, config, arch, tensor_type):
        writer.add_tensor(name, array, raw_dtype=stored_as)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_hyperparameters(writer: gguf.GGUFWriter, config, arch: gguf.MODEL_ARCH) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if arch == gguf.MODEL_ARCH.LLAMA:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)


def _add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    added = tokenizer.get_added_tokens_decoder()
    writer.add_tokenizer_model("gpt2")
    # The converter names the pre-tokenizer by hashing how it splits a probe text, and knows no hash for a
    # tokenizer trained here; ByteLevel with its default regex splits exactly as llama.cpp's "gpt-2" does.
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(sorted(vocab, key=vocab.__getitem__))
    writer.add_token_types([_token_type(added.get(token_id)) for token_id in sorted(vocab.values())])
    # Merges, bos/eos/pad ids and the chat template, read by gguf-py exactly as the converter reads them.
    special = gguf.SpecialVocab(model_dir, load_merges=True)
    # Our tokenizer's post-processor adds no BOS, while llama.cpp adds one to a BPE vocabulary unless told not to.
    special.add_special_token.setdefault("bos", False)
    special.add_to_gguf(writer, quiet=True)


def _token_type(added_token) -> gguf.TokenType:
    if added_token is None:
        return gguf.TokenType.NORMAL
    return gguf.TokenType.CONTROL if added_token.special else gguf.TokenType.USER_DEFINED


def _tensors(model_dir: Path, config, arch: gguf.MODEL_ARCH, tensor_type: GGMLType) -> Iterator[tuple]:
    """(gguf name, array, ggml type) for every tensor the file stores."""
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for path in sorted(model_dir.glob("*.safetensors")):
        for hf_name, weight in load_file(path).items():
            if hf_name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # llama.cpp omits output.weight and ties it to token_embd.weight
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            array = weight.to(torch.float32).numpy()
            if arch == gguf.MODEL_ARCH.LLAMA:
                array = _permute_for_ggml_rope(hf_name, array, config)
            yield name, *_encode(name, array, tensor_type)


def _permute_for_ggml_rope(hf_name: str, array: np.ndarray, config) -> np.ndarray:
    """HF's Llama rotates the two halves of each head; ggml's rope rotates adjacent pairs. The converter
    reorders q's and k's rows per head to match (k with the KV head count), as `convert_hf_to_gguf.py` does."""
    if ".q_proj." in hf_name:
        n_head = config.num_attention_heads
    elif ".k_proj." in hf_name:
        n_head = config.num_key_value_heads
    else:
        return array
    rows = array.shape[0]
    return array.reshape(n_head, 2, rows // n_head // 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


def _encode(name: str, array: np.ndarray, tensor_type: GGMLType) -> tuple[np.ndarray, GGMLType]:
    if array.ndim == 1:
        return array, GGMLType.F32
    fits = array.shape[-1] % gguf.GGML_QUANT_SIZES[tensor_type][0] == 0
    stored_as = tensor_type if fits else GGMLType.Q8_0
    try:
        return gguf.quants.quantize(array, stored_as), stored_as
    except NotImplementedError:
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        n_blocks = array.size // gguf.GGML_QUANT_SIZES[stored_as][0]
        blocks = _RANDOM_BLOCKS[stored_as](n_blocks, float(array.std()), rng)
        return blocks.reshape(array.shape[0], -1), stored_as


def _random_q4_k_blocks(n_blocks: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """value = d * scale * q - d * min, with q uniform over 0..15 (std 4.6) and min = 7.5 * scale centring it on
    zero; scales of 1..8 (mean 4.5) keep min within its 6 bits."""
    scales = rng.integers(1, 9, size=(n_blocks, 8), dtype=np.uint8)
    mins = np.round(scales * 7.5).astype(np.uint8)
    d = np.full((n_blocks, 1), std / (4.6 * 4.5), dtype=np.float16).view(np.uint8)
    nibbles = rng.integers(0, 256, size=(n_blocks, 128), dtype=np.uint8)
    return np.concatenate([d, d, _pack_k_scales(scales, mins), nibbles], axis=1)


def _pack_k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins -> 12 bytes, the inverse of ggml's get_scale_min_k4: sub-blocks 0-3 whole
    in bytes 0-7, sub-blocks 4-7 split into low nibbles (bytes 8-11) and top 2 bits (spare bits of bytes 0-7)."""
    scale_lo, scale_hi = np.split(scales, 2, axis=1)
    min_lo, min_hi = np.split(mins, 2, axis=1)
    return np.concatenate([
        scale_lo | (scale_hi >> 4) << 6,
        min_lo | (min_hi >> 4) << 6,
        (scale_hi & 0x0F) | (min_hi & 0x0F) << 4,
    ], axis=1)


def _random_q6_k_blocks(n_blocks: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """value = d * scale * (q - 32), with q uniform over 0..63 (std 18.5) and int8 scales of 1..127 (mean 64)."""
    quants = rng.integers(0, 256, size=(n_blocks, 192), dtype=np.uint8)  # 128 bytes low nibbles, 64 high pairs
    scales = rng.integers(1, 128, size=(n_blocks, 16), dtype=np.uint8)
    d = np.full((n_blocks, 1), std / (18.5 * 64), dtype=np.float16).view(np.uint8)
    return np.concatenate([quants, scales, d], axis=1)


_RANDOM_BLOCKS = {GGMLType.Q4_K: _random_q4_k_blocks, GGMLType.Q6_K: _random_q6_k_blocks}
