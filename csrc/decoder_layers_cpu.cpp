// A stack of Llama-family decoder layers on a KV cache, in one op call: the engine's whole forward on CPU (float32
// or bfloat16 weights, activations and cache; the residual stream, norms, RoPE and softmax in float32).
//
// Glossary: B sequences, T new tokens each (a tree, a chain, one decode token or a prefill chunk), M = B * T rows,
// H the hidden size, Hq / Hkv query / key-value heads of D elements, G = Hq / Hkv query heads per KV head, I the MLP
// width, L_b the committed length of sequence b (its tree's K/V go to positions L_b .. L_b + T - 1).
//
// Why one op: the default target's forward is ~250 small torch ops at T = 1, whose dispatch and allocation cost several
// times all its matmuls; llama.cpp's whole forward on the same weights costs about the matmuls. Here a layer is 4 calls
// of the small-M linear kernel (csrc/linear_cpu.cpp) plus loops over the rows for everything else, in buffers allocated
// once per call.
//
// Per layer, for every row:   x = rms_norm(h) * w_in
//                             q, k, v = x @ Wqkv^T (+ b), [q_norm, k_norm], RoPE(q, k) from the given cos / sin
//                             K/V -> cache at L_b + t;  a = tree attention (prefix + the nodes the mask allows)
//                             h += a @ Wo^T;  x = rms_norm(h) * w_post;  h += (silu(x Wg^T) * (x Wu^T)) @ Wd^T
// and at the end h = rms_norm(h) * w_final.
//
// Batch invariance (greedy speculation relies on it): every value of row (b, t) is computed by the same sequence of
// float operations whatever B and T are and whatever the other rows hold. Matmuls: the linear kernel's fixed order.
// Norms, RoPE, SiLU: per row. Attention: one query row's scores run over its keys in position order (the prefix, then
// the tree nodes in node order, which is position order along a path) and are summed in that order; a key the mask
// hides contributes nothing. So a tree node's hidden state equals plain decoding's of the same tokens bit for bit.
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

// The weights of one layer as the Python side passes them (spec_kernels/decoder_layers.py: LAYER_FIELDS), in order.
enum LayerField : int {
  kInputNorm = 0,  // [H]
  kQkv,            // [(Hq + 2 Hkv) D, H]
  kQkvBias,        // [(Hq + 2 Hkv) D] or undefined
  kO,              // [H, Hq D]
  kPostNorm,       // [H]
  kGateUp,         // [2 I, H]: gate rows, then up rows
  kDown,           // [H, I]
  kQNorm,          // [D] or undefined (Qwen3)
  kKNorm,          // [D] or undefined
  kNumFields,
};
const char* const kFieldNames[kNumFields] = {"input_norm", "qkv",      "qkv_bias", "o",     "post_norm",
                                             "gate_up",    "down",     "q_norm",   "k_norm"};

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

// acc[c] += s[j] * v[rows[j] + 16c .. 16c + 15] for c < C over keys j in order (C a constant: no lane checks or
// spills in the key loop).
template <int C, typename T>
SPECDEC_AVX512 inline void accumulate_values16(const float* s, const T* v, const int64_t* rows, int64_t n,
                                               __m512* acc) {
  for (int64_t j = 0; j < n; ++j) {
    const __m512 a = _mm512_set1_ps(s[j]);
    const T* row = v + rows[j];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(a, load16(row + 16 * c, 16), acc[c]);
  }
}

// o [D] = sum over keys j, in order, of s[j] * v[rows[j]]: one fused multiply-add per key and element from zero, as
// axpy_avx512 key by key does (the same values), with up to 128 elements' sums in registers across the keys. Through
// memory each key's adds waited on the previous key's stores. D not a multiple of 16 takes axpy_avx512.
template <typename T>
SPECDEC_AVX512 void weighted_sum_avx512(const float* s, const T* v, const int64_t* rows, int64_t n, int64_t D,
                                        float* o) {
  if (D % 16 != 0) {
    std::fill(o, o + D, 0.f);
    for (int64_t j = 0; j < n; ++j) axpy_avx512(s[j], v + rows[j], o, D);
    return;
  }
  for (int64_t d0 = 0; d0 < D; d0 += 128) {
    __m512 acc[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) acc[c] = _mm512_setzero_ps();
    const int64_t chunks = std::min<int64_t>(8, (D - d0) / 16);
    switch (chunks) {
      case 8: accumulate_values16<8>(s, v + d0, rows, n, acc); break;
      case 7: accumulate_values16<7>(s, v + d0, rows, n, acc); break;
      case 6: accumulate_values16<6>(s, v + d0, rows, n, acc); break;
      case 5: accumulate_values16<5>(s, v + d0, rows, n, acc); break;
      case 4: accumulate_values16<4>(s, v + d0, rows, n, acc); break;
      case 3: accumulate_values16<3>(s, v + d0, rows, n, acc); break;
      case 2: accumulate_values16<2>(s, v + d0, rows, n, acc); break;
      default: accumulate_values16<1>(s, v + d0, rows, n, acc); break;
    }
    for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(o + d0 + 16 * c, acc[c]);
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

// out = x / sqrt(mean(x^2) + eps) * w for `rows` rows of n: float32 statistics (x row stride ldx), the result in
// out's type (contiguous rows). In place when out == x.
template <typename W, typename O>
void rms_norm(const float* x, int64_t ldx, const W* w, float eps, O* out, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    const float inv = 1.f / std::sqrt(dot(xr, xr, n) / static_cast<float>(n) + eps);
    O* o = out + r * n;
    for (int64_t i = 0; i < n; ++i) o[i] = static_cast<O>(xr[i] * inv * to_f(w[i]));
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

// A matrix of the model [N, K]: dense in the model's dtype (qtype 0), or GGUF blocks as the file stores them (uint8
// [N, K / 32 * block bytes], csrc/quant_linear_cpu.h; qtype its ggml type id, told by the block size).
struct Weight {
  const void* data = nullptr;
  int64_t qtype = 0;
};

// The GGUF type of a uint8 matrix of K inputs by its width (Q4_0 18, Q4_1 20, Q8_0 34 bytes per 32 inputs); 0 for a
// dense matrix; -1 for a width no type has.
int64_t qtype_of(const at::Tensor& w, int64_t K) {
  if (w.scalar_type() != at::kByte) return 0;
  if (w.dim() != 2 || K <= 0 || K % kQuantBlock != 0) return -1;
  for (const QuantType q : {QuantType::kQ4_0, QuantType::kQ4_1, QuantType::kQ8_0}) {
    if (w.size(1) == K / kQuantBlock * quant_block_bytes(static_cast<int64_t>(q))) return static_cast<int64_t>(q);
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
template <typename T>
struct Problem {
  int64_t B, T_, H, Hq, Hkv, D, I, num_layers;
  float eps, scale;
  const int64_t* seqlens;      // [B] (converted to int64)
  const bool* tree_mask;       // [B, T, T]
  const int32_t* block_table;  // [B, max_blocks] or nullptr (contiguous: block b, block_size = S)
  int64_t max_blocks, block_size, num_blocks;
  const T* cos;  // [B, T, D]
  const T* sin;  // [B, T, D]
  T* kv;         // [layers, 2, num_blocks, block_size, Hkv, D]
  const int64_t* capture;  // layers whose input residual stream is copied out (EAGLE-3's features), in order
  int64_t num_capture;
  T* features;             // [B, T, num_capture * H]

  // Offset of logical position p of sequence b in one cache plane, in elements, at KV head 0.
  int64_t row_offset(int64_t b, int64_t p) const {
    const int64_t block = block_table != nullptr ? block_table[b * max_blocks + p / block_size] : b;
    return (block * block_size + p % block_size) * Hkv * D;
  }
  T* plane(int64_t layer, int64_t which) const { return kv + (layer * 2 + which) * num_blocks * block_size * Hkv * D; }
};

// Cache row offsets (KV head 0) of every position 0 .. L_b + T - 1 of every sequence, concatenated (sequence b from
// cu[b]): what key_rows reads, computed once per forward and shared by every layer and query row. Rebuilt per layer
// and unit, with a division per key, it was ~3% of a draft forward at L = 64.
template <typename T>
void position_rows(const Problem<T>& p, std::vector<int64_t>& rows, std::vector<int64_t>& cu) {
  cu.assign(p.B + 1, 0);
  for (int64_t b = 0; b < p.B; ++b) cu[b + 1] = cu[b] + p.seqlens[b] + p.T_;
  rows.resize(cu[p.B]);
  for (int64_t b = 0; b < p.B; ++b) {
    int64_t* out = rows.data() + cu[b];
    const int64_t n = cu[b + 1] - cu[b];
    for (int64_t pos = 0; pos < n; pos += p.block_size - pos % p.block_size) {  // one block per step
      const int64_t first = p.row_offset(b, pos), count = std::min(n - pos, p.block_size - pos % p.block_size);
      for (int64_t i = 0; i < count; ++i) out[pos + i] = first + i * p.Hkv * p.D;
    }
  }
}

// The keys a query row sees, in attention order, as cache row offsets (KV head 0; `positions`: sequence b's part of
// position_rows' table): the prefix 0 .. L_b - 1, then the tree slots its mask allows. Plain decoding of the same
// token sees the same list (its ancestors are then committed positions, in the same order), so every sum below runs
// over the same index sequence in both: the attention of a tree node equals plain decoding's bit for bit. Slots the
// mask hides are not in the list.
template <typename T>
void key_rows(const Problem<T>& p, const int64_t* positions, int64_t b, int64_t t, std::vector<int64_t>& rows) {
  const int64_t L = p.seqlens[b];
  const bool* mask = p.tree_mask + (b * p.T_ + t) * p.T_;  // [T]
  rows.assign(positions, positions + L);
  for (int64_t j = 0; j < p.T_; ++j) {
    if (mask[j]) rows.push_back(positions[L + j]);
  }
}

// Attention of G query heads q [G, D] (float32) over the keys at `rows` (n of them) of one KV head of k / v planes
// (pointers already offset to the head), into out [G, D]. p [G, n] is scratch for the scores and probabilities.
// Scalar version: sequential sums in key order.
template <typename T>
void attend_scalar(const T* k, const T* v, const int64_t* rows, int64_t n, const float* q, int64_t G, int64_t D,
                   float scale, float* p, float* out) {
  for (int64_t g = 0; g < G; ++g) {
    float* s = p + g * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) {
      s[j] = simd::dot8(q + g * D, k + rows[j], D) * scale;
      mx = std::max(mx, s[j]);
    }
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = std::exp(s[j] - mx);
      sum += s[j];
    }
    float* o = out + g * D;
    std::fill(o, o + D, 0.f);
    for (int64_t j = 0; j < n; ++j) axpy_scalar(s[j], v + rows[j], o, D);
    const float inv = n > 0 ? 1.f / sum : 0.f;  // a row that sees nothing (L_b = 0, all-False mask row): zeros
    for (int64_t i = 0; i < D; ++i) o[i] *= inv;
  }
}

#if SPECDEC_DECODER_X86
// The same with AVX-512: scores 16 keys at a time (each key's dot summed lane-wise over D, then by reduce16's fixed
// tree: a key's score does not depend on which keys share its block), the max and the exponentials by vectors, the
// softmax sum in lanes by list index (index j in lane j % 16, one fixed reduction at the end), and the weighted sum
// of V rows in list order. Default target, one thread, T = 16: a forward 1.7x faster at L = 200, 2.2x at L = 500
// (before: a scalar exp and one _mm512_reduce_add_ps per score).
template <typename T>
SPECDEC_AVX512 void attend_avx512(const T* k, const T* v, const int64_t* rows, int64_t n, const float* q, int64_t G,
                                  int64_t D, float scale, float* p, float* out) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - j0);
    const __mmask16 live = count == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 qv = load16(q + g * D + d, D - d);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          if (j < count) {
            const int slot = 4 * (j % 4) + j / 4;  // reduce16 leaves acc[slot] in lane j
            acc[slot] = _mm512_fmadd_ps(qv, load16(k + rows[j0 + j] + d, D - d), acc[slot]);
          }
        }
      }
      _mm512_mask_storeu_ps(p + g * n + j0, live, _mm512_mul_ps(simd::reduce16(acc), scale_v));
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = p + g * n;
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 live = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
      mx = _mm512_mask_max_ps(mx, live, mx, _mm512_maskz_loadu_ps(live, s + j));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 live = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(live, simd::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), m)));
      _mm512_mask_storeu_ps(s + j, live, e);
      sum = _mm512_add_ps(sum, e);
    }
    const float total = _mm512_reduce_add_ps(sum);
    float* o = out + g * D;
    weighted_sum_avx512(s, v, rows, n, D, o);
    const float inv = n > 0 ? 1.f / total : 0.f;  // a row that sees nothing (L_b = 0, all-False mask row): zeros
    for (int64_t i = 0; i < D; ++i) o[i] *= inv;
  }
}

