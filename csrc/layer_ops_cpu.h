// Vector primitives (dot, axpy and weighted sums over float32 or bfloat16 rows: an AVX-512 body, an AVX2 one and a
// scalar one, chosen once per process), row-wise pieces (RMSNorm, RoPE) and the linear kernels' entry points as the
// decoder layers call them (csrc/layers_cpu.h). Internal to the CPU layer stack: each translation unit that includes
// it gets its own copy (an unnamed namespace).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_team.h"
#include "linear_cpu.h"
#include "quant_linear_cpu.h"

#include "cpu_simd.h"

#define SPECDEC_DECODER_X86 SPECDEC_CPU_X86

namespace specdec {
namespace {

using simd::cpu_has_avx2;
using simd::cpu_has_avx512;

// ---------------------------------------------------------------------------------------------------------------
// Vector primitives over float32 queries / accumulators and float32 or bfloat16 keys / values: an AVX-512 body, an
// AVX2 one and a scalar one, chosen once per process (their dot products sum in different orders, so one process never
// mixes them).
// ---------------------------------------------------------------------------------------------------------------

inline float to_f(float v) { return v; }
inline float to_f(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
void axpy_scalar(float alpha, const T* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * to_f(x[i]);
}

#if SPECDEC_DECODER_X86
// How many keys ahead attention's reads of the cache prefetch their K and V rows (tried 8-256 on Zen 4:
// bench/RESULTS.md, "Attention's reads of the cache, into L2").
constexpr int64_t kKeysAhead = 32;

// Every cache line of a K or V row of the paged cache (n elements at p), into L2 ahead of its read: attention gathers
// the rows by index (a KV head's rows a stride apart, blocks anywhere). A row of D = 64 bfloat16 spans two lines.
// Into L1 (before), a long context's loads still stalled on their rows.
template <typename T>
__attribute__((always_inline)) inline void prefetch_row(const T* p, int64_t n) {
  const uintptr_t from = reinterpret_cast<uintptr_t>(p);
  simd::prefetch_lines(from, from + n * sizeof(T), true);
}

// 16 elements (the first `count` of them; the rest zero) as float32 lanes.
template <typename T>
SPECDEC_AVX512 inline __m512 load16(const T* p, int64_t count) {
  const __mmask16 m = count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(m, p);
  } else {
    const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
}

// The first `count` (<= 16) of 16 float32 lanes stored at p as float32 or bfloat16 (simd::round_bf16): load16's
// inverse.
template <typename T>
SPECDEC_AVX512 inline void store16(T* p, __m512 v, int64_t count) {
  const __mmask16 m = count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(p, m, v);
  } else {
    _mm256_mask_storeu_epi16(p, m, simd::round_bf16(v));
  }
}

// scale_row and convert_row (below), 16 and 8 elements at a time (convert_row's 8: simd::convert_row8).
template <typename W, typename O>
SPECDEC_AVX512 void scale_row_avx512(const float* x, float inv, const W* w, O* o, int64_t n) {
  const __m512 s = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 16) {
    store16(o + i, _mm512_mul_ps(_mm512_mul_ps(load16(x + i, n - i), s), load16(w + i, n - i)), n - i);
  }
}

template <typename I, typename O>
SPECDEC_AVX512 inline void convert_row_avx512(const I* x, O* o, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) store16(o + i, load16(x + i, n - i), n - i);
}

template <typename W, typename O>
SPECDEC_AVX2 void scale_row_avx2(const float* x, float inv, const W* w, O* o, int64_t n) {
  const __m256 s = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 8) {
    simd::store8(o + i, _mm256_mul_ps(_mm256_mul_ps(simd::load8(x + i, n - i), s), simd::load8(w + i, n - i)), n - i);
  }
}

