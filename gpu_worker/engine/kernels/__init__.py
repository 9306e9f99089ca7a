"""Native kernels, built on first use with torch's C++ extension loader and cached on disk; each loader returns
None where the CPU lacks the instructions its source is written for (the torch path serves, just slower)."""

from __future__ import annotations

import functools
import hashlib
import logging
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


def cpu_isa() -> list[str]:
    return [isa for isa in KERNEL_ISAS if isa in cpu_flags()]


@functools.cache
def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown CPU"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")


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


def _build_dir() -> Path:
    from ..builtin_models import cache_dir

    # A folder per checkout: torch rebuilds a module whose source path changed, and two checkouts sharing one
    # folder (a CI clone beside a working tree) deleted each other's .so while the other was loading it.
    here = Path(__file__).parent
    return cache_dir() / "kernels" / f"torch-{torch.__version__}" / hashlib.sha1(str(here).encode()).hexdigest()[:12]


def _build(name: str, sources: list[str], cflags: list[str]):
    from torch.utils.cpp_extension import load

    here, build = Path(__file__).parent, _build_dir()
    build.mkdir(parents=True, exist_ok=True)
    try:
        return load(name=name, sources=[str(here / source) for source in sources], build_directory=str(build),
                    extra_cflags=["-O3", *cflags, "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as exc:  # no compiler or ninja
        log.warning("%s unavailable (%s); using the torch path", " + ".join(sources), exc)
        return None


def _cpu_kernels_build() -> tuple[str, list[str]]:
    """The bf16 kernels' module name and flags: with AMX where the CPU has it (decode attention's scores on tiles),
    AVX512-BF16 alone elsewhere."""
    if cpu_has(AMX_BF16_FLAGS):
        return "tokenfleet_cpu_kernels_amx", ["-mavx512f", "-mavx512bf16", "-mamx-tile", "-mamx-bf16",
                                              "-DTOKENFLEET_AMX"]
    return "tokenfleet_cpu_kernels", ["-mavx512f", "-mavx512bf16"]


CPU_KERNEL_SOURCES = ("cpu_kernels.cpp", "cpu_attention_kernels.cpp", "amx_prefill_attention.cpp",
                      "avx512_prefill_attention.cpp")
CPU_KERNEL_HEADERS = ("cpu_kernels.h", "amx_tiles.h", "elementwise.h", "vec.h", "sum16.h", "paged_kv.h")
AVX2_FLAGS = frozenset({"avx2", "fma"})


# cpu_avx2_kernels.cpp's module: name, sources, compiler flags.
AVX2_BUILD = ("tokenfleet_avx2_kernels", ("cpu_avx2_kernels.cpp",), ["-mavx2", "-mfma"])


def _bf16_build() -> tuple[str, tuple[str, ...], list[str]] | None:
    """The module `bf16_kernels` loads on this CPU (name, sources, compiler flags), or None."""
    if cpu_has_avx512_bf16():
        name, flags = _cpu_kernels_build()
        return name, CPU_KERNEL_SOURCES, flags
    return AVX2_BUILD if cpu_has(AVX2_FLAGS) else None


def bf16_kernels_built() -> bool:
    """Whether nothing is left to compile before `bf16_kernels` loads: its module is built from sources no newer
    than it, or this CPU has none."""
    if (build := _bf16_build()) is None:
        return True
    name, sources, _ = build
    built = _build_dir() / f"{name}.so"
    here = Path(__file__).parent
    return built.is_file() and all(built.stat().st_mtime >= (here / source).stat().st_mtime
                                   for source in (*sources, *CPU_KERNEL_HEADERS))


@functools.cache
def cpu_kernels():
    """`cpu_kernels.cpp` + `cpu_attention_kernels.cpp` + the prefill attention (bf16 element-wise ops, GEMV, decode
    attention over bf16 and int8 caches, prefill attention: on AMX tiles where the CPU has them,
    `amx_prefill_attention.cpp`, else `avx512_prefill_attention.cpp`) as one module, or None (it needs
    AVX512-BF16)."""
    if not cpu_has_avx512_bf16():
        return None
    name, sources, flags = _bf16_build()
    return _build(name, list(sources), flags)


@functools.cache
def avx2_kernels():
    """`cpu_avx2_kernels.cpp` (on AVX2 + FMA vectors: the element-wise kernels of `cpu_kernels`, and a decode step's
    rotary, KV write and attention in float32 from the paged cache), or None."""
    if not cpu_has(AVX2_FLAGS):
        return None
    name, sources, flags = AVX2_BUILD
    return _build(name, list(sources), flags)


def bf16_kernels():
    """The native bf16 kernels for this CPU: `cpu_kernels` where it has AVX512-BF16 (all of them), else the AVX2
    module (the element-wise ops and decode attention), or None (the torch path serves)."""
    return cpu_kernels() if cpu_has_avx512_bf16() else avx2_kernels()


@functools.cache
def quant_cpu_kernels():
    """`quant_cpu_kernels.cpp` + `quant_avx2_gemv.cpp` (int8 / int4 products, bf16 or fp32 activations, or int8
    ones for int4's GEMV; bf16 products for CPUs without native bf16) as one module, or None (it needs AVX2 + FMA +
    F16C)."""
    if not cpu_has(QUANT_CPU_FLAGS):
        log.warning("quantized CPU kernels need AVX2, FMA and F16C; using the torch path")
        return None
    return _build("tokenfleet_quant_cpu_kernels", ["quant_cpu_kernels.cpp", "quant_avx2_gemv.cpp"],
                  ["-mavx2", "-mfma", "-mf16c"])


@functools.cache
def quant_vnni_kernels():
    """`quant_vnni_kernels.cpp` + `quant_vnni_gemm.cpp` (int8 / int4 products with int8 activations, for few rows
    and for many) as one module, or None (it needs AVX512-VNNI: Intel since Cascade Lake, AMD since Zen 4)."""
    if not cpu_has(QUANT_VNNI_FLAGS):
        return None
    return _build("tokenfleet_quant_vnni_kernels", ["quant_vnni_kernels.cpp", "quant_vnni_gemm.cpp"],
                  ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512dq"])


@functools.cache
def quant_amx_kernels():
    """`quant_amx_kernels.cpp` (int8 / int4 products for tens of rows on AMX) as a module, or None (it needs AMX:
    Intel since Sapphire Rapids, and Linux's leave to use it)."""
    if not cpu_has(QUANT_AMX_FLAGS):
        return None
    module = _build("tokenfleet_quant_amx_kernels", ["quant_amx_kernels.cpp"],
                    ["-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"])
    return module if module is not None and module.amx_usable() else None
