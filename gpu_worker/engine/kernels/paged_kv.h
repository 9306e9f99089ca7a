// What the decode steps of both native CPU modules (cpu_attention_kernels.cpp on AVX-512, cpu_avx2_kernels.cpp on
// AVX2) share: a decode batch's tasks and their rows in the paged cache [blocks, KVH, block_size, D], the rotation of
// a fused projection's q and k heads, and the KV write.
#pragma once
#include "torch_api.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "elementwise.h"

namespace paged_kv {

// Token t's cache row for KV head `head` of a sequence whose block table is `table` [.., block_size rows each],
// for first <= t < L, as rows[t - first], listed once: a division per token and use took a third of the decode
// kernel's time. The table's entries before the block of `first` are not read (a sliding window's freed blocks).
inline void list_rows(const int64_t* table, int64_t head, int64_t KVH, int64_t block_size, int64_t first, int64_t L,
                      std::vector<int64_t>& rows) {
  rows.resize(std::max<int64_t>(0, L - first));
  for (int64_t block = first / block_size; block * block_size < L; block++) {
    const int64_t base = (table[block] * KVH + head) * block_size - block * block_size;  // row of token t: base + t
    for (int64_t t = std::max(first, block * block_size); t < std::min(L, (block + 1) * block_size); t++)
      rows[t - first] = base + t;
  }
}

// Each of the H query heads' sink logit (gpt-oss's attention sinks: one more score in its softmax, with no value
// behind it), float32 [H]; nullptr for none.
inline const float* sink_logits(const c10::optional<at::Tensor>& sinks, int64_t H) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == H,
              "sinks must be float32 [H]");
  return sinks->data_ptr<float>();
}

// Decode attention's batch: one query token per sequence, H query heads sharing KVH key/value heads, a task per
// (sequence, KV head) that reads that head's context once for its G query heads. q [B, H, D] bf16 with contiguous
// heads, its rows strided (a view of the fused projection's rows: no copy of the queries), block_tables
// [B, max_blocks], context_lens [B]; `out` is the result [B, H, D], contiguous. With a sliding `window` (> 0; 0:
// none) a row of context L sees its last `window` tokens only, [max(0, L - window), L); the table's entries before
// that first key's block may be freed (-1) and are never read.
struct DecodeBatch {
  at::Tensor tables, lens, out;
  int64_t B, H, D, KVH, G, block_size, max_blocks, q_row, window;
  const float* sinks = nullptr;  // each query head's sink logit (gpt-oss), or none

  DecodeBatch(const at::Tensor& q, int64_t kv_heads, int64_t block_size_, const at::Tensor& block_tables,
              const at::Tensor& context_lens, int64_t window_, const c10::optional<at::Tensor>& sink_logits)
      : tables(block_tables.to(at::kLong).contiguous()), lens(context_lens.to(at::kLong).contiguous()),
        B(q.size(0)), H(q.size(1)), D(q.size(2)), KVH(kv_heads), G(q.size(1) / kv_heads), block_size(block_size_),
        max_blocks(tables.size(1)), q_row(q.stride(0)), window(window_) {
    TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && q.scalar_type() == at::kBFloat16,
                "q must be bf16 with contiguous heads");
    TORCH_CHECK(D % 32 == 0 && H % KVH == 0, "head_dim % 32 == 0 and whole query groups");
    TORCH_CHECK(window >= 0, "window: a positive number of tokens, or 0 for none");
    sinks = paged_kv::sink_logits(sink_logits, H);
    out = at::empty({B, H, D}, q.options());
  }
  // Query head g of the task's group: its sink logit, joined to its softmax as one more score with no value behind
  // it; -inf (no share of the softmax) where the heads have none.
  float sink(int64_t task, int64_t g) const { return sinks ? sinks[head(task) * G + g] : -INFINITY; }
  int64_t tasks() const { return B * KVH; }
  int64_t sequence(int64_t task) const { return task / KVH; }
  int64_t head(int64_t task) const { return task % KVH; }
  int64_t context(int64_t task) const { return lens.data_ptr<int64_t>()[sequence(task)]; }
  // The first position the task's row sees.
  int64_t first_key(int64_t task) const { return window > 0 ? std::max<int64_t>(0, context(task) - window) : 0; }
  // The task's G query heads [G, D] in q, and where their outputs go in `out`.
  const uint16_t* queries(const at::Tensor& q, int64_t task) const {
    return static_cast<const uint16_t*>(q.data_ptr()) + sequence(task) * q_row + head(task) * G * D;
  }
  uint16_t* outputs(int64_t task) const {
    return static_cast<uint16_t*>(out.data_ptr()) + (sequence(task) * H + head(task) * G) * D;
  }
  // The cache rows of the task's tokens from position `first` (first_key, or a position before it in its block) to
  // the end of its context.
  void list_task_rows(int64_t task, int64_t first, std::vector<int64_t>& rows) const {
    list_rows(tables.data_ptr<int64_t>() + sequence(task) * max_blocks, head(task), KVH, block_size, first,
              context(task), rows);
  }
};

