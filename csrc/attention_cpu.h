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
// b's part of position_rows' table, cache offsets at KV head 0; or widen_positions' rows): the prefix 0 .. L_b - 1,
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
// The same with AVX-512: scores 16 keys at a time (each key's dot summed lane-wise over D, then by reduce16's fixed
// tree: a key's score does not depend on which keys share its block), the max and the exponentials by vectors, the
// softmax sum in lanes by list index (index j in lane j % 16, one fixed reduction at the end), and the weighted sum
// of V rows in list order. Each key's and value's bf16 row is widened once for the G query heads of its KV head.
// `in_place` (float32 keys only): the first in_place keys are rows k + j * D (j the list index, D a multiple of 16),
// read where they lie instead of staged (widen_positions made them once for every query row that shares them).
template <typename T>
SPECDEC_AVX512 void attend_avx512(const T* k, const T* v, const int64_t* rows, int64_t n, const float* q, int64_t G,
                                  int64_t D, float scale, float softcap, float* p, float* out, int64_t in_place = 0) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  // bf16 keys are widened once per block of 16 into kf (fp32, D padded to 16 with zeros, as load16's masked tail
  // reads them) for all G heads: the same products and sums as widening them head by head
  const int64_t Dp = (D + 15) / 16 * 16;
  thread_local std::vector<float> widened;
  widened.resize(static_cast<size_t>(16 * Dp));
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - j0);
    const __mmask16 live = count == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
    const float* kf = widened.data();
    if constexpr (std::is_same_v<T, float>) {
      if (j0 + 16 <= in_place) kf = k + j0 * D;
    }
    for (int64_t j = 0; kf == widened.data() && j < count; ++j) {
      const T* row = k + rows[j0 + j];
      if (j0 + j + kKeysAhead < n) prefetch_row(k + rows[j0 + j + kKeysAhead], D);
      float* staged = widened.data() + j * Dp;
      if (D == 64) {  // the common head size: four full vectors, no masks
#pragma GCC unroll 4
        for (int64_t d = 0; d < 64; d += 16) _mm512_storeu_ps(staged + d, load16(row + d, 16));
      } else {
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(staged + d, load16(row + d, D - d));
      }
    }
    // a short last block's missing keys as zeros: every block then runs the same 16 unconditional chains (the dead
    // lanes are not stored, and no chain mixes into another's lane)
    if (kf == widened.data()) std::fill(widened.data() + count * Dp, widened.data() + 16 * Dp, 0.f);
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 qv = load16(q + g * D + d, D - d);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          const int slot = 4 * (j % 4) + j / 4;  // reduce16 leaves acc[slot] in lane j
          acc[slot] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kf + j * Dp + d), acc[slot]);
        }
      }
      _mm512_mask_storeu_ps(p + g * n + j0, live, _mm512_mul_ps(simd::reduce16(acc), scale_v));
    }
  }
  if (softcap > 0.f) soft_cap(p, p, G * n, softcap);
  thread_local std::vector<float> totals;  // [G]: each head's softmax sum
  totals.resize(static_cast<size_t>(G));
  for (int64_t g = 0; g < G; ++g) {
    float* s = p + g * n;
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
    totals[g] = _mm512_reduce_add_ps(sum);
  }
  weighted_sums_heads_avx512(p, n, v, rows, n, D, G, out);  // each V row widened once for the G heads
  for (int64_t g = 0; g < G; ++g) {
    const float inv = n > 0 ? 1.f / totals[g] : 0.f;  // a row that sees nothing (L_b = 0, all-False mask row): zeros
    for (int64_t i = 0; i < D; ++i) out[g * D + i] *= inv;
  }
}

template <typename T>
SPECDEC_AVX512 void widen_positions_avx512(const T* k, const T* v, const int64_t* rows, int64_t n, int64_t D,
                                           float* kf, float* vf) {
  for (int64_t j = 0; j < n; ++j) {
    convert_row_avx512(k + rows[j], kf + j * D, D);
    convert_row_avx512(v + rows[j], vf + j * D, D);
  }
}

// acc[c] += s[j] * v[rows[j] + 8c .. 8c + 7] for c < C over keys j in order: C * 8 elements' sums in registers (C
// a constant, so no lane checks or spills in the key loop).
template <int C, typename T>
SPECDEC_AVX2 inline void accumulate_values(const float* s, const T* v, const int64_t* rows, int64_t n, __m256* acc) {
  for (int64_t j = 0; j < n; ++j) {
    const __m256 a = _mm256_set1_ps(s[j]);
    const T* row = v + rows[j];
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
            float softcap, float* p, float* out, int64_t in_place = 0) {
#if SPECDEC_DECODER_X86
  if (cpu_has_avx512()) return attend_avx512(k, v, rows, n, q, G, D, scale, softcap, p, out, in_place);
  if (cpu_has_avx2()) return attend_avx2(k, v, rows, n, q, G, D, scale, softcap, p, out);
#endif
  attend_scalar(k, v, rows, n, q, G, D, scale, softcap, p, out);
}

// Whether a worker's attention widens each sequence's keys and values once per KV head (widen_positions) for all the
// query rows it attends there: on AVX-512, D a multiple of 16, and several query rows (T >= 2: a verify or a prompt
// chunk) making at least two units per worker and KV head (T * groups of them; one would only copy them twice).
inline bool widens_once(int64_t D, int64_t T, int64_t groups, int64_t workers) {
  return cpu_has_avx512() && D % 16 == 0 && T >= 2 && T * groups >= 2 * workers;
}

// Keys and values of the n positions at `rows` (cache row offsets, already at the KV head) as float32 rows [n, D]
// in kf and vf: the floats attend_avx512 stages per block of 16, so reading them (attend's in_place) changes no sum.
template <typename T>
void widen_positions(const T* k, const T* v, const int64_t* rows, int64_t n, int64_t D, float* kf, float* vf) {
#if SPECDEC_DECODER_X86
  if (cpu_has_avx512()) return widen_positions_avx512(k, v, rows, n, D, kf, vf);
#endif
  for (int64_t j = 0; j < n; ++j) {
    convert_row(k + rows[j], kf + j * D, D);
    convert_row(v + rows[j], vf + j * D, D);
  }
}

}  // namespace
}  // namespace specdec
