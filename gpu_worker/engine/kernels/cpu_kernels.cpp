// CPU kernels for bf16 serving (AVX512-BF16), each checked against its torch reference in
// tests/engine/test_cpu_kernels.py. All are memory-bound; they exist because the torch path moves the
// same bytes several times (gathers, upcasts, one pass per element-wise op).
#include <torch/extension.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

static inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

// y[1, N] = x[1, K] @ w[N, K]^T with fp32 accumulation. Batch-1 decode is one such product per weight;
// oneDNN's bf16 path reaches about 60% of the read bandwidth on it. Each OpenMP thread takes one
// contiguous range of rows and reads it front to back, one row at a time, so the hardware prefetcher
// sees a single sequential stream: this reached the bandwidth of a plain read loop, where interleaving
// eight rows with software prefetch stayed near 60% of it. K % 32 == 0.
static inline uint16_t row_dot_bf16(const uint16_t* x, const uint16_t* w, int64_t K) {
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

torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(), "x must be [1, K] contiguous");
  TORCH_CHECK(w.is_contiguous() && w.size(1) == x.size(1) && w.size(1) % 32 == 0, "w must be [N, K], K % 32 == 0");
  const int64_t K = w.size(1), N = w.size(0);
  auto y = torch::empty({1, N}, x.options());
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = static_cast<const uint16_t*>(w.data_ptr());
  auto* yp = static_cast<uint16_t*>(y.data_ptr());
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) yp[n] = row_dot_bf16(xp, wp + n * K, K);
  return y;
}

// exp for 16 lanes: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, p a degree-6 Taylor polynomial
// (relative error < 2e-7, below the bf16 output's resolution). std::exp per score dominated the kernel.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Softmax of s[0, L) in place, in fp32.
static inline void softmax_inplace(float* s, int64_t L) {
  const float mx = *std::max_element(s, s + L);
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
  const __m512 inv = _mm512_set1_ps(1.0f / sum);
  t = 0;
  for (; t + 16 <= L; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
  for (; t < L; t++) s[t] *= 1.0f / sum;
}

static inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline __m512 load_bf16x16_from(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

static inline __m512 load_bf16x16(const uint16_t* p) {
  return load_bf16x16_from(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Tokens ahead to prefetch: each token's key (or value) row lies in a scattered block, where the
// hardware prefetcher loses the stream; prefetching both 64-byte lines of a row halved the kernel's time.
constexpr int64_t kPrefetchAhead = 16;

// Decode attention straight from the paged cache: one query token per sequence, H query heads sharing
// KVH key/value heads. For each (sequence, KV head) it reads that head's keys and values block by block
// through the block table, once for all query heads of its group, with an exact (two-pass) softmax in
// fp32. The torch path first gathers every context into a padded copy, then attends over the copy.
// q: [B, H, D]; caches: [blocks, KVH, block_size, D]; block_tables: [B, max_blocks]; context_lens: [B].
torch::Tensor paged_decode_attention_bf16(const torch::Tensor& q, const torch::Tensor& k_cache,
                                          const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                          const torch::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1), block_size = k_cache.size(2), G = H / KVH;
  TORCH_CHECK(D % 32 == 0 && H % KVH == 0, "head_dim % 32 == 0 and whole query groups");
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = context_lens.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(q);
  const auto* qp = static_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = static_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vp = static_cast<const uint16_t*>(v_cache.data_ptr());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t max_blocks = tables.size(1);
#pragma omp parallel
  {
    std::vector<float> scores, acc;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * KVH; task++) {
      const int64_t b = task / KVH, kvh = task % KVH, L = lp[b];
      scores.resize(G * L);
      acc.resize(G * D);
      const uint16_t* qb = qp + (b * H + kvh * G) * D;
      // Offset of token t's row for this KV head: a block holds each head's block_size rows contiguously.
      const auto row = [&](int64_t t) {
        return ((tp[b * max_blocks + t / block_size] * KVH + kvh) * block_size + t % block_size) * D;
      };
      for (int64_t t = 0; t < L; t++) {
        const uint16_t* key = kp + row(t);
        if (t + kPrefetchAhead < L) {  // blocks are scattered: fetch ahead of the hardware prefetcher
          const uint16_t* ahead = kp + row(t + kPrefetchAhead);
          for (int64_t d = 0; d < D; d += 32) _mm_prefetch(reinterpret_cast<const char*>(ahead + d), _MM_HINT_T0);
        }
        for (int64_t g = 0; g < G; g++) {
          __m512 dot = _mm512_setzero_ps();
          for (int64_t d = 0; d < D; d += 32)
            dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(qb + g * D + d),
                                   (__m512bh)_mm512_loadu_si512(key + d));
          scores[g * L + t] = _mm512_reduce_add_ps(dot) * static_cast<float>(scale);
        }
      }
      for (int64_t g = 0; g < G; g++) softmax_inplace(scores.data() + g * L, L);
      // Values: 64 columns at a time, converted once per token, accumulated in registers for 4 heads.
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t gn = std::min<int64_t>(4, G - g0);
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
          const int64_t cn = std::min<int64_t>(4, (D - d0) / 16);
          __m512 a[4][4];
          for (int64_t g = 0; g < 4; g++)
            for (int64_t c = 0; c < 4; c++) a[g][c] = _mm512_setzero_ps();
          for (int64_t t = 0; t < L; t++) {
            const uint16_t* value = vp + row(t) + d0;
            if (t + kPrefetchAhead < L) {
              const uint16_t* ahead = vp + row(t + kPrefetchAhead) + d0;
              for (int64_t d = 0; d < 16 * cn; d += 32) _mm_prefetch(reinterpret_cast<const char*>(ahead + d), _MM_HINT_T0);
            }
            __m512 v[4];
            for (int64_t c = 0; c < cn; c++) v[c] = load_bf16x16(value + 16 * c);
            for (int64_t g = 0; g < gn; g++) {
              const __m512 p = _mm512_set1_ps(scores[(g0 + g) * L + t]);
              for (int64_t c = 0; c < cn; c++) a[g][c] = _mm512_fmadd_ps(p, v[c], a[g][c]);
            }
          }
          for (int64_t g = 0; g < gn; g++)
            for (int64_t c = 0; c < cn; c++) _mm512_storeu_ps(acc.data() + (g0 + g) * D + d0 + 16 * c, a[g][c]);
        }
      }
      for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++) op[(b * H + kvh * G + g) * D + d] = to_bf16(acc[g * D + d]);
    }
  }
  return out;
}

