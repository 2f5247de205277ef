// Quantized GEMM for many rows of x (prefill chunks, large decode batches): W is dequantized a
// tile of output channels at a time into bf16 (a thread-local buffer that stays in L2) and
// multiplied by oneDNN's batch-reduce GEMM micro-kernel (ATen's cpublas::brgemm: AMX tiles where
// the CPU has AMX-BF16, AVX-512 BF16 otherwise).
//
// Why: with many rows the products are compute-bound, and bf16 AMX multiplies an order of
// magnitude faster than fp32 FMAs; dequantizing each weight once per step costs the same as
// reading it, and the weights stay packed in memory (only the tile is ever bf16).
//
// Precision ("bf16x3"): a dequantized weight (fp16 scale x code: up to 19 significant bits) and
// an fp32 activation each lose ~2^-9 of their value in one bf16. Each is split into a bf16 head
// and a bf16 tail (v = hi + lo, exact to ~2^-17), and three products, hi.hi + hi.lo + lo.hi,
// recover the fp32 result to ~2^-16: the model then follows its dequantized fp32 twin, not a
// bf16 one. The products are the cheap part (AMX); the tails cost one more store per weight.
// Precision "bf16x2" (the default) rounds the weight once and splits only the activation: two
// products, hi.x_hi + hi.x_lo, the bf16-rounded weights times the fp32 activations (one store per
// weight, as dequantizing costs most at decode-sized row counts). Precision "bf16" rounds each
// operand once to bf16 and runs one product per tile: no tails are split, stored, packed or
// multiplied, for a model that follows a bf16 twin instead.
//
// Precision "fp32" (CPUs without AMX, where torch's bf16 brgemm does not run: AVX2, and AVX-512
// without AMX such as Zen 4 or Ice Lake): each tile is dequantized to fp32 and multiplied by
// ATen's fp32 GEMM (at::mm: MKL or oneDNN sgemm, which pick their own vector paths at run time), the
// activations read in the decoders' order: the dequantized model's product, exactly.
//
// The tile computes C^T[n, m] = W[n, :] . x[m, :]: the dequantized rows are brgemm's row-major
// A operand as they come out of the decoder, and x, packed once per call, is the VNNI B operand.
// Both use the decoder's chunk order of K (quant_formats.h), so the nibble formats' interleaved
// blocks need no shuffling: permuting K the same way in both operands leaves the dot unchanged.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/sub.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/from_blob.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "quant_avx2.h"
#include "quant_avx512.h"
#include "quant_formats.h"
#include "cpu_ops.h"

