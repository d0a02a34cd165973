// The sampling filters' threshold on the CPU: spec_kernels/_sampling.py's ``keep_threshold`` for one row, the one
// implementation the regular step (verify_tree's coupled rows and rejection sampling, through the
// ``keep_threshold`` op) and the native steps' coupled rows (rng::perturbed_argmax) share, so a seeded request
// samples the same tokens on either path.
//
// Glossary (spec_kernels/_sampling.py): z is a row of scaled logits (logits / temperature), finite at its maximum;
// top-k, top-p and min-p apply in HF's order, and together keep exactly the entries z >= thr.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "rng_cpu.h"

namespace specdec {
namespace sampling {

// Candidates a top-p search sorts before it falls back to the whole row (spec_kernels._sampling.TOPP_CANDIDATES).
constexpr int64_t kTopPCandidates = 1024;

// Whether any filter is on (top_k 0, top_p 1, min_p 0: off).
inline bool filtered(int64_t top_k, float top_p, float min_p) { return top_k > 0 || top_p < 1.0f || min_p > 0.0f; }

// The threshold thr such that the filters keep exactly z >= thr (-inf: keep all), over z [V]; `buf` is scratch.
// top-k keeps the k largest (ties at the k-th all kept; k >= V keeps all); top-p, on the top-k-renormalised
// distribution, keeps entry i iff the mass of the entries before it in descending order is < top_p (a tie at the
// boundary kept whole); min-p keeps z >= max z + log(min_p). The masses are summed in one fixed order, so the
// threshold is the same float wherever it is computed.
inline float keep_threshold(const float* z, int64_t V, int64_t top_k, float top_p, float min_p,
                            std::vector<float>& buf) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float zmax = kNegInf;
  for (int64_t x = 0; x < V; ++x) zmax = z[x] > zmax ? z[x] : zmax;
  const bool use_k = top_k > 0 && top_k < V;
  float thr = kNegInf;
  if (top_p < 1.0f) {
    int64_t C = std::min<int64_t>(V, std::max<int64_t>(kTopPCandidates, use_k ? top_k : 0));
    for (;;) {  // the C largest, in descending order (once more over the whole row where they hold too little mass)
      buf.assign(z, z + V);
      if (C < V) std::nth_element(buf.begin(), buf.begin() + (C - 1), buf.end(), std::greater<float>());
      std::sort(buf.begin(), buf.begin() + C, std::greater<float>());
      const float thr_k = use_k ? buf[top_k - 1] : kNegInf;
      float total = 0.0f;  // the kept row's mass, relative to its maximum
      for (int64_t x = 0; x < V; ++x) {
        if (z[x] >= thr_k) total += std::exp(z[x] - zmax);
      }
      float before = 0.0f;  // the mass of the candidates before the next one
      int64_t keep = 0;
      while (keep < C && buf[keep] >= thr_k && before < top_p) before += std::exp(buf[keep++] - zmax) / total;
      // found where top-p or the top-k cut ended it, or where the candidates are the whole row (keep >= 1: the
      // first candidate is the maximum, >= thr_k, and top_p > 0)
      if (before >= top_p || keep < C || C == V) {
        thr = buf[keep - 1];
        break;
      }
      C = V;
    }
  } else if (use_k) {  // the k-th largest
    buf.assign(z, z + V);
    std::nth_element(buf.begin(), buf.begin() + (top_k - 1), buf.end(), std::greater<float>());
    thr = buf[top_k - 1];
  }
  if (min_p > 0.0f) thr = std::max(thr, zmax + std::log(min_p));
  return thr;
}

// The coupled sample of a filtered row at one node: rng::perturbed_argmax over the entries the filters keep, their
// threshold computed on z [V] / t as the regular step computes it (spec_kernels/verify_tree/cpu.py's _perturbed);
// -1 where z holds a NaN or its maximum is not finite, as rng::perturbed_argmax. `zt` and `buf` are scratch.
template <typename T>
int64_t filtered_argmax(const T* z, int64_t V, float t, uint64_t key, int64_t top_k, float top_p, float min_p,
                        std::vector<float>& zt, std::vector<float>& buf) {
  zt.resize(V);
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t x = 0; x < V; ++x) {
    const float v = static_cast<float>(z[x]);
    if (v != v) return -1;
    top = v > top ? v : top;
    zt[x] = v / t;
  }
  if (!std::isfinite(top)) return -1;
  return rng::perturbed_argmax(zt.data(), V, 1.0f, key, keep_threshold(zt.data(), V, top_k, top_p, min_p, buf));
}

}  // namespace sampling
}  // namespace specdec
