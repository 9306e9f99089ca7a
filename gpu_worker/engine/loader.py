"""Loads a checkpoint's weights (HF names and layout, whatever the file format) into our `Transformer`."""

from __future__ import annotations

import torch

from .attention import CpuPagedAttention
from .checkpoint import Checkpoint
from .errors import ModelLoadError
from .kernels import cpu_kernels
from .linear import pack_linears
from .model import Transformer
from .model_config import ModelConfig
from .rope import RotaryEmbedding

# HF name fragment -> (our fused parameter fragment, shard index)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def _shard_sizes(cfg: ModelConfig, fused: str) -> list[int]:
    if fused.endswith("qkv_proj"):
        kv = cfg.num_kv_heads * cfg.head_dim
        return [cfg.num_heads * cfg.head_dim, kv, kv]
    return [cfg.intermediate_size, cfg.intermediate_size]


def _target(name: str, cfg: ModelConfig) -> tuple[str, int | None]:
    """HF parameter name -> (our parameter name, row offset into a fused parameter or None)."""
    name = name.removeprefix("model.")
    for hf, (ours, shard) in _FUSED.items():
        if f".{hf}." in name:
            return name.replace(hf, ours), sum(_shard_sizes(cfg, ours)[:shard])
    return name, None


def load_model(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device) -> Transformer:
    cfg = checkpoint.config
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to(dtype).to_empty(device=device)  # cast on meta: no full-precision copy on the device
    params = dict(model.named_parameters())
    loaded_rows: dict[str, int] = {}
    for hf_name, tensor in checkpoint.tensors():
        _copy(tensor, hf_name, params, loaded_rows, cfg)
    if cfg.tie_word_embeddings and "lm_head.weight" not in loaded_rows:
        model.lm_head.weight = model.embed_tokens.weight
        loaded_rows["lm_head.weight"] = model.lm_head.weight.shape[0]
    missing = [n for n, p in params.items() if loaded_rows.get(n, 0) != p.shape[0]]
    if missing:
        raise ModelLoadError(f"checkpoint {checkpoint.path} lacks weights: {', '.join(missing[:8])}"
                             + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    # Built after the dtype cast: frequencies stay float32, as in HF.
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    use_cpu_kernels(model, dtype, device)
    return model.eval()


def use_cpu_kernels(model: Transformer, dtype: torch.dtype, device: torch.device) -> None:
    """bf16 on CPU: prepacked / native linear kernels and paged decode attention from the cache."""
    pack_linears(model)
    kernels = cpu_kernels() if device.type == "cpu" and dtype == torch.bfloat16 else None
    if CpuPagedAttention.supports(kernels, dtype, device, model.config.head_dim):
        for layer in model.layers:
            layer.self_attn.attn = CpuPagedAttention(layer.self_attn.attn.scale, kernels)


def _copy(tensor: torch.Tensor, hf_name: str, params: dict, loaded_rows: dict, cfg: ModelConfig) -> None:
    if hf_name.endswith("rotary_emb.inv_freq"):
        return
    name, offset = _target(hf_name, cfg)
    if name not in params:
        raise ModelLoadError(f"checkpoint weight {hf_name!r} has no place in {cfg.architecture}")
    param = params[name]
    rows = param.data if offset is None else param.data[offset:offset + tensor.shape[0]]
    if rows.shape != tensor.shape:
        raise ModelLoadError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(rows.shape)}")
    with torch.no_grad():
        rows.copy_(tensor)
    loaded_rows[name] = loaded_rows.get(name, 0) + tensor.shape[0]