// Calls row(t, h, dst_row, src_k, src_v) for each token t and KV head h of k, v [T, KVH, D] (column slices of
// the fused qkv output: only each token's [KVH, D] must be contiguous), dst_row its cache row.
template <typename F>
void for_each_slot(const at::Tensor& k, const at::Tensor& v, int64_t KVH_cache, int64_t block_size,
                   const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, F&& row) {
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  TORCH_CHECK(k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16, "k and v must be bf16");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D, "rows [KVH, D] contiguous");
  TORCH_CHECK(KVH_cache == KVH, "the cache holds ", KVH_cache, " KV heads, k has ", KVH);
  const int64_t* bp = slot_blocks.data_ptr<int64_t>();
  const int64_t* op = slot_offsets.data_ptr<int64_t>();
  const auto* kp = static_cast<const uint16_t*>(k.data_ptr());
  const auto* vp = static_cast<const uint16_t*>(v.data_ptr());
  // In parallel for a batch: each row's lines are cold (the cache's rows were last touched a step ago), and one
  // thread's serial writes, a measurable share of the mixed workload (`tokenfleet bench engine`), left the other
  // waiting.
#pragma omp parallel for schedule(static) if (T * KVH >= 64)
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < KVH; h++)
      row((bp[t] * KVH + h) * block_size + op[t], kp + t * k.stride(0) + h * D, vp + t * v.stride(0) + h * D);
}

// cache[slot_blocks[t], :, slot_offsets[t]] = rows[t] for k and v of a bf16 cache: what the reference's two
// index_put calls do, in one call without the advanced-indexing overhead (a share of a batch-1 decode step).
inline void write_rows(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                       const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cache [blocks, KVH, bs, D] contiguous");
  const int64_t D = k.size(2);
  auto* kc = static_cast<uint16_t*>(k_cache.data_ptr());
  auto* vc = static_cast<uint16_t*>(v_cache.data_ptr());
  for_each_slot(k, v, k_cache.size(1), k_cache.size(2), slot_blocks, slot_offsets,
                [&](int64_t dst, const uint16_t* ks, const uint16_t* vs) {
                  std::memcpy(kc + dst * D, ks, D * 2);
                  std::memcpy(vc + dst * D, vs, D * 2);
                });
}

// q [B, H, D], k and v [B, KVH, D]: views of a fused projection's rows qkv [B, (H + 2 KVH) D], after rotating
// q's and k's heads in place.
struct RotatedQkv {
  at::Tensor q, k, v;
};

template <class V>
RotatedQkv rotate(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t H, int64_t KVH) {
  const int64_t B = qkv.size(0), D = qkv.size(1) / (H + 2 * KVH);
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D, "qkv holds ", H, " query and 2 x ", KVH, " key/value heads");
  elementwise::rotary_inplace<V>(qkv, cos, sin, H + KVH, D);
  return {qkv.narrow(1, 0, H * D).view({B, H, D}), qkv.narrow(1, H * D, KVH * D).view({B, KVH, D}),
          qkv.narrow(1, (H + KVH) * D, KVH * D).view({B, KVH, D})};
}

using DecodeAttention = at::Tensor (*)(const at::Tensor& q, const at::Tensor& k_cache,
                                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                                          const at::Tensor& context_lens, double scale, int64_t window,
                                          const c10::optional<at::Tensor>& sinks);

// A decode-only step's attention for one layer in one call: rotary (on V's vectors), the KV write and `attend`,
// which as four calls from Python (with the split of qkv and the cache's views) spent more time in the interpreter
// than in the kernels at batch 1. Returns [B, H * D].
template <class V, DecodeAttention attend>
at::Tensor decode_step_bf16(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                               const at::Tensor& kv_cache, const at::Tensor& slot_blocks,
                               const at::Tensor& slot_offsets, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, int64_t H, int64_t KVH, double scale,
                               int64_t window, const c10::optional<at::Tensor>& sinks) {
  auto [q, k, v] = rotate<V>(qkv, cos, sin, H, KVH);
  auto k_cache = kv_cache.select(0, 0), v_cache = kv_cache.select(0, 1);
  write_rows(k, v, k_cache, v_cache, slot_blocks, slot_offsets);
  return attend(q, k_cache, v_cache, block_tables, context_lens, scale, window, sinks).view({q.size(0), -1});
}

// An int8 cache's planes: kv_data int8 [2, blocks, KVH, block_size, D] (keys, values), kv_scale bf16 [2, blocks, KVH,
// block_size], a scale per row.
inline void check_int8_cache(const at::Tensor& kv_data, const at::Tensor& kv_scale) {
  TORCH_CHECK(kv_data.is_contiguous() && kv_scale.is_contiguous() && kv_data.scalar_type() == at::kChar &&
                  kv_scale.scalar_type() == at::kBFloat16 && kv_data.size(4) % 16 == 0,
              "an int8 cache with bf16 scales, contiguous, head_dim % 16 == 0");
}

