// The 8-bit activation path's VNNI kernel for a few x rows, every format read row-wise: 16 weight rows' quants read
// straight from their blocks, two rows to a 512-bit vector, turned to vpdpbusd's operand order in registers (a dword of
// 4 quants per row, 16 rows per vector) and dotted there with every x row's int8 block; the epilogue of
// csrc/quant_int8_cpu.h then runs on 16 rows at once. A section of csrc/quant_linear_cpu.cpp, included by
// csrc/quant_int8_cpu.h (whose scales, x blocks and epilogue it shares) before its VNNI panel, which takes the
// K-quants' scales from the gathers below.
//
// Why not the panel (which every format keeps past kRowWiseRows x rows): it transposes 16 rows' quants
// with AVX2 and stores them, then loads them back for each group of x rows; at a few x rows that transpose was most of
// the work. Here a block's transpose is 24 shuffles on vectors already loaded, and each x row costs its 8 vpdpbusd
// and the epilogue; one x row skips the transpose (its dots with the pairs, each row's lanes summed after).
//
// Why it gives the panel's bits (the spec's): a block's I and S are exact integers whatever order the products are
// summed in, and the float epilogue is the panel's, operation for operation, one output per lane, blocks in order.
//
// Glossary: a *pair* is one vector holding two weight rows' 32 quants of the same block, each made an unsigned byte
// (vpdpbusd multiplies unsigned bytes by signed ones) by adding kUnsignedOffset, taken off after as offset times the
// x block's sum. Its 128-bit lanes hold 16 quants each: [A 0-15, A 16-31, B 0-15, B 16-31] (rows A and B), or
// [A 0-15, B 0-15, A 16-31, B 16-31] for the nibble formats (kSplitHalves), whose byte j holds elements j and j + 16.
#pragma once

#if SPECDEC_CPU_X86

template <QuantType Q>
constexpr bool kSplitHalves = kSubBlocks<Q> == 1 && Q != QuantType::kQ8_0;

// _mm512_shuffle_i32x4's selectors that take, from two vectors in a pair's lane order (rows 0-7 in the first, 8-15 in
// the second), the lanes of rows 0-15's quants 0-15 (kFirstHalf) and 16-31 (kSecondHalf).
template <QuantType Q>
constexpr int kFirstHalf = kSplitHalves<Q> ? 0x44 : 0x88;
template <QuantType Q>
constexpr int kSecondHalf = kSplitHalves<Q> ? 0xee : 0xdd;

#define SPECDEC_QVNNI_INLINE SPECDEC_QVNNI __attribute__((always_inline)) inline

// 32 bytes at p (the low half) and 32 at p + stride (the high half).
SPECDEC_QVNNI_INLINE __m512i pair32(const uint8_t* p, int64_t stride) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + stride));
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

template <int Shift, int Mask>
SPECDEC_QVNNI_INLINE __m512i pair_field(const uint8_t* p, int64_t stride) {
  const __m512i v = Shift == 0 ? pair32(p, stride) : _mm512_srli_epi16(pair32(p, stride), Shift);
  return _mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(Mask)));
}

