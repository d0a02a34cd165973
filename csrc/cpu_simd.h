// AVX-512 pieces shared by the CPU kernels (csrc/linear_cpu.cpp, csrc/decoder_layers_cpu.cpp): the target attribute
// that compiles a function for AVX-512 without global -mavx512 flags, a transposing 16-way lane sum and a vector exp.
// Callers choose the AVX-512 code at run time (__builtin_cpu_supports) and keep a scalar path for other CPUs.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SPECDEC_CPU_X86 1
// GCC 12 under -Wall flags the deliberately undefined registers of its own AVX-512 intrinsics (_mm512_undefined_ps)
// once they are inlined into target("avx512...") functions: a false positive, silenced for the files that use them.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define SPECDEC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#else
#define SPECDEC_CPU_X86 0
#endif

#include <cstdlib>

namespace specdec {
namespace simd {

// Whether this CPU runs the AVX-512 (F, BW, VL + FMA) code paths; decided once per process, so a kernel never mixes
// its vector and scalar paths (their sums run in different orders). SPECDEC_LINEAR_SCALAR=1 forces the scalar paths.
inline bool cpu_has_avx512() {
#if SPECDEC_CPU_X86
  static const bool ok = std::getenv("SPECDEC_LINEAR_SCALAR") == nullptr && __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

// The same plus AVX512-BF16 dot products (the bfloat16 linear kernel).
inline bool cpu_has_avx512_bf16() {
#if SPECDEC_CPU_X86
  static const bool ok = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

}  // namespace simd
}  // namespace specdec

#if SPECDEC_CPU_X86
namespace specdec {
namespace simd {

// Sums the lanes of 16 accumulators at once: lane 4q + r of the result is the sum of acc[4r + q]. Every accumulator
// goes through the same tree, ((v0+v8)+(v4+v12)) + ((v1+v9)+(v5+v13)) + ... (lane pairs i, i+8, then i, i+4, then
// adjacent), whatever the others hold; unused accumulators are zero and never mix into used ones. One transposing
// tree costs 15 adds + 30 shuffles per 16 outputs, against ~8 instructions per output for _mm512_reduce_add_ps.
SPECDEC_AVX512 inline __m512 reduce16(const __m512* acc) {
  __m512 b[8], c[4], d[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // halves: b[i] = [acc[2i] (8 lanes), acc[2i+1] (8 lanes)]
    const __m512 lo = _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44);
    const __m512 hi = _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE);
    b[i] = _mm512_add_ps(lo, hi);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // quarters: c[i] = [acc[4i], acc[4i+1], acc[4i+2], acc[4i+3]] (4 lanes each)
    const __m512 lo = _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88);
    const __m512 hi = _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD);
    c[i] = _mm512_add_ps(lo, hi);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {  // pairs of lanes within each quarter
    const __m512 lo = _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 hi = _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1));
    d[i] = _mm512_add_ps(lo, hi);
  }
  const __m512 lo = _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0));
  const __m512 hi = _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1));
  return _mm512_add_ps(lo, hi);
}

// e^x lane by lane (Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for e^r, then 2^n by
// vscalefps); within 2 ulp of expf for x in [-87, 88], 0 below, +inf above. A pure function of each lane, so any
// grouping of elements into vectors gives the same values.
SPECDEC_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3365447504f), _CMP_LT_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), y, n);
}

}  // namespace simd
}  // namespace specdec
#endif  // SPECDEC_CPU_X86
