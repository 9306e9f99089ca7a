"""`python -m gpu_worker.engine.kernels`: compiles each native CPU kernel module this CPU can use, once per install
(`make setup` runs it), so that neither an engine's first start nor the test suite waits minutes for the
compiler. The modules compile side by side, one process each: a module of one source leaves a core idle."""

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from . import avx2_kernels, compiled, cpu_kernels, cpu_modules, quant_amx_kernels, quant_cpu_kernels, quant_vnni_kernels

with ProcessPoolExecutor(max_workers=os.cpu_count() or 1, mp_context=multiprocessing.get_context("fork")) as pool:
    list(pool.map(compiled, cpu_modules()))
for build in (cpu_kernels, avx2_kernels, quant_cpu_kernels, quant_vnni_kernels, quant_amx_kernels):
    print(f"{build.__name__}: {'ready' if build() is not None else 'not used on this CPU (or no compiler)'}")
