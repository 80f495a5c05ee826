// The (K, V) dtype pairs the CUDA attention kernels (decode and prefill) are built for: every
// K == V pair, plus a short list of mixed pairs. Each pair is one kernel instantiation per
// head dim, so the list is kept short on purpose; a pair outside it runs on the generic
// kernel (cuda_generic.h), which decodes each side by its run-time dtype. The mixed pairs are the
// ones users ask for: a higher-precision K (logits are more sensitive to K error than outputs are
// to V error) over a compact V, and a quantized K over a 16-bit V.
#pragma once

#include <array>
#include <cstddef>
#include <iterator>
#include <utility>

#include "cache/cuda/dispatch.h"
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

// Every pair the kernels are built for: K == V for each concrete dtype, then the mixed pairs.
inline constexpr size_t kCudaNumKvPairs = [] {
  size_t n = std::size(kCudaMixedKvPairs);
  for (const auto& t : kKvDtypeTraits)
    if (t.concrete) ++n;
  return n;
}();
inline constexpr std::array<std::pair<KvDtype, KvDtype>, kCudaNumKvPairs> kCudaKvPairs = [] {
  std::array<std::pair<KvDtype, KvDtype>, kCudaNumKvPairs> a{};
  size_t n = 0;
  for (const auto& t : kKvDtypeTraits)
    if (t.concrete) a[n++] = {t.dtype, t.dtype};
  for (const auto& pr : kCudaMixedKvPairs) a[n++] = pr;
  return a;
}();

namespace detail {
template <class F, size_t... I>
bool with_cuda_kv_pair(KvDtype k, KvDtype v, F& f, std::index_sequence<I...>) {
  return ((k == kCudaKvPairs[I].first && v == kCudaKvPairs[I].second
               ? (f(KvDtypeConst<kCudaKvPairs[I].first>{}, KvDtypeConst<kCudaKvPairs[I].second>{}),
                  true)
               : false) ||
          ...);
}
}  // namespace detail

// Calls f(KvDtypeConst<k>{}, KvDtypeConst<v>{}) for a pair of kCudaKvPairs; false (nothing
// called) for any other pair. The one runtime -> compile-time switch of the attention launchers.
template <class F>
bool with_cuda_kv_pair(KvDtype k, KvDtype v, F&& f) {
  return detail::with_cuda_kv_pair(k, v, f, std::make_index_sequence<kCudaNumKvPairs>{});
}

}  // namespace kvq::cuda
