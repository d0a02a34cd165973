// The K-quants' bfloat16 path on AMX tiles, a section of csrc/quant_linear_cpu.cpp kept in its own file: included
// there inside its anonymous namespace, after QuantArgs and the block decoders, and only where the compiler has the AMX
// intrinsics (SPECDEC_CPU_AMX).
//
// A K-quant weight is w = scale_g q + shift_g: q a small integer, scale_g and shift_g one float per *group* of 32
// weights (Q4_K, Q5_K) or 16 (Q2_K, Q3_K, Q6_K). So a row of x times a group is
//   scale_g (sum_e x_e q_e) + shift_g (sum_e x_e),
// and every q (at most 6 bits and a sign) is a bfloat16 exactly, as is x. One tdpbf16ps multiplies 16 weight rows'
// quants of a group by the group's x elements for 16 x rows at once (each product exact in float32), and the float32
// epilogue adds each group's two terms in group order, one FMA each:
//   acc = fma(scale_g, dot_g, acc); acc = fma(shift_g, xsum_g, acc)     (g = 0, 1, ... along K)
// where dot_g is the tile's sum of the group's products and xsum_g the x row's own sum over the group (a fixed
// vector reduction). What rounds differs from the float path's (linear on the dequantized matrix): the group's
// products are summed before the scale multiplies them. It stays batch-invariant: an output's dot_g reads its own x
// row and weight row only, its epilogue runs in group order whatever M is, and x rows past M are zeros that only
// their own (unstored) outputs see. A process runs it for every M once it runs at all (quant_tiles), so a tree node's
// logits are still plain decoding's bit for bit. Float32 x keeps the float path (the dequantized model's logits
// exactly).
//
// Why: the float path pays one float32 FMA per 16 weights and x row; a tile pays one instruction per 16 x 16 outputs
// and 16 or 32 weights, so a verify pass of up to 16 rows costs about what one row costs, and a prompt's chunk a
// fraction of the float path's. What it costs: each 16-row block's quants are first written out as bfloat16 (the
// panel) and each group's 16 x 16 sums pass through memory to the epilogue, both paid whatever M is, so one decoding
// row is slower than on the float path (why quant_tiles is opt-in).
#pragma once

#define SPECDEC_QAMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c,amx-tile,amx-bf16")))

template <QuantType Q>
constexpr int kGroup = kPerSubBlock<Q> ? 32 : 16;

// Tiles: 0-1 two groups' quants (16 weight rows each), 2-3 their x elements (16 x rows), 4-5 and 6-7 two pairs'
// dot products.
// A 16-weight group takes half a sub-block's row of quants (32 bytes) and half a packed x block (8 k-pair rows).
SPECDEC_QAMX inline void configure_group_tiles(int group) {
  amx::TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  if (group == 16) c.colsb[0] = c.colsb[1] = 32, c.rows[2] = c.rows[3] = 8;
  _tile_loadconfig(&c);
}

// One weight-row block's panel: quants [K / 32][16 rows][32] (bfloat16 bits, in each row's k order) and each
// super-block's scales [K / 256][16 rows]; rows past the block's end zeros.
struct GroupPanel {
  std::vector<uint16_t> quants;
  std::vector<KScales> scales;
};

// bfloat16 bits of the integers -32 .. 31: a quant's value by one permute of its 6-bit field.
inline const uint16_t* bf16_of_small_ints() {
  alignas(64) static const auto table = [] {
    std::array<uint16_t, 64> t{};
    for (int i = 0; i < 64; ++i) t[i] = c10::BFloat16(static_cast<float>(i - 32)).x;
    return t;
  }();
  return table.data();
}

// 32 bytes from p as words, then (v >> shift) & mask.
SPECDEC_QAMX inline __m512i words32(const uint8_t* p, int shift, int mask) {
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_and_si512(_mm512_srlv_epi16(v, _mm512_set1_epi16(static_cast<short>(shift))),
                          _mm512_set1_epi16(static_cast<short>(mask)));
}

