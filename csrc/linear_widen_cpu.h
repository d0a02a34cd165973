// The bfloat16 linear's AVX-512 widening path and the timing that chooses it, a section of csrc/linear_cpu.cpp kept
// in its own file: included there inside its anonymous namespace and its x86 guard, after LinearArgs, kRowBlock,
// kPanelRows, slot and the AVX-512 path's finish_tile.
#pragma once

// ---------------------------------------------------------------------------------------------------------------
// AVX-512 widening path for bfloat16 (CPUs whose vdpbf16ps issues slowly: bf16_widens in
// csrc/linear_cpu.cpp).
// ---------------------------------------------------------------------------------------------------------------

// The k loop runs 32 elements per step, as the AVX512-BF16 path pairs them: one 64-byte load of 32 weights, lo = the
// even ones (k + 2l: shifted into an fp32's top half), hi = the odd ones (k + 2l + 1: masked in place), each fed to
// fp32 FMAs against x widened once per call and thread into the same even / odd order ([M, ldxf], zero-padded to a
// whole step). Lane l of an accumulator adds its lo product, then its hi one, for k = 0, 32, ...: one fixed order
// whatever M and the tile: the AVX512-BF16 path's pairs, each product rounded into the sum on its own (its outputs
// equal that path's but for about one in 10^4). 16 products per FMA against 32 per vdpbf16ps: this path pays where
// vdpbf16ps issues at under 0.4x the FMAs' rate (bf16_widens; bench/RESULTS.md, "bfloat16 matmuls where vdpbf16ps
// is slow").
SPECDEC_AVX512 inline void split_even_odd(__m512i raw, __m512& lo, __m512& hi) {
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

SPECDEC_AVX512 inline void load_w32(const uint16_t* w, __m512& lo, __m512& hi) {
  split_even_odd(_mm512_loadu_si512(w), lo, hi);
}

// The last K % 32 weights of a row, zero-padded (an odd K pairs its last element with a zero).
SPECDEC_AVX512 inline void load_w32_tail(const uint16_t* w, int64_t count, __m512& lo, __m512& hi) {
  split_even_odd(_mm512_maskz_loadu_epi16(static_cast<__mmask32>((uint64_t{1} << count) - 1), w), lo, hi);
}

// x [M, K] bf16 -> out [M, ldxf] fp32 (ldxf = K rounded up to 32), per 32 elements the 16 even then the 16 odd.
SPECDEC_AVX512 inline void widen_even_odd32(const LinearArgs<c10::BFloat16>& a, float* out, int64_t ldxf) {
  for (int64_t m = 0; m < a.M; ++m) {
    const uint16_t* x = reinterpret_cast<const uint16_t*>(a.x + m * a.ldx);
    float* o = out + m * ldxf;
    for (int64_t k = 0; k < a.K; k += 32) {
      __m512 lo, hi;
      if (k + 32 <= a.K) {
        load_w32(x + k, lo, hi);
      } else {
        load_w32_tail(x + k, a.K - k, lo, hi);
      }
      _mm512_storeu_ps(o + k, lo);
      _mm512_storeu_ps(o + k + 16, hi);
    }
  }
}

// A vector in a register that GCC may not fold into its users as a memory operand (each FMA would reload it).
SPECDEC_AVX512 inline __m512 load_in_zmm(const float* p) {
  __m512 v = _mm512_loadu_ps(p);
  __asm__("" : "+v"(v));
  return v;
}

// One k step of 32 for NB weight rows (row stride K; `count` < 32: the row's zero-padded tail) and MB widened x rows.
template <int NB, int MB>
SPECDEC_AVX512 inline void step32_widen(const uint16_t* w, int64_t K, int64_t count, const float* x, int64_t ldxf,
                                        __m512* acc) {
  if constexpr (MB <= 2) {  // few x rows: all of them in registers, the weight rows widened one at a time
    __m512 x_lo[MB], x_hi[MB];
#pragma GCC unroll 2
    for (int mb = 0; mb < MB; ++mb) {
      x_lo[mb] = load_in_zmm(x + mb * ldxf);
      x_hi[mb] = load_in_zmm(x + mb * ldxf + 16);
    }
#pragma GCC unroll 16
    for (int nb = 0; nb < NB; ++nb) {
      __m512 w_lo, w_hi;
      if (count == 32) {
        load_w32(w + nb * K, w_lo, w_hi);
      } else {
        load_w32_tail(w + nb * K, count, w_lo, w_hi);
      }
#pragma GCC unroll 2
      for (int mb = 0; mb < MB; ++mb) {
        acc[slot<NB>(nb, mb)] = _mm512_fmadd_ps(w_lo, x_lo[mb], acc[slot<NB>(nb, mb)]);
        acc[slot<NB>(nb, mb)] = _mm512_fmadd_ps(w_hi, x_hi[mb], acc[slot<NB>(nb, mb)]);
      }
    }
  } else {  // many x rows: the NB weight rows widened once per step, each x half loaded once and fed to NB FMAs
    __m512 w_lo[NB], w_hi[NB];
#pragma GCC unroll 4
    for (int nb = 0; nb < NB; ++nb) {
      if (count == 32) {
        load_w32(w + nb * K, w_lo[nb], w_hi[nb]);
      } else {
        load_w32_tail(w + nb * K, count, w_lo[nb], w_hi[nb]);
      }
    }
#pragma GCC unroll 8
    for (int mb = 0; mb < MB; ++mb) {
      const __m512 x_lo = load_in_zmm(x + mb * ldxf);
#pragma GCC unroll 4
      for (int nb = 0; nb < NB; ++nb) acc[slot<NB>(nb, mb)] = _mm512_fmadd_ps(w_lo[nb], x_lo, acc[slot<NB>(nb, mb)]);
      const __m512 x_hi = load_in_zmm(x + mb * ldxf + 16);
#pragma GCC unroll 4
      for (int nb = 0; nb < NB; ++nb) acc[slot<NB>(nb, mb)] = _mm512_fmadd_ps(w_hi[nb], x_hi, acc[slot<NB>(nb, mb)]);
    }
  }
}

// NB weight rows x MB x rows (accumulator slot<NB>(nb, mb), summed by finish_tile as the AVX-512 paths do); `prefetch`
// walks the next NB weight rows at this tile's pace, one line per row per step.
template <int NB, int MB>
SPECDEC_AVX512 void tile_widen(const LinearArgs<c10::BFloat16>& a, const float* xw, int64_t ldxf, int64_t n0,
                               int64_t m0, const char* prefetch) {
  static_assert(NB * MB <= 16, "a tile holds at most 16 accumulators");
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  const uint16_t* w = reinterpret_cast<const uint16_t*>(a.w) + n0 * a.K;
  const float* x = xw + m0 * ldxf;
  const int64_t K = a.K;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (prefetch != nullptr) {
#pragma GCC unroll 16
      for (int nb = 0; nb < NB; ++nb) _mm_prefetch(prefetch + nb * 64, _MM_HINT_T1);
      prefetch += NB * 64;
    }
    step32_widen<NB, MB>(w + k, K, 32, x + k, ldxf, acc);
  }
  if (k < K) step32_widen<NB, MB>(w + k, K, K - k, x + k, ldxf, acc);
  finish_tile<c10::BFloat16, NB, MB>(a, acc, n0, m0);
}

