// A model as the native step runners take it (spec_kernels::draft_chain, greedy_steps, eagle3_draft and
// spec_chain): the class torch.classes.spec_kernels.NativeModel, built once per model by
// spec_kernels.decoder_layers.NativeModel (a draft model, a target, or with set_head an EAGLE-3 head), checked
// once there, and handed to every call as one argument instead of its tensors one by one.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <vector>

namespace specdec {

struct NativeModel : torch::CustomClassHolder {
  // embed [V, H]; weights: LAYER_FIELDS tensors per layer (an empty tensor for a missing optional one; uint8 GGUF
  // blocks for a quantized matrix); final_norm [H]; lm_head [K, H], K = V or over vocab_map [K] (a draft's
  // restricted vocabulary: the token ids of its rows); rope_table [2, P, D] (cos, sin), in the model's dtype.
  NativeModel(at::Tensor embed, std::vector<at::Tensor> weights, at::Tensor final_norm, at::Tensor lm_head,
              at::Tensor rope_table, int64_t num_heads, double eps, c10::optional<at::Tensor> vocab_map);

  // An EAGLE-3 head: hidden_norm [H] the feature's norm, fc [H, C * H_target] over the target's residual streams
  // entering layers `capture` (C of them), norm_before_residual: the residual stream starts at the normed feature.
  void set_head(at::Tensor hidden_norm, at::Tensor fc, bool norm_before_residual, std::vector<int64_t> capture);

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
};

}  // namespace specdec
