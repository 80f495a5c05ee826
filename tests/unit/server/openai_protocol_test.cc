// Request validation and response shapes of the OpenAI API (no model, no HTTP).
#include "kvq/server/openai_protocol.h"

#include <gtest/gtest.h>

#include <random>

namespace kvq {
namespace {

using json = nlohmann::json;

// Expects `fn` to throw ApiError with `status` and `param`.
template <typename F>
void expect_api_error(F fn, int status, const std::string& param, const std::string& context) {
  try {
    fn();
    ADD_FAILURE() << context << ": no error";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), status) << context << ": " << e.what();
    EXPECT_EQ(e.param(), param) << context << ": " << e.what();
    EXPECT_FALSE(std::string(e.what()).empty()) << context;
  }
}

TEST(OpenAiProtocol, CompletionFieldsAreRead) {
  std::random_device rd;
  const unsigned seed = rd();
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(0.01f, 1.0f);
  const float temperature = 2.0f * unit(rng), top_p = unit(rng), min_p = unit(rng) * 0.5f;
  const int top_k = static_cast<int>(rng() % 100) + 1,
            max_tokens = static_cast<int>(rng() % 1000) + 1, n = static_cast<int>(rng() % 8) + 1,
            logprobs = static_cast<int>(rng() % 6);
  const uint64_t s = rng();
  json body = {{"model", "m"},
               {"prompt", "hello"},
               {"temperature", temperature},
               {"top_p", top_p},
               {"top_k", top_k},
               {"min_p", min_p},
               {"max_tokens", max_tokens},
               {"n", n},
               {"seed", s},
               {"stop", {"a", "bc"}},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}},
               {"logprobs", logprobs},
               {"echo", false},
               {"presence_penalty", 0},
               {"user", "someone"},
               {"some_future_field", {{"x", 1}}}};
  GenerationRequest r = parse_completion_request(body);
  const std::string ctx = "seed " + std::to_string(seed);
  EXPECT_EQ(r.endpoint, Endpoint::kCompletions);
  EXPECT_EQ(r.model, "m");
  EXPECT_EQ(r.prompt_text, "hello");
  EXPECT_FALSE(r.prompt_ids_given);
  EXPECT_FLOAT_EQ(r.sampling.temperature, temperature) << ctx;
  EXPECT_FLOAT_EQ(r.sampling.top_p, top_p) << ctx;
  EXPECT_FLOAT_EQ(r.sampling.min_p, min_p) << ctx;
  EXPECT_EQ(r.sampling.top_k, top_k) << ctx;
  EXPECT_EQ(r.max_tokens, max_tokens) << ctx;
  EXPECT_EQ(r.n, n) << ctx;
  EXPECT_EQ(r.sampling.seed, s) << ctx;
  EXPECT_EQ(r.sampling.stop, (std::vector<std::string>{"a", "bc"}));
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.logprobs, logprobs) << ctx;
}

TEST(OpenAiProtocol, Defaults) {
  GenerationRequest r = parse_completion_request({{"prompt", "x"}});
  EXPECT_FALSE(r.max_tokens);
  EXPECT_EQ(r.n, 1);
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.logprobs);
  EXPECT_EQ(r.sampling.temperature, 1.0f);  // OpenAI's default
  EXPECT_EQ(r.sampling.top_p, 1.0f);
  EXPECT_EQ(r.sampling.top_k, 0);
  EXPECT_FALSE(r.sampling.seed);
  // null means "not given".
  GenerationRequest n =
      parse_completion_request({{"prompt", "x"}, {"max_tokens", nullptr}, {"stop", nullptr}});
  EXPECT_FALSE(n.max_tokens);
  EXPECT_TRUE(n.sampling.stop.empty());
  EXPECT_EQ(parse_completion_request({{"prompt", "x"}, {"top_k", -1}}).sampling.top_k,
            0);  // vLLM's "off"
}

TEST(OpenAiProtocol, PromptForms) {
  std::random_device rd;
  const unsigned seed = rd();
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(1 + rng() % 20);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % 50000);
  GenerationRequest a = parse_completion_request({{"prompt", ids}});
  EXPECT_TRUE(a.prompt_ids_given);
  EXPECT_EQ(a.prompt_ids, ids) << "seed " << seed;
  GenerationRequest b = parse_completion_request({{"prompt", json::array({ids})}});
  EXPECT_EQ(b.prompt_ids, ids) << "seed " << seed;
  GenerationRequest c = parse_completion_request({{"prompt", {"one"}}});
  EXPECT_EQ(c.prompt_text, "one");
  expect_api_error(
      [] {
        parse_completion_request({{"prompt", {"a", "b"}}});
      },
      400, "prompt", "two prompts");
  expect_api_error(
      [] {
        parse_completion_request({{"prompt", json::array()}});
      },
      400, "prompt", "empty list");
  expect_api_error(
      [] {
        parse_completion_request({{"prompt", {1, -2}}});
      },
      400, "prompt", "negative id");
  expect_api_error(
      [] {
        parse_completion_request({{"prompt", {1, 2.5}}});
      },
      400, "prompt", "float id");
  expect_api_error(
      [] {
        parse_completion_request({{"prompt", 7}});
      },
      400, "prompt", "number prompt");
  expect_api_error([] { parse_completion_request(json::object()); }, 400, "prompt",
                   "missing prompt");
}

