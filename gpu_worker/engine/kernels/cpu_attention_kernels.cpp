// Paged KV writes and decode attention on CPU, for a bf16 cache and an int8 one (a scale per token and head),
// checked against their torch references in tests/gpu_worker/engine/test_cpu_kernels.py and test_kv_cache_int8.py.
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "decode_rows.h"
#include "paged_kv.h"
#include "sum16.h"
#ifdef TOKENFLEET_AMX
#include "amx_tiles.h"
#endif

namespace {

constexpr int64_t kL2Ahead = 128;  // tokens ahead to fetch into L2 (see paged_decode)
constexpr int64_t kPageAhead = 64;  // tokens ahead to touch each page of keys and values (see paged_decode)
constexpr int64_t kPageBytes = 4096;

using decode_rows::Bf16Rows;
using decode_rows::Int8Rows;
using decode_rows::kPrefetchAhead;

#ifdef TOKENFLEET_AMX
// Scores on AMX (built where the CPU has it): a task's G query heads as B tiles 4.., one per 32 dims,
// b[h][kp][2g + j] = q[g][32h + 2kp + j] (heads past G zero), loaded once per task; sixteen keys a tile A straight
// from the cache (16 rows at its row stride), two such groups at a time (tiles 2 and 3 into accumulators 0 and 1):
// C[key][head] summed over the dims. Not reloading the query for every group, nor waiting on one group's products
// before loading the next, saves kernel time with the context in cache (`python -m bench.lab.decode_parts`).
struct QueryTiles {
  std::vector<uint16_t> b;
  int64_t D = 0, G = 0;

  void load(const uint16_t* q, int64_t heads, int64_t dim) {
    G = heads, D = dim;
    b.assign(D / 32 * 512, 0);
    for (int64_t g = 0; g < G; g++)
      for (int64_t d = 0; d < D; d++) b[(d / 32) * 512 + (d % 32) / 2 * 32 + 2 * g + d % 2] = q[g * D + d];
    for (int64_t h = 0; h < D / 32; h++) {
      const uint16_t* tile = b.data() + h * 512;
      switch (h) {  // tile numbers are immediates (GCC spells them into the instruction's text)
        case 0: _tile_loadd(4, tile, 64); break;
        case 1: _tile_loadd(5, tile, 64); break;
        case 2: _tile_loadd(6, tile, 64); break;
        default: _tile_loadd(7, tile, 64); break;
      }
    }
  }

  // The products of n <= 32 keys with the query heads into accumulators 0 and 1, where the tile unit computes them
  // while the core goes on: keys 0-15 the rows from `first`, 16-31 from `second` (each sixteen rows of one block).
  void issue32(const uint16_t* first, const uint16_t* second, int64_t n) const {
    const bool two = n > 16;
    _tile_zero(0);
    if (two) _tile_zero(1);
#define TOKENFLEET_ACCUMULATE(query_tile, d)  \
  _tile_loadd(2, first + (d), D * 2);         \
  _tile_dpbf16ps(0, 2, query_tile);           \
  if (two) {                                  \
    _tile_loadd(3, second + (d), D * 2);      \
    _tile_dpbf16ps(1, 3, query_tile);         \
  }
    TOKENFLEET_ACCUMULATE(4, 0)
    if (D > 32) { TOKENFLEET_ACCUMULATE(5, 32) }
    if (D > 64) { TOKENFLEET_ACCUMULATE(6, 64) }
    if (D > 96) { TOKENFLEET_ACCUMULATE(7, 96) }
#undef TOKENFLEET_ACCUMULATE
  }

  // scores[g * L + i] = scale * (q_g . key i) for the n keys issue32 was given, out of the accumulators.
  void collect32(float scale, int64_t n, float* scores, int64_t L) const {
    const bool two = n > 16;
    alignas(64) float c[2][16 * 16];
    _tile_stored(0, c[0], 64);
    if (two) _tile_stored(1, c[1], 64);
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));
    const __m512 ks = _mm512_set1_ps(scale);
    for (int64_t half = 0; half < (two ? 2 : 1); half++) {
      const int64_t m = std::min<int64_t>(16, n - 16 * half);
      for (int64_t g = 0; g < G; g++)
        _mm512_mask_storeu_ps(scores + g * L + 16 * half, static_cast<__mmask16>((1u << m) - 1),
                              _mm512_mul_ps(_mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(g)), c[half], 4), ks));
    }
  }

};