// K-quant sub-block s of super-block sb as 32 bfloat16 (k_quant's values): the quant fields as words, then their
// values from the table's halves lo, hi (Q4_K, Q5_K, Q6_K); the other K-quants through float32.
template <QuantType Q>
SPECDEC_QAMX inline __m512i quants_bf16(const uint8_t* sb, int s, __m512i lo, __m512i hi) {
  if constexpr (Q == QuantType::kQ4_K) {
    return _mm512_permutexvar_epi16(words32(sb + 16 + 32 * (s / 2), 4 * (s % 2), 15), hi);  // hi[i]: i
  } else if constexpr (Q == QuantType::kQ5_K) {
    const __m512i low = words32(sb + 48 + 32 * (s / 2), 4 * (s % 2), 15);
    const __mmask32 high = _mm256_test_epi8_mask(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16)),
                                                 _mm256_set1_epi8(static_cast<char>(1 << s)));
    return _mm512_permutexvar_epi16(_mm512_mask_add_epi16(low, high, low, _mm512_set1_epi16(16)), hi);
  } else if constexpr (Q == QuantType::kQ6_K) {
    const __m512i low = words32(sb + 64 * (s / 4) + 32 * (s % 2), 4 * ((s / 2) % 2), 15);
    const __m512i high = _mm512_slli_epi16(words32(sb + 128 + 32 * (s / 4), 2 * (s % 4), 3), 4);
    return _mm512_permutex2var_epi16(lo, _mm512_or_si512(low, high), hi);  // q - 32
  } else {
    const __m512 q0 = _mm512_cvtepi32_ps(k_quant16<Q>(sb, s, 0)), q1 = _mm512_cvtepi32_ps(k_quant16<Q>(sb, s, 16));
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(q1, q0));
  }
}

template <QuantType Q>
SPECDEC_QAMX void build_group_panel(const QuantArgs& a, int64_t n0, int rows, GroupPanel& p) {
  const int64_t blocks = a.K / 32;
  p.quants.resize(static_cast<size_t>(blocks * 16 * 32));
  p.scales.resize(static_cast<size_t>(blocks / 8 * 16));
  uint16_t* quants = p.quants.data();
  KScales* scales = p.scales.data();
  const __m512i lo = _mm512_loadu_si512(bf16_of_small_ints()), hi = _mm512_loadu_si512(bf16_of_small_ints() + 32);
  for (int r = 0; r < rows; ++r) {
    const uint8_t* row = a.w + (n0 + r) * a.row_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      if (b % 8 == 0) load_row_scales_avx2<Q>(row, b, scales[b / 8 * 16 + r]);
      const __m512i q = quants_bf16<Q>(row + b / 8 * kBlockBytes<Q>, static_cast<int>(b % 8), lo, hi);
      _mm512_storeu_si512(quants + (b * 16 + r) * 32, q);
    }
  }
  for (int r = rows; r < 16; ++r) {  // N's tail: zero rows, whose sums are not stored
    for (int64_t b = 0; b < blocks; ++b) _mm512_storeu_si512(quants + (b * 16 + r) * 32, _mm512_setzero_si512());
    for (int64_t sb = 0; sb < blocks / 8; ++sb) scales[sb * 16 + r] = KScales{};
  }
}

SPECDEC_QAMX inline __m512 widen_bf16(const uint16_t* p) {  // 16 bfloat16 as float32
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// xsum [ceil(M / 16)][K / G][16]: x row m's sum over each group (widened to float32, lane-wise halves then
// _mm512_reduce_add_ps: one fixed order), zeros past M.
template <int G>
SPECDEC_QAMX void group_sums(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, std::vector<float>& xsum) {
  const int64_t groups = K / G;
  xsum.assign(static_cast<size_t>((M + 15) / 16 * groups * 16), 0.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* v = x + m * ldx + g * G;
      const __m512 sum = G == 32 ? _mm512_add_ps(widen_bf16(v), widen_bf16(v + 16)) : widen_bf16(v);
      xsum[(m / 16 * groups + g) * 16 + m % 16] = _mm512_reduce_add_ps(sum);
    }
  }
}

// Groups g, g + 1 of one 16-row weight block and 16 x rows into sum tiles C, C + 1 (tiles 0-3 their operands).
template <int C, int kPerSub>
SPECDEC_QAMX inline void group_dots(const uint16_t* quants, const uint32_t* xb, int64_t g) {
  _tile_loadd(0, quants + g / kPerSub * 512 + g % kPerSub * 16, 64);
  _tile_loadd(2, xb + g / kPerSub * amx::kXBlock + g % kPerSub * 128, 64);
  _tile_loadd(1, quants + (g + 1) / kPerSub * 512 + (g + 1) % kPerSub * 16, 64);
  _tile_loadd(3, xb + (g + 1) / kPerSub * amx::kXBlock + (g + 1) % kPerSub * 128, 64);
  if constexpr (C == 4) {  // the tile macros take literal register numbers
    _tile_zero(4);
    _tile_zero(5);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 1, 3);
  } else {
    _tile_zero(6);
    _tile_zero(7);
    _tile_dpbf16ps(6, 0, 2);
    _tile_dpbf16ps(7, 1, 3);
  }
}

