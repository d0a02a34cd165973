// The 8-bit activation path's AVX2 kernels: vpmaddubsw / vpmaddwd dot products of 8 weight rows at a time with each x
// row's int8 block, then csrc/quant_int8_cpu.h's epilogue on 8 lanes. Two kernels: a panel tile past
// kAvx2RowWiseRows x rows, the row-wise kernel up to it (decoding, short verifies); int8_rows_avx2 chooses. A section
// of csrc/quant_linear_cpu.cpp, included by csrc/quant_int8_cpu.h after its panel (Panel<8>, fill_panel,
// fill_panel_scales), which these kernels read, and before the VNNI kernels.
#pragma once

#if SPECDEC_CPU_X86

inline int32_t dword_at(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// maddubs: int16 lane i of the result sums q's bytes 2i, 2i + 1 times xq's (q: int_quants plus kAvx2Offset<Q>).
template <QuantType Q>
SPECDEC_QAVX2 inline __m256i dot16_avx2(__m256i q, __m256i xq) {
  if constexpr (Q == QuantType::kQ8_0) {
    return _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(xq, q));
  } else {
    return _mm256_maddubs_epi16(q, xq);
  }
}

// vpmaddwd by ones: dword j sums int16 lanes 2j and 2j + 1.
SPECDEC_QAVX2 inline __m256i widen16(__m256i v) { return _mm256_madd_epi16(v, _mm256_set1_epi16(1)); }

// The AVX2 epilogue of block b for an x block (its two 16-element sums xs[0], xs[1], their total `sum` as a float and
// its scale dx) on 8 weight rows (lane i: row i), from the integer sums of each row's elements 0-15 (half0) and 16-31
// (half1) with their quants plus kAvx2Offset<Q>: that offset times the x sums taken off (int_quants' sums), then the
// panel's scales; shared by the panel's tile and the row-wise kernel.
template <QuantType Q>
SPECDEC_QAVX2 inline __m256 int8_epilogue_avx2(const Panel<8>& p, int64_t b, const int32_t* xs, float sum, float dx,
                                               __m256i half0, __m256i half1, __m256 acc) {
  constexpr int kOff = kAvx2Offset<Q>;
  __m256i I;
  if constexpr (kGroupScales<Q>) {
    if constexpr (kOff != 0) {
      half0 = _mm256_sub_epi32(half0, _mm256_set1_epi32(kOff * xs[0]));
      half1 = _mm256_sub_epi32(half1, _mm256_set1_epi32(kOff * xs[1]));
    }
    const __m256i s0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.sc.data() + b * 16));
    const __m256i s1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.sc.data() + b * 16 + 8));
    I = _mm256_add_epi32(_mm256_mullo_epi32(s0, half0), _mm256_mullo_epi32(s1, half1));
  } else {
    I = _mm256_add_epi32(half0, half1);
  }
  __m256 fI = _mm256_cvtepi32_ps(I);
  if constexpr (!kGroupScales<Q> && kOff != 0) {
    // the offset taken off in float, where a block has one scale: the sums, kOff times x's (S) and their difference
    // are integers below 2^24, so fnmadd rounds nothing and gives float(I) itself, with no integer broadcast of kOff S
    fI = _mm256_fnmadd_ps(_mm256_set1_ps(kOff), _mm256_set1_ps(sum), fI);
  }
  __m256 u = rounded(_mm256_mul_ps(_mm256_loadu_ps(p.a.data() + b * 8), fI));
  if constexpr (kIntMin<Q>) {
    __m256 S = _mm256_set1_ps(sum);  // exact: float(xs[0] + xs[1])
    if constexpr (kGroupScales<Q>) {  // Q2_K's per-16 minima
      const __m256i m0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.mn.data() + b * 16));
      const __m256i m1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.mn.data() + b * 16 + 8));
      S = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_mullo_epi32(m0, _mm256_set1_epi32(xs[0])),
                                              _mm256_mullo_epi32(m1, _mm256_set1_epi32(xs[1]))));
    }
    u = _mm256_add_ps(u, rounded(_mm256_mul_ps(_mm256_loadu_ps(p.c.data() + b * 8), S)));
  }
  return _mm256_add_ps(acc, rounded(_mm256_mul_ps(_mm256_set1_ps(dx), u)));
}