// A softmax over a task's tokens 32 at a time (flash decoding's online softmax): each chunk's scores to bf16
// probabilities relative to the running maximum, the sums so far (acc, in accumulate_values' order) rescaled when it
// rises.
struct OnlineSoftmax {
  alignas(64) float scores[16 * 32];  // [head][token of the chunk]
  alignas(64) uint16_t pairs[16 * 32];
  float max[16], sum[16];
  int64_t G, D;

  // `sink(g)`: head g's sink logit (-inf for none), its share of the softmax from the start: exp(sink - max).
  template <typename Sink>
  OnlineSoftmax(int64_t heads, int64_t dim, Sink&& sink) : G(heads), D(dim) {
    for (int64_t g = 0; g < G; g++) {
      max[g] = sink(g);
      sum[g] = max[g] == -INFINITY ? 0.0f : 1.0f;
    }
  }

  // `skip` (< 16): the chunk's leading keys the row does not see (before its sliding window), left out.
  void take(int64_t n, float* acc, int64_t skip = 0) {
    const __mmask16 m0 = static_cast<__mmask16>((n >= 16 ? 0xffff : (1u << n) - 1) & ~((1u << skip) - 1));
    const __mmask16 m1 = static_cast<__mmask16>(n >= 32 ? 0xffff : n > 16 ? (1u << (n - 16)) - 1 : 0);
    for (int64_t g = 0; g < G; g++) {
      const __m512 s0 = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m0, scores + g * 32);
      const __m512 s1 = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m1, scores + g * 32 + 16);
      const float top = std::max(max[g], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
      if (top > max[g]) {
        const float shrink = std::exp(max[g] - top);
        const __m512 f = _mm512_set1_ps(shrink);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(acc + g * D + d, _mm512_mul_ps(f, _mm512_loadu_ps(acc + g * D + d)));
        sum[g] *= shrink;
        max[g] = top;
      }
      const __m512 vtop = _mm512_set1_ps(top);
      const __m512 e0 = _mm512_maskz_mov_ps(m0, exp16(_mm512_sub_ps(s0, vtop)));
      const __m512 e1 = _mm512_maskz_mov_ps(m1, exp16(_mm512_sub_ps(s1, vtop)));
      sum[g] += _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + g * 32), (__m256i)_mm512_cvtneps_pbh(e0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + g * 32 + 16), (__m256i)_mm512_cvtneps_pbh(e1));
    }
  }
};