// Lane l sums a[i] * b[i] for i = l, l + 16, ...; then one fixed reduction of the 16 lanes.
template <typename T>
SPECDEC_AVX512 float dot_avx512(const float* a, const T* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(load16(a + i, n - i), load16(b + i, n - i), acc);
  return _mm512_reduce_add_ps(acc);
}

template <typename T>
SPECDEC_AVX512 void axpy_avx512(float alpha, const T* x, float* y, int64_t n) {
  const __m512 a = _mm512_set1_ps(alpha);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(a, load16(x + i, n - i), _mm512_maskz_loadu_ps(m, y + i)));
  }
}

// acc[g C + c] += s[g ld_s + j] * v[rows[j] + 16c .. 16c + 15] for c < C and heads g < NG over keys j in order: each
// key's V row is widened once for the NG heads (C and NG constants: no lane checks or spills in the key loop).
template <int C, int NG, typename T>
SPECDEC_AVX512 inline void accumulate_values16(const float* s, int64_t ld_s, const T* v, const int64_t* rows,
                                               int64_t n, __m512* acc) {
  for (int64_t j = 0; j < n; ++j) {
    const T* row = v + rows[j];
    if (j + kKeysAhead < n) prefetch_row(v + rows[j + kKeysAhead], 16 * C);
    __m512 vr[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) vr[c] = load16(row + 16 * c, 16);
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) {
      const __m512 a = _mm512_set1_ps(s[g * ld_s + j]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[g * C + c] = _mm512_fmadd_ps(a, vr[c], acc[g * C + c]);
    }
  }
}

// o [D] = sum over keys j, in order, of s[j] * v[rows[j]]: one fused multiply-add per key and element from zero (or,
// `resume`, from o's values: a sum continued over more keys), as axpy_avx512 key by key does (the same values), with
// up to 128 elements' sums in registers across the keys. Through memory each key's adds waited on the previous key's
// stores. D not a multiple of 16 takes axpy_avx512.
template <typename T>
SPECDEC_AVX512 void weighted_sum_avx512(const float* s, const T* v, const int64_t* rows, int64_t n, int64_t D,
                                        float* o, bool resume) {
  if (D % 16 != 0) {
    if (!resume) std::fill(o, o + D, 0.f);
    for (int64_t j = 0; j < n; ++j) axpy_avx512(s[j], v + rows[j], o, D);
    return;
  }
  for (int64_t d0 = 0; d0 < D; d0 += 128) {
    const int64_t chunks = std::min<int64_t>(8, (D - d0) / 16);
    __m512 acc[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) acc[c] = resume && c < chunks ? _mm512_loadu_ps(o + d0 + 16 * c) : _mm512_setzero_ps();
    switch (chunks) {
      case 8: accumulate_values16<8, 1>(s, 0, v + d0, rows, n, acc); break;
      case 7: accumulate_values16<7, 1>(s, 0, v + d0, rows, n, acc); break;
      case 6: accumulate_values16<6, 1>(s, 0, v + d0, rows, n, acc); break;
      case 5: accumulate_values16<5, 1>(s, 0, v + d0, rows, n, acc); break;
      case 4: accumulate_values16<4, 1>(s, 0, v + d0, rows, n, acc); break;
      case 3: accumulate_values16<3, 1>(s, 0, v + d0, rows, n, acc); break;
      case 2: accumulate_values16<2, 1>(s, 0, v + d0, rows, n, acc); break;
      default: accumulate_values16<1, 1>(s, 0, v + d0, rows, n, acc); break;
    }
    for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(o + d0 + 16 * c, acc[c]);
  }
}

