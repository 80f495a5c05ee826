// The OpenAI API's request and response shapes for /v1/completions and /v1/chat/completions:
// parsing and validating request bodies, and building response bodies and stream chunks.
// Nothing here touches HTTP or the engine; the server glues them together.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/core/error.h"
#include "kvq/engine/llm_engine.h"
#include "kvq/engine/sampler.h"
#include "kvq/server/chat_format.h"

namespace kvq {

// A request the server refuses, answered as {"error": {"message", "type", "param", "code"}}
// with an HTTP status (4xx for the client's mistakes).
class ApiError : public InputError {
 public:
  ApiError(int status, const std::string& message, std::string param = {}, std::string code = {},
           std::string type = "invalid_request_error");
  int status() const { return status_; }
  const std::string& param() const { return param_; }  // "" -> null
  const std::string& code() const { return code_; }    // "" -> null
  const std::string& type() const { return type_; }

 private:
  int status_;
  std::string param_, code_, type_;
};

nlohmann::json error_json(const ApiError& e);

enum class Endpoint : uint8_t { kCompletions, kChatCompletions };

// A validated request. Fields the API has and kvq honours; unknown fields are ignored (clients
// send many), known fields of the wrong type or with unsupported values are refused.
struct GenerationRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::optional<std::string> model;
  // /v1/completions: prompt text, or token ids (prompt_ids_given).
  std::string prompt_text;
  std::vector<int32_t> prompt_ids;
  bool prompt_ids_given = false;
  // /v1/chat/completions.
  std::vector<ChatMessage> messages;
  bool add_generation_prompt = true;

  SamplingParams sampling;        // max_tokens is resolved later when not given
  std::optional<int> max_tokens;  // as given (max_tokens, or chat's max_completion_tokens)
  int n = 1;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // completions: `logprobs: k` (k >= 0); chat: `logprobs: true`. nullopt: not asked.
  std::optional<int> logprobs;
  int top_logprobs = 0;  // chat's top_logprobs: alternatives per token
};

// Parses a request body; throws ApiError (400) for malformed JSON or a body that is not an object.
nlohmann::json parse_json_body(std::string_view body);

// Validates the body of each endpoint; throws ApiError (400) naming the field (as `param`).
GenerationRequest parse_completion_request(const nlohmann::json& body);
GenerationRequest parse_chat_request(const nlohmann::json& body);

// What one choice produced (accumulated over the whole request).
struct ChoiceOutput {
  std::string text;
  std::string finish_reason;  // "stop", "length"
  std::vector<int32_t> token_ids;
  std::vector<TokenLogprob> logprobs;
};

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_prompt_tokens = 0;
};
nlohmann::json usage_json(const Usage& u);

// Fixed per-response fields.
struct ResponseMeta {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string id;  // "cmpl-..." / "chatcmpl-..."
  int64_t created = 0;
  std::string model;
};

// How a token is spelled in logprobs (its decoded text).
using TokenText = std::function<std::string(int32_t id)>;

// The logprobs object of one choice over `logprobs` (tokens in order): completions' shape
// {tokens, token_logprobs, top_logprobs, text_offset} with offsets counted from `text_offset`
// (advanced past these tokens) and top_logprobs null when no alternatives were asked, else one
// {token text: logprob} object per token; or chat's {content: [{token, logprob, bytes,
// top_logprobs: [{token, logprob, bytes}]}]}. `in_text` spells a token as the returned text has
// it (empty for a special token the text skips, such as an end-of-text token generated with
// ignore_eos), so that text_offset indexes the text; without it the offsets advance by
// token_text's bytes.
nlohmann::json logprobs_json(Endpoint endpoint, const std::vector<TokenLogprob>& logprobs,
                             const TokenText& token_text, int64_t* text_offset,
                             const TokenText& in_text = {});

// The non-streaming response body.
nlohmann::json make_response(const ResponseMeta& meta, const std::vector<ChoiceOutput>& choices,
                             const Usage& usage, bool with_logprobs, const TokenText& token_text,
                             const TokenText& in_text = {});

// One streamed chunk for one choice. `first` (chat): the delta carries the assistant role.
// finish_reason empty: not finished yet (null). logprobs: null when absent.
nlohmann::json make_stream_chunk(const ResponseMeta& meta, int index, std::string_view text,
                                 bool first, std::string_view finish_reason,
                                 const nlohmann::json& logprobs, bool usage_field);
// The last chunk when stream_options.include_usage: empty choices and the usage.
nlohmann::json make_usage_chunk(const ResponseMeta& meta, const Usage& usage);

// Server-sent events framing.
std::string sse_data(const nlohmann::json& chunk);  // "data: {...}\n\n"
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

}  // namespace kvq