namespace pagedq_cpu {
namespace {

constexpr int64_t kTileRows = 32;  // output channels dequantized per tile
constexpr int64_t kMaxCols = 128;  // rows of x per brgemm call (its N)

using at::BFloat16;

// One weight row into bf16 head and tail rows in natural order, the portable way (the tail
// past K stays 0); lo null: the head alone, rounded.
void dequant_row_portable(int64_t fmt, const uint8_t* row, int64_t K, float scale, float* values,
                          BFloat16* hi, BFloat16* lo) {
  dequant_row_f32(fmt, row, K, scale, values);
  for (int64_t i = 0; i < K; ++i) {
    hi[i] = BFloat16(values[i]);
    if (lo) lo[i] = BFloat16(values[i] - static_cast<float>(hi[i]));
  }
}

}  // namespace

// The same with the AVX-512 decoders (inlined: this code has their target).
PAGEDQ_AVX512_BEGIN
namespace v512 {

// fp32 -> bf16, rounding to nearest even (weights are finite: no NaN case).
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

#include "quant_gemm_rows.inc"

// One weight row dequantized to fp32 in chunk order (precision fp32).
void dequant_row_f32(int64_t fmt, const RowRef& row, int64_t K, float scale, float* out) {
  walk_row(fmt, row, K, scale, [&](int64_t c, __m512i w, __m512 ws, __m512 wm) {
    float* at = out + c * kChunk;
    _mm512_storeu_ps(at, dequant16<0>(w, ws, wm));
    _mm512_storeu_ps(at + 16, dequant16<1>(w, ws, wm));
    _mm512_storeu_ps(at + 32, dequant16<2>(w, ws, wm));
    _mm512_storeu_ps(at + 48, dequant16<3>(w, ws, wm));
  });
}

// 16 rows of 16 32-bit words transposed in registers: r[i] holds row i, then column i.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // within each 128-bit lane: [a0 b0 a1 b1], [a2 b2 a3 b3]
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + w], lane L: word 4L + w of rows i..i+3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int w = 0; w < 4; ++w) {  // a 4 x 4 transpose of the lanes of r[w], r[4+w], r[8+w], r[12+w]
    const __m512i s0 = _mm512_shuffle_i32x4(r[w], r[4 + w], 0x44);
    const __m512i s1 = _mm512_shuffle_i32x4(r[w], r[4 + w], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(r[8 + w], r[12 + w], 0x44);
    const __m512i s3 = _mm512_shuffle_i32x4(r[8 + w], r[12 + w], 0xEE);
    t[w] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    t[4 + w] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    t[8 + w] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    t[12 + w] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// out[j, i] = c[i, j] + bias[i] for the tile's C^T [rows, cols] (rows, cols <= 128): 16 x 16
// blocks transposed in registers, where a scalar loop read c with a stride (4% of a 64-row step).
void store_transposed(const float* c, int64_t rows, int64_t cols, const float* bias, float* out,
                      int64_t ldo) {
  for (int64_t i0 = 0; i0 < rows; i0 += 16) {
    const int64_t ni = std::min<int64_t>(16, rows - i0);
    const __mmask16 keep_i = static_cast<__mmask16>((1u << ni) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep_i, bias + i0) : _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < cols; j0 += 16) {
      const int64_t nj = std::min<int64_t>(16, cols - j0);
      const __mmask16 keep_j = static_cast<__mmask16>((1u << nj) - 1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < ni ? _mm512_maskz_loadu_epi32(keep_j, c + (i0 + i) * cols + j0)
                      : _mm512_setzero_si512();
      transpose16(r);
      for (int j = 0; j < nj; ++j)
        _mm512_mask_storeu_ps(out + (j0 + j) * ldo + i0, keep_i,
                              _mm512_add_ps(_mm512_castsi512_ps(r[j]), b));
    }
  }
}

// x [M, K] fp32 -> bf16 in brgemm's VNNI B layout [padded / 2, M, 2] (32-bit words), K in the
// decoder's chunk order; with `lo`, heads at hi and tails at lo (each rounded), else the values
// rounded at hi. One pass: 16 rows x 32 positions are converted, transposed as words in
// registers and stored 16 words at a time (the ATen version took 5 ops and 19% of a GEMM call).
// Needs padded % 32 == 0; positions at or past K are 0.
void pack_acts(const float* x, int64_t M, int64_t K, int64_t padded, bool nibbles, uint32_t* hi,
               uint32_t* lo) {
  at::parallel_for(0, (M + 15) / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t m0 = b * 16, rows = std::min<int64_t>(16, M - m0);
      const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1);
      for (int64_t p0 = 0; p0 < padded; p0 += 32) {
        __m512i h[16], l[16];
        for (int r = 0; r < 16; ++r) {
          __m256i half_h[2], half_l[2];
          for (int g = 0; g < 2; ++g) {  // positions p0 + 16g ..: one 16-value group of x's row
            const int64_t q = p0 / 16 + g, sub = q % 4;
            const int64_t e0 = q / 4 * kChunk + (nibbles && (sub == 1 || sub == 2) ? 3 - sub : sub) * 16;
            const int64_t n = r < rows ? std::clamp<int64_t>(K - e0, 0, 16) : 0;
            const __m512 v = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1),
                                                   x + (m0 + r) * K + std::min(e0, K));
            half_h[g] = to_bf16(v);
            if (lo) {  // the head rounded, as a float again: the tail is at most half an ulp
              const __m512 head = _mm512_castsi512_ps(
                  _mm512_slli_epi32(_mm512_cvtepu16_epi32(half_h[g]), 16));
              half_l[g] = to_bf16(_mm512_sub_ps(v, head));
            }
          }
          h[r] = _mm512_inserti64x4(_mm512_castsi256_si512(half_h[0]), half_h[1], 1);
          if (lo) l[r] = _mm512_inserti64x4(_mm512_castsi256_si512(half_l[0]), half_l[1], 1);
        }
        transpose16(h);
        if (lo) transpose16(l);
        for (int j = 0; j < 16; ++j) {
          const int64_t at = (p0 / 2 + j) * M + m0;
          _mm512_mask_storeu_epi32(hi + at, keep, h[j]);
          if (lo) _mm512_mask_storeu_epi32(lo + at, keep, l[j]);
        }
      }
    }
  });
}

}  // namespace v512
PAGEDQ_AVX512_END

