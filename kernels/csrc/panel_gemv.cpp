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

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_ops.h"
#include "int16_acts.h"
#include "quant_avx2.h"
#include "quant_formats.h"

namespace pagedq_cpu::v256 {
namespace {

constexpr int kPanelW = 4;           // weight rows per pass (4 int32 sums a group in registers)
constexpr int kPanelBlocks = 8;      // 32-blocks decoded at a time (256 codes)
constexpr int64_t kPanelGroups = 4;  // groups of 8 activation rows per pass over the weights
// Rows from which a last partial group is padded to 8: row at a time, 4-7 rows cost about what 8
// do (their sums are reduced 8 lanes at a time), so 12 rows as 8 + 4 were slower than before.
constexpr int64_t kPanelPadRows = 4;

// The activation rows interleaved 8 at a time: int16 pair t (codes 2t, 2t + 1 in the walkers'
// order) of rows 8g .. 8g + 7 at x[(g * pairs + t) * 8 + r]. A last group of kPanelPadRows rows
// or more is padded with zero rows; fewer take the row-at-a-time kernels (panel_tail).
struct PanelActs {
  int64_t groups = 0, pairs = 0;
  std::vector<int32_t> x;
};

void interleave(const Acts& a, int64_t K, PanelActs& pa) {
  pa.groups = (a.rows + 8 - kPanelPadRows) / 8;
  pa.pairs = K / 2;
  pa.x.resize(pa.groups * pa.pairs * 8);  // every slot is written below: no clearing pass
  for (int64_t r = 0; r < pa.groups * 8; ++r) {
    int32_t* dst = pa.x.data() + (r / 8) * pa.pairs * 8 + r % 8;
    if (r >= a.rows) {  // padding rows of the last group
      for (int64_t t = 0; t < pa.pairs; ++t) dst[t * 8] = 0;
      continue;
    }
    const int32_t* src = reinterpret_cast<const int32_t*>(a.qrow(r));
    for (int64_t t = 0; t < pa.pairs; ++t) dst[t * 8] = src[t];
  }
}

// kPanelW weight rows' codes (walkers' order) and scales for up to kPanelBlocks blocks.
struct PanelChunk {
  alignas(32) int16_t codes[kPanelW][kPanelBlocks * 32];
  float s_lo[kPanelW][kPanelBlocks], s_hi[kPanelW][kPanelBlocks], m[kPanelW][kPanelBlocks];
};

template <class W>
inline void decode_chunk(const LinearArgs& p, int64_t n, int j, int64_t b0, int64_t nb, PanelChunk& c) {
  const float scale = p.scales ? p.scales[n] : 0.f;
  const int64_t span = span_bytes(p);
  const uint8_t* at = p.w + n * p.row_bytes + b0 / 8 * span;
  // the same codes of the next pass's row: a whole pass of compute ahead
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

// Activation rows 8g .. 8g + 8 GR - 1 against the chunk's weight rows: out[i * kPanelW + j]
// lane r += row 8 (g + i) + r's dot with weight row j over the chunk's blocks.
template <class W, int GR>
inline void panel_group(const PanelChunk& c, const PanelActs& pa, const Acts& a, int64_t g, int64_t b0,
                        int64_t nb, __m256* sums) {
  __m256 out[GR * kPanelW];
  for (int k = 0; k < GR * kPanelW; ++k) out[k] = sums[k];
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
        // two scales: pairs 0-3 and 8-11 are elements 0-15, 4-7 and 12-15 are 16-31
        const int t = W::kTwoScales ? (tt < 4 ? tt : tt + 4) + 4 * half : tt;
        __m256i xa[GR];
        for (int i = 0; i < GR; ++i)
          xa[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[i] + t * 8));
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
          out[i * kPanelW + j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][j]), _mm256_mul_ps(s, da[i]),
                                                 out[i * kPanelW + j]);
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
  for (int k = 0; k < GR * kPanelW; ++k) sums[k] = out[k];
}

