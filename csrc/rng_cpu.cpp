// Counter-based uniforms on the CPU: spec_kernels/rng.py's ``uniform`` in one pass, bit for bit.
//
// out[b, i] = top 24 bits of mix64(mix64(keys[b] + GOLDEN) + i * GOLDEN), as (k + 0.5) / 2^24 in float32: the same
// wrapping uint64 arithmetic as the torch ops (a dozen element-wise int64 ops over [B, n] there, one loop here) and
// as the Triton kernels' ``_gumbel_tile``.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace specdec {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

inline uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

at::Tensor rng_uniform_cpu(const at::Tensor& keys, int64_t n) {
  TORCH_CHECK(keys.dim() == 1 && keys.scalar_type() == at::kLong, "rng_uniform: keys must be [B] int64, got ",
              keys.sizes(), " ", keys.scalar_type());
  TORCH_CHECK(n >= 0, "rng_uniform: n must be >= 0, got ", n);
  const at::Tensor k = keys.contiguous();
  const int64_t B = k.size(0);
  at::Tensor out = at::empty({B, n}, keys.options().dtype(at::kFloat));
  const int64_t* key = k.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const float scale = 1.0f / 16777216.0f;  // 2^-24
  for (int64_t b = 0; b < B; ++b) {
    const uint64_t base = mix64(static_cast<uint64_t>(key[b]) + kGolden);
    float* row = o + b * n;
    at::parallel_for(0, n, 16384, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const uint64_t x = mix64(base + static_cast<uint64_t>(i) * kGolden);
        row[i] = (static_cast<float>(x >> 40) + 0.5f) * scale;
      }
    });
  }
  return out;
}

}  // namespace specdec
