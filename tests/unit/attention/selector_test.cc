// The backend registry, reasons_unsupported, run()'s guard and the selector.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "attention_harness.h"
#include "kvq/attention/backend.h"
#include "kvq/attention/support_matrix.h"
#include "kvq/core/error.h"

namespace kvq {
namespace {

// Where `needle` is missing, the failure shows the whole message.
::testing::AssertionResult mentions(const std::string& message, const std::string& needle) {
  if (message.find(needle) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << needle << "' not in: " << message;
}

// stories260K's attention: 8 query heads, 4 kv heads, head_dim 8.
LayerKvSpec tiny_spec(int head_dim = 8) {
  test::AttnCase c;
  c.head_dim_k = c.head_dim_v = head_dim;
  c.num_kv_heads = 4;
  c.ratio = 2;
  return test::spec_for(c);
}

bool has_reason(const std::vector<std::string>& reasons, const std::string& needle) {
  return std::any_of(reasons.begin(), reasons.end(),
                     [&](const std::string& r) { return r.find(needle) != std::string::npos; });
}

const std::vector<std::string>* passed_over_reasons(const BackendChoice& c,
                                                    const std::string& name) {
  for (const auto& [n, reasons] : c.passed_over)
    if (n == name) return &reasons;
  return nullptr;
}

template <typename T>
bool contains(const std::vector<T>& v, const T& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

TEST(AttentionRegistry, PriorityOrderUniqueNamesAndLookup) {
  const auto all = all_attention_backends();
  ASSERT_GE(all.size(), 2u);
  std::set<std::string> names;
  for (size_t i = 0; i < all.size(); ++i) {
    EXPECT_TRUE(names.insert(std::string(all[i]->name())).second) << all[i]->name();
    EXPECT_EQ(find_attention_backend(all[i]->name()), all[i]);
    if (i > 0) {
      EXPECT_GE(all[i - 1]->capabilities().priority, all[i]->capabilities().priority)
          << all[i - 1]->name() << " is listed before " << all[i]->name();
    }
    for (const auto& [k, v] : all[i]->capabilities().kv_dtype_pairs) {
      EXPECT_TRUE(traits(k).concrete && traits(k).valid_as_k) << to_string(k);
      EXPECT_TRUE(traits(v).concrete && traits(v).valid_as_v) << to_string(v);
    }
  }
  EXPECT_TRUE(names.count("cpu_reference"));
  EXPECT_TRUE(names.count("cpu_avx512"));
  EXPECT_EQ(find_attention_backend("flash_attn"), nullptr);
  EXPECT_EQ(find_attention_backend(""), nullptr);
}

TEST(AttentionSelector, HeadDim8FallsBackToReferenceWithTheReasonShown) {
  const BackendChoice c = select_attention_backend(tiny_spec(), Device::kCpu);
  ASSERT_NE(c.backend, nullptr);
  EXPECT_EQ(c.backend->name(), "cpu_reference");
  const auto* reasons = passed_over_reasons(c, "cpu_avx512");
  ASSERT_NE(reasons, nullptr);
  EXPECT_TRUE(has_reason(*reasons, "head_dim 8 not in {64, 128, 256}"));
}

TEST(AttentionSelector, HeadDim128PicksAvx512AndPassesOverReferenceAsLowerPriority) {
  const BackendChoice c = select_attention_backend(tiny_spec(128), Device::kCpu);
  ASSERT_NE(c.backend, nullptr);
  EXPECT_EQ(c.backend->name(), "cpu_avx512");
  const auto* reasons = passed_over_reasons(c, "cpu_reference");
  ASSERT_NE(reasons, nullptr);
  EXPECT_EQ(*reasons, std::vector<std::string>{"lower priority"});
}

TEST(AttentionSelector, ForcingABackendThatCannotRunGivesItsReasons) {
  try {
    select_attention_backend(tiny_spec(), Device::kCpu, "cpu_avx512");
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    const std::string m = e.what();
    EXPECT_TRUE(mentions(m, "--attention-backend cpu_avx512 cannot run layer 3"));
    EXPECT_TRUE(mentions(m, "head_dim 8 not in {64, 128, 256}"));
  }
  // Forcing one that can run is honoured even if a higher-priority one could too.
  const BackendChoice c = select_attention_backend(tiny_spec(128), Device::kCpu, "cpu_reference");
  EXPECT_EQ(c.backend->name(), "cpu_reference");
}

TEST(AttentionSelector, UnknownForcedNameListsValidNames) {
  try {
    select_attention_backend(tiny_spec(128), Device::kCpu, "flashinfer");
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    const std::string m = e.what();
    EXPECT_TRUE(mentions(m, "'flashinfer'"));
    for (const AttentionBackend* b : all_attention_backends())
      EXPECT_TRUE(mentions(m, std::string(b->name())));
  }
}

TEST(AttentionSelector, NoCandidateListsEveryBackendsReasonsOnOneLine) {
  LayerKvSpec spec = tiny_spec(128);
  spec.block_tokens = 8;          // avx512 refuses
  spec.k_dtype = KvDtype::kAuto;  // nobody can run an unresolved dtype
  try {
    select_attention_backend(spec, Device::kCpu);
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    EXPECT_TRUE(mentions(m, "cpu_avx512: "));
    EXPECT_TRUE(mentions(m, "cpu_reference: "));
    EXPECT_TRUE(mentions(m, "block_tokens 8 not in {16, 32}"));
    EXPECT_TRUE(mentions(m, "unresolved"));
  }
  // No CUDA backend is built into this test binary's registry for a CPU-only build: asking
  // for cuda either finds one or says why each CPU backend does not qualify.
  try {
    const BackendChoice c = select_attention_backend(tiny_spec(128), Device::kCuda);
    EXPECT_EQ(c.backend->capabilities().device, Device::kCuda);
  } catch (const InputError& e) {
    EXPECT_TRUE(mentions(std::string(e.what()), "runs on cpu, not cuda"));
  }
}

// A backend with narrow whitelists, to check reasons_unsupported itself.
class NarrowBackend final : public AttentionBackend {
 public:
  NarrowBackend() {
    caps_.kv_dtype_pairs = {{KvDtype::kBFloat16, KvDtype::kBFloat16},
                            {KvDtype::kFp8E4M3, KvDtype::kFp8E4M3}};
    caps_.head_dims = {64, 128};
    caps_.block_tokens = {16};
    caps_.attention_kinds = {AttentionKind::kCausal};
    caps_.gqa_ratios = {1, 4};
  }
  std::string_view name() const override { return "narrow"; }
  const AttentionCapabilities& capabilities() const override { return caps_; }
  mutable int runs = 0;

 protected:
  std::vector<std::string> extra_reasons(const LayerKvSpec& spec) const override {
    if (spec.num_kv_heads > 8) return {"more than 8 kv heads"};
    return {};
  }
  void run_impl(const LayerKvSpec&, const AttentionArgs&) const override { ++runs; }

 private:
  AttentionCapabilities caps_;
};

TEST(AttentionBackendReasons, EveryFailingWhitelistIsOneReasonNamingValueAndAccepted) {
  NarrowBackend b;
  test::AttnCase c;
  c.k = KvDtype::kInt4PerTokenHead;
  c.v = KvDtype::kBFloat16;
  c.head_dim_k = 32;
  c.head_dim_v = 256;
  c.block_tokens = 32;
  c.kind = AttentionKind::kSlidingWindow;
  c.window = 4;
  c.ratio = 2;
  c.num_kv_heads = 16;
  const auto reasons = b.reasons_unsupported(test::spec_for(c));
  EXPECT_EQ(reasons.size(), 7u);
  EXPECT_TRUE(has_reason(reasons,
                         "(K, V) dtypes (int4_per_token_head, bfloat16) not supported; "
                         "accepts (K, V) in {(bfloat16, bfloat16), (fp8_e4m3, fp8_e4m3)}"));
  EXPECT_TRUE(has_reason(reasons, "K head_dim 32 not in {64, 128}"));
  EXPECT_TRUE(has_reason(reasons, "V head_dim 256 not in {64, 128}"));
  EXPECT_TRUE(has_reason(reasons, "block_tokens 32 not in {16}"));
  EXPECT_TRUE(has_reason(reasons, "attention kind sliding_window not in {causal}"));
  EXPECT_TRUE(has_reason(reasons, "GQA ratio 2 not in {1, 4}"));
  EXPECT_TRUE(has_reason(reasons, "more than 8 kv heads"));

  EXPECT_TRUE(
      has_reason(b.reasons_unsupported(test::spec_for(c), Device::kCuda), "runs on cpu, not cuda"));
  test::AttnCase ok;
  ok.ratio = 4;
  EXPECT_TRUE(b.reasons_unsupported(test::spec_for(ok)).empty());
  EXPECT_TRUE(b.reasons_unsupported(test::spec_for(ok), Device::kCpu).empty());
}

TEST(AttentionBackendRun, RefusesSpecsItDidNotWhitelist) {
  // A real, consistent problem whose spec cpu_avx512 does not accept (head_dim 8).
  test::AttnCase c;
  c.head_dim_k = c.head_dim_v = 8;
  c.seqs = {{5, 1}};
  test::AttnProblem problem(c, test::fresh_seed());
  const AttentionBackend* avx = find_attention_backend("cpu_avx512");
  EXPECT_THROW(avx->run(problem.spec(), problem.args()), InternalError);
  EXPECT_NO_THROW(find_attention_backend("cpu_reference")->run(problem.spec(), problem.args()));

  NarrowBackend narrow;
  test::AttnCase wide;
  wide.ratio = 2;  // not in {1, 4}
  wide.seqs = {{5, 1}};
  test::AttnProblem p2(wide, test::fresh_seed());
  EXPECT_THROW(narrow.run(p2.spec(), p2.args()), InternalError);
  EXPECT_EQ(narrow.runs, 0);
}

TEST(AttentionBackendRun, RefusesArgumentsOfAnotherLayer) {
  test::AttnCase c;
  c.k = c.v = KvDtype::kFp8E4M3;
  c.seqs = {{20, 2}};
  test::AttnProblem problem(c, test::fresh_seed());
  const AttentionBackend* ref = find_attention_backend("cpu_reference");
  LayerKvSpec other = problem.spec();
  other.k_dtype = KvDtype::kBFloat16;  // the cache holds fp8: a spec of another layer
  EXPECT_THROW(ref->run(other, problem.args()), InternalError);

  AttentionArgs bad_block = problem.args();
  std::vector<int32_t> indices = {999, 0};
  bad_block.block_table.indices = indices.data();
  EXPECT_THROW(ref->run(problem.spec(), bad_block), InternalError);
}

// Property: over random specs the selector only ever hands out a backend whose whitelists
// (checked here independently) contain the spec, and always the highest-priority one.
TEST(AttentionSelector, NeverHandsABackendASpecOutsideItsWhitelist) {
  const unsigned seed = test::fresh_seed();
  std::mt19937 rng(seed);
  auto pick = [&](auto const& v) {
    return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)];
  };
  const std::vector<int> dims = {8, 16, 48, 64, 128, 256};
  const std::vector<int> blocks = {8, 16, 32};
  const std::vector<int> ratios = {1, 2, 3, 4, 8};
  std::vector<KvDtype> dtypes;
  for (const auto& t : kKvDtypeTraits)
    if (t.concrete) dtypes.push_back(t.dtype);
  const std::vector<AttentionKind> kinds = {AttentionKind::kCausal, AttentionKind::kSlidingWindow,
                                            AttentionKind::kNonCausal};
  for (int iter = 0; iter < 500; ++iter) {
    test::AttnCase c;
    c.k = pick(dtypes);
    c.v = pick(dtypes);
    c.head_dim_k = c.head_dim_v = pick(dims);
    c.block_tokens = pick(blocks);
    c.ratio = pick(ratios);
    c.kind = pick(kinds);
    c.window = 16;
    const LayerKvSpec spec = test::spec_for(c);
    const bool storable = spec.validation_errors().empty();
    auto accepts = [&](const AttentionBackend& b) {
      const AttentionCapabilities& caps = b.capabilities();
      auto in = [](const std::vector<int>& w, int x) { return w.empty() || contains(w, x); };
      return storable && caps.device == Device::kCpu &&
             contains(caps.kv_dtype_pairs, std::pair{spec.k_dtype, spec.v_dtype}) &&
             in(caps.head_dims, spec.head_dim_k) && in(caps.head_dims, spec.head_dim_v) &&
             in(caps.block_tokens, spec.block_tokens) &&
             contains(caps.attention_kinds, spec.attention) &&
             in(caps.gqa_ratios, spec.gqa_ratio());
    };
    const AttentionBackend* want = nullptr;
    for (const AttentionBackend* b : all_attention_backends()) {
      EXPECT_EQ(b->reasons_unsupported(spec, Device::kCpu).empty(), accepts(*b))
          << b->name() << " on " << c.describe() << ", seed " << seed;
      if (!want && accepts(*b)) want = b;
    }
    if (want) {
      const BackendChoice choice = select_attention_backend(spec, Device::kCpu);
      EXPECT_EQ(choice.backend, want) << c.describe() << ", seed " << seed;
      EXPECT_EQ(choice.passed_over.size(), all_attention_backends().size() - 1);
    } else {
      EXPECT_THROW(select_attention_backend(spec, Device::kCpu), InputError)
          << c.describe() << ", seed " << seed;
    }
  }
}

TEST(AttentionSupportMatrix, ListsEveryBackendWithItsWhitelists) {
  const nlohmann::json j = attention_support_matrix_json();
  ASSERT_TRUE(j.contains("backends"));
  const auto all = all_attention_backends();
  ASSERT_EQ(j["backends"].size(), all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    const auto& b = j["backends"][i];
    const AttentionCapabilities& caps = all[i]->capabilities();
    EXPECT_EQ(b["name"], std::string(all[i]->name()));
    EXPECT_EQ(b["device"], std::string(to_string(caps.device)));
    EXPECT_EQ(b["priority"], caps.priority);
    EXPECT_EQ(b["kv_dtype_pairs"].size(), caps.kv_dtype_pairs.size());
    const nlohmann::json dims =
        caps.head_dims.empty() ? nlohmann::json("any") : nlohmann::json(caps.head_dims);
    EXPECT_EQ(b["head_dims"], dims);
  }

  const std::vector<std::string> lines = attention_support_matrix_lines();
  for (const AttentionBackend* b : all) {
    const std::string prefix = std::string(b->name()) + " (" +
                               std::string(to_string(b->capabilities().device)) + ", priority ";
    EXPECT_TRUE(std::any_of(lines.begin(), lines.end(), [&](const std::string& l) {
      return l.rfind(prefix, 0) == 0;
    })) << b->name();
  }
  EXPECT_TRUE(has_reason(lines, "head_dim:     {64, 128, 256}"));
}

}  // namespace
}  // namespace kvq
