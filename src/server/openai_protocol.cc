#include "kvq/server/openai_protocol.h"

#include <cmath>
#include <limits>

namespace kvq {

ApiError::ApiError(int status, const std::string& message, std::string param, std::string code,
                   std::string type)
    : InputError(message),
      status_(status),
      param_(std::move(param)),
      code_(std::move(code)),
      type_(std::move(type)) {}

nlohmann::json error_json(const ApiError& e) {
  auto opt = [](const std::string& s) {
    return s.empty() ? nlohmann::json(nullptr) : nlohmann::json(s);
  };
  return {{"error",
           {{"message", e.what()},
            {"type", e.type()},
            {"param", opt(e.param())},
            {"code", opt(e.code())}}}};
}

nlohmann::json parse_json_body(std::string_view body) {
  nlohmann::json j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded())
    throw ApiError(
        400,
        "the request body is not valid JSON; send a JSON object (Content-Type: application/json)");
  if (!j.is_object())
    throw ApiError(400,
                   "the request body must be a JSON object, got " + std::string(j.type_name()));
  return j;
}

namespace {

std::string type_word(const nlohmann::json& v) {
  if (v.is_boolean()) return "a boolean";
  if (v.is_number_integer() || v.is_number_unsigned()) return "an integer";
  if (v.is_number_float()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "null";
}

[[noreturn]] void bad_type(const std::string& field, const char* want, const nlohmann::json& got) {
  throw ApiError(400, "'" + field + "' must be " + want + ", got " + type_word(got), field);
}

[[noreturn]] void bad_value(const std::string& field, const std::string& what) {
  throw ApiError(400, "'" + field + "' " + what, field);
}

// Typed access to the body's fields; absent and null mean "not given".
class Fields {
 public:
  explicit Fields(const nlohmann::json& j) : j_(j) {}

  const nlohmann::json* get(const std::string& name) const {
    auto it = j_.find(name);
    if (it == j_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  std::optional<bool> boolean(const std::string& name) const {
    const auto* v = get(name);
    if (!v) return std::nullopt;
    if (!v->is_boolean()) bad_type(name, "a boolean", *v);
    return v->get<bool>();
  }
  std::optional<double> number(const std::string& name) const {
    const auto* v = get(name);
    if (!v) return std::nullopt;
    if (!v->is_number()) bad_type(name, "a number", *v);
    return v->get<double>();
  }
  std::optional<int64_t> integer(const std::string& name, int64_t lo, int64_t hi) const {
    const auto* v = get(name);
    if (!v) return std::nullopt;
    return as_integer(name, *v, lo, hi);
  }
  std::optional<std::string> string(const std::string& name) const {
    const auto* v = get(name);
    if (!v) return std::nullopt;
    if (!v->is_string()) bad_type(name, "a string", *v);
    return v->get<std::string>();
  }

  static int64_t as_integer(const std::string& name, const nlohmann::json& v, int64_t lo,
                            int64_t hi) {
    if (!v.is_number_integer() && !v.is_number_unsigned()) bad_type(name, "an integer", v);
    bool in_range = true;
    int64_t x = 0;
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      in_range = u <= static_cast<uint64_t>(hi);
      x = in_range ? static_cast<int64_t>(u) : hi;
    } else {
      x = v.get<int64_t>();
    }
    if (!in_range || x < lo || x > hi)
      bad_value(name, "must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                          "], got " + v.dump());
    return x;
  }

 private:
  const nlohmann::json& j_;
};

constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();

std::vector<int32_t> token_id_list(const std::string& field, const nlohmann::json& arr) {
  std::vector<int32_t> ids;
  ids.reserve(arr.size());
  for (const auto& v : arr)
    ids.push_back(static_cast<int32_t>(Fields::as_integer(field, v, 0, kMaxInt32)));
  return ids;
}

// A field kvq knows but cannot honour: refused rather than silently ignored, since the
// output would not be what the client asked for.
void refuse_unless(bool ok, const std::string& field, const std::string& what) {
  if (!ok) throw ApiError(400, "'" + field + "' " + what + " is not supported by kvq", field);
}

// Fields both endpoints share.
void parse_common(const Fields& f, GenerationRequest& r) {
  r.model = f.string("model");
  if (auto v = f.integer("n", 1, 128)) r.n = static_cast<int>(*v);
  if (auto v = f.boolean("stream")) r.stream = *v;
  if (const auto* so = f.get("stream_options")) {
    if (!so->is_object()) bad_type("stream_options", "an object", *so);
    if (!r.stream) bad_value("stream_options", "is only allowed when 'stream' is true");
    if (auto v = Fields(*so).boolean("include_usage")) r.include_usage = *v;
  }

  SamplingParams& p = r.sampling;
  p = SamplingParams{};
  if (auto v = f.number("temperature")) p.temperature = static_cast<float>(*v);
  if (auto v = f.number("top_p")) p.top_p = static_cast<float>(*v);
  if (auto v = f.integer("top_k", -1, kMaxInt32))
    p.top_k = *v <= 0 ? 0 : static_cast<int>(*v);  // vLLM: -1 = off
  if (auto v = f.number("min_p")) p.min_p = static_cast<float>(*v);
  if (const auto* v = f.get("seed")) {
    if (!v->is_number_integer() && !v->is_number_unsigned()) bad_type("seed", "an integer", *v);
    p.seed =
        v->is_number_unsigned() ? v->get<uint64_t>() : static_cast<uint64_t>(v->get<int64_t>());
  }
  if (const auto* v = f.get("stop")) {
    if (v->is_string()) {
      p.stop.push_back(v->get<std::string>());
    } else if (v->is_array()) {
      for (const auto& s : *v) {
        if (!s.is_string()) bad_type("stop", "a string or an array of strings", s);
        p.stop.push_back(s.get<std::string>());
      }
    } else {
      bad_type("stop", "a string or an array of strings", *v);
    }
    for (const auto& s : p.stop)
      if (s.empty()) bad_value("stop", "must not contain empty strings");
  }
  if (const auto* v = f.get("stop_token_ids")) {  // vLLM extension
    if (!v->is_array()) bad_type("stop_token_ids", "an array of integers", *v);
    p.stop_token_ids = token_id_list("stop_token_ids", *v);
  }
  if (auto v = f.boolean("ignore_eos")) p.ignore_eos = *v;  // vLLM extension
  // kvq extension: false opts this request out of speculative decoding.
  if (auto v = f.boolean("speculative")) p.speculate = *v;

  for (const char* name : {"presence_penalty", "frequency_penalty"})
    if (auto v = f.number(name)) refuse_unless(*v == 0.0, name, "other than 0");
  if (auto v = f.number("repetition_penalty"))
    refuse_unless(*v == 1.0, "repetition_penalty", "other than 1");
  if (const auto* v = f.get("logit_bias")) {
    if (!v->is_object()) bad_type("logit_bias", "an object", *v);
    refuse_unless(v->empty(), "logit_bias", "(a non-empty map)");
  }
  if (const auto* v = f.get("response_format")) {
    if (!v->is_object()) bad_type("response_format", "an object", *v);
    auto t = Fields(*v).string("type");
    refuse_unless(!t || *t == "text", "response_format", "of type '" + t.value_or("") + "'");
  }
}

// Sampling values the sampler would refuse, reported with the field they came from.
void check_sampling(const SamplingParams& p) {
  SamplingParams probe = p;
  probe.max_tokens = 1;  // checked on its own: it may still be unresolved here
  auto errors = sampling_param_errors(probe);
  if (errors.empty()) return;
  const std::string& e = errors.front();
  const std::string field = e.substr(0, e.find(' '));
  throw ApiError(400, "'" + field + "'" + e.substr(field.size()), field);
}

std::string message_content(const nlohmann::json& content, size_t i) {
  const std::string field = "messages[" + std::to_string(i) + "].content";
  if (content.is_null()) return {};
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) bad_type(field, "a string or an array of text parts", content);
  std::string text;
  for (const auto& part : content) {
    if (!part.is_object()) bad_type(field, "a string or an array of text parts", part);
    Fields pf(part);
    const auto type = pf.string("type");
    if (type != "text")
      throw ApiError(
          400,
          "'" + field + "': only text parts are supported, got type '" + type.value_or("") + "'",
          field);
    const auto t = pf.string("text");
    if (!t) throw ApiError(400, "'" + field + "': a text part needs 'text'", field);
    text += *t;
  }
  return text;
}

}  // namespace

GenerationRequest parse_completion_request(const nlohmann::json& body) {
  Fields f(body);
  GenerationRequest r;
  r.endpoint = Endpoint::kCompletions;
  const auto* prompt = f.get("prompt");
  if (!prompt)
    throw ApiError(400, "'prompt' is required (a string or an array of token ids)", "prompt");
  const char* prompt_kinds = "a string or an array of token ids";
  const nlohmann::json* one = prompt;
  if (prompt->is_array() && !prompt->empty() &&
      (prompt->front().is_string() || prompt->front().is_array())) {
    // A list of prompts: OpenAI batches them; kvq serves one prompt per request.
    if (prompt->size() != 1)
      throw ApiError(
          400, "'prompt': a list of several prompts is not supported; send one request per prompt",
          "prompt");
    one = &prompt->front();
  }
  if (one->is_string()) {
    r.prompt_text = one->get<std::string>();
  } else if (one->is_array()) {
    if (one->empty()) bad_value("prompt", "must not be an empty array");
    r.prompt_ids = token_id_list("prompt", *one);
    r.prompt_ids_given = true;
  } else {
    bad_type("prompt", prompt_kinds, *one);
  }
  parse_common(f, r);
  if (auto v = f.integer("max_tokens", 1, kMaxInt32)) r.max_tokens = static_cast<int>(*v);
  if (auto v = f.integer("logprobs", 0, 20)) r.logprobs = static_cast<int>(*v);
  if (auto v = f.boolean("echo")) refuse_unless(!*v, "echo", "true");
  if (auto v = f.integer("best_of", 1, 128)) refuse_unless(*v == r.n, "best_of", "other than n");
  if (auto v = f.string("suffix")) refuse_unless(v->empty(), "suffix", "(a non-empty suffix)");
  check_sampling(r.sampling);
  return r;
}

GenerationRequest parse_chat_request(const nlohmann::json& body) {
  Fields f(body);
  GenerationRequest r;
  r.endpoint = Endpoint::kChatCompletions;
  const auto* msgs = f.get("messages");
  if (!msgs)
    throw ApiError(400, "'messages' is required (an array of {role, content})", "messages");
  if (!msgs->is_array()) bad_type("messages", "an array of {role, content}", *msgs);
  if (msgs->empty()) bad_value("messages", "must not be empty");
  for (size_t i = 0; i < msgs->size(); ++i) {
    const auto& m = (*msgs)[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) bad_type(at, "an object with role and content", m);
    Fields mf(m);
    auto role = mf.string("role");
    if (!role) throw ApiError(400, "'" + at + ".role' is required", at + ".role");
    if (*role != "system" && *role != "developer" && *role != "user" && *role != "assistant" &&
        *role != "tool")
      throw ApiError(400,
                     "'" + at +
                         ".role' must be one of system, developer, user, assistant, tool; got '" +
                         *role + "'",
                     at + ".role");
    auto content = m.find("content");
    r.messages.push_back(
        {*role, message_content(content == m.end() ? nlohmann::json() : *content, i)});
  }
  parse_common(f, r);
  if (auto v = f.integer("max_tokens", 1, kMaxInt32)) r.max_tokens = static_cast<int>(*v);
  if (auto v = f.integer("max_completion_tokens", 1, kMaxInt32))
    r.max_tokens = static_cast<int>(*v);
  if (auto v = f.boolean("logprobs"); v && *v) r.logprobs = 0;
  if (auto v = f.integer("top_logprobs", 0, 20)) {
    if (*v > 0 && !r.logprobs) bad_value("top_logprobs", "needs 'logprobs': true");
    r.top_logprobs = static_cast<int>(*v);
  }
  if (auto v = f.boolean("add_generation_prompt")) r.add_generation_prompt = *v;  // vLLM extension
  if (const auto* v = f.get("tools")) {
    if (!v->is_array()) bad_type("tools", "an array", *v);
    refuse_unless(v->empty(), "tools", "(tool calling)");
  }
  check_sampling(r.sampling);
  return r;
}

nlohmann::json usage_json(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_prompt_tokens}}}};
}

