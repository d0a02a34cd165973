// The stack of Llama-family decoder layers on a KV cache (run_layers), the checks of a model's tensors and of one
// call's inputs, and one forward (forward): shared by the decoder_layers op (csrc/decoder_layers_cpu.cpp) and the
// native step runners (csrc/runner_cpu.cpp).
#pragma once

#include <algorithm>
#include <array>

#include "attention_cpu.h"
#include "native_model.h"

namespace specdec {
namespace {

// The weights of one layer as the Python side passes them (spec_kernels/decoder_layers/ref.py: LAYER_FIELDS), in order.
enum LayerField : int {
  kInputNorm = 0,  // [H]
  kQkv,            // [(Hq + 2 Hkv) D, H], or [(Hq + Hkv) D, H] where kV holds the v rows apart
  kQkvBias,        // [(Hq + 2 Hkv) D] or undefined
  kO,              // [H, Hq D]
  kPostNorm,       // [H]
  kGateUp,         // [2 I, H]: gate rows, then up rows
  kDown,           // [H, I]
  kQNorm,          // [D] or undefined (Qwen3)
  kKNorm,          // [D] or undefined
  kV,              // [Hkv D, H] or undefined: v's rows apart from q/k's (a GGUF file's v in a format of its own)
  kAttnOutNorm,    // [H] or undefined: Gemma's norm of the attention's output, before the residual add
  kMlpOutNorm,     // [H] or undefined: Gemma's norm of the MLP's output
  kNumFields,
};
const char* const kFieldNames[kNumFields] = {"input_norm", "qkv",    "qkv_bias", "o", "post_norm",     "gate_up",
                                             "down",       "q_norm", "k_norm",   "v", "attn_out_norm", "mlp_out_norm"};

// A norm's weight may be float32 under a bfloat16 model (Gemma's 1 + w, which bfloat16 would round): rms_norm reads
// it in its own dtype, the product rounded once either way.
template <typename T, typename O>
void norm_rows(const float* x, int64_t ldx, const at::Tensor& w, float eps, O* out, int64_t rows, int64_t n) {
  if (w.scalar_type() == at::kFloat) return rms_norm(x, ldx, w.data_ptr<float>(), eps, out, rows, n);
  rms_norm(x, ldx, w.data_ptr<T>(), eps, out, rows, n);
}

// gelu_tanh(g) = g / 2 (1 + tanh(c (g + 0.044715 g^3))), c = sqrt(2 / pi); tanh(y) = 1 - 2 / (e^(2y) + 1) (an
// overflowing e^(2y) gives 1).
constexpr float kGeluC = 0.7978845608028654f, kGeluA = 0.044715f;

template <typename T>
void gelu_tanh_mul_scalar(const T* gate, const T* up, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = to_f(gate[i]);
    const float th = 1.f - 2.f / (std::exp(2.f * kGeluC * (g + kGeluA * g * g * g)) + 1.f);
    out[i] = static_cast<T>(0.5f * g * (1.f + th) * to_f(up[i]));
  }
}


template <typename T>
void silu_mul_scalar(const T* gate, const T* up, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = to_f(gate[i]);
    out[i] = static_cast<T>(g / (1.f + std::exp(-g)) * to_f(up[i]));
  }
}

#if SPECDEC_DECODER_X86
template <typename T>
SPECDEC_AVX512 void silu_mul_avx512(const T* gate, const T* up, T* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t count = std::min<int64_t>(16, n - i);
    const __m512 g = load16(gate + i, count);
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 e = simd::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    store16(out + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), load16(up + i, count)), count);
  }
}

template <typename T>
SPECDEC_AVX2 void silu_mul_avx2(const T* gate, const T* up, T* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t count = std::min<int64_t>(8, n - i);
    const __m256 g = simd::load8(gate + i, count);
    const __m256 e = simd::exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    simd::store8(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), simd::load8(up + i, count)), count);
  }
}
#endif

template <typename T>
void silu_mul(const T* gate, const T* up, T* out, int64_t n) {
#if SPECDEC_DECODER_X86
  if (cpu_has_avx512()) return silu_mul_avx512(gate, up, out, n);
  if (cpu_has_avx2()) return silu_mul_avx2(gate, up, out, n);
#endif
  silu_mul_scalar(gate, up, out, n);
}

#if SPECDEC_DECODER_X86
template <typename T>
SPECDEC_AVX512 void gelu_tanh_mul_avx512(const T* gate, const T* up, T* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f), half = _mm512_set1_ps(0.5f);
  const __m512 c2 = _mm512_set1_ps(2.f * kGeluC), a = _mm512_set1_ps(kGeluA);
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t count = std::min<int64_t>(16, n - i);
    const __m512 g = load16(gate + i, count);
    const __m512 y = _mm512_mul_ps(c2, _mm512_add_ps(g, _mm512_mul_ps(a, _mm512_mul_ps(_mm512_mul_ps(g, g), g))));
    const __m512 th = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(simd::exp16(y), one)));
    const __m512 gelu = _mm512_mul_ps(_mm512_mul_ps(half, g), _mm512_add_ps(one, th));
    store16(out + i, _mm512_mul_ps(gelu, load16(up + i, count)), count);
  }
}