// One row x [D] bf16 as int8 with its bf16 scale (see each module's quantize_row).
using QuantizeRow = void (*)(const uint16_t* x, int64_t D, int8_t* q, uint16_t* scale);
// One int8 row with its bf16 scale as bf16 [D], each value q * scale rounded.
using DequantizeRow = void (*)(const int8_t* q, uint16_t scale, int64_t D, uint16_t* out);

// write_rows into an int8 cache: each row quantized with its own scale as it is written.
template <QuantizeRow quantize>
void write_int8_rows(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_data, at::Tensor& kv_scale,
                     const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  check_int8_cache(kv_data, kv_scale);
  const int64_t D = k.size(2), values = kv_data[0].numel(), scales = kv_scale[0].numel();
  auto* data = kv_data.data_ptr<int8_t>();
  auto* scale = static_cast<uint16_t*>(kv_scale.data_ptr());
  for_each_slot(k, v, kv_data.size(2), kv_data.size(3), slot_blocks, slot_offsets,
                [&](int64_t dst, const uint16_t* ks, const uint16_t* vs) {
                  quantize(ks, D, data + dst * D, scale + dst);
                  quantize(vs, D, data + values + dst * D, scale + scales + dst);
                });
}

// The int8 cache's keys (which = 0) or values (1) of `length` tokens through each row's block table, dequantized to
// bf16 in one pass: [B, KVH, length, D], what the reference's gather computes (q as bf16 times the row's bf16
// scale, rounded). Prefill over a cached context attends over this copy; the reference's gather, dequantize and
// multiply took four passes in torch's bf16 ops. A freed entry (-1: a block wholly before a sliding window) is not
// read: its tokens come out as zeros, where the reference gathers block 0 in its place (masked, either way).
template <DequantizeRow dequantize>
at::Tensor gather_int8_rows(const at::Tensor& kv_data, const at::Tensor& kv_scale, int64_t which,
                               const at::Tensor& block_tables, int64_t length) {
  check_int8_cache(kv_data, kv_scale);
  TORCH_CHECK(which == 0 || which == 1, "which: 0 (keys) or 1 (values)");
  const int64_t KVH = kv_data.size(2), bs = kv_data.size(3), D = kv_data.size(4);
  auto tables = block_tables.to(at::kLong).contiguous();
  const int64_t B = tables.size(0), max_blocks = tables.size(1);
  TORCH_CHECK(length <= max_blocks * bs, "length ", length, " is past the block tables' ", max_blocks * bs, " tokens");
  auto out = at::empty({B, KVH, length, D}, kv_scale.options());
  const int8_t* data = kv_data.data_ptr<int8_t>() + which * kv_data[0].numel();
  const auto* scales = static_cast<const uint16_t*>(kv_scale.data_ptr()) + which * kv_scale[0].numel();
  const int64_t* tp = tables.data_ptr<int64_t>();
  auto* op = static_cast<uint16_t*>(out.data_ptr());
#pragma omp parallel for schedule(static) if (B * KVH * length * D >= elementwise::kMinParallelElements)
  for (int64_t b = 0; b < B * KVH; b++) {
    const int64_t* table = tp + (b / KVH) * max_blocks;
    for (int64_t t0 = 0; t0 < length; t0 += bs) {
      const int64_t n = std::min(bs, length - t0);
      uint16_t* dst = op + (b * length + t0) * D;
      if (table[t0 / bs] < 0) {
        std::memset(dst, 0, n * D * sizeof(uint16_t));
        continue;
      }
      const int64_t first = (table[t0 / bs] * KVH + b % KVH) * bs;
      for (int64_t i = 0; i < n; i++) dequantize(data + (first + i) * D, scales[first + i], D, dst + i * D);
    }
  }
  return out;
}

using Int8Write = void (*)(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_data,
                          at::Tensor& kv_scale, const at::Tensor& slot_blocks, const at::Tensor& slot_offsets);

// The same over an int8 cache (kv_data int8 [2, blocks, KVH, block_size, D], kv_scale [2, blocks, KVH, block_size]):
// `write` quantizes each row as it writes it, `attend` reads the cache at one byte a value.
template <class V, Int8Write write, DecodeAttention attend>
at::Tensor decode_step_int8(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                               const at::Tensor& kv_data, const at::Tensor& kv_scale,
                               const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                               const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t H,
                               int64_t KVH, double scale, int64_t window,
                               const c10::optional<at::Tensor>& sinks) {
  auto [q, k, v] = rotate<V>(qkv, cos, sin, H, KVH);
  auto data = kv_data, scales = kv_scale;
  write(k, v, data, scales, slot_blocks, slot_offsets);
  return attend(q, kv_data, kv_scale, block_tables, context_lens, scale, window, sinks).view({q.size(0), -1});
}

}  // namespace paged_kv
