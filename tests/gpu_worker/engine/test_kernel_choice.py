"""`kernel_choice.choose_kernels`: the kernels an engine is built with, for each device, dtype, instruction set and
option, asked without building an engine (CUDA's too, without a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

from gpu_worker.engine import EngineConfig
from gpu_worker.engine.attention import HeadLayout, ScaledPagedAttention, TorchPagedAttention
from gpu_worker.engine.cpu_attention import (
    CpuInt8PagedAttention,
    CpuPagedAttention,
    NativePrefillAttention,
    WidenedDecodeAttention,
)
from gpu_worker.engine.kernel_choice import CpuBf16Linears, TorchLinears, choose_kernels, this_cpu
from gpu_worker.engine.kernels import (
    AVX2_FLAGS,
    QUANT_CPU_FLAGS,
    avx2_kernels,
    cpu_has,
    cpu_has_avx512_bf16,
    cpu_kernels,
    quant_amx_kernels,
    quant_cpu_kernels,
    quant_vnni_kernels,
)
from gpu_worker.engine.linear import (
    GemvPlan,
    OneDnnPackedLinearKernel,
    RowInvariantBf16LinearKernel,
    TorchLinearKernel,
    WidenedBf16LinearKernel,
    onednn_packs_bf16,
)
from gpu_worker.engine.ops import NativeCpuOps, TorchOps
from gpu_worker.engine.quantization.kernels import (
    GEMV_ROWS,
    CpuInt4LinearKernel,
    CpuInt8LinearKernel,
    DequantLinearKernel,
    OneDnnInt8LinearKernel,
    onednn_int8_matmul,
)
from gpu_worker.engine.quantization.weights import quantize_int4, quantize_int8
from services.text.errors import ModelLoadError

HEADS = HeadLayout(12, 4, 64, 0.125)
DENSE = torch.randn(96, 256).bfloat16()
INT8, INT4 = quantize_int8(torch.randn(96, 256)), quantize_int4(torch.randn(96, 256), 64)
needs_quant_kernels = pytest.mark.skipif(not cpu_has(QUANT_CPU_FLAGS), reason="the quantized kernels need AVX2")


def kernels_for(dtype: torch.dtype = torch.bfloat16, **options):
    return choose_kernels(EngineConfig("", **options), dtype)


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="this CPU's native bf16 kernels need AVX512-BF16")
def test_bf16_on_this_cpu_takes_its_avx512_kernels():
    kernels = kernels_for()
    assert type(kernels.ops) is NativeCpuOps and kernels.ops.module is cpu_kernels()
    attention = kernels.attention(HEADS)
    assert type(attention) in (NativePrefillAttention, CpuPagedAttention) and attention.kernels is cpu_kernels()
    if not hasattr(cpu_kernels(), "amx_usable") or cpu_kernels().amx_usable():  # the AMX build needs Linux's leave
        assert type(attention) is NativePrefillAttention
    dense = kernels.linears.dense(DENSE)
    assert type(dense) is OneDnnPackedLinearKernel and dense.native is cpu_kernels()
    assert dense.gemv_plan == GemvPlan.for_cpu(this_cpu().vendor, this_cpu().family)
    assert kernels.isa.flags == this_cpu().flags and not kernels.decode_graphs


@needs_quant_kernels
def test_int8_and_int4_weights_take_the_native_kernels_this_cpu_has():
    linears = kernels_for().linears
    int8, int4 = linears.quantized(INT8, shares_weight=False), linears.quantized(INT4, shares_weight=False)
    assert type(int8) is CpuInt8LinearKernel and type(int4) is CpuInt4LinearKernel
    if quant_vnni_kernels() is not None:  # the int8-activation GEMVs; the VNNI GEMM past them where no AMX
        assert int8._gemv == quant_vnni_kernels().int8_gemv_a8 and int4._gemv == quant_vnni_kernels().int4_gemv_a8
    else:
        assert int8._gemv == quant_cpu_kernels().int8_gemv and int8.gemv_rows == GEMV_ROWS
    larger = "amx" if quant_amx_kernels() is not None else "gemm" if quant_vnni_kernels() is not None else "tiles"
    assert int8.larger.__name__ == larger and int4.larger.__name__ == larger
    w8a8 = quantize_int8(torch.randn(96, 256), int8_activations=True)
    assert type(linears.quantized(w8a8, shares_weight=False)) is (
        OneDnnInt8LinearKernel if onednn_int8_matmul() else CpuInt8LinearKernel)
    assert type(linears.quantized(w8a8, shares_weight=True)) is CpuInt8LinearKernel  # no second copy of a table


def test_float32_on_cpu_takes_the_torch_references_throughout():
    for options in ({}, {"kv_cache_dtype": "int8"}, {"cpu_isa": "avx2"}):
        kernels = kernels_for(torch.float32, **options)
        assert type(kernels.ops) is TorchOps and type(kernels.linears) is TorchLinears
        assert type(kernels.linears.dense(DENSE.float())) is TorchLinearKernel
        assert type(kernels.linears.quantized(INT8, shares_weight=False)) is DequantLinearKernel
    assert type(kernels_for(torch.float32).attention(HEADS)) is TorchPagedAttention
    assert type(kernels_for(torch.float32, kv_cache_dtype="int8").attention(HEADS)) is ScaledPagedAttention


@pytest.mark.skipif(not cpu_has(AVX2_FLAGS | QUANT_CPU_FLAGS), reason="the AVX2 kernels need AVX2, FMA and F16C")
def test_an_avx2_choice_named_in_the_engine_config_takes_an_avx2_hosts_kernels_on_this_cpu():
    kernels = kernels_for(cpu_isa="avx2")
    assert not {f for f in kernels.isa.flags if f.startswith(("avx512", "amx", "avx_vnni"))}
    assert kernels.isa.names == [isa for isa in ("avx2", "fma") if isa in this_cpu().flags]
    assert type(kernels.ops) is NativeCpuOps and kernels.ops.module is avx2_kernels()
    attention = kernels.attention(HEADS)
    assert type(attention) is CpuPagedAttention and attention.kernels is avx2_kernels()
    int8_cache = kernels_for(cpu_isa="avx2", kv_cache_dtype="int8").attention(HEADS)
    assert type(int8_cache) is CpuInt8PagedAttention and int8_cache.kernels is avx2_kernels()
    assert type(kernels.linears.dense(DENSE)) is WidenedBf16LinearKernel  # oneDNN packs no bf16 there
    int4 = kernels.linears.quantized(INT4, shares_weight=False)
    assert int4._gemv == quant_cpu_kernels().int4_gemv_a8 and int4.larger.__name__ == "tiles"  # no VNNI, no AMX
    w8a8 = quantize_int8(torch.randn(96, 256), int8_activations=True)
    assert type(kernels.linears.quantized(w8a8, shares_weight=False)) is CpuInt8LinearKernel  # no exact int8 oneDNN
    torch_path = kernels_for(cpu_isa="avx2", torch_ops=True)
    assert type(torch_path.ops) is TorchOps and type(torch_path.attention(HEADS)) is WidenedDecodeAttention
    assert type(torch_path.linears.dense(DENSE)) is WidenedBf16LinearKernel  # the linears keep theirs


def test_an_int8_kv_cache_takes_the_native_int8_attention_where_the_cpu_has_the_bf16_kernels():
    kernels = kernels_for(kv_cache_dtype="int8")
    attention = kernels.attention(HEADS)
    if kernels.ops.module is None:
        assert type(attention) is ScaledPagedAttention
    else:
        assert type(attention) is CpuInt8PagedAttention and attention.kernels is kernels.ops.module
    assert kernels.kv_format.name == "int8"
    assert type(kernels.attention(HeadLayout(4, 2, 48, 48**-0.5))) is ScaledPagedAttention  # a head size they skip
    with pytest.raises(ModelLoadError, match="fp8 KV cache needs a CUDA GPU"):
        kernels_for(kv_cache_dtype="fp8")


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="batch-invariant mode needs AVX512-BF16")
def test_batch_invariant_mode_takes_the_row_invariant_product():
    kernels = kernels_for(deterministic=True)
    assert kernels.batch_invariant and type(kernels.linears) is CpuBf16Linears
    assert type(kernels.linears.dense(DENSE)) is RowInvariantBf16LinearKernel
    assert type(kernels.linears.dense(torch.randn(96, 40).bfloat16())) is TorchLinearKernel  # inputs not in 32s
    assert kernels.attention(HEADS).row_invariant_decode


def test_no_other_cpu_isa_is_taken():
    with pytest.raises(ValueError, match="cpu_isa must be one of native, avx2"):
        kernels_for(cpu_isa="avx512")


@pytest.mark.skipif(not onednn_packs_bf16(), reason="bf16 weights are packed for oneDNN only with native bf16")
def test_a_packed_weight_with_inputs_not_in_32s_has_no_gemv():
    assert kernels_for().linears.dense(torch.randn(96, 40).bfloat16()).native is None


class TestCuda:
    """The choice for a CUDA engine, built without a GPU (no kernel runs): Triton's ops and attention, CUDA graphs."""

    @pytest.fixture(autouse=True)
    def _triton(self):
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # as the Triton tests define their kernels on CPU
        pytest.importorskip("triton", reason="Triton is not installed")

    def test_cuda_takes_the_triton_kernels_and_replays_decode_steps_from_graphs(self):
        from gpu_worker.engine.ops import TritonOps
        from gpu_worker.engine.triton_attention import TritonPagedAttention, TritonScaledPagedAttention

        for dtype in (torch.bfloat16, torch.float32):
            kernels = kernels_for(dtype, device="cuda")
            assert type(kernels.ops) is TritonOps and type(kernels.attention(HEADS)) is TritonPagedAttention
            assert kernels.decode_graphs and kernels.isa is None
            assert type(kernels.linears.dense(DENSE)) is TorchLinearKernel
        assert type(kernels_for(device="cuda", kv_cache_dtype="fp8").attention(HEADS)) is TritonScaledPagedAttention
        assert not kernels_for(device="cuda", enforce_eager=True).decode_graphs

    def test_cuda_quantized_weights_take_triton_in_16_bits_and_the_reference_in_float32(self):
        from gpu_worker.engine.quantization.kernels import TritonInt4LinearKernel, TritonInt8LinearKernel

        linears = kernels_for(device="cuda").linears
        assert type(linears.quantized(INT8, shares_weight=False)) is TritonInt8LinearKernel
        assert type(linears.quantized(INT4, shares_weight=False)) is TritonInt4LinearKernel
        assert type(kernels_for(torch.float32, device="cuda").linears.quantized(INT8, False)) is DequantLinearKernel

    def test_the_torch_path_on_cuda_is_the_reference_eager(self):
        kernels = kernels_for(device="cuda", torch_ops=True)
        assert type(kernels.ops) is TorchOps and type(kernels.attention(HEADS)) is TorchPagedAttention
        assert not kernels.decode_graphs
