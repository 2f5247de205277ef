// The GEMV from 8 activation rows on (int16 activations, every decodable packed format): a
// register-blocked panel instead of quant_gemv.cpp's row-at-a-time kernels (AVX2, 8 activation
// rows to a vector) and, from kPanel512Rows, of group_gemv.cpp's grouped kernel (AVX-512 VNNI,
// 16 rows to a vector, one vpdpwssd per 32 products; grouped weights are put back into GGUF
// rows a chunk at a time, `degroup`).
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
// to 64 rows stay in L2 while the thread's weight rows pass (panel_rows); the last rows % 8 take
// the row-at-a-time kernels (panel_tail) right after their weight rows, still cached.
//
// Measured (Intel Xeon, model 167, capped at avx2, 1 thread, 2 layers of the 1.7B shape), GMAC/s
// row-at-a-time -> panel: Q8_0 32.8 -> 42.1 at 16 rows, 37.5 -> 56.4 at 64; Q4_K 30.2 -> 39.0,
// 28.7 -> 54.5; Q6_K 19.4 -> 33.2, 20.5 -> 47.3 (docs/quantization.md has the table).

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_ops.h"
#include "int16_acts.h"
#include "quant_avx2.h"
#include "quant_avx512.h"
#include "quant_formats.h"

namespace pagedq_cpu {
namespace {

constexpr int kPanelW = 4;               // weight rows per pass (4 int32 sums a group in registers)
constexpr int kPanelBlocks = 8;          // 32-blocks decoded at a time (256 codes)
constexpr int64_t kPanelPassRows = 64;   // activation rows per pass over the weights
// AVX2: rows from which a last partial group is padded to 8: row at a time, 4-7 rows cost about
// what 8 do (their sums are reduced 8 lanes at a time), so 12 rows as 8 + 4 were slower.
constexpr int64_t kPanelPadRows = 4;

// The activation rows interleaved R at a time: int16 pair t (codes 2t, 2t + 1 in the walkers'
// order) of rows R g .. R g + R - 1 at x[(g * pairs + t) * R + r]. A last group of `pad` rows or
// more is padded with zero rows; fewer take the row-at-a-time kernels (panel_tail).
struct PanelActs {
  int64_t rows_per_group = 8, groups = 0, pairs = 0;
  std::vector<int32_t> x;
};

void interleave(const Acts& a, int64_t K, int64_t R, int64_t pad, PanelActs& pa) {
  pa.rows_per_group = R;
  pa.groups = (a.rows + R - pad) / R;
  pa.pairs = K / 2;
  pa.x.assign(pa.groups * pa.pairs * R, 0);
  for (int64_t r = 0; r < std::min(a.rows, pa.groups * R); ++r) {
    const int32_t* src = reinterpret_cast<const int32_t*>(a.qrow(r));
    int32_t* dst = pa.x.data() + (r / R) * pa.pairs * R + r % R;
    for (int64_t t = 0; t < pa.pairs; ++t) dst[t * R] = src[t];
  }
}

// kPanelW weight rows' codes (walkers' order) and scales for up to kPanelBlocks blocks.
struct PanelChunk {
  alignas(32) int16_t codes[kPanelW][kPanelBlocks * 32];
  float s_lo[kPanelW][kPanelBlocks], s_hi[kPanelW][kPanelBlocks], m[kPanelW][kPanelBlocks];
};

// Each groupable format's block fields in GGUF's order (kernels/block_formats.py: GROUP_FIELDS):
// bytes, and whether they hold codes (slot order in a group) or scales (row order); 0 ends.
struct Field {
  int8_t bytes;
  bool code;
};
const Field* group_fields(int64_t fmt) {
  static constexpr Field q4_0[] = {{2, false}, {16, true}, {0, false}};
  static constexpr Field q4_1[] = {{2, false}, {2, false}, {16, true}, {0, false}};
  static constexpr Field q5_0[] = {{2, false}, {4, true}, {16, true}, {0, false}};
  static constexpr Field q5_1[] = {{2, false}, {2, false}, {4, true}, {16, true}, {0, false}};
  static constexpr Field q8_0[] = {{2, false}, {32, true}, {0, false}};
#define PAGEDQ_SCALE_BYTES {1, false}, {1, false}, {1, false}, {1, false}
  static constexpr Field q4_k[] = {{2, false}, {2, false}, PAGEDQ_SCALE_BYTES, PAGEDQ_SCALE_BYTES,
                                   PAGEDQ_SCALE_BYTES, {32, true}, {32, true}, {32, true}, {32, true},
                                   {0, false}};
  static constexpr Field q5_k[] = {{2, false}, {2, false}, PAGEDQ_SCALE_BYTES, PAGEDQ_SCALE_BYTES,
                                   PAGEDQ_SCALE_BYTES, {32, true}, {32, true}, {32, true}, {32, true},
                                   {32, true}, {0, false}};
  static constexpr Field q6_k[] = {{16, true}, {16, true}, {16, true}, {16, true}, {16, true},
                                   {16, true}, {16, true}, {16, true}, {16, true}, {16, true},
                                   {16, true}, {16, true}, PAGEDQ_SCALE_BYTES, PAGEDQ_SCALE_BYTES,
                                   PAGEDQ_SCALE_BYTES, PAGEDQ_SCALE_BYTES, {2, false}, {0, false}};
#undef PAGEDQ_SCALE_BYTES
  switch (fmt) {
    case kQ4_0: return q4_0;
    case kQ4_1: return q4_1;
    case kQ5_0: return q5_0;
    case kQ5_1: return q5_1;
    case kQ8_0: return q8_0;
    case kQ4_K: return q4_k;
    case kQ5_K: return q5_k;
    default: return q6_k;
  }
}

// Each field of a group's block copied to the 16 rows' buffers (N bytes a row).
template <int N>
inline void copy_field(const uint8_t* src, const int64_t* from, uint8_t* dst, int64_t row_bytes) {
  for (int r = 0; r < kGroupRows; ++r) std::memcpy(dst + r * row_bytes, src + from[r] * N, N);
}

// A grouped weight's 16 rows from n (a group's first) back as GGUF rows, [16, row_bytes] in
// `rows`: 16 rows share each block position field by field (group_gemv.cpp has the layout).
void degroup_rows(const LinearArgs& p, int64_t n, std::vector<uint8_t>& rows) {
  const int64_t bytes = block_bytes(p.fmt), blocks = p.row_bytes / bytes;
  rows.resize(kGroupRows * p.row_bytes);
  int64_t in_order[kGroupRows], slots[kGroupRows];
  for (int r = 0; r < kGroupRows; ++r) in_order[r] = r, slots[r] = group_slot(p.fmt, r);
  const uint8_t* group = p.w + n * p.row_bytes;
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t at = 0;
    for (const Field* f = group_fields(p.fmt); f->bytes; at += f->bytes, ++f) {
      const uint8_t* src = group + kGroupRows * (b * bytes + at);
      const int64_t* from = f->code ? slots : in_order;
      uint8_t* dst = rows.data() + b * bytes + at;
      switch (f->bytes) {  // sizes known here: moves, not calls to memcpy
        case 1: copy_field<1>(src, from, dst, p.row_bytes); break;
        case 2: copy_field<2>(src, from, dst, p.row_bytes); break;
        case 4: copy_field<4>(src, from, dst, p.row_bytes); break;
        case 16: copy_field<16>(src, from, dst, p.row_bytes); break;
        default: copy_field<32>(src, from, dst, p.row_bytes); break;
      }
    }
  }
}

// Weight row `row` (GGUF blocks, scale: its int8 row scale) decoded for chunk slot j: blocks b0 ..
// b0 + nb - 1.
template <class W>
inline void decode_chunk(const LinearArgs& p, const uint8_t* row, float scale, int j, int64_t b0,
                         int64_t nb, PanelChunk& c, bool prefetch) {
  const int64_t span = span_bytes(p);
  const uint8_t* at = row + b0 / 8 * span;
  if (prefetch)  // the same codes of the next pass's row: a whole pass of compute ahead
    for (int64_t off = 0; off < span; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(at + kPanelW * p.row_bytes + off), _MM_HINT_T0);
  W::walk(at, nb * 32, scale, [&](int64_t b, __m256i e, __m256i o, float s_lo, float s_hi, float m) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(c.codes[j] + b * 32), e);
    _mm256_store_si256(reinterpret_cast<__m256i*>(c.codes[j] + b * 32 + 16), o);
    c.s_lo[j][b] = s_lo;
    c.s_hi[j][b] = s_hi;
    c.m[j][b] = m;
  });
}

