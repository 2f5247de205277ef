// Skinny GEMV: out[b, n] = sum_k x[b, k] * w[n, k] (+ bias[n]) for 1-16 rows of x (decode at
// small batch), fp32.
//
// Why: such steps are bound by streaming the weights, and BLAS GEMM kernels tuned for big tiles
// reach about half the memory bandwidth there. Here each weight row is read once, for all rows
// of x. 1-4 rows stream with AVX2 (memory-bound: wider vectors change nothing); 5-16 rows reuse
// each weight element for up to 16 FMAs, so they are compute-bound and run in register tiles,
// AVX2 or AVX-512 as the caller's `isa` says.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <cstdint>

#include "cpu_ops.h"

namespace pagedq_cpu {

namespace {

// Each thread streams one contiguous slice of w, and each loop step also prefetches the cache
// line kPrefetchFloats (4 KiB) ahead in that stream: the hardware prefetchers stop at every
// 4 KiB page and ramp up again, which costs a third of the bandwidth on a pass over a model's
// projections; 4 KiB ahead hides that ramp, further ahead evicts lines before their use.
// Prefetches past the end of w are harmless (they never fault).
constexpr int64_t kPrefetchFloats = 1024;

inline void prefetch_ahead(const float* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchFloats), _MM_HINT_T0);
}

// 1-4 rows: one weight row at a time against every row of x (two accumulators per x row).
template <int B>
void skinny_rows(const float* x, const float* w, const float* bias, float* out, int64_t N,
                 int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* wr = w + n * K;
      __m256 acc0[B], acc1[B];
      for (int b = 0; b < B; ++b) {
        acc0[b] = _mm256_setzero_ps();
        acc1[b] = _mm256_setzero_ps();
      }
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
        prefetch_ahead(wr + k);  // 16 floats = one cache line per step
        const __m256 w0 = _mm256_loadu_ps(wr + k), w1 = _mm256_loadu_ps(wr + k + 8);
        for (int b = 0; b < B; ++b) {
          acc0[b] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + b * K + k), acc0[b]);
          acc1[b] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + b * K + k + 8), acc1[b]);
        }
      }
      for (int b = 0; b < B; ++b) {
        float v = hsum(_mm256_add_ps(acc0[b], acc1[b]));
        for (int64_t kk = k; kk < K; ++kk) v += wr[kk] * x[b * K + kk];
        out[b * N + n] = v + (bias ? bias[n] : 0.f);
      }
    }
  });
}

// out[i, j] for MR rows of x and NR rows of w: MR * NR accumulators stay in registers while
// the loop streams K; the NR weight rows stay in L1 across the row groups of x. With Prefetch
// (the first row group) step k also prefetches the NR * 8 floats at w + NR * k, kPrefetchFloats
// ahead: the tile's NR rows are contiguous, so that pointer walks the stream at the rate the
// loop consumes it.
template <int MR, int NR, bool Prefetch = false>
inline void dot_tile(const float* x, const float* w, int64_t K, float* out, int64_t N,
                     const float* bias) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if constexpr (Prefetch)
      for (int j = 0; j < NR * 8; j += 16) prefetch_ahead(w + NR * k + j);
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float v = hsum(acc[i][j]);
      for (int64_t kk = k; kk < K; ++kk) v += x[i * K + kk] * w[j * K + kk];
      out[i * N + j] = v + (bias ? bias[j] : 0.f);
    }
}

// 5-16 rows, AVX2: 3 x rows by 4 weight rows per register tile (12 of the 16 ymm registers
// accumulate).
struct Avx2Tile {
  static constexpr int kRows = 3, kCols = 4;
  template <int MR, int NR, bool Prefetch = false>
  static void dot(const float* x, const float* w, int64_t K, float* out, int64_t N,
                  const float* bias) {
    dot_tile<MR, NR, Prefetch>(x, w, K, out, N, bias);
  }
};

// ---- the same tiles with AVX-512 ---------------------------------------------------------------
// The library is built for AVX2 (every x86-64 CPU the kernels support); only these functions are
// compiled for AVX-512F, and they run only when the caller asks for Isa::kAvx512, which it does
// only on a CPU that has it. 16-lane FMAs halve the instruction count of the compute-bound tiles,
// and 32 vector registers hold a 4 x 4 tile of accumulators.
#define PAGEDQ_AVX512 __attribute__((target("avx512f,avx512vl,avx512dq,fma")))

