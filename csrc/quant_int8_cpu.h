// The 8-bit activation path of quant_linear: x quantized per row and 32-weight block to int8 with one float scale
// (llama.cpp's Q8_0: d = amax / 127, q = round(x / d)), integer dot products with the weight blocks' quants, then a
// float epilogue per block. A section of csrc/quant_linear_cpu.cpp kept in its own file: included there inside its
// anonymous namespace, after csrc/quant_blocks_cpu.h (whose decoders of scales and quants it reuses).
//
// Glossary: a weight block b of row n is read as integers: quants q[32] (signed, the format's offset removed), group
// scales sc[2] and group minima mn[2] (one per 16 weights; 1 where the format has none), and float scales a (its d,
// or d times a K-quant's sub-block scale) and c (its minimum's factor; 0 where it has none). An x block is xq[32],
// its scale dx and its two 16-element sums xs[2]. Then, per output (m, n), with every float operation rounded once:
//   I = sc0 * sum(q xq over elements 0-15) + sc1 * sum(over 16-31)          (int32, exact)
//   S = mn0 * xs0 + mn1 * xs1                                                (int32, exact; formats with a minimum)
//   u = a * float(I); u = u + c * float(S); acc = acc + dx * u               (float32, blocks in order)
// out = acc (+ bias last, as the float path). |I| and |S| stay below 2^24 for every format, so float(I) is exact.
// The integers are exact whatever the order, and every path (scalar, AVX2, AVX512-VNNI) runs the epilogue as written,
// one output per lane: the paths agree bit for bit, and a row's result depends on that row only (batch-invariant).
// spec_kernels/quant_linear/ref.py's quant_linear_ref(activations="int8") is the same arithmetic in torch.
#pragma once

// Formats read as integers: all but none. Q2_K / Q3_K / Q6_K carry per-16 group scales (Q2_K its minima too).
template <QuantType Q>
constexpr bool kGroupScales = Q == QuantType::kQ2_K || Q == QuantType::kQ3_K || Q == QuantType::kQ6_K;
// What makes int_quants' integers unsigned bytes (VNNI's vpdpbusd and AVX2's vpmaddubsw multiply unsigned bytes by
// signed ones), taken off after as offset times the x block's sum.
template <QuantType Q>
constexpr int kUnsignedOffset = Q == QuantType::kQ8_0   ? 128
                                : Q == QuantType::kQ4_0 ? 8
                                : Q == QuantType::kQ5_0 ? 16
                                : Q == QuantType::kQ6_K ? 32
                                : Q == QuantType::kQ3_K ? 4
                                                        : 0;
// AVX2's: every format's but Q8_0's, whose q + 128 times xq would overflow maddubs's int16 pair sums (those take |q|
// and xq with q's sign); the others stay <= 63 (2 * 63 * 127 < 2^15).
template <QuantType Q>
constexpr int kAvx2Offset = Q == QuantType::kQ8_0 ? 0 : kUnsignedOffset<Q>;
// The largest of those unsigned quants (|q| for Q8_0), and so how many of maddubs's int16 pair sums (each at most
// 2 * that * 128, x's quants being at most 127 in magnitude) one int16 lane can add up before vpmaddwd widens it:
// the AVX2 kernels sum that many in int16, which keeps the integers exact and saves the widening multiplies.
template <QuantType Q>
constexpr int kAvx2Max = Q == QuantType::kQ8_0   ? 128
                         : Q == QuantType::kQ2_K ? 3
                         : Q == QuantType::kQ3_K ? 7
                         : Q == QuantType::kQ5_0 || Q == QuantType::kQ5_1 || Q == QuantType::kQ5_K ? 31
                         : Q == QuantType::kQ6_K ? 63
                                                 : 15;
template <QuantType Q>
constexpr int kInt16Sums = std::max(1, 32767 / (2 * kAvx2Max<Q> * 128));
template <QuantType Q>
constexpr bool kIntMin = Q == QuantType::kQ4_1 || Q == QuantType::kQ5_1 || Q == QuantType::kQ2_K ||
                         Q == QuantType::kQ4_K || Q == QuantType::kQ5_K;

// The float scales and integer group factors of block b of `row`; `half` converts an fp16 field (scalar or F16C:
// the same values).
struct BlockScales {
  float a, c;
  int32_t sc[2], mn[2];
};