// acc[c] += s[j] * v[rows[j] + 8c .. 8c + 7] for c < C over keys j in order: C * 8 elements' sums in registers (C
// a constant, so no lane checks or spills in the key loop).
template <int C, typename T>
SPECDEC_AVX2 inline void accumulate_values(const float* s, const T* v, const int64_t* rows, int64_t n, __m256* acc) {
  for (int64_t j = 0; j < n; ++j) {
    const __m256 a = _mm256_set1_ps(s[j]);
    const T* row = v + rows[j];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(a, simd::load8(row + 8 * c, 8), acc[c]);
  }
}

// o [D] = sum over keys j, in order, of s[j] * v[rows[j]]: one fused multiply-add per key and element from zero, as
// axpy_avx2 key by key does, with up to 64 elements' sums held in registers across the keys. Through memory, each
// key's adds waited on the previous key's stores (~10 cycles a key). D not a multiple of 8 takes axpy_avx2.
template <typename T>
SPECDEC_AVX2 void weighted_sum_avx2(const float* s, const T* v, const int64_t* rows, int64_t n, int64_t D, float* o) {
  if (D % 8 != 0) {
    std::fill(o, o + D, 0.f);
    for (int64_t j = 0; j < n; ++j) axpy_avx2(s[j], v + rows[j], o, D);
    return;
  }
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
    const int64_t chunks = std::min<int64_t>(8, (D - d0) / 8);
    switch (chunks) {
      case 8: accumulate_values<8>(s, v + d0, rows, n, acc); break;
      case 7: accumulate_values<7>(s, v + d0, rows, n, acc); break;
      case 6: accumulate_values<6>(s, v + d0, rows, n, acc); break;
      case 5: accumulate_values<5>(s, v + d0, rows, n, acc); break;
      case 4: accumulate_values<4>(s, v + d0, rows, n, acc); break;
      case 3: accumulate_values<3>(s, v + d0, rows, n, acc); break;
      case 2: accumulate_values<2>(s, v + d0, rows, n, acc); break;
      default: accumulate_values<1>(s, v + d0, rows, n, acc); break;
    }
    for (int64_t c = 0; c < chunks; ++c) _mm256_storeu_ps(o + d0 + 8 * c, acc[c]);
  }
}

// The same with AVX2: 8 keys at a time (reduce8 leaves key j0 + j's score in lane j), the softmax sum in lanes by list
// index (index j in lane j % 8).
template <typename T>
SPECDEC_AVX2 void attend_avx2(const T* k, const T* v, const int64_t* rows, int64_t n, const float* q, int64_t G,
                              int64_t D, float scale, float* p, float* out) {
  const __m256 scale_v = _mm256_set1_ps(scale);
  alignas(32) float block[8];
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t count = std::min<int64_t>(8, n - j0);
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      if (count == 8 && D % 8 == 0) {  // whole vectors of 8 keys: no lane checks (the same sums)
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(q + g * D + d);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, simd::load8(k + rows[j0 + j] + d, 8), acc[j]);
        }
      } else {
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = simd::load8(q + g * D + d, D - d);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) {
            if (j < count) acc[j] = _mm256_fmadd_ps(qv, simd::load8(k + rows[j0 + j] + d, D - d), acc[j]);
          }
        }
      }
      _mm256_store_ps(block, _mm256_mul_ps(simd::reduce8(acc), scale_v));
      std::memcpy(p + g * n + j0, block, static_cast<size_t>(count) * sizeof(float));
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = p + g * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
    const __m256 m = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
      const int64_t count = std::min<int64_t>(8, n - j);
      _mm256_store_ps(block, simd::exp8(_mm256_sub_ps(simd::load8(s + j, count), m)));
      for (int64_t i = count; i < 8; ++i) block[i] = 0.f;  // (padding lanes: e^(0 - max))
      std::memcpy(s + j, block, static_cast<size_t>(count) * sizeof(float));
      sum = _mm256_add_ps(sum, _mm256_load_ps(block));
    }
    const float total = simd::reduce_add8(sum);
    float* o = out + g * D;
    weighted_sum_avx2(s, v, rows, n, D, o);
    const float inv = n > 0 ? 1.f / total : 0.f;  // a row that sees nothing (L_b = 0, all-False mask row): zeros
    for (int64_t i = 0; i < D; ++i) o[i] *= inv;
  }
}
#endif

template <typename T>
void attend(const T* k, const T* v, const int64_t* rows, int64_t n, const float* q, int64_t G, int64_t D, float scale,
            float* p, float* out) {
#if SPECDEC_DECODER_X86
  if (cpu_has_avx512()) return attend_avx512(k, v, rows, n, q, G, D, scale, p, out);
  if (cpu_has_avx2()) return attend_avx2(k, v, rows, n, q, G, D, scale, p, out);
#endif
  attend_scalar(k, v, rows, n, q, G, D, scale, p, out);
}

// out[i] = silu(gate[i]) * up[i] = gate / (1 + e^-gate) * up, for n elements.
template <typename T>
void silu_mul_scalar(const T* gate, const T* up, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = to_f(gate[i]);
    out[i] = static_cast<T>(g / (1.f + std::exp(-g)) * to_f(up[i]));
  }
}

#if SPECDEC_DECODER_X86
template <typename T>
SPECDEC_AVX512 void silu_mul_avx512(const T* gate, const T* up, T* out, int64_t n) {
  alignas(64) float buf[16];
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t count = std::min<int64_t>(16, n - i);
    const __m512 g = load16(gate + i, count);
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 e = simd::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_store_ps(buf, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), load16(up + i, count)));
    for (int64_t j = 0; j < count; ++j) out[i + j] = static_cast<T>(buf[j]);
  }
}

