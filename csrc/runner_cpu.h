// The native step runners' pieces: one model's forwards from raw buffers kept across forwards (ChainRunner), a
// draft's greedy chain (run_chain), the kinds of draft of a step (NoDraft for plain steps, ModelDraft; an EAGLE-3
// head's HeadDraft is csrc/head_draft_cpu.h) and the steps themselves: run_tree_step, the one greedy step (the target's pass over trees and
// greedy::walk), which tree_step runs once on trees drafted elsewhere and run_spec_chain runs for every native step
// of a call, plain or speculative (a chain is a tree). The op entry points are csrc/runner_cpu.cpp.
#pragma once

#include <ATen/ops/from_blob.h>

#include <limits>

#include "argmax_cpu.h"
#include "layers_cpu.h"
#include "keep_threshold_cpu.h"
#include "rng_cpu.h"

namespace specdec {

// csrc/compact_kv_cpu.cpp
void compact_kv_cpu(const at::Tensor& cache, const at::Tensor& cache_seqlens, const at::Tensor& accepted_nodes,
                    const at::Tensor& num_accepted, const c10::optional<at::Tensor>& block_table);

namespace {

// One model's forwards within one chain op call (draft_chain, spec_chain): its tensors checked and its cache's geometry
// read once, then every forward runs from raw buffers kept across forwards. Driven through ATen ops (the embedding,
// RoPE rows and mask as tensors, then decoder_layers_cpu), a forward cost ~25 op calls: ~60 per speculative step, each
// paying ATen's dispatch. The values are the op path's: the same embedding and RoPE rows, the causal mask, run_layers,
// the final norm, and the logits kernel.
template <typename T>
class ChainRunner {
 public:
  // embed [V, H], lm_head [V', H] (V' = V, or a restricted vocabulary's K), rope [2, P, D] by position; table
  // int32 [B, W] contiguous, or undefined for a contiguous cache of B rows. The model's dtype is the RoPE table's;
  // embed and lm_head are in it or GGUF blocks (uint8 [V, H / 32 * block bytes]: an embedding row is dequantized
  // to float32 and rounded to the dtype, as the op path's lookup does).
  //
  // An EAGLE-3 head (`hidden_norm` [H] given): one layer whose attention reads cat(rms_norm(embedding) * input_norm,
  // rms_norm(feature) * hidden_norm) [2 H] and whose residual stream starts at the feature (at its normed form with
  // `norm_before_residual`); forward_head runs it, `norm` is its final norm (before lm_head).
  ChainRunner(const char* op, const at::Tensor& embed, at::TensorList weights, const at::Tensor& norm,
              const at::Tensor& lm_head, const at::Tensor& kv, const at::Tensor& rope, int64_t heads, double eps,
              const at::Tensor& table, int64_t B, const at::Tensor& hidden_norm = at::Tensor(),
              bool norm_before_residual = false, bool variant = false)
      : op_(op),
        weights_(present(weights)),
        embed_(embed.contiguous()),
        norm_(norm.contiguous()),
        head_(lm_head.contiguous()),
        rope_(rope.contiguous()),
        table_(table),
        hidden_norm_(hidden_norm),
        norm_before_residual_(norm_before_residual) {
    TORCH_CHECK_VALUE(norm.dim() == 1, op, ": the final norm must be [H], got ", norm.sizes());
    const int64_t H = norm.size(0);
    embed_qtype_ = qtype_of(embed, H), head_qtype_ = qtype_of(lm_head, H);
    const bool dense_fits = (embed_qtype_ > 0 || (embed.dim() == 2 && embed.size(1) == H)) &&
                            (head_qtype_ > 0 || (lm_head.dim() == 2 && lm_head.size(1) == H));
    TORCH_CHECK_VALUE(embed_qtype_ >= 0 && head_qtype_ >= 0 && dense_fits,
                      op, ": embed [V, H] and lm_head [V, H] must have the final norm's H = ", H,
                      " (dense, or as GGUF blocks), got ", embed.sizes(), " and ", lm_head.sizes());
    const at::ScalarType dtype = rope.scalar_type();
    d_ = check_model(dtype, embed.device(), H, weights_, norm, kv, heads, hidden_norm.defined() ? 2 * H : 0);
    for (int64_t l = 0; l < d_.num_layers && !variant; ++l) {  // (Gemma's fields come with its variant: set_variant)
      const at::Tensor* w = weights_.data() + l * kNumFields;
      for (const int f : {kInputNorm, kPostNorm, kQNorm, kKNorm}) {
        TORCH_CHECK_TYPE(!w[f].defined() || w[f].scalar_type() == dtype, op, ": layer ", l, " ", kFieldNames[f],
                         " must be ", dtype, " (float32 norms come with a variant: NativeModel.set_variant), got ",
                         w[f].scalar_type());
      }
      TORCH_CHECK_VALUE(!w[kAttnOutNorm].defined() && !w[kMlpOutNorm].defined(), op,
                        ": the step runners run the Llama layer; a model with attn_out_norm / mlp_out_norm (Gemma's) ",
                        "needs its variant (NativeModel.set_variant)");
    }
    TORCH_CHECK_TYPE(norm.scalar_type() == dtype || (variant && norm.scalar_type() == at::kFloat), op,
                     ": the final norm must be ", dtype, variant ? " or float32" : "", ", got ", norm.scalar_type());
    TORCH_CHECK_VALUE(!(variant && hidden_norm.defined()), op,
                      ": an EAGLE-3 head runs the Llama layer (a variant is a target's or a draft model's)");
    TORCH_CHECK_VALUE(!hidden_norm.defined() || (d_.num_layers == 1 && hidden_norm.dim() == 1 &&
                                                 hidden_norm.size(0) == H && hidden_norm.scalar_type() == dtype &&
                                                 hidden_norm.is_contiguous()),
                      op, ": an EAGLE-3 head is one layer with a contiguous ", dtype, " hidden_norm [", H, "]");
    TORCH_CHECK_TYPE((embed_qtype_ > 0 || embed.scalar_type() == dtype) &&
                         (head_qtype_ > 0 || lm_head.scalar_type() == dtype),
                     op, ": the embedding and lm_head must be ", dtype, " like the RoPE table (or GGUF blocks), got ",
                     embed.scalar_type(), " and ", lm_head.scalar_type());
    TORCH_CHECK_VALUE(rope.dim() == 3 && rope.size(0) == 2 && rope.size(2) == d_.D, op,
                      ": the RoPE table must be [2, P, D] with D = ", d_.D, ", got ", rope.sizes());
    if (table.defined()) {
      TORCH_CHECK_VALUE(table.dim() == 2 && table.size(0) == B, op, ": block_table must be [B, max_blocks] with B = ",
                        B, ", got ", table.sizes());
    } else {
      TORCH_CHECK_VALUE(kv.size(2) == B, op, ": a contiguous cache has ", kv.size(2), " rows for B = ", B);
    }
    p_.H = d_.H, p_.Hq = d_.Hq, p_.Hkv = d_.Hkv, p_.D = d_.D, p_.I = d_.I, p_.num_layers = d_.num_layers;
    p_.eps = static_cast<float>(eps);
    p_.scale = 1.f / std::sqrt(static_cast<float>(d_.D));
    p_.num_blocks = kv.size(2);
    p_.block_size = kv.size(3);
    p_.block_table = table.defined() ? table.data_ptr<int32_t>() : nullptr;
    p_.max_blocks = table.defined() ? table.size(1) : 1;
    p_.kv = kv.data_ptr<T>();
  }

