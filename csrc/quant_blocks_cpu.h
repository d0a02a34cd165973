// The GGUF block formats decoded to float32 weights, 32 at a time: scalar, AVX2 (4 x 8 lanes) and AVX-512 (2 x 16
// lanes). A section of csrc/quant_linear_cpu.cpp kept in its own file: included there inside its anonymous namespace,
// after the SPECDEC_QAVX2 / SPECDEC_QAVX512 targets.
//
// Glossary: the kernels walk a row of W in *sub-blocks* of 32 weights: a block of the 32-weight types, or one eighth
// of a K-quant *super-block* of 256 weights. Sub-block b of a row starts at weight 32 b. Layouts (q the quants;
// d, dmin, m fp16; "byte j: j, j+16" means byte j's low nibble is element j, its high nibble element j + 16):
//   Q8_0 (34 bytes): d, 32 int8 q;                                   w = q * d
//   Q4_0 (18 bytes): d, 16 bytes of nibbles (byte j: j, j+16);       w = d * (q - 8)
//   Q4_1 (20 bytes): d, m, 16 bytes of nibbles;                      w = d * q + m
//   Q5_0 (22 bytes): d, 4 bytes qh (bit i: element i's bit 4), 16 bytes of nibbles;    w = d * (q - 16)
//   Q5_1 (24 bytes): d, m, 4 bytes qh, 16 bytes of nibbles;          w = d * q + m
// and per 256 weights (sub-block s = 0..7; a *group* is 16 weights, g = 2 s + (element >= 16)):
//   Q2_K (84 bytes): 16 bytes of group scales (low nibble sc, high nibble mn), 64 bytes of 2-bit q (s's from byte
//     32 (s / 4) + e, bits 2 (s % 4)), d, dmin;                          w = (d sc_g) q - (dmin mn_g)
//   Q3_K (110 bytes): 32 bytes hmask (s's bit 2 of q from bit s of byte e, set meaning +0, clear -4), 64 bytes of
//     2-bit q (as Q2_K), 12 bytes of 6-bit group scales (k3_scale), d;    w = (d (sc_g - 32)) q
//   Q4_K (144 bytes): d, dmin, 12 bytes of 6-bit sub-block scales and minima (k4_scale_min), 128 bytes of nibbles
//     (s's from byte 32 (s / 2) + e, the high nibble for odd s);        w = (d sc_s) q - (dmin mn_s)
//   Q5_K (176 bytes): as Q4_K with 32 bytes qh after the scales (bit s of byte e: bit 4 of q)
//   Q6_K (210 bytes): 128 bytes of low nibbles (s's from byte 64 (s / 4) + 32 (s % 2) + e, the high nibble when
//     (s / 2) % 2), 64 bytes of 2-bit highs (byte 32 (s / 4) + e, bits 2 (s % 4)), 16 int8 group scales, d;
//     w = (d sc_g) (q - 32)
// These are gguf.quants.dequantize's float32 values exactly. Why the float algebra agrees: every product of d or
// dmin with a small integer scale and a quant is exact in float32, so only a final addition can round, and it rounds
// once wherever it is done (hence one FMA equals gguf's multiply-then-add, and FMA contraction changes nothing). The
// significant bits: an fp16 d has at most 11 (a subnormal fewer; all stay normal in float32), an integer of
// magnitude at most 2^k that is a power of two or below 2^k at most k; so d sc q has at most
//   Q4_0 / Q5_0 / Q8_0: 11 + 4 / 5 / 7 bits (no addition at all); Q4_1 / Q5_1: 11 + 4 / 5, then + m rounds once;
//   Q2_K: 11 + 4 (sc) + 2 (q), and dmin mn 11 + 4, then one subtraction; Q3_K: 11 + 5 (|sc - 32| <= 32) + 2
//   (|q| <= 4), no addition; Q4_K / Q5_K: 11 + 6 (sc) + 4 / 5 (q), dmin mn 11 + 6, one subtraction;
//   Q6_K: 11 + 7 (|sc| <= 128) + 5 (|q - 32| <= 32) = 23, no addition;
// all within float32's 24, and far from its overflow and underflow. A subtraction is the addition of the negated
// term (exact, signed zeros included), so w = fma(d sc, q, -(dmin mn)).
#pragma once

