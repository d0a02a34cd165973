// The native step runners: several whole steps of a model in one op call, from raw buffers kept across forwards
// (ChainRunner): a draft's greedy chain (draft_chain), the target's plain greedy steps (greedy_steps) and greedy
// speculative steps of a draft model's chains (spec_chain). Each forward is the layer stack's (csrc/layers_cpu.h),
// so a runner emits exactly the tokens the op path's steps emit.

#include "argmax_cpu.h"
#include "layers_cpu.h"

namespace specdec {

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
              bool norm_before_residual = false)
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
    TORCH_CHECK_VALUE(embed.dim() == 2 && lm_head.dim() == 2 && embed_qtype_ >= 0 && head_qtype_ >= 0 &&
                          (embed_qtype_ > 0 || embed.size(1) == H) && (head_qtype_ > 0 || lm_head.size(1) == H),
                      op, ": embed [V, H] and lm_head [V, H] must have the final norm's H = ", H,
                      " (dense, or as GGUF blocks), got ", embed.sizes(), " and ", lm_head.sizes());
    const at::ScalarType dtype = rope.scalar_type();
    d_ = check_model(dtype, embed.device(), H, weights_, norm, kv, heads, hidden_norm.defined() ? 2 * H : 0);
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

  int64_t vocab() const { return head_.size(0); }
  int64_t hidden_size() const { return d_.H; }

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
  const T* normed() const { return out_.data(); }
  const T* forward_logits_out() const { return logits_.data(); }  // the last forward's logits, when it made them

  // Logits [rows, V'] of hidden states [rows, H]. Valid until the next call.
  const T* logits(const T* hidden, int64_t rows) {
    logits_.resize(rows * vocab());
    if (rows > 0) linear(hidden, head(), nullptr, logits_.data(), rows, vocab(), d_.H);
    return logits_.data();
  }

 private:
  void run(const int64_t* tokens, int64_t ld, int64_t B, int64_t T_, const int64_t* start, bool with_logits,
           const T* feats = nullptr) {
    const int64_t H = d_.H, D = d_.D, M = B * T_, V = embed_.size(0), P = rope_.size(1);
    h_.resize(M * H);
    cos_sin_.resize(2 * M * D);
    out_.resize(M * H);
    if (with_logits) logits_.resize(M * vocab());
    seqlens_.assign(start, start + B);
    if (mask_size_ < M * T_) mask_.reset(new bool[M * T_]), mask_size_ = M * T_;
    const T* emb = embed_qtype_ == 0 ? embed_.data_ptr<T>() : nullptr;
    const uint8_t* emb_blocks = embed_qtype_ != 0 ? embed_.data_ptr<uint8_t>() : nullptr;
    row_.resize(H);
    const T* cos = rope_.data_ptr<T>();
    const T* sin = cos + P * D;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T_; ++t) {
        const int64_t m = b * T_ + t, tok = tokens[b * ld + t], pos = start[b] + t;
        TORCH_CHECK_VALUE(tok >= 0 && tok < V, op_, ": token ", tok, " is not an id of the ", V, "-token embedding");
        TORCH_CHECK_VALUE(pos >= 0 && pos < P, op_, ": position ", pos, " needs a longer RoPE table than ", P);
        if (emb != nullptr) {
          for (int64_t i = 0; i < H; ++i) h_[m * H + i] = to_f(emb[tok * H + i]);
        } else {
          dequant_row(emb_blocks, embed_qtype_, H / kQuantBlock, tok, row_.data());
          for (int64_t i = 0; i < H; ++i) h_[m * H + i] = to_f(row_[i]);
        }
        std::copy(cos + pos * D, cos + (pos + 1) * D, cos_sin_.data() + m * D);
        std::copy(sin + pos * D, sin + (pos + 1) * D, cos_sin_.data() + (M + m) * D);
        for (int64_t j = 0; j < T_; ++j) mask_[m * T_ + j] = j <= t;
      }
    }
    Problem<T> p = p_;
    if (feats != nullptr) head_inputs(feats, M, p);
    p.B = B, p.T_ = T_;
    p.seqlens = seqlens_.data();
    p.tree_mask = mask_.get();
    p.cos = cos_sin_.data();
    p.sin = p.cos + M * D;
    check_positions(p, B, T_);
    if (M == 0) return;
    run_layers(p, weights_, norm_.data_ptr<T>(), h_.data(), out_.data(), with_logits ? head() : Weight{},
               vocab(), logits_.data());
    if (feats != nullptr) raw_.assign(h_.begin(), h_.end());
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
  bool norm_before_residual_ = false;
  std::vector<T> attn_in_, raw_;  // a head's [M, 2 H] attention input and [M, H] raw outputs
  std::vector<float> row_f_;      // [H]: one feature in float32
  int64_t embed_qtype_ = 0, head_qtype_ = 0;  // GGUF type ids, 0 for dense
  std::vector<T> row_;                         // [H]: a quantized embedding row in the model's dtype
  Dims d_{};
  Problem<T> p_{};
  std::vector<float> h_;  // the residual stream in float32
  std::vector<T> cos_sin_, out_, logits_;
  std::vector<int64_t> seqlens_;
  std::unique_ptr<bool[]> mask_;
  int64_t mask_size_ = 0;
};

