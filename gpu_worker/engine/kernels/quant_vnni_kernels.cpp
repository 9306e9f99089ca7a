// Few-row products with int8 and int4 weights whose activations are quantized to int8 as they arrive, each run
// of 32 inputs with its own scale (max |x| / 127), as llama.cpp's q8_0 / q4_0 dot products do; checked against
// the dequantized weight's matmul in tests/gpu_worker/engine/test_quant_vnni_kernels.py.
//
// Why: the fp32 GEMVs of quant_cpu_kernels.cpp spend three vector instructions per 16 weights (widen, convert,
// FMA) and ran compute-bound on weights that sit in a server's L3. AVX512-VNNI's vpdpbusd multiplies 64 weight
// bytes by 64 activation bytes and sums each four into one of 16 int32 lanes in one instruction: per 64 weights
// a chunk then costs a load, vpdpbusd, a conversion and an FMA (lanes 0-7 hold the chunk's first 32 inputs,
// 8-15 the next 32, so the FMA applies both runs' activation scales at once). Runs of 32 keep the quantization
// error to llama.cpp's, where per-token activation scales (w8a8) cost perplexity (`tokenfleet bench quant`).
//
// vpdpbusd multiplies unsigned by signed bytes. int4's q (0 .. 15) is unsigned as it is. int8's q is signed:
// the kernel flips its top bit (q + 128, unsigned) and serves it in int4's form, with the offset -128 * scale
// applied to x's group sums once per row, as the GEMM does: one load per 64 weights fewer than starting each
// chunk's sum at -128 * sum(x's four bytes per lane), which streamed from DRAM no faster.
//
// Weights are the canonical forms of gpu_worker/engine/quantization/weights.py, [N, K] row-major:
//   int8: q int8 [N, K], scale [N, K/G]: w = q * scale over each group of G inputs (G = K: one per channel).
//   int4: packed uint8 [N, K/2] (input 2i in the low nibble of byte i, 2i + 1 in the high one), scale and
//         offset [N, K/G]: w = q * scale + offset.
// G is 32 or a multiple of 64. Scales may be float32 or bfloat16. y is [M, N] in x's dtype (bf16 or fp32).
#include "torch_api.h"
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_common.h"
#include "quant_vnni_common.h"
#include "sum16.h"

namespace {

constexpr int64_t kPassBytes = 16 << 10;  // of weight rows taken against every group of x rows, from L1

// A weight row's chunk at input k as 64 unsigned bytes. int8: q + 128 (its top bit flipped); int4: the nibbles
// in input order, each 16-bit lane's byte b widened to (b & 0xF) | (b >> 4) << 8. `tail`: only K - k < 64
// inputs are left; the rest of the chunk reads as zeros.
struct Int8Chunk {
  static constexpr bool kFlipped = true;  // reads q + 128: w = (q + 128) * scale - 128 * scale
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
  static constexpr bool kFlipped = false;
  const uint8_t* packed;
  int64_t K;
  const uint8_t* row(int64_t n) const { return packed + n * (K / 2); }
  int64_t row_bytes() const { return K / 2; }
  static constexpr int64_t chunk_bytes() { return kChunk / 2; }
  __m512i operator()(const uint8_t* row, int64_t k) const {
    return int4_in_order(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k / 2)));
  }
  __m512i tail(const uint8_t* row, int64_t k) const {
    return int4_in_order(_mm256_maskz_loadu_epi8(static_cast<__mmask32>((1ull << ((K - k) / 2)) - 1), row + k / 2));
  }
};

// acc[r][m] += chunk c of weight row r times x row m, scaled by x's run scales (and, kScaled, by the weight
// rows' per-chunk scales). Every index is a compile-time constant, so the accumulators live in registers:
// R weight rows at once give R * M independent sums, enough to hide an FMA's ~4-cycle latency.
template <int R, int M, bool kScaled>
inline void accumulate(__m512 (&acc)[R][M], const __m512i (&w)[R], const __m512 (&wscale)[R], const QuantizedX& x,
                       int64_t m0, int64_t c) {
#pragma GCC unroll 8
  for (int m = 0; m < M; m++) {
    const int64_t i = (m0 + m) * x.chunks + c;
    const __m512i xq = _mm512_loadu_si512(x.q.data() + i * kChunk);
    const __m512 xs = _mm512_loadu_ps(x.scale.data() + i * 16);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
      const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r], xq);
      acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), kScaled ? _mm512_mul_ps(xs, wscale[r]) : xs, acc[r][m]);
    }
  }
}

