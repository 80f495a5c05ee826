// cpu_avx512: paged attention on the CPU for decode and prefill. Units of work are
// (sequence, kv head, up to kMaxQueries queries of the GQA group); when there are fewer
// units than cores (decode of a small batch) each unit's kv range is split into pieces whose
// softmax states are merged at the end. OpenMP spreads the tasks over cores. A task walks
// its kv tokens in chunks: K and V rows are dequantized once into fp32 scratch (L1-resident)
// and shared by every query of the group, each query keeping an fp32 online softmax. The
// per-task kernel is AVX-512 when the CPU has it (kernel_avx512.cc), AVX2 (kernel_avx2.cc) or
// portable C++ otherwise. With int8/int4_per_token_head K the AVX-512 and AVX2 kernels compute
// Q·K as integer dot products on the codes (KDot, kernel.h): the queries are quantized to int8
// here, once per task.
#include <cpuid.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <omp.h>

#include "attention/backends.h"
#include "attention/cpu_avx512/kernel.h"
#include "kvq/core/error.h"
#include "kvq/quant/codec.h"

namespace kvq {

namespace cpu_attn {

namespace {
// Queries (positions x heads of the group) per work item: bounds the per-thread scratch.
constexpr int kMaxQueries = 64;
// Splitting a unit's kv range: pieces of at least this many tokens, at most this many pieces.
constexpr int kMinSplitTokens = 256;
constexpr int kMaxSplits = 32;
}  // namespace

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return has;
}

// AVX512-VNNI: CPUID leaf 7 subleaf 0, ECX bit 11 (the OS saving ZMM state is part of
// cpu_has_avx512()).
bool cpu_has_avx512_vnni() {
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return cpu_has_avx512() && __get_cpuid_count(7, 0, &a, &b, &c, &d) != 0 && (c & (1u << 11));
  }();
  return has;
}

// AVX-VNNI: CPUID leaf 7 subleaf 1, EAX bit 4 (the YMM state: part of cpu_has_avx2()).
bool cpu_has_avx_vnni() {
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return cpu_has_avx2() && __get_cpuid_count(7, 1, &a, &b, &c, &d) != 0 && (a & (1u << 4));
  }();
  return has;
}

// F16C through CPUID leaf 1 (clang's __builtin_cpu_supports does not know "f16c").
bool cpu_has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
}

bool cpu_has_avx2() {
  static const bool has =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
  return has;
}

Isa best_isa() {
  // KVQ_CPU_ISA=avx2 or portable: a narrower kernel than the CPU allows (A/B measurements; an
  // AVX-512 machine standing in for an AVX2-only one). The model's products read it too.
  static const Isa isa = [] {
    const std::string want = env_choice("KVQ_CPU_ISA", {"avx512", "avx2", "portable"});
    if (want != "avx2" && want != "portable" && cpu_has_avx512()) return Isa::kAvx512;
    if (want != "portable" && cpu_has_avx2()) return Isa::kAvx2;
    return Isa::kPortable;
  }();
  return isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kPortable:
      break;
  }
  return "portable";
}

const char* k_dot_name(KDot k_dot) {
  switch (k_dot) {
    case KDot::kVnni:
      return "vnni";
    case KDot::kMaddubs:
      return "maddubs";
    case KDot::kFloat:
      break;
  }
  return "float";
}

bool k_dot_supported(Isa isa, KDot k_dot) {
  switch (k_dot) {
    case KDot::kFloat:
      return true;
    case KDot::kVnni:
      return (isa == Isa::kAvx512 && cpu_has_avx512_vnni()) ||
             (isa == Isa::kAvx2 && cpu_has_avx_vnni());
    case KDot::kMaddubs:
      return (isa == Isa::kAvx512 && cpu_has_avx512()) || (isa == Isa::kAvx2 && cpu_has_avx2());
  }
  return false;
}

