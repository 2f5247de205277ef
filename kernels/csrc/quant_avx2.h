// AVX2 decoders of the packed formats (quant_formats.h) for the integer GEMV on CPUs without
// AVX-512 VNNI (AVX2 machines such as AMD Zen 2/3 and older Intel, or any CPU capped at avx2).
//
// Why: dequantizing each weight row to fp32 before multiplying made the AVX2 GEMV compute-bound
// at half of llama.cpp's speed. Here each 32-element block becomes two vectors of 16 int16 codes
// which meet the activations' int16 codes in _mm256_madd_epi16 (16 x 16 -> 32 bits, pairs
// summed): the same int16 activation rounding as the VNNI path (its precision argument in
// quant_gemv.cpp holds here too), no float per weight.
//
// The codes come out split by parity, not in natural order: e holds the even elements and o the
// odd ones, each [8 of elements 0-15 | 8 of elements 16-31] (e: 0, 2, .., 14 | 16, .., 30). Why:
// widening bytes to int16 in natural order takes a cross-lane shuffle per 16 codes
// (vpmovzxbw), and Intel runs shuffles on one port, which bounded the one-row GEMV; an int16
// lane's low and high byte are an AND and a shift apart, on any ALU port. The activations are
// stored in the same order (quant_gemv.cpp: quantize_acts), so madd(e, x_e) + madd(o, x_o) is
// the block's dot product, lanes 0-3 from elements 0-15 and lanes 4-7 from 16-31.
//
// Each walker calls f(b, e, o, s_lo, s_hi, m) for 32-block b of one row: the block's value is
// s * code + m, with s_lo for elements 0-15 and s_hi for 16-31 (equal except Q6_K, whose scales
// cover 16 elements). Symmetric formats fold their offset into the codes (Q4_0: code - 8), so m
// is 0 for them and the caller skips that term at compile time (kHasMin).

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant_formats.h"

namespace pagedq_cpu::v256 {

// 32 byte codes in natural order (byte t: element t) -> their even and odd elements as int16.
inline void split_unsigned(__m256i c, __m256i& e, __m256i& o) {
  e = _mm256_and_si256(c, _mm256_set1_epi16(0x00FF));
  o = _mm256_srli_epi16(c, 8);
}
inline void split_signed(__m256i c, __m256i& e, __m256i& o) {
  e = _mm256_srai_epi16(_mm256_slli_epi16(c, 8), 8);
  o = _mm256_srai_epi16(c, 8);
}

inline __m256i minus(__m256i v, int16_t offset) {
  return offset ? _mm256_sub_epi16(v, _mm256_set1_epi16(offset)) : v;
}

// Bit t of the 32 bits at p as byte t of the result (0xFF where set, 0 where not): each byte
// takes its bit's source byte (a shuffle within the lane, both lanes hold all four), every
// other bit is set by the OR, and the compare finds the bytes that are then all ones.
inline __m256i bits_as_bytes(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                       2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i others = _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFELL);
  return _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi8(-1));
}

// The 32-element block formats' walk: each block's codes and its fp16 scale (and minimum, where
// W has one, right after it).
template <class W, class F>
inline void walk_blocks(const uint8_t* row, int64_t K, F&& f) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* blk = row + b * W::kBytes;
    __m256i e, o;
    W::codes(blk, e, o);
    f(b, e, o, fp16(blk), fp16(blk), W::kHasMin ? fp16(blk + 2) : 0.f);
  }
}

template <int64_t Fmt>
struct Nibble32 {  // Q4_0, Q4_1, Q5_0, Q5_1
  static constexpr int64_t kBytes = Fmt == kQ4_0 ? 18 : Fmt == kQ4_1 ? 20 : Fmt == kQ5_0 ? 22 : 24;
  static constexpr bool kHasMin = Fmt == kQ4_1 || Fmt == kQ5_1;
  static constexpr bool kFive = Fmt == kQ5_0 || Fmt == kQ5_1;
  static constexpr bool kTwoScales = false;
  static constexpr int16_t kOffset = kHasMin ? 0 : 8;  // Q4_0's (Q5_0's 16 is merged in codes())

