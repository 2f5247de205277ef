// The ops of pagedq_cpu_ops, registered as torch.ops.pagedq_cpu.* (no pybind: the light
// headers keep the one-off compile short). One place lists every op and its schema; each op
// lives in the source file named after it.

#include <torch/library.h>

#include "cpu_ops.h"
#include "quant_linear.h"

TORCH_LIBRARY(pagedq_cpu, m) {
  m.def(
      "paged_attention_rows(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
      "Tensor block_table, Tensor rows, float scale, int heads_per_item, int grain) -> ()");
  m.def("skinny_linear(Tensor(a!) out, Tensor x, Tensor w, Tensor? bias, int isa) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor w, float eps) -> ()");
  m.def("argmax_rows(Tensor(a!) out, Tensor x) -> ()");
  m.def(
      "decoder_layers(Tensor x, Tensor rope, Tensor[] in_norm, Tensor[] qkv_w, "
      "Tensor?[] qkv_packed, Tensor?[] qkv_bias, Tensor?[] q_norm, Tensor?[] k_norm, "
      "Tensor[] o_w, Tensor?[] o_packed, Tensor?[] o_bias, Tensor[] post_norm, "
      "Tensor[] gate_up_w, Tensor?[] gate_up_packed, Tensor[] down_w, Tensor?[] down_packed, "
      "Tensor[] k_caches, Tensor[] v_caches, Tensor slot_mapping, Tensor block_table, "
      "Tensor rows, int num_heads, int heads_per_item, int grain, int skinny_max_rows, int isa, "
      "float eps, float scale) -> Tensor");
  m.def("quant_gemv(Tensor(a!) out, Tensor x, Tensor w, int fmt, Tensor? scales, Tensor? bias, "
        "int isa, int acts=16) -> ()");
  m.def("quant_gemm(Tensor(a!) out, Tensor x, Tensor w, int fmt, Tensor? scales, Tensor? bias, "
        "int isa, int precision=0) -> ()");
  m.def("bf16_tiles() -> bool", &pagedq_cpu::bf16_tiles);
  using pagedq_cpu::QuantLinear;
  m.class_<QuantLinear>("QuantLinear")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>,
                       c10::List<c10::optional<at::Tensor>>, c10::optional<at::Tensor>, int64_t,
                       std::vector<int64_t>, int64_t, int64_t>())
      .def("forward", &QuantLinear::forward)
      .def("nbytes", &QuantLinear::nbytes)
      .def_readonly("in_features", &QuantLinear::in_features)
      .def_readonly("out_features", &QuantLinear::out_features)
      .def_readonly("precision", &QuantLinear::precision);
  m.def(
      "decoder_layers_packed(Tensor x, Tensor rope, Tensor[] in_norm, Tensor?[] q_norm, "
      "Tensor?[] k_norm, Tensor[] post_norm, __torch__.torch.classes.pagedq_cpu.QuantLinear[] qkv, "
      "__torch__.torch.classes.pagedq_cpu.QuantLinear[] o, "
      "__torch__.torch.classes.pagedq_cpu.QuantLinear[] gate_up, "
      "__torch__.torch.classes.pagedq_cpu.QuantLinear[] down, Tensor[] k_caches, "
      "Tensor[] v_caches, Tensor slot_mapping, Tensor block_table, Tensor rows, int num_heads, "
      "int heads_per_item, int grain, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedq_cpu, CPU, m) {
  m.impl("paged_attention_rows", &pagedq_cpu::paged_attention_rows);
  m.impl("skinny_linear", &pagedq_cpu::skinny_linear);
  m.impl("rms_norm", &pagedq_cpu::rms_norm);
  m.impl("argmax_rows", &pagedq_cpu::argmax_rows);
  m.impl("decoder_layers", &pagedq_cpu::decoder_layers);
  m.impl("quant_gemv", &pagedq_cpu::quant_gemv);
  m.impl("quant_gemm", &pagedq_cpu::quant_gemm);
  m.impl("decoder_layers_packed", &pagedq_cpu::decoder_layers_packed);
}

// The oneDNN-packed weights are MkldnnCPU tensors, so the dispatcher picks that key for
// decoder_layers, which takes them.
TORCH_LIBRARY_IMPL(pagedq_cpu, MkldnnCPU, m) {
  m.impl("decoder_layers", &pagedq_cpu::decoder_layers);
}
