"""Reads an HF `config.json` into the few numbers our model code needs, refusing what it cannot serve."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.text.errors import ModelLoadError

from .ops import GATED_ACTIVATIONS

# architecture name in config.json -> whether q/k/v projections carry a bias
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
    "Qwen3ForCausalLM": False,
    "Qwen3MoeForCausalLM": False,
    "MixtralForCausalLM": False,
    "Phi3ForCausalLM": False,  # Phi-3, Phi-3.5, Phi-4, Phi-4-mini: q/k/v and gate/up stored fused, as ours
    "Gemma2ForCausalLM": False,
    "Gemma3ForCausalLM": False,  # Gemma 3's text model (1B; the larger ones ship with vision, not served)
    "GptOssForCausalLM": False,  # q/k/v/o biased by `attention_bias`, as Llama's are
    "OlmoeForCausalLM": False,
}
# architectures that RMS-normalise each head of q and of k before rotary
QK_NORM_ARCHITECTURES = frozenset({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"})
# architectures that RMS-normalise q and k whole (all heads at once) before rotary
WHOLE_QK_NORM_ARCHITECTURES = frozenset({"OlmoeForCausalLM"})

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts in place of the MLP: a router scores `num_experts` SwiGLU experts for each token, which
    runs through its `experts_per_token` best, their outputs weighted by the router's softmax probabilities (those k
    renormalised to sum to 1 where `renormalize`). `dense_layers` keep one dense MLP of the model's
    `intermediate_size` instead. gpt-oss's differ: `softmax_over_top_k` (the top k of the router's logits, biased
    where `router_bias`, then a softmax over those k alone: `renormalize` is moot) and `clamped_swiglu` (alpha,
    limit): experts with biased projections and a clamped SwiGLU (`mlp.ClampedSwiGLUMLP`)."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    renormalize: bool
    dense_layers: frozenset[int] = frozenset()
    router_bias: bool = False
    softmax_over_top_k: bool = False
    clamped_swiglu: tuple[float, float] | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    qk_norm_whole: bool = False  # OLMoE: q's and k's norms span all their heads at once, not each head
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to ±clip_qkv after the norms
    attention_sinks: bool = False  # gpt-oss: each head's softmax joined by a learned logit (`self_attn.sinks`)
    sliding_window: int | None = None  # each token sees itself and the window - 1 before it, in every layer but:
    full_attention_layers: frozenset[int] = frozenset()  # (hybrid models: Qwen2 below max_window_layers, Gemma)
    moe: MoEConfig | None = None
    hidden_act: str = "silu"  # the gated MLP's activation (`ops.GATED_ACTIVATIONS`)
    # Gemma's: norms scale by 1 + weight, embeddings by √hidden; norms after attention and MLP too ("sandwich");
    # scores scaled by query_pre_attn_scalar ** -0.5 and (Gemma 2) attention scores and final logits soft-capped;
    # (Gemma 3) sliding layers with a rotary of their own, (theta, scaling).
    norm_weight_offset: bool = False
    embedding_scale: float | None = None
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attention_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_rope: tuple[float, dict] | None = None
    checkpoint_dtype: torch.dtype = torch.float32
    eos_token_ids: frozenset[int] = frozenset()

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window_of(self, layer: int) -> int | None:
        """The layer's sliding window; None: it attends to the whole context."""
        return None if layer in self.full_attention_layers else self.sliding_window

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir} has no config.json: not an HF model directory")
        raw = json.loads(path.read_text())
        return cls.from_dict(raw, _generation_eos(Path(model_dir)))

    @classmethod
    def from_dict(cls, raw: dict, extra_eos: frozenset[int] = frozenset()) -> ModelConfig:
        arch = (raw.get("architectures") or ["<none>"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch!r}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        try:
            num_heads = raw["num_attention_heads"]
            hidden = raw["hidden_size"]
            rope = _architecture_rope(arch, raw)
            return cls(
                architecture=arch,
                hidden_size=hidden,
                num_layers=raw["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=raw.get("num_key_value_heads") or num_heads,
                head_dim=raw.get("head_dim") or hidden // num_heads,
                intermediate_size=raw["intermediate_size"],
                vocab_size=raw["vocab_size"],
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope.pop("rope_theta", 10000.0)),
                rope_scaling=rope,
                max_position_embeddings=raw.get("max_position_embeddings", 2048),
                tie_word_embeddings=raw.get("tie_word_embeddings", False),
                qkv_bias=SUPPORTED_ARCHITECTURES[arch] or raw.get("attention_bias", False),
                # Where a config has `attention_bias`, transformers biases o_proj by it too (Llama, Qwen3, Gemma,
                # gpt-oss, OLMoE); Mistral, Mixtral and Phi-3 have no such field, and Qwen2 (q/k/v always biased)
                # never biases o_proj, whatever its config says.
                o_proj_bias=raw.get("attention_bias", False) and not SUPPORTED_ARCHITECTURES[arch],
                qk_norm=arch in QK_NORM_ARCHITECTURES | WHOLE_QK_NORM_ARCHITECTURES,
                qk_norm_whole=arch in WHOLE_QK_NORM_ARCHITECTURES,
                clip_qkv=raw.get("clip_qkv") if arch == "OlmoeForCausalLM" else None,
                attention_sinks=arch == "GptOssForCausalLM",
                sliding_window=(window := _sliding_window(raw)),
                full_attention_layers=_full_attention_layers(raw) if window is not None else frozenset(),
                moe=_MOE_READERS[arch](raw) if arch in _MOE_READERS else None,
                hidden_act=_gated_activation(raw),
                **(_gemma_fields(arch, raw) if arch.startswith("Gemma") else {}),
                checkpoint_dtype=_DTYPES.get(raw.get("dtype") or raw.get("torch_dtype"), torch.float32),
                eos_token_ids=frozenset(_as_list(raw.get("eos_token_id"))) | extra_eos,
            )
        except KeyError as missing:
            raise ModelLoadError(f"config.json lacks required field {missing}") from None


def _qwen3_moe(raw: dict) -> MoEConfig:
    """Sparse where `decoder_sparse_step` divides the layer's number (from 1) and `mlp_only_layers` leaves it."""
    experts, step = raw.get("num_experts") or raw["num_local_experts"], raw.get("decoder_sparse_step", 1)
    dense = {i for i in range(raw["num_hidden_layers"])
             if i in (raw.get("mlp_only_layers") or []) or not (experts > 0 and (i + 1) % step == 0)}
    return MoEConfig(experts, raw["num_experts_per_tok"], raw["moe_intermediate_size"],
                     raw.get("norm_topk_prob", False), frozenset(dense))


def _mixtral_moe(raw: dict) -> MoEConfig:
    """Every layer sparse; the top k always renormalised (transformers' Mixtral router does so unconditionally)."""
    return MoEConfig(raw["num_local_experts"], raw["num_experts_per_tok"], raw["intermediate_size"], True)


def _olmoe_moe(raw: dict) -> MoEConfig:
    """Every layer sparse; Qwen3-MoE's router (softmax, top k, renormalised where `norm_topk_prob`)."""
    return MoEConfig(raw.get("num_experts") or raw["num_local_experts"], raw["num_experts_per_tok"],
                     raw["intermediate_size"], raw.get("norm_topk_prob", False))


def _gpt_oss_moe(raw: dict) -> MoEConfig:
    """Every layer sparse. The clamped SwiGLU's alpha is `swiglu_alpha` in transformers 5 (1.702 by default: the
    value 4.x fixed in code, and no released config.json names it); its limit `swiglu_limit`."""
    return MoEConfig(raw["num_local_experts"], raw["num_experts_per_tok"], raw["intermediate_size"], False,
                     router_bias=True, softmax_over_top_k=True,
                     clamped_swiglu=(float(raw.get("swiglu_alpha") or 1.702), float(raw.get("swiglu_limit") or 7.0)))


_MOE_READERS = {"Qwen3MoeForCausalLM": _qwen3_moe, "MixtralForCausalLM": _mixtral_moe,
                "OlmoeForCausalLM": _olmoe_moe, "GptOssForCausalLM": _gpt_oss_moe}


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


# gpt-oss's rotary where its config names none: GptOssConfig's default (its theta defaults to 150000)
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def _rope_parameters(raw: dict) -> dict:
    """transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params = dict(params.get("full_attention", params))  # per layer kind (Gemma 3): the full layers' is the model's
    default_theta = 10000.0
    if raw.get("model_type") == "gpt_oss":
        default_theta, params = 150000.0, params or dict(_GPT_OSS_ROPE)
    params.setdefault("rope_theta", raw.get("rope_theta", default_theta))
    return _normalised_rope(params)


def _normalised_rope(params: dict) -> dict:
    """`rope_theta`, and where the kind is not plain RoPE its parameters under `rope_type` (`type` in older
    configs), as `RotaryEmbedding` takes them."""
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    return {**params, "rope_type": rope_type} if rope_type != "default" else {"rope_theta": params["rope_theta"]}


def _architecture_rope(arch: str, raw: dict) -> dict:
    """LongRoPE and partial rotary are served as Phi-3 defines them. Other architectures rotate whole heads in
    transformers, and their longrope is not what our per-position choice (`rope.py`) was checked against."""
    rope = _rope_parameters(raw)
    if arch == "Phi3ForCausalLM":
        return _phi3_rope(raw, rope)
    if rope.get("rope_type") == "longrope":
        raise ModelLoadError(f"rope scaling 'longrope' is served for Phi3ForCausalLM only, not {arch}")
    rope.pop("partial_rotary_factor", None)
    return rope


def _phi3_rope(raw: dict, rope: dict) -> dict:
    """Phi3Config's readings: `su` and `yarn` are its old names for longrope, and no other scaling is valid; the
    top-level `original_max_position_embeddings` (default 4096) wins over the rope parameters' own; longrope's
    `factor` defaults to max_position_embeddings / original; `partial_rotary_factor` sits in the rope parameters
    or at the top level (Phi-4-mini's config.json)."""
    kind = rope.get("rope_type", "default")
    if kind in ("su", "yarn", "longrope"):
        original = raw.get("original_max_position_embeddings", 4096)
        rope = {**rope, "rope_type": "longrope", "original_max_position_embeddings": original}
        if rope.get("factor") is None:
            rope["factor"] = raw.get("max_position_embeddings", 4096) / original
    elif kind != "default":
        raise ModelLoadError(f"Phi3ForCausalLM's rope scaling must be longrope or none, not {kind!r}")
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    rope.pop("partial_rotary_factor", None)
    return rope if partial == 1.0 else {**rope, "partial_rotary_factor": partial}


def _sliding_window(raw: dict) -> int | None:
    window = raw.get("sliding_window")
    if window is None:
        return None
    if raw.get("model_type") == "qwen2":
        layer_types = raw.get("layer_types") or []
        if not raw.get("use_sliding_window", False) and "sliding_attention" not in layer_types:
            return None
    return int(window)


def _full_attention_layers(raw: dict) -> frozenset[int]:
    """transformers 5 names each layer's attention in `layer_types`; before it, Gemma 2 slid in its even layers and
    Gemma 3 in all but every `sliding_window_pattern`-th; other configs without them (Mistral, Phi-3) slide in every
    layer."""
    layers = range(raw["num_hidden_layers"])
    if (kinds := raw.get("layer_types")) is not None:
        return frozenset(i for i, kind in enumerate(kinds) if kind != "sliding_attention")
    if raw.get("model_type") == "gemma2":
        return frozenset(i for i in layers if i % 2)
    if raw.get("model_type") in ("gemma3_text", "gemma3"):
        return frozenset(i for i in layers if (i + 1) % raw.get("sliding_window_pattern", 6) == 0)
    return frozenset()


def _gated_activation(raw: dict) -> str:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act not in GATED_ACTIVATIONS:
        raise ModelLoadError(f"MLP activation {act!r} is not served; served: {', '.join(GATED_ACTIVATIONS)}")
    return act


def _gemma_fields(arch: str, raw: dict) -> dict:
    """Gemma 2 and 3 as transformers 5 reads their configs (the defaults are its configuration classes')."""
    fields = dict(norm_weight_offset=True, embedding_scale=raw["hidden_size"] ** 0.5, sandwich_norms=True,
                  query_pre_attn_scalar=raw.get("query_pre_attn_scalar", 256),
                  attention_softcap=raw.get("attn_logit_softcapping"),
                  final_logit_softcap=raw.get("final_logit_softcapping"))
    if arch == "Gemma3ForCausalLM":
        local = {"rope_theta": raw.get("rope_local_base_freq", 10000.0),
                 **((raw.get("rope_parameters") or {}).get("sliding_attention") or {})}
        local = _normalised_rope(local)
        fields["sliding_rope"] = (float(local.pop("rope_theta")), local)
    return fields


def _generation_eos(model_dir: Path) -> frozenset[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return frozenset()
    return frozenset(_as_list(json.loads(path.read_text()).get("eos_token_id")))


def resolve_dtype(requested: str | torch.dtype, checkpoint: torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` follows the checkpoint, except float16 on CPU, which torch runs orders of magnitude slower than
    bfloat16 there."""
    if isinstance(requested, torch.dtype):
        return requested
    if requested == "auto":
        if checkpoint == torch.float16 and device.type == "cpu":
            return torch.bfloat16
        return checkpoint
    if requested not in _DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {requested!r}")
    return _DTYPES[requested]


def resolve_max_model_len(config: ModelConfig, requested: int | None) -> int:
    """The model's positions, or fewer where asked; never more."""
    limit = config.max_position_embeddings
    if requested is not None and requested > limit:
        raise ModelLoadError(f"max_model_len {requested} exceeds the model's {limit} positions")
    return requested or limit
