// Next-token sampling on the device: one block per logit row, the CPU Sampler's rules
// (src/engine/sampler.cc) without a sort in the common cases.
//
// Per row (params[row]):
//   - temperature <= 0 (or NaN), or top_k == 1: greedy, one pass: the largest logit, lowest id on
//     ties; NaN logits never win; a row of only NaNs gives 0.
//   - otherwise s = logit / temperature; candidates in the CPU sampler's order (s descending,
//     lower id first on ties); keep the first top_k; then the shortest prefix whose softmax
//     mass (renormalized over the top-k) reaches top_p; then those with
//     p >= min_p * p(first); draw one from what is left, in proportion to exp(s).
// The kept set is a prefix of that order, found by radix select on the float's bits (3 passes
// of 11/11/10 bits; weighted by fixed-point exp(s - max) for top-p, so sums are exact and the
// result reproducible), never by sorting the vocabulary. The draw is a Gumbel-max over the kept
// set: argmax(s + G), G from a counter-based hash of (seed, step, token id), so a row's token
// depends only on its logits and (seed, step), not on its position in the batch.
// Passes over a row (each reads vocab floats; 256 x 152k fp32 is 156 MB a pass):
//   greedy 1; temperature only 1;
//   0 < top_k <= 512: 3 (select) + 1 (gather); top_p / min_p then cost nothing more: the k
//     candidates are ranked in shared memory;
//   top_k off or > 512: [3 select, when top_k is on] + [1 max, with top_p or min_p]
//     + [3 weighted select, with top_p] + 1 draw: at most 8 (top_k 2000 + top_p + min_p).
// Ties straddling a cut add 3 passes (an id select), rare for real logits.
// +inf logits are kept in the order but their probabilities are undefined (as on the CPU); the
// draw then picks the lowest-id +inf logit.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvq/model/cuda_model.h"

namespace kvq::cuda {

// Workspace sample_tokens needs (bytes; 0 today: everything lives in shared memory). Callers
// allocate it once for the largest batch and pass it on every call.
size_t sampling_workspace_bytes(int rows, int vocab);

// out[r] = the token drawn from logits[r * vocab, (r + 1) * vocab) under params[r]. logits,
// params (one per row) and out are device memory; nothing is allocated, nothing synchronizes.
// vocab must be in [1, 2^22]; parameters are assumed valid (sampling_param_errors).
void sample_tokens(const float* logits, int rows, int vocab, const DeviceSampling* params,
                   int32_t* out, void* workspace, cudaStream_t stream);

}  // namespace kvq::cuda
