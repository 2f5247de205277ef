// Shared declarations of the pagedq_cpu_ops library: the ops (library.cpp registers them; the
// fused layer calls them directly, without a dispatcher round trip), the instruction-set choice
// the callers pass, and the small AVX2 helpers several ops use.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace pagedq_cpu {

// The `isa` argument of the ops that have more than one vector path (pagedq.kernels.cpu_ops.Isa
// mirrors it). The backend selector picks it once from the CPU's features, so which path runs is
// the caller's stated choice, not a hidden global.
// kAvx512Vnni adds BW and VNNI (the packed-weight kernels' integer dot products); the skinny
// GEMV runs its AVX-512 tiles for it too. kAvx2Vnni is the AVX2 paths with AVX-VNNI (the 256-bit
// vpdpwssd: Intel Core from Alder Lake on, which has no AVX-512): the packed kernels' many-row
// panel fuses each vpmaddwd and its vpaddd (panel_gemv_vnni.cpp); everything else runs as kAvx2.
enum Isa : int64_t { kAvx2 = 0, kAvx512 = 1, kAvx512Vnni = 2, kAvx2Vnni = 3 };

// The whole library is compiled for AVX2 + FMA + F16C: every op checks that first, so a call on
// an older CPU (or through a stale build) is a clear error, not an illegal instruction.
inline void check_cpu() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  TORCH_CHECK(ok, "pagedq's C++ CPU kernels need AVX2, FMA and F16C, which this CPU lacks: run "
              "with PAGEDQ_CPU_KERNEL=0 (the PyTorch kernels)");
}

// The level this process may use (pagedq.kernels.cpu_features.ISA_LEVELS; here 0 = avx2 and
// avx2_vnni, 1 = avx512, 2 = avx512_vnni, 3 = amx): PAGEDQ_CPU_ISA caps it, as the Python selector
// does, so a capped process (the tests' way to run an AVX2 machine's paths on a bigger CPU)
// cannot reach a path above its level from C++ either.
inline std::string isa_cap_name() {
  const char* env = std::getenv("PAGEDQ_CPU_ISA");
  return env ? env : "";
}
inline int64_t isa_cap() {
  static const int64_t cap = [] {
    const std::string level = isa_cap_name();
    if (level == "avx2" || level == "avx2_vnni") return 0;
    if (level == "avx512") return 1;
    if (level == "avx512_vnni") return 2;
    return 3;
  }();
  return cap;
}

// Whether this compiler can target AVX-VNNI (gcc 11 or later: `-mavxvnni`,
// _mm256_dpwssd_avx_epi32). An older one builds panel_gemv_vnni.cpp and quant_gemv_vnni.cpp as
// calls to the AVX2 kernels, so isa kAvx2Vnni still runs (at AVX2's speed) and the library builds.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 11
#define PAGEDQ_AVX_VNNI_BUILD 0
#else
#define PAGEDQ_AVX_VNNI_BUILD 1
#endif

// AVX-VNNI (the VEX-encoded 256-bit vpdpwssd) is beside the chain of levels, not on it: the
// avx2_vnni level (an Intel Core without AVX-512) and amx have it; avx2 (a Zen 3), avx512 (a
// Skylake-X) and avx512_vnni (an Ice Lake or a Zen 4) do not, so a cap at those hides it.
inline bool avx_vnni_allowed() {
  static const bool ok = [] {
    const std::string level = isa_cap_name();
    return level != "avx2" && level != "avx512" && level != "avx512_vnni";
  }();
  return ok;
}

// Whether this CPU runs level `isa` and PAGEDQ_CPU_ISA allows it.
inline bool runs_isa(int64_t isa) {
  static const bool has_avx512 = isa_cap() >= 1 && __builtin_cpu_supports("avx512f") &&
                                 __builtin_cpu_supports("avx512vl") &&
                                 __builtin_cpu_supports("avx512dq");
  static const bool has_vnni = has_avx512 && isa_cap() >= 2 && __builtin_cpu_supports("avx512bw") &&
                               __builtin_cpu_supports("avx512vnni");
#if PAGEDQ_AVX_VNNI_BUILD
  static const bool has_avx_vnni = avx_vnni_allowed() && __builtin_cpu_supports("avxvnni");
#else
  static const bool has_avx_vnni = avx_vnni_allowed();  // isa 3 runs AVX2's kernels in this build
#endif
  return isa == kAvx2 || (isa == kAvx512 && has_avx512) || (isa == kAvx512Vnni && has_vnni) ||
         (isa == kAvx2Vnni && has_avx_vnni);
}

// A wrong `isa` would crash on an illegal instruction; refuse it with a message instead.
inline void check_isa(int64_t isa) {
  check_cpu();
  TORCH_CHECK(runs_isa(isa),
              "isa ", isa, " is not one this CPU runs (or PAGEDQ_CPU_ISA allows): pass 0 (AVX2), 1 "
              "(AVX-512) on a CPU with AVX-512F/VL/DQ, 2 (AVX-512 VNNI) on one that also has "
              "AVX-512BW/VNNI, or 3 (AVX2 with AVX-VNNI) on one with AVX-VNNI");
}

