"""Native kernels, built on first use with torch's C++ extension loader and cached on disk, and the CPU they are
chosen for (/proc/cpuinfo, read once). `NativeKernels` holds the modules a CPU with given flags runs, each None where
the flags lack the instructions its source is written for (the torch path serves); `kernel_choice` picks from
them."""

from __future__ import annotations

import functools
import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def cpu_has(flags: frozenset[str]) -> bool:
    return flags <= cpu_flags()


def cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_flags()


# The instruction sets the CPU kernels are chosen by, as start-up logs and benchmarks name them.
KERNEL_ISAS = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f", "avx_vnni", "avx2", "fma")


def isa_names(flags: frozenset[str]) -> list[str]:
    return [isa for isa in KERNEL_ISAS if isa in flags]


def cpu_isa() -> list[str]:
    return isa_names(cpu_flags())


def cpu_model() -> str:
    return _cpuinfo_field("model name") or "unknown CPU"


def cpu_family() -> tuple[str, int]:
    """The first CPU's vendor and family as /proc/cpuinfo says them (("", 0) where it does not)."""
    family = _cpuinfo_field("cpu family")
    return _cpuinfo_field("vendor_id"), int(family) if family.isdigit() else 0


@functools.cache
def _cpuinfo_field(name: str) -> str:
    """The first CPU's `name` in /proc/cpuinfo, or ""."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() == name), "")


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports here (the CUDA kernels' compiler; the CPU path never needs it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


QUANT_CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})
QUANT_VNNI_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
QUANT_AMX_FLAGS = frozenset({"amx_tile", "amx_bf16", "avx512_bf16", "avx512bw", "avx512vl"})
AMX_BF16_FLAGS = frozenset({"amx_tile", "amx_bf16", "avx512_bf16"})
AVX2_FLAGS = frozenset({"avx2", "fma"})


def _build_dir() -> Path:
    from services.text.builtin_models import cache_dir

    # A folder per checkout: torch rebuilds a module whose source path changed, and two checkouts sharing one
    # folder (a CI clone beside a working tree) deleted each other's .so while the other was loading it.
    here = Path(__file__).parent
    return cache_dir() / "kernels" / f"torch-{torch.__version__}" / hashlib.sha1(str(here).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class NativeModule:
    """One native kernel module: its name, its sources in this folder, the compiler flags it needs, and the CPU
    flags (/proc/cpuinfo) its instructions need."""

    name: str
    sources: tuple[str, ...]
    cflags: tuple[str, ...]
    needs: frozenset[str]

    def fits(self, flags: frozenset[str]) -> bool:
        return self.needs <= flags

    def built(self) -> bool:
        """Whether its library is on disk, no older than its sources and the headers they include."""
        library = self.build_dir() / f"{self.name}.so"
        return library.is_file() and all(library.stat().st_mtime >= path.stat().st_mtime for path in self.inputs())

    def inputs(self) -> set[Path]:
        """Its sources and, through their `#include "..."` lines, every header of this folder they read."""
        here = Path(__file__).parent
        found, pending = set(), [here / source for source in self.sources]
        while pending:
            path = pending.pop()
            if path not in found and path.is_file():
                found.add(path)
                pending += [here / name for name in re.findall(r'^#include "([^"]+)"', path.read_text(), re.M)]
        return found

    def build_dir(self) -> Path:
        """Its own folder: torch's loader locks and writes build.ninja per folder, so modules sharing one could not
        be compiled at once."""
        return _build_dir() / self.name

    def load(self):
        """The compiled module (compiling it first where needed), or None where it cannot be built."""
        return _load(self)


@functools.cache
def _load(module: NativeModule):
    """Each module is built and imported once a process."""
    from torch.utils.cpp_extension import load

    here, build = Path(__file__).parent, module.build_dir()
    build.mkdir(parents=True, exist_ok=True)
    try:
        return load(name=module.name, sources=[str(here / source) for source in module.sources],
                    build_directory=str(build), extra_cflags=["-O3", *module.cflags, "-fopenmp"],
                    extra_ldflags=["-fopenmp"])
    except Exception as exc:  # no compiler or ninja
        log.warning("%s unavailable (%s); using the torch path", " + ".join(module.sources), exc)
        return None


CPU_KERNEL_SOURCES = ("cpu_kernels.cpp", "cpu_attention_kernels.cpp", "amx_prefill_attention.cpp",
                      "avx512_prefill_attention.cpp", "moe_kernels.cpp")
# The bf16 module: with AMX where the CPU has it (decode attention's scores and prefill attention on tiles),
# AVX512-BF16 alone elsewhere; and the AVX2 module for CPUs without AVX512-BF16.
CPU_MODULE = NativeModule("tokenfleet_cpu_kernels", CPU_KERNEL_SOURCES, ("-mavx512f", "-mavx512bf16"),
                          frozenset({"avx512_bf16"}))
CPU_AMX_MODULE = NativeModule("tokenfleet_cpu_kernels_amx", (*CPU_KERNEL_SOURCES, "amx_linear.cpp"),
                              ("-mavx512f", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-DTOKENFLEET_AMX"),
                              AMX_BF16_FLAGS)
AVX2_MODULE = NativeModule("tokenfleet_avx2_kernels", ("cpu_avx2_kernels.cpp",), ("-mavx2", "-mfma"), AVX2_FLAGS)
QUANT_CPU_MODULE = NativeModule("tokenfleet_quant_cpu_kernels", ("quant_cpu_kernels.cpp", "quant_avx2_gemv.cpp"),
                                ("-mavx2", "-mfma", "-mf16c"), QUANT_CPU_FLAGS)
QUANT_VNNI_MODULE = NativeModule("tokenfleet_quant_vnni_kernels", ("quant_vnni_kernels.cpp", "quant_vnni_gemm.cpp"),
                                 ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512dq"),
                                 QUANT_VNNI_FLAGS)
QUANT_AMX_MODULE = NativeModule("tokenfleet_quant_amx_kernels", ("quant_amx_kernels.cpp",),
                                ("-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bw", "-mavx512vl",
                                 "-mavx512bf16"), QUANT_AMX_FLAGS)


def _avx512_bf16_module(flags: frozenset[str]) -> NativeModule | None:
    """The AVX512-BF16 module for a CPU with these flags (the AMX build where it has AMX), or None."""
    return next((m for m in (CPU_AMX_MODULE, CPU_MODULE) if m.fits(flags)), None)


def _bf16_module(flags: frozenset[str]) -> NativeModule | None:
    """The module `NativeKernels.bf16` loads for these flags, or None."""
    return _avx512_bf16_module(flags) or (AVX2_MODULE if AVX2_MODULE.fits(flags) else None)


class NativeKernels:
    """The native modules a CPU with these flags runs, each built and loaded on first use: None where the flags lack
    its instructions or it cannot be built (the torch path serves)."""

    def __init__(self, flags: frozenset[str]):
        self.flags = flags

    @functools.cached_property
    def avx512_bf16(self):
        """`cpu_kernels.cpp` + `cpu_attention_kernels.cpp` + the prefill attention (bf16 element-wise ops, GEMV, decode
        attention over bf16 and int8 caches, prefill attention: on AMX tiles where the CPU has them,
        `amx_prefill_attention.cpp`, else `avx512_prefill_attention.cpp`; the AMX build adds `amx_linear.cpp`) as one
        module (it needs AVX512-BF16)."""
        module = _avx512_bf16_module(self.flags)
        return module.load() if module is not None else None

    @functools.cached_property
    def bf16(self):
        """The element-wise ops and decode attention: `avx512_bf16` where the flags have AVX512-BF16 (all of its
        kernels), else `cpu_avx2_kernels.cpp` (on AVX2 + FMA vectors: the element-wise kernels, and a decode step's
        rotary, KV write and attention in float32 from the paged cache)."""
        module = _bf16_module(self.flags)
        return module.load() if module is not None else None

    @functools.cached_property
    def quant(self):
        """`quant_cpu_kernels.cpp` + `quant_avx2_gemv.cpp` (int8 / int4 products, bf16 or fp32 activations, or int8
        ones for int4's GEMV; bf16 products for CPUs without native bf16) as one module (it needs AVX2 + FMA +
        F16C)."""
        if not QUANT_CPU_MODULE.fits(self.flags):
            log.warning("quantized CPU kernels need AVX2, FMA and F16C; using the torch path")
            return None
        return QUANT_CPU_MODULE.load()

    @functools.cached_property
    def quant_vnni(self):
        """`quant_vnni_kernels.cpp` + `quant_vnni_gemm.cpp` (int8 / int4 products with int8 activations, for few rows
        and for many) as one module (it needs AVX512-VNNI: Intel since Cascade Lake, AMD since Zen 4)."""
        return QUANT_VNNI_MODULE.load() if QUANT_VNNI_MODULE.fits(self.flags) else None

    @functools.cached_property
    def quant_amx(self):
        """`quant_amx_kernels.cpp` (int8 / int4 products for tens of rows on AMX) as a module (it needs AMX: Intel
        since Sapphire Rapids, and Linux's leave to use it)."""
        if not QUANT_AMX_MODULE.fits(self.flags):
            return None
        module = QUANT_AMX_MODULE.load()
        return module if module is not None and module.amx_usable() else None


@functools.cache
def native_kernels(flags: frozenset[str]) -> NativeKernels:
    return NativeKernels(flags)


def cpu_worker_modules() -> list[NativeModule]:
    """The modules a CPU worker may load on this CPU: the bf16 one, and the quantized linears' (the default model
    is served quantized)."""
    bf16 = _bf16_module(cpu_flags())
    quantized = [m for m in (QUANT_CPU_MODULE, QUANT_VNNI_MODULE, QUANT_AMX_MODULE) if m.fits(cpu_flags())]
    return ([bf16] if bf16 else []) + quantized


def cpu_worker_kernels_built() -> bool:
    """Whether nothing is left to compile before a CPU worker loads its kernels."""
    return all(module.built() for module in cpu_worker_modules())


def build_cpu_worker_kernels() -> None:
    """Compiles the modules `cpu_worker_modules` lists (those already built only load)."""
    for module in cpu_worker_modules():
        module.load()


def cpu_modules() -> list[NativeModule]:
    """Every module this CPU can run, the one with the most sources first."""
    flags = cpu_flags()
    fitting = [m for m in (_avx512_bf16_module(flags), AVX2_MODULE, QUANT_CPU_MODULE, QUANT_VNNI_MODULE,
                           QUANT_AMX_MODULE) if m is not None and m.fits(flags)]
    return sorted(fitting, key=lambda m: -len(m.sources))


def compiled(module: NativeModule) -> bool:
    """Compiles `module` where needed (in a child process of `python -m gpu_worker.engine.kernels`)."""
    return module.load() is not None


# This CPU's modules, as kernel tests and benchmarks call them (the engine's come through `kernel_choice`).
def cpu_kernels():
    return native_kernels(cpu_flags()).avx512_bf16


def avx2_kernels():
    """The AVX2 module, on any CPU with AVX2 (one with AVX512-BF16 serves with `cpu_kernels`)."""
    return AVX2_MODULE.load() if AVX2_MODULE.fits(cpu_flags()) else None


def quant_cpu_kernels():
    return native_kernels(cpu_flags()).quant


def quant_vnni_kernels():
    return native_kernels(cpu_flags()).quant_vnni


def quant_amx_kernels():
    return native_kernels(cpu_flags()).quant_amx
