// Fuzz targets: one per input kvq reads from untrusted sources (issue #16). Each function runs
// one input through the parser the way kvq uses it. A rejection with a clear message
// (InputError, ApiError) is the expected answer to bad input and is swallowed; anything else
// (another exception, a sanitizer report, a failed invariant: std::abort) is a finding.
//
// The same functions back the libFuzzer binaries (tests/fuzz/fuzzer_main.cc, `make fuzz`) and
// the corpus test in the ordinary build (tests/fuzz/corpus_test.cc), which replays the seed
// corpora and every committed regression input under the sanitizer build too.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

namespace kvq::fuzz {

using Input = std::span<const uint8_t>;

// A safetensors file: header, tensor table, and the small float tensors read back.
void safetensors_file(Input data);
// config.json text (+ quantization config) -> parse_json_text -> parse_model_config ->
// make_kv_plan, with the KV flags
// (--kv-cache-dtype, -ctk / -ctv, --kv-cache-dtype-skip-layers, --block-size) drawn from the
// first bytes; the plan's JSON and table are rendered.
void model_config(Input data);
// tokenizer.json -> Tokenizer::from_json, then encode / decode; or (first byte odd) text through
// the default model's tokenizer, checking decode(encode(text)) == text for valid UTF-8.
void tokenizer(Input data);
// An OpenAI request body -> parse_json_body -> the completions or chat parser (first byte),
// and a chat request's messages rendered with both chat formats.
void openai_request(Input data);
// The small flag parsers: --kv-cache-dtype names, --kv-cache-dtype-skip-layers, byte sizes,
// --speculative-config (first byte selects).
void flags(Input data);

struct Target {
  std::string_view name;
  void (*run)(Input);
};
std::span<const Target> targets();

}  // namespace kvq::fuzz
