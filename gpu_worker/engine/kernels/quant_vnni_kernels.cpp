// Few-row products with int8 and int4 weights whose activations are quantized to int8 as they arrive, each run
// of 32 inputs with its own scale (max |x| / 127), as llama.cpp's q8_0 / q4_0 dot products do; checked against
// the dequantized weight's matmul in tests/engine/test_quant_vnni_kernels.py.
//
// Why: the fp32 GEMVs of quant_cpu_kernels.cpp spend three vector instructions per 16 weights (widen, convert,
// FMA) and ran compute-bound on weights that sit in a server's L3. AVX512-VNNI's vpdpbusd multiplies 64 weight
// bytes by 64 activation bytes and sums each four into one of 16 int32 lanes in one instruction: per 64 weights
// a chunk then costs a load, vpdpbusd, a conversion and an FMA (lanes 0-7 hold the chunk's first 32 inputs,
// 8-15 the next 32, so the FMA applies both runs' activation scales at once). Runs of 32 keep the quantization
// error to llama.cpp's: per-token activation scales (w8a8) cost SmolLM2 +2% perplexity.
//
// vpdpbusd multiplies unsigned by signed bytes. int4's q (0 .. 15) is unsigned as it is. int8's q is signed:
// the kernel flips its top bit (q + 128, unsigned) and starts each chunk's sum at -128 * sum(x's four bytes per
// lane), precomputed per token, which leaves sum(q * x) exactly.
//
// Weights are the canonical forms of gpu_worker/engine/quantization/weights.py, [N, K] row-major:
//   int8: q int8 [N, K], scale [N, K/G]: w = q * scale over each group of G inputs (G = K: one per channel).
//   int4: packed uint8 [N, K/2] (input 2i in the low nibble of byte i, 2i + 1 in the high one), scale and
//         offset [N, K/G]: w = q * scale + offset.
// G is 32 or a multiple of 64. Scales may be float32 or bfloat16. y is [M, N] in x's dtype (bf16 or fp32).
#include <torch/extension.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_common.h"

namespace {

constexpr int64_t kPassBytes = 16 << 10;  // of weight rows taken against every group of x rows, from L1
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
  std::vector<int32_t> minus_bias;  // [M, chunks, 16]: -128 * the sum of each lane's four bytes of q (int8 only)
  // [M, K / G]: the sums of quantized x over each weight group, for int4's offsets. Quantized, not exact: the
  // product is then the weight times quantized x, as int8's is; exact sums left the error of sum(q * scale * x),
  // a term larger than the result when offsets cancel it (~2% error where int8 had 0.5%).
  std::vector<float> group_sum;
};

template <typename X>
QuantizedX quantize_x(const X* xp, int64_t M, int64_t K, int64_t G, bool signed_weights) {
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
  if (signed_weights) {
    out.minus_bias.resize(M * out.chunks * 16);
    const __m512i u128 = _mm512_set1_epi8(static_cast<char>(0x80));  // 128 as vpdpbusd's unsigned operand
    for (int64_t i = 0; i < M * out.chunks; i++) {
      // What the flipped weights' +128 adds to each lane: 128 * the sum of its four bytes of q.
      const __m512i q = _mm512_loadu_si512(out.q.data() + i * kChunk);
      const __m512i bias = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u128, q);
      _mm512_storeu_si512(out.minus_bias.data() + i * 16, _mm512_sub_epi32(_mm512_setzero_si512(), bias));
    }
  }
  return out;
}

// x quantized, read as it is (bf16 or fp32): a conversion to fp32 first cost a torch op, ~2 us a call.
QuantizedX quantize_x(const torch::Tensor& x, int64_t G, bool signed_weights) {
  const auto xc = x.contiguous();
  return xc.scalar_type() == at::kBFloat16
             ? quantize_x(xc.data_ptr<at::BFloat16>(), x.size(0), x.size(1), G, signed_weights)
             : quantize_x(xc.data_ptr<float>(), x.size(0), x.size(1), G, signed_weights);
}

// A weight row's chunk at input k as 64 unsigned bytes. int8: q + 128 (its top bit flipped); int4: the nibbles
// in input order, each 16-bit lane's byte b widened to (b & 0xF) | (b >> 4) << 8. `tail`: only K - k < 64
// inputs are left; the rest of the chunk reads as zeros.
struct Int8Chunk {
  const int8_t* q;
  int64_t K;
  const int8_t* row(int64_t n) const { return q + n * K; }
  int64_t row_bytes() const { return K; }
  static constexpr int64_t chunk_bytes() { return kChunk; }
  __m512i operator()(const int8_t* row, int64_t k) const {
    return _mm512_xor_si512(_mm512_loadu_si512(row + k), _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  __m512i tail(const int8_t* row, int64_t k) const {
    const __mmask64 mask = (1ull << (K - k)) - 1;
    return _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, row + k), _mm512_set1_epi8(static_cast<char>(0x80)));
  }
};

