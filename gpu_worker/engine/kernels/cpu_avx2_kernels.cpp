// The bf16 element-wise kernels of elementwise.h on 8-lane AVX2 + FMA vectors, for CPUs without AVX-512 (the
// module cpu_kernels needs AVX512-BF16): each one pass where the torch reference takes several.
#include <torch/extension.h>

#include "elementwise.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { elementwise::bind<Avx2>(m); }
