// Quantized GEMV: out[b, n] = sum_k x[b, k] * W[n, k] for a few rows of x, reading W in its
// packed form (GGUF blocks or per-channel int8; see quant_formats.h).
//
// Why: decode at small batch streams every weight once per step; packed 4-8 bit weights are a
// quarter to an eighth of fp32's bytes. Like llama.cpp, the activations are quantized to int8
// per 32 values (scale da), so each 64-code chunk of a weight row meets each activation row in
// one integer dot product (AVX-512 VNNI vpdpbusd, or AVX2 maddubs), and the float scales apply
// per 4-code lane afterwards:
//   out += sum_lanes ws * da * isum(lane) + wm * da * sum(qa in lane)
// Each weight row is decoded once for all activation rows.
//
// The library is built for AVX2; the AVX-512 functions are compiled for AVX-512 (pragma below)
// and run only when the caller passes Isa kAvx512Vnni (check_isa refuses it on CPUs without).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "quant_avx512.h"
#include "quant_formats.h"
#include "cpu_ops.h"

namespace pagedq_cpu {
namespace {

constexpr int kMaxGroup = 8;  // activation rows per pass over a weight row (accumulators live in registers)
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of the current weight row to prefetch

// Activation rows quantized for one call, in the chunk order of the weight format.
struct Acts {
  int64_t rows = 0, padded = 0;  // padded: K rounded up to a whole chunk
  std::vector<int8_t> q;  // [rows, padded]
  std::vector<float> da;  // [rows, padded / 4]: the activation scale of each lane
  std::vector<float> ab;  // [rows, padded / 4]: da * (sum of the lane's 4 codes)
  const int8_t* qrow(int64_t b) const { return q.data() + b * padded; }
  const float* darow(int64_t b) const { return da.data() + b * padded / 4; }
  const float* abrow(int64_t b) const { return ab.data() + b * padded / 4; }
};

void quantize_acts(const float* x, int64_t rows, int64_t K, bool nibbles, Acts& a) {
  a.rows = rows;
  a.padded = (K + kChunk - 1) / kChunk * kChunk;
  a.q.assign(rows * a.padded, 0);
  a.da.assign(rows * a.padded / 4, 0.f);
  a.ab.assign(rows * a.padded / 4, 0.f);
  for (int64_t b = 0; b < rows; ++b) {
    const float* xr = x + b * K;
    int8_t* q = a.q.data() + b * a.padded;
    float* da = a.da.data() + b * a.padded / 4;
    float* ab = a.ab.data() + b * a.padded / 4;
    for (int64_t blk = 0; blk < K / kActBlock; ++blk) {
      const float* v = xr + blk * kActBlock;
      float amax = 0.f;
      for (int i = 0; i < kActBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int i = 0; i < kActBlock; ++i) {
        const int64_t pos = chunk_position(blk * kActBlock + i, nibbles);
        q[pos] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
      }
      for (int i = 0; i < kActBlock; i += 4) {  // the lanes of this block
        const int64_t pos = chunk_position(blk * kActBlock + i, nibbles);
        da[pos / 4] = d;
        ab[pos / 4] = d * static_cast<float>(q[pos] + q[pos + 1] + q[pos + 2] + q[pos + 3]);
      }
    }
  }
}

inline void prefetch_row(const uint8_t* row, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchBytes + off), _MM_HINT_T0);
}

// f(first_row, std::integral_constant<int, G>) over groups of up to kMaxGroup activation rows:
// G is a compile-time constant, so each group's accumulators live in registers.
template <class F>
inline void for_each_group(int64_t rows, F&& f) {
  for (int64_t b = 0; b < rows; b += kMaxGroup) {
    switch (std::min<int64_t>(kMaxGroup, rows - b)) {
      case 1: f(b, std::integral_constant<int, 1>{}); break;
      case 2: f(b, std::integral_constant<int, 2>{}); break;
      case 3: f(b, std::integral_constant<int, 3>{}); break;
      case 4: f(b, std::integral_constant<int, 4>{}); break;
      case 5: f(b, std::integral_constant<int, 5>{}); break;
      case 6: f(b, std::integral_constant<int, 6>{}); break;
      case 7: f(b, std::integral_constant<int, 7>{}); break;
      default: f(b, std::integral_constant<int, 8>{}); break;
    }
  }
}

}  // namespace

