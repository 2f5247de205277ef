// The one-to-three-row GEMV (few_rows.inc) of Q5_0 and Q5_1 compiled for AVX-512BW/VL, for the
// `avx512` level (AVX-512 without VNNI: Skylake-SP/X, or any AVX-512 CPU capped there). VNNI
// CPUs run the grouped GEMV instead (group_gemv.cpp); AVX2 ones quant_gemv.cpp's build.
//
// Why: one stream's decode reads each weight once, and below VNNI the Q5_0/Q5_1 row kernel is
// bound by its decode: the 32 fifth bits of a block were spread to bytes with a broadcast, a
// shuffle, an OR and a compare, then merged (quant_avx2.h, 12 operations a block). AVX-512BW
// takes the 32 bits as a mask register (one kmov) and merges them in one masked move: 7
// operations. Q5_0 is most of a Q4_K_M file whose rows do not divide into K-quant super-blocks
// (SmolLM2-135M's 576-wide matrices).
//
// The headers are included before the target pragma, so their inline functions keep the
// library's AVX2 target (a copy compiled for AVX-512 could be the one the linker keeps); this
// file's own functions, in an anonymous namespace, take AVX-512BW/VL. VNNI is left out of the
// target: gcc would fuse vpmaddwd + vpaddd into vpdpwssd, which these CPUs lack.

#include <immintrin.h>

#include <cstdint>
#include <cstring>
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

template <class W>
void rows_of(const LinearArgs& p, const Acts& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    if (a.rows == 1)
      few_rows<W, 1>(p, a, 0, n);
    else if (a.rows == 2)
      few_rows<W, 2>(p, a, 0, n);
    else
      few_rows<W, 3>(p, a, 0, n);
  }
}

}  // namespace

bool few_rows_gemv(const LinearArgs& p, const Acts& a, int64_t n0, int64_t n1) {
  if (a.rows < 1 || a.rows > 3) return false;
  if (p.fmt == kQ5_0)
    rows_of<FifthBitsMask<kQ5_0>>(p, a, n0, n1);
  else if (p.fmt == kQ5_1)
    rows_of<FifthBitsMask<kQ5_1>>(p, a, n0, n1);
  else
    return false;
  return true;
}

}  // namespace pagedq_cpu::v256bw

#pragma GCC pop_options
