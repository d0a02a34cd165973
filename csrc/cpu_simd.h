// SIMD pieces shared by the CPU kernels (csrc/linear_cpu.cpp, csrc/layer_ops_cpu.h, csrc/verify_tree_cpu.cpp):
// the target attributes that compile a function for AMX, AVX-512 or AVX2 + FMA without global -m flags, transposing
// lane sums (16-way, 8-way) and 16 x 16 blocks, vector exps, and bfloat16 loads and rounding. Callers choose a path
// once per process (cpu_isa) and keep a scalar one for other CPUs.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SPECDEC_CPU_X86 1
// GCC 12 under -Wall flags the deliberately undefined registers of its own AVX-512 intrinsics (_mm512_undefined_ps)
// once they are inlined into target("avx512...") functions: a false positive, silenced for the files that use them.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define SPECDEC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#define SPECDEC_AVX2 __attribute__((target("avx2,fma")))
// AMX intrinsics need GCC 11 / clang 12; an older compiler builds everything else and leaves the tiles unused.
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define SPECDEC_CPU_AMX 1
#define SPECDEC_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,amx-tile,amx-bf16")))
#else
#define SPECDEC_CPU_AMX 0
#endif
#else
#define SPECDEC_CPU_X86 0
#define SPECDEC_CPU_AMX 0
#endif

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace specdec {
namespace simd {

// The vector paths a kernel may take, widest last. Each kernel's paths sum in different orders, so the choice is made
// once per process (cpu_isa) and a kernel never mixes them.
enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// Whether SPECDEC_CPU_ISA caps the kernels' paths at `path` ("avx512", "avx2" or "scalar"): tests run every path on
// one machine. avx512 only turns the AMX tiles off (cpu_has_amx_bf16, cpu_has_amx_int8).
inline bool capped_at(const char* path) {
  const char* v = std::getenv("SPECDEC_CPU_ISA");
  return v != nullptr && std::strcmp(v, path) == 0;
}

// The widest path this CPU runs: AVX-512 (F, BW, VL + FMA), AVX2 + FMA (AMD Zen 1-3, Intel before Skylake-SP and
// its client parts), else scalar, under SPECDEC_CPU_ISA's cap; SPECDEC_LINEAR_SCALAR=1, the older switch, means
// scalar.
inline Isa detect_isa() {
#if SPECDEC_CPU_X86
  Isa cap = Isa::kAvx512;
  if (capped_at("avx2")) cap = Isa::kAvx2;
  if (capped_at("scalar") || std::getenv("SPECDEC_LINEAR_SCALAR") != nullptr) cap = Isa::kScalar;
  const bool fma = __builtin_cpu_supports("fma");
  if (cap >= Isa::kAvx512 && fma && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return Isa::kAvx512;
  }
  if (cap >= Isa::kAvx2 && fma && __builtin_cpu_supports("avx2")) return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

inline Isa cpu_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

// Whether this CPU runs the AVX-512 (F, BW, VL + FMA) code paths.
inline bool cpu_has_avx512() { return cpu_isa() == Isa::kAvx512; }

// Whether it runs the AVX2 + FMA ones (and not the AVX-512 ones, which are then taken instead).
inline bool cpu_has_avx2() { return cpu_isa() == Isa::kAvx2; }

// AVX-512 plus AVX512-BF16 dot products (the bfloat16 linear kernel's AVX-512 path; an AVX-512 CPU without them
// takes its AVX2 path, which widens bfloat16 to float32).
inline bool cpu_has_avx512_bf16() {
#if SPECDEC_CPU_X86
  static const bool ok = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

// AMX tiles (Intel Sapphire Rapids and later): CPUID leaf 7's EDX bit `feature` (22 AMX-BF16, 25 AMX-INT8) beside
// AMX-TILE (bit 24). Linux hands a process the tile registers' 8 KB state only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM), made here; where the request fails, or SPECDEC_CPU_ISA caps the paths (=avx512 keeps AVX-512
// without tiles), the AVX-512 paths run instead.
inline bool detect_amx(int feature) {
#if SPECDEC_CPU_AMX && defined(__linux__)
  if (!cpu_has_avx512() || capped_at("avx512")) return false;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
  if (((edx >> 24) & 1u) == 0 || ((edx >> feature) & 1u) == 0) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  (void)feature;
  return false;
#endif
}

// AMX-BF16 on top of AVX512-BF16: the bfloat16 linear kernel's widest path.
inline bool cpu_has_amx_bf16() {
  static const bool ok = cpu_has_avx512_bf16() && detect_amx(22);
  return ok;
}

// AMX-INT8 on top of AVX512-VNNI: the 8-bit activation path's tiles (csrc/quant_int8_amx_cpu.h).
inline bool cpu_has_amx_int8() {
#if SPECDEC_CPU_X86
  static const bool ok = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") && detect_amx(25);
  return ok;
#else
  return false;
#endif
}

// The scalar paths' dot product: the AVX2 path's order written as plain C++, 8 partial sums (sum l over
// i = l, l + 8, ...) then the tree ((s0+s1)+(s2+s3)) + ((s4+s5)+(s6+s7)). The lanes are independent, so the compiler
// vectorizes them for whatever the target has (SSE2, NEON) without reassociating a sum, and there is less rounding
// error than in one running sum. b is float32 or anything that converts to it (c10::BFloat16).
template <typename T>
inline float dot8(const float* a, const T* b, int64_t n) {
  float s[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) s[l] += a[i + l] * static_cast<float>(b[i + l]);
  }
  for (int l = 0; i + l < n; ++l) s[l] += a[i + l] * static_cast<float>(b[i + l]);
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

}  // namespace simd
}  // namespace specdec

#if SPECDEC_CPU_X86
namespace specdec {
namespace simd {

// The cache lines of [from, to), into L2 (`l2`) or L1, ahead of their reads: the int8 kernels' next tiles
// (csrc/quant_int8_cpu.h's fill_panel, csrc/quant_int8_rows_cpu.h's prefetch_ahead) and attention's K and V rows
// (gathered by index from the paged cache). Always inlined: as a plain inline function (5a5ab6f) GCC emitted none of
// these in the row kernels (bench/RESULTS-log.md, "A prefetch helper that was not inlined").
__attribute__((always_inline)) inline void prefetch_lines(uintptr_t from, uintptr_t to, bool l2) {
  for (uintptr_t line = from & ~uintptr_t{63}; line < to; line += 64) {
    if (l2) {
      _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
    }
  }
}

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

// Transposes a 16 x 16 matrix of 32-bit elements held as 16 rows: afterwards r[j] lane i is what r[i] lane j was.
// Pure moves (unpacks and shuffles), so any 32-bit payload - fp32, or a pair of bfloat16 - passes bit for bit.
SPECDEC_AVX512 inline void transpose16(__m512* r) {
  __m512 t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {  // 2 x 2 blocks of elements
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {  // 4 x 4 blocks within each 128-bit lane
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
#pragma GCC unroll 2
  for (int h = 0; h < 16; h += 8) {  // 128-bit lanes: the even and odd ones of rows i and i + 4
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xDD);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // then the even and odd ones of rows i and i + 8
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
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

// Sums the lanes of 8 accumulators at once: lane i of the result is the sum of acc[i], always by the same tree
// ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)) whatever the other accumulators hold (unused ones are zero and never mix into
// used ones). 7 horizontal adds, 2 lane permutes and 1 add per 8 outputs.
SPECDEC_AVX2 inline __m256 reduce8(const __m256* acc) {
  const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]);  // [0:01 0:23 1:01 1:23 | 0:45 0:67 1:45 1:67]
  const __m256 s23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]);
  const __m256 s67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 q0 = _mm256_hadd_ps(s01, s23);  // [0:0123 1:0123 2:0123 3:0123 | 0:4567 1:4567 2:4567 3:4567]
  const __m256 q1 = _mm256_hadd_ps(s45, s67);  // the same for accumulators 4..7
  return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

// The sum of one vector's 8 lanes by the same tree as reduce8's.
SPECDEC_AVX2 inline float reduce_add8(__m256 v) {
  const __m256 s = _mm256_hadd_ps(v, v);  // [01 23 01 23 | 45 67 45 67]
  const __m256 q = _mm256_hadd_ps(s, s);  // [0123 ... | 4567 ...]
  return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
}

SPECDEC_AVX2 inline float reduce_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// exp16's algorithm on 8 lanes (the same polynomial, so the same values lane by lane); 2^n as two exact power-of-two
// factors built in the exponent field, since AVX2 has no vscalefps and n reaches 128.
SPECDEC_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3365447504f), _CMP_LT_OQ);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // n in [-126, 128]: 2^n = 2^h * 2^(n-h) with h = n >> 1, both exponents in [-63, 64]
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i h = _mm256_srai_epi32(ni, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23));
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), bias), 23));
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(_mm256_mul_ps(y, p1), p2));
}