// The row decoders again where the CPU converts fp32 to bf16 in one instruction (AVX512_BF16:
// round to nearest even, as above), which the rounding written out takes six for. Perf: the
// decoders were a quarter of a 64-row GEMM step.
PAGEDQ_AVX512_BF16_BEGIN
namespace v512_bf16 {
using namespace v512;

inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

#include "quant_gemm_rows.inc"

}  // namespace v512_bf16
PAGEDQ_AVX512_END

namespace {

// Whether this CPU converts to bf16 in one instruction (PAGEDQ_CPU_BF16_CONVERT=0: never, so the
// tests can run the other decoders too).
bool native_bf16() {
  static const bool yes = [] {
    const char* env = std::getenv("PAGEDQ_CPU_BF16_CONVERT");
    return __builtin_cpu_supports("avx512bf16") && !(env && std::string(env) == "0");
  }();
  return yes;
}

// Where each of K activations goes in the nibble formats' chunk order (an index for index_copy_).
at::Tensor nibble_index(int64_t K) {
  at::Tensor index = at::empty({K}, at::TensorOptions().dtype(at::kLong));
  int64_t* pos = index.data_ptr<int64_t>();
  for (int64_t k = 0; k < K; ++k) pos[k] = chunk_position(k, true);
  return index;
}

// x [M, K] fp32 -> bf16 [padded / 2, M, 2] (brgemm's VNNI layout for B = x^T), K in chunk order.
at::Tensor pack_activations(const at::Tensor& x, int64_t padded, bool nibbles) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor xb = at::zeros({M, padded}, x.options().dtype(at::kBFloat16));
  if (nibbles) {
    xb.index_copy_(1, nibble_index(K), x.to(at::kBFloat16));
  } else {
    xb.narrow(1, 0, K).copy_(x);
  }
  // pairs of K as one 32-bit word, transposed: [M, padded / 2] -> [padded / 2, M]
  return xb.view(at::kInt).t().contiguous();
}

// x's bf16 head and tail (x - head), each packed as above.
std::pair<at::Tensor, at::Tensor> pack_split(const at::Tensor& x, int64_t padded, bool nibbles) {
  const at::Tensor head = x.to(at::kBFloat16);
  const at::Tensor tail = at::sub(x, head.to(at::kFloat));
  return {pack_activations(head.to(at::kFloat), padded, nibbles),
          pack_activations(tail, padded, nibbles)};
}

// x's packed B operand(s) for the precision: (rounded, none) or (heads, tails).
std::pair<at::Tensor, at::Tensor> pack_x(const at::Tensor& x, int64_t padded, bool nibbles,
                                         bool tails, bool fast) {
  if (!fast || padded % 32 != 0)
    return tails ? pack_split(x, padded, nibbles)
                 : std::pair{pack_activations(x, padded, nibbles), at::Tensor()};
  const int64_t M = x.size(0), K = x.size(1);
  const auto options = x.options().dtype(at::kInt);
  at::Tensor hi = at::empty({padded / 2, M}, options);
  at::Tensor lo = tails ? at::empty({padded / 2, M}, options) : at::Tensor();
  const at::Tensor xc = x.contiguous();
  v512::pack_acts(xc.data_ptr<float>(), M, K, padded, nibbles,
                  reinterpret_cast<uint32_t*>(hi.data_ptr<int32_t>()),
                  tails ? reinterpret_cast<uint32_t*>(lo.data_ptr<int32_t>()) : nullptr);
  return {hi, lo};
}

