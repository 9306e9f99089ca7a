// The native bf16 kernels for CPUs without AVX-512 (cpu_kernels needs AVX512-BF16): the element-wise ops of
// elementwise.h on 8-lane AVX2 + FMA vectors, and a decode step's rotary, KV write and attention straight from the
// paged cache in one call. With no bf16 products on these CPUs the attention widens each key and value to fp32 as
// it reads it and computes in fp32, as the float32 reference does (`WidenedDecodeAttention`), where the torch path
// spends most of a batch-1 token gathering the context, upcasting it and in dozens of small ops per layer
// (`python -m bench.lab.avx2_path`).
#include "torch_api.h"

#include <vector>

#include "elementwise.h"
#include "paged_kv.h"

namespace {

using V = Avx2;

// A cache's token-head rows as the kernels read them (row r: [D] values at r * D), eight values at a time as fp32:
// bf16 widened, or int8 times the row's bf16 scale (the context read at one byte a value, never copied).
struct Bf16Rows {
  const uint16_t* k;
  const uint16_t* v;
  int64_t D;
  __m256 key(int64_t r, int64_t d) const { return V::load_bf16(k + r * D + d); }
  __m256 value(int64_t r, int64_t d) const { return V::load_bf16(v + r * D + d); }
};

struct Int8Rows {
  const int8_t* k;
  const int8_t* v;
  const uint16_t* k_scale;
  const uint16_t* v_scale;
  int64_t D;
  static __m256 widen(const int8_t* p, uint16_t scale) {
    const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    return V::mul(x, V::set1(elementwise::bf16_value(scale)));
  }
  __m256 key(int64_t r, int64_t d) const { return widen(k + r * D + d, k_scale[r]); }
  __m256 value(int64_t r, int64_t d) const { return widen(v + r * D + d, v_scale[r]); }
};

// Eight vectors' sums, lane i the sum of v[i].
inline __m256 sum8(const __m256 (&v)[8]) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // ab: v0..v3's low-half sums, then their high-half sums; cd the same for v4..v7.
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// scores[g * L + t] = scale * q_g . key t for G query heads (fp32, [G, D]), eight keys at a time: each key row
// widened once into `rows`, then each head's eight products summed together (one reduction per eight scores).
template <class Rows>
void score(const float* qf, int64_t G, int64_t D, const Rows& cache, const int64_t* token_rows, int64_t L,
           float scale, float* rows, float* scores) {
  for (int64_t t0 = 0; t0 < L; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, L - t0);
    for (int64_t i = 0; i < 8; i++)
      for (int64_t d = 0; d < D; d += 8)
        V::store(rows + i * D + d, i < n ? cache.key(token_rows[t0 + i], d) : V::set1(0.0f));
    for (int64_t g = 0; g < G; g++) {
      __m256 acc[8];
      for (auto& a : acc) a = V::set1(0.0f);
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qf + g * D + d);
        for (int64_t i = 0; i < 8; i++) acc[i] = V::fmadd(qv, _mm256_loadu_ps(rows + i * D + d), acc[i]);
      }
      alignas(32) float s[8];
      V::store(s, V::mul(sum8(acc), V::set1(scale)));
      std::copy(s, s + n, scores + g * L + t0);
    }
  }
}

// Softmax of s[0, L) in place, exact (two passes) in fp32.
// `sink`: one more logit in the softmax with no value behind it (an attention sink), -inf for none.
void softmax(float* s, int64_t L, float sink) {
  float mx = sink;
  for (int64_t t = 0; t < L; t++) mx = std::max(mx, s[t]);
  auto sum = V::set1(0.0f);
  int64_t t = 0;
  for (; t + 8 <= L; t += 8) {
    const __m256 e = elementwise::exp<V>(V::sub(_mm256_loadu_ps(s + t), V::set1(mx)));
    V::store(s + t, e);
    sum = V::add(sum, e);
  }
  float total = V::reduce_add(sum);
  for (; t < L; t++) total += (s[t] = std::exp(s[t] - mx));
  total += std::exp(sink - mx);
  for (t = 0; t < L; t++) s[t] /= total;
}

