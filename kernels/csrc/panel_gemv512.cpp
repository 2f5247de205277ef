// The panel GEMV (panel_gemv.cpp) with AVX-512 vectors, for CPUs with AVX-512BW but no VNNI
// (Skylake-SP/X: the `avx512` level): 16 activation rows a vector, so each vpmaddwd makes 32
// products where AVX2's makes 16, for the same broadcast of a weight pair and the same decode.
// VNNI CPUs run the grouped GEMV instead (group_gemv.cpp: vpdpbusd), AVX2 ones the 8-row panel.
//
// The headers are included before the target pragma, so their inline functions and the
// std::vector members used here keep the library's AVX2 target in every file (a copy compiled
// for AVX-512 could be the one the linker keeps); this file's own functions, in an anonymous
// namespace, take AVX-512 and inline the AVX2 walkers (a subset of it). VNNI is left out of the
// target: gcc would fuse vpmaddwd + vpaddd into vpdpwssd, which these CPUs lack.

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

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2,avx512f,avx512bw,avx512vl,avx512dq")

namespace pagedq_cpu::v512 {
namespace {

using v256::Nibble32;
using v256::Q8_0;
using v256::Int8;
using v256::KQuant45;
using v256::Q6_K;

// 16 activation rows a vector, 4 groups (64 rows) a pass: with 2 (32 rows, AVX2's pass) the
// K-quants' decode, shared by the pass, held them to 1.26-1.31x the AVX2 panel at K = 1536, with
// 4 1.41-1.49x (Q8_0 and Q4_1 1.1x either way; Zen 5 capped at avx512, 64-256 rows); at K = 576
// (the model's qkv, gate_up and LM head) passes of 64 run 1.15-1.18x faster than passes of 32
// (141 against 121 GMAC/s at N = 3072, 64 rows, 1 thread), although 64 rows' activations (74
// KiB) overflow a 48 KiB L1: once the outputs went out a stripe at a time, what had made 32
// rows faster there (every output line of a pass in one L1 set) was gone.
struct Lanes {
  static constexpr int64_t kRows = 16, kGroups = 4;
  using F = __m512;
  using I = __m512i;
  static F zero() { return _mm512_setzero_ps(); }
  static I izero() { return _mm512_setzero_si512(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static I iload(const int32_t* p) { return _mm512_loadu_si512(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F splat(float v) { return _mm512_set1_ps(v); }
  static I splat(int32_t v) { return _mm512_set1_epi32(v); }
  static I madd_add(I acc, I w, I x) { return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x)); }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
};

#include "panel_kernel.inc"

}  // namespace

void panel_gemv_parts(const LinearArgs* parts, int64_t count, const Acts& a) { panel_parts(parts, count, a); }

}  // namespace pagedq_cpu::v512

#pragma GCC pop_options
