// Activations rounded to int8 per 32 values, the input of the int8-activation GEMVs (quant_gemv's
// acts = 8): byte_gemv.cpp on AVX2, group_gemv.cpp's byte mode on AVX-512 VNNI.
//
// Each block of 32 values x gets the step da = max|x| / 127 and the codes q = round(x / da) in
// [-127, 127] (nearest even, as cvtps rounds), natural order; sx = da * sum(q) is what a block's
// weight offset m multiplies (sum over the block of m x ~ m sx). Computed once per call for
// all the call's weight rows: one pass over x, vectorized (AVX2).

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "quant_avx2.h"
#include "quant_formats.h"

namespace pagedq_cpu {

struct ByteActs {
  int64_t rows = 0, blocks = 0;  // blocks of 32 per row
  std::vector<int8_t> q;         // [rows * blocks, 32]
  std::vector<float> da, sx;     // [rows * blocks]
  std::vector<float> dat, sxt;   // da and sx transposed, [blocks, tstride] (quantize_bytes_transposed)
  // Q6_K's offsets (a scale per 16 values): da * sum(q) over each block's first and second 16,
  // [rows * blocks], and transposed as dat; filled only when quantize_bytes is asked for halves
  std::vector<float> s0, s1, s0t, s1t;
  int64_t tstride = 0;
  const int8_t* block(int64_t i) const { return q.data() + i * 32; }  // i = row * blocks + block
};

inline void quantize_bytes(const float* x, int64_t rows, int64_t K, ByteActs& a, bool halves = false) {
  a.rows = rows;
  a.blocks = K / 32;
  a.q.resize(rows * K);
  a.da.resize(rows * a.blocks);
  a.sx.resize(rows * a.blocks);
  if (halves) {
    a.s0.resize(rows * a.blocks);
    a.s1.resize(rows * a.blocks);
  }
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  // packs interleaves 128-bit lanes: dword j of the packed bytes holds values 4 order[j]..
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < rows * a.blocks; ++i) {
    const float* xb = x + i * 32;
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], sign));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const __m256 inv = _mm256_set1_ps(m > 0.f ? 127.f / m : 0.f);
    __m256i c[4], total = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
      total = _mm256_add_epi32(total, c[j]);
    }
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + i * 32),
                        _mm256_permutevar8x32_epi32(bytes, order));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    a.da[i] = m / 127.f;
    a.sx[i] = a.da[i] * static_cast<float>(_mm_cvtsi128_si32(s));
    if (halves) {
      a.s0[i] = a.da[i] * static_cast<float>(v256::hsum_epi32(_mm256_add_epi32(c[0], c[1])));
      a.s1[i] = a.da[i] * static_cast<float>(v256::hsum_epi32(_mm256_add_epi32(c[2], c[3])));
    }
  }
}

namespace v256 {
// quantize_bytes for the AVX2 kernels (byte_gemv.cpp, byte_panel.cpp), which read each block's
// da and sx (with halves, Q6_K's s0 and s1) for consecutive rows in one load: transposed into
// dat, sxt (s0t, s1t), a.tstride apart.
inline void quantize_bytes_transposed(const float* x, int64_t rows, int64_t K, ByteActs& a, bool halves) {
  quantize_bytes(x, rows, K, a, halves);
  a.tstride = transpose_steps(a.da.data(), rows, a.blocks, a.dat);
  transpose_steps(a.sx.data(), rows, a.blocks, a.sxt);
  if (halves) {
    transpose_steps(a.s0.data(), rows, a.blocks, a.s0t);
    transpose_steps(a.s1.data(), rows, a.blocks, a.s1t);
  }
}

// Activation rows r0 .. a.rows - 1 (1-3 of them; a quantized, da and sx not transposed) against
// weight row n with byte_gemv's row-at-a-time kernel: byte_panel.cpp's rows past its groups.
void byte_tail(const LinearArgs& p, const ByteActs& a, int64_t r0, int64_t n);
}  // namespace v256

}  // namespace pagedq_cpu