// A greedy chain: tokens tok [B, gamma] (row stride gamma), token d the argmax of token d - 1's logits (the first of
// the roots' logits [B, V]), tokens 1 .. gamma - 1 run through `model` at positions L_b + d. ``strict``: a row's
// tokens are -1 from its first non-finite logits on. ``id_of`` [V] (or null): a restricted vocabulary's token ids.
// ``stops`` [S]: the chain ends after the first token d at which any row emits one of them (no forward past it; the
// rows' tokens after d are left unwritten). Returns the tokens per row it emitted: gamma, or that d.
template <typename T, typename R>
int64_t run_chain(ChainRunner<T>& model, const R* root, int64_t V, const int64_t* L, int64_t B, int64_t gamma,
                  bool strict, const int64_t* id_of, int64_t* tok, const std::vector<int64_t>& stops = {}) {
  std::vector<int64_t> ids(B), pos(B);
  const T* logits = nullptr;  // [B, V]
  for (int64_t d = 1; d <= gamma; ++d) {
    bool stopped = false;
    for (int64_t b = 0; b < B; ++b) {
      int64_t& t = tok[b * gamma + d - 1];
      t = d > 1 && tok[b * gamma + d - 2] < 0 ? -1  // a strict row stays -1 after its first bad logits
          : d == 1                            ? greedy::argmax(root + b * V, V, strict)
                                              : greedy::argmax(logits + b * V, V, strict);
      if (id_of != nullptr) t = id_of[t];  // never strict: t >= 0
      ids[b] = std::max<int64_t>(t, 0);    // a -1 row runs token 0
      pos[b] = L[b] + d;                   // the node's slot
      stopped = stopped || std::find(stops.begin(), stops.end(), t) != stops.end();
    }
    if (d == gamma || stopped) return d;
    logits = model.forward_logits(ids.data(), 1, B, 1, pos.data());  // [B, V]
  }
  return gamma;
}

// The block table as the runners read it: int32, contiguous (undefined when absent).
at::Tensor table_of(const c10::optional<at::Tensor>& block_table) {
  return block_table.has_value() ? block_table->to(at::kInt).contiguous() : at::Tensor();
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

}  // namespace

