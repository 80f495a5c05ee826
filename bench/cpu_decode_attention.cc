// Decode attention on the CPU (cpu_avx512) over a 4096-token context, per KV dtype, with the
// machine's memory bandwidth alongside for scale.
//
// Shape: 32 query heads / 8 kv heads, head_dim 128, block 16, one query per sequence, batch
// 1..4. Each iteration reads a different copy of the cache (a different "layer"), and the
// copies together are much larger than the last-level cache, so every KV byte comes from
// DRAM as it does in a real model where all layers stream through once per token.
//
// Counters: GB_per_s = KV bytes read (values + per-row scales, K and V) / wall time, in
// 1e9 bytes per second.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "kvq/attention/backend.h"
#include "kvq/cache/paged_kv_cache.h"
#include "kvq/quant/codec.h"

namespace {

using namespace kvq;

constexpr int kContext = 4096;
constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kBlockTokens = 16;
constexpr int kMaxBatch = 4;
constexpr size_t kMinFootprint = size_t{512} << 20;  // bytes cycled through, >> any LLC

struct AlignedFree {
  void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{64}); }
};
using Storage = std::unique_ptr<std::byte[], AlignedFree>;
Storage allocate(size_t bytes) {
  return Storage(static_cast<std::byte*>(::operator new[](bytes, std::align_val_t{64})));
}

LayerKvSpec bench_spec(KvDtype d) {
  LayerKvSpec s;
  s.k_dtype = s.v_dtype = d;
  s.num_q_heads = kQHeads;
  s.num_kv_heads = kKvHeads;
  s.head_dim_k = s.head_dim_v = kHeadDim;
  s.block_tokens = kBlockTokens;
  if (traits(d).uses_tensor_scale) {
    const float ts = d == KvDtype::kNvfp4 ? 0.002f : 0.01f;
    s.k_scale = {ScaleSourceKind::kCheckpoint, "", {ts}};
    s.v_scale = {ScaleSourceKind::kCheckpoint, "", {ts}};
  }
  return s;
}

// One dtype's cache: `copies` disjoint copies of kMaxBatch sequences of kContext tokens.
struct Fixture {
  KvDtype dtype = KvDtype::kAuto;
  LayerKvSpec spec;
  int copies = 0;
  int32_t blocks_per_copy = 0;
  Storage k, v;
  LayerCacheView view;
  std::vector<float> q, out;

  void build(KvDtype d) {
    dtype = d;
    spec = bench_spec(d);
    k.reset();
    v.reset();
    const size_t block_bytes = spec.block_bytes();
    blocks_per_copy = kMaxBatch * kContext / kBlockTokens;
    const size_t copy_bytes = block_bytes * static_cast<size_t>(blocks_per_copy);
    copies = static_cast<int>(std::clamp<size_t>(kMinFootprint / copy_bytes + 1, 2, 64));
    const KvSideLayout kl = spec.layout(KvSide::kK), vl = spec.layout(KvSide::kV);
    const size_t total_blocks = static_cast<size_t>(blocks_per_copy) * copies;
    k = allocate(kl.block_bytes * total_blocks);
    v = allocate(vl.block_bytes * total_blocks);
    view.k_base = k.get();
    view.v_base = v.get();
    view.k_layout = kl;
    view.v_layout = vl;
    view.num_blocks = static_cast<int32_t>(total_blocks);

    // Copy 0 holds real encoded data; the others are byte copies of it.
    std::mt19937 rng(1234);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> row(kHeadDim);
    for (KvSide side : {KvSide::kK, KvSide::kV}) {
      const KvSideLayout& l = side == KvSide::kK ? kl : vl;
      std::byte* base = side == KvSide::kK ? k.get() : v.get();
      for (int32_t b = 0; b < blocks_per_copy; ++b)
        for (int h = 0; h < kKvHeads; ++h)
          for (int t = 0; t < kBlockTokens; ++t) {
            for (float& x : row) x = normal(rng);
            std::byte* blk = base + static_cast<size_t>(b) * l.block_bytes;
            quant::encode_row(d, row, spec.scale(side).for_head(h), blk + l.value_offset(h, t),
                              l.row_scale_bytes ? blk + l.scale_offset(h, t) : nullptr);
          }
      const size_t copy = l.block_bytes * static_cast<size_t>(blocks_per_copy);
      for (int c = 1; c < copies; ++c) std::memcpy(base + c * copy, base, copy);
    }
    q.resize(static_cast<size_t>(kMaxBatch) * kQHeads * kHeadDim);
    for (float& x : q) x = normal(rng);
    out.resize(static_cast<size_t>(kMaxBatch) * kQHeads * kHeadDim);
  }
};