constexpr int64_t kF32TileBytes = 192 * 1024;  // an fp32 tile that stays in L2 beside x's rows

// x [M, K] in the decoders' order of K, zero-padded to `padded` columns (itself when that is K).
at::Tensor order_x(const at::Tensor& x, int64_t padded, bool nibbles) {
  const int64_t M = x.size(0), K = x.size(1);
  if (!nibbles && padded == K) return x;
  at::Tensor xo = at::zeros({M, padded}, x.options());
  if (!nibbles) {
    xo.narrow(1, 0, K).copy_(x);
    return xo;
  }
  xo.index_copy_(1, nibble_index(K), x);
  return xo;
}

// Precision fp32: tiles of W dequantized to fp32 (AVX-512 decoders in chunk order where `fast`,
// else the portable ones in natural order), each multiplied by all of x with ATen's fp32 GEMM
// into its columns of out. Threads take whole tiles; the GEMM inside runs on one thread.
void gemm_f32(const LinearArgs& args, const at::Tensor& x, bool fast) {
  const int64_t M = args.rows, K = args.K, N = args.N;
  const bool decode_fast = fast && args.fmt != kBF16;
  const int64_t padded = decode_fast ? (K + kChunk - 1) / kChunk * kChunk : K;
  const at::Tensor xo = order_x(x, padded, decode_fast && nibble_order(args.fmt));
  const int64_t tile = std::clamp<int64_t>(kF32TileBytes / (padded * 4) / 16 * 16, 16, 256);
  const int64_t fmt_bytes = args.fmt == kBF16 ? 0 : block_bytes(args.fmt);
  at::parallel_for(0, (N + tile - 1) / tile, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> a(tile * padded, 0.f);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile, rows = std::min(tile, N - n0);
      for (int64_t i = 0; i < rows; ++i) {
        const float scale = args.scales ? args.scales[n0 + i] : 0.f;
        float* dst = a.data() + i * padded;
        if (decode_fast) {
          const v512::RowRef ref = args.grouped
              ? v512::RowRef::grouped(args.fmt, args.w, n0 + i, args.row_bytes, fmt_bytes)
              : v512::RowRef::plain(args.w, n0 + i, args.row_bytes, fmt_bytes);
          v512::dequant_row_f32(args.fmt, ref, K, scale, dst);
        } else {
          const uint8_t* row = args.w + (n0 + i) * args.row_bytes;
          if (!v256::dequant_row_f32(args.fmt, row, K, scale, dst))
            dequant_row_f32(args.fmt, row, K, scale, dst);  // bf16 rows: widened exactly
        }
      }
      // out's columns n0.. (row stride ldo) = x · tile^T (+ bias): ATen's fp32 GEMM, one thread
      // (this runs inside the parallel region), writing through the strided view.
      float* c = args.out + n0;
      at::Tensor cv = at::from_blob(c, {M, rows}, {args.ldo, 1}, xo.options());
      const at::Tensor tile_t = at::from_blob(a.data(), {rows, padded}, xo.options()).t();
      if (args.bias) {
        for (int64_t m = 0; m < M; ++m) std::copy(args.bias + n0, args.bias + n0 + rows, c + m * args.ldo);
        cv.addmm_(xo, tile_t);
      } else {
        at::mm_out(cv, xo, tile_t);
      }
    }
  });
}

}  // namespace

bool bf16_tiles() {
  static const bool yes = isa_cap() >= 3 && at::native::cpublas::could_pack(at::kBFloat16);
  return yes;
}

