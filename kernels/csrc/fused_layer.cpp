// Every Llama-family decoder layer of a step in one op, for CPU fp32 steps whose attention rows
// all go to the paged kernel (decodes and short prefill chunks).
//
// Why: the Python layer issues ~60 ATen calls per layer (norms, views, RoPE's mul/roll/addcmul,
// the KV scatter with its padding check, chunk, silu, mul, adds). At decode batch sizes each
// costs microseconds of dispatch and an OpenMP wake-up, which over a model's layers adds up to
// a sizeable share of a small step. Here the glue is plain loops between the same heavy kernels:
// RMSNorm, the projections (skinny GEMV for few rows, the oneDNN-prepacked weight otherwise),
// RoPE fused with the KV-cache write, paged attention, SiLU-and-multiply and the residuals. One
// call for all layers also means the engine thread releases the GIL once per step, not once
// per layer.
//
// Numerics follow the Python path (pagedq/worker/models/llama.py): RMSNorm and RoPE in fp32
// with the same folded-sign table, q/k RMSNorm (Qwen3) before RoPE, silu(gate) * up.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstdint>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu_ops.h"
#include "quant_linear.h"

namespace pagedq_cpu {
namespace {

// Rows a oneDNN GEMM runs on, as backend.py's padded_rows(): a bucket per 1/8 of a doubling (16
// rows at least), so a worker sees a few dozen GEMM shapes, not one per step's token count
// (oneDNN and glibc keep memory per shape).
inline int64_t padded_rows(int64_t rows) {
  const int64_t top = int64_t(1) << (63 - __builtin_clzll(static_cast<uint64_t>(rows)));
  const int64_t step = std::max<int64_t>(16, top / 8);
  return (rows + step - 1) / step * step;
}

// x @ w.T + bias by the route the Python linear takes for this many rows (the backend's
// LinearChoice): the skinny GEMV up to skinny_max_rows, the oneDNN-packed copy when there is
// one, ATen's linear otherwise.
at::Tensor project(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& packed,
                   const c10::optional<at::Tensor>& bias, int64_t skinny_max_rows, int64_t isa) {
  if (x.size(0) <= skinny_max_rows) {
    at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
    skinny_linear(out, x, w, bias, isa);
    return out;
  }
  if (!packed.has_value() || !packed->defined()) return at::linear(x, w, bias);
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const int64_t rows = x.size(0), padded = padded_rows(rows);
  const at::Tensor in = padded == rows
      ? x : at::cat({x, at::zeros({padded - rows, x.size(1)}, x.options())});
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(in);
  stack.emplace_back(*packed);
  stack.emplace_back(bias);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  const at::Tensor out = stack.back().toTensor();
  return padded == rows ? out : out.narrow(0, 0, rows);
}

// dst[d] = rope(src)[d] with an optional per-head RMSNorm first (Qwen3's q_norm / k_norm).
// rope(x)[d] = x[d] * cos[d] + x[(d + D/2) % D] * signed_sin[d] (rotate_half folded in the table).
inline void norm_rope(const float* src, const float* norm_w, float eps, const float* cos,
                      const float* ssin, int64_t D, float* dst, float* tmp) {
  const float* x = src;
  if (norm_w != nullptr) {
    float ss = 0.f;
    for (int64_t d = 0; d < D; ++d) ss += src[d] * src[d];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
    for (int64_t d = 0; d < D; ++d) tmp[d] = norm_w[d] * (src[d] * inv);
    x = tmp;
  }
  const int64_t half = D / 2;  // two loops, not one with (d + half) % D: they vectorize
  for (int64_t d = 0; d < half; ++d) dst[d] = x[d] * cos[d] + x[d + half] * ssin[d];
  for (int64_t d = half; d < D; ++d) dst[d] = x[d] * cos[d] + x[d - half] * ssin[d];
}

// Rotates q into q_out [T, NH, D] and k into its cache slot; copies v into its slot. Tokens with
// slot < 0 (padding) write nothing to the cache. CT is the cache dtype: float, or float16/bfloat16
// (rounded from the fp32 values on the way in).
template <typename CT>
void rope_and_cache(const at::Tensor& qkv, const at::Tensor& rope, const float* q_norm,
                    const float* k_norm, float eps, int64_t num_heads, int64_t num_kv_heads,
                    at::Tensor& q_out, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping) {
  const int64_t T = qkv.size(0), D = q_out.size(2), bs = k_cache.size(1);
  const int64_t width = qkv.size(1);
  const float* src = qkv.data_ptr<float>();
  const float* table = rope.data_ptr<float>();  // [T, 2, D]
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  float* q = q_out.data_ptr<float>();
  CT* kc = k_cache.data_ptr<CT>();
  CT* vc = v_cache.data_ptr<CT>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const int64_t heads = num_heads + num_kv_heads;
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> tmp(D), kbuf(D);
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = src + t * width;
      const float* cos = table + t * 2 * D;
      const float* ssin = cos + D;
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < num_heads; ++h)
        norm_rope(row + h * D, q_norm, eps, cos, ssin, D, q + (t * num_heads + h) * D, tmp.data());
      if (slot < 0) continue;
      const int64_t blk = slot / bs, off = slot % bs;
      for (int64_t j = 0; j < num_kv_heads; ++j) {
        CT* kdst = kc + blk * ks0 + off * ks1 + j * ks2;
        CT* vdst = vc + blk * vs0 + off * vs1 + j * vs2;
        const float* v = row + (heads + j) * D;
        norm_rope(row + (num_heads + j) * D, k_norm, eps, cos, ssin, D, kbuf.data(), tmp.data());
        for (int64_t d = 0; d < D; ++d) {  // identity for a float cache, rounding otherwise
          kdst[d] = static_cast<CT>(kbuf[d]);
          vdst[d] = static_cast<CT>(v[d]);
        }
      }
    }
  });
}

