// Prefill attention on AVX512-BF16 where there are no AMX tiles, straight from the paged bf16 cache: every prefill
// chunk of a step in one call, checked against the float32 reference and against torch's own bf16 path in
// tests/gpu_worker/engine/test_cpu_kernels.py.
//
// Why: the torch path gathers each chunk's cached context into a copy and runs torch's flash attention, whose bf16
// products go through MKL's generic fp32 sgemm on AMD CPUs: a share of the mixed workload's time (`tokenfleet bench
// engine`) far above its share of the arithmetic. Here every product is a dpbf16 (bf16 pairs into fp32).
//
// Its arithmetic is torch's flash attention's, so that a served answer does not move with the kernel: an earlier
// kernel here with an online softmax over 64-key tiles (probabilities rounded to bf16 under each tile's running
// max) flipped the default model's greedy answer to "What is the capital of France?" on a 0.08-nat margin. As in
// torch, the keys go in blocks of 512 from the start of the context; a row's scores (its product with each key,
// then times the scale) have their max over the block, exp(score - max) is summed in fp32 and rounded to bf16 for
// the product with the values, earlier blocks' sums and outputs are rescaled by exp(old max - new max), and the
// output is multiplied by 1 / sum. What differs is the order of the fp32 sums (dot products, the softmax sum), a
// few ulps: an emulation of this arithmetic kept the default model's answers to factual questions.
//
// With a sliding window a row sees only its last `window` positions (itself included): a task's keys start at the
// first its first row sees, so its cost is the window's, not the context's, and the freed blocks before the window
// are never read. Key blocks stay where the reference's torch attention has them: every 512 keys from the first
// block the chunk's first row sees (a block wholly before a task's keys adds nothing to any of its rows).
//
// A task is one chunk's KV head and up to kQueryTokens of its tokens (their G query heads, R rows):
// - scores with lanes over query rows: the query packed once per task as pairs of dims, each key's pair of dims
//   broadcast straight from its cache row, so keys are never copied or transposed, and the max and sum over keys
//   are element-wise across vectors;
// - values with lanes over dims: each pair of value rows interleaved once per block.
// Built only where the CPU has no AMX (the AMX build takes amx_prefill_attention.cpp's).
#ifndef TOKENFLEET_AMX
#include <limits>
#include <vector>

#include "cpu_kernels.h"
#include "paged_kv.h"

namespace {

constexpr int64_t kQueryTokens = 32;  // a task's tokens: their rows share each key and value row it reads
constexpr int64_t kKeyBlock = 512;    // torch's kv split: the keys one max, sum and rounding of probabilities cover
constexpr int64_t kKeysPerPass = 8;   // keys a score pass holds in registers, with two vectors of rows each

struct Task {
  int64_t chunk, head, first, count, work;
};

// One thread's scratch for its current task (R16: the rows rounded up to whole vectors of 16).
struct Scratch {
  std::vector<uint32_t> query;   // [D/2][R16]: row r's dims 2kp, 2kp+1
  std::vector<int32_t> limit;    // [R16]: the last key row r sees (causal)
  std::vector<int32_t> lower;    // [R16]: the first key row r sees (its sliding window's; else below every key)
  std::vector<float> scores;     // [kKeyBlock][R16]: scaled scores, lanes over rows
  std::vector<uint32_t> probs;   // [kKeyBlock/2][R16]: keys 2jp, 2jp+1's probabilities for row r, bf16
  std::vector<uint32_t> values;  // [kKeyBlock/2][D]: keys 2jp, 2jp+1's values at dim d, bf16
  std::vector<float> out;        // [R16][D]: unnormalized output
  std::vector<float> row_max, row_sum, rescale;  // [R16]
  std::vector<int64_t> key_rows;                 // cache row of each key of the task
  std::vector<const uint16_t*> key_ptrs;         // [kKeyBlock]: the block's key rows
};

inline uint32_t pair_at(const uint16_t* row, int64_t kp) {
  uint32_t pair;
  std::memcpy(&pair, row + 2 * kp, 4);
  return pair;
}

// scores[j][r] = q_r . k_j for the block's keys j0 .. j0 + kKeysPerPass and the kRowVectors * 16 rows from vector rv0.
template <int kRowVectors>
void score_pass(Scratch& s, int64_t R16, int64_t rv0, int64_t D, int64_t j0) {
  __m512 acc[kKeysPerPass][kRowVectors];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < D / 2; kp++) {
    __m512bh q[kRowVectors];
    for (int r = 0; r < kRowVectors; r++)
      q[r] = (__m512bh)_mm512_loadu_si512(s.query.data() + kp * R16 + (rv0 + r) * 16);
    for (int j = 0; j < kKeysPerPass; j++) {
      const __m512bh k = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(s.key_ptrs[j0 + j], kp)));
      for (int r = 0; r < kRowVectors; r++) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], q[r], k);
    }
  }
  for (int j = 0; j < kKeysPerPass; j++)
    for (int r = 0; r < kRowVectors; r++) _mm512_storeu_ps(s.scores.data() + (j0 + j) * R16 + (rv0 + r) * 16, acc[j][r]);
}

