// kvq's skinny GEMM (bf16, or e4m3 with row and column scales) for decode-sized products (issue
// #14, batch-1 steps at the weight floor): out[m][n] (fp32, row stride ldc) = in[m][k] (bf16, row
// stride lda) * w[n][k]^T
// (+ beta * out), for m <= kGemvMaxRows input rows (a batch-1 step, a verification step of up
// to 16 tokens).
//
// Such a product reads the whole weight once and does a few FLOPs per byte, so its time is the
// weight bytes over HBM bandwidth, and cuBLASLt's kernels for these shapes leave 6-33% of the
// bandwidth unused (docs/notes/decode-tuning.md). This kernel streams each weight row once:
// a block owns 16 output features, its 4 or 8 warps split k; each lane loads 16 bytes of two weight
// rows and of its input row per step and feeds them to two m16n8k16 tensor-core MMAs (the k
// positions of a fragment are permuted consistently for W and x, so a lane's contiguous 16
// bytes are its fragment); the warps' partial sums are added in a fixed order (deterministic).
// Launched with programmatic dependent launch: the first weight loads are issued before
// waiting for the kernel that writes `in`.
//
// GemmTuner times it beside cuBLASLt's candidates and keeps whichever is faster per shape.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace kvq::cuda_model {

inline constexpr int kGemvMaxRows = 16;

// Whether gemv_bf16 takes these operands: 1 <= m <= kGemvMaxRows, n >= 1, k a positive
// multiple of 8, lda a multiple of 8 (>= k), ldc >= n, `in` and `w` 16-byte aligned, `out`
// 4-byte aligned.
bool gemv_bf16_fits(int m, int n, int k, const void* in, int lda, const void* w, const float* out,
                    int ldc);

// The variants, named by their warps per block; GemmTuner times each. 4 and 8: the warps split k
// and load their weight fragments into registers (a block per 16 output features). kGemvRing
// (9): 8 such warps fed by a producer warp that streams the weight rows into a shared-memory
// ring by bulk copies (TMA), a block per SM looping over the tiles (docs/notes/
// decode-tuning.md version 19; the tuner times it for steps of up to KVQ_GEMV_RING rows).
inline constexpr int kGemvRing = 9;
inline constexpr int kGemvWarps[] = {4, 8, kGemvRing};
// Whether variant `warps` takes m rows of k values (bf16, or e4m3 for fp8): 4 and 8 take every
// shape the *_fits checks accept; kGemvRing keeps the m input rows in shared memory beside a
// ring of at least two 66 KB stages (bf16 rows of k up to 45k for 1 row, 11k for 4, 5.6k for 8,
// 2.5k for 16; e4m3 rows twice as long).
bool gemv_variant_fits(int warps, int m, int k, bool fp8);
// KVQ_GEMV_RING_PDL: how a ring launch overlaps the kernel before it: serial (0: no
// programmatic dependent launch), wait (1, default: launched early, its producer waits for that
// kernel before streaming), prefetch (2: launched early, streaming at once). InputError for
// another value (A/B; docs/notes/decode-tuning.md version 19).
int gemv_ring_pdl_from_env();

// The product above on `stream` (operands as gemv_bf16_fits requires, `warps` one of
// kGemvWarps; checked). With beta 0, `out` is written without being read (it may hold anything).
void gemv_bf16(int m, int n, int k, const void* in, int lda, const void* w, float* out, int ldc,
               float beta, cudaStream_t stream, int warps = 4);

// The FP8 path's product (model/cuda/linear.h): out[i][j] = in_scale[i] * w_scale[j] *
// sum_c in[i][c] * w[j][c] (+ beta * out), e4m3 codes in and w (rows of k bytes; k and lda
// multiples of 16), one fp32 scale per input row and per weight row, the scales applied with
// fp8_scale_product's arithmetic; m16n8k32 MMAs, otherwise as gemv_bf16.
bool gemv_fp8_fits(int m, int n, int k, const void* in, int lda, const void* w, const float* out,
                   int ldc);
void gemv_fp8(int m, int n, int k, const void* in, const float* in_scale, int lda, const void* w,
              const float* w_scale, float* out, int ldc, float beta, cudaStream_t stream,
              int warps = 4);

