// Quantized GEMV: out[b, n] = sum_k x[b, k] * W[n, k] for a few rows of x, reading W in its
// packed form (GGUF blocks, per-channel int8 or bf16 rows; see quant_formats.h).
//
// Why: decode at small batch streams every weight once per step; packed 4-8 bit weights are a
// quarter to an eighth of fp32's bytes. Each weight row is decoded once for all activation rows.
//
// Precision: the product follows the dequantized model, not a coarser one. llama.cpp rounds the
// activations to int8 per 32 values; on SmolLM2 that made greedy decoding part from the
// dequantized model's within a few tokens on half the prompts. Here:
// - AVX-512 VNNI: activations are int16 per 32 values (scale da, ~2^-16 of the block's largest);
//   each 64-code chunk meets them in two vpdpwssd, codes widened to 16 bits by unpacking against
//   zero, and the float scales apply per 4-code lane afterwards:
//     out += sum_lanes ws * da * isum(lane) + wm * da * sum(qa in lane)
//   The unpack pairs bytes 2m, 2m+1 with 8 + 2m, 9 + 2m of each 16-code group into lane m of
//   that group, so the activations are stored in that order (act_position).
// - AVX2: the same int16 activations per 32 values, each block's even elements before its odd
//   ones; each 32-code block is decoded to int16 codes in that order (quant_avx2.h: no
//   cross-lane shuffle) and meets them in _mm256_madd_epi16, the block's
//   scales applied to the int32 sums. (It dequantized each row to fp32 before: compute-bound,
//   half of llama.cpp's speed on an AVX2 machine.)
// - acts = 8 (opt-in): int8 activations per 32 values, llama.cpp's rounding, one byte product per
//   weight: byte_gemv.cpp (AVX2 maddubs; Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K; below
//   kPanelRows rows), byte_panel.cpp (the same from kPanelRows, but Q8_0) and group_gemv.cpp's
//   byte mode.
//   The matching-prefix bars against the dequantized twin fail with it (docs/quantization.md),
//   so it is never the default; the other formats keep int16 when asked for it.
//
// The library is built for AVX2; the AVX-512 functions are compiled for AVX-512 (pragma below)
// and run only when the caller passes Isa kAvx512Vnni (check_isa refuses it on CPUs without).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "quant_avx2.h"
#include "quant_avx512.h"
#include "cpu_ops.h"
#include "int16_acts.h"
#include "quant_formats.h"

