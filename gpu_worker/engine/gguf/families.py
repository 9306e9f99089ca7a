"""What sets each GGUF architecture we serve apart, as llama.cpp's convert_hf_to_gguf.py writes it and
src/llama-model.cpp reads it back: the HF names of its layers' tensors, what the converter did to their values, and
the `ModelConfig` fields beyond the llama family's.

- llama (Llama, Mistral, SmolLM, Mixtral with experts), qwen2, qwen3, qwen3moe: the llama family; llama files' q/k
  rows are interleaved by the converter (`checkpoint.unpermute_rotary` undoes it).
- gemma2, gemma3 (Gemma 3's text model): every RMSNorm weight is stored as w + 1 (Gemma's norm scales by 1 + w),
  served back as w; norms before and after attention and the MLP (`post_attention_norm`, `ffn_norm`,
  `post_ffw_norm`); GeGLU; embeddings scaled by √hidden. q/k rows stay in HF's order. No file says which layers
  slide: llama.cpp's fixed patterns (Gemma 2 every other layer from the first, Gemma 3 all but every 6th) unless
  `attention.sliding_window_pattern` says otherwise.
- phi3 (Phi-3, 3.5, 4, 4-mini): q/k/v fused in `attn_qkv`, gate and up stacked in `ffn_up`, both as HF's Phi3
  stores them; LongRoPE as the `rope_factors_long` / `rope_factors_short` tensors and `rope.scaling.*` keys;
  partial rotary as `rope.dimension_count` below the head size.
- olmoe (OLMoE): the llama family's tensors with q/k rows in HF's order (llama.cpp rotates NeoX-style), q's and k's
  RMSNorms over the whole projection (`attn_q_norm` [hidden], `attn_k_norm` [kv heads * head_dim]: HF's OLMoE norms
  all heads at once); every layer a mixture, softmax routing, the top k NOT renormalised (llama.cpp's olmoe graph
  passes norm_w = false; an `expert_weights_norm` key, which the converter does not write, is followed), experts
  `feed_forward_length` wide. The converter writes `layer_norm_rms_epsilon` as 1e-5 whatever the config says (every
  OLMoE's value) and no clip_qkv, and llama.cpp's olmoe graph clips nothing: a file is served unclipped, and one
  carrying `attention.clamp_kqv` (which llama.cpp would ignore, and which does not say whether it clips before or
  after the norms) is refused by name.
- gpt-oss (GptOssForCausalLM; llama.cpp's LLM_ARCH_OPENAI_MOE): q/k/v/o biased, rows in HF's order; each head's
  attention sink as `attn_sinks.weight` (HF's `self_attn.sinks`, no `.weight`); `post_attention_norm` is HF's
  post_attention_layernorm (the MLP's input norm). The router is biased (`ffn_gate_inp.bias`, float32); softmax over
  the top k of its logits (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT); experts biased (`ffn_{gate,up,down}_exps
  .bias`), `expert_feed_forward_length` wide, gate and up split apart by the converter (HF interleaves them: gate
  rows 0::2, up 1::2). The clamped SwiGLU's alpha 1.702 and limit 7.0 are llama.cpp constants (no key carries
  them): every file is served with them. Sliding layers from `attention.sliding_window`, in llama.cpp's pattern
  (period 2: even layers slide) unless `attention.sliding_window_pattern` says otherwise; their rotary is the full
  layers' unless `rope.freq_base_swa` gives another base. YaRN from the `rope.scaling.*` keys, unrounded
  (`truncate` false: every released gpt-oss config and OpenAI's reference; llama.cpp rounds its correction range,
  a small departure we do not copy). Expert matrices in any type we decode, MXFP4 (how the converter repacks the
  released checkpoints) included; attention scores scaled by head_dim ** -0.5.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import gguf

from services.text.errors import ModelLoadError

from ..model_config import MoEConfig
from .dequantize import dequantize


class GgufCheckpoint(Protocol):
    """What a family's mapping reads of a file (`checkpoint.GgufCheckpoint`)."""

    path: Path
    reader: gguf.GGUFReader

    def hparam(self, key: str, default=None): ...


_ARCH, _T = gguf.MODEL_ARCH_NAMES, gguf.MODEL_TENSOR
_OLMOE, _GPT_OSS = _ARCH[gguf.MODEL_ARCH.OLMOE], _ARCH[gguf.MODEL_ARCH.GPT_OSS]


def tensor_name(tensor: gguf.MODEL_TENSOR) -> str:
    """gguf-py's name for the tensor, without a layer's `blk.{bid}.`."""
    return gguf.TENSOR_NAMES[tensor].removeprefix("blk.{bid}.")