// ================================================================ AVX-512 VNNI
PAGEDQ_AVX512_BEGIN
namespace v512 {
namespace {

// G activation rows (G <= kMaxGroup) starting at row b0 against weight rows [n0, n1).
template <class Walker, int G>
void rows_group(const LinearArgs& p, const Acts& a, int64_t b0, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    prefetch_row(row, p.row_bytes);
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    const float scale = p.scales ? p.scales[n] : 0.f;
    Walker::walk(row, p.K, scale, [&](int64_t c, __m512i w, __m512 ws, __m512 wm) {
      for (int g = 0; g < G; ++g) {
        const int64_t b = b0 + g;
        const __m512i q = _mm512_loadu_si512(a.qrow(b) + c * kChunk);
        const __m512 da = _mm512_loadu_ps(a.darow(b) + c * kLanesPerChunk);
        const __m512 ab = _mm512_loadu_ps(a.abrow(b) + c * kLanesPerChunk);
        const __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, q);
        acc[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(ws, da), acc[g]);
        acc[g] = _mm512_fmadd_ps(wm, ab, acc[g]);
      }
    });
    const float bias = p.bias ? p.bias[n] : 0.f;
    for (int g = 0; g < G; ++g) p.out[(b0 + g) * p.ldo + n] = _mm512_reduce_add_ps(acc[g]) + bias;
  }
}

// bf16 weights: each row widened to fp32 in registers (a shift) against fp32 activations.
template <int G>
void bf16_group(const LinearArgs& p, int64_t b0, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    prefetch_row(row, p.row_bytes);
    const uint16_t* w = reinterpret_cast<const uint16_t*>(row);
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t k = 0; k < p.K; k += 16) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
      const __m512 wf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
      for (int g = 0; g < G; ++g)
        acc[g] = _mm512_fmadd_ps(wf, _mm512_loadu_ps(p.x + (b0 + g) * p.K + k), acc[g]);
    }
    const float bias = p.bias ? p.bias[n] : 0.f;
    for (int g = 0; g < G; ++g) p.out[(b0 + g) * p.ldo + n] = _mm512_reduce_add_ps(acc[g]) + bias;
  }
}

template <class Walker>
void run_rows(const LinearArgs& p, const Acts& a, int64_t n0, int64_t n1) {
  for_each_group(a.rows, [&](int64_t b, auto group) {
    rows_group<Walker, decltype(group)::value>(p, a, b, n0, n1);
  });
}

}  // namespace

void gemv(const LinearArgs& p, const Acts& a, int64_t n0, int64_t n1) {
  switch (p.fmt) {
    case kQ4_0: run_rows<Nibble32<kQ4_0>>(p, a, n0, n1); break;
    case kQ4_1: run_rows<Nibble32<kQ4_1>>(p, a, n0, n1); break;
    case kQ5_0: run_rows<Nibble32<kQ5_0>>(p, a, n0, n1); break;
    case kQ5_1: run_rows<Nibble32<kQ5_1>>(p, a, n0, n1); break;
    case kQ8_0: run_rows<Q8_0>(p, a, n0, n1); break;
    case kInt8: run_rows<Int8>(p, a, n0, n1); break;
    case kQ4_K: run_rows<KQuant45<kQ4_K>>(p, a, n0, n1); break;
    case kQ5_K: run_rows<KQuant45<kQ5_K>>(p, a, n0, n1); break;
    case kQ6_K: run_rows<Q6_K>(p, a, n0, n1); break;
    case kBF16:
      for_each_group(p.rows, [&](int64_t b, auto group) {
        bf16_group<decltype(group)::value>(p, b, n0, n1);
      });
      break;
  }
}

}  // namespace v512
PAGEDQ_AVX512_END

