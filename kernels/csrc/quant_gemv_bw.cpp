// The few-row GEMV of the avx512 level (AVX-512 without VNNI: Skylake-SP/X, or any AVX-512 CPU
// capped there), compiled for AVX-512BW/VL: Q5_0 and Q5_1 (1-3 rows) through few_rows.inc with
// their fifth bits in mask registers, Q4_K, Q5_K and Q6_K (1-7 rows) in 512-bit vectors (below). VNNI CPUs run
// the grouped GEMV instead (group_gemv.cpp); AVX2 ones quant_gemv.cpp's build.
//
// Why: one stream's decode reads each weight once, and below VNNI these row kernels are bound
// by their vector operations, not by the weights' bandwidth. Q5_0/Q5_1: the 32 fifth bits of a
// block were spread to bytes with a broadcast, a shuffle, an OR and a compare, then merged
// (quant_avx2.h, 12 operations a block); AVX-512BW takes the 32 bits as a mask register (one
// kmov) and merges them in one masked move: 7 operations. Q5_0 is most of a Q4_K_M file whose
// rows do not divide into K-quant super-blocks (SmolLM2-135M's 576-wide matrices); Q4_K and Q6_K
// are the rest of a Q4_K_M file whose rows do (1-8B models: SmolLM2-1.7B's shape, 764 + 289 of
// its 1053 MB).
//
// The headers are included before the target pragma, so their inline functions keep the
// library's AVX2 target (a copy compiled for AVX-512 could be the one the linker keeps); this
// file's own functions, in an anonymous namespace, take AVX-512BW/VL. VNNI is left out of the
// target: gcc would fuse vpmaddwd + vpaddd into vpdpwssd, which these CPUs lack.

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>
#include <type_traits>

#include "cpu_ops.h"
#include "int16_acts.h"
#include "quant_avx2.h"
#include "quant_formats.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2,avx512f,avx512bw,avx512vl,avx512dq")

namespace pagedq_cpu::v256bw {
namespace {

using namespace v256;  // the walkers and the activations' layout (quant_avx2.h, int16_acts.h)

// Q5_0 / Q5_1 as quant_avx2.h's Nibble32 (the same codes, in the same order), the fifth bits
// merged through a mask register: bit t of the block's 32 is byte t's (natural order, as the
// nibbles come out of the broadcast and the shift).
template <int64_t Fmt>
struct FifthBitsMask : Nibble32<Fmt> {
  using Base = Nibble32<Fmt>;
  static_assert(Base::kFive, "Q5_0 and Q5_1 only");

