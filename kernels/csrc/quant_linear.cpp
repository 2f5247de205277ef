// QuantLinear's methods (quant_linear.h); library.cpp registers the class.

#include "int16_acts.h"
#include "quant_linear.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>

#include "quant_formats.h"

#include "cpu_ops.h"

namespace pagedq_cpu {
namespace {

// fp32 rows: the skinny GEMV for few rows (its AVX-512 tiles when isa allows), else ATen.
at::Tensor dense(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                 bool skinny, int64_t isa) {
  if (!skinny || x.size(0) > kMaxSkinnyRows) return at::linear(x, w, bias);
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  skinny_linear(out, x, w, bias, isa);
  return out;
}

}  // namespace

QuantLinear::QuantLinear(std::vector<at::Tensor> data_, std::vector<int64_t> fmts_,
                         c10::List<c10::optional<at::Tensor>> scales_,
                         c10::optional<at::Tensor> bias_, int64_t in_features_,
                         std::vector<int64_t> gemv_max_rows_, int64_t isa_,
                         int64_t precision_)
    : data(std::move(data_)), fmts(std::move(fmts_)), scales(std::move(scales_)),
      bias(std::move(bias_)), gemv_max_rows(std::move(gemv_max_rows_)),
      in_features(in_features_), isa(isa_), precision(precision_) {
  check_isa(isa);
  check_precision(precision);
  TORCH_CHECK(!data.empty() && fmts.size() == data.size() && scales.size() == data.size() &&
                  gemv_max_rows.size() == data.size(),
              "QuantLinear: one format, scales entry and GEMV row limit per segment");
  for (const at::Tensor& d : data) out_features += d.size(0);
  TORCH_CHECK(!bias.has_value() || !bias->defined() || bias->numel() == out_features,
              "QuantLinear: bias must have one entry per output");
}

// Whether every segment takes one GEMV kernel at this many rows, which then runs them as one
// call (the activations split or quantized once, one parallel region): the grouped VNNI GEMV,
// or below VNNI the AVX2 GEMV on int16 activations over GGUF rows.
bool QuantLinear::one_gemv(int64_t rows) const {
  if (data.size() < 2) return false;
  const bool vnni = isa == kAvx512Vnni;
  // byte_gemv runs its formats alone; from kPanelRows on the panels take them (gemv_parts)
  if (!vnni && (precision & kInt8ActsBit) && rows < v256::kPanelRows) return false;
  for (size_t i = 0; i < data.size(); ++i) {
    if (rows > gemv_max_rows[i]) return false;
    if (vnni ? !(fmts[i] & kGrouped) : (fmts[i] == kF32 || fmts[i] == kBF16)) return false;
  }
  return true;
}

at::Tensor QuantLinear::parts_forward(const at::Tensor& x) const {
  check_isa(isa);
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  std::vector<LinearArgs> parts;
  parts.reserve(data.size());
  int64_t col = 0;
  for (size_t i = 0; i < data.size(); ++i) {  // each part's columns of out (and of the bias)
    parts.push_back(check_linear("quant_linear", out, x, data[i], fmts[i], scales.get(i), bias, col));
    col += data[i].size(0);
  }
  const int64_t count = static_cast<int64_t>(parts.size());
  if (isa == kAvx512Vnni)
    v512::group_gemv_parts(parts.data(), count, (precision & kInt8ActsBit) != 0);
  else
    v256::gemv_parts(parts.data(), count, isa, (precision & kInt8ActsBit) != 0);
  return out;
}

at::Tensor QuantLinear::forward(const at::Tensor& x) const {
  if (one_gemv(x.size(0))) return parts_forward(x);
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  int64_t col = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    const int64_t n = data[i].size(0);
    at::Tensor part = out.narrow(1, col, n);
    c10::optional<at::Tensor> b;
    if (bias.has_value() && bias->defined()) b = bias->narrow(0, col, n);
    if (fmts[i] == kF32)  // a tensor the packed kernels do not read, kept as fp32 rows
      part.copy_(dense(x, data[i], b, x.size(0) <= gemv_max_rows[i], isa));
    else if (x.size(0) <= gemv_max_rows[i])
      quant_gemv(part, x, data[i], fmts[i], scales.get(i), b, isa,
                 precision & kInt8ActsBit ? kInt8Acts : kInt16Acts);
    else
      quant_gemm(part, x, data[i], fmts[i], scales.get(i), b, isa, precision & ~kInt8ActsBit);
    col += n;
  }
  return out;
}

int64_t QuantLinear::nbytes() const {
  int64_t total = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    total += data[i].numel() * data[i].element_size();
    const c10::optional<at::Tensor> s = scales.get(i);
    if (s.has_value() && s->defined()) total += s->numel() * s->element_size();
  }
  return total;
}

}  // namespace pagedq_cpu
