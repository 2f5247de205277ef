// Paged attention for CPU query rows that read K/V straight from the paged cache (AVX2 + FMA,
// and an AVX-512 path where the CPU has it and head_dim % 16 == 0).
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
// The AVX2 path walks each block once for all the item's KV heads; the AVX-512 path (attend16)
// walks the blocks once per KV head, keeping that head's V accumulators in registers (a row of a
// half-precision cache over fewer than kMinHalfKeys16 keys keeps the AVX2 path). Keys that
// several sequences' rows read from the same blocks (a cached prompt prefix) are attended for
// all of them at once first (shared_pass, two matrix products a KV head); each row then
// finishes over its own keys on either path and merges the two (own_softmax).

#include <ATen/Parallel.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include "cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <vector>

namespace pagedq_cpu {
namespace {

constexpr int64_t kLanes = 8;  // floats per __m256
constexpr int kMaxRowsPerDot = 4;
// Tokens per step of the block loop; each step also prefetches the same rows of the block
// blocks_ahead() entries further down the block table.
constexpr int64_t kStepRows = 8;
// How far ahead in a stream of K or V rows the software prefetches reach, in bytes: the block
// kPrefetchBytes further down the block table. One block ahead, 1 KiB with the default 8-token
// blocks of one fp16 head (D = 64), left each block's fetch no more than one block's compute
// (~0.1 us) to hide a DRAM miss in: 64 decode rows at 64-96 tokens of context, the step's KV
// (118 MB) far past L3, spent 261 us a layer in attention, 4 KiB ahead 175-184 (Zen 5 capped at
// avx512, 2 threads; 8 KiB 197). Each stream's first blocks up to that distance are prefetched
// as it starts (its run-up), so a sequence's first blocks do not wait for DRAM either.
constexpr int64_t kPrefetchBytes = 4096;

// Blocks between the one read and the one prefetched, for a stream of `block_bytes` a block.
inline int64_t blocks_ahead(int64_t block_bytes) {
  return std::max<int64_t>(1, (kPrefetchBytes + block_bytes - 1) / block_bytes);
}

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

// A stream's run-up: blocks [b0, b1) of the block table, whole, before its loop's own prefetches
// (blocks_ahead() further down) take over.
template <typename T>
inline void prefetch_blocks(const T* base, int64_t block_stride, const int32_t* table, int64_t b0,
                            int64_t b1, int64_t bs, int64_t len, int64_t row_stride,
                            int64_t head_stride, int64_t h0, int64_t h1, int64_t D) {
  for (int64_t b = b0; b < b1; ++b)
    prefetch_rows(base + static_cast<int64_t>(table[b]) * block_stride, 0, std::min(bs, len - b * bs),
                  row_stride, head_stride, h0, h1, D);
}

// max(s[0..n)), vectorised: a scalar loop is one serial chain of compares per score, as long
// as the dot products that made them.
inline float max_of(const float* s, int64_t n) {
  __m256 m0 = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), m1 = m0;
  int64_t t = 0;
  for (; t + 2 * kLanes <= n; t += 2 * kLanes) {
    m0 = _mm256_max_ps(m0, _mm256_loadu_ps(s + t));
    m1 = _mm256_max_ps(m1, _mm256_loadu_ps(s + t + kLanes));
  }
  m0 = _mm256_max_ps(m0, m1);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m0), _mm256_extractf128_ps(m0, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  float max = _mm_cvtss_f32(h);
  for (; t < n; ++t) max = std::max(max, s[t]);
  return max;
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
  bool avx512;  // use_avx512(head_dim): attend16, else attend2
};

// Per-thread scratch: scaled fp32 queries, scores/probabilities and output accumulators of
// the heads of one work item.
struct Scratch {
  std::vector<float> q, scores, acc, sums;
  Scratch(int64_t heads, int64_t head_dim, int64_t max_len)
      : q(heads * head_dim), scores(heads * max_len), acc(heads * head_dim), sums(heads) {}
};

// The part of a row's attention over keys several rows read from the same physical blocks (a
// cached prompt prefix, e.g. a tool list every request of a step carries): computed for all
// those rows at once as two matrix products (shared_pass), then merged by each row into its
// softmax over its own keys. For KV head h and its query head g: the max and the sum of exp of
// the scores over keys [0, tokens) (max[h * stride + g], sum[...]) and the V rows weighted by
// those exps, unnormalised (acc[(h * stride + g) * head_dim ...]).
struct SharedPart {
  int64_t tokens = 0;  // keys [0, tokens) of the row are in the part (0: no part)
  const float* max = nullptr;
  const float* sum = nullptr;
  const float* acc = nullptr;
  int64_t stride = 0;
};

// Rows whose block tables start with the same blocks, and their attention over those keys:
// max, sum [num_kv_heads][members * group], acc [num_kv_heads][members * group][head_dim].
struct PrefixGroup {
  std::vector<int64_t> members;    // row indices
  const int32_t* table = nullptr;  // the first member's block table (the shared blocks)
  int64_t tokens = 0;              // whole blocks
  at::Tensor max, sum, acc;
};

// In place s[t] = exp(s[t] - max) over the row's own keys [part.tokens, len), the max taken with
// the shared part's entry i where there is one; *sum gets the whole denominator. Returns the
// factor that brings the part's weighted V sums to that max (0 without a part).
inline float own_softmax(float* s, int64_t len, const SharedPart& part, int64_t i, float* sum) {
  const int64_t first = part.tokens;
  if (!first) {
    *sum = exp_and_sum(s, len, max_of(s, len));
    return 0.0f;
  }
  const float max = std::max(part.max[i], max_of(s + first, len - first));
  const float alpha = std::exp(part.max[i] - max);
  *sum = exp_and_sum(s + first, len - first, max) + part.sum[i] * alpha;
  return alpha;
}

// ---- AVX-512 decode path -------------------------------------------------------------------
//
// Why: over long contexts a decode row's time is the dot products, not the reads (a shared
// prompt prefix sits in L2 for every row of the step). The AVX2 tiles above reload their V
// accumulators every few tokens and reduce each score with 256-bit horizontal adds; here a
// 16-lane tile keeps the G query rows' V accumulators in registers over the whole context and
// reduces four tokens' dot products at once. Taken when head_dim % 16 == 0 and the CPU (and
// PAGEDQ_CPU_ISA) allow AVX-512; the result matches the AVX2 path to fp32 rounding.

#define PAGEDQ_AVX512 __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,fma,f16c")))

constexpr int64_t kLanes16 = 16;
constexpr int kTileTokens16 = 4;

template <typename T>
PAGEDQ_AVX512 inline __m512 load16(const T* p);

template <>
PAGEDQ_AVX512 inline __m512 load16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}

