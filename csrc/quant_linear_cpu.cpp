// Small-M linear on GGUF-quantized weights as stored (out = x @ dequant(W)^T + bias) on CPU: Q8_0, Q4_0, Q4_1, Q5_0,
// Q5_1 and the K-quants Q2_K .. Q6_K, dequantized in registers and multiplied in float32 by AVX-512 or AVX2 FMAs.
//
// Glossary: M rows of x, N output features (rows of W), K the reduction length, a multiple of the format's block (32
// weights, 256 for a K-quant super-block). The loops walk a row in *sub-blocks* of 32 weights; a K-quant's scales are
// decoded once per super-block and row. csrc/quant_blocks_cpu.h draws each layout and decodes it, to exactly
// gguf.quants.dequantize's float32 values (its header says why FMAs change nothing).
//
// The contract: quant_linear(x, W) is linear(x, dequant(W)) of csrc/linear_cpu.cpp in float32, bit for bit, on every
// path: the same float32 weights, the same accumulator lanes summing the same k in the same order, the same lane
// tree, the bias last. So it inherits linear's batch invariance (out[i] is the M = 1 result of row i whatever M,
// the other rows or the thread count), and a float32 model run on its quantized weights gives the logits of the same
// model dequantized at load. A bfloat16 x is widened to float32 first and each output rounded once.
//
// Two ways to get there, chosen by M:
// - *fused* (M <= 16): each sub-block of a tile's weight rows is dequantized into registers once per 8 rows of x and
//   FMA'd against them, with the accumulators linear's tile would hold. Decoding streams the weights once per call at
//   0.33-1.06 bytes per weight instead of bf16's 2: this path is the speed of the whole kernel.
// - *panel* (larger M, and CPUs without AVX2 + F16C): 16 rows dequantized into an L2-resident float32 panel, then
//   linear's own float32 kernel on it. The dequantization is paid once per weight whatever M is.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "amx_cpu.h"
#include "cpu_simd.h"
#include "linear_cpu.h"
#include "quant_linear_cpu.h"

#if SPECDEC_CPU_X86
// The scale conversions need F16C (every AVX2 CPU has it); reduce8 / reduce16's targets must be subsets of these.
#define SPECDEC_QAVX2 __attribute__((target("avx2,fma,f16c")))
#define SPECDEC_QAVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c")))
#endif

