// Launcher of the compaction kernel: picks the widest vector the layout allows, then launches.
//
// Torch-free on purpose (see csrc/kernels/compact_kv.cuh): the TORCH_CHECKs, device guard and current stream
// live in csrc/bindings.cpp, which the host compiler builds, so this file compiles with any nvcc
// (`nvcc -std=c++17 -c -arch=sm_80` and `-gencode arch=compute_90a,code=sm_90a` are checked in CI).
#include <cstdint>

#include "kernels/compact_kv.cuh"

namespace specdec {

cudaError_t compact_kv_cuda(const CompactKvParams& p, cudaStream_t stream) {
  if (p.num_planes == 0 || p.batch == 0 || p.max_nodes == 0 || p.row_bytes == 0) return cudaSuccess;
  if (p.batch > 65535 || p.num_planes > 65535) return cudaErrorInvalidValue;

  // 16-byte loads need the base pointer, the row length and every stride 16-byte aligned; a D=80 fp16 row with
  // an odd head count, say, falls back to 8, 4, 2 or 1 bytes.
  const uint64_t align_bits = reinterpret_cast<uintptr_t>(p.cache) | static_cast<uint64_t>(p.row_bytes) |
                              static_cast<uint64_t>(p.plane_stride) | static_cast<uint64_t>(p.seq_stride) |
                              static_cast<uint64_t>(p.slot_stride);
  if (align_bits % 16 == 0) return detail::launch<uint4>(p, stream);
  if (align_bits % 8 == 0) return detail::launch<uint2>(p, stream);
  if (align_bits % 4 == 0) return detail::launch<uint32_t>(p, stream);
  if (align_bits % 2 == 0) return detail::launch<uint16_t>(p, stream);
  return detail::launch<uint8_t>(p, stream);
}

}  // namespace specdec