nlohmann::json logprobs_json(Endpoint endpoint, const std::vector<TokenLogprob>& logprobs,
                             const TokenText& token_text, int64_t* text_offset,
                             const TokenText& in_text) {
  if (endpoint == Endpoint::kCompletions) {
    nlohmann::json tokens = nlohmann::json::array(), values = nlohmann::json::array(),
                   offsets = nlohmann::json::array(), tops = nlohmann::json::array();
    bool any_top = false;
    for (const auto& lp : logprobs) {
      std::string t = token_text(lp.id);
      offsets.push_back(*text_offset);
      *text_offset += static_cast<int64_t>(in_text ? in_text(lp.id).size() : t.size());
      tokens.push_back(std::move(t));
      values.push_back(lp.logprob);
      // OpenAI's legacy shape: {token text: logprob}; two ids spelled alike keep the likelier.
      nlohmann::json top = nlohmann::json::object();
      for (const auto& [id, v] : lp.top) {
        const std::string s = token_text(id);
        if (!top.contains(s)) top[s] = v;
      }
      any_top = any_top || !lp.top.empty();
      tops.push_back(std::move(top));
    }
    return {{"tokens", tokens},
            {"token_logprobs", values},
            {"top_logprobs", any_top ? tops : nlohmann::json(nullptr)},
            {"text_offset", offsets}};
  }
  auto entry = [&](int32_t id, float v) {
    std::string t = token_text(id);
    nlohmann::json bytes = nlohmann::json::array();
    for (unsigned char c : t) bytes.push_back(static_cast<int>(c));
    return nlohmann::json{{"token", std::move(t)}, {"logprob", v}, {"bytes", std::move(bytes)}};
  };
  nlohmann::json content = nlohmann::json::array();
  for (const auto& lp : logprobs) {
    nlohmann::json e = entry(lp.id, lp.logprob);
    nlohmann::json top = nlohmann::json::array();
    for (const auto& [id, v] : lp.top) top.push_back(entry(id, v));
    e["top_logprobs"] = std::move(top);
    content.push_back(std::move(e));
  }
  return {{"content", std::move(content)}};
}