template <QuantType Q, typename Half>
inline BlockScales int_scales(const uint8_t* row, int64_t b, Half half) {
  BlockScales k{0.f, 0.f, {1, 1}, {1, 1}};
  if constexpr (kSubBlocks<Q> == 1) {
    const uint8_t* blk = row + b * kBlockBytes<Q>;
    k.a = half(blk);
    if constexpr (kIntMin<Q>) k.c = half(blk + 2);
  } else {
    const uint8_t* sb = row + b / 8 * kBlockBytes<Q>;
    const int s = static_cast<int>(b % 8);
    if constexpr (Q == QuantType::kQ2_K) {
      k.a = half(sb + 80), k.c = -half(sb + 82);
      for (int h = 0; h < 2; ++h) k.sc[h] = sb[2 * s + h] & 15, k.mn[h] = sb[2 * s + h] >> 4;
    } else if constexpr (Q == QuantType::kQ3_K) {
      k.a = half(sb + 108);
      for (int h = 0; h < 2; ++h) k.sc[h] = k3_scale(sb + 96, 2 * s + h);
    } else if constexpr (Q == QuantType::kQ4_K || Q == QuantType::kQ5_K) {
      int scale, min;
      k4_scale_min(sb + 4, s, scale, min);
      k.a = half(sb) * static_cast<float>(scale);  // exact: an fp16 times a 6-bit integer
      k.c = -(half(sb + 2) * static_cast<float>(min));
    } else {
      static_assert(Q == QuantType::kQ6_K, "a K-quant");
      k.a = half(sb + 208);
      for (int h = 0; h < 2; ++h) k.sc[h] = static_cast<int8_t>(sb[192 + 2 * s + h]);
    }
  }
  return k;
}

// Block b's 32 quants as signed integers (the value the weight is a multiple of, before a minimum).
template <QuantType Q>
inline void int_quants(const uint8_t* row, int64_t b, int8_t* q) {
  if constexpr (kSubBlocks<Q> > 1) {
    const uint8_t* sb = row + b / 8 * kBlockBytes<Q>;
    for (int e = 0; e < 32; ++e) q[e] = static_cast<int8_t>(k_quant<Q>(sb, static_cast<int>(b % 8), e));
  } else if constexpr (Q == QuantType::kQ8_0) {
    std::memcpy(q, row + b * kBlockBytes<Q> + 2, 32);
  } else {
    const uint8_t* blk = row + b * kBlockBytes<Q>;
    constexpr bool kMin = Q == QuantType::kQ4_1 || Q == QuantType::kQ5_1;
    constexpr bool kFive = Q == QuantType::kQ5_0 || Q == QuantType::kQ5_1;
    const uint8_t* qs = blk + 2 + (kMin ? 2 : 0) + (kFive ? 4 : 0);
    uint32_t qh = 0;
    if constexpr (kFive) std::memcpy(&qh, blk + 2 + (kMin ? 2 : 0), 4);
    constexpr int kOffset = kMin ? 0 : (kFive ? 16 : 8);
    for (int i = 0; i < 32; ++i) {
      const int v = ((qs[i % 16] >> (4 * (i / 16))) & 15) | static_cast<int>(((qh >> i) & 1) << 4);
      q[i] = static_cast<int8_t>(v - kOffset);
    }
  }
}

// x [M, K] (row stride ldx) as int8 blocks: xq [M, K], dx [M, K / 32], xs [M, K / 16] (each 16 elements' sum), and
// sum [M, K / 32] each block's sum as a float (exact: |sum| <= 32 * 127), which the vector epilogues broadcast.
struct Int8Rows {
  std::vector<int8_t> xq;
  std::vector<float> dx;
  std::vector<int32_t> xs;
  std::vector<float> sum;
};

// nearbyint rounds half to even, as torch.round does in the reference; the clamp only guards rounding noise in
// amax * (1 / d).
inline void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, Int8Rows& r) {
  r.xq.resize(static_cast<size_t>(M * K));
  r.dx.resize(static_cast<size_t>(M * K / 32));
  r.xs.resize(static_cast<size_t>(M * K / 16));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < K / 32; ++b) {
      const float* v = x + m * ldx + b * 32;
      float amax = 0.f;
      for (int e = 0; e < 32; ++e) amax = std::max(amax, std::fabs(v[e]));
      const float d = amax / 127.f;
      const float inv = d != 0.f ? 1.f / d : 0.f;
      int8_t* q = r.xq.data() + m * K + b * 32;
      int32_t sums[2] = {0, 0};
      for (int e = 0; e < 32; ++e) {
        const float s = std::min(std::max(v[e] * inv, -127.f), 127.f);
        q[e] = static_cast<int8_t>(static_cast<int>(std::nearbyint(s)));
        sums[e / 16] += q[e];
      }
      r.dx[m * (K / 32) + b] = d;
      r.xs[m * (K / 16) + 2 * b] = sums[0], r.xs[m * (K / 16) + 2 * b + 1] = sums[1];
    }
  }
}

// Keeps a product from being fused with the add after it: GCC contracts a * b + c into an FMA inside the vector
// paths' FMA targets (and on CPUs whose baseline has FMA), which would round once where the reference rounds twice.
template <typename V>
__attribute__((always_inline)) inline V rounded(V v) {  // inlined: a vector V is passed in its caller's registers
#if defined(__GNUC__) && SPECDEC_CPU_X86
  __asm__("" : "+v"(v));
#elif defined(__GNUC__)
  __asm__("" : "+g"(v));
#endif
  return v;
}

