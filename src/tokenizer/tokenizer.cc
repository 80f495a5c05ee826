#include "kvq/tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "kvq/core/error.h"
#include "kvq/core/json_text.h"
#include "tokenizer/bpe.h"
#include "tokenizer/decoders.h"
#include "tokenizer/pipeline.h"
#include "tokenizer/regex.h"
#include "tokenizer/utf8.h"

namespace kvq {

namespace {

using nlohmann::json;
using tok::utf8_char_len;
using tok::utf8_decode;

struct AddedToken {
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
  bool operator==(const AddedToken&) const = default;
};

// Leftmost-longest literal matching of added tokens (HF uses Aho-Corasick with
// MatchKind::LeftmostLongest); matches do not overlap.
class AddedMatcher {
 public:
  void add(std::string pattern, int32_t token) {
    if (pattern.empty()) return;
    const auto first = static_cast<uint8_t>(pattern[0]);
    patterns_.push_back({std::move(pattern), token});
    auto& list = by_first_[first];
    list.push_back(patterns_.size() - 1);
    std::stable_sort(list.begin(), list.end(), [&](size_t a, size_t b) {
      return patterns_[a].text.size() > patterns_[b].text.size();
    });
  }
  bool empty() const { return patterns_.empty(); }

  struct Match {
    size_t begin, end;
    int32_t token;
  };
  std::vector<Match> find_all(std::string_view s) const {
    std::vector<Match> out;
    for (size_t i = 0; i < s.size();) {
      bool found = false;
      for (size_t p : by_first_[static_cast<uint8_t>(s[i])]) {
        const std::string& t = patterns_[p].text;
        if (s.compare(i, t.size(), t) == 0) {
          out.push_back({i, i + t.size(), patterns_[p].token});
          i += t.size();
          found = true;
          break;
        }
      }
      if (!found) ++i;
    }
    return out;
  }

 private:
  struct Pat {
    std::string text;
    int32_t token;
  };
  std::vector<Pat> patterns_;
  std::array<std::vector<size_t>, 256> by_first_;
};

struct Segment {
  std::string text;
  int32_t id;  // an added token's id, or -1 for text still to tokenize
  bool at_origin;
};

std::string read_text_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw InputError(p.string() + ": cannot be read");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Rust regex's Unicode \w (HF's single_word check): Alphabetic, marks, decimal digits,
// connector punctuation and the joiners; PCRE2's \w differs (it has all of \p{N}, e.g. "²").
bool is_word_char(std::string_view ch) {
  static const tok::Regex word(R"(^[\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}]$)");
  return word.search(ch);
}

// Last / first character of s.
std::string_view last_char(std::string_view s) {
  size_t k = s.size() - 1;
  while (k > 0 && (static_cast<uint8_t>(s[k]) & 0xC0) == 0x80) --k;
  return s.substr(k);
}

}  // namespace

struct Tokenizer::Impl {
  std::string origin;
  // HF's AddedVocabulary: content -> id, id -> token (its latest flags), the contents of special
  // tokens (skipped by decode), and which tokens match on raw or on normalized text.
  std::unordered_map<std::string, int32_t> added_by_content;
  std::unordered_map<int32_t, AddedToken> added_by_id;
  std::unordered_map<std::string, bool> special_contents;
  AddedMatcher raw_matcher;         // tokens matched on the raw text (normalized == false)
  AddedMatcher normalized_matcher;  // tokens matched on normalized text
  std::unique_ptr<tok::Normalizer> normalizer;
  std::unique_ptr<tok::PreTokenizer> pre_tokenizer;
  std::optional<tok::BpeModel> model;
  std::unique_ptr<tok::PostProcessor> post_processor;
  std::unique_ptr<tok::Decoder> decoder;
  int32_t vocab_size = 0;
  std::optional<int32_t> bos;
  std::vector<int32_t> eos;
  bool add_bos = false;
  std::string chat_template;

