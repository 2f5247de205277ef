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
// block's value s * code + m (kSigned: int8 codes, m = 0; else unsigned).
struct ByteQ8_0 {
  static constexpr bool kSigned = true, kHasMin = false;
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
  template <class F>
  static inline void walk(const uint8_t* row, int64_t K, F&& f) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* blk = row + b * kBytes;
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (Fmt == kQ4_1 ? 4 : 2)));
      const __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), low);
      const float d = fp16(blk);
      f(b, codes, d, Fmt == kQ4_1 ? fp16(blk + 2) : -8.f * d);
    }
  }
};

struct ByteQ4_K {  // 8 sub-blocks of 32 per 256, 6-bit scales and mins
  static constexpr bool kSigned = false, kHasMin = true;
  template <class F>
  static inline void walk(const uint8_t* row, int64_t K, F&& f) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const uint8_t* blk = row + sb * 144;
      const float d = fp16(blk), dmin = fp16(blk + 2);
      uint8_t sc[8], mn[8];
      k_scales(blk + 4, sc, mn);
      for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 high
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * c));
        f(sb * 8 + 2 * c, _mm256_and_si256(q, low), d * sc[2 * c], -dmin * mn[2 * c]);
        f(sb * 8 + 2 * c + 1, _mm256_and_si256(_mm256_srli_epi16(q, 4), low), d * sc[2 * c + 1],
          -dmin * mn[2 * c + 1]);
      }
    }
  }
};

}  // namespace pagedq_cpu::v256
