"""The decoder-only transformer (Llama, Mistral, Qwen2) in plain torch, written for a paged KV cache.

Inputs are flattened: all tokens of all scheduled sequences in one [T] vector with their positions;
`AttentionMetadata` says which belong together. q/k/v and gate/up are fused into one matmul each.
A layer's computation is `decoder_layer`, over its parts: the modules themselves (`forward`), or the same calls
bound ahead of time (`Transformer.bound`, what the model runner serves with).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from . import ops
from .attention import AttentionMetadata, HeadLayout, TorchPagedAttention
from .linear import Linear
from .model_config import ModelConfig
from .quantization.weights import QuantizedWeight, with_exact_scales
from .rope import RotaryEmbedding


class Embedding(nn.Embedding):
    """`nn.Embedding` whose table may be quantized: rows are then dequantized as they are looked up."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.quantized: QuantizedWeight | None = None

    @property
    def weight_shape(self) -> tuple[int, int]:
        return self.num_embeddings, self.embedding_dim

    def quantize(self, weight: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> None:
        self.quantized, self.dtype = with_exact_scales(weight.to(device)), dtype
        self.weight = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:
            return super().forward(ids)
        return self.quantized.rows(ids).to(self.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm_step(self.weight, self.eps, x, residual)

    def bound(self) -> Callable:
        """`forward` with the weight bound, called without the module's machinery."""
        return functools.partial(rms_norm_step, self.weight, self.eps)


def rms_norm_step(weight: torch.Tensor, eps: float, x: torch.Tensor,
                  residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Adds the pending residual first when given one: returns (normed, the residual stream after the add)."""
    if residual is None:
        return ops.rms_norm(x, weight, eps), x
    return ops.add_rms_norm(x, residual, weight, eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=False)
        # Rotary, the KV cache write and attention: one interface, whose CPU kernels fuse them for decode steps.
        self.attn = TorchPagedAttention(HeadLayout(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class LayerParts(NamedTuple):
    """What a decoder layer calls: its modules (`DecoderLayer.parts`), or those calls bound (`DecoderLayer.bound`)."""

    input_layernorm: Callable
    qkv_proj: Callable
    attn: Callable
    o_proj: Callable
    post_attention_layernorm: Callable
    gate_up_proj: Callable
    act: Callable
    down_proj: Callable


def decoder_layer(p: LayerParts, x, residual, cos, sin, kv_cache, meta: AttentionMetadata,
                  rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: the previous layer's MLP output (the embeddings for the first layer, with no residual yet).
    Returns this layer's MLP output and the residual stream it is still to be added to, for every row or, given
    `rows`, for those alone: every row's keys and values are still written to the cache."""
    x, residual = p.input_layernorm(x, residual)
    attended = p.attn(p.qkv_proj(x), cos, sin, kv_cache, meta)
    if rows is not None:
        attended, residual = attended[rows], residual[rows]
    x, residual = p.post_attention_layernorm(p.o_proj(attended), residual)
    return p.down_proj(p.act(p.gate_up_proj(x))), residual


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, cos, sin, kv_cache, meta, rows=None) -> tuple[torch.Tensor, torch.Tensor]:
        return decoder_layer(self.parts(), x, residual, cos, sin, kv_cache, meta, rows)

    def parts(self) -> LayerParts:
        a, m = self.self_attn, self.mlp
        return LayerParts(self.input_layernorm, a.qkv_proj, a.attn, a.o_proj, self.post_attention_layernorm,
                          m.gate_up_proj, ops.silu_and_mul, m.down_proj)

    def bound(self) -> Callable:
        """`forward` over parts bound ahead of time. The attention is looked up at each call, as each linear's
        kernel is: engines install theirs after loading, and tests swap them."""
        a, m = self.self_attn, self.mlp
        parts = LayerParts(self.input_layernorm.bound(), a.qkv_proj.bound(), lambda *args: a.attn(*args),
                           a.o_proj.bound(), self.post_attention_layernorm.bound(), m.gate_up_proj.bound(),
                           ops.silu_and_mul, m.down_proj.bound())
        return functools.partial(decoder_layer, parts)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Returns final hidden states [T, hidden], or only those of `rows` (the ones sampled): the last layer's
        o_proj and MLP then run for them alone, a 12-layer model's prefill chunk doing ~1/13 less work (llama.cpp
        does the same). `logits` projects the rows that are sampled."""
        return self.run(self.layers, self.norm, input_ids, positions, kv_caches, meta, rows)

    def bound(self) -> Callable:
        """`forward` with every layer's and the final norm's calls bound ahead (`DecoderLayer.bound`): the same
        kernels in the same order, without the modules' calls, parameter lookups and wrappers between them (a
        batch-1 step's forward on tokenfleet-large spent ~0.35 ms of 3.8 in them on a Zen 5; bench/RESULTS.md).
        No module's hooks run on this path."""
        return functools.partial(self.run, [layer.bound() for layer in self.layers], self.norm.bound())

    def run(self, layers: list[Callable], norm: Callable, input_ids: torch.Tensor, positions: torch.Tensor,
            kv_caches: list[torch.Tensor], meta: AttentionMetadata, rows: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        residual = None
        *inner, last = zip(layers, kv_caches, strict=True)
        for layer, kv_cache in inner:
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        layer, kv_cache = last
        x, residual = layer(x, residual, cos, sin, kv_cache, meta, rows)
        return norm(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model's dtype, or float32 where the LM head's kernel has them so at no cost: the sampler
        upcasts only when it needs more than an argmax."""
        return self.lm_head.forward_float32(hidden)
