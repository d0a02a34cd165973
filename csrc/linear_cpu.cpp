// Small-M linear (out = x @ weight^T + bias) on CPU: AMX-BF16 tiles, AVX-512 fp32 FMA and AVX512-BF16 dot products,
// or AVX2 FMA.
//
// Glossary: M rows of x (decode: 1, verify: T), N output features (rows of weight [N, K]), K the reduction length.
// A *tile* is NB weight rows x MB x rows computed together: each weight vector loaded feeds MB FMAs, each x vector
// NB, and the NB * MB <= 16 accumulators stay in registers.
//
// Why not torch.mm: at M <= 16 its GEMMs cost 3-5x the weight bytes' streaming time on a 2-core AVX-512 CPU (the
// default target's 57 matmuls at M=1: 4.4x a plain OpenMP dot-product loop). This kernel
// streams each weight row once per call and reuses it from L1 across the rows of x.
//
// Batch invariance (the contract greedy speculation relies on): every output element is reduced in one fixed order
// whatever M is and whichever rows share its tile. Accumulator lane l sums k = l, l + 16, ... (fp32) or the pairs
// k = 2l, 2l + 1, 2l + 32, ... (bf16) in increasing k; the 16 lanes are then summed by one fixed tree (reduce16),
// and the bias is added last. Tile shapes only choose which accumulators share registers, never the order of one
// accumulator's additions, so linear(x)[i] is bitwise linear(x[i:i+1])[0].
//
// The AMX, AVX-512 and AVX2 code is compiled for its ISA with target attributes (no global -m flags), and chosen once
// per process (simd::cpu_isa): a CPU with AMX-BF16 tiles runs bfloat16 weights whose K is a multiple of 32 on them
// (see the AMX section: there each element is its own running sum over k blocks), a CPU with AVX2 + FMA but no
// AVX-512 (or no AVX512-BF16, for bf16) takes the AVX2 path (8 lanes, each summing a fixed sequence of k in
// increasing order, bf16 widened to fp32 in registers, then reduce8's fixed tree: see linear_avx2_cpu.h), one without
// either a scalar path; each is correct and batch-invariant in its own order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "amx_cpu.h"
#include "cpu_simd.h"

#define SPECDEC_LINEAR_X86 SPECDEC_CPU_X86

