// KV-cache compaction on CPU: whole-row memcpy, parallel over (plane, sequence).
//
// Glossary: see csrc/kernels/compact_kv.cuh (plane, row, L_b, path).
//
// The binding (csrc/bindings.cpp) has already checked ranks, batch sizes, dtypes, devices and contiguity, and
// hands over int64 contiguous index tensors and an int32 contiguous block table. This file checks the *values*
// (reading them is free on CPU) and moves the rows.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace specdec {

namespace {

struct Layout {
  unsigned char* data;
  int64_t batch;
  int64_t row_bytes;
  int64_t plane_stride;  // bytes
  int64_t seq_stride;    // bytes between sequences (contiguous) or physical blocks (paged)
  int64_t slot_stride;   // bytes
  int64_t capacity;      // logical slots per sequence
  int64_t block_size;
  int64_t num_blocks;
  const int32_t* block_table;  // [B, max_blocks] or nullptr
  int64_t max_blocks;

  unsigned char* row(int64_t n, int64_t b, int64_t pos) const {
    unsigned char* plane = data + n * plane_stride;
    if (block_table == nullptr) return plane + b * seq_stride + pos * slot_stride;
    const int64_t block = block_table[b * max_blocks + pos / block_size];
    return plane + block * seq_stride + (pos % block_size) * slot_stride;
  }

