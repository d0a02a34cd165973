// AMX pieces shared by the bfloat16 kernels on tiles (csrc/linear_amx_cpu.h, csrc/quant_amx_cpu.h): the tile
// configuration's layout and x packed into the k-pair layout a tdpbf16ps's second operand takes.
#pragma once

#include <cstdint>

#include "cpu_simd.h"

#if SPECDEC_CPU_AMX
namespace specdec {
namespace amx {

struct TileConfig {  // the ldtilecfg layout (palette 1)
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t kXBlock = 16 * 16;  // dwords in one packed x block: 16 k pairs x 16 x rows

// x [M, K] bfloat16 bits (row stride ldx, K a multiple of 32) -> packed [ceil(M / 16)][K / 32] blocks, each 16 k-pair
// rows of 16 x rows (row p holds, for each x row, the dword of k = 2p, 2p + 1; zeros past M).
SPECDEC_AMX inline void pack_x_pairs(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint32_t* packed) {
  const int64_t kblocks = K / 32;
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      __m512 r[16];
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) {  // x row m0 + c's 32 elements as 16 dwords
        r[c] = m0 + c < M ? _mm512_loadu_ps(reinterpret_cast<const float*>(x + (m0 + c) * ldx + kb * 32))
                          : _mm512_setzero_ps();
      }
      simd::transpose16(r);
      float* block = reinterpret_cast<float*>(packed + (m0 / 16 * kblocks + kb) * kXBlock);
#pragma GCC unroll 16
      for (int p = 0; p < 16; ++p) _mm512_storeu_ps(block + p * 16, r[p]);
    }
  }
}

}  // namespace amx
}  // namespace specdec
#endif  // SPECDEC_CPU_AMX
