#include "tokenizer/pipeline.h"

#include <nlohmann/json.hpp>
#include <stdexcept>

#include "tokenizer/nfc.h"
#include "tokenizer/regex.h"
#include "tokenizer/utf8.h"

namespace kvq::tok {

namespace {

using nlohmann::json;

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw std::invalid_argument(path + ": " + what);
}

const json& member(const json& j, const char* key, const std::string& path) {
  auto it = j.find(key);
  if (it == j.end()) bad(path, std::string("missing \"") + key + "\"");
  return *it;
}

std::string get_string(const json& j, const char* key, const std::string& path) {
  const json& v = member(j, key, path);
  if (!v.is_string()) bad(path + "." + key, "must be a string");
  return v.get<std::string>();
}

bool get_bool(const json& j, const char* key, const std::string& path, bool fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) bad(path + "." + key, "must be true or false");
  return it->get<bool>();
}

std::string type_of(const json& j, const std::string& path) {
  if (!j.is_object()) bad(path, "must be an object with a \"type\"");
  return get_string(j, "type", path);
}

SplitBehavior parse_behavior(const json& j, const std::string& path) {
  if (!j.is_string()) bad(path, "must be a string");
  const std::string b = j.get<std::string>();
  if (b == "Removed") return SplitBehavior::kRemoved;
  if (b == "Isolated") return SplitBehavior::kIsolated;
  if (b == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (b == "Contiguous") return SplitBehavior::kContiguous;
  bad(path, "unknown split behavior \"" + b +
                "\" (accepted: Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous)");
}

// Replaces every split by the kept spans that `finder` and `behavior` give for it.
template <typename Finder>
void split_each(std::vector<PreSplit>& splits, const Finder& finder, SplitBehavior behavior) {
  std::vector<PreSplit> out;
  out.reserve(splits.size());
  for (PreSplit& sp : splits) {
    for (const Piece& p : split_by_behavior(finder(sp.text), behavior)) {
      if (p.end == p.begin) continue;
      out.push_back({sp.text.substr(p.begin, p.end - p.begin), sp.at_origin && p.begin == 0});
    }
  }
  splits = std::move(out);
}

// ---- normalizers -------------------------------------------------------------------------

class SequenceNormalizer final : public Normalizer {
 public:
  std::vector<std::unique_ptr<Normalizer>> parts;
  void apply(std::string& s) const override {
    for (const auto& p : parts) p->apply(s);
  }
};

class PrependNormalizer final : public Normalizer {
 public:
  std::string prepend;
  void apply(std::string& s) const override {
    if (!s.empty()) s.insert(0, prepend);
  }
};

class ReplaceNormalizer final : public Normalizer {
 public:
  Pattern pattern;
  std::string content;
  void apply(std::string& s) const override { s = pattern.replace_all(s, content); }
};

class StripNormalizer final : public Normalizer {
 public:
  bool left = true, right = true;
  void apply(std::string& s) const override {
    size_t b = 0, e = s.size();
    if (left) {
      while (b < e) {
        const size_t n = utf8_char_len(s, b);
        if (!is_unicode_whitespace(utf8_decode(s, b, n))) break;
        b += n;
      }
    }
    if (right) {
      while (e > b) {
        size_t k = e - 1;
        while (k > b && (static_cast<uint8_t>(s[k]) & 0xC0) == 0x80) --k;
        if (!is_unicode_whitespace(utf8_decode(s, k, e - k))) break;
        e = k;
      }
    }
    s = s.substr(b, e - b);
  }
};

class NfcNormalizer final : public Normalizer {
 public:
  void apply(std::string& s) const override { s = nfc(s); }
};

// ---- pre-tokenizers ----------------------------------------------------------------------

class SequencePreTokenizer final : public PreTokenizer {
 public:
  std::vector<std::unique_ptr<PreTokenizer>> parts;
  void apply(std::vector<PreSplit>& splits) const override {
    for (const auto& p : parts) p->apply(splits);
  }
};

constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

const Regex& gpt2_regex() {
  static const Regex re(kGpt2Pattern);
  return re;
}

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  bool add_prefix_space = true;
  bool use_regex = true;
  void apply(std::vector<PreSplit>& splits) const override {
    if (add_prefix_space) {
      for (PreSplit& sp : splits) {
        if (sp.text.empty() || sp.text[0] != ' ') sp.text.insert(0, " ");
      }
    }
    if (use_regex) {
      const Regex& re = gpt2_regex();
      split_each(
          splits,
          [&](std::string_view s) {
            std::vector<Piece> out;
            size_t prev = 0;
            for (auto [b, e] : re.find_all(s)) {
              if (prev != b) out.push_back({prev, b, false});
              out.push_back({b, e, true});
              prev = e;
            }
            if (prev != s.size()) out.push_back({prev, s.size(), false});
            return out;
          },
          SplitBehavior::kIsolated);
    }
    const ByteLevelMap& m = byte_level_map();
    for (PreSplit& sp : splits) {
      std::string mapped;
      mapped.reserve(sp.text.size() * 2);
      for (char c : sp.text) mapped += m.byte_to_char[static_cast<uint8_t>(c)];
      sp.text = std::move(mapped);
    }
  }
};