// What one thread computes: the int8 x and the float sums of weight rows [n_begin, n_end) into a.sums.
struct Int8Args {
  const Int8Rows* x;
  const QuantArgs* a;
};

template <QuantType Q>
void int8_rows_scalar(const Int8Args& p, int64_t n_begin, int64_t n_end) {
  const QuantArgs& a = *p.a;
  const int64_t blocks = a.K / 32;
  thread_local std::vector<float> acc;  // [M]
  acc.resize(static_cast<size_t>(a.M));
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = a.w + n * a.row_bytes;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t b = 0; b < blocks; ++b) {
      int8_t q[32];
      int_quants<Q>(row, b, q);
      const BlockScales k = int_scales<Q>(row, b, fp16_at);
      for (int64_t m = 0; m < a.M; ++m) {
        const int8_t* xq = p.x->xq.data() + m * a.K + b * 32;
        int32_t half[2] = {0, 0};
        for (int e = 0; e < 32; ++e) half[e / 16] += static_cast<int32_t>(q[e]) * xq[e];
        const int32_t I = k.sc[0] * half[0] + k.sc[1] * half[1];
        float u = rounded(k.a * static_cast<float>(I));
        if constexpr (kIntMin<Q>) {
          const int32_t* xs = p.x->xs.data() + m * (a.K / 16) + 2 * b;
          u = u + rounded(k.c * static_cast<float>(k.mn[0] * xs[0] + k.mn[1] * xs[1]));
        }
        acc[m] = acc[m] + rounded(p.x->dx[m * blocks + b] * u);
      }
    }
    for (int64_t m = 0; m < a.M; ++m) store(a, m, n, acc[m]);
  }
}

#if SPECDEC_CPU_X86

#define SPECDEC_QVNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

// acc + vpdpbusd(w, the dword at p in every lane), the broadcast embedded in the instruction's memory operand: GCC 12
// does not fold _mm512_set1_epi32 of a load into vpdpbusd, which then takes a vpbroadcastd of its own per product.
typedef int32_t unaligned_dword __attribute__((may_alias, aligned(1)));
SPECDEC_QVNNI __attribute__((always_inline)) inline __m512i dpbusd_dword(__m512i acc, __m512i w, const int8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const unaligned_dword*>(p)));
  return acc;
}

// 32 bytes from p, each (v >> shift) & mask: one 16-bit shift serves every byte, the mask dropping what crossed in.
SPECDEC_QAVX2 __attribute__((always_inline)) inline __m256i field32(const uint8_t* p, int shift, int mask) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(static_cast<char>(mask)));
}

// The 32 bits of Q5_0 / Q5_1's qh as bytes 0 or 16 (element i's fifth bit is bit i): llama.cpp's bytes_from_bits_32.
SPECDEC_QAVX2 inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                0x0303030303030303));  // byte i: byte i / 8 of bits
  const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                        _mm256_set1_epi64x(-1));  // all ones where bit i % 8 is set
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

// Blocks a kernel's step takes at once: a K-quant's super-block (its scales are gathered together), else one.
template <QuantType Q>
constexpr int kStepBlocks = kSubBlocks<Q> == 1 ? 1 : 8;

