// The GEMV over grouped rows (format code | kGrouped): the one-stream decode's kernel for the
// 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the K-quants (Q4_K, Q5_K, Q6_K).
//
// Why: the row-at-a-time GEMV (quant_gemv.cpp) spends most of each 64-code chunk expanding that
// row's two fp16 scales into lanes and widening its codes to 16 bits: shuffles, which this CPU
// runs on one port. Measured, it ran compute-bound at about half the memory's speed. Here 16 rows
// are read together: each 512-bit load holds 4 rows' codes of one block (2 rows for Q8_0, Q4_K
// and Q5_K), one broadcast activation vector serves every row, and the 16 rows' scales are one
// vector load. Per 16 rows x 32 codes that is ~45 vector ops instead of ~120 (Q6_K, a scale per
// 16 codes: ~55). From 2 activation rows the codes are transposed once in registers to one
// dword of all 16 rows per vector (transpose_q8, transpose_lanes), so each row's sums come out
// of vpdpbusd in lanes with nothing left to reduce (~20 ops a row instead of ~45).
//
// Layout (QuantWeight.grouped in pagedq/worker/models/quant.py writes it): the rows of a group of
// 16 share each block position; block b of the group holds the format's fields one after
// another, each field for all 16 rows: [d x16][m x16][qh x16][qs x16] (the fields the format
// has, in GGUF's order; Q4_K: d, dmin, each of its 12 scale bytes and each 32-byte run of qs;
// Q5_K the same with its 32 bytes of qh after the scales; Q6_K: each 16-byte run of ql and qh,
// each of its 16 scale bytes, d). Scales are in row order; the code fields are in group_slot
// order, the order in which the reduction below leaves the rows' sums, so the sums come out in
// row order.
// The same bytes as the GGUF rows: the layout is a permutation of them.
//
// Precision: the activations are int16 per 32 values as in quant_gemv.cpp (scale amax / 32512),
// each split into two signed bytes, code = 256 hi + lo, so the unsigned-by-signed byte dot product
// (vpdpbusd) takes them: sum(w q) = 256 sum(w hi) + sum(w lo), exactly. Byte mode (quant_gemv's
// acts = 8, opt-in): the activations are int8 per 32 values (scale amax / 127, byte_acts.h's rule)
// and each product is one vpdpbusd: half the dot products and activation loads, at int8's
// rounding of the activations (~2^-8 of a block's largest value instead of ~2^-15).

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "byte_acts.h"
#include "quant_avx512.h"
#include "quant_formats.h"

PAGEDQ_AVX512_BEGIN
namespace pagedq_cpu {
namespace v512 {
namespace {

constexpr int kMaxActRows = 8;  // activation rows per pass over a group (accumulators in registers)
// Weights per chunk when the rows take several passes (all_rows): small enough that a chunk stays
// in L2 beside the passes' activations. Measured (AMD EPYC Zen 5, 2 threads, level avx512_vnni,
// against one pass over a thread's whole share each time), ms a pass over the 1.7B shape's
// matrices: Q8_0 107 -> 95 at 16 rows, 388 -> 328 at 64; Q4_K 99 -> 96, 375 -> 354; the bundled
// model's Q8_0 at 64 rows 27.1 -> 26.3 (64 KiB and 96 KiB level with 128, 256 KiB and up less).
constexpr int64_t kChunkBytes = 128 * 1024;
constexpr float kActMax = 32512.f;  // 127 * 256: the largest code whose high byte fits in int8

// The activation rows, per 32-value block: codes as two signed bytes (natural order), the block's
// scale da and da * (sum of its codes) (the offset term: m * sum(x)). Byte mode: int8 codes in lo
// (byte_acts.h's rounding), hi unused.
struct SplitActs {
  int64_t blocks = 0;
  std::vector<int8_t> hi, lo;  // [rows, blocks * 32]
  std::vector<float> da, sx;   // [rows, blocks]
  std::vector<int32_t> s32;    // [rows, blocks * 2]: 32 x each 16 codes' sum (Q6_K only, sub_sums)
};

void split_acts(const float* x, int64_t rows, int64_t K, SplitActs& a) {
  a.blocks = K / 32;
  a.hi.resize(rows * K);
  a.lo.resize(rows * K);
  a.da.resize(rows * a.blocks);
  a.sx.resize(rows * a.blocks);
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m512i half = _mm512_set1_epi32(128);
  for (int64_t i = 0; i < rows * a.blocks; ++i) {
    const float* xb = x + i * 32;
    const __m512 v[2] = {_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16)};
    const float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_and_ps(v[0], sign), _mm512_and_ps(v[1], sign)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? kActMax / amax : 0.f);
    __m512i sum = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const __m512i code = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], inv));  // |code| <= 32512
      const __m512i high = _mm512_srai_epi32(_mm512_add_epi32(code, half), 8);  // in [-127, 127]
      const __m512i low = _mm512_sub_epi32(code, _mm512_slli_epi32(high, 8));  // in [-128, 127]
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.hi.data() + i * 32 + 16 * h), _mm512_cvtepi32_epi8(high));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.lo.data() + i * 32 + 16 * h), _mm512_cvtepi32_epi8(low));
      sum = _mm512_add_epi32(sum, code);
    }
    a.da[i] = amax / kActMax;
    a.sx[i] = a.da[i] * static_cast<float>(_mm512_reduce_add_epi32(sum));
  }
}