// The most x rows one tile takes: 2 weight rows x 8 x rows = 16 accumulators + 4 widened weight vectors + one x
// vector, within the 32 zmm registers.
constexpr int64_t kWidenChunk = 8;

// Weight rows [n, block_end) of one block against x rows [m0, m0 + mb), 1 <= mb <= kWidenChunk, in tiles as wide as
// 16 accumulators allow (NB = 16 / 8 / 4 / 4 / 2 weight rows for mb = 1 / 2 / 3 / 4 / 5-8): every accumulator adds two
// dependent FMAs per k step, so a tile of fewer accumulators waits on the FMAs' latency rather than their issue.
// Rows that do not fill a tile run one at a time. `prefetch`: the tiles pull the next block's lines.
template <int NB, int MB>
SPECDEC_AVX512 void block_widen(const LinearArgs<c10::BFloat16>& a, const float* xw, int64_t ldxf, int64_t n,
                                int64_t block_end, int64_t m0, bool prefetch) {
  int64_t r = n;
  for (; r + NB <= block_end; r += NB) {
    tile_widen<NB, MB>(a, xw, ldxf, r, m0,
                       prefetch ? reinterpret_cast<const char*>(a.w + (r + kRowBlock) * a.K) : nullptr);
  }
  for (; r < block_end; ++r) tile_widen<1, MB>(a, xw, ldxf, r, m0, nullptr);
}