// A greedy draft chain in one call: from the roots' draft logits [B, V], gamma tokens per row, each the argmax of
// the previous one's logits; the first gamma - 1 run through the model at positions L_b + d (their K/V written there,
// as the drafter's per-level forwards would). Returns tokens [B, gamma] int64. Why: a drafted level costs its weights
// plus more than twice that in Python and op dispatch when driven level by level from Python (the default draft); here
// one call pays the dispatch once. The target's plain greedy decoding runs the same chain (``strict``: from a row's
// first non-finite logits on, its tokens are -1, and the engine decodes that step the regular way).
at::Tensor draft_chain_cpu(const at::Tensor& root_logits, const at::Tensor& embed, at::TensorList weights,
                           const at::Tensor& final_norm, const at::Tensor& lm_head, at::Tensor kv_cache,
                           const at::Tensor& cache_seqlens, const at::Tensor& rope_table,
                           const c10::optional<at::Tensor>& block_table, int64_t num_heads, double eps,
                           int64_t gamma, bool strict, const c10::optional<at::Tensor>& vocab_map) {
  TORCH_CHECK_VALUE(root_logits.dim() == 2 && root_logits.device().is_cpu(),
                    "draft_chain: root_logits must be [B, V] on CPU, got ", root_logits.sizes());
  TORCH_CHECK_TYPE(root_logits.scalar_type() == at::kFloat || root_logits.scalar_type() == at::kBFloat16,
                   "draft_chain: root_logits must be float32 or bfloat16, got ", root_logits.scalar_type());
  const int64_t B = root_logits.size(0), V = root_logits.size(1);
  TORCH_CHECK_VALUE(gamma >= 1, "draft_chain: gamma must be >= 1, got ", gamma);
  TORCH_CHECK_VALUE(embed.dim() == 2 && embed.size(0) >= V && lm_head.dim() == 2 && lm_head.size(0) == V &&
                        lm_head.is_contiguous(),
                    "draft_chain: embed [V, H] and a contiguous lm_head [V, H] must match the logits' V = ", V,
                    ", got ", embed.sizes(), " and ", lm_head.sizes());
  // a restricted draft vocabulary: logits and lm_head rows are over vocab_map [V] (token ids), not over all ids
  TORCH_CHECK_VALUE(!vocab_map.has_value() || !strict, "draft_chain: a strict (target) chain has no vocab_map");
  const at::Tensor ids = vocab_ids("draft_chain", vocab_map, V, embed.size(0));
  TORCH_CHECK_VALUE(rope_table.dim() == 3 && rope_table.size(0) == 2, "draft_chain: rope_table must be [2, P, D]");
  TORCH_CHECK_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == B,
                    "draft_chain: cache_seqlens must be [B] = [", B, "]");
  const at::Tensor seqlens = cache_seqlens.to(at::kLong).contiguous();  // [B]: the roots' positions L_b
  const int64_t max_pos = B > 0 ? seqlens.max().item<int64_t>() + gamma : 0;
  TORCH_CHECK_VALUE(max_pos <= rope_table.size(1), "draft_chain: positions up to ", max_pos,
                    " need a longer RoPE table than ", rope_table.size(1));
  at::Tensor tokens = at::empty({B, gamma}, seqlens.options());  // [B, gamma]
  const int64_t* L = seqlens.data_ptr<int64_t>();
  const int64_t* id_of = ids.defined() ? ids.data_ptr<int64_t>() : nullptr;
  const at::Tensor table = table_of(block_table);
  with_dtype(rope_table.scalar_type(), [&](auto type) {
    ChainRunner<decltype(type)> model("draft_chain", embed, weights, final_norm, lm_head, kv_cache, rope_table,
                                      num_heads, eps, table, B);
    with_dtype(root_logits.scalar_type(), [&](auto root_type) {  // the target's roots: float32 logits
      run_chain(model, root_logits.data_ptr<decltype(root_type)>(), V, L, B, gamma, strict, id_of,
                tokens.data_ptr<int64_t>());
    });
  });
  return tokens;
}