// out[g][d0, d0 + 8 kChunks) = sum over t of p[g][t] * value t, for kHeads heads from p's first row: each value
// chunk widened once for all the heads, the sums kept in registers (kHeads * kChunks of them, plus the chunks).
template <int kHeads, int kChunks, class Rows>
void attend_values(const float* p, int64_t L, const Rows& cache, const int64_t* token_rows, int64_t D, int64_t d0,
                   uint16_t* out) {
  __m256 acc[kHeads][kChunks];
  for (auto& head : acc)
    for (auto& a : head) a = V::set1(0.0f);
  for (int64_t t = 0; t < L; t++) {
    __m256 v[kChunks];
    for (int c = 0; c < kChunks; c++) v[c] = cache.value(token_rows[t], d0 + 8 * c);
    for (int g = 0; g < kHeads; g++) {
      const __m256 weight = V::set1(p[g * L + t]);
      for (int c = 0; c < kChunks; c++) acc[g][c] = V::fmadd(weight, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < kHeads; g++)
    for (int c = 0; c < kChunks; c++) V::store_bf16(out + g * D + d0 + 8 * c, acc[g][c]);
}

// Decode attention straight from the paged cache (paged_kv::DecodeBatch says its tasks): scores eight keys at a
// time, an exact (two-pass) fp32 softmax, then the value sums. With a sliding window (> 0) a task reads only the
// keys its row sees, from the first on: the window's cost, not the context's.
template <class Rows>
at::Tensor paged_decode(const at::Tensor& q, const Rows& cache, int64_t KVH, int64_t block_size,
                           const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                           int64_t window, const c10::optional<at::Tensor>& sinks) {
  const paged_kv::DecodeBatch batch(q, KVH, block_size, block_tables, context_lens, window, sinks);
  const int64_t G = batch.G, D = batch.D;
#pragma omp parallel
  {
    std::vector<float> qf(G * D), rows(8 * D), scores;
    std::vector<int64_t> token_rows;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < batch.tasks(); task++) {
      batch.list_task_rows(task, batch.first_key(task), token_rows);  // the keys the row sees
      const int64_t L = static_cast<int64_t>(token_rows.size());
      const uint16_t* qb = batch.queries(q, task);
      for (int64_t i = 0; i < G * D; i++) qf[i] = elementwise::bf16_value(qb[i]);
      scores.resize(G * L);
      score(qf.data(), G, D, cache, token_rows.data(), L, static_cast<float>(scale), rows.data(), scores.data());
      for (int64_t g = 0; g < G; g++) softmax(scores.data() + g * L, L, batch.sink(task, g));
      uint16_t* ob = batch.outputs(task);
      for (int64_t g = 0; g < G; g += 3) {  // three heads at a time over 16 columns, fewer over 32
        const float* p = scores.data() + g * L;
        const int64_t heads = std::min<int64_t>(3, G - g);
        for (int64_t d0 = 0; d0 < D; d0 += heads == 3 ? 16 : 32) {
          if (heads == 3) attend_values<3, 2>(p, L, cache, token_rows.data(), D, d0, ob + g * D);
          else if (heads == 2) attend_values<2, 4>(p, L, cache, token_rows.data(), D, d0, ob + g * D);
          else attend_values<1, 4>(p, L, cache, token_rows.data(), D, d0, ob + g * D);
        }
      }
    }
  }
  return batch.out;
}

at::Tensor paged_decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache,
                                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                                          const at::Tensor& context_lens, double scale, int64_t window,
                                          const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  const Bf16Rows cache{static_cast<const uint16_t*>(k_cache.data_ptr()),
                       static_cast<const uint16_t*>(v_cache.data_ptr()), q.size(2)};
  return paged_decode(q, cache, k_cache.size(1), k_cache.size(2), block_tables, context_lens, scale, window, sinks);
}

// The int8 cache's planes as rows (paged_kv::check_int8_cache says their layout).
Int8Rows int8_rows(const at::Tensor& kv_data, const at::Tensor& kv_scale) {
  paged_kv::check_int8_cache(kv_data, kv_scale);
  const auto* data = kv_data.data_ptr<int8_t>();
  const auto* scales = static_cast<const uint16_t*>(kv_scale.data_ptr());
  return {data, data + kv_data[0].numel(), scales, scales + kv_scale[0].numel(), kv_data.size(4)};
}

at::Tensor paged_decode_attention_int8(const at::Tensor& q, const at::Tensor& kv_data,
                                          const at::Tensor& kv_scale, const at::Tensor& block_tables,
                                          const at::Tensor& context_lens, double scale, int64_t window,
                                          const c10::optional<at::Tensor>& sinks) {
  return paged_decode(q, int8_rows(kv_data, kv_scale), kv_data.size(2), kv_data.size(3), block_tables, context_lens,
                      scale, window, sinks);
}

// One row x [D] bf16 as int8 with its bf16 scale, exactly as the reference quantize_per_row: scale =
// bf16(max(max |x| / 127, 1e-8)), q = round-half-even(x / scale) within +-127.
void quantize_row(const uint16_t* x, int64_t D, int8_t* q, uint16_t* scale) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 peak = V::set1(0.0f);
  for (int64_t d = 0; d < D; d += 8) peak = V::max(peak, _mm256_and_ps(V::load_bf16(x + d), magnitude));
  alignas(32) float lanes[8];
  V::store(lanes, peak);
  const uint16_t s = elementwise::to_bf16(std::max(*std::max_element(lanes, lanes + 8) / 127.0f, 1e-8f));
  const __m256 sv = V::set1(elementwise::bf16_value(s));
  for (int64_t d = 0; d < D; d += 8) {
    __m256i r = _mm256_cvtps_epi32(V::div(V::load_bf16(x + d), sv));
    r = _mm256_max_epi32(_mm256_min_epi32(r, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r, r), _mm256_setzero_si256());  // 4 per 128 bits
    const __m128i eight = _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + d), eight);
  }
  *scale = s;
}

// One int8 row times its scale as bf16, for paged_kv::gather_int8_rows.
void dequantize_row(const int8_t* q, uint16_t scale, int64_t D, uint16_t* out) {
  for (int64_t d = 0; d < D; d += 8) V::store_bf16(out + d, Int8Rows::widen(q + d, scale));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  elementwise::bind<V>(m);
  m.def("paged_decode_attention_bf16", &paged_decode_attention_bf16);
  m.def("write_kv_bf16", &paged_kv::write_rows);
  m.def("decode_step_bf16", &paged_kv::decode_step_bf16<V, &paged_decode_attention_bf16>);
  m.def("paged_decode_attention_int8", &paged_decode_attention_int8);
  m.def("write_kv_int8", &paged_kv::write_int8_rows<&quantize_row>);
  m.def("gather_int8_bf16", &paged_kv::gather_int8_rows<&dequantize_row>);
  m.def("decode_step_int8",
        &paged_kv::decode_step_int8<V, &paged_kv::write_int8_rows<&quantize_row>, &paged_decode_attention_int8>);
}