namespace specdec {

namespace {

#include "quant_blocks_cpu.h"  // the block formats' decoders: scalar, AVX2, AVX-512 (uses the targets above)

// What one thread computes: x [M, K] float32 with row stride ldx (a bfloat16 x widened) times W [N, row_bytes], the
// float32 sums of weight rows n0 .. n0 + ldo - 1 into sums [M, ldo]. The bias and the output's one rounding come after
// (finish), so the tiles, the bulk of the code, are built once per format whatever the output dtype.
struct QuantArgs {
  const float* x;
  int64_t ldx;
  const uint8_t* w;
  float* sums;
  int64_t n0, ldo;
  int64_t M, K, row_bytes;
};

inline void store(const QuantArgs& a, int64_t m, int64_t n, float sum) { a.sums[m * a.ldo + n - a.n0] = sum; }

// A vector's lanes 0 .. rows - 1 (its 8 or 16 floats: weight rows n0 ...) as x row m's sums.
template <typename V>
inline void store_lanes(const QuantArgs& a, int64_t m, int64_t n0, int64_t rows, const V& v) {
  std::memcpy(a.sums + m * a.ldo + n0 - a.n0, &v, static_cast<size_t>(rows) * sizeof(float));
}

#include "quant_int8_cpu.h"  // the 8-bit activation path (uses QuantArgs, store and store_lanes)
#if SPECDEC_CPU_AMX
#include "quant_amx_cpu.h"  // rows_amx_groups: the K-quants' bfloat16 path on AMX tiles (uses QuantArgs)
#endif

// Whether bfloat16 x times K-quant `qtype` (float activations) runs on AMX tiles: where the bfloat16 linear does and
// SPECDEC_QUANT_TILES=1 asks for it, chosen once per process for every M. Off by default: the tiles make a verify pass
// or a prompt's chunk several times cheaper, but one decoding row costs more than on the float path (its panel of
// quants and per-group epilogue serve 16 x rows; bench/RESULTS.md).
bool quant_tiles(int64_t qtype) {
#if SPECDEC_CPU_AMX
  static const bool on = [] {
    const char* v = std::getenv("SPECDEC_QUANT_TILES");
    return v != nullptr && std::strcmp(v, "1") == 0 && simd::cpu_has_amx_bf16();
  }();
  return on && !int8_activations(qtype) && quant_format(qtype).block_weights == 256;
#else
  (void)qtype;
  return false;
#endif
}

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// Rows of W handed to a thread at a time (and the panel's height): linear's row block, so the panel path's linear
// calls tile as linear would.
constexpr int64_t kRowBlock = 16;

#if SPECDEC_CPU_X86
template <QuantType Q>
SPECDEC_QAVX2 void dequant_row_avx2(const uint8_t* row, int64_t blocks, float* out) {
  ScalesOf<Q> k;
  for (int64_t b = 0; b < blocks; ++b) {
    if (b % kSubBlocks<Q> == 0) load_row_scales_avx2<Q>(row, b, k);
    __m256 w[4];
    dequant_avx2<Q>(row, b, k, w);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + b * 32 + 8 * i, w[i]);
  }
}
#endif  // SPECDEC_CPU_X86

// How this process multiplies (chosen once: the fused paths must sum in linear's float32 order, so they follow its
// path, and need F16C for the scales).
enum class Fused { kNone, kAvx2, kAvx512 };

Fused fused_path() {
  static const Fused path = [] {
#if SPECDEC_CPU_X86
    if (!__builtin_cpu_supports("f16c")) return Fused::kNone;
    if (simd::cpu_isa() == simd::Isa::kAvx512) return Fused::kAvx512;
    if (simd::cpu_isa() == simd::Isa::kAvx2) return Fused::kAvx2;
#endif
    return Fused::kNone;
  }();
  return path;
}

template <QuantType Q>
void dequant_row(const uint8_t* row, int64_t blocks, float* out) {
#if SPECDEC_CPU_X86
  if (fused_path() != Fused::kNone) return dequant_row_avx2<Q>(row, blocks, out);
#endif
  ScalesOf<Q> k;
  for (int64_t b = 0; b < blocks; ++b) {
    if (b % kSubBlocks<Q> == 0) load_row_scales<Q>(row, b, k);
    dequant_scalar<Q>(row, b, k, out + b * 32);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Panel path: 16 rows dequantized, then linear's float32 kernel (one thread's share: part 0 of 1), x taken in chunks
// of rows that stay in L2 across the weight blocks.
// ---------------------------------------------------------------------------------------------------------------

// Bytes of float32 x one chunk holds: linear's AVX-512 float32 tiles stream every x row once per 4 weight rows, so a
// prompt's whole chunk (M K floats, megabytes) read from L3 that often starves the FMAs; a chunk this size stays in L2
// beside the 16-row panel, and each weight block is dequantized once per chunk instead of once per call (linear is
// batch-invariant: a row's sums do not depend on which rows share its call).
constexpr int64_t kXChunkBytes = int64_t{1} << 20;
constexpr int64_t kMinChunkRows = 32;

template <QuantType Q>
void rows_panel(const QuantArgs& a, int64_t n_begin, int64_t n_end) {
  const int64_t chunk = std::max(kMinChunkRows, kXChunkBytes / (a.K * 4) / kRowBlock * kRowBlock);
  thread_local std::vector<float> panel, sums;  // [16, K], [chunk, 16]
  panel.resize(static_cast<size_t>(kRowBlock * a.K));
  sums.resize(static_cast<size_t>(std::min(a.M, chunk) * kRowBlock));
  for (int64_t m0 = 0; m0 < a.M; m0 += chunk) {
    const int64_t count = std::min(chunk, a.M - m0);
    for (int64_t n0 = n_begin; n0 < n_end; n0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, n_end - n0);
      for (int64_t r = 0; r < rows; ++r) {
        dequant_row<Q>(a.w + (n0 + r) * a.row_bytes, a.K / 32, panel.data() + r * a.K);
      }
      linear_f32_part(a.x + m0 * a.ldx, panel.data(), nullptr, sums.data(), count, rows, a.K, a.ldx, 0, 1);
      for (int64_t m = 0; m < count; ++m) {
        for (int64_t r = 0; r < rows; ++r) store(a, m0 + m, n0 + r, sums[m * rows + r]);
      }
    }
  }
}

#if SPECDEC_CPU_X86

// ---------------------------------------------------------------------------------------------------------------
// Fused AVX2 path: linear's AVX2 float32 tile (lane l of accumulator (n, m) sums k = l, l + 8, ... in order, then
// reduce8), its weights dequantized from the block in registers.
// ---------------------------------------------------------------------------------------------------------------

template <QuantType Q, int NB, int MB>
SPECDEC_QAVX2 void tile_avx2(const QuantArgs& a, int64_t n0, int64_t m0, bool prefetch) {
  static_assert(NB * MB <= 8, "a tile holds at most 8 accumulators");
  constexpr int64_t kStep = NB * kBlockBytes<Q>;  // bytes of W one block (or super-block) step reads
  __m256 acc[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  const uint8_t* w = a.w + n0 * a.row_bytes;
  // the next tile's rows (contiguous after these), pulled in at this tile's pace
  const char* next = prefetch ? reinterpret_cast<const char*>(w + NB * a.row_bytes) : nullptr;
  const int64_t blocks = a.K / 32;
  ScalesOf<Q> scales[NB];  // a K-quant super-block's, per weight row
  for (int64_t b = 0; b < blocks; ++b) {
    if (next != nullptr && b % kSubBlocks<Q> == 0) {
#pragma GCC unroll 8
      for (int64_t off = 0; off < kStep; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
      next += kStep;
    }
    if (b % kSubBlocks<Q> == 0) {
#pragma GCC unroll 8
      for (int nb = 0; nb < NB; ++nb) load_row_scales_avx2<Q>(w + nb * a.row_bytes, b, scales[nb]);
    }
    const float* x = a.x + m0 * a.ldx + b * 32;
#pragma GCC unroll 8
    for (int nb = 0; nb < NB; ++nb) {
      __m256 wv[4];
      dequant_avx2<Q>(w + nb * a.row_bytes, b, scales[nb], wv);
#pragma GCC unroll 8
      for (int mb = 0; mb < MB; ++mb) {
        const float* xr = x + mb * a.ldx;
        __m256& c = acc[mb * NB + nb];
        c = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(xr), c);
        c = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xr + 8), c);
        c = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xr + 16), c);
        c = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xr + 24), c);
      }
    }
  }
  alignas(32) float sums[8];
  _mm256_store_ps(sums, simd::reduce8(acc));
  for (int mb = 0; mb < MB; ++mb) {
    for (int nb = 0; nb < NB; ++nb) store(a, m0 + mb, n0 + nb, sums[mb * NB + nb]);
  }
}

