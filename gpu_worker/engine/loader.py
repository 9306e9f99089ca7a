"""Loads a checkpoint's weights (HF names and layout, whatever the file format) into our `Transformer`.

Dense weights are copied into place (q/k/v and gate/up into their fused parameters). A pre-quantized
checkpoint's linears arrive as several tensors each (`qweight`, `scales`, ...): its format turns them into
one quantized weight per shard, and the fused linear is quantized once all its shards are in (a GGUF file's
quantized matrices arrive as such weights whole; float32, the reference dtype, serves them dense). With a
`quantizer`, dense weights are quantized at load time instead. Linear weights are allocated only when a
dense tensor arrives for them, so a quantized model never holds a dense copy. Every kernel comes from the
`kernel_choice.KernelSet` the model is loaded with.
"""

from __future__ import annotations

import torch
from torch import nn

from services.text.errors import ModelLoadError

from .checkpoint import Checkpoint
from .host_memory import move_parameters_to_huge_pages_
from .kernel_choice import KernelSet
from .linear import Linear, RowInvariantBf16LinearKernel, pack_linears
from .model import Embedding, Transformer, rotary_embeddings
from .model_config import ModelConfig
from .quantization.methods import WeightQuantizer
from .quantization.weights import QuantizedWeight, concat_rows
from .rope import head_order
from .stacked_experts import unstack_experts

# HF module name -> (our fused module's name, shard index), wherever it sits (a layer's MLP, or an expert's)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Mixtral's names for the same modules
_MIXTRAL_NAMES = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def shard_sizes(cfg: ModelConfig, fused: str) -> list[int]:
    """The rows of each shard of our fused module `fused` (its full name)."""
    if fused.endswith("qkv_proj"):
        kv = cfg.num_kv_heads * cfg.head_dim
        return [cfg.num_heads * cfg.head_dim, kv, kv]
    rows = cfg.moe.expert_intermediate_size if ".experts." in fused else cfg.intermediate_size
    return [rows, rows]


def qkv_row_order(cfg: ModelConfig) -> torch.Tensor | None:
    """Which of the checkpoint's fused q/k/v rows each of ours holds: partial rotary reorders each q and k head
    (`rope.head_order`), v stays. None where nothing is reordered. Our weights in this order are what the
    model serves; whatever writes them back as a checkpoint must undo it (`torch.argsort` of this)."""
    within = head_order(cfg.head_dim, cfg.rope_scaling)
    if within is None:
        return None
    heads = cfg.num_heads + cfg.num_kv_heads
    qk = (torch.arange(heads)[:, None] * cfg.head_dim + within).flatten()
    return torch.cat([qk, torch.arange(heads * cfg.head_dim, (heads + cfg.num_kv_heads) * cfg.head_dim)])


def _target(name: str, cfg: ModelConfig) -> tuple[str, int | None]:
    """HF parameter name -> (our parameter name, row offset into a fused parameter or None)."""
    parts = name.removeprefix("model.").split(".")
    if "block_sparse_moe" in parts:
        parts = [_MIXTRAL_NAMES.get(part, part) for part in parts]
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, shard = _FUSED[parts[-2]]
        module = ".".join([*parts[:-2], fused])
        return f"{module}.{parts[-1]}", sum(shard_sizes(cfg, module)[:shard])
    return ".".join(parts), None


def load_model(checkpoint: Checkpoint, kernels: KernelSet, quantizer: WeightQuantizer | None = None) -> Transformer:
    """The model in `kernels.dtype` on `kernels.device`, served by `kernels`. Batch-invariant kernels
    (`kernels.batch_invariant`): a ModelLoadError where this model, dtype or device has none."""
    cfg, dtype, device = checkpoint.config, kernels.dtype, kernels.device
    with torch.device("meta"):
        model = Transformer(cfg, kernels.ops, kernels.attention)
    model = model.to(dtype)  # cast on meta: no full-precision copy on the device
    for module in model.modules():
        if not isinstance(module, Linear):
            module.to_empty(device=device, recurse=False)
    loading = _Loading(model, cfg, kernels)
    fmt = getattr(checkpoint, "quantization", None)
    parts: dict[str, dict[str, torch.Tensor]] = {}  # each quantized module's tensors (qweight, scales...)
    for hf_name, tensor in unstack_experts(cfg.architecture, checkpoint.tensors()):  # gpt-oss's, one at a time
        module, _, suffix = hf_name.rpartition(".")
        if isinstance(tensor, QuantizedWeight):  # a GGUF matrix or MXFP4 experts, quantized as the file stores it
            # The reference dtype serves dense weights, exactly the file's values; so does a format no kernel keeps.
            if dtype == torch.float32 or not kernels.linears.keeps(tensor):
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
        quantize_model(model, quantizer, kernels)
    # Built after the dtype cast: frequencies stay float32, as in HF.
    model.rotaries = rotary_embeddings(cfg)[0].to(device)
    _pack(model, checkpoint, kernels)
    return model.eval()