  // Gemma's layer (NativeModel.set_variant's Variant, its rope_local a table [2, P, D] like the model's), the
  // embedding rows' scale and the final logits' soft cap (0: none).
  void set_variant(const Variant& variant, double embed_scale, double final_softcap) {
    variant_ = variant;
    apply_variant(p_, variant);
    embed_scale_ = embed_scale;
    final_softcap_ = static_cast<float>(final_softcap);
  }
  float final_softcap() const { return final_softcap_; }

  int64_t vocab() const { return head_.size(0); }
  int64_t hidden_size() const { return d_.H; }
  const char* op() const { return op_; }
  int64_t num_blocks() const { return p_.num_blocks; }  // the KV cache's geometry: blocks of block_size positions
  int64_t block_size() const { return p_.block_size; }

  // Tokens [B, T] (row stride ld) at positions start[b] + t, a causal chunk over the cache: the final-normed hidden
  // states [B * T, H], their K/V written. Valid until the next forward.
  const T* forward(const int64_t* tokens, int64_t ld, int64_t B, int64_t T_, const int64_t* start) {
    run(tokens, ld, B, T_, start, false);
    return out_.data();
  }

  // The same forward and the logits [B * T, V'] of every row (logits(forward(...), B * T), in one team). Valid until
  // the next forward.
  const T* forward_logits(const int64_t* tokens, int64_t ld, int64_t B, int64_t T_, const int64_t* start) {
    run(tokens, ld, B, T_, start, true);
    return logits_.data();
  }

  // The forward and logits of trees: node t of row b (tokens [B, T]) at slot start[b] + t and position start[b] +
  // depths[b * T + t], seeing the prefix and the nodes tree_mask [B, T, T] allows. Valid until the next forward.
  const T* forward_tree(const int64_t* tokens, int64_t B, int64_t T_, const int64_t* start, const int64_t* depths,
                        const bool* tree_mask) {
    run(tokens, T_, B, T_, start, true, nullptr, depths, tree_mask);
    return logits_.data();
  }

  // An EAGLE-3 head's forward (the runner built with a hidden norm): entry (b, t) is token tokens[b * ld + t] at
  // position start[b] + t with the feature feats [B * T, H]. Returns its raw outputs [B * T, H] (the stand-ins for
  // the next entries' features); normed() holds them final-normed, logits() of those the draft's. Valid until the
  // next forward.
  const T* forward_head(const int64_t* tokens, int64_t ld, int64_t B, int64_t T_, const int64_t* start,
                        const T* feats, bool with_logits) {
    TORCH_CHECK(hidden_norm_.defined(), op_, ": forward_head needs a head's runner");
    run(tokens, ld, B, T_, start, with_logits, feats);
    return raw_.data();
  }
  // The same entries' K/V only (Problem::kv_only): no outputs.
  void head_kv(const int64_t* tokens, int64_t ld, int64_t B, int64_t T_, const int64_t* start, const T* feats) {
    TORCH_CHECK(hidden_norm_.defined(), op_, ": head_kv needs a head's runner");
    run(tokens, ld, B, T_, start, false, feats, nullptr, nullptr, true);
  }
  // The same over trees: entry t of row b at slot start[b] + t and position start[b] + depths[b * T + t], seeing the
  // prefix and the entries tree_mask [B, T, T] allows. No logits.
  const T* forward_head_tree(const int64_t* tokens, int64_t B, int64_t T_, const int64_t* start,
                             const int64_t* depths, const bool* tree_mask, const T* feats) {
    TORCH_CHECK(hidden_norm_.defined(), op_, ": forward_head_tree needs a head's runner");
    run(tokens, T_, B, T_, start, false, feats, depths, tree_mask);
    return raw_.data();
  }
  const T* normed() const { return out_.data(); }
  const T* forward_logits_out() const { return logits_.data(); }  // the last forward's logits, when it made them

