"""GGUF files of the Gemma 2, Gemma 3, Phi-3, OLMoE and gpt-oss families, written as llama.cpp's converter writes
them (Gemma's RMSNorm weights + 1, Phi-3's fused projections and LongRoPE tensors, no query_pre_attn_scalar or layer
pattern for Gemma; OLMoE's whole-projection q/k norms; gpt-oss's sinks, biases and de-interleaved experts), serve
what HF transformers serves from the same model's directory (float32 greedy), with the directory's config and
rotary frequencies; Gemma's attention scale and sliding layers are llama.cpp's; Q8_0 mixtures and gpt-oss's MXFP4
experts load and generate; what a file cannot say is refused by name (a phi3 file with half its LongRoPE factors,
an olmoe file asking to clip, models whose clipping or SwiGLU llama.cpp fixes otherwise)."""

from __future__ import annotations

import dataclasses
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.engine import ModelLoadError
from gpu_worker.engine.checkpoint import open_checkpoint
from gpu_worker.engine.model_config import ModelConfig
from gpu_worker.engine.quantization.weights import Mxfp4Weight
from gpu_worker.engine.rope import RotaryEmbedding
from tests.gguf_files import write_gguf
from tests.gpu_worker.engine import test_gguf
from tests.gpu_worker.engine.test_gguf import (
    LONG_PROMPTS,
    PROMPTS,
    hf_greedy_loading,
    hyperparameters_file,
    ours_greedy,
)

T = gguf.GGMLQuantizationType
small_checkpoint = test_gguf.small_checkpoint  # the same module-scoped fixture: a 1 000-token vocabulary, hidden 256


def _longrope(rotary_dims: int) -> dict:
    """conftest's LongRoPE, with one short and one long factor per rotary frequency of these checkpoints."""
    n = rotary_dims // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 2.5 * i / (n - 1) for i in range(n)],
            "long_factor": [1.0 + 15.0 * (i / (n - 1)) ** 2 for i in range(n)]}


# conftest's ARCHITECTURES, in shapes a file can say. Gemma: query_pre_attn_scalar = head_dim, which llama.cpp takes
# for all but the 27B models; Gemma 3 with six layers, the sixth full (llama.cpp's pattern), its full layers'
# rotary scaled 8x and the sliding layers' base their own. Phi-3: 64 dims per head (hidden 256 / 4 heads), every
# one rotated (phi3) or 3/4 of them with tied embeddings (phi4-mini).
FAMILIES = {
    "gemma2": {"query_pre_attn_scalar": 32},
    "gemma3": {"query_pre_attn_scalar": 32, "num_hidden_layers": 6, "layer_types": None},
    "phi3": {"rope_parameters": _longrope(64)},
    "phi4-mini": {"rope_parameters": _longrope(48)},
    # llama.cpp's: OLMoE unclipped; gpt-oss's SwiGLU limit 7 (with hidden 256 its gate and up still cross it)
    "olmoe": {"clip_qkv": None},
    "gpt-oss": {"swiglu_limit": 7.0},
}


def varied(model_dir, out):
    """A copy of `model_dir` with random RMSNorm weights (Gemma's start at 0, Phi-3's at 1: the +1 the converter adds
    to Gemma's gets values to change) and, for Gemma, an embedding table 1/16 as large: scaled by √hidden = 16 it
    enters at the other weights' scale, where as it is it outweighs every layer and the tied LM head repeats the last
    token whatever the layers do. gpt-oss's sinks a few units, as conftest's `_loud_sinks` makes them."""
    shutil.copytree(model_dir, out)
    tensors = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name, tensor in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = tensor + 0.2 * torch.randn(tensor.shape, generator=generator)
        elif name.endswith("self_attn.sinks"):  # conftest's loud sinks: a few units, where a mistake shows
            tensors[name] = torch.rand(tensor.shape, generator=generator) * 5.0 - 1.0
    if "gemma" in out.name:
        tensors["model.embed_tokens.weight"] /= 16
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_a_float32_gguf_file_greedy_equals_its_hf_directory(small_checkpoint, tmp_path, arch):
    model_dir = varied(small_checkpoint(arch, **FAMILIES[arch]), tmp_path / arch)
    path = write_gguf(model_dir, tmp_path / f"{arch}.gguf", T.F32)
    prompts = [*PROMPTS[:2], LONG_PROMPTS[0]]  # two past Gemma's sliding window of 40; within Phi-3's original context
    assert ours_greedy(str(path), prompts, 12) == hf_greedy_loading(model_dir, prompts, 12)


