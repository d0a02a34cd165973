// The small-M linear kernel of csrc/linear_cpu.cpp on raw pointers, for other C++ ops that run matmuls in their own
// loops (csrc/layer_ops_cpu.h): same tiles, same batch-invariant reduction order, same threading rule.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace specdec {

// out [M, N] = x [M, K] (row stride ldx, unit inner stride) @ weight [N, K]^T + bias [N] (or nullptr); float32.
void linear_f32(const float* x, const float* weight, const float* bias, float* out, int64_t M, int64_t N, int64_t K,
                int64_t ldx);

// The same in bfloat16 (AVX512-BF16 dot products, float32 sums, one rounding per output).
void linear_bf16(const c10::BFloat16* x, const c10::BFloat16* weight, const c10::BFloat16* bias, c10::BFloat16* out,
                 int64_t M, int64_t N, int64_t K, int64_t ldx);

// One thread's share of the same calls, for ops that run their own threads (csrc/cpu_team.h): the output columns of
// weight-row blocks `part` of `parts` (equal to within one 16-row block), the rest of out untouched. The parts
// together write exactly what the whole call writes, bit for bit.
void linear_f32_part(const float* x, const float* weight, const float* bias, float* out, int64_t M, int64_t N,
                     int64_t K, int64_t ldx, int64_t part, int64_t parts);
void linear_bf16_part(const c10::BFloat16* x, const c10::BFloat16* weight, const c10::BFloat16* bias,
                      c10::BFloat16* out, int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t part, int64_t parts);

}  // namespace specdec
