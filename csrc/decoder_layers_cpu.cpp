// A stack of Llama-family decoder layers on a KV cache, in one op call: the engine's whole forward on CPU (float32
// or bfloat16 weights, activations and cache; the residual stream, norms, RoPE and softmax in float32).
//
// Glossary: B sequences, T new tokens each (a tree, a chain, one decode token or a prefill chunk), M = B * T rows,
// H the hidden size, Hq / Hkv query / key-value heads of D elements, G = Hq / Hkv query heads per KV head, I the MLP
// width, L_b the committed length of sequence b (its tree's K/V go to positions L_b .. L_b + T - 1).
//
// Why one op: the default target's forward is ~250 small torch ops at T = 1, whose dispatch and allocation cost several
// times all its matmuls; llama.cpp's whole forward on the same weights costs about the matmuls. Here a layer is 4 calls
// of the small-M linear kernel (csrc/linear_cpu.cpp) plus loops over the rows for everything else, in buffers allocated
// once per call.
//
// Per layer, for every row:   x = rms_norm(h) * w_in
//                             q, k, v = x @ Wqkv^T (+ b), [q_norm, k_norm], RoPE(q, k) from the given cos / sin
//                             K/V -> cache at L_b + t;  a = tree attention (prefix + the nodes the mask allows)
//                             h += a @ Wo^T;  x = rms_norm(h) * w_post;  h += (silu(x Wg^T) * (x Wu^T)) @ Wd^T
// and at the end h = rms_norm(h) * w_final. Gemma's variant (Variant in csrc/native_model.h): each block's output
// normed before it joins h (attn_out_norm, mlp_out_norm), GELU-tanh for SiLU, its query scale, soft-capped scores,
// and per layer a sliding window (a row at L_b + its depth sees the positions past that less the window) with its own
// RoPE. A norm's weight may be float32 (Gemma's 1 + w).
//
// Batch invariance (greedy speculation relies on it): every value of row (b, t) is computed by the same sequence of
// float operations whatever B and T are and whatever the other rows hold. Matmuls: the linear kernel's fixed order.
// Norms, RoPE, SiLU: per row. Attention: one query row's scores run over its keys in position order (the prefix, then
// the tree nodes in node order, which is position order along a path) and are summed in that order; a key the mask
//
// The layer stack itself is csrc/layers_cpu.h (with csrc/attention_cpu.h and csrc/layer_ops_cpu.h); this file is the
// op's entry points.

#include "layers_cpu.h"
#include "native_model.h"

