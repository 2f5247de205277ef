// Packed weight formats the quantized kernels read in place, and the activation layout they
// share (pagedq/worker/models/quant.py documents the formats; its dequantizers are the tests'
// reference).
//
// Every kernel reduces a weight row to "chunks" of 64 codes. Within a chunk, lane l (codes
// 4l..4l+3) has one scale ws[l] and one offset wm[l]: weight = ws[l] * code + wm[l]. The codes
// of one chunk are in the order one SIMD decode produces them; for the 32-element nibble formats
// that order interleaves two blocks (see chunk_position), and the activations are stored in the
// same order instead of shuffling the weights. The AVX-512 kernels decode in registers
// (quant_avx512.h); the portable dequantizer here (dequant_row_f32) serves the AVX2 paths.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pagedq_cpu {

// GGML's type ids for the GGUF formats (kBF16: plain bf16 rows, multiplied as they are); kInt8 is
// pagedq's per-channel int8 (scales beside).
enum Format : int64_t {
  kF32 = 0, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30, kInt8 = 100,
};

// A format code with this bit set: the same blocks regrouped 16 rows at a time (group_gemv.cpp
// describes the layout), which the one-row GEMV reads without shuffling.
constexpr int64_t kGrouped = 1 << 10;
constexpr int64_t kGroupRows = 16;

// Formats that can be regrouped: the 32-element blocks of one fp16 scale (and min) and the
// K-quants.
inline bool groupable(int64_t fmt) {
  return fmt == kQ4_0 || fmt == kQ4_1 || fmt == kQ5_0 || fmt == kQ5_1 || fmt == kQ8_0 ||
         fmt == kQ4_K || fmt == kQ5_K || fmt == kQ6_K;
}

// Slot of row r within its group for the code fields (scales keep row order): the order in which
// group_gemv's reduction leaves the rows' sums, so its output lanes come out in row order.
inline int64_t group_slot(int64_t fmt, int64_t r) {
  if (fmt == kQ8_0 || fmt == kQ4_K || fmt == kQ5_K)  // 2 rows per vector
    return 8 * (r / 8) + 2 * (r % 4) + (r / 4) % 2;
  return 4 * (r % 4) + r / 4;  // nibble formats and Q6_K: 4 rows per vector
}

constexpr int64_t kChunk = 64;  // codes per chunk
constexpr int64_t kLanesPerChunk = kChunk / 4;
constexpr int64_t kActBlock = 32;  // activations are quantized per 32 values

// Elements per block and bytes per block of each format (kInt8: one byte per element).
inline bool format_size(int64_t fmt, int64_t& block, int64_t& bytes) {
  switch (fmt) {
    case kQ4_0: block = 32; bytes = 18; return true;
    case kQ4_1: block = 32; bytes = 20; return true;
    case kQ5_0: block = 32; bytes = 22; return true;
    case kQ5_1: block = 32; bytes = 24; return true;
    case kQ8_0: block = 32; bytes = 34; return true;
    case kQ4_K: block = 256; bytes = 144; return true;
    case kQ5_K: block = 256; bytes = 176; return true;
    case kQ6_K: block = 256; bytes = 210; return true;
    case kBF16: block = 1; bytes = 2; return true;
    case kInt8: block = 1; bytes = 1; return true;
    default: return false;
  }
}

inline int64_t block_bytes(int64_t fmt) {
  int64_t block = 0, bytes = 0;
  format_size(fmt, block, bytes);
  return bytes;
}

// The nibble formats (Q4_0, Q4_1, Q5_0, Q5_1) decode two blocks per chunk as
// [block0 0-15, block1 0-15, block0 16-31, block1 16-31]: low nibbles of both, then high.
inline bool nibble_order(int64_t fmt) {
  return fmt == kQ4_0 || fmt == kQ4_1 || fmt == kQ5_0 || fmt == kQ5_1;
}

// Chunk position of element e of a row (the activations are stored at these positions).
inline int64_t chunk_position(int64_t e, bool nibbles) {
  if (!nibbles) return e;
  const int64_t chunk = e / kChunk, r = e % kChunk, blk = r / 32, t = r % 32;
  return chunk * kChunk + (t < 16 ? 0 : 32) + blk * 16 + t % 16;
}