// out[r][d0 .. d0 + 16 kVectors) = out * rescale[r] + sum over the block's key pairs of p[j][r] v[j][d], for kRows
// rows from r0.
template <int kRows, int kVectors>
void value_pass(Scratch& s, int64_t R16, int64_t r0, int64_t D, int64_t d0, int64_t pairs) {
  __m512 acc[kRows][kVectors];
  for (int i = 0; i < kRows; i++) {
    const __m512 a = _mm512_set1_ps(s.rescale[r0 + i]);
    for (int c = 0; c < kVectors; c++)
      acc[i][c] = _mm512_mul_ps(a, _mm512_loadu_ps(s.out.data() + (r0 + i) * D + d0 + 16 * c));
  }
  for (int64_t jp = 0; jp < pairs; jp++) {
    __m512bh v[kVectors];
    for (int c = 0; c < kVectors; c++) v[c] = (__m512bh)_mm512_loadu_si512(s.values.data() + jp * D + d0 + 16 * c);
    for (int i = 0; i < kRows; i++) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(s.probs[jp * R16 + r0 + i]));
      for (int c = 0; c < kVectors; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], v[c], p);
    }
  }
  for (int i = 0; i < kRows; i++)
    for (int c = 0; c < kVectors; c++) _mm512_storeu_ps(s.out.data() + (r0 + i) * D + d0 + 16 * c, acc[i][c]);
}

// The block's scores (keys kb0 .. kb0 + n, positions in the context) times `scale`, its max per row, its
// probabilities as bf16 pairs, the rows' sums and the factor their earlier outputs are rescaled by.
void softmax_block(Scratch& s, int64_t R16, int64_t kb0, int64_t n, __m512 scale) {
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t rv = 0; rv < R16 / 16; rv++) {
    const __m512i limit = _mm512_loadu_si512(s.limit.data() + rv * 16);
    const __m512i lower = _mm512_loadu_si512(s.lower.data() + rv * 16);
    const __m512 old_max = _mm512_loadu_ps(s.row_max.data() + rv * 16);
    // Rows see every key of the block below the diagonal and inside their windows: no mask there.
    const bool masked = kb0 + n - 1 > _mm512_reduce_min_epi32(limit) || kb0 < _mm512_reduce_max_epi32(lower);
    __m512 mx = minus_inf;
    for (int64_t j = 0; j < n; j++) {
      float* sc = s.scores.data() + j * R16 + rv * 16;
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sc), scale);
      if (masked) {
        const __m512i key = _mm512_set1_epi32(static_cast<int>(kb0 + j));
        x = _mm512_mask_blend_ps(_mm512_cmple_epi32_mask(key, limit) & _mm512_cmpge_epi32_mask(key, lower), minus_inf,
                                 x);
      }
      _mm512_storeu_ps(sc, x);
      mx = _mm512_max_ps(mx, x);
    }
    mx = _mm512_max_ps(old_max, mx);  // a row that sees none of the block keeps its max: its rescale is 1
    // Without a sink the first block's old max is -inf: its rescale is 0 (the clamped exp's 1e-38 times zeros); with
    // one, exp(sink - max) of the sum of 1 the sink started it with. A row that has seen no key and has no sink (its
    // window starts in a later block) has nothing to rescale: 0, not exp(-inf - -inf).
    const __m512 alpha = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(mx, minus_inf, _CMP_NEQ_OQ),
                                             exp16(_mm512_sub_ps(old_max, mx)));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t jp = 0; jp < n / 2; jp++) {
      __m512i pair = _mm512_setzero_si512();
      for (int e = 0; e < 2; e++) {
        const __m512 sc = _mm512_loadu_ps(s.scores.data() + (2 * jp + e) * R16 + rv * 16);
        const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(sc, minus_inf, _CMP_NEQ_OQ), exp16(_mm512_sub_ps(sc, mx)));
        sum = _mm512_add_ps(sum, p);
        const __m512i bits = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p));
        pair = _mm512_or_si512(pair, e ? _mm512_slli_epi32(bits, 16) : bits);
      }
      _mm512_storeu_si512(s.probs.data() + jp * R16 + rv * 16, pair);
    }
    _mm512_storeu_ps(s.row_max.data() + rv * 16, mx);
    _mm512_storeu_ps(s.row_sum.data() + rv * 16, _mm512_fmadd_ps(alpha, _mm512_loadu_ps(s.row_sum.data() + rv * 16), sum));
    _mm512_storeu_ps(s.rescale.data() + rv * 16, alpha);
  }
}

