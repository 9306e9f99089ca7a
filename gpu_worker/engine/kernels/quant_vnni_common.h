// What the int8-activation kernels share (quant_vnni_kernels.cpp, quant_vnni_gemm.cpp): x quantized to int8 per
// run of 32 inputs, each run with its own scale (max |x| / 127), as llama.cpp's q8_0 / q4_0 dot products take it;
// int4 nibbles put in input order; the checks of their arguments. Internal linkage: each source gets its own copy.
#pragma once
#include "torch_api.h"
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kChunk = 64;  // inputs per vpdpbusd

// Sixteen consecutive values as floats, lanes past `count` zero.
inline __m512 load16(const float* p, int64_t count) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << std::min<int64_t>(count, 16)) - 1), p);
}
inline __m512 load16(const at::BFloat16* p, int64_t count) {
  const __m256i bits = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << std::min<int64_t>(count, 16)) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// x [M, K] quantized per run of 32 inputs, K padded with zeros to whole chunks of 64.
struct QuantizedX {
  int64_t M, K, chunks;
  std::vector<int8_t> q;            // [M, chunks * 64]
  std::vector<float> scale;         // [M, chunks, 16]: lanes 0-7 the chunk's first run's scale, 8-15 the second's
  // [M, K / G]: the sums of quantized x over each weight group, for the offsets (int4's; int8's -128 * scale, for
  // its flipped sign bit). Quantized, not exact: the product is then the weight times quantized x; exact sums
  // left the error of sum(q * scale * x), a term larger than the result when offsets cancel it.
  std::vector<float> group_sum;
};

template <typename X>
QuantizedX quantize_x(const X* xp, int64_t M, int64_t K, int64_t G) {
  QuantizedX out;
  out.M = M, out.K = K, out.chunks = (K + kChunk - 1) / kChunk;
  const int64_t padded = out.chunks * kChunk, groups = K / G;
  out.q.assign(M * padded, 0);
  out.scale.assign(M * out.chunks * 16, 0.0f);
  out.group_sum.assign(M * groups, 0.0f);
  for (int64_t m = 0; m < M; m++) {
    const X* row = xp + m * K;
    for (int64_t b = 0; b < K / 32; b++) {
      const __m512 v0 = load16(row + 32 * b, 16), v1 = load16(row + 32 * b + 16, 16);
      const float peak = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float s = peak / 127.0f, inv = peak > 0.0f ? 127.0f / peak : 0.0f;
      const __m512 r = _mm512_set1_ps(inv);
      int8_t* q = out.q.data() + m * padded + 32 * b;
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, r)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, r));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(q1));
      std::fill_n(out.scale.data() + (m * out.chunks + b / 2) * 16 + (b % 2) * 8, 8, s);
      out.group_sum[m * groups + 32 * b / G] += s * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
    }
  }
  return out;
}

// x quantized, read as it is (bf16 or fp32): a conversion to fp32 first cost a torch op a call.
QuantizedX quantize_x(const at::Tensor& x, int64_t G) {
  const auto xc = x.contiguous();
  return xc.scalar_type() == at::kBFloat16
             ? quantize_x(xc.data_ptr<at::BFloat16>(), x.size(0), x.size(1), G)
             : quantize_x(xc.data_ptr<float>(), x.size(0), x.size(1), G);
}

// 32 packed int4 bytes (inputs 2j in the low nibble of byte j, 2j + 1 in the high one) as 64 bytes in input order:
// widened to 16 bits, byte j's nibbles become the 16-bit lane (lo | hi << 8), which is that order in memory.
inline __m512i int4_in_order(__m256i packed) {
  const __m512i b = _mm512_cvtepu8_epi16(packed);
  return _mm512_and_si512(_mm512_or_si512(b, _mm512_slli_epi16(b, 4)), _mm512_set1_epi16(0x0F0F));
}

inline void store16(float* y, __m512 v, int64_t count) {
  _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << count) - 1), v);
}
// Rounded to nearest even as torch rounds (products are finite: no NaN case), without AVX512-BF16, which not
// every VNNI CPU has (Cascade Lake, Ice Lake).
inline void store16(at::BFloat16* y, __m512 v, int64_t count) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
  _mm256_mask_storeu_epi16(y, static_cast<__mmask16>((1u << count) - 1), _mm512_cvtepi32_epi16(rounded));
}

// The VNNI loops take a chunk of 64 inputs within one group, or two groups of 32.
int64_t chunk_group(int64_t G) {
  TORCH_CHECK(G == 32 || G % 64 == 0, "the group size K / groups = ", G, " must be 32 or a multiple of 64");
  return G;
}

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(1) == K, "x must be [M, K] with M >= 1 and K = ", K,
              ", got ", x.sizes());
}

}  // namespace