SPECDEC_AVX512 void chunk_widen(const LinearArgs<c10::BFloat16>& a, const float* xw, int64_t ldxf, int64_t n,
                                int64_t block_end, int64_t m0, int64_t mb, bool prefetch) {
  switch (mb) {
    case 1:
      return block_widen<16, 1>(a, xw, ldxf, n, block_end, m0, prefetch);
    case 2:
      return block_widen<8, 2>(a, xw, ldxf, n, block_end, m0, prefetch);
    case 3:
      return block_widen<4, 3>(a, xw, ldxf, n, block_end, m0, prefetch);
    case 4:
      return block_widen<4, 4>(a, xw, ldxf, n, block_end, m0, prefetch);
    case 5:
      return block_widen<2, 5>(a, xw, ldxf, n, block_end, m0, prefetch);
    case 6:
      return block_widen<2, 6>(a, xw, ldxf, n, block_end, m0, prefetch);
    case 7:
      return block_widen<2, 7>(a, xw, ldxf, n, block_end, m0, prefetch);
    default:
      return block_widen<2, 8>(a, xw, ldxf, n, block_end, m0, prefetch);
  }
}

// Weight rows [n_begin, n_end), per panel of kPanelRows x rows, per block of kRowBlock weight rows: the panel in
// ceil(rows / 8) chunks as even as possible (9 rows: 4 + 5), each run against the whole block, so a chunk's widened x
// rows stay in L1 across the block and the block's weight rows in L1 across the chunks; the first chunk's tiles
// prefetch the next block (a whole block only: the range's last one may be short).
SPECDEC_AVX512 void rows_widen(const LinearArgs<c10::BFloat16>& a, const float* xw, int64_t ldxf, int64_t n_begin,
                               int64_t n_end) {
  for (int64_t p0 = 0; p0 < a.M; p0 += kPanelRows) {
    const int64_t rows = std::min(kPanelRows, a.M - p0);
    const int64_t chunks = (rows + kWidenChunk - 1) / kWidenChunk;
    for (int64_t n = n_begin; n < n_end; n += kRowBlock) {
      const int64_t block_end = std::min(n + kRowBlock, n_end);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t m0 = p0 + c * rows / chunks, mb = p0 + (c + 1) * rows / chunks - m0;
        chunk_widen(a, xw, ldxf, n, block_end, m0, mb, c == 0 && block_end == n + kRowBlock);
      }
    }
  }
}


// Whether this CPU's vdpbf16ps issues at under 0.4x its fp32 FMA's rate, timed once per process on 16 independent
// accumulators each (~0.15 ms): then the widening path computes more products per cycle than the AVX512-BF16 one
// (32 products per vdpbf16ps against 16 per FMA plus an integer op per 32; bench/RESULTS.md, "bfloat16 matmuls where
// vdpbf16ps is slow", has the machine that issues it at a quarter of the FMAs' rate).
SPECDEC_AVX512 __attribute__((noinline)) double time_dot_or_fma(bool dot, int reps) {
  __m512 acc[16];  // distinct starts: 16 equal chains would be folded into one, timing the latency of one chain
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_set1_ps(static_cast<float>(j));
  __m512 a = _mm512_set1_ps(1.0f);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) {
    __asm__("" : "+v"(a));
    if (dot) {
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)a, (__m512bh)a);
    } else {
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(a, a, acc[j]);
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  float sink[16];
  _mm512_storeu_ps(sink, simd::reduce16(acc));
  __asm__ volatile("" : : "r"(sink) : "memory");
  return seconds;
}
