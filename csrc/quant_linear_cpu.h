// The GGUF-quantized small-M linear kernel of csrc/quant_linear_cpu.cpp on raw pointers, for other C++ ops that run
// matmuls in their own loops (csrc/layer_ops_cpu.h).
//
// Weights are GGUF blocks as stored: [N, K / block_weights * block_bytes] bytes, a row's blocks in order (32 weights
// per block, or 256 for the K-quants).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace specdec {

// ggml's type ids of the block formats the kernel reads (gguf.GGMLQuantizationType).
enum class QuantType : int64_t {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
};

// The numeric mode rides on the type id: ggml's id multiplies float activations (quant_linear as linear on the
// dequantized matrix); the id plus kInt8Activations quantizes them to int8 blocks first and multiplies integers
// (csrc/quant_int8_cpu.h). A matrix passed as int8 rather than uint8 blocks asks for the second (qtype_of).
constexpr int64_t kInt8Activations = 256;

constexpr bool int8_activations(int64_t qtype) { return qtype >= kInt8Activations; }
constexpr int64_t ggml_type(int64_t qtype) { return int8_activations(qtype) ? qtype - kInt8Activations : qtype; }

// The kernels' unit of a row: 32 weights, a block of the 32-weight types or an eighth of a K-quant super-block.
constexpr int64_t kQuantBlock = 32;

struct QuantFormat {
  int64_t block_weights, block_bytes;
};

// One block of ggml type id `qtype` (either mode); {0, 0} for an id the kernel does not read. spec_kernels/types.py's
// QUANT_FORMATS holds the same facts.
constexpr QuantFormat quant_format(int64_t qtype) {
  switch (static_cast<QuantType>(ggml_type(qtype))) {
    case QuantType::kQ4_0:
      return {32, 18};
    case QuantType::kQ4_1:
      return {32, 20};
    case QuantType::kQ5_0:
      return {32, 22};
    case QuantType::kQ5_1:
      return {32, 24};
    case QuantType::kQ8_0:
      return {32, 34};
    case QuantType::kQ2_K:
      return {256, 84};
    case QuantType::kQ3_K:
      return {256, 110};
    case QuantType::kQ4_K:
      return {256, 144};
    case QuantType::kQ5_K:
      return {256, 176};
    case QuantType::kQ6_K:
      return {256, 210};
  }
  return {0, 0};
}

// Bytes of a row of K weights in `qtype`, or 0 for an id the kernel does not read or a K not a multiple of its block.
constexpr int64_t quant_row_bytes(int64_t qtype, int64_t K) {
  const QuantFormat f = quant_format(qtype);
  return f.block_weights > 0 && K > 0 && K % f.block_weights == 0 ? K / f.block_weights * f.block_bytes : 0;
}

// out [M, N] = x [M, K] (row stride ldx) @ dequant(weight [N, quant_row_bytes(qtype, K)])^T + bias [N] (or nullptr),
// in float32 sums; bfloat16 x is widened to float32 and each output rounded once. K is a multiple of qtype's block.
// With kInt8Activations in qtype, x's blocks are quantized to int8 first and the sums are integer dot products.
void quant_linear_f32(const float* x, const uint8_t* weight, int64_t qtype, const float* bias, float* out, int64_t M,
                      int64_t N, int64_t K, int64_t ldx);
void quant_linear_bf16(const c10::BFloat16* x, const uint8_t* weight, int64_t qtype, const c10::BFloat16* bias,
                       c10::BFloat16* out, int64_t M, int64_t N, int64_t K, int64_t ldx);

// One thread's share of the same calls (csrc/cpu_team.h): weight-row blocks `part` of `parts`, the rest of out
// untouched. The parts together write exactly what the whole call writes, bit for bit.
void quant_linear_f32_part(const float* x, const uint8_t* weight, int64_t qtype, const float* bias, float* out,
                           int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t part, int64_t parts);
void quant_linear_bf16_part(const c10::BFloat16* x, const uint8_t* weight, int64_t qtype, const c10::BFloat16* bias,
                            c10::BFloat16* out, int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t part,
                            int64_t parts);

// Row `row` of dequant(weight) (row_blocks = K / 32) into out [K] in T: an embedding lookup of a quantized table.
// The values are the kernel's own (and gguf.quants.dequantize's) float32 weights, then rounded.
void quant_dequant_row_f32(const uint8_t* weight, int64_t qtype, int64_t row_blocks, int64_t row, float* out);
void quant_dequant_row_bf16(const uint8_t* weight, int64_t qtype, int64_t row_blocks, int64_t row,
                            c10::BFloat16* out);

}  // namespace specdec
