// Greedy verify_tree on CPU in one call: the walk of every row of a batch whose rows are all greedy (temperature 0)
// and whose children are deterministic (no draft_probs), float32 logits.
//
// Why: plain decoding and greedy speculation verify every step, and the general native path (spec_kernels/
// verify_tree.py) is ~30 torch ops of checks, argmax and walking: 10-70% of a default-target forward a step at batch 1
// on a CPU. Here the walk reads one logits row per visited node (an AVX-512 argmax over V) and nothing
// else.
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

#include "cpu_simd.h"

namespace specdec {

namespace {

constexpr int64_t kPadNode = -1;

using simd::cpu_has_avx2;
using simd::cpu_has_avx512;

// The first index of the maximum of z [V], or -1 when the row holds a NaN or its maximum is infinite.
int64_t argmax_scalar(const float* z, int64_t V) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t idx = -1;
  for (int64_t i = 0; i < V; ++i) {
    if (std::isnan(z[i])) return -1;
    if (idx < 0 || z[i] > best) best = z[i], idx = i;
  }
  return std::isfinite(best) ? idx : -1;
}

#if SPECDEC_CPU_X86
SPECDEC_AVX512 int64_t argmax_avx512(const float* z, int64_t V) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 live = V - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (V - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(live, z + i);
    nan |= _mm512_mask_cmp_ps_mask(live, v, v, _CMP_UNORD_Q);
    mx = _mm512_mask_max_ps(mx, live, mx, v);
  }
  const float best = _mm512_reduce_max_ps(mx);
  if (nan != 0 || !std::isfinite(best)) return -1;
  const __m512 target = _mm512_set1_ps(best);
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 live = V - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (V - i)) - 1);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(live, _mm512_maskz_loadu_ps(live, z + i), target, _CMP_EQ_OQ);
    if (hit != 0) return i + __builtin_ctz(hit);
  }
  return -1;  // unreachable: the maximum is in the row
}

SPECDEC_AVX2 int64_t argmax_avx2(const float* z, int64_t V) {
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(z + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  float best = simd::reduce_max8(mx);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < V; ++j) has_nan |= std::isnan(z[j]), best = std::max(best, z[j]);
  if (has_nan || !std::isfinite(best)) return -1;
  const __m256 target = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= V; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(z + i), target, _CMP_EQ_OQ));
    if (hit != 0) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; i < V; ++i) {
    if (z[i] == best) return i;
  }
  return -1;  // unreachable: the maximum is in the row
}
#endif

int64_t argmax(const float* z, int64_t V) {
#if SPECDEC_CPU_X86
  if (cpu_has_avx512()) return argmax_avx512(z, V);
  if (cpu_has_avx2()) return argmax_avx2(z, V);
#endif
  return argmax_scalar(z, V);
}

}  // namespace

// logits [B, T, V] float32, tokens [B, T] int64, parents [B, T] int64 -> (accepted_nodes [B, T], output_tokens
// [B, T], num_accepted [B]), int64.
std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_greedy_cpu(const at::Tensor& logits, const at::Tensor& tokens,
                                                                 const at::Tensor& parents) {
  TORCH_CHECK_VALUE(logits.dim() == 3 && logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
                    "verify_greedy: logits must be float32 [B, T, V] on CPU, got ", logits.sizes(), " ",
                    logits.scalar_type(), " on ", logits.device());
  const int64_t B = logits.size(0), T = logits.size(1), V = logits.size(2);
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
      bool valid = true;
      for (int64_t i = 0; i < T && valid; ++i) {
        const int64_t parent = pp[b * T + i], token = tp[b * T + i];
        valid = parent >= -1 && parent < i && (parent < 0 || (token >= 0 && token < V));
      }
      if (!valid) continue;
      int64_t cur = 0, depth = 0;
      cp[b] = 0;
      while (true) {
        const int64_t best = argmax(zp + (b * T + cur) * V, V);
        if (best < 0) break;  // not finite: the caller's Python path sanitises this row
        int64_t next = -1;
        for (int64_t c = cur + 1; c < T; ++c) {
          if (pp[b * T + c] == cur && tp[b * T + c] == best) {
            next = c;
            break;
          }
        }
        if (next < 0) {
          out[depth] = best;
          cp[b] = depth + 1;
          break;
        }
        out[depth] = best;
        acc[++depth] = next;
        cur = next;
      }
    }
  });
  return {accepted, output, counts};
}

}  // namespace specdec
