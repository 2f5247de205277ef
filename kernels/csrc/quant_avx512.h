// AVX-512 decoders of the packed formats (quant_formats.h), shared by the quantized GEMV and the
// GEMM's bf16 tile dequantizer. Everything here is compiled for AVX-512 (pragma below) and runs
// only where the CPU has it (the callers check at run time).

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_formats.h"

// The walkers' target; code compiled for it (or a superset) inlines them.
#define PAGEDQ_AVX512_BEGIN \
  _Pragma("GCC push_options")  \
  _Pragma("GCC target(\"avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,bmi2\")")
#define PAGEDQ_AVX512_END _Pragma("GCC pop_options")
// The same plus AVX512_BF16 (its fp32 -> bf16 conversion), for code the caller runs only where
// the CPU has it; closed by PAGEDQ_AVX512_END.
#define PAGEDQ_AVX512_BF16_BEGIN \
  _Pragma("GCC push_options")  \
  _Pragma("GCC target(\"avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,bmi2,avx512bf16\")")

PAGEDQ_AVX512_BEGIN
namespace pagedq_cpu::v512 {

// [v[first] x8, v[first + 1] x8]: the lanes of two 32-code halves of a chunk
inline __m512 half_lanes(__m512 v, int first) {
  const __m512i idx = _mm512_add_epi32(
      _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), _mm512_set1_epi32(first));
  return _mm512_permutexvar_ps(idx, v);
}
inline __m512 quarter_lanes(__m512 v, int first) {  // [v[first] x4, ..., v[first + 3] x4]
  const __m512i idx = _mm512_add_epi32(
      _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm512_set1_epi32(first));
  return _mm512_permutexvar_ps(idx, v);
}

// Where one weight row's bytes are: field `off` (`size` bytes, of the format's block layout) of
// its block b. Rows follow one another (GGUF's layout), or, kGrouped, 16 rows share each block
// position field by field (group_gemv.cpp): the code fields in group_slot order, scales in row
// order.
struct RowRef {
  const uint8_t* row;  // plain: the row's first byte; grouped: its group's
  int64_t block_bytes;
  int64_t r = -1, slot = 0;  // grouped: the row within its group and its code slot
  static RowRef plain(const uint8_t* w, int64_t n, int64_t row_bytes, int64_t block_bytes) {
    return {w + n * row_bytes, block_bytes};
  }
  static RowRef grouped(int64_t fmt, const uint8_t* w, int64_t n, int64_t row_bytes,
                        int64_t block_bytes) {
    const int64_t r = n % kGroupRows;
    return {w + (n - r) * row_bytes, block_bytes, r, group_slot(fmt, r)};
  }
  const uint8_t* at(int64_t b, int64_t off, int64_t size, bool code) const {
    if (r < 0) return row + b * block_bytes + off;
    return row + kGroupRows * (b * block_bytes + off) + (code ? slot : r) * size;
  }
};

// Each walker calls f(chunk, codes, ws, wm) for every chunk of one weight row; codes are
// unsigned bytes (Q8_0/int8 stored +128, with wm = -128 * ws).

template <int64_t Fmt>
struct Nibble32 {  // Q4_0, Q4_1, Q5_0, Q5_1
  static constexpr int64_t kBytes = Fmt == kQ4_0 ? 18 : Fmt == kQ4_1 ? 20 : Fmt == kQ5_0 ? 22 : 24;
  static constexpr bool kMin = Fmt == kQ4_1 || Fmt == kQ5_1;
  static constexpr bool kFive = Fmt == kQ5_0 || Fmt == kQ5_1;
  static constexpr int64_t kQh = kMin ? 4 : 2;
  static constexpr int64_t kQs = kQh + (kFive ? 4 : 0);

