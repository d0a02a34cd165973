// spec_kernels.SuffixTree: see suffix_tree_cpu.h and the Python reference spec_engine/drafters/suffix_ref.py.
// Nodes live in one pool (freed slots reused); a child is found through one hash map keyed by (parent, token), so a
// root with thousands of children costs the same lookup as a leaf's parent.
#include "suffix_tree_cpu.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <queue>

namespace specdec {

namespace {

// A token tensor [n] as int64 values on the host (a copy for int32; the data itself for contiguous int64).
std::vector<int64_t> host_tokens(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.dim() == 1, "SuffixTree: ", what, " must be [n], got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.device().is_cpu(), "SuffixTree: ", what, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, "SuffixTree: ", what,
                   " must be int32 or int64, got ", t.scalar_type());
  const at::Tensor c = t.to(at::kLong).contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + c.numel());
}

constexpr double kSpecEps = 1e-6;  // as suffix_ref.SPEC_EPS

}  // namespace

SuffixTree::SuffixTree(int64_t max_depth) : max_depth_(max_depth) {
  TORCH_CHECK_VALUE(max_depth >= 1, "SuffixTree: max_depth must be >= 1, got ", max_depth);
  nodes_.emplace_back();  // the root
}

int32_t SuffixTree::child(int32_t parent, int32_t token) const {
  const auto it = edges_.find(edge_key(parent, token));
  return it == edges_.end() ? kNone : it->second;
}

int32_t SuffixTree::add_child(int32_t parent, int32_t token) {
  int32_t id;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
    nodes_[id] = Node{};
  } else {
    id = static_cast<int32_t>(nodes_.size());
    nodes_.emplace_back();
  }
  Node& n = nodes_[id];
  n.token = token;
  n.next_sibling = nodes_[parent].first_child;
  if (n.next_sibling != kNone) nodes_[n.next_sibling].prev_sibling = id;
  nodes_[parent].first_child = id;
  edges_.emplace(edge_key(parent, token), id);
  return id;
}

void SuffixTree::unlink(int32_t parent, int32_t node) {
  // node has count 0: its subtree held only the removed occurrence's continuation, which is already at count 0
  // below it (children never count more than their parent), so the whole chain under it is freed.
  std::vector<int32_t> stack{node};
  Node& n = nodes_[node];
  if (n.prev_sibling != kNone) {
    nodes_[n.prev_sibling].next_sibling = n.next_sibling;
  } else {
    nodes_[parent].first_child = n.next_sibling;
  }
  if (n.next_sibling != kNone) nodes_[n.next_sibling].prev_sibling = n.prev_sibling;
  edges_.erase(edge_key(parent, n.token));
  while (!stack.empty()) {
    const int32_t id = stack.back();
    stack.pop_back();
    for (int32_t c = nodes_[id].first_child; c != kNone; c = nodes_[c].next_sibling) {
      edges_.erase(edge_key(id, nodes_[c].token));
      stack.push_back(c);
    }
    free_.push_back(id);
  }
}

void SuffixTree::extend(int64_t seq_id, const at::Tensor& tokens) {
  const std::vector<int64_t> values = host_tokens(tokens, "tokens");
  for (const int64_t value : values) {  // all checked first: a bad id leaves the tree as it was
    TORCH_CHECK_VALUE(value >= 0 && value <= INT32_MAX, "SuffixTree: token ids must lie in [0, 2^31), got ", value);
  }
  Sequence& seq = seqs_[seq_id];
  std::vector<int32_t> next;
  next.reserve(max_depth_);
  for (const int64_t value : values) {
    const auto t = static_cast<int32_t>(value);
    seq.tokens.push_back(t);
    next.clear();
    const int64_t keep = std::min<int64_t>(static_cast<int64_t>(seq.active.size()), max_depth_ - 1);
    for (int64_t i = -1; i < keep; ++i) {  // the root (the new length-1 suffix), then each suffix that may grow
      const int32_t parent = i < 0 ? 0 : seq.active[i];
      int32_t c = child(parent, t);
      if (c == kNone) c = add_child(parent, t);
      nodes_[c].count += 1;
      nodes_[c].stamp = ++clock_;
      next.push_back(c);
    }
    seq.active.swap(next);
  }
}

void SuffixTree::remove(int64_t seq_id) {
  const auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return;
  const std::vector<int32_t> tokens = std::move(it->second.tokens);
  seqs_.erase(it);
  const auto n = static_cast<int64_t>(tokens.size());
  for (int64_t start = 0; start < n; ++start) {
    int32_t node = 0;
    for (int64_t i = start; i < std::min(n, start + max_depth_); ++i) {
      const int32_t c = child(node, tokens[i]);
      TORCH_CHECK(c != kNone, "SuffixTree: corrupt tree (a removed sequence's suffix is missing)");
      if (--nodes_[c].count == 0) {
        unlink(node, c);
        break;
      }
      node = c;
    }
  }
}