constexpr int64_t kAvx2TileRows = 16;  // x rows a group (below)

// Int8Rows as the tile reads them: each group of kAvx2TileRows x rows block-major (the group's rows' block b side by
// side), so that the tile's walk (every row of block b, then block b + 1) is one sequential stream. Row after row of
// Int8Rows, K bytes apart (a power of two, often), the rows share the L1 cache's sets.
struct XTiles {
  std::vector<int8_t> q;    // [groups][K / 32][rows][32]
  std::vector<float> dx;    // [groups][K / 32][rows]
  std::vector<int32_t> xs;  // [groups][K / 32][rows][2]
  std::vector<float> sum;   // [groups][K / 32][rows]
};

// Row m0 + i's block b of a group at index m0 * (K / 32) + b * (the group's rows) + i.
inline void pack_x_tiles(const Int8Rows& x, int64_t M, int64_t K, XTiles& t) {
  const int64_t blocks = K / 32;
  t.q.resize(static_cast<size_t>(M * K));
  t.dx.resize(static_cast<size_t>(M * blocks));
  t.xs.resize(static_cast<size_t>(2 * M * blocks));
  t.sum.resize(static_cast<size_t>(M * blocks));
  for (int64_t m0 = 0; m0 < M; m0 += kAvx2TileRows) {
    const int64_t mb = std::min(kAvx2TileRows, M - m0);
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t i = 0; i < mb; ++i) {
        const int64_t to = m0 * blocks + b * mb + i, from = (m0 + i) * blocks + b;
        std::memcpy(t.q.data() + to * 32, x.xq.data() + from * 32, 32);
        t.dx[to] = x.dx[from], t.sum[to] = x.sum[from];
        t.xs[2 * to] = x.xs[2 * from], t.xs[2 * to + 1] = x.xs[2 * from + 1];
      }
    }
  }
}

// AVX2: the panel's quants (plus kAvx2Offset) times each x row's dwords, into dword sums per row. A block's 8 panel
// vectors are loaded once and stay in registers while up to kAvx2TileRows x rows take their turn, each row's
// accumulator on the stack: independent chains, and each row still adds its blocks in order (the same bits). Row i's
// float epilogue runs after row i + 1's integer sums (software pipelining): its operands are ready when it is issued,
// so the long chain (loads, maddubs, widening, the float epilogue) does not fill the scheduler.
template <QuantType Q>
SPECDEC_QAVX2 void int8_tile_avx2(const QuantArgs& a, const XTiles& x, const Panel<8>& p, int64_t m0, int64_t n0,
                                  int64_t rows) {
  const int64_t blocks = a.K / 32;
  const int64_t mb = std::min(kAvx2TileRows, a.M - m0);
  const int64_t base = m0 * blocks;  // pack_x_tiles' index of the group's first block
  constexpr int kRun = std::min(4, kInt16Sums<Q>);  // dword j's products summed in int16, then widened
  __m256 acc[kAvx2TileRows];
  for (int64_t i = 0; i < mb; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i w[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.q.data() + (b * 8 + j) * 32));
    }
    __m256i prev[2];
    for (int64_t i = 0; i < mb; ++i) {
      const int64_t s = base + b * mb + i;
      const int8_t* xq = x.q.data() + s * 32;
      __m256i half[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 8
      for (int j0 = 0; j0 < 8; j0 += kRun) {
        __m256i s16 = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = j0; j < j0 + kRun; ++j) {
          s16 = _mm256_add_epi16(s16, dot16_avx2<Q>(w[j], _mm256_set1_epi32(dword_at(xq + 4 * j))));
        }
        half[j0 / 4] = _mm256_add_epi32(half[j0 / 4], widen16(s16));
      }
      if (i > 0) {
        acc[i - 1] = int8_epilogue_avx2<Q>(p, b, &x.xs[2 * (s - 1)], x.sum[s - 1], x.dx[s - 1], prev[0], prev[1],
                                           acc[i - 1]);
      }
      prev[0] = half[0], prev[1] = half[1];
    }
    const int64_t s = base + b * mb + mb - 1;
    acc[mb - 1] = int8_epilogue_avx2<Q>(p, b, &x.xs[2 * s], x.sum[s], x.dx[s], prev[0], prev[1], acc[mb - 1]);
  }
  for (int64_t i = 0; i < mb; ++i) store_lanes(a, m0 + i, n0, rows, acc[i]);
}