// Block s of the step at `blk` (a super-block, or the block itself) as 32 bytes: int_quants' integers plus kOff (0:
// signed; kUnsignedOffset<Q>: unsigned). Always inlined: a kernel that unrolls its step's blocks gets each block's
// offsets and shifts as constants, and one load for the two blocks that share a K-quant's bytes.
template <QuantType Q, int kOff = 0>
SPECDEC_QAVX2 __attribute__((always_inline)) inline __m256i step_quants_avx2(const uint8_t* blk, int s) {
  static_assert(kOff == 0 || kOff == kUnsignedOffset<Q>, "signed or unsigned");
  if constexpr (Q == QuantType::kQ8_0) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    return kOff != 0 ? _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80))) : q;
  } else if constexpr (kSubBlocks<Q> == 1) {  // Q4_0, Q4_1, Q5_0, Q5_1
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kBlockBytes<Q> - 16));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(qs, 4), qs);  // elements 0-15 low nibbles, 16-31 high
    __m256i v = _mm256_and_si256(both, _mm256_set1_epi8(15));
    constexpr bool kMin = Q == QuantType::kQ4_1 || Q == QuantType::kQ5_1;
    if constexpr (Q == QuantType::kQ5_0 || Q == QuantType::kQ5_1) {
      v = _mm256_or_si256(v, fifth_bits(blk + (kMin ? 4 : 2)));
    }
    constexpr int kOffset = (kMin ? 0 : (Q == QuantType::kQ5_0 ? 16 : 8)) - kOff;
    return kOffset != 0 ? _mm256_sub_epi8(v, _mm256_set1_epi8(kOffset)) : v;
  } else {
    const uint8_t* sb = blk;  // the super-block
    if constexpr (Q == QuantType::kQ2_K) {
      return field32(sb + 16 + 32 * (s / 4), 2 * (s % 4), 3);
    } else if constexpr (Q == QuantType::kQ3_K) {  // a clear high bit subtracts 4
      const __m256i high = _mm256_slli_epi16(field32(sb, s, 1), 2);
      const __m256i v = _mm256_add_epi8(field32(sb + 32 + 32 * (s / 4), 2 * (s % 4), 3), high);
      return kOff == 4 ? v : _mm256_sub_epi8(v, _mm256_set1_epi8(4));
    } else if constexpr (Q == QuantType::kQ4_K) {
      return field32(sb + 16 + 32 * (s / 2), 4 * (s % 2), 15);
    } else if constexpr (Q == QuantType::kQ5_K) {
      const __m256i high = _mm256_slli_epi16(field32(sb + 16, s, 1), 4);
      return _mm256_or_si256(field32(sb + 48 + 32 * (s / 2), 4 * (s % 2), 15), high);
    } else {
      static_assert(Q == QuantType::kQ6_K, "a K-quant");
      const __m256i low = field32(sb + 64 * (s / 4) + 32 * (s % 2), 4 * ((s / 2) % 2), 15);
      const __m256i high = _mm256_slli_epi16(field32(sb + 128 + 32 * (s / 4), 2 * (s % 4), 3), 4);
      const __m256i v = _mm256_or_si256(low, high);
      return kOff == 32 ? v : _mm256_sub_epi8(v, _mm256_set1_epi8(32));
    }
  }
}

// Block b of `row` as step_quants_avx2 gives it.
template <QuantType Q, int kOff = 0>
SPECDEC_QAVX2 inline __m256i int_quants_avx2(const uint8_t* row, int64_t b) {
  return step_quants_avx2<Q, kOff>(row + b / kStepBlocks<Q> * kBlockBytes<Q>, static_cast<int>(b % kStepBlocks<Q>));
}

// 8 rows of 8 dwords -> 8 vectors, vector j holding dword j (elements 4j .. 4j + 3) of rows 0-7.
SPECDEC_QAVX2 inline void transpose8x8(const __m256i* r, __m256i* t) {
  __m256i a[8], c[8];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {  // rows 4i .. 4i + 3: dwords (0|4), (1|5), (2|6), (3|7)
    c[4 * i] = _mm256_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    c[4 * i + 1] = _mm256_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    c[4 * i + 2] = _mm256_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    c[4 * i + 3] = _mm256_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm256_permute2x128_si256(c[j], c[4 + j], 0x20);
    t[j + 4] = _mm256_permute2x128_si256(c[j], c[4 + j], 0x31);
  }
}

// A tile of NB (8 or 16) weight rows decoded once for every x row: per block, 8 vectors of NB dwords (vector j:
// elements 4j .. 4j + 3 of each row; VNNI's operand order), and the rows' scales side by side.
template <int NB>
struct Panel {
  std::vector<int8_t> q;  // [blocks, 8, NB, 4]
  std::vector<float> a, c;  // [blocks, NB]
  std::vector<int32_t> sc, mn;  // [blocks, 2, NB]
  void resize(int64_t blocks) {
    q.resize(static_cast<size_t>(blocks * 32 * NB));
    a.resize(static_cast<size_t>(blocks * NB)), c.resize(a.size());
    sc.resize(static_cast<size_t>(blocks * 2 * NB)), mn.resize(sc.size());
  }
};

// fp16_f16c as a function object for int_scales (which has no target of its own: fp16_f16c needs none, and inlines).
struct F16c {
  __attribute__((always_inline)) float operator()(const uint8_t* p) const { return fp16_f16c(p); }
};

// Row i's scales for every block, one call per block (int_scales).
template <QuantType Q, int NB>
SPECDEC_QAVX2 void fill_scales(const uint8_t* row, int64_t blocks, int i, Panel<NB>& p) {
  // raw pointers: a store through the vectors' own would make the compiler reload them after every store
  float* const pa = p.a.data();
  float* const pc = p.c.data();
  int32_t* const psc = p.sc.data();
  int32_t* const pmn = p.mn.data();
  for (int64_t b = 0; b < blocks; ++b) {
    const BlockScales k = int_scales<Q>(row, b, F16c{});
    pa[b * NB + i] = k.a;
    if constexpr (kIntMin<Q>) pc[b * NB + i] = k.c;
    for (int h = 0; h < 2 && kGroupScales<Q>; ++h) {
      psc[(b * 2 + h) * NB + i] = k.sc[h];
      if constexpr (kIntMin<Q>) pmn[(b * 2 + h) * NB + i] = k.mn[h];  // Q2_K's minima factors
    }
  }
}