// ---------------------------------------------------------------------------------------------------------------
// The K-quants' scales, decoded once per super-block and row (the vector paths' decoders are below: at M = 1 a
// scalar decode of 8-16 scales costs about as much as the quants' own vector work).
// ---------------------------------------------------------------------------------------------------------------

template <QuantType Q>
constexpr int64_t kSubBlocks = quant_format(static_cast<int64_t>(Q)).block_weights / kQuantBlock;

// Whether a kernel streaming Q's blocks prefetches them into L2 rather than L1: the K-quants, where streaming their
// matrices from DRAM ran faster so (L1 no longer holds the lines of 16 rows' next super-blocks beside the ones being
// read; measured on Zen 4, then on the Xeon with AMX); the 32-weight formats, whose kernels are bound by their
// instructions, keep L1 (bench/RESULTS-log.md, "K-quant files on Zen 4" and "The AMX-INT8 tiles taken apart").
template <QuantType Q>
constexpr bool prefetch_to_l2() {
  return kSubBlocks<Q> > 1;
}

template <QuantType Q>
constexpr int64_t kBlockBytes = quant_format(static_cast<int64_t>(Q)).block_bytes;

// A K-quant super-block's scales: w = scale[i] * q + shift[i] (no shift where the format has no minimum), i the
// group of 16 weights, or for Q4_K / Q5_K the sub-block of 32 (scale_index).
struct KScales {
  float scale[16];
  float shift[16];
};

template <QuantType Q>
constexpr bool kPerSubBlock = Q == QuantType::kQ4_K || Q == QuantType::kQ5_K;

// Where KScales holds the scale of sub-block s's elements from e on (e a multiple of 8).
template <QuantType Q>
constexpr int scale_index(int s, int e) {
  return kPerSubBlock<Q> ? s : 2 * s + e / 16;
}

// The 32-weight types keep their scales in each block: nothing to decode ahead.
struct NoScales {};
template <QuantType Q>
using ScalesOf = std::conditional_t<(kSubBlocks<Q> > 1), KScales, NoScales>;

template <QuantType Q>
constexpr bool kHasShift = Q == QuantType::kQ2_K || Q == QuantType::kQ4_K || Q == QuantType::kQ5_K;

inline float fp16_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(v);
}

// Q3_K's 6-bit scale of group g from its 12 bytes: the low 4 bits from byte g % 8 (its high nibble for g >= 8), the
// high 2 from byte 8 + g % 4 at bits 2 (g / 4).
inline int k3_scale(const uint8_t* sc, int g) {
  const int low = (sc[g % 8] >> (4 * (g / 8))) & 15;
  const int high = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
  return (low | (high << 4)) - 32;
}

// Q4_K / Q5_K's 6-bit scale and minimum of sub-block s from their 12 bytes: for s < 4 the low 6 bits of bytes s and
// 4 + s; for s >= 4 the nibbles of byte 4 + s (low: scale, high: minimum) below the top 2 bits of bytes s - 4, s.
inline void k4_scale_min(const uint8_t* sc, int s, int& scale, int& min) {
  if (s < 4) {
    scale = sc[s] & 63, min = sc[4 + s] & 63;
  } else {
    scale = (sc[4 + s] & 15) | ((sc[s - 4] >> 6) << 4);
    min = (sc[4 + s] >> 4) | ((sc[s] >> 6) << 4);
  }
}

