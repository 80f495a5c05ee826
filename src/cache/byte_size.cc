// Byte sizes from the command line (--kv-cache-memory and friends) and the
// arithmetic that turns a byte budget into a block count.
#include <array>
#include <cstdint>
#include <limits>
#include <string>

#include "kvq/cache/paged_kv_cache.h"
#include "kvq/core/error.h"

namespace kvq {

namespace {

// Exact arithmetic for "1.5GiB": digits * unit / 10^fraction_digits needs more than 64 bits.
__extension__ typedef unsigned __int128 u128;

struct Unit {
  std::string_view name;
  uint64_t bytes;
  bool exact_case;  // the binary 'i' forms are spelled exactly; decimal forms in any case
};

constexpr uint64_t kKi = 1024;
constexpr std::array<Unit, 9> kUnits = {{
    {"B", 1, false},
    {"KB", 1000ull, false},
    {"MB", 1000ull * 1000, false},
    {"GB", 1000ull * 1000 * 1000, false},
    {"TB", 1000ull * 1000 * 1000 * 1000, false},
    {"KiB", kKi, true},
    {"MiB", kKi* kKi, true},
    {"GiB", kKi* kKi* kKi, true},
    {"TiB", kKi* kKi* kKi* kKi, true},
}};

bool ascii_iequal(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    char x = a[i], y = b[i];
    if (x >= 'a' && x <= 'z') x = static_cast<char>(x - 'a' + 'A');
    if (y >= 'a' && y <= 'z') y = static_cast<char>(y - 'a' + 'A');
    if (x != y) return false;
  }
  return true;
}

bool is_space(char c) {
  return c == ' ' || c == '\t';
}
bool is_digit(char c) {
  return c >= '0' && c <= '9';
}

// More significant digits than anyone types; keeps digits * unit within 128 bits.
constexpr int kMaxSignificantDigits = 24;

}  // namespace

size_t parse_byte_size(std::string_view text, std::string_view what) {
  auto fail = [&]() -> InputError {
    return InputError(std::string(what) + ": cannot parse '" + std::string(text) +
                      "' as a byte size; accepted: a number with an optional unit B, KB, MB, "
                      "GB, TB, KiB, MiB, GiB, TiB (e.g. 4GiB)");
  };
  std::string_view s = text;
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);

  // Number: digits, optionally '.' and more digits. No sign, no exponent.
  size_t i = 0;
  u128 digits = 0;
  int significant = 0;
  int fraction_digits = 0;
  size_t int_digits = 0, frac_digits_seen = 0;
  auto take_digit = [&](char c) {
    if (digits == 0 && c == '0') return true;  // leading zeros carry no precision
    if (++significant > kMaxSignificantDigits) return false;
    digits = digits * 10 + static_cast<unsigned>(c - '0');
    return true;
  };
  for (; i < s.size() && is_digit(s[i]); ++i, ++int_digits)
    if (!take_digit(s[i])) throw fail();
  if (int_digits == 0) throw fail();
  if (i < s.size() && s[i] == '.') {
    ++i;
    // Trailing zeros of the fraction change nothing; skip them so "1.50000" is not "too precise".
    size_t end = i;
    while (end < s.size() && is_digit(s[end])) ++end;
    frac_digits_seen = end - i;
    size_t last = end;
    while (last > i && s[last - 1] == '0') --last;
    for (; i < last; ++i, ++fraction_digits)
      if (!take_digit(s[i])) throw fail();
    i = end;
    if (frac_digits_seen == 0) throw fail();
  }

  std::string_view unit = s.substr(i);
  while (!unit.empty() && is_space(unit.front())) unit.remove_prefix(1);
  uint64_t multiplier = 0;
  if (unit.empty()) {
    multiplier = 1;
  } else {
    for (const Unit& u : kUnits)
      if (u.exact_case ? unit == u.name : ascii_iequal(unit, u.name)) multiplier = u.bytes;
  }
  if (multiplier == 0) throw fail();

  u128 bytes = digits * multiplier;                       // <= 10^24 * 2^40 < 2^120
  for (int k = 0; k < fraction_digits; ++k) bytes /= 10;  // floor: fractional bytes round down
  if (bytes == 0 || bytes > std::numeric_limits<size_t>::max()) throw fail();
  return static_cast<size_t>(bytes);
}

int64_t blocks_for_budget(std::span<const LayerKvSpec> layers, size_t budget_bytes) {
  KVQ_CHECK(!layers.empty(), "blocks_for_budget: no layers");
  size_t per_block = 0;
  for (const LayerKvSpec& spec : layers) {
    KVQ_CHECK(spec.block_tokens == layers.front().block_tokens,
              "blocks_for_budget: layer " + std::to_string(spec.layer) + " has block_tokens " +
                  std::to_string(spec.block_tokens) + ", layer " +
                  std::to_string(layers.front().layer) + " has " +
                  std::to_string(layers.front().block_tokens));
    per_block += spec.block_bytes();
  }
  KVQ_CHECK(per_block > 0, "blocks_for_budget: layers occupy zero bytes per block");
  return static_cast<int64_t>(budget_bytes / per_block);
}

}  // namespace kvq