// dst += src, the residual adds: a plain loop over contiguous fp32 rows where ATen's add_ (its
// dispatch and TensorIterator set-up) took longer than the add itself at a few rows.
void add_into(at::Tensor& dst, const at::Tensor& src) {
  if (!(dst.is_contiguous() && src.is_contiguous() && dst.scalar_type() == at::kFloat &&
        src.scalar_type() == at::kFloat && dst.numel() == src.numel())) {
    dst.add_(src);
    return;
  }
  float* d = dst.data_ptr<float>();
  const float* a = src.data_ptr<float>();
  at::parallel_for(0, dst.numel(), 1 << 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) d[i] += a[i];
  });
}

// out[t, i] = silu(gu[t, i]) * gu[t, I + i]; silu(g) = g * sigmoid(g), computed from
// e = exp(-|g|) <= 1 so it never overflows.
at::Tensor silu_mul(const at::Tensor& gu) {
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gu.options());
  const float* src = gu.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = src + t * 2 * I;
      const float* u = g + I;
      float* o = dst + t * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp8(_mm256_or_ps(gv, sign));  // exp(-|g|)
        const __m256 num = _mm256_blendv_ps(one, e, gv);  // g < 0: e / (1 + e)
        const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
      }
      for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

const float* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr<float>() : nullptr;
}

// x -> x @ W^T (+ bias) for one projection: the dense route above, or a QuantLinear's.
using Project = std::function<at::Tensor(const at::Tensor&)>;

// One layer's weights, whatever form its projections take.
struct LayerWeights {
  const at::Tensor& in_norm;
  const at::Tensor& post_norm;
  c10::optional<at::Tensor> q_norm, k_norm;
  Project qkv, o, gate_up, down;
};

// What every layer of the step shares.
struct StepArgs {
  const at::Tensor& rope;
  const at::Tensor& slot_mapping;
  const at::Tensor& block_table;
  const at::Tensor& rows;
  int64_t num_heads, heads_per_item, grain;
  double eps, scale;
};

