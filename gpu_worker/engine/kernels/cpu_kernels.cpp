// CPU kernels for bf16 serving (AVX512-BF16): GEMVs, batch-invariant mode's product and, from elementwise.h, the
// element-wise ops; each checked against its torch reference in tests/gpu_worker/engine/test_cpu_kernels.py.
#include <omp.h>

#include <vector>

#include "bf16_rows.h"
#include "cpu_kernels.h"
#include "paged_kv.h"
#include "sum16.h"
#ifdef TOKENFLEET_AMX
#include "amx_tiles.h"
#endif

// Each thread takes one contiguous range of the N weight rows and reads it as `streams` sequential streams, a row
// from each in turn, asking for each stream's row `prefetch_rows` ahead (0: none) as it starts on a row. The
// caller's plan (linear.py's GemvPlan) is chosen by the CPU's family, where its batch-1 decode reads the nearest the
// bandwidth (`python -m bench.lab.gemv_plans`). The plan changes which rows a thread reads when, never a row's sum.
template <typename F>
static void for_rows_in_streams(int64_t N, int64_t row_bytes, const uint16_t* w, int64_t streams,
                                int64_t prefetch_rows, F&& row) {
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t first = N * t / threads, last = N * (t + 1) / threads;
    const int64_t part = (last - first + streams - 1) / streams;
    const auto* bytes = reinterpret_cast<const char*>(w);
    for (int64_t i = 0; i < part; i++)
      for (int64_t s = 0; s < streams; s++) {
        const int64_t n = first + s * part + i;
        if (n >= last) continue;
        if (prefetch_rows && i + prefetch_rows < part && n + prefetch_rows < last)
          prefetch(bytes + (n + prefetch_rows) * row_bytes, row_bytes);
        row(n);
      }
  }
}

template <int M>
static void gemv_rows_bf16(const uint16_t* xp, const uint16_t* wp, uint16_t* yp, int64_t N, int64_t K,
                           int64_t streams, int64_t prefetch_rows) {
  for_rows_in_streams(N, K * 2, wp, streams, prefetch_rows, [&](int64_t n) {
    if constexpr (M == 1) yp[n] = row_dot_bf16(xp, wp + n * K, K);
    else rows_dot_bf16<M>(xp, wp + n * K, K, yp + n, N);
  });
}

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w, int64_t streams, int64_t prefetch_rows) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kGemvRows && x.is_contiguous(),
              "x must be [M, K] contiguous, 1 <= M <= ", kGemvRows);
  TORCH_CHECK(w.is_contiguous() && w.size(1) == x.size(1) && w.size(1) % 32 == 0, "w must be [N, K], K % 32 == 0");
  TORCH_CHECK(streams >= 1 && prefetch_rows >= 0, "streams >= 1, prefetch_rows >= 0");
  const int64_t M = x.size(0), K = w.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = static_cast<const uint16_t*>(w.data_ptr());
  auto* yp = static_cast<uint16_t*>(y.data_ptr());
  switch (M) {
    case 1: gemv_rows_bf16<1>(xp, wp, yp, N, K, streams, prefetch_rows); break;
    case 2: gemv_rows_bf16<2>(xp, wp, yp, N, K, streams, prefetch_rows); break;
    case 3: gemv_rows_bf16<3>(xp, wp, yp, N, K, streams, prefetch_rows); break;
    case 4: gemv_rows_bf16<4>(xp, wp, yp, N, K, streams, prefetch_rows); break;
    default: gemv_rows_bf16<5>(xp, wp, yp, N, K, streams, prefetch_rows); break;
  }
  return y;
}

// Batch-invariant mode's product, y[M, N] = x[M, K] @ w[N, K]^T for any M, each output summed in one order whatever
// M and whatever tile computes it, so that a row's result does not depend on the other rows: one fp32 chain over K
// in steps of 32, then sum16's tree across its lanes. A tile of MR rows of x by NR rows of w (MR * NR <= 16) shares
// each load and reduces its sums together; its shape changes which sums run side by side, never how one is summed
// (sum16 adds each vector's lanes in the same tree wherever it sits, an unused slot holding zeros). K % 32 == 0.
template <int MR, int NR>
static inline void tile_dot_bf16(const uint16_t* x, const uint16_t* w, int64_t K, uint16_t* y, int64_t N) {
  static_assert(MR * NR <= 16);
  __m512 acc[16];
  for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
  if constexpr (MR == 1) {  // one row of x (a decode): rows of w one after another, whole rows as gemv_bf16 reads
    for (int n = 0; n < NR; n++)
      for (int64_t k = 0; k < K; k += 32)
        acc[n] = _mm512_dpbf16_ps(acc[n], (__m512bh)_mm512_loadu_si512(w + n * K + k),
                                  (__m512bh)_mm512_loadu_si512(x + k));
  } else {
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh wv[NR];
      for (int n = 0; n < NR; n++) wv[n] = (__m512bh)_mm512_loadu_si512(w + n * K + k);
      for (int m = 0; m < MR; m++) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
        for (int n = 0; n < NR; n++) acc[m * NR + n] = _mm512_dpbf16_ps(acc[m * NR + n], wv[n], xv);
      }
    }
  }
  alignas(32) uint16_t sums[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums), to_bf16x16(sum16(acc)));
  for (int m = 0; m < MR; m++) std::memcpy(y + m * N, sums + m * NR, NR * sizeof(uint16_t));
}

