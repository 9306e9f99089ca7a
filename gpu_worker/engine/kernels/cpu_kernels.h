// What the bf16 CPU kernels share (cpu_kernels.cpp, cpu_attention_kernels.cpp, moe_kernels.cpp, built as one
// module): bf16 conversions, a vectorized exp and softmax, a range's software prefetch, and the attention and
// mixture kernels' declarations.
#pragma once
#include "torch_api.h"
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>

#include "elementwise.h"

using elementwise::kMinParallelElements;

using elementwise::bf16_value;
using elementwise::to_bf16;

// Every 64-byte line of [p, p + bytes) into L1 (T0), or into L2 (T1).
template <int kHint = _MM_HINT_T0>
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(static_cast<const char*>(p) + b, static_cast<_mm_hint>(kHint));
}

// exp for 16 lanes (relative error < 2e-7): std::exp per score dominated the attention kernels.
static inline __m512 exp16(__m512 x) { return elementwise::exp<Avx512>(x); }

// Softmax of s[0, L) in place, in fp32.
// `sink`: one more logit in the softmax with no value behind it (an attention sink), -inf for none.
static inline void softmax_inplace(float* s, int64_t L, float sink = -INFINITY) {
  // The maximum sixteen lanes at a time: std::max_element's serial chain of compares took a quarter of the decode
  // attention kernel's time once its products ran on AMX tiles.
  __m512 lanes = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= L; i += 16) lanes = _mm512_max_ps(lanes, _mm512_loadu_ps(s + i));
  if (i < L) lanes = _mm512_max_ps(lanes, _mm512_mask_loadu_ps(lanes, static_cast<__mmask16>((1u << (L - i)) - 1), s + i));
  const float mx = std::max(_mm512_reduce_max_ps(lanes), sink);
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= L; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), vmx));
    _mm512_storeu_ps(s + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  float sum = _mm512_reduce_add_ps(vsum);
  for (; t < L; t++) sum += (s[t] = std::exp(s[t] - mx));
  sum += std::exp(sink - mx);
  const __m512 inv = _mm512_set1_ps(1.0f / sum);
  t = 0;
  for (; t + 16 <= L; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
  for (; t < L; t++) s[t] *= 1.0f / sum;
}

static inline float bf16_to_float(uint16_t h) { return elementwise::bf16_value(h); }

static inline __m512 load_bf16x16_from(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

static inline __m512 load_bf16x16(const uint16_t* p) {
  return load_bf16x16_from(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

static inline __m256i to_bf16x16(__m512 v) {  // round to nearest even, as to_bf16
  __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

at::Tensor grouped_mm_bf16(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offsets);
at::Tensor moe_silu_bf16(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down,
                         const at::Tensor& weights, const at::Tensor& experts);

// `window`: each decode row's (each prefill row's) sliding window in tokens, itself included; 0 for none.
at::Tensor paged_decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache,
                                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                                          const at::Tensor& context_lens, double scale, int64_t window,
                                          const c10::optional<at::Tensor>& sinks);
at::Tensor paged_decode_attention_int8(const at::Tensor& q, const at::Tensor& kv_data,
                                          const at::Tensor& kv_scale, const at::Tensor& block_tables,
                                          const at::Tensor& context_lens, double scale, int64_t window,
                                          const c10::optional<at::Tensor>& sinks);
void write_kv_int8(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_data, at::Tensor& kv_scale,
                   const at::Tensor& slot_blocks, const at::Tensor& slot_offsets);
at::Tensor gather_int8_bf16(const at::Tensor& kv_data, const at::Tensor& kv_scale, int64_t which,
                               const at::Tensor& block_tables, int64_t length);
#ifndef TOKENFLEET_AMX
void prefill_attention_dpbf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& query_starts, const at::Tensor& query_lens,
                              const at::Tensor& context_lens, const at::Tensor& block_tables, double scale,
                              int64_t window, const c10::optional<at::Tensor>& sinks, at::Tensor& out);
#else
at::Tensor amx_linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                              const c10::optional<at::Tensor>& bias);
void prefill_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& query_starts, const at::Tensor& query_lens,
                            const at::Tensor& context_lens, const at::Tensor& block_tables, double scale,
                            int64_t window, const c10::optional<at::Tensor>& sinks, at::Tensor& out);
#endif
