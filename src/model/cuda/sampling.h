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
// The kept set is a prefix of that order; the vocabulary is never sorted.
//   - 0 < top_k <= 512: one pass finds the max, one counts the candidates within 16 distances
//     below it (2^-6 .. 2^9; a second count inside the octave when the first holding k holds
//     more than 2048), one gathers them; they are sorted in shared memory and top-p / min-p
//     are applied there exactly. Flat rows (more than 2048 within the finest distance) fall
//     back to the radix select below.
//   - otherwise: radix select on the float's bits (3 passes of 11/11/10 bits) finds the top-k
//     cut; top-p is a second radix select weighted by exp(s - max) in 2^-42 fixed point (exact,
//     order-free sums, so the same (seed, step) gives the same token on every run).
//   - ties straddling a cut: 3 more passes (an id select), rare for real logits.
// The draw is a Gumbel-max over the kept set, argmax(s + G), G from a counter-based hash of
// (seed, step, token id): a row's token depends only on its logits and (seed, step), not on
// its position in the batch (two rows with equal logits and (seed, step) draw the same token).
// Measured on one H100, 256 rows x 151936 (156 MB of logits a pass), per call: greedy 63 us;
// temperature only 209 us; min_p 181 us; top_k 50 (+ top_p 0.9) 385 us; top_p 0.9 without
// top_k 601 us; top_k 2000 + top_p 0.9 + min_p 0.05 685 us.
// +inf logits are kept in the order but their probabilities are undefined (as on the CPU); the
// draw then picks the lowest-id +inf logit.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvq/model/cuda_model.h"

namespace kvq::cuda {

// Workspace sample_tokens uses (bytes: 8 per 2048 logits of each row), where greedy rows are
// reduced over many blocks (one 2048-logit slice each) before the row's block takes the best of
// its slices; without it (nullptr) one block reads the whole row. Callers allocate it once for
// the largest batch and pass it on every call.
size_t sampling_workspace_bytes(int rows, int vocab);

// out[r] = the token drawn from logits[r * vocab, (r + 1) * vocab) under params[r]. logits,
// params (one per row) and out are device memory; workspace (nullable) holds at least
// sampling_workspace_bytes(rows, vocab); nothing is allocated, nothing synchronizes.
// vocab must be in [1, 2^22]; parameters are assumed valid (sampling_param_errors).
void sample_tokens(const float* logits, int rows, int vocab, const DeviceSampling* params,
                   int32_t* out, void* workspace, cudaStream_t stream);

}  // namespace kvq::cuda
