// Many-row products with int8 and int4 weights and int8 activations (x quantized per run of 32, as the GEMVs of
// quant_vnni_kernels.cpp take it) for CPUs with AVX512-VNNI and no AMX (AMD Zen 4 / Zen 5, Intel before Sapphire
// Rapids); checked against the dequantized weight's matmul in tests/gpu_worker/engine/test_quant_vnni_kernels.py.
//
// Why: without AMX, the dequantized bf16 tiles into oneDNN run slower than the engine's prepacked bf16 matmul at
// many rows (prefill chunks, decode batches), since a matmul there is bound by arithmetic and both do the same bf16
// arithmetic plus the dequantization. vpdpbusd does 64 multiply-adds an instruction where vdpbf16ps does 32, so the
// int8 x int8 product can be the faster one, if the run scales cost little (`tokenfleet bench quant`).
//
// Layout: the GEMVs keep a lane per 4 inputs and sum lanes at the end, which costs a conversion and an FMA per
// 64 inputs, per weight row and per x row. Here a lane is a weight row: 16 weight rows are transposed once per
// call into quads (Wt[k / 4][16], each 32-bit lane four consecutive inputs of one row, in L1), and each x row's
// quad is broadcast against them: per run of 32 inputs, 8 vpdpbusd into int32 sums for 16 rows, then one
// conversion and one FMA with the run's scale, for every x row. The transposition is paid once per 16 rows for
// all of x's rows.
//
// int4's nibbles are unsigned as they are; their offsets multiply x's group sums. int8 weights are flipped to
// unsigned (q + 128) and served as int4's form, w = (q + 128) * scale - 128 * scale: a sum started at -128 * the
// sum of x's run instead (the GEMVs' way) costs more at many rows than the offsets' one FMA per group.
#include "torch_api.h"
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <vector>

#include "quant_common.h"
#include "quant_vnni_common.h"

namespace {

constexpr int64_t kLanes = 16;  // weight rows a block: one per 32-bit lane

// Each x row's run scales, [M, K / 32].
std::vector<float> run_scales(const QuantizedX& x) {
  const int64_t runs = x.K / 32;
  std::vector<float> out(x.M * runs);
  for (int64_t m = 0; m < x.M; m++)
    for (int64_t r = 0; r < runs; r++) out[m * runs + r] = x.scale[(m * x.chunks + r / 2) * 16 + (r % 2) * 8];
  return out;
}

// 16 x 16 32-bit values: r[i] holds row i; afterwards r[j] holds column j (row i in lane i).
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; i++) {  // lane L of 128 bits: rows 2i, 2i + 1 at columns 4L .. 4L + 3, interleaved
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i v[4][4];  // v[R][c], lane L: rows 4R .. 4R + 3 at column 4L + c
  for (int R = 0; R < 4; R++) {
    v[R][0] = _mm512_unpacklo_epi64(t[4 * R], t[4 * R + 2]);
    v[R][1] = _mm512_unpackhi_epi64(t[4 * R], t[4 * R + 2]);
    v[R][2] = _mm512_unpacklo_epi64(t[4 * R + 1], t[4 * R + 3]);
    v[R][3] = _mm512_unpackhi_epi64(t[4 * R + 1], t[4 * R + 3]);
  }
  for (int c = 0; c < 4; c++) {  // column 4L + c gathers lane L of v[0..3][c]
    const __m512i p0 = _mm512_shuffle_i32x4(v[0][c], v[1][c], 0x44), p1 = _mm512_shuffle_i32x4(v[0][c], v[1][c], 0xEE);
    const __m512i p2 = _mm512_shuffle_i32x4(v[2][c], v[3][c], 0x44), p3 = _mm512_shuffle_i32x4(v[2][c], v[3][c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(p0, p2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(p0, p2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(p1, p3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(p1, p3, 0xDD);
  }
}

// A block of 16 weight rows as vpdpbusd's unsigned operand: wt[k / 4] the quads of inputs k .. k + 3 of every
// row (rows past N zero), and each row's scales and offsets per group, scale[g][row]: w = q * scale + offset.
struct Block {
  std::vector<uint32_t> wt;  // [K / 4][16]
  std::vector<float> scale, offset;
};

// `row_bytes(row, k, out)` writes inputs [k, k + 64) of weight row `row` as 64 unsigned bytes (zeros past K).
template <typename RowBytes>
void transpose_block(Block& b, int64_t K, int64_t rows, RowBytes&& row_bytes) {
  for (int64_t k = 0; k < K; k += 64) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = i < rows ? row_bytes(i, k) : _mm512_setzero_si512();
    transpose16(r);
    for (int64_t j = 0; j < 16 && k + 4 * j < K; j++) _mm512_storeu_si512(b.wt.data() + (k / 4 + j) * kLanes, r[j]);
  }
}

// The same inputs of the next block's row, asked for now: sixteen rows read side by side are sixteen streams,
// more than the hardware prefetcher follows (a 49152-row LM head ran at a quarter of the bandwidth without).
inline void prefetch_next_block(const void* p, int64_t block_bytes) {
  _mm_prefetch(static_cast<const char*>(p) + block_bytes, _MM_HINT_T0);
}

template <typename S>
void block_scales(std::vector<float>& out, const S* s, int64_t groups, int64_t n0, int64_t rows) {
  for (int64_t g = 0; g < groups; g++)
    for (int64_t i = 0; i < kLanes; i++) out[g * kLanes + i] = i < rows ? load_float(s + (n0 + i) * groups + g) : 0.0f;
}

// y[m0 .. m0 + M) x [n0 .. n0 + rows) of x @ W.T from a block. Runs of 32 inputs within groups of G: each run's
// int32 sums take the run's scale into the group's sums, each group's the weight rows' scales (and offsets).
template <int M, typename Y>
void block_product(const Block& b, const QuantizedX& x, const std::vector<float>& run_scale, int64_t G, int64_t m0, Y* y,
                   int64_t N, int64_t n0, int64_t rows) {
  const int64_t runs = x.K / 32, groups = x.K / G, padded = x.chunks * kChunk;
  const int32_t* xq = reinterpret_cast<const int32_t*>(x.q.data());
  __m512 acc[M];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m512 group_acc[M];
    for (auto& a : group_acc) a = _mm512_setzero_ps();
    for (int64_t run = g * G / 32; run < (g + 1) * G / 32; run++) {
      __m512i sum[M];
      for (auto& v : sum) v = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int j = 0; j < 8; j++) {
        const __m512i w = _mm512_loadu_si512(b.wt.data() + (run * 8 + j) * kLanes);
        for (int m = 0; m < M; m++)
          sum[m] = _mm512_dpbusd_epi32(sum[m], w, _mm512_set1_epi32(xq[((m0 + m) * padded) / 4 + run * 8 + j]));
      }
      for (int m = 0; m < M; m++)
        group_acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m]), _mm512_set1_ps(run_scale[(m0 + m) * runs + run]),
                                       group_acc[m]);
    }
    const __m512 s = _mm512_loadu_ps(b.scale.data() + g * kLanes);
    for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(group_acc[m], s, acc[m]);
    const __m512 o = _mm512_loadu_ps(b.offset.data() + g * kLanes);
    for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(o, _mm512_set1_ps(x.group_sum[(m0 + m) * groups + g]), acc[m]);
  }
  for (int m = 0; m < M; m++) store16(y + (m0 + m) * N + n0, acc[m], rows);
}