template <int MR, int NR, bool Prefetch = false>
PAGEDQ_AVX512 inline void dot_tile16(const float* x, const float* w, int64_t K, float* out,
                                     int64_t N, const float* bias) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if constexpr (Prefetch)
      for (int j = 0; j < NR * 16; j += 16) prefetch_ahead(w + NR * k + j);
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_ps(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {  // the K tail: masked loads read nothing past the row
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_maskz_loadu_ps(m, w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      out[i * N + j] = _mm512_reduce_add_ps(acc[i][j]) + (bias ? bias[j] : 0.f);
}

// The tile's calls into dot_tile16 stay calls (a function built for AVX2 cannot inline AVX-512
// code); one call covers a whole 4 x 4 tile over K, so the call costs nothing measurable.
struct Avx512Tile {
  static constexpr int kRows = 4, kCols = 4;
  template <int MR, int NR, bool Prefetch = false>
  static void dot(const float* x, const float* w, int64_t K, float* out, int64_t N,
                  const float* bias) {
    dot_tile16<MR, NR, Prefetch>(x, w, K, out, N, bias);
  }
};

// ---- 5-16 rows with either tile ----------------------------------------------------------------
// Rows m.. of x in groups of Tile::kRows (then the leftover group) against NR weight rows.
template <class Tile, int NR>
void row_groups(int64_t m, int64_t M, const float* x, const float* w, int64_t K, float* out,
                int64_t N, const float* bias) {
  for (; m + Tile::kRows <= M; m += Tile::kRows)
    Tile::template dot<Tile::kRows, NR>(x + m * K, w, K, out + m * N, N, bias);
  const int64_t rest = M - m;
  if (rest == 3) Tile::template dot<3, NR>(x + m * K, w, K, out + m * N, N, bias);
  if (rest == 2) Tile::template dot<2, NR>(x + m * K, w, K, out + m * N, N, bias);
  if (rest == 1) Tile::template dot<1, NR>(x + m * K, w, K, out + m * N, N, bias);
}

// Threads split the weight rows in tiles of Tile::kCols; each tile's first row group (M >= 5, so
// a full one) prefetches the weight stream, the other groups find those rows in L1.
template <class Tile>
void tiled_rows(const float* x, const float* w, const float* bias, float* out, int64_t M,
                int64_t N, int64_t K) {
  const int64_t col_blocks = (N + Tile::kCols - 1) / Tile::kCols;
  at::parallel_for(0, col_blocks, 4, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n = c * Tile::kCols;
      if (n + Tile::kCols > N) {  // ragged last columns: one weight row at a time
        for (int64_t nn = n; nn < N; ++nn)
          row_groups<Tile, 1>(0, M, x, w + nn * K, K, out + nn, N, bias ? bias + nn : nullptr);
        continue;
      }
      const float* bn = bias ? bias + n : nullptr;
      Tile::template dot<Tile::kRows, Tile::kCols, true>(x, w + n * K, K, out + n, N, bn);
      row_groups<Tile, Tile::kCols>(Tile::kRows, M, x, w + n * K, K, out + n, N, bn);
    }
  });
}

}  // namespace

void skinny_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w,
                   const c10::optional<at::Tensor>& bias, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: shapes");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "skinny_linear: fp32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(),
              "skinny_linear: contiguous tensors only");
  const int64_t rows = x.size(0), N = w.size(0), K = w.size(1);
  TORCH_CHECK(rows >= 1 && rows <= kMaxSkinnyRows && out.size(0) == rows && out.size(1) == N,
              "skinny_linear: 1 to 16 rows, out [rows, N]");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N, "skinny_linear: bias [N]");
    bp = bias->data_ptr<float>();
  }
  check_isa(isa);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (rows) {
    case 1: skinny_rows<1>(xp, wp, bp, op, N, K); break;
    case 2: skinny_rows<2>(xp, wp, bp, op, N, K); break;
    case 3: skinny_rows<3>(xp, wp, bp, op, N, K); break;
    case 4: skinny_rows<4>(xp, wp, bp, op, N, K); break;
    default:
      if (isa == kAvx512 || isa == kAvx512Vnni)  // (kAvx2Vnni: AVX2's tiles)
        tiled_rows<Avx512Tile>(xp, wp, bp, op, rows, N, K);
      else
        tiled_rows<Avx2Tile>(xp, wp, bp, op, rows, N, K);
      break;
  }
}

}  // namespace pagedq_cpu