// K plain greedy steps in one call (the target's plain decoding, batched): the roots [B] run at positions L_b, then
// token d = 1 .. K is the argmax of the previous forward's logits, tokens 1 .. K - 1 run at L_b + d (their K/V
// written there, as K one-token steps would). Returns tokens [B, K'] int64, K' <= K: the call ends after the first
// token at which any row emits one of stop_ids [S] (a row's end of text: no forward is spent past it, so a long
// chain costs nothing at a request's end; the engine cuts each row at its own stop tokens and runs the rows that
// go on in its next call). From a row's first non-finite logits on its tokens are -1 (the engine then decodes that
// step the regular way, which sanitises or raises).
at::Tensor greedy_steps_cpu(const at::Tensor& roots, const at::Tensor& embed, at::TensorList weights,
                            const at::Tensor& final_norm, const at::Tensor& lm_head, at::Tensor kv_cache,
                            const at::Tensor& cache_seqlens, const at::Tensor& rope_table,
                            const c10::optional<at::Tensor>& block_table, int64_t num_heads, double eps,
                            int64_t steps, const c10::optional<at::Tensor>& stop_ids) {
  TORCH_CHECK_VALUE(roots.dim() == 1 && roots.device().is_cpu(), "greedy_steps: roots must be [B] on CPU, got ",
                    roots.sizes());
  TORCH_CHECK_VALUE(!stop_ids.has_value() || (stop_ids->dim() == 1 && stop_ids->device().is_cpu()),
                    "greedy_steps: stop_ids must be [S] on CPU");
  const int64_t B = roots.size(0);
  TORCH_CHECK_VALUE(steps >= 1, "greedy_steps: steps must be >= 1, got ", steps);
  TORCH_CHECK_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == B,
                    "greedy_steps: cache_seqlens must be [B] = [", B, "]");
  TORCH_CHECK_VALUE(rope_table.dim() == 3 && rope_table.size(0) == 2, "greedy_steps: rope_table must be [2, P, D]");
  const at::Tensor ids = roots.to(at::kLong).contiguous();              // [B]
  const at::Tensor seqlens = cache_seqlens.to(at::kLong).contiguous();  // [B]: the roots' positions L_b
  at::Tensor tokens = at::empty({B, steps}, seqlens.options());        // [B, K]
  const at::Tensor table = table_of(block_table);
  std::vector<int64_t> stops;  // [S]
  if (stop_ids.has_value()) {
    const at::Tensor s = stop_ids->to(at::kLong).contiguous();
    stops.assign(s.data_ptr<int64_t>(), s.data_ptr<int64_t>() + s.numel());
  }
  int64_t ran = steps;
  with_dtype(rope_table.scalar_type(), [&](auto type) {
    ChainRunner<decltype(type)> model("greedy_steps", embed, weights, final_norm, lm_head, kv_cache, rope_table,
                                      num_heads, eps, table, B);
    const int64_t* L = seqlens.data_ptr<int64_t>();
    const auto* logits = model.forward_logits(ids.data_ptr<int64_t>(), 1, B, 1, L);  // [B, V]
    ran = run_chain(model, logits, model.vocab(), L, B, steps, true, nullptr, tokens.data_ptr<int64_t>(), stops);
  });
  return ran == steps ? tokens : tokens.narrow(1, 0, ran).contiguous();  // [B, K']
}

