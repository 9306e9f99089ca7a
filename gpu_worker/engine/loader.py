"""Loads a checkpoint's weights (HF names and layout, whatever the file format) into our `Transformer`.

Dense weights are copied into place (q/k/v and gate/up into their fused parameters). A pre-quantized
checkpoint's linears arrive as several tensors each (`qweight`, `scales`, ...): its format turns them into
one quantized weight per shard, and the fused linear is quantized once all its shards are in (a GGUF file's
quantized matrices arrive as such weights whole; float32, the reference dtype, serves them dense). With a
`quantizer`, dense weights are quantized at load time instead. Linear weights are allocated only when a
dense tensor arrives for them, so a quantized model never holds a dense copy.
"""

from __future__ import annotations

import os
from collections import Counter

import torch
from torch import nn

from .checkpoint import Checkpoint
from .errors import ModelLoadError
from .host_memory import move_parameters_to_huge_pages_
from .kv_cache_format import DenseKVFormat, KVCacheFormat
from .linear import Linear, RowInvariantBf16LinearKernel, pack_linears
from .model import Embedding, Transformer
from .model_config import ModelConfig
from .quantization.methods import WeightQuantizer
from .quantization.weights import QuantizedWeight, concat_rows
from .rope import RotaryEmbedding

# HF name fragment -> (our fused parameter fragment, shard index)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def shard_sizes(cfg: ModelConfig, fused: str) -> list[int]:
    if fused.endswith("qkv_proj"):
        kv = cfg.num_kv_heads * cfg.head_dim
        return [cfg.num_heads * cfg.head_dim, kv, kv]
    return [cfg.intermediate_size, cfg.intermediate_size]


def _target(name: str, cfg: ModelConfig) -> tuple[str, int | None]:
    """HF parameter name -> (our parameter name, row offset into a fused parameter or None)."""
    name = name.removeprefix("model.")
    for hf, (ours, shard) in _FUSED.items():
        if f".{hf}." in name:
            return name.replace(hf, ours), sum(shard_sizes(cfg, ours)[:shard])
    return name, None


def load_model(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device,
               quantizer: WeightQuantizer | None = None, kv_format: KVCacheFormat | None = None,
               batch_invariant: bool = False) -> Transformer:
    """`batch_invariant`: kernels whose result for a token does not depend on the other tokens of its step
    (`EngineConfig.deterministic`); a ModelLoadError where this model, dtype or device has none."""
    cfg = checkpoint.config
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to(dtype)  # cast on meta: no full-precision copy on the device
    for module in model.modules():
        if not isinstance(module, Linear):
            module.to_empty(device=device, recurse=False)
    loading = _Loading(model, cfg, dtype, device)
    fmt = getattr(checkpoint, "quantization", None)
    parts: dict[str, dict[str, torch.Tensor]] = {}  # each quantized module's tensors (qweight, scales...)
    for hf_name, tensor in checkpoint.tensors():
        module, _, suffix = hf_name.rpartition(".")
        if isinstance(tensor, QuantizedWeight):  # a GGUF matrix, quantized as the file stores it
            if dtype == torch.float32:  # the reference dtype serves dense weights, exactly the file's values
                loading.copy(hf_name, tensor.dequantize())
            else:
                loading.add_quantized(hf_name, tensor)
        elif fmt is not None and suffix in fmt.tensor_names():
            parts.setdefault(module, {})[suffix] = tensor
        else:
            loading.copy(hf_name, tensor)
    for module, tensors in parts.items():
        missing = set(fmt.required_names(tensors)) - set(tensors)
        if missing:
            raise ModelLoadError(f"checkpoint {checkpoint.path}: quantized {module} lacks {', '.join(sorted(missing))}")
        loading.add_quantized(f"{module}.weight", fmt.read(tensors))
    loading.finish(checkpoint)
    if quantizer is not None:
        quantize_model(model, quantizer, dtype, device)
    # Built after the dtype cast: frequencies stay float32, as in HF.
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    _install_kernels(model, checkpoint, dtype, device, kv_format or DenseKVFormat(dtype), batch_invariant)
    return model.eval()


def _install_kernels(model: Transformer, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device,
                     kv_format: KVCacheFormat, batch_invariant: bool) -> None:
    pack_linears(model, batch_invariant)
    move_parameters_to_huge_pages_(model)  # the dense weights each decode step streams
    kv_format.install(model, device)
    if batch_invariant:
        _require_batch_invariance(model, checkpoint)


def kernel_summary(model: Transformer) -> str:
    """Which kernels serve the model, for the start-up log; on CPU also what they were chosen by (the CPU, its
    instruction sets, the threads and the CPUs this process may run on)."""
    from .kernels import bf16_kernels, cpu_isa, cpu_model

    linears = Counter(type(m.kernel).__name__ for m in model.modules() if isinstance(m, Linear))
    attention = Counter(type(layer.self_attn.attn).__name__ for layer in model.layers)
    summary = "; ".join(f"{what}: " + ", ".join(f"{name} x{n}" for name, n in found.items())
                        for what, found in (("linear", linears), ("attention", attention)))
    plans = {m.kernel.gemv_plan for m in model.modules() if isinstance(m, Linear) and hasattr(m.kernel, "gemv_plan")}
    summary += "".join(f"; bf16 GEMVs: {p.streams} streams a thread, {p.prefetch_rows} rows ahead prefetched"
                       for p in plans)
    if next(model.parameters()).device.type != "cpu":
        return summary
    native = bf16_kernels()
    return (f"{cpu_model()}, ISA {' '.join(cpu_isa()) or 'baseline'}, {torch.get_num_threads()} threads on CPUs "
            f"{sorted(os.sched_getaffinity(0))}, native bf16 kernels {native.__name__ if native else 'none'}; "
            + summary)