// y = x @ W.T: each thread a contiguous range of 16-row blocks, each block transposed by `prepare(block, n0,
// rows)` once and multiplied by every row of x, 8 at a time (their sums in registers).
template <typename Prepare>
at::Tensor gemm(const at::Tensor& x, int64_t N, int64_t K, int64_t G, const at::Tensor& scale,
                   Prepare&& prepare) {
  check_x(x, K);
  TORCH_CHECK(G % 32 == 0, "the group size K / groups = ", G, " must be a multiple of 32");
  const QuantizedX xq = quantize_x(x, G);
  const std::vector<float> run_scale = run_scales(xq);
  const int64_t M = x.size(0), blocks = (N + kLanes - 1) / kLanes;
  auto y = at::empty({M, N}, x.options());
  dispatch_types(scale, y, [&](auto* sp, auto* yp) {
    parallel_rows(blocks, K * M, [&](int64_t b0, int64_t b1) {
      Block b{std::vector<uint32_t>(K / 4 * kLanes), std::vector<float>(K / G * kLanes), std::vector<float>(K / G * kLanes)};
      for (int64_t blk = b0; blk < b1; blk++) {
        const int64_t n0 = blk * kLanes, rows = std::min(kLanes, N - n0);
        prepare(b, sp, n0, rows);
        for (int64_t m0 = 0; m0 < M; m0 += kMaxRowsAtOnce) {
          dispatch_rows(std::min(kMaxRowsAtOnce, M - m0), [&](auto m) {
            block_product<m()>(b, xq, run_scale, G, m0, yp, N, n0, rows);
          });
        }
      }
    });
  });
  return y;
}

}  // namespace

// y [M, N] = x [M, K] @ (q * scale).T, x quantized per run of 32; scale [N, groups], groups of a multiple of 32.
at::Tensor int8_gemm_a8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  const Int8Weight w = int8_weight(q, scale);
  const int64_t K = w.K, groups = K / w.G;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  return gemm(x, w.N, K, w.G, w.scale, [&](Block& b, auto* sp, int64_t n0, int64_t rows) {
    transpose_block(b, K, rows, [&](int64_t i, int64_t k) {
      const __mmask64 mask = K - k >= 64 ? ~0ull : (1ull << (K - k)) - 1;
      const int8_t* p = w.q + (n0 + i) * K + k;
      prefetch_next_block(p, kLanes * K);
      return _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, p), flip);
    });
    block_scales(b.scale, sp, groups, n0, rows);
    for (size_t i = 0; i < b.offset.size(); i++) b.offset[i] = -128.0f * b.scale[i];  // for the flip's +128
  });
}

// y [M, N] = x [M, K] @ (q * scale + offset).T, q the nibbles of packed, scale/offset [N, K / G].
at::Tensor int4_gemm_a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                           const at::Tensor& offset) {
  const Int4Weight w = int4_weight(packed, scale, offset);
  const int64_t K = w.K, groups = K / w.G;
  return gemm(x, w.N, K, w.G, w.scale, [&](Block& b, auto* sp, int64_t n0, int64_t rows) {
    transpose_block(b, K, rows, [&](int64_t i, int64_t k) {
      const __mmask32 mask = K - k >= 64 ? ~0u : (1u << ((K - k) / 2)) - 1;  // 32 bytes hold inputs k .. k + 63
      const uint8_t* p = w.packed + (n0 + i) * (K / 2) + k / 2;
      prefetch_next_block(p, kLanes * K / 2);
      return int4_in_order(_mm256_maskz_loadu_epi8(mask, p));
    });
    block_scales(b.scale, sp, groups, n0, rows);
    block_scales(b.offset, static_cast<decltype(sp)>(w.offset.data_ptr()), groups, n0, rows);
  });
}