  std::optional<int32_t> token_to_id(std::string_view t) const {
    if (auto it = added_by_content.find(std::string(t)); it != added_by_content.end()) {
      return it->second;
    }
    if (auto it = model->vocab().find(t); it != model->vocab().end()) return it->second;
    return std::nullopt;
  }
  const std::string* id_to_token(int32_t id) const {
    if (auto it = added_by_id.find(id); it != added_by_id.end()) return &it->second.content;
    return model->id_to_token(id);
  }
  bool is_special(int32_t id) const {
    const std::string* t = id_to_token(id);
    return t != nullptr && special_contents.contains(*t);
  }

  // HF's AddedVocabulary::find_matches + split_with_indices on one segment.
  void split_added(const Segment& seg, const AddedMatcher& m, std::vector<Segment>& out) const {
    const std::string& s = seg.text;
    size_t start_offset = 0;
    for (const auto& match : m.find_all(s)) {
      size_t start = match.begin, stop = match.end;
      const AddedToken& t = added_by_id.at(match.token);
      if (t.single_word) {
        const bool start_space = start == 0 || !is_word_char(last_char(s.substr(0, start)));
        const bool stop_space = stop == s.size() || !is_word_char(std::string_view(s).substr(
                                                        stop, utf8_char_len(s, stop)));
        if (!start_space || !stop_space) continue;
      }
      if (t.lstrip) {
        size_t b = start;
        while (b > 0) {
          size_t k = b - 1;
          while (k > 0 && (static_cast<uint8_t>(s[k]) & 0xC0) == 0x80) --k;
          if (!tok::is_unicode_whitespace(utf8_decode(s, k, b - k))) break;
          b = k;
        }
        start = std::max(b, start_offset);
      }
      if (t.rstrip) {
        while (stop < s.size()) {
          const size_t n = utf8_char_len(s, stop);
          if (!tok::is_unicode_whitespace(utf8_decode(s, stop, n))) break;
          stop += n;
        }
      }
      if (start_offset < start) {
        out.push_back(
            {s.substr(start_offset, start - start_offset), -1, seg.at_origin && start_offset == 0});
      }
      out.push_back({s.substr(start, stop - start), match.token, false});
      start_offset = stop;
    }
    if (start_offset < s.size()) {
      out.push_back({s.substr(start_offset), -1, seg.at_origin && start_offset == 0});
    }
  }

  std::vector<int32_t> encode(std::string_view input, bool add_special) const {
    std::string text = tok::utf8_valid(input) ? std::string(input) : tok::utf8_lossy(input);
    std::vector<Segment> raw;
    if (!text.empty()) split_added({std::move(text), -1, true}, raw_matcher, raw);

    std::vector<Segment> segs;
    for (Segment& seg : raw) {
      if (seg.id >= 0) {
        segs.push_back(std::move(seg));
        continue;
      }
      if (normalizer) normalizer->apply(seg.text);
      if (seg.text.empty()) continue;
      split_added(seg, normalized_matcher, segs);
    }

    std::vector<int32_t> ids;
    ids.reserve(input.size() / 3 + 4);
    std::unordered_map<std::string, std::vector<int32_t>> cache;  // per pre-token
    std::vector<tok::PreSplit> splits;
    for (Segment& seg : segs) {
      if (seg.id >= 0) {
        ids.push_back(seg.id);
        continue;
      }
      splits.clear();
      splits.push_back({std::move(seg.text), seg.at_origin});
      if (pre_tokenizer) pre_tokenizer->apply(splits);
      for (const tok::PreSplit& sp : splits) {
        if (sp.text.size() > 256) {  // long words are rare; do not let them fill the cache
          model->tokenize(sp.text, ids);
          continue;
        }
        auto [it, inserted] = cache.try_emplace(sp.text);
        if (inserted) model->tokenize(sp.text, it->second);
        ids.insert(ids.end(), it->second.begin(), it->second.end());
      }
    }
    if (post_processor) post_processor->apply(ids, add_special);
    return ids;
  }