template <QuantType Q, int NB, int MB>
SPECDEC_QAVX2 void span_avx2(const QuantArgs& a, int64_t n_begin, int64_t n_end, int64_t m0) {
  int64_t n = n_begin;
  for (; n + NB <= n_end; n += NB) tile_avx2<Q, NB, MB>(a, n, m0, true);
  for (; n < n_end; ++n) tile_avx2<Q, 1, MB>(a, n, m0, false);
}

// Tiles of NB rows x the M (<= 8) rows of x from m0: 8 accumulators, as many weight rows as they leave room for.
template <QuantType Q>
void rows_avx2(const QuantArgs& a, int64_t n_begin, int64_t n_end, int64_t m0, int64_t M) {
  switch (M) {
    case 1:  // 4 rows, not 8: 8 accumulators plus a block's 4 weight vectors and its scales spill the 16 registers
      return span_avx2<Q, 4, 1>(a, n_begin, n_end, m0);
    case 2:
      return span_avx2<Q, 4, 2>(a, n_begin, n_end, m0);
    case 3:
      return span_avx2<Q, 2, 3>(a, n_begin, n_end, m0);
    case 4:
      return span_avx2<Q, 2, 4>(a, n_begin, n_end, m0);
    case 5:
      return span_avx2<Q, 1, 5>(a, n_begin, n_end, m0);
    case 6:
      return span_avx2<Q, 1, 6>(a, n_begin, n_end, m0);
    case 7:
      return span_avx2<Q, 1, 7>(a, n_begin, n_end, m0);
    default:
      return span_avx2<Q, 1, 8>(a, n_begin, n_end, m0);
  }
}