class SplitPreTokenizer final : public PreTokenizer {
 public:
  Pattern pattern;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  void apply(std::vector<PreSplit>& splits) const override {
    split_each(
        splits,
        [&](std::string_view s) {
          std::vector<Piece> pieces = pattern.find_matches(s);
          if (invert) {
            for (Piece& p : pieces) p.is_match = !p.is_match;
          }
          return pieces;
        },
        behavior);
  }
};

enum class PrependScheme { kAlways, kFirst, kNever };

class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  std::string replacement = "\xE2\x96\x81";  // U+2581
  PrependScheme scheme = PrependScheme::kAlways;
  bool split = true;
  void apply(std::vector<PreSplit>& splits) const override {
    for (PreSplit& sp : splits) {
      std::string r;
      r.reserve(sp.text.size() + replacement.size());
      for (char c : sp.text) {
        if (c == ' ') {
          r += replacement;
        } else {
          r += c;
        }
      }
      const bool starts = r.compare(0, replacement.size(), replacement) == 0;
      if (!starts &&
          (scheme == PrependScheme::kAlways || (scheme == PrependScheme::kFirst && sp.at_origin))) {
        r.insert(0, replacement);
      }
      sp.text = std::move(r);
    }
    if (!split) return;
    split_each(
        splits,
        [&](std::string_view s) {
          std::vector<Piece> out;
          size_t prev = 0;
          for (size_t pos = s.find(replacement); pos != std::string_view::npos;
               pos = s.find(replacement, pos + replacement.size())) {
            if (prev != pos) out.push_back({prev, pos, false});
            out.push_back({pos, pos + replacement.size(), true});
            prev = pos + replacement.size();
          }
          if (prev != s.size()) out.push_back({prev, s.size(), false});
          return out;
        },
        SplitBehavior::kMergedWithNext);
  }
};

class DigitsPreTokenizer final : public PreTokenizer {
 public:
  explicit DigitsPreTokenizer(bool individual) : re_(individual ? R"(\p{N})" : R"(\p{N}+)") {}
  void apply(std::vector<PreSplit>& splits) const override {
    split_each(
        splits,
        [&](std::string_view s) {
          std::vector<Piece> out;
          size_t prev = 0;
          for (auto [b, e] : re_.find_all(s)) {
            if (prev != b) out.push_back({prev, b, false});
            out.push_back({b, e, true});
            prev = e;
          }
          if (prev != s.size()) out.push_back({prev, s.size(), false});
          return out;
        },
        SplitBehavior::kIsolated);
  }

 private:
  Regex re_;
};

// ---- post-processors ---------------------------------------------------------------------