// The first key the chunk's first row sees: 0, or with a sliding window (> 0) its window's first.
int64_t first_key(int64_t context, int64_t query_len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, context - query_len - window + 1) : 0;
}

void run_task(const Task& t, Scratch& s, const uint16_t* q, int64_t q_stride, const uint16_t* k_cache,
              const uint16_t* v_cache, const int64_t* starts, const int64_t* contexts, const int64_t* lens,
              const int64_t* tables, int64_t max_blocks, int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale,
              int64_t window, const float* sinks, uint16_t* out) {
  const int64_t G = H / KVH, R = t.count * G, R16 = (R + 15) & ~int64_t{15};
  const int64_t before = contexts[t.chunk] - lens[t.chunk] + t.first;  // keys before the task's first token
  const int64_t keys = before + t.count;
  // Key blocks of kKeyBlock from the first cache block the chunk's rows see (the reference gathers from there);
  // the task's keys from the first its first row sees, down to a multiple of kKeysPerPass from the blocks' origin.
  const int64_t origin = first_key(contexts[t.chunk], lens[t.chunk], window) / bs * bs;
  const int64_t seen = window > 0 ? std::max<int64_t>(0, before - window + 1) : 0;
  const int64_t start = origin + (seen - origin) / kKeysPerPass * kKeysPerPass;
  const auto row_of = [&](int64_t r) {
    return q + (starts[t.chunk] + t.first + r / G) * q_stride + (t.head * G + r % G) * D;
  };
  s.query.assign(D / 2 * R16, 0);
  s.limit.resize(R16);
  s.lower.resize(R16);
  for (int64_t r = 0; r < R16; r++) {
    const int64_t position = before + std::min(r, R - 1) / G;
    s.limit[r] = static_cast<int32_t>(position);
    s.lower[r] = window > 0 ? static_cast<int32_t>(position - window + 1) : std::numeric_limits<int32_t>::min();
    if (r < R)
      for (int64_t kp = 0; kp < D / 2; kp++) s.query[kp * R16 + r] = pair_at(row_of(r), kp);
  }
  s.key_rows.resize((keys - start + kKeysPerPass - 1) / kKeysPerPass * kKeysPerPass);  // key start + j at j
  for (int64_t j = 0; j < static_cast<int64_t>(s.key_rows.size()); j++) {
    // Keys before the first seen (in a freed block, maybe) repeat it, and keys past the end the last: masked.
    const int64_t key = std::clamp(start + j, seen, keys - 1);
    s.key_rows[j] = (tables[t.chunk * max_blocks + key / bs] * KVH + t.head) * bs + key % bs;
  }
  s.scores.resize(kKeyBlock * R16);
  s.probs.resize(kKeyBlock / 2 * R16);
  s.values.resize(kKeyBlock / 2 * D);
  s.key_ptrs.resize(kKeyBlock);
  s.out.assign(R16 * D, 0.0f);
  s.row_max.assign(R16, -INFINITY);
  s.row_sum.assign(R16, 0.0f);
  if (sinks)  // a head's sink, one more score with no value: the running max and sum start from it
    for (int64_t r = 0; r < R; r++) {
      s.row_max[r] = sinks[t.head * G + r % G];
      s.row_sum[r] = 1.0f;
    }
  s.rescale.resize(R16);
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t end = start + static_cast<int64_t>(s.key_rows.size());
  for (int64_t kb0 = start, next; kb0 < end; kb0 = next) {
    next = std::min(origin + ((kb0 - origin) / kKeyBlock + 1) * kKeyBlock, end);
    const int64_t n = next - kb0;  // a multiple of 8
    const int64_t* block_rows = s.key_rows.data() + (kb0 - start);
    for (int64_t j = 0; j < n; j++) s.key_ptrs[j] = k_cache + block_rows[j] * D;
    for (int64_t j0 = 0; j0 < n; j0 += kKeysPerPass) {
      int64_t rv = 0;
      for (; rv + 2 <= R16 / 16; rv += 2) score_pass<2>(s, R16, rv, D, j0);
      if (rv < R16 / 16) score_pass<1>(s, R16, rv, D, j0);
    }
    softmax_block(s, R16, kb0, n, vscale);
    for (int64_t jp = 0; jp < n / 2; jp++) {
      const uint16_t* v0 = v_cache + block_rows[2 * jp] * D;
      const uint16_t* v1 = v_cache + block_rows[2 * jp + 1] * D;
      for (int64_t d = 0; d < D; d += 16) {
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + d)));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + d)));
        _mm512_storeu_si512(s.values.data() + jp * D + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      int64_t r = 0;
      if (D - d0 >= 64) {
        for (; r + 6 <= R; r += 6) value_pass<6, 4>(s, R16, r, D, d0, n / 2);
        for (; r < R; r++) value_pass<1, 4>(s, R16, r, D, d0, n / 2);
      } else {
        for (; r + 6 <= R; r += 6) value_pass<6, 2>(s, R16, r, D, d0, n / 2);
        for (; r < R; r++) value_pass<1, 2>(s, R16, r, D, d0, n / 2);
      }
    }
  }
  for (int64_t r = 0; r < R; r++) {
    uint16_t* dst = out + (starts[t.chunk] + t.first + r / G) * H * D + (t.head * G + r % G) * D;
    const __m512 inv = _mm512_set1_ps(1.0f / s.row_sum[r]);
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          to_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(s.out.data() + r * D + d), inv)));
  }
}

}  // namespace

