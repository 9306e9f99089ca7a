// A few-row product with int4 weights and int8 activations for CPUs with AVX2 but no VNNI (Zen 1-3, Intel client
// cores), part of the quant_cpu_kernels module. x is quantized to int8 per run of 32 inputs, each run with its own
// scale (max |x| / 127), as llama.cpp's q4_0 dot product and our VNNI GEMVs take it.
//
// Why: the fp32 int4 GEMV of quant_cpu_kernels.cpp unpacks, widens and converts every nibble and runs
// compute-bound, well below the rate the int8 GEMV streams its weights at. vpmaddubsw multiplies 32 unsigned bytes
// (the nibbles, 0 .. 15) by 32 signed ones and adds adjacent pairs into 16 bits (at most 2 * 15 * 127: no
// saturation); vpmaddwd against ones widens those to eight 32-bit sums: faster than the fp32 GEMV (`tokenfleet bench
// quant` on an AVX2 host). (int8 weights stay on the fp32 GEMV: with |q| and q's sign moved onto x, llama.cpp's
// trick, it ran no faster.)
//
// The weight is the canonical int4 form of gpu_worker/engine/quantization/weights.py: packed uint8 [N, K/2]
// (input 2i in the low nibble of byte i, 2i + 1 in the high one), scale and offset [N, K/G]: w = q * scale +
// offset over each group of G inputs, G % 32 == 0. Scales may be float32 or bfloat16. y is [M, N] in x's dtype
// (bf16 or fp32), M <= kMaxRowsAtOnce.
#include "torch_api.h"
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <vector>

#include "quant_common.h"

namespace {

constexpr int64_t kRun = 32;  // inputs per activation scale, and per vpmaddubsw

// x [M, K] quantized per run of 32, each run's inputs stored evens first, then odds: the order in which one
// 16-byte load of int4 nibbles comes apart (low nibbles, then high).
struct RunQuantizedX {
  int64_t M, K, runs;
  std::vector<int8_t> q;          // [M, K]
  std::vector<float> scale;       // [M, runs]
  // [M, K / G]: the sums of quantized x over each weight group, for int4's offsets. Quantized, not exact, as in
  // the VNNI kernels: the product is then the weight times quantized x, where exact sums leave an error term
  // larger than the result when the offsets cancel it.
  std::vector<float> group_sum;
};

template <typename X>
RunQuantizedX quantize_runs(const X* xp, int64_t M, int64_t K, int64_t G) {
  RunQuantizedX out{M, K, K / kRun, std::vector<int8_t>(M * K), std::vector<float>(M * (K / kRun)),
                    std::vector<float>(M * (K / G), 0.0f)};
  for (int64_t m = 0; m < M; m++) {
    for (int64_t b = 0; b < out.runs; b++) {
      const X* run = xp + m * K + b * kRun;
      float peak = 0.0f;
      for (int64_t i = 0; i < kRun; i++) peak = std::max(peak, std::abs(static_cast<float>(run[i])));
      const float s = peak / 127.0f, inv = peak > 0.0f ? 127.0f / peak : 0.0f;
      int8_t* q = out.q.data() + m * K + b * kRun;
      int sum = 0;
      for (int64_t i = 0; i < kRun; i++) {
        const int v = static_cast<int>(std::nearbyint(static_cast<float>(run[i]) * inv));  // to nearest even
        q[(i % 2) * (kRun / 2) + i / 2] = static_cast<int8_t>(v);
        sum += v;
      }
      out.scale[m * out.runs + b] = s;
      out.group_sum[m * (K / G) + b * kRun / G] += s * static_cast<float>(sum);
    }
  }
  return out;
}

RunQuantizedX quantize_runs(const at::Tensor& x, int64_t G) {
  const auto xc = x.contiguous();
  return xc.scalar_type() == at::kBFloat16
             ? quantize_runs(xc.data_ptr<at::BFloat16>(), x.size(0), x.size(1), G)
             : quantize_runs(xc.data_ptr<float>(), x.size(0), x.size(1), G);
}

// A weight row's run of 32 and its dot product with a quantized x run, as eight 32-bit partial sums.
struct Int4Rows {
  const uint8_t* packed;
  int64_t K;
  __m256i load(int64_t n, int64_t run) const {  // low nibbles (even inputs), then high ones (odd inputs)
    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + n * (K / 2) + run * (kRun / 2)));
    const __m128i low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(p, 4), low), _mm_and_si128(p, low));
  }
  static __m256i dot(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
  }
};