int32_t SuffixTree::match(const int64_t* tokens, int64_t n) const {
  int32_t node = 0;
  for (int64_t i = 0; i < n && node != kNone; ++i) {
    if (tokens[i] < 0 || tokens[i] > INT32_MAX) return kNone;
    node = child(node, static_cast<int32_t>(tokens[i]));
  }
  return node;
}

int64_t SuffixTree::frequency(const at::Tensor& tokens) const {
  const std::vector<int64_t> values = host_tokens(tokens, "tokens");
  if (values.empty()) return 0;
  const int32_t node = match(values.data(), static_cast<int64_t>(values.size()));
  return node == kNone ? 0 : nodes_[node].count;
}

void SuffixTree::ranked_children(int32_t node, std::vector<int32_t>& out) const {
  out.clear();
  for (int32_t c = nodes_[node].first_child; c != kNone; c = nodes_[c].next_sibling) out.push_back(c);
  std::sort(out.begin(), out.end(), [this](int32_t a, int32_t b) {
    const Node &x = nodes_[a], &y = nodes_[b];
    return x.count != y.count ? x.count > y.count : x.stamp > y.stamp;
  });
}

SuffixTree::Draft SuffixTree::grow_tree(int32_t node, int64_t budget, double min_token_prob) const {
  struct Item {
    double prob;
    int64_t order;  // when it was queued: equal probabilities leave in that order
    int32_t node;
    int64_t parent;  // index of the parent's drafted node; -1 under the root
  };
  const auto later = [](const Item& a, const Item& b) {
    return a.prob != b.prob ? a.prob < b.prob : a.order > b.order;
  };
  std::priority_queue<Item, std::vector<Item>, decltype(later)> queue(later);
  std::vector<int32_t> ranked;
  int64_t order = 0;
  const auto push_children = [&](int32_t parent, double prob, int64_t index) {
    ranked_children(parent, ranked);
    for (const int32_t c : ranked) {
      const double p = prob * nodes_[c].count / nodes_[parent].count;
      if (p < min_token_prob) break;  // the rest are rarer
      queue.push(Item{p, order++, c, index});
    }
  };
  Draft out;
  push_children(node, 1.0, -1);
  while (!queue.empty() && static_cast<int64_t>(out.tokens.size()) < budget) {
    const Item it = queue.top();
    queue.pop();
    out.tokens.push_back(nodes_[it.node].token);
    out.parents.push_back(it.parent);
    out.probs.push_back(it.prob);
    out.score += it.prob;
    push_children(it.node, it.prob, static_cast<int64_t>(out.tokens.size()) - 1);
  }
  return out;
}

SuffixTree::Draft SuffixTree::grow_chain(int32_t node, int64_t budget, double min_token_prob) const {
  Draft out;
  double prob = 1.0;
  std::vector<int32_t> ranked;
  while (static_cast<int64_t>(out.tokens.size()) < budget && nodes_[node].first_child != kNone) {
    ranked_children(node, ranked);
    const int32_t c = ranked.front();
    prob = prob * nodes_[c].count / nodes_[node].count;
    if (prob < min_token_prob) break;
    out.tokens.push_back(nodes_[c].token);
    out.parents.push_back(static_cast<int64_t>(out.tokens.size()) - 2);
    out.probs.push_back(prob);
    out.score += prob;
    node = c;
  }
  return out;
}

std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<double>, double, int64_t> SuffixTree::speculate(
    const at::Tensor& context, int64_t max_tokens, double max_spec_factor, double min_token_prob, bool tree) const {
  const std::vector<int64_t> ctx = host_tokens(context, "context");
  const auto n = static_cast<int64_t>(ctx.size());
  Draft best;
  int64_t best_len = 0;
  for (int64_t match_len = 1; match_len <= std::min(n, max_depth_); ++match_len) {
    const int32_t node = match(ctx.data() + (n - match_len), match_len);
    if (node == kNone) break;
    // compared as a double before the cast: a factor's budget past int64 (unbounded in the reference) is no UB
    const double by_factor = match_len * max_spec_factor + kSpecEps;
    const int64_t budget = !(by_factor > 0.0)                               ? 0
                           : by_factor >= static_cast<double>(max_tokens) ? std::max<int64_t>(max_tokens, 0)
                                                                          : static_cast<int64_t>(by_factor);
    Draft draft = tree ? grow_tree(node, budget, min_token_prob) : grow_chain(node, budget, min_token_prob);
    if (draft.score >= best.score) {
      best = std::move(draft);
      best_len = match_len;
    }
  }
  return {std::move(best.tokens), std::move(best.parents), std::move(best.probs), best.score, best_len};
}

}  // namespace specdec