// weighted_sum_avx512 for NG heads at once over the same keys (s [NG, ld_s], o [NG, D] with D = 16 C): the same
// multiply-adds in the same key order for every head (the same values), each V row widened once.
template <int C, int NG, typename T>
SPECDEC_AVX512 void weighted_sums_avx512(const float* s, int64_t ld_s, const T* v, const int64_t* rows, int64_t n,
                                         float* o, bool resume) {
  __m512 acc[NG * C];
#pragma GCC unroll 32
  for (int i = 0; i < NG * C; ++i) acc[i] = resume ? _mm512_loadu_ps(o + 16 * i) : _mm512_setzero_ps();
  accumulate_values16<C, NG>(s, ld_s, v, rows, n, acc);
#pragma GCC unroll 32
  for (int i = 0; i < NG * C; ++i) _mm512_storeu_ps(o + 16 * i, acc[i]);  // head g, chunk c at o + g D + 16 c
}

// G heads' weighted sums (s [G, ld_s] -> o [G, D]; `resume`: continued from o's values): up to 6 heads at once for
// D = 64 and 3 for D = 128 (as many as the registers hold), else head by head.
template <typename T>
SPECDEC_AVX512 void weighted_sums_heads_avx512(const float* s, int64_t ld_s, const T* v, const int64_t* rows,
                                               int64_t n, int64_t D, int64_t G, float* o, bool resume) {
  for (int64_t g = 0; g < G;) {
    const float* sg = s + g * ld_s;
    float* og = o + g * D;
    const int64_t left = G - g;
    if (D == 64) {
      switch (std::min<int64_t>(left, 6)) {
        case 6: weighted_sums_avx512<4, 6>(sg, ld_s, v, rows, n, og, resume); break;
        case 5: weighted_sums_avx512<4, 5>(sg, ld_s, v, rows, n, og, resume); break;
        case 4: weighted_sums_avx512<4, 4>(sg, ld_s, v, rows, n, og, resume); break;
        case 3: weighted_sums_avx512<4, 3>(sg, ld_s, v, rows, n, og, resume); break;
        case 2: weighted_sums_avx512<4, 2>(sg, ld_s, v, rows, n, og, resume); break;
        default: weighted_sums_avx512<4, 1>(sg, ld_s, v, rows, n, og, resume); break;
      }
      g += std::min<int64_t>(left, 6);
    } else if (D == 128) {
      switch (std::min<int64_t>(left, 3)) {
        case 3: weighted_sums_avx512<8, 3>(sg, ld_s, v, rows, n, og, resume); break;
        case 2: weighted_sums_avx512<8, 2>(sg, ld_s, v, rows, n, og, resume); break;
        default: weighted_sums_avx512<8, 1>(sg, ld_s, v, rows, n, og, resume); break;
      }
      g += std::min<int64_t>(left, 3);
    } else {
      weighted_sum_avx512(sg, v, rows, n, D, og, resume);
      g += 1;
    }
  }
}

// AVX2: lane l sums a[i] * b[i] for i = l, l + 8, ...; then reduce_add8's fixed tree.
template <typename T>
SPECDEC_AVX2 float dot_avx2(const float* a, const T* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(simd::load8(a + i, n - i), simd::load8(b + i, n - i), acc);
  return simd::reduce_add8(acc);
}

template <typename T>
SPECDEC_AVX2 void axpy_avx2(float alpha, const T* x, float* y, int64_t n) {
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, simd::load8(x + i, 8), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] = std::fma(alpha, to_f(x[i]), y[i]);  // the vector lanes' fused rounding
}
#endif

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
#if SPECDEC_DECODER_X86
  if (cpu_has_avx512()) return dot_avx512(a, b, n);
  if (cpu_has_avx2()) return dot_avx2(a, b, n);
#endif
  return simd::dot8(a, b, n);
}

template <typename T>
inline void axpy(float alpha, const T* x, float* y, int64_t n) {
#if SPECDEC_DECODER_X86
  if (cpu_has_avx512()) return axpy_avx512(alpha, x, y, n);
  if (cpu_has_avx2()) return axpy_avx2(alpha, x, y, n);
#endif
  axpy_scalar(alpha, x, y, n);
}

// ---------------------------------------------------------------------------------------------------------------
// Row-wise pieces.
// ---------------------------------------------------------------------------------------------------------------