// The quants of sub-block S of the super-block at p (K-quants), or of the block at p, for the rows at p and
// p + stride, as unsigned bytes in the pair's order (int_quants' integers plus kUnsignedOffset).
template <QuantType Q, int S>
SPECDEC_QVNNI_INLINE __m512i pair_quants(const uint8_t* p, int64_t stride) {
  if constexpr (Q == QuantType::kQ8_0) {
    return _mm512_xor_si512(pair32(p + 2, stride), _mm512_set1_epi8(static_cast<char>(0x80)));
  } else if constexpr (kSubBlocks<Q> == 1) {  // Q4_0, Q4_1, Q5_0, Q5_1
    constexpr int64_t kQs = kBlockBytes<Q> - 16;
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kQs));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + stride + kQs));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(both), _mm256_srli_epi16(both, 4), 1);
    __m512i q = _mm512_and_si512(v, _mm512_set1_epi8(15));
    if constexpr (Q == QuantType::kQ5_0 || Q == QuantType::kQ5_1) {  // element i's fifth bit is bit i of qh
      constexpr int64_t kQh = Q == QuantType::kQ5_1 ? 4 : 2;
      uint32_t ha, hb;
      std::memcpy(&ha, p + kQh, 4);
      std::memcpy(&hb, p + stride + kQh, 4);
      const __mmask64 high = (uint64_t{ha} & 0xffff) | (uint64_t{hb} & 0xffff) << 16 | uint64_t{ha >> 16} << 32 |
                             uint64_t{hb >> 16} << 48;
      q = _mm512_mask_add_epi8(q, high, q, _mm512_set1_epi8(16));
    }
    return q;
  } else if constexpr (Q == QuantType::kQ2_K) {
    return pair_field<2 * (S % 4), 3>(p + 16 + 32 * (S / 4), stride);
  } else if constexpr (Q == QuantType::kQ3_K) {  // the low 2 bits, plus 4 where hmask's bit S is set
    const __m512i low = pair_field<2 * (S % 4), 3>(p + 32 + 32 * (S / 4), stride);
    const __mmask64 high = _mm512_test_epi8_mask(pair32(p, stride), _mm512_set1_epi8(static_cast<char>(1 << S)));
    return _mm512_mask_add_epi8(low, high, low, _mm512_set1_epi8(4));
  } else if constexpr (Q == QuantType::kQ4_K) {
    return pair_field<4 * (S % 2), 15>(p + 16 + 32 * (S / 2), stride);
  } else if constexpr (Q == QuantType::kQ5_K) {
    const __m512i low = pair_field<4 * (S % 2), 15>(p + 48 + 32 * (S / 2), stride);
    const __mmask64 high = _mm512_test_epi8_mask(pair32(p + 16, stride), _mm512_set1_epi8(static_cast<char>(1 << S)));
    return _mm512_mask_add_epi8(low, high, low, _mm512_set1_epi8(16));
  } else {
    static_assert(Q == QuantType::kQ6_K, "a format read row-wise");
    const __m512i low = pair_field<4 * ((S / 2) % 2), 15>(p + 64 * (S / 4) + 32 * (S % 2), stride);
    const __m512i high = pair_field<2 * (S % 4), 3>(p + 128 + 32 * (S / 4), stride);
    return _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
  }
}

// 8 vectors of 16 dwords -> each 128-bit lane's sum: lane L of vector j lands in dword j % 4 of lane L of out[j / 4].
SPECDEC_QVNNI_INLINE void lane_sums(const __m512i* d, __m512i* out) {
  __m512i s[4];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    s[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(d[2 * k], d[2 * k + 1]),
                            _mm512_unpackhi_epi32(d[2 * k], d[2 * k + 1]));
  }
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k) {
    out[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(s[2 * k], s[2 * k + 1]),
                              _mm512_unpackhi_epi64(s[2 * k], s[2 * k + 1]));
  }
}

// The 8 pairs' quants turned to VNNI's operand order in registers: out[j] holds dword j (quants 4j .. 4j + 3) of rows
// 0-15, lane r row r. Each 128-bit lane of 4 pairs is a 4 x 4 dword transpose (unpacks), then one shuffle per output
// takes its four lanes (rows 0-3, 4-7 from pairs 0-3; 8-11, 12-15 from pairs 4-7).
template <QuantType Q>
SPECDEC_QVNNI_INLINE void pairs_to_columns(const __m512i* q, __m512i* out) {
  __m512i t[8];
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {  // pairs 4h .. 4h + 3: t[4h + k] lane L = dword k of lane L of each pair
    const __m512i* p = q + 4 * h;
    const __m512i lo01 = _mm512_unpacklo_epi32(p[0], p[1]), hi01 = _mm512_unpackhi_epi32(p[0], p[1]);
    const __m512i lo23 = _mm512_unpacklo_epi32(p[2], p[3]), hi23 = _mm512_unpackhi_epi32(p[2], p[3]);
    t[4 * h] = _mm512_unpacklo_epi64(lo01, lo23), t[4 * h + 1] = _mm512_unpackhi_epi64(lo01, lo23);
    t[4 * h + 2] = _mm512_unpacklo_epi64(hi01, hi23), t[4 * h + 3] = _mm512_unpackhi_epi64(hi01, hi23);
  }
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    out[k] = _mm512_shuffle_i32x4(t[k], t[4 + k], kFirstHalf<Q>);
    out[4 + k] = _mm512_shuffle_i32x4(t[k], t[4 + k], kSecondHalf<Q>);
  }
}

// The float scales a, c and (Q2_K, Q3_K, Q6_K) the group scales and (Q2_K) minima of 16 rows' super-block or block,
// [sub-block or group][row]. Dead rows (past the matrix's end) read nothing and hold zeros.
struct Scales16 {
  __m512 a[8], c[8];
  __m512i sc[16], mn[16];
};

// Pair i holds rows pair_row(i) and pair_row(i) + 4, so that lane_sums' dwords and pairs_to_columns' lanes come out as
// rows 0-15 in order.
constexpr int pair_row(int i) { return i + 4 * (i / 4); }

// Row offsets for the gathers: lane r reads row r.
SPECDEC_QVNNI_INLINE __m512i row_offsets(int64_t row_bytes) {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(static_cast<int>(row_bytes)));
}