// Pair t of a 32-block in the walkers' order: with two scales (Q6_K), pairs 0-3 and 8-11 are
// elements 0-15 (half 0), 4-7 and 12-15 elements 16-31 (half 1).
template <class W>
constexpr int pair_of(int tt, int half) {
  return W::kTwoScales ? (tt < 4 ? tt : tt + 4) + 4 * half : tt;
}

// The AVX2 kernel: 8 activation rows to a vector.
struct Ymm {
  static constexpr int64_t kRows = 8;
  static constexpr bool kTail = true;  // the last rows % 8 (under kPanelPadRows) row at a time

  // Activation groups g .. g + GR - 1 against the chunk's weight rows: acc[(i kPanelW + j) 8 + r]
  // += row 8 (g + i) + r's dot with weight row j over the chunk's blocks.
  template <class W, int GR>
  static void group(const PanelChunk& c, const PanelActs& pa, const Acts& a, int64_t g, int64_t b0,
                    int64_t nb, float* acc) {
    __m256 out[GR * kPanelW];
    for (int k = 0; k < GR * kPanelW; ++k) out[k] = _mm256_loadu_ps(acc + 8 * k);
    for (int64_t b = 0; b < nb; ++b) {
      const int32_t* xb[GR];
      __m256 da[GR];
      for (int i = 0; i < GR; ++i) {
        xb[i] = pa.x.data() + ((g + i) * pa.pairs + (b0 + b) * 16) * 8;
        da[i] = _mm256_loadu_ps(a.dat.data() + (b0 + b) * a.tstride + 8 * (g + i));
      }
      for (int half = 0; half < (W::kTwoScales ? 2 : 1); ++half) {
        __m256i isum[GR][kPanelW];
        for (int i = 0; i < GR; ++i)
          for (int j = 0; j < kPanelW; ++j) isum[i][j] = _mm256_setzero_si256();
#pragma GCC unroll 16
        for (int tt = 0; tt < (W::kTwoScales ? 8 : 16); ++tt) {
          const int t = pair_of<W>(tt, half);
          __m256i xa[GR];
          for (int i = 0; i < GR; ++i) xa[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[i] + t * 8));
          for (int j = 0; j < kPanelW; ++j) {
            int32_t wp;
            std::memcpy(&wp, c.codes[j] + b * 32 + 2 * t, 4);
            const __m256i wv = _mm256_set1_epi32(wp);
            for (int i = 0; i < GR; ++i) {
              isum[i][j] = _mm256_add_epi32(isum[i][j], _mm256_madd_epi16(wv, xa[i]));
              // keep the sums a chain in registers: reassociated, gcc computed all 64 products
              // first and spilled them
              asm("" : "+x"(isum[i][j]));
            }
          }
        }
        for (int j = 0; j < kPanelW; ++j) {
          const __m256 s = _mm256_set1_ps(half ? c.s_hi[j][b] : c.s_lo[j][b]);
          for (int i = 0; i < GR; ++i)
            out[i * kPanelW + j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][j]), _mm256_mul_ps(s, da[i]), out[i * kPanelW + j]);
        }
      }
      if constexpr (W::kHasMin) {
        for (int i = 0; i < GR; ++i) {
          const __m256 ab = _mm256_loadu_ps(a.abt.data() + (b0 + b) * a.tstride + 8 * (g + i));
          for (int j = 0; j < kPanelW; ++j)
            out[i * kPanelW + j] = _mm256_fmadd_ps(_mm256_set1_ps(c.m[j][b]), ab, out[i * kPanelW + j]);
        }
      }
    }
    for (int k = 0; k < GR * kPanelW; ++k) _mm256_storeu_ps(acc + 8 * k, out[k]);
  }
};

}  // namespace
}  // namespace pagedq_cpu