KDot default_k_dot(Isa isa, KvDtype k) {
  // KVQ_CPU_INT_DOT=0: K decoded to fp32 for every dtype (A/B, or to take the quantization of
  // q out of the results); =maddubs: vpmaddubsw even where VNNI exists.
  static const std::string mode = env_choice("KVQ_CPU_INT_DOT", {"0", "1", "maddubs"});
  if (!integer_k(k) || mode == "0") return KDot::kFloat;
  if (mode != "maddubs" && k_dot_supported(isa, KDot::kVnni)) return KDot::kVnni;
  return k_dot_supported(isa, KDot::kMaddubs) ? KDot::kMaddubs : KDot::kFloat;
}

float unscaled_factor(KvDtype dtype, float tensor_scale) {
  float f = 0.0f;
  if (dtype == KvDtype::kFp8E4M3) f = 256.0f * tensor_scale;
  if (dtype == KvDtype::kFp8E5M2) f = tensor_scale;
  return std::isnormal(f) ? f : 0.0f;
}

bool default_fp8_scale_after() {
  static const bool on = env_choice("KVQ_CPU_FP8_SCALE_AFTER", {"0", "1"}) != "0";
  return on;
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

// The integer Q·K's queries (QuantizedQ): for each of the nq prepared queries of dim dk,
// s_q = max|q| / 127 and qq = round_half_even(q / s_q) (|q / s_q| <= 127 up to a rounding,
// clamped), placed in the int4 order when `int4_order`; an all-zero query takes s_q = 1 and
// zero codes (its logits are exactly 0, as in fp32). False where a query has a non-finite
// element or max|q| / 127 is subnormal (its rounding bound would not hold): the item then
// runs in fp32.
bool quantize_queries(const float* q, int nq, int dk, bool int4_order, int8_t* qq, float* scale,
                      float* sum, int32_t* qq_sum, float* centre) {
  for (int i = 0; i < nq; ++i) {
    const float* x = q + static_cast<size_t>(i) * dk;
    float amax = 0.0f;
    double total = 0.0;
    for (int d = 0; d < dk; ++d) {
      if (!std::isfinite(x[d])) return false;
      amax = std::max(amax, std::fabs(x[d]));
      total += x[d];
    }
    const float s = amax == 0.0f ? 1.0f : amax / 127.0f;
    if (!(s >= std::numeric_limits<float>::min())) return false;
    int8_t* out = qq + static_cast<size_t>(i) * dk;
    int32_t code_sum = 0;
    for (int d = 0; d < dk; ++d) {
      const int c = static_cast<int>(std::clamp(std::nearbyint(x[d] / s), -127.0f, 127.0f));
      // int4 order: per 64 elements, the even ones then the odd ones.
      const int at = int4_order ? d - d % 64 + (d % 2) * 32 + (d % 64) / 2 : d;
      out[at] = static_cast<int8_t>(c);
      code_sum += c;
    }
    scale[i] = s;
    sum[i] = static_cast<float>(total);
    qq_sum[i] = code_sum;
    centre[i] = static_cast<float>(7.5 * (total - static_cast<double>(s) * code_sum));
  }
  return true;
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
  if (!item.normalize) return;
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

void run_tiled(const LayerKvSpec& spec, const AttentionArgs& args, Isa isa, KDot k_dot,
               int min_tasks, bool fp8_scale_after) {
  const BlockTableView& bt = args.block_table;
  const int ratio = spec.gqa_ratio();
  const int dk = spec.head_dim_k, dv = spec.head_dim_v;
  const int pos_per_item = std::max(1, kMaxQueries / ratio);
  const size_t max_nq = static_cast<size_t>(pos_per_item) * ratio;
  const bool k_rotated = traits(spec.k_dtype).rotated;
  const bool v_rotated = traits(spec.v_dtype).rotated;
  KVQ_CHECK(bt.block_tokens % kTile == 0, "cpu_avx512 tiles need block_tokens % 16 == 0");
  KVQ_CHECK(isa != Isa::kAvx512 || cpu_has_avx512(), "run_tiled: this CPU has no AVX-512");
  KVQ_CHECK(isa != Isa::kAvx2 || cpu_has_avx2(), "run_tiled: this CPU has no AVX2/FMA/F16C");
  for (int d : {dk, dv})
    KVQ_CHECK(isa == Isa::kPortable || d == 64 || d == 128 || d == 256,
              std::string("the ") + isa_name(isa) + " kernel has no instance for head_dim " +
                  std::to_string(d));
  const auto run_item = isa == Isa::kAvx512 ? run_item_avx512
                        : isa == Isa::kAvx2 ? run_item_avx2
                                            : run_item_portable;
  auto decoder = [&](KvDtype d, int dim) {
    DecodeTileFn f = isa == Isa::kAvx512 ? avx512_decoder(d, dim)
                     : isa == Isa::kAvx2 ? avx2_decoder(d, dim)
                                         : nullptr;
    return f ? f : decode_tile_generic;
  };
  const DecodeTileFn k_decode = decoder(spec.k_dtype, dk), v_decode = decoder(spec.v_dtype, dv);
  auto unscaled = [&](KvDtype d, int dim) -> DecodeTileFn {
    if (!fp8_scale_after) return nullptr;
    return isa == Isa::kAvx512 ? avx512_unscaled_decoder(d, dim)
           : isa == Isa::kAvx2 ? avx2_unscaled_decoder(d, dim)
                               : nullptr;
  };
  const DecodeTileFn k_unscaled = unscaled(spec.k_dtype, dk),
                     v_unscaled = unscaled(spec.v_dtype, dv);
  KVQ_CHECK(k_dot_supported(isa, k_dot), std::string("run_tiled: the ") + isa_name(isa) +
                                             " kernel has no " + k_dot_name(k_dot) +
                                             " q.k on this CPU");
  KLogitsFn k_logits = nullptr;  // integer Q·K (int8/int4_per_token_head K only)
  if (k_dot != KDot::kFloat && integer_k(spec.k_dtype)) {
    k_logits = isa == Isa::kAvx512 ? avx512_k_logits(k_dot, spec.k_dtype, dk)
                                   : avx2_k_logits(k_dot, spec.k_dtype, dk);
    KVQ_CHECK(k_logits != nullptr && args.cache.layout(KvSide::kK).row_scale_bytes == 4,
              "run_tiled: no integer q.k for this K layout");
  }
  const bool int4_order = spec.k_dtype == KvDtype::kInt4PerTokenHead;

  // Masks as documented in AttentionArgs: query position `pos` sees kv tokens [lo, hi).
  auto visible = [&](int pos, int kv_len) {
    const int lo = spec.attention == AttentionKind::kSlidingWindow
                       ? std::max(0, pos - spec.sliding_window + 1)
                       : 0;
    const int hi = spec.attention == AttentionKind::kNonCausal ? kv_len : pos + 1;
    return std::pair{lo, hi};
  };

  // Units: (sequence, kv head, up to pos_per_item positions), with the kv range they see.
  struct Unit {
    int seq, kv_head, first_pos, num_pos;
    int kv_first, kv_last;
    int splits = 1;
    size_t partial = 0;  // first task's offset in `partials` when split
  };
  std::vector<Unit> units;
  for (int s = 0; s < bt.num_seqs; ++s) {
    const int q_len = args.q_indptr[s + 1] - args.q_indptr[s];
    const int kv_len = bt.seq_lens[s];
    for (int j = 0; j < q_len; j += pos_per_item) {
      const int n = std::min(pos_per_item, q_len - j);
      const int first = visible(kv_len - q_len + j, kv_len).first;
      const int last = visible(kv_len - q_len + j + n - 1, kv_len).second;
      for (int g = 0; g < spec.num_kv_heads; ++g) units.push_back({s, g, j, n, first, last});
    }
  }

  // Too few units to occupy every core (decode of a small batch): split the kv range of each
  // unit into pieces with their own softmax state, merged at the end (flash-decoding).
  const int tasks_wanted = min_tasks > 0 ? min_tasks : 2 * omp_get_max_threads();
  const int want = units.empty() ? 1
                                 : (tasks_wanted + static_cast<int>(units.size()) - 1) /
                                       static_cast<int>(units.size());
  struct Task {
    int unit, kv_begin, kv_end, split;
  };
  std::vector<Task> tasks;
  const size_t partial_floats = max_nq * (static_cast<size_t>(dv) + 2);
  size_t num_partials = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    Unit& unit = units[u];
    const int len = unit.kv_last - unit.kv_first;
    int splits = std::clamp(std::min(want, len / kMinSplitTokens), 1, kMaxSplits);
    const int piece = (len / splits + kChunk - 1) / kChunk * kChunk;  // chunk-aligned pieces
    splits = (len + piece - 1) / piece;
    unit.splits = splits;
    unit.partial = num_partials;
    if (splits > 1) num_partials += static_cast<size_t>(splits);
    // Pieces start at multiples of kChunk from the unit's first tile.
    const int base = unit.kv_first - unit.kv_first % kTile;
    for (int sp = 0; sp < splits; ++sp)
      tasks.push_back({static_cast<int>(u), sp == 0 ? unit.kv_first : base + sp * piece,
                       sp + 1 == splits ? unit.kv_last : base + (sp + 1) * piece, sp});
  }
  std::vector<float> partials(num_partials * partial_floats);
  const int num_tasks = static_cast<int>(tasks.size());

  auto out_row = [&](const Unit& unit, int j, int r) {
    const int q_row = args.q_indptr[unit.seq] + unit.first_pos + j;
    return args.out + (static_cast<size_t>(q_row) * spec.num_q_heads +
                       static_cast<size_t>(unit.kv_head * ratio + r)) *
                          dv;
  };
  auto unrotate_out = [&](const Unit& unit) {
    if (!v_rotated) return;  // V rows are stored rotated: the weighted sum is too
    for (int j = 0; j < unit.num_pos; ++j)
      for (int r = 0; r < ratio; ++r)
        quant::hadamard_unrotate(std::span<float>(out_row(unit, j, r), static_cast<size_t>(dv)));
  };

#pragma omp parallel if (num_tasks > 1)
  {
    std::vector<float> q(max_nq * dk), acc(max_nq * dv), m(max_nq), l(max_nq);
    std::vector<float> k_tile(static_cast<size_t>(kChunk) * dk, 0.0f);
    std::vector<float> v_tile(static_cast<size_t>(kChunk) * dv, 0.0f);
    std::vector<float> p(2 * kChunk);
    std::vector<int> lo(pos_per_item), hi(pos_per_item);
    // Integer Q·K: the quantized queries and one position's logits per chunk.
    std::vector<int8_t> qq(k_logits != nullptr ? max_nq * dk : 0);
    std::vector<float> q_scale(k_logits != nullptr ? max_nq : 0), q_sum(q_scale.size());
    std::vector<int32_t> qq_sum(q_scale.size());
    std::vector<float> q_centre(q_scale.size());
    std::vector<float> logits(k_logits != nullptr ? static_cast<size_t>(ratio) * kChunk : 0);

#pragma omp for schedule(dynamic, 1)
    for (int t = 0; t < num_tasks; ++t) {
      const Task& task = tasks[static_cast<size_t>(t)];
      const Unit& unit = units[static_cast<size_t>(task.unit)];
      const int kv_len = bt.seq_lens[unit.seq];
      const int q_begin = args.q_indptr[unit.seq];
      const int q_len = args.q_indptr[unit.seq + 1] - q_begin;
      for (int j = 0; j < unit.num_pos; ++j) {
        const auto [vis_lo, vis_hi] = visible(kv_len - q_len + unit.first_pos + j, kv_len);
        lo[j] = std::max(vis_lo, task.kv_begin);
        hi[j] = std::min(vis_hi, task.kv_end);
        if (lo[j] >= hi[j]) lo[j] = hi[j] = task.kv_begin;  // sees nothing of this piece
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

      auto side = [&](KvSide s, DecodeTileFn decode, DecodeTileFn unscaled_decode) {
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
        const float factor = unscaled_factor(out.dtype, out.tensor_scale);
        if (unscaled_decode != nullptr && factor != 0.0f) {
          out.decode = unscaled_decode;
          out.post_scale = factor;
        }
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
      item.k = side(KvSide::kK, k_decode, k_unscaled);
      item.v = side(KvSide::kV, v_decode, v_unscaled);
      item.soft_cap = args.logit_soft_cap;
      item.out_pos_stride = static_cast<size_t>(spec.num_q_heads) * dv;
      item.out = out_row(unit, 0, 0);
      item.k_tile = k_tile.data();
      item.v_tile = v_tile.data();
      item.p = p.data();
      if (k_logits != nullptr &&
          quantize_queries(q.data(), unit.num_pos * ratio, dk, int4_order, qq.data(),
                           q_scale.data(), q_sum.data(), qq_sum.data(), q_centre.data())) {
        item.k_logits = k_logits;
        item.qq = {qq.data(), q_scale.data(), q_sum.data(), qq_sum.data(), q_centre.data()};
        item.logits = logits.data();
      }
      if (unit.splits == 1) {
        item.acc = acc.data();
        item.m = m.data();
        item.l = l.data();
        run_item(item);
        unrotate_out(unit);
      } else {  // leave this piece's unnormalized state for the merge
        float* part =
            partials.data() + (unit.partial + static_cast<size_t>(task.split)) * partial_floats;
        item.acc = part;
        item.m = part + max_nq * dv;
        item.l = item.m + max_nq;
        item.normalize = false;
        run_item(item);
      }
    }

    // Merge split units: out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M), M = max m_s.
    const int num_units = static_cast<int>(units.size());
#pragma omp for schedule(dynamic, 1)
    for (int u = 0; u < num_units; ++u) {
      const Unit& unit = units[static_cast<size_t>(u)];
      if (unit.splits == 1) continue;
      for (int qi = 0; qi < unit.num_pos * ratio; ++qi) {
        auto part = [&](int sp) {
          return partials.data() + (unit.partial + static_cast<size_t>(sp)) * partial_floats;
        };
        float mx = -std::numeric_limits<float>::infinity();
        for (int sp = 0; sp < unit.splits; ++sp) mx = std::max(mx, part(sp)[max_nq * dv + qi]);
        float* o = out_row(unit, qi / ratio, qi % ratio);
        std::fill(o, o + dv, 0.0f);
        float denom = 0.0f;
        for (int sp = 0; sp < unit.splits; ++sp) {
          const float m_s = part(sp)[max_nq * dv + qi];
          if (m_s == -std::numeric_limits<float>::infinity()) continue;  // saw nothing
          const float w = std::exp(m_s - mx);
          denom += part(sp)[max_nq * dv + max_nq + qi] * w;
          const float* a = part(sp) + static_cast<size_t>(qi) * dv;
          for (int d = 0; d < dv; ++d) o[d] += a[d] * w;
        }
        for (int d = 0; d < dv; ++d) o[d] /= denom;
      }
      unrotate_out(unit);
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
    const cpu_attn::Isa isa = cpu_attn::best_isa();
    cpu_attn::run_tiled(spec, args, isa, cpu_attn::default_k_dot(isa, spec.k_dtype), 0,
                        cpu_attn::default_fp8_scale_after());
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