def _require_batch_invariance(model: Transformer, checkpoint: Checkpoint) -> None:
    """Every linear on the row-invariant kernel and every layer's attention one query row at a time (the model
    runner then attends prompts row by row too): dense bf16 weights on a CPU with AVX512-BF16."""
    linears = {type(m.kernel).__name__ for m in model.modules()
               if isinstance(m, Linear) and not isinstance(m.kernel, RowInvariantBf16LinearKernel)}
    attention = {type(layer.self_attn.attn).__name__ for layer in model.layers
                 if not layer.self_attn.attn.row_invariant_decode}
    if linears or attention:
        raise ModelLoadError(
            f"{checkpoint.path}: deterministic (batch-invariant) mode needs dense bf16 weights on a CPU with "
            f"AVX512-BF16 and a bf16 or int8 KV cache; this model would run {', '.join(sorted(linears | attention))}")


class _Loading:
    """Where each checkpoint tensor goes, and what has arrived so far."""

    def __init__(self, model: Transformer, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        self.model, self.cfg, self.dtype, self.device = model, cfg, dtype, device
        self.modules = dict(model.named_modules())
        self.loaded_rows: dict[str, int] = {}
        self.shards: dict[str, dict[int, QuantizedWeight]] = {}  # our weight name -> {row offset: shard}

    def _parameter(self, name: str) -> nn.Parameter:
        module_name, _, attr = name.rpartition(".")
        module = self.modules.get(module_name)
        param = getattr(module, attr, None) if module is not None else None
        if not isinstance(param, nn.Parameter):
            raise ModelLoadError(f"checkpoint weight {name!r} has no place in {self.cfg.architecture}")
        if param.is_meta:  # a linear's dense weight: allocated when it arrives
            param = nn.Parameter(torch.empty(param.shape, dtype=self.dtype, device=self.device), requires_grad=False)
            setattr(module, attr, param)
        return param

    def copy(self, hf_name: str, tensor: torch.Tensor) -> None:
        if hf_name.endswith("rotary_emb.inv_freq"):
            return
        name, offset = _target(hf_name, self.cfg)
        param = self._parameter(name)
        rows = param.data if offset is None else param.data[offset:offset + tensor.shape[0]]
        if rows.shape != tensor.shape:
            raise ModelLoadError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(rows.shape)}")
        with torch.no_grad():
            rows.copy_(tensor)
        self.loaded_rows[name] = self.loaded_rows.get(name, 0) + tensor.shape[0]

    def add_quantized(self, hf_name: str, weight: QuantizedWeight) -> None:
        name, offset = _target(hf_name, self.cfg)
        if not isinstance(self.modules.get(name.removesuffix(".weight")), Linear | Embedding):
            raise ModelLoadError(f"quantized weight {hf_name!r} has no place in {self.cfg.architecture}")
        self.shards.setdefault(name, {})[offset or 0] = weight
        self.loaded_rows[name] = self.loaded_rows.get(name, 0) + weight.shape[0]

    def finish(self, checkpoint: Checkpoint) -> None:
        missing = []
        for name, shards in self.shards.items():
            module = self.modules[name.removesuffix(".weight")]
            if sum(w.shape[0] for w in shards.values()) != module.weight_shape[0]:
                missing.append(name)  # a fused linear with a shard missing
                continue
            try:
                module.quantize(concat_rows([shards[k] for k in sorted(shards)]), self.dtype, self.device)
            except ValueError as exc:
                raise ModelLoadError(f"{checkpoint.path}: {name}: {exc}") from exc
        if self.cfg.tie_word_embeddings and "lm_head.weight" not in self.loaded_rows:
            _tie_lm_head(self.model, self.dtype, self.device)
            self.loaded_rows["lm_head.weight"] = self.cfg.vocab_size
        missing += [n for n, p in self.model.named_parameters()
                    if p.is_meta or self.loaded_rows.get(n, 0) != p.shape[0]]
        if missing:
            raise ModelLoadError(f"checkpoint {checkpoint.path} lacks weights: {', '.join(missing[:8])}"
                                 + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def _tie_lm_head(model: Transformer, dtype: torch.dtype, device: torch.device) -> None:
    if model.embed_tokens.quantized is not None:
        model.lm_head.quantize(model.embed_tokens.quantized, dtype, device, shares_weight=True)
    else:
        model.lm_head.weight = model.embed_tokens.weight


def quantize_model(model: Transformer, quantizer: WeightQuantizer, dtype: torch.dtype, device: torch.device) -> None:
    """Quantizes every dense linear and the embedding table in place (a tied LM head shares the table's weight);
    weights the checkpoint brought quantized stay as they are."""
    table = model.embed_tokens.weight
    tied = table is not None and model.lm_head.weight is table
    if table is not None:
        model.embed_tokens.quantize(quantizer.for_table(tied)(table.detach()), dtype, device)
    for module in model.modules():
        if isinstance(module, Linear) and module.weight is not None:
            if tied and module is model.lm_head:
                module.quantize(model.embed_tokens.quantized, dtype, device, shares_weight=True)
            else:
                module.quantize(quantizer(module.weight.detach()), dtype, device)