namespace pagedq_cpu {
namespace {

constexpr int kMaxGroup = 8;  // activation rows per pass over a weight row (accumulators live in registers)

// Where chunk position pos's activation goes among the chunk's 64 int16s: the first 32 meet the
// codes unpacked from bytes 0-7 of each 16-byte group, the last 32 those from bytes 8-15.
inline int64_t act_position(int64_t pos) {
  const int64_t chunk = pos / kChunk, group = pos % kChunk / 16, r = pos % 16;
  return chunk * kChunk + (r < 8 ? 0 : 32) + group * 8 + r % 8;
}

// f(first_row, std::integral_constant<int, G>) over groups of up to kMaxGroup activation rows:
// G is a compile-time constant, so each group's accumulators live in registers.
template <class F>
inline void for_each_group(int64_t rows, F&& f) {
  for (int64_t b = 0; b < rows; b += kMaxGroup) {
    switch (std::min<int64_t>(kMaxGroup, rows - b)) {
      case 1: f(b, std::integral_constant<int, 1>{}); break;
      case 2: f(b, std::integral_constant<int, 2>{}); break;
      case 3: f(b, std::integral_constant<int, 3>{}); break;
      case 4: f(b, std::integral_constant<int, 4>{}); break;
      case 5: f(b, std::integral_constant<int, 5>{}); break;
      case 6: f(b, std::integral_constant<int, 6>{}); break;
      case 7: f(b, std::integral_constant<int, 7>{}); break;
      default: f(b, std::integral_constant<int, 8>{}); break;
    }
  }
}

}  // namespace

// ================================================================ AVX-512 VNNI
PAGEDQ_AVX512_BEGIN
namespace v512 {
namespace {

// G activation rows (G <= kMaxGroup) starting at row b0 against weight rows [n0, n1).
template <class Walker, int G>
void rows_group(const LinearArgs& p, const Acts& a, int64_t b0, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    const float scale = p.scales ? p.scales[n] : 0.f;
    const int64_t span = span_bytes(p);
    Walker::walk(RowRef::plain(p.w, n, p.row_bytes, block_bytes(p.fmt)), p.K, scale,
                 [&](int64_t c, __m512i w, __m512 ws, __m512 wm) {
      if (c % 4 == 0) prefetch_ahead(row + c / 4 * span, span);
      const __m512i zero = _mm512_setzero_si512();
      const __m512i w_lo = _mm512_unpacklo_epi8(w, zero), w_hi = _mm512_unpackhi_epi8(w, zero);
      for (int g = 0; g < G; ++g) {
        const int64_t b = b0 + g;
        const int16_t* q = a.qrow(b) + c * kChunk;
        const __m512 da = _mm512_loadu_ps(a.darow(b) + c * kLanesPerChunk);
        const __m512 ab = _mm512_loadu_ps(a.abrow(b) + c * kLanesPerChunk);
        __m512i isum = _mm512_dpwssd_epi32(zero, w_lo, _mm512_loadu_si512(q));
        isum = _mm512_dpwssd_epi32(isum, w_hi, _mm512_loadu_si512(q + 32));
        acc[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(ws, da), acc[g]);
        acc[g] = _mm512_fmadd_ps(wm, ab, acc[g]);
      }
    });
    const float bias = p.bias ? p.bias[n] : 0.f;
    for (int g = 0; g < G; ++g) p.out[(b0 + g) * p.ldo + n] = _mm512_reduce_add_ps(acc[g]) + bias;
  }
}

// bf16 weights: each row widened to fp32 in registers (a shift) against fp32 activations.
template <int G>
void bf16_group(const LinearArgs& p, int64_t b0, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    const uint16_t* w = reinterpret_cast<const uint16_t*>(row);
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t k = 0; k < p.K; k += 16) {
      if (k % 32 == 0) prefetch_ahead(row + 2 * k, 64);
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
      const __m512 wf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
      for (int g = 0; g < G; ++g)
        acc[g] = _mm512_fmadd_ps(wf, _mm512_loadu_ps(p.x + (b0 + g) * p.K + k), acc[g]);
    }
    const float bias = p.bias ? p.bias[n] : 0.f;
    for (int g = 0; g < G; ++g) p.out[(b0 + g) * p.ldo + n] = _mm512_reduce_add_ps(acc[g]) + bias;
  }
}

template <class Walker>
void run_rows(const LinearArgs& p, const Acts& a, int64_t n0, int64_t n1) {
  for_each_group(a.rows, [&](int64_t b, auto group) {
    rows_group<Walker, decltype(group)::value>(p, a, b, n0, n1);
  });
}

}  // namespace

// The activations as int16 codes per 32 values, 16 values at a time (cvtps rounds to nearest
// even, as nearbyint does). Why vectorized: it runs on one thread before every GEMV, where a
// scalar loop took ~5% of a one-stream decode step (perf). A half-block's 16 codes are two runs
// of 8 in act_position order (its low 8 at the group's lane position, its high 8 32 further).
void quantize_acts(const float* x, int64_t rows, int64_t K, bool nibbles, Acts& a) {
  a.rows = rows;
  a.padded = (K + kChunk - 1) / kChunk * kChunk;
  a.steps = a.padded / 4;
  a.q.assign(rows * a.padded, 0);
  a.da.assign(rows * a.padded / 4, 0.f);
  a.ab.assign(rows * a.padded / 4, 0.f);
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < rows; ++b) {
    const float* xr = x + b * K;
    int16_t* q = a.q.data() + b * a.padded;
    float* da = a.da.data() + b * a.padded / 4;
    float* ab = a.ab.data() + b * a.padded / 4;
    for (int64_t blk = 0; blk < K / kActBlock; ++blk) {
      const __m512 v[2] = {_mm512_loadu_ps(xr + blk * kActBlock),
                           _mm512_loadu_ps(xr + blk * kActBlock + 16)};
      const float amax = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_and_ps(v[0], sign), _mm512_and_ps(v[1], sign)));
      const float d = amax / 32767.f, inv = amax > 0.f ? 32767.f / amax : 0.f;
      for (int half = 0; half < 2; ++half) {
        const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(v[half], _mm512_set1_ps(inv)));
        const int32_t sum = _mm512_reduce_add_epi32(codes);
        const __m256i narrow = _mm512_cvtepi32_epi16(codes);
        const int64_t pos = chunk_position(blk * kActBlock + 16 * half, nibbles);
        int16_t* at = q + act_position(pos);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm256_castsi256_si128(narrow));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(at + 32), _mm256_extracti128_si256(narrow, 1));
        for (int lane = 0; lane < 4; ++lane) {
          da[pos / 4 + lane] = d;
          ab[pos / 4 + lane] = d * static_cast<float>(sum) * 0.25f;
        }
      }
    }
  }
}