template <typename T>
SPECDEC_AVX2 void gelu_tanh_mul_avx2(const T* gate, const T* up, T* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f), half = _mm256_set1_ps(0.5f);
  const __m256 c2 = _mm256_set1_ps(2.f * kGeluC), a = _mm256_set1_ps(kGeluA);
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t count = std::min<int64_t>(8, n - i);
    const __m256 g = simd::load8(gate + i, count);
    const __m256 y = _mm256_mul_ps(c2, _mm256_add_ps(g, _mm256_mul_ps(a, _mm256_mul_ps(_mm256_mul_ps(g, g), g))));
    const __m256 th = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(simd::exp8(y), one)));
    const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_add_ps(one, th));
    simd::store8(out + i, _mm256_mul_ps(gelu, simd::load8(up + i, count)), count);
  }
}
#endif

// The MLP's activation times up: SiLU (Llama) or GELU-tanh (Gemma).
template <typename T>
void act_mul(bool gelu, const T* gate, const T* up, T* out, int64_t n) {
  if (!gelu) return silu_mul(gate, up, out, n);
#if SPECDEC_DECODER_X86
  if (cpu_has_avx512()) return gelu_tanh_mul_avx512(gate, up, out, n);
  if (cpu_has_avx2()) return gelu_tanh_mul_avx2(gate, up, out, n);
#endif
  gelu_tanh_mul_scalar(gate, up, out, n);
}

