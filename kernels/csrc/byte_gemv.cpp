// The AVX2 GEMV on int8 activations (quant_gemv's acts = 8) for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
// Q4_K and Q6_K: the activations are rounded to int8 per 32 values (step da = max|x| / 127), once
// per call, and each 32-code block of a weight row meets them in one _mm256_maddubs_epi16
// (unsigned x signed bytes, pairs summed to int16) and one _mm256_madd_epi16 against ones (to
// int32; Q6_K: against its int8 scales), as llama.cpp's AVX2 kernels do.
//
// Why: the int16-activation GEMV (quant_gemv.cpp) widens every code to 16 bits and multiplies in
// _mm256_madd_epi16, 16 products per instruction; here 32 codes go in one instruction as bytes,
// with no widening. The cost is the activations' rounding: ~2^-8 of each block's largest value
// instead of ~2^-16, so the model no longer follows its dequantized twin to the last bit
// (docs/quantization.md: fidelity of int8 activations). Callers opt in.
//
// Per block: value = s * code + m (quant_avx2.h's convention). Unsigned codes (the nibble
// formats, 0-15; Q5_0/Q5_1 0-31 with their fifth bits; Q6_K 0-63) go into maddubs as they are;
// the offsets m (Q4_0: -8 d, Q5_0: -16 d; Q4_1, Q5_1, Q4_K: their mins; Q6_K: -32 d sc per half)
// meet the block's da * sum(q). Q8_0's signed codes use the sign trick (|w| unsigned, q with w's
// sign): |w| <= 128 and |q| <= 127, so a pair's sum stays within int16.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "byte_acts.h"
#include "byte_walkers.h"
#include "cpu_ops.h"
#include "quant_avx2.h"
#include "quant_formats.h"

namespace pagedq_cpu::v256 {
namespace {

constexpr int kMaxRows = 8;  // activation rows per pass over a weight row (accumulators in registers)

// 4-8 activation rows from b0 against weight row n: each block's sums of all rows reduced into
// one vector (quant_avx2.h: sum_rows8), one convert and FMA per block for the group.
template <class W, int G>
void byte_group_wide(const LinearArgs& p, const ByteActs& a, int64_t b0, int64_t n) {
  __m256 acc = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
  W::walk(p.w + n * p.row_bytes, p.K, [&](int64_t b, __m256i codes, float s, float m) {
    const __m256i u = W::kSigned ? _mm256_sign_epi8(codes, codes) : codes;
    __m256i d[8];
    for (int g = 0; g < 8; ++g) {
      if (g >= G) {
        d[g] = _mm256_setzero_si256();
        continue;
      }
      __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.block((b0 + g) * a.blocks + b)));
      if constexpr (W::kSigned) q = _mm256_sign_epi8(q, codes);
      d[g] = dot_u8(u, q);
    }
    const __m256 da = _mm256_loadu_ps(a.dat.data() + b * a.tstride + b0);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_rows8(d)), _mm256_mul_ps(_mm256_set1_ps(s), da), acc);
    if constexpr (W::kHasMin)
      mins = _mm256_fmadd_ps(_mm256_set1_ps(m), _mm256_loadu_ps(a.sxt.data() + b * a.tstride + b0), mins);
  });
  alignas(32) float sums[8];
  _mm256_store_ps(sums, _mm256_add_ps(acc, mins));
  const float bias = p.bias ? p.bias[n] : 0.f;
  for (int g = 0; g < G; ++g) p.out[(b0 + g) * p.ldo + n] = sums[g] + bias;
}

// The last K / 32 % 8 blocks of a row one by one (the 32-element formats' rows whose K is no
// multiple of 256), for byte_group_narrow's rows: total[g] += their sums.
template <class W, int G>
inline void tail_blocks(const ByteActs& a, int64_t b0, const uint8_t* row, int64_t whole, float* total) {
  if (whole == a.blocks) return;
  W::walk(row + whole * W::kBytes, (a.blocks - whole) * 32, [&](int64_t b, __m256i codes, float s, float m) {
    const __m256i u = W::kSigned ? _mm256_sign_epi8(codes, codes) : codes;
    for (int g = 0; g < G; ++g) {
      const int64_t i = (b0 + g) * a.blocks + whole + b;
      __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.block(i)));
      if constexpr (W::kSigned) q = _mm256_sign_epi8(q, codes);
      total[g] += s * a.da[i] * static_cast<float>(hsum_epi32(dot_u8(u, q))) + m * a.sx[i];
    }
  });
}