template <>
PAGEDQ_AVX512 inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <>
PAGEDQ_AVX512 inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// {sum(a), sum(b), sum(c), sum(d)}: three 256/128-bit folds shared by the four, then an
// in-lane fold; 9 shuffles for four sums instead of four separate reductions.
PAGEDQ_AVX512 inline __m128 hsum4_512(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(2, 3, 0, 1)));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512i lane0 = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(lane0, s));
}

// scores[g * s_stride + j] = dot(q[g * D :], k[j * k_stride :]) for NG rows x NT (4 or 1) tokens.
template <typename T, int NG, int NT>
PAGEDQ_AVX512 inline void qk_tile16(const T* k, int64_t k_stride, const float* q, int64_t D,
                                    float* scores, int64_t s_stride) {
  __m512 acc[NG][NT];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < NT; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += kLanes16) {
    __m512 qv[NG];
    for (int g = 0; g < NG; ++g) qv[g] = _mm512_loadu_ps(q + g * D + d);
    for (int j = 0; j < NT; ++j) {
      const __m512 kv = load16(k + j * k_stride + d);
      for (int g = 0; g < NG; ++g) acc[g][j] = _mm512_fmadd_ps(qv[g], kv, acc[g][j]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    if constexpr (NT == 4)
      _mm_storeu_ps(scores + g * s_stride, hsum4_512(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
    else
      scores[g * s_stride] = _mm512_reduce_add_ps(acc[g][0]);
  }
}

// Scores of one KV head's NG query rows over keys [first, len), block by block; the next
// block's rows of this head are prefetched a tile at a time.
template <typename T, int NG>
PAGEDQ_AVX512 void qk_head16(const T* k_head, const Geometry& geo, const int32_t* table,
                             int64_t first, int64_t len, const float* q, float* scores) {
  const int64_t bs = geo.block_size, D = geo.head_dim, stride = geo.k_stride1;
  const int64_t num_blocks = (len + bs - 1) / bs;
  const int64_t ahead = blocks_ahead(bs * D * static_cast<int64_t>(sizeof(T)));
  prefetch_blocks(k_head, geo.k_stride0, table, first / bs + 1, std::min(num_blocks, first / bs + ahead),
                  bs, len, stride, 0, 0, 1, D);
  for (int64_t b = first / bs; b < num_blocks; ++b) {
    const int64_t t0 = b * bs, n = std::min(bs, len - t0);
    const T* block = k_head + static_cast<int64_t>(table[b]) * geo.k_stride0;
    const T* next = b + ahead < num_blocks ? k_head + static_cast<int64_t>(table[b + ahead]) * geo.k_stride0 : nullptr;
    const int64_t next_n = next ? std::min(bs, len - t0 - ahead * bs) : 0;
    int64_t o = std::max<int64_t>(first - t0, 0);
    for (; o + kTileTokens16 <= n; o += kTileTokens16) {
      if (next) prefetch_rows(next, o, std::min(o + kTileTokens16, next_n), stride, 0, 0, 1, D);
      qk_tile16<T, NG, kTileTokens16>(block + o * stride, stride, q, D, scores + t0 + o, len);
    }
    for (; o < n; ++o) qk_tile16<T, NG, 1>(block + o * stride, stride, q, D, scores + t0 + o, len);
  }
}

// The accumulators of NG rows x NV * 16 dims from d0: init[g * D + d0 ...] * alpha[g], or zero
// without init.
template <int NG, int NV>
PAGEDQ_AVX512 inline void start_acc(__m512 (&a)[NG][NV], const float* init, const float* alpha,
                                    int64_t D, int64_t d0) {
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < NV; ++i)
      a[g][i] = init ? _mm512_mul_ps(_mm512_set1_ps(alpha[g]),
                                     _mm512_loadu_ps(init + g * D + d0 + i * kLanes16))
                     : _mm512_setzero_ps();
}

// acc[g * D + d0 ...] = sum_t p[g * len + t] * V_t[d0 ...] over keys [first, len), NV * 16
// dims from d0, for NG rows, started from start_acc: the accumulators stay in registers for
// the whole context.
template <typename T, int NG, int NV>
PAGEDQ_AVX512 void pv_slice16(const T* v_head, const Geometry& geo, const int32_t* table,
                              int64_t first, int64_t len, const float* p, const float* init,
                              const float* alpha, int64_t d0, float* acc) {
  const int64_t bs = geo.block_size, D = geo.head_dim, stride = geo.v_stride1;
  __m512 a[NG][NV];
  start_acc<NG, NV>(a, init, alpha, D, d0);
  const int64_t num_blocks = (len + bs - 1) / bs;
  const int64_t ahead = blocks_ahead(bs * NV * kLanes16 * static_cast<int64_t>(sizeof(T)));
  prefetch_blocks(v_head + d0, geo.v_stride0, table, first / bs, std::min(num_blocks, first / bs + ahead),
                  bs, len, stride, 0, 0, 1, NV * kLanes16);
  for (int64_t b = first / bs; b < num_blocks; ++b) {
    const int64_t t0 = b * bs, n = std::min(bs, len - t0);
    const T* block = v_head + static_cast<int64_t>(table[b]) * geo.v_stride0 + d0;
    if (b + ahead < num_blocks)
      prefetch_rows(v_head + static_cast<int64_t>(table[b + ahead]) * geo.v_stride0 + d0, 0,
                    std::min(bs, len - t0 - ahead * bs), stride, 0, 0, 1, NV * kLanes16);
    for (int64_t o = std::max<int64_t>(first - t0, 0); o < n; ++o) {
      __m512 pb[NG];
      for (int g = 0; g < NG; ++g) pb[g] = _mm512_set1_ps(p[g * len + t0 + o]);
      for (int i = 0; i < NV; ++i) {
        const __m512 vv = load16(block + o * stride + i * kLanes16);
        for (int g = 0; g < NG; ++g) a[g][i] = _mm512_fmadd_ps(pb[g], vv, a[g][i]);
      }
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + g * D + d0 + i * kLanes16, a[g][i]);
}

template <typename T, int NG>
PAGEDQ_AVX512 void pv_head16(const T* v_head, const Geometry& geo, const int32_t* table,
                             int64_t first, int64_t len, const float* p, const float* init,
                             const float* alpha, float* acc) {
  int64_t d = 0;
  for (; d + 4 * kLanes16 <= geo.head_dim; d += 4 * kLanes16)
    pv_slice16<T, NG, 4>(v_head, geo, table, first, len, p, init, alpha, d, acc);
  for (; d < geo.head_dim; d += kLanes16)
    pv_slice16<T, NG, 1>(v_head, geo, table, first, len, p, init, alpha, d, acc);
}

// One KV head's NG (1-4) query rows (the shared part's entries pidx ..): scores, softmax
// numerators (sums[g]: denominators), and the unnormalised weighted V sums; keys before
// part.tokens come from the shared part, rescaled to the row's max.
template <typename T, int NG>
PAGEDQ_AVX512 void head16(const T* k_head, const T* v_head, const Geometry& geo,
                          const int32_t* table, int64_t len, const SharedPart& part, int64_t pidx,
                          const float* q, float* scores, float* acc, float* sums) {
  const int64_t first = part.tokens;
  qk_head16<T, NG>(k_head, geo, table, first, len, q, scores);
  float alpha[NG];
  for (int g = 0; g < NG; ++g) alpha[g] = own_softmax(scores + g * len, len, part, pidx + g, sums + g);
  pv_head16<T, NG>(v_head, geo, table, first, len, scores,
                   first ? part.acc + pidx * geo.head_dim : nullptr, alpha, acc);
}

// attend()'s work on the AVX-512 path (the caller has scaled the queries into buf.q).
template <typename T>
PAGEDQ_AVX512 void attend16(const Geometry& geo, const T* k_cache, const T* v_cache,
                            const int32_t* table, int64_t len, const SharedPart& part,
                            int64_t h0, int64_t h1, Scratch& buf) {
  const int64_t G = geo.group, D = geo.head_dim;
  for (int64_t h = h0; h < h1; ++h) {
    const T* k_head = k_cache + h * geo.k_stride2;
    const T* v_head = v_cache + h * geo.v_stride2;
    for (int64_t g = 0; g < G; g += kMaxRowsPerDot) {
      const int64_t pidx = h * part.stride + g;
      const int64_t r = (h - h0) * G + g;
      const float* q = buf.q.data() + r * D;
      float* s = buf.scores.data() + r * len;
      float* acc = buf.acc.data() + r * D;
      float* sums = buf.sums.data() + r;
      switch (std::min<int64_t>(kMaxRowsPerDot, G - g)) {
        case 1: head16<T, 1>(k_head, v_head, geo, table, len, part, pidx, q, s, acc, sums); break;
        case 2: head16<T, 2>(k_head, v_head, geo, table, len, part, pidx, q, s, acc, sums); break;
        case 3: head16<T, 3>(k_head, v_head, geo, table, len, part, pidx, q, s, acc, sums); break;
        default: head16<T, 4>(k_head, v_head, geo, table, len, part, pidx, q, s, acc, sums); break;
      }
    }
  }
}

// A row of a half-precision (fp16/bf16) cache seeing fewer keys than this takes the AVX2 path
// even where the AVX-512 one runs: over short contexts a step's rows are bound by reading
// their blocks, and the AVX2 path reads each block once for all the item's KV heads (one
// contiguous run) where the AVX-512 one reads it once per head (a 128-byte piece of every
// token row). Zen 5 capped at avx512, 2 threads, fp16 cache, 30 layers past L3, us a layer
// (AVX-512 -> AVX2 path): 64 rows over 48 keys 190-205 -> 139-147, over 96 292-294 ->
// 265-273, over 128 356-361 -> 349-353, over 192 489-491 -> 497-502; 16 rows over 96 53-55 ->
// 44-46; bf16 alike. An fp32 cache's rows keep the AVX-512 path at every length (64 rows over
// 48 keys 198 against 217, over 96 375 against 441).
constexpr int64_t kMinHalfKeys16 = 128;

// Whether attend() takes the AVX-512 path for this head_dim (the CPU and PAGEDQ_CPU_ISA allow it).
inline bool use_avx512(int64_t head_dim) {
  static const bool ok = runs_isa(kAvx512) && __builtin_cpu_supports("avx512bw");
  return ok && head_dim % kLanes16 == 0;
}

// attend()'s work on the AVX2 path: every KV head of a block together (one contiguous read).
template <typename T>
void attend2(const Geometry& geo, const T* k_cache, const T* v_cache, const int32_t* table,
             int64_t len, const SharedPart& part, int64_t h0, int64_t h1, Scratch& buf) {
  const int64_t G = geo.group, D = geo.head_dim, bs = geo.block_size;
  const int64_t rows = (h1 - h0) * G;
  const int64_t first_block = part.tokens / bs;  // the shared part ends on a block boundary
  const float* q = buf.q.data();
  float* scores = buf.scores.data();  // [rows][len]
  float* acc = buf.acc.data();        // [rows][D]
  // Pass 1: scores of every visible key after the shared part, block by block.
  const int64_t num_blocks = (len + bs - 1) / bs;
  const int64_t dist = blocks_ahead(bs * (h1 - h0) * D * static_cast<int64_t>(sizeof(T)));
  prefetch_blocks(k_cache, geo.k_stride0, table, first_block + 1, std::min(num_blocks, first_block + dist),
                  bs, len, geo.k_stride1, geo.k_stride2, h0, h1, D);
  for (int64_t b = first_block; b < num_blocks; ++b) {
    const int64_t t0 = b * bs, n = std::min(bs, len - t0);
    const T* block = k_cache + static_cast<int64_t>(table[b]) * geo.k_stride0;
    const int64_t ahead = b + dist;
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
  // Softmax numerators and denominators, fp32; the accumulators start from the shared part.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = (h0 + r / G) * part.stride + r % G;
    const float alpha = own_softmax(scores + r * len, len, part, i, buf.sums.data() + r);
    for (int64_t d = 0; d < D; ++d) acc[r * D + d] = part.tokens ? alpha * part.acc[i * D + d] : 0.0f;
  }
  // Pass 2: probability-weighted sum of V rows, accumulators in registers within a block.
  prefetch_blocks(v_cache, geo.v_stride0, table, first_block, std::min(num_blocks, first_block + dist),
                  bs, len, geo.v_stride1, geo.v_stride2, h0, h1, D);
  for (int64_t b = first_block; b < num_blocks; ++b) {
    const int64_t t0 = b * bs, n = std::min(bs, len - t0);
    const T* block = v_cache + static_cast<int64_t>(table[b]) * geo.v_stride0;
    const int64_t ahead = b + dist;
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
}

// QT: query/out dtype; T: cache dtype (the same, or fp16/bf16 under fp32 queries: a cache in
// half the bytes, which is what bounds attention over long contexts).
template <typename QT, typename T>
void attend(const Geometry& geo, const QT* query, const T* k_cache, const T* v_cache,
            const int32_t* table, int64_t token, int64_t len, const SharedPart& part,
            int64_t h0, int64_t h1, float scale, QT* out, Scratch& buf) {
  const int64_t G = geo.group, D = geo.head_dim;
  const int64_t rows = (h1 - h0) * G;  // query heads of this item, as rows h0 * G ...
  float* q = buf.q.data();
  const float* acc = buf.acc.data();  // [rows][D]
  for (int64_t r = 0; r < rows; ++r) {
    const QT* src = query + token * geo.q_stride0 + (h0 * G + r) * geo.q_stride1;
    for (int64_t d = 0; d < D; ++d) q[r * D + d] = static_cast<float>(src[d]) * scale;
  }
  if (geo.avx512 && (sizeof(T) == sizeof(float) || len >= kMinHalfKeys16)) {
    attend16<T>(geo, k_cache, v_cache, table, len, part, h0, h1, buf);
  } else {
    attend2<T>(geo, k_cache, v_cache, table, len, part, h0, h1, buf);
  }
  for (int64_t r = 0; r < rows; ++r) {
    QT* dst = out + token * geo.o_stride0 + (h0 * G + r) * geo.o_stride1;
    const float inv = 1.0f / buf.sums[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<QT>(acc[r * D + d] * inv);
  }
}

// Rows sharing fewer keys than this, or rows of fewer sequences than this, do not repay the
// shared pass (one sequence's own rows, a verification run or a short chunk, measured slower
// through it: 4 rows over 200 keys 43 -> 69 us, Intel Xeon model 207);
// groups past kMaxSharedBytes a call (the gathered keys and values, queries, scores and
// partial sums) are left to each row (read from the cache as usual).
constexpr int64_t kMinSharedTokens = 64;
constexpr size_t kMinSharingSeqs = 4;
constexpr int64_t kMaxSharedBytes = int64_t{64} << 20;

// The rows' prefix groups: rows whose block tables start with the same blocks (of at least
// kMinSharingSeqs sequences, over at least kMinSharedTokens keys every one of them sees) share
// those whole blocks.
std::vector<PrefixGroup> share_prefixes(const Geometry& geo, const int64_t* row, int64_t num_rows,
                                        const int32_t* table) {
  std::vector<PrefixGroup> out;
  std::map<int32_t, std::vector<int64_t>> groups;  // first block -> rows (ordered: deterministic)
  for (int64_t i = 0; i < num_rows; ++i)
    if (row[3 * i + 2] >= kMinSharedTokens) groups[table[row[3 * i + 1] * geo.table_stride]].push_back(i);
  int64_t bytes = 0;
  for (auto& [first, members] : groups) {
    std::set<int64_t> seqs;
    for (const int64_t m : members) seqs.insert(row[3 * m + 1]);
    if (seqs.size() < kMinSharingSeqs) continue;
    const int32_t* lead = table + row[3 * members[0] + 1] * geo.table_stride;
    int64_t blocks = std::numeric_limits<int64_t>::max();
    for (const int64_t m : members) blocks = std::min(blocks, row[3 * m + 2] / geo.block_size);
    for (const int64_t m : members) {
      const int32_t* mine = table + row[3 * m + 1] * geo.table_stride;
      int64_t b = 0;
      while (b < blocks && mine[b] == lead[b]) ++b;
      blocks = b;
    }
    const int64_t tokens = blocks * geo.block_size;
    const int64_t queries = static_cast<int64_t>(members.size()) * geo.group;
    // K and V gathered, the queries, the scores and the partial sums: fp32, every KV head
    const int64_t size = geo.num_kv_heads * (2 * tokens * geo.head_dim + queries * (2 * geo.head_dim + tokens + 2));
    if (tokens < kMinSharedTokens || bytes + size * 4 > kMaxSharedBytes) continue;
    bytes += size * 4;
    PrefixGroup& grp = out.emplace_back();
    grp.members = std::move(members);
    grp.table = lead;
    grp.tokens = tokens;
  }
  return out;
}

// ---- The shared pass: every member of a prefix group over the shared keys at once ----------
//
// Why: a row alone streams its head's keys and V rows from L2 (over a 457-key tool list,
// 117 KB each at head_dim 64) for a few multiplies a load, and ran at a fifth of the FMA
// units' rate. The members' queries against the shared keys are one matrix product per KV
// head (scores = Q K^T, [members x group] x keys), and so are the weighted V sums (P V): both
// run through ATen's GEMM (MKL / oneDNN, near the machine's peak), with an exact two-pass
// softmax between them. Each row then finishes over its own keys (head16) and merges the two.

// dst[h][t][:] = cache row of token t, KV head h, as fp32, for the group's first `tokens` keys.
template <typename T>
void gather_rows(const Geometry& geo, const T* cache, int64_t stride0, int64_t stride1,
                 int64_t stride2, const int32_t* table, int64_t tokens, float* dst) {
  const int64_t D = geo.head_dim, bs = geo.block_size;
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* src = cache + static_cast<int64_t>(table[t / bs]) * stride0 + t % bs * stride1;
      for (int64_t h = 0; h < geo.num_kv_heads; ++h)
        for (int64_t d = 0; d < D; ++d)
          dst[(h * tokens + t) * D + d] = static_cast<float>(src[h * stride2 + d]);
    }
  });
}

// The group's partial attention over its shared keys, every member and KV head.
template <typename QT, typename T>
void shared_pass(const Geometry& geo, const QT* query, const int64_t* row, const T* k_cache,
                 const T* v_cache, PrefixGroup& grp, float scale) {
  const int64_t Hkv = geo.num_kv_heads, G = geo.group, D = geo.head_dim, N = grp.tokens;
  const int64_t members = static_cast<int64_t>(grp.members.size()), M = members * G;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor k = at::empty({Hkv, N, D}, f32), v = at::empty({Hkv, N, D}, f32);
  gather_rows(geo, k_cache, geo.k_stride0, geo.k_stride1, geo.k_stride2, grp.table, N, k.data_ptr<float>());
  gather_rows(geo, v_cache, geo.v_stride0, geo.v_stride1, geo.v_stride2, grp.table, N, v.data_ptr<float>());
  at::Tensor q = at::empty({Hkv, M, D}, f32);
  float* qp = q.data_ptr<float>();
  for (int64_t m = 0; m < members; ++m) {
    const QT* src = query + row[3 * grp.members[m]] * geo.q_stride0;
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qp[(h * M + m * G + g) * D + d] = static_cast<float>(src[(h * G + g) * geo.q_stride1 + d]) * scale;
  }
  at::Tensor scores = at::bmm(q, k.transpose(1, 2));  // [Hkv, M, N]
  grp.max = at::empty({Hkv, M}, f32);
  grp.sum = at::empty({Hkv, M}, f32);
  float* s = scores.data_ptr<float>();
  float* max = grp.max.data_ptr<float>();
  float* sum = grp.sum.data_ptr<float>();
  at::parallel_for(0, Hkv * M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      max[r] = max_of(s + r * N, N);
      sum[r] = exp_and_sum(s + r * N, N, max[r]);
    }
  });
  grp.acc = at::bmm(scores, v);  // [Hkv, M, D]
}