template <typename T>
const T* ptr(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

// h [M, H] float32: the residual stream, updated in place through every layer; out [M, H]: the final-normed h;
// with `head` [V, H] (dense or GGUF blocks) also logits [M, V] = out head^T. One team (csrc/cpu_team.h) runs the
// whole stack, the logits included: each stage is split across its workers (matmuls by weight-row blocks, attention
// by units, the row-wise pieces by rows of h) with a sync between stages. As ~5 at::parallel_for regions per layer,
// the fork / join cost dominated the small stages and left the second thread idle through every row-wise piece; the
// logits as a region of their own cost a few percent of a draft forward.
template <typename T>
void run_layers(const Problem<T>& p, const std::vector<at::Tensor>& weights, const at::Tensor& final_norm, float* h,
                T* out, const Weight& head = {}, int64_t V = 0, T* logits = nullptr) {
  const int64_t M = p.B * p.T_, H = p.H, D = p.D, Hq = p.Hq, Hkv = p.Hkv, I = p.I, G = Hq / Hkv;
  const int64_t qkv_width = (Hq + 2 * Hkv) * D;
  std::vector<T> x(M * std::max(H, I)), qkv(M * qkv_width), attn(M * Hq * D), gate_up(M * 2 * I), delta(M * H);
  std::vector<float> qk(M * (Hq + Hkv) * D), attn_f(M * Hq * D);  // float32 q/k after norms and RoPE; attention
  // Gemma: a block's output widened for its own norm (kAttnOutNorm, kMlpOutNorm) before it joins h
  const bool sandwich = weights.size() >= kNumFields &&
                        (weights[kAttnOutNorm].defined() || weights[kMlpOutNorm].defined());  // (every layer alike)
  std::vector<float> block_out(sandwich ? M * H : 0);
  // Each worker's key list and scores, sized here: nothing inside the team may allocate (an exception cannot leave
  // it).
  int64_t max_keys = 0;
  for (int64_t b = 0; b < p.B; ++b) max_keys = std::max(max_keys, p.cache_seqlens[b] + p.T_);
  std::vector<int64_t> positions, cu_positions;  // [sum_b (L_b + T)], [B + 1]
  position_rows(p, positions, cu_positions);
  const int64_t max_workers = team_size();
  std::vector<std::vector<int64_t>> key_lists(max_workers);
  std::vector<std::vector<float>> score_bufs(max_workers);
  // Row sets (attends_row_sets): each worker's keys of up to kMaxSharedRows rows, their scores, q and outputs
  const bool row_sets = attends_row_sets(p.T_);
  const int64_t set_rows = row_sets ? std::min(kMaxSharedRows, p.T_) : 1;
  std::vector<std::vector<std::vector<int64_t>>> set_keys(max_workers);
  std::vector<std::vector<float>> set_q(max_workers), set_out(max_workers);
  for (int64_t i = 0; i < max_workers; ++i) {
    // (a set's rows are as many as keep R G (L_b + T) scores within kSetScoreBytes, or one)
    key_lists[i].reserve(max_keys);
    score_bufs[i].reserve(row_sets ? std::max(kSetScoreBytes / int64_t{sizeof(float)}, G * max_keys) : G * max_keys);
    if (!row_sets) continue;
    set_keys[i].resize(set_rows);
    for (auto& keys : set_keys[i]) keys.reserve(max_keys);
    set_q[i].resize(set_rows * G * D), set_out[i].resize(set_rows * G * D);
  }
  // Row sets' split over the workers: (b, KV head, t) in order, each worker a contiguous run of about equal keys
  // (a causal chunk's later rows have more), so a worker's rows of one sequence and KV head share their keys' reads.
  // cost_end[i]: the keys of the first i + 1 of them.
  std::vector<int64_t> cost_end;
  if (row_sets) {
    cost_end.resize(p.B * Hkv * p.T_);
    std::vector<int64_t> row_keys(p.T_);
    int64_t total = 0;
    for (int64_t b = 0; b < p.B; ++b) {
      for (int64_t t = 0; t < p.T_; ++t) {
        const bool* mask = p.tree_mask + (b * p.T_ + t) * p.T_;  // [T]
        row_keys[t] = p.cache_seqlens[b] + std::count(mask, mask + p.T_, true) + 1;
      }
      for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
        for (int64_t t = 0; t < p.T_; ++t) {
          total += row_keys[t];
          cost_end[(b * Hkv + kvh) * p.T_ + t] = total;
        }
      }
    }
  }

  run_team([&](const Worker& w) {
    std::vector<int64_t>& keys = key_lists[w.id()];
    std::vector<float>& scores = score_bufs[w.id()];
    const auto [m_begin, m_end] = w.share(M);  // this worker's rows of h in the row-wise stages
    const int64_t my_rows = m_end - m_begin;
    // Attention units without row sets (a decode token; CPUs without AVX-512): (b, t, KV head, a group of its G
    // query heads). A group shares each key's loads across its heads, so a unit is all G heads, except where the units
    // would not spread evenly over the workers: then the G heads split into `groups` parts (with one KV head, a decode
    // token would be a single unit, on one thread). With AVX-512 a unit transposes each block of keys once for its
    // heads (score_keys_avx512), which a split would repeat: there the heads split only where the units are fewer
    // than the workers. Each head's sums are its own, so the split changes no value. Workers take every size()-th
    // unit: a causal chunk's later rows have more keys.
    const int64_t rows_units = M * Hkv;
    const bool whole = cpu_has_avx512() ? rows_units >= w.size()
                                        : rows_units % w.size() == 0 || rows_units >= 4 * w.size();
    const int64_t groups = whole ? 1 : std::min(G, w.size());
    const int64_t per_group = (G + groups - 1) / groups;
    const int64_t num_units = rows_units * groups;
    // this worker's row sets: the (b, KV head, t) whose keys' midpoint falls in its share of all the keys
    int64_t set_begin = 0, set_end = 0;
    if (!cost_end.empty()) {
      const int64_t total = cost_end.back();
      const auto owner = [&](int64_t i) {
        const int64_t mid2 = cost_end[i] + (i > 0 ? cost_end[i - 1] : 0);  // twice the midpoint of its keys
        return std::min<int64_t>(w.size() - 1, mid2 * w.size() / (2 * total));
      };
      const int64_t n_pairs = static_cast<int64_t>(cost_end.size());
      while (set_begin < n_pairs && owner(set_begin) < w.id()) ++set_begin;
      set_end = set_begin;
      while (set_end < n_pairs && owner(set_end) == w.id()) ++set_end;
    }
    // A block's output (delta, this worker's rows) joins the residual stream: through its own norm where the layer
    // has one (Gemma's sandwich norms: rounded to T as the block's output is), else as it is.
    const auto join = [&](const at::Tensor& out_norm) {
      if (out_norm.defined()) {
        convert_row(delta.data() + m_begin * H, block_out.data() + m_begin * H, my_rows * H);
        norm_rows<T>(block_out.data() + m_begin * H, H, out_norm, p.eps, delta.data() + m_begin * H, my_rows, H);
      }
      for (int64_t i = m_begin * H; i < m_end * H; ++i) h[i] += to_f(delta[i]);
    };

    for (int64_t l = 0; l < p.num_layers; ++l) {
      const at::Tensor* wl = weights.data() + l * kNumFields;
      T* k_plane = p.plane(l, 0);
      T* v_plane = p.plane(l, 1);
      for (int64_t c = 0; c < p.num_capture; ++c) {
        if (p.capture[c] != l) continue;
        for (int64_t m = m_begin; m < m_end; ++m) {
          T* dst = p.features + (m * p.num_capture + c) * H;
          convert_row(h + m * H, dst, H);
        }
      }
      const bool given = l == 0 && p.attn_in != nullptr;  // EAGLE-3: the caller built the attention input
      const T* qkv_in = given ? p.attn_in : x.data();
      const int64_t qkv_k = given ? p.attn_width : H;
      if (!given) norm_rows<T>(h + m_begin * H, H, wl[kInputNorm], p.eps, x.data() + m_begin * H, my_rows, H);
      w.sync();
      // qkv: [M, (Hq + 2 Hkv) D], or with v apart [M, (Hq + Hkv) D] then v's [M, Hkv D] (one stage: no sync between)
      const bool v_apart = wl[kV].defined();
      const int64_t qk_width = v_apart ? (Hq + Hkv) * D : qkv_width;
      const T* bias = ptr<T>(wl[kQkvBias]);
      linear(w, qkv_in, weight_of(wl[kQkv], qkv_k), bias, qkv.data(), M, qk_width, qkv_k);
      if (v_apart) {
        linear(w, qkv_in, weight_of(wl[kV], qkv_k), bias == nullptr ? nullptr : bias + qk_width,
               qkv.data() + M * qk_width, M, Hkv * D, qkv_k);
      }
      w.sync();
      // q / k heads one by one (a decode token's 4-6 heads then spread over the workers): float32, norms, RoPE;
      // a KV head's K and V then go to the cache
      const int64_t window = p.windows != nullptr ? p.windows[l] : 0;  // 0: none
      const bool local = window > 0 && p.cos_local != nullptr;  // the windowed layers' own RoPE (Gemma 3)
      const T* cos = local ? p.cos_local : p.cos;
      const T* sin = local ? p.sin_local : p.sin;
      const bool kv_only = p.kv_only && l + 1 == p.num_layers;  // (then its queries feed nothing)
      const auto [hd_begin, hd_end] = w.share(M * (Hq + Hkv));
      for (int64_t u = hd_begin; u < hd_end; ++u) {
        const int64_t m = u / (Hq + Hkv), hd = u % (Hq + Hkv);
        if (kv_only && hd < Hq) continue;
        const T* row = qkv.data() + m * qk_width;  // [Hq D | Hkv D] (then [Hkv D] of v, where not apart)
        float* head = qk.data() + u * D;           // [D] of qk's row m: [Hq D | Hkv D]
        convert_row(row + hd * D, head, D);
        if (wl[kQNorm].defined()) norm_rows<T>(head, D, wl[hd < Hq ? kQNorm : kKNorm], p.eps, head, 1, D);
        rope_head(head, cos + m * D, sin + m * D, D);
        if (hd < Hq) continue;
        const int64_t b = m / p.T_, t = m % p.T_;
        const int64_t dst = p.row_offset(b, p.cache_seqlens[b] + t) + (hd - Hq) * D;
        convert_row(head, k_plane + dst, D);
        const T* v_row = v_apart ? qkv.data() + M * qk_width + m * Hkv * D : row + (Hq + Hkv) * D;  // [Hkv D]
        std::copy(v_row + (hd - Hq) * D, v_row + (hd - Hq + 1) * D, v_plane + dst);  // V head hd - Hq
      }
      w.sync();
      if (kv_only) return;  // (every worker alike: no sync follows)
      if (row_sets) {
        for (int64_t i = set_begin; i < set_end;) {  // a run of one sequence's rows at one KV head, at most set_rows
          const int64_t b = i / (Hkv * p.T_), kvh = i / p.T_ % Hkv, t0 = i % p.T_;
          // at most as many rows as keep their scores [R G, L_b + T] within kSetScoreBytes (L2 holds them)
          const int64_t fit = kSetScoreBytes / static_cast<int64_t>(sizeof(float) * G * (p.cache_seqlens[b] + p.T_));
          const int64_t R = std::min({set_rows, p.T_ - t0, set_end - i, std::max<int64_t>(1, fit)});
          std::vector<std::vector<int64_t>>& lists = set_keys[w.id()];
          std::array<const int64_t*, kMaxSharedRows> set_lists;
          std::array<int64_t, kMaxSharedRows> counts;
          int64_t shared = std::numeric_limits<int64_t>::max(), longest = 0;
          for (int64_t r = 0; r < R; ++r) {
            key_rows(p, positions.data() + cu_positions[b], b, t0 + r, lists[r], window);
            set_lists[r] = lists[r].data(), counts[r] = static_cast<int64_t>(lists[r].size());
            longest = std::max(longest, counts[r]);
            // the keys every row of the set sees at the same places of its list (the prefix, at least)
            const int64_t common = std::min(shared, counts[r]);
            shared = std::mismatch(lists[0].begin(), lists[0].begin() + common, lists[r].begin()).first -
                     lists[0].begin();
          }
          float* q = set_q[w.id()].data();  // [R G, D]: the rows' query heads of this KV head
          for (int64_t r = 0; r < R; ++r) {
            const float* from = qk.data() + (b * p.T_ + t0 + r) * (Hq + Hkv) * D + kvh * G * D;
            std::copy(from, from + G * D, q + r * G * D);
          }
          scores.resize(R * G * longest);
          float* a = set_out[w.id()].data();  // [R G, D]
          attend_rows(k_plane + kvh * D, v_plane + kvh * D, set_lists.data(), counts.data(), R, shared, q, G, D,
                      p.scale, p.softcap, scores.data(), longest, a);
          for (int64_t r = 0; r < R; ++r) {
            convert_row(a + r * G * D, attn.data() + ((b * p.T_ + t0 + r) * Hq + kvh * G) * D, G * D);
          }
          i += R;
        }
      } else {
        int64_t keys_of = -1;  // the query row whose keys `keys` holds
        for (int64_t u = w.id(); u < num_units; u += w.size()) {
          const int64_t m = u / (Hkv * groups), kvh = u / groups % Hkv;
          const int64_t h0 = kvh * G + u % groups * per_group, heads = std::min(per_group, (kvh + 1) * G - h0);
          if (heads <= 0) continue;
          const int64_t b = m / p.T_;
          float* a = attn_f.data() + (m * Hq + h0) * D;  // [heads, D]
          const float* q = qk.data() + m * (Hq + Hkv) * D + h0 * D;
          if (m != keys_of) {  // the row's keys as offsets into the cache
            key_rows(p, positions.data() + cu_positions[b], b, m % p.T_, keys, window);
            keys_of = m;
          }
          scores.resize(heads * keys.size());
          attend(k_plane + kvh * D, v_plane + kvh * D, keys.data(), static_cast<int64_t>(keys.size()), q, heads, D,
                 p.scale, p.softcap, scores.data(), a);
          convert_row(a, attn.data() + (m * Hq + h0) * D, heads * D);
        }
      }
      w.sync();
      linear(w, attn.data(), weight_of(wl[kO], Hq * D), nullptr, delta.data(), M, H, Hq * D);
      w.sync();
      join(wl[kAttnOutNorm]);
      norm_rows<T>(h + m_begin * H, H, wl[kPostNorm], p.eps, x.data() + m_begin * H, my_rows, H);
      w.sync();
      linear(w, x.data(), weight_of(wl[kGateUp], H), nullptr, gate_up.data(), M, 2 * I, H);
      w.sync();
      // the activation, elementwise (any split gives the same values): this worker's share of all M * I, into x's
      // rows (x is dead once gate_up is done)
      const auto [a_begin, a_end] = w.share(M * I);
      for (int64_t i = a_begin; i < a_end;) {
        const int64_t m = i / I, c = i % I, n = std::min(a_end - i, I - c);
        act_mul(p.gelu, gate_up.data() + m * 2 * I + c, gate_up.data() + m * 2 * I + I + c, x.data() + i, n);
        i += n;
      }
      w.sync();
      linear(w, x.data(), weight_of(wl[kDown], I), nullptr, delta.data(), M, H, I);
      w.sync();
      // the residual add, then (next layer or the end) the norm of the same rows: no sync between
      join(wl[kMlpOutNorm]);
    }
    norm_rows<T>(h + m_begin * H, H, final_norm, p.eps, out + m_begin * H, my_rows, H);
    if (head.data == nullptr) return;
    w.sync();
    linear(w, out, head, nullptr, logits, M, V, H);  // the same row blocks as the logits kernel's own split
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Checks (no values: shared with the Meta kernel) and the entry points.
// ---------------------------------------------------------------------------------------------------------------

void check_vector(const at::Tensor& t, int64_t n, const char* name, int64_t layer) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n, "decoder_layers: layer ", layer, " ", name, " must be [", n,
                    "], got ", t.sizes());
}

void check_matrix(const at::Tensor& t, int64_t rows, int64_t cols, const char* name, int64_t layer) {
  const bool blocks = t.scalar_type() == at::kByte || t.scalar_type() == at::kChar;
  const bool fits = blocks ? qtype_of(t, cols) > 0 : t.dim() == 2 && t.size(1) == cols;
  TORCH_CHECK_VALUE(t.dim() >= 1 && t.size(0) == rows && fits, "decoder_layers: layer ", layer, " ", name, " must be [",
                    rows, ", ", cols, "]", blocks ? " as GGUF blocks (uint8 [N, K / block_weights, block_bytes])" : "",
                    ", got ", t.sizes());
}

struct Dims {
  int64_t B, T, H, Hq, Hkv, D, I, num_layers;
};

// The model's tensors: its layer weights, final norm and cache, in `dtype` on `device`, hidden size H. Dims with B
// and T zero. Checked once per call of every op (a chain op runs many forwards on them). `qkv_in`: the width the
// qkv matrix reads (0: H; EAGLE-3's head reads 2 H).
Dims check_model(at::ScalarType dtype, const c10::Device& device, int64_t H, const std::vector<at::Tensor>& weights,
                 const at::Tensor& final_norm, const at::Tensor& kv_cache, int64_t num_heads, int64_t qkv_in = 0) {
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16,
                   "decoder_layers: the native path takes float32 or bfloat16, got ", dtype);
  TORCH_CHECK_VALUE(kv_cache.dim() == 6, "decoder_layers: kv_cache must be [layers, 2, blocks, block_size, Hkv, D], ",
                    "got ", kv_cache.sizes());
  TORCH_CHECK_VALUE(kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
                    "decoder_layers: kv_cache must be contiguous [layers, 2, ...], got shape ", kv_cache.sizes());
  TORCH_CHECK_TYPE(kv_cache.scalar_type() == dtype, "decoder_layers: kv_cache must be ", dtype, " like hidden, got ",
                   kv_cache.scalar_type());
  TORCH_CHECK_VALUE(weights.size() % kNumFields == 0, "decoder_layers: weights must hold ", int(kNumFields),
                    " tensors per layer, got ", weights.size());
  Dims d{0, 0, H, num_heads, kv_cache.size(4), kv_cache.size(5), 0, static_cast<int64_t>(weights.size()) / kNumFields};
  TORCH_CHECK_VALUE(d.num_layers <= kv_cache.size(0), "decoder_layers: ", d.num_layers, " layers but the cache has ",
                    kv_cache.size(0));
  TORCH_CHECK_VALUE(d.Hkv > 0 && d.Hq > 0 && d.Hq % d.Hkv == 0, "decoder_layers: num_heads ", d.Hq,
                    " must be a positive multiple of the cache's KV heads ", d.Hkv);
  TORCH_CHECK_VALUE(d.D % 2 == 0, "decoder_layers: head_dim must be even (rotate-half RoPE), got ", d.D);
  for (int64_t l = 0; l < d.num_layers; ++l) {
    const at::Tensor* w = weights.data() + l * kNumFields;
    for (int f = 0; f < kNumFields; ++f) {
      if (!w[f].defined()) {
        TORCH_CHECK_VALUE(f == kQkvBias || f == kQNorm || f == kKNorm || f == kV || f == kAttnOutNorm ||
                              f == kMlpOutNorm,
                          "decoder_layers: layer ", l, " ", kFieldNames[f], " is missing");
        continue;
      }
      const bool matrix = f == kQkv || f == kO || f == kGateUp || f == kDown || f == kV;  // may be GGUF blocks
      const bool blocks = w[f].scalar_type() == at::kByte || w[f].scalar_type() == at::kChar;
      const bool norm = f == kInputNorm || f == kPostNorm || f == kQNorm || f == kKNorm || f == kAttnOutNorm ||
                        f == kMlpOutNorm;  // (float32 too: norm_rows)
      TORCH_CHECK_TYPE(w[f].scalar_type() == dtype || (matrix && blocks) || (norm && w[f].scalar_type() == at::kFloat),
                       "decoder_layers: layer ", l, " ", kFieldNames[f], " must be ", dtype, " like hidden",
                       matrix ? " (or uint8 GGUF blocks)" : norm && dtype != at::kFloat ? " (or float32)" : "", ", got ",
                       w[f].scalar_type());
      TORCH_CHECK_VALUE(w[f].device() == device && w[f].is_contiguous(), "decoder_layers: layer ", l, " ",
                        kFieldNames[f], " must be contiguous and on ", device);
    }
    TORCH_CHECK_VALUE(w[kQNorm].defined() == w[kKNorm].defined(), "decoder_layers: q_norm and k_norm go together");
    if (l == 0) d.I = w[kGateUp].dim() >= 2 ? w[kGateUp].size(0) / 2 : 0;  // dense [2 I, H] or blocks [2 I, ., .]
    const int64_t qkv_width = (d.Hq + 2 * d.Hkv) * d.D;
    check_vector(w[kInputNorm], d.H, "input norm", l);
    const int64_t qkv_k = qkv_in > 0 && l == 0 ? qkv_in : d.H;
    check_matrix(w[kQkv], w[kV].defined() ? qkv_width - d.Hkv * d.D : qkv_width, qkv_k, "qkv", l);
    if (w[kV].defined()) check_matrix(w[kV], d.Hkv * d.D, qkv_k, "v", l);
    if (w[kQkvBias].defined()) check_vector(w[kQkvBias], qkv_width, "qkv bias", l);
    check_matrix(w[kO], d.H, d.Hq * d.D, "o", l);
    check_vector(w[kPostNorm], d.H, "post-attention norm", l);
    if (w[kAttnOutNorm].defined()) check_vector(w[kAttnOutNorm], d.H, "attn_out_norm", l);
    if (w[kMlpOutNorm].defined()) check_vector(w[kMlpOutNorm], d.H, "mlp_out_norm", l);
    for (const int f : {kAttnOutNorm, kMlpOutNorm}) {
      TORCH_CHECK_VALUE(w[f].defined() == weights[f].defined(), "decoder_layers: ", kFieldNames[f],
                        " must be given in every layer or in none (layer ", l, ")");
    }
    check_matrix(w[kGateUp], 2 * d.I, d.H, "gate_up", l);
    check_matrix(w[kDown], d.H, d.I, "down", l);
    if (w[kQNorm].defined()) {
      check_vector(w[kQNorm], d.D, "q_norm", l);
      check_vector(w[kKNorm], d.D, "k_norm", l);
    }
  }
  TORCH_CHECK_VALUE(final_norm.dim() == 1 && final_norm.size(0) == d.H &&
                        (final_norm.scalar_type() == dtype || final_norm.scalar_type() == at::kFloat),
                    "decoder_layers: final_norm must be ", dtype, " (or float32) [", d.H, "], got ",
                    final_norm.sizes(), " ", final_norm.scalar_type());
  TORCH_CHECK_VALUE(final_norm.device() == device && kv_cache.device() == device,
                    "decoder_layers: all tensors must be on ", device);
  return d;
}

