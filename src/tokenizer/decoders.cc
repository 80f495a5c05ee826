#include "tokenizer/decoders.h"

#include <nlohmann/json.hpp>
#include <stdexcept>

#include "tokenizer/utf8.h"

namespace kvq::tok {

namespace {

using nlohmann::json;
using Kind = DecoderStep::Kind;

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw std::invalid_argument(path + ": " + what);
}

std::string single_char(const json& j, const char* key, const std::string& path) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string()) bad(path + "." + key, "must be a string");
  std::string s = it->get<std::string>();
  if (s.empty() || utf8_char_len(s, 0) != s.size()) bad(path + "." + key, "must be one character");
  return s;
}

void parse_into(const json& j, const std::string& path, std::vector<DecoderStep>& steps) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) {
    bad(path, "must be an object with a string \"type\"");
  }
  const std::string type = j["type"].get<std::string>();
  DecoderStep s{};
  if (type == "Sequence") {
    auto it = j.find("decoders");
    if (it == j.end() || !it->is_array()) bad(path + ".decoders", "must be an array");
    for (size_t i = 0; i < it->size(); ++i) {
      parse_into((*it)[i], path + ".decoders[" + std::to_string(i) + "]", steps);
    }
    return;
  }
  if (type == "ByteLevel") {
    s.kind = Kind::kByteLevel;
  } else if (type == "ByteFallback") {
    s.kind = Kind::kByteFallback;
  } else if (type == "Fuse") {
    s.kind = Kind::kFuse;
  } else if (type == "Replace") {
    s.kind = Kind::kReplace;
    if (!j.contains("pattern")) bad(path, "missing \"pattern\"");
    s.pattern = Pattern::parse(j["pattern"], path + ".pattern");
    if (!j.contains("content") || !j["content"].is_string()) {
      bad(path + ".content", "must be a string");
    }
    s.content = j["content"].get<std::string>();
  } else if (type == "Strip") {
    s.kind = Kind::kStrip;
    s.content = single_char(j, "content", path);
    for (const char* key : {"start", "stop"}) {
      auto it = j.find(key);
      if (it == j.end() || !it->is_number_unsigned()) {
        bad(path + "." + key, "must be a non-negative integer");
      }
      (std::string(key) == "start" ? s.start : s.stop) = it->get<size_t>();
    }
  } else if (type == "Metaspace") {
    s.kind = Kind::kMetaspace;
    s.replacement = single_char(j, "replacement", path);
    if (auto it = j.find("prepend_scheme"); it != j.end() && it->is_string()) {
      s.prepend = it->get<std::string>() != "never";
    } else if (auto a = j.find("add_prefix_space"); a != j.end() && a->is_boolean()) {
      s.prepend = a->get<bool>();
    }
  } else {
    bad(path, "unsupported decoder type \"" + type +
                  "\" (supported: Sequence, ByteLevel, Replace, ByteFallback, Fuse, Strip, "
                  "Metaspace)");
  }
  steps.push_back(std::move(s));
}

