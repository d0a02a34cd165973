// The native step runners' op entry points (their pieces: csrc/runner_cpu.h): a draft's greedy chain
// (draft_chain), the target's plain steps (plain_steps), an EAGLE-3 head's entries and chain (eagle3_draft),
// greedy speculative steps of a draft model's or a head's chains (spec_chain) and one greedy step over trees drafted
// elsewhere (tree_step). Each forward is the layer stack's (csrc/layers_cpu.h), so a runner emits exactly the tokens
// the op path's steps emit. Each takes its models as NativeModel objects (csrc/native_model.h), built and checked
// once per model.

#include "native_model.h"
#include "head_draft_cpu.h"

namespace specdec {

NativeModel::NativeModel(at::Tensor embed_, std::vector<at::Tensor> weights_, at::Tensor final_norm_,
                         at::Tensor lm_head_, at::Tensor rope_table_, int64_t num_heads_, double eps_,
                         c10::optional<at::Tensor> vocab_map_)
    : embed(embed_.contiguous()),
      final_norm(final_norm_.contiguous()),
      lm_head(lm_head_.contiguous()),
      rope_table(rope_table_.contiguous()),
      weights(std::move(weights_)),
      num_heads(num_heads_),
      eps(eps_) {
  // a quantized embed / lm_head may be GGUF blocks [V, H / block_weights, block_bytes] (layer_ops_cpu.h's qtype_of)
  TORCH_CHECK_VALUE(embed.dim() >= 2 && lm_head.dim() >= 2 && final_norm.dim() == 1,
                    "NativeModel: embed [V, H], lm_head [K, H] and final_norm [H] expected, got ", embed.sizes(), ", ",
                    lm_head.sizes(), " and ", final_norm.sizes());
  TORCH_CHECK_VALUE(rope_table.dim() == 3 && rope_table.size(0) == 2,
                    "NativeModel: rope_table must be [2, P, D], got ", rope_table.sizes());
  TORCH_CHECK_VALUE(embed.device().is_cpu() && lm_head.device().is_cpu() && rope_table.device().is_cpu(),
                    "NativeModel: the native runners take CPU tensors");
  TORCH_CHECK_VALUE(num_heads >= 1, "NativeModel: num_heads must be >= 1, got ", num_heads);
  ids = specdec::vocab_ids("NativeModel", vocab_map_, lm_head.size(0), embed.size(0));
}

void NativeModel::set_variant(std::vector<int64_t> windows_, c10::optional<at::Tensor> rope_local_,
                              double softmax_scale_, double softcap_, std::string activation_, double embed_scale_,
                              double final_softcap_) {
  const int64_t layers = static_cast<int64_t>(weights.size()) / kNumFields;
  TORCH_CHECK_VALUE(embed_scale_ >= 0. && final_softcap_ >= 0., "NativeModel.set_variant: embed_scale and ",
                    "final_softcap must be >= 0 (0: none), got ", embed_scale_, " and ", final_softcap_);
  variant = make_variant("NativeModel.set_variant", layers, std::move(windows_), rope_local_, rope_table,
                         softmax_scale_, softcap_, activation_);
  embed_scale = embed_scale_;
  final_softcap = final_softcap_;
  has_variant = true;
}

void NativeModel::set_head(at::Tensor hidden_norm_, at::Tensor fc_, bool norm_before_residual_,
                           std::vector<int64_t> capture_) {
  TORCH_CHECK_VALUE(hidden_norm_.dim() == 1 && hidden_norm_.size(0) == final_norm.size(0),
                    "NativeModel.set_head: hidden_norm must be [H] = [", final_norm.size(0), "], got ",
                    hidden_norm_.sizes());
  TORCH_CHECK_VALUE(!capture_.empty() && fc_.dim() == 2 && fc_.size(0) == final_norm.size(0) &&
                        fc_.size(1) % static_cast<int64_t>(capture_.size()) == 0,
                    "NativeModel.set_head: fc must be [H, layers * H_target] over the captured layers, got ",
                    fc_.sizes(), " for ", capture_.size(), " layers");
  TORCH_CHECK_TYPE(fc_.scalar_type() == rope_table.scalar_type(),
                   "NativeModel.set_head: fc must be in the head's dtype");
  TORCH_CHECK_VALUE(fc_.device().is_cpu() && hidden_norm_.device().is_cpu(),
                    "NativeModel.set_head: fc and hidden_norm must be on the CPU, got ", fc_.device(), " and ",
                    hidden_norm_.device());
  hidden_norm = hidden_norm_.contiguous();
  fc = fc_.contiguous();
  norm_before_residual = norm_before_residual_;
  capture = std::move(capture_);
}

namespace {

constexpr int64_t kMaxTreeNodes = 1024;  // spec_chain's widest tree (spec_kernels.decoder_layers.SPEC_CHAIN_MAX_NODES)

// The runner of `m` (its KV cache `kv`, the block table, B rows) for op `op`.
template <typename T>
ChainRunner<T> runner_of(const char* op, const NativeModel& m, const at::Tensor& kv, const at::Tensor& table,
                         int64_t B) {
  ChainRunner<T> runner(op, m.embed, m.weights, m.final_norm, m.lm_head, kv, m.rope_table, m.num_heads, m.eps, table,
                        B, m.hidden_norm, m.norm_before_residual, m.has_variant);
  if (m.has_variant) runner.set_variant(m.variant, m.embed_scale, m.final_softcap);
  return runner;
}

using OptTensor = c10::optional<at::Tensor>;

// The entries of a native call's Tensor?[] argument `arg`, which holds `fields` (their names, for the error): n of
// them, or none where `empty_ok`.
std::vector<OptTensor> entries_of(const char* op, const char* arg, const OptTensorList& list, size_t n,
                                  const char* fields, bool empty_ok = false) {
  TORCH_CHECK_VALUE(list.size() == n || (empty_ok && list.size() == 0), op, ": ", arg, " must be [", fields, "]",
                    empty_ok ? " or []" : "", ", got ", list.size(), " entries");
  std::vector<OptTensor> out;
  for (size_t i = 0; i < list.size(); ++i) out.push_back(list.get(i));
  return out;
}

at::Tensor required(const char* op, const OptTensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.has_value(), op, ": ", name, " is required, got None");
  return *t;
}

// A native call's sampled rows (Sampling, csrc/runner_cpu.h) from its `sampling` argument [temperature, noise_seeds,
// top_k, top_p, min_p] ([]: every row greedy), checked: temperature [B] float32 and noise_seeds [B] int64 together
// (none: every row greedy); top_k [B] int64, top_p and min_p [B] float32 together, with them.
Sampling sampling_of(const char* op, int64_t B, const OptTensorList& sampling) {
  std::vector<OptTensor> e =
      entries_of(op, "sampling", sampling, 5, "temperature, noise_seeds, top_k, top_p, min_p", true);
  e.resize(5);
  const OptTensor &temperature = e[0], &noise_seeds = e[1], &top_k = e[2], &top_p = e[3], &min_p = e[4];
  Sampling s;
  TORCH_CHECK_VALUE(temperature.has_value() == noise_seeds.has_value(), op, ": temperature and noise_seeds go together");
  TORCH_CHECK_VALUE(top_k.has_value() == top_p.has_value() && top_p.has_value() == min_p.has_value() &&
                        (!top_k.has_value() || temperature.has_value()),
                    op, ": top_k, top_p and min_p go together, with temperature");
  if (!temperature.has_value()) return s;
  const auto rows = [&](const at::Tensor& t, at::ScalarType type) {
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == B && t.scalar_type() == type, op,
                      ": per-row sampling inputs must be [B] = [", B, "] ", type, ", got ", t.sizes(), " ",
                      t.scalar_type());
    return t.contiguous();
  };
  const at::Tensor t = rows(*temperature, at::kFloat), seeds = rows(*noise_seeds, at::kLong);
  s.temperature.assign(t.data_ptr<float>(), t.data_ptr<float>() + B);
  s.seeds.assign(seeds.data_ptr<int64_t>(), seeds.data_ptr<int64_t>() + B);
  for (const float v : s.temperature) {
    TORCH_CHECK_VALUE(std::isfinite(v) && v >= 0.0f, op, ": temperatures must be finite and >= 0, got ", v);
  }
  if (!top_k.has_value()) return s;
  const at::Tensor k = rows(*top_k, at::kLong), p = rows(*top_p, at::kFloat), m = rows(*min_p, at::kFloat);
  s.top_k.assign(k.data_ptr<int64_t>(), k.data_ptr<int64_t>() + B);
  s.top_p.assign(p.data_ptr<float>(), p.data_ptr<float>() + B);
  s.min_p.assign(m.data_ptr<float>(), m.data_ptr<float>() + B);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(s.top_k[b] >= 0 && s.top_p[b] > 0.0f && s.top_p[b] <= 1.0f && s.min_p[b] >= 0.0f &&
                          s.min_p[b] <= 1.0f,
                      op, ": top_k must be >= 0, top_p in (0, 1] and min_p in [0, 1], got ", s.top_k[b], ", ",
                      s.top_p[b], " and ", s.min_p[b]);
  }
  return s;
}