template <typename T>
SPECDEC_AVX2 void silu_mul_avx2(const T* gate, const T* up, T* out, int64_t n) {
  alignas(32) float buf[8];
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t count = std::min<int64_t>(8, n - i);
    const __m256 g = simd::load8(gate + i, count);
    const __m256 e = simd::exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_store_ps(buf, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), simd::load8(up + i, count)));
    for (int64_t j = 0; j < count; ++j) out[i + j] = static_cast<T>(buf[j]);
  }
}
#endif

template <typename T>
void silu_mul(const T* gate, const T* up, T* out, int64_t n) {
#if SPECDEC_DECODER_X86
  if (cpu_has_avx512()) return silu_mul_avx512(gate, up, out, n);
  if (cpu_has_avx2()) return silu_mul_avx2(gate, up, out, n);
#endif
  silu_mul_scalar(gate, up, out, n);
}

template <typename T>
const T* ptr(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

// h [M, H] float32: the residual stream, updated in place through every layer; out [M, H]: the final-normed h;
// with `head` [V, H] (dense or GGUF blocks) also logits [M, V] = out head^T. One team (csrc/cpu_team.h) runs the
// whole stack, the logits included: each stage is split across its workers (matmuls by weight-row blocks, attention
// by units, the row-wise pieces by rows of h) with a sync between stages. As ~5 at::parallel_for regions per layer,
// the fork / join cost dominated the small stages and left the second thread idle through every row-wise piece; the
// logits as a region of their own cost a few percent of a draft forward.
template <typename T>
void run_layers(const Problem<T>& p, const std::vector<at::Tensor>& weights, const T* final_norm, float* h, T* out,
                const Weight& head = {}, int64_t V = 0, T* logits = nullptr) {
  const int64_t M = p.B * p.T_, H = p.H, D = p.D, Hq = p.Hq, Hkv = p.Hkv, I = p.I, G = Hq / Hkv;
  const int64_t qkv_width = (Hq + 2 * Hkv) * D;
  std::vector<T> x(M * std::max(H, I)), qkv(M * qkv_width), attn(M * Hq * D), gate_up(M * 2 * I), delta(M * H);
  std::vector<float> qk(M * (Hq + Hkv) * D), attn_f(M * Hq * D);  // float32 q/k after norms and RoPE; attention
  // Each worker's key list and scores, sized here: nothing inside the team may allocate (an exception cannot leave
  // it).
  int64_t max_keys = 0;
  for (int64_t b = 0; b < p.B; ++b) max_keys = std::max(max_keys, p.seqlens[b] + p.T_);
  std::vector<int64_t> positions, cu_positions;  // [sum_b (L_b + T)], [B + 1]
  position_rows(p, positions, cu_positions);
  const int64_t max_workers = team_size();
  std::vector<std::vector<int64_t>> key_lists(max_workers);
  std::vector<std::vector<float>> score_bufs(max_workers);
  for (int64_t i = 0; i < max_workers; ++i) key_lists[i].reserve(max_keys), score_bufs[i].reserve(G * max_keys);

  run_team([&](const Worker& w) {
    std::vector<int64_t>& keys = key_lists[w.id()];
    std::vector<float>& scores = score_bufs[w.id()];
    const auto [m_begin, m_end] = w.share(M);  // this worker's rows of h in the row-wise stages
    const int64_t my_rows = m_end - m_begin;
    // Attention units: (b, t, KV head, a group of its G query heads). A group shares each key's loads across its
    // heads, so a unit is all G heads, except where the units would not spread evenly over the workers: then the G
    // heads split into `groups` parts. With one KV head (the default target) a decode token was a single unit, its
    // attention on one thread. Interleaved, L = 1024, bfloat16: a forward takes 22% less time at T = 1, 11% at T = 3.
    // Each head's sums are its own, so the split changes no value. Workers take every size()-th unit: a causal
    // chunk's later rows have more keys.
    const int64_t rows_units = M * Hkv;
    const int64_t groups = rows_units % w.size() == 0 || rows_units >= 4 * w.size() ? 1 : std::min(G, w.size());
    const int64_t per_group = (G + groups - 1) / groups;
    const int64_t num_units = rows_units * groups;

    for (int64_t l = 0; l < p.num_layers; ++l) {
      const at::Tensor* wl = weights.data() + l * kNumFields;
      T* k_plane = p.plane(l, 0);
      T* v_plane = p.plane(l, 1);
      for (int64_t c = 0; c < p.num_capture; ++c) {
        if (p.capture[c] != l) continue;
        for (int64_t m = m_begin; m < m_end; ++m) {
          T* dst = p.features + (m * p.num_capture + c) * H;
          for (int64_t i = 0; i < H; ++i) dst[i] = static_cast<T>(h[m * H + i]);
        }
      }
      rms_norm(h + m_begin * H, H, ptr<T>(wl[kInputNorm]), p.eps, x.data() + m_begin * H, my_rows, H);
      w.sync();
      linear(w, x.data(), weight_of(wl[kQkv], H), ptr<T>(wl[kQkvBias]), qkv.data(), M, qkv_width, H);
      w.sync();
      // q / k heads one by one (a decode token's 4-6 heads then spread over the workers): float32, norms, RoPE;
      // a KV head's K and V then go to the cache
      const auto [hd_begin, hd_end] = w.share(M * (Hq + Hkv));
      for (int64_t u = hd_begin; u < hd_end; ++u) {
        const int64_t m = u / (Hq + Hkv), hd = u % (Hq + Hkv);
        const T* row = qkv.data() + m * qkv_width;  // [Hq D | Hkv D | Hkv D]
        float* head = qk.data() + u * D;            // [D] of qk's row m: [Hq D | Hkv D]
        for (int64_t i = 0; i < D; ++i) head[i] = to_f(row[hd * D + i]);
        if (wl[kQNorm].defined()) rms_norm(head, D, ptr<T>(wl[hd < Hq ? kQNorm : kKNorm]), p.eps, head, 1, D);
        rope_head(head, p.cos + m * D, p.sin + m * D, D);
        if (hd < Hq) continue;
        const int64_t b = m / p.T_, t = m % p.T_;
        const int64_t dst = p.row_offset(b, p.seqlens[b] + t) + (hd - Hq) * D;
        for (int64_t i = 0; i < D; ++i) k_plane[dst + i] = static_cast<T>(head[i]);
        std::copy(row + (Hkv + hd) * D, row + (Hkv + hd + 1) * D, v_plane + dst);  // V head hd - Hq
      }
      w.sync();
      int64_t keys_of = -1;  // the query row whose keys `keys` holds
      for (int64_t u = w.id(); u < num_units; u += w.size()) {
        const int64_t m = u / (Hkv * groups), kvh = u / groups % Hkv;
        const int64_t h0 = kvh * G + u % groups * per_group, heads = std::min(per_group, (kvh + 1) * G - h0);
        if (heads <= 0) continue;
        const int64_t b = m / p.T_;
        if (m != keys_of) key_rows(p, positions.data() + cu_positions[b], b, m % p.T_, keys), keys_of = m;
        scores.resize(heads * keys.size());
        float* a = attn_f.data() + (m * Hq + h0) * D;  // [heads, D]
        attend(k_plane + kvh * D, v_plane + kvh * D, keys.data(), static_cast<int64_t>(keys.size()),
               qk.data() + m * (Hq + Hkv) * D + h0 * D, heads, D, p.scale, scores.data(), a);
        std::transform(a, a + heads * D, attn.data() + (m * Hq + h0) * D, [](float v) { return static_cast<T>(v); });
      }
      w.sync();
      linear(w, attn.data(), weight_of(wl[kO], Hq * D), nullptr, delta.data(), M, H, Hq * D);
      w.sync();
      for (int64_t i = m_begin * H; i < m_end * H; ++i) h[i] += to_f(delta[i]);
      rms_norm(h + m_begin * H, H, ptr<T>(wl[kPostNorm]), p.eps, x.data() + m_begin * H, my_rows, H);
      w.sync();
      linear(w, x.data(), weight_of(wl[kGateUp], H), nullptr, gate_up.data(), M, 2 * I, H);
      w.sync();
      // the activation, elementwise (any split gives the same values): this worker's share of all M * I, into x's
      // rows (x is dead once gate_up is done)
      const auto [a_begin, a_end] = w.share(M * I);
      for (int64_t i = a_begin; i < a_end;) {
        const int64_t m = i / I, c = i % I, n = std::min(a_end - i, I - c);
        silu_mul(gate_up.data() + m * 2 * I + c, gate_up.data() + m * 2 * I + I + c, x.data() + i, n);
        i += n;
      }
      w.sync();
      linear(w, x.data(), weight_of(wl[kDown], I), nullptr, delta.data(), M, H, I);
      w.sync();
      // the residual add, then (next layer or the end) the norm of the same rows: no sync between
      for (int64_t i = m_begin * H; i < m_end * H; ++i) h[i] += to_f(delta[i]);
    }
    rms_norm(h + m_begin * H, H, final_norm, p.eps, out + m_begin * H, my_rows, H);
    if (head.data == nullptr) return;
    w.sync();
    linear(w, out, head, nullptr, logits, M, V, H);  // the same row blocks as the logits kernel's own split
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Checks (no values: shared with the Meta kernel) and the entry points.
// ---------------------------------------------------------------------------------------------------------------

void check_vector(const at::Tensor& t, int64_t n, const char* name, int64_t layer) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n, "decoder_layers: layer ", layer, " ", name, " must be [", n,
                    "], got ", t.sizes());
}

void check_matrix(const at::Tensor& t, int64_t rows, int64_t cols, const char* name, int64_t layer) {
  const bool blocks = t.scalar_type() == at::kByte;
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == rows && (blocks ? qtype_of(t, cols) > 0 : t.size(1) == cols),
                    "decoder_layers: layer ", layer, " ", name, " must be [", rows, ", ", cols, "]",
                    blocks ? " as GGUF blocks (uint8 [N, K / 32 * 18, 20 or 34 bytes])" : "", ", got ", t.sizes());
}

struct Dims {
  int64_t B, T, H, Hq, Hkv, D, I, num_layers;
};

// The model's tensors: its layer weights, final norm and cache, in `dtype` on `device`, hidden size H. Dims with B
// and T zero. Checked once per call of every op (a chain op runs many forwards on them).
Dims check_model(at::ScalarType dtype, const c10::Device& device, int64_t H, const std::vector<at::Tensor>& weights,
                 const at::Tensor& final_norm, const at::Tensor& kv_cache, int64_t num_heads) {
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16,
                   "decoder_layers: the native path takes float32 or bfloat16, got ", dtype);
  TORCH_CHECK_VALUE(kv_cache.dim() == 6, "decoder_layers: kv_cache must be [layers, 2, blocks, block_size, Hkv, D], ",
                    "got ", kv_cache.sizes());
  TORCH_CHECK_VALUE(kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
                    "decoder_layers: kv_cache must be contiguous [layers, 2, ...], got shape ", kv_cache.sizes());
  TORCH_CHECK_TYPE(kv_cache.scalar_type() == dtype, "decoder_layers: kv_cache must be ", dtype, " like hidden, got ",
                   kv_cache.scalar_type());
  TORCH_CHECK_VALUE(weights.size() % kNumFields == 0, "decoder_layers: weights must hold ", int(kNumFields),
                    " tensors per layer, got ", weights.size());
  Dims d{0, 0, H, num_heads, kv_cache.size(4), kv_cache.size(5), 0, static_cast<int64_t>(weights.size()) / kNumFields};
  TORCH_CHECK_VALUE(d.num_layers <= kv_cache.size(0), "decoder_layers: ", d.num_layers, " layers but the cache has ",
                    kv_cache.size(0));
  TORCH_CHECK_VALUE(d.Hkv > 0 && d.Hq > 0 && d.Hq % d.Hkv == 0, "decoder_layers: num_heads ", d.Hq,
                    " must be a positive multiple of the cache's KV heads ", d.Hkv);
  TORCH_CHECK_VALUE(d.D % 2 == 0, "decoder_layers: head_dim must be even (rotate-half RoPE), got ", d.D);
  for (int64_t l = 0; l < d.num_layers; ++l) {
    const at::Tensor* w = weights.data() + l * kNumFields;
    for (int f = 0; f < kNumFields; ++f) {
      if (!w[f].defined()) {
        TORCH_CHECK_VALUE(f == kQkvBias || f == kQNorm || f == kKNorm, "decoder_layers: layer ", l, " ",
                          kFieldNames[f], " is missing");
        continue;
      }
      const bool matrix = f == kQkv || f == kO || f == kGateUp || f == kDown;  // these may be GGUF blocks (uint8)
      TORCH_CHECK_TYPE(w[f].scalar_type() == dtype || (matrix && w[f].scalar_type() == at::kByte),
                       "decoder_layers: layer ", l, " ", kFieldNames[f], " must be ", dtype, " like hidden",
                       matrix ? " (or uint8 GGUF blocks)" : "", ", got ", w[f].scalar_type());
      TORCH_CHECK_VALUE(w[f].device() == device && w[f].is_contiguous(), "decoder_layers: layer ", l, " ",
                        kFieldNames[f], " must be contiguous and on ", device);
    }
    TORCH_CHECK_VALUE(w[kQNorm].defined() == w[kKNorm].defined(), "decoder_layers: q_norm and k_norm go together");
    if (l == 0) d.I = w[kGateUp].dim() == 2 ? w[kGateUp].size(0) / 2 : 0;
    const int64_t qkv_width = (d.Hq + 2 * d.Hkv) * d.D;
    check_vector(w[kInputNorm], d.H, "input norm", l);
    check_matrix(w[kQkv], qkv_width, d.H, "qkv", l);
    if (w[kQkvBias].defined()) check_vector(w[kQkvBias], qkv_width, "qkv bias", l);
    check_matrix(w[kO], d.H, d.Hq * d.D, "o", l);
    check_vector(w[kPostNorm], d.H, "post-attention norm", l);
    check_matrix(w[kGateUp], 2 * d.I, d.H, "gate_up", l);
    check_matrix(w[kDown], d.H, d.I, "down", l);
    if (w[kQNorm].defined()) {
      check_vector(w[kQNorm], d.D, "q_norm", l);
      check_vector(w[kKNorm], d.D, "k_norm", l);
    }
  }
  TORCH_CHECK_VALUE(final_norm.dim() == 1 && final_norm.size(0) == d.H && final_norm.scalar_type() == dtype,
                    "decoder_layers: final_norm must be ", dtype, " [", d.H, "], got ", final_norm.sizes());
  TORCH_CHECK_VALUE(final_norm.device() == device && kv_cache.device() == device,
                    "decoder_layers: all tensors must be on ", device);
  return d;
}

