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