// 9 to 16 rows of x: per weight row, x rows 0-7 then the rest, the row read from memory once (from L1 the second
// time) and dequantized twice.
template <QuantType Q>
SPECDEC_QAVX2 void rows_two_chunks_avx2(const QuantArgs& a, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    tile_avx2<Q, 1, 8>(a, n, 0, true);
    switch (a.M - 8) {
      case 1:
        tile_avx2<Q, 1, 1>(a, n, 8, false);
        break;
      case 2:
        tile_avx2<Q, 1, 2>(a, n, 8, false);
        break;
      case 3:
        tile_avx2<Q, 1, 3>(a, n, 8, false);
        break;
      case 4:
        tile_avx2<Q, 1, 4>(a, n, 8, false);
        break;
      case 5:
        tile_avx2<Q, 1, 5>(a, n, 8, false);
        break;
      case 6:
        tile_avx2<Q, 1, 6>(a, n, 8, false);
        break;
      case 7:
        tile_avx2<Q, 1, 7>(a, n, 8, false);
        break;
      default:
        tile_avx2<Q, 1, 8>(a, n, 8, false);
        break;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Fused AVX-512 path: linear's AVX-512 float32 tile (lane l sums k = l, l + 16, ..., then reduce16: accumulator j's
// sum lands in lane 4 (j % 4) + j / 4).
// ---------------------------------------------------------------------------------------------------------------

template <QuantType Q, int NB, int MB>
SPECDEC_QAVX512 void tile_avx512(const QuantArgs& a, int64_t n0, int64_t m0, bool prefetch) {
  static_assert(NB * MB <= 16, "a tile holds at most 16 accumulators");
  constexpr int64_t kStep = NB * kBlockBytes<Q>;
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  const uint8_t* w = a.w + n0 * a.row_bytes;
  const char* next = prefetch ? reinterpret_cast<const char*>(w + NB * a.row_bytes) : nullptr;
  const int64_t blocks = a.K / 32;
  ScalesOf<Q> scales[NB];  // a K-quant super-block's, per weight row
  for (int64_t b = 0; b < blocks; ++b) {
    if (next != nullptr && b % kSubBlocks<Q> == 0) {
#pragma GCC unroll 16
      for (int64_t off = 0; off < kStep; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
      next += kStep;
    }
    if (b % kSubBlocks<Q> == 0) {
#pragma GCC unroll 16
      for (int nb = 0; nb < NB; ++nb) load_row_scales_avx2<Q>(w + nb * a.row_bytes, b, scales[nb]);
    }
    const float* x = a.x + m0 * a.ldx + b * 32;
#pragma GCC unroll 16
    for (int nb = 0; nb < NB; ++nb) {
      __m512 wv[2];
      dequant_avx512<Q>(w + nb * a.row_bytes, b, scales[nb], wv);
#pragma GCC unroll 8
      for (int mb = 0; mb < MB; ++mb) {
        const float* xr = x + mb * a.ldx;
        __m512& c = acc[mb * NB + nb];
        c = _mm512_fmadd_ps(wv[0], _mm512_loadu_ps(xr), c);
        c = _mm512_fmadd_ps(wv[1], _mm512_loadu_ps(xr + 16), c);
      }
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, simd::reduce16(acc));
  for (int mb = 0; mb < MB; ++mb) {
    for (int nb = 0; nb < NB; ++nb) {
      const int j = mb * NB + nb;
      store(a, m0 + mb, n0 + nb, sums[4 * (j % 4) + j / 4]);
    }
  }
}

template <QuantType Q, int NB, int MB>
SPECDEC_QAVX512 void span_avx512(const QuantArgs& a, int64_t n_begin, int64_t n_end, int64_t m0) {
  int64_t n = n_begin;
  for (; n + NB <= n_end; n += NB) tile_avx512<Q, NB, MB>(a, n, m0, true);
  for (; n < n_end; ++n) tile_avx512<Q, 1, MB>(a, n, m0, false);
}

template <QuantType Q>
void rows_avx512(const QuantArgs& a, int64_t n_begin, int64_t n_end, int64_t m0, int64_t M) {
  switch (M) {
    case 1:
      return span_avx512<Q, 16, 1>(a, n_begin, n_end, m0);
    case 2:
      return span_avx512<Q, 8, 2>(a, n_begin, n_end, m0);
    case 3:
      return span_avx512<Q, 4, 3>(a, n_begin, n_end, m0);
    case 4:
      return span_avx512<Q, 4, 4>(a, n_begin, n_end, m0);
    case 5:
      return span_avx512<Q, 2, 5>(a, n_begin, n_end, m0);
    case 6:
      return span_avx512<Q, 2, 6>(a, n_begin, n_end, m0);
    case 7:
      return span_avx512<Q, 2, 7>(a, n_begin, n_end, m0);
    default:
      return span_avx512<Q, 2, 8>(a, n_begin, n_end, m0);
  }
}

template <QuantType Q>
SPECDEC_QAVX512 void rows_two_chunks_avx512(const QuantArgs& a, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    tile_avx512<Q, 1, 8>(a, n, 0, true);
    switch (a.M - 8) {
      case 1:
        tile_avx512<Q, 1, 1>(a, n, 8, false);
        break;
      case 2:
        tile_avx512<Q, 1, 2>(a, n, 8, false);
        break;
      case 3:
        tile_avx512<Q, 1, 3>(a, n, 8, false);
        break;
      case 4:
        tile_avx512<Q, 1, 4>(a, n, 8, false);
        break;
      case 5:
        tile_avx512<Q, 1, 5>(a, n, 8, false);
        break;
      case 6:
        tile_avx512<Q, 1, 6>(a, n, 8, false);
        break;
      case 7:
        tile_avx512<Q, 1, 7>(a, n, 8, false);
        break;
      default:
        tile_avx512<Q, 1, 8>(a, n, 8, false);
        break;
    }
  }
}

#endif  // SPECDEC_CPU_X86

// The fused tiles take x 8 rows at a time, dequantizing each block once per 8 rows; past kMaxFusedRows rows the
// panel's dequantization, paid once, costs less. At 9-16 rows the two fused chunks and the panel cost about the same
// (SmolLM2's 16-token forward, one thread: ~120 ms of CPU time either way, ~1.2x the bfloat16 kernel's).
constexpr int64_t kFusedChunk = 8;
constexpr int64_t kMaxFusedRows = 16;

template <QuantType Q>
void rows(const QuantArgs& a, int64_t n_begin, int64_t n_end) {
#if SPECDEC_CPU_X86
  const bool avx512 = fused_path() == Fused::kAvx512;
  if (fused_path() != Fused::kNone && a.M <= kFusedChunk) {
    return avx512 ? rows_avx512<Q>(a, n_begin, n_end, 0, a.M) : rows_avx2<Q>(a, n_begin, n_end, 0, a.M);
  }
  if (fused_path() != Fused::kNone && a.M <= kMaxFusedRows) {
    return avx512 ? rows_two_chunks_avx512<Q>(a, n_begin, n_end) : rows_two_chunks_avx2<Q>(a, n_begin, n_end);
  }
#endif
  rows_panel<Q>(a, n_begin, n_end);
}

constexpr const char* kTakenTypes =
    "Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q2_K (10), Q3_K (11), Q4_K (12), Q5_K (13), Q6_K (14)";

template <typename F>
void with_qtype(int64_t qtype, F&& f) {
#define SPECDEC_QTYPE_CASE(q) \
  case QuantType::q:          \
    return f(std::integral_constant<QuantType, QuantType::q>{});
  switch (static_cast<QuantType>(ggml_type(qtype))) {
    SPECDEC_QTYPE_CASE(kQ4_0)
    SPECDEC_QTYPE_CASE(kQ4_1)
    SPECDEC_QTYPE_CASE(kQ5_0)
    SPECDEC_QTYPE_CASE(kQ5_1)
    SPECDEC_QTYPE_CASE(kQ8_0)
    SPECDEC_QTYPE_CASE(kQ2_K)
    SPECDEC_QTYPE_CASE(kQ3_K)
    SPECDEC_QTYPE_CASE(kQ4_K)
    SPECDEC_QTYPE_CASE(kQ5_K)
    SPECDEC_QTYPE_CASE(kQ6_K)
  }
#undef SPECDEC_QTYPE_CASE
  TORCH_CHECK_VALUE(false, "quant_linear: unsupported GGML type id ", qtype, "; the kernel reads ", kTakenTypes);
}

// o[i] = T(x[i]) for n elements, as the decoder's convert_row (csrc/layer_ops_cpu.h) without its AVX-512 path: 8 at a
// time where AVX2 is (simd::convert_row8: the same bits as the cast).
template <typename T>
void convert_row(const float* x, T* o, int64_t n) {
#if SPECDEC_CPU_X86
  if (simd::cpu_isa() >= simd::Isa::kAvx2) return simd::convert_row8(x, o, n);
#endif
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(x[i]);
}

// Weight rows [n_begin, n_end) of x (T) @ W: a bfloat16 x widened into this thread's buffer first.
template <typename T>
void run_rows(const T* x, const uint8_t* w, int64_t qtype, const T* bias, T* out, int64_t M, int64_t N, int64_t K,
              int64_t ldx, int64_t n_begin, int64_t n_end) {
  constexpr bool kBf16 = std::is_same_v<T, c10::BFloat16>;
  const bool tiles = kBf16 && quant_tiles(qtype);
  const float* xf = nullptr;
  int64_t ldxf = ldx;
  if constexpr (!kBf16) {
    xf = x;
  } else if (!tiles) {
    thread_local std::vector<float> widened;  // [M, K]
    widened.resize(static_cast<size_t>(M * K));
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < K; ++k) widened[m * K + k] = static_cast<float>(x[m * ldx + k]);
    }
    xf = widened.data(), ldxf = K;
  }
  thread_local std::vector<float> sums;  // [M, n_end - n_begin]
  sums.resize(static_cast<size_t>(M * (n_end - n_begin)));
  const QuantArgs a{xf, ldxf, w, sums.data(), n_begin, n_end - n_begin, M, K, quant_row_bytes(qtype, K)};
  if (tiles) {
#if SPECDEC_CPU_AMX
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(x);
    with_qtype(qtype, [&](auto q) {
      if constexpr (kSubBlocks<decltype(q)::value> > 1) rows_amx_groups<decltype(q)::value>(a, bits, ldx, n_begin, n_end);
    });
#endif
  } else if (int8_activations(qtype)) {
    thread_local Int8Rows xq;  // each thread quantizes x itself: M K work against the M N K of its share
    quantize_int8(xf, ldxf, M, K, xq);
    const Int8Args ia{&xq, &a};
    with_qtype(qtype, [&](auto q) { int8_rows<decltype(q)::value>(ia, n_begin, n_end); });
  } else {
    with_qtype(qtype, [&](auto q) { rows<decltype(q)::value>(a, n_begin, n_end); });
  }
  // linear's store: the bias last (fp32), then one rounding to the output dtype
  for (int64_t m = 0; m < M; ++m) {
    float* row = sums.data() + m * a.ldo;  // [n_end - n_begin]
    if (bias != nullptr) {
      for (int64_t n = n_begin; n < n_end; ++n) row[n - n_begin] += to_float(bias[n]);
    }
    convert_row(row, out + m * N + n_begin, n_end - n_begin);
  }
}

template <typename T>
void run(const T* x, const uint8_t* w, int64_t qtype, const T* bias, T* out, int64_t M, int64_t N, int64_t K,
         int64_t ldx) {
  const int64_t num_blocks = (N + kRowBlock - 1) / kRowBlock;
  // Threads for calls with >= ~1 us of one-thread work (linear's rule): a block's work is the larger of its
  // streaming time (~20 bytes/ns from DRAM) and its FMA time (~100 GFLOP/s on one core with the dequantization).
  const double block_bytes_ = static_cast<double>(kRowBlock * quant_row_bytes(qtype, K));
  const double block_flops = 2.0 * static_cast<double>(M * kRowBlock * K);
  const double block_us = std::max(block_bytes_ / 20e3, block_flops / 100e3);
  const int64_t grain = static_cast<int64_t>(1.0 / std::max(block_us, 1e-3)) + 1;
  at::parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) {
    run_rows<T>(x, w, qtype, bias, out, M, N, K, ldx, begin * kRowBlock, std::min(end * kRowBlock, N));
  });
}