// Software prefetch of weights while they are read (the row-at-a-time GEMVs of quant_gemv.cpp
// and byte_gemv.cpp, the grouped one of group_gemv.cpp): the lines ``ahead`` bytes past
// [at, at + bytes), into L2. Each kernel calls it once per chunk it reads (8 blocks, 256 codes,
// 32 bf16 values, a grouped block), so the misses overlap the compute a line or two at a time.
// Why: those kernels first prefetched each whole row at once, and the burst stalled on the L1
// fill buffers: 71% of the AVX2 one-row GEMV's samples sat on the instruction after a
// prefetcht0, and it read 12-15 GB/s where the memory streams 23 (Intel Xeon with AMX capped at
// avx2, 2 threads, the 1.7B shape's matrices); spread, 18-21 GB/s. Into L2 and 3 KB ahead
// measured best of 1-8 KB into L1 or L2 (Q8_0 20.6 GB/s against 17.3 into L1 at 2 KB; the
// K-quants within 3% of their best).
constexpr uintptr_t kAheadBytes = 3072;
// The grouped VNNI GEMV and the 512-bit K-quant rows (quant_gemv_bw.cpp) reach further: their
// chunks are short in time against a DRAM miss, and from two activation rows on the products of
// a chunk outlasted a 3 KB lead, so the memory stream paused while they ran (the 1.7B shape's
// one-row GEMV 17.6 ms a pass, two rows 21.5, three 25: each row's products added, not
// overlapped). 8 KB ahead (AMD EPYC Zen 5, 2 threads, `quant_kernels --shapes memory`, Q4_1 /
// Q4_K / Q8_0): two rows 22.0 / 19.9 / 31.9 -> 18.6 / 15.5 / 27.8 ms, three 25.7-27.6 / 23.9-24.5 /
// 34.7-35.7 -> 22.2 / 18.8 / 31.4, one row of Q4_1 / Q4_K 2-12% faster (Q8_0's one row 6% slower:
// it keeps 3 KB); 6-12 KB alike, 16 KB slower. In the engine (native level): one stream of the
// 1.7B shape's Q4_K_M 18.9-20.2 -> 16.6-18.6 ms a step, three streams 30.9-35.5 -> 27.1-30.3, the
// bundled Q4_1 model's one stream 369-396 -> 398-425 tok/s; the 512-bit K-quant rows (level
// avx512) one stream 23.2-25.5 -> 21.5-23.7 ms.
constexpr uintptr_t kAheadBytesFar = 8192;
inline void prefetch_ahead(const uint8_t* at, int64_t bytes, uintptr_t ahead = kAheadBytes) {
  const uintptr_t from = reinterpret_cast<uintptr_t>(at) + ahead;
  for (uintptr_t line = from & ~uintptr_t(63); line < from + bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
}

// The whole row 4 KB ahead into L1 at once: kept for the AVX2 GEMVs' passes of four or more
// activation rows, which are compute-bound (each row's decode serves up to 8 of them): there
// prefetch_ahead measured 3-8% slower (Q8_0 at 64 rows, the bundled model's matrices).
inline void prefetch_row(const uint8_t* row, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row + 4096 + off), _MM_HINT_T0);
}

