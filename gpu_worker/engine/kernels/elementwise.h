// The bf16 element-wise kernels (RMSNorm, its residual add, SiLU·mul, rotary, argmax), written once over a vector
// type from vec.h and built per instruction set: into cpu_kernels (AVX-512) and cpu_avx2_kernels (AVX2, for CPUs
// without AVX-512, where torch's bf16 element-wise ops take a large share of a batch-1 token:
// `python -m bench.lab.avx2_path`). Each rounds as its
// torch reference in ops.py does and is checked against it in tests/gpu_worker/engine/test_cpu_kernels.py. All are
// memory-bound: the torch path moves the same bytes several times (upcasts, one pass per op).
#pragma once
#include "torch_api.h"

#include <cmath>
#include <vector>

#include "vec.h"

namespace elementwise {

// Element-wise work below which a kernel runs on the calling thread: a decode step's one-row ops took several
// times their arithmetic in starting and joining the parallel region.
constexpr int64_t kMinParallelElements = 1 << 15;

// exp: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, p a degree-6 Taylor polynomial (relative error < 2e-7, below
// bf16's resolution). x is clamped to [-87, 89]: e^89 is past fp32's range already (inf), and n stays where each
// vector's scaling by 2^n is exact.
template <class V>
inline typename V::F exp(typename V::F x) {
  x = V::min(V::max(x, V::set1(-87.0f)), V::set1(89.0f));
  const auto n = V::round_to_int(V::mul(x, V::set1(1.44269504f)));
  const auto r = V::fnmadd(n, V::set1(0.693147181f), x);
  auto p = V::set1(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = V::fmadd(p, r, V::set1(c));
  return V::scale_by_pow2(p, n);
}

// out[I] = bf16(silu(gate)) * up for one row x = [gate | up] of 2I, each op's result rounded to bf16 as torch's.
template <class V>
inline void silu_and_mul_row(const uint16_t* x, uint16_t* out, int64_t I) {
  // silu(g) = g / (1 + e^-g): with g above 88 (e^-g below fp32's range) e^-g clamps at e^-87, which divides g by 1.
  const auto one = V::set1(1.0f), minus = V::set1(-1.0f);
  for (int64_t i = 0; i < I; i += V::kLanes) {
    const auto g = V::load_bf16(x + i), u = V::load_bf16(x + I + i);
    const auto act = V::round_bf16(V::div(g, V::add(one, exp<V>(V::mul(g, minus)))));
    V::store_bf16(out + i, V::mul(act, u));
  }
}

// The same over [T, 2I] rows.
template <class V>
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.size(1) % 32 == 0, "x must be [T, 2I] contiguous, I % 16 == 0");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = at::empty({T, I}, x.options());
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
#pragma omp parallel for schedule(static) if (T * I >= kMinParallelElements)
  for (int64_t t = 0; t < T; t++) silu_and_mul_row<V>(xp + t * 2 * I, op + t * I, I);
  return out;
}

// HF's RMSNorm on one row: normalize in fp32, round to bf16, then multiply by the bf16 weight.
template <class V>
inline void rms_norm_row(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t H, float eps) {
  auto sq = V::set1(0.0f);
  for (int64_t h = 0; h < H; h += V::kLanes) {
    const auto v = V::load_bf16(x + h);
    sq = V::fmadd(v, v, sq);
  }
  const auto inv = V::set1(1.0f / std::sqrt(V::reduce_add(sq) / H + eps));
  for (int64_t h = 0; h < H; h += V::kLanes)
    V::store_bf16(out + h, V::mul(V::load_bf16(w + h), V::round_bf16(V::mul(V::load_bf16(x + h), inv))));
}

template <class V>
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 16 == 0, "x must be contiguous, hidden % 16 == 0");
  const int64_t H = x.size(-1), T = x.numel() / H;
  auto out = at::empty_like(x);
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = static_cast<const uint16_t*>(weight.data_ptr());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
#pragma omp parallel for schedule(static) if (T * H >= kMinParallelElements)
  for (int64_t t = 0; t < T; t++) rms_norm_row<V>(xp + t * H, wp, op + t * H, H, static_cast<float>(eps));
  return out;
}

// (rms_norm(x + residual), x + residual), the sum rounded to bf16 as torch's add: the residual stream's add and the
// next norm in one pass over the row instead of two ops.
template <class V>
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                        const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes() && x.size(-1) % 16 == 0,
              "x and residual must be contiguous, of one shape, hidden % 16 == 0");
  const int64_t H = x.size(-1), T = x.numel() / H;
  auto out = at::empty_like(x);
  auto sum = at::empty_like(x);
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  const auto* rp = static_cast<const uint16_t*>(residual.data_ptr());
  const auto* wp = static_cast<const uint16_t*>(weight.data_ptr());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
  auto* sp = static_cast<uint16_t*>(sum.data_ptr());