// The quants of rows n0 .. n0 + rows - 1 (rows <= NB; the rest zero) into the panel, each plus kOff: 0 (signed),
// kUnsignedOffset<Q> (AVX2's maddubs) or 128 (VNNI's vpdpbusd, every format); the kernels take off kOff sum(xq).
template <QuantType Q, int NB, int kOff>
SPECDEC_QAVX2 void fill_panel(const QuantArgs& a, int64_t n0, int64_t rows, Panel<NB>& p) {
  const int64_t blocks = a.K / 32;
  // The next tile's rows (contiguous after these) pulled in at this tile's pace: NB rows read a block at a time are NB
  // streams, more than the hardware prefetchers follow (without this, M = 1 waited on DRAM in the quants' loads).
  const uintptr_t next = reinterpret_cast<uintptr_t>(a.w) + (n0 + NB) * a.row_bytes;
  const int64_t step = NB * a.row_bytes / blocks;  // bytes of the next tile per block
  const uint8_t* const w = a.w;
  const int64_t row_bytes = a.row_bytes;
  int8_t* const q = p.q.data();
  for (int64_t b = 0; b < blocks; ++b) {
    simd::prefetch_lines(next + b * step, next + (b + 1) * step, false);
    for (int h = 0; h < NB / 8; ++h) {
      __m256i r[8], t[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const int64_t n = n0 + 8 * h + i;
        if constexpr (kOff == 128) {  // the signed quants' sign bit flipped
          r[i] = n < n0 + rows ? int_quants_avx2<Q>(w + n * row_bytes, b) : _mm256_setzero_si256();
          r[i] = _mm256_xor_si256(r[i], _mm256_set1_epi8(static_cast<char>(0x80)));
        } else {
          r[i] = n < n0 + rows ? int_quants_avx2<Q, kOff>(w + n * row_bytes, b) : _mm256_setzero_si256();
        }
      }
      transpose8x8(r, t);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + ((b * 8 + j) * NB + 8 * h) * 4), t[j]);
      }
    }
  }
}

// The fp16 at byte `off` of 8 rows, converted side by side: lane i row r[i].
SPECDEC_QAVX2 inline __m256 fp16_rows8(const uint8_t* const* r, int64_t off) {
  uint16_t v[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) std::memcpy(&v[i], r[i] + off, 2);
  return _mm256_cvtph_ps(_mm_setr_epi16(static_cast<int16_t>(v[0]), static_cast<int16_t>(v[1]),
                                        static_cast<int16_t>(v[2]), static_cast<int16_t>(v[3]),
                                        static_cast<int16_t>(v[4]), static_cast<int16_t>(v[5]),
                                        static_cast<int16_t>(v[6]), static_cast<int16_t>(v[7])));
}

// Q6_K's 16 group scales (int8, at byte 192 of the super-block at `off`) of 8 rows, as int32 side by side: out[g]
// lane i is row r[i]'s scale g. An 8 x 16 byte transpose by unpacks (bytes, then pairs, then quads of rows).
SPECDEC_QAVX2 inline void q6k_group_scales8(const uint8_t* const* r, int64_t off, __m256i* out) {
  __m128i v[8], u[8], w[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) v[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r[i] + off + 192));
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {  // u[2k]: groups 0-7 of rows 2k, 2k + 1 (a 16-bit unit each); u[2k + 1]: 8-15
    u[2 * k] = _mm_unpacklo_epi8(v[2 * k], v[2 * k + 1]), u[2 * k + 1] = _mm_unpackhi_epi8(v[2 * k], v[2 * k + 1]);
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {  // w[4h + q]: groups 4q .. 4q + 3 of rows 4h .. 4h + 3 (a 32-bit unit each)
    const __m128i* x = u + 4 * h;
    w[4 * h] = _mm_unpacklo_epi16(x[0], x[2]), w[4 * h + 1] = _mm_unpackhi_epi16(x[0], x[2]);
    w[4 * h + 2] = _mm_unpacklo_epi16(x[1], x[3]), w[4 * h + 3] = _mm_unpackhi_epi16(x[1], x[3]);
  }
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {  // groups 4q, 4q + 1 and 4q + 2, 4q + 3: rows 0-7 in each 64-bit half
    const __m128i lo = _mm_unpacklo_epi32(w[q], w[4 + q]), hi = _mm_unpackhi_epi32(w[q], w[4 + q]);
    out[4 * q] = _mm256_cvtepi8_epi32(lo), out[4 * q + 1] = _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo));
    out[4 * q + 2] = _mm256_cvtepi8_epi32(hi), out[4 * q + 3] = _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi));
  }
}

