// The AVX2 GEMV from 8 activation rows on (int16 activations, every decodable packed format):
// a register-blocked panel instead of quant_gemv.cpp's row-at-a-time kernels.
//
// Why: row at a time, each 32-block's int32 sums of every activation row had to be reduced
// across lanes (hadd, 3 uops each on Intel) before its scale applied, and that bounded the
// GEMV at 16-64 rows (Q4_K: ~29 GMAC/s a core, level with the fp32-tile GEMM). Here the lanes
// are activation rows, so nothing is reduced:
// - the activations are interleaved 8 rows to a vector: 32-bit lane r of vector t holds row r's
//   int16 codes 2t and 2t + 1 (the walkers' order, quant_avx2.h);
// - 4 weight rows are decoded 8 blocks at a time into int16 codes on the stack, and each pair
//   of codes is broadcast from there (vpbroadcastd from memory: a load, no shuffle port);
// - per pair: one vpmaddwd and one vpaddd per weight row and group, two groups at a time (16
//   int32 sums of a block in registers); per block one convert and FMA per weight row and group
//   (scale x each row's step da, a vector of the 8 rows), and the offsets' FMA against their
//   code sums.
// The weight row's decode is shared by every group (8 rows) of the pass; the activations of up
// to 32 rows stay in L2 while the thread's weight rows pass (panel_rows); a last group of 4-7
// rows is padded, 1-3 take the row-at-a-time kernels (panel_tail) while the weights are cached.
//
// Measured (Intel Xeon, model 167, capped at avx2, 1 thread, the 1.7B shape), GMAC/s row at a
// time -> panel: Q8_0 32.8 -> 49.2 at 16 rows, 37.5 -> 57.3 at 64; Q4_K 30.2 -> 48.2, 28.7 ->
// 56.5; Q6_K 19.4 -> 39.2, 20.5 -> 47.1 (docs/quantization.md has the table).
// The body is panel_kernel.inc, shared with the AVX-512 panel (panel_gemv512.cpp: 16 rows a
// vector); this file gives it AVX2's vectors.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_ops.h"
#include "int16_acts.h"
#include "panel_tile.h"
#include "quant_avx2.h"
#include "quant_formats.h"

namespace pagedq_cpu::v256 {
namespace {

// 8 activation rows a vector, 4 groups (32 rows) a pass (panel_tile.h's Lanes256).
struct Lanes : Lanes256 {
  static I madd_add(I acc, I w, I x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
};

#include "panel_kernel.inc"

}  // namespace

void panel_gemv_parts(const LinearArgs* parts, int64_t count, const Acts& a) { panel_parts(parts, count, a); }

}  // namespace pagedq_cpu::v256
