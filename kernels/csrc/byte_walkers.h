// The int8-activation kernels' weight walkers (byte_gemv.cpp: the row at a time; byte_panel.cpp:
// the panel from 8 rows): each 32-block's codes as bytes in natural order, the order
// quantize_bytes (byte_acts.h) gives the activations, with the block's scale and offset.

#pragma once

#include <immintrin.h>

#include <cstdint>

#include "quant_avx2.h"
#include "quant_formats.h"

namespace pagedq_cpu::v256 {

// 32 unsigned codes times 32 signed activations: 8 int32 sums of 4 products each.
inline __m256i dot_u8(__m256i codes, __m256i q) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, q), _mm256_set1_epi16(1));
}

// Each walker calls f(b, codes, s, m) for 32-block b of a row: 32 codes in natural order, the
// block's value s * code + m (kSigned: int8 codes, m = 0; else unsigned). eight(row, c0, f, s,
// m, m2) calls f(j, codes, widen) for the eight blocks from c0 (a multiple of 8, all eight in the
// row) and gives their scales and offsets as vectors, lane j for block c0 + j; widen is what
// the block's maddubs pairs meet in vpmaddwd (ones, or Q6_K's int8 scales: ByteQ6_K), m2 the
// offset of Q6_K's second halves (zero elsewhere). kBytes: a 32-block's
// bytes (0: the format's blocks are 256-element super-blocks, and K a multiple of 256).
// kSumQuads: how many maddubs results of a block (4 codes of 8 rows each) byte_panel.cpp may add
// in int16 before they overflow: a pair of products is at most 2 x 15 x 127 = 3810 for the
// nibbles (8 of them: 30480), 2 x 31 x 127 = 7874 with a fifth bit (4: 31496).
struct ByteQ8_0 {
  static constexpr bool kSigned = true, kHasMin = false, kSixBit = false;
  static constexpr int64_t kBytes = 34;
  static constexpr int kSumQuads = 1;  // (signed codes: not a panel format)
  template <class F>
  static inline void eight(const uint8_t* row, int64_t c0, F&& f, __m256& s, __m256& m, __m256& m2) {
    const uint8_t* blk = row + c0 * kBytes;
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) f(j, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + j * kBytes + 2)), ones);
    half_pairs8(blk, kBytes, s, m);
    m = m2 = _mm256_setzero_ps();
  }
  template <class F>
  static inline void walk(const uint8_t* row, int64_t K, F&& f) {
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* blk = row + b * 34;
      f(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)), fp16(blk), 0.f);
    }
  }
};

template <int64_t Fmt>
struct ByteNibble32 {  // Q4_0 (code - 8), Q4_1 (code + min), Q5_0 (code - 16), Q5_1 (code + min)
  static constexpr bool kSigned = false, kHasMin = true, kSixBit = false;
  static constexpr bool kFive = Fmt == kQ5_0 || Fmt == kQ5_1, kOwnMin = Fmt == kQ4_1 || Fmt == kQ5_1;
  static constexpr int64_t kBytes = Fmt == kQ4_0 ? 18 : Fmt == kQ4_1 ? 20 : Fmt == kQ5_0 ? 22 : 24;
  static constexpr float kOffset = Fmt == kQ4_0 ? -8.f : -16.f;  // of the formats without a min
  static constexpr int kSumQuads = kFive ? 4 : 8;
  // the natural order's codes, 0-15 (0-31 with the fifth bits, quant_avx2.h's bits_as_bytes)
  static inline __m256i codes(const uint8_t* blk) {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kBytes - 16));
    const __m256i c = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(0x0F));
    if constexpr (!kFive) return c;
    return _mm256_or_si256(c, _mm256_and_si256(bits_as_bytes(blk + kBytes - 20), _mm256_set1_epi8(0x10)));
  }
  template <class F>
  static inline void eight(const uint8_t* row, int64_t c0, F&& f, __m256& s, __m256& m, __m256& m2) {
    const uint8_t* blk = row + c0 * kBytes;
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) f(j, codes(blk + j * kBytes), ones);
    half_pairs8(blk, kBytes, s, m);
    if constexpr (!kOwnMin) m = _mm256_mul_ps(s, _mm256_set1_ps(kOffset));
    m2 = _mm256_setzero_ps();
  }
  template <class F>
  static inline void walk(const uint8_t* row, int64_t K, F&& f) {
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* blk = row + b * kBytes;
      const float d = fp16(blk);
      f(b, codes(blk), d, kOwnMin ? fp16(blk + 2) : kOffset * d);
    }
  }
};

