// Programmatic dependent launch (sm_90) for the small kernels of a step: a kernel launched
// with launch_pdl() may be scheduled while the previous kernel on the stream finishes, and
// waits in wait_for_previous_kernel() (first thing, before any global memory access) until
// that kernel has completed and its writes are visible; allow_next_kernel() lets the next
// such kernel be scheduled early. Both are no-ops for a kernel launched without the attribute
// (and the wait is a no-op after a kernel that is not a PDL primary, e.g. a cuBLAS GEMM).
// KVQ_PDL=0 launches without the attribute (A/B).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "cache/cuda/cuda_check.h"

namespace kvq::cuda {

__device__ __forceinline__ void wait_for_previous_kernel() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void allow_next_kernel() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Kernels that let the next kernel be scheduled only after their main loop (or never) and
// do it as their first instruction instead, as bits (`early` kernel arguments): 1 kvq's
// skinny GEMM (the default: its dependents' launches then overlap it), 2 the split-KV decode
// kernel, 4 the decode merges (2 and 4 measured no gain: docs/notes/decode-tuning.md version
// 15). KVQ_PDL_EARLY=bits overrides the default (A/B; 0: every one after its main loop).
inline bool pdl_early(int which) {
  static const int bits = [] {
    const char* e = std::getenv("KVQ_PDL_EARLY");
    return e == nullptr || *e == '\0' ? 1 : std::atoi(e);
  }();
  return (bits & which) != 0;
}

inline bool pdl_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("KVQ_PDL");
    return e == nullptr || std::strcmp(e, "0") != 0;
  }();
  return on;
}

// kernel<<<grid, block, smem, stream>>>(args...), with the programmatic-serialization attribute
// when `programmatic`; launch errors are checked.
// `cluster` > 0: thread-block clusters of that many blocks along x (grid.x a multiple of it).
template <typename... Params, typename... Args>
void launch_kernel_cluster(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                           unsigned cluster, cudaStream_t stream, bool programmatic,
                           Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (programmatic) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (cluster > 0) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  KVQ_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}
template <typename... Params, typename... Args>
void launch_kernel_smem(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                        cudaStream_t stream, bool programmatic, Args&&... args) {
  launch_kernel_cluster(kernel, grid, block, smem, 0, stream, programmatic,
                        std::forward<Args>(args)...);
}
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                   bool programmatic, Args&&... args) {
  launch_kernel_smem(kernel, grid, block, 0, stream, programmatic, std::forward<Args>(args)...);
}

// launch_kernel with the attribute when pdl_enabled() and stream is not the legacy default
// stream (load-time kernels launch plainly).
template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                Args&&... args) {
  launch_kernel(kernel, grid, block, stream, pdl_enabled() && stream != nullptr,
                std::forward<Args>(args)...);
}

}  // namespace kvq::cuda
