"""gpt-oss's parts against transformers': attention sinks (the reference attention, and the kernels chosen for them),
MXFP4 experts dequantized at load, and the released config's reading. (Whole models against HF: test_matches_hf.py's
gpt-oss.)"""

from __future__ import annotations

import json
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.engine import LLM, EngineConfig, SamplingParams
from gpu_worker.engine.attention import (
    AttentionMetadata,
    HeadLayout,
    PrefillChunk,
    TorchPagedAttention,
)
from gpu_worker.engine.kernel_choice import choose_kernels
from gpu_worker.engine.model_config import ModelConfig
from gpu_worker.engine.quantization.weights import FP4_VALUES, Mxfp4Weight, dequantize_mxfp4
from gpu_worker.engine.stacked_experts import unstack_experts
from services.text.errors import ModelLoadError
from tests.conftest import DEVICE, hf_model_greedy

BLOCK, LENGTH, WINDOW = 4, 23, 6
HEADS, KV_HEADS, DIM = 4, 2, 8


def _hf_attention(q, keys, values, sinks, positions, window):
    """transformers' gpt-oss eager attention over the whole sequence, each query masked to its window: [rows, H, D]."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    seen = torch.arange(LENGTH)[None, :]
    visible = (seen <= positions[:, None]) & (seen > positions[:, None] - window)
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    module = types.SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, sinks=sinks, training=False)
    out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                     values.transpose(0, 1)[None], mask[None, None], DIM**-0.5)
    return out[0]


def test_sinks_take_their_share_of_each_softmax_as_transformers_does_in_decode_and_prefill():
    gen = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(LENGTH, KV_HEADS, DIM, generator=gen) for _ in range(2))
    table = torch.randperm(12, generator=gen)[:6]
    cache = torch.randn(2, 12, KV_HEADS, BLOCK, DIM, generator=gen)
    for p in range(LENGTH):
        cache[:, table[p // BLOCK], :, p % BLOCK] = torch.stack([keys[p], values[p]])
    sinks = torch.tensor([3.0, -1.0, 0.5, 2.0])  # a few units: each takes a share that shows
    attention = TorchPagedAttention(HeadLayout(HEADS, KV_HEADS, DIM, DIM**-0.5, WINDOW, sinks=True))
    attention.sinks = sinks
    q = torch.randn(LENGTH, HEADS, DIM, generator=gen)

    decode = attention.decode(q[-1:], cache, AttentionMetadata.decode_rows([table.tolist()], [LENGTH], BLOCK))
    rows = torch.arange(LENGTH - 7, LENGTH)  # a prefill chunk over cached context, its first rows' windows in it
    meta = AttentionMetadata(rows, rows, BLOCK, [], None, None, [PrefillChunk(0, 7, LENGTH, table)])
    prefill = torch.empty(7, HEADS, DIM)
    attention.prefill(q[rows], keys[rows], values[rows], cache, meta, prefill)

    torch.testing.assert_close(decode, _hf_attention(q[-1:], keys, values, sinks, torch.tensor([LENGTH - 1]), WINDOW))
    torch.testing.assert_close(prefill, _hf_attention(q[rows], keys, values, sinks, rows, WINDOW))
    without = _hf_attention(q[-1:], keys, values, torch.full((HEADS,), -1e9), torch.tensor([LENGTH - 1]), WINDOW)
    assert (decode - without).abs().max() > 0.05  # the sinks matter here


def test_heads_with_sinks_take_the_native_kernels_as_other_heads_do():
    for options in ({}, {"kv_cache_dtype": "int8"}):
        kernels = choose_kernels(EngineConfig("", **options), torch.bfloat16)
        with_sinks = kernels.attention(HeadLayout(12, 4, 64, 0.125, sinks=True))  # a head size they take
        assert type(with_sinks) is type(kernels.attention(HeadLayout(12, 4, 64, 0.125)))


def _to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., n] (n a multiple of 32) -> (blocks [..., n / 32, 16], scales [..., n / 32]) as the format stores them:
    each group of 32 scaled by a power of two that brings its largest into FP4's range, each value rounded to the
    nearest FP4 value, two to a byte, the even one in the low nibble."""
    groups = weight.reshape(*weight.shape[:-1], -1, 32).float()
    exponent = torch.floor(torch.log2(groups.abs().amax(dim=-1).clamp(min=2.0**-100))) - 2  # max / 2^e in [4, 8)
    scaled = groups / torch.exp2(exponent)[..., None]
    nibbles = (scaled[..., None] - torch.tensor(FP4_VALUES)).abs().argmin(dim=-1).to(torch.uint8)
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (3, 10, 4), dtype=torch.uint8, generator=gen)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), theirs)