// An EAGLE-3 head's draft in one call: entries (b, t) of tokens [B, T] at positions start[b] + t, each with the
// target's feature of the position before it from the paged feature cache [1, num_blocks, block_size, H] (zeros at
// position 0): a prefill chunk or a step's catch-up, their K/V written. Then, from each row's root (entry last[b],
// at position R_b = start[b] + last[b]), a greedy chain of gamma tokens: token d the argmax of the head's logits at
// node d - 1 (over vocab_map's ids when given), nodes 1 .. gamma - 1 run at R_b + d with their parent's output as
// their feature (K/V written there), as the drafter's level-by-level chain does. Returns (the entries' raw outputs
// [B, T, H], the chain [B, gamma] int64; [B, 0] for gamma = 0). Why: driven from Python, a head step is dozens of
// small torch ops (two norms, a cat, the layer, a 49152-wide scatter of the draft logits) whose dispatch cost more
// than the head's weights.
std::tuple<at::Tensor, at::Tensor> eagle3_draft_cpu(
    const at::Tensor& tokens, const at::Tensor& start, const at::Tensor& last, const at::Tensor& feature_cache,
    const at::Tensor& embed, at::TensorList weights, const at::Tensor& hidden_norm, const at::Tensor& norm,
    const at::Tensor& lm_head, at::Tensor kv_cache, const at::Tensor& rope_table,
    const c10::optional<at::Tensor>& block_table, int64_t num_heads, double eps, bool norm_before_residual,
    int64_t gamma, const c10::optional<at::Tensor>& vocab_map) {
  TORCH_CHECK_VALUE(tokens.dim() == 2 && tokens.device().is_cpu(), "eagle3_draft: tokens must be [B, T] on CPU, got ",
                    tokens.sizes());
  const int64_t B = tokens.size(0), T_ = tokens.size(1), H = norm.size(0);
  TORCH_CHECK_VALUE(gamma >= 0, "eagle3_draft: gamma must be >= 0, got ", gamma);
  TORCH_CHECK_VALUE(T_ >= 1 || B == 0, "eagle3_draft: tokens must hold at least one entry per row");
  for (const at::Tensor* t : {&start, &last}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == B, "eagle3_draft: start and last must be [B] = [", B, "]");
  }
  TORCH_CHECK_VALUE(kv_cache.dim() == 6, "eagle3_draft: kv_cache must be [1, 2, blocks, block_size, Hkv, D]");
  TORCH_CHECK_VALUE(feature_cache.dim() == 4 && feature_cache.size(1) == kv_cache.size(2) &&
                        feature_cache.size(2) == kv_cache.size(3) && feature_cache.size(3) == H &&
                        feature_cache.scalar_type() == rope_table.scalar_type() && feature_cache.is_contiguous() &&
                        feature_cache.device().is_cpu(),
                    "eagle3_draft: feature_cache must be a contiguous ", rope_table.scalar_type(),
                    " [1, blocks, block_size, H] on the KV cache's blocks with H = ", H, ", got ",
                    feature_cache.sizes(), " ", feature_cache.scalar_type());
  const at::Tensor ids = tokens.to(at::kLong).contiguous();  // [B, T]
  const at::Tensor first = start.to(at::kLong).contiguous(), root_t = last.to(at::kLong).contiguous();  // [B]
  const at::Tensor table = table_of(block_table);
  const at::Tensor id_map = vocab_ids("eagle3_draft", vocab_map, lm_head.size(0), embed.size(0));
  const int64_t* S = first.data_ptr<int64_t>();
  const int64_t* R = root_t.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(S[b] >= 0 && R[b] >= 0 && R[b] < T_, "eagle3_draft: row ", b, " has start ", S[b],
                      " and last ", R[b], " (must lie in [0, ", T_, "))");
  }
  at::Tensor out = at::empty({B, T_, H}, feature_cache.options());  // [B, T, H]
  at::Tensor chain = at::empty({B, gamma}, ids.options());          // [B, gamma]
  if (B == 0) return {out, chain};
  with_dtype(rope_table.scalar_type(), [&](auto type) {
    using T = decltype(type);
    ChainRunner<T> head("eagle3_draft", embed, weights, norm, lm_head, kv_cache, rope_table, num_heads, eps, table,
                        B, hidden_norm, norm_before_residual);
    // the entries' features: position p - 1 of the row's feature cache, zeros before the first token
    const int64_t block_size = feature_cache.size(2), max_blocks = table.defined() ? table.size(1) : 1;
    const int32_t* blocks = table.defined() ? table.data_ptr<int32_t>() : nullptr;
    const T* cache = feature_cache.data_ptr<T>();
    std::vector<T> feats(B * T_ * H, static_cast<T>(0.f));  // [B * T, H]
    for (int64_t b = 0; b < B; ++b) {
      const int64_t capacity = blocks != nullptr ? max_blocks * block_size : block_size;
      TORCH_CHECK_VALUE(S[b] + T_ <= capacity, "eagle3_draft: row ", b, " needs positions up to ", S[b] + T_,
                        " but its cache holds ", capacity);
      for (int64_t t = 0; t < T_; ++t) {
        const int64_t pos = S[b] + t - 1;
        if (pos < 0) continue;
        const int64_t block = blocks != nullptr ? blocks[b * max_blocks + pos / block_size] : b;
        TORCH_CHECK_VALUE(block >= 0 && block < feature_cache.size(1), "eagle3_draft: block_table[", b, "] names ",
                          "block ", block, " outside the cache");
        const T* src = cache + (block * block_size + pos % block_size) * H;
        std::copy(src, src + H, feats.begin() + (b * T_ + t) * H);
      }
    }
    const T* raw = head.forward_head(ids.data_ptr<int64_t>(), T_, B, T_, S, feats.data(), false);  // [B * T, H]
    std::copy(raw, raw + B * T_ * H, out.data_ptr<T>());
    if (gamma == 0) return;
    // the roots: their raw outputs feed node 1, their final-normed ones give the first logits
    std::vector<T> prev(B * H), roots(B * H);  // [B, H]
    std::vector<int64_t> pos(B), next(B);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t m = b * T_ + R[b];
      std::copy(raw + m * H, raw + (m + 1) * H, prev.begin() + b * H);
      std::copy(head.normed() + m * H, head.normed() + (m + 1) * H, roots.begin() + b * H);
    }
    const int64_t V = head.vocab();
    const int64_t* id_of = id_map.defined() ? id_map.data_ptr<int64_t>() : nullptr;
    const T* logits = head.logits(roots.data(), B);  // [B, V]
    int64_t* tok = chain.data_ptr<int64_t>();
    for (int64_t d = 1; d <= gamma; ++d) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t best = std::max<int64_t>(greedy::argmax(logits + b * V, V, false), 0);
        next[b] = tok[b * gamma + d - 1] = id_of != nullptr ? id_of[best] : best;
        pos[b] = S[b] + R[b] + d;
      }
      if (d == gamma) break;
      const T* h = head.forward_head(next.data(), 1, B, 1, pos.data(), prev.data(), true);  // [B, H]
      std::copy(h, h + B * H, prev.begin());
      logits = head.forward_logits_out();  // [B, V]
    }
  });
  return {out, chain};
}

