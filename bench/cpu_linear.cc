// The CPU model's matrix products (model::Linear) at decode shapes, bf16 and fp32 weights, next
// to a plain read of the same bytes for scale.
//
// Shape: the default model's layer (hidden 256, q 256, kv 2 x 128, FFN 768), six layers'
// weights (9.4 MB in bf16) times `copies` cycled: copies 1 stays in a 32 MB last-level cache,
// copies 8 (75 MB) streams from DRAM. m = 1 .. 16 input rows.
// Counters: GB_per_s = weight bytes / wall time.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstring>
#include <random>
#include <vector>

#include "model/linear.h"

namespace {

using kvq::model::FloatArray;
using kvq::model::Linear;

constexpr int kLayers = 6, kH = 256, kQkv = 512, kI = 768;

struct Layer {
  Linear qkv, o, gate_up, down;
};

Linear make(int rows, int cols, Linear::Storage s, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 0.05f);
  FloatArray v(static_cast<size_t>(rows) * cols);
  for (size_t i = 0; i < v.size(); ++i) v.data()[i] = nd(rng);
  return Linear(std::move(v), rows, cols, s);
}

void BM_DecodeLayerProducts(benchmark::State& state) {
  const auto storage = state.range(0) ? Linear::Storage::kBFloat16 : Linear::Storage::kFloat32;
  const int m = static_cast<int>(state.range(1));
  kvq::model::use_single_threaded_blas();  // as the model does: OpenMP splits, BLAS does not
  std::mt19937 rng(1);
  std::vector<Layer> layers(static_cast<size_t>(kLayers * state.range(2)));
  size_t bytes = 0;
  for (Layer& l : layers) {
    l.qkv = make(kQkv, kH, storage, rng);
    l.o = make(kH, kH, storage, rng);
    l.gate_up = make(2 * kI, kH, storage, rng);
    l.down = make(kH, kI, storage, rng);
    bytes += l.qkv.bytes() + l.o.bytes() + l.gate_up.bytes() + l.down.bytes();
  }
  std::vector<float> x(static_cast<size_t>(m) * 2 * kI, 0.01f), y(static_cast<size_t>(m) * 2 * kI);
  size_t at = 0;
  for (auto _ : state) {
    for (int li = 0; li < kLayers; ++li, at = (at + 1) % layers.size()) {
      const Layer& l = layers[at];
      l.qkv.apply(m, x.data(), kH, y.data(), kQkv, 0.0f);
      l.o.apply(m, x.data(), kH, y.data(), kH, 1.0f);
      l.gate_up.apply(m, x.data(), kH, y.data(), 2 * kI, 0.0f);
      l.down.apply(m, x.data(), kI, y.data(), kH, 1.0f);
    }
    benchmark::DoNotOptimize(y.data());
  }
  const double step_bytes = static_cast<double>(bytes) / static_cast<double>(state.range(2));
  state.counters["GB_per_s"] =
      benchmark::Counter(step_bytes * state.iterations() / 1e9, benchmark::Counter::kIsRate);
  state.counters["MB"] = step_bytes / 1e6;
}
BENCHMARK(BM_DecodeLayerProducts)
    ->ArgNames({"bf16", "m", "copies"})
    ->ArgsProduct({{0, 1}, {1, 2, 5, 8, 9, 16}, {1, 8}})
    ->UseRealTime();

// Reading the bf16 weights' bytes once (sum of 32-bit words, split over the OpenMP threads).
void BM_ReadBytes(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0)) << 20;
  std::vector<uint32_t> buf(bytes / 4, 1u);
  for (auto _ : state) {
    uint32_t sum = 0;
#pragma omp parallel for reduction(+ : sum) schedule(static)
    for (size_t i = 0; i < buf.size(); ++i) sum += buf[i];
    benchmark::DoNotOptimize(sum);
  }
  state.counters["GB_per_s"] = benchmark::Counter(
      static_cast<double>(bytes) * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_ReadBytes)->ArgName("MiB")->Arg(12)->Arg(24)->Arg(256)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
