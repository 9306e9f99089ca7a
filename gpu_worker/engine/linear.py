"""Linear layers behind one small interface: a torch reference kernel and the CPU bf16 kernels.

On CPU, bf16 `F.linear` re-lays out its weight for oneDNN on every call; packing it once at load time (the layout
inductor's CPU freezing uses) runs the same math faster. For the few rows of a decode step (memory-bound) our
AVX512-BF16 GEMV in `kernels/cpu_kernels.cpp` reads the weights faster still; on AMX CPUs a decode step's rows up to
AMX_LINEAR_ROWS go to our tile loop (`kernels/amx_linear.cpp`), which reads oneDNN's packed copy in place. On CPUs
without native bf16 products (plain AVX2), where oneDNN will not pack bf16, the weight is widened to float32 as it
is read. The reference stays the default everywhere else and is what exactness tests compare against. The row
counts each kernel serves are where it measured faster than the next (`tokenfleet bench engine`, the linears'
rates by `python -m bench.lab.linear_rates`; bench/RESULTS.md).
Quantized weights plug in as more kernels (`quantization/kernels.py`), each holding its own weight.
Batch-invariant mode (`EngineConfig.deterministic`) packs every bf16 weight for one kernel instead, whose rows
do not depend on one another (`RowInvariantBf16LinearKernel`). `kernel_choice` picks each weight's kernel.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .host_memory import collapse_onto_huge_pages
from .quantization.weights import QuantizedWeight

# The row count oneDNN tunes the packed layout for; it serves every row count correctly.
PACKING_BATCH_HINT = 128
# Rows up to which `gemv_bf16` (weights read once for all rows) beats oneDNN's packed matmul: batch-1 decode, and a
# decode step scoring 4 guesses.
GEMV_ROWS = 5
# Rows up to which `amx_linear_bf16` (kernels/amx_linear.cpp) beats oneDNN's own matmul over the same packed weight,
# where the CPU has AMX: a decode step's rows; a prefill chunk's go to oneDNN.
AMX_LINEAR_ROWS = 192

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GemvPlan:
    """How `gemv_bf16` reads each thread's share of the weight rows: as `streams` sequential streams, a row from
    each in turn, asking for each stream's row `prefetch_rows` ahead as it starts on one (0: the hardware prefetcher
    alone). The outputs are the same bits whatever the plan; the share of the read bandwidth each plan reaches, by
    CPU family, is `python -m bench.lab.gemv_plans`'s (bench/RESULTS.md)."""

    streams: int = 2
    prefetch_rows: int = 2

    @classmethod
    def for_cpu(cls, vendor: str, family: int) -> GemvPlan:
        """The plan for a CPU by its /proc/cpuinfo vendor_id and cpu family (`kernels.cpu_family`): a Zen 4 (AMD
        family 19h) reads faster with no software prefetch, every other CPU measured with it. Family 19h is also
        Zen 3, whose bf16 linears take another kernel (no AVX512-BF16)."""
        return cls(prefetch_rows=0) if (vendor, family) == ("AuthenticAMD", 0x19) else cls()


class TorchLinearKernel:
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)