Fixture& fixture_for(KvDtype d) {
  static Fixture f;  // one dtype at a time keeps peak memory at one footprint
  if (f.dtype != d) f.build(d);
  return f;
}

void BM_DecodeAttention(benchmark::State& state, KvDtype dtype) {
  const int batch = static_cast<int>(state.range(0));
  Fixture& f = fixture_for(dtype);
  const AttentionBackend* backend = find_attention_backend("cpu_avx512");
  if (auto r = backend->reasons_unsupported(f.spec); !r.empty()) {
    state.SkipWithError(r.front().c_str());
    return;
  }
  // Block tables for every copy: sequence i of copy c owns a contiguous run of blocks.
  const int32_t blocks_per_seq = kContext / kBlockTokens;
  std::vector<std::vector<int32_t>> indices(static_cast<size_t>(f.copies));
  std::vector<int32_t> indptr(batch + 1), seq_lens(batch, kContext), q_indptr(batch + 1);
  for (int i = 0; i <= batch; ++i) {
    indptr[i] = i * blocks_per_seq;
    q_indptr[i] = i;
  }
  for (int c = 0; c < f.copies; ++c)
    for (int i = 0; i < batch; ++i)
      for (int32_t b = 0; b < blocks_per_seq; ++b)
        indices[c].push_back(c * f.blocks_per_copy + i * blocks_per_seq + b);

  AttentionArgs args;
  args.q = f.q.data();
  args.out = f.out.data();
  args.q_indptr = q_indptr.data();
  args.block_table.indptr = indptr.data();
  args.block_table.seq_lens = seq_lens.data();
  args.block_table.num_seqs = batch;
  args.block_table.block_tokens = kBlockTokens;
  args.cache = f.view;
  args.softmax_scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));

  int c = 0;
  for (auto _ : state) {
    args.block_table.indices = indices[c].data();
    backend->run(f.spec, args);
    benchmark::DoNotOptimize(f.out.data());
    benchmark::ClobberMemory();
    c = (c + 1) % f.copies;
  }
  const double kv_bytes = static_cast<double>(f.spec.bytes_per_token()) * kContext * batch;
  state.counters["GB_per_s"] =
      benchmark::Counter(kv_bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["KV_MB"] = kv_bytes * 1e-6;
  state.SetLabel(std::string(to_string(dtype)));
}

// Copies a 512 MiB buffer with every thread copying its share: the machine's copy bandwidth.
// GB_per_s counts bytes copied (each read once and written once).
void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = size_t{512} << 20;
  Storage src = allocate(bytes), dst = allocate(bytes);
  std::memset(src.get(), 1, bytes);
  std::memset(dst.get(), 2, bytes);
  for (auto _ : state) {
#pragma omp parallel
    {
      // Contiguous shares, one per thread.
      const size_t n = static_cast<size_t>(omp_get_num_threads());
      const size_t t = static_cast<size_t>(omp_get_thread_num());
      const size_t share = (bytes / n) & ~size_t{63};
      const size_t begin = t * share, end = t + 1 == n ? bytes : begin + share;
      std::memcpy(dst.get() + begin, src.get() + begin, end - begin);
    }
    benchmark::ClobberMemory();
  }
  state.counters["GB_per_s"] = benchmark::Counter(static_cast<double>(bytes) * 1e-9,
                                                  benchmark::Counter::kIsIterationInvariantRate);
}

// Reads a 512 MiB buffer (every thread summing its share): the read-only bandwidth that
// decode attention, which reads far more than it writes, can at best reach.
void BM_ReadBandwidth(benchmark::State& state) {
  const size_t bytes = size_t{512} << 20;
  Storage src = allocate(bytes);
  std::memset(src.get(), 1, bytes);
  const auto* words = reinterpret_cast<const uint64_t*>(src.get());
  const long n = static_cast<long>(bytes / sizeof(uint64_t));
  for (auto _ : state) {
    uint64_t sum = 0;
#pragma omp parallel for reduction(+ : sum) schedule(static)
    for (long i = 0; i < n; ++i) sum += words[i];
    benchmark::DoNotOptimize(sum);
  }
  state.counters["GB_per_s"] = benchmark::Counter(static_cast<double>(bytes) * 1e-9,
                                                  benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::RegisterBenchmark("BM_Memcpy", BM_Memcpy)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_ReadBandwidth", BM_ReadBandwidth)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  for (const auto& t : kKvDtypeTraits) {
    if (!t.concrete) continue;
    benchmark::RegisterBenchmark(("BM_DecodeAttention/" + std::string(t.name)).c_str(),
                                 BM_DecodeAttention, t.dtype)
        ->ArgName("batch")
        ->DenseRange(1, kMaxBatch)
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