  // The token strings HF's decode hands to the decoder.
  const std::string* decode_token(int32_t id, bool skip_special) const {
    const std::string* t = id_to_token(id);
    return t != nullptr && skip_special && special_contents.contains(*t) ? nullptr : t;
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

namespace {

std::unique_ptr<Tokenizer::Impl> parse_tokenizer_json(std::string_view text,
                                                      const std::string& origin) {
  const json j = parse_json_text(text, origin);
  auto fail = [&](const std::string& what) -> InputError {
    return InputError(origin + ": " + what);
  };
  if (!j.is_object()) throw fail("must be a JSON object (a Hugging Face tokenizer.json)");
  auto impl = std::make_unique<Tokenizer::Impl>();
  impl->origin = origin;

  try {
    // ---- model ----
    auto mit = j.find("model");
    if (mit == j.end() || !mit->is_object()) {
      throw fail("missing \"model\" (a tokenizer.json has model, normalizer, pre_tokenizer, ...)");
    }
    std::string type = "BPE";  // HF also accepts an untagged BPE model
    if (auto t = mit->find("type"); t != mit->end()) {
      if (!t->is_string()) throw fail("model.type must be a string");
      type = t->get<std::string>();
    }
    if (type != "BPE") {
      throw fail("model.type \"" + type + "\" is not supported (supported: BPE)");
    }
    impl->model = tok::BpeModel::from_json(*mit);

    // ---- components ----
    auto get = [&](const char* key) -> const json& {
      static const json null_json;
      auto it = j.find(key);
      return it == j.end() ? null_json : *it;
    };
    impl->normalizer = tok::parse_normalizer(get("normalizer"), "normalizer");
    impl->pre_tokenizer = tok::parse_pre_tokenizer(get("pre_tokenizer"), "pre_tokenizer");
    impl->post_processor = tok::parse_post_processor(get("post_processor"), "post_processor");
    impl->decoder = tok::Decoder::parse(get("decoder"), "decoder");

    // ---- added tokens ----
    const json& added = get("added_tokens");
    if (!added.is_null() && !added.is_array()) throw fail("added_tokens must be an array");
    // Added tokens are registered one by one in file order with HF's id rule (the "id" field is
    // only checked by HF, with a warning): a known content keeps its id, else the model's id for
    // it, else the next id after the model vocabulary and the added tokens so far.
    std::vector<AddedToken> special_list, classic_list;
    if (added.is_array()) {
      const auto model_len = static_cast<int64_t>(impl->model->vocab().size());
      int64_t max_added = -1;
      for (size_t i = 0; i < added.size(); ++i) {
        const json& a = added[i];
        const std::string path = "added_tokens[" + std::to_string(i) + "]";
        if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() ||
            a["id"].get<int64_t>() < 0 || a["id"].get<int64_t>() > INT32_MAX ||
            !a.contains("content") || !a["content"].is_string()) {
          throw fail(path + " needs an integer \"id\" >= 0 and a string \"content\"");
        }
        AddedToken t;
        t.content = a["content"].get<std::string>();
        auto flag = [&](const char* key, bool fallback) {
          auto it = a.find(key);
          if (it == a.end() || it->is_null()) return fallback;
          if (!it->is_boolean()) throw fail(path + "." + key + " must be true or false");
          return it->get<bool>();
        };
        t.special = flag("special", false);
        t.normalized = flag("normalized", !t.special);
        t.single_word = flag("single_word", false);
        t.lstrip = flag("lstrip", false);
        t.rstrip = flag("rstrip", false);
        if (t.content.empty()) continue;
        if (t.special && !impl->special_contents.contains(t.content)) {
          impl->special_contents.emplace(t.content, true);
          special_list.push_back(t);
        }
        bool duplicate = false;
        for (const auto& [id, known] : impl->added_by_id) duplicate = duplicate || known == t;
        if (duplicate) continue;
        int64_t id;
        if (auto it = impl->added_by_content.find(t.content); it != impl->added_by_content.end()) {
          id = it->second;
        } else if (auto mt = impl->model->vocab().find(t.content);
                   mt != impl->model->vocab().end()) {
          id = mt->second;
        } else {
          id = max_added < 0
                   ? model_len
                   : (max_added >= model_len || model_len == 0 ? max_added + 1 : model_len);
        }
        if (id > INT32_MAX) throw fail(path + ": too many tokens");
        max_added = std::max(max_added, id);
        impl->added_by_content[t.content] = static_cast<int32_t>(id);
        impl->added_by_id[static_cast<int32_t>(id)] = t;
        if (!impl->special_contents.contains(t.content)) classic_list.push_back(t);
      }
    }
    for (const auto* list : {&special_list, &classic_list}) {
      for (const AddedToken& t : *list) {
        const int32_t id = impl->added_by_content.at(t.content);
        if (!t.normalized) {
          impl->raw_matcher.add(t.content, id);
        } else {
          std::string content = t.content;  // matched against normalized text, so normalize it too
          if (impl->normalizer) impl->normalizer->apply(content);
          impl->normalized_matcher.add(std::move(content), id);
        }
      }
    }
  } catch (const std::invalid_argument& e) {
    throw fail(e.what());
  }

  int32_t max_id = impl->model->max_id();
  for (const auto& [id, t] : impl->added_by_id) max_id = std::max(max_id, id);
  impl->vocab_size = max_id + 1;
  return impl;
}

// A token named in tokenizer_config.json: "<s>", {"content": "<s>", ...} or null.
std::optional<std::string> config_token(const json& cfg, const char* key,
                                        const std::string& origin) {
  auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  throw InputError(origin + ": " + key + " must be a string, {\"content\": ...} or null");
}

// An id or a list of ids (eos_token_id may be either).
std::vector<int32_t> config_ids(const json& cfg, const char* key, const std::string& origin,
                                int32_t vocab_size) {
  std::vector<int32_t> ids;
  auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return ids;
  auto one = [&](const json& v) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= vocab_size) {
      throw InputError(origin + ": " + key + " must be a token id in [0, " +
                       std::to_string(vocab_size) + ") or a list of them, got " + v.dump());
    }
    ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
  };
  if (it->is_array()) {
    for (const json& v : *it) one(v);
  } else {
    one(*it);
  }
  return ids;
}

