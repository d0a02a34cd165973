// The linear's AVX2 + FMA path, a section of csrc/linear_cpu.cpp kept in its own file: included there inside its
// anonymous namespace and its x86 guard, after LinearArgs, kRowBlock and kPanelRows.
#pragma once

// ---------------------------------------------------------------------------------------------------------------
// AVX2 + FMA path (CPUs without AVX-512: AMD Zen 1-3, older and client Intel parts).
// ---------------------------------------------------------------------------------------------------------------

// The k loop runs 16 elements per step as two 8-lane halves, lo and hi, each multiplied by its own x half:
// - fp32: lo = w[k .. k+7], hi = w[k+8 .. k+15], x read in place, so lane l sums k = l, l + 8, l + 16, ... in order;
// - bf16: one 32-byte load of 16 weights, lo = the even ones (k + 2l: shifted into an fp32's top half), hi = the odd
//   ones (k + 2l + 1: masked in place), 3 instructions per 16 weights where widening 8 at a time took 4 per 8; x is
//   widened to fp32 once per call and thread into that even/odd order (Avx2Args), so lane l sums k = 2l, 2l + 1,
//   2l + 16, ...
template <typename T>
struct Avx2Args {
  const LinearArgs<T>& a;
  const float* x;  // fp32: a.x in place, row stride a.ldx; bf16: [M, Kp] widened, per 16 elements the even then odd
  int64_t ldx;
};

// 16 weights of row w from k as the (lo, hi) halves above.
template <typename T>
SPECDEC_AVX2 inline void load_w16(const T* w, __m256& lo, __m256& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo = _mm256_loadu_ps(w);
    hi = _mm256_loadu_ps(w + 8);
  } else {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
}

// x [M, K] bf16 -> out [M, ldxf] fp32 in Avx2Args' even / odd order, the last step zero-padded: the weights' own
// split (load_w16) applied to x. An index-computing scalar loop took ~10% of a draft forward of the default pair
// (K = 512).
SPECDEC_AVX2 inline void widen_even_odd(const LinearArgs<c10::BFloat16>& a, float* out, int64_t ldxf) {
  for (int64_t m = 0; m < a.M; ++m) {
    const c10::BFloat16* x = a.x + m * a.ldx;
    float* o = out + m * ldxf;
    for (int64_t k = 0; k < a.K; k += 16) {
      alignas(32) c10::BFloat16 tail[16] = {};
      const bool full = k + 16 <= a.K;
      if (!full) std::memcpy(tail, x + k, static_cast<size_t>(a.K - k) * sizeof(c10::BFloat16));
      __m256 lo, hi;
      load_w16(full ? x + k : tail, lo, hi);
      _mm256_storeu_ps(o + k, lo);
      _mm256_storeu_ps(o + k + 8, hi);
    }
  }
}

// A vector loaded into a register that the compiler may not fold back into its users as memory operands: GCC turns
// `x = load(p); fma(w0, x, a0); fma(w1, x, a1)` into two FMAs that each read p: a 2 x 4 tile then issues 20 loads per
// 16 FMAs (Zen 3: 2 ymm loads and 2 FMAs per cycle), 12 with x held here.
SPECDEC_AVX2 inline __m256 load_in_register(const float* p) {
  __m256 v = _mm256_loadu_ps(p);
  __asm__("" : "+x"(v));
  return v;
}

// One k step of 16 for the tile's NB weight rows (row stride K) and MB x rows (row stride ldx). Each accumulator adds
// its lo product, then its hi one, whatever the loop order below: the order of one output's additions never depends
// on the tile.
template <typename T, int NB, int MB>
SPECDEC_AVX2 inline void step16(const T* w, int64_t K, const float* x, int64_t ldx, __m256* acc) {
  if constexpr (MB <= 2) {  // few x rows: all of them in registers, the weight rows widened one at a time
    __m256 x_lo[MB], x_hi[MB];
#pragma GCC unroll 8
    for (int mb = 0; mb < MB; ++mb) {
      x_lo[mb] = load_in_register(x + mb * ldx);
      x_hi[mb] = load_in_register(x + mb * ldx + 8);
    }
#pragma GCC unroll 8
    for (int nb = 0; nb < NB; ++nb) {
      __m256 w_lo, w_hi;
      load_w16(w + nb * K, w_lo, w_hi);
#pragma GCC unroll 8
      for (int mb = 0; mb < MB; ++mb) {
        acc[mb * NB + nb] = _mm256_fmadd_ps(w_lo, x_lo[mb], acc[mb * NB + nb]);
        acc[mb * NB + nb] = _mm256_fmadd_ps(w_hi, x_hi[mb], acc[mb * NB + nb]);
      }
    }
  } else {  // many x rows: the NB weight rows widened once per step (2 NB registers), each x half loaded once and fed
            // to NB FMAs
    __m256 w_lo[NB], w_hi[NB];
#pragma GCC unroll 8
    for (int nb = 0; nb < NB; ++nb) load_w16(w + nb * K, w_lo[nb], w_hi[nb]);
#pragma GCC unroll 8
    for (int mb = 0; mb < MB; ++mb) {
      const __m256 x_lo = load_in_register(x + mb * ldx);
#pragma GCC unroll 8
      for (int nb = 0; nb < NB; ++nb) acc[mb * NB + nb] = _mm256_fmadd_ps(w_lo[nb], x_lo, acc[mb * NB + nb]);
      const __m256 x_hi = load_in_register(x + mb * ldx + 8);
#pragma GCC unroll 8
      for (int nb = 0; nb < NB; ++nb) acc[mb * NB + nb] = _mm256_fmadd_ps(w_hi[nb], x_hi, acc[mb * NB + nb]);
    }
  }
}