  // The target of an EAGLE-3 head's steps: every forward copies the residual streams entering `layers` out
  // (captured(): [B * T, layers * H], in that order; valid until the next forward).
  void capture(at::IntArrayRef layers) {
    for (const int64_t l : layers) {
      TORCH_CHECK_VALUE(l >= 0 && l < d_.num_layers, op_, ": capture layer ", l, " is not one of the ",
                        d_.num_layers, " layers");
    }
    capture_.assign(layers.begin(), layers.end());
  }
  const T* captured() const { return captured_.data(); }
  int64_t num_capture() const { return static_cast<int64_t>(capture_.size()); }

  // Logits [rows, V'] of hidden states [rows, H]. Valid until the next call.
  const T* logits(const T* hidden, int64_t rows) {
    logits_.resize(rows * vocab());
    if (rows > 0) linear(hidden, head(), nullptr, logits_.data(), rows, vocab(), d_.H);
    return logits_.data();
  }

 private:
  // A causal chunk, or trees where `depths` and `tree_mask` are given (forward_tree); `kv_only`: its K/V alone.
  void run(const int64_t* tokens, int64_t ld, int64_t B, int64_t T_, const int64_t* start, bool with_logits,
           const T* feats = nullptr, const int64_t* depths = nullptr, const bool* tree_mask = nullptr,
           bool kv_only = false) {
    const int64_t H = d_.H, D = d_.D, M = B * T_, V = embed_.size(0), P = rope_.size(1);
    h_.resize(M * H);
    cos_sin_.resize(2 * M * D);
    out_.resize(M * H);
    if (with_logits) logits_.resize(M * vocab());
    cache_seqlens_.assign(start, start + B);
    if (mask_size_ < M * T_) mask_.reset(new bool[M * T_]), mask_size_ = M * T_;
    const T* emb = embed_qtype_ == 0 ? embed_.data_ptr<T>() : nullptr;
    const uint8_t* emb_blocks = embed_qtype_ != 0 ? static_cast<const uint8_t*>(embed_.data_ptr()) : nullptr;
    row_.resize(H);
    const T* cos = rope_.data_ptr<T>();
    const T* sin = cos + P * D;
    const T* cos_l = variant_.rope_local.defined() ? variant_.rope_local.data_ptr<T>() : nullptr;  // the windowed layers' [2, P, D]
    if (cos_l != nullptr) cos_sin_local_.resize(2 * M * D);
    if (!variant_.windows.empty()) depths_.resize(M);
    const float embed_scale = to_f(static_cast<T>(embed_scale_));  // HF's normalizer, in the dtype
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T_; ++t) {
        const int64_t m = b * T_ + t, tok = tokens[b * ld + t], pos = start[b] + (depths ? depths[m] : t);
        TORCH_CHECK_VALUE(tok >= 0 && tok < V, op_, ": token ", tok, " is not an id of the ", V, "-token embedding");
        TORCH_CHECK_VALUE(pos >= 0 && pos < P, op_, ": position ", pos, " needs a longer RoPE table than ", P);
        if (emb != nullptr) {
          for (int64_t i = 0; i < H; ++i) h_[m * H + i] = to_f(emb[tok * H + i]);
        } else {
          dequant_row(emb_blocks, embed_qtype_, H / kQuantBlock, tok, row_.data());
          for (int64_t i = 0; i < H; ++i) h_[m * H + i] = to_f(row_[i]);
        }
        if (embed_scale_ > 0.) {  // rounded to the dtype as the embedding times HF's normalizer is
          for (int64_t i = 0; i < H; ++i) h_[m * H + i] = to_f(static_cast<T>(h_[m * H + i] * embed_scale));
        }
        std::copy(cos + pos * D, cos + (pos + 1) * D, cos_sin_.data() + m * D);
        std::copy(sin + pos * D, sin + (pos + 1) * D, cos_sin_.data() + (M + m) * D);
        if (cos_l != nullptr) {
          std::copy(cos_l + pos * D, cos_l + (pos + 1) * D, cos_sin_local_.data() + m * D);
          std::copy(cos_l + (P + pos) * D, cos_l + (P + pos + 1) * D, cos_sin_local_.data() + (M + m) * D);
        }
        if (!variant_.windows.empty()) depths_[m] = depths ? depths[m] : t;
        for (int64_t j = 0; j < T_; ++j) mask_[m * T_ + j] = tree_mask ? tree_mask[m * T_ + j] : j <= t;
      }
    }
    Problem<T> p = p_;
    if (feats != nullptr) head_inputs(feats, M, p);
    if (!capture_.empty()) {
      captured_.resize(M * num_capture() * H);
      p.capture = capture_.data(), p.num_capture = num_capture(), p.features = captured_.data();
    }
    p.B = B, p.T_ = T_, p.kv_only = kv_only;
    p.cache_seqlens = cache_seqlens_.data();
    p.tree_mask = mask_.get();
    p.cos = cos_sin_.data();
    p.sin = p.cos + M * D;
    if (cos_l != nullptr) p.cos_local = cos_sin_local_.data(), p.sin_local = p.cos_local + M * D;
    if (!variant_.windows.empty()) p.windows = variant_.windows.data(), p.depths = depths_.data();
    check_positions(p, B, T_);
    if (M == 0) return;
    run_layers(p, weights_, norm_, h_.data(), out_.data(), with_logits ? head() : Weight{},
               vocab(), logits_.data());
    if (feats != nullptr && !kv_only) raw_.assign(h_.begin(), h_.end());
  }

