// Prefill attention on AMX tiles, straight from the paged bf16 cache: every prefill chunk of a step in one call,
// checked against the torch path in tests/gpu_worker/engine/test_cpu_kernels.py. Built only where the CPU has AMX.
//
// Why: torch's flash attention, over each chunk's keys and values (gathered into a copy where the chunk has cached
// context before it), was a large share of a prefill step of the benchmark model, far below what the tiles compute
// (the mixed workload of `tokenfleet bench engine`).
//
// Per (chunk, KV head) the context's keys are laid out once as B tiles of K^T (16 dim pairs x 16 keys) and its
// values as B tiles of V (16 key pairs x 16 dims); then per (chunk, query head, 16 query rows) the scores of all
// keys the rows see go to a buffer (A = the rows of q, read in place from the fused projection), an exact softmax
// in fp32 over each row (two passes: no rescaling of the output), and the probabilities, rounded to bf16 as torch's
// flash attention rounds them for its product with V, times the values into four accumulator tiles.
//
// With a sliding window a row sees only its last `window` positions (itself included): a chunk's context is packed
// from the first key its first row sees and a task's scores start at the first its first row sees (each down to a
// multiple of 32, for whole tiles), so its cost is the window's, not the context's; the freed blocks before the window
// are never read (their keys pack as zeros, masked).
#ifdef TOKENFLEET_AMX
#include <vector>

#include "amx_tiles.h"
#include "cpu_kernels.h"
#include "paged_kv.h"

namespace {

constexpr int64_t kTile = 16;

// One (chunk, KV head)'s context from token `from` (a multiple of 32) as B tiles: keys [ceil((L - from) / 16)][D / 32]
// [16 dim pairs][16 keys], values [ceil((L - from) / 32)][D / 16][16 key pairs][16 dims][2], token t at t - from;
// tokens before `first` (outside every row's window) and past L zero.
struct PackedContext {
  std::vector<uint32_t> keys, values;
  int64_t from = 0;

  void pack(const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table, int64_t first, int64_t L,
            int64_t kvh, int64_t KVH, int64_t block_size, int64_t D) {
    from = first & ~int64_t{31};
    const int64_t key_tiles = (L - from + 15) / 16, value_tiles = (L - from + 31) / 32, pairs = D / 2;
    keys.assign(key_tiles * pairs * 16, 0);
    values.assign(value_tiles * (D / 16) * 256, 0);
    for (int64_t t = first; t < L; t++) {
      const int64_t row = (table[t / block_size] * KVH + kvh) * block_size + t % block_size, i = t - from;
      const auto* k = reinterpret_cast<const uint32_t*>(k_cache + row * D);
      uint32_t* kt = keys.data() + (i / 16) * pairs * 16 + i % 16;
      for (int64_t p = 0; p < pairs; p++) kt[p * 16] = k[p];  // [dim pair p / 16 tile][p % 16][key]
      const uint16_t* v = v_cache + row * D;
      auto* vt = reinterpret_cast<uint16_t*>(values.data() + (i / 32) * (D / 16) * 256) + (i % 32) / 2 * 32 + i % 2;
      for (int64_t d = 0; d < D; d++) vt[(d / 16) * 512 + (d % 16) * 2] = v[d];
    }
  }
};

// The first key a row at `position` sees: 0, or with a sliding window (> 0) its window's first.
inline int64_t window_start(int64_t position, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
}

// Lanes j .. j + 15 that lie in [a, n).
inline __mmask16 lanes_in(int64_t j, int64_t a, int64_t n) {
  const int64_t lo = std::clamp<int64_t>(a - j, 0, 16), hi = std::clamp<int64_t>(n - j, 0, 16);
  return hi <= lo ? 0 : static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
}

}  // namespace

// q: [T, H, D] bf16 rows (a view of the fused projection: rows strided, heads contiguous); out: [T, H, D]
// contiguous, its prefill rows written here. Chunk c's query rows are [query_starts[c], + query_lens[c]), the
// last query_lens[c] of its context_lens[c] tokens, whose keys and values are in the cache through block_tables[c];
// `window` > 0: each row sees its last `window` positions only (block_tables' entries before the first block a
// chunk's first row sees may be -1), 0: all.
void prefill_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& query_starts, const at::Tensor& query_lens,
                            const at::Tensor& context_lens, const at::Tensor& block_tables, double scale,
                            int64_t window, const c10::optional<at::Tensor>& sinks, at::Tensor& out) {
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(1), block_size = k_cache.size(2), G = H / KVH;
  const float* sink_logits = paged_kv::sink_logits(sinks, H);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.stride(2) == 1 && q.stride(1) == D && D % 32 == 0 && D <= 128 &&
                  H % KVH == 0 && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "bf16 q with contiguous heads, head_dim % 32 == 0 and <= 128, whole query groups, contiguous caches");
  TORCH_CHECK(amx_permitted(), "this process may not use AMX tiles (Linux refused arch_prctl)");
  TORCH_CHECK(window >= 0, "window: a positive number of tokens, or 0 for none");
  const int64_t C = query_starts.size(0), max_blocks = block_tables.size(1), q_row = q.stride(0);
  const int64_t* qs = query_starts.data_ptr<int64_t>();
  const int64_t* ql = query_lens.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const auto* qp = static_cast<const uint16_t*>(q.data_ptr());
  const auto* kc = static_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vc = static_cast<const uint16_t*>(v_cache.data_ptr());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
  std::vector<PackedContext> contexts(C * KVH);
  std::vector<int64_t> task_chunk, task_row;  // tasks: (chunk, query head, 16 query rows)
  for (int64_t c = 0; c < C; c++)
    for (int64_t r = 0; r < ql[c]; r += kTile) task_chunk.push_back(c), task_row.push_back(r);
  const int64_t tasks = static_cast<int64_t>(task_chunk.size()) * H;
