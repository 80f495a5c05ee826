// Serving metrics and their Prometheus text exposition (GET /metrics).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "kvq/engine/llm_engine.h"
#include "kvq/plan/layer_kv_spec.h"

namespace kvq {

// Cumulative histogram with fixed bucket upper bounds (Prometheus _bucket/_sum/_count).
// Thread-safe.
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value, int64_t times = 1);
  // Appends HELP/TYPE lines and the series.
  void render(std::string& out, const std::string& name, const std::string& help) const;
  int64_t count() const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<int64_t> counts_;  // per bucket (not cumulative); the last is +Inf
  double sum_ = 0.0;
  int64_t count_ = 0;
};

// Layers whose KV blocks have the same byte layout (same K and V dtypes). Every cache block id
// spans all layers, so a group's block count is the cache's; its bytes per block differ.
struct KvLayerGroup {
  std::string k_dtype, v_dtype;
  std::vector<int> layers;
  size_t bytes_per_block = 0;  // summed over the group's layers
};
std::vector<KvLayerGroup> kv_layer_groups(std::span<const LayerKvSpec> layers);
// "0,2,4" or "0-5"
std::string format_layer_list(const std::vector<int>& layers);

// Token counts per second over a sliding window of whole seconds. Thread-safe.
class RateWindow {
 public:
  explicit RateWindow(int seconds = 10);
  void add(int64_t n);
  double per_second() const;

 private:
  using Clock = std::chrono::steady_clock;
  int64_t second_now() const;
  int seconds_;
  Clock::time_point start_;
  mutable std::mutex mu_;
  std::vector<int64_t> buckets_;  // ring of per-second counts
  std::vector<int64_t> stamp_;    // which second each bucket holds
};

// What the HTTP server measures itself; the engine's counters come from EngineStats.
class ServerMetrics {
 public:
  ServerMetrics();

  Histogram time_to_first_token;  // seconds, from request arrival to the first token
  Histogram inter_token_latency;  // seconds between tokens of one request
  Histogram request_latency;      // seconds, arrival to the last token
  RateWindow prompt_rate, generation_rate;

  void count_finished(const std::string& finish_reason);  // per engine request
  void count_error(int http_status);

  std::string render(const EngineStats& stats, std::span<const KvLayerGroup> groups) const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, int64_t> finished_;
  std::map<int, int64_t> errors_;
};

}  // namespace kvq
