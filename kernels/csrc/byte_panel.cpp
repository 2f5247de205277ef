// The AVX2 panel on int8 activations (quant_gemv's acts = 8, opt-in) from 8 rows, for the
// formats whose codes are unsigned: Q4_0, Q4_1, Q4_K (nibbles), Q5_0, Q5_1 (five bits) and
// Q6_K (six, its int8 scales in the widening: byte_walkers.h's ByteQ6_K).
//
// Why: the int16 panel (panel_gemv.cpp) makes 16 products per vpmaddwd and adds each result
// (two instructions per 16). Here a vpmaddubsw makes 32 (unsigned codes x signed int8
// activations, pairs summed to int16), and a nibble's products are small enough (a pair at most
// 2 x 15 x 127 = 3810) that a block's eight are summed in int16 (at most 30480) before one
// vpmaddwd widens them: 16 instructions per 256 products where the int16 panel takes 32 (five
// bits: four at a time, six bits two, byte_walkers.h's kSumQuads). Q8_0's signed codes would
// need the sign trick (one vpsignb per product) and int32 sums per pair: no fewer instructions
// than int16, so Q8_0 (and the formats without a byte walker) keep the int16 panel.
//
// Layout, as the int16 panel's:
// - the activations (byte_acts.h's rounding, natural order) interleaved 8 rows to a vector:
//   32-bit lane r of vector t holds row r's codes 4t .. 4t + 3;
// - 4 weight rows decoded a chunk (8 blocks of 32) at a time into bytes on the stack, each
//   quad of codes broadcast from there;
// - per block and weight row and group: 8 vpmaddubsw, 7 vpaddw, one vpmaddwd against ones, one
//   convert and FMA (scale x each row's step da), and the offset's FMA against the rows' sx;
// - outputs through panel_tile.h's stripes; a last group of 4-7 rows is padded with zero rows,
//   1-3 go through byte_gemv's row-at-a-time kernel (byte_tail) while the weights are cached.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "byte_acts.h"
#include "byte_walkers.h"
#include "cpu_ops.h"
#include "int16_acts.h"
#include "panel_tile.h"
#include "quant_avx2.h"
#include "quant_formats.h"

namespace pagedq_cpu::v256 {
namespace {

constexpr int kW = 4;                // weight rows per pass
constexpr int64_t kLanes = 8;        // activation rows a vector
constexpr int64_t kGroups = 4;       // groups of them per pass (32 rows: as the int16 panel)
constexpr int64_t kPadRows = 4;      // a last group of this many rows or more is padded
constexpr int64_t kChunkBlocks = 8;  // 32-blocks decoded at a time (a K-quant super-block)

// Rows kLanes g .. kLanes g + 7's int8 codes, quad t at x[(g * quads + t) * kLanes + r].
struct BytePanelActs {
  int64_t groups = 0, quads = 0;
  std::vector<int32_t> x;
};

void interleave(const ByteActs& a, int64_t K, BytePanelActs& pa) {
  pa.quads = K / 4;
  pa.groups = interleave_rows(reinterpret_cast<const int32_t*>(a.q.data()), pa.quads, a.rows, pa.quads,
                              kLanes, kPadRows, pa.x);
}

// kW weight rows' codes (bytes, natural order) and their blocks' scales and offsets.
struct ByteChunk {
  alignas(32) uint8_t codes[kW][kChunkBlocks * 32];
  float s[kW][kChunkBlocks], m[kW][kChunkBlocks];
  float m2[kW][kChunkBlocks];              // Q6_K: the second halves' offsets
  int16_t sc[kW][kChunkBlocks][2];         // Q6_K: each half's int8 scale (ByteQ6_K)
};

// Weight row n's blocks [b0, b0 + nb) into the chunk's row j: eight at a time with their scales
// as vectors (the byte walkers' eight()), a row's last, shorter chunk block by block.
template <class W>
inline void decode_chunk(const LinearArgs& p, int64_t n, int j, int64_t b0, int64_t nb, ByteChunk& c) {
  const int64_t span = span_bytes(p);
  const uint8_t* row = p.w + n * p.row_bytes;
  // the same codes of the next pass's row: a whole pass of compute ahead
  for (int64_t off = 0; off < span; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row + b0 / 8 * span + kW * p.row_bytes + off), _MM_HINT_T0);
  const auto put = [&](int64_t b, __m256i codes) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(c.codes[j] + b * 32), codes);
  };
  if (nb == kChunkBlocks) {
    __m256 s, m, m2;
    W::eight(row, b0, [&](int b, __m256i codes, __m256i widen) {
      put(b, codes);
      if constexpr (W::kSixBit) {
        c.sc[j][b][0] = static_cast<int16_t>(_mm256_extract_epi16(widen, 0));
        c.sc[j][b][1] = static_cast<int16_t>(_mm256_extract_epi16(widen, 8));
      }
    }, s, m, m2);
    _mm256_storeu_ps(c.s[j], s);
    _mm256_storeu_ps(c.m[j], m);
    if constexpr (W::kSixBit) _mm256_storeu_ps(c.m2[j], m2);
    return;
  }
  if constexpr (!W::kSixBit) {  // a row's last, shorter chunk (32-element formats only)
    W::walk(row + b0 * W::kBytes, nb * 32, [&](int64_t b, __m256i codes, float s, float m) {
      put(b, codes);
      c.s[j][b] = s;
      c.m[j][b] = m;
    });
  }
}

