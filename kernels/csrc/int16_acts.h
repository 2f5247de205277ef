// Activations rounded to int16 per 32 values (or per VNNI chunk lane), the input of the int16
// GEMVs: quant_gemv.cpp (the row-at-a-time kernels of both levels) and panel_gemv.cpp (AVX2, 8 or
// more rows, Q6_K 5). quant_gemv.cpp's quantize_acts fills it, once per call for every weight row.

#pragma once

#include <cstdint>
#include <vector>

#include "cpu_ops.h"
#include "quant_formats.h"

namespace pagedq_cpu {

// Activation rows prepared for one call as int16 codes. VNNI path: in the chunk order of the
// weight format (act_position), padded to whole chunks, da/ab per 4-code lane. AVX2 path: each
// block's even elements before its odd ones (padded = K), da/ab per 32-value block.
struct Acts {
  int64_t rows = 0, padded = 0, steps = 0;  // steps: da / ab entries per row
  std::vector<int16_t> q;  // [rows, padded]
  std::vector<float> da;  // [rows, padded / 4] (VNNI) or [rows, K / 32] (AVX2): the code step
  std::vector<float> ab;  // likewise: da * (the lane's share of / the block's) code sum
  std::vector<float> dat, abt;  // AVX2: da and ab transposed, [steps, tstride] (transpose_steps)
  int64_t tstride = 0;
  const int16_t* qrow(int64_t b) const { return q.data() + b * padded; }
  const float* darow(int64_t b) const { return da.data() + b * steps; }
  const float* abrow(int64_t b) const { return ab.data() + b * steps; }
};

namespace v256 {
// Activation rows from which the AVX2 GEMV runs the panel (panel_gemv.cpp) on int16 activations.
constexpr int64_t kPanelRows = 8;
// The same for Q6_K alone, whose row-at-a-time kernel is the slowest (a scale per 16 codes): its
// panel, padded to 8 rows, was 1.15-1.6x faster from 5 rows (Intel Xeon model 167 capped at
// avx2, 2 threads, --shapes down: 3.7-4.1 against 4.5-6.3 ms a pass at 5-7 rows; 4 rows level).
constexpr int64_t kPanelRowsQ6K = 5;
// x @ W^T for `count` weights that read the same activations a (already quantized), the rows in
// groups of 8 (panel_gemv.cpp; a last group of 4-7 rows padded), 1-3 left over through panel_tail.
void panel_gemv_parts(const LinearArgs* parts, int64_t count, const Acts& a);
// Activation rows r0 .. a.rows - 1 against weight row n with the row-at-a-time kernels
// (quant_gemv.cpp).
void panel_tail(const LinearArgs& p, const Acts& a, int64_t r0, int64_t n);
// Activation rows from which the panel runs with AVX-512 vectors where asked (isa kAvx512) and
// wide_panel() holds: from 12 rows the AVX2 panel pads to 16 lanes too (8 + 4 padded to 8), so
// the 16-row vectors pad no more than it does and make twice the products a vpmaddwd. Measured
// (AMD EPYC Zen 5 capped at avx512, 2 threads, quant_kernels, from 32 -> from 12): the bundled
// model's matrices at 12-16 rows 1.0-1.08x, 18-21 1.07-1.1x, 28 1.33-1.36x (Q4_1, Q8_0, Q5_0);
// SmolLM2-1.7B's shapes at 16 rows 1.14-1.21x (Q4_K, Q8_0), 20 1.10-1.22x, 28 1.38-1.47x; at 9
// rows (one group of 16 against 8 + a row-at-a-time tail) it lost 0.85-0.95x. Earlier, before
// the stripe tile, the crossover was measured at 32 (level at 16 on the bundled model).
constexpr int64_t kWidePanelRows = 12;
// Whether the AVX-512 panel runs here: AVX-512F/VL/DQ (runs_isa(kAvx512)) and BW.
inline bool wide_panel() {
  static const bool yes = runs_isa(kAvx512) && __builtin_cpu_supports("avx512bw");
  return yes;
}
}  // namespace v256

namespace v256vnni {
// The AVX2 panel with AVX-VNNI's vpdpwssd (panel_gemv_vnni.cpp): call only where
// runs_isa(kAvx2Vnni) holds.
void panel_gemv_parts(const LinearArgs* parts, int64_t count, const Acts& a);
// Weight rows [n0, n1) against 1-3 activation rows (the K-quants 1-7) with AVX-VNNI
// (quant_gemv_vnni.cpp), the AVX2 kernels' result bit for bit; false (nothing done) for other
// row counts and formats. Call only where runs_isa(kAvx2Vnni) holds.
bool few_rows_gemv(const LinearArgs& p, const Acts& a, int64_t n0, int64_t n1);
}  // namespace v256vnni

namespace v256bw {
// Weight rows [n0, n1) against a few activation rows in AVX-512BW (quant_gemv_bw.cpp): Q5_0 and
// Q5_1 (1-3 rows) with their fifth bits merged through mask registers, Q4_K, Q5_K and Q6_K (1-7 rows)
// in 512-bit vectors; the AVX2 row kernels' result bit for bit. Call only where wide_panel()
// holds. False (nothing written) for other formats and row counts.
bool few_rows_gemv(const LinearArgs& p, const Acts& a, int64_t n0, int64_t n1);
}  // namespace v256bw

namespace v512 {
// The same panel with 16 rows a vector (panel_gemv512.cpp): call only where wide_panel() holds.
void panel_gemv_parts(const LinearArgs* parts, int64_t count, const Acts& a);
}  // namespace v512

}  // namespace pagedq_cpu
