// The 8-bit activation path's AMX-INT8 kernel, beside the row-wise one (csrc/quant_int8_rows_cpu.h): the same pairs
// and columns of 16 weight rows, but one tdpbssd makes every x row's block sums at once. A section of
// csrc/quant_linear_cpu.cpp, included by csrc/quant_int8_cpu.h after the row-wise kernel, whose pieces it uses, and
// only where the compiler has the AMX intrinsics (SPECDEC_CPU_AMX).
//
// Per block: the columns (w[j] dword r = quants 4j .. 4j + 3 of weight row r), their offset taken off again so that
// they are int_quants' signed integers, are exactly the layout of a tdpbssd's second operand, 8 rows of 64 bytes; the
// first is up to 16 x rows' 32 int8 quants, read in place from the quantized x (row stride K). The result tile holds,
// for x row m and weight row r, sum(xq q) over the block (over each 16-element group in its own tile where the
// format has group scales), and the row-wise kernel's epilogue then runs on it with no offset, one x row and 16
// weight rows at a time.
//
// Why it gives the spec's bits: the tile's sums are the exact integers I is made of, and the epilogue is the same
// code. Why: the row-wise kernel pays 8 vpdpbusd per x row and block, here one instruction serves 16 x rows, leaving
// the epilogue and the columns' transpose (once per 16 x rows) as the work of a verify pass or a prompt's chunk.
#pragma once

#define SPECDEC_QAMX8 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,amx-tile,amx-int8")))

// x rows per tile: a tile's 16 rows.
constexpr int kTileRows = 16;

// A step is one tdpbssd: a block, or one of its two groups where the format has group scales.
template <QuantType Q>
constexpr int kGroupsPerBlock = kGroupScales<Q> ? 2 : 1;

// Two sets of tiles, used by turns so that one step's tiles are loaded while the other's sums are stored: set t holds
// the sums in tile t, the x rows' quants in 2 + t and the columns in 4 + t, for `live` x rows.
template <QuantType Q>
SPECDEC_QAMX8 inline void configure_int8_tiles(int live) {
  amx::TileConfig c;
  for (int t = 0; t < 2; ++t) {
    c.rows[t] = static_cast<uint8_t>(live), c.colsb[t] = 64;
    c.rows[2 + t] = static_cast<uint8_t>(live), c.colsb[2 + t] = static_cast<uint16_t>(32 / kGroupsPerBlock<Q>);
    c.rows[4 + t] = static_cast<uint8_t>(8 / kGroupsPerBlock<Q>), c.colsb[4 + t] = 64;
  }
  _tile_loadconfig(&c);
}

// What a tile of 16 weight rows keeps for its run of up to 8 blocks: each block's columns and each step's sums
// ([step][x row][weight row]).
struct TileRun {
  alignas(64) uint8_t columns[8][8][64];
  alignas(64) int32_t sums[16][kTileRows][16];
};

// Block S of a super-block (K-quants; else the block at off, stored as block `at`) of the 8 pairs: its columns, as
// signed bytes (tdpbssd multiplies signed by signed, so no offset is taken off per x row after).
template <QuantType Q, int S>
SPECDEC_QAMX8 __attribute__((always_inline)) inline void store_columns(const PairRows& pr, int64_t off, int at,
                                                                       TileRun& run) {
  __m512i q[8], w[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) q[i] = pair_quants<Q, S>(pr.p[i] + off, pr.stride[i]);
  pairs_to_columns<Q>(q, w);
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(kUnsignedOffset<Q>));  // back to int_quants' integers
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) _mm512_store_si512(run.columns[at][j], _mm512_sub_epi8(w[j], offset));
}

// Step `step` on tile set T: x's quants at xq (row stride K) times its columns, the sums out to run.sums[step]. (The
// intrinsics take the tiles' numbers as literals.)
#define SPECDEC_TILE_STEP(tile_sums, tile_x, tile_w)                            \
  _tile_loadd(tile_x, xq + step / kG * 32 + step % kG * (32 / kG), K);           \
  _tile_loadd(tile_w, run.columns[step / kG][step % kG * (8 / kG)], 64);          \
  _tile_zero(tile_sums);                                                          \
  _tile_dpbssd(tile_sums, tile_x, tile_w);                                        \
  _tile_stored(tile_sums, run.sums[step], 64)

template <QuantType Q, int T>
SPECDEC_QAMX8 __attribute__((always_inline)) inline void tile_step(const int8_t* xq, int64_t K, int step,
                                                                   TileRun& run) {
  constexpr int kG = kGroupsPerBlock<Q>;
  if constexpr (T == 0) {
    SPECDEC_TILE_STEP(0, 2, 4);
  } else {
    SPECDEC_TILE_STEP(1, 3, 5);
  }
}
#undef SPECDEC_TILE_STEP