namespace specdec {

namespace {

// What one call computes, as raw pointers: x [M, K] with row stride ldx, weight [N, K] contiguous, out [M, N].
template <typename T>
struct LinearArgs {
  const T* x;
  const T* w;
  const T* bias;  // [N] or nullptr
  T* out;
  int64_t M, N, K, ldx;
};

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// Writes one finished sum: bias last (fp32), then one rounding to the output dtype. c10::BFloat16's constructor
// rounds to nearest even, like torch's own bf16 kernels.
template <typename T>
inline void store(const LinearArgs<T>& a, int64_t m, int64_t n, float sum) {
  if (a.bias != nullptr) sum += to_float(a.bias[n]);
  a.out[m * a.N + n] = static_cast<T>(sum);
}

// Rows of weight handed to a thread at a time: a whole number of the widest tile (16 rows), so how N is split across
// threads never changes a tile's shape.
constexpr int64_t kRowBlock = 16;

// The most x rows one pass over a thread's weight rows takes (a prompt's chunk is cut into panels this tall): a
// panel's widened rows stay in L2 across the weight blocks (128 x 1536 fp32: 768 KB), where a whole 512-row chunk
// (3 MB at K = 1536) was read from beyond L2 once per kRowBlock weight rows (bench/RESULTS-log.md, "Prompt chunks in
// panels of x rows"). The AVX-512 widening path and the AVX2 path (float32 x too) run a call panel by panel.
constexpr int64_t kPanelRows = 128;

// ---------------------------------------------------------------------------------------------------------------
// Scalar path: CPUs without AVX2 (and other architectures): simd::dot8, the AVX2 path's order in plain C++.
// ---------------------------------------------------------------------------------------------------------------

template <typename T>
void rows_scalar(const LinearArgs<T>& a, int64_t n_begin, int64_t n_end) {
  std::vector<float> x(static_cast<size_t>(a.M * a.K));  // [M, K]: x in fp32
  for (int64_t m = 0; m < a.M; ++m) {
    for (int64_t k = 0; k < a.K; ++k) x[m * a.K + k] = to_float(a.x[m * a.ldx + k]);
  }
  for (int64_t n = n_begin; n < n_end; ++n) {  // each weight row streamed once, then read from L1 by every x row
    for (int64_t m = 0; m < a.M; ++m) store(a, m, n, simd::dot8(x.data() + m * a.K, a.w + n * a.K, a.K));
  }
}

#if SPECDEC_LINEAR_X86

// ---------------------------------------------------------------------------------------------------------------
// AVX-512 path.
// ---------------------------------------------------------------------------------------------------------------

// Where a tile keeps accumulator (nb, mb) so that reduce16 leaves x row mb's NB sums in lanes mb * NB .. + NB - 1,
// in n order: lane 4q + r of reduce16 is accumulator 4r + q, so output lane L needs accumulator 4 (L % 4) + L / 4.
template <int NB>
constexpr int slot(int nb, int mb) {
  return 4 * ((mb * NB + nb) % 4) + (mb * NB + nb) / 4;
}

// Sums the tile's accumulators, adds the bias (fp32, last) and stores each x row's NB outputs.
template <typename T, int NB, int MB>
SPECDEC_AVX512 inline void finish_tile(const LinearArgs<T>& a, const __m512* acc, int64_t n0, int64_t m0) {
  static_assert((NB & (NB - 1)) == 0 && NB * MB <= 16, "NB is a power of two; a tile holds <= 16 accumulators");
  __m512 sums = simd::reduce16(acc);
  if (a.bias != nullptr) {
    const __mmask16 row_mask = static_cast<__mmask16>((1u << NB) - 1);
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 bias;
    if constexpr (std::is_same_v<T, float>) {
      bias = _mm512_maskz_loadu_ps(row_mask, a.bias + n0);
    } else {
      const __m256i raw = _mm256_maskz_loadu_epi16(row_mask, a.bias + n0);
      bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    // Lane L gets bias[n0 + L % NB]: every x row of the tile sees the same NB biases.
    const __m512i wrap = _mm512_and_si512(iota, _mm512_set1_epi32(NB - 1));
    sums = _mm512_add_ps(sums, _mm512_permutexvar_ps(wrap, bias));
  }
  // One conversion for the whole tile, then each x row's NB outputs as one plain copy (8-64 bytes).
  alignas(64) T rows[16];
  if constexpr (std::is_same_v<T, float>) {
    _mm512_store_ps(rows, sums);
  } else {
    _mm256_store_si256(reinterpret_cast<__m256i*>(rows), simd::round_bf16(sums));
  }
#pragma GCC unroll 4
  for (int mb = 0; mb < MB; ++mb) std::memcpy(a.out + (m0 + mb) * a.N + n0, rows + mb * NB, NB * sizeof(T));
}

// fp32 tile: lane l of acc (n, m) sums x[m, k] * w[n, k] for k = l, l + 16, ..., the tail masked to zeros.
template <int NB, int MB>
SPECDEC_AVX512 void tile_f32(const LinearArgs<float>& a, int64_t n0, int64_t m0, const char* prefetch) {
  static_assert(NB * MB <= 16, "a tile holds at most 16 accumulators");
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  const float* w = a.w + n0 * a.K;
  const float* x = a.x + m0 * a.ldx;
  const int64_t K = a.K;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if (prefetch != nullptr) {
#pragma GCC unroll 16
      for (int nb = 0; nb < NB; ++nb) _mm_prefetch(prefetch + nb * 64, _MM_HINT_T1);
      prefetch += NB * 64;
    }
    __m512 xv[MB];
#pragma GCC unroll 4
    for (int mb = 0; mb < MB; ++mb) xv[mb] = _mm512_loadu_ps(x + mb * a.ldx + k);
#pragma GCC unroll 16
    for (int nb = 0; nb < NB; ++nb) {
      const __m512 wv = _mm512_loadu_ps(w + nb * K + k);
#pragma GCC unroll 4
      for (int mb = 0; mb < MB; ++mb) acc[slot<NB>(nb, mb)] = _mm512_fmadd_ps(wv, xv[mb], acc[slot<NB>(nb, mb)]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 xv[MB];
#pragma GCC unroll 4
    for (int mb = 0; mb < MB; ++mb) xv[mb] = _mm512_maskz_loadu_ps(mask, x + mb * a.ldx + k);
#pragma GCC unroll 16
    for (int nb = 0; nb < NB; ++nb) {
      const __m512 wv = _mm512_maskz_loadu_ps(mask, w + nb * K + k);
#pragma GCC unroll 4
      for (int mb = 0; mb < MB; ++mb) acc[slot<NB>(nb, mb)] = _mm512_fmadd_ps(wv, xv[mb], acc[slot<NB>(nb, mb)]);
    }
  }
  finish_tile<float, NB, MB>(a, acc, n0, m0);
}

// bf16 tile: lane l of acc (n, m) adds the products of the pair k = 2l, 2l + 1 (one vdpbf16ps), then the pair 32
// further, ...; the tail is masked to zeros (an odd K pairs its last element with a zero).
template <int NB, int MB>
SPECDEC_AVX512 void tile_bf16(const LinearArgs<c10::BFloat16>& a, int64_t n0, int64_t m0, const char* prefetch) {
  static_assert(NB * MB <= 16, "a tile holds at most 16 accumulators");
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  const uint16_t* w = reinterpret_cast<const uint16_t*>(a.w) + n0 * a.K;
  const uint16_t* x = reinterpret_cast<const uint16_t*>(a.x) + m0 * a.ldx;
  const int64_t K = a.K;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (prefetch != nullptr) {
#pragma GCC unroll 16
      for (int nb = 0; nb < NB; ++nb) _mm_prefetch(prefetch + nb * 64, _MM_HINT_T1);
      prefetch += NB * 64;
    }
    __m512bh xv[MB];
#pragma GCC unroll 4
    for (int mb = 0; mb < MB; ++mb) xv[mb] = (__m512bh)_mm512_loadu_si512(x + mb * a.ldx + k);
#pragma GCC unroll 16
    for (int nb = 0; nb < NB; ++nb) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + nb * K + k);
#pragma GCC unroll 4
      for (int mb = 0; mb < MB; ++mb) acc[slot<NB>(nb, mb)] = _mm512_dpbf16_ps(acc[slot<NB>(nb, mb)], wv, xv[mb]);
    }
  }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    __m512bh xv[MB];
#pragma GCC unroll 4
    for (int mb = 0; mb < MB; ++mb) xv[mb] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + mb * a.ldx + k);
#pragma GCC unroll 16
    for (int nb = 0; nb < NB; ++nb) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + nb * K + k);