class OneDnnPackedLinearKernel:
    """oneDNN's matmul over the weight it packed for itself; a few rows by `gemv_bf16` over the plain weight, and a
    decode step's rows on AMX over oneDNN's packed copy (`amx_tiles`) where the CPU has it. `native`: the module of
    the GEMV and the AMX matmul (`kernels.NativeKernels.avx512_bf16`), or None (oneDNN serves every row count)."""

    def __init__(self, weight: torch.Tensor, native, gemv_plan: GemvPlan):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_BATCH_HINT)
        self.native = native if weight.shape[1] % 32 == 0 else None
        self.gemv_plan = gemv_plan
        self.out_features = weight.shape[0]
        self.tiles = amx_tiles(self.packed, weight, self.native)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        if self.native is not None and rows <= GEMV_ROWS and bias is None:
            plan = self.gemv_plan
            return self.native.gemv_bf16(x.contiguous(), weight, plan.streams, plan.prefetch_rows)
        if self.tiles is not None and rows <= AMX_LINEAR_ROWS and x.dim() == 2:
            return self.native.amx_linear_bf16(x.contiguous(), self.tiles, self.out_features, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def packed_span(self) -> tuple[int, int]:
        """Where oneDNN keeps the packed weight: (address, bytes)."""
        return torch.ops.mkldnn.data_ptr(self.packed), torch.ops.mkldnn._nbytes(self.packed)


class WidenedBf16LinearKernel:
    """bf16 weights on CPUs without native bf16 products (plain AVX2), where oneDNN will not pack them and torch's
    bf16 linear runs several times slower than its float32 one: `kernels/quant_cpu_kernels.cpp`
    (`kernels.NativeKernels.quant`) widens the weight to float32 as it reads it (a GEMV for a few rows, float32
    tiles for more), keeping only the bf16 copy."""

    def __init__(self, weight: torch.Tensor, native):
        self.native = native

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        return weight.shape[1] % 32 == 0

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.native.bf16_mm(x, weight)
        return y if bias is None else y + bias


class RowInvariantBf16LinearKernel:
    """Batch-invariant mode's kernel: `rowwise_mm_bf16` sums each output in one fixed order whatever the number of
    rows, so a token's result does not depend on what shares its step, where the default kernels switch between
    a GEMV and oneDNN's matmul, each blocking the sum its own way."""

    def __init__(self, weight: torch.Tensor, native):
        self.native = native  # `kernels.NativeKernels.avx512_bf16`

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.native.rowwise_mm_bf16(x.reshape(-1, x.shape[-1]).contiguous(), weight)
        y = y.view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        return weight.shape[1] % 32 == 0 and weight.is_contiguous()


def amx_tiles(packed: torch.Tensor, weight: torch.Tensor, kernels) -> torch.Tensor | None:
    """oneDNN's packed copy of `weight` as the flat bf16 tensor `amx_linear_bf16` reads, where this CPU's kernels have
    it and oneDNN laid the weight out as that kernel expects ([N/32][K/32][16 input pairs][32 outputs][2], zero
    padded: its AB16b32a2b on AMX CPUs), checked here byte for byte; else None. The view shares oneDNN's memory (held
    by `packed`): no second copy of the weight."""
    if kernels is None or not hasattr(kernels, "amx_linear_bf16") or not kernels.amx_usable():
        return None
    n, k = weight.shape
    blocks = (-(-n // 32), k // 32)
    nbytes = torch.ops.mkldnn._nbytes(packed)
    if k % 32 or nbytes != blocks[0] * blocks[1] * 1024 * 2:
        return None
    tiles = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed)),
                             dtype=torch.bfloat16)
    padded = weight.new_zeros(blocks[0] * 32, k)
    padded[:n] = weight.detach()
    expected = padded.view(blocks[0], 32, blocks[1], 16, 2).permute(0, 2, 3, 1, 4)
    return tiles if torch.equal(tiles.view(expected.shape).view(torch.int16), expected.view(torch.int16)) else None


@functools.cache
def onednn_packs_bf16() -> bool:
    """oneDNN packs bf16 weights only on CPUs with native bf16 support (AVX512-BF16/AMX or AVX-NE-CONVERT);
    on plain AVX2 hosts it refuses, and the reference serves."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(32, 32, dtype=torch.bfloat16), PACKING_BATCH_HINT)
    except RuntimeError:
        return False
    return True


class Linear(nn.Linear):
    """`nn.Linear` whose matmul is done by a swappable kernel (the reference until `pack` or `quantize`).

    A quantized linear drops its dense weight (`weight` is None); its kernel holds the quantized one."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.kernel = TorchLinearKernel()

    @property
    def weight_shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias)

    def bound(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`forward` without the module's machinery: the weight bound, the kernel looked up at each call (packing
        and quantizing swap it; a quantized kernel holds its own weight and ignores the one passed)."""
        weight, bias = self.weight, self.bias
        return lambda x: self.kernel(x, weight, bias)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """The product in float32 where the kernel computes it so anyway (the quantized GEMVs), else `forward`."""
        float32_output = getattr(self.kernel, "float32_output", None)
        return self.forward(x) if float32_output is None else float32_output(x, self.bias)

    def pack(self, kernels) -> None:
        """The loaded weight's kernel, as `kernels` (a `kernel_choice.KernelSet`) chooses it, packing the weight where
        that kernel packs; the original stays for tied embeddings."""
        if self.weight is not None:
            self.kernel = kernels.linears.dense(self.weight)

    def quantize(self, weight: QuantizedWeight, kernels, shares_weight: bool = False) -> None:
        """Serve `weight` by the kernel `kernels` (a `kernel_choice.KernelSet`) chooses, dropping the dense weight.
        `shares_weight`: the weight is also the embedding table (a tied LM head)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight of shape {tuple(weight.shape)} for a linear of "
                             f"{(self.out_features, self.in_features)}")
        self.kernel = kernels.linears.quantized(weight, shares_weight)
        self.weight = None


def pack_linears(model: nn.Module, kernels) -> None:
    """Packs every linear's weight for its kernel (`Linear.pack`), oneDNN's packed copies then moved onto huge pages
    (`collapse_onto_huge_pages`), as the dense weights are: the mixed workload of `tokenfleet bench engine` reads
    them every step."""
    linears = [module for module in model.modules() if isinstance(module, Linear)]
    for module in linears:
        module.pack(kernels)
    packed = [m.kernel.packed_span() for m in linears if isinstance(m.kernel, OneDnnPackedLinearKernel)]
    if packed:
        moved = collapse_onto_huge_pages(packed)
        log.info("oneDNN's packed weights: %d of %d MiB on huge pages", moved >> 20, sum(n for _, n in packed) >> 20)
