"""Native kernels, built on first use with torch's C++ extension loader and cached on disk."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch


def cpu_has_avx512_bf16() -> bool:
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@functools.cache
def cpu_kernels():
    """`cpu_kernels.cpp` as a module, or None where it cannot run (no AVX512-BF16) or cannot build."""
    if not cpu_has_avx512_bf16():
        return None
    from torch.utils.cpp_extension import load

    from ..builtin_models import cache_dir

    build = cache_dir() / "kernels" / f"torch-{torch.__version__}"
    build.mkdir(parents=True, exist_ok=True)
    source = Path(__file__).parent / "cpu_kernels.cpp"
    try:
        return load(name="tokenfleet_cpu_kernels", sources=[str(source)], build_directory=str(build),
                    extra_cflags=["-O3", "-mavx512f", "-mavx512bf16", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as exc:  # no compiler or ninja: the torch path serves, just slower
        logging.getLogger(__name__).warning("CPU kernels unavailable (%s); using the torch path", exc)
        return None


@functools.cache
def quant_cpu_kernels():
    """`quant_cpu_kernels.cpp` (int8 / int4 few-row products) as a module, or None where it cannot run (no
    AVX2 + FMA + F16C) or cannot build."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        flags = []
    if not all(f in flags for f in ("avx2", "fma", "f16c")):
        logging.getLogger(__name__).warning("quantized CPU kernels need AVX2, FMA and F16C; using the torch path")
        return None
    from torch.utils.cpp_extension import load

    from ..builtin_models import cache_dir

    build = cache_dir() / "kernels" / f"torch-{torch.__version__}"
    build.mkdir(parents=True, exist_ok=True)
    source = Path(__file__).parent / "quant_cpu_kernels.cpp"
    try:
        return load(name="tokenfleet_quant_cpu_kernels", sources=[str(source)], build_directory=str(build),
                    extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as exc:  # no compiler or ninja: the torch path serves, just slower
        logging.getLogger(__name__).warning("quantized CPU kernels unavailable (%s); using the torch path", exc)
        return None
