// Products with int8 and int4 weights (AVX2 + FMA), each checked against the dequantized weight's matmul in
// tests/gpu_worker/engine/test_quant_cpu_kernels.py. Two regimes, as a step's row count decides:
// - Few rows (M = 1..8, decode): bound by reading the weights. The int8 GEMV (and the bf16 one for CPUs without
//   native bf16) streams the weight once for all rows, each OpenMP thread its own contiguous range of rows front
//   to back (a single sequential stream per thread reached the bandwidth of a plain read loop where interleaved
//   rows did not); int4's, with int8 activations, is in quant_avx2_gemv.cpp. torch's weight-only ops
//   (aten._weight_int8pack_mm, aten._weight_int4pack_mm_for_cpu) read the weight so slowly at M = 1 that a step
//   took longer than bf16 F.linear reading twice the bytes.
// - Many rows (prefill chunks, large batches): bound by arithmetic. The weight is dequantized tile by tile into a
//   buffer that stays in cache (bf16 where the CPU multiplies bf16 natively, float32 elsewhere) and multiplied
//   by oneDNN's matmul, so the dequantization is paid once for all rows (the weight-only ops redo it per row, and
//   run several times slower than bf16). `tokenfleet bench quant` measures both regimes.
//
// Weights are the canonical forms of gpu_worker/engine/quantization/weights.py, [N, K] row-major:
//   int8: q int8 [N, K], scale [N, K/G]: w = q * scale over each group of G inputs (G = K: one per channel).
//   int4: packed uint8 [N, K/2] (input 2i in the low nibble of byte i, 2i + 1 in the high one), scale and
//         offset [N, K/G]: w = q * scale + offset over each group of G inputs.
// Scales and offsets may be float32 or bfloat16 (half the bytes; our quantizers make them bf16-exact).
// x is [M, K] bf16 or fp32, converted to fp32 once; accumulation is fp32 with FMA; y is [M, N] in x's dtype.
#include "torch_api.h"
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "quant_common.h"

namespace {

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// bf16 rounded to nearest even, for dequantized weights, which are finite (no NaN case: branch-free, so the
// dequantization loops vectorize).
inline uint16_t to_bf16_finite(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// Independent accumulator chains per x row. Each 32 weights give every row four FMAs, and an FMA's result
// feeds the next one ~4 cycles later: one chain per row would stall on that latency (it made M = 4 run at
// half the speed of M = 1); with 4, 2, 1 chains for M <= 2, <= 4, <= 8 the FMA units stay busy and the
// accumulators fit in the 16 registers.
template <int M>
constexpr int kChains = M <= 2 ? 4 : M <= 4 ? 2 : 1;

// Eight inputs of one int8 row, as floats.
inline __m256 int8x8(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}

// Eight inputs of one bf16 row, as floats.
inline __m256 load8(const uint16_t* w) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline __m256 load8(const int8_t* q) { return int8x8(q); }

// The scale of a dense bf16 weight: one, read as the int8 rows read their group scales.
struct UnitScale {
  UnitScale operator+(int64_t) const { return {}; }
};
inline float load_float(UnitScale) { return 1.0f; }

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

// Rows [n0, n1) of y = x @ (q * scale).T, a scale per group of G inputs (G = K: one per row), q int8 or bf16
// (with a UnitScale). G % 32 == 0.
template <int M, typename Q, typename S, typename Y>
void int8_rows(const float* x, const Q* q, S scale, Y* y, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t n1) {
  const int64_t groups = K / G;
  for (int64_t n = n0; n < n1; n++) {
    const Q* row = q + n * K;
    __m256 out[M];
    for (auto& o : out) o = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
      __m256 acc[M][kChains<M>];
      for (auto& a : acc)
        for (auto& c : a) c = _mm256_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
        const __m256 w[4] = {load8(row + k), load8(row + k + 8), load8(row + k + 16), load8(row + k + 24)};
        fma32<M>(acc, w, x, K, k);
      }
      const __m256 s = _mm256_set1_ps(load_float(scale + n * groups + g));
      for (int m = 0; m < M; m++) out[m] = _mm256_fmadd_ps(chains_sum<M>(acc[m]), s, out[m]);
    }
    for (int m = 0; m < M; m++) store(y + m * N + n, hsum(out[m]));
  }
}

