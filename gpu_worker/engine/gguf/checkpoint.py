"""A llama.cpp GGUF file as a checkpoint: hyper-parameters from its metadata, weights renamed to HF's names and
layout (Q8_0 / Q4_0 / Q4_1 matrices as our int8 / int4 weights, MXFP4 ones as `Mxfp4Weight`, others dequantized to
float32; the loader casts them to the serving dtype), the tokenizer from its metadata.

Served: `general.architecture` llama (Llama, Mistral and SmolLM files use it, and Mixtral's, with experts), qwen2,
qwen3, qwen3moe, gemma2, gemma3, phi3, olmoe and gpt-oss (`families.py`: what each needs beyond the llama family);
biases where the file has them (q/k/v, o, a router's, experts'); with plain RoPE,
linear or YaRN scaling (`rope.scaling.*`), Llama 3's as per-frequency factors (`rope_freqs`), or Phi-3's LongRoPE.
A mixture's experts are stored stacked, one [experts, rows, cols] tensor per projection per layer
(`ffn_{gate,up,down}_exps`): they arrive one expert at a time under HF's per-expert names, quantized ones still
quantized. Nothing is written next to the user's file.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import torch

from services.text import gguf_metadata as metadata
from services.text.errors import ModelLoadError
from services.text.tokenizer import Tokenizer
from services.text.tokenizer_files import gguf_file_tokenizer

from ..model_config import ModelConfig, MoEConfig
from ..quantization.weights import QuantizedWeight
from .dequantize import dequantize, dequantize_experts
from .families import BARE_PARAMETERS, FAMILIES, NOT_WEIGHTS, ROPE_FREQS, tensor_name
from .quantized import native_experts, native_weight

_T = gguf.MODEL_TENSOR
_LLAMA, _QWEN3MOE = (gguf.MODEL_ARCH_NAMES[a] for a in (gguf.MODEL_ARCH.LLAMA, gguf.MODEL_ARCH.QWEN3MOE))
# The converter writes MixtralForCausalLM as a llama file with `llama.expert_count` experts.
_LLAMA_WITH_EXPERTS = "MixtralForCausalLM"
_GLOBAL_NAMES = {f"{tensor_name(t)}.weight": f"{hf}.weight" for t, hf in (
    (_T.TOKEN_EMBD, "model.embed_tokens"), (_T.OUTPUT_NORM, "model.norm"), (_T.OUTPUT, "lm_head"))}
# A mixture's stacked experts -> each expert's projection (Mixtral's w1 / w3 / w2 under the names loader.py maps)
_EXPERT_NAMES = {tensor_name(t): hf for t, hf in (
    (_T.FFN_GATE_EXP, "gate_proj"), (_T.FFN_UP_EXP, "up_proj"), (_T.FFN_DOWN_EXP, "down_proj"))}
# The router: llama.cpp keeps it float32 in every file (neither its converter nor llama-quantize touches it).
_ROUTER = re.compile(rf"blk\.\d+\.{tensor_name(_T.FFN_GATE_INP)}\.weight")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Weight types whose values a float32 / float16 serving dtype keeps exactly; anything quantized serves in bf16.
_PLAIN_DTYPES = {gguf.GGMLQuantizationType.F32: torch.float32, gguf.GGMLQuantizationType.F16: torch.float16}


class GgufCheckpoint:
    def __init__(self, path: Path):
        self.path = path
        self.quantization = None  # no format of separate tensors (qweight, scales): quantized matrices come whole
        self.reader = metadata.open_reader(path)
        self.arch = metadata.required(self.reader, "general.architecture")
        if self.arch not in FAMILIES:
            raise ModelLoadError(f"GGUF architecture {self.arch!r} is not supported; "
                                 f"supported: {', '.join(FAMILIES)}")
        self.family = FAMILIES[self.arch]
        self.config = self._config()

    def tokenizer(self) -> Tokenizer:
        return gguf_file_tokenizer(self.reader)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Q8_0 / Q4_0 / Q4_1 / MXFP4 matrices arrive as quantized weights (`quantized.py`), the rest dequantized;
        stacked experts one expert at a time."""
        for tensor in self.reader.tensors:
            if tensor.name in NOT_WEIGHTS:
                continue
            if (expert_name := hf_expert_name(tensor.name)) is not None:
                experts = native_experts(tensor) or dequantize_experts(tensor)
                yield from ((expert_name.format(expert=e), weight) for e, weight in enumerate(experts))
                continue
            name = hf_name(tensor.name, self.family.layer_names)
            weight = native_weight(tensor) or dequantize(tensor)
            if self.family.permuted_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
                weight = _unpermute(weight, self.config.num_heads)
            elif self.family.permuted_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
                weight = _unpermute(weight, self.config.num_kv_heads)
            elif self.family.norm_plus_one and name.endswith("norm.weight"):
                # Gemma's x * (1 + w): the file holds 1 + w in float32; 1 + (that - 1), which the norm computes,
                # gives it back exactly wherever it is at least 0.5 (the subtraction is exact there).
                weight = (weight.dequantize() if isinstance(weight, QuantizedWeight) else weight) - 1.0
            yield name, weight

    # ---- metadata ---------------------------------------------------------------------------------------

    def hparam(self, key: str, default=None):
        key = f"{self.arch}.{key}"
        return metadata.required(self.reader, key) if default is None else metadata.value(self.reader, key, default)

    def _config(self) -> ModelConfig:
        names = {t.name for t in self.reader.tensors}
        hidden, heads = self.hparam("embedding_length"), self.hparam("attention.head_count")
        window = metadata.value(self.reader, f"{self.arch}.attention.sliding_window")
        moe = self._moe()
        fields = dict(
            architecture=_LLAMA_WITH_EXPERTS if self.arch == _LLAMA and moe is not None else self.family.architecture,
            hidden_size=hidden,
            num_layers=self.hparam("block_count"),
            num_heads=heads,
            num_kv_heads=self.hparam("attention.head_count_kv", heads),
            head_dim=self.hparam("attention.key_length", hidden // heads),
            intermediate_size=self.hparam("feed_forward_length"),
            vocab_size=self._vocab_size(),
            rms_norm_eps=self.hparam("attention.layer_norm_rms_epsilon"),
            rope_theta=float(self.hparam("rope.freq_base", 10000.0)),
            rope_scaling=self.family.rope(self) if self.family.rope else self._rope_scaling(),
            max_position_embeddings=self.hparam("context_length"),
            tie_word_embeddings="output.weight" not in names,
            qkv_bias=bool(names & {"blk.0.attn_q.bias", "blk.0.attn_qkv.bias"}),
            o_proj_bias="blk.0.attn_output.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            sliding_window=None if window is None else int(window),
            moe=moe,
            checkpoint_dtype=self._weight_dtype(),
            eos_token_ids=frozenset(metadata.value(self.reader, f"tokenizer.ggml.{key}_token_id")
                                    for key in ("eos", "eot")) - {None},
        )
        if self.family.fields is not None:
            fields.update(self.family.fields(self, fields))
        return ModelConfig(**fields)

    def _moe(self) -> MoEConfig | None:
        """The mixture as llama.cpp's qwen3moe and llama graphs run it: every layer sparse, softmax routing, the
        top k renormalised (both graphs hard-code it; `expert_weights_norm`, which converters write for models whose
        HF config makes it optional, is read where a file has it)."""
        experts = self.hparam("expert_count", 0)
        if not experts:
            if self.arch == _QWEN3MOE:
                raise ModelLoadError(f"GGUF file {self.path} is qwen3moe but has no {self.arch}.expert_count")
            return None
        used, ffn = self.hparam("expert_used_count"), self.hparam("feed_forward_length")
        # llama.cpp's widths: Mixtral's experts are feed_forward_length wide; qwen3moe's expert_feed_forward_length,
        # defaulting to feed_forward_length / expert_used_count.
        width = self.hparam("expert_feed_forward_length", ffn // used if self.arch == _QWEN3MOE else ffn)
        return MoEConfig(int(experts), int(used), int(width), bool(self.hparam("expert_weights_norm", True)))

    def _rope_scaling(self) -> dict:
        """The file's rotary scaling as the dict HF's rope parameters give `rope.py`: the inverse of what
        llama.cpp's converter writes for them."""
        kind = self.hparam("rope.scaling.type", "none")
        freqs = next((t for t in self.reader.tensors if t.name == ROPE_FREQS), None)
        if freqs is not None:
            if kind != "none":
                raise ModelLoadError(f"GGUF file {self.path} has both rope_freqs and RoPE scaling {kind!r}, "
                                     "which tokenfleet does not combine")
            return {"rope_type": "freq_factors", "factors": dequantize(freqs).flatten().tolist()}
        if kind == "none":
            linear = float(self.hparam("rope.scale_linear", 1.0))  # older files' key for linear scaling
            return {} if linear == 1.0 else {"rope_type": "linear", "factor": linear}
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self.hparam("rope.scaling.factor"))}
        if kind == "yarn":
            return self._yarn()
        raise ModelLoadError(f"GGUF RoPE scaling {kind!r} is not supported; supported: none, linear, yarn and "
                             "Llama 3's rope_freqs")

    def _yarn(self) -> dict:
        # yarn_ext_factor and yarn_log_multiplier have no HF counterpart in these architectures: only their
        # neutral values (absent, ext_factor 1 or llama.cpp's negative "default", log_multiplier 0) are served.
        ext_factor = float(self.hparam("rope.scaling.yarn_ext_factor", -1.0))
        log_multiplier = float(self.hparam("rope.scaling.yarn_log_multiplier", 0.0))
        if (ext_factor >= 0 and ext_factor != 1.0) or log_multiplier != 0.0:
            raise ModelLoadError(f"GGUF YaRN with yarn_ext_factor {ext_factor} / yarn_log_multiplier "
                                 f"{log_multiplier} is not supported (only 1 / 0)")
        scaling = {"rope_type": "yarn", "factor": float(self.hparam("rope.scaling.factor")),
                   "original_max_position_embeddings": int(self.hparam("rope.scaling.original_context_length"))}
        # The converter writes HF's attention_factor (the whole cos/sin scale) as yarn_attn_factor.
        for gguf_key, hf_key in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                                 ("yarn_beta_slow", "beta_slow")):
            found = metadata.value(self.reader, f"{self.arch}.rope.scaling.{gguf_key}")
            if found is not None:
                scaling[hf_key] = float(found)
        return scaling

    def _vocab_size(self) -> int:
        embedding = next((t for t in self.reader.tensors if t.name == "token_embd.weight"), None)
        if embedding is None:
            raise ModelLoadError(f"GGUF file {self.path} has no token_embd.weight")
        return int(embedding.shape[-1])  # GGUF lists dimensions innermost first: [hidden, vocab]

    def _weight_dtype(self) -> torch.dtype:
        """What `dtype="auto"` serves: the matrices' own float type, bf16 for quantized ones (dequantized
        values need more range than float16 guarantees, and bf16 is what CPUs and GPUs run fast). A router does
        not count: it is float32 whatever the file's type."""
        types = {t.tensor_type for t in self.reader.tensors if len(t.shape) >= 2 and not _ROUTER.fullmatch(t.name)}
        return _PLAIN_DTYPES.get(types.pop(), torch.bfloat16) if len(types) == 1 else torch.bfloat16


def hf_name(gguf_name: str, layer_names: dict[str, str]) -> str:
    """A tensor's HF name, given its family's names for a layer's tensors (`families.py`)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in layer_names:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no place in this architecture's model")
    layer, part, kind = match.groups()
    if layer_names[part] in BARE_PARAMETERS and kind == "weight":
        return f"model.layers.{layer}.{layer_names[part]}"
    return f"model.layers.{layer}.{layer_names[part]}.{kind}"


def hf_expert_name(gguf_name: str) -> str | None:
    """A stacked experts tensor's HF name with `{expert}` in place of the expert's number; None for any other."""
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _EXPERT_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.mlp.experts.{{expert}}.{_EXPERT_NAMES[part]}.{kind}"


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