// The epilogue of x row m's block b as Int8Rows holds it (the row-wise kernel's few rows).
template <QuantType Q>
SPECDEC_QAVX2 inline __m256 int8_epilogue_rows(const Int8Args& x, const Panel<8>& p, int64_t m, int64_t b,
                                               __m256i half0, __m256i half1, __m256 acc) {
  const int64_t i = m * (x.a->K / 32) + b;
  return int8_epilogue_avx2<Q>(p, b, &x.x->xs[2 * i], x.x->sum[i], x.x->dx[i], half0, half1, acc);
}

// AVX2 for up to kAvx2RowWiseRows x rows (decoding, short verifies): each of 8 weight rows' quants decoded once per
// block and dotted in place with each x row's block, one weight row per vector, each row's two 128-bit lanes (its
// halves) then summed by a transpose of the 8 vectors, per x row; the panel's scales and epilogue. The panel
// transposes the quants once for every x row (stored, then loaded back); past 3 x rows the lane sums cost more.
constexpr int64_t kAvx2RowWiseRows = 3;
template <QuantType Q, int MB>
SPECDEC_QAVX2 void int8_rowwise_avx2(const Int8Args& x, const Panel<8>& p, int64_t n0, int64_t rows, bool more) {
  const QuantArgs& a = *x.a;
  const int64_t blocks = a.K / 32;
  const uint8_t* row[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) row[i] = a.w + (n0 + std::min<int64_t>(i, rows - 1)) * a.row_bytes;  // dead: a copy
  // `more`: this thread's next tile (contiguous after these rows) is pulled in at this tile's pace, a block's share
  // per block (a super-block's share at once ran slower), so that its scales' pass (the first to read each line) does
  // not wait on DRAM
  const uintptr_t next = reinterpret_cast<uintptr_t>(a.w + (n0 + 8) * a.row_bytes);
  const int64_t step = 8 * a.row_bytes / blocks;  // the next tile per block: exact (whole super-blocks per row)
  constexpr bool l2 = prefetch_to_l2<Q>();
  __m256 acc[MB];
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  __m256i prev0, prev1;
  // Up to 2 x rows a K-quant's super-block is unrolled: each block's offsets and shifts are constants, and blocks that
  // share bytes can load them once. At kAvx2RowWiseRows x rows the unrolled body ran slower (RESULTS-log).
  constexpr int kStep = MB < kAvx2RowWiseRows ? kStepBlocks<Q> : 1;
  for (int64_t b0 = 0; b0 < blocks; b0 += kStep) {
#pragma GCC unroll 8
    for (int u = 0; u < kStep; ++u) {
      const int64_t b = b0 + u;
      if (more) simd::prefetch_lines(next + b * step, next + (b + 1) * step, l2);
      const int64_t at = (kStep > 1 ? b0 : b) / kStepBlocks<Q> * kBlockBytes<Q>;  // block b's step (b0's, unrolled)
      const int place = kStep > 1 ? u : static_cast<int>(b % kStepBlocks<Q>);   // and its place there
      __m256i q[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) q[i] = step_quants_avx2<Q, kAvx2Offset<Q>>(row[i] + at, place);
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.x->xq.data() + m * a.K + b * 32));
        // Lane sums: dword j of t[k / 2]'s lane L is vector 4 (k / 2) + j's lane L. The unpacks move whole dwords, so
        // the adds run on int16 lanes (two per dword) while a lane holds at most kInt16Sums maddubs sums, then widen16.
        constexpr int kRun = kInt16Sums<Q>;
        __m256i d[8], s[4], t[2];
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          d[i] = dot16_avx2<Q>(q[i], xq);
          if constexpr (kRun < 2) d[i] = widen16(d[i]);
        }
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          const __m256i lo = _mm256_unpacklo_epi32(d[2 * k], d[2 * k + 1]);
          const __m256i hi = _mm256_unpackhi_epi32(d[2 * k], d[2 * k + 1]);
          s[k] = kRun >= 2 ? _mm256_add_epi16(lo, hi) : _mm256_add_epi32(lo, hi);
          if constexpr (kRun == 2 || kRun == 3) s[k] = widen16(s[k]);
        }