  // One block's codes (the fp16 scale d at blk, the minimum m after it where the format has one).
  static inline void codes(const uint8_t* blk, __m256i& e, __m256i& o) {
    const __m128i qs = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(blk + (kHasMin ? 4 : 2) + (kFive ? 4 : 0)));
    // byte t's low nibble is element t, its high one t + 16: one copy of qs per 128-bit lane,
    // the high one shifted down a nibble
    const __m256i u = _mm256_srlv_epi32(_mm256_broadcastsi128_si256(qs),
                                        _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    if constexpr (kFive) {
      // the fifth bits as bytes in the same natural order, merged before the split: Q5_1's
      // code is nibble | 16 bit, Q5_0's code - 16 is nibble | (bit ? 0 : 0xF0) as a signed byte
      // (12 operations a block where widening first and merging per int16 took 20)
      const __m256i bit = bits_as_bytes(blk + (kHasMin ? 4 : 2));
      const __m256i c = _mm256_and_si256(u, _mm256_set1_epi8(0x0F));
      if constexpr (kHasMin)
        split_unsigned(_mm256_or_si256(c, _mm256_and_si256(bit, _mm256_set1_epi8(0x10))), e, o);
      else
        split_signed(_mm256_or_si256(c, _mm256_andnot_si256(bit, _mm256_set1_epi8(static_cast<char>(0xF0)))), e, o);
      return;
    }
    const __m256i nibble = _mm256_set1_epi16(0x000F);
    e = _mm256_and_si256(u, nibble);
    o = _mm256_and_si256(_mm256_srli_epi16(u, 8), nibble);
    e = minus(e, kOffset);
    o = minus(o, kOffset);
  }

  template <class F>
  static inline void walk(const uint8_t* row, int64_t K, float, F&& f) {
    walk_blocks<Nibble32>(row, K, f);
  }
};

struct Q8_0 {
  static constexpr bool kHasMin = false, kTwoScales = false;
  static constexpr int64_t kBytes = 34;
  static inline void codes(const uint8_t* blk, __m256i& e, __m256i& o) {
    split_signed(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)), e, o);
  }
  template <class F>
  static inline void walk(const uint8_t* row, int64_t K, float, F&& f) {
    walk_blocks<Q8_0>(row, K, f);
  }
};

struct Int8 {  // per-channel int8: the row's scale for every block
  static constexpr bool kHasMin = false, kTwoScales = false;
  template <class F>
  static inline void walk(const uint8_t* row, int64_t K, float scale, F&& f) {
    for (int64_t b = 0; b < K / 32; ++b) {
      __m256i e, o;
      split_signed(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 32)), e, o);
      f(b, e, o, scale, scale, 0.f);
    }
  }
};

// A Q4_K / Q5_K super-block's eight scales d sc_j and offsets -dmin mn_j, lane j for 32-block j
// (k_scales' six-bit unpacking, four bytes at a time instead of one).
inline void k_scale_vectors(const uint8_t* blk, __m256& s, __m256& m) {
  uint32_t a, b, c;
  std::memcpy(&a, blk + 4, 4);
  std::memcpy(&b, blk + 8, 4);
  std::memcpy(&c, blk + 12, 4);
  const uint64_t sc = (a & 0x3F3F3F3Fu) | static_cast<uint64_t>((c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u)) << 32;
  const uint64_t mn = (b & 0x3F3F3F3Fu) | static_cast<uint64_t>(((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u)) << 32;
  const auto widen = [](uint64_t bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes))));
  };
  s = _mm256_mul_ps(_mm256_set1_ps(fp16(blk)), widen(sc));
  m = _mm256_mul_ps(_mm256_set1_ps(-fp16(blk + 2)), widen(mn));
}