// int8 codes (byte_acts.h) in SplitActs' lo, for the byte mode's kernels.
void byte_acts(const float* x, int64_t rows, int64_t K, SplitActs& a) {
  static thread_local ByteActs bytes;
  quantize_bytes(x, rows, K, bytes);
  a.blocks = bytes.blocks;
  a.lo.swap(bytes.q);
  a.da.swap(bytes.da);
  a.sx.swap(bytes.sx);
}

// 32 x the code sum of each 16 activations, for Q6_K: its codes are stored +32 with a scale per
// 16, so each 16-code sub-block's product needs that taken off (in integers, exactly).
void sub_sums(int64_t rows, bool bytes, SplitActs& a) {
  a.s32.resize(rows * a.blocks * 2);
  for (int64_t i = 0; i < rows * a.blocks * 2; ++i) {
    const __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.lo.data() + 16 * i)));
    __m512i code = lo;
    if (!bytes) {
      const __m512i hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.hi.data() + 16 * i)));
      code = _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo);
    }
    a.s32[i] = 32 * _mm512_reduce_add_epi32(code);
  }
}

inline __m512i l_unused() { return _mm512_setzero_si512(); }  // byte mode's hi operand

// 256 hi + lo dotted with the codes, per 32-bit lane: lane l sums its 4 bytes' products.
// Byte mode (B): lo holds the int8 codes, hi is not read.
template <bool B>
inline __m512i dot(__m512i codes, __m512i hi, __m512i lo) {
  if constexpr (B) return _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, lo);
  const __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, hi);
  return _mm512_dpbusd_epi32(_mm512_slli_epi32(h, 8), codes, lo);
}

inline __m512i add_pairs32(__m512i a, __m512i b) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
  return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
inline __m512i add_pairs64(__m512i a, __m512i b) {  // per 128-bit lane: [a01+a23 (as pairs), b...]
  return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}

// s[k]'s 128-bit lane j holds slot 4k + j's partial sums; lane 4j + k of the result its total.
inline __m512i reduce4(const __m512i s[4]) {
  return add_pairs64(add_pairs32(s[0], s[1]), add_pairs32(s[2], s[3]));
}

// s[k]'s 256-bit halves hold slots 2k and 2k + 1; result lane 4a + e: slot 8(a/2) + 2e + a%2.
inline __m512i reduce8(const __m512i s[8]) {
  const __m512i b0 = add_pairs64(add_pairs32(s[0], s[1]), add_pairs32(s[2], s[3]));
  const __m512i b1 = add_pairs64(add_pairs32(s[4], s[5]), add_pairs32(s[6], s[7]));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(b0, b1, 0x88), _mm512_shuffle_i32x4(b0, b1, 0xDD));
}

