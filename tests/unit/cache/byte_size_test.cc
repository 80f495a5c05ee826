#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "cache_test_util.h"
#include "kvq/cache/paged_kv_cache.h"
#include "kvq/core/error.h"

namespace kvq {
namespace {

TEST(ParseByteSize, AcceptsNumbersWithUnits) {
  constexpr size_t K = 1000, Ki = 1024;
  const std::vector<std::pair<std::string, size_t>> good = {
      {"123", 123},
      {"1", 1},
      {"0123", 123},
      {"7B", 7},
      {"7 B", 7},
      {"2KB", 2 * K},
      {"2kb", 2 * K},
      {"3MB", 3 * K * K},
      {"2GB", 2 * K * K * K},
      {"2 gb", 2 * K * K * K},
      {"1TB", K * K * K * K},
      {"64KiB", 64 * Ki},
      {"512MiB", 512 * Ki * Ki},
      {"4GiB", 4 * Ki * Ki * Ki},
      {"4 GiB", 4 * Ki * Ki * Ki},
      {"  4GiB ", 4 * Ki * Ki * Ki},
      {"2TiB", 2 * Ki * Ki * Ki * Ki},
      {"1.5GiB", 3 * Ki * Ki * Ki / 2},
      {"0.5KiB", 512},
      {"1.25KB", 1250},
      {"1.50000000000000000000000000000GiB", 3 * Ki * Ki * Ki / 2},
      {"0.001KiB", 1},  // 1.024 bytes, rounded down
      {"2.5", 2},
      {"16000000TiB", 16000000 * Ki * Ki * Ki * Ki},
      {"18446744073709551615", 18446744073709551615ull},
  };
  for (const auto& [text, want] : good) EXPECT_EQ(parse_byte_size(text, "--x"), want) << text;
}

TEST(ParseByteSize, RejectsBadInputWithTheAcceptedForms) {
  const std::vector<std::string> bad = {"",
                                        " ",
                                        "0",
                                        "0GiB",
                                        "0.0MiB",
                                        "0.4B",
                                        "-1",
                                        "-4GiB",
                                        "+4GiB",
                                        "GiB",
                                        "4 G",
                                        "4GIB",
                                        "4gib",
                                        "4Gib",
                                        "4KIB",
                                        "4iB",
                                        "4GiBs",
                                        "4 GiB extra",
                                        "1e9",
                                        "1.",
                                        ".5GiB",
                                        "1..5GiB",
                                        "1.5.GiB",
                                        "4,096",
                                        "0x10",
                                        "abc",
                                        "4 4GiB",
                                        "nan",
                                        "17000000TiB",
                                        "18446744073709551616",
                                        "99999999999999999999999999999"};
  for (const std::string& text : bad) {
    try {
      parse_byte_size(text, "--kv-cache-memory");
      ADD_FAILURE() << "accepted '" << text << "'";
    } catch (const InputError& e) {
      EXPECT_EQ(std::string(e.what()),
                "--kv-cache-memory: cannot parse '" + text +
                    "' as a byte size; accepted: a number with an optional unit B, KB, MB, GB, "
                    "TB, KiB, MiB, GiB, TiB (e.g. 4GiB)");
    }
  }
}

TEST(BlocksForBudget, SumsEachLayersOwnBlockBytes) {
  const unsigned seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937 rng(seed);
  const int bt = 16;
  const std::vector<LayerKvSpec> specs = {
      test::make_spec(0, KvDtype::kBFloat16, KvDtype::kBFloat16, 8, 128, 128, bt),
      test::make_spec(1, KvDtype::kFp8E4M3, KvDtype::kFp8E5M2, 8, 128, 128, bt),
      test::make_spec(2, KvDtype::kInt4PerTokenHead, KvDtype::kNvfp4, 8, 128, 128, bt),
      test::make_spec(3, KvDtype::kInt8PerTokenHead, KvDtype::kFloat32, 4, 64, 96, bt),
  };
  size_t per_block = 0;
  for (const auto& s : specs) per_block += s.block_bytes();
  // Not padded: the sum is less than the largest layer times the layer count.
  ASSERT_LT(per_block, specs.size() * specs[0].block_bytes());
  for (int i = 0; i < 200; ++i) {
    const size_t budget = std::uniform_int_distribution<size_t>(0, size_t{1} << 40)(rng);
    EXPECT_EQ(blocks_for_budget(specs, budget), static_cast<int64_t>(budget / per_block))
        << "budget " << budget;
  }
  EXPECT_EQ(blocks_for_budget(specs, per_block - 1), 0);
  EXPECT_EQ(blocks_for_budget(specs, per_block), 1);
  EXPECT_EQ(blocks_for_budget(specs, 5 * per_block + per_block / 2), 5);
  EXPECT_EQ(blocks_for_budget(std::span(specs).subspan(2, 1), 3 * specs[2].block_bytes()), 3);
}

TEST(BlocksForBudget, MixedBlockTokensIsAnInternalError) {
  auto a = test::make_spec(0, KvDtype::kBFloat16, KvDtype::kBFloat16, 2, 64, 64, 16);
  auto b = test::make_spec(1, KvDtype::kBFloat16, KvDtype::kBFloat16, 2, 64, 64, 32);
  const std::vector<LayerKvSpec> specs = {a, b};
  EXPECT_THROW(blocks_for_budget(specs, size_t{1} << 30), InternalError);
  EXPECT_THROW(blocks_for_budget({}, size_t{1} << 30), InternalError);
}

}  // namespace
}  // namespace kvq