Dims check_inputs(const at::Tensor& hidden, const std::vector<at::Tensor>& weights, const at::Tensor& final_norm,
                  const at::Tensor& kv_cache, const at::Tensor& cache_seqlens, const at::Tensor& rope,
                  const at::Tensor& tree_mask, const c10::optional<at::Tensor>& block_table, int64_t num_heads,
                  at::IntArrayRef capture) {
  TORCH_CHECK_VALUE(hidden.dim() == 3, "decoder_layers: hidden must be [B, T, H], got ", hidden.sizes());
  const at::ScalarType dtype = hidden.scalar_type();
  Dims d = check_model(dtype, hidden.device(), hidden.size(2), weights, final_norm, kv_cache, num_heads);
  d.B = hidden.size(0), d.T = hidden.size(1);
  TORCH_CHECK_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == d.B, "decoder_layers: cache_seqlens must be [",
                    d.B, "], got ", cache_seqlens.sizes());
  TORCH_CHECK_TYPE(cache_seqlens.scalar_type() == at::kInt || cache_seqlens.scalar_type() == at::kLong,
                   "decoder_layers: cache_seqlens must be int32 or int64, got ", cache_seqlens.scalar_type());
  TORCH_CHECK_VALUE(rope.dim() == 4 && rope.size(0) == 2 && rope.size(1) == d.B && rope.size(2) == d.T &&
                        rope.size(3) == d.D && rope.scalar_type() == dtype,
                    "decoder_layers: rope must be ", dtype, " [2, B, T, D] = [2, ", d.B, ", ", d.T, ", ", d.D, "], got ",
                    rope.sizes(), " ", rope.scalar_type());
  TORCH_CHECK_VALUE(tree_mask.dim() == 3 && tree_mask.size(0) == d.B && tree_mask.size(1) == d.T &&
                        tree_mask.size(2) == d.T && tree_mask.scalar_type() == at::kBool,
                    "decoder_layers: tree_mask must be bool [B, T, T] = [", d.B, ", ", d.T, ", ", d.T, "], got ",
                    tree_mask.sizes(), " ", tree_mask.scalar_type());
  if (block_table.has_value()) {
    TORCH_CHECK_VALUE(block_table->dim() == 2 && block_table->size(0) == d.B, "decoder_layers: block_table must be [",
                      d.B, ", max_blocks], got ", block_table->sizes());
    TORCH_CHECK_TYPE(block_table->scalar_type() == at::kInt || block_table->scalar_type() == at::kLong,
                     "decoder_layers: block_table must be int32 or int64, got ", block_table->scalar_type());
  } else {
    TORCH_CHECK_VALUE(kv_cache.size(2) == d.B, "decoder_layers: a contiguous kv_cache [layers, 2, B, S, Hkv, D] has B = ",
                      kv_cache.size(2), " but hidden has ", d.B, " (pass block_table for a paged cache)");
  }
  for (const int64_t layer : capture) {
    TORCH_CHECK_VALUE(layer >= 0 && layer < d.num_layers, "decoder_layers: capture layer ", layer, " is not one of the ",
                      d.num_layers, " layers");
  }
  for (const at::Tensor* t : {&cache_seqlens, &rope, &tree_mask, &kv_cache, &final_norm}) {
    TORCH_CHECK_VALUE(t->device() == hidden.device(), "decoder_layers: all tensors must be on ", hidden.device(),
                      ", got one on ", t->device());
  }
  return d;
}

// The weights with the optional ones the caller left out (passed as empty tensors: the schema's list has no holes)
// made undefined.
std::vector<at::Tensor> present(at::TensorList list) {
  std::vector<at::Tensor> weights;
  weights.reserve(list.size());
  for (const at::Tensor& t : list) weights.push_back(t.numel() > 0 ? t : at::Tensor());
  return weights;
}

