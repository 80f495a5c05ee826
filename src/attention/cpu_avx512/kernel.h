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
  // true: write out = acc / l. false: leave acc, m, l unnormalized (one piece of a split kv
  // range; the driver merges the pieces).
  bool normalize = true;
  float* out = nullptr;
  size_t out_pos_stride = 0;
  // Scratch owned by the calling thread: acc[num_pos * ratio][dim_v], m and l
  // [num_pos * ratio], k_tile[kChunk][dim_k], v_tile[kChunk][dim_v], p[2 * kChunk].
  float* acc = nullptr;
  float* m = nullptr;
  float* l = nullptr;
  float* k_tile = nullptr;
  float* v_tile = nullptr;
  float* p = nullptr;
};

void run_item_portable(const WorkItem& item);

// AVX-512 (F, BW, VL). Only call when cpu_has_avx512().
void run_item_avx512(const WorkItem& item);
// The AVX-512 decoder for rows of `dim` values of `dtype`, or nullptr where the generic one
// must be used.
DecodeTileFn avx512_decoder(KvDtype dtype, int dim);

bool cpu_has_avx512();

// AVX2 + FMA + F16C (kernel_avx2.cc). Only call when cpu_has_avx2().
void run_item_avx2(const WorkItem& item);
// The AVX2 decoder for rows of `dim` values of `dtype`, or nullptr (the generic one runs).
DecodeTileFn avx2_decoder(KvDtype dtype, int dim);

bool cpu_has_avx2();

enum class Isa { kPortable, kAvx2, kAvx512 };
// The best kernel this CPU runs.
Isa best_isa();
const char* isa_name(Isa isa);
// The whole backend minus the argument checks of AttentionBackend::run (tests call it with
// every Isa the machine supports, kPortable included, to cover each kernel). Units of work whose kv
// range is long are split until there are about `min_tasks` tasks (0: twice the OpenMP threads).
void run_tiled(const LayerKvSpec& spec, const AttentionArgs& args, Isa isa, int min_tasks = 0);

}  // namespace kvq::cpu_attn
