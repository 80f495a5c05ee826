// What every attention backend built into this binary accepts, for `kvq backends`.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace kvq {

// {"backends": [{"name", "device", "priority", "kv_dtype_pairs": [[K, V], ...],
//   "head_dims", "block_tokens", "gqa_ratios" (arrays; "any" when unrestricted),
//   "attention_kinds", "logit_soft_cap", "notes"}, ...]}, in priority order.
nlohmann::json attention_support_matrix_json();

// The same as text, a few lines per backend, for a terminal.
std::vector<std::string> attention_support_matrix_lines();

// Reads the attention kernels' A/B switches (KVQ_CPU_ISA, KVQ_CPU_INT_DOT, KVQ_CPU_FP8_SCALE_AFTER
// and, in a CUDA build, KVQ_PREFILL_KERNEL): an InputError for a value they do not take. The
// command line calls it first, so a typo fails before any work.
void check_cpu_kernel_env();

}  // namespace kvq
