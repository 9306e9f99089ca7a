// What the quantized CPU kernels share (quant_cpu_kernels.cpp, quant_avx2_gemv.cpp, quant_vnni_kernels.cpp,
// quant_amx_kernels.cpp): reading scales and writing outputs in either dtype, a runtime row count or dtype handed
// to templates, weight rows split among threads, and runs of weights dequantized to bf16. Internal linkage: the
// modules are built for different instruction sets.
#pragma once
#include "torch_api.h"
#include <immintrin.h>
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

// The sum of eight floats (the AVX2 GEMVs' row totals).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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
void dispatch_types(const at::Tensor& scale, const at::Tensor& y, F&& body) {
  const bool bf16_scale = scale.scalar_type() == at::kBFloat16, bf16_y = y.scalar_type() == at::kBFloat16;
  if (bf16_scale && bf16_y) body(scale.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  else if (bf16_scale) body(scale.data_ptr<at::BFloat16>(), y.data_ptr<float>());
  else if (bf16_y) body(scale.data_ptr<float>(), y.data_ptr<at::BFloat16>());
  else body(scale.data_ptr<float>(), y.data_ptr<float>());
}

// Dequantization of one run of a weight row to bf16 (n % 32 == 0), where the CPU has AVX512-BF16 (Sapphire
// Rapids, Zen 4): the hardware rounds sixteen floats at a time (a file built without these flags calls them
// only after checking the CPU's).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
inline void int8_run_avx512(const int8_t* q, float scale, uint16_t* d, int64_t n) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t k = 0; k < n; k += 16) {
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + k), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(f, s))));
  }
}

// Sixteen bytes hold 32 inputs, input 2i in the low nibble of byte i: the low nibbles' bf16 values go to the low
// half of each 32-bit lane, the high nibbles' to the top half, which is the inputs' order in memory.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
inline void int4_run_avx512(const uint8_t* p, float scale, float offset, uint16_t* d, int64_t n) {
  const __m512 s = _mm512_set1_ps(scale), o = _mm512_set1_ps(offset);
  const __m512i mask = _mm512_set1_epi32(0xF);
  for (int64_t k = 0; k < n; k += 32) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k / 2)));
    const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, mask)), s, o);
    const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), s, o);
    const __m512i lo16 = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo)));
    const __m512i hi16 = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(hi)));
    _mm512_storeu_si512(d + k, _mm512_or_si512(lo16, _mm512_slli_epi32(hi16, 16)));
  }
}

// x of a few-row product: [M, K], 1 <= M <= kMaxRowsAtOnce, float32 or bf16.
inline void check_few_rows_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRowsAtOnce && x.size(1) == K,
              "x must be [M, K] with 1 <= M <= ", kMaxRowsAtOnce, " and K = ", K, ", got ", x.sizes());
}

inline void check_scales(const at::Tensor& s, at::IntArrayRef shape, const char* name) {
  TORCH_CHECK(s.device().is_cpu() && (s.scalar_type() == at::kFloat || s.scalar_type() == at::kBFloat16),
              name, " must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(s.sizes() == shape, name, " must be ", shape, ", got ", s.sizes());
}

// Calls body(S*) with the scales' element type and returns what it returns.
template <typename F>
auto dispatch_scale(const at::Tensor& scale, F&& body) {
  return scale.scalar_type() == at::kBFloat16 ? body(scale.data_ptr<at::BFloat16>()) : body(scale.data_ptr<float>());
}

// The group size that `scale` [N, groups] implies for K inputs.
inline int64_t group_of(const at::Tensor& scale, int64_t N, int64_t K, int64_t multiple) {
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.size(1) >= 1 && K % scale.size(1) == 0,
              "scale must be [N, groups] with N = ", N, " and groups dividing K = ", K, ", got ", scale.sizes());
  const int64_t G = K / scale.size(1);
  TORCH_CHECK(G % multiple == 0, "the group size K / groups = ", G, " must be a multiple of ", multiple);
  return G;
}

// An int8 weight's arguments, checked: q [N, K] with groups of G (a multiple of 32), scale [N, K / G].
struct Int8Weight {
  const int8_t* q;
  int64_t N, K, G;
  at::Tensor scale;
};

inline Int8Weight int8_weight(const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(),
              "q must be a contiguous int8 [N, K] CPU tensor");
  check_scales(scale, scale.sizes(), "scale");
  const int64_t N = q.size(0), K = q.size(1);
  return {q.data_ptr<int8_t>(), N, K, group_of(scale, N, K, 32), scale.contiguous()};
}

// An int4 weight's arguments, checked: the packed nibbles, [N, K] with groups of G, scale and offset [N, K / G].
struct Int4Weight {
  const uint8_t* packed;
  int64_t N, K, G;
  at::Tensor scale, offset;
};

inline Int4Weight int4_weight(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& offset) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 2 &&
                  packed.is_contiguous(), "packed must be a contiguous uint8 [N, K / 2] CPU tensor");
  check_scales(scale, scale.sizes(), "scale");
  check_scales(offset, scale.sizes(), "offset");
  TORCH_CHECK(scale.scalar_type() == offset.scalar_type(), "scale and offset must have one dtype");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  return {packed.data_ptr<uint8_t>(), N, K, group_of(scale, N, K, 32), scale.contiguous(), offset.contiguous()};
}

}  // namespace