// The branching of a step's draft: `tree`, a chain where it is empty, or with `topk` k > 0 the dynamic tree's shape
// (k, 1, ..., 1) of gamma levels (`tree` empty or that), k at most the draft vocabulary's K.
std::vector<int64_t> shape_of(const char* op, at::IntArrayRef tree, int64_t gamma, int64_t topk, int64_t K) {
  std::vector<int64_t> shape = tree.empty() ? std::vector<int64_t>(gamma, 1) : tree.vec();
  TORCH_CHECK_VALUE(topk >= 0 && topk <= K, op, ": topk (the nodes a level of a dynamic tree keeps) must be in [0, ",
                    K, "] (the draft vocabulary), got ", topk);
  if (topk == 0 || gamma == 0) return shape;
  std::vector<int64_t> dynamic(gamma, 1);
  dynamic[0] = topk;
  TORCH_CHECK_VALUE(tree.empty() || shape == dynamic, op, ": a dynamic tree of topk ", topk, " and gamma ", gamma,
                    " has the shape ", at::IntArrayRef(dynamic), ", got tree ", tree);
  TORCH_CHECK_VALUE(1 + topk * gamma <= kMaxTreeNodes, op, ": a tree of at most ", kMaxTreeNodes, " nodes, got ",
                    1 + topk * gamma, " (topk ", topk, ", gamma ", gamma, ")");
  return dynamic;
}

}  // namespace

