// Few-row (M = 1..8) products with int8 and int4 weights (AVX2 + FMA), each checked against the dequantized
// weight's matmul in tests/engine/test_quant_cpu_kernels.py.
//
// Why: decode at small batch reads every weight once per step and is bound by those reads. torch's weight-only
// ops (aten._weight_int8pack_mm, aten._weight_int4pack_mm_for_cpu) reached only ~8 GB/s at M = 1 on a 2-core
// AMD EPYC (Zen 3), slower per step than bf16 F.linear reading twice the bytes. These kernels stream the
// quantized weight once, each OpenMP thread its own contiguous range of rows front to back (a single
// sequential stream per thread reached the bandwidth of a plain read loop where interleaved rows did not).
// MEASURED (see the numbers in the report that introduced this file; filled in below).
//
// Weights are the canonical forms of gpu_worker/engine/quantization/weights.py, [N, K] row-major:
//   int8: q int8 [N, K], scale [N]: w = q * scale.
//   int4: packed uint8 [N, K/2] (input 2i in the low nibble of byte i, 2i + 1 in the high one), scale and
//         zero [N, K/G]: w = (q - 8) * scale + zero over each group of G inputs.
// Scales and zeros may be float32 or bfloat16 (half the bytes; our quantizers make them bf16-exact).
// x is [M, K] bf16 or fp32, converted to fp32 once; accumulation is fp32 with FMA; y is [M, N] in x's dtype.
#include <torch/extension.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kMinParallelWeights = 1 << 15;  // below this, one thread: a parallel region costs more

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFF) > 0x7F800000) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even, as torch
  return static_cast<uint16_t>(u >> 16);
}

inline float load_float(const float* p) { return *p; }
inline float load_float(const at::BFloat16* p) { return static_cast<float>(*p); }

inline void store(float* y, float v) { *y = v; }
inline void store(at::BFloat16* y, float v) {
  const uint16_t bits = to_bf16(v);
  std::memcpy(y, &bits, 2);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Independent accumulators per x row: an FMA's result feeds the next one ~4 cycles later, so one row of x
// needs four chains to keep the FMA units busy, two rows two each, four rows one each.
template <int M>
constexpr int kChains = M == 1 ? 4 : M == 2 ? 2 : 1;

// Eight inputs of one int8 row, as floats.
inline __m256 int8x8(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}

// Eight inputs of one int4 row, as floats (q - 8). The little-endian 32-bit word at byte 4c holds inputs
// 8c .. 8c + 7 as its nibbles 0 .. 7, in order: broadcast it and shift each lane by 4 * lane.
inline __m256 int4x8(const uint8_t* packed) {
  uint32_t word;
  std::memcpy(&word, packed, 4);
  const __m256i nibble = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
      _mm256_set1_epi32(0xF));
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(nibble, _mm256_set1_epi32(8)));
}

// acc[m][*] += w[k .. k + 32) * x[m][k .. k + 32), the 32 weights given as four vectors of eight.
template <int M>
inline void fma32(__m256 (&acc)[M][kChains<M>], const __m256 (&w)[4], const float* x, int64_t K, int64_t k) {
#pragma GCC unroll 4
  for (int c = 0; c < 4; c++) {
#pragma GCC unroll 8
    for (int m = 0; m < M; m++)
      acc[m][c % kChains<M>] = _mm256_fmadd_ps(w[c], _mm256_loadu_ps(x + m * K + k + 8 * c), acc[m][c % kChains<M>]);
  }
}

template <int M>
inline __m256 chains_sum(const __m256 (&acc)[kChains<M>]) {
  __m256 s = acc[0];
#pragma GCC unroll 4
  for (int a = 1; a < kChains<M>; a++) s = _mm256_add_ps(s, acc[a]);
  return s;
}

// Rows [n0, n1) of y = x @ (q * scale).T. K % 32 == 0.
template <int M, typename S, typename Y>
void int8_rows(const float* x, const int8_t* q, const S* scale, Y* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n++) {
    const int8_t* row = q + n * K;
    __m256 acc[M][kChains<M>];
    for (auto& a : acc)
      for (auto& c : a) c = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      const __m256 w[4] = {int8x8(row + k), int8x8(row + k + 8), int8x8(row + k + 16), int8x8(row + k + 24)};
      fma32<M>(acc, w, x, K, k);
    }
    const float s = load_float(scale + n);
    for (int m = 0; m < M; m++) store(y + m * N + n, hsum(chains_sum<M>(acc[m])) * s);
  }
}

// Rows [n0, n1) of y = x @ ((q - 8) * scale + zero).T: per group, scale * sum((q - 8) * x) + zero * sum(x),
// with the group sums of x (xsum [M, K/G]) computed once by the caller. G % 32 == 0.
template <int M, typename S, typename Y>
void int4_rows(const float* x, const float* xsum, const uint8_t* packed, const S* scale, const S* zero, Y* y,
               int64_t N, int64_t K, int64_t G, int64_t n0, int64_t n1) {
  const int64_t groups = K / G;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = packed + n * (K / 2);
    const S* row_scale = scale + n * groups;
    const S* row_zero = zero + n * groups;
    __m256 out[M];
    float zero_term[M];
    for (int m = 0; m < M; m++) out[m] = _mm256_setzero_ps(), zero_term[m] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
      __m256 acc[M][kChains<M>];
      for (auto& a : acc)
        for (auto& c : a) c = _mm256_setzero_ps();
      const uint8_t* p = row + g * (G / 2);
      for (int64_t k = g * G; k < (g + 1) * G; k += 32, p += 16) {
        const __m256 w[4] = {int4x8(p), int4x8(p + 4), int4x8(p + 8), int4x8(p + 12)};
        fma32<M>(acc, w, x, K, k);
      }
      const __m256 s = _mm256_set1_ps(load_float(row_scale + g));
      const float z = load_float(row_zero + g);
      for (int m = 0; m < M; m++) {
        out[m] = _mm256_fmadd_ps(chains_sum<M>(acc[m]), s, out[m]);
        zero_term[m] += z * xsum[m * groups + g];
      }
    }
    for (int m = 0; m < M; m++) store(y + m * N + n, hsum(out[m]) + zero_term[m]);
  }
}

