"""Rotary scaling: the inverse frequencies and attention factor of each HF form equal transformers' own, bit for
bit; YaRN's attention factor scales cos and sin; LongRoPE picks its factors per position; partial rotary, in our
kernels' layout, rotates as transformers does; what we cannot serve is refused by name."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.engine import ModelLoadError
from gpu_worker.engine.model_config import ModelConfig
from gpu_worker.engine.rope import (
    RotaryEmbedding,
    apply_rotary,
    head_order,
    longrope_parameters,
    rotary_dim,
    rotary_parameters,
)

HEAD_DIM = 64
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128}
# HF rope parameters (less rope_theta, which ModelConfig keeps apart), the variants real configs use
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
    "yarn": YARN,
    "yarn-betas-untruncated": {**YARN, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},  # gpt-oss's style
    "yarn-mscale": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.707},  # DeepSeek's style
    "yarn-attention-factor": {**YARN, "attention_factor": 1.3},
}


@pytest.mark.parametrize("theta", [10000.0, 1000000.0])
@pytest.mark.parametrize("name", SCALINGS)
def test_frequencies_and_attention_factor_equal_transformers(name, theta):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = SCALINGS[name]
    config = transformers.LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=1024,
                                      rope_parameters={**scaling, "rope_theta": theta})
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    inv_freq, factor = rotary_parameters(HEAD_DIM, theta, scaling)
    assert torch.equal(inv_freq, expected_inv_freq)
    assert factor == expected_factor


def test_yarns_attention_factor_scales_cos_and_sin():
    plain = RotaryEmbedding(HEAD_DIM, 10000.0, {})
    yarn = RotaryEmbedding(HEAD_DIM, 10000.0, YARN)
    cos, sin = yarn.cos_sin(torch.tensor([0, 1]), torch.float32)
    assert yarn.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(8.0)).item() + 1)
    assert torch.equal(cos[0], torch.full((HEAD_DIM,), yarn.attention_factor))
    assert torch.equal(plain.cos_sin(torch.tensor([0]), torch.float32)[0][0], torch.ones(HEAD_DIM))
    assert torch.allclose(cos.square() + sin.square(), torch.tensor(yarn.attention_factor ** 2))


def test_an_unsupported_scaling_is_refused_by_name():
    with pytest.raises(ModelLoadError, match="dynamic"):
        RotaryEmbedding(HEAD_DIM, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


def test_yarn_without_its_original_context_is_refused_by_name():
    """transformers would take max_position_embeddings, which the rope parameters do not carry."""
    with pytest.raises(ModelLoadError, match="original_max_position_embeddings"):
        RotaryEmbedding(HEAD_DIM, 10000.0, {"rope_type": "yarn", "factor": 4.0})


ORIGINAL = 64


def _phi3(partial: float = 1.0, **rope):
    """(transformers' Phi3Config with LongRoPE over a 64-token original context in 1024, the scaling
    ModelConfig reads from its config.json)."""
    import transformers

    half = int(HEAD_DIM * partial) // 2
    config = transformers.Phi3Config(
        hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=1024, pad_token_id=None,
        original_max_position_embeddings=ORIGINAL, partial_rotary_factor=partial, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(half)],
            "long_factor": [1.0 + i * i / 4 for i in range(half)], **rope})
    return config, ModelConfig.from_dict({**config.to_dict(), "architectures": ["Phi3ForCausalLM"]}).rope_scaling


@pytest.mark.parametrize("rope", [{}, {"attention_factor": 1.5}], ids=["attention-factor-from-factor", "given"])
@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_frequencies_and_attention_factor_equal_transformers(partial, rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config, scaling = _phi3(partial, **rope)
    short, long, factor = longrope_parameters(rotary_dim(HEAD_DIM, scaling), 10000.0, scaling)
    expected_short, expected_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    expected_long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=ORIGINAL + 1)
    assert torch.equal(short, expected_short) and torch.equal(long, expected_long)
    assert factor == expected_factor != 1.0


def test_longrope_rotates_positions_from_the_original_context_on_by_the_long_factors():
    _, scaling = _phi3()
    short, long, factor = longrope_parameters(HEAD_DIM, 10000.0, scaling)
    positions = torch.tensor([0, ORIGINAL - 1, ORIGINAL, 5 * ORIGINAL])
    cos, sin = RotaryEmbedding(HEAD_DIM, 10000.0, scaling).cos_sin(positions, torch.float32)
    freqs = positions.float()[:, None] * torch.stack([short, short, long, long])
    emb = torch.cat((freqs, freqs), dim=-1)
    assert torch.equal(cos, emb.cos() * factor) and torch.equal(sin, emb.sin() * factor)


@pytest.mark.parametrize("start", [0, ORIGINAL], ids=["short", "long"])
def test_partial_rotary_in_our_layout_equals_transformers_rotary_of_the_first_dims(start):
    """q reordered by `head_order` and rotated over whole heads by our cos/sin is transformers' rotary of the
    first 3/4 of each head, reordered alike: the other dims unrotated and unscaled by the attention factor.
    (Positions all on one side of the original context, where transformers' choice and ours agree.)"""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    config, scaling = _phi3(0.75)
    positions = torch.arange(start, start + ORIGINAL)
    q, k = torch.randn(2, 1, 4, ORIGINAL, HEAD_DIM).unbind(0)
    cos, sin = Phi3RotaryEmbedding(config)(q, positions[None])
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    order = head_order(HEAD_DIM, scaling)
    our_cos, our_sin = RotaryEmbedding(HEAD_DIM, 10000.0, scaling).cos_sin(positions, torch.float32)
    assert torch.equal(apply_rotary(q[..., order], our_cos, our_sin), expected_q[..., order])
    assert torch.equal(apply_rotary(k[..., order], our_cos, our_sin), expected_k[..., order])


def test_an_odd_number_of_rotated_dims_is_refused():
    with pytest.raises(ModelLoadError, match="even number"):
        RotaryEmbedding(HEAD_DIM, 10000.0, {"partial_rotary_factor": 33 / HEAD_DIM})


def test_older_phi3_configs_read_as_transformers_reads_them():
    """Phi-3-mini-128k's config.json: rope_scaling of type `su`, the original context at the top level, no
    factor (the ratio of the two contexts), partial_rotary_factor at the top level as Phi-4-mini has it."""
    raw = {"architectures": ["Phi3ForCausalLM"], "hidden_size": 256, "num_attention_heads": 4,
           "num_hidden_layers": 1, "intermediate_size": 512, "vocab_size": 100, "max_position_embeddings": 131072,
           "original_max_position_embeddings": 4096, "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
           "rope_scaling": {"type": "su", "short_factor": [1.0] * 24, "long_factor": [2.0] * 24}}
    assert ModelConfig.from_dict(raw).rope_scaling == {
        "rope_type": "longrope", "short_factor": [1.0] * 24, "long_factor": [2.0] * 24, "factor": 32.0,
        "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75}