// Every position written or read must lie in the sequence's blocks: L_b + T within the table's capacity, and the
// blocks those positions use real blocks of the cache.
template <typename T>
void check_positions(const Problem<T>& p, int64_t B, int64_t T_) {
  const int64_t capacity = p.block_table != nullptr ? p.max_blocks * p.block_size : p.block_size;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(p.seqlens[b] >= 0 && p.seqlens[b] + T_ <= capacity, "decoder_layers: sequence ", b,
                      " has L_b = ", p.seqlens[b], " and T = ", T_, " but its cache holds ", capacity, " positions");
    if (p.block_table != nullptr) {
      const int64_t used = (p.seqlens[b] + T_ + p.block_size - 1) / p.block_size;
      for (int64_t i = 0; i < used; ++i) {
        const int32_t block = p.block_table[b * p.max_blocks + i];
        TORCH_CHECK_VALUE(block >= 0 && block < p.num_blocks, "decoder_layers: block_table[", b, ", ", i, "] = ",
                          block, " is not a block of the cache (", p.num_blocks, " blocks)");
      }
    }
  }
}

// Checks the values (positions and block ids; free on CPU), runs the layers and the final norm into out [B, T, H].
template <typename T>
void forward(const Dims& d, const at::Tensor& hidden, const std::vector<at::Tensor>& weights,
             const at::Tensor& final_norm, at::Tensor& kv_cache, const at::Tensor& seqlens, const at::Tensor& mask,
             const at::Tensor& cos_sin, const at::Tensor& table, double eps, const std::vector<int64_t>& capture,
             at::Tensor& out, at::Tensor& features) {
  Problem<T> p{};
  p.B = d.B, p.T_ = d.T, p.H = d.H, p.Hq = d.Hq, p.Hkv = d.Hkv, p.D = d.D, p.I = d.I, p.num_layers = d.num_layers;
  p.eps = static_cast<float>(eps);
  p.scale = 1.f / std::sqrt(static_cast<float>(d.D));
  p.seqlens = seqlens.data_ptr<int64_t>();
  p.tree_mask = mask.data_ptr<bool>();
  p.num_blocks = kv_cache.size(2);
  p.block_size = kv_cache.size(3);
  p.block_table = table.defined() ? table.data_ptr<int32_t>() : nullptr;
  p.max_blocks = table.defined() ? table.size(1) : 1;
  p.cos = cos_sin.data_ptr<T>();
  p.sin = p.cos + d.B * d.T * d.D;
  p.kv = kv_cache.data_ptr<T>();
  p.capture = capture.data();
  p.num_capture = static_cast<int64_t>(capture.size());
  p.features = features.data_ptr<T>();

  check_positions(p, d.B, d.T);

  std::vector<float> h(d.B * d.T * d.H);  // the residual stream in float32
  const T* in = hidden.data_ptr<T>();
  for (size_t i = 0; i < h.size(); ++i) h[i] = to_f(in[i]);
  run_layers(p, weights, final_norm.data_ptr<T>(), h.data(), out.data_ptr<T>());
}

}  // namespace

// Returns (out [B, T, H], features [B, T, len(capture) * H]): the final-normed hidden states, and the residual
// streams entering the layers in `capture` (in its order; empty when it is).
std::tuple<at::Tensor, at::Tensor> decoder_layers_cpu(const at::Tensor& hidden, at::TensorList weights_list,
                                                      const at::Tensor& final_norm, at::Tensor kv_cache,
                                                      const at::Tensor& cache_seqlens, const at::Tensor& rope,
                                                      const at::Tensor& tree_mask,
                                                      const c10::optional<at::Tensor>& block_table, int64_t num_heads,
                                                      double eps, at::IntArrayRef capture) {
  const std::vector<at::Tensor> weights = present(weights_list);
  const Dims d = check_inputs(hidden, weights, final_norm, kv_cache, cache_seqlens, rope, tree_mask, block_table,
                              num_heads, capture);
  TORCH_CHECK_VALUE(hidden.device().is_cpu(), "decoder_layers: the native kernel runs on CPU, got ", hidden.device());
  const at::Tensor seqlens = cache_seqlens.to(at::kLong).contiguous();  // [B]
  const at::Tensor mask = tree_mask.contiguous();                        // [B, T, T]
  const at::Tensor cos_sin = rope.contiguous();                          // [2, B, T, D]
  const at::Tensor input = hidden.contiguous();                          // [B, T, H]
  at::Tensor table;                                                      // [B, max_blocks]
  if (block_table.has_value()) table = block_table->to(at::kInt).contiguous();

  at::Tensor out = at::empty(hidden.sizes(), hidden.options());  // [B, T, H]
  at::Tensor features = at::empty({d.B, d.T, static_cast<int64_t>(capture.size()) * d.H}, hidden.options());
  if (out.numel() == 0) return {out, features};
  const std::vector<int64_t> layers(capture.begin(), capture.end());
  if (hidden.scalar_type() == at::kFloat) {
    forward<float>(d, input, weights, final_norm.contiguous(), kv_cache, seqlens, mask, cos_sin, table, eps, layers,
                   out, features);
  } else {
    forward<c10::BFloat16>(d, input, weights, final_norm.contiguous(), kv_cache, seqlens, mask, cos_sin, table, eps,
                           layers, out, features);
  }
  return {out, features};
}

std::tuple<at::Tensor, at::Tensor> decoder_layers_meta(const at::Tensor& hidden, at::TensorList weights_list,
                                                       const at::Tensor& final_norm, at::Tensor kv_cache,
                                                       const at::Tensor& cache_seqlens, const at::Tensor& rope,
                                                       const at::Tensor& tree_mask,
                                                       const c10::optional<at::Tensor>& block_table,
                                                       int64_t num_heads, double eps, at::IntArrayRef capture) {
  const std::vector<at::Tensor> weights = present(weights_list);
  const Dims d = check_inputs(hidden, weights, final_norm, kv_cache, cache_seqlens, rope, tree_mask, block_table,
                              num_heads, capture);
  return {at::empty(hidden.sizes(), hidden.options()),
          at::empty({d.B, d.T, static_cast<int64_t>(capture.size()) * d.H}, hidden.options())};
}

namespace {

// The first index of the maximum of z [V] (NaNs skipped; a row of NaNs gives 0): a greedy draft's choice. A bad
// proposal costs acceptance only, never correctness (verify_tree decides). ``strict``: -1 where the row holds a NaN
// or its maximum is not finite, the rows verify_greedy leaves to the Python path (which sanitises them or raises).
template <typename T>
int64_t first_argmax(const T* z, int64_t V, bool strict) {
  int64_t best = 0;
  float best_v = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int64_t i = 0; i < V; ++i) {
    const float v = to_f(z[i]);
    nan |= v != v;
    if (v > best_v) best_v = v, best = i;
  }
  return strict && (nan || !std::isfinite(best_v)) ? -1 : best;
}

// One model's forwards within one chain op call (draft_chain, spec_chain): its tensors checked and its cache's geometry
// read once, then every forward runs from raw buffers kept across forwards. Driven through ATen ops (the embedding,
// RoPE rows and mask as tensors, then decoder_layers_cpu), a forward cost ~25 op calls: ~60 per speculative step, each
// paying ATen's dispatch. The values are the op path's: the same embedding and RoPE rows, the causal mask, run_layers,
// the final norm, and the logits kernel.
template <typename T>
class ChainRunner {
 public:
  // embed [V, H], lm_head [V', H] (V' = V, or a restricted vocabulary's K), rope [2, P, D] by position; table
  // int32 [B, W] contiguous, or undefined for a contiguous cache of B rows. The model's dtype is the RoPE table's;
  // embed and lm_head are in it or GGUF blocks (uint8 [V, H / 32 * block bytes]: an embedding row is dequantized
  // to float32 and rounded to the dtype, as the op path's lookup does).
  ChainRunner(const char* op, const at::Tensor& embed, at::TensorList weights, const at::Tensor& norm,
              const at::Tensor& lm_head, const at::Tensor& kv, const at::Tensor& rope, int64_t heads, double eps,
              const at::Tensor& table, int64_t B)
      : op_(op),
        weights_(present(weights)),
        embed_(embed.contiguous()),
        norm_(norm.contiguous()),
        head_(lm_head.contiguous()),
        rope_(rope.contiguous()),
        table_(table) {
    TORCH_CHECK_VALUE(norm.dim() == 1, op, ": the final norm must be [H], got ", norm.sizes());
    const int64_t H = norm.size(0);
    embed_qtype_ = qtype_of(embed, H), head_qtype_ = qtype_of(lm_head, H);
    TORCH_CHECK_VALUE(embed.dim() == 2 && lm_head.dim() == 2 && embed_qtype_ >= 0 && head_qtype_ >= 0 &&
                          (embed_qtype_ > 0 || embed.size(1) == H) && (head_qtype_ > 0 || lm_head.size(1) == H),
                      op, ": embed [V, H] and lm_head [V, H] must have the final norm's H = ", H,
                      " (dense, or as GGUF blocks), got ", embed.sizes(), " and ", lm_head.sizes());
    const at::ScalarType dtype = rope.scalar_type();
    d_ = check_model(dtype, embed.device(), H, weights_, norm, kv, heads);
    TORCH_CHECK_TYPE((embed_qtype_ > 0 || embed.scalar_type() == dtype) &&
                         (head_qtype_ > 0 || lm_head.scalar_type() == dtype),
                     op, ": the embedding and lm_head must be ", dtype, " like the RoPE table (or GGUF blocks), got ",
                     embed.scalar_type(), " and ", lm_head.scalar_type());
    TORCH_CHECK_VALUE(rope.dim() == 3 && rope.size(0) == 2 && rope.size(2) == d_.D, op,
                      ": the RoPE table must be [2, P, D] with D = ", d_.D, ", got ", rope.sizes());
    if (table.defined()) {
      TORCH_CHECK_VALUE(table.dim() == 2 && table.size(0) == B, op, ": block_table must be [B, max_blocks] with B = ",
                        B, ", got ", table.sizes());
    } else {
      TORCH_CHECK_VALUE(kv.size(2) == B, op, ": a contiguous cache has ", kv.size(2), " rows for B = ", B);
    }
    p_.H = d_.H, p_.Hq = d_.Hq, p_.Hkv = d_.Hkv, p_.D = d_.D, p_.I = d_.I, p_.num_layers = d_.num_layers;
    p_.eps = static_cast<float>(eps);
    p_.scale = 1.f / std::sqrt(static_cast<float>(d_.D));
    p_.num_blocks = kv.size(2);
    p_.block_size = kv.size(3);
    p_.block_table = table.defined() ? table.data_ptr<int32_t>() : nullptr;
    p_.max_blocks = table.defined() ? table.size(1) : 1;
    p_.kv = kv.data_ptr<T>();
  }

