"""Phi-3's LongRoPE across its original context, and Phi-4-mini's partial rotary from a pre-quantized checkpoint.

We rotate a token at position p with the long factors iff p >= original_max_position_embeddings (`rope.py`).
transformers' `generate` agrees while a sequence stays within the original context; once it passes it, Phi-3's
`prepare_inputs_for_generation` drops the cache and re-prefills the whole sequence with the long factors, which a
cache whose keys never change cannot do. Past it, the reference is HF's model with its rotary chosen per position.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.engine import LLM, SamplingParams
from tests import quant_packers
from tests.conftest import DEVICE, hf_greedy, hf_model_greedy

ORIGINAL = 64
# Long factors that matter, and an attention factor of sqrt(1 + ln 16 / ln 64) = 1.29
CROSSING = {"original_max_position_embeddings": ORIGINAL, "max_position_embeddings": 16 * ORIGINAL}
KV_BYTES = 16 << 20
ARCHS = ["phi3", "phi4-mini"]


def _prompts(lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(len(lengths))
    return [torch.randint(1, 32000, (n,), generator=generator).tolist() for n in lengths]


def _ours(model_dir, prompts, max_new, **engine_kwargs) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", device=DEVICE, kv_cache_memory_bytes=KV_BYTES, **engine_kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_new]
    return [o.token_ids for o in llm.generate(prompts, params)]


def _hf_per_position(model_dir, prompts, max_new) -> list[list[int]]:
    """HF's Phi-3 greedy, its rotary taking the long factors at positions >= ORIGINAL and the short ones below:
    transformers' own frequencies and attention factor, chosen per position as we choose them."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    short, scale = ROPE_INIT_FUNCTIONS["longrope"](model.config, DEVICE)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](model.config, DEVICE, seq_len=ORIGINAL + 1)

    def rotary(x, position_ids):
        positions = position_ids[..., None]
        freqs = torch.where(positions >= ORIGINAL, positions.float() * long, positions.float() * short)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)

    model.model.rotary_emb.forward = rotary  # per position, so the cache HF drops at the crossing is the same
    return hf_model_greedy(model, prompts, max_new)


@pytest.mark.parametrize("arch", ARCHS)
def test_sequences_within_the_original_context_equal_hf_generate(make_checkpoint, arch):
    model_dir = make_checkpoint(arch, **CROSSING)
    # 40 + 25 tokens reach position ORIGINAL - 1 exactly, as the 64-token prompt (the original context whole) does
    prompts, max_new = _prompts([5, 30, 40, 64]), [40, 20, 25, 1]
    assert _ours(model_dir, prompts, max_new) == hf_greedy(model_dir, prompts, max_new)


@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 16}], ids=["whole", "chunked-prefill"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tokens_past_the_original_context_take_the_long_factors_by_position(make_checkpoint, arch, engine_kwargs):
    """Generations that cross the original context, and prompts longer than it (whose first ORIGINAL positions
    stay short, where HF's generate would rotate them long)."""
    model_dir = make_checkpoint(arch, **CROSSING)
    prompts, max_new = _prompts([20, 50, 63, 64, 100]), [60, 40, 20, 20, 15]
    assert _ours(model_dir, prompts, max_new, **engine_kwargs) == _hf_per_position(model_dir, prompts, max_new)


def test_keys_cached_past_the_original_context_serve_a_later_request_unchanged(make_checkpoint):
    """No key depends on how long its sequence grows: a follow-up request reuses the blocks its predecessor
    decoded past the original context (positions 64 to 95, long), and still gives the per-position tokens."""
    model_dir = make_checkpoint("phi3", **CROSSING)
    llm = LLM(str(model_dir), dtype="float32", device=DEVICE, kv_cache_memory_bytes=KV_BYTES, block_size=16)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = _prompts([60])[0]
    first_out = llm.generate([first], greedy)[0].token_ids
    second = first + first_out + [7, 8, 9]
    second_out = llm.generate([second], greedy)[0].token_ids
    assert llm.engine.stats()["prefix_cache_hits"] == 96  # six full blocks of 16
    assert [first_out, second_out] == _hf_per_position(model_dir, [first, second], [40, 40])


def test_a_gptq_partial_rotary_checkpoint_serves_what_its_dequantized_twin_serves(make_checkpoint, tmp_path):
    """The q and k rows a partial-rotary model reorders are reordered in packed int4 weights as in dense ones."""
    src = make_checkpoint("phi4-mini")
    tensors, dense = load_file(src / "model.safetensors"), load_file(src / "model.safetensors")
    for name in [n for n in tensors if n.endswith("qkv_proj.weight")]:
        q, scales, zeros = quant_packers.quantize_groupwise(tensors.pop(name), 32)
        dense[name] = quant_packers.dequantize_groupwise(q, scales, zeros, 32)
        for suffix, packed in quant_packers.pack_gptq(q, scales, zeros, 32, v2=True).items():
            tensors[name.removesuffix("weight") + suffix] = packed
    config = quant_packers.gptq_quantization_config(32, v2=True, sym=False)
    quantized, twin = _write(src, tmp_path / "gptq", tensors, config), _write(src, tmp_path / "dense", dense, None)
    torch.testing.assert_close(_prompt_logprobs(quantized), _prompt_logprobs(twin), rtol=1e-4, atol=1e-4)


def _prompt_logprobs(model_dir) -> torch.Tensor:
    llm = LLM(str(model_dir), dtype="float32", device=DEVICE, kv_cache_memory_bytes=KV_BYTES)
    outs = llm.generate(_prompts([12, 30]), SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    return torch.tensor([v for o in outs for v in o.prompt_logprobs[1:]])


def _write(src, out, tensors, quantization_config):
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    if quantization_config is not None:
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return out
