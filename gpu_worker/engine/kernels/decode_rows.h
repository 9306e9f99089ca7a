// A paged cache's token-head rows as the AVX-512 decode attention reads them (cpu_attention_kernels.cpp's
// paged_decode; cpu_avx2_kernels.cpp has its own for AVX2), bf16 or int8 with a scale per row: each format's products
// of a query group with a key row, and its sums of value rows weighted by the group's probabilities.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"

namespace decode_rows {

// Tokens ahead to prefetch: each token's key (or value) row lies in a scattered block, where the
// hardware prefetcher loses the stream; prefetching both 64-byte lines of a row halved the kernel's time.
constexpr int64_t kPrefetchAhead = 16;

// A cache's token-head rows as attention reads them (row r: [D] values at r * D). `dots` are a head group's
// products with a key row, each a vector still to be summed, times `key_scale`; `attend_values` sums the value rows
// weighted by the group's probabilities.
struct Bf16Rows {
  static constexpr int64_t kBytes = 2;
  const uint16_t* k;
  const uint16_t* v;
  int64_t D;

  // out[16 g] = the G query heads' (q: [G][D]) products with key row r, the row loaded once for all of them:
  // loaded once per head, in a loop over a runtime D, the score pass had read each key row G times, slower in cache
  // and from DRAM (`python -m bench.lab.decode_parts`).
  void dots(const uint16_t* q, const float*, int64_t r, int64_t G, __m512* out) const {
    const uint16_t* key = k + r * D;
    switch (D) {
      case 64: dots_of<2>(q, key, G, out); break;
      case 128: dots_of<4>(q, key, G, out); break;
      default:
        for (int64_t g = 0; g < G; g++) {
          __m512 acc = _mm512_setzero_ps();
          for (int64_t d = 0; d < D; d += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + g * D + d), (__m512bh)_mm512_loadu_si512(key + d));
          out[16 * g] = acc;
        }
    }
  }
  // The same with the row's kChunks vectors of 32 dims held in registers across the heads.
  template <int kChunks>
  static void dots_of(const uint16_t* q, const uint16_t* key, int64_t G, __m512* out) {
    __m512bh row[kChunks];
    for (int c = 0; c < kChunks; c++) row[c] = (__m512bh)_mm512_loadu_si512(key + 32 * c);
    for (int64_t g = 0; g < G; g++) {
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < kChunks; c++)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + (g * kChunks + c) * 32), row[c]);
      out[16 * g] = acc;
    }
  }
  float key_scale(int64_t) const { return 1.0f; }

  // acc[g * D + d] = sum over t < L of p[g][t] * v[row t][d] for G heads' probabilities p (fp32, rows of L): two
  // tokens per dpbf16, each pair of value rows interleaved (unpack) against a pair of probabilities rounded to bf16,
  // as torch's CPU flash attention rounds them for its product with V: half the instructions of converting and
  // multiplying each value in fp32. Heads go up to four at a time, their count a template argument, so that the
  // accumulators stay in registers: indexed by a runtime head count they lived on the stack, a load and a store
  // around every dpbf16 (`python -m bench.lab.decode_parts`).
  void attend_values(const float* p, int64_t L, int64_t G, const int64_t* token_rows, float* acc,
                     std::vector<uint16_t>& pairs) const {
    const int64_t L2 = (L + 1) & ~int64_t{1};  // an odd count's last token pairs with a zero probability
    pairs.assign(G * L2, 0);
    for (int64_t g = 0; g < G; g++) {
      int64_t t = 0;
      for (; t + 16 <= L; t += 16)  // round to nearest even, as to_bf16
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs.data() + g * L2 + t),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + g * L + t)));
      for (; t < L; t++) pairs[g * L2 + t] = to_bf16(p[g * L + t]);
    }
    std::fill(acc, acc + G * D, 0.0f);
    accumulate_values(pairs.data(), L2, 0, L, L, G, token_rows, acc);
    for (int64_t g = 0; g < G; g++) unpermute_columns(acc + g * D);
  }

  // acc (G rows of D, each 32 columns in accumulate_columns' lane order) += the value rows of tokens [begin, end)
  // weighted by the heads' bf16 probabilities, pairs[g * stride + t - begin] for token t.
  void accumulate_values(const uint16_t* pairs, int64_t stride, int64_t begin, int64_t end, int64_t L, int64_t G,
                         const int64_t* token_rows, float* acc) const {
    for (int64_t g0 = 0; g0 < G; g0 += 4)
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int64_t heads = std::min<int64_t>(4, G - g0);
        if (D - d0 >= 64)
          accumulate_heads<2>(pairs + g0 * stride, stride, begin, end, L, token_rows, d0, acc + g0 * D, heads);
        else
          accumulate_heads<1>(pairs + g0 * stride, stride, begin, end, L, token_rows, d0, acc + g0 * D, heads);
      }
  }

  // One head's D sums from accumulate_values' lane order to column order: lane 4k + i of each 32 columns' low pairs
  // is column 8k + i of its 32, of the high pairs column 8k + 4 + i.
  void unpermute_columns(float* row) const {
    for (int64_t c = 0; c < D; c += 32) {
      alignas(64) float low[16], high[16];
      std::memcpy(low, row + c, sizeof low);
      std::memcpy(high, row + c + 16, sizeof high);
      for (int64_t k = 0; k < 4; k++)
        for (int64_t i = 0; i < 4; i++) {
          row[c + 8 * k + i] = low[4 * k + i];
          row[c + 8 * k + 4 + i] = high[4 * k + i];
        }
    }
  }

  // A head count known at compile time: padding three heads (GQA 12/4) to four cost a quarter more products.
  template <int kHalves>
  void accumulate_heads(const uint16_t* pairs, int64_t stride, int64_t begin, int64_t end, int64_t L,
                        const int64_t* token_rows, int64_t d0, float* acc, int64_t heads) const {
    switch (heads) {
      case 1: accumulate_columns<kHalves, 1>(pairs, stride, begin, end, L, token_rows, d0, acc); break;
      case 2: accumulate_columns<kHalves, 2>(pairs, stride, begin, end, L, token_rows, d0, acc); break;
      case 3: accumulate_columns<kHalves, 3>(pairs, stride, begin, end, L, token_rows, d0, acc); break;
      default: accumulate_columns<kHalves, 4>(pairs, stride, begin, end, L, token_rows, d0, acc); break;
    }
  }

  // kHeads heads' sums over columns [d0, d0 + 32 kHalves), in registers over the tokens: each 32 columns as the
  // products of interleaved pairs leave them, the low pairs' 16 lanes then the high pairs'.
  template <int kHalves, int kHeads>
  void accumulate_columns(const uint16_t* pairs, int64_t stride, int64_t begin, int64_t end, int64_t L,
                          const int64_t* token_rows, int64_t d0, float* acc) const {
    __m512 a[kHeads][2 * kHalves];
    for (int g = 0; g < kHeads; g++)
      for (int c = 0; c < 2 * kHalves; c++) a[g][c] = _mm512_loadu_ps(acc + g * D + d0 + 16 * c);
    for (int64_t t = begin; t < end; t += 2) {
      const int64_t r0 = token_rows[t], r1 = t + 1 < end ? token_rows[t + 1] : r0;
      if (t + kPrefetchAhead + 1 < L) {
        prefetch(v + token_rows[t + kPrefetchAhead] * D + d0, 64 * kHalves);
        prefetch(v + token_rows[t + kPrefetchAhead + 1] * D + d0, 64 * kHalves);
      }
      __m512bh lo[kHalves], hi[kHalves];
      for (int h = 0; h < kHalves; h++) {
        const __m512i x0 = _mm512_loadu_si512(v + r0 * D + d0 + 32 * h);
        const __m512i x1 = _mm512_loadu_si512(v + r1 * D + d0 + 32 * h);
        lo[h] = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
        hi[h] = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
      }
      for (int g = 0; g < kHeads; g++) {
        uint32_t pair;
        std::memcpy(&pair, pairs + g * stride + t - begin, 4);
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int h = 0; h < kHalves; h++) {
          a[g][2 * h] = _mm512_dpbf16_ps(a[g][2 * h], lo[h], pp);
          a[g][2 * h + 1] = _mm512_dpbf16_ps(a[g][2 * h + 1], hi[h], pp);
        }
      }
    }
    for (int g = 0; g < kHeads; g++)
      for (int c = 0; c < 2 * kHalves; c++) _mm512_storeu_ps(acc + g * D + d0 + 16 * c, a[g][c]);
  }
};

