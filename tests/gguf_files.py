"""Small GGUF files for tests, written from an HF checkpoint the way llama.cpp's convert_hf_to_gguf.py does.

`write_gguf(model_dir, out, tensor_type)` takes a directory as the `make_checkpoint` fixture writes it (Llama,
Qwen2, Qwen3, Qwen3-MoE, Mixtral, Gemma 2, Gemma 3 or Phi-3, a byte-level BPE tokenizer with a chat template) and
writes one GGUF file: the `{arch}.*` hyper-parameters (rotary scaling included: linear and YaRN as `rope.scaling.*`,
Llama 3's as the `rope_freqs` tensor; a mixture's expert counts and widths), the tokenizer as `tokenizer.ggml.*`
metadata, and the tensors under gguf's own names, with Llama's (and Mixtral's) q/k rows permuted as the converter
permutes them. Qwen3-MoE is written as `qwen3moe`, Mixtral as `llama` with `llama.expert_count`, as the converter
writes them: each layer's experts stacked into one [experts, rows, cols] tensor per projection
(`ffn_{gate,up,down}_exps`), the router as `ffn_gate_inp`. Gemma's RMSNorm weights are stored + 1 (Gemma 2's LM head
always tied, Gemma 3's embedding trimmed to the tokenizer's vocabulary), with the converters' keys (soft-capping,
sliding window; Gemma 3's rotary per layer kind); Phi-3's fused q/k/v and gate/up as they are, its LongRoPE as
`rope_factors_{long,short}` and `rope.scaling.*` keys, partial rotary as `rope.dimension_count`. OLMoE as `olmoe`
(q/k norms as they are, the norm epsilon written as 1e-5 as OlmoeModel does); gpt-oss as `gpt-oss` (GptOssModel:
sinks as `attn_sinks.weight`, HF's stacked experts transposed to [experts, out, in] and gate/up de-interleaved into
`ffn_gate_exps` / `ffn_up_exps`, their biases likewise; the window and expert width as keys; YaRN's keys). 1-D
tensors (norms, rope_freqs), biases and routers stay F32 (llama.cpp never quantizes a router); every other weight
is stored in `tensor_type`, except that MXFP4 (how the converter repacks gpt-oss's released experts) stores only
the experts so and the rest in F32.

Like the converter, this refuses what a file cannot say: a Qwen3-MoE model with dense layers (`mlp_only_layers`,
`decoder_sparse_step`: qwen3moe files have no dense MLP tensors) or whose top k is not renormalised (llama.cpp's
qwen3moe graph always renormalises it, and the converter writes no key for it); a Gemma whose query_pre_attn_scalar
or sliding layers are not the ones llama.cpp derives (`_check_gemma`); an OLMoE that clips q/k/v, renormalises its
top k or has another norm epsilon, or a gpt-oss whose SwiGLU, sliding layers or YaRN rounding are not llama.cpp's
fixed ones (`_check_olmoe`, `_check_gpt_oss`).

gguf-py has no quantizer for the K-quants (Q4_K, Q6_K). For those the weights are random but valid blocks
(seeded by tensor name, scaled to roughly the weight's std), so the file's values are NOT the checkpoint's:
tests compare our engine with HF transformers loading the same file, never with the original checkpoint.
A K-quant needs rows of a multiple of 256 values; a weight whose rows are shorter or ragged stays in Q8_0,
as does any weight whose rows do not fit `tensor_type`'s block.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Iterator
from itertools import chain
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig

GGMLType = gguf.GGMLQuantizationType
ARCHITECTURES = {"LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA, "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
                 "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3, "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE,
                 "MixtralForCausalLM": gguf.MODEL_ARCH.LLAMA, "Gemma2ForCausalLM": gguf.MODEL_ARCH.GEMMA2,
                 "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3, "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3,
                 "OlmoeForCausalLM": gguf.MODEL_ARCH.OLMOE, "GptOssForCausalLM": gguf.MODEL_ARCH.GPT_OSS}
_GEMMA = (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3)
_EXPERT = re.compile(r"\.experts\.(\d+)\.")  # an expert's tensor: model.layers.N.mlp.experts.E.gate_proj.weight
_ROUTER = re.compile(re.escape(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_INP]).replace(r"\{bid\}", r"\d+")
                     + r"\.weight")


def write_gguf(model_dir: Path, out: Path, tensor_type: GGMLType) -> Path:
    config = AutoConfig.from_pretrained(model_dir)
    arch = ARCHITECTURES[config.architectures[0]]
    hparams = json.loads((model_dir / "config.json").read_text())
    if arch == gguf.MODEL_ARCH.QWEN3MOE:
        _check_qwen3moe(config)
    if arch in _GEMMA:
        _check_gemma(config, arch)
    _CHECKS.get(arch, lambda _: None)(config)
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    _add_hyperparameters(writer, config, arch, hparams)
    if arch not in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.PHI3):  # their converters write no rope.scaling.*
        _add_rope_scaling(writer, _full_rope(config), arch)
    _add_tokenizer(writer, model_dir)
    extra = _phi3_rope(writer, config, hparams) if arch == gguf.MODEL_ARCH.PHI3 else _rope_freqs(config)
    tensors = chain(extra, _tensors(model_dir, config, arch, tensor_type))  # the converter's order
    for name, array, stored_as in tensors:
        writer.add_tensor(name, array, raw_dtype=stored_as)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_hyperparameters(writer: gguf.GGUFWriter, config, arch: gguf.MODEL_ARCH, hparams: dict) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(1e-5 if arch == gguf.MODEL_ARCH.OLMOE else config.rms_norm_eps)
    if arch != gguf.MODEL_ARCH.GEMMA2:  # Gemma2Model.set_gguf_parameters writes none (`_check_gemma`)
        writer.add_rope_freq_base(_full_rope(config)["rope_theta"])
    if arch == gguf.MODEL_ARCH.LLAMA:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        writer.add_rope_dimension_count(head_dim)
    if (head_dim := hparams.get("head_dim")) is not None:  # the converter reads config.json, as here
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    if (experts := _num_experts(config)) is not None:  # TextModel's keys, from HF's names for them
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if (width := hparams.get("moe_intermediate_size")) is not None:  # Qwen2MoeModel's (Mixtral's is the FFN's)
        writer.add_expert_feed_forward_length(width)
    _add_family_keys(writer, config, arch, hparams)


def _add_family_keys(writer: gguf.GGUFWriter, config, arch: gguf.MODEL_ARCH, hparams: dict) -> None:
    """The keys each family's converter class adds to TextModel's."""
    if arch == gguf.MODEL_ARCH.GEMMA2:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    elif arch == gguf.MODEL_ARCH.GEMMA3:
        # The newer converter's TextModel writes the sliding layers' base too (llama.cpp's default: 10 000).
        writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    elif arch == gguf.MODEL_ARCH.GPT_OSS:
        writer.add_sliding_window(config.sliding_window)
        writer.add_expert_feed_forward_length(config.intermediate_size)
    elif arch == gguf.MODEL_ARCH.PHI3:  # Phi3MiniModel: rotary dims from hidden / heads, window 0 for none
        writer.add_rope_dimension_count(int(_phi3_rope_parameters(config, hparams).get("partial_rotary_factor", 1.0)
                                            * config.hidden_size) // config.num_attention_heads)
        writer.add_sliding_window(config.sliding_window or 0)


def _full_rope(config) -> dict:
    """The rope parameters of the full-attention layers (Gemma 3 keeps one set per layer kind)."""
    return config.rope_parameters.get("full_attention", config.rope_parameters)


def _check_gemma(config, arch: gguf.MODEL_ARCH) -> None:
    """What a gemma2 / gemma3 file cannot say: llama.cpp scales scores by head_dim ** -0.5 (hidden / heads for the
    27B models, told by their layer count) as no query_pre_attn_scalar is written; its sliding layers follow a
    fixed pattern (every other from the first; all but every 6th); Gemma 2's rotary base is 10 000 and Gemma 3's
    sliding layers' rotary unscaled."""
    scale_27b = config.num_hidden_layers == (46 if arch == gguf.MODEL_ARCH.GEMMA2 else 62)
    scalar = config.hidden_size // config.num_attention_heads if scale_27b else config.head_dim
    if config.query_pre_attn_scalar != scalar:
        raise ValueError(f"a {arch.name.lower()} file has no query_pre_attn_scalar: llama.cpp takes {scalar}, "
                         f"the config {config.query_pre_attn_scalar}")
    period = 2 if arch == gguf.MODEL_ARCH.GEMMA2 else 6
    pattern = ["sliding_attention" if i % period < period - 1 else "full_attention"
               for i in range(config.num_hidden_layers)]
    if config.layer_types != pattern:
        raise ValueError(f"llama.cpp's {arch.name.lower()} layers are {pattern}, the config's {config.layer_types}")
    sliding_rope = config.rope_parameters.get("sliding_attention", config.rope_parameters)
    if sliding_rope.get("rope_type", "default") != "default" or (
            arch == gguf.MODEL_ARCH.GEMMA2 and config.rope_parameters["rope_theta"] != 10000.0):
        raise ValueError(f"rope parameters {config.rope_parameters} have no {arch.name.lower()} file")


