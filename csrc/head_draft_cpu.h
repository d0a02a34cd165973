// An EAGLE-3 head's side of the native steps (HeadDraft: its entries, its chains and static trees, the coupled rows'
// draws, the features it stores) and of the eagle3_draft op, on the runner pieces of csrc/runner_cpu.h.
#pragma once

#include "runner_cpu.h"

namespace specdec {
namespace {

// A sampled chain's draws (eagle3_draft's noise): per row its inverse temperature (0: greedy, the plain argmax), per
// row and level the Gumbel noise over the draft vocabulary [B, gamma, K], and where each level's logits go
// [B, gamma, K] (float32: the caller's draft distributions; null: nowhere).
struct ChainDraws {
  const float* inv_temp;
  const float* noise;
  float* logits;

  template <typename T>
  int64_t argmax(const T* row_logits, int64_t b, int64_t level, int64_t V) const {
    const float* g = noise + level * V;
    const float scale = inv_temp[b];
    int64_t best = 0;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t k = 0; k < V; ++k) {
      const float v = static_cast<float>(row_logits[k]) * scale + g[k];
      if (v > top) top = v, best = k;  // NaN never wins
    }
    return best;
  }

  // out [V]: a level's perturbed logits back in the logits' units, (z * scale + g) / scale = z + t g: argmax's order,
  // and a dynamic tree's path scores on the head's error in logit units, as a greedy row's (t to 0: its own)
  template <typename T>
  void perturb(const T* row_logits, int64_t level, float scale, int64_t V, float* out) const {
    const float* g = noise + level * V;
    for (int64_t k = 0; k < V; ++k) out[k] = (static_cast<float>(row_logits[k]) * scale + g[k]) / scale;
  }
};

// An EAGLE-3 head's side of a step (and of the eagle3_draft op): its entries read the target's features from the
// paged feature cache [1, num_blocks, block_size, H] (an entry at position p the feature of p - 1, zeros at 0); its
// chain feeds each node its parent's raw output as its feature; with `fc` [H, F] (the head's map of the target's
// captured streams to its features) commit stores the accepted positions' features. The head's cache keeps only the
// root's entry of a step (built on a true feature): the next step's catch-up is every token the step emitted.
template <typename T>
class HeadDraft {
 public:
  HeadDraft(ChainRunner<T>& head, const at::Tensor& features, const at::Tensor& table, const int64_t* id_of,
            const at::Tensor& fc = at::Tensor())
      : head_(head),
        num_blocks_(head.num_blocks()),
        block_size_(head.block_size()),
        blocks_(table.defined() ? table.data_ptr<int32_t>() : nullptr),
        max_blocks_(table.defined() ? table.size(1) : 1),
        id_of_(id_of),
        fc_(fc) {
    const at::ScalarType dtype = c10::CppTypeToScalarType<T>::value;
    TORCH_CHECK_VALUE(features.dim() == 4 && features.size(0) == 1 && features.size(1) == num_blocks_ &&
                          features.size(2) == block_size_ && features.size(3) == head.hidden_size() &&
                          features.scalar_type() == dtype && features.is_contiguous() && features.device().is_cpu(),
                      head.op(), ": the head's feature cache must be a contiguous ", dtype,
                      " [1, blocks, block_size, H] on its KV cache's blocks (", num_blocks_, ", ", block_size_,
                      ", H = ", head.hidden_size(), "), got ", features.sizes(), " ", features.scalar_type());
    cache_ = features.data_ptr<T>();
  }

  // Entries (b, t): tokens[b * ld + t] at positions start[b] + t, their K/V written; each row's root, entry last[b]
  // at R_b = start[b] + last[b] (roots() [B]), then runs alone for its output: nothing reads the others' (a
  // prompt's, a catch-up's), and an entry's K/V need only the entries before it, so they are written first, K/V
  // only (the root's outputs the same bits as in one causal chunk: the kernels are batch-invariant). The roots' raw
  // outputs [B, H] (normed() holds them final-normed), valid until the next forward.
  const T* entries(const int64_t* tokens, int64_t ld, int64_t B, int64_t T_, const int64_t* start,
                   const int64_t* last) {
    if (T_ > 1) {
      feature_rows(B, T_, start);  // [B * T, H]
      head_.head_kv(tokens, ld, B, T_, start, feats_.data());
    }
    roots_.resize(B), root_tok_.resize(B);
    for (int64_t b = 0; b < B; ++b) roots_[b] = start[b] + last[b], root_tok_[b] = tokens[b * ld + last[b]];
    feature_rows(B, 1, roots_.data());  // [B, H]
    return head_.forward_head(root_tok_.data(), 1, B, 1, roots_.data(), feats_.data(), false);
  }
  const int64_t* roots() const { return roots_.data(); }

