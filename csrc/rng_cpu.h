// Counter-based random numbers on the CPU (spec_kernels/rng.py's, bit for bit) and the coupling's Gumbel noise,
// shared by the ops that draw it: rng_uniform and rng_gumbel (csrc/rng_cpu.cpp) and the native steps' sampled rows
// (csrc/runner_cpu.h).
//
// Gumbel noise is -log(-log(u)) with log = det_log: a logarithm made only of exact bit operations, IEEE products and
// fused multiply-adds, written once per instruction set with the same operations in the same order, so a value is the
// same float whichever path computes it (scalar, AVX2, AVX-512, one element or a whole row). torch.log is not that:
// its vector body and its scalar tail are different functions, so where an element falls decided its last bit, and
// the native steps, which compute only the few entries that can win an argmax (perturbed_argmax), could not match it.
// Accuracy: within ~2 ulp of log on the normal floats (tests/test_rng.py).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_simd.h"

namespace specdec {
namespace rng {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr float kUnit = 1.0f / 16777216.0f;  // 2^-24: u = (k + 0.5) 2^-24 for the top 24 bits k of a hash
// The largest uniform, 1 - 2^-24: (k + 0.5) 2^-24 rounds to 1 at k = 2^24 - 1 (k + 0.5 needs 25 bits), where
// -log(-log u) is infinite (an entry that always won) or, through det_log, -89 (one that never did).
constexpr float kUnitMax = 0.99999994f;

inline uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// rng.noise_keys: the key of the coupling's noise at `position` for a row whose noise seed is `seed`.
inline uint64_t noise_key(int64_t seed, int64_t position) {
  return mix64(mix64(static_cast<uint64_t>(seed)) + static_cast<uint64_t>(position) * kGolden);
}

// The base of rng.uniform's row for `key`: element i is unit(mix64(base + i * kGolden)).
inline uint64_t row_base(uint64_t key) { return mix64(key + kGolden); }
inline float unit(uint64_t x) { return std::min((static_cast<float>(x >> 40) + 0.5f) * kUnit, kUnitMax); }
inline float uniform_at(uint64_t base, int64_t i) { return unit(mix64(base + static_cast<uint64_t>(i) * kGolden)); }

// det_log's constants: log(1 + f) = f + f^2 (C0 + f (C1 + ... )) on f in [sqrt(1/2) - 1, sqrt(2) - 1] (Cephes'
// logf polynomial with its -1/2 folded in), and log 2 split so that e * kLn2Hi is exact.
constexpr float kLogC[10] = {7.0376836292e-2f,  -1.1514610310e-1f, 1.1676998740e-1f,  -1.2420140846e-1f,
                             1.4249322787e-1f,  -1.6668057665e-1f, 2.0000714765e-1f,  -2.4999993993e-1f,
                             3.3333331174e-1f,  -0.5f};
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr uint32_t kSqrt2Mantissa = 0x3504F3;  // the mantissa bits of sqrt(2)

// The natural log of a positive normal finite float (the only inputs Gumbel noise makes: u in [2^-25, 1 - 2^-24]
// and -log(u) in [5.9e-8, 17.33]). x = 2^e m, m in [sqrt(1/2), sqrt(2)) by exact bit moves; f = m - 1 exactly
// (Sterbenz).
inline float det_log(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  int32_t e = static_cast<int32_t>(bits >> 23) - 127;
  uint32_t mant = bits & 0x7FFFFF;
  const bool high = mant > kSqrt2Mantissa;  // m > sqrt(2): halve it (exponent 126), e + 1
  e += high ? 1 : 0;
  const uint32_t mbits = mant | (high ? 0x3F000000u : 0x3F800000u);
  float m;
  std::memcpy(&m, &mbits, 4);
  const float f = m - 1.0f;
  float p = kLogC[0];
  for (int i = 1; i < 10; ++i) p = std::fmaf(p, f, kLogC[i]);
  const float r = std::fmaf(f * f, p, f);
  const float ef = static_cast<float>(e);
  return std::fmaf(ef, kLn2Hi, std::fmaf(ef, kLn2Lo, r));
}

// The coupling's Gumbel noise from a uniform: -log(-log(u)).
inline float gumbel_of(float u) { return -det_log(-det_log(u)); }

// Bounds on the noise of u in [2^-25, 1 - 2^-24]: -log(-log u) in [-2.8524, 16.6355] (rounded outward).
constexpr float kGumbelMax = 16.64f, kGumbelMin = -2.86f;

#if SPECDEC_CPU_X86
SPECDEC_AVX512 inline __m512 det_log16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(127));
  const __m512i mant = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFF));
  const __mmask16 high = _mm512_cmpgt_epi32_mask(mant, _mm512_set1_epi32(kSqrt2Mantissa));
  e = _mm512_mask_add_epi32(e, high, e, _mm512_set1_epi32(1));
  const __m512i exp_bits = _mm512_mask_blend_epi32(high, _mm512_set1_epi32(0x3F800000), _mm512_set1_epi32(0x3F000000));
  const __m512 m = _mm512_castsi512_ps(_mm512_or_si512(mant, exp_bits));
  const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.0f));
  __m512 p = _mm512_set1_ps(kLogC[0]);
  for (int i = 1; i < 10; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kLogC[i]));
  const __m512 r = _mm512_fmadd_ps(_mm512_mul_ps(f, f), p, f);
  const __m512 ef = _mm512_cvtepi32_ps(e);
  return _mm512_fmadd_ps(ef, _mm512_set1_ps(kLn2Hi), _mm512_fmadd_ps(ef, _mm512_set1_ps(kLn2Lo), r));
}