template <QuantType Q>
inline void load_scales(const uint8_t* sb, KScales& k) {
  if constexpr (Q == QuantType::kQ2_K) {
    const float d = fp16_at(sb + 80), dmin = fp16_at(sb + 82);
    for (int g = 0; g < 16; ++g) {
      k.scale[g] = d * static_cast<float>(sb[g] & 15);
      k.shift[g] = -(dmin * static_cast<float>(sb[g] >> 4));
    }
  } else if constexpr (Q == QuantType::kQ3_K) {
    const float d = fp16_at(sb + 108);
    for (int g = 0; g < 16; ++g) k.scale[g] = d * static_cast<float>(k3_scale(sb + 96, g)), k.shift[g] = 0.f;
  } else if constexpr (Q == QuantType::kQ4_K || Q == QuantType::kQ5_K) {
    const float d = fp16_at(sb), dmin = fp16_at(sb + 2);
    for (int s = 0; s < 8; ++s) {
      int scale, min;
      k4_scale_min(sb + 4, s, scale, min);
      k.scale[s] = d * static_cast<float>(scale);
      k.shift[s] = -(dmin * static_cast<float>(min));
    }
  } else {
    static_assert(Q == QuantType::kQ6_K, "a K-quant");
    const float d = fp16_at(sb + 208);
    for (int g = 0; g < 16; ++g) {
      k.scale[g] = d * static_cast<float>(static_cast<int8_t>(sb[192 + g]));
      k.shift[g] = 0.f;
    }
  }
}

template <QuantType Q>
inline void load_scales(const uint8_t*, NoScales&) {}

// The scales of the super-block holding sub-block b of `row` (b its first sub-block).
template <QuantType Q>
inline void load_row_scales(const uint8_t* row, int64_t b, ScalesOf<Q>& k) {
  load_scales<Q>(row + b / kSubBlocks<Q> * kBlockBytes<Q>, k);
}

// ---------------------------------------------------------------------------------------------------------------
// The quants: element e of K-quant sub-block s of super-block sb, as an integer (q - 32 for Q6_K, q - 4 (1 - hbit)
// for Q3_K), read as `(byte >> shift) & mask` fields of one or two bytes per element.
// ---------------------------------------------------------------------------------------------------------------

template <QuantType Q>
inline int k_quant(const uint8_t* sb, int s, int e) {
  if constexpr (Q == QuantType::kQ2_K) {
    return (sb[16 + 32 * (s / 4) + e] >> (2 * (s % 4))) & 3;
  } else if constexpr (Q == QuantType::kQ3_K) {
    return ((sb[32 + 32 * (s / 4) + e] >> (2 * (s % 4))) & 3) + (((sb[e] >> s) & 1) << 2) - 4;
  } else if constexpr (Q == QuantType::kQ4_K) {
    return (sb[16 + 32 * (s / 2) + e] >> (4 * (s % 2))) & 15;
  } else if constexpr (Q == QuantType::kQ5_K) {
    return ((sb[48 + 32 * (s / 2) + e] >> (4 * (s % 2))) & 15) | (((sb[16 + e] >> s) & 1) << 4);
  } else {
    return (((sb[64 * (s / 4) + 32 * (s % 2) + e] >> (4 * ((s / 2) % 2))) & 15) |
            (((sb[128 + 32 * (s / 4) + e] >> (2 * (s % 4))) & 3) << 4)) -
           32;
  }
}

// Sub-block b of `row` into w[0 .. 31]; `k` the scales of its super-block (K-quants).
template <QuantType Q>
inline void dequant_scalar(const uint8_t* row, int64_t b, const ScalesOf<Q>& k, float* w) {
  if constexpr (kSubBlocks<Q> > 1) {
    const uint8_t* sb = row + b / 8 * kBlockBytes<Q>;
    const int s = static_cast<int>(b % 8);
    for (int e = 0; e < 32; ++e) {
      const int g = scale_index<Q>(s, e);
      const float q = static_cast<float>(k_quant<Q>(sb, s, e));
      w[e] = kHasShift<Q> ? k.scale[g] * q + k.shift[g] : k.scale[g] * q;
    }
  } else {
    const uint8_t* blk = row + b * kBlockBytes<Q>;
    const float d = fp16_at(blk);
    if constexpr (Q == QuantType::kQ8_0) {
      for (int i = 0; i < 32; ++i) w[i] = static_cast<float>(static_cast<int8_t>(blk[2 + i])) * d;
    } else {
      constexpr bool kMin = Q == QuantType::kQ4_1 || Q == QuantType::kQ5_1;
      constexpr bool kFive = Q == QuantType::kQ5_0 || Q == QuantType::kQ5_1;
      const uint8_t* qs = blk + 2 + (kMin ? 2 : 0) + (kFive ? 4 : 0);
      uint32_t qh = 0;
      if constexpr (kFive) std::memcpy(&qh, blk + 2 + (kMin ? 2 : 0), 4);
      const float m = kMin ? fp16_at(blk + 2) : 0.f;
      constexpr int kOffset = kMin ? 0 : (kFive ? 16 : 8);
      for (int i = 0; i < 32; ++i) {
        const int q = ((qs[i % 16] >> (4 * (i / 16))) & 15) | static_cast<int>(((qh >> i) & 1) << 4);
        w[i] = kMin ? d * static_cast<float>(q) + m : d * static_cast<float>(q - kOffset);
      }
    }
  }
}

