// Products with int8 and int4 weights for a decode batch's tens of rows, on AMX (Sapphire Rapids and later),
// checked against the dequantized weight's matmul in tests/gpu_worker/engine/test_quant_amx_kernels.py.
//
// Why: between the few rows the VNNI GEMVs serve (their arithmetic grows with every row) and the hundreds of a
// prefill chunk (where dequantizing the whole weight into a bf16 buffer for oneDNN costs little against the
// matmul), the dequantized copy's bytes are what a step pays: written, then read back, 2 bytes a weight on top
// of the 1 or 0.5 the weight itself takes. Here each block of 32 weight rows is dequantized into a buffer that
// stays in L1/L2 and multiplied at once by every row of x on AMX, whose 16 x 16 x 32 tile product costs little
// at these sizes; memory then carries the quantized weight alone.
//
// Layout: C^T = W x^T, with A = the dequantized weight rows (16 rows x 32 inputs a tile, each tile a
// contiguous KiB) and B = x, packed once per call in AMX's pairs: B[kp][m] holds x[m][2kp], x[m][2kp + 1]
// (16 pairs x 16 rows a tile, contiguous). Tiles strided by 4 KiB (x's plain rows at M = 1024) ran at a
// quarter of the speed: their rows share a cache set. Per-channel int8 is dequantized to its integers (exact
// in bf16) and the scale applied to the fp32 products, so it computes the exact weight; per-group int8 and
// int4 are dequantized with their scales, rounded to bf16 as the tiles path of quant_cpu_kernels.cpp does.
#include "torch_api.h"
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "quant_common.h"

namespace {

constexpr int64_t kBlockRows = 32;  // weight rows a block: two A tiles

// x [M, K] bf16 as B tiles: xp[m / 16][kp][m % 16] = the pair x[m][2kp .. 2kp + 2), rows past M zero.
std::vector<uint32_t> pack_x(const at::Tensor& xb, int64_t m_blocks) {
  const int64_t M = xb.size(0), pairs = xb.size(1) / 2;
  const auto* xw = static_cast<const uint32_t*>(xb.data_ptr());
  std::vector<uint32_t> xp(m_blocks * pairs * 16, 0);
  for (int64_t m = 0; m < M; m++)
    for (int64_t kp = 0; kp < pairs; kp++) xp[((m / 16) * pairs + kp) * 16 + m % 16] = xw[m * pairs + kp];
  return xp;
}

// Where weight row r of a block (< kBlockRows) has its inputs [32 kb, 32 kb + 32) in A-tile layout:
// w[r / 16][kb][r % 16][32], each tile (16 rows x 32 inputs) one contiguous KiB.
inline int64_t a_offset(int64_t r, int64_t kb, int64_t K) { return ((r / 16) * (K / 32) + kb) * 512 + (r % 16) * 32; }

// Weight row n into row r of a block. Per channel (G = K): its integers, exact, and the scale returned for
// the products; per group: dequantized with the groups' scales, 1 returned.
template <typename S>
float int8_block_row(uint16_t* w, const int8_t* q, const S* scale, int64_t K, int64_t G, int64_t n, int64_t r) {
  const int8_t* row = q + n * K;
  if (G == K) {
    for (int64_t kb = 0; kb < K / 32; kb++) int8_run_avx512(row + 32 * kb, 1.0f, w + a_offset(r, kb, K), 32);
    return load_float(scale + n);
  }
  const int64_t groups = K / G, per_group = G / 32;
  for (int64_t g = 0, kb = 0; g < groups; g++) {
    const float s = load_float(scale + n * groups + g);
    for (const int64_t end = kb + per_group; kb < end; kb++)
      int8_run_avx512(row + 32 * kb, s, w + a_offset(r, kb, K), 32);
  }
  return 1.0f;
}

template <typename S>
float int4_block_row(uint16_t* w, const uint8_t* packed, const S* scale, const S* offset, int64_t K, int64_t G,
                     int64_t n, int64_t r) {
  const uint8_t* row = packed + n * (K / 2);
  const int64_t groups = K / G, per_group = G / 32;
  for (int64_t g = 0, kb = 0; g < groups; g++) {
    const float s = load_float(scale + n * groups + g), o = load_float(offset + n * groups + g);
    for (const int64_t end = kb + per_group; kb < end; kb++)
      int4_run_avx512(row + 16 * kb, s, o, w + a_offset(r, kb, K), 32);
  }
  return 1.0f;
}

// C tile (16 weight rows x 16 x rows, fp32) into y [M, N] as bf16, each weight row times its `row_scale`.
void store_tile(const float* c, const float* row_scale, at::BFloat16* y, int64_t M, int64_t N, int64_t n0,
                int64_t m0) {
  for (int i = 0; i < 16 && n0 + i < N; i++)
    for (int j = 0; j < 16 && m0 + j < M; j++) y[(m0 + j) * N + n0 + i] = at::BFloat16(c[i * 16 + j] * row_scale[i]);
}

// y = x @ W.T. `dequant(block, n, row)` writes weight row n (< N) as K bf16 values into row `row` of a block in
// A-tile layout (see a_offset) and returns the scale its products take (1 where dequant applied it).
template <typename Dequant>
at::Tensor amx_mm(const at::Tensor& x, int64_t N, int64_t K, Dequant&& dequant) {
  TORCH_CHECK(amx_permitted(), "this process may not use AMX tiles (Linux refused arch_prctl)");
  const int64_t M = x.size(0), kb_count = K / 32, m_blocks = (M + 15) / 16, blocks = (N + kBlockRows - 1) / kBlockRows;
  const auto xb = x.to(at::kBFloat16).contiguous();
  const std::vector<uint32_t> xp = pack_x(xb, m_blocks);
  auto y = at::empty({M, N}, xb.options());
  auto* yp = y.data_ptr<at::BFloat16>();
#pragma omp parallel
  {
    configure_tiles();
    std::vector<uint16_t> w(kBlockRows * K);
    float scales[kBlockRows];
    alignas(64) float c[16 * 16];
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
      const int64_t n0 = b * kBlockRows;
      for (int64_t r = 0; r < kBlockRows; r++) {
        if (n0 + r < N) {
          scales[r] = dequant(w.data(), n0 + r, r);
        } else {
          scales[r] = 0.0f;
          for (int64_t kb = 0; kb < kb_count; kb++) std::memset(w.data() + a_offset(r, kb, K), 0, 64);
        }
      }
      const uint16_t* a0 = w.data();
      const uint16_t* a1 = w.data() + a_offset(16, 0, K);
      for (int64_t mb = 0; mb < m_blocks; mb += 2) {
        const bool pair = mb + 1 < m_blocks;
        const uint32_t* b0 = xp.data() + mb * (K / 2) * 16;
        const uint32_t* b1 = b0 + (K / 2) * 16;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < kb_count; kb++) {
          _tile_loadd(4, a0 + kb * 512, 64);
          _tile_loadd(5, a1 + kb * 512, 64);
          _tile_loadd(6, b0 + kb * 256, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(2, 5, 6);
          if (pair) {
            _tile_loadd(7, b1 + kb * 256, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        const int64_t m0 = mb * 16;
        _tile_stored(0, c, 64);
        store_tile(c, scales, yp, M, N, n0, m0);
        _tile_stored(2, c, 64);
        store_tile(c, scales + 16, yp, M, N, n0 + 16, m0);
        if (pair) {
          _tile_stored(1, c, 64);
          store_tile(c, scales, yp, M, N, n0, m0 + 16);
          _tile_stored(3, c, 64);
          store_tile(c, scales + 16, yp, M, N, n0 + 16, m0 + 16);
        }
      }
    }
    _tile_release();
  }
  return x.scalar_type() == at::kBFloat16 ? y : y.to(x.scalar_type());
}

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.size(0) >= 1 && x.size(1) == K,
              "x must be a float32 or bfloat16 [M, ", K, "] CPU tensor with M >= 1, got ", x.sizes());
}

}  // namespace