SPECDEC_QVNNI_INLINE __m512i gather16(__mmask16 live, __m512i offsets, const uint8_t* p) {
  return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets, p, 1);
}

SPECDEC_QVNNI_INLINE __m512 half_low(__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }

// The scales of 16 rows' super-block at p: int_scales' values (a = d sc and c = -(dmin mn) exact products; the group
// scales of Q2_K, Q3_K and Q6_K, Q2_K's minima), decoded 16 rows at a time from a few gathers of each row's bytes.
template <QuantType Q>
SPECDEC_QVNNI_INLINE void gather_k_scales(const uint8_t* p, __mmask16 live, __m512i offsets, Scales16& k) {
  if constexpr (Q == QuantType::kQ4_K || Q == QuantType::kQ5_K) {  // k4_scale_min's bit fields, 16 rows per lane
    const __m512i g0 = gather16(live, offsets, p), g1 = gather16(live, offsets, p + 4);
    const __m512i g2 = gather16(live, offsets, p + 8), g3 = gather16(live, offsets, p + 12);
    const __m512 d = half_low(g0), dmin = half_low(_mm512_srli_epi32(g0, 16));
    const __m512i bits6 = _mm512_set1_epi32(63), bits4 = _mm512_set1_epi32(15), bits2 = _mm512_set1_epi32(3);
    const __m512i sign = _mm512_set1_epi32(INT32_MIN);  // -(...): the sign bit flipped, as the scalar minus does
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      const int t = 8 * (s % 4);
      __m512i scale, min;
      if (s < 4) {
        scale = _mm512_and_si512(_mm512_srli_epi32(g1, t), bits6);
        min = _mm512_and_si512(_mm512_srli_epi32(g2, t), bits6);
      } else {
        const __m512i low = _mm512_srli_epi32(g3, t);
        scale = _mm512_or_si512(_mm512_and_si512(low, bits4),
                                _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(g1, t + 6), bits2), 4));
        min = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(low, 4), bits4),
                              _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(g2, t + 6), bits2), 4));
      }
      k.a[s] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(scale));
      k.c[s] = _mm512_castsi512_ps(
          _mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(min))), sign));
    }
  } else if constexpr (Q == QuantType::kQ2_K) {  // scales[16]: a group's scale in the low nibble, minimum high
    const __m512i dm = gather16(live, offsets, p + 80);
    const __m512 d = half_low(dm);
    const __m512 c = _mm512_castsi512_ps(  // -dmin: the sign bit flipped, as the scalar minus does
        _mm512_xor_si512(_mm512_castps_si512(half_low(_mm512_srli_epi32(dm, 16))), _mm512_set1_epi32(INT32_MIN)));
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) k.a[s] = d, k.c[s] = c;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i g = gather16(live, offsets, p + 4 * j);
#pragma GCC unroll 4
      for (int e = 0; e < 4; ++e) {
        const __m512i byte = _mm512_and_si512(_mm512_srli_epi32(g, 8 * e), _mm512_set1_epi32(255));
        k.sc[4 * j + e] = _mm512_and_si512(byte, _mm512_set1_epi32(15));
        k.mn[4 * j + e] = _mm512_srli_epi32(byte, 4);
      }
    }
  } else if constexpr (Q == QuantType::kQ3_K) {  // k3_scale's bit fields, 16 rows per lane
    const __m512 d = half_low(gather16(live, offsets, p + 108));
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) k.a[s] = d;
    const __m512i low[2] = {gather16(live, offsets, p + 96), gather16(live, offsets, p + 100)};
    const __m512i high = gather16(live, offsets, p + 104);
#pragma GCC unroll 16
    for (int g = 0; g < 16; ++g) {
      const __m512i l = _mm512_and_si512(_mm512_srli_epi32(low[(g % 8) / 4], 8 * (g % 4) + 4 * (g / 8)),
                                         _mm512_set1_epi32(15));
      const __m512i h = _mm512_and_si512(_mm512_srli_epi32(high, 8 * (g % 4) + 2 * (g / 4)), _mm512_set1_epi32(3));
      k.sc[g] = _mm512_sub_epi32(_mm512_or_si512(l, _mm512_slli_epi32(h, 4)), _mm512_set1_epi32(32));
    }
  } else {
    static_assert(Q == QuantType::kQ6_K, "a K-quant");
    const __m512 d = half_low(_mm512_srli_epi32(gather16(live, offsets, p + 206), 16));  // d: bytes 208-209
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) k.a[s] = d;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i g = gather16(live, offsets, p + 192 + 4 * j);
#pragma GCC unroll 4
      for (int e = 0; e < 4; ++e) k.sc[4 * j + e] = _mm512_srai_epi32(_mm512_slli_epi32(g, 24 - 8 * e), 24);
    }
  }
}