// 8 bfloat16 values widened to float32 lanes (exact: bfloat16 is float32's top half).
SPECDEC_AVX2 inline __m256 widen_bf16(__m128i raw) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// 8 elements of float32 or bfloat16 (any 2-byte T is read as bfloat16 bits) at p, the first `count` of them and the
// rest zero, as float32 lanes.
template <typename T>
SPECDEC_AVX2 inline __m256 load8(const T* p, int64_t count) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 2, "float32 or bfloat16");
  if constexpr (sizeof(T) == 4) {
    if (count >= 8) return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    alignas(32) float buf[8] = {};
    std::memcpy(buf, p, static_cast<size_t>(count) * 4);
    return _mm256_load_ps(buf);
  } else {
    if (count >= 8) return widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    alignas(16) uint16_t buf[8] = {};
    std::memcpy(buf, p, static_cast<size_t>(count) * 2);
    return widen_bf16(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
  }
}

// float32 -> bfloat16 bits, rounded as c10::BFloat16's constructor rounds (to nearest even, NaN -> 0x7FC0), so a
// vector of outputs is bitwise what static_cast<c10::BFloat16> writes one by one (vcvtneps2bf16 would flush
// denormals): 16 lanes packed into 16 bits each.
SPECDEC_AVX512 inline __m256i round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

