// Wall-clock timers for the parts of the CPU forward pass, compiled in only with
// -DKVQ_PROFILE=ON (cmake): KVQ_PROFILE_SCOPE("name") adds the enclosing scope's time to
// "name"; at exit a table (total ms, calls, us per call, share) goes to stderr. Off by
// default: the macro expands to nothing. Used for docs/notes/cpu-decode-profile.md.
#pragma once

#if KVQ_PROFILE
#include <chrono>
#include <cstdint>

namespace kvq::profile {

// The accumulator of `name` (one per distinct string literal, created on first use).
struct Counter {
  int64_t ns = 0;
  int64_t calls = 0;
};
Counter& counter(const char* name);

class Scope {
 public:
  explicit Scope(Counter& c) : c_(c), t0_(std::chrono::steady_clock::now()) {}
  ~Scope() {
    c_.ns +=
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_)
            .count();
    ++c_.calls;
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Counter& c_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace kvq::profile

#define KVQ_PROFILE_CAT2(a, b) a##b
#define KVQ_PROFILE_CAT(a, b) KVQ_PROFILE_CAT2(a, b)
#define KVQ_PROFILE_SCOPE(name)                                                     \
  static thread_local ::kvq::profile::Counter& KVQ_PROFILE_CAT(kvq_pc_, __LINE__) = \
      ::kvq::profile::counter(name);                                                \
  ::kvq::profile::Scope KVQ_PROFILE_CAT(kvq_ps_, __LINE__)(KVQ_PROFILE_CAT(kvq_pc_, __LINE__))
#else
#define KVQ_PROFILE_SCOPE(name) \
  do {                          \
  } while (false)
#endif