#pragma GCC unroll 4
      for (int mb = 0; mb < MB; ++mb) acc[slot<NB>(nb, mb)] = _mm512_dpbf16_ps(acc[slot<NB>(nb, mb)], wv, xv[mb]);
    }
  }
  finish_tile<c10::BFloat16, NB, MB>(a, acc, n0, m0);
}

template <typename T, int NB, int MB>
SPECDEC_AVX512 inline void tile(const LinearArgs<T>& a, int64_t n0, int64_t m0, bool prefetch = false) {
  // The next NB weight rows, contiguous after these: one cache line per row per k step (64 B of fp32 or bf16), pulled
  // into L2 while this tile computes.
  const char* next = prefetch ? reinterpret_cast<const char*>(a.w + (n0 + NB) * a.K) : nullptr;
  if constexpr (std::is_same_v<T, float>) {
    tile_f32<NB, MB>(a, n0, m0, next);
  } else {
    tile_bf16<NB, MB>(a, n0, m0, next);
  }
}

// All M rows of x against weight rows [n0, n0 + NB): x in chunks of 4 rows plus one chunk of the rest, so the NB
// weight rows (NB * K elements, <= 14 KB here) are read from memory once and from L1 by the later chunks. Every chunk
// prefetches the next NB rows, not only the first: a cold forward of the default target (fp32, one thread, weights
// streamed from L3/DRAM) at M=16 is ~25% faster with these than with first-chunk prefetches, ~40% than with none.
template <typename T, int NB>
SPECDEC_AVX512 void rows_all_m(const LinearArgs<T>& a, int64_t n0, bool prefetch) {
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) tile<T, NB, 4>(a, n0, m, prefetch);
  switch (a.M - m) {
    case 3:
      tile<T, NB, 3>(a, n0, m, prefetch);
      break;
    case 2:
      tile<T, NB, 2>(a, n0, m, prefetch);
      break;
    case 1:
      tile<T, NB, 1>(a, n0, m, prefetch);
      break;
    default:
      break;
  }
}