  static inline void codes(const uint8_t* blk, __m256i& e, __m256i& o) {
    constexpr int64_t qh = Base::kHasMin ? 4 : 2;  // after d (and m); the nibbles after qh
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + qh + 4));
    const __m256i u = _mm256_srlv_epi32(_mm256_broadcastsi128_si256(qs),
                                        _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    uint32_t bits;
    std::memcpy(&bits, blk + qh, 4);
    const __mmask32 fifth = _cvtu32_mask32(bits);
    const __m256i nibble = _mm256_and_si256(u, _mm256_set1_epi8(0x0F));
    if constexpr (Base::kHasMin)  // Q5_1: nibble | 16 bit
      split_unsigned(_mm256_mask_add_epi8(nibble, fifth, nibble, _mm256_set1_epi8(16)), e, o);
    else  // Q5_0's code - 16 as a signed byte: nibble | (bit ? 0 : 0xF0)
      split_signed(_mm256_mask_mov_epi8(
          _mm256_or_si256(nibble, _mm256_set1_epi8(static_cast<char>(0xF0))), fifth, nibble), e, o);
  }
};

#include "few_rows.inc"

// ---- the K-quants in 512-bit vectors ------------------------------------------------------------
//
// Why: one stream of a Q4_K_M model is mostly Q4_K rows (SmolLM2-1.7B's shape: 764 of its 1053
// MB), and the AVX2 row kernel is bound by its vector operations, not the weights' bandwidth
// (~87 a super-block: 16 vpmaddwd, 20 for the nibbles, six vphaddd of three uops). A 512-bit
// load holds two 32-byte runs of codes, four 32-blocks: one shift and four ANDs give their
// parity halves, and each vpmaddwd meets two blocks' activations at once, so the nibbles and the
// products take half the instructions; the eight blocks' totals come out of four vectors by
// unpacks and adds (no vphaddd in 512 bits), and the scales apply as in few_rows. Q6_K alike:
// its low bits of blocks [0 | 1] in one load, [2 | 3] shifted down a nibble, each half's two high
// bits moved by a per-half shift (vpsllvw / vpsrlvw). Measured (AMD EPYC Zen 5 capped at avx512,
// 2 threads, `quant_kernels --shapes memory`, ms a pass, AVX2 kernel -> these): Q4_K 1 row
// 22.5-23.3 -> 20.5-22.5, 2 rows 35.1-35.3 -> 27.5-28.3, 3 rows 48.4-49.8 -> 35.3-35.7; Q6_K 1
// row 31.5-32.2 -> 24.3-28.3, 2 rows 45.7-45.9 -> 31.9-33.1, 3 rows 61.4-62.0 -> 41.4-41.5
// (one row of Q4_K is near this VM's bandwidth either way: 43-47 GB/s).

// The activations in a 512-bit kernel's order: per four 32-blocks, the parity halves of the two
// blocks each 512-bit load of codes holds, in the order the loads come: Q4_K's 64 bytes hold
// blocks 2i (low nibbles) and 2i + 1 (high) of two 32-byte runs, so e0 e2 o0 o2 e1 e3 o1 o3;
// Q6_K's 64 bytes of low bits blocks 0 and 1 (low nibbles) and 2 and 3 (high), so e0 e1 o0 o1
// e2 e3 o2 o3 (16 int16 each).
using BlockOrder = int[8][2];  // (block of the four, parity half) of each 16-code chunk
constexpr BlockOrder kQ4KOrder = {{0, 0}, {2, 0}, {0, 1}, {2, 1}, {1, 0}, {3, 0}, {1, 1}, {3, 1}};
constexpr BlockOrder kQ6KOrder = {{0, 0}, {1, 0}, {0, 1}, {1, 1}, {2, 0}, {3, 0}, {2, 1}, {3, 1}};

void pair_blocks(const Acts& a, int64_t K, const BlockOrder& order, std::vector<int16_t>& out) {
  out.resize(a.rows * K);
  for (int64_t r = 0; r < a.rows; ++r)
    for (int64_t b4 = 0; b4 < K / 128; ++b4)
      for (int c = 0; c < 8; ++c)
        std::memcpy(out.data() + r * K + b4 * 128 + c * 16,
                    a.qrow(r) + (b4 * 4 + order[c][0]) * kActBlock + order[c][1] * 16, 32);
}

// Two vectors of two blocks' codes each ([a | b] and [c | d], parity halves e, o) met by G
// activation rows (q: row 0's 128 activations in pair_blocks' order, rows K apart): t[g][i] the
// first pair's int32 sums, t[g][i + 1] the second's.
template <int G>
inline void products512(const int16_t* q, int64_t K, __m512i e0, __m512i o0, __m512i e1, __m512i o1,
                        __m512i (*t)[4], int i) {
  for (int g = 0; g < G; ++g) {
    const auto at = [&](int c) { return _mm512_loadu_si512(q + g * K + 32 * c); };
    t[g][i] = _mm512_add_epi32(_mm512_madd_epi16(e0, at(0)), _mm512_madd_epi16(o0, at(1)));
    t[g][i + 1] = _mm512_add_epi32(_mm512_madd_epi16(e1, at(2)), _mm512_madd_epi16(o1, at(3)));
  }
}

// Lane j: block j's integer total, from t[0] = blocks [0 | 2], t[1] = [1 | 3], t[2] = [4 | 6],
// t[3] = [5 | 7] (eight lanes of each block's sums a 256-bit half).
inline __m256i totals512(const __m512i* t) {
  const __m512i x = _mm512_add_epi32(_mm512_unpacklo_epi32(t[0], t[1]), _mm512_unpackhi_epi32(t[0], t[1]));
  const __m512i y = _mm512_add_epi32(_mm512_unpacklo_epi32(t[2], t[3]), _mm512_unpackhi_epi32(t[2], t[3]));
  // per 128-bit lane [a, b, c, d]: lanes 0 and 1 blocks 0, 1, 4, 5 (two parts each), 2 and 3 blocks 2, 3, 6, 7
  const __m512i w = _mm512_add_epi32(_mm512_unpacklo_epi64(x, y), _mm512_unpackhi_epi64(x, y));
  const __m512i lanes = _mm512_shuffle_i64x2(w, w, _MM_SHUFFLE(3, 1, 2, 0));  // lanes 0, 2, 1, 3
  const __m256i sum = _mm256_add_epi32(_mm512_castsi512_si256(lanes), _mm512_extracti64x4_epi64(lanes, 1));
  return _mm256_permutevar8x32_epi32(sum, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
}

// Super-block half h (blocks 4h .. 4h + 3) of a Q4_K or Q5_K row as int16 codes: e02 / o02 the
// parity halves of blocks [4h | 4h + 2] (the low nibbles of two 32-byte runs), e13 / o13 of
// [4h + 1 | 4h + 3] (the high ones). Q4_K's high nibbles stay in place, 16 x the code, as in
// quant_avx2.h's KQuant45 (its scale_vectors takes the 16 back); Q5_K's fifth bits come from
// qh, bit j of byte t for element t of block j, each half shifted by its own block's j.
template <int64_t Fmt>
inline void k45_codes512(const uint8_t* blk, int h, __m512i& e02, __m512i& o02, __m512i& e13,
                         __m512i& o13) {
  if constexpr (Fmt == kQ4_K) {
    const __m512i low = _mm512_set1_epi16(0x000F), high = _mm512_set1_epi16(0x00F0);
    const __m512i bytes = _mm512_loadu_si512(blk + 16 + 64 * h);
    const __m512i shifted = _mm512_srli_epi16(bytes, 8);
    e02 = _mm512_and_si512(bytes, low), o02 = _mm512_and_si512(shifted, low);
    e13 = _mm512_and_si512(bytes, high), o13 = _mm512_and_si512(shifted, high);
  } else {
    const __m512i bytes = _mm512_loadu_si512(blk + 48 + 64 * h);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)));
    const auto fifth = [&](int j0, int j1) {  // bit j0 (low half) / j1 (high half) of each byte, to bit 4
      const __m512i by = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(j0)),
                                            _mm256_set1_epi16(static_cast<int16_t>(j1)), 1);
      return _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, by), _mm512_set1_epi8(1)), 4);
    };
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i c02 = _mm512_or_si512(_mm512_and_si512(bytes, nibble), fifth(4 * h, 4 * h + 2));
    const __m512i c13 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble),
                                        fifth(4 * h + 1, 4 * h + 3));
    const __m512i byte = _mm512_set1_epi16(0x00FF);
    e02 = _mm512_and_si512(c02, byte), o02 = _mm512_srli_epi16(c02, 8);
    e13 = _mm512_and_si512(c13, byte), o13 = _mm512_srli_epi16(c13, 8);
  }
}