TEST(OpenAiProtocol, WrongTypesNameTheField) {
  const json base = {{"prompt", "x"}};
  const std::vector<std::pair<std::string, json>> cases = {{"temperature", "hot"},
                                                           {"top_p", true},
                                                           {"top_k", 1.5},
                                                           {"min_p", json::array()},
                                                           {"max_tokens", "10"},
                                                           {"n", 2.0},
                                                           {"seed", "7"},
                                                           {"stop", 3},
                                                           {"stream", "yes"},
                                                           {"logprobs", true},
                                                           {"echo", 1},
                                                           {"model", 3},
                                                           {"stream_options", true},
                                                           {"stop_token_ids", 1},
                                                           {"ignore_eos", "no"},
                                                           {"speculative", "no"},
                                                           {"logit_bias", "x"}};
  for (const auto& [field, value] : cases) {
    json b = base;
    b[field] = value;
    if (field == "stream_options") b["stream"] = true;
    expect_api_error([&] { parse_completion_request(b); }, 400, field, field + "=" + value.dump());
  }
}

TEST(OpenAiProtocol, SpeculativeOptOutIsRead) {
  json body = {{"model", "m"}, {"prompt", "hello"}};
  EXPECT_TRUE(parse_completion_request(body).sampling.speculate);
  body["speculative"] = false;
  EXPECT_FALSE(parse_completion_request(body).sampling.speculate);
  body["speculative"] = true;
  EXPECT_TRUE(parse_completion_request(body).sampling.speculate);
}

TEST(OpenAiProtocol, InvalidValuesNameTheField) {
  const std::vector<std::pair<std::string, json>> cases = {{"temperature", -0.5},
                                                           {"top_p", 0.0},
                                                           {"top_p", 1.5},
                                                           {"n", 0},
                                                           {"n", 1000},
                                                           {"max_tokens", 0},
                                                           {"max_tokens", -3},
                                                           {"min_p", 1.5},
                                                           {"top_k", -2},
                                                           {"logprobs", 21},
                                                           {"stop", {"a", ""}},
                                                           {"echo", true},
                                                           {"best_of", 3},
                                                           {"presence_penalty", 0.5},
                                                           {"frequency_penalty", -1.0},
                                                           {"logit_bias", {{"5", 10}}},
                                                           {"suffix", "tail"},
                                                           {"max_tokens", 1LL << 40}};
  for (const auto& [field, value] : cases) {
    json b = {{"prompt", "x"}, {field, value}};
    expect_api_error([&] { parse_completion_request(b); }, 400, field, field + "=" + value.dump());
  }
  expect_api_error(
      [] {
        parse_completion_request({{"prompt", "x"}, {"stream_options", {{"include_usage", true}}}});
      },
      400, "stream_options", "stream_options without stream");
}

TEST(OpenAiProtocol, ChatRequests) {
  json body = {
      {"messages",
       {{{"role", "system"}, {"content", "sys"}},
        {{"role", "user"},
         {"content", {{{"type", "text"}, {"text", "a"}}, {{"type", "text"}, {"text", "b"}}}}},
        {{"role", "assistant"}, {"content", nullptr}}}},
      {"max_tokens", 5},
      {"max_completion_tokens", 7},
      {"logprobs", true},
      {"top_logprobs", 2},
      {"tools", json::array()}};
  GenerationRequest r = parse_chat_request(body);
  EXPECT_EQ(r.endpoint, Endpoint::kChatCompletions);
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[1].content, "ab");
  EXPECT_EQ(r.messages[2].content, "");
  EXPECT_EQ(r.max_tokens, 7);  // max_completion_tokens wins
  EXPECT_EQ(r.logprobs, 0);
  EXPECT_EQ(r.top_logprobs, 2);

  expect_api_error([] { parse_chat_request(json::object()); }, 400, "messages", "missing");
  expect_api_error(
      [] {
        parse_chat_request({{"messages", json::array()}});
      },
      400, "messages", "empty");
  expect_api_error([] { parse_chat_request({{"messages", "hi"}}); }, 400, "messages", "string");
  expect_api_error(
      [] {
        parse_chat_request({{"messages", {{{"content", "x"}}}}});
      },
      400, "messages[0].role", "no role");
  expect_api_error(
      [] {
        parse_chat_request({{"messages", {{{"role", "wizard"}, {"content", "x"}}}}});
      },
      400, "messages[0].role", "bad role");
  expect_api_error(
      [] {
        parse_chat_request({{"messages", {{{"role", "user"}, {"content", 5}}}}});
      },
      400, "messages[0].content", "number content");
  expect_api_error(
      [] {
        parse_chat_request(
            {{"messages",
              {{{"role", "user"}, {"content", {{{"type", "image_url"}, {"image_url", "u"}}}}}}}});
      },
      400, "messages[0].content", "image part");
  expect_api_error(
      [] {
        parse_chat_request(
            {{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"top_logprobs", 2}});
      },
      400, "top_logprobs", "top_logprobs without logprobs");
  expect_api_error(
      [] {
        parse_chat_request({{"messages", {{{"role", "user"}, {"content", "x"}}}},
                            {"tools", {{{"type", "function"}}}}});
      },
      400, "tools", "tools");
  expect_api_error(
      [] {
        parse_chat_request(
            {{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"max_completion_tokens", 0}});
      },
      400, "max_completion_tokens", "zero");
}

