"""A llama.cpp GGUF file as a checkpoint: hyper-parameters from its metadata, weights renamed to HF's names and
layout (Q8_0 / Q4_0 / Q4_1 matrices as our int8 / int4 weights, others dequantized to float32; the loader casts
them to the serving dtype), the tokenizer from its metadata.

Only llama-family files are served: `general.architecture` llama (Llama, Mistral and SmolLM files use it) or
qwen2. Nothing is written next to the user's file.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import torch

from ..errors import ModelLoadError
from ..model_config import ModelConfig
from ..quantization.weights import QuantizedWeight
from ..tokenizer import Tokenizer
from . import metadata
from .dequantize import dequantize
from .quantized import native_weight

# general.architecture -> the HF architecture whose config and weight names the file maps to
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# llama.cpp's converter interleaves the rotary halves of llama files' q/k rows (`permute`); Qwen2's it leaves in
# HF's order.
_PERMUTED_QK = {"llama"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Weight types whose values a float32 / float16 serving dtype keeps exactly; anything quantized serves in bf16.
_PLAIN_DTYPES = {gguf.GGMLQuantizationType.F32: torch.float32, gguf.GGMLQuantizationType.F16: torch.float16}


class GgufCheckpoint:
    def __init__(self, path: Path):
        self.path = path
        self.quantization = None  # no format of separate tensors (qweight, scales): quantized matrices come whole
        try:
            self.reader = gguf.GGUFReader(path)
        except (ValueError, OSError) as exc:
            raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc
        self.arch = metadata.required(self.reader, "general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ModelLoadError(f"GGUF architecture {self.arch!r} is not supported; "
                                 f"supported: {', '.join(ARCHITECTURES)}")
        self.config = self._config()

    def tokenizer(self) -> Tokenizer:
        from .tokenizer import build_tokenizer

        return Tokenizer(build_tokenizer(self.reader))

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Q8_0 / Q4_0 / Q4_1 matrices arrive as quantized weights (`quantized.py`), the rest dequantized."""
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            weight = native_weight(tensor) or dequantize(tensor)
            if self.arch in _PERMUTED_QK and name.endswith(("q_proj.weight", "q_proj.bias")):
                weight = _unpermute(weight, self.config.num_heads)
            elif self.arch in _PERMUTED_QK and name.endswith(("k_proj.weight", "k_proj.bias")):
                weight = _unpermute(weight, self.config.num_kv_heads)
            yield name, weight

    # ---- metadata ---------------------------------------------------------------------------------------

    def _hparam(self, key: str, default=None):
        key = f"{self.arch}.{key}"
        return metadata.required(self.reader, key) if default is None else metadata.value(self.reader, key, default)

    def _config(self) -> ModelConfig:
        names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in names:
            raise ModelLoadError("this GGUF file scales RoPE by per-frequency factors (rope_freqs, Llama-3.1 "
                                 "style), which tokenfleet does not read yet: serve the model's HF directory")
        hidden, heads = self._hparam("embedding_length"), self._hparam("attention.head_count")
        scaling = metadata.value(self.reader, f"{self.arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            raise ModelLoadError(f"GGUF RoPE scaling {scaling!r} is not supported")
        window = metadata.value(self.reader, f"{self.arch}.attention.sliding_window")
        return ModelConfig(
            architecture=ARCHITECTURES[self.arch],
            hidden_size=hidden,
            num_layers=self._hparam("block_count"),
            num_heads=heads,
            num_kv_heads=self._hparam("attention.head_count_kv", heads),
            head_dim=self._hparam("attention.key_length", hidden // heads),
            intermediate_size=self._hparam("feed_forward_length"),
            vocab_size=self._vocab_size(),
            rms_norm_eps=self._hparam("attention.layer_norm_rms_epsilon"),
            rope_theta=float(self._hparam("rope.freq_base", 10000.0)),
            max_position_embeddings=self._hparam("context_length"),
            tie_word_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names,
            sliding_window=None if window is None else int(window),
            checkpoint_dtype=self._weight_dtype(),
            eos_token_ids=frozenset(metadata.value(self.reader, f"tokenizer.ggml.{key}_token_id")
                                    for key in ("eos", "eot")) - {None},
        )

    def _vocab_size(self) -> int:
        embedding = next((t for t in self.reader.tensors if t.name == "token_embd.weight"), None)
        if embedding is None:
            raise ModelLoadError(f"GGUF file {self.path} has no token_embd.weight")
        return int(embedding.shape[-1])  # GGUF lists dimensions innermost first: [hidden, vocab]

    def _weight_dtype(self) -> torch.dtype:
        """What `dtype="auto"` serves: the matrices' own float type, bf16 for quantized ones (dequantized
        values need more range than float16 guarantees, and bf16 is what CPUs and GPUs run fast)."""
        types = {t.tensor_type for t in self.reader.tensors if len(t.shape) == 2}
        return _PLAIN_DTYPES.get(types.pop(), torch.bfloat16) if len(types) == 1 else torch.bfloat16


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no place in a llama-family model")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def _unpermute(weight: torch.Tensor | QuantizedWeight, num_heads: int) -> torch.Tensor | QuantizedWeight:
    if isinstance(weight, torch.Tensor):
        return unpermute_rotary(weight, num_heads)
    return weight.select_rows(unpermute_rotary(torch.arange(weight.shape[0]), num_heads))


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head it interleaves the two rotary halves (rows 0, d/2, 1,
    d/2 + 1, ...); HF keeps the halves apart (rows 0 .. d/2 - 1, then d/2 .. d - 1)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))
