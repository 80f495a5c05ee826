#include "kvq/server/metrics.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "kvq/core/error.h"
#include "kvq/core/kv_dtype.h"

namespace kvq {

namespace {

std::string num(double v) {
  char b[40];
  std::snprintf(b, sizeof b, "%.17g", v);
  return b;
}

void header(std::string& out, const std::string& name, const char* type, const std::string& help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void sample(std::string& out, const std::string& name, const std::string& labels, double v) {
  out += name;
  if (!labels.empty()) out += "{" + labels + "}";
  out += " " + num(v) + "\n";
}

void metric(std::string& out, const std::string& name, const char* type, const std::string& help,
            double v) {
  header(out, name, type, help);
  sample(out, name, "", v);
}

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {
  KVQ_CHECK(std::is_sorted(bounds_.begin(), bounds_.end()), "histogram bounds must be sorted");
}

void Histogram::observe(double value, int64_t times) {
  const size_t i = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), value) -
                                       bounds_.begin());
  std::lock_guard lk(mu_);
  counts_[i] += times;
  sum_ += value * static_cast<double>(times);
  count_ += times;
}

int64_t Histogram::count() const {
  std::lock_guard lk(mu_);
  return count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& help) const {
  std::lock_guard lk(mu_);
  header(out, name, "histogram", help);
  int64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts_[i];
    const std::string le = i < bounds_.size() ? num(bounds_[i]) : "+Inf";
    sample(out, name + "_bucket", "le=\"" + le + "\"", static_cast<double>(cumulative));
  }
  sample(out, name + "_sum", "", sum_);
  sample(out, name + "_count", "", static_cast<double>(count_));
}

std::vector<KvLayerGroup> kv_layer_groups(std::span<const LayerKvSpec> layers) {
  std::vector<KvLayerGroup> groups;
  for (const auto& spec : layers) {
    const std::string k(to_string(spec.k_dtype)), v(to_string(spec.v_dtype));
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const KvLayerGroup& g) { return g.k_dtype == k && g.v_dtype == v; });
    if (it == groups.end()) {
      groups.push_back({k, v, {}, 0});
      it = groups.end() - 1;
    }
    it->layers.push_back(spec.layer);
    it->bytes_per_block += spec.block_bytes();
  }
  return groups;
}