// The K-quants also serve the few-row GEMV (quant_gemv.cpp) a super-block at a time: codes(blk,
// j, ...) decodes its 32-block j, scale_vectors its eight blocks' scales as vectors.
template <int64_t Fmt>
struct KQuant45 {  // Q4_K, Q5_K: 8 sub-blocks of 32 per 256, six-bit scales and mins
  static constexpr int64_t kBytes = Fmt == kQ4_K ? 144 : 176;
  static constexpr bool kHasMin = true, kTwoScales = false;
  // The factor on an odd 32-block's scale: Q4_K's codes() gives that block's codes x 16.
  static constexpr float kOddScale = Fmt == kQ4_K ? 0.0625f : 1.f;

  static inline void codes(const uint8_t* blk, int j, __m256i& e, __m256i& o) {
    const uint8_t* qs = blk + (Fmt == kQ4_K ? 16 : 48);
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (j / 2) * 32));
    if constexpr (Fmt == kQ4_K) {
      // straight from the int16 words: block j's even elements are the low byte's nibble
      // (j odd: the high nibble), its odd ones the high byte's. An odd block's nibbles stay
      // where they are, 16 x the code (kOddScale takes the 16 back out of its scale: exact,
      // a power of two), so a pair of blocks costs one shift and four ANDs, not three shifts
      // and three ANDs
      const __m256i mask = _mm256_set1_epi16(j % 2 ? 0x00F0 : 0x000F);
      e = _mm256_and_si256(bytes, mask);
      o = _mm256_and_si256(_mm256_srli_epi16(bytes, 8), mask);
      return;
    }
    __m256i c = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(0x0F));
    // Q5_K: bit j of qh[t], moved to bit 4 (no carry across bytes)
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
    c = _mm256_or_si256(c, _mm256_slli_epi16(
                               _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1)), 4));
    split_unsigned(c, e, o);
  }

  // Lane j: block j's scale d sc_j (x kOddScale) and offset -dmin mn_j.
  static inline void scale_vectors(const uint8_t* blk, __m256& s, __m256& m) {
    k_scale_vectors(blk, s, m);
    if constexpr (kOddScale != 1.f)
      s = _mm256_mul_ps(s, _mm256_setr_ps(1.f, kOddScale, 1.f, kOddScale, 1.f, kOddScale, 1.f, kOddScale));
  }

  template <class F>
  static inline void walk(const uint8_t* row, int64_t K, float, F&& f) {
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const uint8_t* blk = row + sb * kBytes;
      const float d = fp16(blk), dmin = fp16(blk + 2);
      uint8_t sc[8], mn[8];
      k_scales(blk + 4, sc, mn);
#pragma GCC unroll 8  // codes(blk, j) picks its shifts by j at compile time
      for (int j = 0; j < 8; ++j) {
        __m256i e, o;
        codes(blk, j, e, o);
        const float s = d * sc[j] * (j % 2 ? kOddScale : 1.f);
        f(sb * 8 + j, e, o, s, s, -dmin * mn[j]);
      }
    }
  }
};

struct Q6_K {  // 6-bit codes minus 32, one int8 scale per 16 elements
  static constexpr bool kHasMin = false, kTwoScales = true;
  static constexpr int64_t kBytes = 210;

