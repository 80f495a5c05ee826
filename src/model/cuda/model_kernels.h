// The CUDA model's elementwise and row kernels (everything but the GEMMs and attention).
// Activations that feed a GEMM are written in the GEMM's input precision (`bf16` true:
// __nv_bfloat16, else fp32); the residual stream and every GEMM output stay fp32.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvq::cuda_model {

// x[t][:] = embed[tokens[t]][:] as fp32; a negative token (kMaskToken) takes the fp32 row
// `mask` (a DFlash drafter's mask embedding; callers admit negative ids only with one).
void embed_gather(const void* embed, bool bf16, const float* mask, const int32_t* tokens, int T,
                  int H, float* x, cudaStream_t stream);

// out[i][:] = rms_norm(x[rows ? rows[i] : i][:]) * w, n rows of H (sum of squares in fp64,
// like the CPU path), written as bf16 or fp32.
void rms_norm_rows(const float* x, const int32_t* rows, int n, int H, const float* w, float eps,
                   void* out, bool bf16, cudaStream_t stream);

// A product still to be added to the residual stream: add[r][:] (row stride H), times
// row_scale[r] x col_scale[:] when col_scale is set (an FP8 product whose scales were deferred).
struct ResidualAdd {
  const float* add = nullptr;
  const float* row_scale = nullptr;
  const float* col_scale = nullptr;
};
// x[i][:] += the residual add (in place), then rms_norm_rows of the new rows: the bits of
// fp8_scale_product (beta 1) followed by rms_norm_rows, in one kernel.
void add_rms_norm_rows(float* x, const ResidualAdd& ra, int n, int H, const float* w, float eps,
                       void* out, bool bf16, cudaStream_t stream);

// cs[t][f] = (cos, sin)(positions[t] * inv_freq[f]) in fp64, stored fp32 (the CPU's table).
void rope_table(const int32_t* positions, int T, const double* inv_freq, int half, float* cs,
                cudaStream_t stream);

// From the fused projections qkv [T][(nq + 2 nkv) d]: adds `bias` (nullable), RMSNorms each
// q / k head (q_norm / k_norm nullable), applies RoPE from `cs`, and writes q [T][nq][d],
// k [T][nkv][d], v [T][nkv][d]. With row_scale (T) and col_scale ((nq + 2 nkv) d) set, qkv is
// an FP8 product whose scales were deferred to here (fp8_scale_product's arithmetic).
void qkv_post(const float* qkv, const float* bias, const float* q_norm, const float* k_norm,
              const float* cs, int T, int nq, int nkv, int d, float eps, float* q, float* k,
              float* v, cudaStream_t stream, const float* row_scale = nullptr,
              const float* col_scale = nullptr);

// x[t][:] += bias, T rows of n.
void add_bias_rows(float* x, const float* bias, int T, int n, cudaStream_t stream);

// out[t][i] = silu(gate + bg) * (up + bu) from gu [T][2I] (gate columns first); bias nullable;
// row_scale (T) / col_scale (2I): deferred FP8 scales of gu, as in qkv_post.
void silu_mul(const float* gu, const float* bias, int T, int I, void* out, bool bf16,
              cudaStream_t stream, const float* row_scale = nullptr,
              const float* col_scale = nullptr);

// out[i][:] = src[rows[i]][:] for i < n, rows of F floats.
void gather_rows(const float* src, const int32_t* rows, int n, int F, float* out,
                 cudaStream_t stream);

// Brings [p, p + bytes) into L2 (cp.async.bulk.prefetch.L2 from `warps` one-warp blocks); a
// hint: it writes nothing. p must be 16-byte aligned; bytes is rounded down to 16.
void l2_prefetch(const void* p, size_t bytes, int warps, cudaStream_t stream);

// out = bf16(in), n elements.
void to_bf16(const float* in, int64_t n, void* out, cudaStream_t stream);

// Synthetic weights: w[i] = scale * u(seed, i), u uniform with unit variance, as bf16.
void fill_random_bf16(void* w, int64_t n, uint64_t seed, float scale, cudaStream_t stream);
void fill_f32(float* w, int64_t n, float value, cudaStream_t stream);