#if SPECDEC_CPU_X86

// ---------------------------------------------------------------------------------------------------------------
// AVX2: sub-block b as 4 x 8 lanes, w[i] holding elements 8 i .. 8 i + 7.
// ---------------------------------------------------------------------------------------------------------------

// load_scales with F16C conversions and 4-16 scales per instruction: the same values (the products are exact, and a
// minimum's negation flips the sign bit, as the scalar `-` does).

// F16C's conversion of the fp16 at p, spelled in assembly so that it needs no target of its own: GCC inlines no
// F16C-target function into one without that target (csrc/quant_int8_cpu.h's int_scales: a call per block was most
// of Q6_K's slowness on AVX2, bench/RESULTS.md, "K-quants on AVX2"). Only code that checked F16C calls it.
__attribute__((always_inline)) inline float fp16_f16c(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  const __m128i h = _mm_cvtsi32_si128(v);
  __m128 f;
  __asm__("vcvtph2ps %1, %0" : "=x"(f) : "x"(h));
  return _mm_cvtss_f32(f);
}

SPECDEC_QAVX2 inline __m128i bytes4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm_cvtepu8_epi32(_mm_cvtsi32_si128(v));
}

SPECDEC_QAVX2 inline __m256i bytes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Q4_K / Q5_K's super-block at sb: its 8 sub-blocks' scales (d times the 6-bit scale) and shifts (-dmin times the
// 6-bit minimum), lane s sub-block s. Sub-blocks 0-3 from the low 6 bits of bytes 0-3 (scales) and 4-7 (minima); 4-7
// from bytes 8-11's nibbles under those bytes' top 2 bits (k4_scale_min).
SPECDEC_QAVX2 inline void k4_scales_avx2(const uint8_t* sb, __m256& scale, __m256& shift) {
  const __m128 d = _mm_set1_ps(fp16_f16c(sb)), dmin = _mm_set1_ps(fp16_f16c(sb + 2));
  const __m128i lo = bytes4(sb + 4), mid = bytes4(sb + 8), hi = bytes4(sb + 12);
  const __m128i six = _mm_set1_epi32(63), four = _mm_set1_epi32(15);
  const __m128i sc_hi = _mm_or_si128(_mm_and_si128(hi, four), _mm_slli_epi32(_mm_srli_epi32(lo, 6), 4));
  const __m128i mn_hi = _mm_or_si128(_mm_srli_epi32(hi, 4), _mm_slli_epi32(_mm_srli_epi32(mid, 6), 4));
  const __m128 neg = _mm_set1_ps(-0.f);
  scale = _mm256_set_m128(_mm_mul_ps(d, _mm_cvtepi32_ps(sc_hi)),
                          _mm_mul_ps(d, _mm_cvtepi32_ps(_mm_and_si128(lo, six))));
  shift = _mm256_set_m128(_mm_xor_ps(_mm_mul_ps(dmin, _mm_cvtepi32_ps(mn_hi)), neg),
                          _mm_xor_ps(_mm_mul_ps(dmin, _mm_cvtepi32_ps(_mm_and_si128(mid, six))), neg));
}

template <QuantType Q>
SPECDEC_QAVX2 inline void load_scales_avx2(const uint8_t* sb, KScales& k) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  if constexpr (Q == QuantType::kQ2_K) {
    const __m256 d = _mm256_set1_ps(fp16_f16c(sb + 80)), dmin = _mm256_set1_ps(fp16_f16c(sb + 82));
    for (int h = 0; h < 2; ++h) {
      const __m256i v = bytes8(sb + 8 * h);
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
      const __m256 mn = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
      _mm256_storeu_ps(k.scale + 8 * h, _mm256_mul_ps(d, sc));
      _mm256_storeu_ps(k.shift + 8 * h, _mm256_xor_ps(_mm256_mul_ps(dmin, mn), sign));
    }
  } else if constexpr (Q == QuantType::kQ3_K) {
    // groups 0-7: the low nibbles of bytes 0-7, their high bits from bytes 8-11 at bits 0 (g < 4) and 2; groups 8-15:
    // the high nibbles, high bits at 4 and 6 (k3_scale)
    const __m256 d = _mm256_set1_ps(fp16_f16c(sb + 108));
    const __m256i low = bytes8(sb + 96), high = _mm256_broadcastsi128_si256(bytes4(sb + 104));
    const __m256i three = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
    const __m256i h0 = _mm256_and_si256(_mm256_srlv_epi32(high, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)), three);
    const __m256i h1 = _mm256_and_si256(_mm256_srlv_epi32(high, _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6)), three);
    const __m256i l0 = _mm256_and_si256(low, _mm256_set1_epi32(15)), l1 = _mm256_srli_epi32(low, 4);
    const __m256i s0 = _mm256_sub_epi32(_mm256_or_si256(l0, _mm256_slli_epi32(h0, 4)), bias);
    const __m256i s1 = _mm256_sub_epi32(_mm256_or_si256(l1, _mm256_slli_epi32(h1, 4)), bias);
    _mm256_storeu_ps(k.scale, _mm256_mul_ps(d, _mm256_cvtepi32_ps(s0)));
    _mm256_storeu_ps(k.scale + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(s1)));
  } else if constexpr (Q == QuantType::kQ4_K || Q == QuantType::kQ5_K) {
    __m256 scale, shift;
    k4_scales_avx2(sb, scale, shift);
    _mm256_storeu_ps(k.scale, scale);
    _mm256_storeu_ps(k.shift, shift);
  } else {
    static_assert(Q == QuantType::kQ6_K, "a K-quant");
    const __m256 d = _mm256_set1_ps(fp16_f16c(sb + 208));
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 192 + 8 * h)));
      _mm256_storeu_ps(k.scale + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(v)));
    }
  }
}

