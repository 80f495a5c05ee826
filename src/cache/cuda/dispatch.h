// Runtime -> compile-time dispatch for the CUDA launchers: one switch over the KV dtypes and
// one over the head dims, shared by the cache-write and attention launchers so each launcher
// is a single templated call instead of a repeated launch/check block per case.
#pragma once

#include <type_traits>

#include "kvq/core/kv_dtype.h"

namespace kvq::cuda {

template <KvDtype D>
using KvDtypeConst = std::integral_constant<KvDtype, D>;

// Calls f(KvDtypeConst<d>{}) for a concrete dtype; returns false (nothing called) for kAuto.
template <class F>
bool with_kv_dtype(KvDtype d, F&& f) {
  switch (d) {
    case KvDtype::kFloat16:
      return f(KvDtypeConst<KvDtype::kFloat16>{}), true;
    case KvDtype::kBFloat16:
      return f(KvDtypeConst<KvDtype::kBFloat16>{}), true;
    case KvDtype::kFloat32:
      return f(KvDtypeConst<KvDtype::kFloat32>{}), true;
    case KvDtype::kFp8E4M3:
      return f(KvDtypeConst<KvDtype::kFp8E4M3>{}), true;
    case KvDtype::kFp8E5M2:
      return f(KvDtypeConst<KvDtype::kFp8E5M2>{}), true;
    case KvDtype::kInt8PerTokenHead:
      return f(KvDtypeConst<KvDtype::kInt8PerTokenHead>{}), true;
    case KvDtype::kFp8PerTokenHead:
      return f(KvDtypeConst<KvDtype::kFp8PerTokenHead>{}), true;
    case KvDtype::kInt4PerTokenHead:
      return f(KvDtypeConst<KvDtype::kInt4PerTokenHead>{}), true;
    case KvDtype::kNvfp4:
      return f(KvDtypeConst<KvDtype::kNvfp4>{}), true;
    case KvDtype::kAuto:
      break;
  }
  return false;
}

// Calls f(std::integral_constant<int, hd>{}) for head_dim 64, 128 or 256; false otherwise.
template <class F>
bool with_head_dim(int hd, F&& f) {
  switch (hd) {
    case 64:
      return f(std::integral_constant<int, 64>{}), true;
    case 128:
      return f(std::integral_constant<int, 128>{}), true;
    case 256:
      return f(std::integral_constant<int, 256>{}), true;
    default:
      return false;
  }
}

}  // namespace kvq::cuda