void gemv(const LinearArgs& p, const Acts& a, int64_t n0, int64_t n1) {
  const bool decoded = visit_walker<Nibble32, Q8_0, Int8, KQuant45, Q6_K>(
      p.fmt, [&](auto w) { run_rows<decltype(w)>(p, a, n0, n1); });
  if (!decoded && p.fmt == kBF16)
    for_each_group(p.rows, [&](int64_t b, auto group) {
      bf16_group<decltype(group)::value>(p, b, n0, n1);
    });
}

}  // namespace v512
PAGEDQ_AVX512_END

// ================================================================ AVX2 (integer codes)
namespace v256 {
namespace {

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

#include "few_rows.inc"

// 4-8 activation rows from b0 against weight row n, as int_group below, but each block's sums of
// all rows reduced into one vector (sum_rows8): one convert and FMA per block for the group.
template <class W, int G>
void int_group_wide(const LinearArgs& p, const Acts& a, int64_t b0, int64_t n) {
  __m256 acc = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
  const float scale = p.scales ? p.scales[n] : 0.f;
  W::walk(p.w + n * p.row_bytes, p.K, scale,
          [&](int64_t b, __m256i e, __m256i o, float s_lo, float s_hi, float m) {
    __m256i d_lo[8], d_hi[8];
    for (int g = 0; g < 8; ++g) {
      if (g >= G) {
        d_lo[g] = d_hi[g] = _mm256_setzero_si256();
        continue;
      }
      d_lo[g] = block_dot(e, o, a.qrow(b0 + g) + b * kActBlock);
      if constexpr (W::kTwoScales) {  // lanes 0-3: elements 0-15; lanes 4-7: 16-31
        d_hi[g] = _mm256_blend_epi32(_mm256_setzero_si256(), d_lo[g], 0xF0);
        d_lo[g] = _mm256_blend_epi32(d_lo[g], _mm256_setzero_si256(), 0xF0);
      }
    }
    const __m256 da = _mm256_loadu_ps(a.dat.data() + b * a.tstride + b0);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_rows8(d_lo)), _mm256_mul_ps(_mm256_set1_ps(s_lo), da), acc);
    if constexpr (W::kTwoScales)
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_rows8(d_hi)), _mm256_mul_ps(_mm256_set1_ps(s_hi), da), acc);
    if constexpr (W::kHasMin)
      mins = _mm256_fmadd_ps(_mm256_set1_ps(m), _mm256_loadu_ps(a.abt.data() + b * a.tstride + b0), mins);
  });
  alignas(32) float sums[8];
  _mm256_store_ps(sums, _mm256_add_ps(acc, mins));
  const float bias = p.bias ? p.bias[n] : 0.f;
  for (int g = 0; g < G; ++g) p.out[(b0 + g) * p.ldo + n] = sums[g] + bias;
}