  // A head's attention input and residual stream from the embeddings in h_ and the features feats [M, H].
  void head_inputs(const T* feats, int64_t M, Problem<T>& p) {
    const int64_t H = d_.H;
    attn_in_.resize(M * 2 * H);
    row_f_.resize(H);
    for (int64_t m = 0; m < M; ++m) {
      T* in = attn_in_.data() + m * 2 * H;  // [normed embedding | normed feature]
      rms_norm(h_.data() + m * H, H, ptr<T>(weights_[kInputNorm]), p.eps, in, 1, H);
      for (int64_t i = 0; i < H; ++i) row_f_[i] = to_f(feats[m * H + i]);
      rms_norm(row_f_.data(), H, hidden_norm_.data_ptr<T>(), p.eps, in + H, 1, H);
      for (int64_t i = 0; i < H; ++i) h_[m * H + i] = norm_before_residual_ ? to_f(in[H + i]) : row_f_[i];
    }
    p.attn_in = attn_in_.data();
    p.attn_width = 2 * H;
  }

  const char* op_;
  std::vector<at::Tensor> weights_;
  Weight head() const { return {head_.data_ptr(), head_qtype_}; }
  static void dequant_row(const uint8_t* w, int64_t qtype, int64_t blocks, int64_t row, float* out) {
    quant_dequant_row_f32(w, qtype, blocks, row, out);
  }
  static void dequant_row(const uint8_t* w, int64_t qtype, int64_t blocks, int64_t row, c10::BFloat16* out) {
    quant_dequant_row_bf16(w, qtype, blocks, row, out);
  }

  at::Tensor embed_, norm_, head_, rope_, table_, hidden_norm_;
  Variant variant_;                        // Gemma's layer (set_variant), else the Llama layer's defaults
  std::vector<int64_t> depths_;            // each row's depth in its tree [M], where the variant has windows
  std::vector<T> cos_sin_local_;           // [2, M, D]: the windowed layers' RoPE rows
  double embed_scale_ = 0.;
  float final_softcap_ = 0.f;
  bool norm_before_residual_ = false;
  std::vector<T> attn_in_, raw_;  // a head's [M, 2 H] attention input and [M, H] raw outputs
  std::vector<int64_t> capture_;  // a head's target: the layers whose input streams go to captured_ [M, C * H]
  std::vector<T> captured_;
  std::vector<float> row_f_;      // [H]: one feature in float32
  int64_t embed_qtype_ = 0, head_qtype_ = 0;  // GGUF type ids, 0 for dense
  std::vector<T> row_;                         // [H]: a quantized embedding row in the model's dtype
  Dims d_{};
  Problem<T> p_{};
  std::vector<float> h_;  // the residual stream in float32
  std::vector<T> cos_sin_, out_, logits_;
  std::vector<int64_t> cache_seqlens_;
  std::unique_ptr<bool[]> mask_;
  int64_t mask_size_ = 0;
};

// pick(z) of one row of a model's logits z [V] as its output reads them: soft-capped into `capped` [V] (float32)
// where the model caps its final logits (Gemma 2: soft_cap, GemmaForCausalLM.logits' function, so a native step
// chooses what a regular step chooses), else z itself.
template <typename T, typename Pick>
int64_t pick_final(const ChainRunner<T>& model, const T* z, int64_t V, std::vector<float>& capped, const Pick& pick) {
  if (model.final_softcap() <= 0.f) return pick(z);
  capped.resize(V);
  soft_cap(z, capped.data(), V, model.final_softcap());
  return pick(static_cast<const float*>(capped.data()));
}

// A greedy chain: tokens tok [B, gamma] (row stride gamma), token d the argmax of token d - 1's logits (the first of
// the roots' logits [B, V], final ones: capped where the model caps), tokens 1 .. gamma - 1 run through `model` at
// positions L_b + d. ``strict``: a row's tokens are -1 from its first non-finite logits on. ``id_of`` [V] (or null):
// a restricted vocabulary's token ids.
template <typename T, typename R>
void run_chain(ChainRunner<T>& model, const R* root, int64_t V, const int64_t* L, int64_t B, int64_t gamma,
               bool strict, const int64_t* id_of, int64_t* tok) {
  std::vector<int64_t> ids(B), pos(B);
  std::vector<float> capped;
  const T* logits = nullptr;  // [B, V]
  const auto argmax = [&](const auto* z) { return greedy::argmax(z, V, strict); };
  for (int64_t d = 1; d <= gamma; ++d) {
    for (int64_t b = 0; b < B; ++b) {
      int64_t& t = tok[b * gamma + d - 1];
      t = d > 1 && tok[b * gamma + d - 2] < 0 ? -1  // a strict row stays -1 after its first bad logits
          : d == 1                            ? argmax(root + b * V)
                                              : pick_final(model, logits + b * V, V, capped, argmax);
      if (id_of != nullptr) t = id_of[t];  // never strict: t >= 0
      ids[b] = std::max<int64_t>(t, 0);    // a -1 row runs token 0
      pos[b] = L[b] + d;                   // the node's slot
    }
    if (d == gamma) return;
    logits = model.forward_logits(ids.data(), 1, B, 1, pos.data());  // [B, V]
  }
}