// Whether this process may use AMX (asked of Linux once; the CPU's flags say whether it has AMX).
bool amx_usable() { return amx_permitted(); }

// y [M, N] = x [M, K] @ (q * scale).T: scale [N, groups], one group of K per channel.
at::Tensor int8_amx_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  const Int8Weight w8 = int8_weight(q, scale);
  check_x(x, w8.K);
  return dispatch_scale(w8.scale, [&](auto* sp) {
    return amx_mm(x, w8.N, w8.K, [&](uint16_t* w, int64_t n, int64_t r) {
      return int8_block_row(w, w8.q, sp, w8.K, w8.G, n, r);
    });
  });
}

// y [M, N] = x [M, K] @ (q * scale + offset).T, q the nibbles of packed, scale/offset [N, K / G].
at::Tensor int4_amx_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                          const at::Tensor& offset) {
  const Int4Weight w4 = int4_weight(packed, scale, offset);
  check_x(x, w4.K);
  return dispatch_scale(w4.scale, [&](auto* sp) {
    const auto* op = static_cast<decltype(sp)>(w4.offset.data_ptr());
    return amx_mm(x, w4.N, w4.K, [&](uint16_t* w, int64_t n, int64_t r) {
      return int4_block_row(w, w4.packed, sp, op, w4.K, w4.G, n, r);
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_usable", &amx_usable, "whether Linux lets this process use AMX tiles");
  m.def("int8_amx_mm", &int8_amx_mm, "y [M, N] = x [M, K] @ (q * scale).T on AMX, per block of 32 weight rows");
  m.def("int4_amx_mm", &int4_amx_mm, "y [M, N] = x [M, K] @ (q * scale + offset).T on AMX");
}
