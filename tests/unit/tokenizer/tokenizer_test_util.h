// Small tokenizer.json files built by the tests, whose outputs can be worked out by hand.
#pragma once

#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kvq/tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace kvq::test {

// The GPT-2 byte-level character of byte b.
inline std::string bl(uint8_t b) {
  return tok::byte_level_map().byte_to_char[b];
}

// A byte-level BPE: ids 0..255 are the 256 byte characters (id == byte value), then one id per
// merge result in merge order (id 256 + rank). Merges are given on raw text ("a", "b") and
// written in byte-level form.
inline nlohmann::json byte_level_bpe(const std::vector<std::pair<std::string, std::string>>& merges,
                                     bool merges_as_pairs = true) {
  auto to_bl = [](const std::string& s) {
    std::string out;
    for (char c : s) out += bl(static_cast<uint8_t>(c));
    return out;
  };
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[bl(static_cast<uint8_t>(b))] = b;
  nlohmann::json m = nlohmann::json::array();
  int next = 256;
  for (const auto& [a, b] : merges) {
    const std::string merged = to_bl(a + b);
    if (!vocab.contains(merged)) vocab[merged] = next++;
    if (merges_as_pairs) {
      m.push_back({to_bl(a), to_bl(b)});
    } else {
      m.push_back(to_bl(a) + " " + to_bl(b));
    }
  }
  nlohmann::json j;
  j["version"] = "1.0";
  j["added_tokens"] = nlohmann::json::array();
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "ByteLevel"},
                        {"add_prefix_space", false},
                        {"trim_offsets", true},
                        {"use_regex", true}};
  j["post_processor"] = nullptr;
  j["decoder"] = {{"type", "ByteLevel"},
                  {"add_prefix_space", true},
                  {"trim_offsets", true},
                  {"use_regex", true}};
  j["model"] = {{"type", "BPE"},     {"dropout", nullptr},     {"unk_token", nullptr},
                {"fuse_unk", false}, {"byte_fallback", false}, {"vocab", vocab},
                {"merges", m}};
  return j;
}

inline nlohmann::json added_token(int id, const std::string& content, bool special,
                                  bool lstrip = false, bool rstrip = false) {
  return {{"id", id},         {"content", content},     {"single_word", false}, {"lstrip", lstrip},
          {"rstrip", rstrip}, {"normalized", !special}, {"special", special}};
}

// A Llama-2 style sentencepiece BPE: <unk>=0 <s>=1 </s>=2, <0x00>..<0xFF> = 3..258, then the
// characters of `chars` and the merge results. Normalizer Prepend("▁") + Replace(" ", "▁"),
// decoder Replace/ByteFallback/Fuse/Strip, TemplateProcessing [<s>, $A].
inline nlohmann::json sentencepiece_bpe(
    const std::vector<std::string>& chars,
    const std::vector<std::pair<std::string, std::string>>& merges) {
  nlohmann::json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  int next = 3;
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    vocab[name] = next++;
  }
  for (const std::string& c : chars) {
    if (!vocab.contains(c)) vocab[c] = next++;
  }
  nlohmann::json m = nlohmann::json::array();
  for (const auto& [a, b] : merges) {
    if (!vocab.contains(a + b)) vocab[a + b] = next++;
    m.push_back(a + " " + b);
  }
  const std::string sp = "\xE2\x96\x81";
  nlohmann::json j;
  j["version"] = "1.0";
  j["added_tokens"] = {added_token(0, "<unk>", true), added_token(1, "<s>", true),
                       added_token(2, "</s>", true)};
  j["normalizer"] = {{"type", "Sequence"},
                     {"normalizers",
                      {{{"type", "Prepend"}, {"prepend", sp}},
                       {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", sp}}}}};
  j["pre_tokenizer"] = nullptr;
  j["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single",
       {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
        {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
      {"pair", nlohmann::json::array()},
      {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}};
  j["decoder"] = {{"type", "Sequence"},
                  {"decoders",
                   {{{"type", "Replace"}, {"pattern", {{"String", sp}}}, {"content", " "}},
                    {{"type", "ByteFallback"}},
                    {{"type", "Fuse"}},
                    {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  j["model"] = {{"type", "BPE"},    {"dropout", nullptr},    {"unk_token", "<unk>"},
                {"fuse_unk", true}, {"byte_fallback", true}, {"vocab", vocab},
                {"merges", m}};
  return j;
}

inline Tokenizer make(const nlohmann::json& j) {
  return Tokenizer::from_json(j.dump(), "test.json");
}

// Random text over a mix of ASCII, whitespace, multi-byte characters and (optionally) invalid
// bytes.
inline std::string random_text(std::mt19937& rng, size_t n_pieces, bool invalid_bytes) {
  static const std::vector<std::string> pieces = {"a",        "b",        "c",
                                                  "e",        "l",        "o",
                                                  "z",        "Q",        " ",
                                                  "  ",       "\n",       "\t",
                                                  "\r\n",     "0",        "7",
                                                  "42",       ".",        ",",
                                                  "'s",       "'",        "!",
                                                  "(",        ")",        "_",
                                                  "é",        "ü",        "ß",
                                                  "€",        "日本",     "한",
                                                  "🐍",        "👍🏽", "\xE2\x80\x8B",
                                                  "\xC2\xA0", "\xC2\x85", "\xE2\x96\x81"};
  std::string s;
  for (size_t i = 0; i < n_pieces; ++i) {
    if (invalid_bytes && rng() % 10 == 0) {
      s.push_back(static_cast<char>(0x80 + rng() % 0x80));
    } else {
      s += pieces[rng() % pieces.size()];
    }
  }
  return s;
}

}  // namespace kvq::test