PAGEDQ_AVX512_BEGIN
namespace pagedq_cpu {
namespace {

// The AVX-512 VNNI kernel: Ymm's with 16 activation rows to a vector and vpdpwssd, which adds
// its 32 products into the sums itself (Ymm: a vpmaddwd and a vpaddd per 16).
struct Zmm {
  static constexpr int64_t kRows = 16;
  static constexpr bool kTail = false;  // the last group padded whatever its rows

  template <class W, int GR>
  static void group(const PanelChunk& c, const PanelActs& pa, const Acts& a, int64_t g, int64_t b0,
                    int64_t nb, float* acc) {
    __m512 out[GR * kPanelW];
    for (int k = 0; k < GR * kPanelW; ++k) out[k] = _mm512_loadu_ps(acc + 16 * k);
    for (int64_t b = 0; b < nb; ++b) {
      const int32_t* xb[GR];
      __m512 da[GR];
      for (int i = 0; i < GR; ++i) {
        xb[i] = pa.x.data() + ((g + i) * pa.pairs + (b0 + b) * 16) * 16;
        da[i] = _mm512_loadu_ps(a.dat.data() + (b0 + b) * a.tstride + 16 * (g + i));
      }
      for (int half = 0; half < (W::kTwoScales ? 2 : 1); ++half) {
        __m512i isum[GR][kPanelW];
        for (int i = 0; i < GR; ++i)
          for (int j = 0; j < kPanelW; ++j) isum[i][j] = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int tt = 0; tt < (W::kTwoScales ? 8 : 16); ++tt) {
          const int t = pair_of<W>(tt, half);
          __m512i xa[GR];
          for (int i = 0; i < GR; ++i) xa[i] = _mm512_loadu_si512(xb[i] + t * 16);
          for (int j = 0; j < kPanelW; ++j) {
            int32_t wp;
            std::memcpy(&wp, c.codes[j] + b * 32 + 2 * t, 4);
            const __m512i wv = _mm512_set1_epi32(wp);
            for (int i = 0; i < GR; ++i) isum[i][j] = _mm512_dpwssd_epi32(isum[i][j], wv, xa[i]);
          }
        }
        for (int j = 0; j < kPanelW; ++j) {
          const __m512 s = _mm512_set1_ps(half ? c.s_hi[j][b] : c.s_lo[j][b]);
          for (int i = 0; i < GR; ++i)
            out[i * kPanelW + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i][j]), _mm512_mul_ps(s, da[i]), out[i * kPanelW + j]);
        }
      }
      if constexpr (W::kHasMin) {
        for (int i = 0; i < GR; ++i) {
          const __m512 ab = _mm512_loadu_ps(a.abt.data() + (b0 + b) * a.tstride + 16 * (g + i));
          for (int j = 0; j < kPanelW; ++j)
            out[i * kPanelW + j] = _mm512_fmadd_ps(_mm512_set1_ps(c.m[j][b]), ab, out[i * kPanelW + j]);
        }
      }
    }
    for (int k = 0; k < GR * kPanelW; ++k) _mm512_storeu_ps(acc + 16 * k, out[k]);
  }
};

}  // namespace
}  // namespace pagedq_cpu
PAGEDQ_AVX512_END