// Independent accumulator chains per x row: one chain per row stalls on the FMA's latency at M = 1.
template <int M>
constexpr int kChainsA8 = M <= 2 ? 2 : 1;

// Rows [n0, n1) of y = x @ W.T, one weight row at a time, front to back.
template <int M, typename S, typename Y>
void a8_rows(const RunQuantizedX& x, const Int4Rows& rows, const S* scale, const S* offset, Y* y, int64_t N, int64_t G,
             int64_t n0, int64_t n1) {
  constexpr int C = kChainsA8<M>;
  const int64_t K = x.K, groups = K / G, runs_per_group = G / kRun;
  for (int64_t n = n0; n < n1; n++) {
    __m256 out[M];
    float offset_term[M];
    for (int m = 0; m < M; m++) out[m] = _mm256_setzero_ps(), offset_term[m] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
      __m256 acc[M][C];
      for (auto& a : acc)
        for (auto& c : a) c = _mm256_setzero_ps();
      for (int64_t r = 0; r < runs_per_group; r++) {
        const int64_t run = g * runs_per_group + r;
        const __m256i w = rows.load(n, run);
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) {
          const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + m * K + run * kRun));
          const __m256 xs = _mm256_broadcast_ss(x.scale.data() + m * x.runs + run);
          acc[m][r % C] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Int4Rows::dot(w, xq)), xs, acc[m][r % C]);
        }
      }
      const __m256 s = _mm256_set1_ps(load_float(scale + n * groups + g));
      for (int m = 0; m < M; m++) {
        __m256 sum = acc[m][0];
        for (int c = 1; c < C; c++) sum = _mm256_add_ps(sum, acc[m][c]);
        out[m] = _mm256_fmadd_ps(sum, s, out[m]);
        offset_term[m] += load_float(offset + n * groups + g) * x.group_sum[m * groups + g];
      }
    }
    for (int m = 0; m < M; m++) store(y + m * N + n, hsum(out[m]) + offset_term[m]);
  }
}

template <typename S>
at::Tensor gemv_a8(const at::Tensor& x, const Int4Rows& rows, const S* scale, const S* offset, int64_t N,
                      int64_t G) {
  check_few_rows_x(x, rows.K);
  const RunQuantizedX xq = quantize_runs(x, G);
  auto y = at::empty({x.size(0), N}, x.options());
  const auto run = [&](auto* yp) {
    dispatch_rows(x.size(0), [&](auto m) {
      parallel_rows(N, rows.K, [&](int64_t n0, int64_t n1) { a8_rows<m()>(xq, rows, scale, offset, yp, N, G, n0, n1); });
    });
  };
  if (y.scalar_type() == at::kBFloat16) run(y.data_ptr<at::BFloat16>());
  else run(y.data_ptr<float>());
  return y;
}

}  // namespace

// y [M, N] = x [M, K] @ (q * scale + offset).T, q the nibbles of packed, x quantized per run of 32 (M <= 8).
at::Tensor int4_gemv_a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                           const at::Tensor& offset) {
  const Int4Weight w = int4_weight(packed, scale, offset);
  return dispatch_scale(w.scale, [&](auto* sp) {
    const auto* op = reinterpret_cast<decltype(sp)>(w.offset.data_ptr());
    return gemv_a8(x, Int4Rows{w.packed, w.K}, sp, op, w.N, w.G);
  });
}