// "<0xNN>" -> NN, as HF's ByteFallback decoder reads it.
int byte_token_value(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  const int hi = hex(t[3]), lo = hex(t[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

// The bytes a ByteLevel decoder makes of one token: mapped characters back to their bytes, or
// the token's own UTF-8 when any character is not a mapped one.
void byte_level_bytes(const std::string& t, std::string& out) {
  const ByteLevelMap& m = byte_level_map();
  const size_t mark = out.size();
  for (size_t i = 0; i < t.size();) {
    const size_t n = utf8_char_len(t, i);
    const uint32_t cp = utf8_decode(t, i, n);
    if (cp >= m.char_to_byte.size() || m.char_to_byte[cp] < 0) {
      out.resize(mark);
      out += t;
      return;
    }
    out.push_back(static_cast<char>(m.char_to_byte[cp]));
    i += n;
  }
}

std::string strip_token(const std::string& t, const DecoderStep& s) {
  // Character-wise, as HF: up to `start` leading and `stop` trailing copies of s.content.
  std::vector<size_t> starts;
  for (size_t i = 0; i < t.size(); i += utf8_char_len(t, i)) starts.push_back(i);
  const size_t n = starts.size();
  auto char_at = [&](size_t k) {
    const size_t e = k + 1 < n ? starts[k + 1] : t.size();
    return std::string_view(t).substr(starts[k], e - starts[k]);
  };
  size_t start_cut = 0;
  for (size_t k = 0; k < std::min(s.start, n) && char_at(k) == s.content; ++k) start_cut = k + 1;
  size_t stop_cut = n;
  for (size_t k = 0; k < std::min(s.stop, n) && char_at(n - 1 - k) == s.content; ++k) {
    stop_cut = n - 1 - k;
  }
  if (stop_cut <= start_cut) return "";
  const size_t b = start_cut < n ? starts[start_cut] : t.size();
  const size_t e = stop_cut < n ? starts[stop_cut] : t.size();
  return t.substr(b, e - b);
}

std::string metaspace_token(const std::string& t, const DecoderStep& s, bool first) {
  std::string out;
  out.reserve(t.size());
  for (size_t i = 0; i < t.size();) {
    const size_t n = utf8_char_len(t, i);
    if (t.compare(i, n, s.replacement) == 0) {
      if (!(first && s.prepend)) out += ' ';
    } else {
      out.append(t, i, n);
    }
    i += n;
  }
  return out;
}

std::vector<std::string> apply_step(const DecoderStep& s, std::vector<std::string> tokens) {
  std::vector<std::string> out;
  switch (s.kind) {
    case Kind::kByteLevel: {
      std::string bytes;
      for (const std::string& t : tokens) byte_level_bytes(t, bytes);
      out.push_back(utf8_lossy(bytes));
      return out;
    }
    case Kind::kReplace:
      for (std::string& t : tokens) t = s.pattern.replace_all(t, s.content);
      return tokens;
    case Kind::kByteFallback: {
      std::string run;
      size_t run_len = 0;
      auto flush = [&] {
        if (run_len == 0) return;
        if (utf8_valid(run)) {
          out.push_back(run);
        } else {
          for (size_t k = 0; k < run_len; ++k) out.emplace_back(kReplacementChar);
        }
        run.clear();
        run_len = 0;
      };
      for (std::string& t : tokens) {
        const int b = byte_token_value(t);
        if (b >= 0) {
          run.push_back(static_cast<char>(b));
          ++run_len;
        } else {
          flush();
          out.push_back(std::move(t));
        }
      }
      flush();
      return out;
    }
    case Kind::kFuse: {
      std::string all;
      for (const std::string& t : tokens) all += t;
      out.push_back(std::move(all));
      return out;
    }
    case Kind::kStrip:
      for (std::string& t : tokens) t = strip_token(t, s);
      return tokens;
    case Kind::kMetaspace:
      for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = metaspace_token(tokens[i], s, i == 0);
      return tokens;
  }
  return tokens;
}

// ---- streaming ---------------------------------------------------------------------------

// One step's incremental state. `fused`: an earlier step (Fuse, ByteLevel) has joined all tokens
// into one, so this step sees the stream as pieces of a single token.
class StepState {
 public:
  StepState(const DecoderStep& s, bool fused) : s_(s), fused_(fused) {}

  void push(std::string t, std::vector<std::string>& out) {
    switch (s_.kind) {
      case Kind::kByteLevel:
        byte_level_bytes(t, bytes_);
        emit_complete_utf8(out, false);
        return;
      case Kind::kReplace:
        if (!fused_) {
          out.push_back(s_.pattern.replace_all(t, s_.content));
          return;
        }
        held_ += t;
        replace_held(out, false);
        return;
      case Kind::kByteFallback: {
        const int b = byte_token_value(t);
        if (b >= 0) {
          run_.push_back(static_cast<char>(b));
          return;
        }
        flush_run(out);
        out.push_back(std::move(t));
        return;
      }
      case Kind::kFuse:
        out.push_back(std::move(t));
        return;
      case Kind::kStrip:
        if (!fused_) {
          out.push_back(strip_token(t, s_));
          return;
        }
        out.push_back(strip_leading(t));
        return;
      case Kind::kMetaspace:
        out.push_back(metaspace_token(t, s_, fused_ || count_ == 0));
        ++count_;
        return;
    }
  }

  void finish(std::vector<std::string>& out) {
    switch (s_.kind) {
      case Kind::kByteLevel:
        emit_complete_utf8(out, true);
        break;
      case Kind::kReplace:
        replace_held(out, true);
        break;
      case Kind::kByteFallback:
        flush_run(out);
        break;
      default:
        break;
    }
    count_ = 0;
    start_left_ = s_.start;
  }

 private:
  // Emits the longest prefix of bytes_ that later bytes cannot change; at the end, a truncated
  // sequence becomes one U+FFFD, as String::from_utf8_lossy does.
  void emit_complete_utf8(std::vector<std::string>& out, bool at_end) {
    std::string text;
    size_t i = 0;
    while (i < bytes_.size()) {
      const Utf8Step st = utf8_step(bytes_, i);
      if (st.status == Utf8Status::kTruncated && !at_end) break;
      if (st.status == Utf8Status::kChar) {
        text.append(bytes_, i, st.len);
      } else {
        text += kReplacementChar;
      }
      i += st.len;
    }
    bytes_.erase(0, i);
    if (!text.empty()) out.push_back(std::move(text));
  }

  // Literal replacement over a stream: replace the whole matches, then hold back a tail that
  // may be the start of a match still to come.
  void replace_held(std::vector<std::string>& out, bool at_end) {
    size_t keep = 0;
    const std::string& lit = s_.pattern.literal;
    if (!at_end && !lit.empty()) {
      size_t last_end = 0;
      for (const Piece& p : s_.pattern.find_matches(held_)) {
        if (p.is_match) last_end = p.end;
      }
      const size_t tail = held_.size() - last_end;
      for (size_t k = std::min(lit.size() - 1, tail); k > 0; --k) {
        if (held_.compare(held_.size() - k, k, lit, 0, k) == 0) {
          keep = k;
          break;
        }
      }
    }
    const std::string ready =
        s_.pattern.replace_all(held_.substr(0, held_.size() - keep), s_.content);
    held_.erase(0, held_.size() - keep);
    if (!ready.empty()) out.push_back(ready);
  }

  void flush_run(std::vector<std::string>& out) {
    if (run_.empty()) return;
    if (utf8_valid(run_)) {
      out.push_back(run_);
    } else {
      for (size_t k = 0; k < run_.size(); ++k) out.emplace_back(kReplacementChar);
    }
    run_.clear();
  }

  std::string strip_leading(const std::string& t) {
    size_t b = 0;
    while (start_left_ > 0 && b < t.size()) {
      const size_t n = utf8_char_len(t, b);
      if (t.compare(b, n, s_.content) != 0) {
        start_left_ = 0;
        break;
      }
      b += n;
      --start_left_;
    }
    if (b < t.size()) start_left_ = 0;
    return t.substr(b);
  }

  const DecoderStep& s_;
  bool fused_;
  std::string bytes_;             // kByteLevel: bytes not yet emitted
  std::string held_;              // kReplace (fused)
  std::string run_;               // kByteFallback: the current run of <0xNN> bytes
  size_t count_ = 0;              // kMetaspace: tokens seen
  size_t start_left_ = s_.start;  // kStrip (fused)
};

class ChainStream final : public DecoderStream {
 public:
  explicit ChainStream(const std::vector<DecoderStep>& steps) {
    bool fused = false;
    for (const DecoderStep& s : steps) {
      states_.emplace_back(s, fused);
      fused = fused || s.kind == Kind::kFuse || s.kind == Kind::kByteLevel;
    }
  }
  std::string push(std::string token) override {
    std::string result;
    feed(0, std::move(token), result);
    return result;
  }
  std::string finish() override {
    std::string result;
    for (size_t k = 0; k < states_.size(); ++k) {
      std::vector<std::string> out;
      states_[k].finish(out);
      for (std::string& o : out) feed(k + 1, std::move(o), result);
    }
    return result;
  }

 private:
  void feed(size_t k, std::string token, std::string& result) {
    if (k == states_.size()) {
      result += token;
      return;
    }
    std::vector<std::string> out;
    states_[k].push(std::move(token), out);
    for (std::string& o : out) feed(k + 1, std::move(o), result);
  }
  std::vector<StepState> states_;
};

// For chains whose later steps need the whole text (e.g. a regex Replace after Fuse): hold every
// token and decode them at finish(). Exact, but not incremental.
class BufferedStream final : public DecoderStream {
 public:
  explicit BufferedStream(const Decoder& d) : d_(d) {}
  std::string push(std::string token) override {
    tokens_.push_back(std::move(token));
    return "";
  }
  std::string finish() override {
    std::string text = d_.decode(std::move(tokens_));
    tokens_.clear();
    return text;
  }

 private:
  const Decoder& d_;
  std::vector<std::string> tokens_;
};

}  // namespace

std::unique_ptr<Decoder> Decoder::parse(const json& j, const std::string& path) {
  if (j.is_null()) return nullptr;
  auto d = std::make_unique<Decoder>();
  parse_into(j, path, d->steps_);
  return d;
}

std::string Decoder::decode(std::vector<std::string> tokens) const {
  for (const DecoderStep& s : steps_) tokens = apply_step(s, std::move(tokens));
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

std::unique_ptr<DecoderStream> Decoder::stream() const {
  bool fused = false;
  for (const DecoderStep& s : steps_) {
    // Steps that look at a whole token cannot work piecewise on a fused stream.
    const bool whole_token_step = s.kind == Kind::kByteLevel || s.kind == Kind::kByteFallback ||
                                  (s.kind == Kind::kReplace && s.pattern.regex) ||
                                  (s.kind == Kind::kStrip && s.stop > 0);
    if (fused && whole_token_step) return std::make_unique<BufferedStream>(*this);
    fused = fused || s.kind == Kind::kFuse || s.kind == Kind::kByteLevel;
  }
  return std::make_unique<ChainStream>(steps_);
}

}  // namespace kvq::tok