// Weight rows [n_begin, n_end): the widest tile that still keeps MB x rows in registers (16 accumulators), then
// single rows for what does not fill one.
template <typename T>
SPECDEC_AVX512 void rows_avx512(const LinearArgs<T>& a, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  if (a.M == 1) {
    for (; n + 16 <= n_end; n += 16) tile<T, 16, 1>(a, n, 0, true);
  } else if (a.M == 2) {
    for (; n + 8 <= n_end; n += 8) tile<T, 8, 2>(a, n, 0, true);
  } else {
    for (; n + 4 <= n_end; n += 4) rows_all_m<T, 4>(a, n, true);
  }
  for (; n < n_end; ++n) rows_all_m<T, 1>(a, n, false);
}

#include "linear_widen_cpu.h"  // rows_widen and time_dot_or_fma (uses LinearArgs, slot and finish_tile above)

#endif  // SPECDEC_LINEAR_X86

// vdpbf16ps's time over the FMAs' for the same count of instructions (best of 5 interleaved rounds: a preempted round
// only loses), measured once per process; 0 where the CPU has no AVX512-BF16.
double dot_over_fma() {
  static const double ratio = [] {
#if SPECDEC_LINEAR_X86
    if (!simd::cpu_has_avx512_bf16()) return 0.0;
    double dot = 1e9, fma = 1e9;
    for (int round = 0; round < 5; ++round) {
      dot = std::min(dot, time_dot_or_fma(true, 2000));
      fma = std::min(fma, time_dot_or_fma(false, 2000));
    }
    return dot / fma;
#else
    return 0.0;
#endif
  }();
  return ratio;
}

// The widening path above the ratio at which it computes more products per cycle (see time_dot_or_fma).
constexpr double kWidenAboveRatio = 2.5;

// The bfloat16 path for an AVX512-BF16 CPU without AMX tiles: the widening path where vdpbf16ps issues slowly
// (dot_over_fma() > kWidenAboveRatio), else vdpbf16ps; SPECDEC_BF16_LINEAR=widen or =dot chooses (tests run both on
// one machine). Chosen once per process: the two sum in different orders.
bool bf16_widens() {
  static const bool widen = [] {
    const char* v = std::getenv("SPECDEC_BF16_LINEAR");
    if (v != nullptr && std::strcmp(v, "widen") == 0) return true;
    if (v != nullptr && std::strcmp(v, "dot") == 0) return false;
    return dot_over_fma() > kWidenAboveRatio;
  }();
  return widen;
}

#if SPECDEC_LINEAR_X86
#if SPECDEC_CPU_AMX
#include "linear_amx_cpu.h"  // rows_amx: the bfloat16 path on AMX tiles (uses LinearArgs above)
#endif
#include "linear_avx2_cpu.h"  // rows_avx2: the AVX2 + FMA path (uses LinearArgs, kRowBlock and kPanelRows above)

#endif  // SPECDEC_LINEAR_X86

enum class Path { kScalar, kAvx2, kAvx512, kAvx512Widen, kAmx };

// This CPU's path for T and a weight's K (chosen once per process for each: the paths sum in different orders, so a
// weight's outputs never depend on M).
template <typename T>
Path path_for([[maybe_unused]] int64_t K) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (simd::cpu_has_amx_bf16() && K % 32 == 0) return Path::kAmx;
    if (simd::cpu_has_avx512_bf16() && bf16_widens()) return Path::kAvx512Widen;
  }
  const bool avx512 = std::is_same_v<T, float> ? simd::cpu_has_avx512() : simd::cpu_has_avx512_bf16();
  return avx512 ? Path::kAvx512 : simd::cpu_isa() >= simd::Isa::kAvx2 ? Path::kAvx2 : Path::kScalar;
}