// A greedy draft chain in one call: from the roots' draft logits [B, V] (final ones: capped where the model caps,
// as its Python logits are; run_chain caps the chain's own), gamma tokens per row, each the argmax of the previous
// one's logits; the first gamma - 1 run through the model at positions L_b + d (their K/V written there,
// as the drafter's per-level forwards would). Returns tokens [B, gamma] int64. Why: a drafted level costs its weights
// plus more than twice that in Python and op dispatch when driven level by level from Python (the default draft); here
// one call pays the dispatch once. ``strict``: from a row's first non-finite logits on, its tokens are -1.
at::Tensor draft_chain_cpu(const at::Tensor& root_logits, const c10::intrusive_ptr<NativeModel>& model,
                           at::Tensor kv_cache, const at::Tensor& cache_seqlens,
                           const c10::optional<at::Tensor>& block_table, int64_t gamma, bool strict) {
  const NativeModel& m = *model;
  TORCH_CHECK_VALUE(root_logits.dim() == 2 && root_logits.device().is_cpu(),
                    "draft_chain: root_logits must be [B, V] on CPU, got ", root_logits.sizes());
  TORCH_CHECK_TYPE(root_logits.scalar_type() == at::kFloat || root_logits.scalar_type() == at::kBFloat16,
                   "draft_chain: root_logits must be float32 or bfloat16, got ", root_logits.scalar_type());
  const int64_t B = root_logits.size(0), V = root_logits.size(1);
  TORCH_CHECK_VALUE(gamma >= 1 && gamma <= m.rope_table.size(1), "draft_chain: gamma must be in [1, ",
                    m.rope_table.size(1), "] (the RoPE table's positions), got ", gamma);
  TORCH_CHECK_VALUE(m.embed.size(0) >= V && m.lm_head.size(0) == V,
                    "draft_chain: the model's embed [V, H] and lm_head [V, H] must match the logits' V = ", V,
                    ", got ", m.embed.sizes(), " and ", m.lm_head.sizes());
  // a restricted draft vocabulary: logits and lm_head rows are over vocab_map [V] (token ids), not over all ids
  TORCH_CHECK_VALUE(!m.restricted() || !strict, "draft_chain: a strict (target) chain has no vocab_map");
  TORCH_CHECK_VALUE(!m.is_head(), "draft_chain: an EAGLE-3 head drafts with eagle3_draft");
  TORCH_CHECK_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == B,
                    "draft_chain: cache_seqlens must be [B] = [", B, "]");
  const at::Tensor cache_seqlens_long = cache_seqlens.to(at::kLong).contiguous();  // [B]: the roots' positions L_b
  const int64_t max_pos = B > 0 ? cache_seqlens_long.max().item<int64_t>() + gamma : 0;
  TORCH_CHECK_VALUE(max_pos <= m.rope_table.size(1), "draft_chain: positions up to ", max_pos,
                    " need a longer RoPE table than ", m.rope_table.size(1));
  at::Tensor tokens = at::empty({B, gamma}, cache_seqlens_long.options());  // [B, gamma]
  const at::Tensor logits = root_logits.contiguous();             // [B, V], read row by row
  const int64_t* L = cache_seqlens_long.data_ptr<int64_t>();
  const at::Tensor table = table_of(block_table);
  with_dtype(m.rope_table.scalar_type(), [&](auto type) {
    ChainRunner<decltype(type)> draft = runner_of<decltype(type)>("draft_chain", m, kv_cache, table, B);
    with_dtype(root_logits.scalar_type(), [&](auto root_type) {  // the target's roots: float32 logits
      run_chain(draft, logits.data_ptr<decltype(root_type)>(), V, L, B, gamma, strict, m.vocab_ids(),
                tokens.data_ptr<int64_t>());
    });
  });
  return tokens;
}

