// Tree attention inside the CPU layer stack (csrc/layers_cpu.h): what one call works on (Problem), the key rows a
// query sees (the prefix, then the tree nodes its mask allows, in position order), and the attention of one query
// group over them for three ISAs. Batch-invariant: a query row's scores are summed over its keys in position order.
#pragma once

#include "layer_ops_cpu.h"

namespace specdec {
namespace {

template <typename T>
struct Problem {
  int64_t B, T_, H, Hq, Hkv, D, I, num_layers;
  float eps, scale;
  const int64_t* cache_seqlens;      // [B] (converted to int64)
  const bool* tree_mask;       // [B, T, T]
  const int32_t* block_table;  // [B, max_blocks] or nullptr (contiguous: block b, block_size = S)
  int64_t max_blocks, block_size, num_blocks;
  const T* cos;  // [B, T, D]
  const T* sin;  // [B, T, D]
  T* kv;         // [layers, 2, num_blocks, block_size, Hkv, D]
  const int64_t* capture;  // layers whose input residual stream is copied out (EAGLE-3's features), in order
  int64_t num_capture;
  T* features;             // [B, T, num_capture * H]
  // EAGLE-3's first (only) layer: its attention reads this [B * T, attn_width] instead of rms_norm(h) (the normed
  // embedding beside the normed feature); nullptr for a model's layers.
  const T* attn_in = nullptr;
  int64_t attn_width = 0;
  // Gemma's layer (the defaults are Llama's): per layer a sliding window of that many positions (0: none), whose
  // layers rotate by cos_local / sin_local [B, T, D] where given; depths [B, T] each row's depth in its tree (its
  // logical position less L_b: what a window counts from); attention scores soft-capped at softcap (0: none); a
  // GELU-tanh MLP.
  const int64_t* windows = nullptr;
  const T* cos_local = nullptr;
  const T* sin_local = nullptr;
  const int64_t* depths = nullptr;
  float softcap = 0.f;
  bool gelu = false;
  // The last layer stops once its K/V are written (a causal chunk whose outputs nobody reads: the caller wants the
  // cache; h and the outputs are left as they were).
  bool kv_only = false;

