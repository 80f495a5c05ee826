// Hopper (sm_90a) warpgroup MMA wrappers shared by the warp-specialized attention kernels: the PTX
// the kernels need and nothing else, each wrapper one instruction (the mbarrier, bulk-copy and
// named-barrier ones are in cache/cuda/mbarrier.cuh).
//
// Shared-memory operand layout (the only one used here): 16-bit rows of 64 elements (128 bytes)
// in the 128-byte swizzle, i.e. 16-byte chunk c of row r of a 1024-byte aligned atom of 8 rows
// lives at r * 128 + ((c ^ (r % 8)) * 16); a tile wider than 64 elements is several such
// column blocks one after another. K-major operands (Q, K: rows are M / N, the 64 elements are
// K) step K by 16 elements with +32 bytes inside a row; MN-major operands (V: rows are K =
// tokens, the 64 elements are N = head dims) step K by 16 rows with +2048 bytes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cache/cuda/mbarrier.cuh"

namespace kvq::cuda::sm90 {

// ---- shared-memory swizzle and matrix descriptors ---------------------------------------------

// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` in a 128-byte-swizzled column block.
__host__ __device__ constexpr uint32_t swizzle128(int row, int chunk) {
  return static_cast<uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

// A wgmma shared-memory matrix descriptor for the 128-byte swizzle: start address, leading
// byte offset (MN-major: bytes from one 64-element column block to the next; K-major: unused),
// stride byte offset (bytes from one group of 8 rows to the next).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (uint64_t{1} << 62);
}

// ---- warpgroup MMA ----------------------------------------------------------------------------

// Before the first wgmma of a batch whose accumulator or A registers other instructions wrote.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads or writes of an accumulator across the asynchronous
// MMAs that use it (apply after wgmma_wait and before wgmma_fence).
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulator fragment of m64nNk16 (fp32): thread (warp w of the warpgroup, lane 4g + c)
// holds d[4j + e] = D[16w + g + 8(e / 2)][8j + 2c + e % 2]. A register fragment (16-bit) holds
// a[0] = A[16w + g][2c, 2c + 1], a[1] = A[16w + g + 8][2c, 2c + 1], a[2] and a[3] the same at
// k + 8: an accumulator's pairs of n-blocks 2kk, 2kk + 1 are the A fragment of k step kk.
//
// The wrappers, one instruction each, differ only in N (32 or 64 accumulator registers) and the
// operand type: the operand lists below are written once. KVQ_WGMMA_D<R>(d): d's registers as
// read-write operands %0 .. %R-1; KVQ_WGMMA_R<R>: the PTX vector of those operands.
// clang-format off
#define KVQ_WGMMA_D32(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), \
    "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
    "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), \
    "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), \
    "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define KVQ_WGMMA_D64(d) KVQ_WGMMA_D32(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
    "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), \
    "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), \
    "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), \
    "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define KVQ_WGMMA_R32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define KVQ_WGMMA_R64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
// clang-format on
// D (+)= A B, A and B shared-memory descriptors (both K-major); operands after the R
// accumulators: %R a, %R+1 b, %R+2 scale_d (0: D = A B).
#define KVQ_WGMMA_SS(NAME, SHAPE, TY, R, IA, IB, IS)                                        \
  __device__ __forceinline__ void NAME(float(&d)[R], uint64_t a, uint64_t b, int scale_d) { \
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %" #IS                                 \
                 ", 0;\n"                                                                   \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY " " KVQ_WGMMA_R##R \
                 ", %" #IA ", %" #IB ", p, 1, 1, 0, 0;\n}\n"                                \
                 : KVQ_WGMMA_D##R(d)                                                        \
                 : "l"(a), "l"(b), "r"(scale_d));                                           \
  }
// D += A B, A in registers (AV: the PTX vector of %R .. %R+3), B a shared-memory descriptor
// (%R+4, MN-major).
#define KVQ_WGMMA_RS_TB(NAME, SHAPE, TY, R, AV, IB)                                       \
  __device__ __forceinline__ void NAME(float(&d)[R], const uint32_t(&a)[4], uint64_t b) { \
    asm volatile(                                                                         \
        "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"                                      \
        "wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY " " KVQ_WGMMA_R##R        \
        ", " AV ", %" #IB ", p, 1, 1, 1;\n}\n"                                            \
        : KVQ_WGMMA_D##R(d)                                                               \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                            \
  }
KVQ_WGMMA_SS(wgmma_ss_m64n64k16_bf16, "m64n64k16", "bf16", 32, 32, 33, 34)
KVQ_WGMMA_SS(wgmma_ss_m64n128k16_bf16, "m64n128k16", "bf16", 64, 64, 65, 66)
KVQ_WGMMA_SS(wgmma_ss_m64n64k16_f16, "m64n64k16", "f16", 32, 32, 33, 34)
KVQ_WGMMA_SS(wgmma_ss_m64n128k16_f16, "m64n128k16", "f16", 64, 64, 65, 66)
KVQ_WGMMA_RS_TB(wgmma_rs_m64n64k16_bf16_tb, "m64n64k16", "bf16", 32, "{%32, %33, %34, %35}", 36)
KVQ_WGMMA_RS_TB(wgmma_rs_m64n128k16_bf16_tb, "m64n128k16", "bf16", 64, "{%64, %65, %66, %67}", 68)
KVQ_WGMMA_RS_TB(wgmma_rs_m64n64k16_f16_tb, "m64n64k16", "f16", 32, "{%32, %33, %34, %35}", 36)
KVQ_WGMMA_RS_TB(wgmma_rs_m64n128k16_f16_tb, "m64n128k16", "f16", 64, "{%64, %65, %66, %67}", 68)
#undef KVQ_WGMMA_RS_TB
#undef KVQ_WGMMA_SS
#undef KVQ_WGMMA_R64
#undef KVQ_WGMMA_R32
#undef KVQ_WGMMA_D64
#undef KVQ_WGMMA_D32

// D (+)= A B with A and B in shared memory, both K-major (scale_d 0: D = A B).
template <int N, bool kBf16>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t a, uint64_t b, int scale_d) {
  static_assert(N == 64 || N == 128);
  if constexpr (N == 64) {
    if constexpr (kBf16)
      wgmma_ss_m64n64k16_bf16(d, a, b, scale_d);
    else
      wgmma_ss_m64n64k16_f16(d, a, b, scale_d);
  } else {
    if constexpr (kBf16)
      wgmma_ss_m64n128k16_bf16(d, a, b, scale_d);
    else
      wgmma_ss_m64n128k16_f16(d, a, b, scale_d);
  }
}
// D += A B with A in registers and B in shared memory, MN-major.
template <int N, bool kBf16>
__device__ __forceinline__ void wgmma_rs_tb(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {
  static_assert(N == 64 || N == 128);
  if constexpr (N == 64) {
    if constexpr (kBf16)
      wgmma_rs_m64n64k16_bf16_tb(d, a, b);
    else
      wgmma_rs_m64n64k16_f16_tb(d, a, b);
  } else {
    if constexpr (kBf16)
      wgmma_rs_m64n128k16_bf16_tb(d, a, b);
    else
      wgmma_rs_m64n128k16_f16_tb(d, a, b);
  }
}

}  // namespace kvq::cuda::sm90