def _rotary(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return dict(RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).named_buffers())


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_a_gguf_files_config_and_rotary_are_its_hf_directorys(small_checkpoint, tmp_path, arch):
    """LongRoPE's long factors included, which the greedy test's sequences never reach. The end-of-sequence ids
    come from the tokenizer instead of config.json, and the norm epsilon is stored in float32."""
    model_dir = small_checkpoint(arch, **FAMILIES[arch])
    ours = open_checkpoint(write_gguf(model_dir, tmp_path / "model.gguf", T.F32)).config
    theirs = ModelConfig.from_dir(model_dir)
    assert _rotary(ours).keys() == _rotary(theirs).keys()
    for name, buffer in _rotary(ours).items():
        assert torch.equal(buffer, _rotary(theirs)[name]), name

    def rest(cfg: ModelConfig) -> ModelConfig:
        return dataclasses.replace(cfg, rope_scaling={}, eos_token_ids=frozenset(),
                                   rms_norm_eps=float(np.float32(cfg.rms_norm_eps)))

    assert rest(ours) == rest(theirs)


@pytest.mark.parametrize(("arch", "layers", "hidden", "heads", "head_dim", "scalar", "full"), [
    ("gemma2", 26, 2304, 8, 256, 256, set(range(1, 26, 2))),  # Gemma 2 2B
    ("gemma2", 46, 4608, 32, 128, 144, set(range(1, 46, 2))),  # Gemma 2 27B
    ("gemma3", 26, 1152, 4, 256, 256, {5, 11, 17, 23}),  # Gemma 3 1B
    ("gemma3", 62, 5376, 32, 128, 168, set(range(5, 62, 6))),  # Gemma 3 27B
], ids=["gemma2-2b", "gemma2-27b", "gemma3-1b", "gemma3-27b"])
def test_gemmas_attention_scale_and_sliding_layers_are_llama_cpps(tmp_path, arch, layers, hidden, heads, head_dim,
                                                                  scalar, full):
    """No file has query_pre_attn_scalar: llama.cpp's scale, hidden / heads for the 27B models and head_dim for
    the rest, is the released configs' query_pre_attn_scalar."""
    path = hyperparameters_file(tmp_path / "model.gguf", arch, block_count=layers, embedding_length=hidden,
                                head_count=heads, key_length=head_dim, sliding_window=512)
    config = open_checkpoint(path).config
    assert config.query_pre_attn_scalar == scalar and config.full_attention_layers == full
    assert config.norm_weight_offset and config.sandwich_norms and config.embedding_scale == hidden ** 0.5


def test_a_phi3_file_with_half_its_longrope_factors_names_the_other(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "phi3.gguf", "phi3")
    for key, value in {"embedding_length": 8, "head_count": 2, "block_count": 1, "feed_forward_length": 16,
                       "layer_norm_rms_eps": 1e-5, "context_length": 64, "rope_scaling_orig_ctx_len": 16}.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tensor("rope_factors_long.weight", np.ones(2, dtype=np.float32))
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="rope_factors_short"):
        open_checkpoint(tmp_path / "phi3.gguf")


# ---- OLMoE and gpt-oss ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["olmoe", "gpt-oss"])
def test_a_q8_0_mixture_file_loads_with_its_experts_quantized_and_generates(small_checkpoint, tmp_path, arch):
    from gpu_worker.engine import LLM, SamplingParams
    from gpu_worker.engine.quantization.weights import QuantizedWeight
    from tests.conftest import DEVICE

    path = write_gguf(small_checkpoint(arch, **FAMILIES[arch]), tmp_path / "model.gguf", T.Q8_0)
    experts = [w for name, w in open_checkpoint(path).tensors() if ".experts." in name and name.endswith("weight")]
    assert len(experts) == 2 * 4 * 3 and all(isinstance(w, QuantizedWeight) for w in experts)
    llm = LLM(str(path), device=DEVICE, kv_cache_memory_bytes=64 << 20, max_model_len=1024)
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [8, 8]


def test_gpt_oss_mxfp4_experts_arrive_as_stored_with_ggmls_values_and_generate(small_checkpoint, tmp_path):
    """MXFP4 is how the converter stores the released checkpoints' experts (repacked, not requantized)."""
    path = write_gguf(small_checkpoint("gpt-oss", **FAMILIES["gpt-oss"]), tmp_path / "model.gguf", T.MXFP4)
    weights = dict(open_checkpoint(path).tensors())
    stacked = [t for t in gguf.GGUFReader(path).tensors if t.tensor_type == T.MXFP4]
    assert sorted({t.name.split(".")[2] for t in stacked}) == ["ffn_down_exps", "ffn_gate_exps", "ffn_up_exps"]
    for tensor in stacked:
        layer, part = tensor.name.split(".")[1:3]
        reference = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
        for expert, values in enumerate(reference):
            served = weights[f"model.layers.{layer}.mlp.experts.{expert}.{part[4:-5]}_proj.weight"]
            assert isinstance(served, Mxfp4Weight)  # as stored, for a GPU's kernel (dequantized at load on a CPU)
            assert torch.equal(served.dequantize(), values), (tensor.name, expert)
    assert len(ours_greedy(str(path), PROMPTS[:1], 8)[0]) == 8


def test_an_olmoe_file_that_asks_to_clip_qkv_is_refused_by_name(tmp_path):
    path = hyperparameters_file(tmp_path / "olmoe.gguf", "olmoe", expert_count=4, expert_used_count=2,
                                clamp_kqv=8.0)
    with pytest.raises(ModelLoadError, match="clamp_kqv"):
        open_checkpoint(path)


