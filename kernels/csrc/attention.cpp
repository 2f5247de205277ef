// Paged attention for CPU query rows that read K/V straight from the paged cache (AVX2 + FMA).
//
// Why: gathering every sequence's K/V blocks into a padded tensor before SDPA reads the cache,
// writes a copy and reads the copy again. Decode is memory-bound, so walking the block table in
// place and reading each K/V row exactly once is the floor.
//
// A "row" is one query token: (index into query/out, sequence, number of visible keys). A
// decode token sees its whole sequence; token j of a prefill chunk of q_len tokens in a
// sequence of seq_len sees seq_len - q_len + j + 1 keys. Only slots < visible length are ever
// read, so unwritten (even NaN) cache slots cannot leak into the output.
//
// Work item = (row, range of KV heads). For each KV head, its G = num_heads / num_kv_heads
// query heads are processed together, so each K and V row is loaded once per KV head. Softmax
// is exact two-pass in fp32: scores of all visible keys into a per-thread buffer, then exp and
// sum, then out = sum_t p_t * V_t / sum. fp16/bf16 caches are converted to fp32 on load.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include "cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace pagedq_cpu {
namespace {

constexpr int64_t kLanes = 8;  // floats per __m256
constexpr int kMaxRowsPerDot = 4;
// Tokens per step of the block loop; each step also prefetches the same rows of the block
// kPrefetchAhead entries further down the block table.
constexpr int64_t kStepRows = 8;
constexpr int64_t kPrefetchAhead = 1;

// ---- fp32 loads of 8 cache elements ------------------------------------------------------

template <typename T>
inline __m256 load8(const T* p);

template <>
inline __m256 load8<float>(const float* p) {
  return _mm256_loadu_ps(p);
}

template <>
inline __m256 load8<c10::Half>(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <>
inline __m256 load8<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Four horizontal sums at once: {sum(a), sum(b), sum(c), sum(d)}.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Stores the horizontal sums of acc[0..NT) to dst[0..NT).
template <int NT>
inline void store_sums(const __m256* acc, float* dst) {
  if constexpr (NT == 8) {
    _mm_storeu_ps(dst, hsum4(acc[0], acc[1], acc[2], acc[3]));
    _mm_storeu_ps(dst + 4, hsum4(acc[4], acc[5], acc[6], acc[7]));
  } else if constexpr (NT == 4) {
    _mm_storeu_ps(dst, hsum4(acc[0], acc[1], acc[2], acc[3]));
  } else {
    for (int j = 0; j < NT; ++j) dst[j] = hsum(acc[j]);
  }
}

// Tokens per QK tile for NG query rows: NG * NT accumulators + NG query vectors + one K
// vector fit the 16 ymm registers.
template <int NG>
constexpr int tile_tokens() {
  return NG == 1 ? 8 : NG == 4 ? 2 : 4;
}

// scores[g * s_stride + j] = dot(q[g * D :], k[j * k_stride :]) for NG query rows x NT tokens.
template <typename T, int NG, int NT>
inline void qk_tile(const T* k, int64_t k_stride, const float* q, int64_t D, float* scores,
                    int64_t s_stride) {
  __m256 acc[NG][NT];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < NT; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += kLanes) {
    __m256 qv[NG];
    for (int g = 0; g < NG; ++g) qv[g] = _mm256_loadu_ps(q + g * D + d);
    for (int j = 0; j < NT; ++j) {
      const __m256 kv = load8(k + j * k_stride + d);
      for (int g = 0; g < NG; ++g) acc[g][j] = _mm256_fmadd_ps(qv[g], kv, acc[g][j]);
    }
  }
  for (int g = 0; g < NG; ++g) store_sums<NT>(acc[g], scores + g * s_stride);
}

// Scores of n consecutive tokens of one block for NG query rows.
template <typename T, int NG>
inline void qk_rows(const T* k, int64_t k_stride, int64_t n, const float* q, int64_t D,
                    float* scores, int64_t s_stride) {
  constexpr int NT = tile_tokens<NG>();
  int64_t o = 0;
  for (; o + NT <= n; o += NT) qk_tile<T, NG, NT>(k + o * k_stride, k_stride, q, D, scores + o, s_stride);
  for (; o < n; ++o) qk_tile<T, NG, 1>(k + o * k_stride, k_stride, q, D, scores + o, s_stride);
}

// acc[g * D + d] += sum_o p[g * p_stride + o] * v[o * v_stride + d] over n tokens, for NG rows
// and NV * 8 dims starting at d = 0 (pointers come pre-offset); accumulators stay in registers.
template <typename T, int NG, int NV>
inline void pv_tile(const T* v, int64_t v_stride, int64_t n, const float* p, int64_t p_stride,
                    float* acc, int64_t D) {
  __m256 a[NG][NV];
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < NV; ++i) a[g][i] = _mm256_loadu_ps(acc + g * D + i * kLanes);
  for (int64_t o = 0; o < n; ++o) {
    __m256 pb[NG];
    for (int g = 0; g < NG; ++g) pb[g] = _mm256_broadcast_ss(p + g * p_stride + o);
    for (int i = 0; i < NV; ++i) {
      const __m256 vv = load8(v + o * v_stride + i * kLanes);
      for (int g = 0; g < NG; ++g) a[g][i] = _mm256_fmadd_ps(pb[g], vv, a[g][i]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + g * D + i * kLanes, a[g][i]);
}

// Weighted V of n consecutive tokens of one block for NG query rows, all D dims.
template <typename T, int NG>
inline void pv_rows(const T* v, int64_t v_stride, int64_t n, const float* p, int64_t p_stride,
                    float* acc, int64_t D) {
  constexpr int NV = NG == 4 ? 2 : 4;
  int64_t d = 0;
  for (; d + NV * kLanes <= D; d += NV * kLanes)
    pv_tile<T, NG, NV>(v + d, v_stride, n, p, p_stride, acc + d, D);
  for (; d < D; d += kLanes) pv_tile<T, NG, 1>(v + d, v_stride, n, p, p_stride, acc + d, D);
}

// The G query rows of one KV head, in chunks of at most four rows.
template <typename T>
inline void qk_group(const T* k, int64_t k_stride, int64_t n, const float* q, int64_t G,
                     int64_t D, float* scores, int64_t s_stride) {
  for (int64_t g = 0; g < G; g += kMaxRowsPerDot) {
    const float* qg = q + g * D;
    float* sg = scores + g * s_stride;
    switch (std::min<int64_t>(kMaxRowsPerDot, G - g)) {
      case 1: qk_rows<T, 1>(k, k_stride, n, qg, D, sg, s_stride); break;
      case 2: qk_rows<T, 2>(k, k_stride, n, qg, D, sg, s_stride); break;
      case 3: qk_rows<T, 3>(k, k_stride, n, qg, D, sg, s_stride); break;
      default: qk_rows<T, 4>(k, k_stride, n, qg, D, sg, s_stride); break;
    }
  }
}

template <typename T>
inline void pv_group(const T* v, int64_t v_stride, int64_t n, const float* p, int64_t p_stride,
                     int64_t G, int64_t D, float* acc) {
  for (int64_t g = 0; g < G; g += kMaxRowsPerDot) {
    const float* pg = p + g * p_stride;
    float* ag = acc + g * D;
    switch (std::min<int64_t>(kMaxRowsPerDot, G - g)) {
      case 1: pv_rows<T, 1>(v, v_stride, n, pg, p_stride, ag, D); break;
      case 2: pv_rows<T, 2>(v, v_stride, n, pg, p_stride, ag, D); break;
      case 3: pv_rows<T, 3>(v, v_stride, n, pg, p_stride, ag, D); break;
      default: pv_rows<T, 4>(v, v_stride, n, pg, p_stride, ag, D); break;
    }
  }
}

// Software prefetch of rows [o0, o1) (heads h0..h1 of each) of a block further down the block
// table: every block is a jump the hardware prefetchers cannot predict. Issued a few rows at a
// time, interleaved with the compute, so the misses overlap it without flooding the fill buffers.
// Into L2 (T1), not L1: the L1 fill buffers are few, and the loads that follow hit L2 fast
// enough; T0 prefetches of a working set past L3 stall on those buffers and end up slower than
// no software prefetch at all.
template <typename T>
inline void prefetch_rows(const T* block, int64_t o0, int64_t o1, int64_t row_stride,
                          int64_t head_stride, int64_t h0, int64_t h1, int64_t D) {
  const int64_t bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t o = o0; o < o1; ++o)
    for (int64_t h = h0; h < h1; ++h) {
      const char* p = reinterpret_cast<const char*>(block + o * row_stride + h * head_stride);
      for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
    }
}

// In place: s[t] = exp(s[t] - max) for t < n; returns the sum.
inline float exp_and_sum(float* s, int64_t n, float max) {
  const __m256 m = _mm256_set1_ps(max);
  __m256 total = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
    _mm256_storeu_ps(s + t, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = hsum(total);
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - max);
    sum += s[t];
  }
  return sum;
}