  template <class F>
  static inline void walk(const RowRef& row, int64_t K, float, F&& f) {
    const int64_t blocks = K / 32;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int64_t c = 0; c * 2 < blocks; ++c) {
      const int64_t i0 = 2 * c, i1 = 2 * c + 1;
      const bool pair = i1 < blocks;
      const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row.at(i0, kQs, 16, true)));
      const __m128i q1 = pair ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(row.at(i1, kQs, 16, true)))
                              : _mm_setzero_si128();
      const __m256i qs = _mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1);
      __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(qs), _mm256_srli_epi16(qs, 4), 1);
      w = _mm512_and_si512(w, low4);
      if constexpr (kFive) {
        uint32_t h0, h1 = 0;
        std::memcpy(&h0, row.at(i0, kQh, 4, true), 4);
        if (pair) std::memcpy(&h1, row.at(i1, kQh, 4, true), 4);
        const uint64_t bits = (h0 & 0xFFFFull) | (uint64_t(h1 & 0xFFFF) << 16) |
                              (uint64_t(h0 >> 16) << 32) | (uint64_t(h1 >> 16) << 48);
        w = _mm512_mask_add_epi8(w, bits, w, _mm512_set1_epi8(16));
      }
      // d0, m0, d1, m1 (fp16 each; the min fields are unused without kMin)
      uint16_t dm[4] = {0, 0, 0, 0};
      std::memcpy(&dm[0], row.at(i0, 0, 2, false), 2);
      if constexpr (kMin) std::memcpy(&dm[1], row.at(i0, 2, 2, false), 2);
      if (pair) std::memcpy(&dm[2], row.at(i1, 0, 2, false), 2);
      if (kMin && pair) std::memcpy(&dm[3], row.at(i1, 2, 2, false), 2);
      uint64_t dm64;
      std::memcpy(&dm64, dm, 8);
      const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(dm64)));  // d0 m0 d1 m1
      const __m512 v = _mm512_castps128_ps512(dmf);
      const __m512 ws = _mm512_permutexvar_ps(
          _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2), v);
      __m512 wm;
      if constexpr (kMin)
        wm = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 1, 1, 1, 1, 3, 3, 3, 3), v);
      else
        wm = _mm512_mul_ps(ws, _mm512_set1_ps(kFive ? -16.f : -8.f));
      f(c, w, ws, wm);
    }
  }
};

struct Q8_0 {
  template <class F>
  static inline void walk(const RowRef& row, int64_t K, float, F&& f) {
    const int64_t blocks = K / 32;
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t c = 0; c * 2 < blocks; ++c) {
      const int64_t i0 = 2 * c, i1 = 2 * c + 1;
      const bool pair = i1 < blocks;
      const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.at(i0, 2, 32, true)));
      const __m256i q1 = pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.at(i1, 2, 32, true)))
                              : _mm256_set1_epi8(static_cast<char>(0x80));  // codes 0 after the flip
      const __m512i w = _mm512_xor_si512(
          _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1), flip);
      uint16_t h[2] = {0, 0};
      std::memcpy(&h[0], row.at(i0, 0, 2, false), 2);
      if (pair) std::memcpy(&h[1], row.at(i1, 0, 2, false), 2);
      uint32_t both;
      std::memcpy(&both, h, 4);
      const __m512 v = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(both))));
      const __m512 ws = half_lanes(v, 0);
      f(c, w, ws, _mm512_mul_ps(ws, _mm512_set1_ps(-128.f)));
    }
  }
};

struct Int8 {
  template <class F>
  static inline void walk(const RowRef& ref, int64_t K, float scale, F&& f) {
    const uint8_t* row = ref.row;
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const __m512 ws = _mm512_set1_ps(scale), wm = _mm512_set1_ps(-128.f * scale);
    for (int64_t c = 0; c * kChunk < K; ++c) {
      const int64_t left = K - c * kChunk;
      const __mmask64 m = left >= 64 ? ~0ull : (1ull << left) - 1;
      f(c, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, row + c * kChunk), flip), ws, wm);
    }
  }
};

template <int64_t Fmt>
struct KQuant45 {  // Q4_K, Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins
  static constexpr int64_t kBytes = Fmt == kQ4_K ? 144 : 176;
  template <class F>
  static inline void walk(const RowRef& row, int64_t K, float, F&& f) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      uint8_t packed[12], sc[8], mn[8];
      for (int i = 0; i < 12; ++i) packed[i] = *row.at(sb, 4 + i, 1, false);
      k_scales(packed, sc, mn);
      uint16_t dd[2];
      std::memcpy(&dd[0], row.at(sb, 0, 2, false), 2);
      std::memcpy(&dd[1], row.at(sb, 2, 2, false), 2);
      uint32_t both;
      std::memcpy(&both, dd, 4);
      const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(both)));  // d, dmin
      const __m256 d8 = _mm256_broadcastss_ps(dm);
      const __m256 dmin8 = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
      uint64_t sc64, mn64;
      std::memcpy(&sc64, sc, 8);
      std::memcpy(&mn64, mn, 8);
      const __m256 scales = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(sc64))));
      const __m256 mins = _mm256_mul_ps(dmin8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mn64))));
      // [d*sc 0-7 | -dmin*m 0-7]
      const __m512 table = _mm512_insertf32x8(_mm512_castps256_ps512(scales),
                                              _mm256_sub_ps(_mm256_setzero_ps(), mins), 1);
      const int64_t qs = Fmt == kQ4_K ? 16 : 48;
      const __m256i qh = Fmt == kQ5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                            row.at(sb, 16, 32, true)))
                                      : _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {  // grouped: qh and each 32-byte run of qs are fields of their own
        const __m256i q = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(row.at(sb, qs + 32 * j, 32, true)));
        __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
        w = _mm512_and_si512(w, low4);
        if constexpr (Fmt == kQ5_K) {
          const __mmask32 lo = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << (2 * j))));
          const __mmask32 hi = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << (2 * j + 1))));
          const __mmask64 bits = static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << 32);
          w = _mm512_mask_add_epi8(w, bits, w, _mm512_set1_epi8(16));
        }
        f(sb * 4 + j, w, half_lanes(table, 2 * j), half_lanes(table, 8 + 2 * j));
      }
    }
  }
};