// int8 rows dequantized in registers (the query in fp32 times the int8 key, then the row's scale), so the
// context is read at one byte a value and never copied: the torch reference gathers and dequantizes it first.
struct Int8Rows {
  static constexpr int64_t kBytes = 1;
  const int8_t* k;
  const int8_t* v;
  const uint16_t* k_scale;
  const uint16_t* v_scale;
  int64_t D;
  static __m512 int8x16(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // The key row converted once for all G heads, in registers for the head dims models have; the products and
  // their order as before. Converted once per head, it had made the kernel compute-bound, from DRAM and in cache
  // (`python -m bench.lab.decode_parts`), the output unchanged.
  void dots(const uint16_t*, const float* q, int64_t r, int64_t G, __m512* out) const {
    switch (D) {
      case 64: dots_of<4>(q, k + r * D, G, out); break;
      case 128: dots_of<8>(q, k + r * D, G, out); break;
      default:
        for (int64_t g = 0; g < G; g++) {
          __m512 acc = _mm512_setzero_ps();
          for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d), int8x16(k + r * D + d), acc);
          out[16 * g] = acc;
        }
    }
  }
  template <int kChunks>
  static void dots_of(const float* q, const int8_t* key, int64_t G, __m512* out) {
    __m512 row[kChunks];
    for (int c = 0; c < kChunks; c++) row[c] = int8x16(key + 16 * c);
    for (int64_t g = 0; g < G; g++) {
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < kChunks; c++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + (g * kChunks + c) * 16), row[c], acc);
      out[16 * g] = acc;
    }
  }
  float key_scale(int64_t r) const { return bf16_to_float(k_scale[r]); }

  // acc[g * D + d] = sum over t < L of p[g][t] * v[row t][d] * scale[row t]: 64 columns at a time, each value
  // converted once per token, accumulated in registers for 4 heads.
  void attend_values(const float* p, int64_t L, int64_t G, const int64_t* token_rows, float* acc,
                     std::vector<uint16_t>&) const {
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const int64_t gn = std::min<int64_t>(4, G - g0);
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int64_t cn = std::min<int64_t>(4, (D - d0) / 16);
        __m512 a[4][4];
        for (int64_t g = 0; g < 4; g++)
          for (int64_t c = 0; c < 4; c++) a[g][c] = _mm512_setzero_ps();
        for (int64_t t = 0; t < L; t++) {
          const int64_t r = token_rows[t];
          if (t + kPrefetchAhead < L)
            prefetch(reinterpret_cast<const char*>(v) + (token_rows[t + kPrefetchAhead] * D + d0) * kBytes,
                     16 * cn * kBytes);
          __m512 values[4];
          for (int64_t c = 0; c < cn; c++) values[c] = int8x16(v + r * D + d0 + 16 * c);
          const float vs = bf16_to_float(v_scale[r]);
          for (int64_t g = 0; g < gn; g++) {
            const __m512 weight = _mm512_set1_ps(p[(g0 + g) * L + t] * vs);
            for (int64_t c = 0; c < cn; c++) a[g][c] = _mm512_fmadd_ps(weight, values[c], a[g][c]);
          }
        }
        for (int64_t g = 0; g < gn; g++)
          for (int64_t c = 0; c < cn; c++) _mm512_storeu_ps(acc + (g0 + g) * D + d0 + 16 * c, a[g][c]);
      }
    }
  }
};

}  // namespace decode_rows