struct Geometry {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size;
  int64_t q_stride0, q_stride1, o_stride0, o_stride1;
  int64_t k_stride0, k_stride1, k_stride2, v_stride0, v_stride1, v_stride2;
  int64_t table_stride;
};

// Per-thread scratch: scaled fp32 queries, scores/probabilities and output accumulators of
// the heads of one work item.
struct Scratch {
  std::vector<float> q, scores, acc, sums;
  Scratch(int64_t heads, int64_t head_dim, int64_t max_len)
      : q(heads * head_dim), scores(heads * max_len), acc(heads * head_dim), sums(heads) {}
};

// QT: query/out dtype; T: cache dtype (the same, or fp16/bf16 under fp32 queries: a cache in
// half the bytes, which is what bounds attention over long contexts).
template <typename QT, typename T>
void attend(const Geometry& geo, const QT* query, const T* k_cache, const T* v_cache,
            const int32_t* table, int64_t token, int64_t len, int64_t h0, int64_t h1, float scale,
            QT* out, Scratch& buf) {
  const int64_t G = geo.group, D = geo.head_dim, bs = geo.block_size;
  const int64_t rows = (h1 - h0) * G;  // query heads of this item, as rows h0 * G ...
  float* q = buf.q.data();
  float* scores = buf.scores.data();  // [rows][len]
  float* acc = buf.acc.data();        // [rows][D]
  for (int64_t r = 0; r < rows; ++r) {
    const QT* src = query + token * geo.q_stride0 + (h0 * G + r) * geo.q_stride1;
    for (int64_t d = 0; d < D; ++d) q[r * D + d] = static_cast<float>(src[d]) * scale;
  }
  // Pass 1: scores of every visible key, block by block through the block table.
  const int64_t num_blocks = (len + bs - 1) / bs;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t t0 = b * bs, n = std::min(bs, len - t0);
    const T* block = k_cache + static_cast<int64_t>(table[b]) * geo.k_stride0;
    const int64_t ahead = b + kPrefetchAhead;
    const T* next = ahead < num_blocks ? k_cache + static_cast<int64_t>(table[ahead]) * geo.k_stride0 : nullptr;
    const int64_t next_n = next ? std::min(bs, len - ahead * bs) : 0;
    for (int64_t o0 = 0; o0 < n; o0 += kStepRows) {
      const int64_t o1 = std::min(n, o0 + kStepRows);
      if (next) prefetch_rows(next, o0, std::min(o1, next_n), geo.k_stride1, geo.k_stride2, h0, h1, D);
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t r = (h - h0) * G;
        qk_group(block + o0 * geo.k_stride1 + h * geo.k_stride2, geo.k_stride1, o1 - o0, q + r * D,
                 G, D, scores + r * len + t0 + o0, len);
      }
    }
  }
  // Softmax numerators and denominators, fp32.
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * len;
    float max = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) max = std::max(max, s[t]);
    buf.sums[r] = exp_and_sum(s, len, max);
  }
  // Pass 2: probability-weighted sum of V rows, accumulators in registers within a block.
  std::fill(acc, acc + rows * D, 0.0f);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t t0 = b * bs, n = std::min(bs, len - t0);
    const T* block = v_cache + static_cast<int64_t>(table[b]) * geo.v_stride0;
    const int64_t ahead = b + kPrefetchAhead;
    const T* next = ahead < num_blocks ? v_cache + static_cast<int64_t>(table[ahead]) * geo.v_stride0 : nullptr;
    const int64_t next_n = next ? std::min(bs, len - ahead * bs) : 0;
    for (int64_t o0 = 0; o0 < n; o0 += kStepRows) {
      const int64_t o1 = std::min(n, o0 + kStepRows);
      if (next) prefetch_rows(next, o0, std::min(o1, next_n), geo.v_stride1, geo.v_stride2, h0, h1, D);
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t r = (h - h0) * G;
        pv_group(block + o0 * geo.v_stride1 + h * geo.v_stride2, geo.v_stride1, o1 - o0,
                 scores + r * len + t0 + o0, len, G, D, acc + r * D);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    QT* dst = out + token * geo.o_stride0 + (h0 * G + r) * geo.o_stride1;
    const float inv = 1.0f / buf.sums[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<QT>(acc[r * D + d] * inv);
  }
}