// The same contract as the AMX kernel's prefill_attention_bf16 (amx_prefill_attention.cpp): q [T, H, D] bf16 rows
// (a view of the fused projection); out [T, H, D] contiguous, its prefill rows written here; chunk c's query rows
// are [query_starts[c], + query_lens[c]), the last query_lens[c] of its context_lens[c] tokens, whose keys and
// values are in the cache [blocks, KVH, block_size, D] through block_tables[c]; `window` > 0: each row sees its last
// `window` positions only (block_tables' entries before the first block a chunk's first row sees may be -1), 0: all.
void prefill_attention_dpbf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& query_starts, const at::Tensor& query_lens,
                              const at::Tensor& context_lens, const at::Tensor& block_tables, double scale,
                              int64_t window, const c10::optional<at::Tensor>& sinks, at::Tensor& out) {
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(1), bs = k_cache.size(2);
  const float* sink_logits = paged_kv::sink_logits(sinks, H);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 && out.is_contiguous() &&
                  out.scalar_type() == at::kBFloat16 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "bf16 q, out and caches; out and the caches contiguous");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && D % 32 == 0 && H % KVH == 0,
              "q rows [H, D] contiguous, head_dim % 32 == 0, whole query groups");
  TORCH_CHECK(window >= 0, "window: a positive number of tokens, or 0 for none");
  auto starts = query_starts.to(at::kLong).contiguous(), lens = query_lens.to(at::kLong).contiguous();
  auto contexts = context_lens.to(at::kLong).contiguous(), tables = block_tables.to(at::kLong).contiguous();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* cp = contexts.data_ptr<int64_t>();
  std::vector<Task> tasks;
  for (int64_t c = 0; c < starts.size(0); c++)
    for (int64_t first = 0; first < lp[c]; first += kQueryTokens) {
      const int64_t count = std::min(kQueryTokens, lp[c] - first);
      const int64_t before = cp[c] - lp[c] + first;  // the task's first row's position
      const int64_t seen = window > 0 ? std::max<int64_t>(0, before - window + 1) : 0;
      for (int64_t h = 0; h < KVH; h++) tasks.push_back({c, h, first, count, count * (before + count - seen)});
    }
  // Longest first, so that the last tasks handed out are short ones.
  std::sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.work > b.work; });
  const auto* qp = static_cast<const uint16_t*>(q.data_ptr());
  const auto* kc = static_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vc = static_cast<const uint16_t*>(v_cache.data_ptr());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t n = static_cast<int64_t>(tasks.size()), max_blocks = tables.size(1), q_stride = q.stride(0);
#pragma omp parallel
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; i++)
      run_task(tasks[i], scratch, qp, q_stride, kc, vc, sp, cp, lp, tp, max_blocks, H, KVH, D, bs,
               static_cast<float>(scale), window, sink_logits, op);
  }
}
#endif  // TOKENFLEET_AMX