// W8A16: the FP8 path's weights (e4m3 codes [n][k], one fp32 dequantization scale per row) times
// bf16 input rows, with no input quantization: out[i][j] = w_scale[j] * sum_c in[i][c] * w[j][c]
// (+ beta * out). Each code is converted to bf16 in registers (exactly: every e4m3 value is a
// bf16 value) and fed to bf16 MMAs with fp32 accumulation (a warp step is 64 columns, as for
// gemv_fp8), the sum then multiplied by the row's scale (fp32, rounded once). Decode-sized FP8
// steps take it instead of quantizing their activations (docs/notes/decode-tuning.md version
// 21). k a multiple of 16 (16-byte rows of codes), lda a multiple of 8; otherwise as
// gemv_bf16_fits.
bool gemv_w8a16_fits(int m, int n, int k, const void* in, int lda, const void* w, const float* out,
                     int ldc);
void gemv_w8a16(int m, int n, int k, const void* in, int lda, const void* w, const float* w_scale,
                float* out, int ldc, float beta, cudaStream_t stream, int warps = 4);

// The MLP's gate|up product and its SiLU-mul in one kernel: out[i][f] (row stride ldo, bf16 or
// fp32) = silu(g) * u, where g and u are features f and n + f of in[m][k] * w_gate_up[2 n][k]^T
// (gate rows first; no bias, no scales), each summed exactly as gemv_bf16 sums it, with
// silu_mul's arithmetic: the bits of gemv_bf16 followed by cuda_model::silu_mul, one launch
// and no fp32 product in memory. The fits check is gemv_bf16's for the 2 n-row weight, with
// `out` 2-byte (bf16) or 4-byte aligned.
bool gemv_bf16_silu_mul_fits(int m, int n, int k, const void* in, int lda, const void* w_gate_up,
                             const void* out, int ldo, bool out_bf16);
void gemv_bf16_silu_mul(int m, int n, int k, const void* in, int lda, const void* w_gate_up,
                        void* out, int ldo, bool out_bf16, cudaStream_t stream, int warps = 4);

// The RMSNorm that feeds a product, inside it (one launch less per norm; docs/notes/
// decode-tuning.md version 16): the input rows are x's rows (fp32, row stride ldx) normalized
// with rms_norm_rows' arithmetic (weight w, eps) and rounded to bf16, the bits rms_norm_rows
// writes for a bf16 model; every block normalizes its own copy into shared memory after the
// wait for the kernel that writes x. Rows 1..kGemvNormMaxRows; k a multiple of 8; x and w
// 16-byte aligned, ldx a multiple of 4; m x (k + 32) x 2 bytes of shared memory at most
// kGemvNormMaxSmem (with the kernel's static arrays, within the default 48 KiB per block: 4
// rows of k 4096, 2 of k 8192).
struct GemvNorm {
  const float* x = nullptr;
  int ldx = 0;
  const float* w = nullptr;
  float eps = 0.0f;
};
inline constexpr int kGemvNormMaxRows = 4;
inline constexpr size_t kGemvNormMaxSmem = 40u * 1024;
bool gemv_norm_fits(int m, int k, const GemvNorm& norm);
// gemv_bf16 / gemv_bf16_silu_mul of the normalized rows (their other operands as there).
void gemv_bf16_norm(int m, int n, int k, const GemvNorm& norm, const void* w, float* out, int ldc,
                    float beta, cudaStream_t stream, int warps = 4);
void gemv_bf16_silu_mul_norm(int m, int n, int k, const GemvNorm& norm, const void* w_gate_up,
                             void* out, int ldo, bool out_bf16, cudaStream_t stream, int warps = 4);

// The same three fusions for W8A16 (e4m3 weights with their row scales, as gemv_w8a16): gate
// and up are each scaled by their weight row's scale before the SiLU-mul. The fits checks are
// the bf16 ones with k a multiple of 16.
bool gemv_w8a16_silu_mul_fits(int m, int n, int k, const void* in, int lda, const void* w_gate_up,
                              const void* out, int ldo, bool out_bf16);
void gemv_w8a16_silu_mul(int m, int n, int k, const void* in, int lda, const void* w_gate_up,
                         const float* w_scale, void* out, int ldo, bool out_bf16,
                         cudaStream_t stream, int warps = 4);
void gemv_w8a16_norm(int m, int n, int k, const GemvNorm& norm, const void* w, const float* w_scale,
                     float* out, int ldc, float beta, cudaStream_t stream, int warps = 4);
void gemv_w8a16_silu_mul_norm(int m, int n, int k, const GemvNorm& norm, const void* w_gate_up,
                              const float* w_scale, void* out, int ldo, bool out_bf16,
                              cudaStream_t stream, int warps = 4);

}  // namespace kvq::cuda_model