// K plain steps in one call (the target's plain decoding, batched): the speculative steps' loop
// (run_spec_chain) with no draft. The roots [B] run at positions L_b, then token d = 1 .. K is the argmax of the
// previous forward's logits (a sampled row's perturbed argmax: `temperature`, `noise_seeds` and its filters, as
// spec_chain_cpu takes them), tokens 1 .. K - 1 run at L_b + d (their K/V written there, as K one-token steps
// would). Returns tokens [B, K'] int64, K' <= K: the call ends after the first token at which any row emits one of
// stop_ids [S] (a row's end of text: no forward is spent past it, so a long chain costs nothing at a request's end;
// the engine cuts each row at its own stop tokens and runs the rows that go on in its next call), and before a step
// where some row's logits are not finite (K' = 0 when the first is: the engine then decodes that step the regular
// way, which sanitises or raises).
at::Tensor plain_steps_cpu(const at::Tensor& roots, const c10::intrusive_ptr<NativeModel>& model, at::Tensor kv_cache,
                            const at::Tensor& cache_seqlens, const c10::optional<at::Tensor>& block_table,
                            int64_t steps, const c10::optional<at::Tensor>& stop_ids, const OptTensorList& sampling) {
  const NativeModel& m = *model;
  TORCH_CHECK_VALUE(roots.dim() == 1 && roots.device().is_cpu(), "plain_steps: roots must be [B] on CPU, got ",
                    roots.sizes());
  TORCH_CHECK_VALUE(!stop_ids.has_value() || (stop_ids->dim() == 1 && stop_ids->device().is_cpu()),
                    "plain_steps: stop_ids must be [S] on CPU");
  const int64_t B = roots.size(0);
  TORCH_CHECK_VALUE(steps >= 1 && steps <= m.rope_table.size(1), "plain_steps: steps must be in [1, ",
                    m.rope_table.size(1), "] (the RoPE table's positions), got ", steps);
  TORCH_CHECK_VALUE(B >= 1, "plain_steps: no roots (B = 0)");
  TORCH_CHECK_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == B,
                    "plain_steps: cache_seqlens must be [B] = [", B, "]");
  TORCH_CHECK_VALUE(!m.restricted() && !m.is_head(),
                    "plain_steps: a target's own model (its logits decide the output), not a draft's or a head");
  const at::Tensor ids = roots.to(at::kLong).contiguous();              // [B]
  const at::Tensor cache_seqlens_long = cache_seqlens.to(at::kLong).contiguous();  // [B]: the roots' positions L_b
  ChainRows rows{B, 0, steps, false, {}, std::vector<int64_t>(B, 1), {}, std::vector<int64_t>(B, steps), {}, 1};
  rows.catch_up.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + B);
  rows.L.assign(cache_seqlens_long.data_ptr<int64_t>(), cache_seqlens_long.data_ptr<int64_t>() + B);
  rows.sampling = sampling_of("plain_steps", B, sampling);
  if (stop_ids.has_value()) {
    const at::Tensor s = stop_ids->to(at::kLong).contiguous();
    rows.stops.assign(s.data_ptr<int64_t>(), s.data_ptr<int64_t>() + s.numel());
  }
  std::vector<int64_t> out(B * steps * 2, 0);  // [B, K, 2]: per step the count (1; 0 where not run), the token
  std::vector<double> secs(steps * 2);
  const at::Tensor table = table_of(block_table);
  with_dtype(m.rope_table.scalar_type(), [&](auto type) {
    ChainRunner<decltype(type)> target = runner_of<decltype(type)>("plain_steps", m, kv_cache, table, B);
    NoDraft none;
    run_spec_chain(target, none, rows, kv_cache, table, out.data(), secs.data());
  });
  int64_t ran = 0;
  while (ran < steps && B > 0 && out[ran * 2] > 0) ++ran;  // every row runs every step
  at::Tensor tokens = at::empty({B, ran}, cache_seqlens_long.options());  // [B, K']
  int64_t* tok = tokens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < ran; ++s) tok[b * ran + s] = out[(b * steps + s) * 2 + 1];
  }
  return tokens;
}