namespace {
const char* object_name(Endpoint e, bool chunk) {
  if (e == Endpoint::kCompletions) return "text_completion";
  return chunk ? "chat.completion.chunk" : "chat.completion";
}
}  // namespace

nlohmann::json make_response(const ResponseMeta& meta, const std::vector<ChoiceOutput>& choices,
                             const Usage& usage, bool with_logprobs, const TokenText& token_text,
                             const TokenText& in_text) {
  nlohmann::json out_choices = nlohmann::json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const auto& c = choices[i];
    nlohmann::json lp = nullptr;
    if (with_logprobs) {
      int64_t offset = 0;
      lp = logprobs_json(meta.endpoint, c.logprobs, token_text, &offset, in_text);
    }
    nlohmann::json choice = {{"index", i}};
    if (meta.endpoint == Endpoint::kCompletions)
      choice["text"] = c.text;
    else
      choice["message"] = {{"role", "assistant"}, {"content", c.text}};
    choice["logprobs"] = std::move(lp);
    choice["finish_reason"] = c.finish_reason;
    out_choices.push_back(std::move(choice));
  }
  return {{"id", meta.id},           {"object", object_name(meta.endpoint, false)},
          {"created", meta.created}, {"model", meta.model},
          {"choices", out_choices},  {"usage", usage_json(usage)}};
}