  // 32-block j = 4 half + quarter of the super-block: elements 128 half + 32 quarter + t, as
  // bytes 0-63 in natural order (the stored code, 32 over the value's; byte_walkers.h's Q6_K
  // takes them so).
  static inline __m256i bytes(const uint8_t* blk, int j) {
    const int half = j / 4, quarter = j % 4;
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + half * 32));
    const __m256i ql = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(blk + half * 64 + (quarter % 2) * 32));
    const __m256i lo4 = _mm256_and_si256(quarter < 2 ? ql : _mm256_srli_epi16(ql, 4), _mm256_set1_epi8(0x0F));
    // the quarter's two high bits straight to bits 4-5 (one shift each way, none for quarter 2)
    const int up = 4 - 2 * quarter;
    const __m256i moved = up > 0 ? _mm256_slli_epi16(qh, up) : up < 0 ? _mm256_srli_epi16(qh, -up) : qh;
    return _mm256_or_si256(lo4, _mm256_and_si256(moved, _mm256_set1_epi8(0x30)));
  }
  // The same block's codes minus 32, split by parity as int16.
  static inline void codes(const uint8_t* blk, int j, __m256i& e, __m256i& o) {
    split_unsigned(bytes(blk, j), e, o);
    e = minus(e, 32);
    o = minus(o, 32);
  }

  // The 16 scales d sc_i in the one-row GEMV's order: first [blocks 0-3's first halves (scales
  // 0, 2, 4, 6) | their second halves (1, 3, 5, 7)], then the same for blocks 4-7.
  static inline void scale_vectors(const uint8_t* blk, __m256& first, __m256& second) {
    const __m128i sc = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)),
                                        _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
    const __m256 d = _mm256_set1_ps(fp16(blk + 208));
    first = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    second = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
  }

  template <class F>
  static inline void walk(const uint8_t* row, int64_t K, float, F&& f) {
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const uint8_t* blk = row + sb * kBytes;
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = fp16(blk + 208);
#pragma GCC unroll 8  // codes(blk, j) picks its shifts by j at compile time
      for (int j = 0; j < 8; ++j) {
        __m256i e, o;
        codes(blk, j, e, o);
        f(sb * 8 + j, e, o, d * sc[2 * j], d * sc[2 * j + 1], 0.f);
      }
    }
  }
};

// The walkers by layout: the 32-element blocks (fp16 scales at a fixed stride along a row: a
// walker derived from Nibble32 counts) and the K-quants (eight 32-blocks a super-block, their
// scales as vectors: scale_vectors). The row kernels (few_rows.inc) and the panel's chunk decode
// (panel_kernel.inc) pick their paths by these.
template <class W>
constexpr bool kBlock32 = std::is_same_v<W, Q8_0> || std::is_base_of_v<Nibble32<kQ4_0>, W> ||
                          std::is_base_of_v<Nibble32<kQ4_1>, W> || std::is_base_of_v<Nibble32<kQ5_0>, W> ||
                          std::is_base_of_v<Nibble32<kQ5_1>, W>;
template <class W>
constexpr bool kSuper256 = std::is_same_v<W, KQuant45<kQ4_K>> || std::is_same_v<W, KQuant45<kQ5_K>> ||
                           std::is_same_v<W, Q6_K>;