// A tile's sums (reduce8 per 8 accumulators: lane i = accumulator i, by the same tree for every accumulator), plus the
// bias (fp32, last), rounded once and stored as each x row's NB outputs: `store`'s arithmetic on 8 outputs at a time
// (one at a time: a branch on the bias and a scalar rounding per output, 8 per 2 x 4 tile of 36 k steps at K = 576).
template <typename T, int NB, int MB>
SPECDEC_AVX2 inline void finish_avx2(const LinearArgs<T>& a, const __m256* acc, int64_t n0, int64_t m0) {
  constexpr int kAcc = (NB * MB + 7) / 8 * 8;
  static_assert(8 % NB == 0, "a vector of sums holds whole x rows");
  __m256 bias = _mm256_setzero_ps();
  if (a.bias != nullptr) {
    alignas(32) float b[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) b[i] = to_float(a.bias[n0 + i % NB]);
    bias = _mm256_load_ps(b);
  }
  alignas(32) T rows[kAcc];
#pragma GCC unroll 2
  for (int j = 0; j < kAcc; j += 8) {
    __m256 sums = simd::reduce8(acc + j);
    if (a.bias != nullptr) sums = _mm256_add_ps(sums, bias);
    if constexpr (std::is_same_v<T, float>) {
      _mm256_store_ps(rows + j, sums);
    } else {
      _mm_store_si128(reinterpret_cast<__m128i*>(rows + j), simd::round_bf16(sums));
    }
  }
#pragma GCC unroll 8
  for (int mb = 0; mb < MB; ++mb) std::memcpy(a.out + (m0 + mb) * a.N + n0, rows + mb * NB, NB * sizeof(T));
}

// NB weight rows x MB x rows: accumulator mb * NB + nb; then reduce8 per 8 accumulators (lane i = accumulator i: the
// same tree for every accumulator), the bias (fp32, last) and one rounding per output. `prefetch` walks the next
// weight rows at this tile's pace; with `prefetch_every` = c > 1 it pulls only the lines of the steps s with
// s % c = `prefetch_phase` (c tiles over the same weight rows, one per chunk of x rows, share the prefetches).
template <typename T, int NB, int MB>
SPECDEC_AVX2 void tile_avx2(const Avx2Args<T>& p, int64_t n0, int64_t m0, const char* prefetch,
                            int64_t prefetch_every = 1, int64_t prefetch_phase = 0) {
  static_assert(NB * MB <= 16, "a tile holds at most 16 accumulators");
  constexpr int kAcc = (NB * MB + 7) / 8 * 8;
  const LinearArgs<T>& a = p.a;
  __m256 acc[kAcc];
#pragma GCC unroll 16
  for (int j = 0; j < kAcc; ++j) acc[j] = _mm256_setzero_ps();
  const T* w = a.w + n0 * a.K;
  const float* x = p.x + m0 * p.ldx;
  const int64_t K = a.K;
  // the next tile's rows (contiguous after these), streamed into L2 at this tile's pace: NB * 16 elements per k step
  constexpr int64_t kStepBytes = NB * 16 * static_cast<int64_t>(sizeof(T));
  int64_t k = 0;
  int64_t next_prefetch = prefetch_phase * 16;  // the k of the next step whose lines this tile prefetches
  for (; k + 16 <= K; k += 16) {
    if (prefetch != nullptr) {
      if constexpr (kStepBytes >= 64) {
        if (k == next_prefetch) {
#pragma GCC unroll 8
          for (int64_t i = 0; i < kStepBytes; i += 64) _mm_prefetch(prefetch + i, _MM_HINT_T1);
          next_prefetch += prefetch_every * 16;
        }
      } else {
        if ((k / 16) % (64 / kStepBytes) == 0) _mm_prefetch(prefetch, _MM_HINT_T1);
      }
      prefetch += kStepBytes;
    }
    step16<T, NB, MB>(w + k, K, x + k, p.ldx, acc);
  }
  if (k < K) {  // the last K % 16 elements, through zero-padded copies (the same lanes as a full step)
    alignas(32) T wt[NB * 16] = {};
    alignas(32) float xt[MB * 16] = {};
    for (int nb = 0; nb < NB; ++nb) std::memcpy(wt + nb * 16, w + nb * K + k, (K - k) * sizeof(T));
    for (int mb = 0; mb < MB; ++mb) {  // bf16's widened x is padded already: its whole last step is copied
      std::memcpy(xt + mb * 16, x + mb * p.ldx + k, (std::is_same_v<T, float> ? K - k : 16) * sizeof(float));
    }
    step16<T, NB, MB>(wt, 16, xt, 16, acc);
  }
  finish_avx2<T, NB, MB>(a, acc, n0, m0);
}

