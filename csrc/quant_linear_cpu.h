// The GGUF-quantized small-M linear kernel of csrc/quant_linear_cpu.cpp on raw pointers, for other C++ ops that run
// matmuls in their own loops (csrc/layer_ops_cpu.h).
//
// Weights are GGUF blocks as stored: [N, K / 32 * block_bytes] bytes, each row K / 32 blocks of 32 weights.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace specdec {

// ggml's type ids of the block formats the kernel reads (gguf.GGMLQuantizationType).
enum class QuantType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

constexpr int64_t kQuantBlock = 32;  // weights per block, every type

// Bytes of one block of `qtype` (Q4_0 18, Q4_1 20, Q8_0 34), or 0 for a type the kernel does not read.
int64_t quant_block_bytes(int64_t qtype);

// out [M, N] = x [M, K] (row stride ldx) @ dequant(weight [N, K / 32 * block_bytes])^T + bias [N] (or nullptr), in
// float32 sums; bfloat16 x is widened to float32 and each output rounded once. K is a multiple of 32.
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

// Row `row` of dequant(weight) (row_blocks blocks) into out [row_blocks * 32] in T: an embedding lookup of a
// quantized table. The values are the kernel's own (and gguf.quants.dequantize's) float32 weights, then rounded.
void quant_dequant_row_f32(const uint8_t* weight, int64_t qtype, int64_t row_blocks, int64_t row, float* out);
void quant_dequant_row_bf16(const uint8_t* weight, int64_t qtype, int64_t row_blocks, int64_t row,
                            c10::BFloat16* out);

}  // namespace specdec