namespace pagedq_cpu {
namespace {

// Activation groups [g0, g1) against weight rows [n0, n1), kPanelW at a time; `tail`: also the
// last rows past the groups (the row-at-a-time kernels, while the weight rows are cached).
template <class W, class Kern>
void panel_block(const LinearArgs& p, const Acts& a, const PanelActs& pa, int64_t g0, int64_t g1,
                 int64_t n0, int64_t n1, bool tail) {
  constexpr int64_t R = Kern::kRows;
  static thread_local PanelChunk chunk;
  static thread_local std::vector<float> sums;
  static thread_local std::vector<uint8_t> plain;
  PanelChunk& c = chunk;  // one TLS lookup, not one per use
  std::vector<float>& acc = sums;
  std::vector<uint8_t>& rows = plain;
  acc.resize((g1 - g0) * kPanelW * R);
  const int64_t blocks = p.K / kActBlock;
  for (int64_t n = n0; n < n1; n += kPanelW) {
    const int w = static_cast<int>(std::min<int64_t>(kPanelW, n1 - n));
    if (p.grouped && n % kGroupRows == 0) degroup_rows(p, n, rows);  // n0: a group's first row
    const uint8_t* base = p.grouped ? rows.data() + n % kGroupRows * p.row_bytes : p.w + n * p.row_bytes;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t b0 = 0; b0 < blocks; b0 += kPanelBlocks) {
      const int64_t nb = std::min<int64_t>(kPanelBlocks, blocks - b0);
      for (int j = 0; j < kPanelW; ++j) {
        const int k = std::min(j, w - 1);
        decode_chunk<W>(p, base + k * p.row_bytes, p.scales ? p.scales[n + k] : 0.f, j, b0, nb, c,
                        !p.grouped);
      }
      int64_t g = g0;
      for (; g + 2 <= g1; g += 2) Kern::template group<W, 2>(c, pa, a, g, b0, nb, acc.data() + (g - g0) * kPanelW * R);
      if (g < g1) Kern::template group<W, 1>(c, pa, a, g, b0, nb, acc.data() + (g - g0) * kPanelW * R);
    }
    for (int64_t g = g0; g < g1; ++g) {
      for (int j = 0; j < w; ++j) {
        const float* out = acc.data() + ((g - g0) * kPanelW + j) * R;
        const float bias = p.bias ? p.bias[n + j] : 0.f;
        for (int64_t r = 0; r < R && R * g + r < a.rows; ++r) p.out[(R * g + r) * p.ldo + n + j] = out[r] + bias;
      }
    }
    for (int j = 0; tail && pa.groups * R < a.rows && j < w; ++j) v256::panel_tail(p, a, pa.groups * R, n + j);
  }
}

// Every activation row against weight rows [n0, n1), kPanelPassRows at a time: their
// interleaved activations (2 KiB per 8 rows and 64 codes of K) stay in L2 while every weight row
// of the range passes; all the rows at once spilled to L3 from ~1024 rows on (K = 1536).
template <class W, class Kern>
void panel_rows(const LinearArgs& p, const Acts& a, const PanelActs& pa, int64_t n0, int64_t n1) {
  const int64_t step = kPanelPassRows / Kern::kRows;
  for (int64_t g0 = 0; g0 < pa.groups; g0 += step) {
    const int64_t g1 = std::min(pa.groups, g0 + step);
    panel_block<W, Kern>(p, a, pa, g0, g1, n0, n1, Kern::kTail && g1 == pa.groups);
  }
}

template <class Kern>
void panel_parts(const LinearArgs* parts, int64_t count, const Acts& a, int64_t pad) {
  static thread_local PanelActs panel;
  interleave(a, parts[0].K, Kern::kRows, pad, panel);
  const PanelActs& pa = panel;  // the workers read this thread's copy (a thread_local is not captured)
  // grouped weights: whole groups to a thread (each degrouped once per pass)
  const int64_t unit = parts[0].grouped ? kGroupRows : kPanelW;
  parallel_parts(parts, count, unit, [&](int64_t i, int64_t u0, int64_t u1) {
    const LinearArgs& p = parts[i];
    visit_walker<v256::Nibble32, v256::Q8_0, v256::Int8, v256::KQuant45, v256::Q6_K>(p.fmt, [&](auto w) {
      panel_rows<decltype(w), Kern>(p, a, pa, u0 * unit, std::min(u1 * unit, p.N));
    });
  });
}

}  // namespace

void v256::panel_gemv_parts(const LinearArgs* parts, int64_t count, const Acts& a) {
  panel_parts<Ymm>(parts, count, a, kPanelPadRows);
}

void v512::panel_gemv_parts(const LinearArgs* parts, int64_t count) {
  static thread_local Acts codes;
  v256::quantize_acts(parts[0].x, parts[0].rows, parts[0].K, codes);
  panel_parts<Zmm>(parts, count, codes, 1);
}

}  // namespace pagedq_cpu
