// Mixtures of experts on CPU for decode-sized steps (AVX512-BF16), checked against their torch references in
// tests/gpu_worker/engine/test_cpu_moe.py. A few rows of a step choose their k experts each; a loop over the experts
// would start a parallel region per expert and projection and run a dozen small torch ops around them. Here every
// chosen expert's rows run in one parallel loop over (expert, block of its weight rows), each thread one contiguous
// run of blocks (long sequential streams, as gemv_bf16 reads a weight), with bf16_rows.h's products: each output one
// fp32 chain over K, whatever the other rows.
#include <omp.h>

#include <vector>

#include "bf16_rows.h"
#include "cpu_kernels.h"

namespace {

constexpr int64_t kBlockRows = 16;  // weight rows per unit of work

struct ExpertRuns {
  std::vector<int64_t> chosen;  // the experts any row chose, ascending
  const int64_t* offsets;       // rows offsets[e] .. offsets[e + 1] are expert e's
};

// rows of w [E, N, K] times each chosen expert's rows of x [P, K] into y [P, N], in one parallel loop: call inside
// a parallel region (its `omp for` ends in a barrier).
void grouped_product(const ExpertRuns& runs, const uint16_t* x, const uint16_t* w, int64_t N, int64_t K,
                     uint16_t* y) {
  const int64_t blocks = (N + kBlockRows - 1) / kBlockRows;
  const int64_t items = static_cast<int64_t>(runs.chosen.size()) * blocks;
#pragma omp for schedule(static)
  for (int64_t item = 0; item < items; item++) {
    const int64_t e = runs.chosen[item / blocks], n0 = item % blocks * kBlockRows;
    const int64_t first = runs.offsets[e];
    rows_times_block_bf16(x + first * K, runs.offsets[e + 1] - first, w + e * N * K, K, y + first * N, N, n0,
                          std::min(N, n0 + kBlockRows));
  }
}

ExpertRuns runs_of(const at::Tensor& offsets, int64_t num_experts, int64_t rows) {
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) == num_experts + 1 && offsets.scalar_type() == at::kLong &&
                  offsets.is_contiguous(), "offsets must be [E + 1] int64");
  ExpertRuns runs{{}, offsets.data_ptr<int64_t>()};
  TORCH_CHECK(runs.offsets[0] == 0 && runs.offsets[num_experts] == rows, "offsets must run from 0 to x's rows");
  for (int64_t e = 0; e < num_experts; e++) {
    TORCH_CHECK(runs.offsets[e + 1] >= runs.offsets[e], "offsets must not decrease");
    if (runs.offsets[e + 1] > runs.offsets[e]) runs.chosen.push_back(e);
  }
  return runs;
}

const uint16_t* bf16_data(const at::Tensor& t) { return static_cast<const uint16_t*>(t.data_ptr()); }

void check_experts(const at::Tensor& w, int64_t K, const char* name) {
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.scalar_type() == at::kBFloat16 && w.size(2) == K && K % 32 == 0,
              name, " must be [E, N, K] contiguous bf16 with K = ", K, ", K % 32 == 0");
}

}  // namespace

// y[P, N]: rows offsets[e] .. offsets[e + 1] of x [P, K] (token-expert pairs sorted by expert) times w[e]^T, for
// every expert at once.
at::Tensor grouped_mm_bf16(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offsets) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x must be [P, K] contiguous bf16");
  check_experts(w, x.size(1), "w");
  const auto runs = runs_of(offsets, w.size(0), x.size(0));
  auto y = at::empty({x.size(0), w.size(1)}, x.options());
#pragma omp parallel
  grouped_product(runs, bf16_data(x), bf16_data(w), w.size(1), w.size(2), static_cast<uint16_t*>(y.data_ptr()));
  return y;
}

