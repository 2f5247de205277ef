// The index of each row's largest value (the first one on ties; the first NaN where a row has
// one, as torch.max does): greedy sampling's pick over a step's logits.
//
// Why: ATen's max(dim=-1) with indices took 0.72 ms over 64 rows of SmolLM2's 49152 logits (1.0
// ms a call in a 64-stream decode step's profile, ~2% of the step; AMD EPYC Zen 5, 2 threads)
// while amax alone took 0.07: the index tracking is what it does not vectorize. Here a row is
// two vector passes, the max (NaN noticed on the way) and then the first lane equal to it; the
// second pass finds the row in L1/L2: 0.08 ms at 64 rows, 0.004 at one (ATen 0.025).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "cpu_ops.h"

namespace pagedq_cpu {
namespace {

// The first i in [0, n) with x[i] == v (v found by the caller, so there is one), or the first
// NaN when `nan`.
int64_t first_equal(const float* x, int64_t n, float v, bool nan) {
  const __m256 want = _mm256_set1_ps(v);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i);
    const int mask = _mm256_movemask_ps(nan ? _mm256_cmp_ps(a, a, _CMP_UNORD_Q)
                                            : _mm256_cmp_ps(a, want, _CMP_EQ_OQ));
    if (mask) return i + __builtin_ctz(static_cast<unsigned>(mask));
  }
  for (; i < n; ++i)
    if (nan ? std::isnan(x[i]) : x[i] == v) return i;
  return 0;
}

int64_t row_argmax(const float* x, int64_t n) {
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
  __m256 unordered = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
  float best = -INFINITY;
  bool nan = _mm256_movemask_ps(unordered) != 0;
  for (float v : lanes) best = v > best ? v : best;
  for (; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    best = x[i] > best ? x[i] : best;
  }
  if (!nan && best == -INFINITY) return 0;  // every value -inf (a fully masked row): index 0
  return first_equal(x, n, best, nan);
}

}  // namespace

void argmax_rows(at::Tensor& out, const at::Tensor& x) {
  check_cpu();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "argmax_rows: fp32 [rows, n] with contiguous rows");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.size(0) == x.size(0) &&
                  out.is_contiguous(),
              "argmax_rows: out must be int64 [rows]");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: rows of at least one value");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // a row is ~0.01 ms: threads only for several of them
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = row_argmax(xp + r * stride, n);
  });
}

}  // namespace pagedq_cpu