// FP8 (e4m3) rows for the FP8 GEMMs: codes[r][c] = e4m3(x[r][c] / scale[r]) (round to nearest
// even, saturating at 448: the reference codec's rounding), rows of `cols` values `ldx` apart
// in x (bf16 or fp32), packed in codes. The scale of row r:
//   kDynamic: max |x[r][:]| / 448 (1 for an all-zero row), written to scale[r];
//   kStatic:  scale_in[0] for every row, written to scale[r];
//   kGiven:   scale[r] as it is (read, not written).
// A row whose given or static scale is not positive gets codes 0.
enum class Fp8Scale : uint8_t { kDynamic, kStatic, kGiven };
// `held`: 1 each thread holds its share of the row in registers (one memory round trip; up to 8
// values or 16-byte chunks a thread), 0 the kernels that re-read the row per pass, -1 the default
// (KVQ_FP8_HELD=0: 0, else 1). The same codes and scales either way.
void quantize_rows_fp8(const void* x, bool bf16, int rows, int cols, int64_t ldx, Fp8Scale mode,
                       const float* scale_in, uint8_t* codes, float* scale, cudaStream_t stream,
                       int held = -1);

// The producers of an FP8 projection's input with the quantization fused in: each is the same
// codes and scales, bit for bit, as its bf16-output kernel followed by quantize_rows_fp8 (one
// block per row; docs/notes/fp8-gemm.md).
//   rms_norm_rows_fp8:        rms_norm_rows (n rows of H, contiguous), or add_rms_norm_rows
//                             when `ra` holds a residual add (x updated in place)
//   quantize_rows_fp8_rounded: to_bf16 of fp32 rows (ldx apart)
void rms_norm_rows_fp8(float* x, int n, int H, const float* w, float eps, Fp8Scale mode,
                       const float* scale_in, uint8_t* codes, float* scale, cudaStream_t stream,
                       const ResidualAdd& ra = {}, int held = -1);
void quantize_rows_fp8_rounded(const float* x, int rows, int cols, int64_t ldx, Fp8Scale mode,
                               const float* scale_in, uint8_t* codes, float* scale,
                               cudaStream_t stream, int held = -1);

// The scales of an FP8 GEMM run with unit scales (gemm_tuner.h, Fp8Scaling::kEpilogue):
// out[i][j] = raw[i][j] * row_scale[i] * col_scale[j] (+ beta * out[i][j]), row stride ld for
// both; raw may be out (beta 0).
void fp8_scale_product(const float* raw, int m, int n, int ld, const float* row_scale,
                       const float* col_scale, float beta, float* out, cudaStream_t stream);

// out[r][p * vs + c] = parts[p][r][c]: n rows of `shards` column blocks of vs columns, gathered
// per shard (the vocabulary-parallel LM head's all-gather), as whole rows.
void interleave_shards(const float* parts, int shards, int n, int vs, float* out,
                       cudaStream_t stream);

// out[r] = argmax of logits row r (lowest id on ties).
void argmax_rows(const float* logits, int rows, int vocab, int32_t* out, cudaStream_t stream);

// tokens[dst[i]] = ids[rows[i]] for i < n: tokens that another model left on the device (a
// drafter's deferred drafts) into a step's staged tokens.
void scatter_tokens(const int32_t* ids, const int32_t* rows, const int32_t* dst, int n,
                    int32_t* tokens, cudaStream_t stream);

// The next pass of a greedy chain of one-token decode steps, in the step's staging on the
// device: for i < n, tokens[i] = ids[i], positions[i] += 1, seq_lens[i] += 1 and
// slots[i] = next_slots[i].
void advance_decode_step(const int32_t* ids, const int64_t* next_slots, int n, int32_t* tokens,
                         int32_t* positions, int32_t* seq_lens, int64_t* slots,
                         cudaStream_t stream);

}  // namespace kvq::cuda_model