// Q4_K / Q5_K's sub-block scales and shifts (k4_scales_avx2's values) of the super-blocks at `off` of 8 rows, lane i
// row r[i]: each row's 16-byte head (d, dmin, 12 bytes of 6-bit scales and minima) transposed to four dwords with
// rows in lanes, then each sub-block's fields taken out of all 8 rows at once (gather_k_scales' rule, which VNNI's
// kernels apply to 16 rows gathered, csrc/quant_int8_rows_cpu.h).
SPECDEC_QAVX2 inline void k4_scales_rows8(const uint8_t* const* r, int64_t off, __m256* scale, __m256* shift) {
  __m256i v[4], t[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // rows i and i + 4, one per 128-bit lane
    v[i] = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(r[i + 4] + off),
                               reinterpret_cast<const __m128i*>(r[i] + off));
  }
  t[0] = _mm256_unpacklo_epi32(v[0], v[1]), t[1] = _mm256_unpackhi_epi32(v[0], v[1]);
  t[2] = _mm256_unpacklo_epi32(v[2], v[3]), t[3] = _mm256_unpackhi_epi32(v[2], v[3]);
  const __m256i head = _mm256_unpacklo_epi64(t[0], t[2]);  // dword 0 of rows 0-7: d | dmin << 16
  const __m256i lo = _mm256_unpackhi_epi64(t[0], t[2]), mid = _mm256_unpacklo_epi64(t[1], t[3]);  // bytes 4-7, 8-11
  const __m256i hi = _mm256_unpackhi_epi64(t[1], t[3]);  // bytes 12-15
  // d and dmin as 8 halves each, rows in order: [d 0-3, dmin 0-3 | d 4-7, dmin 4-7], then the 64-bit quarters sorted
  const __m256i halves = _mm256_permute4x64_epi64(
      _mm256_packus_epi32(_mm256_and_si256(head, _mm256_set1_epi32(0xffff)), _mm256_srli_epi32(head, 16)), 0xd8);
  const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
  const __m256 dmin = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
  const __m256 neg = _mm256_set1_ps(-0.f);
  const __m256i six = _mm256_set1_epi32(63), four = _mm256_set1_epi32(15), two = _mm256_set1_epi32(3);
  // sub-block k: the low 6 bits of head bytes 4 + k (scale) and 8 + k (minimum); k + 4: byte 12 + k's nibbles under
  // the top 2 bits of those bytes (k4_scales_avx2's rule)
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const __m256i sc = _mm256_and_si256(_mm256_srli_epi32(lo, 8 * k), six);
    const __m256i mn = _mm256_and_si256(_mm256_srli_epi32(mid, 8 * k), six);
    const __m256i sc_top = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(lo, 8 * k + 6), two), 4);
    const __m256i mn_top = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(mid, 8 * k + 6), two), 4);
    const __m256i sc_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(hi, 8 * k), four), sc_top);
    const __m256i mn_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(hi, 8 * k + 4), four), mn_top);
    scale[k] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
    scale[k + 4] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc_hi));
    shift[k] = _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn)), neg);
    shift[k + 4] = _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn_hi)), neg);
  }
}