// One block of activation block i against 16 rows: acc += isum * scale * da, mins += offset *
// da * sum(codes) (the rows' integer sums isum, their scales and offsets in row order).
inline void accumulate(__m512& acc, __m512& mins, __m512i isum, __m512 scale, __m512 offset,
                       const SplitActs& a, int64_t i) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(scale, _mm512_set1_ps(a.da[i])), acc);
  mins = _mm512_fmadd_ps(offset, _mm512_set1_ps(a.sx[i]), mins);
}

// Runs body(group's first byte, acc, mins) over the groups [g0, g1) for the G activation rows
// from b0, the accumulators zeroed before, and stores each group's 16 outputs (plus the bias).
template <int G, class Body>
inline void each_group(const LinearArgs& p, int64_t b0, int64_t g0, int64_t g1, Body&& body) {
  for (int64_t grp = g0; grp < g1; ++grp) {
    __m512 acc[G], mins[G];
    for (int g = 0; g < G; ++g) acc[g] = mins[g] = _mm512_setzero_ps();
    body(p.w + grp * kGroupRows * p.row_bytes, acc, mins);
    const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + grp * kGroupRows) : _mm512_setzero_ps();
    for (int g = 0; g < G; ++g)
      _mm512_storeu_ps(p.out + (b0 + g) * p.ldo + grp * kGroupRows,
                       _mm512_add_ps(_mm512_add_ps(acc[g], mins[g]), bias));
  }
}

// The 16 rows' weight codes of one block as unsigned bytes, 4 rows per vector (nibble formats).
template <int64_t Fmt>
inline void nibble_codes(const uint8_t* at, __m512i lo[4], __m512i hi[4]) {
  using W = Nibble32<Fmt>;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int k = 0; k < 4; ++k) {
    const __m512i v = _mm512_loadu_si512(at + kGroupRows * W::kQs + 64 * k);
    lo[k] = _mm512_and_si512(v, low4);  // codes 0-15 of slots 4k..4k+3
    hi[k] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);  // codes 16-31
    if constexpr (W::kFive) {  // bit i of a slot's qh is its code i's fifth bit
      uint64_t u[2];
      std::memcpy(u, at + kGroupRows * W::kQh + 16 * k, 16);
      const uint64_t low_bits = 0x0000FFFF0000FFFFull, high_bits = ~low_bits;
      const __mmask64 mlo = _pext_u64(u[0], low_bits) | (_pext_u64(u[1], low_bits) << 32);
      const __mmask64 mhi = _pext_u64(u[0], high_bits) | (_pext_u64(u[1], high_bits) << 32);
      const __m512i sixteen = _mm512_set1_epi8(16);
      lo[k] = _mm512_mask_add_epi8(lo[k], mlo, lo[k], sixteen);
      hi[k] = _mm512_mask_add_epi8(hi[k], mhi, hi[k], sixteen);
    }
  }
}

// The 16 rows' codes of one Q8_0 block, 2 rows per vector (v[k]: slot 2k's 8 dwords of 4 codes,
// then slot 2k + 1's), transposed in registers to one dword of every row per vector: v[o] then
// holds codes 4 kQ8Dword[o] .. + 3 of the 16 rows, in row order (the slots' order is the one the
// transpose's unpack tree undoes, as reduce8's does). Three stages of 8 shuffles swap the dword
// index's bits with the vector index's.
constexpr int kQ8Dword[8] = {0, 2, 1, 3, 4, 6, 5, 7};
inline void transpose_q8(__m512i v[8]) {
  __m512i t[8];
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm512_unpacklo_epi32(v[k], v[k + 1]);
    t[k + 1] = _mm512_unpackhi_epi32(v[k], v[k + 1]);
  }
  for (int k : {0, 1, 4, 5}) {
    v[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);
    v[k + 2] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
  }
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_shuffle_i32x4(v[k], v[k + 4], 0x88);
    t[k + 4] = _mm512_shuffle_i32x4(v[k], v[k + 4], 0xDD);
  }
  for (int k = 0; k < 8; ++k) v[k] = t[k];
}