// The block table as the runners read it: int32, contiguous (undefined when absent).
at::Tensor table_of(const c10::optional<at::Tensor>& block_table) {
  return block_table.has_value() ? int32_block_table("native step", *block_table) : at::Tensor();
}

// A restricted vocabulary's ids [V] as int64, each an id of the embedding's `rows` (undefined when absent).
at::Tensor vocab_ids(const char* op, const c10::optional<at::Tensor>& vocab_map, int64_t V, int64_t rows) {
  if (!vocab_map.has_value()) return at::Tensor();
  TORCH_CHECK_VALUE(vocab_map->device().is_cpu(), op, ": vocab_map must be on the CPU");
  at::Tensor ids = vocab_map->to(at::kLong).contiguous();
  TORCH_CHECK_VALUE(ids.dim() == 1 && ids.size(0) == V, op, ": vocab_map must be [V] = [", V, "], got ", ids.sizes());
  TORCH_CHECK_VALUE(V == 0 || (ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < rows), op,
                    ": vocab_map ids must lie in [0, ", rows, ")");
  return ids;
}

// f(float{}) for float32, f(c10::BFloat16{}) otherwise: the chain ops' dtype dispatch (their checks allow these two).
template <typename F>
void with_dtype(at::ScalarType dtype, F&& f) {
  if (dtype == at::kFloat) {
    f(float{});
  } else {
    f(c10::BFloat16{});
  }
}


// The accepted path's ranks (spec_engine/tree.py's path_ranks, the rule the adaptive controller's width choice
// reads): rank [n] for a path of n nodes (root first, `path`), rank[i] the rank of node path[i + 1] among its
// siblings (0: its parent's first child, the draft's likeliest: a static tree numbers siblings best first, and a
// dynamic level keeps each parent's children in score order), then rank[n - 1] kPathRejected where the last node
// has children (all rejected) or kPathLeaf where it has none (nothing was judged below it).
constexpr int64_t kPathRejected = -1, kPathLeaf = -2;

inline void path_ranks(const int64_t* parents, int64_t T, const int64_t* path, int64_t n, int64_t* rank) {
  for (int64_t i = 1; i < n; ++i) {
    const int64_t node = path[i];
    int64_t r = 0;
    for (int64_t j = 1; j < node; ++j) r += parents[j] == parents[node];
    rank[i - 1] = r;
  }
  const int64_t last = path[n - 1];
  bool children = false;
  for (int64_t j = last + 1; j < T; ++j) children = children || parents[j] == last;
  rank[n - 1] = children ? kPathRejected : kPathLeaf;
}

// One tree's attention mask [T, T] (node t sees itself and its ancestors) and depths [T], from parents [T]
// (parents[t] < t; -1 for a root and padding, which sees itself only, at depth 0).
inline void ancestor_mask(const int64_t* parents, int64_t T, bool* mask, int64_t* depths) {
  for (int64_t t = 0; t < T; ++t) {
    const int64_t parent = parents[t];
    bool* row = mask + t * T;
    if (parent >= 0) {
      std::copy(mask + parent * T, mask + (parent + 1) * T, row);
    } else {
      std::fill(row, row + T, false);
    }
    row[t] = true;
    depths[t] = parent >= 0 ? depths[parent] + 1 : 0;
  }
}

// A step's draft shape (run_spec_chain): the static tree with `branching[d]` children for each node at depth d (a
// chain: all 1; no levels: a plain step), its nodes numbered breadth-first as spec_engine/tree.py's StaticTree numbers
// them: parents [T] (-1 for the root), depths [T], and levels [depth + 2] (level d is nodes levels[d] ..
// levels[d + 1] - 1). A head drafts level d + 1 from levels 1 .. d + 1 re-rooted (HeadDraft::tree): their mask
// [n, n] and depths [n] (node 1 + i as entry i, at depth - 1; n = levels[d + 2] - 1) are sub_masks[d] and
// sub_depths[d], fixed by the shape. `topk` k > 0: EAGLE-2's dynamic tree, of the shape (k, 1, ..., 1) (k nodes per
// level), whose parents the head chooses per row and step (HeadDraft::dynamic_tree); `parents` is then only the
// shape's numbering, and the masks follow from each row's chosen parents.
struct TreeShape {
  std::vector<int64_t> branching, parents{-1}, depths{0}, levels{0, 1};
  std::vector<std::vector<bool>> sub_masks;
  std::vector<std::vector<int64_t>> sub_depths;
  int64_t topk = 0;