// Weight rows [n_begin, n_end) on `path`. Each thread of a split call widens a bf16 x for the AVX2 path itself, into
// its own buffer (reused across calls: a forward makes ~40 of them per thread).
template <typename T>
void rows(const LinearArgs<T>& a, [[maybe_unused]] Path path, int64_t n_begin, int64_t n_end) {
#if SPECDEC_LINEAR_X86
#if SPECDEC_CPU_AMX
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (path == Path::kAmx) return rows_amx(a, n_begin, n_end);
  }
#endif
  if (path == Path::kAvx512) return rows_avx512<T>(a, n_begin, n_end);
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (path == Path::kAvx512Widen) {
      thread_local std::vector<float> widened;  // [M, ldxf]
      const int64_t ldxf = (a.K + 31) / 32 * 32;
      widened.resize(static_cast<size_t>(a.M * ldxf));
      widen_even_odd32(a, widened.data(), ldxf);
      return rows_widen(a, widened.data(), ldxf, n_begin, n_end);
    }
  }
  if (path == Path::kAvx2) {
    if constexpr (std::is_same_v<T, float>) {
      return rows_avx2<T>({a, a.x, a.ldx}, n_begin, n_end);
    } else {
      thread_local std::vector<float> widened;  // [M, ldxf]
      const int64_t ldxf = (a.K + 15) / 16 * 16;
      widened.resize(static_cast<size_t>(a.M * ldxf));
      widen_even_odd(a, widened.data(), ldxf);
      return rows_avx2<T>({a, widened.data(), ldxf}, n_begin, n_end);
    }
  }
#endif
  rows_scalar<T>(a, n_begin, n_end);
}

template <typename T>
void run(const LinearArgs<T>& a) {
  const Path path = path_for<T>(a.K);
  const int64_t num_blocks = (a.N + kRowBlock - 1) / kRowBlock;
  // Threads for calls with >= ~1 us of one-thread work. Between the forwards of a decode loop the second thread
  // spins (OpenMP's active wait), so handing it half of a call costs well under a microsecond; a higher threshold
  // (tuned with the thread asleep, when the v projection [64, 320] fp32 at M=1 ran slower on two threads than one)
  // left the default target's qkv, o and bfloat16 down projections, half its weights, on one thread. Forward at
  // T=1, interleaved in one process: bfloat16 21% less time, float32 10%. One block's work
  // is the larger of its streaming time (~130 KB/us from L2) and its FMA time (one core: ~200 GFLOP/s fp32, ~350
  // bf16), measured on the default target's matrices; at::parallel_for splits only ranges longer than `grain`
  // blocks. The split is by whole blocks: a tile's sums never depend on the thread count.
  const double block_bytes = static_cast<double>(kRowBlock * a.K * static_cast<int64_t>(sizeof(T)));
  const double block_flops = 2.0 * static_cast<double>(a.M * kRowBlock * a.K);
  const double flops_per_us = path == Path::kAmx                                   ? 2000e3
                              : std::is_same_v<T, float> || path == Path::kAvx512Widen ? 200e3
                                                                                       : 350e3;
  const double block_us = std::max(block_bytes / 130e3, block_flops / flops_per_us);
  const int64_t grain = static_cast<int64_t>(1.0 / std::max(block_us, 1e-3)) + 1;
  at::parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) {
    rows<T>(a, path, begin * kRowBlock, std::min(end * kRowBlock, a.N));
  });
}

// Share `part` of `parts` of the weight rows, as whole blocks: parts are equal to within one block.
template <typename T>
void run_part(const LinearArgs<T>& a, int64_t part, int64_t parts) {
  const int64_t num_blocks = (a.N + kRowBlock - 1) / kRowBlock;
  const int64_t per = num_blocks / parts, extra = num_blocks % parts;
  const int64_t begin = part * per + std::min(part, extra), end = begin + per + (part < extra ? 1 : 0);
  if (begin < end) rows<T>(a, path_for<T>(a.K), begin * kRowBlock, std::min(end * kRowBlock, a.N));
}

