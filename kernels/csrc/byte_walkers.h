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
// m) calls f(j, codes) for the eight blocks from c0 (a multiple of 8, all eight in the row) and
// gives their scales and offsets as vectors, lane j for block c0 + j. kBytes: a 32-block's
// bytes (0: the format's blocks are 256-element super-blocks, and K a multiple of 256).
struct ByteQ8_0 {
  static constexpr bool kSigned = true, kHasMin = false;
  static constexpr int64_t kBytes = 34;
  template <class F>
  static inline void eight(const uint8_t* row, int64_t c0, F&& f, __m256& s, __m256& m) {
    const uint8_t* blk = row + c0 * kBytes;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) f(j, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + j * kBytes + 2)));
    half_pairs8(blk, kBytes, s, m);
    m = _mm256_setzero_ps();
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
struct ByteNibble32 {  // Q4_0 (code - 8), Q4_1 (code + min)
  static constexpr bool kSigned = false, kHasMin = true;
  static constexpr int64_t kBytes = Fmt == kQ4_0 ? 18 : 20;
  static inline __m256i codes(const uint8_t* blk) {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (Fmt == kQ4_1 ? 4 : 2)));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(0x0F));
  }
  template <class F>
  static inline void eight(const uint8_t* row, int64_t c0, F&& f, __m256& s, __m256& m) {
    const uint8_t* blk = row + c0 * kBytes;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) f(j, codes(blk + j * kBytes));
    half_pairs8(blk, kBytes, s, m);
    if constexpr (Fmt == kQ4_0) m = _mm256_mul_ps(s, _mm256_set1_ps(-8.f));
  }
  template <class F>
  static inline void walk(const uint8_t* row, int64_t K, F&& f) {
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* blk = row + b * kBytes;
      const float d = fp16(blk);
      f(b, codes(blk), d, Fmt == kQ4_1 ? fp16(blk + 2) : -8.f * d);
    }
  }
};

struct ByteQ4_K {  // 8 sub-blocks of 32 per 256, 6-bit scales and mins
  static constexpr bool kSigned = false, kHasMin = true;
  static constexpr int64_t kBytes = 0;
  template <class F>
  static inline void eight(const uint8_t* row, int64_t c0, F&& f, __m256& s, __m256& m) {
    const uint8_t* blk = row + c0 / 8 * 144;
    const __m256i low = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 high
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * c));
      f(2 * c, _mm256_and_si256(q, low));
      f(2 * c + 1, _mm256_and_si256(_mm256_srli_epi16(q, 4), low));
    }
    k_scale_vectors(blk, s, m);
  }
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

}  // namespace pagedq_cpu::v256