// The epilogue (int8_tile_vnni's, operation for operation) of x row m and block b, whose scales are k's entry s,
// for 16 weight rows (lane r row r): h0, h1 the rows' sums of (q + kOff) xq over quants 0-15 and 16-31 (where the
// format has one scale per block, any split of their total). Returns acc plus the block's term.
template <QuantType Q, int kOff = kUnsignedOffset<Q>>
SPECDEC_QVNNI_INLINE __m512 rows16_epilogue(const Int8Args& x, __m512i h0, __m512i h1, int64_t m, int64_t b,
                                            const Scales16& k, int s, __m512 acc) {
  const int64_t K = x.a->K;
  const int32_t* xs = x.x->xs.data() + m * (K / 16) + 2 * b;
  __m512i I;
  if constexpr (kGroupScales<Q>) {
    I = _mm512_add_epi32(_mm512_mullo_epi32(k.sc[2 * s], _mm512_sub_epi32(h0, _mm512_set1_epi32(kOff * xs[0]))),
                         _mm512_mullo_epi32(k.sc[2 * s + 1], _mm512_sub_epi32(h1, _mm512_set1_epi32(kOff * xs[1]))));
  } else {
    I = _mm512_add_epi32(h0, h1);
  }
  __m512 fI = _mm512_cvtepi32_ps(I);
  if constexpr (!kGroupScales<Q> && kOff != 0) {  // the offset taken off in float (int8_epilogue_avx2's rule)
    fI = _mm512_fnmadd_ps(_mm512_set1_ps(kOff), _mm512_set1_ps(x.x->sum[m * (K / 32) + b]), fI);
  }
  __m512 u = rounded(_mm512_mul_ps(k.a[s], fI));
  if constexpr (kIntMin<Q> && kGroupScales<Q>) {  // Q2_K: S = mn0 xs0 + mn1 xs1
    const __m512i S = _mm512_add_epi32(_mm512_mullo_epi32(k.mn[2 * s], _mm512_set1_epi32(xs[0])),
                                       _mm512_mullo_epi32(k.mn[2 * s + 1], _mm512_set1_epi32(xs[1])));
    u = _mm512_add_ps(u, rounded(_mm512_mul_ps(k.c[s], _mm512_cvtepi32_ps(S))));
  } else if constexpr (kIntMin<Q>) {
    const __m512 sum = _mm512_set1_ps(x.x->sum[m * (K / 32) + b]);  // S: the other formats' mn is 1
    u = _mm512_add_ps(u, rounded(_mm512_mul_ps(k.c[s], sum)));
  }
  return _mm512_add_ps(acc, rounded(_mm512_mul_ps(_mm512_set1_ps(x.x->dx[m * (K / 32) + b]), u)));
}

// What one block step reads: the 8 pairs' row pointers (at the block or super-block) and second rows' distances.
struct PairRows {
  const uint8_t* p[8];
  int64_t stride[8];
};

// A tile of 16 weight rows from n0 (`rows` live): where it starts, its pairs, and its scale gathers' lanes and
// offsets.
struct TileReads {
  const uint8_t* base;
  PairRows pr;
  __mmask16 live;
  __m512i offsets;
};

SPECDEC_QVNNI_INLINE TileReads tile_reads(const QuantArgs& a, int64_t n0, int64_t rows) {
  TileReads t;
  t.base = a.w + n0 * a.row_bytes;
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // a dead row reads the last live one (its lanes are never stored)
    const int64_t r0 = std::min<int64_t>(pair_row(i), rows - 1), r1 = std::min<int64_t>(pair_row(i) + 4, rows - 1);
    t.pr.p[i] = t.base + r0 * a.row_bytes, t.pr.stride[i] = (r1 - r0) * a.row_bytes;
  }
  t.live = static_cast<__mmask16>((1u << rows) - 1);
  t.offsets = row_offsets(a.row_bytes);
  return t;
}

// The scales of the block at byte `off` of a tile's rows (a format of one scale per block) into k's entry s: d, and
// m where the format has a minimum, each converted as F16C's scalar conversion does.
template <QuantType Q>
SPECDEC_QVNNI_INLINE void gather_block_scales(const TileReads& t, int64_t off, int s, Scales16& k) {
  const __m512i v = gather16(t.live, t.offsets, t.base + off);
  k.a[s] = half_low(v);
  if constexpr (kIntMin<Q>) k.c[s] = half_low(_mm512_srli_epi32(v, 16));
}