// Activation rows r0 .. r0 + G - 1 (x: activations in pair_blocks' order) against Q4_K or Q5_K
// row n: the integer sums, scales and float operations of few_rows<KQuant45<Fmt>, G>, so its
// result bit for bit.
template <int64_t Fmt, int G>
void k45_rows512(const LinearArgs& p, const Acts& a, const int16_t* x, int64_t r0, int64_t n) {
  using W = KQuant45<Fmt>;
  const uint8_t* row = p.w + n * p.row_bytes;
  const int64_t span = span_bytes(p);
  __m256 acc[G], mins[G];
  for (int g = 0; g < G; ++g) acc[g] = mins[g] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < p.K / 256; ++sb) {
    const uint8_t* blk = row + sb * W::kBytes;
    if (r0 == 0) prefetch_ahead(blk, span, kAheadBytesFar);  // the first piece fetches for all
    __m512i t[G][4];
    for (int h = 0; h < 2; ++h) {
      __m512i e02, o02, e13, o13;
      k45_codes512<Fmt>(blk, h, e02, o02, e13, o13);
      products512<G>(x + r0 * p.K + sb * 256 + h * 128, p.K, e02, o02, e13, o13, t, 2 * h);
    }
    __m256 s, m;
    W::scale_vectors(blk, s, m);
    for (int g = 0; g < G; ++g) {
      acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals512(t[g])),
                               _mm256_mul_ps(s, _mm256_loadu_ps(a.darow(r0 + g) + sb * 8)), acc[g]);
      mins[g] = _mm256_fmadd_ps(m, _mm256_loadu_ps(a.abrow(r0 + g) + sb * 8), mins[g]);
    }
  }
  for (int g = 0; g < G; ++g)
    p.out[(r0 + g) * p.ldo + n] = hsum(_mm256_add_ps(acc[g], mins[g])) + (p.bias ? p.bias[n] : 0.f);
}