// o[i] = x[i] for n elements, float32 or bfloat16 either side: widened exactly, or rounded as c10::BFloat16 rounds,
// on every path.
template <typename I, typename O>
void convert_row(const I* x, O* o, int64_t n) {
#if SPECDEC_DECODER_X86
  if (cpu_has_avx512()) return convert_row_avx512(x, o, n);
  if (cpu_has_avx2()) return simd::convert_row8(x, o, n);
#endif
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<O>(to_f(x[i]));
}

// o[i] = x[i] * inv * w[i] for n elements, rounded once to O: the same two products per element on every path.
template <typename W, typename O>
void scale_row(const float* x, float inv, const W* w, O* o, int64_t n) {
#if SPECDEC_DECODER_X86
  if (cpu_has_avx512()) return scale_row_avx512(x, inv, w, o, n);
  if (cpu_has_avx2()) return scale_row_avx2(x, inv, w, o, n);
#endif
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<O>(x[i] * inv * to_f(w[i]));
}

// out = x / sqrt(mean(x^2) + eps) * w for `rows` rows of n: float32 statistics (x row stride ldx), the result in
// out's type (contiguous rows). In place when out == x.
template <typename W, typename O>
void rms_norm(const float* x, int64_t ldx, const W* w, float eps, O* out, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    const float inv = 1.f / std::sqrt(dot(xr, xr, n) / static_cast<float>(n) + eps);
    scale_row(xr, inv, w, out + r * n, n);
  }
}

// Rotate-half RoPE of one head in place: x[i] = x[i] cos[i] - x[i + D/2] sin[i], x[i + D/2] = x[i + D/2] cos[i + D/2]
// + x[i] sin[i + D/2]; the same two products and one sum per element as the torch path's x * cos + rotated * sin.
template <typename T>
void rope_head(float* x, const T* cos, const T* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * to_f(cos[i]) + (-b) * to_f(sin[i]);
    x[i + half] = b * to_f(cos[i + half]) + a * to_f(sin[i + half]);
  }
}

// Soft capping (Gemma 2's attention scores and final logits): out = cap tanh(z / cap) for n elements of z (float32 or
// bfloat16), cap > 0; +-inf and NaN stay themselves (a logit outside a restricted vocabulary stays -inf). tanh as
// Cephes' tanhf: an odd polynomial below |y| = 0.625, 1 - 2 / (e^(2 |y|) + 1) above, its sign copied back. The
// AVX-512 and AVX2 bodies agree lane by lane (simd::exp16 / exp8); the scalar one (std::exp) may differ from them in
// the last bit. The attention and the final logits of every path (the decoder layers, the step runners, the softcap
// op) run this one function, its body chosen once per process, so a native step's capped logits are a regular
// step's bit for bit. out may be z (float32).
constexpr float kTanhSmall = 0.625f;
constexpr float kTanhPoly[5] = {-5.70498872745E-3f, 2.06390887954E-2f, -5.37397155531E-2f, 1.33314422036E-1f,
                                -3.33332819422E-1f};

inline float soft_cap_scalar(float z, float cap) {
  if (std::isinf(z) || z != z) return z;
  const float y = z / cap, a = std::fabs(y), s = y * y;
  float t;
  if (a < kTanhSmall) {
    float poly = kTanhPoly[0];
    for (int i = 1; i < 5; ++i) poly = std::fma(poly, s, kTanhPoly[i]);
    t = std::fma(poly * s, a, a);
  } else {
    t = 1.f - 2.f / (std::exp(a + a) + 1.f);
  }
  return std::copysign(t, y) * cap;
}