template <typename QT, typename T>
void run(const Geometry& geo, const at::Tensor& query, const at::Tensor& k_cache,
         const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& rows,
         int64_t heads_per_item, double scale, int64_t grain, at::Tensor& out) {
  const int64_t num_rows = rows.size(0);
  const int64_t* row = rows.data_ptr<int64_t>();  // [num_rows, 3]: token, sequence, length
  int64_t max_len = 0;
  for (int64_t i = 0; i < num_rows; ++i) max_len = std::max(max_len, row[3 * i + 2]);
  const int64_t splits = (geo.num_kv_heads + heads_per_item - 1) / heads_per_item;
  const QT* q = query.data_ptr<QT>();
  const T* k = k_cache.data_ptr<T>();
  const T* v = v_cache.data_ptr<T>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  QT* o = out.data_ptr<QT>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, num_rows * splits, grain, [&](int64_t begin, int64_t end) {
    Scratch buf(heads_per_item * geo.group, geo.head_dim, std::max<int64_t>(max_len, 1));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t* r = row + 3 * (item / splits);
      const int64_t h0 = (item % splits) * heads_per_item;
      const int64_t h1 = std::min(geo.num_kv_heads, h0 + heads_per_item);
      if (r[2] == 0) continue;  // nothing visible (the caller zero-fills such rows)
      attend<QT, T>(geo, q, k, v, table + r[1] * geo.table_stride, r[0], r[2], h0, h1, fscale, o, buf);
    }
  });
}

}  // namespace