// x [M, K] as fp32: x's own data when it is fp32 and contiguous, else a copy in `buffer`. (Converting here
// rather than with x.to(kFloat) saves a torch op, a noticeable share of a call at small N.)
const float* x_as_fp32(const at::Tensor& x, std::vector<float>& buffer) {
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

// Plain loops for CPUs without AVX512-BF16 (quant_common.h has the fast ones); the compiler vectorized them
// poorly (slower than the matmul they feed). Chosen once at start-up.
void int8_run_plain(const int8_t* q, float scale, uint16_t* d, int64_t n) {
  for (int64_t k = 0; k < n; k++) d[k] = to_bf16_finite(static_cast<float>(q[k]) * scale);
}

void int4_run_plain(const uint8_t* p, float scale, float offset, uint16_t* d, int64_t n) {
  for (int64_t i = 0; i < n / 2; i++) {
    d[2 * i] = to_bf16_finite(static_cast<float>(p[i] & 0xF) * scale + offset);
    d[2 * i + 1] = to_bf16_finite(static_cast<float>(p[i] >> 4) * scale + offset);
  }
}

// The same runs into float32 tiles (no rounding: these loops vectorize as written).
void int8_run(const int8_t* q, float scale, float* d, int64_t n) {
  for (int64_t k = 0; k < n; k++) d[k] = static_cast<float>(q[k]) * scale;
}

void int4_run(const uint8_t* p, float scale, float offset, float* d, int64_t n) {
  for (int64_t i = 0; i < n / 2; i++) {
    d[2 * i] = static_cast<float>(p[i] & 0xF) * scale + offset;
    d[2 * i + 1] = static_cast<float>(p[i] >> 4) * scale + offset;
  }
}

const bool kHasAvx512Bf16 = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
void (*const int8_run_bf16)(const int8_t*, float, uint16_t*, int64_t) =
    kHasAvx512Bf16 ? int8_run_avx512 : int8_run_plain;
void (*const int4_run_bf16)(const uint8_t*, float, float, uint16_t*, int64_t) =
    kHasAvx512Bf16 ? int4_run_avx512 : int4_run_plain;
void int8_run(const int8_t* q, float scale, uint16_t* d, int64_t n) { int8_run_bf16(q, scale, d, n); }
void int4_run(const uint8_t* p, float scale, float offset, uint16_t* d, int64_t n) {
  int4_run_bf16(p, scale, offset, d, n);
}

// Rows [n0, n1) of the dequantized weight, as bf16 or float32 (T), into out [n1 - n0, K].
template <typename S, typename T>
void int8_dequant_rows(const int8_t* q, const S* scale, T* out, int64_t K, int64_t G, int64_t n0, int64_t n1) {
  const int64_t groups = K / G;
  for (int64_t n = n0; n < n1; n++)
    for (int64_t g = 0; g < groups; g++)
      int8_run(q + n * K + g * G, load_float(scale + n * groups + g), out + (n - n0) * K + g * G, G);
}

template <typename S, typename T>
void int4_dequant_rows(const uint8_t* packed, const S* scale, const S* offset, T* out, int64_t K, int64_t G,
                       int64_t n0, int64_t n1) {
  const int64_t groups = K / G;
  for (int64_t n = n0; n < n1; n++)
    for (int64_t g = 0; g < groups; g++)
      int4_run(packed + n * (K / 2) + g * (G / 2), load_float(scale + n * groups + g),
               load_float(offset + n * groups + g), out + (n - n0) * K + g * G, G);
}

// y = x @ W.T for many rows of x (prefill chunks, large decode batches), W dequantized a tile of rows at a time
// into a buffer and multiplied by oneDNN's matmul: the dequantization is paid once per call for all rows, where
// the weight-only ops redo it per row. The tiles are bf16 where the CPU multiplies bf16 natively (AMX /
// AVX512-BF16) and float32 elsewhere: on a plain AVX2 CPU oneDNN's bf16 matmul runs several times slower than its
// float32 one. Tiles of up to kTileWeights hold a small model's whole matrix, so most calls are one dequantization
// and one x @ W.T straight into y (larger models' tiles write into y's columns in place); at many rows this runs
// as fast as bf16's prepacked matmul, where smaller tiles' W @ x.T and the transpose of y it needed cost more than
// the matmul itself (`tokenfleet bench quant`). The buffer is the calling thread's, kept between calls.
// `dequant(buffer, n0, n1)` writes rows [n0, n1) of W as T.
constexpr int64_t kTileWeights = int64_t{4} << 20;
template <typename T, typename F>
at::Tensor tiled_dequant_mm(const at::Tensor& x, int64_t N, int64_t K, F&& dequant) {
  const int64_t M = x.size(0);
  const int64_t tile = std::min<int64_t>(N, std::max<int64_t>(16, kTileWeights / K / 16 * 16));
  thread_local std::vector<T> storage;
  storage.resize(std::max<size_t>(storage.size(), tile * K));
  const auto xt = x.to(std::is_same_v<T, float> ? at::kFloat : at::kBFloat16).contiguous();
  auto buffer = at::from_blob(storage.data(), {tile, K}, xt.options());
  auto* bp = storage.data();
  at::Tensor y = N == tile ? at::Tensor() : at::empty({M, N}, xt.options());
  for (int64_t n0 = 0; n0 < N; n0 += tile) {
    const int64_t rows = std::min(tile, N - n0);
#pragma omp parallel
    {
#ifdef _OPENMP
      const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
#else
      const int64_t threads = 1, t = 0;
#endif
      const int64_t a = n0 + rows * t / threads, b = n0 + rows * (t + 1) / threads;
      dequant(bp + (a - n0) * K, a, b);
    }
    if (N == tile) {
      y = at::mm(xt, buffer.t());
    } else {
      auto out = y.narrow(1, n0, rows);
      at::mm_out(out, xt, buffer.narrow(0, 0, rows).t());
    }
  }
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

// Calls body(T*) with a null pointer of the tiles' element type on this CPU, returning what it returns.
template <typename F>
auto dispatch_tile_type(F&& body) {
  return kHasAvx512Bf16 ? body(static_cast<uint16_t*>(nullptr)) : body(static_cast<float*>(nullptr));
}

}  // namespace

// y [M, N] = x [M, K] @ (q * scale).T for M <= 8 (decode): scale [N, groups], one group of K per channel.
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  const Int8Weight w = int8_weight(q, scale);
  const int8_t* qp = w.q;
  const int64_t N = w.N, K = w.K, G = w.G;
  check_few_rows_x(x, K);
  const auto& sc = w.scale;
  std::vector<float> x_buffer;
  const float* xp = x_as_fp32(x, x_buffer);
  auto y = at::empty({x.size(0), N}, x.options());
  dispatch_types(sc, y, [&](auto* sp, auto* yp) {
    dispatch_rows(x.size(0), [&](auto rows) {
      parallel_rows(N, K, [&](int64_t n0, int64_t n1) { int8_rows<rows()>(xp, qp, sp, yp, N, K, G, n0, n1); });
    });
  });
  return y;
}