Dims check_inputs(const at::Tensor& hidden, const std::vector<at::Tensor>& weights, const at::Tensor& final_norm,
                  const at::Tensor& kv_cache, const at::Tensor& cache_seqlens, const at::Tensor& rope,
                  const at::Tensor& tree_mask, const c10::optional<at::Tensor>& block_table, int64_t num_heads,
                  at::IntArrayRef capture) {
  TORCH_CHECK_VALUE(hidden.dim() == 3, "decoder_layers: hidden must be [B, T, H], got ", hidden.sizes());
  const at::ScalarType dtype = hidden.scalar_type();
  Dims d = check_model(dtype, hidden.device(), hidden.size(2), weights, final_norm, kv_cache, num_heads);
  d.B = hidden.size(0), d.T = hidden.size(1);
  TORCH_CHECK_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == d.B, "decoder_layers: cache_seqlens must be [",
                    d.B, "], got ", cache_seqlens.sizes());
  TORCH_CHECK_TYPE(cache_seqlens.scalar_type() == at::kInt || cache_seqlens.scalar_type() == at::kLong,
                   "decoder_layers: cache_seqlens must be int32 or int64, got ", cache_seqlens.scalar_type());
  TORCH_CHECK_VALUE(rope.dim() == 4 && rope.size(0) == 2 && rope.size(1) == d.B && rope.size(2) == d.T &&
                        rope.size(3) == d.D && rope.scalar_type() == dtype,
                    "decoder_layers: rope must be ", dtype, " [2, B, T, D] = [2, ", d.B, ", ", d.T, ", ", d.D, "], got ",
                    rope.sizes(), " ", rope.scalar_type());
  TORCH_CHECK_VALUE(tree_mask.dim() == 3 && tree_mask.size(0) == d.B && tree_mask.size(1) == d.T &&
                        tree_mask.size(2) == d.T && tree_mask.scalar_type() == at::kBool,
                    "decoder_layers: tree_mask must be bool [B, T, T] = [", d.B, ", ", d.T, ", ", d.T, "], got ",
                    tree_mask.sizes(), " ", tree_mask.scalar_type());
  if (block_table.has_value()) {
    TORCH_CHECK_VALUE(block_table->dim() == 2 && block_table->size(0) == d.B, "decoder_layers: block_table must be [",
                      d.B, ", max_blocks], got ", block_table->sizes());
    TORCH_CHECK_TYPE(block_table->scalar_type() == at::kInt || block_table->scalar_type() == at::kLong,
                     "decoder_layers: block_table must be int32 or int64, got ", block_table->scalar_type());
  } else {
    TORCH_CHECK_VALUE(kv_cache.size(2) == d.B, "decoder_layers: a contiguous kv_cache [layers, 2, B, S, Hkv, D] has B = ",
                      kv_cache.size(2), " but hidden has ", d.B, " (pass block_table for a paged cache)");
  }
  for (const int64_t layer : capture) {
    TORCH_CHECK_VALUE(layer >= 0 && layer < d.num_layers, "decoder_layers: capture layer ", layer, " is not one of the ",
                      d.num_layers, " layers");
  }
  for (const at::Tensor* t : {&cache_seqlens, &rope, &tree_mask, &kv_cache, &final_norm}) {
    TORCH_CHECK_VALUE(t->device() == hidden.device(), "decoder_layers: all tensors must be on ", hidden.device(),
                      ", got one on ", t->device());
  }
  TORCH_CHECK_VALUE(!block_table.has_value() || block_table->device() == hidden.device(),
                    "decoder_layers: all tensors must be on ", hidden.device(), ", got the block_table on ",
                    block_table.has_value() ? block_table->device() : hidden.device());
  return d;
}

