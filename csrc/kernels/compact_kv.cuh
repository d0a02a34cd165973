// KV-cache compaction after tree verification: torch-free CUDA kernel.
//
// Glossary: a *plane* is one [B, S, ...] (or paged [num_blocks, block_size, ...]) slice of the stacked cache, i.e.
// the K or the V of one layer; a *row* is the K/V of one token in one plane (prod(trailing dims) * elem bytes);
// L_b is the committed length of sequence b; accepted_nodes[b, t] is the t-th node of the accepted path.
//
// Effect, per plane n, sequence b and t < num_accepted[b]:
//     row(n, b, L_b + t) <- old row(n, b, L_b + accepted_nodes[b, t])
//
// This header has two parts:
//   - CompactKvParams and the launcher declaration: plain C++ plus the CUDA runtime types, so the torch-facing
//     .cpp glue (compiled by the host compiler) can include it;
//   - the kernel itself, only under __CUDACC__.
// Nothing here includes torch, so `nvcc -c csrc/compact_kv.cu` works on machines whose nvcc cannot parse
// torch's CUDA headers (nvcc 13 with a CPU torch).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace specdec {

// Index tensors are int32 or int64 (the *_int64 flags), read as they are: no cast kernel before the launch, so one
// call is one launch.
struct CompactKvParams {
  void* cache;                 // [N, B, S, ...] or paged [N, num_blocks, block_size, ...]
  const void* cache_seqlens;   // [B], contiguous
  const void* accepted_nodes;  // [B, T], row stride accepted_stride
  const void* num_accepted;    // [B], contiguous
  const void* block_table;     // [B, max_blocks], row stride block_table_stride; nullptr for a contiguous cache
  bool cache_seqlens_int64;
  bool accepted_int64;
  bool num_accepted_int64;
  bool block_table_int64;
  int64_t num_planes;             // N
  int64_t batch;                  // B
  int64_t max_nodes;              // T: the most rows one sequence can move (accepted_nodes.size(1))
  int64_t accepted_stride;
  int64_t row_bytes;              // bytes of one token's row in one plane
  int64_t plane_stride;           // bytes between planes (dim 0)
  int64_t seq_stride;             // bytes between sequences (contiguous) or physical blocks (paged): dim 1
  int64_t slot_stride;            // bytes between slots (dim 2)
  int64_t capacity;               // logical slots per sequence: S, or max_blocks * block_size when paged
  int64_t block_size;             // paged only
  int64_t num_blocks;             // paged only
  int64_t block_table_stride;     // paged only
};

// Launches the compaction on `stream`. Never syncs with the host. Values that would need a host sync to validate
// (an index past the cache, a block id out of range, num_accepted > T) are not reported: such rows are skipped.
// Returns cudaErrorInvalidValue for shapes the launch cannot cover (B or N above 65535, T too large for the
// staging buffer in shared memory), or the launch error.
cudaError_t compact_kv_cuda(const CompactKvParams& params, cudaStream_t stream);

#ifdef __CUDACC__

namespace detail {

__device__ __forceinline__ int64_t load_index(const void* ptr, bool is_int64, int64_t i) {
  return is_int64 ? static_cast<const int64_t*>(ptr)[i] : static_cast<const int32_t*>(ptr)[i];
}

// Byte address of logical slot `pos` of sequence b in a plane, or nullptr when the slot lies outside the cache.
__device__ __forceinline__ unsigned char* slot_ptr(const CompactKvParams& p, unsigned char* plane, int64_t b,
                                                    int64_t pos) {
  if (pos < 0 || pos >= p.capacity) return nullptr;
  if (p.block_table == nullptr) return plane + b * p.seq_stride + pos * p.slot_stride;
  const int64_t block = load_index(p.block_table, p.block_table_int64, b * p.block_table_stride + pos / p.block_size);
  if (block < 0 || block >= p.num_blocks) return nullptr;
  return plane + block * p.seq_stride + (pos % p.block_size) * p.slot_stride;
}

// One block per (chunk of the row, sequence, plane); thread i owns the i-th vector of the chunk in every row of
// the path. All hazards are therefore within one thread's own column: each thread loads every source of its column
// into its own shared-memory lane first, then stores them. No __syncthreads is needed because no thread reads
// another thread's lane. Rows with source == destination (a chain's whole path) are neither read nor written.
template <typename Vec>
__global__ void compact_kv_kernel(const CompactKvParams p) {
  extern __shared__ __align__(16) unsigned char stage_raw[];
  Vec* stage = reinterpret_cast<Vec*>(stage_raw);  // [T, blockDim.x]

  const int64_t b = blockIdx.y;
  const int64_t n = blockIdx.z;
  const int64_t vecs_per_row = p.row_bytes / static_cast<int64_t>(sizeof(Vec));
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= vecs_per_row) return;

