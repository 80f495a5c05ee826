// The fuzz targets in the ordinary build: every seed and regression input of the corpus
// (tests/fuzz/corpus/<target>/, copied next to this binary as fuzz_corpus/ by the build, or
// $KVQ_FUZZ_CORPUS), then random mutations of the seeds (fresh seed each run, printed). A
// target that throws anything but InputError / ApiError, trips a sanitizer or aborts fails.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "fuzz/targets.h"

namespace {

namespace fs = std::filesystem;

fs::path corpus_root() {
  if (const char* e = std::getenv("KVQ_FUZZ_CORPUS"); e != nullptr && *e != '\0') return e;
  return fs::read_symlink("/proc/self/exe").parent_path() / "fuzz_corpus";
}

std::vector<uint8_t> read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

uint32_t fresh_seed() {
  if (const char* e = std::getenv("KVQ_TEST_SEED"); e != nullptr && *e != '\0')
    return static_cast<uint32_t>(std::strtoul(e, nullptr, 10));
  return std::random_device{}();
}

class FuzzCorpus : public ::testing::TestWithParam<kvq::fuzz::Target> {
 protected:
  void SetUp() override {
    const fs::path tok = corpus_root() / "default_tokenizer.json";
    if (std::getenv("KVQ_FUZZ_TOKENIZER") == nullptr && fs::exists(tok))
      setenv("KVQ_FUZZ_TOKENIZER", tok.c_str(), 1);
  }
};

// Runs one input; anything that escapes the target is a finding.
void run_one(const kvq::fuzz::Target& t, const std::vector<uint8_t>& input,
             const std::string& what) {
  try {
    t.run(input);
  } catch (const std::exception& e) {
    ADD_FAILURE() << t.name << ": " << what << " threw " << e.what();
  } catch (...) {
    ADD_FAILURE() << t.name << ": " << what << " threw a non-std exception";
  }
}

TEST_P(FuzzCorpus, SeedsAndRegressionsAreHandled) {
  const kvq::fuzz::Target& t = GetParam();
  const fs::path dir = corpus_root() / std::string(t.name);
  ASSERT_TRUE(fs::is_directory(dir)) << dir << " is missing (set KVQ_FUZZ_CORPUS)";
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    run_one(t, read_file(e.path()), e.path().filename().string());
    ++n;
  }
  EXPECT_GE(n, 3) << "the corpus of " << t.name << " holds " << n << " inputs";
}

// A few hundred cheap mutations per seed (byte flips, insertions, deletions, truncation,
// splices of two seeds): not a fuzzer, but it runs in every CI build, sanitizers included.
TEST_P(FuzzCorpus, MutatedSeedsAreHandled) {
  const kvq::fuzz::Target& t = GetParam();
  const fs::path dir = corpus_root() / std::string(t.name);
  ASSERT_TRUE(fs::is_directory(dir));
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());  // directory order is not stable
  std::vector<std::vector<uint8_t>> seeds;
  for (const fs::path& f : files) seeds.push_back(read_file(f));
  ASSERT_FALSE(seeds.empty());
  const uint32_t seed = fresh_seed();
  std::mt19937 rng(seed);
  auto pick = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  const int per_seed = 300;
  for (size_t s = 0; s < seeds.size(); ++s) {
    for (int m = 0; m < per_seed; ++m) {
      std::vector<uint8_t> x = seeds[s];
      const int edits = 1 + static_cast<int>(pick(8));
      for (int e = 0; e < edits; ++e) {
        switch (pick(6)) {
          case 0:  // flip a bit
            if (!x.empty()) x[pick(x.size())] ^= static_cast<uint8_t>(1u << pick(8));
            break;
          case 1:  // a random byte
            if (!x.empty()) x[pick(x.size())] = static_cast<uint8_t>(pick(256));
            break;
          case 2:  // insert an interesting byte
            x.insert(x.begin() + static_cast<std::ptrdiff_t>(pick(x.size() + 1)),
                     std::array<uint8_t, 8>{0, 0xff, '"', '{', '[', ',', '-', '9'}[pick(8)]);
            break;
          case 3:  // delete a run
            if (!x.empty()) {
              const size_t at = pick(x.size());
              x.erase(
                  x.begin() + static_cast<std::ptrdiff_t>(at),
                  x.begin() + static_cast<std::ptrdiff_t>(std::min(x.size(), at + 1 + pick(16))));
            }
            break;
          case 4:  // truncate
            x.resize(pick(x.size() + 1));
            break;
          default: {  // splice: the head of this input and the tail of another seed
            const std::vector<uint8_t>& o = seeds[pick(seeds.size())];
            const size_t a = pick(x.size() + 1), b = pick(o.size() + 1);
            x.resize(a);
            x.insert(x.end(), o.begin() + static_cast<std::ptrdiff_t>(b), o.end());
            break;
          }
        }
      }
      run_one(t, x,
              "mutation " + std::to_string(m) + " of seed file " + std::to_string(s) +
                  " (KVQ_TEST_SEED=" + std::to_string(seed) + ")");
      if (HasFailure()) return;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, FuzzCorpus,
                         ::testing::ValuesIn(kvq::fuzz::targets().begin(),
                                             kvq::fuzz::targets().end()),
                         [](const ::testing::TestParamInfo<kvq::fuzz::Target>& p) {
                           return std::string(p.param.name);
                         });

}  // namespace