// cache[slot_blocks[t], :, slot_offsets[t]] = rows[t] for k and v: what the reference's two index_put
// calls do, in one call without the advanced-indexing overhead (it was ~5% of a batch-1 decode step).
// k and v may be column slices of the fused qkv output: only each token's [KVH, D] must be contiguous.
void write_kv_bf16(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache, torch::Tensor& v_cache,
                   const torch::Tensor& slot_blocks, const torch::Tensor& slot_offsets) {
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2), block_size = k_cache.size(2);
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D, "rows [KVH, D] contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(1) == KVH, "cache [blocks, KVH, bs, D]");
  const int64_t* bp = slot_blocks.data_ptr<int64_t>();
  const int64_t* op = slot_offsets.data_ptr<int64_t>();
  const auto* kp = static_cast<const uint16_t*>(k.data_ptr());
  const auto* vp = static_cast<const uint16_t*>(v.data_ptr());
  auto* kc = static_cast<uint16_t*>(k_cache.data_ptr());
  auto* vc = static_cast<uint16_t*>(v_cache.data_ptr());
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < KVH; h++) {
      const int64_t dst = ((bp[t] * KVH + h) * block_size + op[t]) * D;
      std::memcpy(kc + dst, kp + t * k.stride(0) + h * D, D * 2);
      std::memcpy(vc + dst, vp + t * v.stride(0) + h * D, D * 2);
    }
}

static inline __m256i to_bf16x16(__m512 v) {  // round to nearest even, as to_bf16
  __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

// out[T, I] = bf16(silu(gate)) * up for x = [gate | up] of shape [T, 2I], rounding as torch does in
// bf16 (each op's result rounded to bf16). torch's bf16 silu and mul run ~10x slower on this CPU.
torch::Tensor silu_and_mul_bf16(const torch::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.size(1) % 32 == 0, "x must be [T, 2I] contiguous, I % 16 == 0");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; t++) {
    for (int64_t i = 0; i < I; i += 16) {
      const __m512 g = load_bf16x16(xp + t * 2 * I + i);
      const __m512 u = load_bf16x16(xp + t * 2 * I + I + i);
      const __m512 sig = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      const __m512 act = load_bf16x16_from(to_bf16x16(sig));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + t * I + i), to_bf16x16(_mm512_mul_ps(act, u)));
    }
  }
  return out;
}

// HF's RMSNorm in bf16 on one row: normalize in fp32, round to bf16, then multiply by the bf16 weight.
static inline void rms_norm_row(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t H, float eps) {
  __m512 sq = _mm512_setzero_ps();
  for (int64_t h = 0; h < H; h += 16) {
    const __m512 v = load_bf16x16(x + h);
    sq = _mm512_fmadd_ps(v, v, sq);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / H + eps));
  for (int64_t h = 0; h < H; h += 16) {
    const __m512 n = load_bf16x16_from(to_bf16x16(_mm512_mul_ps(load_bf16x16(x + h), inv)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + h), to_bf16x16(_mm512_mul_ps(load_bf16x16(w + h), n)));
  }
}

torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 16 == 0, "x must be contiguous, hidden % 16 == 0");
  const int64_t H = x.size(-1), T = x.numel() / H;
  auto out = torch::empty_like(x);
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = static_cast<const uint16_t*>(weight.data_ptr());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; t++) rms_norm_row(xp + t * H, wp, op + t * H, H, static_cast<float>(eps));
  return out;
}

// (rms_norm(x + residual), x + residual), the sum rounded to bf16 as torch's add: the residual stream's
// add and the next norm in one pass over the row instead of two ops.
std::vector<torch::Tensor> add_rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& residual,
                                             const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes() && x.size(-1) % 16 == 0,
              "x and residual must be contiguous, of one shape, hidden % 16 == 0");
  const int64_t H = x.size(-1), T = x.numel() / H;
  auto out = torch::empty_like(x);
  auto sum = torch::empty_like(x);
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  const auto* rp = static_cast<const uint16_t*>(residual.data_ptr());
  const auto* wp = static_cast<const uint16_t*>(weight.data_ptr());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
  auto* sp = static_cast<uint16_t*>(sum.data_ptr());
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; t++) {
    for (int64_t h = 0; h < H; h += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(sp + t * H + h),
                          to_bf16x16(_mm512_add_ps(load_bf16x16(xp + t * H + h), load_bf16x16(rp + t * H + h))));
    rms_norm_row(sp + t * H, wp, op + t * H, H, static_cast<float>(eps));
  }
  return {out, sum};
}

// Row-wise argmax of bf16 logits [B, V], first index on ties, as torch.argmax. Greedy decoding needs
// nothing else from the logits, and torch's argmax plus the float upcast cost ~8 ms a step here.
torch::Tensor argmax_bf16(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits must be [B, V] contiguous");
  const int64_t B = logits.size(0), V = logits.size(1);
  auto out = torch::empty({B}, logits.options().dtype(torch::kInt64));
  const auto* lp = static_cast<const uint16_t*>(logits.data_ptr());
  int64_t* op = out.data_ptr<int64_t>();
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < B; b++) {
    const uint16_t* row = lp + b * V;
    __m512 best = _mm512_set1_ps(-INFINITY);
    int64_t v = 0;
    for (; v + 16 <= V; v += 16) best = _mm512_max_ps(best, load_bf16x16(row + v));
    float mx = _mm512_reduce_max_ps(best);
    for (int64_t r = v; r < V; r++) mx = std::max(mx, bf16_to_float(row[r]));
    int64_t index = 0;  // the first maximum; a NaN counts as one, as in torch.argmax
    for (; index < V - 1; index++) {
      const float f = bf16_to_float(row[index]);
      if (f == mx || f != f) break;
    }
    op[b] = index;
  }
  return out;
}

// In-place rotary embedding (HF's rotate-half layout) of the first `heads` heads of each row of
// qkv [T, W], with HF's bf16 rounding: x*cos and rotate_half(x)*sin each rounded, then their sum.
void rotary_inplace_bf16(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         int64_t heads, int64_t head_dim) {
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && head_dim % 32 == 0,
              "contiguous inputs, head_dim % 32 == 0");
  const int64_t T = qkv.size(0), W = qkv.size(1), half = head_dim / 2;
  auto* xp = static_cast<uint16_t*>(qkv.data_ptr());
  const auto* cp = static_cast<const uint16_t*>(cos.data_ptr());
  const auto* sp = static_cast<const uint16_t*>(sin.data_ptr());
  auto round = [](__m512 v) { return load_bf16x16_from(to_bf16x16(v)); };
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; t++) {
    for (int64_t h = 0; h < heads; h++) {
      uint16_t* x = xp + t * W + h * head_dim;
      for (int64_t i = 0; i < half; i += 16) {
        const __m512 c = load_bf16x16(cp + t * head_dim + i), s = load_bf16x16(sp + t * head_dim + i);
        const __m512 x1 = load_bf16x16(x + i), x2 = load_bf16x16(x + half + i);
        const __m512 y1 = _mm512_add_ps(round(_mm512_mul_ps(x1, c)), round(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), s)));
        const __m512 y2 = _mm512_add_ps(round(_mm512_mul_ps(x2, c)), round(_mm512_mul_ps(x1, s)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + i), to_bf16x16(y1));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + half + i), to_bf16x16(y2));
      }
    }
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_bf16", &argmax_bf16);
  m.def("rotary_inplace_bf16", &rotary_inplace_bf16);
  m.def("silu_and_mul_bf16", &silu_and_mul_bf16);
  m.def("rms_norm_bf16", &rms_norm_bf16);
  m.def("add_rms_norm_bf16", &add_rms_norm_bf16);
  m.def("gemv_bf16", &gemv_bf16);
  m.def("paged_decode_attention_bf16", &paged_decode_attention_bf16);
  m.def("write_kv_bf16", &write_kv_bf16);
}