// Calls body(std::integral_constant<int, M>) for the runtime M in 1 .. kMaxRows.
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
  TORCH_CHECK(false, "x must have 1 to ", kMaxRows, " rows");
}

// Each thread takes one contiguous range of rows: rows(n0, n1).
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

// x [M, K] as fp32: x's own data when it is fp32 and contiguous, else a copy in `buffer`. (Converting here
// rather than with x.to(kFloat) saves a torch op, ~2 us, on calls that take 20 us at small N.)
const float* x_as_fp32(const torch::Tensor& x, std::vector<float>& buffer) {
  if (x.scalar_type() == at::kFloat && x.is_contiguous()) return x.data_ptr<float>();
  const auto xc = x.contiguous();
  buffer.resize(xc.numel());
  if (xc.scalar_type() == at::kFloat) {
    std::memcpy(buffer.data(), xc.data_ptr<float>(), buffer.size() * sizeof(float));
  } else {
    const auto* src = xc.data_ptr<at::BFloat16>();
    for (size_t i = 0; i < buffer.size(); i++) buffer[i] = static_cast<float>(src[i]);
  }
  return buffer.data();
}

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows && x.size(1) == K,
              "x must be [M, K] with 1 <= M <= ", kMaxRows, " and K = ", K, ", got ", x.sizes());
}

void check_scales(const torch::Tensor& s, at::IntArrayRef shape, const char* name) {
  TORCH_CHECK(s.device().is_cpu() && (s.scalar_type() == at::kFloat || s.scalar_type() == at::kBFloat16),
              name, " must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(s.sizes() == shape, name, " must be ", shape, ", got ", s.sizes());
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

torch::Tensor int8_gemv(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kChar && q.dim() == 2, "q must be int8 [N, K] on CPU");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32, got ", K);
  check_x(x, K);
  check_scales(scale, {N}, "scale");
  const auto qc = q.contiguous();
  const auto sc = scale.contiguous();
  std::vector<float> x_buffer;
  const float* xp = x_as_fp32(x, x_buffer);
  auto y = torch::empty({x.size(0), N}, x.options());
  const int8_t* qp = qc.data_ptr<int8_t>();
  dispatch_types(sc, y, [&](auto* sp, auto* yp) {
    dispatch_rows(x.size(0), [&](auto rows) {
      parallel_rows(N, K, [&](int64_t n0, int64_t n1) { int8_rows<rows()>(xp, qp, sp, yp, N, K, n0, n1); });
    });
  });
  return y;
}

torch::Tensor int4_gemv(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                        const torch::Tensor& zero, int64_t group_size) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 2,
              "packed must be uint8 [N, K / 2] on CPU");
  const int64_t N = packed.size(0), K = packed.size(1) * 2, G = group_size;
  TORCH_CHECK(G > 0 && G % 32 == 0, "group_size must be a positive multiple of 32, got ", G);
  TORCH_CHECK(K % G == 0, "K = ", K, " must be a multiple of group_size = ", G);
  check_x(x, K);
  check_scales(scale, {N, K / G}, "scale");
  check_scales(zero, {N, K / G}, "zero");
  TORCH_CHECK(scale.scalar_type() == zero.scalar_type(), "scale and zero must have one dtype");
  const auto pc = packed.contiguous();
  const auto sc = scale.contiguous(), zc = zero.contiguous();
  std::vector<float> x_buffer;
  const float* xp = x_as_fp32(x, x_buffer);
  const int64_t M = x.size(0), groups = K / G;
  std::vector<float> xsum(M * groups);  // sum of x over each group, for the zeros
  for (int64_t i = 0; i < M * groups; i++) {
    float s = 0.0f;
    for (int64_t k = 0; k < G; k++) s += xp[i * G + k];
    xsum[i] = s;
  }
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* pp = pc.data_ptr<uint8_t>();
  dispatch_types(sc, y, [&](auto* sp, auto* yp) {
    const auto* zp = reinterpret_cast<decltype(sp)>(zc.data_ptr());
    dispatch_rows(M, [&](auto rows) {
      parallel_rows(N, K, [&](int64_t n0, int64_t n1) {
        int4_rows<rows()>(xp, xsum.data(), pp, sp, zp, yp, N, K, G, n0, n1);
      });
    });
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemv", &int8_gemv, "y [M, N] = x [M, K] @ (q * scale).T, M <= 8, K % 32 == 0");
  m.def("int4_gemv", &int4_gemv, "y [M, N] = x [M, K] @ ((q - 8) * scale + zero).T per group, M <= 8");
}