  explicit TreeShape(std::vector<int64_t> children = {}, int64_t k = 0) : branching(std::move(children)), topk(k) {
    for (size_t d = 0; d < branching.size(); ++d) {
      for (int64_t p = levels[d]; p < levels[d + 1]; ++p) {
        for (int64_t c = 0; c < branching[d]; ++c) {
          parents.push_back(p);
          depths.push_back(static_cast<int64_t>(d) + 1);
        }
      }
      levels.push_back(static_cast<int64_t>(parents.size()));
    }
    for (int64_t d = 0; d + 1 < depth(); ++d) {
      const int64_t n = levels[d + 2] - 1;
      std::vector<int64_t> sub_parents(n), sub_depth(n);
      for (int64_t i = 0; i < n; ++i) sub_parents[i] = parents[i + 1] - 1;  // the root's children: -1
      std::unique_ptr<bool[]> mask(new bool[n * n]);
      ancestor_mask(sub_parents.data(), n, mask.get(), sub_depth.data());
      sub_masks.emplace_back(mask.get(), mask.get() + n * n);
      sub_depths.push_back(std::move(sub_depth));
    }
  }
  int64_t nodes() const { return static_cast<int64_t>(parents.size()); }
  int64_t depth() const { return static_cast<int64_t>(branching.size()); }
  bool is_chain() const { return nodes() == depth() + 1; }
  bool dynamic() const { return topk > 0; }
};

// The coupled rows of a native call (spec_chain's temperature and noise_seeds; empty: every row greedy). Row b at
// temperature t_b > 0 is sampled through the position-keyed coupling (spec_engine/coupling.py): at a node at
// position p the target emits argmax_x (z_x / t_b + g(s_b, p, x)) (rng::perturbed_argmax, verify_tree's coupled
// sample: an exact draw from softmax(z / t_b)), and a head drafts node d with the same noise at its parent's position
// over its draft vocabulary (HeadDraft::chain's draws, as the regular step's eagle3_draft call; a dynamic tree's level
// d its Gumbel-top-k), so the two agree where their perturbed maxima do. A row with top-k, top-p or min-p samples over the entries they keep
// (sampling::filtered_argmax); its head drafts as an unfiltered row's does.
struct Sampling {
  std::vector<float> temperature;  // [B]: 0 for a greedy row
  std::vector<int64_t> seeds;      // [B]: the coupling's noise seeds
  std::vector<int64_t> top_k;      // [B] (all three, or none: no row filtered): 0, 1 and 0 for off
  std::vector<float> top_p, min_p;

  bool sampled(int64_t b) const { return !temperature.empty() && temperature[b] > 0.0f; }
  bool filtered(int64_t b) const { return !top_k.empty() && sampling::filtered(top_k[b], top_p[b], min_p[b]); }
  bool any() const {
    for (const float t : temperature) {
      if (t > 0.0f) return true;
    }
    return false;
  }
};

// The rows of a speculative call (spec_chain_cpu): per row its catch-up, the tokens the draft cache lacks (its lag)
// then the root (row stride `ld`), the catch-up's length (lag + 1), L_b (the root's position), and the tokens it may
// still emit; the steps' draft shape (`tree`, of depth gamma).
struct ChainRows {
  int64_t B, gamma, max_steps;
  bool stop_on_reject;
  std::vector<int64_t> catch_up, catch_up_len, L, tokens_left, stops;
  int64_t ld;
  TreeShape tree;
  Sampling sampling;

  // After a step that drafted nothing (gamma 0: a plain step), the draft's cache did not move: each row's catch-up
  // grows by the tokens it emitted (run_spec_chain applies it for every kind of draft).
  void extend(const std::vector<std::vector<int64_t>>& emitted) {
    int64_t width = 0;
    for (int64_t b = 0; b < B; ++b) width = std::max<int64_t>(width, catch_up_len[b] + emitted[b].size());
    std::vector<int64_t> next(B * width, 0);  // [B, width]
    for (int64_t b = 0; b < B; ++b) {
      std::copy(catch_up.begin() + b * ld, catch_up.begin() + b * ld + catch_up_len[b], next.begin() + b * width);
      std::copy(emitted[b].begin(), emitted[b].end(), next.begin() + b * width + catch_up_len[b]);
      catch_up_len[b] += static_cast<int64_t>(emitted[b].size());
    }
    catch_up = std::move(next);
    ld = width;
  }
};

// A draft's side of a step, for run_spec_chain: propose(r, drafts, parents) fills the nodes 1 .. T - 1 of r.tree
// [B, T - 1] (gamma >= 1; a chain: [B, gamma]), and a dynamic tree's (r.tree.dynamic()) parents [B, T] too;
// commit(r, emitted, drafts, path, target) sets the rows' next catch-ups after a drafted step (path [B, T]: the nodes
// each row accepted, -1 padded); plain(r, emitted, path, target) is what the draft keeps of a plain step (gamma 0),
// whose catch-ups the loop extends itself.

// No draft: the target's plain steps (gamma 0 only: propose and commit are never called).
struct NoDraft {
  void propose(const ChainRows&, int64_t*, int64_t*) {}
  template <typename TT>
  void commit(ChainRows&, const std::vector<std::vector<int64_t>>&, const int64_t*, const int64_t*,
              const ChainRunner<TT>&) {}
  template <typename TT>
  void plain(const ChainRows&, const std::vector<std::vector<int64_t>>&, const int64_t*, const ChainRunner<TT>&) {}
};

// A draft model's side of a speculative step: its catch-up (the lag, then the root, at L_b - catch_up_len + 1 ..),
// then its greedy chain (chains only: spec_chain_cpu refuses its trees). Its cache holds the root and drafts 1 ..
// gamma - 1 afterwards.
template <typename TD>
class ModelDraft {
 public:
  ModelDraft(ChainRunner<TD>& model, const int64_t* id_of) : model_(model), id_of_(id_of) {}