  // Offset of logical position p of sequence b in one cache plane, in elements, at KV head 0.
  int64_t row_offset(int64_t b, int64_t p) const {
    const int64_t block = block_table != nullptr ? block_table[b * max_blocks + p / block_size] : b;
    return (block * block_size + p % block_size) * Hkv * D;
  }
  T* plane(int64_t layer, int64_t which) const { return kv + (layer * 2 + which) * num_blocks * block_size * Hkv * D; }
};

// Cache row offsets (KV head 0) of every position 0 .. L_b + T - 1 of every sequence, concatenated (sequence b from
// cu[b]): what key_rows reads, computed once per forward and shared by every layer and query row. Rebuilt per layer
// and unit, with a division per key, it was ~3% of a draft forward at L = 64.
template <typename T>
void position_rows(const Problem<T>& p, std::vector<int64_t>& rows, std::vector<int64_t>& cu) {
  cu.assign(p.B + 1, 0);
  for (int64_t b = 0; b < p.B; ++b) cu[b + 1] = cu[b] + p.cache_seqlens[b] + p.T_;
  rows.resize(cu[p.B]);
  for (int64_t b = 0; b < p.B; ++b) {
    int64_t* out = rows.data() + cu[b];
    const int64_t n = cu[b + 1] - cu[b];
    for (int64_t pos = 0; pos < n; pos += p.block_size - pos % p.block_size) {  // one block per step
      const int64_t first = p.row_offset(b, pos), count = std::min(n - pos, p.block_size - pos % p.block_size);
      for (int64_t i = 0; i < count; ++i) out[pos + i] = first + i * p.Hkv * p.D;
    }
  }
}

// The keys a query row sees, in attention order, as row offsets of the sequence's positions (`positions`: sequence
// b's part of position_rows' table, cache offsets at KV head 0): the prefix 0 .. L_b - 1,
// then the tree slots its mask allows. Plain decoding of the same token sees the same list (its ancestors are then
// committed positions, in the same order), so every sum below runs over the same index sequence in both: the
// attention of a tree node equals plain decoding's bit for bit. Slots the mask hides are not in the list. With a
// `window` (> 0; p.depths then set), the row at logical position L_b + depth sees only positions past that less the
// window, a tree slot at L_b plus its own depth. Returns the first prefix position in the list.
template <typename T>
int64_t key_rows(const Problem<T>& p, const int64_t* positions, int64_t b, int64_t t, std::vector<int64_t>& rows,
                 int64_t window = 0) {
  const int64_t L = p.cache_seqlens[b];
  const bool* mask = p.tree_mask + (b * p.T_ + t) * p.T_;  // [T]
  const int64_t* depth = window > 0 ? p.depths + b * p.T_ : nullptr;  // [T]
  const int64_t first = window > 0 ? std::max<int64_t>(0, L + depth[t] - window + 1) : 0;  // the first position seen
  const int64_t start = std::min(first, L);
  rows.assign(positions + start, positions + L);
  for (int64_t j = 0; j < p.T_; ++j) {
    if (mask[j] && (depth == nullptr || L + depth[j] >= first)) rows.push_back(positions[L + j]);
  }
  return start;
}

// Attention of G query heads q [G, D] (float32) over the keys at `rows` (n of them) of one KV head of k / v planes
// (pointers already offset to the head), into out [G, D]. p [G, n] is scratch for the scores and probabilities.
// The scores are soft-capped (soft_cap, which keeps a score of +-inf itself: none reaches it, the keys a query does
// not see are not in `rows`; softcap 0: none) before the softmax. Scalar version: sequential sums in key order.
template <typename T>
void attend_scalar(const T* k, const T* v, const int64_t* rows, int64_t n, const float* q, int64_t G, int64_t D,
                   float scale, float softcap, float* p, float* out) {
  for (int64_t g = 0; g < G; ++g) {
    float* s = p + g * n;
    for (int64_t j = 0; j < n; ++j) s[j] = simd::dot8(q + g * D, k + rows[j], D) * scale;
    if (softcap > 0.f) soft_cap(s, s, n, softcap);
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = std::exp(s[j] - mx);
      sum += s[j];
    }
    float* o = out + g * D;
    std::fill(o, o + D, 0.f);
    for (int64_t j = 0; j < n; ++j) axpy_scalar(s[j], v + rows[j], o, D);
    const float inv = n > 0 ? 1.f / sum : 0.f;  // a row that sees nothing (L_b = 0, all-False mask row): zeros
    for (int64_t i = 0; i < D; ++i) o[i] *= inv;
  }
}

#if SPECDEC_DECODER_X86
// Keys rows[j0 .. j0 + count) (count <= 16; cache row offsets) transposed into staged [D, 16] float32: element d of
// key j at staged[16 d + j], the missing keys' lanes zero. Whole groups of 16 32-bit words (16 float32 elements, or
// 32 bfloat16 ones in pairs) go through transpose16, which moves bits; the bfloat16 pairs are then widened exactly.
template <typename T>
SPECDEC_AVX512 void stage_keys_avx512(const T* k, const int64_t* rows, int64_t count, int64_t D, float* staged) {
  constexpr int64_t kPer = std::is_same_v<T, float> ? 16 : 32;  // elements per 32-bit word group
  int64_t d0 = 0;
  for (; d0 + kPer <= D; d0 += kPer) {
    __m512 r[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      r[j] = j < count ? _mm512_castsi512_ps(_mm512_loadu_si512(k + rows[j] + d0)) : _mm512_setzero_ps();
    }
    simd::transpose16(r);  // r[i] lane j: word i of key j
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      if constexpr (std::is_same_v<T, float>) {
        _mm512_storeu_ps(staged + (d0 + i) * 16, r[i]);
      } else {  // word i: elements 2i (its low half) and 2i + 1
        const __m512i w = _mm512_castps_si512(r[i]);
        _mm512_storeu_ps(staged + (d0 + 2 * i) * 16, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
        _mm512_storeu_ps(staged + (d0 + 2 * i + 1) * 16,
                         _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))));
      }
    }
  }
  for (; d0 < D; ++d0) {  // a head size with a partial group
    for (int64_t j = 0; j < 16; ++j) staged[d0 * 16 + j] = j < count ? to_f(k[rows[j] + d0]) : 0.f;
  }
}