// Q6_K's two 32-blocks of one 512-bit vector as int16 codes minus 32: ql holds the low nibbles
// of blocks [a | b] (shift 0) or, shifted down 4, of the next two; qh both blocks' bytes of high
// bits, each half taken from its own bit pair (left by up[i], then masked to bits 4-5).
inline void q6k_codes512(__m512i ql, __m512i qh, __m512i up, bool right, __m512i& e, __m512i& o) {
  const __m512i lo4 = _mm512_and_si512(ql, _mm512_set1_epi8(0x0F));
  const __m512i moved = right ? _mm512_srlv_epi16(qh, up) : _mm512_sllv_epi16(qh, up);
  const __m512i c = _mm512_or_si512(lo4, _mm512_and_si512(moved, _mm512_set1_epi8(0x30)));
  e = _mm512_sub_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0x00FF)), _mm512_set1_epi16(32));
  o = _mm512_sub_epi16(_mm512_srli_epi16(c, 8), _mm512_set1_epi16(32));
}

// Blocks [4h + 0 | 4h + 1] (t[2h]) and [4h + 2 | 4h + 3] (t[2h + 1]) -> few_rows' u0 (h = 0) and
// u1 (h = 1): [the four blocks' first-half totals | their second-half totals].
inline __m256i halves512(__m512i ab, __m512i cd) {
  // per 128-bit lane [a0 + a2, c0 + c2, a1 + a3, c1 + c3], then each pair's two halves added:
  // lanes 0..3 hold (block 0, 2) first halves, (0, 2) second, (1, 3) first, (1, 3) second
  const __m512i x = _mm512_add_epi32(_mm512_unpacklo_epi32(ab, cd), _mm512_unpackhi_epi32(ab, cd));
  const __m512i w = _mm512_add_epi32(x, _mm512_shuffle_epi32(x, _MM_PERM_BADC));
  return _mm512_castsi512_si256(_mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 8, 1, 9, 4, 12, 5, 13, 0, 0, 0, 0, 0, 0, 0, 0), w));
}