  void propose(const ChainRows& r, int64_t* drafts, int64_t*) {
    const int64_t B = r.B, H = model_.hidden_size();
    const int64_t width = *std::max_element(r.catch_up_len.begin(), r.catch_up_len.end());
    start_.resize(B);
    for (int64_t b = 0; b < B; ++b) start_[b] = r.L[b] - r.catch_up_len[b] + 1;
    const TD* hidden = model_.forward(r.catch_up.data(), r.ld, B, width, start_.data());  // [B * width, H]
    root_.clear();
    for (int64_t b = 0; b < B; ++b) {  // [B, H]: each row's root
      const TD* row = hidden + (b * width + r.catch_up_len[b] - 1) * H;
      root_.insert(root_.end(), row, row + H);
    }
    const TD* logits = model_.logits(root_.data(), B);  // [B, V]
    const int64_t V = model_.vocab();
    const float cap = model_.final_softcap();
    if (cap <= 0.f) return run_chain(model_, logits, V, r.L.data(), B, r.gamma, false, id_of_, drafts);
    capped_.resize(B * V);  // [B, V]: the roots' final logits
    soft_cap(logits, capped_.data(), B * V, cap);
    run_chain(model_, capped_.data(), V, r.L.data(), B, r.gamma, false, id_of_, drafts);
  }

  // The rows' next catch-ups once `emitted` [B][n] (accepted drafts, then the target's token) is known: the bonus,
  // after the last draft where all were accepted (the chain never ran it). r.L is still the step's.
  template <typename TT>
  void commit(ChainRows& r, const std::vector<std::vector<int64_t>>& emitted, const int64_t* drafts, const int64_t*,
              const ChainRunner<TT>&) {
    std::vector<int64_t> next(r.B * 2);
    for (int64_t b = 0; b < r.B; ++b) {
      const int64_t n = static_cast<int64_t>(emitted[b].size());
      const bool all = n == r.gamma + 1;
      next[b * 2] = all ? drafts[b * r.gamma + r.gamma - 1] : emitted[b][n - 1];
      next[b * 2 + 1] = emitted[b][n - 1];
      r.catch_up_len[b] = all ? 2 : 1;
    }
    r.catch_up = std::move(next);
    r.ld = 2;
  }

  template <typename TT>
  void plain(const ChainRows&, const std::vector<std::vector<int64_t>>&, const int64_t*, const ChainRunner<TT>&) {}

 private:
  ChainRunner<TD>& model_;
  const int64_t* id_of_;
  std::vector<int64_t> start_;
  std::vector<TD> root_;
  std::vector<float> capped_;
};

// One greedy step over given trees (tree_step_cpu): tokens and parents [B, T] (node 0 the root, parents[i] < i, -1
// for the root and padding, which sees itself only, at depth 0), each row at L_b. The target runs every node (slot
// L_b + t, position L_b + its depth, seeing the prefix and its ancestors) and greedy::walk keeps each row's path:
// path [B, T] and out [B, T] (-1 padded), counts [B] (the tokens emitted; 0 where a visited node's maximum is not
// finite, -1 for a malformed tree, whose step then does not run). The caller compacts the cache. `sampling` (or
// null): its coupled rows walk on their perturbed argmax (the node at position p: rng::perturbed_argmax with p's
// noise), the others on the argmax.
template <typename T>
void run_tree_step(ChainRunner<T>& target, const int64_t* tokens, const int64_t* parents, int64_t B, int64_t T_,
                   const int64_t* L, int64_t* path, int64_t* out, int64_t* counts,
                   const Sampling* sampling = nullptr) {
  const int64_t V = target.vocab();
  bool runs = true;
  for (int64_t b = 0; b < B; ++b) {
    counts[b] = greedy::well_formed(tokens + b * T_, parents + b * T_, T_, V) ? 0 : -1;
    runs = runs && counts[b] == 0;
  }
  if (!runs || B * T_ == 0) return;
  std::vector<int64_t> depths(B * T_);
  std::unique_ptr<bool[]> mask(new bool[B * T_ * T_]);  // [B, T, T]: each node's ancestors and itself
  for (int64_t b = 0; b < B; ++b) ancestor_mask(parents + b * T_, T_, mask.get() + b * T_ * T_, depths.data() + b * T_);
  const T* logits = target.forward_tree(tokens, B, T_, L, depths.data(), mask.get());  // [B * T, V]
  std::vector<float> zt, buf, capped;  // a filtered row's scaled logits, its threshold's scratch, a capped row
  for (int64_t b = 0; b < B; ++b) {
    const auto row = [&](int64_t i) { return logits + (b * T_ + i) * V; };
    if (sampling != nullptr && sampling->sampled(b)) {
      const float t = sampling->temperature[b];
      const int64_t seed = sampling->seeds[b];
      const bool filtered = sampling->filtered(b);
      const auto choose = [&](int64_t i) {
        const uint64_t key = rng::noise_key(seed, L[b] + depths[b * T_ + i]);
        return pick_final(target, row(i), V, capped, [&](const auto* z) {
          if (!filtered) return rng::perturbed_argmax(z, V, t, key);
          return sampling::filtered_argmax(z, V, t, key, sampling->top_k[b], sampling->top_p[b], sampling->min_p[b],
                                           zt, buf);
        });
      };
      counts[b] = greedy::walk_choosing(choose, tokens + b * T_, parents + b * T_, T_, path + b * T_, out + b * T_);
    } else {
      const auto choose = [&](int64_t i) {
        return pick_final(target, row(i), V, capped, [&](const auto* z) { return greedy::argmax(z, V, true); });
      };
      counts[b] = greedy::walk_choosing(choose, tokens + b * T_, parents + b * T_, T_, path + b * T_, out + b * T_);
    }
  }
}