def _check_olmoe(config) -> None:
    """OlmoeModel writes no clip_qkv (nor does llama.cpp's olmoe graph clip), an epsilon of 1e-5, and no key for
    norm_topk_prob (llama.cpp's olmoe graph never renormalises)."""
    if config.clip_qkv is not None or config.norm_topk_prob or config.rms_norm_eps != 1e-5:
        raise ValueError(f"an olmoe file has no clip_qkv ({config.clip_qkv}), no renormalised top k "
                         f"({config.norm_topk_prob}) and epsilon 1e-5 ({config.rms_norm_eps})")


def _check_gpt_oss(config) -> None:
    """llama.cpp's gpt-oss: SwiGLU alpha 1.702 and limit 7 (constants), layers sliding in period 2 from the first,
    YaRN unrounded (the loader's reading: no key says)."""
    pattern = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config.num_hidden_layers)]
    if (config.swiglu_limit, getattr(config, "swiglu_alpha", 1.702)) != (7.0, 1.702) or config.layer_types != pattern:
        raise ValueError(f"llama.cpp's gpt-oss has SwiGLU limit 7, alpha 1.702 and layers {pattern}, not "
                         f"{config.swiglu_limit}, {getattr(config, 'swiglu_alpha', None)}, {config.layer_types}")
    if config.rope_parameters.get("truncate", True) and config.rope_parameters.get("rope_type") == "yarn":
        raise ValueError("a gpt-oss file's YaRN is read unrounded (truncate false)")


