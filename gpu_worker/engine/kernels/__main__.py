"""`python -m gpu_worker.engine.kernels`: compiles each native CPU kernel module this CPU can use, once per install
(`make setup` runs it), so that neither an engine's first start nor the test suite waits for the compiler (the
three modules of an AVX512-BF16 host took 2 min 11 s on 2 cores)."""

from . import avx2_kernels, cpu_kernels, quant_amx_kernels, quant_cpu_kernels, quant_vnni_kernels

for build in (cpu_kernels, avx2_kernels, quant_cpu_kernels, quant_vnni_kernels, quant_amx_kernels):
    print(f"{build.__name__}: {'ready' if build() is not None else 'not used on this CPU (or no compiler)'}")
