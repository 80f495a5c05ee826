// The backends built into this binary (private to src/attention). Each backend is a
// function-local static, so the registry has no global mutable state and no
// static-initialization-order dependence.
#pragma once

#include <string>
#include <vector>

#include "kvq/attention/backend.h"

namespace kvq {

const AttentionBackend& cpu_reference_backend();
const AttentionBackend& cpu_avx512_backend();
#ifdef KVQ_WITH_CUDA
// src/attention/cuda/cuda_decode_backend.cu (built only with KVQ_CUDA).
const AttentionBackend& cuda_decode_backend();
#endif

// "{64, 128, 256}" and friends, for reasons and the support matrix.
std::string format_int_set(const std::vector<int>& values);
// The (K, V) whitelist in short form: "K x V in {a, b} x {a, b}" when it is a full
// product of its K and V dtypes, else the list of pairs.
std::string format_dtype_pairs(const std::vector<std::pair<KvDtype, KvDtype>>& pairs);
std::string format_attention_kinds(const std::vector<AttentionKind>& kinds);

}  // namespace kvq
