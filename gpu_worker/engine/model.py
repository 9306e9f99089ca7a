"""The decoder-only transformer (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2/3; Qwen3-MoE, Mixtral, OLMoE and gpt-oss
with `moe.py`) in plain torch, written for a paged KV cache.

Inputs are flattened: all tokens of all scheduled sequences in one [T] vector with their positions;
`AttentionMetadata` says which belong together. q/k/v and gate/up are fused into one matmul each.
A layer's computation is `decoder_layer`, over its parts: the modules themselves (`forward`), or the same calls
bound ahead of time (`Transformer.bound`, what the model runner serves with). The model is built with its
kernels (`kernel_choice.KernelSet`): the element-wise `ops` and each layer's `attention`; each linear's kernel
arrives as its weight does (`Linear.pack`, `Linear.quantize`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, HeadLayout, TorchPagedAttention
from .linear import Linear
from .mlp import MLP
from .model_config import ModelConfig
from .moe import SparseMoE
from .ops import TorchOps
from .quantization.weights import QuantizedWeight, with_exact_scales
from .rope import RotaryEmbedding


class Embedding(nn.Embedding):
    """`nn.Embedding` whose table may be quantized: rows are then dequantized as they are looked up. `scale`: what
    the rows are multiplied by, rounded to their dtype first (Gemma's √hidden), or None."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float | None = None):
        super().__init__(num_embeddings, embedding_dim)
        self.quantized: QuantizedWeight | None = None
        self.scale = scale

    @property
    def weight_shape(self) -> tuple[int, int]:
        return self.num_embeddings, self.embedding_dim

    def quantize(self, weight: QuantizedWeight, kernels) -> None:
        """Keep the table as `weight`, its rows dequantized to the serving dtype (`kernels.dtype`) as looked up."""
        self.quantized, self.dtype = with_exact_scales(weight), kernels.dtype
        self.weight = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(ids) if self.quantized is None else self.quantized.rows(ids).to(self.dtype)
        return rows if self.scale is None else rows * torch.tensor(self.scale, dtype=rows.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: TorchOps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm_step(self.ops, self.weight, self.eps, x, residual)

    def bound(self) -> Callable:
        """`forward` with the weight bound, called without the module's machinery."""
        return functools.partial(rms_norm_step, self.ops, self.weight, self.eps)


def rms_norm_step(ops: TorchOps, weight: torch.Tensor, eps: float, x: torch.Tensor,
                  residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Adds the pending residual first when given one: returns (normed, the residual stream after the add)."""
    if residual is None:
        return ops.rms_norm(x, weight, eps), x
    return ops.add_rms_norm(x, residual, weight, eps)


class OffsetRMSNorm(RMSNorm):
    """Gemma's: scales by 1 + weight, and multiplies in float32 before rounding (transformers' Gemma RMSNorm)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return offset_rms_norm_step(1.0 + self.weight.float(), self.eps, x, residual)

    def bound(self) -> Callable:
        return functools.partial(offset_rms_norm_step, 1.0 + self.weight.detach().float(), self.eps)


def offset_rms_norm_step(scale: torch.Tensor, eps: float, x: torch.Tensor,
                         residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_step` scaling by `scale` (1 + weight, float32)."""
    if residual is not None:
        x = x + residual
    return (F.rms_norm(x.float(), scale.shape, None, eps) * scale).to(x.dtype), x


def normed_output(norm: Callable, produce: Callable, x: torch.Tensor) -> torch.Tensor:
    """norm(produce(x)), the norm with no residual: Gemma's norms after attention and after the MLP."""
    return norm(produce(x), None)[0]


# A layer's attention for its heads (`KernelSet.attention`).
AttentionFor = Callable[[HeadLayout], TorchPagedAttention]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: TorchOps, attention: AttentionFor, window: int | None):
        super().__init__()
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        # Qwen3, Gemma 3: each head of q and of k RMS-normalised before rotary; OLMoE: q and k whole
        self.norm_widths = (q_size, kv_size) if cfg.qk_norm_whole else (cfg.head_dim, cfg.head_dim)
        if cfg.qk_norm:
            self.q_norm = norm_for(cfg)(self.norm_widths[0], cfg.rms_norm_eps, ops)
            self.k_norm = norm_for(cfg)(self.norm_widths[1], cfg.rms_norm_eps, ops)
        self.clip_qkv = cfg.clip_qkv
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.attention_sinks:  # gpt-oss: one logit per head, joined to its softmax (`attention.softmax_with_sinks`)
            self.sinks = nn.Parameter(torch.empty(cfg.num_heads))
        # Rotary, the KV cache write and attention: one interface, whose CPU kernels fuse them for decode steps.
        self.attn = attention(HeadLayout(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_scale,
                                         window, cfg.attention_softcap, cfg.attention_sinks))
        self.q_size, self.kv_size, self.head_dim = q_size, kv_size, cfg.head_dim

    def head_norms(self) -> Callable:
        """What runs between the qkv projection and attention: q's and k's norms in place where the model has
        them, then q, k and v clamped where it clips them (OLMoE), else nothing."""
        norms = _unchanged
        if hasattr(self, "q_norm"):
            norms = functools.partial(qk_rms_norm, self.q_norm.bound(), self.k_norm.bound(), self.q_size,
                                      self.kv_size, *self.norm_widths)
        return norms if self.clip_qkv is None else functools.partial(clipped, norms, self.clip_qkv)

    def pack(self) -> None:
        """Hands the loaded sink logits to the attention, in float32 as its softmax takes them, as a linear's kernel
        gets its weight (`Linear.pack`): the loader allocates parameters anew, so none is bound before."""
        if hasattr(self, "sinks"):
            self.attn.sinks = self.sinks.detach().float()


def _unchanged(qkv: torch.Tensor) -> torch.Tensor:
    return qkv


def qk_rms_norm(q_norm: Callable, k_norm: Callable, q_size: int, kv_size: int, q_width: int, k_width: int,
                qkv: torch.Tensor) -> torch.Tensor:
    """qkv [T, q + 2 kv] with q and k RMS-normalised (written in place) over groups of `q_width` and `k_width`:
    each head (head_dim), or all of q and of k at once."""
    rows = qkv.shape[0]
    q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
    q.copy_(q_norm(q.reshape(-1, q_width), None)[0].view(rows, q_size))
    k.copy_(k_norm(k.reshape(-1, k_width), None)[0].view(rows, kv_size))
    return qkv


def clipped(norms: Callable, clip: float, qkv: torch.Tensor) -> torch.Tensor:
    """`norms`, then every q, k and v value clamped to ±clip in place (OLMoE's `clip_qkv`)."""
    return norms(qkv).clamp_(-clip, clip)


def feed_forward(cfg: ModelConfig, layer: int, ops: TorchOps) -> nn.Module:
    """The layer's MLP: dense, or a mixture of experts where the model has one in this layer."""
    if cfg.moe is None or layer in cfg.moe.dense_layers:
        return MLP(cfg.hidden_size, cfg.intermediate_size, ops, cfg.hidden_act)
    return SparseMoE(cfg.hidden_size, cfg.moe, ops)


def norm_for(cfg: ModelConfig) -> type[RMSNorm]:
    return OffsetRMSNorm if cfg.norm_weight_offset else RMSNorm


class LayerParts(NamedTuple):
    """What a decoder layer calls: its modules (`DecoderLayer.parts`), or those calls bound (`DecoderLayer.bound`)."""

    input_layernorm: Callable
    qkv_proj: Callable
    head_norms: Callable
    attn: Callable
    o_proj: Callable
    post_attention_layernorm: Callable
    mlp: Callable


def decoder_layer(p: LayerParts, x, residual, cos, sin, kv_cache, meta: AttentionMetadata,
                  rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: the previous layer's MLP output (the embeddings for the first layer, with no residual yet).
    Returns this layer's MLP output and the residual stream it is still to be added to, for every row or, given
    `rows`, for those alone: every row's keys and values are still written to the cache."""
    x, residual = p.input_layernorm(x, residual)
    attended = p.attn(p.head_norms(p.qkv_proj(x)), cos, sin, kv_cache, meta)
    if rows is not None:
        attended, residual = attended[rows], residual[rows]
    x, residual = p.post_attention_layernorm(p.o_proj(attended), residual)
    return p.mlp(x), residual


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: TorchOps, attention: AttentionFor, index: int):
        super().__init__()
        norm = norm_for(cfg)
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, ops, attention, cfg.window_of(index))
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = feed_forward(cfg, index, ops)

    def forward(self, x, residual, cos, sin, kv_cache, meta, rows=None) -> tuple[torch.Tensor, torch.Tensor]:
        return decoder_layer(self.parts(), x, residual, cos, sin, kv_cache, meta, rows)

    def parts(self) -> LayerParts:
        return self._parts(_module)

    def bound(self) -> Callable:
        """`forward` over parts bound ahead of time. The attention is looked up at each call, as each linear's
        kernel is: tests swap them."""
        return functools.partial(decoder_layer, self._parts(_bound))

    def _parts(self, call: Callable[[nn.Module], Callable]) -> LayerParts:
        """The layer's parts, each module as `call` makes it callable (itself, or its calls bound)."""
        a = self.self_attn
        return LayerParts(call(self.input_layernorm), call(a.qkv_proj), a.head_norms(), lambda *args: a.attn(*args),
                          call(a.o_proj), call(self.post_attention_layernorm), call(self.mlp))


def _module(module: nn.Module) -> Callable:
    return module


def _bound(module: nn.Module) -> Callable:
    return module.bound()


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2 and 3: a norm after attention and after the MLP too, before each joins the residual stream. The same
    `decoder_layer` runs it: o_proj's slot normalises its output, the add-and-norm slot is the norm before the MLP
    (`pre_feedforward_layernorm`), and the MLP's slot normalises its output."""

    def __init__(self, cfg: ModelConfig, ops: TorchOps, attention: AttentionFor, index: int):
        super().__init__(cfg, ops, attention, index)
        self.pre_feedforward_layernorm = norm_for(cfg)(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_feedforward_layernorm = norm_for(cfg)(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def _parts(self, call: Callable[[nn.Module], Callable]) -> LayerParts:
        parts = super()._parts(call)
        return parts._replace(
            o_proj=functools.partial(normed_output, call(self.post_attention_layernorm), parts.o_proj),
            post_attention_layernorm=call(self.pre_feedforward_layernorm),
            mlp=functools.partial(normed_output, call(self.post_feedforward_layernorm), parts.mlp))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: TorchOps, attention: AttentionFor):
        super().__init__()
        self.config = cfg
        self.ops = ops
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.embedding_scale)
        layer = SandwichDecoderLayer if cfg.sandwich_norms else DecoderLayer
        self.layers = nn.ModuleList(layer(cfg, ops, attention, i) for i in range(cfg.num_layers))
        self.norm = norm_for(cfg)(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotaries, self.rotary_of_layer = rotary_embeddings(cfg)
        self.logit_softcap = _unchanged if cfg.final_logit_softcap is None else functools.partial(
            softcap, cfg.final_logit_softcap)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metas: list[AttentionMetadata], rows: torch.Tensor | None = None) -> torch.Tensor:
        """Each layer attends through its cache and its metadata (`metas`, one per layer: a hybrid model's layers
        read block tables of their own group, `kv_cache_groups.py`). Returns final hidden states [T, hidden], or
        only those of `rows` (the ones sampled): the last layer's o_proj and MLP then run for them alone, a
        12-layer model's prefill chunk doing ~1/13 less work (llama.cpp does the same). `logits` projects the rows
        that are sampled."""
        return self.run(self.layers, self.norm, input_ids, positions, kv_caches, metas, rows)

    def bound(self) -> Callable:
        """`forward` with every layer's and the final norm's calls bound ahead (`DecoderLayer.bound`): the same
        kernels in the same order, without the modules' calls, parameter lookups and wrappers between them, a
        share of a batch-1 step worth saving (`tokenfleet bench engine`). No module's hooks run on this path."""
        return functools.partial(self.run, [layer.bound() for layer in self.layers], self.norm.bound())

    def run(self, layers: list[Callable], norm: Callable, input_ids: torch.Tensor, positions: torch.Tensor,
            kv_caches: list[torch.Tensor], metas: list[AttentionMetadata],
            rows: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rotations = [rotary.cos_sin(positions, x.dtype) for rotary in self.rotaries]
        residual = None
        *inner, last = zip(layers, kv_caches, metas, self.rotary_of_layer, strict=True)
        for layer, kv_cache, meta, rotary in inner:
            x, residual = layer(x, residual, *rotations[rotary], kv_cache, meta)
        layer, kv_cache, meta, rotary = last
        x, residual = layer(x, residual, *rotations[rotary], kv_cache, meta, rows)
        return norm(x, residual)[0]

    @property
    def graph_capturable(self) -> bool:
        """Whether a CUDA graph can replay a decode step: every layer's attention reads only the metadata's tensors,
        and no mixture of experts groups its rows on the host (`moe.mixture`)."""
        return all(layer.self_attn.attn.graph_safe and not isinstance(layer.mlp, SparseMoE) for layer in self.layers)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model's dtype, or float32 where the LM head's kernel has them so at no cost: the sampler
        upcasts only when it needs more than an argmax. Soft-capped where the model caps them (Gemma 2)."""
        return self.logit_softcap(self.lm_head.forward_float32(hidden))


def softcap(cap: float, x: torch.Tensor) -> torch.Tensor:
    """cap * tanh(x / cap): Gemma 2's bound on attention scores and final logits."""
    return torch.tanh(x / cap) * cap


def rotary_embeddings(cfg: ModelConfig) -> tuple[nn.ModuleList, list[int]]:
    """The model's rotary embeddings (frequencies in float32, as in HF) and the one each layer rotates by: one for
    every layer, or for Gemma 3 another for its sliding layers (their own base)."""
    rotaries = [RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)]
    if cfg.sliding_rope is None:
        return nn.ModuleList(rotaries), [0] * cfg.num_layers
    rotaries.append(RotaryEmbedding(cfg.head_dim, *cfg.sliding_rope))
    return nn.ModuleList(rotaries), [0 if cfg.window_of(i) is None else 1 for i in range(cfg.num_layers)]