template <QuantType Q>
SPECDEC_QAVX2 inline void load_scales_avx2(const uint8_t*, NoScales&) {}

template <QuantType Q>
SPECDEC_QAVX2 inline void load_row_scales_avx2(const uint8_t* row, int64_t b, ScalesOf<Q>& k) {
  load_scales_avx2<Q>(row + b / kSubBlocks<Q> * kBlockBytes<Q>, k);
}

// 8 bytes from p as int32 lanes, then (v >> shift) & mask (a shift by a vector: one instruction, by a count two).
SPECDEC_QAVX2 inline __m256i field8(const uint8_t* p, int shift, int mask) {
  const __m256i v = _mm256_srlv_epi32(bytes8(p), _mm256_set1_epi32(shift));
  return _mm256_and_si256(v, _mm256_set1_epi32(mask));
}

// Elements e0 .. e0 + 7 of K-quant sub-block s as int32 lanes (k_quant's values).
template <QuantType Q>
SPECDEC_QAVX2 inline __m256i k_quant8(const uint8_t* sb, int s, int e0) {
  if constexpr (Q == QuantType::kQ2_K) {
    return field8(sb + 16 + 32 * (s / 4) + e0, 2 * (s % 4), 3);
  } else if constexpr (Q == QuantType::kQ3_K) {
    const __m256i low = field8(sb + 32 + 32 * (s / 4) + e0, 2 * (s % 4), 3);
    const __m256i high = _mm256_slli_epi32(field8(sb + e0, s, 1), 2);
    return _mm256_sub_epi32(_mm256_add_epi32(low, high), _mm256_set1_epi32(4));
  } else if constexpr (Q == QuantType::kQ4_K) {
    return field8(sb + 16 + 32 * (s / 2) + e0, 4 * (s % 2), 15);
  } else if constexpr (Q == QuantType::kQ5_K) {
    const __m256i high = _mm256_slli_epi32(field8(sb + 16 + e0, s, 1), 4);
    return _mm256_or_si256(field8(sb + 48 + 32 * (s / 2) + e0, 4 * (s % 2), 15), high);
  } else {
    const __m256i low = field8(sb + 64 * (s / 4) + 32 * (s % 2) + e0, 4 * ((s / 2) % 2), 15);
    const __m256i high = _mm256_slli_epi32(field8(sb + 128 + 32 * (s / 4) + e0, 2 * (s % 4), 3), 4);
    return _mm256_sub_epi32(_mm256_or_si256(low, high), _mm256_set1_epi32(32));
  }
}