// One decoder layer: x [T, hidden] -> x after attention and MLP, K/V of the new tokens written.
at::Tensor layer(const at::Tensor& x, const LayerWeights& w, at::Tensor& k_cache,
                 at::Tensor& v_cache, const StepArgs& s) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "decoder_layers: x must be contiguous CPU fp32 [T, hidden]");
  const auto cache_dtype = k_cache.scalar_type();
  TORCH_CHECK((cache_dtype == at::kFloat || cache_dtype == at::kHalf ||
               cache_dtype == at::kBFloat16) &&
                  v_cache.scalar_type() == cache_dtype && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1,
              "decoder_layers: float32, float16 or bfloat16 caches with a contiguous head_dim");
  const int64_t T = x.size(0), num_kv_heads = k_cache.size(2), D = k_cache.size(3);
  const int64_t num_heads = s.num_heads;
  TORCH_CHECK(s.rope.is_contiguous() && s.rope.size(0) == T && s.rope.size(1) == 2 &&
                  s.rope.size(2) == D,
              "decoder_layers: rope must be contiguous [T, 2, head_dim]");
  TORCH_CHECK(s.slot_mapping.scalar_type() == at::kLong && s.slot_mapping.is_contiguous() &&
                  s.slot_mapping.numel() == T,
              "decoder_layers: slot_mapping must be contiguous int64 [T]");
  const float feps = static_cast<float>(s.eps);

  // Named scopes: torch.profiler shows where a fused step's time goes (no-ops when no profiler
  // runs; docs/engine.md, "Where a step's time goes").
  at::Tensor h = at::empty_like(x);
  rms_norm(h, x, w.in_norm, s.eps);
  at::Tensor qkv;
  {
    RECORD_FUNCTION("pagedq::qkv_proj", std::vector<c10::IValue>());
    qkv = w.qkv(h);
  }
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "decoder_layers: qkv width");
  at::Tensor q = at::empty({T, num_heads, D}, x.options());
  at::Tensor o = at::empty({T, num_heads, D}, x.options());
  {
    RECORD_FUNCTION("pagedq::rope_attention", std::vector<c10::IValue>());
    const float* qn = data_or_null(w.q_norm);
    const float* kn = data_or_null(w.k_norm);
    if (cache_dtype == at::kHalf)
      rope_and_cache<c10::Half>(qkv, s.rope, qn, kn, feps, num_heads, num_kv_heads, q, k_cache,
                                v_cache, s.slot_mapping);
    else if (cache_dtype == at::kBFloat16)
      rope_and_cache<c10::BFloat16>(qkv, s.rope, qn, kn, feps, num_heads, num_kv_heads, q,
                                    k_cache, v_cache, s.slot_mapping);
    else
      rope_and_cache<float>(qkv, s.rope, qn, kn, feps, num_heads, num_kv_heads, q, k_cache,
                            v_cache, s.slot_mapping);
    paged_attention_rows(o, q, k_cache, v_cache, s.block_table, s.rows, s.scale,
                         s.heads_per_item, s.grain);
  }
  at::Tensor x1, out;
  {
    RECORD_FUNCTION("pagedq::o_proj", std::vector<c10::IValue>());
    x1 = w.o(o.view({T, num_heads * D}));
  }
  add_into(x1, x);
  rms_norm(h, x1, w.post_norm, s.eps);
  {
    RECORD_FUNCTION("pagedq::mlp", std::vector<c10::IValue>());
    out = w.down(silu_mul(w.gate_up(h)));
  }
  add_into(out, x1);
  return out;
}

c10::optional<at::Tensor> item(const c10::List<c10::optional<at::Tensor>>& list, size_t i) {
  return list.size() > i ? list.get(i) : c10::nullopt;
}

}  // namespace