std::optional<json> read_optional_json(const std::filesystem::path& p) {
  std::error_code ec;
  if (!std::filesystem::exists(p, ec)) return std::nullopt;
  json j = parse_json_text(read_text_file(p), p.string());
  if (!j.is_object()) throw InputError(p.string() + ": must be a JSON object");
  return j;
}

}  // namespace

Tokenizer Tokenizer::from_json(std::string_view tokenizer_json, const std::string& origin) {
  return Tokenizer(parse_tokenizer_json(tokenizer_json, origin));
}

Tokenizer Tokenizer::load(const std::string& model_dir) {
  const std::filesystem::path dir(model_dir);
  const std::filesystem::path tj = dir / "tokenizer.json";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(tj, ec)) {
    throw InputError(tj.string() +
                     ": not found (kvq reads Hugging Face tokenizers from tokenizer.json)");
  }
  auto impl = parse_tokenizer_json(read_text_file(tj), tj.string());

  const std::string tc_path = (dir / "tokenizer_config.json").string();
  const std::string gc_path = (dir / "generation_config.json").string();
  const std::string mc_path = (dir / "config.json").string();
  const auto tc = read_optional_json(tc_path);
  const auto gc = read_optional_json(gc_path);
  const auto mc = read_optional_json(mc_path);

  auto named_id = [&](const std::string& token, const char* key) {
    auto id = impl->token_to_id(token);
    if (!id) {
      throw InputError(tc_path + ": " + key + " \"" + token + "\" is not a token of " +
                       tj.string());
    }
    return *id;
  };
  std::optional<int32_t> tc_eos;
  if (tc) {
    if (auto b = config_token(*tc, "bos_token", tc_path)) impl->bos = named_id(*b, "bos_token");
    if (auto e = config_token(*tc, "eos_token", tc_path)) tc_eos = named_id(*e, "eos_token");
    if (auto it = tc->find("add_bos_token"); it != tc->end() && !it->is_null()) {
      if (!it->is_boolean()) throw InputError(tc_path + ": add_bos_token must be true or false");
      impl->add_bos = it->get<bool>();
    }
    if (auto it = tc->find("chat_template"); it != tc->end() && !it->is_null()) {
      if (it->is_string()) {
        impl->chat_template = it->get<std::string>();
      } else if (it->is_array()) {
        // Named templates: [{"name": "default", "template": ...}, ...]; take "default".
        for (const json& t : *it) {
          if (t.is_object() && t.contains("name") && t["name"] == "default" && t.contains("template") &&
              t["template"].is_string()) {
            impl->chat_template = t["template"].get<std::string>();
          }
        }
      } else {
        throw InputError(tc_path + ": chat_template must be a string or a list of named templates");
      }
    }
  }
  std::vector<int32_t> eos;
  if (gc) {
    eos = config_ids(*gc, "eos_token_id", gc_path, impl->vocab_size);
    if (!impl->bos) {
      auto b = config_ids(*gc, "bos_token_id", gc_path, impl->vocab_size);
      if (!b.empty()) impl->bos = b[0];
    }
  }
  if (tc_eos && std::find(eos.begin(), eos.end(), *tc_eos) == eos.end()) eos.push_back(*tc_eos);
  if (mc) {
    if (eos.empty()) eos = config_ids(*mc, "eos_token_id", mc_path, impl->vocab_size);
    if (!impl->bos) {
      auto b = config_ids(*mc, "bos_token_id", mc_path, impl->vocab_size);
      if (!b.empty()) impl->bos = b[0];
    }
  }
  impl->eos = std::move(eos);
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  return impl_->encode(text, add_special_tokens);
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (const std::string* t = impl_->decode_token(id, skip_special_tokens)) tokens.push_back(*t);
  }
  if (impl_->decoder) return impl_->decoder->decode(std::move(tokens));
  std::string out;  // HF joins with spaces when there is no decoder
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (i > 0) out += ' ';
    out += tokens[i];
  }
  return out;
}