// A 32-weight block: the nibble types (and Q5's fifth bits) or Q8_0's bytes, times the block's d (plus m).
template <QuantType Q>
SPECDEC_QAVX2 inline void block_avx2(const uint8_t* blk, __m256* w) {
  // d (and m) from one conversion of the block's first 8 bytes: 4 instructions for both scales, not 8
  const __m128 scales = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk)));
  const __m256 d = _mm256_broadcastss_ps(scales);
  if constexpr (Q == QuantType::kQ8_0) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i));
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
  } else {
    constexpr bool kMin = Q == QuantType::kQ4_1 || Q == QuantType::kQ5_1;
    constexpr bool kFive = Q == QuantType::kQ5_0 || Q == QuantType::kQ5_1;
    const uint8_t* qs = blk + 2 + (kMin ? 2 : 0) + (kFive ? 4 : 0);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));      // bytes 0-7
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));  // 8-15
    const __m256i nibble = _mm256_set1_epi32(15);
    __m256i q[4] = {_mm256_and_si256(b0, nibble), _mm256_and_si256(b1, nibble), _mm256_srli_epi32(b0, 4),
                    _mm256_srli_epi32(b1, 4)};
    if constexpr (kFive) {
      uint32_t bits;
      std::memcpy(&bits, blk + 2 + (kMin ? 2 : 0), 4);
      const __m256i qh = _mm256_set1_epi32(static_cast<int>(bits));
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(qh, _mm256_add_epi32(lane, _mm256_set1_epi32(8 * i))),
                                             _mm256_set1_epi32(1));
        q[i] = _mm256_or_si256(q[i], _mm256_slli_epi32(bit, 4));
      }
    }
    if constexpr (kMin) {
      const __m256 m = _mm256_broadcastss_ps(_mm_movehdup_ps(scales));
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[i]), m);
    } else {
      const __m256i offset = _mm256_set1_epi32(kFive ? 16 : 8);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[i], offset)));
    }
  }
}

template <QuantType Q>
SPECDEC_QAVX2 inline void dequant_avx2(const uint8_t* row, int64_t b, const ScalesOf<Q>& k, __m256* w) {
  if constexpr (kSubBlocks<Q> > 1) {
    const uint8_t* sb = row + b / 8 * kBlockBytes<Q>;
    const int s = static_cast<int>(b % 8);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m256 q = _mm256_cvtepi32_ps(k_quant8<Q>(sb, s, 8 * i));
      const int j = scale_index<Q>(s, 8 * i);
      const __m256 scale = _mm256_broadcast_ss(&k.scale[j]);
      w[i] = kHasShift<Q> ? _mm256_fmadd_ps(scale, q, _mm256_broadcast_ss(&k.shift[j])) : _mm256_mul_ps(scale, q);
    }
  } else {
    block_avx2<Q>(row + b * kBlockBytes<Q>, w);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// AVX-512: sub-block b as 2 x 16 lanes, w[i] holding elements 16 i .. 16 i + 15.
// ---------------------------------------------------------------------------------------------------------------

SPECDEC_QAVX512 inline __m512i field16(const uint8_t* p, int shift, int mask) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_and_si512(_mm512_srlv_epi32(v, _mm512_set1_epi32(shift)), _mm512_set1_epi32(mask));
}

// Bit s of 16 bytes from p, one per lane, as a mask register: Q3_K's and Q5_K's single high bits, with no shifts.
SPECDEC_QAVX512 inline __mmask16 bit16(const uint8_t* p, int s) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm_test_epi8_mask(v, _mm_set1_epi8(static_cast<char>(1 << s)));
}