namespace {

// The rows of a speculative call (spec_chain_cpu): per row the draft cache's gap then the root (row stride `ld`),
// its length, L_b, and the tokens it may still emit.
struct ChainRows {
  int64_t B, gamma, max_steps;
  bool stop_on_reject;
  std::vector<int64_t> gap, gap_len, L, room, stops;
  int64_t ld;
  const int64_t* id_of;  // the draft's restricted vocabulary's ids, or null
};

// The steps of spec_chain_cpu into steps [B, S, gamma + 2] and times [S, 2]; leaves the rows' gaps in `r`.
template <typename TT, typename TD>
void run_spec_chain(ChainRunner<TT>& target, ChainRunner<TD>& draft, ChainRows& r, int64_t* out, double* secs) {
  const int64_t B = r.B, gamma = r.gamma, T = gamma + 1, max_steps = r.max_steps;
  if (B == 0) return;
  const auto is_stop = [&](int64_t t) { return std::find(r.stops.begin(), r.stops.end(), t) != r.stops.end(); };
  std::vector<int64_t> d_start(B), roots(B), drafts(B * gamma), tokens(B * T), next_gap(B * 2);
  std::vector<TD> d_root;  // [B, H_d]
  std::vector<std::vector<int64_t>> emitted(B);
  for (int64_t s = 0; s < max_steps; ++s) {
    bool fits = true;
    for (int64_t b = 0; b < B; ++b) fits = fits && r.room[b] >= T;
    if (!fits) break;
    const auto start = std::chrono::steady_clock::now();
    // 1. the draft catches up: its gap then the root, at positions D_b ..; the root's logits seed the chain
    const int64_t width = *std::max_element(r.gap_len.begin(), r.gap_len.end());
    for (int64_t b = 0; b < B; ++b) {
      d_start[b] = r.L[b] - r.gap_len[b] + 1;
      roots[b] = r.gap[b * r.ld + r.gap_len[b] - 1];
    }
    const TD* d_hidden = draft.forward(r.gap.data(), r.ld, B, width, d_start.data());  // [B * width, H_d]
    const int64_t H_d = draft.hidden_size();
    d_root.clear();
    for (int64_t b = 0; b < B; ++b) {  // [B, H_d]: each row's root
      const TD* row = d_hidden + (b * width + r.gap_len[b] - 1) * H_d;
      d_root.insert(d_root.end(), row, row + H_d);
    }
    const TD* d_logits = draft.logits(d_root.data(), B);  // [B, V_d]
    run_chain(draft, d_logits, draft.vocab(), r.L.data(), B, gamma, false, r.id_of, drafts.data());
    const auto drafted = std::chrono::steady_clock::now();
    // 2. the target runs the root and the chain
    for (int64_t b = 0; b < B; ++b) {
      tokens[b * T] = roots[b];
      std::copy(drafts.begin() + b * gamma, drafts.begin() + (b + 1) * gamma, tokens.begin() + b * T + 1);
    }
    const TT* logits = target.forward_logits(tokens.data(), T, B, T, r.L.data());  // [B * T, V]
    // 3. greedy acceptance: the longest prefix of drafts equal to the target's argmax, then its own next token
    const int64_t V = target.vocab();
    bool finite = true;
    for (int64_t b = 0; b < B && finite; ++b) {
      emitted[b].clear();
      for (int64_t j = 0; j < T; ++j) {
        const int64_t best = greedy::argmax(logits + (b * T + j) * V, V, true);
        if (best < 0) {
          finite = false;
          break;
        }
        emitted[b].push_back(best);
        if (j == gamma || drafts[b * gamma + j] != best) break;
      }
    }
    if (!finite) break;  // nothing of this step is committed
    bool stopped = false;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = static_cast<int64_t>(emitted[b].size());
      int64_t* row = out + (b * max_steps + s) * (gamma + 2);
      row[0] = n;
      for (int64_t i = 0; i < n; ++i) {
        row[1 + i] = emitted[b][i];
        stopped = stopped || is_stop(emitted[b][i]);
      }
      // the draft cache holds the root and drafts 1 .. gamma - 1: all accepted -> draft gamma is its gap
      const bool all = n == T;
      next_gap[b * 2] = all ? drafts[b * gamma + gamma - 1] : emitted[b][n - 1];
      next_gap[b * 2 + 1] = emitted[b][n - 1];
      r.gap_len[b] = all ? 2 : 1;
      r.L[b] += n;
      r.room[b] -= n;
      stopped = stopped || (r.stop_on_reject && n == 1);
    }
    r.gap = next_gap;
    r.ld = 2;
    const auto end = std::chrono::steady_clock::now();
    secs[2 * s] = std::chrono::duration<double>(drafted - start).count();
    secs[2 * s + 1] = std::chrono::duration<double>(end - start).count();
    if (stopped) break;
  }
}

}  // namespace