// Activation rows r0 .. r0 + G - 1 (x in pair_blocks' Q6_K order) against Q6_K row n: the sums,
// scales and float operations of few_rows<Q6_K, G>, so its result bit for bit.
template <int G>
void q6k_rows512(const LinearArgs& p, const Acts& a, const int16_t* x, int64_t r0, int64_t n) {
  const uint8_t* row = p.w + n * p.row_bytes;
  const int64_t span = span_bytes(p);
  // quarters 0 | 1: bits 0-1 | 2-3 left to 4-5; quarters 2 | 3: bits 4-5 | 6-7 right by 0 | 2
  const __m256i four = _mm256_set1_epi16(4), two = _mm256_set1_epi16(2);
  const __m512i up01 = _mm512_inserti64x4(_mm512_castsi256_si512(four), two, 1);
  const __m512i down23 = _mm512_inserti64x4(_mm512_setzero_si512(), two, 1);
  __m256 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < p.K / 256; ++sb) {
    const uint8_t* blk = row + sb * Q6_K::kBytes;
    if (r0 == 0) prefetch_ahead(blk, span, kAheadBytesFar);  // the first piece fetches for all
    __m512i t[G][4];
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
      __m512i e01, o01, e23, o23;
      q6k_codes512(ql, qh, up01, false, e01, o01);
      q6k_codes512(_mm512_srli_epi16(ql, 4), qh, down23, true, e23, o23);
      products512<G>(x + r0 * p.K + sb * 256 + h * 128, p.K, e01, o01, e23, o23, t, 2 * h);
    }
    __m256 s, u;
    Q6_K::scale_vectors(blk, s, u);
    for (int g = 0; g < G; ++g) {
      const float* da = a.darow(r0 + g) + sb * 8;
      const __m256 lo = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(da));
      const __m256 hi = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(da + 4));
      acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(halves512(t[g][0], t[g][1])), _mm256_mul_ps(s, lo), acc[g]);
      acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(halves512(t[g][2], t[g][3])), _mm256_mul_ps(u, hi), acc[g]);
    }
  }
  for (int g = 0; g < G; ++g)
    p.out[(r0 + g) * p.ldo + n] = hsum(acc[g]) + (p.bias ? p.bias[n] : 0.f);
}

// G activation rows from r0 against weight row n: the format's 512-bit kernel.
template <int64_t Fmt, int G>
inline void kquant_rows512(const LinearArgs& p, const Acts& a, const int16_t* x, int64_t r0, int64_t n) {
  if constexpr (Fmt == kQ6_K)
    q6k_rows512<G>(p, a, x, r0, n);
  else
    k45_rows512<Fmt, G>(p, a, x, r0, n);
}

// Q4_K, Q5_K or Q6_K rows [n0, n1) against 1-7 activation rows in 512-bit vectors: 4-7 rows as
// pieces of 2-3 (for_row_pieces, as quant_gemv.cpp's k_pieces), each weight row still in L1 for
// the next piece. Why pieces, not the AVX2 wide groups (4-7 rows) or panel (Q6_K from 5): on
// SmolLM2-1.7B's shapes (Zen 5 capped at avx512, 2 threads) a 3-row piece took 36 (Q4_K) and 41
// (Q6_K) ms a pass where 4 rows in the wide groups took 90 and 154 and Q6_K's panel 124-130 at
// 5-7 rows.
template <int64_t Fmt>
void kquant_gemv512(const LinearArgs& p, const Acts& a, int64_t n0, int64_t n1) {
  static thread_local std::vector<int16_t> paired;
  pair_blocks(a, p.K, Fmt == kQ6_K ? kQ6KOrder : kQ4KOrder, paired);
  const int16_t* x = paired.data();
  for (int64_t n = n0; n < n1; ++n)
    for_row_pieces(a.rows, [&](int64_t r, auto piece) {
      kquant_rows512<Fmt, decltype(piece)::value>(p, a, x, r, n);
    });
}

template <class W>
void rows_of(const LinearArgs& p, const Acts& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for_row_pieces(a.rows, [&](int64_t r, auto piece) { few_rows<W, decltype(piece)::value>(p, a, r, n); });
}

}  // namespace

bool few_rows_gemv(const LinearArgs& p, const Acts& a, int64_t n0, int64_t n1) {
  if (a.rows < 1 || a.rows > 7) return false;
  if (p.fmt == kQ4_K)
    kquant_gemv512<kQ4_K>(p, a, n0, n1);
  else if (p.fmt == kQ5_K)
    kquant_gemv512<kQ5_K>(p, a, n0, n1);
  else if (p.fmt == kQ6_K)
    kquant_gemv512<kQ6_K>(p, a, n0, n1);
  else if (a.rows > 3)
    return false;
  else if (p.fmt == kQ5_0)
    rows_of<FifthBitsMask<kQ5_0>>(p, a, n0, n1);
  else if (p.fmt == kQ5_1)
    rows_of<FifthBitsMask<kQ5_1>>(p, a, n0, n1);
  else
    return false;
  return true;
}

}  // namespace pagedq_cpu::v256bw

#pragma GCC pop_options