template <QuantType Q>
SPECDEC_QAVX512 inline __m512i k_quant16(const uint8_t* sb, int s, int e0) {
  if constexpr (Q == QuantType::kQ2_K) {
    return field16(sb + 16 + 32 * (s / 4) + e0, 2 * (s % 4), 3);
  } else if constexpr (Q == QuantType::kQ3_K) {
    const __m512i low = field16(sb + 32 + 32 * (s / 4) + e0, 2 * (s % 4), 3);
    return _mm512_mask_sub_epi32(low, _knot_mask16(bit16(sb + e0, s)), low, _mm512_set1_epi32(4));  // clear: -4
  } else if constexpr (Q == QuantType::kQ4_K) {
    return field16(sb + 16 + 32 * (s / 2) + e0, 4 * (s % 2), 15);
  } else if constexpr (Q == QuantType::kQ5_K) {
    const __m512i low = field16(sb + 48 + 32 * (s / 2) + e0, 4 * (s % 2), 15);
    return _mm512_mask_add_epi32(low, bit16(sb + 16 + e0, s), low, _mm512_set1_epi32(16));
  } else {
    const __m512i low = field16(sb + 64 * (s / 4) + 32 * (s % 2) + e0, 4 * ((s / 2) % 2), 15);
    const __m512i high = _mm512_slli_epi32(field16(sb + 128 + 32 * (s / 4) + e0, 2 * (s % 4), 3), 4);
    return _mm512_sub_epi32(_mm512_or_si512(low, high), _mm512_set1_epi32(32));
  }
}

template <QuantType Q>
SPECDEC_QAVX512 inline void block_avx512(const uint8_t* blk, __m512* w) {
  const __m128 scales = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk)));
  const __m512 d = _mm512_broadcastss_ps(scales);
  if constexpr (Q == QuantType::kQ8_0) {
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * i));
      w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
    }
  } else {
    constexpr bool kMin = Q == QuantType::kQ4_1 || Q == QuantType::kQ5_1;
    constexpr bool kFive = Q == QuantType::kQ5_0 || Q == QuantType::kQ5_1;
    const uint8_t* qs = blk + 2 + (kMin ? 2 : 0) + (kFive ? 4 : 0);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    __m512i q[2] = {_mm512_and_si512(bytes, _mm512_set1_epi32(15)), _mm512_srli_epi32(bytes, 4)};
    if constexpr (kFive) {  // qh's bits 16 i .. 16 i + 15 are half i's fifth bits: a mask register, no shifts
      uint32_t bits;
      std::memcpy(&bits, blk + 2 + (kMin ? 2 : 0), 4);
#pragma GCC unroll 2
      for (int i = 0; i < 2; ++i) {
        const __mmask16 high = static_cast<__mmask16>(bits >> (16 * i));
        q[i] = _mm512_mask_add_epi32(q[i], high, q[i], _mm512_set1_epi32(16));
      }
    }
    if constexpr (kMin) {
      const __m512 m = _mm512_broadcastss_ps(_mm_movehdup_ps(scales));
#pragma GCC unroll 2
      for (int i = 0; i < 2; ++i) w[i] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q[i]), m);
    } else {
      const __m512i offset = _mm512_set1_epi32(kFive ? 16 : 8);
#pragma GCC unroll 2
      for (int i = 0; i < 2; ++i) w[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(q[i], offset)));
    }
  }
}

template <QuantType Q>
SPECDEC_QAVX512 inline void dequant_avx512(const uint8_t* row, int64_t b, const ScalesOf<Q>& k, __m512* w) {
  if constexpr (kSubBlocks<Q> > 1) {
    const uint8_t* sb = row + b / 8 * kBlockBytes<Q>;
    const int s = static_cast<int>(b % 8);
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) {
      const __m512 q = _mm512_cvtepi32_ps(k_quant16<Q>(sb, s, 16 * i));
      const int j = scale_index<Q>(s, 16 * i);
      const __m512 scale = _mm512_set1_ps(k.scale[j]);
      w[i] = kHasShift<Q> ? _mm512_fmadd_ps(scale, q, _mm512_set1_ps(k.shift[j])) : _mm512_mul_ps(scale, q);
    }
  } else {
    block_avx512<Q>(row + b * kBlockBytes<Q>, w);
  }
}

#endif  // SPECDEC_CPU_X86
