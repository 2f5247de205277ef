// pagedq_quant.Linear: one linear layer over packed weights, as a TorchScript class, so the
// Python layer and C++ callers (the fused decoder layer) run the same path choice.
//
// A Linear holds one or more column segments: fused projections stay fused even where llama.cpp
// gave their parts different formats (Q4_K_M files mix Q5_0 and Q8_0 within q/k/v). Each
// segment runs the quantized GEMV when the step has at most its gemv_max_rows rows (decode:
// every weight streamed once, integer dot products) and the bf16 GEMM otherwise (prefill and big
// batches: compute-bound, AMX); the thresholds come from the backend selector, which measured
// where each format's GEMM overtakes its GEMV.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "quant_formats.h"
#include "quant_ops.h"

namespace pagedq_quant {

struct Linear : torch::CustomClassHolder {
  std::vector<at::Tensor> data;
  std::vector<int64_t> fmts;
  c10::List<c10::optional<at::Tensor>> scales;
  c10::optional<at::Tensor> bias;
  std::vector<int64_t> gemv_max_rows;
  int64_t in_features = 0, out_features = 0;

  Linear(std::vector<at::Tensor> data_, std::vector<int64_t> fmts_,
         c10::List<c10::optional<at::Tensor>> scales_, c10::optional<at::Tensor> bias_,
         int64_t in_features_, std::vector<int64_t> gemv_max_rows_)
      : data(std::move(data_)), fmts(std::move(fmts_)), scales(std::move(scales_)),
        bias(std::move(bias_)), gemv_max_rows(std::move(gemv_max_rows_)),
        in_features(in_features_) {
    TORCH_CHECK(!data.empty() && fmts.size() == data.size() && scales.size() == data.size() &&
                    gemv_max_rows.size() == data.size(),
                "Linear: one format, scales entry and GEMV row limit per segment");
    for (const at::Tensor& d : data) out_features += d.size(0);
    TORCH_CHECK(!bias.has_value() || !bias->defined() || bias->numel() == out_features,
                "Linear: bias must have one entry per output");
  }

  // out[rows, N] = x[rows, K] @ W^T (+ bias), segment by segment into column slices.
  at::Tensor forward(const at::Tensor& x) const {
    at::Tensor out = at::empty({x.size(0), out_features}, x.options());
    int64_t col = 0;
    for (size_t i = 0; i < data.size(); ++i) {
      const int64_t n = data[i].size(0);
      at::Tensor part = out.narrow(1, col, n);
      c10::optional<at::Tensor> b;
      if (bias.has_value() && bias->defined()) b = bias->narrow(0, col, n);
      if (x.size(0) <= gemv_max_rows[i])
        quant_gemv(part, x, data[i], fmts[i], scales.get(i), b);
      else
        quant_gemm(part, x, data[i], fmts[i], scales.get(i), b);
      col += n;
    }
    return out;
  }

  int64_t nbytes() const {
    int64_t total = 0;
    for (size_t i = 0; i < data.size(); ++i) {
      total += data[i].numel() * data[i].element_size();
      const c10::optional<at::Tensor> s = scales.get(i);
      if (s.has_value() && s->defined()) total += s->numel() * s->element_size();
    }
    return total;
  }
};

}  // namespace pagedq_quant

TORCH_LIBRARY_FRAGMENT(pagedq_quant, m) {
  m.class_<pagedq_quant::Linear>("Linear")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>,
                       c10::List<c10::optional<at::Tensor>>, c10::optional<at::Tensor>, int64_t,
                       std::vector<int64_t>>())
      .def("forward", &pagedq_quant::Linear::forward)
      .def("nbytes", &pagedq_quant::Linear::nbytes)
      .def_readonly("in_features", &pagedq_quant::Linear::in_features)
      .def_readonly("out_features", &pagedq_quant::Linear::out_features);
}