// ================================================================ AVX2 (portable decode)
namespace v256 {
namespace {

// 8 lanes of 4-code integer dots: codes unsigned 0..63, or signed (Q8_0/int8) via abs/sign so
// maddubs' 16-bit pair sums never saturate.
template <bool Signed>
inline __m256i dot4(__m256i w, __m256i q) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Signed)
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(q, w)), ones);
  else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, q), ones);
}

template <bool Signed, int G>
void rows_group(const LinearArgs& p, const Acts& a, int64_t b0, const int8_t* codes, const float* ws,
                const float* wm, int64_t n) {
  __m256 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t k = 0; k < a.padded; k += 32) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + k));
    const __m256 s = _mm256_loadu_ps(ws + k / 4), m = _mm256_loadu_ps(wm + k / 4);
    for (int g = 0; g < G; ++g) {
      const int64_t b = b0 + g;
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qrow(b) + k));
      const __m256 isum = _mm256_cvtepi32_ps(dot4<Signed>(w, q));
      acc[g] = _mm256_fmadd_ps(isum, _mm256_mul_ps(s, _mm256_loadu_ps(a.darow(b) + k / 4)), acc[g]);
      if constexpr (!Signed) acc[g] = _mm256_fmadd_ps(m, _mm256_loadu_ps(a.abrow(b) + k / 4), acc[g]);
    }
  }
  const float bias = p.bias ? p.bias[n] : 0.f;
  for (int g = 0; g < G; ++g) p.out[(b0 + g) * p.ldo + n] = hsum(acc[g]) + bias;
}

template <bool Signed>
void run_rows(const LinearArgs& p, const Acts& a, int64_t n0, int64_t n1) {
  std::vector<int8_t> codes(a.padded);
  std::vector<float> ws(a.padded / 4), wm(a.padded / 4);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    prefetch_row(row, p.row_bytes);
    decode_row(p.fmt, row, p.K, p.scales ? p.scales[n] : 0.f, codes.data(), ws.data(), wm.data());
    for_each_group(a.rows, [&](int64_t b, auto group) {
      rows_group<Signed, decltype(group)::value>(p, a, b, codes.data(), ws.data(), wm.data(), n);
    });
  }
}

template <int G>
void bf16_group(const LinearArgs& p, int64_t b0, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    prefetch_row(row, p.row_bytes);
    const uint16_t* w = reinterpret_cast<const uint16_t*>(row);
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t k = 0; k < p.K; k += 8) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k));
      const __m256 wf = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
      for (int g = 0; g < G; ++g)
        acc[g] = _mm256_fmadd_ps(wf, _mm256_loadu_ps(p.x + (b0 + g) * p.K + k), acc[g]);
    }
    const float bias = p.bias ? p.bias[n] : 0.f;
    for (int g = 0; g < G; ++g) p.out[(b0 + g) * p.ldo + n] = hsum(acc[g]) + bias;
  }
}

}  // namespace

void gemv(const LinearArgs& p, const Acts& a, int64_t n0, int64_t n1) {
  if (p.fmt == kBF16)
    for_each_group(p.rows, [&](int64_t b, auto group) {
      bf16_group<decltype(group)::value>(p, b, n0, n1);
    });
  else if (p.fmt == kQ8_0 || p.fmt == kInt8)
    run_rows<true>(p, a, n0, n1);
  else
    run_rows<false>(p, a, n0, n1);
}

}  // namespace v256

// ================================================================ entry point

void quant_gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t fmt,
                const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& bias,
                int64_t isa) {
  check_isa(isa);
  const LinearArgs p = check_linear("quant_gemv", out, x, w, fmt, scales, bias);
  if (p.rows == 0 || p.N == 0) return;
  static thread_local Acts acts;
  if (fmt != kBF16) quantize_acts(p.x, p.rows, p.K, nibble_order(fmt), acts);
  const bool vnni = isa == kAvx512Vnni;
  // Rows per task: enough weight bytes (~32 KiB) that a thread's start-up cost stays small.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(p.row_bytes, 1));
  const Acts& a = acts;
  at::parallel_for(0, p.N, grain, [&](int64_t n0, int64_t n1) {
    if (vnni)
      v512::gemv(p, a, n0, n1);
    else
      v256::gemv(p, a, n0, n1);
  });
}

}  // namespace pagedq_cpu