// G activation rows from b0 against weight row n, a block at a time: the rows few_rows does not
// take (per-channel int8: one scale a row, no offset). Per 32-block, the decoded int16 codes
// meet each row's int16 activations in madd; the scale applies to the int32 sums.
template <class W, int G>
void int_group_narrow(const LinearArgs& p, const Acts& a, int64_t b0, int64_t n) {
  static_assert(!W::kTwoScales && !W::kHasMin, "the block formats take few_rows");
  __m256 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
  const float scale = p.scales ? p.scales[n] : 0.f;
  const uint8_t* row = p.w + n * p.row_bytes;
  const int64_t span = span_bytes(p);
  W::walk(row, p.K, scale, [&](int64_t b, __m256i e, __m256i o, float s, float, float) {
    if (b0 == 0 && b % 8 == 0 && a.rows < kRowPrefetchRows) prefetch_ahead(row + b / 8 * span, span);
    for (int g = 0; g < G; ++g) {
      const __m256 isum = _mm256_cvtepi32_ps(block_dot(e, o, a.qrow(b0 + g) + b * kActBlock));
      acc[g] = _mm256_fmadd_ps(isum, _mm256_set1_ps(s * a.darow(b0 + g)[b]), acc[g]);
    }
  });
  const float bias = p.bias ? p.bias[n] : 0.f;
  for (int g = 0; g < G; ++g) p.out[(b0 + g) * p.ldo + n] = hsum(acc[g]) + bias;
}

// G = 4-7 activation rows of a K-quant from b0 against weight row n as few_rows pieces of 2-3
// rows (for_row_pieces), the weight row still in L1 for each.
// Why: int_group_wide's per-block walk (each block's scales unpacked on their own, eight rows'
// sums reduced whatever G) was slower than the pieces' super-block at a time: SmolLM2-1.7B's
// shapes, AMD EPYC Zen 5 capped at avx2, 2 threads, ms a pass, wide -> pieces: Q4_K 4 rows
// 91.6 -> 74.4, 5 117 -> 84.6, 6 121 -> 102, 7 136 -> 121; Q6_K 4 rows 160 -> 101 (its panel
// from 5). The block formats keep the wide groups (Q8_0, Q4_1: 4 and 6 rows level, 7 slower).
// Each row's result is then the one-row kernel's, bit for bit.
template <class W, int G>
void k_pieces(const LinearArgs& p, const Acts& a, int64_t b0, int64_t n) {
  static_assert(G >= 4 && G <= 7, "pieces of 4-7 rows");
  for_row_pieces(G, [&](int64_t r, auto piece) { few_rows<W, decltype(piece)::value>(p, a, b0 + r, n); });
}

template <class W, int G>
void int_group(const LinearArgs& p, const Acts& a, int64_t b0, int64_t n) {
  if constexpr (G <= 3 && (kBlock32<W> || kSuper256<W>))
    few_rows<W, G>(p, a, b0, n);
  else if constexpr (G >= 4 && G <= 7 && kSuper256<W>)
    k_pieces<W, G>(p, a, b0, n);
  else if constexpr (G >= 4)
    int_group_wide<W, G>(p, a, b0, n);
  else
    int_group_narrow<W, G>(p, a, b0, n);
}

template <class W>
void run_rows(const LinearArgs& p, const Acts& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    if (a.rows >= kRowPrefetchRows) prefetch_row(p.w + n * p.row_bytes, p.row_bytes);
    for_each_group(a.rows, [&](int64_t b, auto group) {
      int_group<W, decltype(group)::value>(p, a, b, n);
    });
  }
}

template <int G>
void bf16_group(const LinearArgs& p, int64_t b0, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    const uint16_t* w = reinterpret_cast<const uint16_t*>(row);
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t k = 0; k < p.K; k += 8) {
      if (k % 32 == 0) prefetch_ahead(row + 2 * k, 64);
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k));
      const __m256 wf = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
      for (int g = 0; g < G; ++g)
        acc[g] = _mm256_fmadd_ps(wf, _mm256_loadu_ps(p.x + (b0 + g) * p.K + k), acc[g]);
    }
    const float bias = p.bias ? p.bias[n] : 0.f;
    for (int g = 0; g < G; ++g) p.out[(b0 + g) * p.ldo + n] = hsum(acc[g]) + bias;
  }
}


// Activation rows r0 .. rows - 1 against weight row n, row-at-a-time (the panel's last 1-3 rows).
template <class W>
void tail_rows(const LinearArgs& p, const Acts& a, int64_t r0, int64_t n) {
  for_each_group(a.rows - r0, [&](int64_t b, auto group) {
    int_group<W, decltype(group)::value>(p, a, r0 + b, n);
  });
}

}  // namespace