// The panel's scales of every format, 16 rows per gather instead of row by row (at M = 1 the per-row conversions and
// stores were the panel's largest cost): a run of 8 blocks at a time, a K-quant's super-block.
template <QuantType Q>
SPECDEC_QVNNI void gather_panel_scales(const QuantArgs& a, int64_t n0, int64_t rows, Panel<16>& p) {
  const TileReads t = tile_reads(a, n0, rows);
  const int64_t blocks = a.K / 32;
  Scales16 k;
  for (int64_t b0 = 0; b0 < blocks; b0 += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, blocks - b0));
    if constexpr (kSubBlocks<Q> == 1) {
      for (int s = 0; s < n; ++s) gather_block_scales<Q>(t, (b0 + s) * kBlockBytes<Q>, s, k);
    } else {
      gather_k_scales<Q>(t.base + b0 / 8 * kBlockBytes<Q>, t.live, t.offsets, k);
    }
    for (int s = 0; s < n; ++s) {
      const int64_t b = b0 + s;
      _mm512_storeu_ps(p.a.data() + b * 16, k.a[s]);
      if constexpr (kIntMin<Q>) _mm512_storeu_ps(p.c.data() + b * 16, k.c[s]);
      if constexpr (kGroupScales<Q>) {
        _mm512_storeu_si512(p.sc.data() + b * 32, k.sc[2 * s]);
        _mm512_storeu_si512(p.sc.data() + b * 32 + 16, k.sc[2 * s + 1]);
      }
      if constexpr (kGroupScales<Q> && kIntMin<Q>) {  // Q2_K
        _mm512_storeu_si512(p.mn.data() + b * 32, k.mn[2 * s]);
        _mm512_storeu_si512(p.mn.data() + b * 32 + 16, k.mn[2 * s + 1]);
      }
    }
  }
}

// One block (sub-block S of a K-quant super-block) of 16 rows times MB x rows from m0, b the block's index in the
// row: each x row's dots with the pairs' columns (or with the pairs, summed per row), then the panel's epilogue
// (int8_tile_vnni) into acc.
template <QuantType Q, int S, int MB>
SPECDEC_QVNNI_INLINE void rows16_block(const Int8Args& x, const PairRows& pr, int64_t off, int64_t b, int64_t m0,
                                       const Scales16& k, __m512* acc) {
  const QuantArgs& a = *x.a;
  // one x row: its dots with the pairs, summed per row after, cost less than turning the pairs into columns first
  constexpr bool kColumns = MB > 1;
  __m512i q[8], w[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) q[i] = pair_quants<Q, S>(pr.p[i] + off, pr.stride[i]);
  if constexpr (kColumns) pairs_to_columns<Q>(q, w);
  constexpr int kS = kSubBlocks<Q> == 1 ? 0 : S;
#pragma GCC unroll 8
  for (int r = 0; r < MB; ++r) {
    const int8_t* xq = x.x->xq.data() + (m0 + r) * a.K + b * 32;
    __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512();  // rows 0-15's sums of quants 0-15, 16-31
    if constexpr (kColumns) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        h0 = dpbusd_dword(h0, w[j], xq + 4 * j);
        h1 = dpbusd_dword(h1, w[4 + j], xq + 16 + 4 * j);
      }
    } else {
      __m512i xb = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
      if constexpr (kSplitHalves<Q>) xb = _mm512_shuffle_i64x2(xb, xb, 0x50);  // [0-15, 0-15, 16-31, 16-31]
      __m512i d[8], sums[2];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) d[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[i], xb);
      lane_sums(d, sums);
      // rows 0-15 of each half: lanes (A, B) of pairs 0-3, then of pairs 4-7
      h0 = _mm512_shuffle_i32x4(sums[0], sums[1], kFirstHalf<Q>);
      h1 = _mm512_shuffle_i32x4(sums[0], sums[1], kSecondHalf<Q>);
    }
    acc[r] = rows16_epilogue<Q>(x, h0, h1, m0 + r, b, k, kS, acc[r]);
  }
}

// How far ahead of its reads a tile prefetches, in bytes along each row: a few K-quant super-blocks.
constexpr int64_t kAheadBytes = 512;
constexpr int64_t kShortRowBytes = 2 * kAheadBytes;