// One task (a sequence's KV head and its G query heads) with the scores on tiles, 32 tokens at a time: a chunk's keys
// scored, its probabilities taken (OnlineSoftmax), its values summed, then the next chunk's. The keys and the values
// stream together so, where scoring every key before reading any value had streamed one then the other: faster from
// DRAM, the same in cache (`python -m bench.lab.decode_parts`). token_rows start at a multiple of 16 tokens, so that
// each tile's sixteen keys lie in one block; with a sliding window the first `skip` of them are before it, masked.
template <typename Sink>
void attend_on_tiles(const QueryTiles& query_tiles, const Bf16Rows& rows, const std::vector<int64_t>& token_rows,
                     int64_t skip, float scale, Sink&& sink, std::vector<float>& acc, uint16_t* out) {
  const int64_t L = static_cast<int64_t>(token_rows.size()), G = query_tiles.G, D = query_tiles.D;
  const int64_t row_bytes = D * Bf16Rows::kBytes;
  const auto* k_bytes = reinterpret_cast<const char*>(rows.k);
  const auto* v_bytes = reinterpret_cast<const char*>(rows.v);
  // One line of each 4 KiB page of keys and of values, kPageAhead tokens ahead of the tiles, into L2: the L2
  // streamer, which does not cross pages, starts on each page then, without holding the core's few fill buffers as
  // prefetching every line into L2 does (which slowed the kernel). Faster from DRAM here and in the two-pass kernel;
  // two lines a page no better, nor 32, 96 or 128 tokens ahead (`python -m bench.lab.decode_parts`).
  const int64_t tokens_per_page = std::max<int64_t>(1, kPageBytes / row_bytes);
  const auto touch_pages = [&](int64_t from, int64_t to) {
    for (int64_t t = from; t < std::min(L, to); t += tokens_per_page) {
      _mm_prefetch(k_bytes + token_rows[t] * row_bytes, _MM_HINT_T1);
      _mm_prefetch(v_bytes + token_rows[t] * row_bytes, _MM_HINT_T1);
    }
  };
  std::fill(acc.begin(), acc.end(), 0.0f);
  OnlineSoftmax online(G, D, sink);
  touch_pages(0, kPageAhead);
  // A chunk's products are issued to the tile unit before the previous chunk's values are summed, so the tiles (and
  // their key loads) work while the core sums: the same bits, a layer faster from DRAM and in cache
  // (`python -m bench.lab.decode_parts`). Into L1 before each issue, the keys the tiles load next (a tile load that
  // misses stalls); 8 or 32 tokens ahead, or the chunk's values before its keys are scored, no better.
  const auto issue = [&](int64_t t0) {
    for (int64_t t = t0 + kPrefetchAhead; t < std::min(L, t0 + 32 + kPrefetchAhead); t++)
      prefetch(k_bytes + token_rows[t] * row_bytes, row_bytes);
    touch_pages(t0 + kPageAhead, t0 + 32 + kPageAhead);
    const int64_t n = std::min<int64_t>(32, L - t0);
    query_tiles.issue32(rows.k + token_rows[t0] * D, n > 16 ? rows.k + token_rows[t0 + 16] * D : nullptr, n);
  };
  issue(0);
  for (int64_t t0 = 0; t0 < L; t0 += 32) {
    const int64_t n = std::min<int64_t>(32, L - t0);
    query_tiles.collect32(scale, n, online.scores, 32);
    online.take(n, acc.data(), t0 == 0 ? skip : 0);
    if (t0 + 32 < L) issue(t0 + 32);
    rows.accumulate_values(online.pairs, 32, t0, t0 + n, L, G, token_rows.data(), acc.data());
  }
  for (int64_t g = 0; g < G; g++) {
    rows.unpermute_columns(acc.data() + g * D);
    const float inv = 1.0f / online.sum[g];
    for (int64_t d = 0; d < D; d++) out[g * D + d] = to_bf16(acc[g * D + d] * inv);
  }
}

// Whether this call's bf16 scores go through tiles: Linux lets this process use them, the query groups fit a tile's
// 16 columns, the query's dims its four tiles, and blocks hold whole tiles of keys.
bool tiles_serve(int64_t G, int64_t D, int64_t block_size) {
  return G <= 16 && D <= 128 && block_size % 16 == 0 && amx_permitted();
}
#endif

