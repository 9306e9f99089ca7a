"""Weight quantization: the quantizers, GPTQ / AWQ checkpoints, and models served with quantized weights."""

from __future__ import annotations

import json

import pytest
import torch

from gpu_worker.engine import LLM, EngineConfig, SamplingParams
from gpu_worker.engine.kernel_choice import choose_kernels
from gpu_worker.engine.kernels import (
    QUANT_AMX_FLAGS,
    QUANT_CPU_FLAGS,
    QUANT_VNNI_FLAGS,
    cpu_flags,
    cpu_has,
    native_kernels,
    quant_vnni_kernels,
)
from gpu_worker.engine.quantization.formats import AwqFormat, GptqFormat
from gpu_worker.engine.quantization.kernels import (
    CpuInt4LinearKernel,
    CpuInt8LinearKernel,
    DequantLinearKernel,
    OneDnnInt8LinearKernel,
    onednn_int8_matmul,
)
from gpu_worker.engine.quantization.methods import WeightQuantizer
from gpu_worker.engine.quantization.weights import (
    Int4Weight,
    Int8Weight,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    with_exact_scales,
)
from services.text.errors import ModelLoadError
from tests import quant_packers
from tests.quant_checkpoints import four_bit_checkpoints, with_dequantized_weights

PROMPTS = [[5, 17, 42, 9, 33, 2, 71, 8], [90, 3, 3, 14]]
LOGPROBS = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
NATIVE = native_kernels(cpu_flags())  # this CPU's modules, as the kernels take them


def quantized_kernel(weight, dtype=torch.bfloat16, shares_weight=False):
    """The kernel an engine in `dtype` on this CPU chooses for `weight`."""
    return choose_kernels(EngineConfig(""), dtype).linears.quantized(weight, shares_weight)


def prompt_logprobs(llm: LLM) -> torch.Tensor:
    outs = llm.generate(PROMPTS, LOGPROBS)
    return torch.tensor([v for o in outs for v in o.prompt_logprobs[1:]])


def test_int8_rounds_each_weight_to_its_rows_nearest_step():
    w = torch.randn(48, 96)
    q = quantize_int8(w)
    assert q.q.dtype == torch.int8 and q.scale.shape == (48,)
    assert torch.equal(q.scale, q.scale.bfloat16().float())  # the kernels take bf16 scales
    assert bool(((q.dequantize() - w).abs() <= q.scale[:, None] / 2 + 1e-6).all())


def test_int4_rounds_each_weight_to_its_groups_nearest_step():
    w = torch.randn(32, 256)
    q = quantize_int4(w, 64)
    assert q.packed.shape == (32, 128) and q.scale.shape == (32, 4)
    step = q.scale.repeat_interleave(64, 1)
    assert bool(((q.dequantize() - w).abs() <= step / 2 + 1e-5).all())


def test_int4_group_size_falls_back_to_one_that_divides_the_inputs():
    quantizer = WeightQuantizer("int4", group_size=128)
    assert quantizer.group_for(576) == 64  # SmolLM2's hidden size: 9 groups of 64
    assert quantizer.group_for(1536) == 128
    assert isinstance(quantizer(torch.randn(16, 40)), Int8Weight)  # no group size divides 40


def test_gptq_hand_packed_word_reads_back():
    # One column, eight inputs, one group: qweight word 0x76543210 holds q = 0..7 (input k in nibble k),
    # qzeros nibble 7 is z - 1 in the classic format, so z = 8 and w = 0.5 * (k - 8).
    tensors = {"qweight": torch.tensor([[0x76543210] * 8], dtype=torch.int32).reshape(1, 8),
               "qzeros": torch.tensor([[0x77777777]], dtype=torch.int32),
               "scales": torch.full((1, 8), 0.5, dtype=torch.float16),
               "g_idx": torch.zeros(8, dtype=torch.int32)}
    w = GptqFormat(group_size=8).read(tensors).dequantize()
    assert torch.equal(w[0], 0.5 * (torch.arange(8.0) - 8))
    assert torch.equal(GptqFormat(group_size=8, v2=True).read(tensors).dequantize()[0], 0.5 * (torch.arange(8.0) - 7))


@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("v2", [False, True])
def test_gptq_weights_dequantize_to_the_packers_input(desc_act, v2):
    generator = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=generator)
    g_idx = quant_packers.act_order_g_idx(256, 128, generator) if desc_act else None
    q, scales, zeros = quant_packers.quantize_groupwise(w, 128, g_idx)
    zeros = zeros.clamp(min=0 if v2 else 1)
    packed = quant_packers.pack_gptq(q, scales, zeros, 128, g_idx, v2=v2)
    ours = GptqFormat(128, v2=v2).read(packed)
    assert (ours.input_perm is not None) == desc_act
    assert torch.equal(ours.dequantize(), quant_packers.dequantize_groupwise(q, scales, zeros, 128, g_idx))


