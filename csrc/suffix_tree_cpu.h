// Suffix decoding's tree in C++: spec_kernels.SuffixTree (torch.classes.spec_kernels.SuffixTree), the same semantics
// as its Python reference spec_engine/drafters/suffix_ref.py::SuffixTreeRef (read its docstring first): a
// depth-bounded suffix trie with occurrence counts, appends of O(max_depth) per token, removal of whole sequences,
// and the speculation tree grown greedily by estimated probability. Registered in csrc/bindings.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace specdec {

class SuffixTree : public torch::CustomClassHolder {
 public:
  explicit SuffixTree(int64_t max_depth);

  // Append tokens [n] (int32 or int64, CPU) to sequence seq_id (created on first use).
  void extend(int64_t seq_id, const at::Tensor& tokens);
  // Forget sequence seq_id (unknown: nothing happens).
  void remove(int64_t seq_id);
  // Occurrences of the string tokens [n] (0 when absent or longer than max_depth).
  int64_t frequency(const at::Tensor& tokens) const;
  int64_t num_nodes() const { return static_cast<int64_t>(nodes_.size() - free_.size()) - 1; }
  int64_t num_seqs() const { return static_cast<int64_t>(seqs_.size()); }
  int64_t max_depth() const { return max_depth_; }
  // The best speculation over every match length of context [n]: (tokens, parents, probs, score, match_len).
  std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<double>, double, int64_t> speculate(
      const at::Tensor& context, int64_t max_tokens, double max_spec_factor, double min_token_prob, bool tree) const;

 private:
  static constexpr int32_t kNone = -1;
  struct Node {
    int32_t token = 0;
    int32_t count = 0;
    int64_t stamp = 0;  // when its count last grew (clock_): ties between siblings go to the latest
    int32_t first_child = kNone;  // children form a doubly linked list, in no order (ranked when speculating)
    int32_t next_sibling = kNone;
    int32_t prev_sibling = kNone;
  };
  struct Sequence {
    std::vector<int32_t> tokens;
    std::vector<int32_t> active;  // nodes of its suffixes of length 1, 2, ... (at most max_depth)
  };
  struct Draft {
    std::vector<int64_t> tokens, parents;
    std::vector<double> probs;
    double score = 0.0;
  };

  static uint64_t edge_key(int32_t parent, int32_t token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(token);
  }
  int32_t child(int32_t parent, int32_t token) const;
  int32_t add_child(int32_t parent, int32_t token);
  void unlink(int32_t parent, int32_t node);
  void ranked_children(int32_t node, std::vector<int32_t>& out) const;
  int32_t match(const int64_t* tokens, int64_t n) const;
  Draft grow_tree(int32_t node, int64_t budget, double min_token_prob) const;
  Draft grow_chain(int32_t node, int64_t budget, double min_token_prob) const;

  int64_t max_depth_;
  int64_t clock_ = 0;  // count increments so far
  std::vector<Node> nodes_;  // nodes_[0] is the root
  std::vector<int32_t> free_;
  std::unordered_map<uint64_t, int32_t> edges_;  // (parent, token) -> child
  std::unordered_map<int64_t, Sequence> seqs_;
};

}  // namespace specdec