struct Int4Chunk {
  const uint8_t* packed;
  int64_t K;
  const uint8_t* row(int64_t n) const { return packed + n * (K / 2); }
  int64_t row_bytes() const { return K / 2; }
  static constexpr int64_t chunk_bytes() { return kChunk / 2; }
  static __m512i nibbles(__m256i bytes) {
    const __m512i b = _mm512_cvtepu8_epi16(bytes);
    return _mm512_and_si512(_mm512_or_si512(b, _mm512_slli_epi16(b, 4)), _mm512_set1_epi16(0x0F0F));
  }
  __m512i operator()(const uint8_t* row, int64_t k) const {
    return nibbles(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k / 2)));
  }
  __m512i tail(const uint8_t* row, int64_t k) const {
    return nibbles(_mm256_maskz_loadu_epi8(static_cast<__mmask32>((1ull << ((K - k) / 2)) - 1), row + k / 2));
  }
};

// acc[r][m] += chunk c of weight row r times x row m, scaled by x's run scales (and, kScaled, by the weight
// rows' per-chunk scales). Every index is a compile-time constant, so the accumulators live in registers:
// R weight rows at once give R * M independent sums, enough to hide an FMA's ~4-cycle latency.
template <int R, int M, bool kSigned, bool kScaled>
inline void accumulate(__m512 (&acc)[R][M], const __m512i (&w)[R], const __m512 (&wscale)[R], const QuantizedX& x,
                       int64_t m0, int64_t c) {
#pragma GCC unroll 8
  for (int m = 0; m < M; m++) {
    const int64_t i = (m0 + m) * x.chunks + c;
    const __m512i xq = _mm512_loadu_si512(x.q.data() + i * kChunk);
    const __m512 xs = _mm512_loadu_ps(x.scale.data() + i * 16);
    const __m512i bias = kSigned ? _mm512_loadu_si512(x.minus_bias.data() + i * 16) : _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
      const __m512i d = _mm512_dpbusd_epi32(bias, w[r], xq);
      acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), kScaled ? _mm512_mul_ps(xs, wscale[r]) : xs, acc[r][m]);
    }
  }
}

// Chunk c of the rows kPrefetchBlocks blocks ahead, asked for now: the hardware prefetcher alone left the
// weights' stream from L3 / DRAM at ~2/3 of the bf16 GEMV's bandwidth.
constexpr int64_t kPrefetchBlocks = 2;

template <int R, typename Chunk, typename Row>
inline void prefetch_ahead(const Chunk& chunk, const Row (&rows)[R], int64_t c) {
  for (int r = 0; r < R; r++)
    _mm_prefetch(reinterpret_cast<const char*>(rows[r] + kPrefetchBlocks * R * chunk.row_bytes() +
                                               c * chunk.chunk_bytes()), _MM_HINT_T0);
}

template <int R, int M>
inline void zero(__m512 (&acc)[R][M]) {
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
}