inline __m512i broadcast_dword(const int8_t* p) {
  int32_t x;
  std::memcpy(&x, p, 4);
  return _mm512_set1_epi32(x);
}

// The 16 rows' integer sums against N * 4 activation codes from offset at (a block: N = 8, at
// = 32 i; Q6_K's 16-code sub-block: N = 4), from codes transposed by transpose_q8 or
// transpose_lanes: each activation dword broadcast against the vector holding that dword of
// every row.
template <bool B, int N = 8>
inline __m512i dot_rows(const __m512i v[N], const SplitActs& a, int64_t at) {
  __m512i lo = _mm512_setzero_si512();
  for (int o = 0; o < N; ++o)
    lo = _mm512_dpbusd_epi32(lo, v[o], broadcast_dword(a.lo.data() + at + 4 * kQ8Dword[o]));
  if constexpr (B) return lo;
  __m512i hi = _mm512_setzero_si512();
  for (int o = 0; o < N; ++o)
    hi = _mm512_dpbusd_epi32(hi, v[o], broadcast_dword(a.hi.data() + at + 4 * kQ8Dword[o]));
  return _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 8));
}

// Four vectors of 4 rows' 16 codes each (a 128-bit lane a row, rows in the nibble formats'
// slot order) transposed in lanes to one dword of every row per vector, in row order, stored at
// out[0..3] in kQ8Dword's order (dwords 0, 2, 1, 3), so dot_rows takes them.
inline void transpose_lanes(const __m512i in[4], __m512i out[4]) {
  const __m512i t0 = _mm512_unpacklo_epi32(in[0], in[1]), t1 = _mm512_unpackhi_epi32(in[0], in[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(in[2], in[3]), t3 = _mm512_unpackhi_epi32(in[2], in[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpacklo_epi64(t1, t3);
  out[2] = _mm512_unpackhi_epi64(t0, t2);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}

// The G activation rows' sums of 32-block `blk` (of `blocks` a row) from codes transposed by
// transpose_q8 or transpose_lanes, scaled into their accumulators.
template <int G, bool B>
inline void transposed_rows(const __m512i v[8], const SplitActs& a, int64_t b0, int64_t blocks,
                            int64_t blk, __m512 scale, __m512 offset, __m512* acc, __m512* mins) {
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    const int64_t i = (b0 + g) * blocks + blk;
    accumulate(acc[g], mins[g], dot_rows<B>(v, a, 32 * i), scale, offset, a, i);
  }
}

// One activation row's sums of its block i against codes 2 rows a vector (Q8_0's slots),
// reduced across lanes (reduce8): the kernel for one row, where a transpose would not pay.
template <bool B>
inline void reduced_row(const __m512i v[8], const SplitActs& a, int64_t i, __m512 scale,
                        __m512 offset, __m512& acc, __m512& mins) {
  const __m512i h = B ? l_unused() : _mm512_broadcast_i64x4(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.hi.data() + i * 32)));
  const __m512i l = _mm512_broadcast_i64x4(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.lo.data() + i * 32)));
  __m512i s[8];
  for (int k = 0; k < 8; ++k) s[k] = dot<B>(v[k], h, l);
  accumulate(acc, mins, reduce8(s), scale, offset, a, i);
}