// Weight rows [n_begin, n_end) of x (bfloat16 bits, row stride ldx) into a.sums, 16 at a time: each block's panel
// built once, then every 16 x rows' sums in registers (acc[r] lane c: x row m0 + c, weight row n0 + r). Two pairs of
// groups in flight: the tiles compute pair p + 1 while the vector units add pair p's dot products.
template <QuantType Q>
SPECDEC_QAMX void rows_amx_groups(const QuantArgs& a, const uint16_t* x, int64_t ldx, int64_t n_begin,
                                  int64_t n_end) {
  constexpr int G = kGroup<Q>, kPerSub = 32 / G, kPerSuper = 256 / G;
  const int64_t kblocks = a.K / 32, groups = a.K / G, mblocks = (a.M + 15) / 16;
  thread_local std::vector<uint32_t> packed_;  // [mblocks][kblocks][16 pairs][16 x rows]
  packed_.resize(static_cast<size_t>(mblocks * kblocks * amx::kXBlock));
  amx::pack_x_pairs(x, ldx, a.M, a.K, packed_.data());
  thread_local std::vector<float> xsum_;
  if constexpr (kHasShift<Q>) group_sums<G>(x, ldx, a.M, a.K, xsum_);
  thread_local GroupPanel panel;
  const uint32_t* packed = packed_.data();
  const float* xsum = xsum_.data();
  configure_group_tiles(G);
  alignas(64) float dots[2][2][256];  // [pair parity][group of the pair][16 weight rows x 16 x rows]
  for (int64_t n0 = n_begin; n0 < n_end; n0 += 16) {
    const int rows = static_cast<int>(std::min<int64_t>(16, n_end - n0));
    build_group_panel<Q>(a, n0, rows, panel);
    const uint16_t* quants = panel.quants.data();
    const KScales* scales = panel.scales.data();
    for (int64_t mb = 0; mb < mblocks; ++mb) {
      __m512 acc[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
      const uint32_t* xb = packed + mb * kblocks * amx::kXBlock;
      const float* xs_row = xsum + mb * groups * 16;
      auto add_pair = [&](int64_t g, const float (*d)[256]) SPECDEC_QAMX {
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const KScales* k = scales + (g + h) / kPerSuper * 16;  // [16 rows]
          const int j = static_cast<int>((g + h) % kPerSuper);
          const __m512 xs = kHasShift<Q> ? _mm512_loadu_ps(xs_row + (g + h) * 16) : __m512{};
#pragma GCC unroll 16
          for (int r = 0; r < 16; ++r) {
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(k[r].scale[j]), _mm512_load_ps(d[h] + 16 * r), acc[r]);
            if constexpr (kHasShift<Q>) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(k[r].shift[j]), xs, acc[r]);
          }
        }
      };
      // groups is a multiple of 8 (K of whole super-blocks): pairs come in twos
      group_dots<4, kPerSub>(quants, xb, 0);
      _tile_stored(4, dots[0][0], 64);
      _tile_stored(5, dots[0][1], 64);
      for (int64_t g = 0; g < groups; g += 4) {
        group_dots<6, kPerSub>(quants, xb, g + 2);
        add_pair(g, dots[0]);
        _tile_stored(6, dots[1][0], 64);
        _tile_stored(7, dots[1][1], 64);
        if (g + 4 < groups) group_dots<4, kPerSub>(quants, xb, g + 4);
        add_pair(g + 2, dots[1]);
        if (g + 4 < groups) {
          _tile_stored(4, dots[0][0], 64);
          _tile_stored(5, dots[0][1], 64);
        }
      }
      simd::transpose16(acc);  // acc[c] lane r: x row mb * 16 + c, weight row n0 + r
      const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
      const int64_t count = std::min<int64_t>(16, a.M - mb * 16);
      for (int64_t c = 0; c < count; ++c) {
        _mm512_mask_storeu_ps(a.sums + (mb * 16 + c) * a.ldo + (n0 - a.n0), mask, acc[c]);
      }
    }
  }
  _tile_release();
}
