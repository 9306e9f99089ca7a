// y = x @ W.T (+ bias) on AMX tiles for a decode step's rows, reading the weight oneDNN packed for itself
// (`OneDnnPackedLinearKernel`), so that no second copy of it is kept. Checked against F.linear in
// tests/gpu_worker/engine/test_amx_linear.py.
//
// Why: at a decode step's row counts oneDNN's AMX matmul runs the projections far below the tiles' peak. This loop
// computes 32 x 32 outputs at a time (two row tiles by two column tiles, the eight tiles all in use) with the inputs
// cut into 256-deep chunks: a chunk's 32 weight columns (16 KiB) stay in L1 while every row tile of x passes over
// them, the partial sums parked between chunks. It beats oneDNN up to `AMX_LINEAR_ROWS` rows, where oneDNN takes
// over (`python -m bench.lab.linear_rates`, `tokenfleet bench engine`; bench/RESULTS.md). No prefetch of the next
// block's weight: it helped only with the weights in cache.
//
// Layout: oneDNN's AB16b32a2b on these CPUs, [N/32][K/32][16 pairs][32 columns][2]: the weight's 32-column block
// over 32 inputs is one KiB-pair, its first 16 columns a B tile at a row stride of 128 bytes, its last 16 at +64.
// Python checks the packed bytes against that layout once per weight (`linear.amx_tiles`) before using it.
#include "torch_api.h"
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"

namespace {

constexpr int64_t kChunk = 8;  // 32-input steps a chunk: 256 inputs

// Rows [r, r + rows) of a C tile (fp32, 16 x 16) into y as bf16 (+ bias), `cols` of its columns.
void store_rows(const float* c, const float* bias, at::BFloat16* y, int64_t ldy, int64_t rows, int64_t cols) {
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; r++) {
    const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(c + 16 * r), b));
    if (cols == 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), v);
    } else {  // the weight's last columns (N % 16)
      alignas(32) uint16_t row[16];
      _mm256_store_si256(reinterpret_cast<__m256i*>(row), v);
      std::memcpy(y + r * ldy, row, cols * sizeof(uint16_t));
    }
  }
}

// Rows [r, r + rows) of two C tiles (the row tile's two 16-column halves) into y.
void store_pair(const float* bias, at::BFloat16* y, int64_t ldy, int64_t rows, int64_t cols0, int64_t cols1,
                float* c, bool second_row_tile) {
  // Tile numbers are immediates: tiles 0/1 hold the first row tile's halves, 2/3 the second's.
  if (second_row_tile) _tile_stored(2, c, 64); else _tile_stored(0, c, 64);
  store_rows(c, bias, y, ldy, rows, cols0);
  if (cols1 <= 0) return;
  if (second_row_tile) _tile_stored(3, c, 64); else _tile_stored(1, c, 64);
  store_rows(c, bias ? bias + 16 : nullptr, y + 16, ldy, rows, cols1);
}

}  // namespace

// x [M, K] bf16 (K % 32 == 0), packed [N/32 * K/32 * 1024] bf16 as above, bias [N] or empty: y [M, N] bf16.
at::Tensor amx_linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                              const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(1) % 32 == 0,
              "x must be a contiguous bf16 [M, K] with K % 32 == 0");
  TORCH_CHECK(amx_permitted(), "this process may not use AMX tiles (Linux refused arch_prctl)");
  const int64_t M = x.size(0), K = x.size(1), KB = K / 32, NB = (N + 31) / 32, MT = (M + 15) / 16;
  TORCH_CHECK(packed.numel() == NB * KB * 1024, "packed weight of ", packed.numel(), " values for [", N, ", ", K, "]");
  std::vector<float> bias_f;
  if (bias && bias->defined()) {
    const auto b = bias->to(at::kFloat).contiguous();
    bias_f.assign(b.data_ptr<float>(), b.data_ptr<float>() + N);
    bias_f.resize(NB * 32, 0.0f);
  }
  auto y = at::empty({M, N}, x.options());
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  // The last row tile where M is not a multiple of 16, zero-padded, so that no tile reads past x.
  std::vector<uint16_t> tail(M % 16 ? 16 * K : 0, 0);
  if (M % 16) std::memcpy(tail.data(), xp + (M - M % 16) * K, M % 16 * K * sizeof(uint16_t));
  const auto a_rows = [&](int64_t m0) { return m0 + 16 <= M ? xp + m0 * K : tail.data(); };
  const auto* wp = static_cast<const uint16_t*>(packed.data_ptr());
  auto* yp = y.data_ptr<at::BFloat16>();
#pragma omp parallel
  {
    configure_tiles();
    alignas(64) float c[256];
    // Each pair of row tiles' four C tiles between chunks: [pair][4][256].
    std::vector<float> spill((MT + 1) / 2 * 1024 + 16);
    float* partial = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(spill.data()) + 63) & ~uintptr_t{63});
#pragma omp for schedule(static)
    for (int64_t nb = 0; nb < NB; nb++) {
      const uint16_t* w = wp + nb * KB * 1024;
      const int64_t n0 = nb * 32, cols0 = std::min<int64_t>(16, N - n0), cols1 = std::min<int64_t>(16, N - n0 - 16);
      for (int64_t k0 = 0; k0 < KB; k0 += kChunk) {
        const int64_t k1 = std::min(KB, k0 + kChunk);
        for (int64_t mt = 0; mt < MT; mt += 2) {
          const bool pair = mt + 1 < MT;
          float* saved = partial + mt / 2 * 1024;
          const uint16_t* a0 = a_rows(mt * 16);
          const uint16_t* a1 = pair ? a_rows(mt * 16 + 16) : nullptr;
          if (k0 == 0) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
          } else {
            _tile_loadd(0, saved, 64);
            _tile_loadd(1, saved + 256, 64);
            _tile_loadd(2, saved + 512, 64);
            _tile_loadd(3, saved + 768, 64);
          }
          for (int64_t kb = k0; kb < k1; kb++) {
            _tile_loadd(4, a0 + kb * 32, K * 2);
            _tile_loadd(6, w + kb * 1024, 128);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, w + kb * 1024 + 32, 128);
            _tile_dpbf16ps(1, 4, 7);
            if (pair) {
              _tile_loadd(5, a1 + kb * 32, K * 2);
              _tile_dpbf16ps(2, 5, 6);
              _tile_dpbf16ps(3, 5, 7);
            }
          }
          if (k1 < KB) {
            _tile_stored(0, saved, 64);
            _tile_stored(1, saved + 256, 64);
            _tile_stored(2, saved + 512, 64);
            _tile_stored(3, saved + 768, 64);
            continue;
          }
          const float* b = bias_f.empty() ? nullptr : bias_f.data() + n0;
          for (int64_t half = 0; half < (pair ? 2 : 1); half++) {
            const int64_t m0 = (mt + half) * 16;
            store_pair(b, yp + m0 * N + n0, N, std::min<int64_t>(16, M - m0), cols0, cols1, c, half == 1);
          }
        }
      }
    }
    _tile_release();
  }
  return y;
}