#pragma omp parallel for schedule(static) if (T * H >= kMinParallelElements)
  for (int64_t t = 0; t < T; t++) {
    for (int64_t h = 0; h < H; h += V::kLanes)
      V::store_bf16(sp + t * H + h, V::add(V::load_bf16(xp + t * H + h), V::load_bf16(rp + t * H + h)));
    rms_norm_row<V>(sp + t * H, wp, op + t * H, H, static_cast<float>(eps));
  }
  return {out, sum};
}

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_value(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The first index of a bf16 row's maximum, as torch.argmax. One pass, each lane keeping its first maximum and where
// it was: a second, scalar pass to find the maximum's first index was a visible share of a large decode step. A row
// with a NaN (torch's argmax picks the first) takes the scalar search.
template <class V>
int64_t argmax_row(const uint16_t* row, int64_t width) {
  auto best = V::set1(-INFINITY);
  auto best_at = V::zero_int(), at = V::iota();
  auto nan = V::no_lanes();
  int64_t v = 0;
  for (; v + V::kLanes <= width; v += V::kLanes, at = V::add_int(at, V::kLanes)) {
    const auto x = V::load_bf16(row + v);
    nan = V::either(nan, V::unordered(x));
    const auto greater = V::greater(x, best);
    best = V::select(greater, x, best);
    best_at = V::select_int(greater, at, best_at);
  }
  // The lanes holding the maximum: the least of their first indices (0 where a lane saw only -inf, as torch).
  float lanes[V::kLanes];
  int32_t lanes_at[V::kLanes];
  V::store(lanes, best);
  V::store_int(lanes_at, best_at);
  float mx = -INFINITY;
  for (const float f : lanes) mx = std::max(mx, f);
  int64_t index = width;
  for (int i = 0; i < V::kLanes; i++)
    if (lanes[i] == mx) index = std::min<int64_t>(index, lanes_at[i]);
  bool tail_nan = false;
  for (int64_t r = v; r < width; r++) {
    const float f = bf16_value(row[r]);
    tail_nan |= f != f;
    if (f > mx) mx = f, index = r;
  }
  if (!V::any(nan) && !tail_nan) return index;
  for (index = 0; index < width - 1; index++) {
    const float f = bf16_value(row[index]);
    if (f != f) break;
  }
  return index;
}

template <class V>
at::Tensor argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits must be [B, V] contiguous");
  const int64_t B = logits.size(0), width = logits.size(1);
  TORCH_CHECK(width >= 1 && width < (int64_t{1} << 31), "V must be in [1, 2^31)");
  auto out = at::empty({B}, logits.options().dtype(at::kLong));
  const auto* lp = static_cast<const uint16_t*>(logits.data_ptr());
  int64_t* op = out.data_ptr<int64_t>();
#pragma omp parallel for schedule(static) if (B > 1)
  for (int64_t b = 0; b < B; b++) op[b] = argmax_row<V>(lp + b * width, width);
  return out;
}

// In-place rotary embedding (HF's rotate-half layout) of the first `heads` heads of each row of qkv [T, W], with
// HF's bf16 rounding: x*cos and rotate_half(x)*sin each rounded, then their sum.
template <class V>
void rotary_inplace(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                    int64_t head_dim) {
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && head_dim % 32 == 0,
              "contiguous inputs, head_dim % 32 == 0");
  const int64_t T = qkv.size(0), W = qkv.size(1), half = head_dim / 2;
  auto* xp = static_cast<uint16_t*>(qkv.data_ptr());
  const auto* cp = static_cast<const uint16_t*>(cos.data_ptr());
  const auto* sp = static_cast<const uint16_t*>(sin.data_ptr());
  const auto minus = V::set1(-1.0f);
#pragma omp parallel for schedule(static) if (T * W >= kMinParallelElements)
  for (int64_t t = 0; t < T; t++) {
    for (int64_t h = 0; h < heads; h++) {
      uint16_t* x = xp + t * W + h * head_dim;
      for (int64_t i = 0; i < half; i += V::kLanes) {
        const auto c = V::load_bf16(cp + t * head_dim + i), s = V::load_bf16(sp + t * head_dim + i);
        const auto x1 = V::load_bf16(x + i), x2 = V::load_bf16(x + half + i);
        V::store_bf16(x + i, V::add(V::round_bf16(V::mul(x1, c)), V::round_bf16(V::mul(V::mul(x2, minus), s))));
        V::store_bf16(x + half + i, V::add(V::round_bf16(V::mul(x2, c)), V::round_bf16(V::mul(x1, s))));
      }
    }
  }
}

// The kernels under the names ops.py calls, for a module built for V.
template <class V>
void bind(pybind11::module_& m) {
  m.def("silu_and_mul_bf16", &silu_and_mul<V>);
  m.def("rms_norm_bf16", &rms_norm<V>);
  m.def("add_rms_norm_bf16", &add_rms_norm<V>);
  m.def("argmax_bf16", &argmax<V>);
  m.def("rotary_inplace_bf16", &rotary_inplace<V>);
}

}  // namespace elementwise