def _pack(model: Transformer, checkpoint: Checkpoint, kernels: KernelSet) -> None:
    pack_linears(model, kernels)
    for layer in model.layers:
        layer.self_attn.pack()
    move_parameters_to_huge_pages_(model)  # the dense weights each decode step streams
    if kernels.batch_invariant:
        _require_batch_invariance(model, checkpoint)


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

    def __init__(self, model: Transformer, cfg: ModelConfig, kernels: KernelSet):
        self.model, self.cfg, self.kernels = model, cfg, kernels
        self.dtype, self.device = kernels.dtype, kernels.device
        self.modules = dict(model.named_modules())
        self.loaded_rows: dict[str, int] = {}
        self.shards: dict[str, dict[int, QuantizedWeight]] = {}  # our weight name -> {row offset: shard}
        self.qkv_order = qkv_row_order(cfg)

    def _in_our_order(self, name: str, offset: int | None, rows: torch.Tensor | QuantizedWeight):
        """A checkpoint's rows of `name` from `offset` on, reordered as we serve them. A shard (q, k or v) holds
        whole heads, and heads are reordered within themselves: its rows come from itself alone."""
        if self.qkv_order is None or not name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
            return rows
        start = offset or 0
        order = self.qkv_order[start:start + rows.shape[0]] - start
        if order.shape[0] != rows.shape[0]:
            return rows  # too many rows: `copy` names the shapes
        return rows[order] if isinstance(rows, torch.Tensor) else rows.select_rows(order)

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
        tensor = self._in_our_order(name, offset, tensor)
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
        self.shards.setdefault(name, {})[offset or 0] = self._in_our_order(name, offset, weight)
        self.loaded_rows[name] = self.loaded_rows.get(name, 0) + weight.shape[0]

    def finish(self, checkpoint: Checkpoint) -> None:
        missing = []
        for name, shards in self.shards.items():
            module = self.modules[name.removesuffix(".weight")]
            if sum(w.shape[0] for w in shards.values()) != module.weight_shape[0]:
                missing.append(name)  # a fused linear with a shard missing
                continue
            try:
                module.quantize(concat_rows([shards[k] for k in sorted(shards)]).to(self.device), self.kernels)
            except ValueError as exc:
                raise ModelLoadError(f"{checkpoint.path}: {name}: {exc}") from exc
        if self.cfg.tie_word_embeddings and "lm_head.weight" not in self.loaded_rows:
            _tie_lm_head(self.model, self.kernels)
            self.loaded_rows["lm_head.weight"] = self.cfg.vocab_size
        missing += [n for n, p in self.model.named_parameters()
                    if p.is_meta or self.loaded_rows.get(n, 0) != p.shape[0]]
        if missing:
            raise ModelLoadError(f"checkpoint {checkpoint.path} lacks weights: {', '.join(missing[:8])}"
                                 + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def _tie_lm_head(model: Transformer, kernels: KernelSet) -> None:
    if model.embed_tokens.quantized is not None:
        model.lm_head.quantize(model.embed_tokens.quantized, kernels, shares_weight=True)
    else:
        model.lm_head.weight = model.embed_tokens.weight


def quantize_model(model: Transformer, quantizer: WeightQuantizer, kernels: KernelSet) -> None:
    """Quantizes every dense linear and the embedding table in place (a tied LM head shares the table's weight);
    weights the checkpoint brought quantized stay as they are."""
    table = model.embed_tokens.weight
    tied = table is not None and model.lm_head.weight is table
    if table is not None:
        model.embed_tokens.quantize(quantizer.for_table(tied)(table.detach()), kernels)
    for module in model.modules():
        if isinstance(module, Linear) and module.weight is not None:
            if tied and module is model.lm_head:
                module.quantize(model.embed_tokens.quantized, kernels, shares_weight=True)
            else:
                module.quantize(quantizer(module.weight.detach()), kernels)