// One fp16 to fp32 in one F16C instruction (the library requires F16C; c10::Half's portable
// conversion took ~10 integer ops, twice per 32-block in the AVX2 GEMV).
inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins.
inline void k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// Portable dequantization of one weight row to K floats in natural order (the AVX2 paths: no
// chunk order there). Each block's arithmetic is GGML's: an fp16 scale times a small integer,
// plus an offset; `scale` is the int8 row scale.
inline void dequant_row_f32(int64_t fmt, const uint8_t* row, int64_t K, float scale, float* out) {
  switch (fmt) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: {
      const int64_t bytes = fmt == kQ4_0 ? 18 : fmt == kQ4_1 ? 20 : fmt == kQ5_0 ? 22 : 24;
      const bool has_min = fmt == kQ4_1 || fmt == kQ5_1, five = fmt == kQ5_0 || fmt == kQ5_1;
      const int64_t qs_off = (has_min ? 4 : 2) + (five ? 4 : 0);
      for (int64_t b = 0; b < K / 32; ++b, out += 32) {
        const uint8_t* blk = row + b * bytes;
        uint32_t qh = 0;
        if (five) std::memcpy(&qh, blk + (has_min ? 4 : 2), 4);
        const float d = fp16(blk);
        const float m = has_min ? fp16(blk + 2) : -(five ? 16.f : 8.f) * d;
        for (int t = 0; t < 16; ++t) {
          const uint8_t byte = blk[qs_off + t];
          const int lo = (byte & 0x0F) | (five ? ((qh >> t) & 1) << 4 : 0);
          const int hi = (byte >> 4) | (five ? ((qh >> (t + 16)) & 1) << 4 : 0);
          out[t] = d * static_cast<float>(lo) + m;
          out[t + 16] = d * static_cast<float>(hi) + m;
        }
      }
      break;
    }
    case kQ8_0:
      for (int64_t b = 0; b < K / 32; ++b, out += 32) {
        const uint8_t* blk = row + b * 34;
        const float d = fp16(blk);
        const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
        for (int t = 0; t < 32; ++t) out[t] = d * static_cast<float>(q[t]);
      }
      break;
    case kInt8: {
      const int8_t* q = reinterpret_cast<const int8_t*>(row);
      for (int64_t k = 0; k < K; ++k) out[k] = scale * static_cast<float>(q[k]);
      break;
    }
    case kBF16:  // the upper half of an fp32: widened exactly
      for (int64_t k = 0; k < K; ++k) {
        uint16_t h;
        std::memcpy(&h, row + 2 * k, 2);
        const uint32_t bits = static_cast<uint32_t>(h) << 16;
        std::memcpy(out + k, &bits, 4);
      }
      break;
    case kQ4_K: case kQ5_K: {
      const int64_t bytes = fmt == kQ4_K ? 144 : 176;
      for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t* blk = row + sb * bytes;
        const float d = fp16(blk), dmin = fp16(blk + 2);
        uint8_t sc[8], mn[8];
        k_scales(blk + 4, sc, mn);
        const uint8_t* qh = blk + 16;
        const uint8_t* qs = blk + (fmt == kQ4_K ? 16 : 48);
        for (int j = 0; j < 8; ++j, out += 32) {  // sub-block j: nibbles of qs[32 (j/2) ...], qh bit j
          const float s = d * sc[j], m = -(dmin * mn[j]);
          for (int t = 0; t < 32; ++t) {
            const uint8_t byte = qs[(j / 2) * 32 + t];
            int code = j % 2 ? byte >> 4 : byte & 0x0F;
            if (fmt == kQ5_K) code |= ((qh[t] >> j) & 1) << 4;
            out[t] = s * static_cast<float>(code) + m;
          }
        }
      }
      break;
    }
    case kQ6_K:
      for (int64_t sb = 0; sb < K / 256; ++sb, out += 256) {
        const uint8_t* blk = row + sb * 210;
        const uint8_t* ql = blk;
        const uint8_t* qh = blk + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        const float d = fp16(blk + 208);
        for (int e = 0; e < 256; ++e) {
          const int half = e / 128, r = e % 128, quarter = r / 32, t = r % 32;
          const uint8_t l = ql[half * 64 + (quarter % 2) * 32 + t];
          const int low = quarter < 2 ? l & 0x0F : l >> 4;
          const int high = (qh[half * 32 + t] >> (2 * quarter)) & 3;
          out[e] = (d * sc[e / 16]) * static_cast<float>((low | (high << 4)) - 32);
        }
      }
      break;
  }
}

// f(W{}) with the decoder ("walker") type an ISA's namespace has for fmt: the same dispatch for
// the AVX-512 and the AVX2 decoders (their namespaces name their walkers alike). Returns false
// for a format no walker decodes (bf16 rows, fp32).
template <template <int64_t> class Nibble32, class Q8_0, class Int8,
          template <int64_t> class KQuant45, class Q6_K, class F>
inline bool visit_walker(int64_t fmt, F&& f) {
  switch (fmt) {
    case kQ4_0: f(Nibble32<kQ4_0>{}); return true;
    case kQ4_1: f(Nibble32<kQ4_1>{}); return true;
    case kQ5_0: f(Nibble32<kQ5_0>{}); return true;
    case kQ5_1: f(Nibble32<kQ5_1>{}); return true;
    case kQ8_0: f(Q8_0{}); return true;
    case kInt8: f(Int8{}); return true;
    case kQ4_K: f(KQuant45<kQ4_K>{}); return true;
    case kQ5_K: f(KQuant45<kQ5_K>{}); return true;
    case kQ6_K: f(Q6_K{}); return true;
    default: return false;
  }
}