def _names(*pairs: tuple[gguf.MODEL_TENSOR, str]) -> dict[str, str]:
    return {tensor_name(t): hf for t, hf in pairs}


_ATTENTION = ((_T.ATTN_Q, "self_attn.q_proj"), (_T.ATTN_K, "self_attn.k_proj"), (_T.ATTN_V, "self_attn.v_proj"),
              (_T.ATTN_OUT, "self_attn.o_proj"))
_QK_NORMS = ((_T.ATTN_Q_NORM, "self_attn.q_norm"), (_T.ATTN_K_NORM, "self_attn.k_norm"))  # per-head RMSNorms
_MLP = ((_T.FFN_GATE, "mlp.gate_proj"), (_T.FFN_UP, "mlp.up_proj"), (_T.FFN_DOWN, "mlp.down_proj"))
_LLAMA_LAYER = _names(*_ATTENTION, *_QK_NORMS, *_MLP, (_T.ATTN_NORM, "input_layernorm"),
                      (_T.FFN_NORM, "post_attention_layernorm"), (_T.FFN_GATE_INP, "mlp.gate"))  # a mixture's router
# Gemma's four norms: HF's post_attention_layernorm is the norm of attention's output, not the MLP's input.
_GEMMA2_LAYER = _names(*_ATTENTION, *_MLP, (_T.ATTN_NORM, "input_layernorm"),
                       (_T.ATTN_POST_NORM, "post_attention_layernorm"), (_T.FFN_NORM, "pre_feedforward_layernorm"),
                       (_T.FFN_POST_NORM, "post_feedforward_layernorm"))
_GEMMA3_LAYER = {**_GEMMA2_LAYER, **_names(*_QK_NORMS)}
# Phi-3's fused projections under HF's own names (llama.cpp also reads q/k/v apart, which the loader fuses); its
# ffn_up is HF's gate_up_proj, gate rows first.
_PHI3_LAYER = _names(*_ATTENTION, (_T.ATTN_QKV, "self_attn.qkv_proj"), (_T.ATTN_NORM, "input_layernorm"),
                     (_T.FFN_NORM, "post_attention_layernorm"), (_T.FFN_UP, "mlp.gate_up_proj"),
                     (_T.FFN_DOWN, "mlp.down_proj"))
# gpt-oss: llama.cpp's post_attention_norm is its MLP's input norm (HF's post_attention_layernorm), and its sinks
# one logit per head.
_GPT_OSS_LAYER = _names(*_ATTENTION, (_T.ATTN_NORM, "input_layernorm"), (_T.ATTN_POST_NORM, "post_attention_layernorm"),
                        (_T.ATTN_SINKS, "self_attn.sinks"), (_T.FFN_GATE_INP, "mlp.gate"))
# HF parameters named without `.weight`: the file's `<name>.weight` is HF's `<name>`.
BARE_PARAMETERS = frozenset({"self_attn.sinks"})
# llama.cpp's gpt-oss SwiGLU (llama-graph.cpp, LLM_FFN_SWIGLU_OAI_MOE): constants, in no file.
GPT_OSS_SWIGLU_ALPHA, GPT_OSS_SWIGLU_LIMIT = 1.702, 7.0
# Tensors that are not weights: rotary scaling, read into the config.
ROPE_FREQS, ROPE_LONG, ROPE_SHORT = (f"{tensor_name(t)}.weight" for t in (
    _T.ROPE_FREQS, _T.ROPE_FACTORS_LONG, _T.ROPE_FACTORS_SHORT))
NOT_WEIGHTS = frozenset({ROPE_FREQS, ROPE_LONG, ROPE_SHORT})


@dataclass(frozen=True)
class Family:
    architecture: str  # the HF architecture whose config and weight names the file maps to
    layer_names: dict[str, str]  # a layer's gguf tensor name -> HF's, under model.layers.N
    permuted_qk: bool = False  # llama.cpp's converter interleaved the rotary halves of q's and k's rows
    norm_plus_one: bool = False  # the converter stored every RMSNorm weight + 1
    rope: Callable[[GgufCheckpoint], dict] | None = None  # the rotary scaling, where not the llama family's keys
    fields: Callable[[GgufCheckpoint, dict], dict] | None = None  # more ModelConfig fields, given the rest


