// Compares kvq's tokenizer with ids and text produced by the Hugging Face `tokenizers` library
// (tests/fixtures/goldens/tokenizer_<model>.json, written by tools/make_goldens.py).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/tokenizer/tokenizer.h"
#include "support/source_dir.h"
#include "tokenizer/utf8.h"

namespace kvq {
namespace {

struct GoldenModel {
  const char* name;
  std::string dir;
};

std::vector<GoldenModel> golden_models() {
  return {{"kvq-code-tiny", ::kvq::test::source_dir() + "/models/kvq-code-tiny"},
          {"stories260K", ::kvq::test::source_dir() + "/../shared/models/stories260K"}};
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return nlohmann::json::parse(ss.str());
}

std::string golden_path(const GoldenModel& m) {
  return ::kvq::test::source_dir() + "/tests/fixtures/goldens/tokenizer_" + m.name + ".json";
}

bool available(const GoldenModel& m, std::string& why) {
  if (!std::filesystem::exists(m.dir + "/tokenizer.json")) {
    why = m.dir + "/tokenizer.json is absent";
    return false;
  }
  if (!std::filesystem::exists(golden_path(m))) {
    why = golden_path(m) + " is absent";
    return false;
  }
  return true;
}

class GoldenTest : public ::testing::TestWithParam<GoldenModel> {};

TEST_P(GoldenTest, EncodeAndDecodeMatchHuggingFaceExactly) {
  const GoldenModel& m = GetParam();
  std::string why;
  if (!available(m, why)) GTEST_SKIP() << why;
  const Tokenizer t = Tokenizer::load(m.dir);
  const nlohmann::json g = read_json(golden_path(m));
  ASSERT_GT(g["cases"].size(), 0u);
  size_t exact = 0;
  for (const auto& c : g["cases"]) {
    const std::string name = c["name"].get<std::string>();
    const std::string text = c["text"].get<std::string>();
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    const auto with_special = c["ids_with_special"].get<std::vector<int32_t>>();
    const auto got = t.encode(text, false);
    const auto got_special = t.encode(text, true);
    const std::string dec = t.decode(ids, false);
    const std::string dec_skip = t.decode(ids, true);
    EXPECT_EQ(got, ids) << m.name << " case " << name;
    EXPECT_EQ(got_special, with_special) << m.name << " case " << name;
    EXPECT_EQ(dec, c["decoded"].get<std::string>()) << m.name << " case " << name;
    EXPECT_EQ(dec_skip, c["decoded_skip_special"].get<std::string>()) << m.name << " case " << name;
    exact += got == ids && got_special == with_special && dec == c["decoded"] &&
             dec_skip == c["decoded_skip_special"];
  }
  std::cout << "[golden] " << m.name << ": " << exact << "/" << g["cases"].size()
            << " cases match exactly\n";
}

TEST_P(GoldenTest, StreamingDecodeEqualsDecodeAndIsValidUtf8) {
  const GoldenModel& m = GetParam();
  std::string why;
  if (!available(m, why)) GTEST_SKIP() << why;
  const Tokenizer t = Tokenizer::load(m.dir);
  const nlohmann::json g = read_json(golden_path(m));
  for (const auto& c : g["cases"]) {
    const auto ids = c["ids_with_special"].get<std::vector<int32_t>>();
    for (bool skip : {false, true}) {
      StreamingDecoder sd(t, skip);
      std::string all;
      for (int32_t id : ids) {
        const std::string piece = sd.push(id);
        EXPECT_TRUE(tok::utf8_valid(piece)) << c["name"] << " id " << id;
        all += piece;
      }
      const std::string tail = sd.finish();
      EXPECT_TRUE(tok::utf8_valid(tail));
      all += tail;
      EXPECT_EQ(all, t.decode(ids, skip)) << m.name << " case " << c["name"] << " skip " << skip;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, GoldenTest, ::testing::ValuesIn(golden_models()),
                         [](const auto& param_info) {
                           std::string n = param_info.param.name;
                           for (char& ch : n) {
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return n;
                         });

}  // namespace
}  // namespace kvq