// The steps of spec_chain_cpu into steps [B, S, gamma + 2], times [S, 2] and, where `ranks` is not null, each
// step's accepted path's ranks [B, S, gamma + 1] (path_ranks; kPathLeaf past them); leaves the rows' catch-ups in `r`.
// `draft`: a ModelDraft or a HeadDraft (whose commit reads the target's captured streams); its drafts are r.tree's
// nodes (a dynamic tree's parents its own), and where that is not a chain the accepted paths' K/V are compacted to
// L_b .. in `kv` (the target's cache, [2, layers, blocks, block_size, ...], on `table`) after each step.
template <typename TT, typename Draft>
void run_spec_chain(ChainRunner<TT>& target, Draft& draft, ChainRows& r, const at::Tensor& kv,
                    const at::Tensor& table, int64_t* out, double* secs, int64_t* ranks = nullptr) {
  const int64_t B = r.B, gamma = r.gamma, T = r.tree.nodes(), max_steps = r.max_steps;
  if (B == 0) return;
  const auto is_stop = [&](int64_t t) { return std::find(r.stops.begin(), r.stops.end(), t) != r.stops.end(); };
  std::vector<int64_t> drafts(B * (T - 1)), tokens(B * T), parents(B * T), path(B * T), accepted(B * T), counts(B);
  std::vector<std::vector<int64_t>> emitted(B);
  for (int64_t i = 0; i < B * T; ++i) parents[i] = r.tree.parents[i % T];  // [B, T]
  const auto longs = at::TensorOptions().dtype(at::kLong);
  const c10::optional<at::Tensor> paged = table.defined() ? c10::optional<at::Tensor>(table) : c10::nullopt;
  for (int64_t s = 0; s < max_steps; ++s) {
    bool fits = true;
    for (int64_t b = 0; b < B; ++b) fits = fits && r.tokens_left[b] >= gamma + 1;
    if (!fits) break;
    const auto start = std::chrono::steady_clock::now();
    // 1. the draft catches up on its lag, then the root (the catch-up's last token), and drafts its tree (gamma 0: a
    // plain step, the draft idle; a dynamic tree: with each row's parents)
    for (int64_t b = 0; b < B; ++b) tokens[b * T] = r.catch_up[b * r.ld + r.catch_up_len[b] - 1];
    if (gamma > 0) draft.propose(r, drafts.data(), parents.data());
    const auto drafted = std::chrono::steady_clock::now();
    // 2. the target runs the root and the drafts, and greedy acceptance keeps the longest path of drafts equal to
    // its argmax, then its own next token; a tree's accepted path is compacted to L_b .. (a chain's is in place)
    for (int64_t b = 0; b < B; ++b) {
      std::copy(drafts.begin() + b * (T - 1), drafts.begin() + (b + 1) * (T - 1), tokens.begin() + b * T + 1);
    }
    run_tree_step(target, tokens.data(), parents.data(), B, T, r.L.data(), path.data(), accepted.data(),
                  counts.data(), &r.sampling);
    bool finite = true;
    for (int64_t b = 0; b < B; ++b) {
      finite = finite && counts[b] >= 1;
      emitted[b].assign(accepted.begin() + b * T, accepted.begin() + b * T + std::max<int64_t>(counts[b], 0));
    }
    if (!finite) break;  // nothing of this step is committed
    if (!r.tree.is_chain()) {
      compact_kv_cpu(kv.flatten(0, 1), at::from_blob(r.L.data(), {B}, longs), at::from_blob(path.data(), {B, T}, longs),
                     at::from_blob(counts.data(), {B}, longs), paged);  // [2 * layers, blocks, block_size, ...]
    }
    if (gamma > 0) {
      draft.commit(r, emitted, drafts.data(), path.data(), target);
    } else {
      draft.plain(r, emitted, path.data(), target);
      r.extend(emitted);
    }
    bool stopped = false;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = static_cast<int64_t>(emitted[b].size());
      int64_t* row = out + (b * max_steps + s) * (gamma + 2);
      row[0] = n;
      if (ranks != nullptr) {
        path_ranks(parents.data() + b * T, T, path.data() + b * T, n, ranks + (b * max_steps + s) * (gamma + 1));
      }
      for (int64_t i = 0; i < n; ++i) {
        row[1 + i] = emitted[b][i];
        stopped = stopped || is_stop(emitted[b][i]);
      }
      r.L[b] += n;
      r.tokens_left[b] -= n;
      stopped = stopped || (r.stop_on_reject && n == 1);
    }
    const auto end = std::chrono::steady_clock::now();
    secs[2 * s] = std::chrono::duration<double>(drafted - start).count();
    secs[2 * s + 1] = std::chrono::duration<double>(end - start).count();
    if (stopped) break;
  }
}

}  // namespace
}  // namespace specdec
