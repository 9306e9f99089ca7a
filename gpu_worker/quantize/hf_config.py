"""A served model's `ModelConfig` (a GGUF file's, as `engine/gguf` read it) as its HF config.json: one entry per
architecture, with the fields that architecture's transformers configuration class reads, and which of our fused
linears its checkpoints keep fused (Phi-3's q/k/v and gate/up; every other splits them).

Whatever a config says must serve the model the file served: `hf_config` reads the dict back as
`ModelConfig.from_dict` does and refuses, naming the fields, a file whose model no HF config of its architecture
describes (e.g. a Gemma 2 file whose sliding layers rotate by a base of their own, an OLMoE file with a window).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from gpu_worker.engine.model_config import ModelConfig
from services.text.errors import ModelLoadError

DROP = object()  # a common field the architecture's config has no place for


@dataclass(frozen=True)
class HFArchitecture:
    model_type: str
    fields: Callable[[ModelConfig], dict] = lambda cfg: {}  # beyond (or replacing) `_common`'s; DROP: leave it out
    fused: frozenset[str] = frozenset()  # our fused linears that HF's checkpoints store fused too


def _common(cfg: ModelConfig) -> dict:
    """The llama family's fields: rotary as HF's rope parameters or, for a GGUF file's per-frequency factors
    (`rope_freqs`), the same form, which `rope.py` alone reads."""
    return {"architectures": [cfg.architecture], "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
            "hidden_act": cfg.hidden_act, "rope_parameters": {"rope_theta": cfg.rope_theta, **cfg.rope_scaling},
            "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
            "attention_bias": cfg.qkv_bias, "sliding_window": cfg.sliding_window,
            "eos_token_id": sorted(cfg.eos_token_ids), "pad_token_id": None,
            "torch_dtype": str(cfg.checkpoint_dtype).removeprefix("torch.")}


def _layer_types(cfg: ModelConfig) -> list[str]:
    return ["full_attention" if cfg.window_of(i) is None else "sliding_attention" for i in range(cfg.num_layers)]


def _qwen3_moe(cfg: ModelConfig) -> dict:
    """Every layer sparse but `mlp_only_layers`."""
    moe = cfg.moe
    return {} if moe is None else {
        "num_experts": moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
        "moe_intermediate_size": moe.expert_intermediate_size, "norm_topk_prob": moe.renormalize,
        "mlp_only_layers": sorted(moe.dense_layers), "decoder_sparse_step": 1}


def _mixtral(cfg: ModelConfig) -> dict:
    moe = cfg.moe
    return {} if moe is None else {"num_local_experts": moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
                                   "intermediate_size": moe.expert_intermediate_size}


def _gemma(cfg: ModelConfig) -> dict:
    """Gemma 2 and 3: GeGLU as `hidden_activation`, scores by query_pre_attn_scalar, each layer's attention in
    `layer_types`; soft-capping where the model caps (None: no capping). Norms of 1 + w and the √hidden
    embedding scale are the architectures' own."""
    scalar = cfg.query_pre_attn_scalar
    return {"hidden_act": DROP, "hidden_activation": cfg.hidden_act,
            "query_pre_attn_scalar": int(scalar) if scalar is not None and scalar == int(scalar) else scalar,
            "layer_types": _layer_types(cfg), "attn_logit_softcapping": cfg.attention_softcap,
            "final_logit_softcapping": cfg.final_logit_softcap}


def _gemma3(cfg: ModelConfig) -> dict:
    """Rope parameters per layer type: the full layers' the model's, the sliding layers' their own."""
    theta, scaling = cfg.sliding_rope or (cfg.rope_theta, cfg.rope_scaling)
    return {**_gemma(cfg), "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta, **cfg.rope_scaling},
        "sliding_attention": {"rope_type": "default", "rope_theta": theta, **scaling}}}


def _phi3(cfg: ModelConfig) -> dict:
    """LongRoPE's short and long factors, factor and attention factor in the rope parameters, its original context
    at the top level too (where Phi3Config reads it); partial rotary as `partial_rotary_factor`. No biases: HF's
    Phi-3 has none. HF's Phi-3 sizes its rotary by hidden / heads."""
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        raise ModelLoadError(f"Phi3ForCausalLM's heads are hidden / heads wide in HF's config, not {cfg.head_dim}")
    original = cfg.rope_scaling.get("original_max_position_embeddings")
    return {"attention_bias": DROP,
            **({} if original is None else {"original_max_position_embeddings": original})}


def _olmoe(cfg: ModelConfig) -> dict:
    """q/k norms over whole projections and no clipping are what OLMoE's config gives; every layer a mixture of
    `intermediate_size`-wide experts. No window: HF's OLMoE has none."""
    moe = cfg.moe
    return {"sliding_window": None, "intermediate_size": moe.expert_intermediate_size, "clip_qkv": cfg.clip_qkv,
            "num_experts": moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
            "norm_topk_prob": moe.renormalize}


ARCHITECTURES = {
    "LlamaForCausalLM": HFArchitecture("llama"),
    "MistralForCausalLM": HFArchitecture("mistral"),
    "Qwen2ForCausalLM": HFArchitecture("qwen2"),
    "Qwen3ForCausalLM": HFArchitecture("qwen3"),
    "Qwen3MoeForCausalLM": HFArchitecture("qwen3_moe", _qwen3_moe),
    "MixtralForCausalLM": HFArchitecture("mixtral", _mixtral),
    "Gemma2ForCausalLM": HFArchitecture("gemma2", _gemma),
    "Gemma3ForCausalLM": HFArchitecture("gemma3_text", _gemma3),
    "Phi3ForCausalLM": HFArchitecture("phi3", _phi3, fused=frozenset({"qkv_proj", "gate_up_proj"})),
    "OlmoeForCausalLM": HFArchitecture("olmoe", _olmoe),
}


def fused_in_hf(architecture: str) -> frozenset[str]:
    """Our fused linears that `architecture`'s HF checkpoints store fused (any architecture we serve)."""
    return ARCHITECTURES[architecture].fused if architecture in ARCHITECTURES else frozenset()


def hf_config(cfg: ModelConfig, source: str) -> dict:
    """`cfg` as config.json; a ModelLoadError naming what an HF config of its architecture cannot say."""
    if cfg.architecture not in ARCHITECTURES:
        raise ModelLoadError(f"{source}: tokenfleet quantize writes no directory from a GGUF file of "
                             f"{cfg.architecture} yet; quantize it at load time (--quantization) instead")
    arch = ARCHITECTURES[cfg.architecture]
    raw = {"model_type": arch.model_type, **_common(cfg), **arch.fields(cfg)}
    raw = {k: v for k, v in raw.items() if v is not DROP}
    differ = _differences(cfg, ModelConfig.from_dict(raw))
    if differ:
        raise ModelLoadError(f"{source}: no {cfg.architecture} config.json says this file's "
                             f"{', '.join(differ)}; quantize it at load time (--quantization) instead")
    return raw


def _differences(ours: ModelConfig, written: ModelConfig) -> list[str]:
    return [f.name for f in dataclasses.fields(ModelConfig) if getattr(ours, f.name) != getattr(written, f.name)]