#if SPECDEC_DECODER_X86
SPECDEC_AVX512 inline __m512 soft_cap16(__m512 z, __m512 cap) {
  const __m512 one = _mm512_set1_ps(1.f), y = _mm512_div_ps(z, cap), a = _mm512_abs_ps(y), s = _mm512_mul_ps(y, y);
  __m512 poly = _mm512_set1_ps(kTanhPoly[0]);
  for (int i = 1; i < 5; ++i) poly = _mm512_fmadd_ps(poly, s, _mm512_set1_ps(kTanhPoly[i]));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(poly, s), a, a);
  const __m512 e = simd::exp16(_mm512_add_ps(a, a));
  const __m512 large = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
  const __m512 t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(kTanhSmall), _CMP_LT_OQ), large, small);
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(static_cast<int32_t>(0x80000000u)));
  const __m512 out = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign)), cap);
  const __mmask16 keep = _mm512_cmp_ps_mask(z, z, _CMP_UNORD_Q) |
                         _mm512_cmp_ps_mask(_mm512_abs_ps(z), _mm512_set1_ps(std::numeric_limits<float>::infinity()),
                                            _CMP_EQ_OQ);
  return _mm512_mask_blend_ps(keep, out, z);
}

SPECDEC_AVX2 inline __m256 soft_cap8(__m256 z, __m256 cap) {
  const __m256 one = _mm256_set1_ps(1.f), y = _mm256_div_ps(z, cap), s = _mm256_mul_ps(y, y);
  const __m256 sign_bit = _mm256_set1_ps(-0.f), a = _mm256_andnot_ps(sign_bit, y);
  __m256 poly = _mm256_set1_ps(kTanhPoly[0]);
  for (int i = 1; i < 5; ++i) poly = _mm256_fmadd_ps(poly, s, _mm256_set1_ps(kTanhPoly[i]));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(poly, s), a, a);
  const __m256 e = simd::exp8(_mm256_add_ps(a, a));
  const __m256 large = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one)));
  const __m256 t = _mm256_blendv_ps(large, small, _mm256_cmp_ps(a, _mm256_set1_ps(kTanhSmall), _CMP_LT_OQ));
  const __m256 out = _mm256_mul_ps(_mm256_or_ps(t, _mm256_and_ps(sign_bit, y)), cap);
  const __m256 keep = _mm256_or_ps(_mm256_cmp_ps(z, z, _CMP_UNORD_Q),
                                   _mm256_cmp_ps(_mm256_andnot_ps(sign_bit, z),
                                                 _mm256_set1_ps(std::numeric_limits<float>::infinity()), _CMP_EQ_OQ));
  return _mm256_blendv_ps(out, z, keep);
}

template <typename T>
SPECDEC_AVX512 void soft_cap_avx512(const T* z, float* out, int64_t n, float cap) {
  const __m512 c = _mm512_set1_ps(cap);
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t count = std::min<int64_t>(16, n - i);
    store16(out + i, soft_cap16(load16(z + i, count), c), count);
  }
}

template <typename T>
SPECDEC_AVX2 void soft_cap_avx2(const T* z, float* out, int64_t n, float cap) {
  const __m256 c = _mm256_set1_ps(cap);
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t count = std::min<int64_t>(8, n - i);
    simd::store8(out + i, soft_cap8(simd::load8(z + i, count), c), count);
  }
}
#endif

template <typename T>
void soft_cap(const T* z, float* out, int64_t n, float cap) {
#if SPECDEC_DECODER_X86
  if (cpu_has_avx512()) return soft_cap_avx512(z, out, n, cap);
  if (cpu_has_avx2()) return soft_cap_avx2(z, out, n, cap);
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = soft_cap_scalar(to_f(z[i]), cap);
}

// A matrix of the model [N, K]: dense in the model's dtype (qtype 0), or GGUF blocks as the file stores them
// (csrc/quant_linear_cpu.h; qtype its ggml type id, told by the blocks' shape: qtype_of).
struct Weight {
  const void* data = nullptr;
  int64_t qtype = 0;
};