// G activation rows from b0 against the groups [g0, g1) of a nibble format; from 2 rows the
// codes are transposed once (transpose_lanes) and every row's sums come out of vpdpbusd in
// lanes, as in q8_groups.
template <int64_t Fmt, int G, bool B>
void nibble_groups(const LinearArgs& p, const SplitActs& a, int64_t b0, int64_t g0, int64_t g1) {
  using W = Nibble32<Fmt>;
  const int64_t blocks = p.K / 32;
  each_group<G>(p, b0, g0, g1, [&](const uint8_t* base, __m512* acc, __m512* mins) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const uint8_t* at = base + blk * kGroupRows * W::kBytes;
      prefetch_ahead(at, kGroupRows * W::kBytes, kAheadBytesFar);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
      __m512 m;
      if constexpr (W::kMin)
        m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 2 * kGroupRows)));
      else
        m = _mm512_mul_ps(d, _mm512_set1_ps(W::kFive ? -16.f : -8.f));
      __m512i lo[4], hi[4];
      nibble_codes<Fmt>(at, lo, hi);
      if constexpr (G >= 2) {
        __m512i v[8];
        transpose_lanes(lo, v);
        transpose_lanes(hi, v + 4);
        transposed_rows<G, B>(v, a, b0, blocks, blk, d, m, acc, mins);
      } else {
        const int64_t i = b0 * blocks + blk;
        const int8_t* xh = B ? nullptr : a.hi.data() + i * 32;
        const int8_t* xl = a.lo.data() + i * 32;
        const __m512i h0 = B ? l_unused() : _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xh)));
        const __m512i h1 = B ? l_unused() : _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xh + 16)));
        const __m512i l0 = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xl)));
        const __m512i l1 = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xl + 16)));
        __m512i s[4];
        for (int k = 0; k < 4; ++k)
          s[k] = _mm512_add_epi32(dot<B>(lo[k], h0, l0), dot<B>(hi[k], h1, l1));
        accumulate(acc[0], mins[0], reduce4(s), d, m, a, i);
      }
    }
  });
}

// The same for Q8_0 (codes stored +128 as unsigned bytes, 2 rows per vector). From 2 activation
// rows the block's codes are transposed once (transpose_q8) and each row's dword j broadcast
// against vector j, so vpdpbusd leaves every row's sum in its own lane and nothing is reduced:
// per row and block 16 vpdpbusd (8 in byte mode) and the scales, against reduce8's 21 shuffles
// and adds on top of them; the transpose's 24 shuffles are paid once for the pass's rows.
template <int G, bool B>
void q8_groups(const LinearArgs& p, const SplitActs& a, int64_t b0, int64_t g0, int64_t g1) {
  const int64_t blocks = p.K / 32;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  each_group<G>(p, b0, g0, g1, [&](const uint8_t* base, __m512* acc, __m512* mins) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const uint8_t* at = base + blk * kGroupRows * 34;
      // (one row of Q8_0 reads 6% faster 3 KB ahead: quant_formats.h)
      prefetch_ahead(at, kGroupRows * 34, G == 1 ? kAheadBytes : kAheadBytesFar);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
      const __m512 m = _mm512_mul_ps(d, _mm512_set1_ps(-128.f));
      __m512i v[8];
      for (int k = 0; k < 8; ++k)
        v[k] = _mm512_xor_si512(_mm512_loadu_si512(at + 2 * kGroupRows + 64 * k), flip);
      if constexpr (G >= 2) {
        transpose_q8(v);
        transposed_rows<G, B>(v, a, b0, blocks, blk, d, m, acc, mins);
      } else {
        reduced_row<B>(v, a, b0 * blocks + blk, d, m, acc[0], mins[0]);
      }
    }
  });
}

// Q4_K's (scale, min) pair of sub-block j for 16 rows, unpacked from its 12 bytes (one 16-row
// field per byte, row order; k_scales in quant_formats.h) into fp32 vectors: w = d sc code -
// dmin mn. One sub-block at a time, so the pass's 16 scale registers are not held across it.
inline void k_scale_vector(const uint8_t* at, int j, __m512 d, __m512 neg_dmin, __m512& sc,
                           __m512& mn) {
  const auto field = [at](int i) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 64 + 16 * i)));
  };
  const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15);
  __m512i sc_code, mn_code;
  if (j < 4) {
    sc_code = _mm512_and_si512(field(j), six);
    mn_code = _mm512_and_si512(field(j + 4), six);
  } else {
    const __m512i low = field(j + 4);
    sc_code = _mm512_or_si512(_mm512_and_si512(low, four),
                              _mm512_slli_epi32(_mm512_srli_epi32(field(j - 4), 6), 4));
    mn_code = _mm512_or_si512(_mm512_srli_epi32(low, 4),
                              _mm512_slli_epi32(_mm512_srli_epi32(field(j), 6), 4));
  }
  sc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc_code));
  mn = _mm512_mul_ps(neg_dmin, _mm512_cvtepi32_ps(mn_code));
}

