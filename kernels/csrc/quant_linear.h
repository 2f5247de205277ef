// QuantLinear: one linear layer over packed weights (torch.classes.pagedq_cpu.QuantLinear), so
// the Python layer and the fused C++ layer run the same path choice.
//
// It holds one or more column segments: fused projections stay fused even where a GGUF gives
// their parts different formats (Q4_K_M files mix Q5_0 and Q8_0 within q/k/v). Each segment runs
// the quantized GEMV when the step has at most its gemv_max_rows rows (decode: every weight
// streamed once, integer dot products) and the bf16-tile GEMM otherwise (prefill chunks and big
// batches: compute-bound, AMX). The backend selector sets the limits, the isa and the GEMM's
// precision (cpu_ops.h: GemmPrecision).
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <vector>

namespace pagedq_cpu {

struct QuantLinear : torch::CustomClassHolder {
  std::vector<at::Tensor> data;  // per segment: packed rows [n_i, bytes per row]
  std::vector<int64_t> fmts;     // per segment: quant_formats.h Format (kF32: plain fp32 rows)
  c10::List<c10::optional<at::Tensor>> scales;  // per segment: int8 row scales, else None
  c10::optional<at::Tensor> bias;               // [out_features] or None
  std::vector<int64_t> gemv_max_rows;           // per segment: the GEMV up to this many rows
  int64_t in_features = 0, out_features = 0, isa = 0, precision = 0;

  QuantLinear(std::vector<at::Tensor> data, std::vector<int64_t> fmts,
              c10::List<c10::optional<at::Tensor>> scales, c10::optional<at::Tensor> bias,
              int64_t in_features, std::vector<int64_t> gemv_max_rows, int64_t isa,
              int64_t precision);

  // out[rows, N] = x[rows, K] @ W^T (+ bias), segment by segment into column slices.
  at::Tensor forward(const at::Tensor& x) const;
  // Resident bytes of the packed weights (and their scales).
  int64_t nbytes() const;

 private:
  bool one_gemv(int64_t rows) const;
  at::Tensor parts_forward(const at::Tensor& x) const;
};

}  // namespace pagedq_cpu