// The same products for any M (prefill chunks, large batches), through dequantized tiles.
at::Tensor int8_dequant_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  const Int8Weight w = int8_weight(q, scale);
  const int8_t* qp = w.q;
  const int64_t N = w.N, K = w.K, G = w.G;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "], got ", x.sizes());
  return dispatch_scale(w.scale, [&](auto* sp) {
    return dispatch_tile_type([&](auto* tile) {
      using T = std::remove_pointer_t<decltype(tile)>;
      return tiled_dequant_mm<T>(x, N, K, [&](T* out, int64_t a, int64_t b) {
        int8_dequant_rows(qp, sp, out, K, G, a, b);
      });
    });
  });
}

at::Tensor int4_dequant_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                              const at::Tensor& offset) {
  const Int4Weight w = int4_weight(packed, scale, offset);
  const uint8_t* pp = w.packed;
  const int64_t N = w.N, K = w.K, G = w.G;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "], got ", x.sizes());
  return dispatch_scale(w.scale, [&](auto* sp) {
    const auto* op = reinterpret_cast<decltype(sp)>(w.offset.data_ptr());
    return dispatch_tile_type([&](auto* tile) {
      using T = std::remove_pointer_t<decltype(tile)>;
      return tiled_dequant_mm<T>(x, N, K, [&](T* out, int64_t a, int64_t b) {
        int4_dequant_rows(pp, sp, op, out, K, G, a, b);
      });
    });
  });
}

