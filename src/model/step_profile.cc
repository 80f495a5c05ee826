#include "model/step_profile.h"

#if KVQ_PROFILE
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace kvq::profile {

namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, std::unique_ptr<Counter>> counters;
  ~Registry() {
    int64_t total = 0;
    for (const auto& [name, c] : counters) total += c->ns;
    std::fprintf(stderr, "kvq profile (KVQ_PROFILE build): %-24s %10s %10s %10s %6s\n", "part",
                 "total ms", "calls", "us/call", "share");
    for (const auto& [name, c] : counters)
      std::fprintf(stderr, "kvq profile (KVQ_PROFILE build): %-24s %10.1f %10lld %10.2f %5.1f%%\n",
                   name.c_str(), c->ns / 1e6, static_cast<long long>(c->calls),
                   c->calls ? c->ns / 1e3 / static_cast<double>(c->calls) : 0.0,
                   total ? 100.0 * static_cast<double>(c->ns) / static_cast<double>(total) : 0.0);
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

Counter& counter(const char* name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto& c = r.counters[name];
  if (!c) c = std::make_unique<Counter>();
  return *c;
}

}  // namespace kvq::profile
#endif