class TemplatePostProcessor final : public PostProcessor {
 public:
  // Each item: the ids of a special token, or nullopt for the sequence $A.
  std::vector<std::optional<std::vector<int32_t>>> single;
  void apply(std::vector<int32_t>& ids, bool add_special_tokens) const override {
    if (!add_special_tokens) return;
    std::vector<int32_t> out;
    out.reserve(ids.size() + 4);
    for (const auto& item : single) {
      if (item) {
        out.insert(out.end(), item->begin(), item->end());
      } else {
        out.insert(out.end(), ids.begin(), ids.end());
      }
    }
    ids = std::move(out);
  }
};

class WrapPostProcessor final : public PostProcessor {  // Roberta/Bert: CLS $A SEP
 public:
  int32_t cls = 0, sep = 0;
  void apply(std::vector<int32_t>& ids, bool add_special_tokens) const override {
    if (!add_special_tokens) return;
    ids.insert(ids.begin(), cls);
    ids.push_back(sep);
  }
};

class NoopPostProcessor final : public PostProcessor {
 public:
  void apply(std::vector<int32_t>&, bool) const override {}
};

class SequencePostProcessor final : public PostProcessor {
 public:
  std::vector<std::unique_ptr<PostProcessor>> parts;
  void apply(std::vector<int32_t>& ids, bool add_special_tokens) const override {
    for (const auto& p : parts) p->apply(ids, add_special_tokens);
  }
};

const json& array_member(const json& j, const char* key, const std::string& path) {
  const json& v = member(j, key, path);
  if (!v.is_array()) bad(path + "." + key, "must be an array");
  return v;
}

}  // namespace

std::vector<Piece> split_by_behavior(std::vector<Piece> pieces, SplitBehavior behavior) {
  std::vector<Piece> acc;
  acc.reserve(pieces.size());
  bool prev_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      return pieces;
    case SplitBehavior::kRemoved:
      for (const Piece& p : pieces) {
        if (!p.is_match) acc.push_back(p);
      }
      return acc;
    case SplitBehavior::kContiguous:
      for (const Piece& p : pieces) {
        if (!acc.empty() && p.is_match == prev_match) {
          acc.back().end = p.end;
        } else {
          acc.push_back(p);
        }
        prev_match = p.is_match;
      }
      return acc;
    case SplitBehavior::kMergedWithPrevious:
      for (const Piece& p : pieces) {
        if (!acc.empty() && p.is_match && !prev_match) {
          acc.back().end = p.end;
        } else {
          acc.push_back(p);
        }
        prev_match = p.is_match;
      }
      return acc;
    case SplitBehavior::kMergedWithNext:
      for (auto it = pieces.rbegin(); it != pieces.rend(); ++it) {
        if (!acc.empty() && it->is_match && !prev_match) {
          acc.back().begin = it->begin;
        } else {
          acc.push_back(*it);
        }
        prev_match = it->is_match;
      }
      return {acc.rbegin(), acc.rend()};
  }
  return pieces;
}

Pattern Pattern::parse(const json& j, const std::string& path) {
  Pattern p;
  if (j.is_object() && j.contains("String") && j["String"].is_string()) {
    p.literal = j["String"].get<std::string>();
  } else if (j.is_object() && j.contains("Regex") && j["Regex"].is_string()) {
    try {
      p.regex = std::make_shared<Regex>(j["Regex"].get<std::string>());
    } catch (const std::invalid_argument& e) {
      bad(path, e.what());
    }
  } else {
    bad(path, "must be {\"String\": ...} or {\"Regex\": ...}");
  }
  return p;
}

