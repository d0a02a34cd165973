// Greedy acceptance's one routine (walk), and its argmax: the first index of the maximum of a row of logits z [V]
// (float32 or bfloat16). verify_tree's greedy walk (csrc/verify_tree_cpu.cpp) and the native step runners
// (csrc/runner_cpu.cpp) both walk with it, so every greedy path picks exactly the same token and path. The argmax
// has an AVX-512 body, an AVX2 one and a scalar one, chosen once per process (simd::cpu_isa); all three give the
// same index (a maximum is exact, and the first index of it is unique).
//
// strict (the target's choice): -1 where the row holds a NaN or its maximum is not finite, the rows the Python path
// sanitises or rejects. Otherwise (a draft's guess, which costs acceptance only, never correctness) NaNs are skipped
// and a row with no value above -inf gives 0.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_simd.h"

namespace specdec {
namespace greedy {

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

// The row's result from its maximum over the non-NaN values (``best``) and whether it held a NaN: -1, 0, or "find the
// first index of best" (returned as -2).
inline int64_t settle(float best, bool nan, bool strict) {
  if (strict && (nan || !std::isfinite(best))) return -1;
  if (best == -std::numeric_limits<float>::infinity()) return 0;  // lenient: nothing above -inf
  return -2;
}

template <typename T>
int64_t argmax_scalar(const T* z, int64_t V, bool strict) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int64_t i = 0; i < V; ++i) {
    const float v = widen(z[i]);
    nan |= v != v;
    if (v > best) best = v;
  }
  const int64_t settled = settle(best, nan, strict);
  if (settled != -2) return settled;
  for (int64_t i = 0; i < V; ++i) {
    if (widen(z[i]) == best) return i;
  }
  return -1;  // unreachable: the maximum is in the row
}

#if SPECDEC_CPU_X86
SPECDEC_AVX512 inline __m512 load16(const float* p, __mmask16 live) { return _mm512_maskz_loadu_ps(live, p); }

SPECDEC_AVX512 inline __m512 load16(const c10::BFloat16* p, __mmask16 live) {
  const __m256i raw = _mm256_maskz_loadu_epi16(live, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));  // bfloat16 is float32's top half
}

template <typename T>
SPECDEC_AVX512 int64_t argmax_avx512(const T* z, int64_t V, bool strict) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 live = V - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (V - i)) - 1);
    const __m512 v = load16(z + i, live);
    nan |= _mm512_mask_cmp_ps_mask(live, v, v, _CMP_UNORD_Q);
    mx = _mm512_mask_max_ps(mx, live & ~_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v, mx);  // NaN lanes keep mx
  }
  const float best = _mm512_reduce_max_ps(mx);
  const int64_t settled = settle(best, nan != 0, strict);
  if (settled != -2) return settled;
  const __m512 target = _mm512_set1_ps(best);
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 live = V - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (V - i)) - 1);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(live, load16(z + i, live), target, _CMP_EQ_OQ);
    if (hit != 0) return i + __builtin_ctz(hit);
  }
  return -1;  // unreachable: the maximum is in the row
}

SPECDEC_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

SPECDEC_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

template <typename T>
SPECDEC_AVX2 int64_t argmax_avx2(const T* z, int64_t V, bool strict) {
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 v = load8(z + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(v, mx);  // a NaN in v gives mx (maxps returns its second operand on NaN)
  }
  float best = simd::reduce_max8(mx);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < V; ++j) {
    const float v = widen(z[j]);
    has_nan |= v != v;
    if (v > best) best = v;
  }
  const int64_t settled = settle(best, has_nan, strict);
  if (settled != -2) return settled;
  const __m256 target = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= V; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(load8(z + i), target, _CMP_EQ_OQ));
    if (hit != 0) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; i < V; ++i) {
    if (widen(z[i]) == best) return i;
  }
  return -1;  // unreachable: the maximum is in the row
}
#endif

template <typename T>
int64_t argmax(const T* z, int64_t V, bool strict) {
#if SPECDEC_CPU_X86
  if (simd::cpu_has_avx512()) return argmax_avx512(z, V, strict);
  if (simd::cpu_has_avx2()) return argmax_avx2(z, V, strict);
#endif
  return argmax_scalar(z, V, strict);
}

// Whether a row's tree is one walk can take: every parent -1 or an earlier node, every drafted token (a node with a
// parent) an id of the V-token vocabulary.
inline bool well_formed(const int64_t* tokens, const int64_t* parents, int64_t T, int64_t V) {
  for (int64_t i = 0; i < T; ++i) {
    if (parents[i] < -1 || parents[i] >= i || (parents[i] >= 0 && (tokens[i] < 0 || tokens[i] >= V))) return false;
  }
  return true;
}

// Greedy acceptance over one row's tree of T nodes (docs/ARCHITECTURE.md, verify_tree, "Greedy"): tokens [T] and
// parents [T] (parents[i] < i, -1 for the root and padding), choose(i) the target's token at node i (its argmax, or
// a coupled row's perturbed argmax), -1 where it cannot choose. From the root, move to the first child (in node order)
// whose token is the target's choice at the current node; where none matches, or at a leaf, emit the choice. Writes
// the path's nodes into path (path[0] = 0) and the emitted tokens into out (the accepted drafts, then the recovered
// or bonus token), at most T each; returns how many tokens were emitted (>= 1), or 0 where a visited node could not
// choose (the row then counts as not verified). A chain is the tree whose parents are -1, 0, 1, ...
template <typename Choose>
int64_t walk_choosing(const Choose& choose, const int64_t* tokens, const int64_t* parents, int64_t T, int64_t* path,
                      int64_t* out) {
  path[0] = 0;
  int64_t cur = 0, depth = 0;
  while (true) {
    const int64_t best = choose(cur);
    if (best < 0) return 0;
    out[depth] = best;
    int64_t next = -1;
    for (int64_t c = cur + 1; c < T && next < 0; ++c) {
      if (parents[c] == cur && tokens[c] == best) next = c;
    }
    if (next < 0) return depth + 1;
    path[++depth] = next;
    cur = next;
  }
}

// walk_choosing with the argmax of row(i), node i's logits [V]: 0 where a visited node's maximum is not finite.
template <typename Row>
int64_t walk(const Row& row, int64_t V, const int64_t* tokens, const int64_t* parents, int64_t T, int64_t* path,
             int64_t* out) {
  return walk_choosing([&](int64_t i) { return argmax(row(i), V, true); }, tokens, parents, T, path, out);
}

}  // namespace greedy
}  // namespace specdec