// The same rounding for 8 lanes (AVX2), packed into 16 bits each.
SPECDEC_AVX2 inline __m128i round_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}

// The first `count` (<= 8) of 8 float32 lanes stored at p as float32 or bfloat16 (round_bf16): load8's inverse.
template <typename T>
SPECDEC_AVX2 inline void store8(T* p, __m256 v, int64_t count) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 2, "float32 or bfloat16");
  if constexpr (sizeof(T) == 4) {
    if (count >= 8) return _mm256_storeu_ps(reinterpret_cast<float*>(p), v);
    alignas(32) float buf[8];
    _mm256_store_ps(buf, v);
    std::memcpy(p, buf, static_cast<size_t>(count) * 4);
  } else {
    if (count >= 8) return _mm_storeu_si128(reinterpret_cast<__m128i*>(p), round_bf16(v));
    alignas(16) uint16_t buf[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(buf), round_bf16(v));
    std::memcpy(p, buf, static_cast<size_t>(count) * 2);
  }
}

// o[i] = x[i] for n elements, float32 or bfloat16 either side, 8 at a time: widened exactly, or rounded as
// c10::BFloat16 rounds (store8), so bitwise what the scalar cast writes.
template <typename I, typename O>
SPECDEC_AVX2 void convert_row8(const I* x, O* o, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) store8(o + i, load8(x + i, n - i), n - i);
}

}  // namespace simd
}  // namespace specdec
#endif  // SPECDEC_CPU_X86
