// Hugging Face tokenizers (tokenizer.json), reimplemented so that encode() and decode() give
// exactly the ids and text the `tokenizers` library gives for the configurations listed in
// docs below: byte-level BPE (GPT-2 / Qwen / Llama-3 style) and sentencepiece-style BPE with
// byte fallback (Llama-2 style). Anything else is refused at load() with an InputError.
//
// Supported tokenizer.json components:
//   model:          BPE (vocab, merges as "a b" strings or [a, b] pairs, unk_token, fuse_unk,
//                   byte_fallback, ignore_merges, continuing_subword_prefix, end_of_word_suffix)
//   normalizer:     Sequence, Prepend, Replace, Strip, NFC
//   pre_tokenizer:  Sequence, ByteLevel, Split (String or Regex pattern, every behavior, invert),
//                   Metaspace (prepend_scheme always/first/never, split), Digits
//   post_processor: TemplateProcessing, ByteLevel, RobertaProcessing, BertProcessing, Sequence
//   decoder:        Sequence, ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace
//   added_tokens:   literal matching, leftmost-longest, with special/normalized/lstrip/rstrip/
//                   single_word honoured; ids assigned by HF's rule (file order; the "id" field
//                   only agrees with it in a consistent file)
// Split regexes run on PCRE2 (UTF + UCP, JIT) with \s widened to Oniguruma's (adds U+0085).
//
// Behaviour on unusual input:
//   - Invalid UTF-8 in encode() input is replaced by U+FFFD (one per maximal invalid
//     subsequence, as Rust's String::from_utf8_lossy does) before tokenization.
//   - decode() skips ids that are neither in the vocabulary nor added tokens, as HF does.
//   - NFC uses tables generated from Python's unicodedata (Unicode 14); characters newer than
//     that are left as they are.
//   - truncation / padding in tokenizer.json are ignored (encode returns every id).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvq {

class Tokenizer {
 public:
  // Reads DIR/tokenizer.json (required) and, when present, DIR/tokenizer_config.json
  // (bos_token, eos_token, add_bos_token, chat_template), DIR/generation_config.json
  // (eos_token_id: int or list, bos_token_id) and DIR/config.json (bos/eos ids, used only when
  // the other files do not name them). Throws InputError naming the file and what is wrong.
  static Tokenizer load(const std::string& model_dir);
  // Same, from the text of a tokenizer.json only (no config files); `origin` names it in errors.
  static Tokenizer from_json(std::string_view tokenizer_json, const std::string& origin);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // add_special_tokens: apply the post_processor (e.g. prepend BOS), as HF does.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const;

  int32_t vocab_size() const;  // largest id + 1 over the vocab and the added tokens
  std::optional<int32_t> bos_id() const;
  std::vector<int32_t> eos_ids() const;  // every id that ends generation
  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;
  bool add_bos_token() const;  // tokenizer_config.json's add_bos_token (false when absent)
  const std::string& chat_template() const;  // "" when none

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  friend class StreamingDecoder;
  std::unique_ptr<Impl> impl_;
};

// Turns ids into text one id at a time. Every piece returned is valid UTF-8 (a multi-byte
// character split over several tokens comes out whole, once complete), and the concatenation
// of all push() results and finish() equals decode(all ids, skip_special_tokens).
// Text is held back only as long as later ids could still change it (an incomplete UTF-8
// sequence, a run of <0xNN> byte tokens, trailing characters a Strip decoder may remove).
// The Tokenizer must outlive the decoder.
class StreamingDecoder {
 public:
  explicit StreamingDecoder(const Tokenizer& t, bool skip_special_tokens = true);
  StreamingDecoder(StreamingDecoder&&) noexcept;
  ~StreamingDecoder();
  std::string push(int32_t id);
  std::string finish();  // flushes what is held back; the decoder can then be reused

  struct State;

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_;
  std::unique_ptr<State> state_;
};

}  // namespace kvq