def test_mxfp4_blocks_and_scales_pair_up_across_shards_and_a_lone_half_is_refused():
    blocks = torch.randint(0, 256, (2, 6, 1, 16), dtype=torch.uint8)  # 2 experts, 3 gate and 3 up rows of 32
    scales = torch.full((2, 6, 1), 127, dtype=torch.uint8)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    norm = ("model.norm.weight", torch.ones(4))
    shards = [(f"{name}_scales", scales), norm, (f"{name}_blocks", blocks)]
    out = dict(unstack_experts("GptOssForCausalLM", iter(shards)))
    rows = dequantize_mxfp4(blocks[1], scales[1])
    gate, up = out["model.layers.0.mlp.experts.1.gate_proj.weight"], out["model.layers.0.mlp.experts.1.up_proj.weight"]
    assert isinstance(gate, Mxfp4Weight) and isinstance(up, Mxfp4Weight)  # kept as stored, for a kernel to take
    assert torch.equal(gate.dequantize(), rows[0::2]) and torch.equal(up.dequantize(), rows[1::2])
    assert "model.norm.weight" in out and len(out) == 5
    with pytest.raises(ModelLoadError, match="without their blocks or scales"):
        list(unstack_experts("GptOssForCausalLM", iter([(f"{name}_blocks", blocks)])))


@pytest.fixture(scope="module")
def mxfp4_checkpoint(make_checkpoint, tmp_path_factory):
    """The gpt-oss test checkpoint with its experts' matrices stored as MXFP4, as the released ones are; and those
    matrices dequantized, in transformers' layout."""
    dense = make_checkpoint("gpt-oss")
    out = tmp_path_factory.mktemp("mxfp4")
    shutil.copytree(dense, out, dirs_exist_ok=True)
    tensors, dequantized = load_file(dense / "model.safetensors"), {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _to_mxfp4(tensors.pop(name).transpose(1, 2))  # stored [E, out, in]
        tensors |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
        dequantized[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2)
    save_file(tensors, out / "model.safetensors")
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out, dequantized


def test_an_mxfp4_checkpoint_serves_its_dequantized_experts_as_transformers_does(mxfp4_checkpoint):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    path, dequantized = mxfp4_checkpoint
    llm = LLM(str(path), dtype="float32", device=DEVICE, kv_cache_memory_bytes=16 << 20)
    # transformers dequantizes MXFP4 on a CPU where asked to (else it fetches Triton kernels from the hub)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True)).to(DEVICE).eval()
    ours, theirs = llm.engine.runner.model.layers[1].mlp.experts[3], hf.model.layers[1].mlp.experts
    gate_up, down = (dequantized[f"model.layers.1.mlp.experts.{proj}"][3].T for proj in ("gate_up_proj", "down_proj"))
    assert torch.equal(theirs.gate_up_proj[3].T.cpu(), gate_up) and torch.equal(theirs.down_proj[3].T.cpu(), down)
    assert torch.equal(ours.gate_up_proj.weight.cpu(), torch.cat([gate_up[0::2], gate_up[1::2]]))  # gate, then up
    assert torch.equal(ours.down_proj.weight.cpu(), down)

    prompts, max_new = [[5, 17, 300, 42] * 12 + [7], [901, 3, 3]], [12, 9]  # the first longer than the window
    got = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_new])
    assert [o.token_ids for o in got] == hf_model_greedy(hf, prompts, max_new)


def test_the_released_config_reads_as_transformers_reads_it():
    """gpt-oss-20b's config.json (transformers 4.55 wrote it: `rope_scaling`, no `swiglu_alpha`), layers cut to 4."""
    raw = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "head_dim": 64, "hidden_size": 2880,
           "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 2,
           "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
           "num_experts_per_tok": 4, "num_hidden_layers": 4, "num_key_value_heads": 8, "num_local_experts": 32,
           "quantization_config": {"quant_method": "mxfp4"}, "rms_norm_eps": 1e-05,
           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
           "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "torch_dtype": "bfloat16",
           "vocab_size": 201088, "eos_token_id": 200002}
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.rope_theta, cfg.rope_scaling["rope_type"], cfg.rope_scaling["truncate"]) == (150000.0, "yarn", False)
    assert [cfg.window_of(i) for i in range(4)] == [128, None, 128, None]
    assert cfg.attention_sinks and cfg.qkv_bias and cfg.o_proj_bias and cfg.head_dim == 64
    moe = cfg.moe
    assert (moe.num_experts, moe.experts_per_token, moe.expert_intermediate_size) == (32, 4, 2880)
    assert moe.router_bias and moe.softmax_over_top_k and moe.clamped_swiglu == (1.702, 7.0)
    assert cfg.checkpoint_dtype == torch.bfloat16
    bare = {k: v for k, v in raw.items() if k not in ("rope_scaling", "rope_theta")}  # GptOssConfig's defaults
    assert ModelConfig.from_dict(bare).rope_scaling == cfg.rope_scaling
