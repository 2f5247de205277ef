// The AVX2 panel (panel_kernel.inc, 8 activation rows a vector) with AVX-VNNI: each pair of
// int16 codes meets the activations in one vpdpwssd (multiply, add the pairs, accumulate)
// where the AVX2 panel spends a vpmaddwd and a vpaddd.
//
// Why: the panel's inner loop is one broadcast (a load) and, per weight row and group, the
// multiply and the add; on an AVX2 core the adds compete with the multiplies for the vector
// ports, so at 8-256 rows the int16 panel ran at the rate of its instructions (~97 GMAC/s on
// two cores of an Intel Xeon capped at avx2, the LM head and the MLP the most of a 64-stream
// step). AVX-VNNI (the VEX encoding, 256-bit) is what Intel's Core CPUs from Alder Lake on have
// instead of AVX-512; its vpdpwssd is the same products and sums in one instruction, exactly
// (int32 lanes that wrap as vpaddd's do, which the codes' range never reaches). The selector
// passes isa kAvx2Vnni (the avx2_vnni level) for such CPUs; the rest of their kernels are AVX2's.

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

#if PAGEDQ_AVX_VNNI_BUILD
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2,avxvnni")

namespace pagedq_cpu::v256vnni {
namespace {

using namespace v256;  // the walkers (quant_avx2.h) and Lanes256 (panel_tile.h)

// panel_gemv.cpp's lanes (8 rows a vector, 4 groups a pass) with the fused multiply-add.
struct Lanes : Lanes256 {
  static I madd_add(I acc, I w, I x) { return _mm256_dpwssd_avx_epi32(acc, w, x); }
};

#include "panel_kernel.inc"

}  // namespace

void panel_gemv_parts(const LinearArgs* parts, int64_t count, const Acts& a) { panel_parts(parts, count, a); }

}  // namespace pagedq_cpu::v256vnni

#pragma GCC pop_options
#else  // a compiler without AVX-VNNI (cpu_ops.h): the AVX2 panel
namespace pagedq_cpu::v256vnni {
void panel_gemv_parts(const LinearArgs* parts, int64_t count, const Acts& a) {
  v256::panel_gemv_parts(parts, count, a);
}
}  // namespace pagedq_cpu::v256vnni
#endif