int32_t Tokenizer::vocab_size() const {
  return impl_->vocab_size;
}
std::optional<int32_t> Tokenizer::bos_id() const {
  return impl_->bos;
}
std::vector<int32_t> Tokenizer::eos_ids() const {
  return impl_->eos;
}
std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  return impl_->token_to_id(token);
}
std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  const std::string* t = impl_->id_to_token(id);
  return t ? std::optional<std::string>(*t) : std::nullopt;
}
bool Tokenizer::is_special(int32_t id) const {
  return impl_->is_special(id);
}
bool Tokenizer::add_bos_token() const {
  return impl_->add_bos;
}
const std::string& Tokenizer::chat_template() const {
  return impl_->chat_template;
}

// ---- streaming ---------------------------------------------------------------------------

struct StreamingDecoder::State {
  std::unique_ptr<tok::DecoderStream> stream;  // null when the tokenizer has no decoder
  bool first = true;
};

StreamingDecoder::StreamingDecoder(const Tokenizer& t, bool skip_special_tokens)
    : tokenizer_(&t), skip_special_(skip_special_tokens), state_(std::make_unique<State>()) {
  if (t.impl_->decoder) state_->stream = t.impl_->decoder->stream();
}
StreamingDecoder::StreamingDecoder(StreamingDecoder&&) noexcept = default;
StreamingDecoder::~StreamingDecoder() = default;

std::string StreamingDecoder::push(int32_t id) {
  const std::string* t = tokenizer_->impl_->decode_token(id, skip_special_);
  if (t == nullptr) return "";
  if (state_->stream) return state_->stream->push(*t);
  std::string out = state_->first ? *t : " " + *t;
  state_->first = false;
  return out;
}

std::string StreamingDecoder::finish() {
  state_->first = true;
  return state_->stream ? state_->stream->finish() : "";
}

}  // namespace kvq