std::string format_layer_list(const std::vector<int>& layers) {
  std::string out;
  for (size_t i = 0; i < layers.size();) {
    size_t j = i;
    while (j + 1 < layers.size() && layers[j + 1] == layers[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(layers[i]);
    if (j > i) out += "-" + std::to_string(layers[j]);
    i = j + 1;
  }
  return out;
}

RateWindow::RateWindow(int seconds)
    : seconds_(seconds),
      start_(Clock::now()),
      buckets_(static_cast<size_t>(seconds) + 1, 0),
      stamp_(static_cast<size_t>(seconds) + 1, -1) {}

int64_t RateWindow::second_now() const {
  return std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - start_).count();
}

void RateWindow::add(int64_t n) {
  const int64_t s = second_now();
  const size_t slot = static_cast<size_t>(s % static_cast<int64_t>(buckets_.size()));
  std::lock_guard lk(mu_);
  if (stamp_[slot] != s) {
    stamp_[slot] = s;
    buckets_[slot] = 0;
  }
  buckets_[slot] += n;
}

double RateWindow::per_second() const {
  // The last `seconds_` whole seconds (the current partial second is left out so the rate does
  // not dip at the start of every second).
  const int64_t now = second_now();
  int64_t total = 0;
  std::lock_guard lk(mu_);
  for (size_t i = 0; i < buckets_.size(); ++i)
    if (stamp_[i] < now && stamp_[i] >= now - seconds_) total += buckets_[i];
  const int64_t span = std::min<int64_t>(seconds_, now);
  return span > 0 ? static_cast<double>(total) / static_cast<double>(span) : 0.0;
}

ServerMetrics::ServerMetrics()
    : time_to_first_token({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                           2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}),
      inter_token_latency({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                           0.5, 0.75, 1.0, 2.5, 5.0, 10.0}),
      request_latency({0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0}) {
}

void ServerMetrics::count_finished(const std::string& finish_reason) {
  std::lock_guard lk(mu_);
  ++finished_[finish_reason];
}

void ServerMetrics::count_error(int http_status) {
  std::lock_guard lk(mu_);
  ++errors_[http_status];
}

std::string ServerMetrics::render(const EngineStats& s,
                                  std::span<const KvLayerGroup> groups) const {
  std::string out;
  metric(out, "kvq_requests_running", "gauge", "Requests being computed by the engine.", s.running);
  metric(out, "kvq_requests_waiting", "gauge", "Requests queued (new or preempted).", s.waiting);
  metric(out, "kvq_preemptions_total", "counter",
         "Sequences preempted (blocks freed, recomputed later).",
         static_cast<double>(s.preemptions));
  metric(out, "kvq_prefix_cache_queries_total", "counter",
         "Prompt tokens looked up in the prefix cache.",
         static_cast<double>(s.prefix_cache_queries));
  metric(out, "kvq_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
         static_cast<double>(s.prefix_cache_hits));
  metric(out, "kvq_prefix_cache_hit_rate", "gauge",
         "Prefix cache hits / queries (tokens) since start.",
         s.prefix_cache_queries > 0 ? static_cast<double>(s.prefix_cache_hits) /
                                          static_cast<double>(s.prefix_cache_queries)
                                    : 0.0);

  const int64_t total = s.blocks_total, used = s.blocks_used, cached = s.blocks_cached_free;
  const int64_t free_blocks = total - used;  // cached-but-unowned blocks are evictable, so free
  metric(out, "kvq_kv_blocks_total", "gauge", "KV cache blocks (each spans every layer).",
         static_cast<double>(total));
  metric(out, "kvq_kv_cache_usage_ratio", "gauge", "Fraction of KV blocks in use.",
         total > 0 ? static_cast<double>(used) / static_cast<double>(total) : 0.0);
  // Per layer group: the plan groups layers by their K/V dtypes, whose blocks differ in bytes.
  std::vector<std::string> labels;
  for (size_t i = 0; i < groups.size(); ++i)
    labels.push_back("group=\"" + std::to_string(i) + "\",k_dtype=\"" + groups[i].k_dtype +
                     "\",v_dtype=\"" + groups[i].v_dtype + "\",layers=\"" +
                     format_layer_list(groups[i].layers) + "\"");
  auto per_group = [&](const std::string& name, const char* help, auto value) {
    header(out, name, "gauge", help);
    for (size_t i = 0; i < groups.size(); ++i) sample(out, name, labels[i], value(groups[i]));
  };
  per_group("kvq_kv_blocks_used", "KV blocks held by requests (and prefixes they share).",
            [&](const KvLayerGroup&) { return static_cast<double>(used); });
  per_group("kvq_kv_blocks_free", "KV blocks free (including evictable cached prefixes).",
            [&](const KvLayerGroup&) { return static_cast<double>(free_blocks); });
  per_group("kvq_kv_blocks_cached", "Free KV blocks still holding a cached prefix (evictable).",
            [&](const KvLayerGroup&) { return static_cast<double>(cached); });
  per_group("kvq_kv_bytes_used", "Bytes of the KV blocks in use, for this group's layers.",
            [&](const KvLayerGroup& g) {
              return static_cast<double>(used) * static_cast<double>(g.bytes_per_block);
            });
  per_group("kvq_kv_bytes_free", "Bytes of the free KV blocks, for this group's layers.",
            [&](const KvLayerGroup& g) {
              return static_cast<double>(free_blocks) * static_cast<double>(g.bytes_per_block);
            });

  metric(out, "kvq_prompt_tokens_total", "counter", "Prompt tokens computed.",
         static_cast<double>(s.prompt_tokens_total));
  metric(out, "kvq_generation_tokens_total", "counter", "Tokens generated.",
         static_cast<double>(s.generation_tokens_total));
  metric(out, "kvq_prompt_tokens_per_second", "gauge",
         "Prompt tokens per second over the last 10 s.", prompt_rate.per_second());
  metric(out, "kvq_generation_tokens_per_second", "gauge",
         "Generated tokens per second over the last 10 s.", generation_rate.per_second());
  metric(out, "kvq_spec_decode_num_draft_tokens_total", "counter",
         "Draft tokens verified by speculative decoding.", static_cast<double>(s.spec.drafted));
  metric(out, "kvq_spec_decode_num_accepted_tokens_total", "counter",
         "Draft tokens accepted by speculative decoding.", static_cast<double>(s.spec.accepted));
  metric(out, "kvq_spec_decode_num_verify_steps_total", "counter",
         "Sequence-steps that verified at least one draft token.",
         static_cast<double>(s.spec.verify_steps));
  metric(out, "kvq_spec_decode_num_emitted_tokens_total", "counter",
         "Tokens produced by verify steps (accepted drafts plus the target's own).",
         static_cast<double>(s.spec.emitted));
  metric(out, "kvq_spec_decode_acceptance_rate", "gauge",
         "Accepted over drafted tokens since start (0 before any draft).", s.spec.acceptance_rate());
  metric(out, "kvq_spec_decode_mean_accepted_length", "gauge",
         "Tokens per verify step since start (accepted drafts + 1; 0 before any).",
         s.spec.mean_accepted_length());
  metric(out, "kvq_spec_decode_steps_without_drafts_total", "counter",
         "Engine steps that auto_disable ran without drafts (drafting did not pay).",
         static_cast<double>(s.spec_steps_skipped));
  metric(out, "kvq_engine_requests_finished_total", "counter", "Engine requests finished.",
         static_cast<double>(s.requests_finished));
  {
    std::lock_guard lk(mu_);
    header(out, "kvq_request_finished_total", "counter",
           "Engine requests finished, by finish reason.");
    for (const auto& [reason, n] : finished_)
      sample(out, "kvq_request_finished_total", "finish_reason=\"" + reason + "\"",
             static_cast<double>(n));
    header(out, "kvq_request_errors_total", "counter", "Requests refused, by HTTP status.");
    for (const auto& [status, n] : errors_)
      sample(out, "kvq_request_errors_total", "status=\"" + std::to_string(status) + "\"",
             static_cast<double>(n));
  }
  time_to_first_token.render(out, "kvq_time_to_first_token_seconds", "Time to first token.");
  inter_token_latency.render(out, "kvq_inter_token_latency_seconds",
                             "Time between tokens of a request.");
  request_latency.render(out, "kvq_request_latency_seconds", "Request arrival to last token.");
  return out;
}

}  // namespace kvq
