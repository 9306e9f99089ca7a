"""Reads an HF `config.json` into the few numbers our model code needs, refusing what it cannot serve."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import ModelLoadError

# architecture name in config.json -> whether q/k/v projections carry a bias
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    sliding_window: int | None = None
    checkpoint_dtype: torch.dtype = torch.float32
    eos_token_ids: frozenset[int] = frozenset()

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
            rope = _rope_parameters(raw)
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
                sliding_window=_sliding_window(raw),
                checkpoint_dtype=_DTYPES.get(raw.get("dtype") or raw.get("torch_dtype"), torch.float32),
                eos_token_ids=frozenset(_as_list(raw.get("eos_token_id"))) | extra_eos,
            )
        except KeyError as missing:
            raise ModelLoadError(f"config.json lacks required field {missing}") from None


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _rope_parameters(raw: dict) -> dict:
    """transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    return {**params, "rope_type": rope_type} if rope_type != "default" else {"rope_theta": params["rope_theta"]}


def _sliding_window(raw: dict) -> int | None:
    window = raw.get("sliding_window")
    if window is None:
        return None
    if raw.get("model_type") == "qwen2":
        layer_types = raw.get("layer_types") or []
        if not raw.get("use_sliding_window", False) and "sliding_attention" not in layer_types:
            return None
    return int(window)


def _generation_eos(model_dir: Path) -> frozenset[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return frozenset()
    return frozenset(_as_list(json.loads(path.read_text()).get("eos_token_id")))


def resolve_dtype(requested: str | torch.dtype, checkpoint: torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` follows the checkpoint, except float16 on CPU, which runs ~1000x slower than bfloat16 there."""
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
    """Without sliding-window attention we are exact only within the window, so refuse longer contexts."""
    limit = config.max_position_embeddings
    if config.sliding_window is not None and config.sliding_window < limit:
        if requested is not None and requested > config.sliding_window:
            raise ModelLoadError(
                f"this model uses sliding-window attention (window {config.sliding_window}), which tokenfleet "
                f"does not implement; set max_model_len <= {config.sliding_window} (asked {requested})"
            )
        limit = config.sliding_window
    if requested is not None and requested > limit:
        raise ModelLoadError(f"max_model_len {requested} exceeds the model's {limit} positions")
    return requested or limit