// 16 * n bytes of a run of code fields from byte `off` of block b: one load for a plain row; a
// grouped row's run is n fields of 16 bytes (Q6_K's), each in its own place.
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m512i code_run64(const RowRef& row, int64_t b, int64_t off) {
  if (row.r < 0) return _mm512_loadu_si512(row.at(b, off, 64, true));
  __m512i v = _mm512_castsi128_si512(load16(row.at(b, off, 16, true)));
  v = _mm512_inserti32x4(v, load16(row.at(b, off + 16, 16, true)), 1);
  v = _mm512_inserti32x4(v, load16(row.at(b, off + 32, 16, true)), 2);
  return _mm512_inserti32x4(v, load16(row.at(b, off + 48, 16, true)), 3);
}
inline __m256i code_run32(const RowRef& row, int64_t b, int64_t off) {
  if (row.r < 0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.at(b, off, 32, true)));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(load16(row.at(b, off, 16, true))),
                                 load16(row.at(b, off + 16, 16, true)), 1);
}

struct Q6_K {  // grouped: ql and qh in fields of 16 bytes, each scale byte a field (block_formats)
  template <class F>
  static inline void walk(const RowRef& row, int64_t K, float, F&& f) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(3);
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const __m512 d = _mm512_set1_ps(fp16(row.at(sb, 208, 2, false)));
      __m128i sc;
      if (row.r < 0) {
        sc = load16(row.at(sb, 192, 16, false));
      } else {
        alignas(16) uint8_t bytes[16];
        for (int i = 0; i < 16; ++i) bytes[i] = *row.at(sb, 192 + i, 1, false);
        sc = _mm_load_si128(reinterpret_cast<const __m128i*>(bytes));
      }
      const __m512 table = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
      for (int c = 0; c < 4; ++c) {
        const int half = c / 2, hi = c % 2;
        const __m512i ql = code_run64(row, sb, 64 * half);
        const __m256i qh = code_run32(row, sb, 128 + 32 * half);
        __m512i w = hi ? _mm512_and_si512(_mm512_srli_epi16(ql, 4), low4) : _mm512_and_si512(ql, low4);
        const __m256i h0 = _mm256_srli_epi16(qh, 4 * hi), h1 = _mm256_srli_epi16(qh, 4 * hi + 2);
        __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1);
        h = _mm512_slli_epi16(_mm512_and_si512(h, two), 4);
        w = _mm512_or_si512(w, h);
        const __m512 ws = quarter_lanes(table, 4 * c);
        f(sb * 4 + c, w, ws, _mm512_mul_ps(ws, _mm512_set1_ps(-32.f)));
      }
    }
  }
};

// 16 codes (group G of the chunk) -> 16 floats: code * ws + wm of their lanes.
template <int G>
inline __m512 dequant16(__m512i w, __m512 ws, __m512 wm) {
  const __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(w, G)));
  return _mm512_fmadd_ps(codes, quarter_lanes(ws, 4 * G), quarter_lanes(wm, 4 * G));
}

// Walks one row of format fmt; f(chunk, codes, ws, wm) as above. Only the groupable formats
// (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and the K-quants) take a grouped row.
template <class F>
inline void walk_row(int64_t fmt, const RowRef& ref, int64_t K, float scale, F&& f) {
  visit_walker<Nibble32, Q8_0, Int8, KQuant45, Q6_K>(
      fmt, [&](auto w) { decltype(w)::walk(ref, K, scale, f); });
}

}  // namespace pagedq_cpu::v512
PAGEDQ_AVX512_END