def test_awq_weights_dequantize_to_the_packers_input():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    q, scales, zeros = quant_packers.quantize_groupwise(w, 64)
    ours = AwqFormat(64).read(quant_packers.pack_awq(q, scales, zeros, 64))
    assert torch.equal(ours.dequantize(), quant_packers.dequantize_groupwise(q, scales, zeros, 64))


@pytest.mark.parametrize("n,k,rows", [(64, 256, 1), (96, 512, 5), (32000, 128, 2), (48, 64, 33), (40, 128, 130)])
@pytest.mark.parametrize("kernel_type", [OneDnnInt8LinearKernel, CpuInt8LinearKernel, CpuInt4LinearKernel])
def test_cpu_kernels_match_the_dequantizing_reference(n, k, rows, kernel_type):
    generator = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=generator) / k**0.5
    weight = (quantize_int4(w, 64) if kernel_type is CpuInt4LinearKernel
              else quantize_int8(w, int8_activations=kernel_type is OneDnnInt8LinearKernel))
    if not cpu_has(QUANT_CPU_FLAGS) or (kernel_type is OneDnnInt8LinearKernel and not onednn_int8_matmul()):
        pytest.skip(f"{kernel_type.__name__} does not run on this CPU")
    assert type(quantized_kernel(weight)) is kernel_type  # not a failed build
    x = torch.randn(rows, k, generator=generator)
    bias = torch.randn(n, generator=generator)
    expected = DequantLinearKernel(weight)(x, None, bias)
    got = kernel_type(weight, NATIVE)(x.bfloat16(), None, bias.bfloat16()).float()
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)


@pytest.mark.skipif(not cpu_has(QUANT_CPU_FLAGS), reason="the native int4 kernel needs AVX2")
def test_a_table_and_its_tied_lm_heads_kernel_hold_one_copy_of_the_scales():
    # The embedding keeps the scales in the form the head's kernel reads, so the kernel takes them as they are.
    table = with_exact_scales(quantize_int4(torch.randn(64, 256) / 16, 32))
    kernel = CpuInt4LinearKernel(table, NATIVE)
    assert kernel.scale.data_ptr() == table.scale.data_ptr() and kernel.offset.data_ptr() == table.offset.data_ptr()


@pytest.mark.skipif(not cpu_has(QUANT_VNNI_FLAGS) or cpu_has(QUANT_AMX_FLAGS),
                    reason="the VNNI GEMM serves decode batches and prefill where the CPU has VNNI and no AMX")
@pytest.mark.parametrize("rows", [5, 64, 300])
def test_without_amx_every_row_count_past_a_decode_steps_few_takes_the_vnni_gemm(rows):
    weight = quantize_int4(torch.randn(96, 256) / 16, 64)
    x = torch.randn(rows, 256).bfloat16()
    got = CpuInt4LinearKernel(weight, NATIVE)(x, None, None)
    assert torch.equal(got, quant_vnni_kernels().int4_gemm_a8(x, weight.packed, weight.scale, weight.offset))


def test_w8a8_weights_take_the_int8_matmul_where_onednn_has_it_and_int8_weights_stay_weight_only():
    w8a8 = quantize_int8(torch.randn(64, 256), int8_activations=True)
    kernel = quantized_kernel(w8a8)
    assert isinstance(kernel, OneDnnInt8LinearKernel if onednn_int8_matmul() else CpuInt8LinearKernel)
    assert isinstance(quantized_kernel(quantize_int8(torch.randn(64, 256))), CpuInt8LinearKernel)
    # A weight the embedding table shares keeps one copy: the row-major kernel reads the table's own tensor.
    shared = quantized_kernel(w8a8, shares_weight=True)
    assert isinstance(shared, CpuInt8LinearKernel) and shared.q.data_ptr() == w8a8.q.data_ptr()


def test_w8a8_quantizes_every_linear_for_int8_activations_and_keeps_the_table_weight_only(make_checkpoint):
    llm = LLM(str(make_checkpoint("llama")), dtype="bfloat16", quantization="w8a8")
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].mlp.down_proj.kernel,
                      OneDnnInt8LinearKernel if onednn_int8_matmul() else CpuInt8LinearKernel)
    assert not model.embed_tokens.quantized.int8_activations
    assert len(llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids) == 4


def test_cpu_int4_kernel_permutes_inputs_for_act_order_weights():
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=generator)
    g_idx = quant_packers.act_order_g_idx(256, 128, generator)
    q, scales, zeros = quant_packers.quantize_groupwise(w, 128, g_idx)
    weight = GptqFormat(128, v2=True).read(quant_packers.pack_gptq(q, scales, zeros, 128, g_idx, v2=True))
    x = torch.randn(3, 256, generator=generator)
    want = x @ weight.dequantize().T
    got = CpuInt4LinearKernel(weight, NATIVE)(x, None, None)
    # Within the rounding of activations to int8 per run of 32 where the CPU has VNNI (fp32 sums elsewhere); an
    # input read from the wrong channel would be off by the whole product.
    assert ((got - want).norm() / want.norm()).item() < 0.01