  int64_t vocab() const { return head_.size(0); }
  int64_t hidden_size() const { return d_.H; }

  // Tokens [B, T] (row stride ld) at positions start[b] + t, a causal chunk over the cache: the final-normed hidden
  // states [B * T, H], their K/V written. Valid until the next forward.
  const T* forward(const int64_t* tokens, int64_t ld, int64_t B, int64_t T_, const int64_t* start) {
    run(tokens, ld, B, T_, start, false);
    return out_.data();
  }

  // The same forward and the logits [B * T, V'] of every row (logits(forward(...), B * T), in one team). Valid until
  // the next forward.
  const T* forward_logits(const int64_t* tokens, int64_t ld, int64_t B, int64_t T_, const int64_t* start) {
    run(tokens, ld, B, T_, start, true);
    return logits_.data();
  }

  // Logits [rows, V'] of hidden states [rows, H]. Valid until the next call.
  const T* logits(const T* hidden, int64_t rows) {
    logits_.resize(rows * vocab());
    if (rows > 0) linear(hidden, head(), nullptr, logits_.data(), rows, vocab(), d_.H);
    return logits_.data();
  }

 private:
  void run(const int64_t* tokens, int64_t ld, int64_t B, int64_t T_, const int64_t* start, bool with_logits) {
    const int64_t H = d_.H, D = d_.D, M = B * T_, V = embed_.size(0), P = rope_.size(1);
    h_.resize(M * H);
    cos_sin_.resize(2 * M * D);
    out_.resize(M * H);
    if (with_logits) logits_.resize(M * vocab());
    seqlens_.assign(start, start + B);
    if (mask_size_ < M * T_) mask_.reset(new bool[M * T_]), mask_size_ = M * T_;
    const T* emb = embed_qtype_ == 0 ? embed_.data_ptr<T>() : nullptr;
    const uint8_t* emb_blocks = embed_qtype_ != 0 ? embed_.data_ptr<uint8_t>() : nullptr;
    row_.resize(H);
    const T* cos = rope_.data_ptr<T>();
    const T* sin = cos + P * D;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T_; ++t) {
        const int64_t m = b * T_ + t, tok = tokens[b * ld + t], pos = start[b] + t;
        TORCH_CHECK_VALUE(tok >= 0 && tok < V, op_, ": token ", tok, " is not an id of the ", V, "-token embedding");
        TORCH_CHECK_VALUE(pos >= 0 && pos < P, op_, ": position ", pos, " needs a longer RoPE table than ", P);
        if (emb != nullptr) {
          for (int64_t i = 0; i < H; ++i) h_[m * H + i] = to_f(emb[tok * H + i]);
        } else {
          dequant_row(emb_blocks, embed_qtype_, H / kQuantBlock, tok, row_.data());
          for (int64_t i = 0; i < H; ++i) h_[m * H + i] = to_f(row_[i]);
        }
        std::copy(cos + pos * D, cos + (pos + 1) * D, cos_sin_.data() + m * D);
        std::copy(sin + pos * D, sin + (pos + 1) * D, cos_sin_.data() + (M + m) * D);
        for (int64_t j = 0; j < T_; ++j) mask_[m * T_ + j] = j <= t;
      }
    }
    Problem<T> p = p_;
    p.B = B, p.T_ = T_;
    p.seqlens = seqlens_.data();
    p.tree_mask = mask_.get();
    p.cos = cos_sin_.data();
    p.sin = p.cos + M * D;
    check_positions(p, B, T_);
    if (M == 0) return;
    run_layers(p, weights_, norm_.data_ptr<T>(), h_.data(), out_.data(), with_logits ? head() : Weight{},
               vocab(), logits_.data());
  }

  const char* op_;
  std::vector<at::Tensor> weights_;
  Weight head() const { return {head_.data_ptr(), head_qtype_}; }
  static void dequant_row(const uint8_t* w, int64_t qtype, int64_t blocks, int64_t row, float* out) {
    quant_dequant_row_f32(w, qtype, blocks, row, out);
  }
  static void dequant_row(const uint8_t* w, int64_t qtype, int64_t blocks, int64_t row, c10::BFloat16* out) {
    quant_dequant_row_bf16(w, qtype, blocks, row, out);
  }

  at::Tensor embed_, norm_, head_, rope_, table_;
  int64_t embed_qtype_ = 0, head_qtype_ = 0;  // GGUF type ids, 0 for dense
  std::vector<T> row_;                         // [H]: a quantized embedding row in the model's dtype
  Dims d_{};
  Problem<T> p_{};
  std::vector<float> h_;  // the residual stream in float32
  std::vector<T> cos_sin_, out_, logits_;
  std::vector<int64_t> seqlens_;
  std::unique_ptr<bool[]> mask_;
  int64_t mask_size_ = 0;
};

// A greedy chain: tokens tok [B, gamma] (row stride gamma), token d the argmax of token d - 1's logits (the first of
// the roots' logits [B, V]), tokens 1 .. gamma - 1 run through `model` at positions L_b + d. ``strict``: a row's
// tokens are -1 from its first non-finite logits on. ``id_of`` [V] (or null): a restricted vocabulary's token ids.
// ``stops`` [S]: the chain ends after the first token d at which any row emits one of them (no forward past it; the
// rows' tokens after d are left unwritten). Returns the tokens per row it emitted: gamma, or that d.
template <typename T, typename R>
int64_t run_chain(ChainRunner<T>& model, const R* root, int64_t V, const int64_t* L, int64_t B, int64_t gamma,
                  bool strict, const int64_t* id_of, int64_t* tok, const std::vector<int64_t>& stops = {}) {
  std::vector<int64_t> ids(B), pos(B);
  const T* logits = nullptr;  // [B, V]
  for (int64_t d = 1; d <= gamma; ++d) {
    bool stopped = false;
    for (int64_t b = 0; b < B; ++b) {
      int64_t& t = tok[b * gamma + d - 1];
      t = d > 1 && tok[b * gamma + d - 2] < 0 ? -1  // a strict row stays -1 after its first bad logits
          : d == 1                            ? first_argmax(root + b * V, V, strict)
                                              : first_argmax(logits + b * V, V, strict);
      if (id_of != nullptr) t = id_of[t];  // never strict: t >= 0
      ids[b] = std::max<int64_t>(t, 0);    // a -1 row runs token 0
      pos[b] = L[b] + d;                   // the node's slot
      stopped = stopped || std::find(stops.begin(), stops.end(), t) != stops.end();
    }
    if (d == gamma || stopped) return d;
    logits = model.forward_logits(ids.data(), 1, B, 1, pos.data());  // [B, V]
  }
  return gamma;
}

// The block table as the runners read it: int32, contiguous (undefined when absent).
at::Tensor table_of(const c10::optional<at::Tensor>& block_table) {
  return block_table.has_value() ? block_table->to(at::kInt).contiguous() : at::Tensor();
}

// A restricted vocabulary's ids [V] as int64, each an id of the embedding's `rows` (undefined when absent).
at::Tensor vocab_ids(const char* op, const c10::optional<at::Tensor>& vocab_map, int64_t V, int64_t rows) {
  if (!vocab_map.has_value()) return at::Tensor();
  TORCH_CHECK_VALUE(vocab_map->device().is_cpu(), op, ": vocab_map must be on the CPU");
  at::Tensor ids = vocab_map->to(at::kLong).contiguous();
  TORCH_CHECK_VALUE(ids.dim() == 1 && ids.size(0) == V, op, ": vocab_map must be [V] = [", V, "], got ", ids.sizes());
  TORCH_CHECK_VALUE(V == 0 || (ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < rows), op,
                    ": vocab_map ids must lie in [0, ", rows, ")");
  return ids;
}