// Decode attention straight from the paged cache (paged_kv::DecodeBatch says its tasks): each (sequence, KV head)
// reads that head's keys and values block by block through the block table, once for all query heads of its group,
// with an exact (two-pass) softmax in fp32, or on AMX tiles in one pass with an online softmax (attend_on_tiles).
// The torch path first gathers every context into a padded copy, then attends over the copy. Rows over [blocks, KVH,
// block_size]. With a sliding window a task reads from its first visible key on: its cost is the window's, not the
// context's, and the freed blocks before it are never read.
template <typename Rows>
at::Tensor paged_decode(const at::Tensor& q, const Rows& rows, int64_t KVH, int64_t block_size,
                           const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                           int64_t window, const c10::optional<at::Tensor>& sinks) {
  const paged_kv::DecodeBatch batch(q, KVH, block_size, block_tables, context_lens, window, sinks);
  const int64_t G = batch.G, D = batch.D, row_bytes = D * Rows::kBytes;
#ifdef TOKENFLEET_AMX
  const bool tiles = std::is_same_v<Rows, Bf16Rows> && tiles_serve(G, D, block_size);
#endif
#pragma omp parallel
  {
    std::vector<float> scores, acc, qf(G * D);
    std::vector<__m512> dots(16 * G);  // [head][16 keys]: products still to be summed
    std::vector<int64_t> token_rows;
    std::vector<uint16_t> pairs;
#ifdef TOKENFLEET_AMX
    QueryTiles query_tiles;
    if (tiles) configure_tiles();
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < batch.tasks(); task++) {
      const int64_t first = batch.first_key(task);
      acc.resize(G * D);
      const uint16_t* qb = batch.queries(q, task);
      if constexpr (std::is_same_v<Rows, Int8Rows>)  // fp32 products with the dequantized keys
        for (int64_t i = 0; i < G * D; i++) qf[i] = bf16_to_float(qb[i]);
      const auto* k_bytes = reinterpret_cast<const char*>(rows.k);
      const auto* v_bytes = reinterpret_cast<const char*>(rows.v);
#ifdef TOKENFLEET_AMX
      if constexpr (std::is_same_v<Rows, Bf16Rows>) {
        if (tiles) {
          // From the multiple of 16 at or before the first key: the same block (block_size % 16 == 0).
          const int64_t aligned = first & ~int64_t{15};
          batch.list_task_rows(task, aligned, token_rows);
          query_tiles.load(qb, G, D);
          attend_on_tiles(query_tiles, rows, token_rows, first - aligned, static_cast<float>(scale),
                          [&](int64_t g) { return batch.sink(task, g); }, acc, batch.outputs(task));
          continue;
        }
      }
#endif
      batch.list_task_rows(task, first, token_rows);  // the keys the row sees, token_rows[t] the t-th of them
      const int64_t L = static_cast<int64_t>(token_rows.size());
      const auto row = [&](int64_t t) { return token_rows[t]; };
      scores.resize(G * L);  // the two-pass softmax's, over all the keys the row sees
      // Into L2 while the keys are scored: each scored token's value row, for the value pass after the softmax, and
      // the key row kL2Ahead on (the first kL2Ahead at once). The value pass then hits L2 and the key stream stays
      // ahead of the products: the kernel reads the context as fast as reading the same rows alone does, where it
      // had read it well below; 128 tokens ahead rather than 64 faster still from DRAM
      // (`python -m bench.lab.decode_parts`).
      for (int64_t t = 0; t < std::min(L, kL2Ahead); t++) prefetch<_MM_HINT_T1>(k_bytes + row(t) * row_bytes, row_bytes);
      // Scores sixteen tokens at a time, their dot products summed together (sum16): one reduction per token
      // and head took most of the kernel's time at short contexts.
      for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, L - t0);
        int64_t r[16];
        alignas(64) float key_scale[16] = {};
        for (int64_t i = 0; i < n; i++) {
          const int64_t t = t0 + i;
          r[i] = row(t);
          key_scale[i] = rows.key_scale(r[i]) * static_cast<float>(scale);
          if (t + kPrefetchAhead < L) prefetch(k_bytes + row(t + kPrefetchAhead) * row_bytes, row_bytes);
          prefetch<_MM_HINT_T1>(v_bytes + r[i] * row_bytes, row_bytes);
          if (t + kL2Ahead < L) prefetch<_MM_HINT_T1>(k_bytes + row(t + kL2Ahead) * row_bytes, row_bytes);
        }
        for (int64_t i = 0; i < n; i++) rows.dots(qb, qf.data(), r[i], G, dots.data() + i);
        for (int64_t g = 0; g < G; g++) {
          __m512(&group)[16] = *reinterpret_cast<__m512(*)[16]>(dots.data() + 16 * g);
          for (int64_t i = n; i < 16; i++) group[i] = _mm512_setzero_ps();
          _mm512_mask_storeu_ps(scores.data() + g * L + t0, static_cast<__mmask16>((1u << n) - 1),
                                _mm512_mul_ps(sum16(group), _mm512_load_ps(key_scale)));
        }
      }
      for (int64_t g = 0; g < G; g++) softmax_inplace(scores.data() + g * L, L, batch.sink(task, g));
      rows.attend_values(scores.data(), L, G, token_rows.data(), acc.data(), pairs);
      uint16_t* out = batch.outputs(task);
      for (int64_t i = 0; i < G * D; i++) out[i] = to_bf16(acc[i]);
    }
