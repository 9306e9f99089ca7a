"""The one place the engine's kernels are chosen. `choose_kernels` takes the engine's options (`EngineConfig`: the
device, the KV-cache format, batch-invariant mode, and a choice to measure: `cpu_isa`, `torch_ops`), the serving
dtype and, on CPU, the instruction sets (read once a process), and returns the `KernelSet` a model is built and
served with: its element-wise ops, each layer's attention, each linear's kernel and the KV-cache format. The model
and its modules take what they are handed; none tests the device or the CPU.

On CPU, bf16 takes the native kernels the instruction sets allow (`kernels.NativeKernels`); float32, the exactness
tests' dtype, and float16 take the torch references. On CUDA the element-wise ops and attention are Triton's (any
dtype) and quantized linears Triton's or FP8's (16-bit serving). Other devices take the references.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .attention import HeadLayout, ScaledPagedAttention, TorchPagedAttention
from .config import EngineConfig
from .cpu_attention import CpuInt8PagedAttention, CpuPagedAttention, NativePrefillAttention, WidenedDecodeAttention
from .kernels import NativeKernels, cpu_family, cpu_flags, cpu_model, isa_names, native_kernels, triton_available
from .kv_cache_format import KVCacheFormat, ScaledKVFormat, kv_cache_format
from .linear import (
    GemvPlan,
    Linear,
    OneDnnPackedLinearKernel,
    RowInvariantBf16LinearKernel,
    TorchLinearKernel,
    WidenedBf16LinearKernel,
    onednn_packs_bf16,
)
from .ops import NativeCpuOps, TorchOps, TritonOps
from .quantization.kernels import (
    CpuInt4LinearKernel,
    CpuInt8LinearKernel,
    CudaFp8LinearKernel,
    DequantLinearKernel,
    OneDnnInt8LinearKernel,
    TritonInt4LinearKernel,
    TritonInt8LinearKernel,
    TritonMxfp4LinearKernel,
    onednn_int8_matmul,
)
from .quantization.weights import Mxfp4Weight, QuantizedWeight
from .triton_attention import TritonPagedAttention, TritonScaledPagedAttention

# What `EngineConfig.cpu_isa` may name: this CPU's instruction sets, or an AVX2-only CPU's.
CPU_ISAS = ("native", "avx2")


@dataclass(frozen=True)
class CpuIsa:
    """A CPU as its kernels are chosen for it: its /proc/cpuinfo flags, vendor and family, and what torch's oneDNN
    does on it."""

    flags: frozenset[str]
    vendor: str
    family: int
    onednn_packs_bf16: bool  # oneDNN packs bf16 weights (native bf16 products: AVX512-BF16, AMX, AVX-NE-CONVERT)
    onednn_int8_exact: bool  # oneDNN multiplies int8 x int8 exactly (VNNI, AMX)

    @property
    def names(self) -> list[str]:
        return isa_names(self.flags)

    def as_avx2_host(self) -> CpuIsa:
        """This CPU seen as one with AVX2, FMA and F16C but no AVX-512, AMX or AVX-VNNI (a Zen 3), where oneDNN
        neither packs bf16 nor multiplies int8 exactly."""
        return dataclasses.replace(self, flags=avx2_host_flags(self.flags), onednn_packs_bf16=False,
                                   onednn_int8_exact=False)


def avx2_host_flags(flags: frozenset[str]) -> frozenset[str]:
    """Of a CPU's flags, those a host with AVX2 and FMA but no AVX-512, AMX or AVX-VNNI (a Zen 3) would show."""
    return frozenset(f for f in flags if not f.startswith(("avx512", "amx", "avx_vnni")))


@functools.cache
def this_cpu() -> CpuIsa:
    """This process's CPU, read once."""
    return CpuIsa(cpu_flags(), *cpu_family(), onednn_packs_bf16(), onednn_int8_matmul())


class TorchLinears:
    """The torch reference for every weight: `F.linear`, and a quantized weight dequantized for each product."""

    def dense(self, weight: torch.Tensor):
        return TorchLinearKernel()

    def quantized(self, weight: QuantizedWeight, shares_weight: bool):
        return DequantLinearKernel(weight)

    def keeps(self, weight: QuantizedWeight) -> bool:
        """Whether a checkpoint's weight in this format is served as stored (`quantized`), not dequantized at load:
        MXFP4 only where a kernel takes it."""
        return not isinstance(weight, Mxfp4Weight)