// The activations as int16 codes per 32 values in the walkers' order (the VNNI path's rule: steps of
// max|x| / 32767, rounded to nearest even), with each block's step at da and step x code sum at
// ab (the weights' offsets meet it), 8 values at a time.
void quantize_acts(const float* x, int64_t rows, int64_t K, Acts& a) {
  a.rows = rows;
  a.padded = K;
  a.steps = K / kActBlock;
  a.q.assign(rows * K, 0);
  a.da.assign(rows * K / kActBlock, 0.f);
  a.ab.assign(rows * K / kActBlock, 0.f);
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t blk = 0; blk < K / kActBlock; ++blk) {
      const float* xb = x + r * K + blk * kActBlock;
      __m256 v[4], amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], sign));
      }
      const float m = hmax(amax), d = m / 32767.f, inv = m > 0.f ? 32767.f / m : 0.f;
      __m256i c[4], total = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
        total = _mm256_add_epi32(total, c[i]);
      }
      int16_t* q = a.q.data() + r * K + blk * kActBlock;
      // The walkers' order (quant_avx2.h): the even elements, then the odd ones, each as
      // [8 of elements 0-15 | 8 of 16-31]. Per half: natural order (packs interleaves 128-bit
      // lanes: put them back), then evens before odds within each 128-bit lane, and together.
      const __m256i parity = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                              0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
      __m256i half[2];
      for (int i = 0; i < 2; ++i) {
        const __m256i natural = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2 * i], c[2 * i + 1]), 0xD8);
        half[i] = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(natural, parity), 0xD8);  // [evens | odds]
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permute2x128_si256(half[0], half[1], 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm256_permute2x128_si256(half[0], half[1], 0x31));
      a.da[r * K / kActBlock + blk] = d;
      a.ab[r * K / kActBlock + blk] = d * static_cast<float>(hsum_epi32(total));
    }
  }
  a.tstride = transpose_steps(a.da.data(), rows, a.steps, a.dat);
  transpose_steps(a.ab.data(), rows, a.steps, a.abt);
}

void gemv(const LinearArgs& p, const Acts& a, int64_t n0, int64_t n1) {
  const bool decoded = visit_walker<Nibble32, Q8_0, Int8, KQuant45, Q6_K>(
      p.fmt, [&](auto w) { run_rows<decltype(w)>(p, a, n0, n1); });
  if (!decoded && p.fmt == kBF16)
    for_each_group(p.rows, [&](int64_t b, auto group) {
      bf16_group<decltype(group)::value>(p, b, n0, n1);
    });
}

void panel_tail(const LinearArgs& p, const Acts& a, int64_t r0, int64_t n) {
  visit_walker<Nibble32, Q8_0, Int8, KQuant45, Q6_K>(p.fmt, [&](auto w) { tail_rows<decltype(w)>(p, a, r0, n); });
}

