// kvq against the Hugging Face tokenizers library on random texts and random id lists, for
// hand-written tokenizer.json configurations that exercise each supported component
// (hf_fuzz_goldens.json, made by make_hf_fuzz_goldens.py).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kvq/tokenizer/tokenizer.h"
#include "support/source_dir.h"
#include "tokenizer/utf8.h"

namespace kvq {
namespace {

TEST(HfFuzzGoldens, EveryConfigurationMatchesHuggingFace) {
  const std::string path = ::kvq::test::source_dir() + "/tests/unit/tokenizer/hf_fuzz_goldens.json";
  std::ifstream f(path);
  ASSERT_TRUE(f) << path;
  const nlohmann::json g = nlohmann::json::parse(f);
  const auto& texts = g["texts"];
  const auto& id_lists = g["id_lists"];
  ASSERT_GT(g["configs"].size(), 5u);
  size_t checked = 0;
  for (const auto& [name, cfg] : g["configs"].items()) {
    std::optional<Tokenizer> t;
    if (cfg.contains("tokenizer")) {
      t.emplace(Tokenizer::from_json(cfg["tokenizer"].dump(), name));
    } else {
      const std::string dir = ::kvq::test::source_dir() + "/" + cfg["model_dir"].get<std::string>();
      if (!std::filesystem::exists(dir + "/tokenizer.json")) {
        std::cout << "[skip] " << name << ": " << dir << " is absent\n";
        continue;
      }
      t.emplace(Tokenizer::load(dir));
    }
    const auto& r = g["results"][name];
    size_t bad = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
      const std::string s = texts[i];
      const auto ids = t->encode(s, false);
      const auto ids_special = t->encode(s, true);
      bad += ids != r["enc"][i].get<std::vector<int32_t>>();
      bad += ids_special != r["enc_special"][i].get<std::vector<int32_t>>();
      EXPECT_EQ(ids, r["enc"][i].get<std::vector<int32_t>>()) << name << " text " << texts[i];
    }
    for (size_t i = 0; i < id_lists.size(); ++i) {
      const auto ids = id_lists[i].get<std::vector<int32_t>>();
      for (bool skip : {false, true}) {
        const auto& want = r[skip ? "dec_skip" : "dec"][i];
        if (want.is_null()) continue;
        const std::string got = t->decode(ids, skip);
        EXPECT_EQ(got, want.get<std::string>()) << name << " ids " << id_lists[i];
        StreamingDecoder sd(*t, skip);
        std::string streamed;
        for (int32_t id : ids) {
          const std::string piece = sd.push(id);
          EXPECT_TRUE(tok::utf8_valid(piece)) << name;
          streamed += piece;
        }
        streamed += sd.finish();
        EXPECT_EQ(streamed, got) << name << " ids " << id_lists[i] << " skip " << skip;
        bad += got != want.get<std::string>() || streamed != got;
      }
    }
    EXPECT_EQ(bad, 0u) << name;
    ++checked;
  }
  std::cout << "[hf-fuzz] " << checked << " configurations x " << texts.size() << " texts and "
            << id_lists.size() << " id lists checked against tokenizers "
            << g["tokenizers_version"].get<std::string>() << "\n";
}

}  // namespace
}  // namespace kvq