// Chunk c of the rows kPrefetchRows ahead, asked for now: the hardware prefetcher alone left the weights' stream
// from L3 / DRAM at ~2/3 of the bf16 GEMV's bandwidth.
constexpr int64_t kPrefetchRows = 8;

template <int R, typename Chunk, typename Row>
inline void prefetch_ahead(const Chunk& chunk, const Row (&rows)[R], int64_t c) {
  for (int r = 0; r < R; r++)
    _mm_prefetch(reinterpret_cast<const char*>(rows[r] + kPrefetchRows * chunk.row_bytes() + c * chunk.chunk_bytes()),
                 _MM_HINT_T0);
}

template <int R, int M>
inline void zero(__m512 (&acc)[R][M]) {
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
}

// Rows [n, n + R) of y = x @ W.T for x's rows [m0, m0 + M), left as vectors to sum: totals[m][slot + r]. Each
// chunk's product takes its weight groups' scales: G = 32, a chunk spans two groups (scaled per chunk);
// G % 64 == 0, a group spans whole chunks (scaled once per group). The offsets (int4's `offset`; int8's
// -128 * scale) multiply x's group sums.
template <int R, int M, typename S, typename Chunk>
inline void row_block(const QuantizedX& x, const Chunk& chunk, const S* scale, const S* offset, __m512 (&totals)[M][16],
                      int64_t G, int64_t m0, int64_t n, int64_t slot) {
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
      accumulate<R, M, true>(acc, w, wscale, x, m0, c);
    }
  } else {
    const int64_t per_group = G / kChunk;
    for (int64_t g = 0; g < groups; g++) {
      __m512 group_acc[R][M];
      zero(group_acc);
      for (int64_t c = g * per_group; c < (g + 1) * per_group; c++) {
        prefetch_ahead<R>(chunk, rows, c);
        for (int r = 0; r < R; r++) w[r] = chunk(rows[r], c * kChunk);
        accumulate<R, M, false>(group_acc, w, wscale, x, m0, c);
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
      for (int64_t g = 0; g < groups; g += 16) {
        const __m512 o = Chunk::kFlipped ? _mm512_mul_ps(load16(scale + (n + r) * groups + g, groups - g), _mm512_set1_ps(-128.0f))
                                         : load16(offset + (n + r) * groups + g, groups - g);
        total = _mm512_fmadd_ps(o, load16(x.group_sum.data() + (m0 + m) * groups + g, groups - g), total);
      }
      totals[m][slot + r] = total;
    }
  }
}

// Weight rows a block at a time: 4 for M <= 2, 2 for M <= 4, else 1 (R * M sums, plus R chunks, stay within
// the 32 vector registers); int8 at M = 1 one row, read front to back as one stream, which streams faster from DRAM
// than four rows (int4, whose unpacking makes it bound by arithmetic, keeps four).
template <int M, typename Chunk>
constexpr int kRowBlock = Chunk::kFlipped && M == 1 ? 1 : M <= 2 ? 4 : M <= 4 ? 2 : 1;

// Weight rows [n0, n1), sixteen at a time: their sums reduced together and stored as one vector (a reduction
// and a store per row took a large share of a short row's time).
template <int M, typename S, typename Y, typename Chunk>
void row_group(const QuantizedX& x, const Chunk& chunk, const S* scale, const S* offset, Y* y, int64_t N, int64_t G,
               int64_t m0, int64_t n0, int64_t n1) {
  constexpr int R = kRowBlock<M, Chunk>;
  for (int64_t b0 = n0; b0 < n1; b0 += 16) {
    const int64_t count = std::min<int64_t>(16, n1 - b0);
    __m512 totals[M][16];
    int64_t n = b0;
    for (; n + R <= b0 + count; n += R) row_block<R, M>(x, chunk, scale, offset, totals, G, m0, n, n - b0);
    for (; n < b0 + count; n++) row_block<1, M>(x, chunk, scale, offset, totals, G, m0, n, n - b0);
    for (int m = 0; m < M; m++) {
      for (int64_t i = count; i < 16; i++) totals[m][i] = _mm512_setzero_ps();
      store16(y + (m0 + m) * N + b0, sum16(totals[m]), count);
    }
  }
}

