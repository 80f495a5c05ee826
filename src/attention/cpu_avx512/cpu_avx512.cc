// cpu_avx512: paged attention on the CPU for decode and prefill. Work items are
// (sequence, kv head, up to kMaxQueries queries of the GQA group); OpenMP spreads them over
// cores. Each item walks its kv tokens in tiles of kTile rows: a tile of K and V is
// dequantized once into fp32 scratch (L1-resident) and shared by every query of the group,
// then each query updates an fp32 online softmax. The per-item kernel is AVX-512 when the
// CPU has it (kernel_avx512.cc) and portable C++ otherwise (below).
#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "attention/backends.h"
#include "attention/cpu_avx512/kernel.h"
#include "kvq/core/error.h"
#include "kvq/quant/codec.h"

namespace kvq {

namespace cpu_attn {

namespace {
// Queries (positions x heads of the group) per work item: bounds the per-thread scratch.
constexpr int kMaxQueries = 64;
}  // namespace

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return has;
}

void decode_tile_generic(const TileSource& src, int n, float* out) {
  for (int i = 0; i < n; ++i)
    quant::decode_row(
        src.dtype, src.values + static_cast<size_t>(i) * src.row_data_bytes,
        src.scales + static_cast<size_t>(i) * src.row_scale_bytes, src.tensor_scale,
        std::span<float>(out + static_cast<size_t>(i) * src.dim, static_cast<size_t>(src.dim)));
}

namespace {

TileSource tile_source(const Side& s, const WorkItem& item, int t0) {
  const int32_t block = item.blocks[t0 / item.block_tokens];
  const size_t in_block = static_cast<size_t>(t0 % item.block_tokens);
  const std::byte* b = s.base + static_cast<size_t>(block) * s.block_bytes;
  return {b + s.value_offset + in_block * s.row_data_bytes,
          b + s.scale_offset + in_block * s.row_scale_bytes,
          s.row_data_bytes,
          s.row_scale_bytes,
          s.dim,
          s.tensor_scale,
          s.dtype};
}

}  // namespace

// The same algorithm as run_item_avx512, in plain C++.
void run_item_portable(const WorkItem& item) {
  const int dk = item.k.dim, dv = item.v.dim;
  const int nq = item.num_pos * item.ratio;
  std::fill(item.acc, item.acc + static_cast<size_t>(nq) * dv, 0.0f);
  std::fill(item.m, item.m + nq, -std::numeric_limits<float>::infinity());
  std::fill(item.l, item.l + nq, 0.0f);

  int first = item.lo[0], last = item.hi[0];
  for (int j = 1; j < item.num_pos; ++j) {
    first = std::min(first, item.lo[j]);
    last = std::max(last, item.hi[j]);
  }
  for (int t0 = first - first % kTile; t0 < last; t0 += kTile) {
    const int n = std::min(kTile, last - t0);
    bool decoded = false;
    for (int j = 0; j < item.num_pos; ++j) {
      const int a = std::max(item.lo[j], t0) - t0, b = std::min(item.hi[j], t0 + n) - t0;
      if (a >= b) continue;  // this position sees nothing of the tile
      if (!decoded) {
        item.k.decode(tile_source(item.k, item, t0), n, item.k_tile);
        item.v.decode(tile_source(item.v, item, t0), n, item.v_tile);
        decoded = true;
      }
      for (int r = 0; r < item.ratio; ++r) {
        const int qi = j * item.ratio + r;
        const float* q = item.q + static_cast<size_t>(qi) * dk;
        float tile_max = -std::numeric_limits<float>::infinity();
        for (int t = a; t < b; ++t) {
          const float* k = item.k_tile + static_cast<size_t>(t) * dk;
          float dot = 0.0f;
          for (int d = 0; d < dk; ++d) dot += q[d] * k[d];
          if (item.soft_cap != 0.0f) dot = item.soft_cap * std::tanh(dot / item.soft_cap);
          item.p[t] = dot;
          tile_max = std::max(tile_max, dot);
        }
        const float m_new = std::max(item.m[qi], tile_max);
        const float corr = std::exp(item.m[qi] - m_new);  // 0 while m is -inf
        float* acc = item.acc + static_cast<size_t>(qi) * dv;
        float sum = 0.0f;
        for (int d = 0; d < dv; ++d) acc[d] *= corr;
        for (int t = a; t < b; ++t) {
          const float w = std::exp(item.p[t] - m_new);
          sum += w;
          const float* v = item.v_tile + static_cast<size_t>(t) * dv;
          for (int d = 0; d < dv; ++d) acc[d] += w * v[d];
        }
        item.l[qi] = item.l[qi] * corr + sum;
        item.m[qi] = m_new;
      }
    }
  }
  for (int j = 0; j < item.num_pos; ++j)
    for (int r = 0; r < item.ratio; ++r) {
      const int qi = j * item.ratio + r;
      const float inv = 1.0f / item.l[qi];
      float* o =
          item.out + static_cast<size_t>(j) * item.out_pos_stride + static_cast<size_t>(r) * dv;
      const float* acc = item.acc + static_cast<size_t>(qi) * dv;
      for (int d = 0; d < dv; ++d) o[d] = acc[d] * inv;
    }
}

void run_tiled(const LayerKvSpec& spec, const AttentionArgs& args, Isa isa) {
  const BlockTableView& bt = args.block_table;
  const int ratio = spec.gqa_ratio();
  const int dk = spec.head_dim_k, dv = spec.head_dim_v;
  const int pos_per_item = std::max(1, kMaxQueries / ratio);
  const bool k_rotated = traits(spec.k_dtype).rotated;
  const bool v_rotated = traits(spec.v_dtype).rotated;
  const bool avx512 = isa == Isa::kAvx512;
  KVQ_CHECK(bt.block_tokens % kTile == 0, "cpu_avx512 tiles need block_tokens % 16 == 0");
  for (int d : {dk, dv})
    KVQ_CHECK(!avx512 || d == 64 || d == 128 || d == 256,
              "the AVX-512 kernel has no instance for head_dim " + std::to_string(d));
  const auto run_item = avx512 ? run_item_avx512 : run_item_portable;
  auto decoder = [&](KvDtype d, int dim) {
    DecodeTileFn f = avx512 ? avx512_decoder(d, dim) : nullptr;
    return f ? f : decode_tile_generic;
  };
  const DecodeTileFn k_decode = decoder(spec.k_dtype, dk), v_decode = decoder(spec.v_dtype, dv);

  struct Unit {
    int seq, kv_head, first_pos, num_pos;
  };
  std::vector<Unit> units;
  for (int s = 0; s < bt.num_seqs; ++s) {
    const int q_len = args.q_indptr[s + 1] - args.q_indptr[s];
    for (int g = 0; g < spec.num_kv_heads; ++g)
      for (int j = 0; j < q_len; j += pos_per_item)
        units.push_back({s, g, j, std::min(pos_per_item, q_len - j)});
  }
  const int num_units = static_cast<int>(units.size());

#pragma omp parallel if (num_units > 1)
  {
    const size_t nq = static_cast<size_t>(pos_per_item) * ratio;
    std::vector<float> q(nq * dk), acc(nq * dv), m(nq), l(nq);
    std::vector<float> k_tile(static_cast<size_t>(kChunk) * dk, 0.0f);
    std::vector<float> v_tile(static_cast<size_t>(kChunk) * dv, 0.0f);
    std::vector<float> p(2 * kChunk);
    std::vector<int> lo(pos_per_item), hi(pos_per_item);

#pragma omp for schedule(dynamic, 1)
    for (int u = 0; u < num_units; ++u) {
      const Unit& unit = units[static_cast<size_t>(u)];
      const int kv_len = bt.seq_lens[unit.seq];
      const int q_begin = args.q_indptr[unit.seq];
      const int q_len = args.q_indptr[unit.seq + 1] - q_begin;
      for (int j = 0; j < unit.num_pos; ++j) {
        // Masks as documented in AttentionArgs: position p sees [lo, hi).
        const int pos = kv_len - q_len + unit.first_pos + j;
        lo[j] = spec.attention == AttentionKind::kSlidingWindow
                    ? std::max(0, pos - spec.sliding_window + 1)
                    : 0;
        hi[j] = spec.attention == AttentionKind::kNonCausal ? kv_len : pos + 1;
        for (int r = 0; r < ratio; ++r) {
          const float* src =
              args.q + (static_cast<size_t>(q_begin + unit.first_pos + j) * spec.num_q_heads +
                        static_cast<size_t>(unit.kv_head * ratio + r)) *
                           dk;
          std::span<float> dst(q.data() + static_cast<size_t>(j * ratio + r) * dk,
                               static_cast<size_t>(dk));
          std::copy(src, src + dk, dst.begin());
          if (k_rotated) quant::hadamard_rotate(dst);  // K rows are stored rotated
          for (float& x : dst) x *= args.softmax_scale;
        }
      }

      auto side = [&](KvSide s, DecodeTileFn decode) {
        const KvSideLayout& layout = args.cache.layout(s);
        Side out;
        out.base = args.cache.base(s);
        out.block_bytes = layout.block_bytes;
        out.value_offset = layout.value_offset(unit.kv_head, 0);
        out.scale_offset = layout.scale_offset(unit.kv_head, 0);
        out.row_data_bytes = layout.row_data_bytes;
        out.row_scale_bytes = layout.row_scale_bytes;
        out.dim = spec.head_dim(s);
        out.tensor_scale = spec.scale(s).for_head(unit.kv_head);
        out.dtype = spec.dtype(s);
        out.decode = decode;
        return out;
      };
      WorkItem item;
      item.q = q.data();
      item.num_pos = unit.num_pos;
      item.ratio = ratio;
      item.lo = lo.data();
      item.hi = hi.data();
      item.blocks = bt.indices + bt.indptr[unit.seq];
      item.block_tokens = bt.block_tokens;
      item.k = side(KvSide::kK, k_decode);
      item.v = side(KvSide::kV, v_decode);
      item.soft_cap = args.logit_soft_cap;
      item.out_pos_stride = static_cast<size_t>(spec.num_q_heads) * dv;
      item.out = args.out + static_cast<size_t>(q_begin + unit.first_pos) * item.out_pos_stride +
                 static_cast<size_t>(unit.kv_head * ratio) * dv;
      item.acc = acc.data();
      item.m = m.data();
      item.l = l.data();
      item.k_tile = k_tile.data();
      item.v_tile = v_tile.data();
      item.p = p.data();
      run_item(item);

      if (v_rotated)  // V rows are stored rotated: the weighted sum is too
        for (int j = 0; j < unit.num_pos; ++j)
          for (int r = 0; r < ratio; ++r)
            quant::hadamard_unrotate(
                std::span<float>(item.out + j * item.out_pos_stride + static_cast<size_t>(r) * dv,
                                 static_cast<size_t>(dv)));
    }
  }
}

}  // namespace cpu_attn