std::vector<Piece> Pattern::find_matches(std::string_view s) const {
  std::vector<Piece> out;
  if (s.empty()) return out;
  size_t prev = 0;
  auto add_match = [&](size_t b, size_t e) {
    if (prev != b) out.push_back({prev, b, false});
    out.push_back({b, e, true});
    prev = e;
  };
  if (regex) {
    for (auto [b, e] : regex->find_all(s)) add_match(b, e);
  } else if (!literal.empty()) {
    for (size_t pos = s.find(literal); pos != std::string_view::npos;
         pos = s.find(literal, pos + literal.size())) {
      add_match(pos, pos + literal.size());
    }
  }
  if (prev != s.size()) out.push_back({prev, s.size(), false});
  return out;
}

std::string Pattern::replace_all(std::string_view s, std::string_view content) const {
  std::string out;
  out.reserve(s.size());
  for (const Piece& p : find_matches(s)) {
    if (p.is_match) {
      out += content;
    } else {
      out.append(s.substr(p.begin, p.end - p.begin));
    }
  }
  return out;
}

std::unique_ptr<Normalizer> parse_normalizer(const json& j, const std::string& path) {
  if (j.is_null()) return nullptr;
  const std::string type = type_of(j, path);
  if (type == "Sequence") {
    auto n = std::make_unique<SequenceNormalizer>();
    const json& parts = array_member(j, "normalizers", path);
    for (size_t i = 0; i < parts.size(); ++i) {
      auto p = parse_normalizer(parts[i], path + ".normalizers[" + std::to_string(i) + "]");
      if (p) n->parts.push_back(std::move(p));
    }
    return n;
  }
  if (type == "Prepend") {
    auto n = std::make_unique<PrependNormalizer>();
    n->prepend = get_string(j, "prepend", path);
    return n;
  }
  if (type == "Replace") {
    auto n = std::make_unique<ReplaceNormalizer>();
    n->pattern = Pattern::parse(member(j, "pattern", path), path + ".pattern");
    n->content = get_string(j, "content", path);
    return n;
  }
  if (type == "Strip") {
    auto n = std::make_unique<StripNormalizer>();
    n->left = get_bool(j, "strip_left", path, true);
    n->right = get_bool(j, "strip_right", path, true);
    return n;
  }
  if (type == "NFC") return std::make_unique<NfcNormalizer>();
  bad(path, "unsupported normalizer type \"" + type +
                "\" (supported: Sequence, Prepend, Replace, Strip, NFC)");
}

std::unique_ptr<PreTokenizer> parse_pre_tokenizer(const json& j, const std::string& path) {
  if (j.is_null()) return nullptr;
  const std::string type = type_of(j, path);
  if (type == "Sequence") {
    auto p = std::make_unique<SequencePreTokenizer>();
    const json& parts = array_member(j, "pretokenizers", path);
    for (size_t i = 0; i < parts.size(); ++i) {
      auto q = parse_pre_tokenizer(parts[i], path + ".pretokenizers[" + std::to_string(i) + "]");
      if (q) p->parts.push_back(std::move(q));
    }
    return p;
  }
  if (type == "ByteLevel") {
    auto p = std::make_unique<ByteLevelPreTokenizer>();
    p->add_prefix_space = get_bool(j, "add_prefix_space", path, true);
    p->use_regex = get_bool(j, "use_regex", path, true);
    return p;
  }
  if (type == "Split") {
    auto p = std::make_unique<SplitPreTokenizer>();
    p->pattern = Pattern::parse(member(j, "pattern", path), path + ".pattern");
    p->behavior = parse_behavior(member(j, "behavior", path), path + ".behavior");
    p->invert = get_bool(j, "invert", path, false);
    return p;
  }
  if (type == "Metaspace") {
    auto p = std::make_unique<MetaspacePreTokenizer>();
    p->replacement = get_string(j, "replacement", path);
    if (p->replacement.empty() || utf8_char_len(p->replacement, 0) != p->replacement.size()) {
      bad(path + ".replacement", "must be a single character");
    }
    if (auto it = j.find("prepend_scheme"); it != j.end() && !it->is_null()) {
      const std::string s = it->is_string() ? it->get<std::string>() : "";
      if (s == "always") {
        p->scheme = PrependScheme::kAlways;
      } else if (s == "first") {
        p->scheme = PrependScheme::kFirst;
      } else if (s == "never") {
        p->scheme = PrependScheme::kNever;
      } else {
        bad(path + ".prepend_scheme", "must be \"always\", \"first\" or \"never\"");
      }
    } else {
      p->scheme = get_bool(j, "add_prefix_space", path, true) ? PrependScheme::kAlways
                                                              : PrependScheme::kNever;
    }
    p->split = get_bool(j, "split", path, true);
    return p;
  }
  if (type == "Digits") {
    return std::make_unique<DigitsPreTokenizer>(get_bool(j, "individual_digits", path, false));
  }
  bad(path, "unsupported pre_tokenizer type \"" + type +
                "\" (supported: Sequence, ByteLevel, Split, Metaspace, Digits)");
}