// Lists hold one entry per layer (optional lists may be empty when no layer has the tensor).
at::Tensor decoder_layers(const at::Tensor& x, const at::Tensor& rope, at::TensorList in_norm,
                          at::TensorList qkv_w, const c10::List<c10::optional<at::Tensor>>& qkv_packed,
                          const c10::List<c10::optional<at::Tensor>>& qkv_bias,
                          const c10::List<c10::optional<at::Tensor>>& q_norm,
                          const c10::List<c10::optional<at::Tensor>>& k_norm, at::TensorList o_w,
                          const c10::List<c10::optional<at::Tensor>>& o_packed,
                          const c10::List<c10::optional<at::Tensor>>& o_bias,
                          at::TensorList post_norm, at::TensorList gate_up_w,
                          const c10::List<c10::optional<at::Tensor>>& gate_up_packed,
                          at::TensorList down_w,
                          const c10::List<c10::optional<at::Tensor>>& down_packed,
                          at::TensorList k_caches, at::TensorList v_caches,
                          const at::Tensor& slot_mapping, const at::Tensor& block_table,
                          const at::Tensor& rows, int64_t num_heads, int64_t heads_per_item,
                          int64_t grain, int64_t skinny_max_rows, int64_t isa, double eps,
                          double scale) {
  const size_t layers = qkv_w.size();
  TORCH_CHECK(in_norm.size() == layers && o_w.size() == layers && post_norm.size() == layers &&
                  gate_up_w.size() == layers && down_w.size() == layers &&
                  k_caches.size() == layers && v_caches.size() == layers,
              "decoder_layers: one entry per layer in every weight and cache list");
  check_isa(isa);
  const StepArgs step{rope, slot_mapping, block_table, rows, num_heads, heads_per_item, grain,
                      eps, scale};
  auto dense = [&](const at::Tensor& w, c10::optional<at::Tensor> packed,
                   c10::optional<at::Tensor> bias) -> Project {
    return [&w, packed, bias, skinny_max_rows, isa](const at::Tensor& in) {
      return project(in, w, packed, bias, skinny_max_rows, isa);
    };
  };
  at::Tensor h = x;
  for (size_t i = 0; i < layers; ++i) {
    at::Tensor k_cache = k_caches[i], v_cache = v_caches[i];
    const LayerWeights w{in_norm[i], post_norm[i], item(q_norm, i), item(k_norm, i),
                         dense(qkv_w[i], item(qkv_packed, i), item(qkv_bias, i)),
                         dense(o_w[i], item(o_packed, i), item(o_bias, i)),
                         dense(gate_up_w[i], item(gate_up_packed, i), c10::nullopt),
                         dense(down_w[i], item(down_packed, i), c10::nullopt)};
    h = layer(h, w, k_cache, v_cache, step);
  }
  return h;
}

// The same layers with packed projections (QuantLinear: GGUF blocks, int8/int4, bf16 rows).
at::Tensor decoder_layers_packed(const at::Tensor& x, const at::Tensor& rope, at::TensorList in_norm,
                                 const c10::List<c10::optional<at::Tensor>>& q_norm,
                                 const c10::List<c10::optional<at::Tensor>>& k_norm,
                                 at::TensorList post_norm, const QuantLinears& qkv,
                                 const QuantLinears& o, const QuantLinears& gate_up,
                                 const QuantLinears& down, at::TensorList k_caches,
                                 at::TensorList v_caches, const at::Tensor& slot_mapping,
                                 const at::Tensor& block_table, const at::Tensor& rows,
                                 int64_t num_heads, int64_t heads_per_item, int64_t grain,
                                 double eps, double scale) {
  check_cpu();
  const size_t layers = qkv.size();
  TORCH_CHECK(in_norm.size() == layers && o.size() == layers && post_norm.size() == layers &&
                  gate_up.size() == layers && down.size() == layers &&
                  k_caches.size() == layers && v_caches.size() == layers,
              "decoder_layers_packed: one entry per layer in every weight and cache list");
  const StepArgs step{rope, slot_mapping, block_table, rows, num_heads, heads_per_item, grain,
                      eps, scale};
  auto packed = [](const c10::intrusive_ptr<QuantLinear>& lin) -> Project {
    return [lin](const at::Tensor& in) { return lin->forward(in); };
  };
  at::Tensor h = x;
  for (size_t i = 0; i < layers; ++i) {
    at::Tensor k_cache = k_caches[i], v_cache = v_caches[i];
    const LayerWeights w{in_norm[i], post_norm[i], item(q_norm, i), item(k_norm, i),
                         packed(qkv[i]), packed(o[i]), packed(gate_up[i]), packed(down[i])};
    h = layer(h, w, k_cache, v_cache, step);
  }
  return h;
}

}  // namespace pagedq_cpu