// A tile of 16 weight rows at `tile` (`rows` live), read a block or super-block of Q at a time, now at byte `at`
// of each row: prefetches the lines of the block kAheadBytes further along rows r0 .. r1 - 1 (twice that into L2
// where prefetch_to_l2) or, past the rows' end, along the next tile's rows (which follow in memory) where `more` says
// this thread reads that tile next. Each row is one stream kept ahead at the reads' own pace, on into the next tile:
// 16 rows read side by side are more streams than the hardware prefetchers follow, and pulling in the next tile in
// bursts stalls the reads behind the prefetches (bench/RESULTS.md). A super-block's step spreads its rows over its
// sub-blocks (prefetch_part). Rows of at most kShortRowBytes (SmolLM2's 576-wide ones) are too short for a stream per
// row to run ahead: there the next tile, contiguous, is one stream, each step pulling in as large a share of it as
// the step reads of this tile (rows r0 .. r1 - 1's share).
template <QuantType Q>
SPECDEC_QVNNI_INLINE void prefetch_ahead(const uint8_t* tile, int64_t row_bytes, int64_t at, int64_t rows, bool more,
                                         int r0 = 0, int r1 = 16) {
  constexpr bool l2 = prefetch_to_l2<Q>();
  if (rows < 16) return;
  if (row_bytes <= kShortRowBytes) {
    if (!more) return;
    const uintptr_t next = reinterpret_cast<uintptr_t>(tile) + 16 * (row_bytes + at);
    simd::prefetch_lines(next + r0 * kBlockBytes<Q>, next + r1 * kBlockBytes<Q>, l2);
    return;
  }
  int64_t ahead = at + (l2 ? 2 * kAheadBytes : kAheadBytes);
  if (ahead >= row_bytes) {  // (still within the next tile's rows: they are longer than the distance)
    if (!more) return;
    tile += 16 * row_bytes, ahead -= row_bytes;
  }
  const uint8_t* p = tile + ahead + r0 * row_bytes;
  for (int r = r0; r < r1; ++r, p += row_bytes) {
    simd::prefetch_lines(reinterpret_cast<uintptr_t>(p), reinterpret_cast<uintptr_t>(p) + kBlockBytes<Q>, l2);
  }
}

// Sub-block S's share of a K-quant step's prefetch_ahead: 2 of the 16 rows, issued beside that sub-block's work. One
// burst of all 16 rows' lines per super-block stalled the step's reads behind them (bench/RESULTS.md).
template <QuantType Q, int S>
SPECDEC_QVNNI_INLINE void prefetch_part(const uint8_t* tile, int64_t row_bytes, int64_t at, int64_t rows, bool more) {
  static_assert(kSubBlocks<Q> == 8 && S < 8, "a K-quant super-block's sub-block");
  prefetch_ahead<Q>(tile, row_bytes, at, rows, more, 2 * S, 2 * S + 2);
}

// Rows n0 .. n0 + rows - 1 (rows <= 16) times x rows m0 .. m0 + MB - 1; `more`: this thread's next tile follows.
template <QuantType Q, int MB>
SPECDEC_QVNNI void rows16_vnni(const Int8Args& x, int64_t n0, int64_t rows, int64_t m0, bool more) {
  const QuantArgs& a = *x.a;
  const int64_t blocks = a.K / 32;
  const TileReads t = tile_reads(a, n0, rows);
  const uint8_t* const base = t.base;
  const PairRows& pr = t.pr;
  __m512 acc[MB];
#pragma GCC unroll 8
  for (int r = 0; r < MB; ++r) acc[r] = _mm512_setzero_ps();
  Scales16 k;
  if constexpr (kSubBlocks<Q> == 1) {
    for (int64_t b = 0; b < blocks; ++b) {
      prefetch_ahead<Q>(base, a.row_bytes, b * kBlockBytes<Q>, rows, more);
      gather_block_scales<Q>(t, b * kBlockBytes<Q>, 0, k);
      rows16_block<Q, 0, MB>(x, pr, b * kBlockBytes<Q>, b, m0, k, acc);
    }
  } else {
    for (int64_t sb = 0; sb < blocks / 8; ++sb) {
      const int64_t off = sb * kBlockBytes<Q>;
      gather_k_scales<Q>(base + off, t.live, t.offsets, k);
      prefetch_part<Q, 0>(base, a.row_bytes, off, rows, more);
      rows16_block<Q, 0, MB>(x, pr, off, 8 * sb, m0, k, acc);
      prefetch_part<Q, 1>(base, a.row_bytes, off, rows, more);
      rows16_block<Q, 1, MB>(x, pr, off, 8 * sb + 1, m0, k, acc);
      prefetch_part<Q, 2>(base, a.row_bytes, off, rows, more);
      rows16_block<Q, 2, MB>(x, pr, off, 8 * sb + 2, m0, k, acc);
      prefetch_part<Q, 3>(base, a.row_bytes, off, rows, more);
      rows16_block<Q, 3, MB>(x, pr, off, 8 * sb + 3, m0, k, acc);
      prefetch_part<Q, 4>(base, a.row_bytes, off, rows, more);
      rows16_block<Q, 4, MB>(x, pr, off, 8 * sb + 4, m0, k, acc);
      prefetch_part<Q, 5>(base, a.row_bytes, off, rows, more);
      rows16_block<Q, 5, MB>(x, pr, off, 8 * sb + 5, m0, k, acc);
      prefetch_part<Q, 6>(base, a.row_bytes, off, rows, more);
      rows16_block<Q, 6, MB>(x, pr, off, 8 * sb + 6, m0, k, acc);
      prefetch_part<Q, 7>(base, a.row_bytes, off, rows, more);
      rows16_block<Q, 7, MB>(x, pr, off, 8 * sb + 7, m0, k, acc);
    }
  }
  for (int r = 0; r < MB; ++r) store_lanes(a, m0 + r, n0, rows, acc[r]);
}