std::unique_ptr<PostProcessor> parse_post_processor(const json& j, const std::string& path) {
  if (j.is_null()) return nullptr;
  const std::string type = type_of(j, path);
  if (type == "Sequence") {
    auto p = std::make_unique<SequencePostProcessor>();
    const json& parts = array_member(j, "processors", path);
    for (size_t i = 0; i < parts.size(); ++i) {
      auto q = parse_post_processor(parts[i], path + ".processors[" + std::to_string(i) + "]");
      if (q) p->parts.push_back(std::move(q));
    }
    return p;
  }
  if (type == "ByteLevel") return std::make_unique<NoopPostProcessor>();  // offsets only
  if (type == "TemplateProcessing") {
    auto p = std::make_unique<TemplatePostProcessor>();
    const json& single = array_member(j, "single", path);
    const json& specials = member(j, "special_tokens", path);
    if (!specials.is_object()) bad(path + ".special_tokens", "must be an object");
    for (size_t i = 0; i < single.size(); ++i) {
      const std::string ipath = path + ".single[" + std::to_string(i) + "]";
      const json& item = single[i];
      if (item.is_object() && item.contains("Sequence")) {
        const json& seq = item["Sequence"];
        if (!seq.is_object() || !seq.contains("id") || seq["id"] != "A") {
          bad(ipath, "a single-sequence template may only use the sequence \"A\"");
        }
        p->single.emplace_back(std::nullopt);
      } else if (item.is_object() && item.contains("SpecialToken")) {
        const json& st = item["SpecialToken"];
        if (!st.is_object() || !st.contains("id") || !st["id"].is_string()) {
          bad(ipath, "SpecialToken needs a string \"id\"");
        }
        const std::string name = st["id"].get<std::string>();
        auto it = specials.find(name);
        if (it == specials.end() || !it->is_object() || !it->contains("ids") ||
            !(*it)["ids"].is_array()) {
          bad(ipath, "special token \"" + name + "\" is not described in special_tokens");
        }
        std::vector<int32_t> ids;
        for (const json& id : (*it)["ids"]) {
          if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
            bad(path + ".special_tokens." + name, "ids must be token ids");
          }
          ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
        }
        p->single.emplace_back(std::move(ids));
      } else {
        bad(ipath, "must be {\"SpecialToken\": ...} or {\"Sequence\": ...}");
      }
    }
    return p;
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    auto p = std::make_unique<WrapPostProcessor>();
    auto token_id = [&](const char* key) {
      const json& v = member(j, key, path);
      if (!v.is_array() || v.size() != 2 || !v[1].is_number_integer()) {
        bad(path + "." + key, "must be [token, id]");
      }
      return static_cast<int32_t>(v[1].get<int64_t>());
    };
    p->cls = token_id("cls");
    p->sep = token_id("sep");
    return p;
  }
  bad(path, "unsupported post_processor type \"" + type +
                "\" (supported: TemplateProcessing, ByteLevel, RobertaProcessing, "
                "BertProcessing, Sequence)");
}

}  // namespace kvq::tok