  // From each row's root (raw [B, H], the roots' outputs entries() just returned; at roots[b] = R_b), gamma greedy
  // tokens into chain [B, gamma]: token d the argmax of node d - 1's draft logits, node d run at R_b + d. With
  // ``draws`` (a sampled chain), token d of a row whose inv_temp is > 0 is the argmax of logits * inv_temp + noise
  // over the draft vocabulary instead (Gumbel-max: a draw from softmax(logits / temperature)), and each level's
  // logits are copied out.
  void chain(const T* raw, int64_t B, const int64_t* roots, int64_t gamma, int64_t* out,
             const ChainDraws* draws = nullptr) {
    const int64_t H = head_.hidden_size(), V = head_.vocab();
    ids_.resize(B), pos_.resize(B);
    prev_.assign(raw, raw + B * H);  // the roots: raw outputs feed node 1, normed ones give the first logits
    const T* logits = head_.logits(head_.normed(), B);  // [B, V]
    for (int64_t d = 1; d <= gamma; ++d) {
      for (int64_t b = 0; b < B; ++b) {
        const T* row_logits = logits + b * V;
        const int64_t level = b * gamma + d - 1;  // [B, gamma] index of this row's level d
        if (draws != nullptr && draws->logits != nullptr) {
          float* keep = draws->logits + level * V;
          for (int64_t k = 0; k < V; ++k) keep[k] = static_cast<float>(row_logits[k]);
        }
        const int64_t best = draws != nullptr && draws->inv_temp[b] > 0.0f
                                 ? draws->argmax(row_logits, b, level, V)
                                 : std::max<int64_t>(greedy::argmax(row_logits, V, false), 0);
        ids_[b] = out[b * gamma + d - 1] = id_of_ != nullptr ? id_of_[best] : best;
        pos_[b] = roots[b] + d;
      }
      if (d == gamma) return;
      const T* h = head_.forward_head(ids_.data(), 1, B, 1, pos_.data(), prev_.data(), true);  // [B, H]
      std::copy(h, h + B * H, prev_.begin());
      logits = head_.forward_logits_out();  // [B, V]
    }
  }

  // Each row's root (raw [B, H], at roots[b] = R_b) as node 0 of a tree of N nodes: its raw output into nodes_
  // [B, N, H] (the nodes' raw outputs), node 1's slot R_b + 1 into pos_, the nodes' target ids tree_tok_ [B, N]
  // cleared. Returns the roots' draft logits [B, V].
  const T* tree_roots(const T* raw, int64_t B, const int64_t* roots, int64_t N) {
    const int64_t H = head_.hidden_size();
    nodes_.resize(B * N * H);
    pos_.resize(B);
    tree_tok_.assign(B * N, 0);
    for (int64_t b = 0; b < B; ++b) {
      std::copy(raw + b * H, raw + (b + 1) * H, nodes_.begin() + b * N * H);
      pos_[b] = roots[b] + 1;
    }
    return head_.logits(head_.normed(), B);  // (the roots' final-normed outputs)
  }