// x rows per pass over a tile: their accumulators, the pairs and their columns fit the 32 registers. More x rows take
// further passes over the same tile, read from the cache.
constexpr int kPassRows = 8;

// Up to this many x rows (decoding, a verify, a short prefill chunk) take the row-wise kernel; past it the panel,
// whose one transpose per tile serves every x row, costs less than a pass's transposes (bench/RESULTS.md).
constexpr int64_t kRowWiseRows = 32;

// rows16_vnni for x rows m0 .. min(M, m0 + kPassRows) - 1: MB counts up to their number.
template <QuantType Q, int MB = 1>
void rows16_pass(const Int8Args& x, int64_t n0, int64_t rows, int64_t m0, bool more) {
  if constexpr (MB < kPassRows) {
    if (x.a->M - m0 > MB) return rows16_pass<Q, MB + 1>(x, n0, rows, m0, more);
  }
  rows16_vnni<Q, MB>(x, n0, rows, m0, more);
}

// Sub-block S of the super-block at `off` (or the block there) of a tile's 16 rows as VNNI's columns (w [8]).
template <QuantType Q, int S>
SPECDEC_QVNNI_INLINE void decode_columns(const PairRows& pr, int64_t off, __m512i* w) {
  __m512i q[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) q[i] = pair_quants<Q, S>(pr.p[i] + off, pr.stride[i]);
  pairs_to_columns<Q>(q, w);
}