  void check_slot(int64_t b, int64_t t, int64_t pos, const char* what) const {
    TORCH_CHECK_VALUE(pos >= 0 && pos < capacity, "compact_kv_: sequence ", b, ", path step ", t, ": ", what,
                      " slot ", pos, " is past the cache (", capacity, " slots per sequence)");
    if (block_table == nullptr) return;
    const int64_t block = block_table[b * max_blocks + pos / block_size];
    TORCH_CHECK_VALUE(block >= 0 && block < num_blocks, "compact_kv_: sequence ", b, ", path step ", t, ": ", what,
                      " slot ", pos, " maps to block_table[", b, ", ", pos / block_size, "] = ", block,
                      ", outside the cache's ", num_blocks, " blocks");
  }
};

// What one sequence's path asks for, shared by all N planes.
enum class Plan : uint8_t {
  kNothing,  // every row is already in place (a chain, or num_accepted <= 1)
  kDirect,   // accepted_nodes[b, t] >= t for all t: copying in increasing t never overwrites a row still to be read
  kStaged,   // anything else: read every source into a buffer, then write
};

// Copies one row into the cache, with non-temporal stores when `streaming` and the layout allows them. A 2 KiB row
// is below memcpy's own streaming threshold, so memcpy first reads every destination line for ownership: a third of
// the traffic when the cache is cold. Callers issue store_fence() before returning.
inline void store_row(unsigned char* dst, const unsigned char* src, int64_t bytes, bool streaming) {
#if defined(__SSE2__)
  if (streaming && bytes % 64 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    for (int64_t i = 0; i < bytes; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

constexpr int64_t kStreamingBytes = 1 << 20;

inline void store_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace

void compact_kv_cpu(const at::Tensor& cache, const at::Tensor& cache_seqlens, const at::Tensor& accepted_nodes,
                    const at::Tensor& num_accepted, const c10::optional<at::Tensor>& block_table) {
  const bool paged = block_table.has_value();
  const int64_t num_planes = cache.size(0);
  const int64_t batch = cache_seqlens.size(0);
  const int64_t max_nodes = accepted_nodes.size(1);
  const int64_t elem = cache.element_size();

  Layout lay{};
  lay.data = static_cast<unsigned char*>(cache.data_ptr());
  lay.batch = batch;
  lay.row_bytes = elem;
  for (int64_t d = 3; d < cache.dim(); ++d) lay.row_bytes *= cache.size(d);
  lay.plane_stride = cache.stride(0) * elem;
  lay.seq_stride = cache.stride(1) * elem;
  lay.slot_stride = cache.stride(2) * elem;
  if (paged) {
    lay.block_size = cache.size(2);
    lay.num_blocks = cache.size(1);
    lay.block_table = block_table->data_ptr<int32_t>();
    lay.max_blocks = block_table->size(1);
    lay.capacity = lay.max_blocks * lay.block_size;
  } else {
    lay.capacity = cache.size(2);
  }

  const int64_t* L = cache_seqlens.data_ptr<int64_t>();
  const int64_t* nodes = accepted_nodes.data_ptr<int64_t>();  // [B, T]
  const int64_t* counts = num_accepted.data_ptr<int64_t>();

  std::vector<Plan> plans(batch, Plan::kNothing);
  int64_t rows_moved = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t base = L[b];
    const int64_t num = counts[b];
    TORCH_CHECK_VALUE(base >= 0, "compact_kv_: cache_seqlens[", b, "] = ", base, " is negative");
    TORCH_CHECK_VALUE(num >= 0 && num <= max_nodes, "compact_kv_: num_accepted[", b, "] = ", num,
                      " is outside [0, T = ", max_nodes, "]");
    bool moves = false;
    bool direct = true;
    for (int64_t t = 0; t < num; ++t) {
      const int64_t node = nodes[b * max_nodes + t];
      TORCH_CHECK_VALUE(node >= 0, "compact_kv_: accepted_nodes[", b, ", ", t, "] = ", node,
                        " is padding (or negative) inside the first num_accepted[", b, "] = ", num, " entries");
      TORCH_CHECK_VALUE(node <= std::numeric_limits<int64_t>::max() - base, "compact_kv_: accepted_nodes[", b, ", ",
                        t, "] = ", node, " is past the cache (cache_seqlens + it overflows)");
      lay.check_slot(b, t, base + node, "source (cache_seqlens + accepted_nodes)");
      lay.check_slot(b, t, base + t, "destination (cache_seqlens + t)");
      if (node != t) {
        moves = true;
        ++rows_moved;
      }
      direct = direct && node >= t;
    }
    plans[b] = !moves ? Plan::kNothing : (direct ? Plan::kDirect : Plan::kStaged);
  }
  if (rows_moved == 0 || lay.row_bytes == 0) return;
  // Bypass the caches only for copies bigger than L2 (like glibc's non-temporal threshold): a small model's
  // compacted rows are read again, warm, by the next forward. With the source prefetch below, cold caches, 32 layers,
  // one thread, medians of 4 runs on a shared 2-core EPYC VM (bench_compact_kv; noisy): B=16 fp16 36-45% -> 45-57%
  // of memcpy, a reversed (staged) path 13-15% -> 16-51%.
  const bool streaming = num_planes * rows_moved * lay.row_bytes >= kStreamingBytes;

  // Aim for ~256 KiB of copying per task so two cores split B=1 work across planes without per-task overhead.
  const int64_t bytes_per_task = std::max<int64_t>(1, rows_moved / batch) * lay.row_bytes;
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / bytes_per_task);

  // Rows are scattered 1-4 KiB runs that the hardware prefetcher catches only mid-row, so a cold copy is latency
  // bound: fetch the next (plane, sequence)'s sources while this one copies.
  auto prefetch_sources = [&](int64_t task) {
    const int64_t n = task / batch;
    const int64_t b = task % batch;
    if (plans[b] == Plan::kNothing) return;
    const int64_t* path = nodes + b * max_nodes;
    for (int64_t t = 0; t < counts[b]; ++t) {
      if (path[t] == t) continue;
      const unsigned char* src = lay.row(n, b, L[b] + path[t]);
      for (int64_t off = 0; off < lay.row_bytes; off += 64) __builtin_prefetch(src + off, 0, 3);
    }
  };

  at::parallel_for(0, num_planes * batch, grain, [&](int64_t begin, int64_t end) {
    std::vector<unsigned char> stage;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / batch;
      const int64_t b = task % batch;
      if (task + 1 < end) prefetch_sources(task + 1);
      if (plans[b] == Plan::kNothing) continue;
      const int64_t base = L[b];
      const int64_t num = counts[b];
      const int64_t* path = nodes + b * max_nodes;
      if (plans[b] == Plan::kDirect) {
        // With node >= t for every t, the row written at step t (slot base + t) is never a later step's source
        // (those are base + node' with node' >= t' > t), so each source is read before anything overwrites it.
        // Skipping the staging buffer halves the bytes touched: a third less time at B=16 fp32, 32 layers, and at
        // B=1 fp16 (best of 200, one thread, a 2-core EPYC; bench/bench_compact_kv.py).
        for (int64_t t = 0; t < num; ++t) {
          if (path[t] == t) continue;
          store_row(lay.row(n, b, base + t), lay.row(n, b, base + path[t]), lay.row_bytes, streaming);
        }
        continue;
      }
      stage.resize(static_cast<size_t>(num * lay.row_bytes));
      for (int64_t t = 0; t < num; ++t) {
        if (path[t] == t) continue;
        std::memcpy(stage.data() + t * lay.row_bytes, lay.row(n, b, base + path[t]), lay.row_bytes);
      }
      for (int64_t t = 0; t < num; ++t) {
        if (path[t] == t) continue;
        store_row(lay.row(n, b, base + t), stage.data() + t * lay.row_bytes, lay.row_bytes, streaming);
      }
    }
    store_fence();
  });
}

}  // namespace specdec
