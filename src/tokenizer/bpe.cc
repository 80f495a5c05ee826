#include "tokenizer/bpe.h"

#include <cstdio>
#include <nlohmann/json.hpp>
#include <queue>
#include <stdexcept>

#include "tokenizer/utf8.h"

namespace kvq::tok {

namespace {

[[noreturn]] void bad(const std::string& what) {
  throw std::invalid_argument(what);
}

std::optional<std::string> optional_string(const nlohmann::json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return std::nullopt;
  if (!it->is_string()) bad(std::string("model.") + key + " must be a string or null");
  return it->get<std::string>();
}

bool optional_bool(const nlohmann::json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return false;
  if (!it->is_boolean()) bad(std::string("model.") + key + " must be true or false");
  return it->get<bool>();
}

}  // namespace

BpeModel BpeModel::from_json(const nlohmann::json& m) {
  BpeModel bpe;
  auto vit = m.find("vocab");
  if (vit == m.end() || !vit->is_object()) bad("model.vocab is missing or not an object");
  auto mit = m.find("merges");
  if (mit == m.end() || !mit->is_array()) bad("model.merges is missing or not an array");

  int64_t max_id = -1;
  for (const auto& [token, id] : vit->items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
      bad("model.vocab[\"" + token + "\"] is not a token id (a non-negative integer)");
    }
    bpe.vocab_.emplace(token, static_cast<int32_t>(id.get<int64_t>()));
    max_id = std::max(max_id, id.get<int64_t>());
  }
  bpe.vocab_r_.assign(static_cast<size_t>(max_id + 1), std::string());
  bpe.has_id_.assign(static_cast<size_t>(max_id + 1), false);
  for (const auto& [token, id] : bpe.vocab_) {
    bpe.vocab_r_[static_cast<size_t>(id)] = token;
    bpe.has_id_[static_cast<size_t>(id)] = true;
  }

  if (auto d = m.find("dropout"); d != m.end() && !d->is_null()) {
    if (!d->is_number() || d->get<double>() < 0.0 || d->get<double>() > 1.0) {
      bad("model.dropout must be null or a number in [0, 1]");
    }
    if (d->get<double>() != 0.0) {
      bad("model.dropout is " + d->dump() + "; only null or 0 (deterministic BPE) is supported");
    }
  }
  bpe.unk_token_ = optional_string(m, "unk_token");
  bpe.continuing_subword_prefix_ = optional_string(m, "continuing_subword_prefix").value_or("");
  bpe.end_of_word_suffix_ = optional_string(m, "end_of_word_suffix").value_or("");
  bpe.fuse_unk_ = optional_bool(m, "fuse_unk");
  bpe.byte_fallback_ = optional_bool(m, "byte_fallback");
  bpe.ignore_merges_ = optional_bool(m, "ignore_merges");

  const size_t prefix_len = bpe.continuing_subword_prefix_.size();
  uint32_t rank = 0;
  for (const auto& entry : *mit) {
    std::string a, b;
    if (entry.is_string()) {
      // Legacy form "a b": exactly one space (HF splits on ' ' and wants two parts).
      const std::string s = entry.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
        bad("model.merges[" + std::to_string(rank) + "] \"" + s +
            "\" is not two tokens separated by one space");
      }
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (entry.is_array() && entry.size() == 2 && entry[0].is_string() &&
               entry[1].is_string()) {
      a = entry[0].get<std::string>();
      b = entry[1].get<std::string>();
    } else {
      bad("model.merges[" + std::to_string(rank) +
          "] is neither a \"a b\" string nor a [\"a\", \"b\"] pair");
    }
    auto ia = bpe.vocab_.find(a);
    auto ib = bpe.vocab_.find(b);
    if (ia == bpe.vocab_.end() || ib == bpe.vocab_.end()) {
      bad("model.merges[" + std::to_string(rank) + "] uses token \"" +
          (ia == bpe.vocab_.end() ? a : b) + "\" which is not in model.vocab");
    }
    if (b.size() < prefix_len) {
      bad("model.merges[" + std::to_string(rank) + "] right token \"" + b +
          "\" is shorter than continuing_subword_prefix");
    }
    const std::string merged = a + b.substr(prefix_len);
    auto im = bpe.vocab_.find(merged);
    if (im == bpe.vocab_.end()) {
      bad("model.merges[" + std::to_string(rank) + "] makes \"" + merged +
          "\" which is not in model.vocab");
    }
    // A repeated pair keeps its last rank, as HF's HashMap collect does.
    bpe.merges_[pair_key(ia->second, ib->second)] = MergeTarget{rank, im->second};
    ++rank;
  }

