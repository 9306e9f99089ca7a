// The row products of bf16 GEMVs (AVX512-BF16): a weight row's dot product with one row of x, or with up to kGemvRows
// rows at once, each an fp32 chain over K rounded to bf16, whatever the other rows. Shared by gemv_bf16
// (cpu_kernels.cpp) and the mixtures of experts (moe_kernels.cpp).
#pragma once

#include <algorithm>

#include "cpu_kernels.h"

// y[1, N] = x[1, K] @ w[N, K]^T with fp32 accumulation. Batch-1 decode is one such product per weight, bound by
// reading the weight, and oneDNN's bf16 path reads it well below the bandwidth. Rows are read front to back, a whole
// row at a time, in a few long sequential streams per thread (for_rows_in_streams): interleaving eight adjacent rows
// with software prefetch had read no faster than oneDNN (`python -m bench.lab.gemv_plans`). K % 32 == 0.
inline uint16_t row_dot_bf16(const uint16_t* x, const uint16_t* w, int64_t K) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();  // two chains hide the dpbf16 latency
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(w + k + 32),
                            (__m512bh)_mm512_loadu_si512(x + k + 32));
  }
  if (k < K) acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
  return to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)));
}

// The same for M <= kGemvRows rows of x (a decode step whose guesses are scored with it): each weight row is read
// once for all of them. It beats oneDNN's packed matmul up to kGemvRows rows; past them it is bound by the dot
// products (`linear.GEMV_ROWS`, `python -m bench.lab.linear_rates`).
constexpr int64_t kGemvRows = 5;

template <int M>
inline void rows_dot_bf16(const uint16_t* x, const uint16_t* w, int64_t K, uint16_t* y, int64_t N) {
  __m512 acc[M];
  for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
    for (int m = 0; m < M; m++) acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512(x + m * K + k));
  }
  for (int m = 0; m < M; m++) y[m * N] = to_bf16(_mm512_reduce_add_ps(acc[m]));
}

// y[m, n] for m < M, n0 <= n < n1: rows n0..n1 of w against all M rows of x, up to kGemvRows of them per read of a
// weight row.
inline void rows_times_block_bf16(const uint16_t* x, int64_t M, const uint16_t* w, int64_t K, uint16_t* y, int64_t N,
                                  int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; m += kGemvRows) {
    const int64_t mr = std::min(kGemvRows, M - m);
    for (int64_t n = n0; n < n1; n++) {
      const uint16_t* xm = x + m * K;
      uint16_t* ym = y + m * N + n;
      switch (mr) {
        case 1: rows_dot_bf16<1>(xm, w + n * K, K, ym, N); break;
        case 2: rows_dot_bf16<2>(xm, w + n * K, K, ym, N); break;
        case 3: rows_dot_bf16<3>(xm, w + n * K, K, ym, N); break;
        case 4: rows_dot_bf16<4>(xm, w + n * K, K, ym, N); break;
        default: rows_dot_bf16<5>(xm, w + n * K, K, ym, N); break;
      }
    }
  }
}