// Lane g of the result: the sum of d[g]'s 8 lanes. The GEMVs' wide groups (4-8 activation rows)
// reduce one block's integer dot products of all their rows at once, so its scale costs one
// convert and one FMA for every row together instead of one each (the per-row float work, not
// the products, bounded the AVX2 GEMV at 16-64 rows).
inline __m256i sum_rows8(const __m256i d[8]) {
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]), _mm256_hadd_epi32(d[6], d[7]));
  // u0: [rows 0-3, low 128 bits | rows 0-3, high 128 bits]; u1 the same for rows 4-7
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                          _mm256_permute2x128_si256(u0, u1, 0x31));
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// Lane j: block j's whole total, from two vectors whose low 128-bit lanes hold blocks 0-3's
// (u0) and 4-7's (u1) totals over their elements 0-15 and whose high lanes hold those over
// 16-31 (two hadd_epi32 rounds of four blocks' eight-lane sums: few_rows.inc's reduce8,
// byte_gemv.cpp's narrow rows).
inline __m256i totals8(__m256i u0, __m256i u1) {
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// The fp16 pairs at p + j * stride for j = 0..7 (eight blocks' scale d and, in the formats with
// one, their minimum m right after it) as fp32 vectors, lane j for block j.
inline void half_pairs8(const uint8_t* p, int64_t stride, __m256& d, __m256& m) {
  // Each pair broadcast from memory and blended into its lane: loads and blends run on any
  // port, where building the vector through inserts (or the stack) took shuffles or stalled
  // on store forwarding.
  const auto at = [&](int j) {
    int32_t v;
    std::memcpy(&v, p + j * stride, 4);
    return _mm256_set1_epi32(v);
  };
  __m256i raw = at(0);
  raw = _mm256_blend_epi32(raw, at(1), 0x02);
  raw = _mm256_blend_epi32(raw, at(2), 0x04);
  raw = _mm256_blend_epi32(raw, at(3), 0x08);
  raw = _mm256_blend_epi32(raw, at(4), 0x10);
  raw = _mm256_blend_epi32(raw, at(5), 0x20);
  raw = _mm256_blend_epi32(raw, at(6), 0x40);
  raw = _mm256_blend_epi32(raw, at(7), 0x80);
  // per 128-bit lane: the four d halves to bytes 0-7, the four m halves to bytes 8-15
  const __m256i split = _mm256_shuffle_epi8(
      raw, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  const __m256i ordered = _mm256_permute4x64_epi64(split, 0xD8);  // [d 0-7 | m 0-7]
  d = _mm256_cvtph_ps(_mm256_castsi256_si128(ordered));
  m = _mm256_cvtph_ps(_mm256_extracti128_si256(ordered, 1));
}

// src [rows, steps] -> dst [steps, stride] (stride = rows + 16, zero-padded past the rows, so
// the AVX-512 panel's last, padded group of 16 reads zeros): one block's values of 8 (16)
// consecutive rows are then one load (sum_rows8's lanes, the panels' groups).
inline int64_t transpose_steps(const float* src, int64_t rows, int64_t steps, std::vector<float>& dst) {
  const int64_t stride = rows + 16;
  dst.assign(steps * stride, 0.f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < steps; ++b) dst[b * stride + r] = src[r * steps + b];
  return stride;
}

// One block's codes (split by parity, as the walkers give them) -> 32 floats s * code + m at
// out[0..31] in natural order: s_lo for elements 0-15, s_hi for 16-31.
inline void store_scaled(__m256i e, __m256i o, float s_lo, float s_hi, float m, float* out) {
  const __m256i a = _mm256_unpacklo_epi16(e, o);  // elements 0-7 | 16-23
  const __m256i b = _mm256_unpackhi_epi16(e, o);  // elements 8-15 | 24-31
  const __m256 lo = _mm256_set1_ps(s_lo), hi = _mm256_set1_ps(s_hi), vm = _mm256_set1_ps(m);
  const auto put = [&](__m128i codes, __m256 s, float* at) {
    _mm256_storeu_ps(at, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(codes)), s, vm));
  };
  put(_mm256_castsi256_si128(a), lo, out);
  put(_mm256_castsi256_si128(b), lo, out + 8);
  put(_mm256_extracti128_si256(a, 1), hi, out + 16);
  put(_mm256_extracti128_si256(b, 1), hi, out + 24);
}

// One row of a block format dequantized to fp32 in natural order with the decoders above (the
// fp32-tile GEMM's AVX2 path; the scalar decoder of quant_formats.h took 10x as long for Q6_K).
// Returns false for a format they do not decode (bf16 rows).
inline bool dequant_row_f32(int64_t fmt, const uint8_t* row, int64_t K, float scale, float* out) {
  const auto store = [&](int64_t b, __m256i e, __m256i o, float s_lo, float s_hi, float m) {
    store_scaled(e, o, s_lo, s_hi, m, out + b * 32);
  };
  return visit_walker<Nibble32, Q8_0, Int8, KQuant45, Q6_K>(
      fmt, [&](auto w) { decltype(w)::walk(row, K, scale, store); });
}

}  // namespace pagedq_cpu::v256