// The scales of rows n0 .. n0 + rows - 1 into the panel (the rest zero), int_scales' values: the 32-weight formats'
// fp16 fields (a = d, c = the minimum's factor), Q6_K's (a = d, its group scales) and Q4_K / Q5_K's (a and c, each
// sub-block's scale and shift) 8 rows at a time, a block or super-block at once; Q2_K / Q3_K's row by row.
template <QuantType Q, int NB>
SPECDEC_QAVX2 void fill_panel_scales(const QuantArgs& a, int64_t n0, int64_t rows, Panel<NB>& p) {
  const int64_t blocks = a.K / 32;
  if constexpr ((kSubBlocks<Q> == 1 || Q == QuantType::kQ6_K || kPerSubBlock<Q>) && NB == 8) {
    const uint8_t* r[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) r[i] = a.w + (n0 + std::min<int64_t>(i, rows - 1)) * a.row_bytes;  // dead: a copy
    const __m256i live_i =
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rows)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 live = _mm256_castsi256_ps(live_i);
    if constexpr (Q == QuantType::kQ6_K) {
      float* const pa = p.a.data();
      int32_t* const psc = p.sc.data();
      for (int64_t j = 0; j < blocks / 8; ++j) {
        const int64_t off = j * kBlockBytes<Q>;
        const __m256 d = _mm256_and_ps(fp16_rows8(r, off + 208), live);
#pragma GCC unroll 8
        for (int s = 0; s < 8; ++s) _mm256_storeu_ps(pa + (8 * j + s) * 8, d);
        __m256i sc[16];
        q6k_group_scales8(r, off, sc);
#pragma GCC unroll 16
        for (int g = 0; g < 16; ++g) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(psc + (16 * j + g) * 8), _mm256_and_si256(sc[g], live_i));
        }
      }
    } else if constexpr (kPerSubBlock<Q>) {  // 8 rows' sub-block scales and shifts, lane = row
      float* const pa = p.a.data();
      float* const pc = p.c.data();
      for (int64_t j = 0; j < blocks / 8; ++j) {
        __m256 scale[8], shift[8];
        k4_scales_rows8(r, j * kBlockBytes<Q>, scale, shift);
#pragma GCC unroll 8
        for (int s = 0; s < 8; ++s) {
          _mm256_storeu_ps(pa + (8 * j + s) * 8, _mm256_and_ps(scale[s], live));
          _mm256_storeu_ps(pc + (8 * j + s) * 8, _mm256_and_ps(shift[s], live));
        }
      }
    } else {
      float* const pa = p.a.data();
      float* const pc = p.c.data();
      for (int64_t b = 0; b < blocks; ++b) {
        _mm256_storeu_ps(pa + b * 8, _mm256_and_ps(fp16_rows8(r, b * kBlockBytes<Q>), live));
        if constexpr (kIntMin<Q>) {
          _mm256_storeu_ps(pc + b * 8, _mm256_and_ps(fp16_rows8(r, b * kBlockBytes<Q> + 2), live));
        }
      }
    }
    return;
  }
  for (int i = 0; i < NB; ++i) {
    if (i < rows) {
      fill_scales<Q, NB>(a.w + (n0 + i) * a.row_bytes, blocks, i, p);
    } else {
      for (int64_t b = 0; b < blocks; ++b) p.a[b * NB + i] = p.c[b * NB + i] = 0.f;
    }
  }
}

#include "quant_int8_avx2_cpu.h"  // the AVX2 kernels: the panel tile and the row-wise kernel
#include "quant_int8_rows_cpu.h"  // the VNNI row-wise kernel for a few x rows, its scale gathers, x's AVX2 quantizer
#if SPECDEC_CPU_AMX
#include "quant_int8_amx_cpu.h"  // int8_rowwise_amx: AMX-INT8 tiles past one pass of the row-wise kernel
#endif

// AVX512-VNNI: 16 weight rows per vector, MB x rows per pass (each panel vector loaded once for them); vpdpbusd sums
// four (q + 128) xq products per dword, and 128 xs is taken off after.
template <QuantType Q, int MB>
SPECDEC_QVNNI void int8_tile_vnni(const Int8Args& x, const Panel<16>& p, int64_t n0, int64_t rows, int64_t m0) {
  const QuantArgs& a = *x.a;
  const int64_t blocks = a.K / 32;
  __m512 acc[MB];
#pragma GCC unroll 4
  for (int r = 0; r < MB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i half[MB][2];
#pragma GCC unroll 4
    for (int r = 0; r < MB; ++r) half[r][0] = half[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512i w = _mm512_loadu_si512(p.q.data() + (b * 8 + j) * 64);
#pragma GCC unroll 4
      for (int r = 0; r < MB; ++r) {
        const int8_t* xq = x.x->xq.data() + (m0 + r) * a.K + b * 32;
        half[r][j / 4] = dpbusd_dword(half[r][j / 4], w, xq + 4 * j);
      }
    }
    const __m512 scale = _mm512_loadu_ps(p.a.data() + b * 16);
#pragma GCC unroll 4
    for (int r = 0; r < MB; ++r) {
      const int32_t* xs = x.x->xs.data() + (m0 + r) * (a.K / 16) + 2 * b;
      __m512i I;
      if constexpr (kGroupScales<Q>) {
        const __m512i h0 = _mm512_sub_epi32(half[r][0], _mm512_set1_epi32(128 * xs[0]));
        const __m512i h1 = _mm512_sub_epi32(half[r][1], _mm512_set1_epi32(128 * xs[1]));
        I = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_loadu_si512(p.sc.data() + b * 32), h0),
                             _mm512_mullo_epi32(_mm512_loadu_si512(p.sc.data() + b * 32 + 16), h1));
      } else {
        I = _mm512_sub_epi32(_mm512_add_epi32(half[r][0], half[r][1]), _mm512_set1_epi32(128 * (xs[0] + xs[1])));
      }
      __m512 u = rounded(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(I)));
      if constexpr (kIntMin<Q>) {
        __m512i S = _mm512_set1_epi32(xs[0] + xs[1]);
        if constexpr (kGroupScales<Q>) {  // Q2_K's per-16 minima
          S = _mm512_add_epi32(
              _mm512_mullo_epi32(_mm512_loadu_si512(p.mn.data() + b * 32), _mm512_set1_epi32(xs[0])),
              _mm512_mullo_epi32(_mm512_loadu_si512(p.mn.data() + b * 32 + 16), _mm512_set1_epi32(xs[1])));
        }
        u = _mm512_add_ps(u, rounded(_mm512_mul_ps(_mm512_loadu_ps(p.c.data() + b * 16), _mm512_cvtepi32_ps(S))));
      }
      acc[r] = _mm512_add_ps(acc[r], rounded(_mm512_mul_ps(_mm512_set1_ps(x.x->dx[(m0 + r) * blocks + b]), u)));
    }
  }
  for (int r = 0; r < MB; ++r) store_lanes(a, m0 + r, n0, rows, acc[r]);
}