// f(float{}) for float32, f(c10::BFloat16{}) otherwise: the chain ops' dtype dispatch (their checks allow these two).
template <typename F>
void with_dtype(at::ScalarType dtype, F&& f) {
  if (dtype == at::kFloat) {
    f(float{});
  } else {
    f(c10::BFloat16{});
  }
}

}  // namespace

// A greedy draft chain in one call: from the roots' draft logits [B, V], gamma tokens per row, each the argmax of
// the previous one's logits; the first gamma - 1 run through the model at positions L_b + d (their K/V written there,
// as the drafter's per-level forwards would). Returns tokens [B, gamma] int64. Why: a drafted level costs its weights
// plus more than twice that in Python and op dispatch when driven level by level from Python (the default draft); here
// one call pays the dispatch once. The target's plain greedy decoding runs the same chain (``strict``: from a row's
// first non-finite logits on, its tokens are -1, and the engine decodes that step the regular way).
at::Tensor draft_chain_cpu(const at::Tensor& root_logits, const at::Tensor& embed, at::TensorList weights,
                           const at::Tensor& final_norm, const at::Tensor& lm_head, at::Tensor kv_cache,
                           const at::Tensor& cache_seqlens, const at::Tensor& rope_table,
                           const c10::optional<at::Tensor>& block_table, int64_t num_heads, double eps,
                           int64_t gamma, bool strict, const c10::optional<at::Tensor>& vocab_map) {
  TORCH_CHECK_VALUE(root_logits.dim() == 2 && root_logits.device().is_cpu(),
                    "draft_chain: root_logits must be [B, V] on CPU, got ", root_logits.sizes());
  TORCH_CHECK_TYPE(root_logits.scalar_type() == at::kFloat || root_logits.scalar_type() == at::kBFloat16,
                   "draft_chain: root_logits must be float32 or bfloat16, got ", root_logits.scalar_type());
  const int64_t B = root_logits.size(0), V = root_logits.size(1);
  TORCH_CHECK_VALUE(gamma >= 1, "draft_chain: gamma must be >= 1, got ", gamma);
  TORCH_CHECK_VALUE(embed.dim() == 2 && embed.size(0) >= V && lm_head.dim() == 2 && lm_head.size(0) == V &&
                        lm_head.is_contiguous(),
                    "draft_chain: embed [V, H] and a contiguous lm_head [V, H] must match the logits' V = ", V,
                    ", got ", embed.sizes(), " and ", lm_head.sizes());
  // a restricted draft vocabulary: logits and lm_head rows are over vocab_map [V] (token ids), not over all ids
  TORCH_CHECK_VALUE(!vocab_map.has_value() || !strict, "draft_chain: a strict (target) chain has no vocab_map");
  const at::Tensor ids = vocab_ids("draft_chain", vocab_map, V, embed.size(0));
  TORCH_CHECK_VALUE(rope_table.dim() == 3 && rope_table.size(0) == 2, "draft_chain: rope_table must be [2, P, D]");
  TORCH_CHECK_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == B,
                    "draft_chain: cache_seqlens must be [B] = [", B, "]");
  const at::Tensor seqlens = cache_seqlens.to(at::kLong).contiguous();  // [B]: the roots' positions L_b
  const int64_t max_pos = B > 0 ? seqlens.max().item<int64_t>() + gamma : 0;
  TORCH_CHECK_VALUE(max_pos <= rope_table.size(1), "draft_chain: positions up to ", max_pos,
                    " need a longer RoPE table than ", rope_table.size(1));
  at::Tensor tokens = at::empty({B, gamma}, seqlens.options());  // [B, gamma]
  const int64_t* L = seqlens.data_ptr<int64_t>();
  const int64_t* id_of = ids.defined() ? ids.data_ptr<int64_t>() : nullptr;
  const at::Tensor table = table_of(block_table);
  with_dtype(rope_table.scalar_type(), [&](auto type) {
    ChainRunner<decltype(type)> model("draft_chain", embed, weights, final_norm, lm_head, kv_cache, rope_table,
                                      num_heads, eps, table, B);
    with_dtype(root_logits.scalar_type(), [&](auto root_type) {  // the target's roots: float32 logits
      run_chain(model, root_logits.data_ptr<decltype(root_type)>(), V, L, B, gamma, strict, id_of,
                tokens.data_ptr<int64_t>());
    });
  });
  return tokens;
}

// K plain greedy steps in one call (the target's plain decoding, batched): the roots [B] run at positions L_b, then
// token d = 1 .. K is the argmax of the previous forward's logits, tokens 1 .. K - 1 run at L_b + d (their K/V
// written there, as K one-token steps would). Returns tokens [B, K'] int64, K' <= K: the call ends after the first
// token at which any row emits one of stop_ids [S] (a row's end of text: no forward is spent past it, so a long
// chain costs nothing at a request's end; the engine cuts each row at its own stop tokens and runs the rows that
// go on in its next call). From a row's first non-finite logits on its tokens are -1 (the engine then decodes that
// step the regular way, which sanitises or raises).
at::Tensor greedy_steps_cpu(const at::Tensor& roots, const at::Tensor& embed, at::TensorList weights,
                            const at::Tensor& final_norm, const at::Tensor& lm_head, at::Tensor kv_cache,
                            const at::Tensor& cache_seqlens, const at::Tensor& rope_table,
                            const c10::optional<at::Tensor>& block_table, int64_t num_heads, double eps,
                            int64_t steps, const c10::optional<at::Tensor>& stop_ids) {
  TORCH_CHECK_VALUE(roots.dim() == 1 && roots.device().is_cpu(), "greedy_steps: roots must be [B] on CPU, got ",
                    roots.sizes());
  TORCH_CHECK_VALUE(!stop_ids.has_value() || (stop_ids->dim() == 1 && stop_ids->device().is_cpu()),
                    "greedy_steps: stop_ids must be [S] on CPU");
  const int64_t B = roots.size(0);
  TORCH_CHECK_VALUE(steps >= 1, "greedy_steps: steps must be >= 1, got ", steps);
  TORCH_CHECK_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == B,
                    "greedy_steps: cache_seqlens must be [B] = [", B, "]");
  TORCH_CHECK_VALUE(rope_table.dim() == 3 && rope_table.size(0) == 2, "greedy_steps: rope_table must be [2, P, D]");
  const at::Tensor ids = roots.to(at::kLong).contiguous();              // [B]
  const at::Tensor seqlens = cache_seqlens.to(at::kLong).contiguous();  // [B]: the roots' positions L_b
  at::Tensor tokens = at::empty({B, steps}, seqlens.options());        // [B, K]
  const at::Tensor table = table_of(block_table);
  std::vector<int64_t> stops;  // [S]
  if (stop_ids.has_value()) {
    const at::Tensor s = stop_ids->to(at::kLong).contiguous();
    stops.assign(s.data_ptr<int64_t>(), s.data_ptr<int64_t>() + s.numel());
  }
  int64_t ran = steps;
  with_dtype(rope_table.scalar_type(), [&](auto type) {
    ChainRunner<decltype(type)> model("greedy_steps", embed, weights, final_norm, lm_head, kv_cache, rope_table,
                                      num_heads, eps, table, B);
    const int64_t* L = seqlens.data_ptr<int64_t>();
    const auto* logits = model.forward_logits(ids.data_ptr<int64_t>(), 1, B, 1, L);  // [B, V]
    ran = run_chain(model, logits, model.vocab(), L, B, steps, true, nullptr, tokens.data_ptr<int64_t>(), stops);
  });
  return ran == steps ? tokens : tokens.narrow(1, 0, ran).contiguous();  // [B, K']
}