def test_odd_shapes_and_float32_take_the_reference_kernel():
    # The row-major kernels read 32 inputs at a time (oneDNN's int8 matmul, w8a8's, takes any K).
    assert isinstance(quantized_kernel(quantize_int8(torch.randn(16, 70))), DequantLinearKernel)
    assert isinstance(quantized_kernel(quantize_int4(torch.randn(40, 64), 16)), DequantLinearKernel)
    assert isinstance(quantized_kernel(quantize_int8(torch.randn(16, 64)), torch.float32), DequantLinearKernel)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama-tied", "qwen3-moe"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_model_computes_what_its_dequantized_weights_compute(make_checkpoint, tmp_path, arch, method):
    src = make_checkpoint(arch, hidden_size=128, intermediate_size=256)
    quantizer = WeightQuantizer(method)
    dense = with_dequantized_weights(src, tmp_path / "dense", quantizer)
    quantized = LLM(str(src), dtype="float32", quantization=method)
    torch.testing.assert_close(prompt_logprobs(quantized), prompt_logprobs(LLM(str(dense), dtype="float32")),
                               rtol=1e-4, atol=1e-4)
    assert all(m.weight is None for m in quantized.engine.runner.model.modules() if hasattr(m, "quantize"))


@pytest.mark.parametrize("fmt,desc_act,v2", [("gptq", False, False), ("gptq", True, False), ("gptq", True, True),
                                             ("awq", False, False)])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_four_bit_checkpoint_serves_what_its_dequantized_twin_serves(make_checkpoint, tmp_path, fmt, desc_act,
                                                                      v2, arch):
    src = make_checkpoint(arch, hidden_size=128, intermediate_size=256)
    quantized, dense = four_bit_checkpoints(src, tmp_path, fmt, 128, desc_act=desc_act, v2=v2)
    llm = LLM(str(quantized), dtype="float32")
    torch.testing.assert_close(prompt_logprobs(llm), prompt_logprobs(LLM(str(dense), dtype="float32")),
                               rtol=1e-4, atol=1e-4)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [8, 8]


def test_quantized_embedding_table_is_shared_with_a_tied_lm_head(make_checkpoint):
    model = LLM(str(make_checkpoint("llama-tied")), dtype="bfloat16", quantization="int8").engine.runner.model
    assert isinstance(model.embed_tokens.quantized, Int8Weight)
    assert model.lm_head.kernel.q is model.embed_tokens.quantized.q


def _with_quantization_config(src, tmp_path, config: dict):
    out = tmp_path / "bad"
    four_bit_checkpoints(src, tmp_path, "gptq", 64)
    gptq = tmp_path / "gptq-quantized"
    raw = json.loads((gptq / "config.json").read_text())
    raw["quantization_config"] = {**raw["quantization_config"], **config}
    gptq.rename(out)
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.mark.parametrize("config,named", [
    ({"bits": 3}, "bits=3"),
    ({"group_size": 16}, "group_size=16"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes'"),
])
def test_unsupported_quantization_configs_are_named(make_checkpoint, tmp_path, config, named):
    bad = _with_quantization_config(make_checkpoint("llama"), tmp_path, config)
    with pytest.raises(ModelLoadError, match=named.replace("(", r"\(")):
        LLM(str(bad))


def test_a_flag_that_conflicts_with_the_checkpoints_quantization_is_refused(make_checkpoint, tmp_path):
    quantized, _ = four_bit_checkpoints(make_checkpoint("llama"), tmp_path, "awq", 64)
    with pytest.raises(ModelLoadError, match="conflicts"):
        LLM(str(quantized), quantization="int8")
    kernel = LLM(str(quantized), quantization="int4").engine.runner.model.layers[0].mlp.down_proj.kernel
    assert isinstance(kernel.weight, Int4Weight)


def test_fp8_on_cpu_is_refused_with_the_reason(make_checkpoint):
    with pytest.raises(ModelLoadError, match="CUDA"):
        LLM(str(make_checkpoint("llama")), quantization="fp8")


def test_fp8_keeps_each_weight_within_e4m3_rounding_of_its_row_scale():
    w = torch.randn(32, 64) * torch.logspace(-3, 1, 32)[:, None]
    q = quantize_fp8(w)
    assert q.q.dtype == torch.float8_e4m3fn and torch.equal(q.q.float().abs().amax(dim=1), torch.full((32,), 448.0))
    # e4m3 keeps 3 mantissa bits: relative rounding error at most 2**-4, plus the subnormal floor.
    assert bool(((q.dequantize() - w).abs() <= w.abs() / 16 + q.scale[:, None] * 2**-9).all())


def test_unknown_method_is_refused(make_checkpoint):
    with pytest.raises(ValueError, match="int8, int4, fp8"):
        LLM(str(make_checkpoint("llama")), quantization="int3")


def test_quantized_weights_are_int4_in_memory(make_checkpoint):
    model = LLM(str(make_checkpoint("llama", hidden_size=128, intermediate_size=256)), dtype="float32",
                quantization="int4").engine.runner.model
    assert isinstance(model.embed_tokens.quantized, Int4Weight)
    assert model.layers[0].mlp.gate_up_proj.kernel.weight.packed.dtype == torch.uint8
