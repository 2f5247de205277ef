// The AVX2 GEMV's one-to-seven-row kernels (few_rows.inc) compiled with AVX-VNNI: each block's
// second vpmaddwd and the add that joins the two are one vpdpwssd (block_dot), the same int32
// sums, so the output is the AVX2 kernels' bit for bit. Runs where the selector passes isa
// kAvx2Vnni (the avx2_vnni level: an Intel Core from Alder Lake on, no AVX-512), for the rows
// the AVX2 GEMV gives few_rows: 1-3 of every block format and K-quant, 4-7 of the K-quants as
// pieces of 2-3 (quant_gemv.cpp's int_group); the rest stays AVX2's.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "int16_acts.h"
#include "quant_avx2.h"
#include "quant_formats.h"

#if PAGEDQ_AVX_VNNI_BUILD
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2,avxvnni")

namespace pagedq_cpu::v256vnni {
namespace {

using namespace v256;  // the walkers and the activations' layout (quant_avx2.h, int16_acts.h)

#define PAGEDQ_FEW_ROWS_DPWSSD
#include "few_rows.inc"
#undef PAGEDQ_FEW_ROWS_DPWSSD

template <class W>
void rows_of(const LinearArgs& p, const Acts& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    if (a.rows >= kRowPrefetchRows) prefetch_row(p.w + n * p.row_bytes, p.row_bytes);  // as run_rows
    for_row_pieces(a.rows, [&](int64_t r, auto piece) { few_rows<W, decltype(piece)::value>(p, a, r, n); });
  }
}

}  // namespace

bool few_rows_gemv(const LinearArgs& p, const Acts& a, int64_t n0, int64_t n1) {
  bool taken = false;
  visit_walker<Nibble32, Q8_0, Int8, KQuant45, Q6_K>(p.fmt, [&](auto w) {
    using W = decltype(w);
    // quant_gemv.cpp's int_group rule: few_rows for 1-3 rows, the K-quants' 4-7 as its pieces
    if constexpr (kBlock32<W> || kSuper256<W>) {
      taken = a.rows >= 1 && a.rows <= (kSuper256<W> ? 7 : 3);
      if (taken) rows_of<W>(p, a, n0, n1);
    }
  });
  return taken;
}

}  // namespace pagedq_cpu::v256vnni

#pragma GCC pop_options
#else  // a compiler without AVX-VNNI (cpu_ops.h): the AVX2 row kernels take every row count
namespace pagedq_cpu::v256vnni {
bool few_rows_gemv(const LinearArgs&, const Acts&, int64_t, int64_t) { return false; }
}  // namespace pagedq_cpu::v256vnni
#endif