// Run c's codes of sub-block 2c + half for 16 rows, 2 rows per vector (Q8_0's slots): the low
// (half 0) or high nibbles of q's 32-byte runs, plus Q5_K's fifth bits from qh.
template <bool Five>
inline void k_codes(const uint8_t* q, const uint8_t* qh, int c, int half, __m512i codes[8]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
  const __m512i bit = _mm512_set1_epi8(static_cast<char>((1 + half) << (2 * c)));
  for (int k = 0; k < 8; ++k) {
    const __m512i v = _mm512_loadu_si512(q + 64 * k);
    codes[k] = _mm512_and_si512(half ? _mm512_srli_epi16(v, 4) : v, low4);
    if constexpr (Five) {  // qh: 16 rows x 32 bytes after the scales, the same slots
      const __mmask64 set = _mm512_test_epi8_mask(_mm512_loadu_si512(qh + 64 * k), bit);
      codes[k] = _mm512_mask_add_epi8(codes[k], set, codes[k], sixteen);
    }
  }
}

// Q4_K / Q5_K: per super-block of 256, four 32-byte runs of nibbles (low: sub-block 2c, high:
// 2c + 1), each a field of 16 rows read 2 rows per vector as Q8_0's codes are; Q5_K's qh (bit j
// of byte t: sub-block j's code t's fifth bit) is one more such field, read beside each run.
template <int64_t Fmt, int G, bool B>
void kquant_groups(const LinearArgs& p, const SplitActs& a, int64_t b0, int64_t g0, int64_t g1) {
  constexpr bool five = Fmt == kQ5_K;
  constexpr int64_t bytes = five ? 176 : 144, qs_at = five ? 48 : 16;
  const int64_t supers = p.K / 256, blocks = p.K / 32;
  each_group<G>(p, b0, g0, g1, [&](const uint8_t* base, __m512* acc, __m512* mins) {
    for (int64_t sb = 0; sb < supers; ++sb) {
      const uint8_t* at = base + sb * kGroupRows * bytes;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
      const __m512 neg_dmin = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 2 * kGroupRows))));
      for (int c = 0; c < 4; ++c) {
        const uint8_t* q = at + kGroupRows * (qs_at + 32 * c);
        prefetch_ahead(q, 512, kAheadBytesFar);
        for (int half = 0; half < 2; ++half) {  // sub-block j = 2c + half: one half at a time
          const int j = 2 * c + half;
          __m512 sc, mn;
          k_scale_vector(at, j, d, neg_dmin, sc, mn);
          __m512i codes[8];
          k_codes<five>(q, at + kGroupRows * 16, c, half, codes);
          if constexpr (G >= 2) {  // as q8_groups: the codes transposed once for the G rows
            transpose_q8(codes);
            transposed_rows<G, B>(codes, a, b0, blocks, sb * 8 + j, sc, mn, acc, mins);
          } else {
            reduced_row<B>(codes, a, b0 * blocks + sb * 8 + j, sc, mn, acc[0], mins[0]);
          }
        }
      }
    }
  });
}

// v's bits shifted left by N (right by -N) within 16-bit lanes.
template <int N>
inline __m512i shift16(__m512i v) {
  if constexpr (N > 0) return _mm512_slli_epi16(v, N);
  else if constexpr (N < 0) return _mm512_srli_epi16(v, -N);
  else return v;
}