// H heads' scores against one staged block of 16 keys (stage_keys_avx512), scaled, into p + h ld for head h: each
// head's 16 scores are one vector, summed over d = 0, 1, ..., D - 1 by one multiply-add each (H chains side by
// side, each staged row loaded once for all of them).
template <int H>
SPECDEC_AVX512 inline void score_block_avx512(const float* staged, const float* q, int64_t D, __m512 scale,
                                              __mmask16 live, float* p, int64_t ld) {
  __m512 acc[H];
#pragma GCC unroll 8
  for (int h = 0; h < H; ++h) acc[h] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 kv = _mm512_loadu_ps(staged + d * 16);
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(q[h * D + d]), kv, acc[h]);
  }
#pragma GCC unroll 8
  for (int h = 0; h < H; ++h) _mm512_mask_storeu_ps(p + h * ld, live, _mm512_mul_ps(acc[h], scale));
}

// Scores of `heads` query heads (q [heads, D], float32) against the keys at rows[from .. to) (cache row offsets),
// scaled, into p + h ld + j for head h and key j. 16 keys at a time, transposed once into `staged` (16 D floats) for
// all the heads, 8 heads' sums at a time: a key's score is the same sequence of operations whichever keys share its
// block and whichever heads run beside it.
template <typename T>
SPECDEC_AVX512 void score_keys_avx512(const T* k, const int64_t* rows, int64_t from, int64_t to, const float* q,
                                      int64_t heads, int64_t D, float scale, float* staged, float* p, int64_t ld) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t j0 = from; j0 < to; j0 += 16) {
    const int64_t count = std::min<int64_t>(16, to - j0);
    const __mmask16 live = count == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
    for (int64_t j = j0 + kKeysAhead; j < std::min(j0 + 16 + kKeysAhead, to); ++j) prefetch_row(k + rows[j], D);
    stage_keys_avx512(k, rows + j0, count, D, staged);
    for (int64_t g = 0; g < heads; g += 8) {
      const float* qg = q + g * D;
      float* pg = p + g * ld + j0;
      switch (std::min<int64_t>(8, heads - g)) {
        case 8: score_block_avx512<8>(staged, qg, D, scale_v, live, pg, ld); break;
        case 7: score_block_avx512<7>(staged, qg, D, scale_v, live, pg, ld); break;
        case 6: score_block_avx512<6>(staged, qg, D, scale_v, live, pg, ld); break;
        case 5: score_block_avx512<5>(staged, qg, D, scale_v, live, pg, ld); break;
        case 4: score_block_avx512<4>(staged, qg, D, scale_v, live, pg, ld); break;
        case 3: score_block_avx512<3>(staged, qg, D, scale_v, live, pg, ld); break;
        case 2: score_block_avx512<2>(staged, qg, D, scale_v, live, pg, ld); break;
        default: score_block_avx512<1>(staged, qg, D, scale_v, live, pg, ld); break;
      }
    }
  }
}