// The checked arguments of quant_gemv / quant_gemm: out[rows, N] = x[rows, K] @ W^T (+ bias).
// out may be a column slice of a wider matrix (row stride ldo): fused projections (q, k and v
// of different formats) write their parts of one output.
struct LinearArgs {
  int64_t fmt, rows, K, N, row_bytes, ldo;  // fmt without the kGrouped bit
  bool grouped;  // rows grouped 16 at a time (kGrouped)
  const float* x;
  const uint8_t* w;
  const float* scales;  // kInt8 row scales, else null
  const float* bias;    // or null
  float* out;
};

// The row-at-a-time GEMVs' prefetching (prefetch_ahead above): a pass of one to three activation
// rows prefetches as it reads, kRowPrefetchRows or more (compute-bound) whole rows (prefetch_row).
constexpr int64_t kRowPrefetchRows = 4;

// The bytes of 256 codes of one of p's rows (8 blocks of 32, a K-quant's super-block, 4 VNNI
// chunks): the span prefetched at a time, computed once per row (a division). The callers keep
// the prefetch call inline: a helper that also tested b % 8 measured 2x slower in few_rows
// (Q4_1 at avx2, one row: 8.3 against 18.5 GB/s).
inline int64_t span_bytes(const LinearArgs& p) { return p.row_bytes * 256 / p.K; }


// x @ w^T + bias into out (col < 0: out is [rows, N], bias [N]) or into its columns
// [col, col + N) (N = w's rows; the bias's values from bias[col]), checked. A fused projection
// writes its parts side by side; each part's columns are pointer arithmetic here, not a
// narrow()ed tensor: ~7 tensor allocations a layer of a one-stream step (torch.profiler put
// narrow / slice / as_strided at ~10% of a 2.6 ms step of the bundled model, its own cost
// included); without them one stream 395-403 -> 404-410 tok/s (AMD EPYC Zen 5, 2 threads,
// scripts/one_stream.py, three alternated pairs).
inline LinearArgs check_linear(const char* op, at::Tensor& out, const at::Tensor& x,
                               const at::Tensor& w, int64_t fmt,
                               const c10::optional<at::Tensor>& scales,
                               const c10::optional<at::Tensor>& bias, int64_t col = -1) {
  const bool whole = col < 0;
  col = whole ? 0 : col;
  const bool grouped = (fmt & kGrouped) != 0;
  fmt &= ~kGrouped;
  int64_t block = 0, bytes = 0;
  TORCH_CHECK(format_size(fmt, block, bytes), op, ": unknown format ", fmt);
  TORCH_CHECK(!grouped || (groupable(fmt) && w.size(0) % kGroupRows == 0), op,
              ": only Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K rows can be grouped, 16 rows at a time");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              op, ": x must be contiguous CPU fp32 [rows, K]");
  const int64_t rows = x.size(0), K = x.size(1);
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.element_size() == 1 && K % 32 == 0 &&
                  K % block == 0 && w.size(1) == K / block * bytes,
              op, ": w must be contiguous packed bytes [N, K / block * block_bytes] with K % 32 == 0");
  const int64_t N = w.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == rows &&
                  (whole ? out.size(1) == N : col + N <= out.size(1)) &&
                  out.stride(1) == 1 && (rows <= 1 || out.stride(0) >= out.size(1)),
              op, ": out must be fp32 [rows, N] with unit column stride");
  const float* sp = nullptr;
  if (fmt == kInt8) {
    TORCH_CHECK(scales.has_value() && scales->defined() && scales->scalar_type() == at::kFloat &&
                    scales->is_contiguous() && scales->numel() == N,
                op, ": int8 weights need fp32 scales [N]");
    sp = scales->data_ptr<float>();
  }
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    (whole ? bias->numel() == N : col + N <= bias->numel()),
                op, ": bias must be fp32 [N]");
    bp = bias->data_ptr<float>() + col;
  }
  return {fmt, rows, K, N, w.size(1), rows > 1 ? out.stride(0) : N, grouped, x.data_ptr<float>(),
          static_cast<const uint8_t*>(w.data_ptr()), sp, bp, out.data_ptr<float>() + col};
}