// Q6_K's quarter Q (codes 32 Q + 16 t .. + 16 of a 128-code half) of 16 rows against G
// activation rows: the 6-bit codes from ql's nibbles (low: quarters 0, 1; high: 2, 3) and qh's
// bit pair Q, 4 rows per vector as the nibble formats' codes are; each 16-code sub-block s has
// a scale of its own, so its sums are reduced and scaled alone, less 32 x the activations' sum.
template <int Q, int G, bool B>
inline void q6k_quarter(const __m512i ql[4], const __m512i qh[4], const uint8_t* at, __m512 d,
                        int s, const SplitActs& a, int64_t b0, int64_t sb, __m512* acc) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30);
  __m512i codes[4];
  for (int k = 0; k < 4; ++k)
    codes[k] = _mm512_or_si512(_mm512_and_si512(Q >= 2 ? _mm512_srli_epi16(ql[k], 4) : ql[k], low4),
                               _mm512_and_si512(shift16<4 - 2 * Q>(qh[k]), two));
  const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + kGroupRows * (192 + s))))));
  const int64_t blocks = a.blocks;
  if constexpr (G >= 2) {  // transposed once for the G rows, as nibble_groups does
    __m512i v[4];
    transpose_lanes(codes, v);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const int64_t i = (b0 + g) * blocks + sb * 8 + s / 2;
      const __m512i sums = dot_rows<B, 4>(v, a, i * 32 + 16 * (s % 2));
      const __m512i isum = _mm512_sub_epi32(sums, _mm512_set1_epi32(a.s32[(b0 + g) * blocks * 2 + sb * 16 + s]));
      acc[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(scale, _mm512_set1_ps(a.da[i])), acc[g]);
    }
    return;
  }
  // Unrolled, the G rows' accumulators stay in registers (measured: 1.1-1.25x at 16-64 rows;
  // the other kernels' wider code sets leave no room for it).
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    const int64_t i = (b0 + g) * blocks + sb * 8 + s / 2;  // the activation block
    const int64_t at_x = i * 32 + 16 * (s % 2);
    const __m512i h = B ? l_unused() : _mm512_broadcast_i32x4(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.hi.data() + at_x)));
    const __m512i l = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.lo.data() + at_x)));
    __m512i sums[4];
    for (int k = 0; k < 4; ++k) sums[k] = dot<B>(codes[k], h, l);
    const __m512i isum = _mm512_sub_epi32(reduce4(sums),
                                          _mm512_set1_epi32(a.s32[(b0 + g) * blocks * 2 + sb * 16 + s]));
    acc[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(scale, _mm512_set1_ps(a.da[i])), acc[g]);
  }
}

// Q6_K: per super-block of 256 (16 rows: 3360 bytes), each 16-byte run of qh serves four
// sub-blocks and each of ql two; both are fields of 16 rows read 4 rows per vector.
template <int G, bool B>
void q6k_groups(const LinearArgs& p, const SplitActs& a, int64_t b0, int64_t g0, int64_t g1) {
  const int64_t supers = p.K / 256;
  each_group<G>(p, b0, g0, g1, [&](const uint8_t* base, __m512* acc, __m512*) {
    for (int64_t sb = 0; sb < supers; ++sb) {
      const uint8_t* at = base + sb * kGroupRows * 210;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + kGroupRows * 208)));
      for (int half = 0; half < 2; ++half) {
        for (int t = 0; t < 2; ++t) {  // codes 16 t .. 16 t + 15 of each quarter of the half
          // a quarter of the super-block's bytes with each quarter of its work; 6 KB ahead
          // measured 1.15x the whole super-block at once 4 KB ahead into L1, 3 KB 1.08x
          prefetch_ahead(at + (2 * half + t) * kGroupRows * 210 / 4, kGroupRows * 210 / 4, 6144);
          __m512i qh[4], ql[4];
          for (int k = 0; k < 4; ++k)
            qh[k] = _mm512_loadu_si512(at + kGroupRows * (128 + 32 * half + 16 * t) + 64 * k);
          const int s = 8 * half + t;  // sub-block of quarter 0
          for (int k = 0; k < 4; ++k)
            ql[k] = _mm512_loadu_si512(at + kGroupRows * (64 * half + 16 * t) + 64 * k);
          q6k_quarter<0, G, B>(ql, qh, at, d, s, a, b0, sb, acc);
          q6k_quarter<2, G, B>(ql, qh, at, d, s + 4, a, b0, sb, acc);
          for (int k = 0; k < 4; ++k)
            ql[k] = _mm512_loadu_si512(at + kGroupRows * (64 * half + 32 + 16 * t) + 64 * k);
          q6k_quarter<1, G, B>(ql, qh, at, d, s + 2, a, b0, sb, acc);
          q6k_quarter<3, G, B>(ql, qh, at, d, s + 6, a, b0, sb, acc);
        }
      }
    }
  });
}