// s [n] scores -> their exponentials less the max, in place; returns their sum, summed in lanes by index (index j in
// lane j % 16, one fixed reduction at the end).
SPECDEC_AVX512 inline float exp_scores_avx512(float* s, int64_t n) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 live = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
    mx = _mm512_mask_max_ps(mx, live, mx, _mm512_maskz_loadu_ps(live, s + j));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 live = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(live, simd::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), m)));
    _mm512_mask_storeu_ps(s + j, live, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// The attention of R query rows of G heads each (q [R G, D], float32) over one KV head's keys (k / v planes already
// offset to the head), into out [R G, D]: row r over the keys at keys[r] (n[r] cache row offsets), whose first S are
// the same for every row (a verify's or a prompt chunk's rows share the prefix). The shared keys and their values
// are read and widened once for all R G heads, each row's own keys for its G heads. Every head's sums are its own and
// run as for one row alone: the scores (score_keys_avx512), the max and the exponentials by vectors, the softmax sum
// by list index (exp_scores_avx512), then the weighted sum of V rows in list order (the shared keys', then the row's
// own continuing from them). p [R G, ld] (ld >= every n[r]) is scratch for the scores; the scores are soft-capped
// (soft_cap, which keeps a score of +-inf itself; softcap 0: none) before the softmax.
template <typename T>
SPECDEC_AVX512 void attend_avx512(const T* k, const T* v, const int64_t* const* keys, const int64_t* n, int64_t R,
                                  int64_t S, const float* q, int64_t G, int64_t D, float scale, float softcap,
                                  float* p, int64_t ld, float* out) {
  thread_local std::vector<float> staged, totals;
  staged.resize(static_cast<size_t>(16 * D));
  totals.resize(static_cast<size_t>(R * G));
  score_keys_avx512(k, keys[0], 0, S, q, R * G, D, scale, staged.data(), p, ld);
  for (int64_t r = 0; r < R; ++r) {
    score_keys_avx512(k, keys[r], S, n[r], q + r * G * D, G, D, scale, staged.data(), p + r * G * ld, ld);
    for (int64_t g = 0; g < G; ++g) {
      float* s = p + (r * G + g) * ld;
      if (softcap > 0.f) soft_cap(s, s, n[r], softcap);
      totals[r * G + g] = exp_scores_avx512(s, n[r]);
    }
  }
  weighted_sums_heads_avx512(p, ld, v, keys[0], S, D, R * G, out, false);
  for (int64_t r = 0; r < R; ++r) {
    weighted_sums_heads_avx512(p + r * G * ld + S, ld, v, keys[r] + S, n[r] - S, D, G, out + r * G * D, true);
    for (int64_t g = 0; g < G; ++g) {
      // a row that sees nothing (L_b = 0, all-False mask row): zeros
      const float inv = n[r] > 0 ? 1.f / totals[r * G + g] : 0.f;
      float* o = out + (r * G + g) * D;
      for (int64_t i = 0; i < D; ++i) o[i] *= inv;
    }
  }
}

// acc[c] += s[j] * v[rows[j] + 8c .. 8c + 7] for c < C over keys j in order: C * 8 elements' sums in registers (C
// a constant, so no lane checks or spills in the key loop).
template <int C, typename T>
SPECDEC_AVX2 inline void accumulate_values(const float* s, const T* v, const int64_t* rows, int64_t n, __m256* acc) {
  for (int64_t j = 0; j < n; ++j) {
    const __m256 a = _mm256_set1_ps(s[j]);
    const T* row = v + rows[j];
    if (j + kKeysAhead < n) prefetch_row(v + rows[j + kKeysAhead], 8 * C);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(a, simd::load8(row + 8 * c, 8), acc[c]);
  }
}

// o [D] = sum over keys j, in order, of s[j] * v[rows[j]]: one fused multiply-add per key and element from zero, as
// axpy_avx2 key by key does, with up to 64 elements' sums held in registers across the keys. Through memory, each
// key's adds waited on the previous key's stores (~10 cycles a key). D not a multiple of 8 takes axpy_avx2.
template <typename T>
SPECDEC_AVX2 void weighted_sum_avx2(const float* s, const T* v, const int64_t* rows, int64_t n, int64_t D, float* o) {
  if (D % 8 != 0) {
    std::fill(o, o + D, 0.f);
    for (int64_t j = 0; j < n; ++j) axpy_avx2(s[j], v + rows[j], o, D);
    return;
  }
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
    const int64_t chunks = std::min<int64_t>(8, (D - d0) / 8);
    switch (chunks) {
      case 8: accumulate_values<8>(s, v + d0, rows, n, acc); break;
      case 7: accumulate_values<7>(s, v + d0, rows, n, acc); break;
      case 6: accumulate_values<6>(s, v + d0, rows, n, acc); break;
      case 5: accumulate_values<5>(s, v + d0, rows, n, acc); break;
      case 4: accumulate_values<4>(s, v + d0, rows, n, acc); break;
      case 3: accumulate_values<3>(s, v + d0, rows, n, acc); break;
      case 2: accumulate_values<2>(s, v + d0, rows, n, acc); break;
      default: accumulate_values<1>(s, v + d0, rows, n, acc); break;
    }
    for (int64_t c = 0; c < chunks; ++c) _mm256_storeu_ps(o + d0 + 8 * c, acc[c]);
  }
}