// Checks that need no values: shared by the CPU and Meta kernels, so fake-tensor tracing raises the same errors.
// Raises ValueError / TypeError in Python, like spec_kernels.linear's own checks.
void check_inputs(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "linear: x must be [..., K], got a 0-d tensor");
  TORCH_CHECK_VALUE(weight.dim() == 2, "linear: weight must be [N, K], got shape ", weight.sizes());
  TORCH_CHECK_VALUE(x.size(-1) == weight.size(1), "linear: x [..., K] has K = ", x.size(-1),
                    " but weight [N, K] has K = ", weight.size(1));
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                   "linear: the native kernel takes float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), "linear: weight is ", weight.scalar_type(), " but x is ",
                   x.scalar_type());
  TORCH_CHECK_VALUE(weight.device() == x.device(), "linear: weight is on ", weight.device(), " but x is on ",
                    x.device());
  TORCH_CHECK_VALUE(weight.is_contiguous(), "linear: weight must be contiguous [N, K] (rows are streamed), got strides ",
                    weight.strides());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0), "linear: bias must be [N] with N = ",
                      weight.size(0), ", got shape ", bias->sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "linear: bias is ", bias->scalar_type(), " but x is ",
                     x.scalar_type());
    TORCH_CHECK_VALUE(bias->device() == x.device(), "linear: bias is on ", bias->device(), " but x is on ",
                      x.device());
  }
}

std::vector<int64_t> out_shape(const at::Tensor& x, const at::Tensor& weight) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = weight.size(0);
  return shape;
}

}  // namespace

void linear_f32(const float* x, const float* weight, const float* bias, float* out, int64_t M, int64_t N, int64_t K,
                int64_t ldx) {
  if (M > 0 && N > 0) run<float>({x, weight, bias, out, M, N, K, ldx});
}

void linear_bf16(const c10::BFloat16* x, const c10::BFloat16* weight, const c10::BFloat16* bias, c10::BFloat16* out,
                 int64_t M, int64_t N, int64_t K, int64_t ldx) {
  if (M > 0 && N > 0) run<c10::BFloat16>({x, weight, bias, out, M, N, K, ldx});
}

void linear_f32_part(const float* x, const float* weight, const float* bias, float* out, int64_t M, int64_t N,
                     int64_t K, int64_t ldx, int64_t part, int64_t parts) {
  if (M > 0 && N > 0) run_part<float>({x, weight, bias, out, M, N, K, ldx}, part, parts);
}

void linear_bf16_part(const c10::BFloat16* x, const c10::BFloat16* weight, const c10::BFloat16* bias,
                      c10::BFloat16* out, int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t part, int64_t parts) {
  if (M > 0 && N > 0) run_part<c10::BFloat16>({x, weight, bias, out, M, N, K, ldx}, part, parts);
}

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_inputs(x, weight, bias);
  TORCH_CHECK_VALUE(x.device().is_cpu(), "linear: the native CPU kernel got tensors on ", x.device());
  const int64_t K = weight.size(1);
  const int64_t N = weight.size(0);
  at::Tensor out = at::empty(out_shape(x, weight), x.options());  // [..., N]
  const int64_t M = K == 0 ? out.numel() / std::max<int64_t>(N, 1) : x.numel() / K;
  if (M == 0 || N == 0) return out;
  // [M, K] with unit inner stride: a view when x is (a row slice of) a contiguous tensor, a copy otherwise.
  at::Tensor rows = x.reshape({M, K});
  if (K > 1 && rows.stride(1) != 1) rows = rows.contiguous();
  at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();

  if (x.scalar_type() == at::kFloat) {
    run<float>({rows.data_ptr<float>(), weight.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                out.data_ptr<float>(), M, N, K, rows.stride(0)});
  } else {
    using bf16 = c10::BFloat16;
    run<bf16>({rows.data_ptr<bf16>(), weight.data_ptr<bf16>(), b.defined() ? b.data_ptr<bf16>() : nullptr,
               out.data_ptr<bf16>(), M, N, K, rows.stride(0)});
  }
  return out;
}

std::tuple<std::string, double> linear_path(bool bf16, int64_t k) {
  const Path path = bf16 ? path_for<c10::BFloat16>(k) : path_for<float>(k);
  const char* name = path == Path::kAmx           ? "amx"
                     : path == Path::kAvx512Widen ? "avx512-widen"
                     : path == Path::kAvx512      ? (bf16 ? "avx512-dot" : "avx512")
                     : path == Path::kAvx2        ? "avx2"
                                                  : "scalar";
  return {name, dot_over_fma()};
}

at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_inputs(x, weight, bias);
  return at::empty(out_shape(x, weight), x.options());
}

}  // namespace specdec