template <typename T, int NB, int MB>
SPECDEC_AVX2 inline void tile8(const Avx2Args<T>& p, int64_t n0, int64_t m0, bool prefetch) {
  tile_avx2<T, NB, MB>(p, n0, m0, prefetch ? reinterpret_cast<const char*>(p.a.w + (n0 + NB) * p.a.K) : nullptr);
}

// The most x rows a many-row tile takes: 2 weight rows x 5 x rows = 10 accumulators + 4 widened weight vectors + one
// x vector, within the 16 ymm registers.
constexpr int64_t kMaxChunk = 5;

// Weight rows [n0, n0 + NB) against x rows [m0, m0 + mb) for 1 <= mb <= kMaxChunk.
template <typename T, int NB>
SPECDEC_AVX2 void tile_chunk(const Avx2Args<T>& p, int64_t n0, int64_t m0, int64_t mb, const char* prefetch,
                             int64_t prefetch_every, int64_t prefetch_phase) {
  switch (mb) {
    case 5:
      return tile_avx2<T, NB, 5>(p, n0, m0, prefetch, prefetch_every, prefetch_phase);
    case 4:
      return tile_avx2<T, NB, 4>(p, n0, m0, prefetch, prefetch_every, prefetch_phase);
    case 3:
      return tile_avx2<T, NB, 3>(p, n0, m0, prefetch, prefetch_every, prefetch_phase);
    case 2:
      return tile_avx2<T, NB, 2>(p, n0, m0, prefetch, prefetch_every, prefetch_phase);
    default:
      return tile_avx2<T, NB, 1>(p, n0, m0, prefetch, prefetch_every, prefetch_phase);
  }
}

// M >= 3 (a verify pass): the FMAs cost more than streaming the weights. Per block of kRowBlock weight rows, x is cut
// into ceil(M / 5) chunks as even as possible (16 rows: 4 x 4), and each chunk runs against the block's weight rows
// two at a time, so every widened weight vector feeds MB FMAs and every x vector 2, and a chunk's x rows stay in L1
// across the block while the block's weight rows stay in L1/L2 across the chunks. The tiles of chunk c prefetch
// every chunks-th line of the next block, starting at line c: together one pass over it, spread over the block.
// One thread, [256, 576] and [256, 1536] bf16 weights (SmolLM2's K) in L2/L3, min of 25 samples of CPU time,
// interleaved with the 4 x 2 tiles this replaced (AMD EPYC Zen 3, loaded machine): 69-72 -> 75-80 GFLOP/s at M = 16,
// of a measured 92 GFLOP/s register-only FMA peak per core. With the weights from DRAM the two are within noise
// (~52-57 GFLOP/s at M = 16): there the DRAM stream and the FMAs barely overlap.
template <typename T>
SPECDEC_AVX2 void rows_avx2_many(const Avx2Args<T>& p, int64_t n_begin, int64_t n_end) {
  for (int64_t p0 = 0; p0 < p.a.M; p0 += kPanelRows) {
    const int64_t M = std::min(kPanelRows, p.a.M - p0);
    const int64_t chunks = (M + kMaxChunk - 1) / kMaxChunk;
    for (int64_t n = n_begin; n < n_end; n += kRowBlock) {
      const int64_t rows_here = std::min(kRowBlock, n_end - n);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t m0 = p0 + c * M / chunks, mb = p0 + (c + 1) * M / chunks - m0;
        int64_t r = 0;
        for (; r + 2 <= rows_here; r += 2) {
          const char* next = reinterpret_cast<const char*>(p.a.w + (n + r + kRowBlock) * p.a.K);
          tile_chunk<T, 2>(p, n + r, m0, mb, rows_here == kRowBlock ? next : nullptr, chunks, c);
        }
        if (r < rows_here) tile_chunk<T, 1>(p, n + r, m0, mb, nullptr, 1, 0);
      }
    }
  }
}

// Weight rows [n_begin, n_end): 8 rows at a time at M = 1, 4 rows against x in chunks of 2 rows at M = 2 (the 4
// weight rows read from memory once, from L1 by the later chunk), rows_avx2_many above M = 2; single rows for what
// does not fill a tile.
template <typename T>
SPECDEC_AVX2 void rows_avx2(const Avx2Args<T>& p, int64_t n_begin, int64_t n_end) {
  const int64_t M = p.a.M;
  if (M > 2) return rows_avx2_many<T>(p, n_begin, n_end);
  int64_t n = n_begin;
  if (M == 1) {
    for (; n + 8 <= n_end; n += 8) tile8<T, 8, 1>(p, n, 0, true);
  } else {
    for (; n + 4 <= n_end; n += 4) tile8<T, 4, 2>(p, n, 0, true);
  }
  for (; n < n_end; ++n) {
    for (int64_t m = 0; m < M; ++m) tile8<T, 1, 1>(p, n, m, false);
  }
}
