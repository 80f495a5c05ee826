// Internal interface of the cpu_avx512 backend: the driver (cpu_avx512.cc, compiled for
// generic x86-64) splits a batch into work items and calls one ISA-specific function per
// item. The AVX-512 item function lives in kernel_avx512.cc behind a target pragma; it only
// sees the plain structs below (raw pointers, no std templates), so no code compiled for
// AVX-512 can leak into generic code through a shared template instantiation.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvq/attention/backend.h"
#include "kvq/core/kv_dtype.h"

namespace kvq::cpu_attn {

// A work item walks its kv tokens in tiles of kTile (block sizes are multiples), grouped in
// chunks of kChunkTiles tiles that are dequantized together.
inline constexpr int kTile = 16;
inline constexpr int kChunkTiles = 2;
inline constexpr int kChunk = kTile * kChunkTiles;

// Rows [0, n) of a tile of one side: row i's values at values + i * row_data_bytes,
// its per-row metadata at scales + i * row_scale_bytes.
struct TileSource {
  const std::byte* values = nullptr;
  const std::byte* scales = nullptr;
  size_t row_data_bytes = 0;
  size_t row_scale_bytes = 0;
  int dim = 0;
  float tensor_scale = 1.0f;
  KvDtype dtype = KvDtype::kFloat32;
};
// Decodes n rows to out[n][dim] floats (rotated space for rotated dtypes).
using DecodeTileFn = void (*)(const TileSource& src, int n, float* out);

// The generic decoder (reference codecs, row by row); works for every dtype.
void decode_tile_generic(const TileSource& src, int n, float* out);

struct Side {
  const std::byte* base = nullptr;  // the side's cache storage (block 0)
  size_t block_bytes = 0;
  size_t value_offset = 0;  // of row 0 of this kv head within a block
  size_t scale_offset = 0;
  size_t row_data_bytes = 0;
  size_t row_scale_bytes = 0;
  int dim = 0;
  float tensor_scale = 1.0f;
  KvDtype dtype = KvDtype::kFloat32;
  DecodeTileFn decode = nullptr;
  // A factor `decode` leaves out of every value (an unscaled fp8 decoder, below), applied by
  // the kernel after the products: K's logits, V's accumulated output. 1 for every other
  // decoder.
  float post_scale = 1.0f;
};

// fp8_e4m3 / fp8_e5m2 (one scale per tensor or kv head): decoders that leave the scale out,
// the kernel applying it once per logit and once per output row instead of once per value.
// e4m3's raw value is its magnitude bits placed in an fp16 (the value / 256, exact for normal
// and subnormal codes alike); e5m2's is the fp16 whose top byte it is. NaN codes give NaN.
// raw * unscaled_factor(dtype, scale) is the reference decode bit for bit; the factor is 0
// where it is not a normal float (256 * scale overflowing, a zero scale): the scaled decoder
// runs then.
float unscaled_factor(KvDtype dtype, float tensor_scale);
// Whether the backend takes fp8 K/V through the unscaled decoders: yes unless
// KVQ_CPU_FP8_SCALE_AFTER=0 (read once; A/B measurements).
bool default_fp8_scale_after();

// Q·K for integer-coded K (int8_per_token_head, int4_per_token_head): either K is decoded to
// fp32 like every other dtype (kFloat), or each query is quantized to int8 once per work item
// and the logits are integer dot products with the codes, scaled after the dot:
//   int8: logit = s_q * S * sum(qq_i * c_i),  s_q = max|q| / 127;
//   int4: logit = S * (s_q * sum(qq_i * c_i) + centre) + Z * sum(q_i)  (QuantizedQ).
// kVnni: vpdpbusd (AVX512-VNNI in the AVX-512 kernel, AVX-VNNI in the AVX2 one); kMaddubs:
// vpmaddubsw + vpmaddwd (AVX-512BW / AVX2), for CPUs without VNNI.
enum class KDot { kFloat, kVnni, kMaddubs };
const char* k_dot_name(KDot k_dot);
inline bool integer_k(KvDtype k) {
  return k == KvDtype::kInt8PerTokenHead || k == KvDtype::kInt4PerTokenHead;
}

struct WorkItem;
// Raw logits (before any soft cap) of queries [qi0, qi0 + nq) of the item against the 16 rows
// of one K tile: out[i * kChunk + t] (a row of WorkItem::logits per query). A tile never
// crosses a block, so all 16 rows are in the cache's storage; rows past the sequence's end
// give garbage logits, which the caller masks.
using KLogitsFn = void (*)(const TileSource& k, const WorkItem& item, int qi0, int nq, float* out);

// The int8 codes of the queries (KLogitsFn's input), prepared once per work item.
// qq[qi * dim_k ...]: round(q / s_q) in [-127, 127]. For int8 K in element order; for int4 K,
// per 64 elements, the 32 even elements then the 32 odd ones (the low and high nibbles of 32
// code bytes). scale[qi] = s_q, sum[qi] = sum of the fp32 q (int4's zero-point term),
// qq_sum[qi] = sum of qq (int8's correction for the unsigned operand c + 128).
// centre[qi] = 7.5 * (sum(q) - s_q * sum(qq)), for int4: with q = s_q qq + e, the logit's
// sum(q_i c_i) = s_q sum(qq_i c_i) + 7.5 sum(e_i) + sum(e_i (c_i - 7.5)); the kernel adds
// the middle term back, so what quantizing q loses is sum(e_i (c_i - 7.5)), |c_i - 7.5| <= 7.5,
// instead of sum(e_i c_i) with c_i up to 15 (about 3x less on typical rows).
struct QuantizedQ {
  const int8_t* qq = nullptr;
  const float* scale = nullptr;
  const float* sum = nullptr;
  const int32_t* qq_sum = nullptr;
  const float* centre = nullptr;
};

// One (sequence, kv head, range of query positions) unit of work. Query (j, r) is
// position j of the range and head r of the GQA group; its prepared vector (rotated if K is,
// softmax scale folded in) is q[(j * ratio + r) * dim_k], its output row is
// out + j * out_pos_stride + r * dim_v (in the rotated space if V is rotated: the driver
// un-rotates). Query position j sees kv tokens [lo[j], hi[j]).
struct WorkItem {
  const float* q = nullptr;
  int num_pos = 0;
  int ratio = 0;
  const int* lo = nullptr;
  const int* hi = nullptr;
  const int32_t* blocks = nullptr;  // the sequence's block ids
  int block_tokens = 0;
  Side k, v;
  float soft_cap = 0.0f;
  // Integer Q·K (nullptr: fp32, K decoded into k_tile): k_logits and the quantized queries.
  KLogitsFn k_logits = nullptr;
  QuantizedQ qq;
  // true: write out = acc / l. false: leave acc, m, l unnormalized (one piece of a split kv
  // range; the driver merges the pieces).
  bool normalize = true;
  float* out = nullptr;
  size_t out_pos_stride = 0;
  // Scratch owned by the calling thread: acc[num_pos * ratio][dim_v], m and l
  // [num_pos * ratio], k_tile[kChunk][dim_k], v_tile[kChunk][dim_v], p[2 * kChunk],
  // logits[ratio][kChunk] (integer Q·K only).
  float* acc = nullptr;
  float* m = nullptr;
  float* l = nullptr;
  float* k_tile = nullptr;
  float* v_tile = nullptr;
  float* p = nullptr;
  float* logits = nullptr;
};

void run_item_portable(const WorkItem& item);

// AVX-512 (F, BW, VL). Only call when cpu_has_avx512().
void run_item_avx512(const WorkItem& item);
// The AVX-512 decoder for rows of `dim` values of `dtype`, or nullptr where the generic one
// must be used.
DecodeTileFn avx512_decoder(KvDtype dtype, int dim);
// The unscaled fp8 decoder (see unscaled_factor), or nullptr for other dtypes.
DecodeTileFn avx512_unscaled_decoder(KvDtype dtype, int dim);

bool cpu_has_avx512();
// AVX512-VNNI on top of cpu_has_avx512().
bool cpu_has_avx512_vnni();
// The AVX-512 integer Q·K for K rows of `dim` values of `dtype` (int8/int4_per_token_head)
// with `k_dot` (kVnni: only when cpu_has_avx512_vnni()), or nullptr.
KLogitsFn avx512_k_logits(KDot k_dot, KvDtype dtype, int dim);

// AVX2 + FMA + F16C (kernel_avx2.cc). Only call when cpu_has_avx2().
void run_item_avx2(const WorkItem& item);
// The AVX2 decoder for rows of `dim` values of `dtype`, or nullptr (the generic one runs).
DecodeTileFn avx2_decoder(KvDtype dtype, int dim);
DecodeTileFn avx2_unscaled_decoder(KvDtype dtype, int dim);

bool cpu_has_avx2();
// AVX-VNNI (the VEX-coded vpdpbusd) on top of cpu_has_avx2().
bool cpu_has_avx_vnni();
// The AVX2 integer Q·K (kVnni: only when cpu_has_avx_vnni()), or nullptr.
KLogitsFn avx2_k_logits(KDot k_dot, KvDtype dtype, int dim);

enum class Isa { kPortable, kAvx2, kAvx512 };
// The best kernel this CPU runs.
Isa best_isa();
const char* isa_name(Isa isa);
// Whether `isa`'s kernel on this CPU can compute Q·K with `k_dot` (kFloat: always; the
// portable kernel has only kFloat).
bool k_dot_supported(Isa isa, KDot k_dot);
// What the backend runs for K dtype `k` with kernel `isa`: an integer Q·K where the dtype has
// codes, the kernel has one and KVQ_CPU_INT_DOT (read once) is not 0 (`maddubs`: kMaddubs even
// where VNNI exists, for A/B); kFloat otherwise.
KDot default_k_dot(Isa isa, KvDtype k);
// The whole backend minus the argument checks of AttentionBackend::run (tests call it with
// every Isa the machine supports, kPortable included, to cover each kernel). `k_dot` applies to
// int8/int4_per_token_head K (other dtypes always decode to fp32) and must be supported by
// `isa`. Units of work whose kv range is long are split until there are about `min_tasks` tasks
// (0: twice the OpenMP threads). `fp8_scale_after`: fp8_e4m3/e5m2 K and V through the
// unscaled decoders (AVX-512 and AVX2 kernels; the portable one always scales as it decodes).
void run_tiled(const LayerKvSpec& spec, const AttentionArgs& args, Isa isa, KDot k_dot,
               int min_tasks = 0, bool fp8_scale_after = true);

}  // namespace kvq::cpu_attn
