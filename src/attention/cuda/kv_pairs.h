// The (K, V) dtype pairs the CUDA attention kernels (decode and prefill) are built for: every
// K == V pair, plus a short list of mixed pairs. Each pair is one kernel instantiation per
// head dim, so the list is kept short on purpose; a pair outside it gets an honest reason in
// the selector and runs on a CPU backend. The mixed pairs are the ones users ask for: a
// higher-precision K (logits are more sensitive to K error than outputs are to V error) over
// a compact V, and a quantized K over a 16-bit V.
#pragma once

#include <utility>

#include "kvq/core/kv_dtype.h"

namespace kvq::cuda {

inline constexpr std::pair<KvDtype, KvDtype> kCudaMixedKvPairs[] = {
    {KvDtype::kBFloat16, KvDtype::kFp8E4M3},
    {KvDtype::kBFloat16, KvDtype::kInt8PerTokenHead},
    {KvDtype::kBFloat16, KvDtype::kInt4PerTokenHead},
    {KvDtype::kFp8E4M3, KvDtype::kBFloat16},
    {KvDtype::kInt8PerTokenHead, KvDtype::kBFloat16},
    {KvDtype::kInt4PerTokenHead, KvDtype::kBFloat16},
    {KvDtype::kFp8E4M3, KvDtype::kInt4PerTokenHead},
    {KvDtype::kInt8PerTokenHead, KvDtype::kInt4PerTokenHead},
    {KvDtype::kFp8PerTokenHead, KvDtype::kInt4PerTokenHead},
};

// True for K == V (any concrete dtype) and for the mixed pairs above.
constexpr bool cuda_kv_pair_supported(KvDtype k, KvDtype v) {
  if (k == v) return k != KvDtype::kAuto;
  for (const auto& p : kCudaMixedKvPairs)
    if (p.first == k && p.second == v) return true;
  return false;
}

}  // namespace kvq::cuda