TEST(OpenAiProtocol, MalformedBodies) {
  expect_api_error([] { parse_json_body("{\"prompt\": "); }, 400, "", "truncated");
  expect_api_error([] { parse_json_body("[1, 2]"); }, 400, "", "array");
  expect_api_error([] { parse_json_body(""); }, 400, "", "empty");
  EXPECT_EQ(parse_json_body("{\"a\": 1}")["a"], 1);
}

TEST(OpenAiProtocol, ErrorShape) {
  json e = error_json(ApiError(404, "no such model", "model", "model_not_found"));
  ASSERT_TRUE(e.contains("error"));
  EXPECT_EQ(e["error"]["message"], "no such model");
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_EQ(e["error"]["param"], "model");
  EXPECT_EQ(e["error"]["code"], "model_not_found");
  json f = error_json(ApiError(400, "bad"));
  EXPECT_TRUE(f["error"]["param"].is_null());
  EXPECT_TRUE(f["error"]["code"].is_null());
}

TEST(OpenAiProtocol, ResponseShapes) {
  std::random_device rd;
  const unsigned seed = rd();
  std::mt19937 rng(seed);
  auto token_text = [](int32_t id) { return "t" + std::to_string(id); };
  std::vector<ChoiceOutput> choices(2);
  for (auto& c : choices) {
    c.text = "abc";
    c.finish_reason = "length";
    for (int i = 0; i < 4; ++i) {
      c.token_ids.push_back(static_cast<int32_t>(rng() % 1000));
      c.logprobs.push_back({c.token_ids.back(), -static_cast<float>(rng() % 100) / 10.0f});
    }
  }
  const Usage usage{7, 8, 3};
  for (Endpoint ep : {Endpoint::kCompletions, Endpoint::kChatCompletions}) {
    ResponseMeta meta{ep, "id-1", 1234, "served"};
    json r = make_response(meta, choices, usage, true, token_text);
    EXPECT_EQ(r["object"], ep == Endpoint::kCompletions ? "text_completion" : "chat.completion");
    EXPECT_EQ(r["id"], "id-1");
    EXPECT_EQ(r["model"], "served");
    EXPECT_EQ(r["created"], 1234);
    EXPECT_EQ(r["usage"]["prompt_tokens"], 7);
    EXPECT_EQ(r["usage"]["completion_tokens"], 8);
    EXPECT_EQ(r["usage"]["total_tokens"], 15);
    ASSERT_EQ(r["choices"].size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      const json& c = r["choices"][i];
      EXPECT_EQ(c["index"], i);
      EXPECT_EQ(c["finish_reason"], "length");
      if (ep == Endpoint::kCompletions) {
        EXPECT_EQ(c["text"], "abc");
        const json& lp = c["logprobs"];
        ASSERT_EQ(lp["tokens"].size(), 4u);
        int64_t offset = 0;
        for (size_t t = 0; t < 4; ++t) {
          EXPECT_EQ(lp["tokens"][t], token_text(choices[i].token_ids[t])) << "seed " << seed;
          EXPECT_FLOAT_EQ(lp["token_logprobs"][t].get<float>(), choices[i].logprobs[t].logprob);
          EXPECT_EQ(lp["text_offset"][t], offset);
          offset += static_cast<int64_t>(token_text(choices[i].token_ids[t]).size());
        }
        EXPECT_TRUE(lp["top_logprobs"].is_null());
      } else {
        EXPECT_EQ(c["message"]["role"], "assistant");
        EXPECT_EQ(c["message"]["content"], "abc");
        ASSERT_EQ(c["logprobs"]["content"].size(), 4u);
        const json& t0 = c["logprobs"]["content"][0];
        const std::string s = token_text(choices[i].token_ids[0]);
        EXPECT_EQ(t0["token"], s);
        EXPECT_EQ(t0["bytes"].size(), s.size());
        EXPECT_FLOAT_EQ(t0["logprob"].get<float>(), choices[i].logprobs[0].logprob);
      }
    }
    json nolp = make_response(meta, choices, usage, false, token_text);
    EXPECT_TRUE(nolp["choices"][0]["logprobs"].is_null());

    json chunk =
        make_stream_chunk(meta, 1, "xy", ep == Endpoint::kChatCompletions, "", nullptr, true);
    EXPECT_EQ(chunk["object"],
              ep == Endpoint::kCompletions ? "text_completion" : "chat.completion.chunk");
    EXPECT_EQ(chunk["choices"][0]["index"], 1);
    EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
    EXPECT_TRUE(chunk.contains("usage") && chunk["usage"].is_null());
    if (ep == Endpoint::kCompletions) {
      EXPECT_EQ(chunk["choices"][0]["text"], "xy");
    } else {
      EXPECT_EQ(chunk["choices"][0]["delta"]["role"], "assistant");
      EXPECT_EQ(chunk["choices"][0]["delta"]["content"], "xy");
    }
    json last = make_stream_chunk(meta, 0, "", false, "stop", nullptr, false);
    EXPECT_EQ(last["choices"][0]["finish_reason"], "stop");
    EXPECT_FALSE(last.contains("usage"));
    if (ep == Endpoint::kChatCompletions) {
      EXPECT_TRUE(last["choices"][0]["delta"].empty());
    }
    json u = make_usage_chunk(meta, usage);
    EXPECT_TRUE(u["choices"].empty());
    EXPECT_EQ(u["usage"]["total_tokens"], 15);
  }
}

