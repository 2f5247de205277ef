// Entry points of the packed-weight kernels that other translation units call directly (no
// dispatcher round trip): the GEMV for few rows, the bf16-tile GEMM for many.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pagedq_quant {

void quant_gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t fmt,
                const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& bias);
void quant_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t fmt,
                const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& bias);

}  // namespace pagedq_quant