template <int G, bool B>
void groups(const LinearArgs& p, const SplitActs& a, int64_t b0, int64_t g0, int64_t g1) {
  switch (p.fmt) {
    case kQ4_0: nibble_groups<kQ4_0, G, B>(p, a, b0, g0, g1); break;
    case kQ4_1: nibble_groups<kQ4_1, G, B>(p, a, b0, g0, g1); break;
    case kQ5_0: nibble_groups<kQ5_0, G, B>(p, a, b0, g0, g1); break;
    case kQ5_1: nibble_groups<kQ5_1, G, B>(p, a, b0, g0, g1); break;
    case kQ4_K: kquant_groups<kQ4_K, G, B>(p, a, b0, g0, g1); break;
    case kQ5_K: kquant_groups<kQ5_K, G, B>(p, a, b0, g0, g1); break;
    case kQ6_K: q6k_groups<G, B>(p, a, b0, g0, g1); break;
    default: q8_groups<G, B>(p, a, b0, g0, g1); break;
  }
}

// Every activation row against the groups [g0, g1), kMaxActRows rows per pass, the groups taken
// a chunk of ~kChunkBytes of weights at a time: each pass after the first reads the chunk from
// L2 instead of the thread's whole share of the matrix from L3 or memory.
template <bool B>
void all_rows(const LinearArgs& p, const SplitActs& a, int64_t g0, int64_t g1) {
  const int64_t chunk = p.rows <= kMaxActRows ? g1 - g0 :
      std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, kGroupRows * p.row_bytes));
  for (int64_t c0 = g0; c0 < g1; c0 += chunk) {
    const int64_t c1 = std::min(g1, c0 + chunk);
    for (int64_t b = 0; b < p.rows; b += kMaxActRows) {
      switch (std::min<int64_t>(kMaxActRows, p.rows - b)) {
        case 1: groups<1, B>(p, a, b, c0, c1); break;
        case 2: groups<2, B>(p, a, b, c0, c1); break;
        case 3: groups<3, B>(p, a, b, c0, c1); break;
        case 4: groups<4, B>(p, a, b, c0, c1); break;
        case 5: groups<5, B>(p, a, b, c0, c1); break;
        case 6: groups<6, B>(p, a, b, c0, c1); break;
        case 7: groups<7, B>(p, a, b, c0, c1); break;
        default: groups<8, B>(p, a, b, c0, c1); break;
      }
    }
  }
}

}  // namespace

void group_gemv(const LinearArgs& p, bool bytes) { group_gemv_parts(&p, 1, bytes); }

// Why one call for several weights: a fused projection's segments (q, k and v; gate and up) read
// the same activations. Split once and run all their groups in one parallel region: at one row
// a decode step's GEMVs are short enough that each region's fork and join barrier is a visible
// share of them, and q/k/v as three regions were three of those and three activation splits.
void group_gemv_parts(const LinearArgs* parts, int64_t count, bool bytes) {
  const LinearArgs& first = parts[0];
  static thread_local SplitActs acts;
  if (bytes)
    byte_acts(first.x, first.rows, first.K, acts);
  else
    split_acts(first.x, first.rows, first.K, acts);
  bool six = false;
  for (int64_t i = 0; i < count; ++i) six = six || parts[i].fmt == kQ6_K;
  if (six) sub_sums(first.rows, bytes, acts);
  const SplitActs& a = acts;
  parallel_parts(parts, count, kGroupRows, [&](int64_t i, int64_t g0, int64_t g1) {
    if (bytes)
      all_rows<true>(parts[i], a, g0, g1);
    else
      all_rows<false>(parts[i], a, g0, g1);
  });
}

}  // namespace v512
}  // namespace pagedq_cpu
PAGEDQ_AVX512_END