// x rows m0 .. m0 + MB - 1 times one step's decoded columns (cols [kStepBlocks][8], blocks from b0): rows16_block's
// dots and epilogue, the rows' accumulators read from and written back to acc [MB].
template <QuantType Q, int MB>
SPECDEC_QVNNI void columns_pass(const Int8Args& x, const __m512i (*cols)[8], int64_t b0, int64_t m0,
                                const Scales16& k, __m512* acc) {
  const int64_t K = x.a->K;
  __m512 sum[MB];
#pragma GCC unroll 8
  for (int r = 0; r < MB; ++r) sum[r] = acc[r];
  for (int s = 0; s < kStepBlocks<Q>; ++s) {
#pragma GCC unroll 8
    for (int r = 0; r < MB; ++r) {
      const int8_t* xq = x.x->xq.data() + (m0 + r) * K + (b0 + s) * 32;
      __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512();  // rows 0-15's sums of quants 0-15, 16-31
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        h0 = dpbusd_dword(h0, cols[s][j], xq + 4 * j);
        h1 = dpbusd_dword(h1, cols[s][4 + j], xq + 16 + 4 * j);
      }
      sum[r] = rows16_epilogue<Q>(x, h0, h1, m0 + r, b0 + s, k, s, sum[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MB; ++r) acc[r] = sum[r];
}

// Rows n0 .. n0 + rows - 1 (rows <= 16) times every x row, past one pass (kPassRows < M <= kRowWiseRows): each step's
// columns decoded once for all the passes, which rows16_pass would decode again for each (the passes' accumulators
// wait in memory between steps). The same dots and epilogue, so the same bits.
template <QuantType Q>
SPECDEC_QVNNI void rows16_passes(const Int8Args& x, int64_t n0, int64_t rows, bool more) {
  const QuantArgs& a = *x.a;
  const int64_t M = a.M;
  const TileReads t = tile_reads(a, n0, rows);
  __m512i cols[kStepBlocks<Q>][8];
  __m512 acc[kRowWiseRows];
  for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  Scales16 k;
  for (int64_t b0 = 0; b0 < a.K / 32; b0 += kStepBlocks<Q>) {
    const int64_t off = b0 / kStepBlocks<Q> * kBlockBytes<Q>;  // the step's block or super-block
    if constexpr (kStepBlocks<Q> == 1) {
      prefetch_ahead<Q>(t.base, a.row_bytes, off, rows, more);
      gather_block_scales<Q>(t, off, 0, k);
      decode_columns<Q, 0>(t.pr, off, cols[0]);
    } else {
      gather_k_scales<Q>(t.base + off, t.live, t.offsets, k);
      prefetch_part<Q, 0>(t.base, a.row_bytes, off, rows, more), decode_columns<Q, 0>(t.pr, off, cols[0]);
      prefetch_part<Q, 1>(t.base, a.row_bytes, off, rows, more), decode_columns<Q, 1>(t.pr, off, cols[1]);
      prefetch_part<Q, 2>(t.base, a.row_bytes, off, rows, more), decode_columns<Q, 2>(t.pr, off, cols[2]);
      prefetch_part<Q, 3>(t.base, a.row_bytes, off, rows, more), decode_columns<Q, 3>(t.pr, off, cols[3]);
      prefetch_part<Q, 4>(t.base, a.row_bytes, off, rows, more), decode_columns<Q, 4>(t.pr, off, cols[4]);
      prefetch_part<Q, 5>(t.base, a.row_bytes, off, rows, more), decode_columns<Q, 5>(t.pr, off, cols[5]);
      prefetch_part<Q, 6>(t.base, a.row_bytes, off, rows, more), decode_columns<Q, 6>(t.pr, off, cols[6]);
      prefetch_part<Q, 7>(t.base, a.row_bytes, off, rows, more), decode_columns<Q, 7>(t.pr, off, cols[7]);
    }
    for (int64_t m0 = 0; m0 < M; m0 += kPassRows) {
      __m512* pass = acc + m0;
      switch (std::min<int64_t>(kPassRows, M - m0)) {
        case 1: columns_pass<Q, 1>(x, cols, b0, m0, k, pass); break;
        case 2: columns_pass<Q, 2>(x, cols, b0, m0, k, pass); break;
        case 3: columns_pass<Q, 3>(x, cols, b0, m0, k, pass); break;
        case 4: columns_pass<Q, 4>(x, cols, b0, m0, k, pass); break;
        case 5: columns_pass<Q, 5>(x, cols, b0, m0, k, pass); break;
        case 6: columns_pass<Q, 6>(x, cols, b0, m0, k, pass); break;
        case 7: columns_pass<Q, 7>(x, cols, b0, m0, k, pass); break;
        default: columns_pass<Q, 8>(x, cols, b0, m0, k, pass); break;
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) store_lanes(a, m, n0, rows, acc[m]);
}

template <QuantType Q>
void int8_rowwise_vnni(const Int8Args& x, int64_t n_begin, int64_t n_end) {
  for (int64_t n0 = n_begin; n0 < n_end; n0 += 16) {
    const int64_t rows = std::min<int64_t>(16, n_end - n0);
    const bool more = n0 + 16 < n_end;  // this thread reads the next tile too
    if (x.a->M > kPassRows) {
      rows16_passes<Q>(x, n0, rows, more);
      continue;
    }
    rows16_pass<Q>(x, n0, rows, 0, more);
  }
}

// quantize_rows with AVX2: the same operations lane by lane (a max is exact, the division and the product round
// once, cvtps rounds half to even as nearbyint does), so the same bits. The max and clamp keep their operands in
// std::max / std::min's order, and a NaN's quant is zeroed as the scalar cast leaves it, so even a NaN in x agrees.
SPECDEC_QAVX2 void quantize_rows_avx2(const float* x, int64_t ldx, int64_t M, int64_t K, Int8Rows& r) {
  r.xq.resize(static_cast<size_t>(M * K));
  r.dx.resize(static_cast<size_t>(M * K / 32));
  r.xs.resize(static_cast<size_t>(M * K / 16));
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < K / 32; ++b) {
      const float* v = x + m * ldx + b * 32;
      __m256 f[4], amax = _mm256_setzero_ps();
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        f[i] = _mm256_loadu_ps(v + 8 * i);
        amax = _mm256_max_ps(_mm256_and_ps(f[i], magnitude), amax);
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
      const float d = _mm_cvtss_f32(h) / 127.f;
      const __m256 inv = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
      __m256i q[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m256 s = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(f[i], inv)));
        q[i] = _mm256_andnot_si256(_mm256_castps_si256(_mm256_cmp_ps(s, s, _CMP_UNORD_Q)), _mm256_cvtps_epi32(s));
      }
      // int32 -> int8 (no value saturates): the packs interleave 128-bit lanes, the permutation puts them back
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.xq.data() + m * K + b * 32),
                          _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      r.dx[m * (K / 32) + b] = d;
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        const __m256i s8 = _mm256_add_epi32(q[2 * half], q[2 * half + 1]);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        r.xs[m * (K / 16) + 2 * b + half] = _mm_cvtsi128_si32(s4);
      }
    }
  }
}

#undef SPECDEC_QVNNI_INLINE

#endif  // SPECDEC_CPU_X86