class CpuBf16Linears(TorchLinears):
    """bf16 on CPU. Dense weights: packed for oneDNN (with the GEMV and the AMX matmul for a decode step's rows)
    where it packs bf16, else widened to float32 as they are read; in batch-invariant mode the row-invariant product.
    Quantized ones: the native int8 / int4 kernels, or w8a8's int8 matmul on oneDNN where it is exact and the weight
    is not the embedding table's too (it keeps a re-laid copy)."""

    def __init__(self, isa: CpuIsa, native: NativeKernels, batch_invariant: bool):
        self.isa, self.native, self.batch_invariant = isa, native, batch_invariant
        self.gemv_plan = GemvPlan.for_cpu(isa.vendor, isa.family)

    def dense(self, weight: torch.Tensor):
        native = self.native
        if self.batch_invariant:
            if RowInvariantBf16LinearKernel.takes(weight) and native.avx512_bf16 is not None:
                return RowInvariantBf16LinearKernel(weight, native.avx512_bf16)
            return TorchLinearKernel()
        if self.isa.onednn_packs_bf16:
            return OneDnnPackedLinearKernel(weight, native.avx512_bf16, self.gemv_plan)
        if WidenedBf16LinearKernel.takes(weight) and native.quant is not None:
            return WidenedBf16LinearKernel(weight, native.quant)
        return TorchLinearKernel()

    def quantized(self, weight: QuantizedWeight, shares_weight: bool):
        if self.native.quant is None:
            return DequantLinearKernel(weight)
        if OneDnnInt8LinearKernel.takes(weight) and self.isa.onednn_int8_exact and not shares_weight:
            return OneDnnInt8LinearKernel(weight, self.native)
        for kernel in (CpuInt8LinearKernel, CpuInt4LinearKernel):
            if kernel.takes(weight):
                return kernel(weight, self.native)
        return DequantLinearKernel(weight)


class CudaLinears(TorchLinears):
    """CUDA: dense weights by torch's matmul; FP8 weights on FP8 tensor cores in bf16 serving, int8 / int4 / MXFP4 by
    Triton's GEMMs in 16-bit serving."""

    def __init__(self, dtype: torch.dtype, triton: bool):
        self.dtype, self.triton = dtype, triton

    def quantized(self, weight: QuantizedWeight, shares_weight: bool):
        if self.dtype == torch.bfloat16 and CudaFp8LinearKernel.takes(weight):
            return CudaFp8LinearKernel(weight)
        if self.triton and self.dtype in (torch.float16, torch.bfloat16):
            for kernel in (TritonInt8LinearKernel, TritonInt4LinearKernel, TritonMxfp4LinearKernel):
                if kernel.takes(weight):
                    return kernel(weight)
        return DequantLinearKernel(weight)

    def keeps(self, weight: QuantizedWeight) -> bool:
        return super().keeps(weight) or (self.triton and self.dtype in (torch.float16, torch.bfloat16))


def _attention(kv_format: KVCacheFormat, dense: type, scaled: type) -> type:
    """The attention class for the cache: `dense` over one in the serving dtype, `scaled` over an int8 / fp8 one."""
    return scaled if isinstance(kv_format, ScaledKVFormat) else dense


def _over_cache(kv_format: KVCacheFormat, cls: type, heads: HeadLayout) -> TorchPagedAttention:
    """`cls` over the cache; soft-capped heads (Gemma 2), which no kernel takes, by the reference (the Triton
    kernels take sinks)."""
    if heads.softcap is not None:
        cls = _attention(kv_format, TorchPagedAttention, ScaledPagedAttention)
    return cls(heads, kv_format.quantize) if isinstance(kv_format, ScaledKVFormat) else cls(heads)


def _reference(kv_format: KVCacheFormat) -> Callable[[HeadLayout], TorchPagedAttention]:
    return functools.partial(_over_cache, kv_format, _attention(kv_format, TorchPagedAttention, ScaledPagedAttention))


def _cpu_bf16_attention(kv_format: KVCacheFormat, module, heads: HeadLayout) -> TorchPagedAttention:
    """The native module's attention where it takes the heads (`kernels.NativeKernels.bf16`; its prefill too where
    it has one), else the torch path: for a dense cache its decode in float32, for an int8 one the reference."""
    native = module is not None and heads.softcap is None and CpuPagedAttention.takes(module, heads.head_dim)
    if isinstance(kv_format, ScaledKVFormat):
        return CpuInt8PagedAttention(heads, module) if native else ScaledPagedAttention(heads, kv_format.quantize)
    if native:
        cls = NativePrefillAttention if NativePrefillAttention.takes(module, heads.head_dim) else CpuPagedAttention
        return cls(heads, module)
    return WidenedDecodeAttention(heads)