// The weights with the optional ones the caller left out (passed as empty tensors: the schema's list has no holes)
// made undefined.
std::vector<at::Tensor> present(at::TensorList list) {
  std::vector<at::Tensor> weights;
  weights.reserve(list.size());
  for (const at::Tensor& t : list) weights.push_back(t.numel() > 0 ? t : at::Tensor());
  return weights;
}

// Every position written or read must lie in the sequence's blocks: L_b + T within the table's capacity, and the
// blocks those positions use real blocks of the cache.
template <typename T>
void check_positions(const Problem<T>& p, int64_t B, int64_t T_) {
  const int64_t capacity = p.block_table != nullptr ? p.max_blocks * p.block_size : p.block_size;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(p.cache_seqlens[b] >= 0 && p.cache_seqlens[b] + T_ <= capacity, "decoder_layers: sequence ",
                      b, " has L_b = ", p.cache_seqlens[b], " and T = ", T_, " but its cache holds ", capacity,
                      " positions");
    if (p.block_table != nullptr) {
      const int64_t used = (p.cache_seqlens[b] + T_ + p.block_size - 1) / p.block_size;
      for (int64_t i = 0; i < used; ++i) {
        const int32_t block = p.block_table[b * p.max_blocks + i];
        TORCH_CHECK_VALUE(block >= 0 && block < p.num_blocks, "decoder_layers: block_table[", b, ", ", i, "] = ",
                          block, " is not a block of the cache (", p.num_blocks, " blocks)");
      }
    }
  }
}