template <QuantType Q>
void int8_rows_vnni(const Int8Args& x, int64_t n_begin, int64_t n_end) {
  constexpr int64_t kRows = 4;  // x rows per pass: 4 x 3 accumulators plus the panel vector fit the 32 registers
  thread_local Panel<16> p;
  p.resize(x.a->K / 32);
  for (int64_t n0 = n_begin; n0 < n_end; n0 += 16) {
    const int64_t rows = std::min<int64_t>(16, n_end - n0);
    fill_panel<Q, 16, 128>(*x.a, n0, rows, p);
    gather_panel_scales<Q>(*x.a, n0, rows, p);
    for (int64_t m0 = 0; m0 < x.a->M; m0 += kRows) {
      switch (std::min(kRows, x.a->M - m0)) {
        case 1:
          int8_tile_vnni<Q, 1>(x, p, n0, rows, m0);
          break;
        case 2:
          int8_tile_vnni<Q, 2>(x, p, n0, rows, m0);
          break;
        case 3:
          int8_tile_vnni<Q, 3>(x, p, n0, rows, m0);
          break;
        default:
          int8_tile_vnni<Q, 4>(x, p, n0, rows, m0);
          break;
      }
    }
  }
}

#endif  // SPECDEC_CPU_X86

// How this process multiplies int8 blocks (chosen once, under SPECDEC_CPU_ISA's cap like the float paths): AMX-INT8
// tiles beside VNNI where the CPU has them (Intel from Sapphire Rapids), VNNI where AVX-512 has it (Intel from Cascade
// Lake, AMD Zen 4), AVX2 elsewhere (AVX-512 without VNNI too), else scalar.
enum class Int8Path { kScalar, kAvx2, kVnni, kAmx };

inline Int8Path int8_path() {
  static const Int8Path path = [] {
#if SPECDEC_CPU_X86
    if (!__builtin_cpu_supports("f16c")) return Int8Path::kScalar;
    if (simd::cpu_isa() == simd::Isa::kAvx512 && __builtin_cpu_supports("avx512vnni")) {
      return SPECDEC_CPU_AMX && simd::cpu_has_amx_int8() ? Int8Path::kAmx : Int8Path::kVnni;
    }
    if (simd::cpu_isa() >= simd::Isa::kAvx2) return Int8Path::kAvx2;
#endif
    return Int8Path::kScalar;
  }();
  return path;
}

// x [M, K] as int8 blocks, by the widest quantizer (they give the same bits).
inline void quantize_int8(const float* x, int64_t ldx, int64_t M, int64_t K, Int8Rows& r) {
#if SPECDEC_CPU_X86
  if (int8_path() != Int8Path::kScalar) {
    quantize_rows_avx2(x, ldx, M, K, r);
  } else {
    quantize_rows(x, ldx, M, K, r);
  }
#else
  quantize_rows(x, ldx, M, K, r);
#endif
  r.sum.resize(static_cast<size_t>(M * K / 32));
  for (size_t i = 0; i < r.sum.size(); ++i) r.sum[i] = static_cast<float>(r.xs[2 * i] + r.xs[2 * i + 1]);
}

// Every path gives the same bits (the header's note), so the choice may depend on M without breaking batch
// invariance: decoding's few rows take the row-wise kernel; more than one pass of it
// (kPassRows) the tiles where the CPU has them, whose fixed cost per block a single pass does not pay back
// (bench/RESULTS.md).
template <QuantType Q>
void int8_rows(const Int8Args& x, int64_t n_begin, int64_t n_end) {
#if SPECDEC_CPU_X86
  const Int8Path path = int8_path();
  if (path == Int8Path::kVnni || path == Int8Path::kAmx) {
#if SPECDEC_CPU_AMX
    if (path == Int8Path::kAmx && x.a->M > kPassRows) return int8_rowwise_amx<Q>(x, n_begin, n_end);
#endif
    if (x.a->M <= kRowWiseRows) return int8_rowwise_vnni<Q>(x, n_begin, n_end);
    return int8_rows_vnni<Q>(x, n_begin, n_end);
  }
  if (path == Int8Path::kAvx2) return int8_rows_avx2<Q>(x, n_begin, n_end);
#endif
  int8_rows_scalar<Q>(x, n_begin, n_end);
}