// The same with AVX2: 8 keys at a time (reduce8 leaves key j0 + j's score in lane j), the softmax sum in lanes by list
// index (index j in lane j % 8).
template <typename T>
SPECDEC_AVX2 void attend_avx2(const T* k, const T* v, const int64_t* rows, int64_t n, const float* q, int64_t G,
                              int64_t D, float scale, float softcap, float* p, float* out) {
  const __m256 scale_v = _mm256_set1_ps(scale);
  alignas(32) float block[8];
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t count = std::min<int64_t>(8, n - j0);
    for (int64_t j = j0 + kKeysAhead; j < std::min(j0 + 8 + kKeysAhead, n); ++j) prefetch_row(k + rows[j], D);
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      if (count == 8 && D % 8 == 0) {  // whole vectors of 8 keys: no lane checks (the same sums)
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(q + g * D + d);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, simd::load8(k + rows[j0 + j] + d, 8), acc[j]);
        }
      } else {
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = simd::load8(q + g * D + d, D - d);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) {
            if (j < count) acc[j] = _mm256_fmadd_ps(qv, simd::load8(k + rows[j0 + j] + d, D - d), acc[j]);
          }
        }
      }
      _mm256_store_ps(block, _mm256_mul_ps(simd::reduce8(acc), scale_v));
      std::memcpy(p + g * n + j0, block, static_cast<size_t>(count) * sizeof(float));
    }
  }
  if (softcap > 0.f) soft_cap(p, p, G * n, softcap);
  for (int64_t g = 0; g < G; ++g) {
    float* s = p + g * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
    const __m256 m = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
      const int64_t count = std::min<int64_t>(8, n - j);
      _mm256_store_ps(block, simd::exp8(_mm256_sub_ps(simd::load8(s + j, count), m)));
      for (int64_t i = count; i < 8; ++i) block[i] = 0.f;  // (padding lanes: e^(0 - max))
      std::memcpy(s + j, block, static_cast<size_t>(count) * sizeof(float));
      sum = _mm256_add_ps(sum, _mm256_load_ps(block));
    }
    const float total = simd::reduce_add8(sum);
    float* o = out + g * D;
    weighted_sum_avx2(s, v, rows, n, D, o);
    const float inv = n > 0 ? 1.f / total : 0.f;  // a row that sees nothing (L_b = 0, all-False mask row): zeros
    for (int64_t i = 0; i < D; ++i) o[i] *= inv;
  }
}
#endif

template <typename T>
void attend(const T* k, const T* v, const int64_t* rows, int64_t n, const float* q, int64_t G, int64_t D, float scale,
            float softcap, float* p, float* out) {
#if SPECDEC_DECODER_X86
  if (cpu_has_avx512()) return attend_avx512(k, v, &rows, &n, 1, n, q, G, D, scale, softcap, p, n, out);
  if (cpu_has_avx2()) return attend_avx2(k, v, rows, n, q, G, D, scale, softcap, p, out);
#endif
  attend_scalar(k, v, rows, n, q, G, D, scale, softcap, p, out);
}

// attend_avx512 over R rows sharing their first S keys (see there), where attends_row_sets holds.
template <typename T>
void attend_rows(const T* k, const T* v, const int64_t* const* keys, const int64_t* n, int64_t R, int64_t S,
                 const float* q, int64_t G, int64_t D, float scale, float softcap, float* p, int64_t ld, float* out) {
#if SPECDEC_DECODER_X86
  if (cpu_has_avx512()) return attend_avx512(k, v, keys, n, R, S, q, G, D, scale, softcap, p, ld, out);
#endif
  TORCH_CHECK(false, "attend_rows: AVX-512 only (attends_row_sets)");
}

// The most query rows one attend_avx512 call takes (one set of a verify's or a prompt chunk's rows).
constexpr int64_t kMaxSharedRows = 16;

// A row set's scores' most bytes (kMaxSharedRows aside): past L2 they slowed the sets more than their shared reads
// gained.
constexpr int64_t kSetScoreBytes = 256 << 10;

// Whether a forward's attention runs in row sets (attend_avx512 over several query rows of one sequence and KV head,
// sharing their common keys): on AVX-512 and where a sequence has several query rows (a verify, a prompt chunk).
inline bool attends_row_sets(int64_t T) { return cpu_has_avx512() && T >= 2; }

}  // namespace
}  // namespace specdec