// Activation groups [g0, g1) against weight rows [n0, n1), kPanelW at a time; `tail`: also the
// last 1-3 activation rows past the groups (the row-at-a-time kernels, while the weights are cached).
template <class W>
void panel_block(const LinearArgs& p, const Acts& a, const PanelActs& pa, int64_t g0, int64_t g1,
                 int64_t n0, int64_t n1, bool tail) {
  static thread_local PanelChunk chunk;
  static thread_local std::vector<__m256> sums;
  PanelChunk& c = chunk;  // one TLS lookup, not one per use
  std::vector<__m256>& acc = sums;
  acc.resize((g1 - g0) * kPanelW);
  const int64_t blocks = p.K / kActBlock;
  for (int64_t n = n0; n < n1; n += kPanelW) {
    const int w = static_cast<int>(std::min<int64_t>(kPanelW, n1 - n));
    std::fill(acc.begin(), acc.end(), _mm256_setzero_ps());
    for (int64_t b0 = 0; b0 < blocks; b0 += kPanelBlocks) {
      const int64_t nb = std::min<int64_t>(kPanelBlocks, blocks - b0);
      for (int j = 0; j < kPanelW; ++j) decode_chunk<W>(p, n + std::min(j, w - 1), j, b0, nb, c);
      int64_t g = g0;
      for (; g + 2 <= g1; g += 2) panel_group<W, 2>(c, pa, a, g, b0, nb, acc.data() + (g - g0) * kPanelW);
      if (g < g1) panel_group<W, 1>(c, pa, a, g, b0, nb, acc.data() + (g - g0) * kPanelW);
    }
    for (int64_t g = g0; g < g1; ++g) {
      for (int j = 0; j < w; ++j) {
        alignas(32) float out[8];
        _mm256_store_ps(out, acc[(g - g0) * kPanelW + j]);
        const float bias = p.bias ? p.bias[n + j] : 0.f;
        for (int r = 0; r < 8 && 8 * g + r < a.rows; ++r) p.out[(8 * g + r) * p.ldo + n + j] = out[r] + bias;
      }
    }
    for (int j = 0; tail && pa.groups * 8 < a.rows && j < w; ++j) panel_tail(p, a, pa.groups * 8, n + j);
  }
}

// Every activation row against weight rows [n0, n1), kPanelGroups groups at a time: their
// interleaved activations (2 KiB a group per 64 codes of K) stay in L2 while every weight row
// of the range passes, and a weight chunk's slice of them (4 KiB a group) in L1; all the rows
// at once spilled to L3 from ~1024 rows on (K = 1536); 8 groups (32 KiB a chunk) ran 1.1-1.15x
// slower than 4 at 64-128 rows on a Zen 5, and fill a Zen 2/3 core's whole L1.
template <class W>
void panel_rows(const LinearArgs& p, const Acts& a, const PanelActs& pa, int64_t n0, int64_t n1) {
  for (int64_t g0 = 0; g0 < pa.groups; g0 += kPanelGroups) {
    const int64_t g1 = std::min(pa.groups, g0 + kPanelGroups);
    panel_block<W>(p, a, pa, g0, g1, n0, n1, g1 == pa.groups);
  }
}

}  // namespace

void panel_gemv_parts(const LinearArgs* parts, int64_t count, const Acts& a) {
  static thread_local PanelActs panel;
  interleave(a, parts[0].K, panel);
  const PanelActs& pa = panel;  // the workers read this thread's copy (a thread_local is not captured)
  parallel_parts(parts, count, kPanelW, [&](int64_t i, int64_t u0, int64_t u1) {
    const LinearArgs& p = parts[i];
    visit_walker<Nibble32, Q8_0, Int8, KQuant45, Q6_K>(p.fmt, [&](auto w) {
      panel_rows<decltype(w)>(p, a, pa, u0 * kPanelW, std::min(u1 * kPanelW, p.N));
    });
  });
}

}  // namespace pagedq_cpu::v256
