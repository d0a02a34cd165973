// A model as the native step runners take it (spec_kernels::draft_chain, plain_steps, eagle3_draft and
// spec_chain): the class torch.classes.spec_kernels.NativeModel, built once per model by
// spec_kernels.decoder_layers.NativeModel (a draft model, a target, or with set_head an EAGLE-3 head), checked
// once there, and handed to every call as one argument instead of its tensors one by one.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_to_copy.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace specdec {

// A native op's Tensor?[] argument: a small group of one call's inputs (its sampling, its per-row inputs), in the
// order the op's comment gives; absent entries are None.
using OptTensorList = c10::List<c10::optional<at::Tensor>>;

// A block table as the CPU kernels read it: int32, contiguous. Ids an int32 cannot hold are refused, not wrapped
// (2^32 + k read as block k would be another sequence's blocks).
inline at::Tensor int32_block_table(const char* op, const at::Tensor& table) {
  if (table.scalar_type() != at::kInt && table.numel() > 0) {
    const at::Tensor wide = table.to(at::kLong);
    const int64_t lo = wide.min().item<int64_t>(), hi = wide.max().item<int64_t>();
    TORCH_CHECK_VALUE(lo >= std::numeric_limits<int32_t>::min() && hi <= std::numeric_limits<int32_t>::max(), op,
                      ": block_table holds ids an int32 cannot (", lo, " .. ", hi, ")");
  }
  return table.to(at::kInt).contiguous();
}

// What a family changes in the layer (spec_kernels/decoder_layers/ref.py: LayerVariant; the defaults are Llama's):
// per layer a sliding window (empty: none), the windowed layers' RoPE (undefined: the model's; shaped like it), the
// query scale (0: D^-1/2), the scores' soft cap (0: none), a GELU-tanh MLP. The decoder_layers op and the step
// runners (NativeModel.set_variant) take it so.
struct Variant {
  std::vector<int64_t> windows;
  at::Tensor rope_local;
  double softmax_scale = 0., softcap = 0.;
  bool gelu = false;
};

// A Variant from an op's arguments, checked (op names the caller) against a model of `layers` layers whose RoPE
// tensor is `rope`.
inline Variant make_variant(const char* op, int64_t layers, std::vector<int64_t> windows,
                            const c10::optional<at::Tensor>& rope_local, const at::Tensor& rope, double softmax_scale,
                            double softcap, c10::string_view activation) {
  TORCH_CHECK_VALUE(windows.empty() || static_cast<int64_t>(windows.size()) == layers, op,
                    ": windows must hold one entry per layer (", layers, "), got ", windows.size());
  for (const int64_t w : windows) TORCH_CHECK_VALUE(w >= 0, op, ": windows must be >= 0, got ", w);
  TORCH_CHECK_VALUE(softmax_scale >= 0. && softcap >= 0., op, ": softmax_scale and softcap must be >= 0 ",
                    "(0: the default), got ", softmax_scale, " and ", softcap);
  TORCH_CHECK_VALUE(activation == "silu" || activation == "gelu_tanh", op,
                    ": activation must be 'silu' or 'gelu_tanh', got '", std::string(activation), "'");
  Variant v;
  v.windows = std::move(windows);
  v.softmax_scale = softmax_scale, v.softcap = softcap, v.gelu = activation == "gelu_tanh";
  if (rope_local.has_value()) {
    const at::Tensor& r = *rope_local;
    TORCH_CHECK_VALUE(r.sizes() == rope.sizes() && r.scalar_type() == rope.scalar_type() && r.device() == rope.device(),
                      op, ": rope_local must be like rope (", rope.sizes(), " ", rope.scalar_type(), " on ",
                      rope.device(), "), got ", r.sizes(), " ", r.scalar_type(), " on ", r.device());
    v.rope_local = r.contiguous();
  }
  return v;
}

struct NativeModel : torch::CustomClassHolder {
  // embed [V, H]; weights: LAYER_FIELDS tensors per layer (an empty tensor for a missing optional one; uint8 GGUF
  // blocks for a quantized matrix); final_norm [H]; lm_head [K, H], K = V or over vocab_map [K] (a draft's
  // restricted vocabulary: the token ids of its rows); rope_table [2, P, D] (cos, sin), in the model's dtype.
  NativeModel(at::Tensor embed, std::vector<at::Tensor> weights, at::Tensor final_norm, at::Tensor lm_head,
              at::Tensor rope_table, int64_t num_heads, double eps, c10::optional<at::Tensor> vocab_map);

  // An EAGLE-3 head: hidden_norm [H] the feature's norm, fc [H, C * H_target] over the target's residual streams
  // entering layers `capture` (C of them), norm_before_residual: the residual stream starts at the normed feature.
  void set_head(at::Tensor hidden_norm, at::Tensor fc, bool norm_before_residual, std::vector<int64_t> capture);

  // Gemma's layer for the runners' forwards: decoder_layers' variant (per-layer windows, the windowed layers' RoPE
  // table [2, P, D] like rope_table, the query scale and soft cap with 0 for none, "silu" or "gelu_tanh"), the
  // embedding's scale (each row times it, rounded to the dtype as HF's normalizer; 0: none) and the final logits'
  // soft cap (Gemma 2; 0: none), which the runners' argmax and sampling read through (soft_cap).
  void set_variant(std::vector<int64_t> windows, c10::optional<at::Tensor> rope_local, double softmax_scale,
                   double softcap, std::string activation, double embed_scale, double final_softcap);

  bool is_head() const { return hidden_norm.defined(); }
  bool restricted() const { return ids.defined(); }  // a draft's vocabulary: lm_head's rows are vocab_map's ids
  const int64_t* vocab_ids() const { return restricted() ? ids.data_ptr<int64_t>() : nullptr; }

  at::Tensor embed, final_norm, lm_head, rope_table;
  std::vector<at::Tensor> weights;
  int64_t num_heads;
  double eps;
  at::Tensor ids;  // vocab_map [K] as int64 (undefined without one)
  at::Tensor hidden_norm, fc;
  bool norm_before_residual = false;
  std::vector<int64_t> capture;
  bool has_variant = false;  // set_variant's, else the Llama layer
  Variant variant;
  double embed_scale = 0.;
  double final_softcap = 0.;
};

}  // namespace specdec