// Groups g .. g + GR - 1 against the chunk's weight rows: sums[(i * kW + j) * kLanes + r] +=
// row kLanes (g + i) + r's dot with weight row j over the chunk.
template <class W, int GR>
inline void byte_group(const ByteChunk& c, const BytePanelActs& pa, const ByteActs& a, int64_t g,
                       int64_t b0, int64_t nb, float* sums) {
  constexpr int kSum = W::kSumQuads;  // int16 sums widened every kSum quads
  __m256 out[GR * kW];
  for (int k = 0; k < GR * kW; ++k) out[k] = _mm256_loadu_ps(sums + k * kLanes);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const int32_t* xb[GR];
    for (int i = 0; i < GR; ++i) xb[i] = pa.x.data() + ((g + i) * pa.quads + (b0 + b) * 8) * kLanes;
    __m256i s16[GR][kW], s32[GR][kW];
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      __m256i xa[GR];
      for (int i = 0; i < GR; ++i) xa[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[i] + t * kLanes));
      for (int j = 0; j < kW; ++j) {
        int32_t quad;
        std::memcpy(&quad, c.codes[j] + b * 32 + 4 * t, 4);
        const __m256i wv = _mm256_set1_epi32(quad);
        for (int i = 0; i < GR; ++i) {
          const __m256i prod = _mm256_maddubs_epi16(wv, xa[i]);
          s16[i][j] = t % kSum ? _mm256_add_epi16(s16[i][j], prod) : prod;
          asm("" : "+v"(s16[i][j]));  // a chain per sum, in registers (as the int16 panel)
          if (t % kSum == kSum - 1) {  // Q6_K: the half's scale in the widening (ByteQ6_K)
            const __m256i by = W::kSixBit ? _mm256_set1_epi16(c.sc[j][b][t / 4]) : ones;
            const __m256i wide = _mm256_madd_epi16(s16[i][j], by);
            s32[i][j] = t == kSum - 1 ? wide : _mm256_add_epi32(s32[i][j], wide);
          }
        }
      }
    }
    for (int i = 0; i < GR; ++i) {
      const int64_t at = (b0 + b) * a.tstride + kLanes * (g + i);
      const __m256 da = _mm256_loadu_ps(a.dat.data() + at);
      // the offsets' activation sums: the block's (sx), or Q6_K's two halves'
      const __m256 sx = _mm256_loadu_ps((W::kSixBit ? a.s0t : a.sxt).data() + at);
      const __m256 sx2 = W::kSixBit ? _mm256_loadu_ps(a.s1t.data() + at) : _mm256_setzero_ps();
      for (int j = 0; j < kW; ++j) {
        __m256 o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[i][j]),
                                   _mm256_mul_ps(_mm256_set1_ps(c.s[j][b]), da), out[i * kW + j]);
        o = _mm256_fmadd_ps(_mm256_set1_ps(c.m[j][b]), sx, o);
        if constexpr (W::kSixBit) o = _mm256_fmadd_ps(_mm256_set1_ps(c.m2[j][b]), sx2, o);
        out[i * kW + j] = o;
      }
    }
  }
  for (int k = 0; k < GR * kW; ++k) _mm256_storeu_ps(sums + k * kLanes, out[k]);
}

