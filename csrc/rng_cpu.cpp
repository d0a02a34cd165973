// Counter-based uniforms on the CPU: spec_kernels/rng.py's ``uniform`` in one pass, bit for bit, and its Gumbel
// noise (csrc/rng_cpu.h).
//
// out[b, i] = top 24 bits of mix64(mix64(keys[b] + GOLDEN) + i * GOLDEN), as (k + 0.5) / 2^24 in float32: the same
// wrapping uint64 arithmetic as the torch ops (a dozen element-wise int64 ops over [B, n] there, one loop here) and
// as the Triton kernels' ``_gumbel_tile``.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#include "rng_cpu.h"

namespace specdec {
namespace {

// [B, n] uniforms of keys [B] into out: row b's element i is rng::uniform_at(row_base(keys[b]), i).
void uniforms(const at::Tensor& keys, int64_t n, float* o) {
  const at::Tensor k = keys.contiguous();
  const int64_t B = k.size(0);
  const int64_t* key = k.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const uint64_t base = rng::row_base(static_cast<uint64_t>(key[b]));
    float* row = o + b * n;
    at::parallel_for(0, n, 16384, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) row[i] = rng::uniform_at(base, i);
    });
  }
}

void check_keys(const char* op, const at::Tensor& keys, int64_t n) {
  TORCH_CHECK(keys.dim() == 1 && keys.scalar_type() == at::kLong, op, ": keys must be [B] int64, got ", keys.sizes(),
              " ", keys.scalar_type());
  TORCH_CHECK(n >= 0, op, ": n must be >= 0, got ", n);
}

}  // namespace

// Both ops' shape and checks without values (their Meta kernel: fake-tensor tracing sees the same errors).
at::Tensor rng_meta(const at::Tensor& keys, int64_t n) {
  check_keys("rng", keys, n);
  return at::empty({keys.size(0), n}, keys.options().dtype(at::kFloat));
}

at::Tensor rng_uniform_cpu(const at::Tensor& keys, int64_t n) {
  check_keys("rng_uniform", keys, n);
  at::Tensor out = at::empty({keys.size(0), n}, keys.options().dtype(at::kFloat));
  uniforms(keys, n, out.data_ptr<float>());
  return out;
}

// rng.gumbel on the CPU: -log(-log(u)) of rng_uniform's [B, n], log being rng::det_log (the same floats as the native
// steps' sampled rows compute: csrc/rng_cpu.h).
at::Tensor rng_gumbel_cpu(const at::Tensor& keys, int64_t n) {
  check_keys("rng_gumbel", keys, n);
  at::Tensor out = at::empty({keys.size(0), n}, keys.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  uniforms(keys, n, o);
  at::parallel_for(0, out.numel(), 16384, [&](int64_t lo, int64_t hi) { rng::gumbel_inplace(o + lo, hi - lo); });
  return out;
}

}  // namespace specdec