#pragma GCC unroll 2
        for (int k = 0; k < 2; ++k) {
          const __m256i lo = _mm256_unpacklo_epi64(s[2 * k], s[2 * k + 1]);
          const __m256i hi = _mm256_unpackhi_epi64(s[2 * k], s[2 * k + 1]);
          t[k] = kRun >= 4 ? _mm256_add_epi16(lo, hi) : _mm256_add_epi32(lo, hi);
          if constexpr (kRun >= 4) t[k] = widen16(t[k]);
        }
        __m256i half0 = _mm256_permute2x128_si256(t[0], t[1], 0x20);
        __m256i half1 = _mm256_permute2x128_si256(t[0], t[1], 0x31);
        // pipelined as in the tile: the epilogue of the (block, x row) before this one, its operands ready
        if (m > 0) {
          acc[m - 1] = int8_epilogue_rows<Q>(x, p, m - 1, b, prev0, prev1, acc[m - 1]);
        } else if (b > 0) {
          acc[MB - 1] = int8_epilogue_rows<Q>(x, p, MB - 1, b - 1, prev0, prev1, acc[MB - 1]);
        }
        prev0 = half0, prev1 = half1;
      }
    }
  }
  acc[MB - 1] = int8_epilogue_rows<Q>(x, p, MB - 1, blocks - 1, prev0, prev1, acc[MB - 1]);
  for (int m = 0; m < MB; ++m) store_lanes(a, m, n0, rows, acc[m]);
}

template <QuantType Q>
void int8_rows_avx2(const Int8Args& x, int64_t n_begin, int64_t n_end) {
  thread_local Panel<8> p;
  p.resize(x.a->K / 32);
  const int64_t M = x.a->M;
  thread_local XTiles tiles;  // each thread's own, as each quantizes x itself
  if (M > kAvx2RowWiseRows) pack_x_tiles(*x.x, M, x.a->K, tiles);
  for (int64_t n0 = n_begin; n0 < n_end; n0 += 8) {
    const int64_t rows = std::min<int64_t>(8, n_end - n0);
    const bool more = n0 + 8 < n_end;
    fill_panel_scales<Q, 8>(*x.a, n0, rows, p);
    static_assert(kAvx2RowWiseRows == 3, "a branch for each x row count up to kAvx2RowWiseRows");
    if (M == 1) {
      int8_rowwise_avx2<Q, 1>(x, p, n0, rows, more);
    } else if (M == 2) {
      int8_rowwise_avx2<Q, 2>(x, p, n0, rows, more);
    } else if (M == kAvx2RowWiseRows) {
      int8_rowwise_avx2<Q, kAvx2RowWiseRows>(x, p, n0, rows, more);
    } else {
      fill_panel<Q, 8, kAvx2Offset<Q>>(*x.a, n0, rows, p);
      for (int64_t m0 = 0; m0 < M; m0 += kAvx2TileRows) int8_tile_avx2<Q>(*x.a, tiles, p, m0, n0, rows);
    }
  }
}

#endif  // SPECDEC_CPU_X86