// Groups [g0, g1) against weight rows [n0, n1), kW at a time; `tail`: also the 1-3 rows past the
// groups (byte_tail, while the weights are cached).
template <class W>
void panel_block(const LinearArgs& p, const ByteActs& a, const BytePanelActs& pa, int64_t g0, int64_t g1,
                 int64_t n0, int64_t n1, bool tail) {
  static thread_local ByteChunk chunk;
  static thread_local std::vector<float> sums;
  static thread_local PanelTile stripe;
  ByteChunk& c = chunk;
  std::vector<float>& acc = sums;
  PanelTile& tile = stripe;
  acc.resize((g1 - g0) * kW * kLanes);
  const int64_t row0 = kLanes * g0, rows = std::min(kLanes * g1, a.rows) - row0;
  for (int64_t n = n0; n < n1; n += kW) {
    const int w = static_cast<int>(std::min<int64_t>(kW, n1 - n));
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t b0 = 0; b0 < a.blocks; b0 += kChunkBlocks) {
      const int64_t nb = std::min<int64_t>(kChunkBlocks, a.blocks - b0);
      for (int j = 0; j < kW; ++j) decode_chunk<W>(p, n + std::min(j, w - 1), j, b0, nb, c);
      int64_t g = g0;
      for (; g + 2 <= g1; g += 2) byte_group<W, 2>(c, pa, a, g, b0, nb, acc.data() + (g - g0) * kW * kLanes);
      if (g < g1) byte_group<W, 1>(c, pa, a, g, b0, nb, acc.data() + (g - g0) * kW * kLanes);
    }
    if ((n - n0) % kStripe == 0) tile.start(row0, rows, n);
    const int64_t col = n - tile.n;
    tile.put(acc.data(), kLanes, kW, w, col);
    if (col + w == kStripe || n + kW >= n1) tile.flush(p, col + w);
    for (int j = 0; tail && pa.groups * kLanes < a.rows && j < w; ++j) byte_tail(p, a, pa.groups * kLanes, n + j);
  }
}

template <class W>
void panel_rows(const LinearArgs& p, const ByteActs& a, const BytePanelActs& pa, int64_t n0, int64_t n1) {
  for (int64_t g0 = 0; g0 < pa.groups; g0 += kGroups) {
    const int64_t g1 = std::min(pa.groups, g0 + kGroups);
    panel_block<W>(p, a, pa, g0, g1, n0, n1, g1 == pa.groups);
  }
}

}  // namespace

bool byte_panel_format(int64_t fmt) { return byte_format(fmt) && fmt != kQ8_0; }

void byte_panel_parts(const LinearArgs* parts, int64_t count) {
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(byte_panel_format(parts[i].fmt) && !parts[i].grouped,
                "byte_panel: int8 activations in the panel take plain Q4_0, Q4_1, Q5_0, Q5_1, Q4_K or Q6_K rows");
  static thread_local ByteActs acts;
  static thread_local BytePanelActs panel;
  const LinearArgs& first = parts[0];
  const bool six = std::any_of(parts, parts + count, [](const LinearArgs& p) { return p.fmt == kQ6_K; });
  quantize_bytes_transposed(first.x, first.rows, first.K, acts, six);
  interleave(acts, first.K, panel);
  const ByteActs& a = acts;  // the workers read this thread's copies (a thread_local is not captured)
  const BytePanelActs& pa = panel;
  parallel_parts(parts, count, kW, [&](int64_t i, int64_t u0, int64_t u1) {
    const LinearArgs& p = parts[i];
    const int64_t n0 = u0 * kW, n1 = std::min(u1 * kW, p.N);
    visit_byte_walker(p.fmt, [&](auto walker) { panel_rows<decltype(walker)>(p, a, pa, n0, n1); });
  });
}

}  // namespace pagedq_cpu::v256
