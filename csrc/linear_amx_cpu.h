// The bfloat16 linear's AMX path, a section of csrc/linear_cpu.cpp kept in its own file: included there inside its
// anonymous namespace, after LinearArgs, and only where the compiler has the AMX intrinsics (SPECDEC_CPU_AMX).
#pragma once

// ---------------------------------------------------------------------------------------------------------------
// AMX path (bfloat16, K a multiple of 32, CPUs with AMX-BF16 tiles: simd::cpu_has_amx_bf16).
// ---------------------------------------------------------------------------------------------------------------
//
// One tdpbf16ps multiplies a tile of 16 weight rows x 32 k (the weight's own row-major layout, loaded in place) by a
// tile of 32 k x 16 x rows (x packed into pairs: row p of the tile holds, for each x row, the dword of k = 2p, 2p + 1)
// into 16 x 16 fp32 sums: 512 multiply-adds per cycle, so a verify pass of 16 rows costs about what streaming the
// weights costs, where the AVX-512 path pays 16x the dot products. Every output element is its own running sum over
// k blocks in increasing order, whatever the other rows and columns of its tile hold: x rows past M are zeros that
// change nothing, a tile of fewer weight rows computes the same sums for the rows it has, so linear(x)[i] is bitwise
// linear(x[i:i+1])[0]. The AMX order differs from the AVX-512 path's; a process takes one of them for all M.
//
// Tiles: 0-3 sums (16 weight rows each), 4 the packed x block, 5-7 weight blocks (5 again for the fourth).

// Every tile 64 bytes wide; the sums and weight tiles `weight_rows` tall (16, or N's tail).
SPECDEC_AMX inline void configure_tiles(int weight_rows) {
  amx::TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = static_cast<uint8_t>(t == 4 ? 16 : weight_rows);
  }
  _tile_loadconfig(&c);
}

using amx::kXBlock;

// x [M, K] -> packed [ceil(M / 16)][K / 32] blocks (amx::pack_x_pairs).
SPECDEC_AMX void pack_x_amx(const LinearArgs<c10::BFloat16>& a, uint32_t* packed) {
  amx::pack_x_pairs(reinterpret_cast<const uint16_t*>(a.x), a.ldx, a.M, a.K, packed);
}

// Stores sum tile `sums` [16 weight rows][16 x rows] (fp32, row-major) as out rows m0.. (bias last, then bf16).
SPECDEC_AMX void finish_tile_amx(const LinearArgs<c10::BFloat16>& a, const float* sums, int64_t n0, int weight_rows,
                                 int64_t m0) {
  const __mmask16 rows_mask = static_cast<__mmask16>((1u << weight_rows) - 1);
  __m512 r[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(sums + i * 16);
  simd::transpose16(r);  // r[c]: x row m0 + c's sums for weight rows n0..
  __m512 bias = _mm512_setzero_ps();
  if (a.bias != nullptr) {
    const __m256i raw = _mm256_maskz_loadu_epi16(rows_mask, a.bias + n0);
    bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  const int64_t count = std::min<int64_t>(16, a.M - m0);
  for (int64_t c = 0; c < count; ++c) {
    const __m512 v = a.bias != nullptr ? _mm512_add_ps(r[c], bias) : r[c];
    _mm256_mask_storeu_epi16(a.out + (m0 + c) * a.N + n0, rows_mask, simd::round_bf16(v));
  }
}

// Weight rows [n0, n0 + 16 * NT) (the last tile `weight_rows` tall) against every packed x block. No software
// prefetch: the hardware's streams serve the tile loads' 16-64 rows better than one prefetch per weight row and k
// block, of the next rows or of these rows ahead (bench/RESULTS.md, "AMX").
template <int NT>
SPECDEC_AMX void tiles_amx(const LinearArgs<c10::BFloat16>& a, const uint32_t* packed, int64_t n0, int weight_rows) {
  const int64_t K = a.K, kblocks = K / 32, stride = K * 2;
  const uint16_t* w = reinterpret_cast<const uint16_t*>(a.w) + n0 * K;
  alignas(64) float sums[NT][256];
  for (int64_t m0 = 0; m0 < a.M; m0 += 16) {
    const uint32_t* x = packed + m0 / 16 * kblocks * kXBlock;
    _tile_zero(0);
    if constexpr (NT > 1) _tile_zero(1);
    if constexpr (NT > 2) _tile_zero(2);
    if constexpr (NT > 3) _tile_zero(3);
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      _tile_loadd(4, x + kb * kXBlock, 64);
      _tile_loadd(5, w + kb * 32, stride);
      _tile_dpbf16ps(0, 5, 4);
      if constexpr (NT > 1) {
        _tile_loadd(6, w + 16 * K + kb * 32, stride);
        _tile_dpbf16ps(1, 6, 4);
      }
      if constexpr (NT > 2) {
        _tile_loadd(7, w + 32 * K + kb * 32, stride);
        _tile_dpbf16ps(2, 7, 4);
      }
      if constexpr (NT > 3) {
        _tile_loadd(5, w + 48 * K + kb * 32, stride);
        _tile_dpbf16ps(3, 5, 4);
      }
    }
    _tile_stored(0, sums[0], 64);
    if constexpr (NT > 1) _tile_stored(1, sums[1], 64);
    if constexpr (NT > 2) _tile_stored(2, sums[2], 64);
    if constexpr (NT > 3) _tile_stored(3, sums[3], 64);
    for (int t = 0; t < NT; ++t) finish_tile_amx(a, sums[t], n0 + 16 * t, t == NT - 1 ? weight_rows : 16, m0);
  }
}

// Weight rows [n_begin, n_end): 64 at a time, then 16, then N's tail (a shorter tile). x is packed by each thread of
// a split call into its own buffer (reused across calls).
SPECDEC_AMX void rows_amx(const LinearArgs<c10::BFloat16>& a, int64_t n_begin, int64_t n_end) {
  thread_local std::vector<uint32_t> packed;
  packed.resize(static_cast<size_t>((a.M + 15) / 16 * (a.K / 32) * kXBlock));
  pack_x_amx(a, packed.data());
  configure_tiles(16);
  int64_t n = n_begin;
  for (; n + 64 <= n_end; n += 64) tiles_amx<4>(a, packed.data(), n, 16);
  for (; n + 16 <= n_end; n += 16) tiles_amx<1>(a, packed.data(), n, 16);
  if (n < n_end) {
    configure_tiles(static_cast<int>(n_end - n));
    tiles_amx<1>(a, packed.data(), n, static_cast<int>(n_end - n));
  }
  _tile_release();
}