  // From each row's root (raw [B, H], at roots[b] = R_b, as chain's), the nodes 1 .. N - 1 of `tree` into out
  // [B, N - 1]: the children of a node are the branching[d] most likely tokens of its draft logits (the first index
  // of the maximum when one; ties to the lower id), level by level. Below the last level, levels 1 .. d + 1 run
  // together, re-rooted at slot R_b + 1 (each node at position R_b + its depth, seeing the prefix through the root
  // and its own ancestors), each fed its parent's raw output as its feature.
  void tree(const T* raw, int64_t B, const int64_t* roots, const TreeShape& tree, int64_t* out) {
    const int64_t H = head_.hidden_size(), V = head_.vocab(), N = tree.nodes();
    const T* logits = tree_roots(raw, B, roots, N);  // [B, n_level, V] with level 0's one node
    for (int64_t d = 0; d < tree.depth(); ++d) {
      const int64_t first = tree.levels[d], n_level = tree.levels[d + 1] - first, kids = tree.branching[d];
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t i = 0; i < n_level; ++i) {
          top_k(logits + (b * n_level + i) * V, V, kids);
          for (int64_t c = 0; c < kids; ++c) {
            const int64_t node = tree.levels[d + 1] + i * kids + c, best = best_[c];
            tree_tok_[b * N + node] = id_of_ != nullptr ? id_of_[best] : best;
          }
        }
      }
      if (d + 1 == tree.depth()) break;
      const int64_t n = tree.levels[d + 2] - 1;  // levels 1 .. d + 1: nodes 1 .. n
      sub_tok_.resize(B * n), sub_depth_.resize(B * n), feats_.resize(B * n * H);
      if (mask_size_ < B * n * n) mask_.reset(new bool[B * n * n]), mask_size_ = B * n * n;
      bool* mask = mask_.get();  // [B, n, n]: each row the shape's re-rooted mask
      for (int64_t b = 0; b < B; ++b) {
        std::copy(tree.sub_masks[d].begin(), tree.sub_masks[d].end(), mask + b * n * n);
        std::copy(tree.sub_depths[d].begin(), tree.sub_depths[d].end(), sub_depth_.begin() + b * n);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t node = i + 1, m = b * n + i;
          sub_tok_[m] = tree_tok_[b * N + node];
          const T* src = nodes_.data() + (b * N + tree.parents[node]) * H;  // the parent's raw output
          std::copy(src, src + H, feats_.begin() + m * H);
        }
      }
      const T* h = head_.forward_head_tree(sub_tok_.data(), B, n, pos_.data(), sub_depth_.data(), mask,
                                           feats_.data());  // [B * n, H]
      const int64_t next = tree.levels[d + 1], n_next = tree.levels[d + 2] - next;
      level_.resize(B * n_next * H);  // [B * n_next, H]: level d + 1's normed outputs
      for (int64_t b = 0; b < B; ++b) {
        std::copy(h + b * n * H, h + (b + 1) * n * H, nodes_.begin() + (b * N + 1) * H);
        const T* normed = head_.normed() + (b * n + next - 1) * H;
        std::copy(normed, normed + n_next * H, level_.begin() + b * n_next * H);
      }
      logits = head_.logits(level_.data(), B * n_next);  // [B, n_next, V]
    }
    for (int64_t b = 0; b < B; ++b) {
      std::copy(tree_tok_.begin() + b * N + 1, tree_tok_.begin() + (b + 1) * N, out + b * (N - 1));
    }
  }

  // EAGLE-2's dynamic tree from each row's root (raw [B, H], at roots[b] = R_b, as chain's): gamma levels of k
  // nodes, their target ids into out [B, N - 1] and their parents into parents [B, N] (N = 1 + k gamma; the root's
  // -1). Level d keeps the k best children of level d - 1's nodes by path score, the rule of
  // spec_engine/drafters/dynamic_tree.py's dynamic_level, mirrored bit for bit (path_scores, better): each node's k
  // best children, then the level's k best of those, best first. Below the last level, levels 1 .. d run together
  // re-rooted at slot R_b + 1 as HeadDraft::tree runs them, with each row's mask from its chosen parents.
  // With `draws` (coupled rows), a row whose inv_temp s = 1 / t is > 0 scores its children on its perturbed logits
  // z + t g, g its level's noise (every node of level d sits at the position its children are sampled at, so one
  // noise per level): a Gumbel-top-k, scored as the chance that the coupled walk takes each, were the head the target.
  void dynamic_tree(const T* raw, int64_t B, const int64_t* roots, int64_t gamma, int64_t k, int64_t* out,
                    int64_t* parents, const ChainDraws* draws = nullptr) {
    const int64_t H = head_.hidden_size(), V = head_.vocab(), N = 1 + k * gamma;
    path_.resize(V), perturbed_.resize(V);
    score_.assign(B * N, 0.0f);  // [B, N]: the nodes' path scores
    for (int64_t b = 0; b < B; ++b) parents[b * N] = -1;
    const T* logits = tree_roots(raw, B, roots, N);  // [B, n_parent, V] with level 0's one node
    for (int64_t d = 1; d <= gamma; ++d) {
      const int64_t n_parent = d == 1 ? 1 : k, first = d == 1 ? 0 : 1 + (d - 2) * k, level = 1 + (d - 1) * k;
      for (int64_t b = 0; b < B; ++b) {
        cand_score_.clear(), cand_tok_.clear();  // [n_parent * k]: each parent's k best children, parent by parent
        const bool coupled = draws != nullptr && draws->inv_temp[b] > 0.0f;
        for (int64_t i = 0; i < n_parent; ++i) {
          const T* z = logits + (b * n_parent + i) * V;
          if (coupled) {
            draws->perturb(z, b * gamma + d - 1, draws->inv_temp[b], V, perturbed_.data());
            path_scores(perturbed_.data(), V, score_[b * N + first + i], path_.data());
          } else {
            path_scores(z, V, score_[b * N + first + i], path_.data());
          }
          best_children(path_.data(), V, k);
          for (int64_t c = 0; c < k; ++c) cand_score_.push_back(path_[best_[c]]), cand_tok_.push_back(best_[c]);
        }
        order_.resize(n_parent * k);
        for (int64_t c = 0; c < n_parent * k; ++c) order_[c] = c;
        std::partial_sort(order_.begin(), order_.begin() + k, order_.end(),
                          [&](int64_t x, int64_t y) { return better(cand_score_[x], x, cand_score_[y], y); });
        for (int64_t j = 0; j < k; ++j) {
          const int64_t c = order_[j], node = b * N + level + j;
          tree_tok_[node] = id(cand_tok_[c]);
          parents[node] = first + c / k;
          score_[node] = cand_score_[c];
        }
      }
      if (d == gamma) break;
      const int64_t n = d * k;  // levels 1 .. d: nodes 1 .. n
      sub_tok_.resize(B * n), sub_depth_.resize(B * n), sub_parent_.resize(n), feats_.resize(B * n * H);
      if (mask_size_ < B * n * n) mask_.reset(new bool[B * n * n]), mask_size_ = B * n * n;
      bool* mask = mask_.get();  // [B, n, n]: each row's re-rooted mask, from its parents
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t i = 0; i < n; ++i) {
          const int64_t parent = parents[b * N + i + 1], m = b * n + i;
          sub_parent_[i] = parent - 1;  // (the root's children: -1)
          sub_tok_[m] = tree_tok_[b * N + i + 1];
          const T* src = nodes_.data() + (b * N + parent) * H;  // the parent's raw output
          std::copy(src, src + H, feats_.begin() + m * H);
        }
        ancestor_mask(sub_parent_.data(), n, mask + b * n * n, sub_depth_.data() + b * n);
      }
      const T* h = head_.forward_head_tree(sub_tok_.data(), B, n, pos_.data(), sub_depth_.data(), mask,
                                           feats_.data());  // [B * n, H]
      level_.resize(B * k * H);  // [B * k, H]: level d's normed outputs
      for (int64_t b = 0; b < B; ++b) {
        std::copy(h + b * n * H, h + (b + 1) * n * H, nodes_.begin() + (b * N + 1) * H);
        const T* normed = head_.normed() + (b * n + n - k) * H;
        std::copy(normed, normed + k * H, level_.begin() + b * k * H);
      }
      logits = head_.logits(level_.data(), B * k);  // [B, k, V]
    }
    for (int64_t b = 0; b < B; ++b) {
      std::copy(tree_tok_.begin() + b * N + 1, tree_tok_.begin() + (b + 1) * N, out + b * (N - 1));
    }
  }

  void propose(const ChainRows& r, int64_t* drafts, int64_t* parents) {
    const int64_t B = r.B, width = *std::max_element(r.catch_up_len.begin(), r.catch_up_len.end());
    start_.resize(B), last_.resize(B);
    for (int64_t b = 0; b < B; ++b) start_[b] = r.L[b] - r.catch_up_len[b] + 1, last_[b] = r.catch_up_len[b] - 1;
    const T* raw = entries(r.catch_up.data(), r.ld, B, width, start_.data(), last_.data());
    if (r.tree.dynamic()) {  // (coupled rows on their level's noise, as their chains)
      const ChainDraws draws = r.sampling.any() ? coupled_draws(r) : ChainDraws{nullptr, nullptr, nullptr};
      dynamic_tree(raw, B, roots(), r.gamma, r.tree.topk, drafts, parents,
                   draws.inv_temp != nullptr ? &draws : nullptr);
    } else if (r.sampling.any()) {  // (chains only: spec_chain_cpu refuses sampled rows' static trees)
      const ChainDraws draws = coupled_draws(r);
      chain(raw, B, roots(), r.gamma, drafts, &draws);
    } else if (r.tree.is_chain()) {
      chain(raw, B, roots(), r.gamma, drafts);
    } else {
      tree(raw, B, roots(), r.tree, drafts);
    }
  }

  // The features of the step's accepted positions L_b .. L_b + n - 1 (fc of the target's captured streams), and
  // the next catch-ups: every emitted token (positions L_b + 1 .. L_b + n, the head's entries of the drafted ones were
  // built on its own guesses). r.L is still the step's.
  void commit(ChainRows& r, const std::vector<std::vector<int64_t>>& emitted, const int64_t*, const int64_t* path,
              const ChainRunner<T>& target) {
    plain(r, emitted, path, target);
    const int64_t T_ = r.gamma + 1;
    r.ld = T_;
    r.catch_up.assign(r.B * T_, 0);
    for (int64_t b = 0; b < r.B; ++b) {
      std::copy(emitted[b].begin(), emitted[b].end(), r.catch_up.begin() + b * T_);
      r.catch_up_len[b] = static_cast<int64_t>(emitted[b].size());
    }
  }

  // The draws of r's coupled rows, a chain's or a dynamic tree's (the regular step's _chain_noise): a sampled row's
  // inverse temperature, and at level d the coupling's noise at its parents' position L_b + d - 1 over the draft
  // vocabulary's target ids.
  ChainDraws coupled_draws(const ChainRows& r) {
    const int64_t B = r.B, gamma = r.gamma, K = head_.vocab();
    inv_temp_.assign(B, 0.0f);
    noise_.assign(B * gamma * K, 0.0f);  // [B, gamma, K]
    for (int64_t b = 0; b < B; ++b) {
      if (!r.sampling.sampled(b)) continue;
      inv_temp_[b] = 1.0f / r.sampling.temperature[b];
      for (int64_t d = 1; d <= gamma; ++d) {
        const uint64_t base = rng::row_base(rng::noise_key(r.sampling.seeds[b], r.L[b] + d - 1));
        float* g = noise_.data() + (b * gamma + d - 1) * K;
        for (int64_t k = 0; k < K; ++k) g[k] = rng::uniform_at(base, id_of_ != nullptr ? id_of_[k] : k);
        rng::gumbel_inplace(g, K);
      }
    }
    return ChainDraws{inv_temp_.data(), noise_.data(), nullptr};
  }

  // A step's emitted positions' features (a plain step's too: the head's entries read them when it next drafts):
  // emitted token j of row b is node path[b * T + j] of the step's tree (T nodes).
  void plain(const ChainRows& r, const std::vector<std::vector<int64_t>>& emitted, const int64_t* path,
             const ChainRunner<T>& target) {
    const int64_t B = r.B, T_ = r.tree.nodes(), H = head_.hidden_size(), F = fc_.size(1);
    feats_.resize(B * T_ * H);
    linear(target.captured(), Weight{fc_.data_ptr(), 0}, nullptr, feats_.data(), B * T_, H, F);  // [B * T, H]
    for (int64_t b = 0; b < B; ++b) {
      for (size_t j = 0; j < emitted[b].size(); ++j) {
        const T* src = feats_.data() + (b * T_ + path[b * T_ + j]) * H;
        std::copy(src, src + H, row(b, r.L[b] + j));
      }
    }
  }

 private:
  // feats_ [B * T, H]: entry (b, t) at position start[b] + t reads the feature of the position before it (zeros at 0).
  void feature_rows(int64_t B, int64_t T_, const int64_t* start) {
    const int64_t H = head_.hidden_size();
    feats_.assign(B * T_ * H, static_cast<T>(0.f));
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T_; ++t) {
        if (start[b] + t >= 1) {
          const T* src = row(b, start[b] + t - 1);
          std::copy(src, src + H, feats_.begin() + (b * T_ + t) * H);
        }
      }
    }
  }

  // Row b's feature cache entry at position pos (its block checked: the ops check positions against the table).
  T* row(int64_t b, int64_t pos) const {
    TORCH_CHECK_VALUE(pos >= 0 && pos / block_size_ < max_blocks_, "EAGLE-3 head: position ", pos, " of row ", b,
                      " lies past its block table");
    const int64_t block = blocks_ != nullptr ? blocks_[b * max_blocks_ + pos / block_size_] : b;
    TORCH_CHECK_VALUE(block >= 0 && block < num_blocks_, "EAGLE-3 head: block ", block, " of row ", b,
                      " is not a block of the feature cache (", num_blocks_, " blocks)");
    return cache_ + (block * block_size_ + pos % block_size_) * head_.hidden_size();
  }

  ChainRunner<T>& head_;
  T* cache_ = nullptr;
  int64_t num_blocks_, block_size_;
  const int32_t* blocks_;
  int64_t max_blocks_;
  const int64_t* id_of_;
  at::Tensor fc_;
  int64_t id(int64_t draft_token) const { return id_of_ != nullptr ? id_of_[draft_token] : draft_token; }

  // A dynamic tree's scores (dynamic_level's rule): the path scores out [V] of one node's children, its own score
  // plus each draft token's log q under its logits z [V], in float32: log q = (z - max z) - lse, lse the log of the
  // sum of exp(z - max z) taken in float64 and rounded to float32 (the two sides sum in other orders with other exps,
  // which part in a double's last bits: rounded, those reach a score only where lse lies that close to a float32
  // rounding boundary); a NaN is -inf.
  template <typename Z>
  static void path_scores(const Z* z, int64_t V, float base, float* out) {
    float top = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int64_t j = 0; j < V; ++j) {
      const float v = static_cast<float>(z[j]);
      nan = nan || v != v;
      top = v > top ? v : top;
    }
    double sum = 0.0;
    for (int64_t j = 0; j < V; ++j) {
      out[j] = static_cast<float>(z[j]) - top;
      sum += std::exp(static_cast<double>(out[j]));
    }
    const float lse = static_cast<float>(std::log(sum));
    for (int64_t j = 0; j < V; ++j) {
      const float s = base + (out[j] - lse);
      out[j] = nan || s != s ? -std::numeric_limits<float>::infinity() : s;  // (a NaN max: torch's amax is NaN)
    }
  }

  // Whether candidate (sa, a) ranks before (sb, b) in a dynamic tree: the higher score, on a tie the lower index (a
  // stable sort's order: the lower parent, then the lower id).
  static bool better(float sa, int64_t a, float sb, int64_t b) { return sa != sb ? sa > sb : a < b; }

  // best_[0 .. k - 1]: the k best draft tokens by path score (scores [V], no NaN), ties to the lower target id
  void best_children(const float* scores, int64_t V, int64_t k) {
    order_.resize(V);
    for (int64_t v = 0; v < V; ++v) order_[v] = v;
    std::partial_sort(order_.begin(), order_.begin() + k, order_.end(), [&](int64_t a, int64_t b) {
      return better(scores[a], id(a), scores[b], id(b));
    });
    best_.assign(order_.begin(), order_.begin() + k);
  }

  // best_[0 .. k - 1]: the k largest of z [V] (NaN never, ties to the lower id; k = 1: greedy::argmax's choice)
  void top_k(const T* z, int64_t V, int64_t k) {
    best_.resize(k);
    if (k == 1) {
      best_[0] = std::max<int64_t>(greedy::argmax(z, V, false), 0);
      return;
    }
    const auto better = [&](int64_t a, int64_t b) {
      const float za = static_cast<float>(z[a]), zb = static_cast<float>(z[b]);
      const bool na = za != za, nb = zb != zb;
      return na != nb ? nb : (na || za == zb ? a < b : za > zb);
    };
    order_.resize(V);
    for (int64_t v = 0; v < V; ++v) order_[v] = v;
    std::partial_sort(order_.begin(), order_.begin() + k, order_.end(), better);
    std::copy(order_.begin(), order_.begin() + k, best_.begin());
  }

  std::vector<float> inv_temp_, noise_;  // coupled_draws': [B] and [B, gamma, K]
  std::vector<T> feats_, prev_, nodes_, level_;
  std::vector<int64_t> start_, last_, roots_, root_tok_, ids_, pos_, tree_tok_, sub_tok_, sub_depth_, best_, order_;
  std::vector<float> score_, path_, perturbed_, cand_score_;  // a dynamic tree's: [B, N], [V], [V], [n_parent * k]
  std::vector<int64_t> cand_tok_, sub_parent_;
  std::unique_ptr<bool[]> mask_;
  int64_t mask_size_ = 0;
};

}  // namespace
}  // namespace specdec