// Each row's SharedPart (none for rows outside every group).
std::vector<SharedPart> shared_parts(const Geometry& geo, int64_t num_rows,
                                     const std::vector<PrefixGroup>& groups) {
  std::vector<SharedPart> parts(num_rows);
  for (const PrefixGroup& grp : groups) {
    const int64_t stride = static_cast<int64_t>(grp.members.size()) * geo.group;
    for (size_t i = 0; i < grp.members.size(); ++i) {
      const int64_t at = static_cast<int64_t>(i) * geo.group;
      parts[grp.members[i]] = {grp.tokens, grp.max.data_ptr<float>() + at,
                               grp.sum.data_ptr<float>() + at,
                               grp.acc.data_ptr<float>() + at * geo.head_dim, stride};
    }
  }
  return parts;
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
  std::vector<PrefixGroup> groups = share_prefixes(geo, row, num_rows, table);
  for (PrefixGroup& grp : groups) shared_pass<QT, T>(geo, q, row, k, v, grp, fscale);
  const std::vector<SharedPart> parts = shared_parts(geo, num_rows, groups);
  at::parallel_for(0, num_rows * splits, grain, [&](int64_t begin, int64_t end) {
    Scratch buf(heads_per_item * geo.group, geo.head_dim, std::max<int64_t>(max_len, 1));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t* r = row + 3 * (item / splits);
      const int64_t h0 = (item % splits) * heads_per_item;
      const int64_t h1 = std::min(geo.num_kv_heads, h0 + heads_per_item);
      if (r[2] == 0) continue;  // nothing visible (the caller zero-fills such rows)
      attend<QT, T>(geo, q, k, v, table + r[1] * geo.table_stride, r[0], r[2], parts[item / splits],
                    h0, h1, fscale, o, buf);
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
                     block_table.stride(0), use_avx512(D)};
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