// Weight rows n0 .. n0 + rows - 1 (rows <= 16) times the `live` x rows from m0 (live <= 16), the tiles configured
// for them; `more`: this thread's next tile follows. Each run of 8 blocks (a K-quant's super-block) goes in three
// phases: the columns stored, the tiles' steps, the epilogues. A tile load cannot take data still in the store queue,
// nor a vector load a tile's stores, so each phase waits once for the one before instead of once a block.
template <QuantType Q>
SPECDEC_QAMX8 void tiles16(const Int8Args& x, int64_t n0, int64_t rows, int64_t m0, int live, bool more) {
  const QuantArgs& a = *x.a;
  const int64_t blocks = a.K / 32;
  const TileReads t = tile_reads(a, n0, rows);
  const uint8_t* const base = t.base;
  const PairRows& pr = t.pr;
  __m512 acc[kTileRows];
  for (int r = 0; r < live; ++r) acc[r] = _mm512_setzero_ps();
  Scales16 k;
  TileRun run;
  constexpr int kG = kGroupsPerBlock<Q>;
  for (int64_t b0 = 0; b0 < blocks; b0 += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, blocks - b0));
    if constexpr (kSubBlocks<Q> == 1) {
      for (int s = 0; s < n; ++s) {
        const int64_t off = (b0 + s) * kBlockBytes<Q>;
        prefetch_ahead<Q>(base, a.row_bytes, off, rows, more);
        gather_block_scales<Q>(t, off, s, k);
        store_columns<Q, 0>(pr, off, s, run);
      }
    } else {
      const int64_t off = b0 / 8 * kBlockBytes<Q>;
      gather_k_scales<Q>(base + off, t.live, t.offsets, k);
      prefetch_part<Q, 0>(base, a.row_bytes, off, rows, more), store_columns<Q, 0>(pr, off, 0, run);
      prefetch_part<Q, 1>(base, a.row_bytes, off, rows, more), store_columns<Q, 1>(pr, off, 1, run);
      prefetch_part<Q, 2>(base, a.row_bytes, off, rows, more), store_columns<Q, 2>(pr, off, 2, run);
      prefetch_part<Q, 3>(base, a.row_bytes, off, rows, more), store_columns<Q, 3>(pr, off, 3, run);
      prefetch_part<Q, 4>(base, a.row_bytes, off, rows, more), store_columns<Q, 4>(pr, off, 4, run);
      prefetch_part<Q, 5>(base, a.row_bytes, off, rows, more), store_columns<Q, 5>(pr, off, 5, run);
      prefetch_part<Q, 6>(base, a.row_bytes, off, rows, more), store_columns<Q, 6>(pr, off, 6, run);
      prefetch_part<Q, 7>(base, a.row_bytes, off, rows, more), store_columns<Q, 7>(pr, off, 7, run);
    }
    const int8_t* xq = x.x->xq.data() + m0 * a.K + b0 * 32;
    for (int step = 0; step < n * kG; step += 2) {
      tile_step<Q, 0>(xq, a.K, step, run);
      if (step + 1 < n * kG) tile_step<Q, 1>(xq, a.K, step + 1, run);
    }
    for (int r = 0; r < live; ++r) {  // row by row: its accumulator stays in a register for the run's blocks
      __m512 sum = acc[r];
#pragma GCC unroll 8
      for (int s = 0; s < n; ++s) {
        const __m512i h0 = _mm512_load_si512(run.sums[kG * s][r]);
        const __m512i h1 = kG == 2 ? _mm512_load_si512(run.sums[kG * s + 1][r]) : _mm512_setzero_si512();
        sum = rows16_epilogue<Q, 0>(x, h0, h1, m0 + r, b0 + s, k, s, sum);
      }
      acc[r] = sum;
    }
  }
  for (int r = 0; r < live; ++r) store_lanes(a, m0 + r, n0, rows, acc[r]);
}

// Every x row, kTileRows a pass over each 16-row tile of weights (further passes read it from the cache).
template <QuantType Q>
SPECDEC_QAMX8 void int8_rowwise_amx(const Int8Args& x, int64_t n_begin, int64_t n_end) {
  const int64_t M = x.a->M;
  int configured = 0;
  for (int64_t n0 = n_begin; n0 < n_end; n0 += 16) {
    const int64_t rows = std::min<int64_t>(16, n_end - n0);
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const int live = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
      if (live != configured) configure_int8_tiles<Q>(live), configured = live;
      tiles16<Q>(x, n0, rows, m0, live, n0 + 16 < n_end);
    }
  }
  _tile_release();
}