template <typename T>
void run_part(const T* x, const uint8_t* w, int64_t qtype, const T* bias, T* out, int64_t M, int64_t N, int64_t K,
              int64_t ldx, int64_t part, int64_t parts) {
  const int64_t num_blocks = (N + kRowBlock - 1) / kRowBlock;
  const int64_t per = num_blocks / parts, extra = num_blocks % parts;
  const int64_t begin = part * per + std::min(part, extra), end = begin + per + (part < extra ? 1 : 0);
  if (begin < end) run_rows<T>(x, w, qtype, bias, out, M, N, K, ldx, begin * kRowBlock, std::min(end * kRowBlock, N));
}

// Checks that need no values: shared by the CPU and Meta kernels. ValueError / TypeError in Python.
void check_inputs(const at::Tensor& x, const at::Tensor& weight, int64_t qtype, const c10::optional<at::Tensor>& bias) {
  const QuantFormat f = quant_format(qtype);
  TORCH_CHECK_VALUE(f.block_weights > 0, "quant_linear: unsupported GGML type id ", qtype, "; the kernel reads ",
                    kTakenTypes);
  TORCH_CHECK_VALUE(x.dim() >= 1, "quant_linear: x must be [..., K], got a 0-d tensor");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                   "quant_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_TYPE(weight.scalar_type() == at::kByte || weight.scalar_type() == at::kChar,
                   "quant_linear: weight must be GGUF blocks, uint8 (float activations) or int8 (8-bit activations), "
                   "got ", weight.scalar_type());
  const int64_t K = x.size(-1);
  TORCH_CHECK_VALUE(K > 0 && K % f.block_weights == 0, "quant_linear: K = ", K, " is not a positive multiple of ",
                    "GGML type ", qtype, "'s ", f.block_weights, "-weight block");
  const int64_t row_bytes = quant_row_bytes(qtype, K);
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == row_bytes, "quant_linear: weight must be [N, ", row_bytes,
                    "] (K / ", f.block_weights, " blocks of ", f.block_bytes, " bytes) for K = ", K, ", got shape ",
                    weight.sizes());
  TORCH_CHECK_VALUE(weight.is_contiguous(), "quant_linear: weight must be contiguous, got strides ", weight.strides());
  TORCH_CHECK_VALUE(weight.device() == x.device(), "quant_linear: weight is on ", weight.device(), " but x is on ",
                    x.device());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0), "quant_linear: bias must be [N] with N = ",
                      weight.size(0), ", got shape ", bias->sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "quant_linear: bias is ", bias->scalar_type(),
                     " but x is ", x.scalar_type());
    TORCH_CHECK_VALUE(bias->device() == x.device(), "quant_linear: bias is on ", bias->device(), " but x is on ",
                      x.device());
  }
}

