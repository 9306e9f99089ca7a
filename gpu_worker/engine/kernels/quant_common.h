// What the quantized CPU kernels share (quant_cpu_kernels.cpp, quant_vnni_kernels.cpp): reading scales and
// writing outputs in either dtype, a runtime row count or dtype handed to templates, and weight rows split
// among threads. Internal linkage: the two modules are built for different instruction sets.
#pragma once
#include <torch/extension.h>
#include <cstdint>
#include <type_traits>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int64_t kMaxRowsAtOnce = 8;  // x rows one pass over the weights multiplies, their sums in registers
constexpr int64_t kMinParallelWeights = 1 << 15;  // below this, one thread: a parallel region costs more

inline float load_float(const float* p) { return *p; }
inline float load_float(const at::BFloat16* p) { return static_cast<float>(*p); }

inline void store(float* y, float v) { *y = v; }
inline void store(at::BFloat16* y, float v) { *y = at::BFloat16(v); }  // round to nearest even, as torch

// Calls body(std::integral_constant<int, M>) for the runtime M in 1 .. kMaxRowsAtOnce.
template <typename F>
void dispatch_rows(int64_t M, F&& body) {
  switch (M) {
    case 1: return body(std::integral_constant<int, 1>());
    case 2: return body(std::integral_constant<int, 2>());
    case 3: return body(std::integral_constant<int, 3>());
    case 4: return body(std::integral_constant<int, 4>());
    case 5: return body(std::integral_constant<int, 5>());
    case 6: return body(std::integral_constant<int, 6>());
    case 7: return body(std::integral_constant<int, 7>());
    case 8: return body(std::integral_constant<int, 8>());
  }
  TORCH_CHECK(false, "x must have 1 to ", kMaxRowsAtOnce, " rows");
}

// Each thread takes one contiguous range of the N weight rows, streamed front to back: rows(n0, n1).
template <typename F>
void parallel_rows(int64_t N, int64_t K, F&& rows) {
#pragma omp parallel if (N * K >= kMinParallelWeights)
  {
#ifdef _OPENMP
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
#else
    const int64_t threads = 1, t = 0;
#endif
    rows(N * t / threads, N * (t + 1) / threads);
  }
}

// Calls body(S*, Y*) with the scales' and the output's element types.
template <typename F>
void dispatch_types(const torch::Tensor& scale, const torch::Tensor& y, F&& body) {
  const bool bf16_scale = scale.scalar_type() == at::kBFloat16, bf16_y = y.scalar_type() == at::kBFloat16;
  if (bf16_scale && bf16_y) body(scale.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  else if (bf16_scale) body(scale.data_ptr<at::BFloat16>(), y.data_ptr<float>());
  else if (bf16_y) body(scale.data_ptr<float>(), y.data_ptr<at::BFloat16>());
  else body(scale.data_ptr<float>(), y.data_ptr<float>());
}

}  // namespace