_CHECKS = {gguf.MODEL_ARCH.OLMOE: _check_olmoe, gguf.MODEL_ARCH.GPT_OSS: _check_gpt_oss}


def _phi3_rope_parameters(config, hparams: dict) -> dict:
    """The converter's rope_parameters: config.json's, with the top-level keys it lacks."""
    top = {key: hparams[key] for key in ("original_max_position_embeddings", "partial_rotary_factor")
           if hparams.get(key) is not None}
    return {**top, **config.rope_parameters}


def _phi3_rope(writer: gguf.GGUFWriter, config, hparams: dict) -> list[tuple]:
    """Phi3MiniModel's LongRoPE: the original context and the attention factor as keys (written here), the
    factors as two tensors (returned)."""
    rope = _phi3_rope_parameters(config, hparams)
    original = rope["original_max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    if not rope.get("long_factor"):
        return []
    if rope["rope_type"] not in ("su", "longrope"):
        raise ValueError(f"Phi-3 rope scaling {rope['rope_type']!r} is not written here")
    scale = config.max_position_embeddings / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    return [(gguf.TENSOR_NAMES[tensor] + ".weight", np.array(rope[key], dtype=np.float32), GGMLType.F32)
            for tensor, key in ((gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, "long_factor"),
                                (gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT, "short_factor"))]


def _num_experts(config) -> int | None:
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)


def _check_qwen3moe(config) -> None:
    if config.mlp_only_layers or config.decoder_sparse_step != 1:
        raise ValueError("a qwen3moe GGUF file has no dense MLP tensors: every layer must be sparse (mlp_only_layers "
                         f"{config.mlp_only_layers}, decoder_sparse_step {config.decoder_sparse_step})")
    if not config.norm_topk_prob:
        raise ValueError("llama.cpp always renormalises qwen3moe's top k: norm_topk_prob=False has no GGUF form")


def _add_rope_scaling(writer: gguf.GGUFWriter, rope: dict, arch: gguf.MODEL_ARCH) -> None:
    """`rope.scaling.*` as the converter's TextModel.set_gguf_parameters writes them; llama3 scaling it writes as
    a tensor instead (`_rope_freqs`), and other kinds it does not write (nor does this)."""
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        # gpt-oss's truncate false is the loader's reading of a gpt-oss file (`_check_gpt_oss`)
        if rope.keys() & {"mscale", "mscale_all_dim"} or ("truncate" in rope and arch != gguf.MODEL_ARCH.GPT_OSS):
            raise ValueError(f"rope parameters {rope} have keys the converter does not write")
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if "attention_factor" in rope:
            writer.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if "beta_fast" in rope:
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if "beta_slow" in rope:
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    elif kind == "llama3" and arch != gguf.MODEL_ARCH.LLAMA:
        raise ValueError("the converter writes llama3 rope scaling for Llama models only")
    elif kind not in ("default", "llama3"):
        raise ValueError(f"rope scaling {kind!r} is not written to GGUF here")