// y [M, N] = x [M, K] @ w.T for a bf16 weight [N, K] on CPUs without native bf16 products, where torch's bf16
// linear is slow at any row count (`python -m bench.lab.avx2_path`): the GEMV for M <= 8, float32 tiles beyond.
at::Tensor bf16_mm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous() &&
                  w.size(1) % 32 == 0, "w must be a contiguous bfloat16 [N, K] CPU tensor, K % 32 == 0");
  const int64_t N = w.size(0), K = w.size(1);
  const auto* wp = static_cast<const uint16_t*>(w.data_ptr());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "], got ", x.sizes());
  if (x.size(0) > kMaxRowsAtOnce) {
    return tiled_dequant_mm<float>(x, N, K, [&](float* out, int64_t a, int64_t b) {
      for (int64_t i = a * K; i < b * K; i++) out[i - a * K] = bf16_to_float(wp[i]);
    });
  }
  check_few_rows_x(x, K);
  std::vector<float> x_buffer;
  const float* xp = x_as_fp32(x, x_buffer);
  auto y = at::empty({x.size(0), N}, x.options());
  const auto gemv = [&](auto* yp) {
    dispatch_rows(x.size(0), [&](auto rows) {
      parallel_rows(N, K, [&](int64_t n0, int64_t n1) { int8_rows<rows()>(xp, wp, UnitScale(), yp, N, K, K, n0, n1); });
    });
  };
  if (y.scalar_type() == at::kBFloat16) gemv(y.data_ptr<at::BFloat16>());
  else gemv(y.data_ptr<float>());
  return y;
}

// "bfloat16" or "float32": the tiles' element type on this CPU (the precision of the weights the many-row
// products multiply).
std::string tile_dtype() { return kHasAvx512Bf16 ? "bfloat16" : "float32"; }

// Each row of x [M, K] as int8 with its own scale, max |x| / 127 (symmetric, per token): the activations of an
// int8 x int8 matmul. Returns (q int8 [M, K], scale float32 [M, 1]); x = q * scale within half a step.
std::vector<at::Tensor> quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bfloat16 [M, K] CPU tensor");
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<float> buffer;
  const float* xp = x_as_fp32(x, buffer);
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto scale = at::empty({M, 1}, x.options().dtype(at::kFloat));
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
#pragma omp parallel for if (M * K >= kMinParallelWeights)
  for (int64_t m = 0; m < M; m++) {
    const float* row = xp + m * K;
    float peak = 0.0f;
    for (int64_t k = 0; k < K; k++) peak = std::max(peak, std::abs(row[k]));
    const float s = peak > 0.0f ? peak / 127.0f : 1.0f, inv = 1.0f / s;
    for (int64_t k = 0; k < K; k++) qp[m * K + k] = static_cast<int8_t>(std::nearbyint(row[k] * inv));
    sp[m] = s;
  }
  return {q, scale};
}

// quant_avx2_gemv.cpp
at::Tensor int4_gemv_a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                           const at::Tensor& offset);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemv", &int8_gemv, "y [M, N] = x [M, K] @ (q * scale).T per group, M <= 8, K % 32 == 0");
  m.def("int4_gemv_a8", &int4_gemv_a8, "y [M, N] = x [M, K] @ (q * scale + offset).T per group, M <= 8, x quantized to int8 per run of 32");
  m.def("int8_dequant_mm", &int8_dequant_mm, "int8_gemv for any M, through dequantized tiles");
  m.def("int4_dequant_mm", &int4_dequant_mm, "y [M, N] = x [M, K] @ (q * scale + offset).T for any M, through dequantized tiles");
  m.def("bf16_mm", &bf16_mm, "y [M, N] = x [M, K] @ w.T, w bf16, for CPUs without native bf16 products");
  m.def("tile_dtype", &tile_dtype, "the element type of the many-row products' dequantized tiles here");
  m.def("quantize_rows", &quantize_rows, "(q int8 [M, K], scale [M, 1]): each row of x symmetric per token");
}