namespace {

class CpuAvx512Backend final : public AttentionBackend {
 public:
  CpuAvx512Backend() {
    caps_.device = Device::kCpu;
    caps_.priority = 10;
    for (const auto& k : kKvDtypeTraits)
      for (const auto& v : kKvDtypeTraits)
        if (k.concrete && v.concrete && k.valid_as_k && v.valid_as_v)
          caps_.kv_dtype_pairs.push_back({k.dtype, v.dtype});
    caps_.head_dims = {64, 128, 256};
    caps_.block_tokens = {16, 32};
    caps_.attention_kinds = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                             AttentionKind::kNonCausal};
    caps_.logit_soft_cap = true;
  }
  std::string_view name() const override { return "cpu_avx512"; }
  const AttentionCapabilities& capabilities() const override { return caps_; }

 protected:
  void run_impl(const LayerKvSpec& spec, const AttentionArgs& args) const override {
    cpu_attn::run_tiled(
        spec, args, cpu_attn::cpu_has_avx512() ? cpu_attn::Isa::kAvx512 : cpu_attn::Isa::kPortable);
  }

 private:
  AttentionCapabilities caps_;
};

}  // namespace

const AttentionBackend& cpu_avx512_backend() {
  static const CpuAvx512Backend backend;
  return backend;
}

}  // namespace kvq