// Up to max_steps greedy speculative steps of a draft model's chain in one call: per step, the draft catches up
// on the tokens its cache lacks (then the root), drafts gamma tokens (draft_chain), the target runs the root and
// the chain at L_b .. L_b + gamma, and the longest prefix of drafts equal to the target's argmax is accepted, plus
// the target's own next token. A chain's accepted nodes are a prefix: both caches stay in place (no compaction).
// The engine's step does the same work in ~10 Python-driven op calls; here it costs its kernels (ChainRunner: no
// ATen op inside the steps).
//
// pending [B, P] int64: per row the tokens at positions D_b .. L_b (the draft cache's gap, then the root), padded
// at the end; pending_lens [B]: their counts (>= 1); seqlens [B]: L_b; budget [B]: tokens the row may still emit
// (a step starts only if every row has gamma + 1 of them left); stop_ids [S]: a step that emits one of them for any
// row is the last, and so is one where some row accepted no draft when ``stop_on_reject`` (an adaptive controller
// re-decides the depth after it). A step whose visited target logits are not finite (a NaN, or a non-finite
// maximum) is dropped and ends the call: the engine's regular step decodes it (and sanitises or raises).
//
// Returns (steps [B, max_steps, gamma + 2] int64: per step the count n of emitted tokens then the tokens, -1
// padded, n = 0 for steps not run; pending_out [B, 2] and pending_lens_out [B]: the rows' new gaps; times
// [max_steps, 2] float64: per step the draft's and the whole step's seconds).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> spec_chain_cpu(
    const at::Tensor& pending, const at::Tensor& pending_lens, const at::Tensor& seqlens, const at::Tensor& t_embed,
    at::TensorList t_weights, const at::Tensor& t_norm, const at::Tensor& t_lm_head, at::Tensor t_kv,
    const at::Tensor& t_rope, int64_t t_heads, double t_eps, const at::Tensor& d_embed, at::TensorList d_weights,
    const at::Tensor& d_norm, const at::Tensor& d_lm_head, at::Tensor d_kv, const at::Tensor& d_rope,
    int64_t d_heads, double d_eps, const c10::optional<at::Tensor>& block_table, const at::Tensor& budget,
    const at::Tensor& stop_ids, int64_t gamma, int64_t max_steps, bool stop_on_reject,
    const c10::optional<at::Tensor>& d_vocab_map) {
  TORCH_CHECK_VALUE(pending.dim() == 2 && pending.size(1) >= 1, "spec_chain: pending must be [B, P], got ",
                    pending.sizes());
  const int64_t B = pending.size(0), P = pending.size(1);
  TORCH_CHECK_VALUE(gamma >= 1 && max_steps >= 1, "spec_chain: gamma and max_steps must be >= 1");
  for (const at::Tensor* t : {&pending_lens, &seqlens, &budget}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == B, "spec_chain: per-row inputs must be [B] = [", B, "]");
  }
  TORCH_CHECK_VALUE(t_lm_head.is_contiguous() && d_lm_head.is_contiguous(), "spec_chain: lm_heads must be contiguous");
  const at::TensorOptions longs = pending.options().dtype(at::kLong);
  const at::Tensor ids = vocab_ids("spec_chain", d_vocab_map, d_lm_head.size(0), d_embed.size(0));

  ChainRows rows{B, gamma, max_steps, stop_on_reject, {}, std::vector<int64_t>(B), std::vector<int64_t>(B),
                 std::vector<int64_t>(B), {}, P, ids.defined() ? ids.data_ptr<int64_t>() : nullptr};
  const at::Tensor gap = pending.to(at::kLong).contiguous();  // [B, P]
  rows.gap.assign(gap.data_ptr<int64_t>(), gap.data_ptr<int64_t>() + B * P);
  const at::Tensor lens = pending_lens.to(at::kLong).contiguous(), L = seqlens.to(at::kLong).contiguous(),
                   room = budget.to(at::kLong).contiguous(), stops = stop_ids.to(at::kLong).contiguous();
  for (int64_t b = 0; b < B; ++b) {
    rows.gap_len[b] = lens.data_ptr<int64_t>()[b];
    rows.L[b] = L.data_ptr<int64_t>()[b];
    rows.room[b] = room.data_ptr<int64_t>()[b];
    TORCH_CHECK_VALUE(rows.gap_len[b] >= 1 && rows.gap_len[b] <= P && rows.L[b] >= rows.gap_len[b] - 1,
                      "spec_chain: row ", b, " has pending_lens ", rows.gap_len[b], " and L_b ", rows.L[b]);
  }
  rows.stops.assign(stops.data_ptr<int64_t>(), stops.data_ptr<int64_t>() + stops.numel());

  at::Tensor steps = at::full({B, max_steps, gamma + 2}, -1, longs);  // [B, S, gamma + 2]
  steps.select(2, 0).zero_();
  at::Tensor times = at::zeros({max_steps, 2}, longs.dtype(at::kDouble));  // [S, 2]
  int64_t* out = steps.data_ptr<int64_t>();
  double* secs = times.data_ptr<double>();
  const at::Tensor table = table_of(block_table);
  with_dtype(t_rope.scalar_type(), [&](auto target_type) {
    with_dtype(d_rope.scalar_type(), [&](auto draft_type) {  // a draft may be narrower than its target
      ChainRunner<decltype(target_type)> target("spec_chain", t_embed, t_weights, t_norm, t_lm_head, t_kv, t_rope,
                                                t_heads, t_eps, table, B);
      ChainRunner<decltype(draft_type)> draft("spec_chain", d_embed, d_weights, d_norm, d_lm_head, d_kv, d_rope,
                                              d_heads, d_eps, table, B);
      run_spec_chain(target, draft, rows, out, secs);
    });
  });
  // [B, 2]: at most the last draft and the bonus (pending itself when no step ran)
  at::Tensor next_gap = rows.ld == 2 ? at::empty({B, 2}, longs) : gap.clone();
  if (rows.ld == 2) std::copy(rows.gap.begin(), rows.gap.end(), next_gap.data_ptr<int64_t>());
  return {steps, next_gap, at::tensor(rows.gap_len, longs), times};
}

}  // namespace specdec
