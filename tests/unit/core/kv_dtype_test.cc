#include "kvq/core/kv_dtype.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "kvq/core/error.h"

namespace kvq {
namespace {

TEST(KvDtypeRegistry, EveryNameAndAliasRoundTrips) {
  std::set<std::string> seen;
  for (const auto& t : kKvDtypeTraits) {
    auto parsed = parse_kv_dtype(t.name);
    ASSERT_TRUE(parsed.has_value()) << t.name;
    EXPECT_EQ(*parsed, t.dtype);
    EXPECT_EQ(to_string(*parsed), t.name);
    EXPECT_TRUE(seen.insert(std::string(t.name)).second) << "duplicate name " << t.name;
    for (auto alias : t.aliases) {
      if (alias.empty()) continue;
      auto a = parse_kv_dtype(alias);
      ASSERT_TRUE(a.has_value()) << alias;
      EXPECT_EQ(*a, t.dtype) << alias;
      EXPECT_EQ(to_string(*a), t.name);
      EXPECT_TRUE(seen.insert(std::string(alias)).second) << "duplicate alias " << alias;
    }
  }
}

TEST(KvDtypeRegistry, VllmSpellingsMapToTheRightDtype) {
  const std::pair<const char*, KvDtype> cases[] = {
      {"auto", KvDtype::kAuto},
      {"float16", KvDtype::kFloat16},
      {"fp16", KvDtype::kFloat16},
      {"half", KvDtype::kFloat16},
      {"bfloat16", KvDtype::kBFloat16},
      {"bf16", KvDtype::kBFloat16},
      {"float32", KvDtype::kFloat32},
      {"fp32", KvDtype::kFloat32},
      {"fp8", KvDtype::kFp8E4M3},
      {"fp8_e4m3", KvDtype::kFp8E4M3},
      {"fp8_e5m2", KvDtype::kFp8E5M2},
      {"int8_per_token_head", KvDtype::kInt8PerTokenHead},
      {"fp8_per_token_head", KvDtype::kFp8PerTokenHead},
      {"int4_per_token_head", KvDtype::kInt4PerTokenHead},
      {"nvfp4", KvDtype::kNvfp4},
  };
  for (auto [name, want] : cases) {
    EXPECT_EQ(parse_kv_dtype_or_throw(name, "--kv-cache-dtype"), want) << name;
  }
}

TEST(KvDtypeRegistry, UnknownNamesAreRefusedWithTheAcceptedList) {
  for (const char* bad : {"fp9", "BF16", "", "int8", "fp8_e4m3 "}) {
    try {
      parse_kv_dtype_or_throw(bad, "--kv-cache-dtype");
      FAIL() << "accepted " << bad;
    } catch (const InputError& e) {
      std::string m = e.what();
      EXPECT_NE(m.find("--kv-cache-dtype"), std::string::npos) << m;
      EXPECT_NE(m.find("unknown KV cache dtype"), std::string::npos) << m;
      EXPECT_NE(m.find("bfloat16 (bf16)"), std::string::npos) << m;
      EXPECT_NE(m.find("nvfp4"), std::string::npos) << m;
      EXPECT_EQ(m.find('\n'), std::string::npos) << "one line: " << m;
    }
  }
}

TEST(KvDtypeRegistry, OtherEnginesNamesSayKvqDoesNotSupportThem) {
  for (const char* foreign : {"fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla", "turboquant_4bit"}) {
    try {
      parse_kv_dtype_or_throw(foreign, "-ctk");
      FAIL() << "accepted " << foreign;
    } catch (const InputError& e) {
      std::string m = e.what();
      EXPECT_NE(m.find("kvq does not support"), std::string::npos) << m;
      EXPECT_NE(m.find(foreign), std::string::npos) << m;
      EXPECT_NE(m.find("fp8_e5m2"), std::string::npos) << m;
    }
  }
}

TEST(KvDtypeTraits, StorageBytesFollowTheFormats) {
  EXPECT_EQ(row_data_bytes(KvDtype::kBFloat16, 128), 256u);
  EXPECT_EQ(row_data_bytes(KvDtype::kFloat32, 128), 512u);
  EXPECT_EQ(row_data_bytes(KvDtype::kFp8E4M3, 128), 128u);
  EXPECT_EQ(row_data_bytes(KvDtype::kInt8PerTokenHead, 128) + row_scale_bytes(KvDtype::kInt8PerTokenHead), 132u);
  EXPECT_EQ(row_data_bytes(KvDtype::kInt4PerTokenHead, 128) + row_scale_bytes(KvDtype::kInt4PerTokenHead), 68u);
  // 64 bytes of fp4 values + 8 e4m3 block scales
  EXPECT_EQ(row_data_bytes(KvDtype::kNvfp4, 128), 72u);
  for (const auto& t : kKvDtypeTraits) {
    if (!t.concrete) continue;
    // bits per value times 128 values is the value payload; scales come on top.
    EXPECT_GE(row_data_bytes(t.dtype, 128) * 8, static_cast<size_t>(t.bits) * 128) << t.name;
  }
}

TEST(KvDtypeTraits, HeadDimRules) {
  EXPECT_TRUE(head_dim_unsupported_reason(KvDtype::kInt4PerTokenHead, 128).empty());
  EXPECT_NE(head_dim_unsupported_reason(KvDtype::kInt4PerTokenHead, 96).find("power of two"),
            std::string::npos);
  EXPECT_NE(head_dim_unsupported_reason(KvDtype::kNvfp4, 8).find("multiple"), std::string::npos);
  EXPECT_TRUE(head_dim_unsupported_reason(KvDtype::kFp8E4M3, 8).empty());
  EXPECT_TRUE(head_dim_unsupported_reason(KvDtype::kBFloat16, 80).empty());
}

}  // namespace
}  // namespace kvq