// 1-3 activation rows from b0 against weight row n, eight blocks at a time: their int32 sums
// reduced into one vector (lane j for block j, hadd pairs as they come), so the eight scales
// (one vector: half_pairs8, k_scale_vectors) apply in one convert and one FMA, as the int16
// rows do (few_rows.inc). Why: a block at a time, each block's scalar scale (a multiply and a
// broadcast), its convert and its FMA, one chain per row, cost more than its products: the 1.7B
// shape's one-row Q4_K GEMV took 2x the int16 kernel's time (AMD EPYC Zen 5 capped at avx2).
template <class W, int G>
void byte_group_narrow(const LinearArgs& p, const ByteActs& a, int64_t b0, int64_t n) {
  __m256 acc[G], mins[G];
  for (int g = 0; g < G; ++g) acc[g] = mins[g] = _mm256_setzero_ps();
  const uint8_t* row = p.w + n * p.row_bytes;
  const int64_t span = span_bytes(p), whole = a.blocks / 8 * 8;
  // Q8_0 keeps 3 KB ahead, as the int16 kernel's one row (quant_formats.h: kAheadBytesFar)
  constexpr uintptr_t ahead = W::kSigned ? kAheadBytes : kAheadBytesFar;
  for (int64_t c0 = 0; c0 < whole; c0 += 8) {
    if (b0 == 0 && a.rows < kRowPrefetchRows) prefetch_ahead(row + c0 / 8 * span, span, ahead);
    __m256i prev[G], pair[G], half[G][2];
    __m256 s, m, m2;
    W::eight(row, c0, [&](int j, __m256i codes, __m256i widen) {
      const __m256i u = W::kSigned ? _mm256_sign_epi8(codes, codes) : codes;
      for (int g = 0; g < G; ++g) {
        __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.block((b0 + g) * a.blocks + c0 + j)));
        if constexpr (W::kSigned) q = _mm256_sign_epi8(q, codes);
        const __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), widen);
        if (j % 2 == 0) {
          prev[g] = d;
        } else if (j % 4 == 1) {
          pair[g] = _mm256_hadd_epi32(prev[g], d);
        } else {
          half[g][j / 4] = _mm256_hadd_epi32(pair[g], _mm256_hadd_epi32(prev[g], d));
        }
      }
    }, s, m, m2);
    for (int g = 0; g < G; ++g) {
      const int64_t i = (b0 + g) * a.blocks + c0;
      acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals8(half[g][0], half[g][1])),
                               _mm256_mul_ps(s, _mm256_loadu_ps(a.da.data() + i)), acc[g]);
      if constexpr (W::kSixBit) {
        mins[g] = _mm256_fmadd_ps(m, _mm256_loadu_ps(a.s0.data() + i), mins[g]);
        mins[g] = _mm256_fmadd_ps(m2, _mm256_loadu_ps(a.s1.data() + i), mins[g]);
      } else if constexpr (W::kHasMin) {
        mins[g] = _mm256_fmadd_ps(m, _mm256_loadu_ps(a.sx.data() + i), mins[g]);
      }
    }
  }
  float total[G];
  for (int g = 0; g < G; ++g) total[g] = hsum(_mm256_add_ps(acc[g], mins[g]));
  if constexpr (!W::kSixBit) tail_blocks<W, G>(a, b0, row, whole, total);
  const float bias = p.bias ? p.bias[n] : 0.f;
  for (int g = 0; g < G; ++g) p.out[(b0 + g) * p.ldo + n] = total[g] + bias;
}

template <class W, int G>
void byte_group(const LinearArgs& p, const ByteActs& a, int64_t b0, int64_t n) {
  if constexpr (G >= 4 && W::kSixBit) {  // Q6_K: pieces of 2-3 rows (the wide rows take one scale a block)
    constexpr int first = G == 4 ? 2 : 3;
    byte_group_narrow<W, first>(p, a, b0, n);
    byte_group<W, G - first>(p, a, b0 + first, n);
  } else if constexpr (G >= 4) {
    byte_group_wide<W, G>(p, a, b0, n);
  } else {
    byte_group_narrow<W, G>(p, a, b0, n);
  }
}

template <class W>
void run_rows(const LinearArgs& p, const ByteActs& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    if (a.rows >= kRowPrefetchRows) prefetch_row(p.w + n * p.row_bytes, p.row_bytes);
    for (int64_t b = 0; b < a.rows; b += kMaxRows) {
      switch (std::min<int64_t>(kMaxRows, a.rows - b)) {
        case 1: byte_group<W, 1>(p, a, b, n); break;
        case 2: byte_group<W, 2>(p, a, b, n); break;
        case 3: byte_group<W, 3>(p, a, b, n); break;
        case 4: byte_group<W, 4>(p, a, b, n); break;
        case 5: byte_group<W, 5>(p, a, b, n); break;
        case 6: byte_group<W, 6>(p, a, b, n); break;
        case 7: byte_group<W, 7>(p, a, b, n); break;
        default: byte_group<W, 8>(p, a, b, n); break;
      }
    }
  }
}

template <class W>
void run(const LinearArgs& p, const ByteActs& a) {
  // Rows per task: enough weight bytes (~32 KiB) that a thread's start-up cost stays small.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(p.row_bytes, 1));
  at::parallel_for(0, p.N, grain, [&](int64_t n0, int64_t n1) { run_rows<W>(p, a, n0, n1); });
}

}  // namespace

bool byte_format(int64_t fmt) {
  return fmt == kQ8_0 || fmt == kQ4_0 || fmt == kQ4_1 || fmt == kQ5_0 || fmt == kQ5_1 || fmt == kQ4_K ||
         fmt == kQ6_K;
}

void byte_tail(const LinearArgs& p, const ByteActs& a, int64_t r0, int64_t n) {
  visit_byte_walker(p.fmt, [&](auto walker) {
    using W = decltype(walker);
    switch (a.rows - r0) {
      case 1: byte_group<W, 1>(p, a, r0, n); break;
      case 2: byte_group<W, 2>(p, a, r0, n); break;
      default: byte_group<W, 3>(p, a, r0, n); break;
    }
  });
}

void byte_gemv(const LinearArgs& p) {
  TORCH_CHECK(byte_format(p.fmt) && !p.grouped,
              "byte_gemv: int8 activations on AVX2 take plain Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K or Q6_K rows");
  static thread_local ByteActs acts;
  quantize_bytes_transposed(p.x, p.rows, p.K, acts, p.fmt == kQ6_K);
  visit_byte_walker(p.fmt, [&](auto walker) { run<decltype(walker)>(p, acts); });
}

}  // namespace pagedq_cpu::v256
