// spec_kernels._sampling.keep_threshold on the CPU: the filters' threshold of each row (csrc/keep_threshold_cpu.h),
// the same floats the native steps' coupled rows compute.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#include "keep_threshold_cpu.h"

namespace specdec {

// z [N, V] float32 scaled logits (finite maxima), top_k [N] int64, top_p [N] and min_p [N] float32 -> thr [N].
at::Tensor keep_threshold_cpu(const at::Tensor& z, const at::Tensor& top_k, const at::Tensor& top_p,
                              const at::Tensor& min_p) {
  TORCH_CHECK_VALUE(z.dim() == 2 && z.scalar_type() == at::kFloat, "keep_threshold: z must be float32 [N, V], got ",
                    z.sizes(), " ", z.scalar_type());
  const int64_t N = z.size(0), V = z.size(1);
  TORCH_CHECK_VALUE(V >= 1, "keep_threshold: z has no entries");
  for (const at::Tensor* t : {&top_k, &top_p, &min_p}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == N, "keep_threshold: per-row inputs must be [N] = [", N, "], got ",
                      t->sizes());
  }
  TORCH_CHECK_VALUE(top_k.scalar_type() == at::kLong && top_p.scalar_type() == at::kFloat &&
                        min_p.scalar_type() == at::kFloat,
                    "keep_threshold: top_k must be int64, top_p and min_p float32");
  const at::Tensor zc = z.contiguous(), kc = top_k.contiguous(), pc = top_p.contiguous(), mc = min_p.contiguous();
  at::Tensor out = at::empty({N}, z.options());
  const float* zp = zc.data_ptr<float>();
  const int64_t* k = kc.data_ptr<int64_t>();
  const float *p = pc.data_ptr<float>(), *m = mc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < N * V; ++i) {  // (sorting NaNs is undefined; the callers sanitise their rows)
    TORCH_CHECK_VALUE(zp[i] == zp[i], "keep_threshold: z holds a NaN (sanitise it: NaN -> -inf)");
  }
  at::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf;
    for (int64_t i = lo; i < hi; ++i) o[i] = sampling::keep_threshold(zp + i * V, V, k[i], p[i], m[i], buf);
  });
  return out;
}

// Its shape and checks without values (the Meta kernel: fake-tensor tracing sees the same errors).
at::Tensor keep_threshold_meta(const at::Tensor& z, const at::Tensor& top_k, const at::Tensor& top_p,
                               const at::Tensor& min_p) {
  TORCH_CHECK_VALUE(z.dim() == 2 && z.scalar_type() == at::kFloat, "keep_threshold: z must be float32 [N, V], got ",
                    z.sizes(), " ", z.scalar_type());
  return at::empty({z.size(0)}, z.options());
}

}  // namespace specdec