namespace specdec {
namespace {

// One call's inputs beside the model's tensors and the cache: the op's Tensor?[] inputs, in this order.
struct LayerInputs {
  at::Tensor cache_seqlens;                 // [B]
  at::Tensor rope;                          // [2, B, T, D]
  at::Tensor tree_mask;                     // [B, T, T]
  c10::optional<at::Tensor> block_table;    // [B, max_blocks], or None: a contiguous cache
  c10::optional<at::Tensor> rope_local;     // [2, B, T, D]: the windowed layers' RoPE, or None: rope's
};

LayerInputs layer_inputs(const OptTensorList& inputs) {
  TORCH_CHECK_VALUE(inputs.size() == 5, "decoder_layers: inputs must be [cache_seqlens, rope, tree_mask, ",
                    "block_table, rope_local], got ", inputs.size(), " entries");
  const c10::optional<at::Tensor> cache_seqlens = inputs.get(0), rope = inputs.get(1), mask = inputs.get(2);
  TORCH_CHECK_VALUE(cache_seqlens.has_value() && rope.has_value() && mask.has_value(),
                    "decoder_layers: cache_seqlens, rope and tree_mask are required, got None");
  return {*cache_seqlens, *rope, *mask, inputs.get(3), inputs.get(4)};
}

}  // namespace

// Returns (out [B, T, H], features [B, T, len(capture) * H]): the final-normed hidden states, and the residual
// streams entering the layers in `capture` (in its order; empty when it is).
std::tuple<at::Tensor, at::Tensor> decoder_layers_cpu(const at::Tensor& hidden, at::TensorList weights_list,
                                                      const at::Tensor& final_norm, at::Tensor kv_cache,
                                                      const OptTensorList& inputs, int64_t num_heads, double eps,
                                                      at::IntArrayRef capture, at::IntArrayRef windows,
                                                      double softmax_scale, double softcap,
                                                      c10::string_view activation) {
  const LayerInputs in = layer_inputs(inputs);
  const auto& [cache_seqlens, rope, tree_mask, block_table, rope_local] = in;
  const std::vector<at::Tensor> weights = present(weights_list);
  const Dims d = check_inputs(hidden, weights, final_norm, kv_cache, cache_seqlens, rope, tree_mask, block_table,
                              num_heads, capture);
  const Variant variant = make_variant("decoder_layers", d.num_layers, {windows.begin(), windows.end()},
                                       in.rope_local, in.rope, softmax_scale, softcap, activation);
  TORCH_CHECK_VALUE(hidden.device().is_cpu(), "decoder_layers: the native kernel runs on CPU, got ", hidden.device());
  const at::Tensor cache_seqlens_long = cache_seqlens.to(at::kLong).contiguous();  // [B]
  const at::Tensor mask = tree_mask.contiguous();  // [B, T, T]
  const at::Tensor cos_sin = rope.contiguous();                          // [2, B, T, D]
  const at::Tensor input = hidden.contiguous();                          // [B, T, H]
  at::Tensor table;                                                      // [B, max_blocks]
  if (block_table.has_value()) table = int32_block_table("decoder_layers", *block_table);

  at::Tensor out = at::empty(hidden.sizes(), hidden.options());  // [B, T, H]
  at::Tensor features = at::empty({d.B, d.T, static_cast<int64_t>(capture.size()) * d.H}, hidden.options());
  if (out.numel() == 0) return {out, features};
  const std::vector<int64_t> layers(capture.begin(), capture.end());
  const at::Tensor norm = final_norm.contiguous();  // [H]
  if (hidden.scalar_type() == at::kFloat) {
    forward<float>(d, input, weights, norm, kv_cache, cache_seqlens_long, mask, cos_sin, table, eps, layers, out,
                   features, variant);
  } else {
    forward<c10::BFloat16>(d, input, weights, norm, kv_cache, cache_seqlens_long, mask, cos_sin, table, eps, layers,
                           out, features, variant);
  }
  return {out, features};
}

static void check_softcap(const at::Tensor& z, double cap) {
  TORCH_CHECK_VALUE(cap > 0. && std::isfinite(cap), "softcap: cap must be finite and > 0, got ", cap);
  TORCH_CHECK_TYPE(z.scalar_type() == at::kFloat || z.scalar_type() == at::kBFloat16,
                   "softcap: z must be float32 or bfloat16, got ", z.scalar_type());
}

// The soft cap of logits z [..., V] (float32 or bfloat16): float32 cap tanh(z / cap), +-inf kept (soft_cap, the
// function the step runners apply to the logits of a model with a final cap).
at::Tensor softcap_cpu(const at::Tensor& z, double cap) {
  check_softcap(z, cap);
  const at::Tensor in = z.contiguous();
  at::Tensor out = at::empty(z.sizes(), z.options().dtype(at::kFloat));
  const int64_t n = in.numel();
  const int64_t grain = 1 << 16;  // elements a task (each element's value is the same whatever the split)
  at::parallel_for(0, (n + grain - 1) / grain, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const int64_t start = c * grain, count = std::min(grain, n - start);
      if (in.scalar_type() == at::kFloat) {
        soft_cap(in.data_ptr<float>() + start, out.data_ptr<float>() + start, count, static_cast<float>(cap));
      } else {
        soft_cap(in.data_ptr<c10::BFloat16>() + start, out.data_ptr<float>() + start, count, static_cast<float>(cap));
      }
    }
  });
  return out;
}

at::Tensor softcap_meta(const at::Tensor& z, double cap) {
  check_softcap(z, cap);
  return at::empty(z.sizes(), z.options().dtype(at::kFloat));
}

std::tuple<at::Tensor, at::Tensor> decoder_layers_meta(const at::Tensor& hidden, at::TensorList weights_list,
                                                       const at::Tensor& final_norm, at::Tensor kv_cache,
                                                       const OptTensorList& inputs, int64_t num_heads, double eps,
                                                       at::IntArrayRef capture, at::IntArrayRef windows,
                                                       double softmax_scale, double softcap,
                                                       c10::string_view activation) {
  const LayerInputs in = layer_inputs(inputs);
  const auto& [cache_seqlens, rope, tree_mask, block_table, rope_local] = in;
  const std::vector<at::Tensor> weights = present(weights_list);
  const Dims d = check_inputs(hidden, weights, final_norm, kv_cache, cache_seqlens, rope, tree_mask, block_table,
                              num_heads, capture);
  make_variant("decoder_layers", d.num_layers, {windows.begin(), windows.end()}, in.rope_local, in.rope,
               softmax_scale, softcap, activation);
  return {at::empty(hidden.sizes(), hidden.options()),
          at::empty({d.B, d.T, static_cast<int64_t>(capture.size()) * d.H}, hidden.options())};
}

}  // namespace specdec