def _rope_freqs(config) -> Iterator[tuple]:
    """Llama 3's scaling as one divisor per frequency, as the converter's LlamaModel.generate_extra_tensors
    computes it (float32, element by element). One difference: the converter takes original_max_position_embeddings
    from the config's top level, defaulting to 8192 (Llama 3.1's and 3.2's own value); here it comes from the rope
    parameters, where HF keeps it, so that a test config's smaller value is written too."""
    rope = config.rope_parameters
    if rope.get("rope_type") != "llama3":
        return
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freqs
    smooth = (old_len / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    factors = torch.where(wavelen < old_len / high, 1.0, torch.where(wavelen > old_len / low, factor, medium))
    yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors.numpy(), GGMLType.F32


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
    """(gguf name, array, ggml type) for every tensor the file stores; a layer's experts, once all have been read,
    as one stacked tensor per projection (the converter's `_experts` buffers)."""
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    experts: dict[str, dict[int, np.ndarray]] = {}  # stacked tensor's HF name -> {expert: its matrix}
    for path in sorted(model_dir.glob("*.safetensors")):
        for hf_name, weight in load_file(path).items():
            if hf_name == "lm_head.weight" and (config.tie_word_embeddings or arch == gguf.MODEL_ARCH.GEMMA2):
                continue  # llama.cpp omits output.weight and ties it to token_embd.weight (Gemma 2's always)
            array = weight.to(torch.float32).numpy()
            if arch in _GEMMA:
                array = _gemma_tensor(hf_name, array, model_dir, arch)
            if arch == gguf.MODEL_ARCH.GPT_OSS:
                yield from (_named(names, *pair, tensor_type) for pair in _gpt_oss_tensors(hf_name, array))
                continue
            if (expert := _EXPERT.search(hf_name)) is not None:
                hf_name = _EXPERT.sub(".experts.", hf_name)  # gguf-py's name for the merged tensor
                experts.setdefault(hf_name, {})[int(expert.group(1))] = array
                if len(experts[hf_name]) < _num_experts(config):
                    continue
                array = np.stack([m for _, m in sorted(experts.pop(hf_name).items())])
            if arch == gguf.MODEL_ARCH.LLAMA:
                array = _permute_for_ggml_rope(hf_name, array, config)
            yield _named(names, hf_name, array, tensor_type)


def _named(names: gguf.TensorNameMap, hf_name: str, array: np.ndarray, tensor_type: GGMLType) -> tuple:
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:  # as the converter's map_tensor_name, e.g. a dense MLP in a qwen3moe model
        raise ValueError(f"{hf_name} has no tensor in this GGUF architecture")
    if _ROUTER.fullmatch(name):
        return name, array, GGMLType.F32
    return name, *_encode(name, array, tensor_type)


def _gpt_oss_tensors(hf_name: str, array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """GptOssModel.modify_tensors for a float checkpoint: `sinks` + `.weight`; the stacked experts ([E, in, out] in
    HF) as [E, out, in], gate_up's alternating gate and up rows (and bias entries) apart."""
    stem, leaf = hf_name.rsplit(".", 1)
    if leaf == "sinks":
        yield f"{hf_name}.weight", array
    elif leaf in ("down_proj", "down_proj_bias") and stem.endswith(".experts"):
        yield f"{stem}.down_proj.{'bias' if leaf.endswith('_bias') else 'weight'}", (
            array if leaf.endswith("_bias") else array.swapaxes(-1, -2))
    elif leaf in ("gate_up_proj", "gate_up_proj_bias"):
        kind = "bias" if leaf.endswith("_bias") else "weight"
        rows = array[..., None] if kind == "bias" else array.swapaxes(-1, -2)  # [E, 2I, in]: gate, up, gate, ...
        for proj, part in (("gate_proj", rows[:, 0::2]), ("up_proj", rows[:, 1::2])):
            yield f"{stem}.{proj}.{kind}", np.ascontiguousarray(part[..., 0] if kind == "bias" else part)
    else:
        yield hf_name, array


def _gemma_tensor(hf_name: str, array: np.ndarray, model_dir: Path, arch: gguf.MODEL_ARCH) -> np.ndarray:
    """Gemma{2,3}Model.modify_tensors: RMSNorm weights + 1 (HF's norm scales by 1 + w); Gemma 3's embedding rows
    past the tokenizer's vocabulary dropped."""
    if hf_name.endswith("norm.weight"):
        return array + np.float32(1)
    if hf_name == "model.embed_tokens.weight" and arch == gguf.MODEL_ARCH.GEMMA3:
        tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
        return array[:len(tokenizer["model"]["vocab"]) + len(tokenizer["added_tokens"])]
    return array


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
    if array.ndim == 1 or not name.endswith(".weight") or (tensor_type == GGMLType.MXFP4 and "_exps." not in name):
        return np.ascontiguousarray(array), GGMLType.F32
    fits = array.shape[-1] % gguf.GGML_QUANT_SIZES[tensor_type][0] == 0
    stored_as = tensor_type if fits else GGMLType.Q8_0
    try:
        return gguf.quants.quantize(array, stored_as), stored_as
    except NotImplementedError:
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        n_blocks = array.size // gguf.GGML_QUANT_SIZES[stored_as][0]
        blocks = _RANDOM_BLOCKS[stored_as](n_blocks, float(array.std()), rng)
        return blocks.reshape(*array.shape[:-1], -1), stored_as


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