// The variant's scalars into a problem (its windows, depths and local RoPE rows the caller's: they differ between
// the op's rows and the runners' tables).
template <typename T>
void apply_variant(Problem<T>& p, const Variant& v) {
  if (v.softmax_scale > 0.) p.scale = static_cast<float>(v.softmax_scale);
  p.softcap = static_cast<float>(v.softcap);
  p.gelu = v.gelu;
}

// Each row's depth in its tree [B, T]: the nodes its mask row sees, less itself.
std::vector<int64_t> tree_depths(const bool* mask, int64_t B, int64_t T) {
  std::vector<int64_t> depths(B * T);
  for (int64_t r = 0; r < B * T; ++r) depths[r] = std::count(mask + r * T, mask + (r + 1) * T, true) - 1;
  return depths;
}

// Checks the values (positions and block ids; free on CPU), runs the layers and the final norm into out [B, T, H].
template <typename T>
void forward(const Dims& d, const at::Tensor& hidden, const std::vector<at::Tensor>& weights,
             const at::Tensor& final_norm, at::Tensor& kv_cache, const at::Tensor& cache_seqlens,
             const at::Tensor& mask,
             const at::Tensor& cos_sin, const at::Tensor& table, double eps, const std::vector<int64_t>& capture,
             at::Tensor& out, at::Tensor& features, const Variant& variant = {}) {
  Problem<T> p{};
  p.B = d.B, p.T_ = d.T, p.H = d.H, p.Hq = d.Hq, p.Hkv = d.Hkv, p.D = d.D, p.I = d.I, p.num_layers = d.num_layers;
  p.eps = static_cast<float>(eps);
  p.scale = 1.f / std::sqrt(static_cast<float>(d.D));
  apply_variant(p, variant);
  std::vector<int64_t> depths;
  if (!variant.windows.empty()) {
    p.windows = variant.windows.data();
    depths = tree_depths(mask.data_ptr<bool>(), d.B, d.T);
    p.depths = depths.data();
  }
  if (variant.rope_local.defined()) {
    p.cos_local = variant.rope_local.data_ptr<T>();
    p.sin_local = p.cos_local + d.B * d.T * d.D;
  }
  p.cache_seqlens = cache_seqlens.data_ptr<int64_t>();
  p.tree_mask = mask.data_ptr<bool>();
  p.num_blocks = kv_cache.size(2);
  p.block_size = kv_cache.size(3);
  p.block_table = table.defined() ? table.data_ptr<int32_t>() : nullptr;
  p.max_blocks = table.defined() ? table.size(1) : 1;
  p.cos = cos_sin.data_ptr<T>();
  p.sin = p.cos + d.B * d.T * d.D;
  p.kv = kv_cache.data_ptr<T>();
  p.capture = capture.data();
  p.num_capture = static_cast<int64_t>(capture.size());
  p.features = features.data_ptr<T>();

  check_positions(p, d.B, d.T);

  std::vector<float> h(d.B * d.T * d.H);  // the residual stream in float32
  const T* in = hidden.data_ptr<T>();
  for (size_t i = 0; i < h.size(); ++i) h[i] = to_f(in[i]);
  run_layers(p, weights, final_norm, h.data(), out.data_ptr<T>());
}

}  // namespace
}  // namespace specdec
