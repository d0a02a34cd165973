// Greedy verify_tree on CPU in one call: the walk of every row of a batch whose rows are all greedy (temperature 0)
// and whose children are deterministic (no draft_probs), float32 logits.
//
// Why: plain decoding and greedy speculation verify every step, and the general native path (spec_kernels/
// verify_tree.py) is ~30 torch ops of checks, argmax and walking: 10-70% of a default-target forward a step at batch 1
// on a CPU. Here the walk reads one logits row per visited node (greedy::walk, csrc/argmax_cpu.h: the runners' walk
// too) and nothing else.
//
// Semantics (docs/ARCHITECTURE.md, verify_tree, "Greedy"): from the root, move to the first child (in node order) whose token is the target
// argmax (the first maximum); where none matches, or at a leaf, emit the argmax. A visited row whose maximum is not
// finite (a NaN anywhere, or an infinite maximum) is reported with num_accepted = 0 and left to the Python path,
// which sanitises it; a row whose tree is malformed (a parent not -1 or below its node, a drafted token outside
// [0, V)) gets num_accepted = -1, for the Python path to raise its error. Every valid result has num_accepted >= 1.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <tuple>

#include "argmax_cpu.h"

namespace specdec {

namespace {

constexpr int64_t kPadNode = -1;

}  // namespace

// logits [B, T, V] float32, tokens [B, T] int64, parents [B, T] int64 -> (accepted_nodes [B, T], output_tokens
// [B, T], num_accepted [B]), int64.
std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_greedy_cpu(const at::Tensor& logits, const at::Tensor& tokens,
                                                                 const at::Tensor& parents) {
  TORCH_CHECK_VALUE(logits.dim() == 3 && logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
                    "verify_greedy: logits must be float32 [B, T, V] on CPU, got ", logits.sizes(), " ",
                    logits.scalar_type(), " on ", logits.device());
  const int64_t B = logits.size(0), T = logits.size(1), V = logits.size(2);
  TORCH_CHECK_VALUE(T >= 1 && V >= 1, "verify_greedy: a tree has its root (T >= 1) and logits a vocabulary, got ",
                    logits.sizes());
  for (const at::Tensor* t : {&tokens, &parents}) {
    TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == B && t->size(1) == T && t->scalar_type() == at::kLong &&
                          t->device().is_cpu(),
                      "verify_greedy: tokens and parents must be int64 [B, T] = [", B, ", ", T, "] on CPU, got ",
                      t->sizes(), " ", t->scalar_type());
  }
  const at::Tensor z = logits.contiguous();
  const at::Tensor tok = tokens.contiguous();
  const at::Tensor par = parents.contiguous();
  const auto opts = tokens.options();
  at::Tensor accepted = at::empty({B, T}, opts);
  at::Tensor output = at::empty({B, T}, opts);
  at::Tensor counts = at::empty({B}, opts);
  const float* zp = z.data_ptr<float>();
  const int64_t* tp = tok.data_ptr<int64_t>();
  const int64_t* pp = par.data_ptr<int64_t>();
  int64_t* ap = accepted.data_ptr<int64_t>();
  int64_t* op = output.data_ptr<int64_t>();
  int64_t* cp = counts.data_ptr<int64_t>();
  // One row per task: a row walks at most T nodes, each one argmax over V (one pass over the row); threads only
  // for batches worth waking a second thread for.
  at::parallel_for(0, B, std::max<int64_t>(1, 8192 / std::max<int64_t>(V, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      int64_t* acc = ap + b * T;
      int64_t* out = op + b * T;
      std::fill(acc, acc + T, kPadNode);
      std::fill(out, out + T, kPadNode);
      acc[0] = 0;
      cp[b] = -1;
      if (!greedy::well_formed(tp + b * T, pp + b * T, T, V)) continue;
      const auto row = [&](int64_t i) { return zp + (b * T + i) * V; };
      cp[b] = greedy::walk(row, V, tp + b * T, pp + b * T, T, acc, out);  // 0: not finite, the Python path sanitises
    }
  });
  return {accepted, output, counts};
}

}  // namespace specdec