// An EAGLE-3 head's draft in one call: entries (b, t) of tokens [B, T] at positions start[b] + t, each with the
// target's feature of the position before it from the paged feature cache [1, num_blocks, block_size, H] (zeros at
// position 0): a prefill chunk or a step's catch-up, their K/V written. Then, from each row's root (entry last[b],
// at position R_b = start[b] + last[b]), a greedy chain of gamma tokens: token d the argmax of the head's logits at
// node d - 1 (over vocab_map's ids when given), nodes 1 .. gamma - 1 run at R_b + d with their parent's output as
// their feature (K/V written there), as the drafter's level-by-level chain does. A sampled chain passes inv_temp
// [B] float32 (1 / temperature; 0 for a greedy row) and noise [B, gamma, K] float32 (each level's Gumbel noise over
// the draft vocabulary): token d of a sampled row is then the argmax of logits * inv_temp + noise (a draw from
// softmax(logits / temperature)). Returns (the roots' raw outputs [B, H] (only the roots run whole:
// HeadDraft::entries), the chain [B, gamma] int64; [B, 0] for gamma = 0; a sampled chain's logits at each level
// [B, gamma, K] float32, [0] otherwise). Why: driven from Python, a head step is dozens of small torch ops (two
// norms, a cat, the layer, a 49152-wide scatter of the draft logits) whose dispatch cost more than the head's
// weights.
// `entries` is [tokens, start, last]; `draws` [inv_temp, noise] for a sampled chain, [] for a greedy one. `topk` k >
// 0 drafts EAGLE-2's dynamic tree instead of the chain (HeadDraft::dynamic_tree; with draws, a sampled row's children
// ranked on its perturbed logits, the noise of level d at its parents' position): gamma levels of k nodes, the
// second result its tokens [B, k gamma] (nodes 1 ..), the third its parents [B, 1 + k gamma] (the root's -1), as
// spec_chain's dynamic trees draft them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> eagle3_draft_cpu(
    at::TensorList entries, const at::Tensor& feature_cache, const c10::intrusive_ptr<NativeModel>& head,
    at::Tensor kv_cache, const c10::optional<at::Tensor>& block_table, int64_t gamma, const OptTensorList& draws,
    int64_t topk) {
  const NativeModel& m = *head;
  TORCH_CHECK_VALUE(m.is_head(), "eagle3_draft: the model must be an EAGLE-3 head (NativeModel.set_head)");
  TORCH_CHECK_VALUE(entries.size() == 3, "eagle3_draft: entries must be [tokens, start, last], got ", entries.size(),
                    " tensors");
  const at::Tensor &tokens = entries[0], &start = entries[1], &last = entries[2];
  std::vector<OptTensor> sampled = entries_of("eagle3_draft", "draws", draws, 2, "inv_temp, noise", true);
  sampled.resize(2);
  const OptTensor &inv_temp = sampled[0], &noise = sampled[1];
  TORCH_CHECK_VALUE(tokens.dim() == 2 && tokens.device().is_cpu(), "eagle3_draft: tokens must be [B, T] on CPU, got ",
                    tokens.sizes());
  const int64_t B = tokens.size(0), T_ = tokens.size(1), H = m.final_norm.size(0);
  TORCH_CHECK_VALUE(gamma >= 0, "eagle3_draft: gamma must be >= 0, got ", gamma);
  TORCH_CHECK_VALUE(T_ >= 1 || B == 0, "eagle3_draft: tokens must hold at least one entry per row");
  for (const at::Tensor* t : {&start, &last}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == B, "eagle3_draft: start and last must be [B] = [", B, "]");
  }
  const at::Tensor ids = tokens.to(at::kLong).contiguous();  // [B, T]
  const at::Tensor first = start.to(at::kLong).contiguous(), root_t = last.to(at::kLong).contiguous();  // [B]
  const at::Tensor table = table_of(block_table);
  const int64_t* S = first.data_ptr<int64_t>();
  const int64_t* R = root_t.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(S[b] >= 0 && R[b] >= 0 && R[b] < T_, "eagle3_draft: row ", b, " has start ", S[b],
                      " and last ", R[b], " (must lie in [0, ", T_, "))");
  }
  const int64_t K = m.lm_head.size(0);                               // the draft vocabulary
  shape_of("eagle3_draft", {}, gamma, topk, K);
  at::Tensor out = at::empty({B, H}, m.rope_table.options());             // [B, H]
  at::Tensor chain = at::empty({B, gamma * std::max<int64_t>(topk, 1)}, ids.options());  // [B, gamma] or [B, k gamma]
  TORCH_CHECK_VALUE(inv_temp.has_value() == noise.has_value(), "eagle3_draft: inv_temp and noise go together");
  at::Tensor temps, gumbel, logits;
  if (noise.has_value()) {
    TORCH_CHECK_VALUE(inv_temp->dim() == 1 && inv_temp->size(0) == B && inv_temp->scalar_type() == at::kFloat,
                      "eagle3_draft: inv_temp must be [B] = [", B, "] float32, got ", inv_temp->sizes(), " ",
                      inv_temp->scalar_type());
    TORCH_CHECK_VALUE(noise->dim() == 3 && noise->size(0) == B && noise->size(1) == gamma && noise->size(2) == K &&
                          noise->scalar_type() == at::kFloat,
                      "eagle3_draft: noise must be [B, gamma, K] = [", B, ", ", gamma, ", ", K, "] float32, got ",
                      noise->sizes(), " ", noise->scalar_type());
    temps = inv_temp->contiguous(), gumbel = noise->contiguous();
  }
  if (noise.has_value() && topk == 0) {
    logits = at::empty({B, gamma, K}, gumbel.options());  // [B, gamma, K]
  } else if (topk > 0) {
    logits = at::full({B, 1 + topk * gamma}, -1, ids.options());  // [B, 1 + k gamma]: the dynamic tree's parents
  } else {
    logits = at::empty({0}, m.rope_table.options().dtype(at::kFloat));
  }
  if (B == 0) return {out, chain, logits};
  with_dtype(m.rope_table.scalar_type(), [&](auto type) {
    using T = decltype(type);
    ChainRunner<T> model = runner_of<T>("eagle3_draft", m, kv_cache, table, B);
    HeadDraft<T> draft(model, feature_cache, table, m.vocab_ids());
    const T* raw = draft.entries(ids.data_ptr<int64_t>(), T_, B, T_, S, R);  // [B, H]
    std::copy(raw, raw + B * H, out.data_ptr<T>());
    ChainDraws draws{temps.defined() ? temps.data_ptr<float>() : nullptr,
                     gumbel.defined() ? gumbel.data_ptr<float>() : nullptr,
                     topk == 0 ? logits.data_ptr<float>() : nullptr};
    if (gamma > 0 && topk > 0) {
      draft.dynamic_tree(raw, B, draft.roots(), gamma, topk, chain.data_ptr<int64_t>(), logits.data_ptr<int64_t>(),
                         gumbel.defined() ? &draws : nullptr);
    } else if (gamma > 0) {
      draft.chain(raw, B, draft.roots(), gamma, chain.data_ptr<int64_t>(), gumbel.defined() ? &draws : nullptr);
    }
  });
  return {out, chain, logits};
}