  int64_t num = load_index(p.num_accepted, p.num_accepted_int64, b);
  num = num < 0 ? 0 : (num > p.max_nodes ? p.max_nodes : num);
  const int64_t base = load_index(p.cache_seqlens, p.cache_seqlens_int64, b);
  const int64_t path = b * p.accepted_stride;  // offset of this sequence's accepted_nodes row
  unsigned char* plane = static_cast<unsigned char*>(p.cache) + n * p.plane_stride;
  const int64_t byte_off = col * static_cast<int64_t>(sizeof(Vec));

#pragma unroll 4
  for (int64_t t = 0; t < num; ++t) {
    const int64_t node = load_index(p.accepted_nodes, p.accepted_int64, path + t);
    if (node == t || node < 0) continue;
    const unsigned char* src = slot_ptr(p, plane, b, base + node);
    if (src == nullptr || slot_ptr(p, plane, b, base + t) == nullptr) continue;
    stage[t * blockDim.x + threadIdx.x] = *reinterpret_cast<const Vec*>(src + byte_off);
  }
#pragma unroll 4
  for (int64_t t = 0; t < num; ++t) {
    const int64_t node = load_index(p.accepted_nodes, p.accepted_int64, path + t);
    if (node == t || node < 0) continue;
    unsigned char* dst = slot_ptr(p, plane, b, base + t);
    if (dst == nullptr || slot_ptr(p, plane, b, base + node) == nullptr) continue;
    *reinterpret_cast<Vec*>(dst + byte_off) = stage[t * blockDim.x + threadIdx.x];
  }
}

// Static shared memory every SM grants without opt-in.
constexpr int64_t kDefaultSmemBytes = 48 * 1024;

template <typename Vec>
cudaError_t launch(const CompactKvParams& p, cudaStream_t stream) {
  const int64_t vec_bytes = sizeof(Vec);
  const int64_t vecs_per_row = p.row_bytes / vec_bytes;
  // A row of fp16 Hkv*D = 1024 is 128 x 16 B: one 128-thread block covers it in one chunk.
  int64_t threads = 256;
  while (threads > 32 && threads / 2 >= vecs_per_row) threads /= 2;
  while (threads > 32 && p.max_nodes * threads * vec_bytes > kDefaultSmemBytes) threads /= 2;
  const int64_t smem = p.max_nodes * threads * vec_bytes;
  if (smem > 0x7fffffff) return cudaErrorInvalidValue;
  if (smem > kDefaultSmemBytes) {
    // T beyond ~96 rows: opt in to the larger carve-out (up to 227 KiB on H100); fails cleanly past it.
    const cudaError_t err = cudaFuncSetAttribute(compact_kv_kernel<Vec>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  const int64_t chunks = (vecs_per_row + threads - 1) / threads;
  if (chunks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(p.batch), static_cast<unsigned>(p.num_planes));
  compact_kv_kernel<Vec><<<grid, static_cast<unsigned>(threads), static_cast<size_t>(smem), stream>>>(p);
  return cudaGetLastError();
}

}  // namespace detail

#endif  // __CUDACC__

}  // namespace specdec