def _full_attention_layers(ck: GgufCheckpoint, layers: int, period: int) -> frozenset[int]:
    """llama.cpp's `set_swa_pattern(period)`: layer i slides iff i % period < period - 1 (0: every layer); a file's
    `attention.sliding_window_pattern`, a period or one flag per layer (true: sliding), overrides it."""
    pattern = ck.hparam("attention.sliding_window_pattern", period)
    if isinstance(pattern, list):
        return frozenset(i for i, sliding in enumerate(pattern) if not sliding)
    return frozenset(i for i in range(layers) if not (pattern == 0 or i % pattern < pattern - 1))


def _gemma(base: dict, model_27b_layers: int) -> dict:
    """Gemma 2's and 3's common fields. The converter writes no query_pre_attn_scalar: llama.cpp scales scores by
    (hidden / heads) ** -0.5 for the 27B models, which it tells by their layer count, and head_dim ** -0.5 for the
    rest. We do the same: it is HF's query_pre_attn_scalar ** -0.5 in every released config (144 and 168 =
    hidden / heads for Gemma 2 / 3 27B, 256 = head_dim for the others)."""
    hidden, heads, layers = base["hidden_size"], base["num_heads"], base["num_layers"]
    return dict(hidden_act="gelu_pytorch_tanh", norm_weight_offset=True, embedding_scale=hidden ** 0.5,
                sandwich_norms=True,
                query_pre_attn_scalar=float(hidden // heads if layers == model_27b_layers else base["head_dim"]))


def _gemma2(ck: GgufCheckpoint, base: dict) -> dict:
    """llama.cpp's defaults where a key is absent (the converter writes all three): a window of 4096, scores capped
    at 50 and logits at 30. Its rotary is the model's in every layer unless `rope.freq_base_swa` gives the sliding
    layers another base."""
    swa_base = ck.hparam("rope.freq_base_swa", base["rope_theta"])
    return dict(_gemma(base, model_27b_layers=46),
                sliding_window=int(ck.hparam("attention.sliding_window", 4096)),
                full_attention_layers=_full_attention_layers(ck, base["num_layers"], 2),
                attention_softcap=float(ck.hparam("attn_logit_softcapping", 50.0)),
                final_logit_softcap=float(ck.hparam("final_logit_softcapping", 30.0)),
                sliding_rope=None if swa_base == base["rope_theta"] else (float(swa_base), base["rope_scaling"]))


def _gemma3(ck: GgufCheckpoint, base: dict) -> dict:
    """Sliding layers (where the file has a window) rotate by base `rope.freq_base_swa` (llama.cpp: 10 000, as every
    released Gemma 3; the newer converter writes HF's value), unscaled; the full layers by `rope.freq_base` and
    the file's `rope.scaling.*`. No score soft-capping; logits capped where the file says (HF's
    final_logit_softcapping, written where set)."""
    window = int(ck.hparam("attention.sliding_window", 0))
    cap = ck.hparam("final_logit_softcapping", 0.0)
    return dict(_gemma(base, model_27b_layers=62),
                sliding_window=window or None,
                full_attention_layers=_full_attention_layers(ck, base["num_layers"], 6) if window else frozenset(),
                final_logit_softcap=float(cap) if cap else None,
                sliding_rope=(float(ck.hparam("rope.freq_base_swa", 10000.0)), {}) if window else None)


def _phi3(ck: GgufCheckpoint, base: dict) -> dict:
    """The converter writes sliding_window 0 for none. A window slides in every layer, as in transformers (llama.cpp
    turns Phi-3's window off altogether)."""
    return dict(sliding_window=int(ck.hparam("attention.sliding_window", 0)) or None)


def _mixture(ck: GgufCheckpoint, base: dict, arch: str) -> MoEConfig:
    """Every layer of these architectures is a mixture: a file without experts is no such model."""
    if base["moe"] is None:
        raise ModelLoadError(f"GGUF file {ck.path} is {arch} but has no {arch}.expert_count")
    return base["moe"]


def _olmoe(ck: GgufCheckpoint, base: dict) -> dict:
    """q/k norms whole; no clipping (refused where a file asks for it); the top k as the router's softmax gave it."""
    if gguf.Keys.Attention.CLAMP_KQV.format(arch=_OLMOE) in ck.reader.fields:
        raise ModelLoadError(f"GGUF olmoe file {ck.path} sets attention.clamp_kqv, which llama.cpp's olmoe graph "
                             "ignores and no converter writes; tokenfleet does not guess where OLMoE clips")
    moe = _mixture(ck, base, _OLMOE)
    return dict(qk_norm_whole=True, clip_qkv=None,
                moe=replace(moe, renormalize=bool(ck.hparam("expert_weights_norm", False))))


def _gpt_oss(ck: GgufCheckpoint, base: dict) -> dict:
    """Sinks, the biased router and experts with llama.cpp's clamped SwiGLU, the sliding pattern and unrounded
    YaRN (the module's docstring)."""
    moe = _mixture(ck, base, _GPT_OSS)
    names = {t.name for t in ck.reader.tensors}
    swa_base = ck.hparam("rope.freq_base_swa", base["rope_theta"])
    rope = base["rope_scaling"]
    if rope.get("rope_type") == "yarn":
        rope = {**rope, "truncate": False}
    return dict(attention_sinks=True, rope_scaling=rope,
                sliding_window=int(ck.hparam("attention.sliding_window")),
                full_attention_layers=_full_attention_layers(ck, base["num_layers"], 2),
                sliding_rope=None if swa_base == base["rope_theta"] else (float(swa_base), rope),
                moe=replace(moe, renormalize=False, softmax_over_top_k=True,
                            router_bias="blk.0.ffn_gate_inp.bias" in names,
                            clamped_swiglu=(GPT_OSS_SWIGLU_ALPHA, GPT_OSS_SWIGLU_LIMIT)))


def phi3_rope(ck: GgufCheckpoint) -> dict:
    """LongRoPE as `rope.py` takes it: the converter's factor tensors (HF's short_factor / long_factor),
    `rope.scaling.original_context_length`, and HF's attention factor as `rope.scaling.attn_factor`; `factor` is
    context / original, as Phi3Config defaults it. Partial rotary where `rope.dimension_count` is below head_dim."""
    kind = ck.hparam("rope.scaling.type", "none")
    if kind not in ("none", "longrope"):
        raise ModelLoadError(f"GGUF phi3 RoPE scaling {kind!r} is not supported; supported: none and longrope")
    factors = {t.name: t for t in ck.reader.tensors if t.name in (ROPE_LONG, ROPE_SHORT)}
    scaling = {}
    if factors or kind == "longrope":
        if missing := sorted({ROPE_LONG, ROPE_SHORT} - factors.keys()):
            raise ModelLoadError(f"GGUF file {ck.path} has LongRoPE without {' and '.join(missing)}")
        original = int(ck.hparam("rope.scaling.original_context_length"))
        scaling = {"rope_type": "longrope", "original_max_position_embeddings": original,
                   "factor": ck.hparam("context_length") / original,
                   "short_factor": dequantize(factors[ROPE_SHORT]).flatten().tolist(),
                   "long_factor": dequantize(factors[ROPE_LONG]).flatten().tolist()}
        if (attention_factor := ck.hparam("rope.scaling.attn_factor", -1.0)) != -1.0:
            scaling["attention_factor"] = float(attention_factor)
    head_dim = ck.hparam("attention.key_length", ck.hparam("embedding_length") // ck.hparam("attention.head_count"))
    dims = ck.hparam("rope.dimension_count", head_dim)
    if dims != head_dim:
        partial = dims / head_dim
        if int(head_dim * partial) != dims:  # `rope.rotary_dim` rounds head_dim * factor down
            partial = math.nextafter(partial, 1.0)
        scaling["partial_rotary_factor"] = partial
    return scaling


FAMILIES = {
    _ARCH[gguf.MODEL_ARCH.LLAMA]: Family("LlamaForCausalLM", _LLAMA_LAYER, permuted_qk=True),
    _ARCH[gguf.MODEL_ARCH.QWEN2]: Family("Qwen2ForCausalLM", _LLAMA_LAYER),
    _ARCH[gguf.MODEL_ARCH.QWEN3]: Family("Qwen3ForCausalLM", _LLAMA_LAYER),
    _ARCH[gguf.MODEL_ARCH.QWEN3MOE]: Family("Qwen3MoeForCausalLM", _LLAMA_LAYER),
    _ARCH[gguf.MODEL_ARCH.GEMMA2]: Family("Gemma2ForCausalLM", _GEMMA2_LAYER, norm_plus_one=True, fields=_gemma2),
    _ARCH[gguf.MODEL_ARCH.GEMMA3]: Family("Gemma3ForCausalLM", _GEMMA3_LAYER, norm_plus_one=True, fields=_gemma3),
    _ARCH[gguf.MODEL_ARCH.PHI3]: Family("Phi3ForCausalLM", _PHI3_LAYER, rope=phi3_rope, fields=_phi3),
    _OLMOE: Family("OlmoeForCausalLM", _LLAMA_LAYER, fields=_olmoe),
    _GPT_OSS: Family("GptOssForCausalLM", _GPT_OSS_LAYER, fields=_gpt_oss),
}