std::vector<int64_t> out_shape(const at::Tensor& x, const at::Tensor& weight) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = weight.size(0);
  return shape;
}

}  // namespace

void quant_linear_f32(const float* x, const uint8_t* weight, int64_t qtype, const float* bias, float* out, int64_t M,
                      int64_t N, int64_t K, int64_t ldx) {
  if (M > 0 && N > 0) run<float>(x, weight, qtype, bias, out, M, N, K, ldx);
}

void quant_linear_bf16(const c10::BFloat16* x, const uint8_t* weight, int64_t qtype, const c10::BFloat16* bias,
                       c10::BFloat16* out, int64_t M, int64_t N, int64_t K, int64_t ldx) {
  if (M > 0 && N > 0) run<c10::BFloat16>(x, weight, qtype, bias, out, M, N, K, ldx);
}

void quant_linear_f32_part(const float* x, const uint8_t* weight, int64_t qtype, const float* bias, float* out,
                           int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t part, int64_t parts) {
  if (M > 0 && N > 0) run_part<float>(x, weight, qtype, bias, out, M, N, K, ldx, part, parts);
}

void quant_linear_bf16_part(const c10::BFloat16* x, const uint8_t* weight, int64_t qtype, const c10::BFloat16* bias,
                            c10::BFloat16* out, int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t part,
                            int64_t parts) {
  if (M > 0 && N > 0) run_part<c10::BFloat16>(x, weight, qtype, bias, out, M, N, K, ldx, part, parts);
}