// The GGUF type of a uint8 (or int8: csrc/quant_linear_cpu.h's kInt8Activations) matrix of K inputs, told by its
// blocks: [N, K / block_weights, block_bytes]
// (QuantizedWeight.blocks: every type has its own pair), or [N, row_bytes] for the 32-weight types (whose widths
// differ; a Q4_K row is as wide as a Q4_0 one); 0 for a dense matrix; -1 for a shape no type has.
int64_t qtype_of(const at::Tensor& w, int64_t K) {
  if (w.scalar_type() != at::kByte && w.scalar_type() != at::kChar) return 0;
  const int64_t mode = w.scalar_type() == at::kChar ? kInt8Activations : 0;  // int8 blocks: 8-bit activations
  for (const QuantType q : {QuantType::kQ4_0, QuantType::kQ4_1, QuantType::kQ5_0, QuantType::kQ5_1, QuantType::kQ8_0,
                            QuantType::kQ2_K, QuantType::kQ3_K, QuantType::kQ4_K, QuantType::kQ5_K, QuantType::kQ6_K}) {
    const int64_t id = static_cast<int64_t>(q);
    const QuantFormat f = quant_format(id);
    if (quant_row_bytes(id, K) == 0) continue;
    const bool blocks = w.dim() == 3 && w.size(1) == K / f.block_weights && w.size(2) == f.block_bytes;
    const bool row = w.dim() == 2 && f.block_weights == kQuantBlock && w.size(1) == quant_row_bytes(id, K);
    if (blocks || row) return id + mode;
  }
  return -1;
}

Weight weight_of(const at::Tensor& w, int64_t K) { return {w.data_ptr(), qtype_of(w, K)}; }

// Matmuls in the model's dtype: the small-M kernel of csrc/linear_cpu.cpp, or on GGUF blocks the quantized kernel of
// csrc/quant_linear_cpu.cpp (the same float32 sums as linear on the dequantized matrix).
void linear(const float* x, const Weight& w, const float* bias, float* out, int64_t M, int64_t N, int64_t K) {
  if (w.qtype != 0) return quant_linear_f32(x, static_cast<const uint8_t*>(w.data), w.qtype, bias, out, M, N, K, K);
  linear_f32(x, static_cast<const float*>(w.data), bias, out, M, N, K, K);
}
void linear(const c10::BFloat16* x, const Weight& w, const c10::BFloat16* bias, c10::BFloat16* out, int64_t M,
            int64_t N, int64_t K) {
  if (w.qtype != 0) return quant_linear_bf16(x, static_cast<const uint8_t*>(w.data), w.qtype, bias, out, M, N, K, K);
  linear_bf16(x, static_cast<const c10::BFloat16*>(w.data), bias, out, M, N, K, K);
}
// One worker's share of the same (its weight-row blocks): the team's workers together write all of out.
void linear(const Worker& wk, const float* x, const Weight& w, const float* bias, float* out, int64_t M, int64_t N,
            int64_t K) {
  if (w.qtype != 0) {
    return quant_linear_f32_part(x, static_cast<const uint8_t*>(w.data), w.qtype, bias, out, M, N, K, K, wk.id(),
                                 wk.size());
  }
  linear_f32_part(x, static_cast<const float*>(w.data), bias, out, M, N, K, K, wk.id(), wk.size());
}
void linear(const Worker& wk, const c10::BFloat16* x, const Weight& w, const c10::BFloat16* bias, c10::BFloat16* out,
            int64_t M, int64_t N, int64_t K) {
  if (w.qtype != 0) {
    return quant_linear_bf16_part(x, static_cast<const uint8_t*>(w.data), w.qtype, bias, out, M, N, K, K, wk.id(),
                                  wk.size());
  }
  linear_bf16_part(x, static_cast<const c10::BFloat16*>(w.data), bias, out, M, N, K, K, wk.id(), wk.size());
}

// What one call works on, as raw pointers and sizes; T is the model's dtype (weights, activations, cache, RoPE).

}  // namespace
}  // namespace specdec