#ifdef TOKENFLEET_AMX
    if (tiles) _tile_release();
#endif
  }
  return batch.out;
}

// One row x [D] bf16 as int8 with its bf16 scale, exactly as the reference quantize_per_row: scale =
// bf16(max(max |x| / 127, 1e-8)), q = round-half-even(x / scale) within +-127.
void quantize_row(const uint16_t* x, int64_t D, int8_t* q, uint16_t* scale) {
  __m512 peak = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) peak = _mm512_max_ps(peak, _mm512_abs_ps(load_bf16x16(x + d)));
  const uint16_t s = to_bf16(std::max(_mm512_reduce_max_ps(peak) / 127.0f, 1e-8f));
  const __m512 sv = _mm512_set1_ps(bf16_to_float(s));
  for (int64_t d = 0; d < D; d += 16) {
    __m512i r = _mm512_cvtps_epi32(_mm512_div_ps(load_bf16x16(x + d), sv));
    r = _mm512_max_epi32(_mm512_min_epi32(r, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + d), _mm512_cvtepi32_epi8(r));
  }
  *scale = s;
}

// One int8 row times its scale as bf16, for paged_kv::gather_int8_rows.
void dequantize_row(const int8_t* q, uint16_t scale, int64_t D, uint16_t* out) {
  const __m512 s = _mm512_set1_ps(bf16_to_float(scale));
  for (int64_t d = 0; d < D; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), to_bf16x16(_mm512_mul_ps(Int8Rows::int8x16(q + d), s)));
}

}  // namespace

at::Tensor paged_decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache,
                                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                                          const at::Tensor& context_lens, double scale, int64_t window,
                                          const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  const Bf16Rows rows{static_cast<const uint16_t*>(k_cache.data_ptr()),
                      static_cast<const uint16_t*>(v_cache.data_ptr()), q.size(2)};
  return paged_decode(q, rows, k_cache.size(1), k_cache.size(2), block_tables, context_lens, scale, window, sinks);
}

// kv_data: int8 [2, blocks, KVH, block_size, D] (keys, values); kv_scale: bf16 [2, blocks, KVH, block_size].
at::Tensor paged_decode_attention_int8(const at::Tensor& q, const at::Tensor& kv_data,
                                          const at::Tensor& kv_scale, const at::Tensor& block_tables,
                                          const at::Tensor& context_lens, double scale, int64_t window,
                                          const c10::optional<at::Tensor>& sinks) {
  paged_kv::check_int8_cache(kv_data, kv_scale);
  const auto* data = kv_data.data_ptr<int8_t>();
  const auto* scales = static_cast<const uint16_t*>(kv_scale.data_ptr());
  const Int8Rows rows{data, data + kv_data[0].numel(), scales, scales + kv_scale[0].numel(), q.size(2)};
  return paged_decode(q, rows, kv_data.size(2), kv_data.size(3), block_tables, context_lens, scale, window, sinks);
}

void write_kv_int8(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_data, at::Tensor& kv_scale,
                   const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  paged_kv::write_int8_rows<&quantize_row>(k, v, kv_data, kv_scale, slot_blocks, slot_offsets);
}

at::Tensor gather_int8_bf16(const at::Tensor& kv_data, const at::Tensor& kv_scale, int64_t which,
                               const at::Tensor& block_tables, int64_t length) {
  return paged_kv::gather_int8_rows<&dequantize_row>(kv_data, kv_scale, which, block_tables, length);
}