nlohmann::json make_stream_chunk(const ResponseMeta& meta, int index, std::string_view text,
                                 bool first, std::string_view finish_reason,
                                 const nlohmann::json& logprobs, bool usage_field) {
  nlohmann::json choice = {{"index", index}};
  if (meta.endpoint == Endpoint::kCompletions) {
    choice["text"] = text;
  } else {
    nlohmann::json delta = nlohmann::json::object();
    if (first) delta["role"] = "assistant";
    if (first || !text.empty()) delta["content"] = text;
    choice["delta"] = std::move(delta);
  }
  choice["logprobs"] = logprobs;
  choice["finish_reason"] =
      finish_reason.empty() ? nlohmann::json(nullptr) : nlohmann::json(finish_reason);
  nlohmann::json chunk = {{"id", meta.id},
                          {"object", object_name(meta.endpoint, true)},
                          {"created", meta.created},
                          {"model", meta.model},
                          {"choices", nlohmann::json::array({std::move(choice)})}};
  // OpenAI sends "usage": null in every chunk but the last when include_usage is set.
  if (usage_field) chunk["usage"] = nullptr;
  return chunk;
}

nlohmann::json make_usage_chunk(const ResponseMeta& meta, const Usage& usage) {
  return {{"id", meta.id},
          {"object", object_name(meta.endpoint, true)},
          {"created", meta.created},
          {"model", meta.model},
          {"choices", nlohmann::json::array()},
          {"usage", usage_json(usage)}};
}

std::string sse_data(const nlohmann::json& chunk) {
  // Invalid UTF-8 cannot reach here (the engine emits whole characters), but a dump must never
  // throw mid-stream: replace rather than fail.
  return "data: " + chunk.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n\n";
}

}  // namespace kvq
