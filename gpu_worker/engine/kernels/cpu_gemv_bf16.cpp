// y[1, N] = x[1, K] @ w[N, K]^T in bf16 with fp32 accumulation (AVX512-BF16 dot products).
// Batch-1 decode is one such product per weight; it is memory-bound, and oneDNN's bf16 path reaches
// about 60% of this loop's bandwidth on it. Rows are split across OpenMP threads, four at a time so
// each thread keeps several weight streams in flight. K must be a multiple of 32.
#include <torch/extension.h>
#include <immintrin.h>
#include <cstring>

static inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(), "x must be [1, K] contiguous");
  TORCH_CHECK(w.is_contiguous() && w.size(1) == x.size(1) && w.size(1) % 32 == 0, "w must be [N, K], K % 32 == 0");
  const int64_t K = w.size(1), N = w.size(0);
  auto y = torch::empty({1, N}, x.options());
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = static_cast<const uint16_t*>(w.data_ptr());
  auto* yp = static_cast<uint16_t*>(y.data_ptr());
#pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < N; n0 += 4) {
    const int64_t rows = std::min<int64_t>(4, N - n0);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t k = 0; k < K; k += 32) {
      const __m512bh b = (__m512bh)_mm512_loadu_si512(xp + k);
      for (int64_t r = 0; r < rows; r++) {
        const __m512bh a = (__m512bh)_mm512_loadu_si512(wp + (n0 + r) * K + k);
        acc[r] = _mm512_dpbf16_ps(acc[r], a, b);
      }
    }
    for (int64_t r = 0; r < rows; r++) yp[n0 + r] = to_bf16(_mm512_reduce_add_ps(acc[r]));
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("gemv_bf16", &gemv_bf16); }