// The MR-row tile over the next `nr` rows of w: NR = 16 / MR of them, fewer at a block's end.
template <int MR, int NR = 16 / MR>
static inline void tile_rows_bf16(int64_t nr, const uint16_t* x, const uint16_t* w, int64_t K, uint16_t* y, int64_t N) {
  if constexpr (NR > 1) {
    if (nr < NR) return tile_rows_bf16<MR, NR - 1>(nr, x, w, K, y, N);
  }
  tile_dot_bf16<MR, NR>(x, w, K, y, N);
}

// y[:, n0:n1] = x[M, K] @ w[n0:n1, K]^T, the batch-invariant tiles over one block of w's rows: each thread's unit of
// work, passing all of x over the block while it is in cache.
static void mm_block_bf16(const uint16_t* xp, int64_t M, const uint16_t* wp, int64_t K, uint16_t* yp, int64_t N,
                          int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; m += 4) {
    const int64_t mr = std::min<int64_t>(4, M - m), wide = 16 / mr;
    for (int64_t n = n0; n < n1; n += wide) {
      const int64_t nr = std::min(wide, n1 - n);
      const uint16_t* xm = xp + m * K;
      const uint16_t* wn = wp + n * K;
      uint16_t* ym = yp + m * N + n;
      switch (mr) {
        case 1: tile_rows_bf16<1>(nr, xm, wn, K, ym, N); break;
        case 2: tile_rows_bf16<2>(nr, xm, wn, K, ym, N); break;
        case 3: tile_rows_bf16<3>(nr, xm, wn, K, ym, N); break;
        default: tile_rows_bf16<4>(nr, xm, wn, K, ym, N); break;
      }
    }
  }
}

constexpr int64_t kBlockN = 16;

at::Tensor rowwise_mm_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x must be [M, K] contiguous bf16");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kBFloat16 && w.size(1) == x.size(1) && w.size(1) % 32 == 0,
              "w must be [N, K] contiguous bf16, K % 32 == 0");
  const int64_t M = x.size(0), K = w.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = static_cast<const uint16_t*>(w.data_ptr());
  auto* yp = static_cast<uint16_t*>(y.data_ptr());
#pragma omp parallel for schedule(static)
  for (int64_t block = 0; block < (N + kBlockN - 1) / kBlockN; block++)
    mm_block_bf16(xp, M, wp, K, yp, N, block * kBlockN, std::min(N, (block + 1) * kBlockN));
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  elementwise::bind<Avx512>(m);
  m.def("gemv_bf16", &gemv_bf16);
  m.def("rowwise_mm_bf16", &rowwise_mm_bf16);
  m.def("grouped_mm_bf16", &grouped_mm_bf16);
  m.def("moe_silu_bf16", &moe_silu_bf16);
  m.def("paged_decode_attention_bf16", &paged_decode_attention_bf16);
  m.def("write_kv_bf16", &paged_kv::write_rows);
  m.def("paged_decode_attention_int8", &paged_decode_attention_int8);
  m.def("write_kv_int8", &write_kv_int8);
  m.def("gather_int8_bf16", &gather_int8_bf16);
  m.def("decode_step_bf16", &paged_kv::decode_step_bf16<Avx512, &paged_decode_attention_bf16>);
  m.def("decode_step_int8", &paged_kv::decode_step_int8<Avx512, &write_kv_int8, &paged_decode_attention_int8>);
#ifdef TOKENFLEET_AMX
  m.def("amx_usable", &amx_permitted, "whether Linux lets this process use AMX tiles");
  m.def("prefill_attention_bf16", &prefill_attention_bf16);
  m.def("amx_linear_bf16", &amx_linear_bf16, "y = x @ W.T (+ bias) on AMX tiles over oneDNN's packed weight");
#else
  m.def("prefill_attention_bf16", &prefill_attention_dpbf16);
#endif
}