void quant_dequant_row_f32(const uint8_t* weight, int64_t qtype, int64_t row_blocks, int64_t row, float* out) {
  const int64_t row_bytes = quant_row_bytes(qtype, row_blocks * kQuantBlock);
  with_qtype(qtype, [&](auto q) { dequant_row<decltype(q)::value>(weight + row * row_bytes, row_blocks, out); });
}

void quant_dequant_row_bf16(const uint8_t* weight, int64_t qtype, int64_t row_blocks, int64_t row,
                            c10::BFloat16* out) {
  thread_local std::vector<float> buf;
  buf.resize(static_cast<size_t>(row_blocks * kQuantBlock));
  quant_dequant_row_f32(weight, qtype, row_blocks, row, buf.data());
  for (size_t i = 0; i < buf.size(); ++i) out[i] = static_cast<c10::BFloat16>(buf[i]);
}

at::Tensor quant_linear_cpu(const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                            const c10::optional<at::Tensor>& bias) {
  check_inputs(x, weight, qtype, bias);
  TORCH_CHECK_VALUE(x.device().is_cpu(), "quant_linear: the native CPU kernel got tensors on ", x.device());
  const int64_t K = x.size(-1), N = weight.size(0);
  at::Tensor out = at::empty(out_shape(x, weight), x.options());  // [..., N]
  const int64_t M = x.numel() / K;
  if (M == 0 || N == 0) return out;
  at::Tensor rows = x.reshape({M, K});  // [M, K] with unit inner stride
  if (rows.stride(1) != 1) rows = rows.contiguous();
  at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const uint8_t* w = static_cast<const uint8_t*>(weight.data_ptr());
  if (weight.scalar_type() == at::kChar && !int8_activations(qtype)) qtype += kInt8Activations;
  if (x.scalar_type() == at::kFloat) {
    run<float>(rows.data_ptr<float>(), w, qtype, b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<float>(), M,
               N, K, rows.stride(0));
  } else {
    using bf16 = c10::BFloat16;
    run<bf16>(rows.data_ptr<bf16>(), w, qtype, b.defined() ? b.data_ptr<bf16>() : nullptr, out.data_ptr<bf16>(), M, N,
              K, rows.stride(0));
  }
  return out;
}

at::Tensor quant_linear_meta(const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                             const c10::optional<at::Tensor>& bias) {
  check_inputs(x, weight, qtype, bias);
  return at::empty(out_shape(x, weight), x.options());
}

std::string quant_int8_path() {
  const Int8Path path = int8_path();
  return path == Int8Path::kAmx    ? "amx"
         : path == Int8Path::kVnni ? "vnni"
         : path == Int8Path::kAvx2 ? "avx2"
                                   : "scalar";
}

}  // namespace specdec
