#include "tokenizer/nfc.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "tokenizer/utf8.h"

namespace kvq::tok {

namespace {

struct NfcDecomposition {
  uint32_t cp, first, second;  // second == 0: a singleton decomposition
};
struct NfcCombiningClass {
  uint32_t first, last;
  uint8_t ccc;
};
struct NfcComposition {
  uint32_t first, second, composite;
};

#include "tokenizer/nfc_tables.inc"

constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount;
constexpr uint32_t kSCount = kLCount * kNCount;

uint8_t combining_class(uint32_t cp) {
  const auto* end = std::end(kNfcCombiningClasses);
  const auto* it =
      std::upper_bound(std::begin(kNfcCombiningClasses), end, cp,
                       [](uint32_t c, const NfcCombiningClass& r) { return c < r.first; });
  if (it == std::begin(kNfcCombiningClasses)) return 0;
  --it;
  return cp <= it->last ? it->ccc : 0;
}

void decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const uint32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  const auto* end = std::end(kNfcDecompositions);
  const auto* it = std::lower_bound(std::begin(kNfcDecompositions), end, cp,
                                    [](const NfcDecomposition& d, uint32_t c) { return d.cp < c; });
  if (it == end || it->cp != cp) {
    out.push_back(cp);
    return;
  }
  decompose(it->first, out);
  if (it->second != 0) decompose(it->second, out);
}

// The primary composite of (a, b), or 0.
uint32_t compose(uint32_t a, uint32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount) {
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  }
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount) {
    return a + (b - kTBase);
  }
  const auto* end = std::end(kNfcCompositions);
  const auto* it =
      std::lower_bound(std::begin(kNfcCompositions), end, std::make_pair(a, b),
                       [](const NfcComposition& c, const std::pair<uint32_t, uint32_t>& k) {
                         return c.first != k.first ? c.first < k.first : c.second < k.second;
                       });
  return it != end && it->first == a && it->second == b ? it->composite : 0;
}

}  // namespace

std::string nfc(std::string_view s) {
  // Every code point below U+0300 is its own NFC with combining class 0; their UTF-8 lead bytes
  // are all below 0xCC.
  if (std::none_of(s.begin(), s.end(), [](char c) { return static_cast<uint8_t>(c) >= 0xCC; })) {
    return std::string(s);
  }
  std::vector<uint32_t> cps;
  cps.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_char_len(s, i);
    decompose(utf8_decode(s, i, n), cps);
    i += n;
  }
  // Canonical ordering: stable sort of each run of non-starters by combining class.
  for (size_t i = 0; i < cps.size();) {
    if (combining_class(cps[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < cps.size() && combining_class(cps[j]) != 0) ++j;
    std::stable_sort(
        cps.begin() + static_cast<ptrdiff_t>(i), cps.begin() + static_cast<ptrdiff_t>(j),
        [](uint32_t a, uint32_t b) { return combining_class(a) < combining_class(b); });
    i = j;
  }
  // Canonical composition (UAX #15): join each character to the last starter unless blocked.
  if (!cps.empty()) {
    size_t starter = 0, kept = 1;
    int last_class = combining_class(cps[0]) == 0 ? 0 : 256;
    for (size_t k = 1; k < cps.size(); ++k) {
      const uint32_t ch = cps[k];
      const int cls = combining_class(ch);
      const uint32_t composite = last_class == 256 ? 0 : compose(cps[starter], ch);
      if (composite != 0 && (last_class < cls || last_class == 0)) {
        cps[starter] = composite;
        continue;
      }
      if (cls == 0) starter = kept;
      last_class = cls;
      cps[kept++] = ch;
    }
    cps.resize(kept);
  }
  std::string out;
  out.reserve(s.size());
  for (uint32_t cp : cps) utf8_append(out, cp);
  return out;
}

}  // namespace kvq::tok