@dataclass(frozen=True)
class KernelSet:
    """What one model is built and served with (`choose_kernels`)."""

    device: torch.device
    dtype: torch.dtype
    ops: TorchOps  # the element-wise ops (the model's norms and activation, attention's rotary, the sampler's argmax)
    kv_format: KVCacheFormat
    attention: Callable[[HeadLayout], TorchPagedAttention]  # a layer's attention over `kv_format`'s cache
    linears: TorchLinears  # each linear's kernel, for its dense or quantized weight
    batch_invariant: bool  # a token's result does not depend on what shares its step (`EngineConfig.deterministic`)
    decode_graphs: bool  # decode steps replayed from CUDA graphs
    isa: CpuIsa | None = None  # on CPU, the instruction sets the kernels were chosen for


def choose_kernels(config: EngineConfig, dtype: torch.dtype) -> KernelSet:
    if config.cpu_isa not in CPU_ISAS:
        raise ValueError(f"cpu_isa must be one of {', '.join(CPU_ISAS)}; got {config.cpu_isa!r}")
    device = torch.device(config.device)
    kv_format = kv_cache_format(config.kv_cache_dtype, dtype, device)
    if device.type == "cpu":
        return _cpu_kernels(config, dtype, device, kv_format)
    if device.type == "cuda":
        return _cuda_kernels(config, dtype, device, kv_format)
    return KernelSet(device, dtype, TorchOps(), kv_format, _reference(kv_format), TorchLinears(),
                     config.deterministic, decode_graphs=False)


def _cpu_kernels(config: EngineConfig, dtype: torch.dtype, device: torch.device,
                 kv_format: KVCacheFormat) -> KernelSet:
    isa = this_cpu() if config.cpu_isa == "native" else this_cpu().as_avx2_host()
    if dtype != torch.bfloat16:
        return KernelSet(device, dtype, TorchOps(), kv_format, _reference(kv_format), TorchLinears(),
                         config.deterministic, decode_graphs=False, isa=isa)
    native = native_kernels(isa.flags)
    module = None if config.torch_ops else native.bf16
    ops = TorchOps() if module is None else NativeCpuOps(module, fuses_mixtures=not config.deterministic)
    return KernelSet(device, dtype, ops, kv_format, functools.partial(_cpu_bf16_attention, kv_format, module),
                     CpuBf16Linears(isa, native, config.deterministic), config.deterministic, decode_graphs=False,
                     isa=isa)


def _cuda_kernels(config: EngineConfig, dtype: torch.dtype, device: torch.device,
                  kv_format: KVCacheFormat) -> KernelSet:
    triton = triton_available()
    if triton and not config.torch_ops:
        ops, attention = TritonOps(), _attention(kv_format, TritonPagedAttention, TritonScaledPagedAttention)
    else:
        ops, attention = TorchOps(), _attention(kv_format, TorchPagedAttention, ScaledPagedAttention)
    # A graph replays a decode step only where attention reads nothing but the metadata's tensors.
    graphs = not config.enforce_eager and attention.graph_safe
    return KernelSet(device, dtype, ops, kv_format, functools.partial(_over_cache, kv_format, attention),
                     CudaLinears(dtype, triton), config.deterministic, decode_graphs=graphs)


def kernel_summary(model: nn.Module, kernels: KernelSet) -> str:
    """Which kernels serve the model, for the start-up log; on CPU also what they were chosen by (the CPU, the
    instruction sets chosen for, the threads and the CPUs this process may run on)."""
    linears = Counter(type(m.kernel).__name__ for m in model.modules() if isinstance(m, Linear))
    attention = Counter(type(layer.self_attn.attn).__name__ for layer in model.layers)
    summary = "; ".join(f"{what}: " + ", ".join(f"{name} x{n}" for name, n in found.items())
                        for what, found in (("linear", linears), ("attention", attention)))
    plans = {m.kernel.gemv_plan for m in model.modules() if isinstance(m, Linear) and hasattr(m.kernel, "gemv_plan")}
    summary += "".join(f"; bf16 GEMVs: {p.streams} streams a thread, {p.prefetch_rows} rows ahead prefetched"
                       for p in plans)
    if kernels.isa is None:
        return summary
    module = kernels.ops.module
    return (f"{cpu_model()}, ISA {' '.join(kernels.isa.names) or 'baseline'}, {torch.get_num_threads()} threads on "
            f"CPUs {sorted(os.sched_getaffinity(0))}, native bf16 kernels {module.__name__ if module else 'none'}; "
            + summary)
