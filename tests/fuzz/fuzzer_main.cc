// libFuzzer entry point of one target of targets.h (KVQ_FUZZ_TARGET names it); built only in
// the fuzz build (clang, -DKVQ_FUZZ=ON: scripts/fuzz.sh, `make fuzz`).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "fuzz/targets.h"

namespace {

const kvq::fuzz::Target& target() {
  static const kvq::fuzz::Target* t = [] {
    for (const kvq::fuzz::Target& c : kvq::fuzz::targets())
      if (c.name == std::string_view(KVQ_FUZZ_TARGET)) return &c;
    std::fprintf(stderr, "no fuzz target named %s\n", KVQ_FUZZ_TARGET);
    std::abort();
  }();
  return *t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  target().run({data, size});
  return 0;
}