// The whole mixture of a few rows with SwiGLU experts, in one parallel region: out[t] = the sum over row t's k
// experts, in ascending expert order, of weight * down(silu(gate) * up)(x[t]). Each op's result is rounded to bf16
// where torch's ops would round it composed one by one over grouped_mm_bf16 (the projections, silu, the product, the
// weighting, each addition): equal to that composition bit for bit. x [T, H]; w_gate_up [E, 2I, H] (gate rows, then up rows);
// w_down [E, H, I]; weights [T, k] bf16; experts [T, k] int64.
at::Tensor moe_silu_bf16(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down,
                         const at::Tensor& weights, const at::Tensor& experts) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x must be [T, H] contiguous bf16");
  const int64_t T = x.size(0), H = x.size(1), E = w_gate_up.size(0), I = w_gate_up.size(1) / 2;
  check_experts(w_gate_up, H, "w_gate_up");
  check_experts(w_down, I, "w_down");
  TORCH_CHECK(w_down.size(0) == E && w_down.size(1) == H, "w_down must be [E, H, I]");
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == T && experts.scalar_type() == at::kLong &&
                  experts.is_contiguous(), "experts must be [T, k] int64");
  TORCH_CHECK(weights.sizes() == experts.sizes() && weights.scalar_type() == at::kBFloat16 && weights.is_contiguous(),
              "weights must be [T, k] bf16");
  const int64_t k = experts.size(1), P = T * k;
  const auto* chosen = experts.data_ptr<int64_t>();
  // Each row's experts in ascending order (pair t * k + j is row t's j-th), then the pairs sorted by expert.
  std::vector<int64_t> pair_expert(P), slot(P), counts(E, 0);
  for (int64_t t = 0; t < T; t++) {
    std::vector<int64_t> order(k);
    for (int64_t j = 0; j < k; j++) order[j] = j;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return chosen[t * k + a] < chosen[t * k + b]; });
    for (int64_t j = 0; j < k; j++) {
      const int64_t e = chosen[t * k + order[j]];
      TORCH_CHECK(e >= 0 && e < E, "expert ", e, " out of range");
      pair_expert[t * k + j] = e;
      slot[t * k + j] = order[j];  // where its weight is
      counts[e]++;
    }
  }
  auto offsets = at::empty({E + 1}, experts.options());
  auto* off = offsets.data_ptr<int64_t>();
  off[0] = 0;
  for (int64_t e = 0; e < E; e++) off[e + 1] = off[e] + counts[e];
  std::vector<int64_t> row_of(P), next(off, off + E);  // sorted position -> pair; pair -> sorted position
  std::vector<int64_t> position(P);
  for (int64_t p = 0; p < P; p++) {
    position[p] = next[pair_expert[p]]++;
    row_of[position[p]] = p / k;
  }
  const auto runs = runs_of(offsets, E, P);
  auto gathered = at::empty({P, H}, x.options()), gate_up = at::empty({P, 2 * I}, x.options());
  auto hidden = at::empty({P, I}, x.options()), per_pair = at::empty({P, H}, x.options());
  auto out = at::empty({T, H}, x.options());
  const uint16_t *xp = bf16_data(x), *wp = bf16_data(weights);
  auto *gp = static_cast<uint16_t*>(gathered.data_ptr()), *up = static_cast<uint16_t*>(gate_up.data_ptr());
  auto *hp = static_cast<uint16_t*>(hidden.data_ptr()), *pp = static_cast<uint16_t*>(per_pair.data_ptr());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t s = 0; s < P; s++) std::memcpy(gp + s * H, xp + row_of[s] * H, H * sizeof(uint16_t));
    grouped_product(runs, gp, bf16_data(w_gate_up), 2 * I, H, up);
#pragma omp for schedule(static)
    for (int64_t s = 0; s < P; s++) elementwise::silu_and_mul_row<Avx512>(up + s * 2 * I, hp + s * I, I);
    grouped_product(runs, hp, bf16_data(w_down), H, I, pp);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++)
      for (int64_t h = 0; h < H; h++) {
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) {
          const int64_t p = t * k + j;
          const float weighted = bf16_value(to_bf16(bf16_value(pp[position[p] * H + h]) *
                                                    bf16_value(wp[t * k + slot[p]])));
          sum = j == 0 ? weighted : bf16_value(to_bf16(sum + weighted));
        }
        op[t * H + h] = to_bf16(sum);
      }
  }
  return out;
}
