// CPU kernels for bf16 serving (AVX512-BF16), each checked against its torch reference in
// tests/engine/test_cpu_kernels.py. All are memory-bound; they exist because the torch path moves the
// same bytes several times (gathers, upcasts, one pass per element-wise op).
#include <vector>

#include "cpu_kernels.h"
#include "sum16.h"
#ifdef TOKENFLEET_AMX
#include "amx_tiles.h"
#endif

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

// The same for M <= kGemvRows rows of x (a decode step whose guesses are scored with it): each weight row is read
// once for all of them. Streaming SmolLM2's matrices on a Zen 5 this ran 1.13-1.23x oneDNN's packed matmul up to 5
// rows, 0.69x at 8 (bound by the dot products there).
constexpr int64_t kGemvRows = 5;

template <int M>
static inline void rows_dot_bf16(const uint16_t* x, const uint16_t* w, int64_t K, uint16_t* y, int64_t N) {
  __m512 acc[M];
  for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
    for (int m = 0; m < M; m++) acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512(x + m * K + k));
  }
  for (int m = 0; m < M; m++) y[m * N] = to_bf16(_mm512_reduce_add_ps(acc[m]));
}

template <int M>
static void gemv_rows_bf16(const uint16_t* xp, const uint16_t* wp, uint16_t* yp, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n++) {
    if constexpr (M == 1) yp[n] = row_dot_bf16(xp, wp + n * K, K);
    else rows_dot_bf16<M>(xp, wp + n * K, K, yp + n, N);
  }
}

torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kGemvRows && x.is_contiguous(),
              "x must be [M, K] contiguous, 1 <= M <= ", kGemvRows);
  TORCH_CHECK(w.is_contiguous() && w.size(1) == x.size(1) && w.size(1) % 32 == 0, "w must be [N, K], K % 32 == 0");
  const int64_t M = x.size(0), K = w.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = static_cast<const uint16_t*>(w.data_ptr());
  auto* yp = static_cast<uint16_t*>(y.data_ptr());
  switch (M) {
    case 1: gemv_rows_bf16<1>(xp, wp, yp, N, K); break;
    case 2: gemv_rows_bf16<2>(xp, wp, yp, N, K); break;
    case 3: gemv_rows_bf16<3>(xp, wp, yp, N, K); break;
    case 4: gemv_rows_bf16<4>(xp, wp, yp, N, K); break;
    default: gemv_rows_bf16<5>(xp, wp, yp, N, K); break;
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
  if constexpr (MR == 1) {  // one row of x (a decode): rows of w one after another, one stream as gemv_bf16 reads
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

torch::Tensor rowwise_mm_bf16(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x must be [M, K] contiguous bf16");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kBFloat16 && w.size(1) == x.size(1) && w.size(1) % 32 == 0,
              "w must be [N, K] contiguous bf16, K % 32 == 0");
  const int64_t M = x.size(0), K = w.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = static_cast<const uint16_t*>(w.data_ptr());
  auto* yp = static_cast<uint16_t*>(y.data_ptr());
  // Each thread takes contiguous blocks of 16 rows of w and passes all of x over a block while it is in cache.
  constexpr int64_t kBlockN = 16;
#pragma omp parallel for schedule(static)
  for (int64_t block = 0; block < (N + kBlockN - 1) / kBlockN; block++) {
    const int64_t n0 = block * kBlockN, n1 = std::min(N, n0 + kBlockN);
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
  return y;
}

// out[T, I] = bf16(silu(gate)) * up for x = [gate | up] of shape [T, 2I], rounding as torch does in
// bf16 (each op's result rounded to bf16). torch's bf16 silu and mul run ~10x slower on this CPU.
torch::Tensor silu_and_mul_bf16(const torch::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.size(1) % 32 == 0, "x must be [T, 2I] contiguous, I % 16 == 0");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
#pragma omp parallel for schedule(static) if (T * I >= kMinParallelElements)
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
#pragma omp parallel for schedule(static) if (T * H >= kMinParallelElements)
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
#pragma omp parallel for schedule(static) if (T * H >= kMinParallelElements)
  for (int64_t t = 0; t < T; t++) {
    for (int64_t h = 0; h < H; h += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(sp + t * H + h),
                          to_bf16x16(_mm512_add_ps(load_bf16x16(xp + t * H + h), load_bf16x16(rp + t * H + h))));
    rms_norm_row(sp + t * H, wp, op + t * H, H, static_cast<float>(eps));
  }
  return {out, sum};
}

// Row-wise argmax of bf16 logits [B, V], first index on ties, as torch.argmax. Greedy decoding needs
// nothing else from the logits, and torch's argmax plus the float upcast cost ~8 ms a step here. One pass, each
// lane keeping its first maximum and where it was: a second, scalar pass to find the maximum's first index took
// 1.5 ms a decode step of 112 rows (a Sapphire Rapids VM). A row with a NaN (torch's argmax picks the first) takes
// the scalar search.
static int64_t argmax_row(const uint16_t* row, int64_t V) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_at = _mm512_setzero_si512(), at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask16 nan = 0;
  int64_t v = 0;
  for (; v + 16 <= V; v += 16, at = _mm512_add_epi32(at, _mm512_set1_epi32(16))) {
    const __m512 x = load_bf16x16(row + v);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __mmask16 greater = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, greater, x);
    best_at = _mm512_mask_mov_epi32(best_at, greater, at);
  }
  // The lanes holding the maximum: the least of their first indices (0 where a lane saw only -inf, as torch).
  float mx = _mm512_reduce_max_ps(best);
  int64_t index = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(best, _mm512_set1_ps(mx), _CMP_EQ_OQ), best_at);
  for (int64_t r = v; r < V; r++) {
    const float f = bf16_to_float(row[r]);
    if (f != f) nan = 1;
    if (f > mx) mx = f, index = r;
  }
  if (!nan) return index;
  for (index = 0; index < V - 1; index++) {
    const float f = bf16_to_float(row[index]);
    if (f != f) break;
  }
  return index;
}

torch::Tensor argmax_bf16(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits must be [B, V] contiguous");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V >= 1 && V < (int64_t{1} << 31), "V must be in [1, 2^31)");
  auto out = torch::empty({B}, logits.options().dtype(torch::kInt64));
  const auto* lp = static_cast<const uint16_t*>(logits.data_ptr());
  int64_t* op = out.data_ptr<int64_t>();
#pragma omp parallel for schedule(static) if (B > 1)
  for (int64_t b = 0; b < B; b++) op[b] = argmax_row(lp + b * V, V);
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
#pragma omp parallel for schedule(static) if (T * W >= kMinParallelElements)
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
  m.def("rowwise_mm_bf16", &rowwise_mm_bf16);
  m.def("paged_decode_attention_bf16", &paged_decode_attention_bf16);
  m.def("write_kv_bf16", &write_kv_bf16);
  m.def("paged_decode_attention_int8", &paged_decode_attention_int8);
  m.def("write_kv_int8", &write_kv_int8);
  m.def("gather_int8_bf16", &gather_int8_bf16);
  m.def("decode_step_bf16", &decode_step_bf16);
  m.def("decode_step_int8", &decode_step_int8);
#ifdef TOKENFLEET_AMX
  m.def("amx_usable", &amx_permitted, "whether Linux lets this process use AMX tiles");
  m.def("prefill_attention_bf16", &prefill_attention_bf16);
#endif
}