// Up to max_steps speculative steps of a draft's chain in one call: per step, the draft catches up on the tokens
// its cache lacks (then the root), drafts gamma tokens (draft_chain), the target runs the root and the chain at
// L_b .. L_b + gamma, and the longest prefix of drafts equal to the target's choice (its argmax; a coupled row's
// perturbed argmax, below) is accepted, plus the target's own next token. A chain's accepted nodes are a prefix:
// both caches stay in place (no compaction).
// ``tree`` (an EAGLE-3 head's only; empty: a chain): the static tree with tree[d] children for each node at depth d
// (gamma levels, breadth-first as spec_engine/tree.py's StaticTree), its children the head's top tree[d] tokens
// (HeadDraft::tree); the target runs every node (slot L_b + t, position L_b + its depth) and the accepted path's
// K/V are compacted to L_b .. (the head's cache keeps only the root's entry, as for chains). ``topk`` k > 0 (a
// head's): EAGLE-2's dynamic tree, k nodes a level (the shape tree = (k, 1, ..., 1), or empty), each
// level the k best children of the level above by path score, parents chosen per row and step
// (HeadDraft::dynamic_tree); the target's pass, the walk and the compaction as for static trees. ``temperature`` and
// ``noise_seeds`` [B] (optional, together): rows at a temperature > 0 are sampled through the position-keyed coupling
// (Sampling in csrc/runner_cpu.h: the regular step's coupled rows, the same tokens), with a head's chains or dynamic
// trees (each level on its parents' position's noise) or none (gamma 0); greedy rows are 0.
// The engine's step does the same work in ~10 Python-driven op calls; here it costs its kernels (ChainRunner: no
// ATen op inside the steps). gamma 0: plain steps, the draft idle (its catch-up grows by each emitted token), a
// head's features still stored: the plain decoding of a head's target.
//
// catch_up [B, P] int64: per row the tokens at positions D_b .. L_b (the draft cache's lag, then the root), padded
// at the end; catch_up_lens [B]: their counts (>= 1); cache_seqlens [B]: L_b; tokens_left [B]: tokens the row may
// still emit (a step starts only if every row has gamma + 1 of them left); stop_ids [S]: a step that emits one of
// them for any row is the last, and so is one where some row accepted no draft when ``stop_on_reject`` (an adaptive
// controller re-decides gamma after it). A step whose visited target logits are not finite (a NaN, or a non-finite
// maximum) is dropped and ends the call: the engine's regular step decodes it (and sanitises or raises).
//
// The draft is a model, or an EAGLE-3 head (NativeModel.set_head: its fc over the target layers it reads; its
// feature cache d_features [1, blocks, block_size, H]; in the target's dtype): the target's captured streams of each
// step's accepted positions become their features (HeadDraft).
//
// Returns (steps [B, max_steps, gamma + 2] int64: per step the count n of emitted tokens then the tokens, -1
// padded, n = 0 for steps not run; catch_up_out [B, P'] and catch_up_lens_out [B]: the rows' new catch-ups; times
// [max_steps, 2] float64: per step the draft's and the whole step's seconds; ranks [B, max_steps, gamma + 1] int64:
// per step the accepted path's ranks (path_ranks in csrc/runner_cpu.h), what a chain of its depth would have kept).
//
// The op's arguments, grouped: caches [t_kv, d_kv] (and a head's d_features); inputs [catch_up, catch_up_lens,
// cache_seqlens, tokens_left, stop_ids, block_table (or None)]; sampling as sampling_of reads it; knobs [gamma,
// max_steps, stop_on_reject]; the draft's shape: tree, topk.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> spec_chain_cpu(
    const c10::intrusive_ptr<NativeModel>& target_model, const c10::intrusive_ptr<NativeModel>& draft_model,
    at::TensorList caches, const OptTensorList& inputs, const OptTensorList& sampling, at::IntArrayRef knobs,
    at::IntArrayRef tree, int64_t topk) {
  const NativeModel& t = *target_model;
  const NativeModel& d = *draft_model;
  TORCH_CHECK_VALUE(caches.size() == 2 || caches.size() == 3, "spec_chain: caches must be [t_kv, d_kv] or [t_kv, ",
                    "d_kv, d_features], got ", caches.size(), " tensors");
  at::Tensor t_kv = caches[0], d_kv = caches[1];
  const OptTensor d_features = caches.size() == 3 ? OptTensor(caches[2]) : c10::nullopt;
  const std::vector<OptTensor> in = entries_of(
      "spec_chain", "inputs", inputs, 6, "catch_up, catch_up_lens, cache_seqlens, tokens_left, stop_ids, block_table");
  const at::Tensor catch_up = required("spec_chain", in[0], "catch_up"),
                   catch_up_lens = required("spec_chain", in[1], "catch_up_lens"),
                   cache_seqlens = required("spec_chain", in[2], "cache_seqlens"),
                   tokens_left = required("spec_chain", in[3], "tokens_left"),
                   stop_ids = required("spec_chain", in[4], "stop_ids");
  const OptTensor& block_table = in[5];
  TORCH_CHECK_VALUE(knobs.size() == 3, "spec_chain: knobs must be [gamma, max_steps, stop_on_reject], got ", knobs);
  const int64_t gamma = knobs[0], max_steps = knobs[1];
  const bool stop_on_reject = knobs[2] != 0;
  TORCH_CHECK_VALUE(catch_up.dim() == 2 && catch_up.size(1) >= 1, "spec_chain: catch_up must be [B, P], got ",
                    catch_up.sizes());
  const int64_t B = catch_up.size(0), P = catch_up.size(1);
  TORCH_CHECK_VALUE(gamma >= 0 && max_steps >= 1, "spec_chain: gamma must be >= 0 and max_steps >= 1, got ", gamma,
                    " and ", max_steps);
  for (const at::Tensor* t : {&catch_up_lens, &cache_seqlens, &tokens_left}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == B, "spec_chain: per-row inputs must be [B] = [", B, "]");
  }
  TORCH_CHECK_VALUE(!t.restricted() && !t.is_head(),
                    "spec_chain: the target is a whole model (its logits decide the output)");
  const at::TensorOptions longs = catch_up.options().dtype(at::kLong);
  const bool head = d.is_head();  // the draft is an EAGLE-3 head on the target's captured streams
  TORCH_CHECK_VALUE(!head || d_features.has_value(), "spec_chain: an EAGLE-3 head needs its feature cache");
  if (head) {
    TORCH_CHECK_TYPE(d.rope_table.scalar_type() == t.rope_table.scalar_type(),
                     "spec_chain: an EAGLE-3 head runs in its target's dtype");
    TORCH_CHECK_VALUE(d.fc.size(1) == static_cast<int64_t>(d.capture.size()) * t.final_norm.size(0),
                      "spec_chain: the head's fc reads ", d.fc.size(1), " stream values, the target has ",
                      d.capture.size(), " x ", t.final_norm.size(0));
  }
  TORCH_CHECK_VALUE(tree.empty() || static_cast<int64_t>(tree.size()) == gamma,
                    "spec_chain: a tree has gamma = ", gamma, " levels, got ", tree.size());
  int64_t nodes = 1, level = 1;
  for (const int64_t children : tree) {
    TORCH_CHECK_VALUE(children >= 1, "spec_chain: a tree's levels have >= 1 children per node, got ", tree);
    TORCH_CHECK_VALUE(children <= kMaxTreeNodes, "spec_chain: a tree of at most ", kMaxTreeNodes, " nodes, got ",
                      tree);
    level *= children, nodes += level;  // (both stay <= kMaxTreeNodes^2: no overflow)
    TORCH_CHECK_VALUE(nodes <= kMaxTreeNodes, "spec_chain: a tree of at most ", kMaxTreeNodes, " nodes, got ", tree);
  }
  ChainRows rows{B, gamma, max_steps, stop_on_reject, {}, std::vector<int64_t>(B), std::vector<int64_t>(B),
                 std::vector<int64_t>(B), {}, P};
  rows.tree = TreeShape(shape_of("spec_chain", tree, gamma, topk, d.lm_head.size(0)), topk);
  TORCH_CHECK_VALUE(head || (rows.tree.is_chain() && topk == 0),
                    "spec_chain: a draft model drafts chains (trees: an EAGLE-3 head)");
  rows.sampling = sampling_of("spec_chain", B, sampling);
  TORCH_CHECK_VALUE(!rows.sampling.any() || gamma == 0 || (head && (rows.tree.is_chain() || topk > 0)),
                    "spec_chain: sampled rows draft an EAGLE-3 head's chains or dynamic trees (a draft model and "
                    "static trees: the regular step)");
  for (const int64_t children : rows.tree.branching) {
    TORCH_CHECK_VALUE(children <= d.lm_head.size(0), "spec_chain: ", children, " children per node, but the draft ",
                      "vocabulary has ", d.lm_head.size(0), " tokens");
  }
  const at::Tensor tokens = catch_up.to(at::kLong).contiguous();  // [B, P]
  rows.catch_up.assign(tokens.data_ptr<int64_t>(), tokens.data_ptr<int64_t>() + B * P);
  const at::Tensor lens = catch_up_lens.to(at::kLong).contiguous(), L = cache_seqlens.to(at::kLong).contiguous(),
                   left = tokens_left.to(at::kLong).contiguous(), stops = stop_ids.to(at::kLong).contiguous();
  for (int64_t b = 0; b < B; ++b) {
    rows.catch_up_len[b] = lens.data_ptr<int64_t>()[b];
    rows.L[b] = L.data_ptr<int64_t>()[b];
    rows.tokens_left[b] = left.data_ptr<int64_t>()[b];
    TORCH_CHECK_VALUE(rows.catch_up_len[b] >= 1 && rows.catch_up_len[b] <= P && rows.L[b] >= rows.catch_up_len[b] - 1,
                      "spec_chain: row ", b, " has catch_up_lens ", rows.catch_up_len[b], " and L_b ", rows.L[b]);
  }
  rows.stops.assign(stops.data_ptr<int64_t>(), stops.data_ptr<int64_t>() + stops.numel());

  at::Tensor steps = at::full({B, max_steps, gamma + 2}, -1, longs);  // [B, S, gamma + 2]
  steps.select(2, 0).zero_();
  at::Tensor times = at::zeros({max_steps, 2}, longs.dtype(at::kDouble));  // [S, 2]
  at::Tensor ranks = at::full({B, max_steps, gamma + 1}, kPathLeaf, longs);  // [B, S, gamma + 1]
  int64_t* out = steps.data_ptr<int64_t>();
  int64_t* path_ranks_out = ranks.data_ptr<int64_t>();
  double* secs = times.data_ptr<double>();
  const at::Tensor table = table_of(block_table);
  with_dtype(t.rope_table.scalar_type(), [&](auto target_type) {
    using TT = decltype(target_type);
    ChainRunner<TT> target = runner_of<TT>("spec_chain", t, t_kv, table, B);
    if (head) {
      target.capture(d.capture);
      ChainRunner<TT> model = runner_of<TT>("spec_chain", d, d_kv, table, B);
      HeadDraft<TT> draft(model, *d_features, table, d.vocab_ids(), d.fc);
      return run_spec_chain(target, draft, rows, t_kv, table, out, secs, path_ranks_out);
    }
    with_dtype(d.rope_table.scalar_type(), [&](auto draft_type) {  // a draft may be narrower than its target
      ChainRunner<decltype(draft_type)> model = runner_of<decltype(draft_type)>("spec_chain", d, d_kv, table, B);
      ModelDraft<decltype(draft_type)> draft(model, d.vocab_ids());
      run_spec_chain(target, draft, rows, t_kv, table, out, secs, path_ranks_out);
    });
  });
  // [B, P']: the rows' catch-ups (the input's when no step ran)
  at::Tensor next_catch_up = at::empty({B, rows.ld}, longs);
  std::copy(rows.catch_up.begin(), rows.catch_up.end(), next_catch_up.data_ptr<int64_t>());
  return {steps, next_catch_up, at::tensor(rows.catch_up_len, longs), times, ranks};
}