void quant_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t fmt,
                const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& bias,
                int64_t isa, int64_t precision) {
  check_isa(isa);
  check_precision(precision);
  const bool tails = precision != kBf16;  // the activations' tails
  const bool weight_tails = precision == kBf16x3;
  const LinearArgs args = check_linear("quant_gemm", out, x, w, fmt, scales, bias);
  fmt = args.fmt;  // without the kGrouped bit
  const int64_t M = args.rows, K = args.K, N = args.N;
  const float* sp = args.scales;
  const float* bp = args.bias;
  if (M == 0 || N == 0) return;
  const bool fast = isa == kAvx512Vnni;  // the AVX-512 decoders (chunk order), else portable ones
  TORCH_CHECK(fast || !args.grouped, "quant_gemm: grouped rows need the AVX-512 VNNI decoders");
  if (precision == kF32Tiles) {
    gemm_f32(args, x, fast);
    return;
  }
  const bool bf16 = fmt == kBF16;  // the rows already are brgemm's A operand, exactly
  const int64_t padded = bf16 ? K : (K + kChunk - 1) / kChunk * kChunk;
  const int64_t fmt_bytes = bf16 ? 0 : block_bytes(fmt);
  const bool bf16_convert = fast && native_bf16();
  const bool nibbles = fast && nibble_order(fmt);
  const auto [x_hi, x_lo] = pack_x(x, padded, nibbles, tails, fast);
  const BFloat16* xh = static_cast<const BFloat16*>(x_hi.data_ptr());
  const BFloat16* xl = tails ? static_cast<const BFloat16*>(x_lo.data_ptr()) : nullptr;
  const uint8_t* wp = args.w;
  float* op = args.out;
  const int64_t row_bytes = args.row_bytes;
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> values(padded);
    std::vector<BFloat16> a_hi(kTileRows * padded, BFloat16(0.f));
    std::vector<BFloat16> a_lo(weight_tails ? kTileRows * padded : 0, BFloat16(0.f));
    std::vector<float> c(kTileRows * kMaxCols);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTileRows, rows = std::min(kTileRows, N - n0);
      const BFloat16* hi = bf16 ? reinterpret_cast<const BFloat16*>(wp + n0 * row_bytes) : a_hi.data();
      for (int64_t i = 0; i < rows && !bf16; ++i) {
        const uint8_t* row = wp + (n0 + i) * row_bytes;
        const v512::RowRef ref = args.grouped
            ? v512::RowRef::grouped(args.fmt, wp, n0 + i, row_bytes, fmt_bytes)
            : v512::RowRef::plain(wp, n0 + i, row_bytes, fmt_bytes);
        const float scale = sp ? sp[n0 + i] : 0.f;
        BFloat16* h = a_hi.data() + i * padded;
        BFloat16* l = weight_tails ? a_lo.data() + i * padded : nullptr;
        if (fast && weight_tails && bf16_convert)
          v512_bf16::dequant_row(args.fmt, ref, K, scale, h, l);
        else if (fast && weight_tails)
          v512::dequant_row(args.fmt, ref, K, scale, h, l);  // whole chunks: a half chunk's tail is 0
        else if (fast && bf16_convert)
          v512_bf16::dequant_row_rounded(args.fmt, ref, K, scale, h);
        else if (fast)
          v512::dequant_row_rounded(args.fmt, ref, K, scale, h);
        else
          dequant_row_portable(fmt, row, K, scale, values.data(), h, l);
      }
      for (int64_t m0 = 0; m0 < M; m0 += kMaxCols) {
        const int64_t cols = std::min(kMaxCols, M - m0);
        using at::native::cpublas::brgemm;
        brgemm(rows, cols, padded, padded, M, cols, false, hi, xh + m0 * 2, c.data());
        if (tails) brgemm(rows, cols, padded, padded, M, cols, true, hi, xl + m0 * 2, c.data());
        if (weight_tails && !bf16) brgemm(rows, cols, padded, padded, M, cols, true, a_lo.data(), xh + m0 * 2, c.data());
        if (fast) {  // C^T back to out's rows
          v512::store_transposed(c.data(), rows, cols, bp ? bp + n0 : nullptr,
                                 op + m0 * args.ldo + n0, args.ldo);
          continue;
        }
        for (int64_t j = 0; j < cols; ++j) {
          float* dst = op + (m0 + j) * args.ldo + n0;
          for (int64_t i = 0; i < rows; ++i) dst[i] = c[i * cols + j] + (bp ? bp[n0 + i] : 0.f);
        }
      }
    }
    at::native::cpublas::brgemm_release();
  });
}

}  // namespace pagedq_cpu