  bpe.byte_ids_.assign(256, -1);
  for (int v = 0; v < 256; ++v) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", v);
    if (auto it = bpe.vocab_.find(std::string_view(name)); it != bpe.vocab_.end()) {
      bpe.byte_ids_[static_cast<size_t>(v)] = it->second;
    }
  }
  if (bpe.unk_token_ && !bpe.vocab_.contains(*bpe.unk_token_)) {
    bad("model.unk_token \"" + *bpe.unk_token_ + "\" is not in model.vocab");
  }
  return bpe;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= vocab_r_.size() || !has_id_[static_cast<size_t>(id)]) {
    return nullptr;
  }
  return &vocab_r_[static_cast<size_t>(id)];
}

void BpeModel::tokenize(std::string_view w, std::vector<int32_t>& out) const {
  if (w.empty()) return;
  if (ignore_merges_) {
    if (auto it = vocab_.find(w); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }

  // Symbols form a doubly linked list over the initial characters; a merged-away symbol gets
  // len 0. This mirrors HF's Word::merge_all so that ties resolve identically.
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    uint32_t len;
  };
  std::vector<Symbol> sym;
  sym.reserve(w.size());
  auto add = [&](int32_t id, size_t len) {
    const auto n = static_cast<int32_t>(sym.size());
    if (n > 0) sym.back().next = n;
    sym.push_back(Symbol{id, n - 1, -1, static_cast<uint32_t>(len)});
  };

  int32_t unk_id = -1;  // a pending unk token (-1: none) and its byte length
  size_t unk_len = 0;
  std::string scratch;
  for (size_t i = 0; i < w.size();) {
    const size_t clen = utf8_char_len(w, i);
    const bool is_first = i == 0, is_last = i + clen >= w.size();
    std::string_view s = w.substr(i, clen);
    if ((!is_first && !continuing_subword_prefix_.empty()) ||
        (is_last && !end_of_word_suffix_.empty())) {
      scratch.clear();
      if (!is_first) scratch += continuing_subword_prefix_;
      scratch += s;
      if (is_last) scratch += end_of_word_suffix_;
      s = scratch;
    }
    i += clen;
    if (auto it = vocab_.find(s); it != vocab_.end()) {
      if (unk_id >= 0) {
        add(unk_id, unk_len);
        unk_id = -1;
      }
      add(it->second, clen);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (char c : s) all = all && byte_ids_[static_cast<uint8_t>(c)] >= 0;
      if (all) {
        // HF adds the byte tokens without first flushing a pending unk; keep that order.
        for (char c : s) add(byte_ids_[static_cast<uint8_t>(c)], 1);
        continue;
      }
    }
    if (unk_token_) {
      if (unk_id >= 0 && fuse_unk_) {
        unk_len += clen;
      } else {
        if (unk_id >= 0) add(unk_id, unk_len);
        unk_id = vocab_.find(*unk_token_)->second;
        unk_len = clen;
      }
    }
    // Without an unk token the character is dropped, as in HF.
  }
  if (unk_id >= 0) add(unk_id, unk_len);

  struct Merge {
    uint32_t rank;
    int32_t pos;
    int32_t new_id;
    bool operator>(const Merge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Merge, std::vector<Merge>, std::greater<>> queue;
  auto lookup = [&](int32_t a, int32_t b) -> const MergeTarget* {
    auto it = merges_.find(pair_key(a, b));
    return it == merges_.end() ? nullptr : &it->second;
  };
  for (size_t k = 0; k + 1 < sym.size(); ++k) {
    if (const MergeTarget* m = lookup(sym[k].id, sym[k + 1].id)) {
      queue.push(Merge{m->rank, static_cast<int32_t>(k), m->new_id});
    }
  }
  while (!queue.empty()) {
    const Merge top = queue.top();
    queue.pop();
    Symbol& cur = sym[static_cast<size_t>(top.pos)];
    if (cur.len == 0 || cur.next == -1) continue;
    const int32_t next_pos = cur.next;
    const Symbol right = sym[static_cast<size_t>(next_pos)];
    const MergeTarget* m = lookup(cur.id, right.id);
    if (m == nullptr || m->new_id != top.new_id) continue;  // a stale entry
    cur.id = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    sym[static_cast<size_t>(next_pos)].len = 0;
    if (right.next >= 0) sym[static_cast<size_t>(right.next)].prev = top.pos;
    if (cur.prev >= 0) {
      if (const MergeTarget* pm = lookup(sym[static_cast<size_t>(cur.prev)].id, cur.id)) {
        queue.push(Merge{pm->rank, cur.prev, pm->new_id});
      }
    }
    if (cur.next >= 0) {
      if (const MergeTarget* nm = lookup(cur.id, sym[static_cast<size_t>(cur.next)].id)) {
        queue.push(Merge{nm->rank, top.pos, nm->new_id});
      }
    }
  }
  for (const Symbol& s : sym) {
    if (s.len != 0) out.push_back(s.id);
  }
}

}  // namespace kvq::tok