namespace {

// The rows of a speculative call (spec_chain_cpu): per row the draft cache's gap then the root (row stride `ld`),
// its length, L_b, and the tokens it may still emit.
struct ChainRows {
  int64_t B, gamma, max_steps;
  bool stop_on_reject;
  std::vector<int64_t> gap, gap_len, L, room, stops;
  int64_t ld;
  const int64_t* id_of;  // the draft's restricted vocabulary's ids, or null
};

// The steps of spec_chain_cpu into steps [B, S, gamma + 2] and times [S, 2]; leaves the rows' gaps in `r`.
template <typename TT, typename TD>
void run_spec_chain(ChainRunner<TT>& target, ChainRunner<TD>& draft, ChainRows& r, int64_t* out, double* secs) {
  const int64_t B = r.B, gamma = r.gamma, T = gamma + 1, max_steps = r.max_steps;
  if (B == 0) return;
  const auto is_stop = [&](int64_t t) { return std::find(r.stops.begin(), r.stops.end(), t) != r.stops.end(); };
  std::vector<int64_t> d_start(B), roots(B), drafts(B * gamma), tokens(B * T), next_gap(B * 2);
  std::vector<TD> d_root;  // [B, H_d]
  std::vector<std::vector<int64_t>> emitted(B);
  for (int64_t s = 0; s < max_steps; ++s) {
    bool fits = true;
    for (int64_t b = 0; b < B; ++b) fits = fits && r.room[b] >= T;
    if (!fits) break;
    const auto start = std::chrono::steady_clock::now();
    // 1. the draft catches up: its gap then the root, at positions D_b ..; the root's logits seed the chain
    const int64_t width = *std::max_element(r.gap_len.begin(), r.gap_len.end());
    for (int64_t b = 0; b < B; ++b) {
      d_start[b] = r.L[b] - r.gap_len[b] + 1;
      roots[b] = r.gap[b * r.ld + r.gap_len[b] - 1];
    }
    const TD* d_hidden = draft.forward(r.gap.data(), r.ld, B, width, d_start.data());  // [B * width, H_d]
    const int64_t H_d = draft.hidden_size();
    d_root.clear();
    for (int64_t b = 0; b < B; ++b) {  // [B, H_d]: each row's root
      const TD* row = d_hidden + (b * width + r.gap_len[b] - 1) * H_d;
      d_root.insert(d_root.end(), row, row + H_d);
    }
    const TD* d_logits = draft.logits(d_root.data(), B);  // [B, V_d]
    run_chain(draft, d_logits, draft.vocab(), r.L.data(), B, gamma, false, r.id_of, drafts.data());
    const auto drafted = std::chrono::steady_clock::now();
    // 2. the target runs the root and the chain
    for (int64_t b = 0; b < B; ++b) {
      tokens[b * T] = roots[b];
      std::copy(drafts.begin() + b * gamma, drafts.begin() + (b + 1) * gamma, tokens.begin() + b * T + 1);
    }
    const TT* logits = target.forward_logits(tokens.data(), T, B, T, r.L.data());  // [B * T, V]
    // 3. greedy acceptance: the longest prefix of drafts equal to the target's argmax, then its own next token
    const int64_t V = target.vocab();
    bool finite = true;
    for (int64_t b = 0; b < B && finite; ++b) {
      emitted[b].clear();
      for (int64_t j = 0; j < T; ++j) {
        const int64_t best = first_argmax(logits + (b * T + j) * V, V, true);
        if (best < 0) {
          finite = false;
          break;
        }
        emitted[b].push_back(best);
        if (j == gamma || drafts[b * gamma + j] != best) break;
      }
    }
    if (!finite) break;  // nothing of this step is committed
    bool stopped = false;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = static_cast<int64_t>(emitted[b].size());
      int64_t* row = out + (b * max_steps + s) * (gamma + 2);
      row[0] = n;
      for (int64_t i = 0; i < n; ++i) {
        row[1 + i] = emitted[b][i];
        stopped = stopped || is_stop(emitted[b][i]);
      }
      // the draft cache holds the root and drafts 1 .. gamma - 1: all accepted -> draft gamma is its gap
      const bool all = n == T;
      next_gap[b * 2] = all ? drafts[b * gamma + gamma - 1] : emitted[b][n - 1];
      next_gap[b * 2 + 1] = emitted[b][n - 1];
      r.gap_len[b] = all ? 2 : 1;
      r.L[b] += n;
      r.room[b] -= n;
      stopped = stopped || (r.stop_on_reject && n == 1);
    }
    r.gap = next_gap;
    r.ld = 2;
    const auto end = std::chrono::steady_clock::now();
    secs[2 * s] = std::chrono::duration<double>(drafted - start).count();
    secs[2 * s + 1] = std::chrono::duration<double>(end - start).count();
    if (stopped) break;
  }
}

}  // namespace

// Up to max_steps greedy speculative steps of a draft model's chain in one call: per step, the draft catches up
// on the tokens its cache lacks (then the root), drafts gamma tokens (draft_chain), the target runs the root and
// the chain at L_b .. L_b + gamma, and the longest prefix of drafts equal to the target's argmax is accepted, plus
// the target's own next token. A chain's accepted nodes are a prefix: both caches stay in place (no compaction).
// The engine's step does the same work in ~10 Python-driven op calls; here it costs its kernels (ChainRunner: no
// ATen op inside the steps).
//
// pending [B, P] int64: per row the tokens at positions D_b .. L_b (the draft cache's gap, then the root), padded
// at the end; pending_lens [B]: their counts (>= 1); seqlens [B]: L_b; budget [B]: tokens the row may still emit
// (a step starts only if every row has gamma + 1 of them left); stop_ids [S]: a step that emits one of them for any
// row is the last, and so is one where some row accepted no draft when ``stop_on_reject`` (an adaptive controller
// re-decides the depth after it). A step whose visited target logits are not finite (a NaN, or a non-finite
// maximum) is dropped and ends the call: the engine's regular step decodes it (and sanitises or raises).
//
// Returns (steps [B, max_steps, gamma + 2] int64: per step the count n of emitted tokens then the tokens, -1
// padded, n = 0 for steps not run; pending_out [B, 2] and pending_lens_out [B]: the rows' new gaps; times
// [max_steps, 2] float64: per step the draft's and the whole step's seconds).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> spec_chain_cpu(
    const at::Tensor& pending, const at::Tensor& pending_lens, const at::Tensor& seqlens, const at::Tensor& t_embed,
    at::TensorList t_weights, const at::Tensor& t_norm, const at::Tensor& t_lm_head, at::Tensor t_kv,
    const at::Tensor& t_rope, int64_t t_heads, double t_eps, const at::Tensor& d_embed, at::TensorList d_weights,
    const at::Tensor& d_norm, const at::Tensor& d_lm_head, at::Tensor d_kv, const at::Tensor& d_rope,
    int64_t d_heads, double d_eps, const c10::optional<at::Tensor>& block_table, const at::Tensor& budget,
    const at::Tensor& stop_ids, int64_t gamma, int64_t max_steps, bool stop_on_reject,
    const c10::optional<at::Tensor>& d_vocab_map) {
  TORCH_CHECK_VALUE(pending.dim() == 2 && pending.size(1) >= 1, "spec_chain: pending must be [B, P], got ",
                    pending.sizes());
  const int64_t B = pending.size(0), P = pending.size(1);
  TORCH_CHECK_VALUE(gamma >= 1 && max_steps >= 1, "spec_chain: gamma and max_steps must be >= 1");
  for (const at::Tensor* t : {&pending_lens, &seqlens, &budget}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == B, "spec_chain: per-row inputs must be [B] = [", B, "]");
  }
  TORCH_CHECK_VALUE(t_lm_head.is_contiguous() && d_lm_head.is_contiguous(), "spec_chain: lm_heads must be contiguous");
  const at::TensorOptions longs = pending.options().dtype(at::kLong);
  const at::Tensor ids = vocab_ids("spec_chain", d_vocab_map, d_lm_head.size(0), d_embed.size(0));

  ChainRows rows{B, gamma, max_steps, stop_on_reject, {}, std::vector<int64_t>(B), std::vector<int64_t>(B),
                 std::vector<int64_t>(B), {}, P, ids.defined() ? ids.data_ptr<int64_t>() : nullptr};
  const at::Tensor gap = pending.to(at::kLong).contiguous();  // [B, P]
  rows.gap.assign(gap.data_ptr<int64_t>(), gap.data_ptr<int64_t>() + B * P);
  const at::Tensor lens = pending_lens.to(at::kLong).contiguous(), L = seqlens.to(at::kLong).contiguous(),
                   room = budget.to(at::kLong).contiguous(), stops = stop_ids.to(at::kLong).contiguous();
  for (int64_t b = 0; b < B; ++b) {
    rows.gap_len[b] = lens.data_ptr<int64_t>()[b];
    rows.L[b] = L.data_ptr<int64_t>()[b];
    rows.room[b] = room.data_ptr<int64_t>()[b];
    TORCH_CHECK_VALUE(rows.gap_len[b] >= 1 && rows.gap_len[b] <= P && rows.L[b] >= rows.gap_len[b] - 1,
                      "spec_chain: row ", b, " has pending_lens ", rows.gap_len[b], " and L_b ", rows.L[b]);
  }
  rows.stops.assign(stops.data_ptr<int64_t>(), stops.data_ptr<int64_t>() + stops.numel());

  at::Tensor steps = at::full({B, max_steps, gamma + 2}, -1, longs);  // [B, S, gamma + 2]
  steps.select(2, 0).zero_();
  at::Tensor times = at::zeros({max_steps, 2}, longs.dtype(at::kDouble));  // [S, 2]
  int64_t* out = steps.data_ptr<int64_t>();
  double* secs = times.data_ptr<double>();
  const at::Tensor table = table_of(block_table);
  with_dtype(t_rope.scalar_type(), [&](auto target_type) {
    with_dtype(d_rope.scalar_type(), [&](auto draft_type) {  // a draft may be narrower than its target
      ChainRunner<decltype(target_type)> target("spec_chain", t_embed, t_weights, t_norm, t_lm_head, t_kv, t_rope,
                                                t_heads, t_eps, table, B);
      ChainRunner<decltype(draft_type)> draft("spec_chain", d_embed, d_weights, d_norm, d_lm_head, d_kv, d_rope,
                                              d_heads, d_eps, table, B);
      run_spec_chain(target, draft, rows, out, secs);
    });
  });
  // [B, 2]: at most the last draft and the bonus (pending itself when no step ran)
  at::Tensor next_gap = rows.ld == 2 ? at::empty({B, 2}, longs) : gap.clone();
  if (rows.ld == 2) std::copy(rows.gap.begin(), rows.gap.end(), next_gap.data_ptr<int64_t>());
  return {steps, next_gap, at::tensor(rows.gap_len, longs), times};
}

}  // namespace specdec