// text_offset indexes the returned text: a special token the text skips (an end-of-text token
// generated under ignore_eos) takes no room in it, whatever its spelling in `tokens`.
TEST(OpenAiProtocol, TextOffsetsSkipTokensTheTextSkips) {
  std::random_device rd;
  const unsigned seed = rd();
  std::mt19937 rng(seed);
  const int32_t kSpecial = 0;
  auto token_text = [](int32_t id) {
    return id == kSpecial ? std::string("<|endoftext|>") : "w" + std::to_string(id);
  };
  auto in_text = [&](int32_t id) { return id == kSpecial ? std::string() : token_text(id); };
  ChoiceOutput c;
  c.finish_reason = "length";
  for (int i = 0; i < 12; ++i) {
    const int32_t id = rng() % 3 == 0 ? kSpecial : static_cast<int32_t>(1 + rng() % 500);
    c.token_ids.push_back(id);
    c.logprobs.push_back({id, -1.0f});
    c.text += in_text(id);
  }
  const json r = make_response(ResponseMeta{Endpoint::kCompletions, "id", 1, "m"}, {c}, Usage{},
                               true, token_text, in_text);
  const json& lp = r["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), c.token_ids.size());
  for (size_t t = 0; t < c.token_ids.size(); ++t) {
    SCOPED_TRACE("seed " + std::to_string(seed) + " token " + std::to_string(t));
    EXPECT_EQ(lp["tokens"][t], token_text(c.token_ids[t]));
    const size_t at = lp["text_offset"][t].get<size_t>();
    // The token's text starts at its offset in the returned text.
    ASSERT_LE(at, c.text.size());
    EXPECT_EQ(c.text.compare(at, in_text(c.token_ids[t]).size(), in_text(c.token_ids[t])), 0);
  }
  // Streamed: the offset carries over from chunk to chunk the same way.
  int64_t offset = 0;
  std::vector<TokenLogprob> first(c.logprobs.begin(), c.logprobs.begin() + 5),
      rest(c.logprobs.begin() + 5, c.logprobs.end());
  (void)logprobs_json(Endpoint::kCompletions, first, token_text, &offset, in_text);
  const json l2 = logprobs_json(Endpoint::kCompletions, rest, token_text, &offset, in_text);
  EXPECT_EQ(l2["text_offset"][0], lp["text_offset"][5]);
  EXPECT_EQ(offset, static_cast<int64_t>(c.text.size()));
}

TEST(OpenAiProtocol, SseFraming) {
  json j = {{"a", "line1\nline2"}};
  const std::string s = sse_data(j);
  ASSERT_TRUE(s.starts_with("data: "));
  ASSERT_TRUE(s.ends_with("\n\n"));
  // One event: the payload is one line (newlines inside strings are escaped by JSON).
  const std::string payload = s.substr(6, s.size() - 8);
  EXPECT_EQ(payload.find('\n'), std::string::npos);
  EXPECT_EQ(json::parse(payload), j);
  EXPECT_EQ(kSseDone, "data: [DONE]\n\n");
}

}  // namespace
}  // namespace kvq