def test_gpt_oss_files_sliding_layers_window_and_swiglu_are_llama_cpps(tmp_path):
    path = hyperparameters_file(tmp_path / "gpt-oss.gguf", "gpt-oss", block_count=4, expert_count=4,
                                expert_used_count=2, expert_feed_forward_length=16, sliding_window=128)
    config = open_checkpoint(path).config
    assert config.sliding_window == 128 and config.full_attention_layers == {1, 3} and config.attention_sinks
    assert config.moe.clamped_swiglu == (1.702, 7.0) and config.moe.softmax_over_top_k
    assert config.moe.expert_intermediate_size == 16


@pytest.mark.parametrize(("arch", "field"), [("olmoe", "clip_qkv"), ("gpt-oss", "SwiGLU limit")])
def test_a_model_whose_clipping_llama_cpp_fixes_otherwise_has_no_gguf_file(small_checkpoint, tmp_path, arch, field):
    """conftest's OLMoE clips q/k/v at 2 and its gpt-oss clamps the SwiGLU at 2: no file says either."""
    with pytest.raises(ValueError, match=field):
        write_gguf(small_checkpoint(arch), tmp_path / "model.gguf", T.F32)


# ---- tokenfleet quantize -------------------------------------------------------------------------------------------

QUANTIZED = ["gemma2", "gemma3", "phi3", "phi4-mini", "olmoe"]
HF_CONFIGS = {"gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig", "phi3": "Phi3Config", "phi4-mini": "Phi3Config",
              "olmoe": "OlmoeConfig"}


def _file(small_checkpoint, tmp_path, arch):
    model_dir = varied(small_checkpoint(arch, **FAMILIES[arch]), tmp_path / arch)
    return write_gguf(model_dir, tmp_path / f"{arch}.gguf", T.F32)


@pytest.mark.parametrize("arch", QUANTIZED)
def test_a_gguf_file_quantizes_to_a_directory_serving_what_load_time_int8_serves(small_checkpoint, tmp_path, arch):
    """Gemma's norms, Phi-3's fused projections and partial rotary, OLMoE's whole q/k norms and experts."""
    from gpu_worker.engine import LLM
    from gpu_worker.quantize.convert import quantize_checkpoint
    from tests.conftest import DEVICE

    path = _file(small_checkpoint, tmp_path, arch)
    done = quantize_checkpoint(str(path), "int8", tmp_path / "int8")
    load_time = LLM(str(path), dtype="float32", device=DEVICE, kv_cache_memory_bytes=64 << 20, max_model_len=1024,
                    quantization="int8")
    prompts = [*PROMPTS[:2], LONG_PROMPTS[0]]
    assert ours_greedy(str(done.out), prompts, 12) == ours_greedy(load_time, prompts, 12)


@pytest.mark.parametrize("arch", QUANTIZED)
def test_a_gguf_files_bf16_directory_is_its_familys_hf_checkpoint(small_checkpoint, tmp_path, arch):
    """transformers reads its config as the family's class and serves from the directory what we serve from it:
    tensors under HF's names and in its layout (Phi-3's q/k/v and gate/up fused, q/k rows in HF's order), read as
    we read them (the int8 test above shows ours is the file's model: Gemma's norm weights w, not 1 + w), and
    every field the model needs (Gemma's layer types, scalar and caps, Gemma 3's rotary per layer type, Phi-3's
    LongRoPE and partial rotary, OLMoE's experts)."""
    from transformers import AutoConfig

    from gpu_worker.quantize.convert import quantize_checkpoint

    done = quantize_checkpoint(str(_file(small_checkpoint, tmp_path, arch)), "bf16", tmp_path / "bf16")
    assert type(AutoConfig.from_pretrained(done.out)).__name__ == HF_CONFIGS[arch]
    prompts = [*PROMPTS[:2], LONG_PROMPTS[0]]
    assert hf_greedy_loading(done.out, prompts, 12) == ours_greedy(str(done.out), prompts, 12)


@pytest.mark.parametrize(("arch", "keys", "named"), [
    ("gpt-oss", dict(expert_count=4, expert_used_count=2, expert_feed_forward_length=16, sliding_window=8),
     "GptOssForCausalLM"),
    ("gemma2", dict(sliding_window=8, rope_freq_base=10000.0, rope_freq_base_swa=500.0), "sliding_rope"),
], ids=["gpt-oss", "gemma2-own-sliding-rotary"])
def test_quantize_refuses_a_file_no_hf_config_of_its_family_describes_by_name(tmp_path, arch, keys, named):
    """Before loading the model: gpt-oss files (not yet written), and a Gemma 2 whose sliding layers rotate by a
    base of their own, which Gemma2Config cannot say."""
    from gpu_worker.quantize.convert import quantize_checkpoint

    path = hyperparameters_file(tmp_path / "model.gguf", arch, **keys)
    with pytest.raises(ModelLoadError, match=named):
        quantize_checkpoint(str(path), "int8", tmp_path / "int8")
    assert not (tmp_path / "int8").exists()