// The rows of `count` weights that read the same x (a fused projection's segments) as one index
// space in units of `unit` rows, split over the threads in one parallel region:
// body(part, first unit, end unit) for each task's share of each part. The tasks take equal
// shares of the weights' bytes, not of their rows: a fused qkv whose v is Q6_K (a Q4_K_M file)
// has rows of 1680 and 1152 bytes, and an even split of its rows left one of two threads idle
// for a quarter of the projection.
template <class F>
inline void parallel_parts(const LinearArgs* parts, int64_t count, int64_t unit, F&& body) {
  const LinearArgs& first = parts[0];
  std::vector<int64_t> ends(count), bytes(count);  // units / bytes of parts [0, i] together
  int64_t total = 0, total_bytes = 0, widest = 1;
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(parts[i].x == first.x && parts[i].rows == first.rows && parts[i].K == first.K,
                "quant_linear: every part of a fused projection reads the same activations");
    const int64_t units = (parts[i].N + unit - 1) / unit;
    total += units;
    total_bytes += units * unit * parts[i].row_bytes;
    ends[i] = total;
    bytes[i] = total_bytes;
    widest = std::max(widest, parts[i].row_bytes);
  }
  // Units per task: enough weight bytes (~32 KiB) that a thread's start-up cost stays small.
  const int64_t grain = std::max<int64_t>(1, 32768 / (unit * widest));
  const int64_t tasks =
      total <= grain ? 1 : std::min<int64_t>(at::get_num_threads(), (total + grain - 1) / grain);
  // the unit where byte `b` of the whole falls (rounded to the nearer unit edge)
  const auto unit_at = [&](int64_t b) {
    int64_t i = 0, start = 0, start_bytes = 0;
    while (i + 1 < count && b >= bytes[i]) start = ends[i], start_bytes = bytes[i++];
    const int64_t per = unit * parts[i].row_bytes;
    return std::min(ends[i], start + (b - start_bytes + per / 2) / per);
  };
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t u0 = unit_at(total_bytes * t / tasks);
      const int64_t u1 = t + 1 == tasks ? total : unit_at(total_bytes * (t + 1) / tasks);
      int64_t start = 0;
      for (int64_t i = 0; i < count && u0 < u1; start = ends[i++]) {
        const int64_t lo = std::max(u0, start), hi = std::min(u1, ends[i]);
        if (lo < hi) body(i, lo - start, hi - start);
      }
    }
  });
}

namespace v512 {
// x @ W^T over grouped rows (group_gemv.cpp); AVX-512 VNNI CPUs only. bytes: int8 activations
// (one vpdpbusd per 64 products) instead of int16 (two).
void group_gemv(const LinearArgs& p, bool bytes);
// The same for `count` grouped weights that read the same x (a fused projection's segments),
// the activations split once and every part's groups in one parallel region.
void group_gemv_parts(const LinearArgs* parts, int64_t count, bool bytes);
}  // namespace v512

namespace v256 {
// The same on the AVX2 GEMV over GGUF rows (quant_gemv.cpp), int16 activations: quantized once
// for every part; `isa` kAvx512 runs the panel's steps with AVX-512 vectors (panel_gemv512.cpp)
// where the CPU also has AVX-512BW. `bytes` (int8 activations): from kPanelRows rows the parts
// of byte_panel_format run the byte panel (byte_panel.cpp, at kAvx512 too), the others the
// int16 one.
void gemv_parts(const LinearArgs* parts, int64_t count, int64_t isa, bool bytes = false);
// The formats byte_gemv takes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K), plain rows.
bool byte_format(int64_t fmt);
// x @ W^T on int8 activations with AVX2 (byte_gemv.cpp); any CPU the library runs on.
void byte_gemv(const LinearArgs& p);
// The formats the int8-activation panel takes: byte_format's but Q8_0 (whose codes are signed).
bool byte_panel_format(int64_t fmt);
// x @ W^T on int8 activations for `count` weights reading the same activations, 8 rows a vector
// (byte_panel.cpp): for kPanelRows rows or more.
void byte_panel_parts(const LinearArgs* parts, int64_t count);
}  // namespace v256

}  // namespace pagedq_cpu
