// The launcher of the prefill kernels for one (K, V) pair (included only by the
// prefill_<k>[__<v>].cu files): the warpgroup-MMA kernel or the verification kernel where the
// plan chose it, else the mma.sync kernel in the block shape the plan chose.
#pragma once

#include "attention/cuda/prefill_kernel.cuh"
#include "attention/cuda/prefill_verify_kernel.cuh"
#include "attention/cuda/prefill_wgmma_kernel.cuh"

namespace kvq::cuda {

template <KvDtype DK, KvDtype DV>
void launch_prefill(const PrefillKernelParams& p, int head_dim, dim3 grid, cudaStream_t stream) {
  if (p.wgmma) {
    const bool launched = launch_prefill_wgmma<DK, DV>(p, head_dim, grid, stream);
    KVQ_CHECK(launched, "cuda prefill: the plan chose the wgmma kernel, not built for this layer");
    return;
  }
  if (p.rows_per_block == prefill_verify_rows()) {
    const bool launched = launch_prefill_verify<DK, DV>(p, head_dim, grid, stream);
    KVQ_CHECK(launched,
              "cuda prefill: the plan chose the verification kernel, not built for this layer");
    return;
  }
  switch (head_dim) {
    case 64:
      return prefill_detail::launch_hd<DK, DV, 64>(p, grid, stream);
    case 128:
      return prefill_detail::launch_hd<DK, DV, 128>(p, grid, stream);
    case 256:
      return prefill_detail::launch_hd<DK, DV, 256>(p, grid, stream);
    default:
      KVQ_CHECK(false,
                "cuda prefill: head_dim " + std::to_string(head_dim) + " not in {64, 128, 256}");
  }
}

}  // namespace kvq::cuda