// Rows [n, n + R) of y = x @ W.T for x's rows [m0, m0 + M). Each chunk's product takes its weight groups' scales: G = 32, a chunk spans
// two groups (scaled per chunk); G % 64 == 0, a group spans whole chunks (scaled once per group). `offset`
// (int4; null for int8) multiplies x's group sums.
template <int R, int M, bool kSigned, typename S, typename Y, typename Chunk>
inline void row_block(const QuantizedX& x, const Chunk& chunk, const S* scale, const S* offset, Y* y, int64_t N,
                      int64_t G, int64_t m0, int64_t n) {
  const int64_t K = x.K, groups = K / G, full = K / kChunk;
  decltype(chunk.row(0)) rows[R];
  for (int r = 0; r < R; r++) rows[r] = chunk.row(n + r);
  __m512 acc[R][M];
  zero(acc);
  __m512i w[R];
  __m512 wscale[R];
  if (G == 32) {
    for (int64_t c = 0; c < x.chunks; c++) {
      prefetch_ahead<R>(chunk, rows, c);
      for (int r = 0; r < R; r++) {
        const S* s = scale + (n + r) * groups + 2 * c;
        w[r] = c < full ? chunk(rows[r], c * kChunk) : chunk.tail(rows[r], c * kChunk);
        wscale[r] = _mm512_insertf32x8(_mm512_set1_ps(load_float(s)),
                                       _mm256_set1_ps(2 * c + 1 < groups ? load_float(s + 1) : 0.0f), 1);
      }
      accumulate<R, M, kSigned, true>(acc, w, wscale, x, m0, c);
    }
  } else {
    const int64_t per_group = G / kChunk;
    for (int64_t g = 0; g < groups; g++) {
      __m512 group_acc[R][M];
      zero(group_acc);
      for (int64_t c = g * per_group; c < (g + 1) * per_group; c++) {
        prefetch_ahead<R>(chunk, rows, c);
        for (int r = 0; r < R; r++) w[r] = chunk(rows[r], c * kChunk);
        accumulate<R, M, kSigned, false>(group_acc, w, wscale, x, m0, c);
      }
      for (int r = 0; r < R; r++) {
        const __m512 s = _mm512_set1_ps(load_float(scale + (n + r) * groups + g));
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_fmadd_ps(group_acc[r][m], s, acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    for (int m = 0; m < M; m++) {
      __m512 total = acc[r][m];
      if (offset != nullptr) {
        for (int64_t g = 0; g < groups; g += 16)
          total = _mm512_fmadd_ps(load16(offset + (n + r) * groups + g, groups - g),
                                  load16(x.group_sum.data() + (m0 + m) * groups + g, groups - g), total);
      }
      store(y + (m0 + m) * N + n + r, _mm512_reduce_add_ps(total));
    }
  }
}

// Weight rows a block at a time: 4 for M <= 2, 2 for M <= 4, else 1 (R * M sums, plus R chunks, stay within
// the 32 vector registers).
template <int M>
constexpr int kRowBlock = M <= 2 ? 4 : M <= 4 ? 2 : 1;

template <int M, bool kSigned, typename S, typename Y, typename Chunk>
void row_group(const QuantizedX& x, const Chunk& chunk, const S* scale, const S* offset, Y* y, int64_t N, int64_t G,
               int64_t m0, int64_t n0, int64_t n1) {
  constexpr int R = kRowBlock<M>;
  int64_t n = n0;
  for (; n + R <= n1; n += R) row_block<R, M, kSigned>(x, chunk, scale, offset, y, N, G, m0, n);
  for (; n < n1; n++) row_block<1, M, kSigned>(x, chunk, scale, offset, y, N, G, m0, n);
}

// Weight rows [n0, n1) against all of x: a pass of weight rows (kPassBytes) at a time, read from memory for x's
// first rows and from L1 for every further group of kMaxRowsAtOnce rows (a decode batch of 32 reads the weights
// once, as the bf16 path's oneDNN does).
template <bool kSigned, typename S, typename Y, typename Chunk>
void rows(const QuantizedX& x, const Chunk& chunk, const S* scale, const S* offset, Y* y, int64_t N, int64_t G,
          int64_t n0, int64_t n1) {
  const int64_t pass = std::max<int64_t>(4, kPassBytes / chunk.row_bytes() / 4 * 4);
  for (int64_t p0 = n0; p0 < n1; p0 += pass) {
    const int64_t p1 = std::min(n1, p0 + pass);
    for (int64_t m0 = 0; m0 < x.M; m0 += kMaxRowsAtOnce) {
      dispatch_rows(std::min(kMaxRowsAtOnce, x.M - m0), [&](auto m) {
        row_group<m(), kSigned>(x, chunk, scale, offset, y, N, G, m0, p0, p1);
      });
    }
  }
}

// The VNNI loops take a chunk of 64 inputs within one group, or two groups of 32.
int64_t chunk_group(int64_t G) {
  TORCH_CHECK(G == 32 || G % 64 == 0, "the group size K / groups = ", G, " must be 32 or a multiple of 64");
  return G;
}

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(1) == K, "x must be [M, K] with M >= 1 and K = ", K,
              ", got ", x.sizes());
}

}  // namespace

// y [M, N] = x [M, K] @ (q * scale).T, x quantized per run of 32; scale [N, groups].
torch::Tensor int8_gemv_a8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  const Int8Weight w = int8_weight(q, scale);
  const int64_t N = w.N, K = w.K, G = chunk_group(w.G);
  check_x(x, K);
  const auto& sc = w.scale;
  const QuantizedX xq = quantize_x(x, G, true);
  const int8_t* qp = w.q;
  auto y = torch::empty({x.size(0), N}, x.options());
  dispatch_types(sc, y, [&](auto* sp, auto* yp) {
    parallel_rows(N, K, [&](int64_t n0, int64_t n1) {
      rows<true>(xq, Int8Chunk{qp, K}, sp, static_cast<decltype(sp)>(nullptr), yp, N, G, n0, n1);
    });
  });
  return y;
}

// y [M, N] = x [M, K] @ (q * scale + offset).T, q the nibbles of packed, scale/offset [N, K / G].
torch::Tensor int4_gemv_a8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                           const torch::Tensor& offset) {
  const Int4Weight w = int4_weight(packed, scale, offset);
  const int64_t N = w.N, K = w.K, G = chunk_group(w.G);
  check_x(x, K);
  const auto &sc = w.scale, &oc = w.offset;
  const QuantizedX xq = quantize_x(x, G, false);
  const uint8_t* pp = w.packed;
  auto y = torch::empty({x.size(0), N}, x.options());
  dispatch_types(sc, y, [&](auto* sp, auto* yp) {
    const auto* op = static_cast<decltype(sp)>(oc.data_ptr());
    parallel_rows(N, K, [&](int64_t n0, int64_t n1) {
      rows<false>(xq, Int4Chunk{pp, K}, sp, op, yp, N, G, n0, n1);
    });
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemv_a8", &int8_gemv_a8, "y [M, N] = x [M, K] @ (q * scale).T, x as int8 per 32 inputs");
  m.def("int4_gemv_a8", &int4_gemv_a8, "y [M, N] = x [M, K] @ (q * scale + offset).T, x as int8 per 32");
}