// Weight rows [n0, n1) against all of x: a pass of weight rows (kPassBytes) at a time, read from memory for x's
// first rows and from L1 for every further group of kMaxRowsAtOnce rows (a decode batch of 32 reads the weights
// once, as the bf16 path's oneDNN does).
template <typename S, typename Y, typename Chunk>
void rows(const QuantizedX& x, const Chunk& chunk, const S* scale, const S* offset, Y* y, int64_t N, int64_t G,
          int64_t n0, int64_t n1) {
  const int64_t pass = std::max<int64_t>(16, kPassBytes / chunk.row_bytes() / 16 * 16);  // whole groups of 16
  for (int64_t p0 = n0; p0 < n1; p0 += pass) {
    const int64_t p1 = std::min(n1, p0 + pass);
    for (int64_t m0 = 0; m0 < x.M; m0 += kMaxRowsAtOnce) {
      dispatch_rows(std::min(kMaxRowsAtOnce, x.M - m0), [&](auto m) {
        row_group<m()>(x, chunk, scale, offset, y, N, G, m0, p0, p1);
      });
    }
  }
}

}  // namespace

// y [M, N] = x [M, K] @ (q * scale).T, x quantized per run of 32; scale [N, groups].
at::Tensor int8_gemv_a8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  const Int8Weight w = int8_weight(q, scale);
  const int64_t N = w.N, K = w.K, G = chunk_group(w.G);
  check_x(x, K);
  const auto& sc = w.scale;
  const QuantizedX xq = quantize_x(x, G);
  const int8_t* qp = w.q;
  auto y = at::empty({x.size(0), N}, x.options());
  dispatch_types(sc, y, [&](auto* sp, auto* yp) {
    parallel_rows(N, K, [&](int64_t n0, int64_t n1) {
      rows(xq, Int8Chunk{qp, K}, sp, static_cast<decltype(sp)>(nullptr), yp, N, G, n0, n1);
    });
  });
  return y;
}

// y [M, N] = x [M, K] @ (q * scale + offset).T, q the nibbles of packed, scale/offset [N, K / G].
at::Tensor int4_gemv_a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                           const at::Tensor& offset) {
  const Int4Weight w = int4_weight(packed, scale, offset);
  const int64_t N = w.N, K = w.K, G = chunk_group(w.G);
  check_x(x, K);
  const auto &sc = w.scale, &oc = w.offset;
  const QuantizedX xq = quantize_x(x, G);
  const uint8_t* pp = w.packed;
  auto y = at::empty({x.size(0), N}, x.options());
  dispatch_types(sc, y, [&](auto* sp, auto* yp) {
    const auto* op = static_cast<decltype(sp)>(oc.data_ptr());
    parallel_rows(N, K, [&](int64_t n0, int64_t n1) {
      rows(xq, Int4Chunk{pp, K}, sp, op, yp, N, G, n0, n1);
    });
  });
  return y;
}

// quant_vnni_gemm.cpp: the same products for many rows, where the CPU has no AMX.
at::Tensor int8_gemm_a8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale);
at::Tensor int4_gemm_a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                           const at::Tensor& offset);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemv_a8", &int8_gemv_a8, "y [M, N] = x [M, K] @ (q * scale).T, x as int8 per 32 inputs");
  m.def("int4_gemv_a8", &int4_gemv_a8, "y [M, N] = x [M, K] @ (q * scale + offset).T, x as int8 per 32");
  m.def("int8_gemm_a8", &int8_gemm_a8, "int8_gemv_a8 for many rows: 16 weight rows a lane each, transposed once");
  m.def("int4_gemm_a8", &int4_gemm_a8, "int4_gemv_a8 for many rows: 16 weight rows a lane each, transposed once");
}