struct ByteQ4_K {  // 8 sub-blocks of 32 per 256, 6-bit scales and mins
  static constexpr bool kSigned = false, kHasMin = true, kSixBit = false;
  static constexpr int64_t kBytes = 0;
  static constexpr int kSumQuads = 8;
  template <class F>
  static inline void eight(const uint8_t* row, int64_t c0, F&& f, __m256& s, __m256& m, __m256& m2) {
    const uint8_t* blk = row + c0 / 8 * 144;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 high
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * c));
      f(2 * c, _mm256_and_si256(q, low), ones);
      f(2 * c + 1, _mm256_and_si256(_mm256_srli_epi16(q, 4), low), ones);
    }
    k_scale_vectors(blk, s, m);
    m2 = _mm256_setzero_ps();
  }
  // (not through eight(): a walk that stored the eight blocks' codes first and called f after
  // ran the 4-8-row GEMV 1.03-1.12x slower, the codes spilled; AMD EPYC Zen 5 capped at avx2)
  template <class F>
  static inline void walk(const uint8_t* row, int64_t K, F&& f) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const uint8_t* blk = row + sb * 144;
      alignas(32) float s[8], m[8];  // the eight scales at once, not a six-bit walk each
      __m256 sv, mv;
      k_scale_vectors(blk, sv, mv);
      _mm256_store_ps(s, sv);
      _mm256_store_ps(m, mv);
      for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 high
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * c));
        f(sb * 8 + 2 * c, _mm256_and_si256(q, low), s[2 * c], m[2 * c]);
        f(sb * 8 + 2 * c + 1, _mm256_and_si256(_mm256_srli_epi16(q, 4), low), s[2 * c + 1], m[2 * c + 1]);
      }
    }
  }
};

// Q6_K: six-bit codes stored +32 (0-63), one int8 scale per 16 codes: value d sc (code - 32).
// Block j's maddubs pairs meet [sc 2j x 8 | sc 2j+1 x 8] in vpmaddwd (the pairs of elements 0-15
// fill the low 8 int16 lanes), so its int32 sums come out scaled, both halves exact (a pair at
// most 2 x 63 x 127 = 16002, times 128): s is d alone, and the -32 offsets meet the activations'
// half sums (ByteActs' s0, s1) with m = -32 d sc_2j, m2 = -32 d sc_2j+1.
struct ByteQ6_K {
  static constexpr bool kSigned = false, kHasMin = false, kSixBit = true;
  static constexpr int64_t kBytes = 0;
  static constexpr int kSumQuads = 2;
  static inline __m256i widen(const uint8_t* blk, int j) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    return _mm256_setr_m128i(_mm_set1_epi16(sc[2 * j]), _mm_set1_epi16(sc[2 * j + 1]));
  }
  template <class F>
  static inline void eight(const uint8_t* row, int64_t c0, F&& f, __m256& s, __m256& m, __m256& m2) {
    const uint8_t* blk = row + c0 / 8 * 210;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) f(j, Q6_K::bytes(blk, j), widen(blk, j));
    const float d = fp16(blk + 208);
    const __m128i sc = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)),
                                        _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    const __m256 off = _mm256_set1_ps(-32.f * d);
    s = _mm256_set1_ps(d);
    m = _mm256_mul_ps(off, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    m2 = _mm256_mul_ps(off, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
  }
};

// f(walker) with the byte walker of `fmt` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q6_K; anything else Q4_K:
// callers check the format first).
template <class F>
inline void visit_byte_walker(int64_t fmt, F&& f) {
  switch (fmt) {
    case kQ8_0: f(ByteQ8_0{}); break;
    case kQ4_0: f(ByteNibble32<kQ4_0>{}); break;
    case kQ4_1: f(ByteNibble32<kQ4_1>{}); break;
    case kQ5_0: f(ByteNibble32<kQ5_0>{}); break;
    case kQ5_1: f(ByteNibble32<kQ5_1>{}); break;
    case kQ6_K: f(ByteQ6_K{}); break;
    default: f(ByteQ4_K{}); break;
  }
}

}  // namespace pagedq_cpu::v256