// Why one call for several weights: at one row the segments of a fused projection (q, k and v;
// gate and up) are GEMVs short enough that quantizing the same activations for each and each
// one's fork and join barrier were a visible share of them (the VNNI path's group_gemv_parts
// does the same for grouped rows).
void gemv_parts(const LinearArgs* parts, int64_t count, int64_t isa, bool bytes) {
  // AVX-512BW (the avx512 level): Q5_0/Q5_1's fifth bits through mask registers, Q4_K, Q5_K and Q6_K
  // in 512-bit vectors (quant_gemv_bw.cpp), up to 7 rows (Q6_K's too, which the AVX2 panel
  // takes from 5 rows on the avx2 level)
  const bool bw = isa == kAvx512 && wide_panel();
  const int64_t rows = parts[0].rows;
  // int8 activations: the byte panel from kPanelRows (1.4-1.6x the int16 panel at 8-64 rows) for
  // the parts it takes, at the avx512 level too: there the 512-bit int16 panel (twice its
  // products a vpmaddwd) was level with it at 16-32 rows on a Zen 5 capped at avx512 (1.14x
  // faster at 64), and 1.2-1.45x slower at 12-256 rows on an Intel Xeon (Q6_K 1.04-1.18x), where
  // it is only 1.2x the 256-bit int16 panel; the CPUs of that level are Intel's. The rest (a
  // Q8_0 v beside Q5_0 q and k) go on below.
  std::vector<LinearArgs> rest;
  if (bytes && rows >= kPanelRows) {
    std::vector<LinearArgs> byte_parts;
    for (int64_t i = 0; i < count; ++i) (byte_panel_format(parts[i].fmt) ? byte_parts : rest).push_back(parts[i]);
    if (!byte_parts.empty()) byte_panel_parts(byte_parts.data(), static_cast<int64_t>(byte_parts.size()));
    if (rest.empty()) return;
    parts = rest.data();
    count = static_cast<int64_t>(rest.size());
  }
  static thread_local Acts codes;
  quantize_acts(parts[0].x, rows, parts[0].K, codes);
  const Acts& a = codes;
  const bool decoded = std::all_of(parts, parts + count, [](const LinearArgs& p) { return p.fmt != kBF16; });
  const bool q6k = std::all_of(parts, parts + count, [](const LinearArgs& p) { return p.fmt == kQ6_K; });
  if (decoded && rows >= (q6k && !bw ? kPanelRowsQ6K : kPanelRows)) {
    if (bw && rows >= kWidePanelRows)
      v512::panel_gemv_parts(parts, count, a);
    else if (isa == kAvx2Vnni)
      v256vnni::panel_gemv_parts(parts, count, a);
    else
      panel_gemv_parts(parts, count, a);
    return;
  }
  const bool avx_vnni = isa == kAvx2Vnni;
  parallel_parts(parts, count, 1, [&](int64_t i, int64_t n0, int64_t n1) {
    if (bw && v256bw::few_rows_gemv(parts[i], a, n0, n1)) return;
    if (avx_vnni && v256vnni::few_rows_gemv(parts[i], a, n0, n1)) return;
    gemv(parts[i], a, n0, n1);
  });
}

}  // namespace v256

// ================================================================ entry point

void quant_gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t fmt,
                const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& bias,
                int64_t isa, int64_t acts) {
  check_isa(isa);
  check_acts(acts);
  const LinearArgs p = check_linear("quant_gemv", out, x, w, fmt, scales, bias);
  if (p.rows == 0 || p.N == 0) return;
  fmt = p.fmt;  // without the kGrouped bit
  const bool vnni = isa == kAvx512Vnni;
  if (p.grouped) {
    TORCH_CHECK(vnni, "quant_gemv: grouped rows need AVX-512 VNNI (isa 2)");
    v512::group_gemv(p, acts == kInt8Acts);
    return;
  }
  // AVX2 instructions: every isa runs them. Below VNNI, from kPanelRows rows the panels take
  // the steps (gemv_parts: the byte panel for its formats, else the int16 one); at avx512 the
  // K-quants' 1-7 rows keep their 512-bit int16 kernels (quant_gemv_bw.cpp), level with the
  // byte GEMV for Q4_K and 1.1-1.4x it for Q6_K (AMD EPYC Zen 5 capped at avx512, 1.7B shape).
  const bool wide_rows = isa == kAvx512 && v256::wide_panel() && (fmt == kQ4_K || fmt == kQ6_K);
  if (acts == kInt8Acts && v256::byte_format(fmt) && (vnni || (p.rows < v256::kPanelRows && !wide_rows))) {
    v256::byte_gemv(p);
    return;
  }
  if (!vnni && fmt != kBF16) {  // the AVX2 GEMV: a projection of one part
    v256::gemv_parts(&p, 1, isa, acts == kInt8Acts);
    return;
  }
  static thread_local Acts codes;
  if (fmt != kBF16) v512::quantize_acts(p.x, p.rows, p.K, nibble_order(fmt), codes);
  // Rows per task: enough weight bytes (~32 KiB) that a thread's start-up cost stays small.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(p.row_bytes, 1));
  const Acts& a = codes;
  at::parallel_for(0, p.N, grain, [&](int64_t n0, int64_t n1) {
    if (vnni)
      v512::gemv(p, a, n0, n1);
    else
      v256::gemv(p, a, n0, n1);
  });
}

}  // namespace pagedq_cpu
