// Prometheus histograms and exposition, KV layer groups.
#include "kvq/server/metrics.h"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <sstream>

#include "kvq/core/kv_dtype.h"

namespace kvq {
namespace {

// name{labels} -> value, for every sample line of an exposition.
std::map<std::string, double> samples(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    EXPECT_NE(sp, std::string::npos) << line;
    out[line.substr(0, sp)] = std::stod(line.substr(sp + 1));
  }
  return out;
}

TEST(Metrics, HistogramCountsCumulatively) {
  std::random_device rd;
  const unsigned seed = rd();
  std::mt19937 rng(seed);
  std::exponential_distribution<double> dist(10.0);
  const std::vector<double> bounds = {0.01, 0.05, 0.1, 0.5, 1.0};
  Histogram h(bounds);
  std::vector<double> values(500);
  double sum = 0.0;
  for (auto& v : values) {
    v = dist(rng);
    h.observe(v);
    sum += v;
  }
  std::string out;
  h.render(out, "x_seconds", "help");
  EXPECT_NE(out.find("# TYPE x_seconds histogram"), std::string::npos);
  auto s = samples(out);
  for (double b : bounds) {
    int64_t expect = 0;
    for (double v : values) expect += v <= b;
    char key[64];
    std::snprintf(key, sizeof key, "x_seconds_bucket{le=\"%.17g\"}", b);
    ASSERT_TRUE(s.count(key)) << key;
    EXPECT_EQ(s[key], static_cast<double>(expect)) << "seed " << seed << " le " << b;
  }
  EXPECT_EQ(s["x_seconds_bucket{le=\"+Inf\"}"], 500.0);
  EXPECT_EQ(s["x_seconds_count"], 500.0);
  EXPECT_NEAR(s["x_seconds_sum"], sum, 1e-9 * sum);
}

TEST(Metrics, LayerGroupsByDtype) {
  std::vector<LayerKvSpec> layers(6);
  for (int i = 0; i < 6; ++i) {
    layers[i].layer = i;
    layers[i].num_q_heads = 4;
    layers[i].num_kv_heads = 2;
    layers[i].head_dim_k = layers[i].head_dim_v = 64;
    layers[i].block_tokens = 16;
    layers[i].k_dtype = layers[i].v_dtype =
        (i == 0 || i == 5) ? KvDtype::kBFloat16 : KvDtype::kFp8E4M3;
  }
  auto groups = kv_layer_groups(layers);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].layers, (std::vector<int>{0, 5}));
  EXPECT_EQ(groups[1].layers, (std::vector<int>{1, 2, 3, 4}));
  EXPECT_EQ(groups[0].bytes_per_block, layers[0].block_bytes() + layers[5].block_bytes());
  EXPECT_EQ(groups[1].bytes_per_block, 4 * layers[1].block_bytes());
  EXPECT_EQ(format_layer_list({0, 5}), "0,5");
  EXPECT_EQ(format_layer_list({1, 2, 3, 4, 7, 9, 10}), "1-4,7,9-10");

  ServerMetrics m;
  EngineStats st;
  st.blocks_total = 100;
  st.blocks_used = 30;
  st.blocks_cached_free = 5;
  st.prefix_cache_queries = 40;
  st.prefix_cache_hits = 10;
  st.preemptions = 3;
  auto s = samples(m.render(st, groups));
  const std::string g1 = "group=\"1\",k_dtype=\"fp8_e4m3\",v_dtype=\"fp8_e4m3\",layers=\"1-4\"";
  EXPECT_EQ(s["kvq_kv_blocks_used{" + g1 + "}"], 30.0);
  EXPECT_EQ(s["kvq_kv_blocks_free{" + g1 + "}"], 70.0);
  EXPECT_EQ(s["kvq_kv_bytes_used{" + g1 + "}"],
            30.0 * static_cast<double>(groups[1].bytes_per_block));
  EXPECT_EQ(s["kvq_prefix_cache_hit_rate"], 0.25);
  EXPECT_EQ(s["kvq_preemptions_total"], 3.0);
  EXPECT_TRUE(s.count("kvq_time_to_first_token_seconds_count"));
  EXPECT_TRUE(s.count("kvq_inter_token_latency_seconds_count"));
}

TEST(Metrics, ExpositionIsWellFormed) {
  ServerMetrics m;
  m.time_to_first_token.observe(0.02);
  m.count_finished("stop");
  m.count_error(400);
  const std::string text = m.render(EngineStats{}, {});
  std::istringstream in(text);
  std::string line;
  std::string last_type;
  while (std::getline(in, line)) {
    ASSERT_FALSE(line.empty());
    if (line.starts_with("# TYPE ")) {
      last_type = line.substr(7, line.find(' ', 7) - 7);
      continue;
    }
    if (line.starts_with("# HELP ")) continue;
    // Every sample belongs to the metric family declared just before it.
    EXPECT_TRUE(line.starts_with(last_type)) << line;
    const size_t sp = line.rfind(' ');
    EXPECT_NO_THROW((void)std::stod(line.substr(sp + 1))) << line;
  }
  auto s = samples(text);
  EXPECT_EQ(s["kvq_request_finished_total{finish_reason=\"stop\"}"], 1.0);
  EXPECT_EQ(s["kvq_request_errors_total{status=\"400\"}"], 1.0);
}

}  // namespace
}  // namespace kvq