#pragma omp parallel
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < C * KVH; i++)
      contexts[i].pack(kc, vc, tables + (i / KVH) * max_blocks, window_start(cl[i / KVH] - ql[i / KVH], window),
                       cl[i / KVH], i % KVH, KVH, block_size, D);
    configure_tiles();
    std::vector<float> scores;
    std::vector<uint16_t> probs;
    alignas(64) float o[kTile * kTile];
    alignas(64) uint16_t q_rows[kTile * 128];
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; task++) {
      const int64_t c = task_chunk[task / H], h = task % H, r0 = task_row[task / H];
      const int64_t rows = std::min(kTile, ql[c] - r0), L = cl[c], first = L - ql[c] + r0;  // row i sees keys <= first + i
      const int64_t seen = first + rows;  // keys any of the rows sees end there
      const PackedContext& ctx = contexts[c * KVH + h / G];
      // Scores from the first key the first row sees, down to a multiple of 32 (inside the packed context): column j
      // is key key0 + j.
      const int64_t key0 = window_start(first, window) & ~int64_t{31};
      const int64_t width = (seen - key0 + 31) / 32 * 32;
      const uint32_t* packed_keys = ctx.keys.data() + (key0 - ctx.from) / 16 * (D / 2) * 16;
      const uint32_t* packed_values = ctx.values.data() + (key0 - ctx.from) / 32 * (D / 16) * 256;
      scores.resize(kTile * width);
      probs.resize(kTile * width);
      for (int64_t i = 0; i < kTile; i++)  // the rows' query head, rows past the chunk's zero
        if (i < rows) std::memcpy(q_rows + i * D, qp + (qs[c] + r0 + i) * q_row + h * D, D * 2);
        else std::memset(q_rows + i * D, 0, D * 2);
      for (int64_t kt = 0; kt < (seen - key0 + 15) / 16; kt++) {
        _tile_zero(0);
        for (int64_t half = 0; half < D / 32; half++) {
          _tile_loadd(1, q_rows + half * 32, D * 2);
          _tile_loadd(2, packed_keys + (kt * (D / 2) + half * 16) * 16, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, scores.data() + kt * 16, width * 4);
      }
      const __m512 ks = _mm512_set1_ps(static_cast<float>(scale));
      float row_sum[kTile];
      for (int64_t i = 0; i < kTile; i++) {
        float* s = scores.data() + i * width;
        uint16_t* p = probs.data() + i * width;
        // Columns [a, n): the keys row i sees.
        const int64_t n = i < rows ? first + i + 1 - key0 : 0;
        const int64_t a = i < rows ? window_start(first + i, window) - key0 : 0;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t j = a & ~int64_t{15}; j < n; j += 16)
          mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, lanes_in(j, a, n), s + j));
        // A head's sink (one more score with no value) joins the max and the sum.
        const float sink = sink_logits && i < rows ? sink_logits[h] : -INFINITY;
        const float top = std::max(_mm512_reduce_max_ps(mx) * static_cast<float>(scale), sink);
        const __m512 m = _mm512_set1_ps(top);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < width; j += 16) {
          const __mmask16 live = lanes_in(j, a, n);
          const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + j), ks), m)));
          const __m256i b = to_bf16x16(e);
          sum = _mm512_add_ps(sum, load_bf16x16_from(b));  // the sum of the rounded probabilities V is weighted by
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), b);
        }
        row_sum[i] = _mm512_reduce_add_ps(sum) + std::exp(sink - top);
      }
      for (int64_t dt = 0; dt < D / 16; dt += 4) {  // four accumulators of 16 dims
        const int64_t n_acc = std::min<int64_t>(4, D / 16 - dt);
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t kp = 0; kp < width / 32; kp++) {
          _tile_loadd(1, probs.data() + kp * 32, width * 2);
          const uint32_t* v = packed_values + kp * (D / 16) * 256 + dt * 256;
          _tile_loadd(2, v, 64);
          _tile_dpbf16ps(4, 1, 2);
          if (n_acc > 1) { _tile_loadd(3, v + 256, 64); _tile_dpbf16ps(5, 1, 3); }
          if (n_acc > 2) { _tile_loadd(2, v + 512, 64); _tile_dpbf16ps(6, 1, 2); }
          if (n_acc > 3) { _tile_loadd(3, v + 768, 64); _tile_dpbf16ps(7, 1, 3); }
        }
        for (int64_t a = 0; a < n_acc; a++) {
          switch (a) {  // tile numbers are immediates
            case 0: _tile_stored(4, o, 64); break;
            case 1: _tile_stored(5, o, 64); break;
            case 2: _tile_stored(6, o, 64); break;
            default: _tile_stored(7, o, 64); break;
          }
          for (int64_t i = 0; i < rows; i++)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + ((qs[c] + r0 + i) * H + h) * D + (dt + a) * 16),
                                to_bf16x16(_mm512_mul_ps(_mm512_load_ps(o + i * 16), _mm512_set1_ps(1.0f / row_sum[i]))));
        }
      }
    }
    _tile_release();
  }
}
#endif