// One greedy speculative step over trees drafted elsewhere (a suffix speculation, a static tree, a hybrid's rows):
// the target's pass over every node, greedy::walk, and the accepted paths' K/V compacted to L_b .. (every plane),
// in one call, as the regular step's target pass, verify_tree and compact_kv_ do. tokens and parents [B, T] int64
// (verify_tree's; node 0 the root); cache_seqlens [B] = L_b; `capture`: the layers whose input streams the step returns
// (an EAGLE-3 head's features). Returns (accepted_nodes [B, T], output_tokens [B, T], num_accepted [B], features
// [B, T, C * H] in the model's dtype, [0] without capture). Where some row's num_accepted is < 1 (a visited node's
// maximum not finite: 0; a malformed tree: -1, no forward run) nothing is compacted: the caller's regular path
// redoes the step (and sanitises or raises).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> tree_step_cpu(
    const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& cache_seqlens,
    const c10::intrusive_ptr<NativeModel>& model, at::Tensor kv_cache, const c10::optional<at::Tensor>& block_table,
    at::IntArrayRef capture) {
  const NativeModel& m = *model;
  TORCH_CHECK_VALUE(tokens.dim() == 2, "tree_step: tokens must be [B, T], got ", tokens.sizes());
  const int64_t B = tokens.size(0), T = tokens.size(1);
  for (const at::Tensor* t : {&tokens, &parents}) {
    TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == B && t->size(1) == T && t->scalar_type() == at::kLong &&
                          t->device().is_cpu(),
                      "tree_step: tokens and parents must be int64 [B, T] = [", B, ", ", T, "] on CPU, got ",
                      t->sizes(), " ", t->scalar_type());
  }
  TORCH_CHECK_VALUE(T >= 1 && cache_seqlens.dim() == 1 && cache_seqlens.size(0) == B,
                    "tree_step: a tree has its root (T >= 1) and cache_seqlens is [B] = [", B, "], got T = ", T, " and ",
                    cache_seqlens.sizes());
  TORCH_CHECK_VALUE(!m.restricted() && !m.is_head(), "tree_step: the target is a whole model (its logits decide)");
  const at::Tensor tok = tokens.contiguous(), par = parents.contiguous(), L = cache_seqlens.to(at::kLong).contiguous();
  const at::TensorOptions longs = tokens.options();
  at::Tensor accepted = at::full({B, T}, -1, longs), output = at::full({B, T}, -1, longs);
  at::Tensor counts = at::empty({B}, longs), features = at::empty({0}, longs.dtype(m.rope_table.scalar_type()));
  const at::Tensor table = table_of(block_table);
  const int64_t* n = counts.data_ptr<int64_t>();
  int64_t least = 1;  // the smallest count: < 1 where a row is left to the regular path
  with_dtype(m.rope_table.scalar_type(), [&](auto type) {
    using T_ = decltype(type);
    ChainRunner<T_> target = runner_of<T_>("tree_step", m, kv_cache, table, B);
    if (!capture.empty()) target.capture(capture);
    run_tree_step(target, tok.data_ptr<int64_t>(), par.data_ptr<int64_t>(), B, T, L.data_ptr<int64_t>(),
                  accepted.data_ptr<int64_t>(), output.data_ptr<int64_t>(), counts.data_ptr<int64_t>());
    least = B > 0 ? *std::min_element(n, n + B) : 1;
    if (!capture.empty() && least >= 0) {  // (a malformed tree ran no forward)
      features = at::empty({B, T, target.num_capture() * target.hidden_size()}, features.options());
      std::copy(target.captured(), target.captured() + features.numel(), features.data_ptr<T_>());
    }
  });
  if (T > 1 && least >= 1) {
    const c10::optional<at::Tensor> paged = table.defined() ? c10::optional<at::Tensor>(table) : c10::nullopt;
    compact_kv_cpu(kv_cache.flatten(0, 1), L, accepted, counts, paged);  // [2 * layers, blocks, block_size, ...]
  }
  return {accepted, output, counts, features};
}

}  // namespace specdec
