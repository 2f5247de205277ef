// RMSNorm over the rows of a 2-D fp32 tensor: out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w.
//
// Why: ATen's composite rms_norm is six kernel launches; at decode batch sizes the launches, not
// the arithmetic, are the cost. Here each row is one pass to sum squares and one to scale.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>

#include "cpu_ops.h"

namespace pagedq_cpu {

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps) {
  check_cpu();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "rms_norm: fp32 [rows, hidden]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(),
              "rms_norm: contiguous tensors only");
  const int64_t rows = x.size(0), H = x.size(1);
  TORCH_CHECK(w.numel() == H && out.size(0) == rows && out.size(1) == H, "rms_norm: shapes");
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * H;
      float* orow = op + r * H;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) orow[i] = wp[i] * (xr[i] * inv);
    }
  });
}


}  // namespace pagedq_cpu