SPECDEC_AVX2 inline __m256 det_log8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256i e = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127));
  const __m256i mant = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFF));
  const __m256i high = _mm256_cmpgt_epi32(mant, _mm256_set1_epi32(kSqrt2Mantissa));  // all ones where high
  e = _mm256_sub_epi32(e, high);                                                     // -(-1) = +1
  const __m256i exp_bits = _mm256_blendv_epi8(_mm256_set1_epi32(0x3F800000), _mm256_set1_epi32(0x3F000000), high);
  const __m256 m = _mm256_castsi256_ps(_mm256_or_si256(mant, exp_bits));
  const __m256 f = _mm256_sub_ps(m, _mm256_set1_ps(1.0f));
  __m256 p = _mm256_set1_ps(kLogC[0]);
  for (int i = 1; i < 10; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kLogC[i]));
  const __m256 r = _mm256_fmadd_ps(_mm256_mul_ps(f, f), p, f);
  const __m256 ef = _mm256_cvtepi32_ps(e);
  return _mm256_fmadd_ps(ef, _mm256_set1_ps(kLn2Hi), _mm256_fmadd_ps(ef, _mm256_set1_ps(kLn2Lo), r));
}

SPECDEC_AVX512 inline __m512 neg16(__m512 v) {  // -v, exactly (the sign bit flipped)
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
}

SPECDEC_AVX512 inline void gumbel_inplace_avx512(float* u, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(u + i, neg16(det_log16(neg16(det_log16(_mm512_loadu_ps(u + i))))));
  for (; i < n; ++i) u[i] = gumbel_of(u[i]);
}

SPECDEC_AVX2 inline void gumbel_inplace_avx2(float* u, int64_t n) {
  int64_t i = 0;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_xor_ps(det_log8(_mm256_loadu_ps(u + i)), sign);
    _mm256_storeu_ps(u + i, _mm256_xor_ps(det_log8(x), sign));
  }
  for (; i < n; ++i) u[i] = gumbel_of(u[i]);
}
#endif

// u [n] uniforms -> their Gumbel noise, in place: gumbel_of of each, the same floats on every path.
inline void gumbel_inplace(float* u, int64_t n) {
#if SPECDEC_CPU_X86
  if (simd::cpu_has_avx512()) return gumbel_inplace_avx512(u, n);
  if (simd::cpu_has_avx2()) return gumbel_inplace_avx2(u, n);
#endif
  for (int64_t i = 0; i < n; ++i) u[i] = gumbel_of(u[i]);
}

// The coupled sample at one node: argmax_x (float(z_x) / t + g(key, x)) over z [V] (verify_tree's perturbed argmax
// of a coupled row at temperature t > 0), over the entries with z_x / t >= keep_from (the filters' threshold:
// sampling::filtered_argmax), computing the noise only where it can win: an entry more than kGumbelMax - kGumbelMin
// (plus a margin for rounding) below the largest z / t cannot reach the maximum. The first index of the maximum, as
// torch.argmax takes; -1 where z holds a NaN or its maximum is not finite (the caller's regular path sanitises such
// rows).
template <typename T>
int64_t perturbed_argmax(const T* z, int64_t V, float t, uint64_t key,
                         float keep_from = -std::numeric_limits<float>::infinity()) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t x = 0; x < V; ++x) {
    const float v = static_cast<float>(z[x]);
    if (v != v) return -1;
    top = v > top ? v : top;
  }
  if (!std::isfinite(top)) return -1;
  const float floor = std::max(top / t - (kGumbelMax - kGumbelMin) - 1.0f, keep_from);
  const uint64_t base = row_base(key);
  int64_t best = -1;
  float best_v = -std::numeric_limits<float>::infinity();
  for (int64_t x = 0; x < V; ++x) {
    const float zt = static_cast<float>(z[x]) / t;
    if (zt < floor) continue;
    const float v = zt + gumbel_of(uniform_at(base, x));
    if (v > best_v || best < 0) best_v = v, best = x;
  }
  return best;
}

}  // namespace rng
}  // namespace specdec