// The `precision` argument of quant_gemm (pagedq.kernels.cpu_ops.GemmPrecision mirrors it):
// kBf16x3 multiplies bf16 heads and tails of both operands (the dequantized fp32 product, to
// ~2^-16); kBf16 multiplies the weights and activations each rounded once to bf16 (one brgemm
// per tile, no tails: ~2^-8 per product, the model then follows a bf16 twin); kBf16x2 rounds the
// weights once and splits the activations (two brgemms: the product of the bf16-rounded weights
// with the fp32 activations, to ~2^-16). These three run on bf16 tiles (oneDNN's brgemm), which
// torch runs only on CPUs with AMX. kF32Tiles (any CPU) dequantizes tiles to fp32, multiplied
// by ATen's fp32 GEMM: the dequantized model's product, exactly.
enum GemmPrecision : int64_t { kBf16x3 = 0, kBf16 = 1, kBf16x2 = 2, kF32Tiles = 3 };

// Whether torch's bf16 brgemm runs here (oneDNN's micro-kernel with AMX; ONEDNN_MAX_CPU_ISA below
// AMX turns it off): the bf16 precisions need it.
bool bf16_tiles();

// quant_gemv's `acts`: the width its activations are rounded to per 32 values. 16 (the default)
// keeps the product to ~2^-15 of the dequantized model's; 8 is llama.cpp's rounding (~2^-8),
// opt-in: one byte product per weight (maddubs on AVX2, one vpdpbusd on VNNI) for Q8_0, Q4_0,
// Q4_1, Q4_K (and, grouped, Q5_0/Q5_1/Q5_K/Q6_K); the other formats keep int16.
constexpr int64_t kInt16Acts = 16, kInt8Acts = 8;
// A QuantLinear precision with this bit set runs its GEMV on int8 activations (kInt8Acts); the
// low bits are the GEMM's GemmPrecision.
constexpr int64_t kInt8ActsBit = 1 << 8;

inline void check_acts(int64_t acts) {
  TORCH_CHECK(acts == kInt16Acts || acts == kInt8Acts, "acts ", acts,
              " is not an activation width: pass 16 (int16, the default) or 8 (int8)");
}

inline void check_precision(int64_t precision) {
  precision &= ~kInt8ActsBit;
  TORCH_CHECK(precision == kBf16x3 || precision == kBf16 || precision == kBf16x2 ||
                  precision == kF32Tiles,
              "precision ", precision,
              " is not a GEMM precision: pass 0 (bf16x3), 1 (bf16), 2 (bf16x2) or 3 (fp32)");
  TORCH_CHECK(precision == kF32Tiles || bf16_tiles(), "GEMM precision ", precision,
              " multiplies bf16 tiles, which torch runs only on CPUs with AMX (this one lacks it, "
              "or ONEDNN_MAX_CPU_ISA hides it): pass precision 3 (fp32)");
}

// Horizontal sum of 8 floats.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0 (scores minus their max), Cephes-style polynomial, rel. error ~1e-7.
// Inputs below -87.3 are clamped (exp ~ 1e-38 instead of a denormal or 0).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i pow2 = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}

void paged_attention_rows(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_table,
                          const at::Tensor& rows, double scale, int64_t heads_per_item,
                          int64_t grain);
// Rows of x skinny_linear takes (it streams each weight row once for all of them);
// pagedq.kernels.cpu_ops.SKINNY_MAX_ROWS mirrors it.
constexpr int64_t kMaxSkinnyRows = 16;
void skinny_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w,
                   const c10::optional<at::Tensor>& bias, int64_t isa);
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps);
// out[r] = the index of row r's largest value: the first on ties, the first NaN where there is
// one (torch.max's), 0 for a row of -inf (argmax.cpp).
void argmax_rows(at::Tensor& out, const at::Tensor& x);
// x @ W.T (+ bias) straight from packed weights (quant_formats.h): the GEMV for few rows, the
// bf16-tile GEMM for many (quant_gemv.cpp, quant_gemm.cpp).
void quant_gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t fmt,
                const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& bias,
                int64_t isa, int64_t acts = kInt16Acts);
void quant_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t fmt,
                const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& bias,
                int64_t isa, int64_t precision);
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
                          double scale);

struct QuantLinear;
using QuantLinears = std::vector<c10::intrusive_ptr<QuantLinear>>;
at::Tensor decoder_layers_packed(const at::Tensor& x, const at::Tensor& rope, at::TensorList in_norm,
                                 const c10::List<c10::optional<at::Tensor>>& q_norm,
                                 const c10::List<c10::optional<at::Tensor>>& k_norm,
                                 at::TensorList post_norm, const QuantLinears& qkv,
                                 const QuantLinears& o, const QuantLinears& gate_up,
                                 const QuantLinears& down, at::TensorList k_caches,
                                 at::TensorList v_caches, const at::Tensor& slot_mapping,
                                 const at::Tensor& block_table, const at::Tensor& rows,
                                 int64_t num_heads, int64_t heads_per_item, int64_t grain,
                                 double eps, double scale);

}  // namespace pagedq_cpu
