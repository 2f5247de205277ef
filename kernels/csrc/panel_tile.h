// What the panels share (panel_kernel.inc: the int16 panels of both widths; byte_panel.cpp: the
// int8 one): their activations interleaved a group of rows to a vector, and the output tile,
// kStripe weight rows' outputs gathered per activation row before they are written.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_formats.h"

namespace pagedq_cpu {

// Weight rows whose outputs are written together: each activation row's kStripe outputs are one
// 64-byte line. Why: written a quad (16 bytes) at a time, straight into `out`, each activation
// row's line was visited four times, and the rows of a pass lie ldo floats apart: with N a
// multiple of 1024 (gate_up 3072, the LM head 49152) every row's line falls in the same L1 set,
// so the pass's 32-64 lines evicted one another between visits. That cost the panel 1.6-1.8x at
// 64 rows on those matrices (Zen 5 capped at avx512, 1 thread, N = 3072, K = 576: 74 GMAC/s
// writing the quads, 131 with no writes at all); the stripe's tile is L1-resident and contiguous.
constexpr int64_t kStripe = 16;

// Activation rows as int32 words (a pair of int16 codes, or a quad of int8 ones; row r's words
// at src + r * stride), interleaved `lanes` rows to a vector: word t of rows lanes g .. lanes g +
// lanes - 1 at x[(g * words + t) * lanes + r]. A last group of `pad` rows or more is padded with
// zero rows (fewer are left to the row-at-a-time kernels). Returns the groups.
inline int64_t interleave_rows(const int32_t* src, int64_t stride, int64_t rows, int64_t words,
                               int64_t lanes, int64_t pad, std::vector<int32_t>& x) {
  const int64_t groups = (rows + lanes - pad) / lanes;
  x.resize(groups * words * lanes);  // every slot is written below: no clearing pass
  for (int64_t r = 0; r < groups * lanes; ++r) {
    int32_t* dst = x.data() + (r / lanes) * words * lanes + r % lanes;
    if (r >= rows) {  // padding rows of the last group
      for (int64_t t = 0; t < words; ++t) dst[t * lanes] = 0;
      continue;
    }
    const int32_t* row = src + r * stride;
    for (int64_t t = 0; t < words; ++t) dst[t * lanes] = row[t];
  }
  return groups;
}

// The outputs of one stripe: row-major, kStripe floats per activation row of the pass.
struct PanelTile {
  std::vector<float> v;
  int64_t row0 = 0, rows = 0, n = 0;  // first activation row, rows, first column

  void start(int64_t first_row, int64_t count, int64_t column) {
    row0 = first_row, rows = count, n = column;
    v.resize(count * kStripe);
  }
  // A pass's sums of `w` weight rows into the stripe at column `col`: the sum of weight row j
  // and the pass's activation row r at sums[((r / lanes) * width + j) * lanes + r % lanes] (the
  // panels' groups of `lanes` rows, `width` weight rows each).
  void put(const float* sums, int64_t lanes, int width, int w, int64_t col) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = sums + (r / lanes) * width * lanes + r % lanes;
      for (int j = 0; j < w; ++j) v[r * kStripe + col + j] = src[j * lanes];
    }
  }
  // the stripe's first `cols` columns to `out` (+ bias), one contiguous run per activation row
  void flush(const LinearArgs& p, int64_t cols) const {
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = p.out + (row0 + r) * p.ldo + n;
      const float* src = v.data() + r * kStripe;
      if (p.bias)
        for (int64_t j = 0; j < cols; ++j) dst[j] = src[j] + p.bias[n + j];
      else
        std::memcpy(dst, src, cols * sizeof(float));
    }
  }
};

namespace v256 {
// The int16 panel's AVX2 vectors (panel_kernel.inc's Lanes: 8 activation rows a vector, 4 groups
// a pass) but for the multiply-add, which panel_gemv.cpp (vpmaddwd + vpaddd) and
// panel_gemv_vnni.cpp (AVX-VNNI's vpdpwssd) each add.
struct Lanes256 {
  static constexpr int64_t kRows = 8, kGroups = 4;
  using F = __m256;
  using I = __m256i;
  static F zero() { return _mm256_setzero_ps(); }
  static I izero() { return _mm256_setzero_si256(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static I iload(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F splat(float v) { return _mm256_set1_ps(v); }
  static I splat(int32_t v) { return _mm256_set1_epi32(v); }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
};
}  // namespace v256

}  // namespace pagedq_cpu