// out[token] = softmax(q K^T * scale) V for every row (token, sequence, visible length).
void paged_attention_rows(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_table,
                          const at::Tensor& rows, double scale, int64_t heads_per_item,
                          int64_t grain) {
  check_cpu();
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_attention_rows runs on CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes(),
              "expected query/out [T, H, D] and k_cache/v_cache [N, B, Hkv, D]");
  TORCH_CHECK(query.scalar_type() == out.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == query.scalar_type() ||
                   query.scalar_type() == at::kFloat),
              "query and out share one dtype, the caches another: the same, or a float16/"
              "bfloat16 cache under float32 queries");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1,
              "the head_dim axis of query, out and the caches must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.stride(1) == 1,
              "block_table must be int32 [num_seqs, max_blocks] with contiguous rows");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 2 && rows.size(1) == 3 &&
                  rows.is_contiguous(),
              "rows must be contiguous int64 [num_rows, 3] (token, sequence, length)");
  const int64_t num_heads = query.size(1), num_kv_heads = k_cache.size(2), D = query.size(2);
  TORCH_CHECK(k_cache.size(3) == D && num_heads % num_kv_heads == 0 && D % kLanes == 0,
              "head_dim must match and be a multiple of 8; num_heads a multiple of num_kv_heads");
  TORCH_CHECK(heads_per_item >= 1 && heads_per_item <= num_kv_heads, "bad heads_per_item");
  const Geometry geo{num_heads,        num_kv_heads,     num_heads / num_kv_heads,
                     D,                k_cache.size(1),  query.stride(0),
                     query.stride(1),  out.stride(0),    out.stride(1),
                     k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                     v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                     block_table.stride(0)};
  const bool fp32_query = query.scalar_type() == at::kFloat;
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      run<float, float>(geo, query, k_cache, v_cache, block_table, rows, heads_per_item, scale,
                        grain, out);
      break;
    case at::kHalf:
      if (fp32_query)
        run<float, c10::Half>(geo, query, k_cache, v_cache, block_table, rows, heads_per_item,
                              scale, grain, out);
      else
        run<c10::Half, c10::Half>(geo, query, k_cache, v_cache, block_table, rows,
                                  heads_per_item, scale, grain, out);
      break;
    case at::kBFloat16:
      if (fp32_query)
        run<float, c10::BFloat16>(geo, query, k_cache, v_cache, block_table, rows,
                                  heads_per_item, scale, grain, out);
      else
        run<c10::BFloat16, c10::BFloat16>(geo, query, k_cache, v_cache, block_table, rows,
                                          heads_per_item, scale, grain, out);
      break;
    default:
      TORCH_CHECK(false, "paged_attention_rows supports float32, float16 and bfloat16, got ",
                  k_cache.scalar_type());
  }
}

}  // namespace pagedq_cpu
