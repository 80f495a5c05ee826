// The HTTP layer over a stand-in engine (FakeEngine): routes, shapes, streaming, every error
// path, client disconnects, shutdown. The real engine's behaviour is in http_model_test.cc.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "kvq/core/error.h"
#include "kvq/server/chat_format.h"
#include "server_test_util.h"

namespace kvq::testing {
namespace {

using json = nlohmann::json;

class HttpApi : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(default_model_dir() + "/tokenizer.json"))
      GTEST_SKIP() << "default model not found at " << default_model_dir();
    Tokenizer tok = Tokenizer::load(default_model_dir());
    const std::vector<int32_t> cycle =
        tok.encode(" the quick brown fox jumps over the lazy dog", false);
    engine_ = std::make_unique<FakeEngine>(std::move(tok), cycle, kContext);
    ServerOptions o;
    o.served_model_name = "tiny";
    server_ = std::make_unique<RunningServer>(*engine_, o);
  }
  void TearDown() override {
    server_.reset();
    engine_.reset();
  }
  int port() const { return server_->port(); }
  json post(const std::string& path, const json& body, int* status) {
    return post_json(port(), path, body.dump(), status);
  }
  std::map<std::string, double> metrics() {
    auto res = server_->client().Get("/metrics");
    EXPECT_TRUE(res);
    EXPECT_EQ(res->status, 200);
    return parse_metrics(res->body);
  }
  void expect_error(const std::string& path, const std::string& body, int status, const json& param,
                    const std::string& context) {
    int got = 0;
    json j = post_json(port(), path, body, &got);
    EXPECT_EQ(got, status) << context << ": " << j.dump();
    ASSERT_TRUE(j.is_object() && j.contains("error")) << context << ": " << j.dump();
    const json& e = j["error"];
    EXPECT_TRUE(e["message"].is_string() && !e["message"].get<std::string>().empty()) << context;
    EXPECT_TRUE(e["type"].is_string()) << context;
    EXPECT_TRUE(e.contains("code")) << context;
    EXPECT_EQ(e["param"], param) << context << ": " << j.dump();
  }

  static constexpr int32_t kContext = 256;
  std::unique_ptr<FakeEngine> engine_;
  std::unique_ptr<RunningServer> server_;
};

TEST_F(HttpApi, InfoRoutes) {
  auto c = server_->client();
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  EXPECT_EQ(json::parse(h->body)["status"], "ok");
  auto m = c.Get("/v1/models");
  ASSERT_TRUE(m);
  json models = json::parse(m->body);
  EXPECT_EQ(models["object"], "list");
  ASSERT_EQ(models["data"].size(), 1u);
  EXPECT_EQ(models["data"][0]["id"], "tiny");
  EXPECT_EQ(models["data"][0]["object"], "model");
  EXPECT_EQ(c.Get("/v1/models/tiny")->status, 200);
  EXPECT_EQ(c.Get("/v1/models/other")->status, 404);
  auto met = c.Get("/metrics");
  ASSERT_TRUE(met);
  EXPECT_EQ(met->status, 200);
  EXPECT_NE(met->get_header_value("Content-Type").find("text/plain"), std::string::npos);
  EXPECT_NE(met->body.find("# TYPE kvq_time_to_first_token_seconds histogram"), std::string::npos);
}

TEST_F(HttpApi, CompletionShapeAndUsage) {
  std::random_device rd;
  const unsigned seed = rd();
  const int max_tokens = 3 + static_cast<int>(seed % 20);
  int status = 0;
  const std::string prompt = "def f(x):\n    return";
  json r = post("/v1/completions",
                {{"model", "tiny"},
                 {"prompt", prompt},
                 {"max_tokens", max_tokens},
                 {"n", 2},
                 {"logprobs", 1}},
                &status);
  ASSERT_EQ(status, 200) << r.dump();
  EXPECT_EQ(r["object"], "text_completion");
  EXPECT_EQ(r["model"], "tiny");
  EXPECT_TRUE(r["id"].get<std::string>().starts_with("cmpl-"));
  ASSERT_EQ(r["choices"].size(), 2u);
  const auto prompt_ids = engine_->tokenizer().encode(prompt, true);
  EXPECT_EQ(r["usage"]["prompt_tokens"], prompt_ids.size());
  EXPECT_EQ(r["usage"]["completion_tokens"], 2 * max_tokens) << "seed " << seed;
  EXPECT_EQ(r["usage"]["total_tokens"], prompt_ids.size() + 2 * max_tokens);
  EXPECT_EQ(engine_->last_prompt(), prompt_ids);
  for (int i = 0; i < 2; ++i) {
    const json& c = r["choices"][i];
    EXPECT_EQ(c["index"], i);
    EXPECT_EQ(c["text"], engine_->expected_text(max_tokens));
    EXPECT_EQ(c["finish_reason"], "length");
    ASSERT_EQ(c["logprobs"]["token_logprobs"].size(), static_cast<size_t>(max_tokens));
    // `logprobs: 1` asks one alternative per token: {token text: logprob}.
    ASSERT_EQ(c["logprobs"]["top_logprobs"].size(), static_cast<size_t>(max_tokens));
    for (int k = 0; k < max_tokens; ++k) {
      EXPECT_FLOAT_EQ(c["logprobs"]["token_logprobs"][k].get<float>(), FakeEngine::logprob_of(k));
      const json& top = c["logprobs"]["top_logprobs"][k];
      ASSERT_TRUE(top.is_object() && top.size() == 1u) << top.dump();
      EXPECT_FLOAT_EQ(top.at(c["logprobs"]["tokens"][k].get<std::string>()).get<float>(),
                      FakeEngine::logprob_of(k));
    }
  }
  EXPECT_EQ(engine_->last_top_logprobs(), 1);
  // `logprobs: 0`: the chosen tokens only, top_logprobs null.
  json zero =
      post("/v1/completions", {{"prompt", prompt}, {"max_tokens", 3}, {"logprobs", 0}}, &status);
  ASSERT_EQ(status, 200) << zero.dump();
  EXPECT_EQ(engine_->last_top_logprobs(), 0);
  EXPECT_TRUE(zero["choices"][0]["logprobs"]["top_logprobs"].is_null());
  EXPECT_EQ(zero["choices"][0]["logprobs"]["token_logprobs"].size(), 3u);
  // Token-id prompts reach the engine as they are.
  json ids = post("/v1/completions", {{"prompt", {5, 6, 7}}, {"max_tokens", 2}}, &status);
  ASSERT_EQ(status, 200) << ids.dump();
  EXPECT_EQ(engine_->last_prompt(), (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(ids["usage"]["prompt_tokens"], 3);
  // Default max_tokens: 16, as OpenAI.
  json def = post("/v1/completions", {{"prompt", "x"}}, &status);
  EXPECT_EQ(def["usage"]["completion_tokens"], 16);
}

TEST_F(HttpApi, StreamedCompletionMatchesWhole) {
  const int max_tokens = 12;
  json body = {{"prompt", "import os"},
               {"max_tokens", max_tokens},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}}};
  StreamResult s = post_stream(port(), "/v1/completions", body);
  ASSERT_EQ(s.status, 200) << s.raw;
  ASSERT_TRUE(s.done) << s.raw;
  ASSERT_GE(s.chunks.size(), 2u);
  std::string text;
  for (size_t i = 0; i + 1 < s.chunks.size(); ++i) {
    const json& c = s.chunks[i];
    EXPECT_EQ(c["object"], "text_completion");
    EXPECT_TRUE(c.contains("usage") && c["usage"].is_null());
    ASSERT_EQ(c["choices"].size(), 1u);
    text += c["choices"][0]["text"].get<std::string>();
    const bool last_text_chunk = i + 2 == s.chunks.size();
    EXPECT_EQ(c["choices"][0]["finish_reason"].is_null(), !last_text_chunk) << c.dump();
  }
  EXPECT_EQ(text, engine_->expected_text(max_tokens));
  const json& u = s.chunks.back();
  EXPECT_TRUE(u["choices"].empty());
  EXPECT_EQ(u["usage"]["completion_tokens"], max_tokens);
  EXPECT_EQ(u["usage"]["prompt_tokens"], engine_->tokenizer().encode("import os", true).size());
  // Ends with exactly one [DONE].
  EXPECT_TRUE(s.raw.ends_with("data: [DONE]\n\n"));
}

TEST_F(HttpApi, ChatWholeAndStreamed) {
  json msgs = {{{"role", "system"}, {"content", "You write Python."}},
               {{"role", "user"}, {"content", "def add"}}};
  int status = 0;
  json r = post("/v1/chat/completions",
                {{"messages", msgs}, {"max_tokens", 6}, {"n", 2}, {"logprobs", true}}, &status);
  ASSERT_EQ(status, 200) << r.dump();
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_TRUE(r["id"].get<std::string>().starts_with("chatcmpl-"));
  const Tokenizer& tok = engine_->tokenizer();
  const auto fmt = detect_chat_format(tok.chat_template());
  ASSERT_TRUE(fmt);
  std::vector<ChatMessage> cm = {{"system", "You write Python."}, {"user", "def add"}};
  EXPECT_EQ(engine_->last_prompt(), tok.encode(render_chat(*fmt, cm), false));
  EXPECT_EQ(r["usage"]["prompt_tokens"], engine_->last_prompt().size());
  // The turn ends at <|im_end|>.
  const auto im_end = tok.token_to_id("<|im_end|>");
  ASSERT_TRUE(im_end);
  const auto stops = engine_->last_params().stop_token_ids;
  EXPECT_NE(std::find(stops.begin(), stops.end(), *im_end), stops.end());
  ASSERT_EQ(r["choices"].size(), 2u);
  EXPECT_EQ(r["choices"][1]["message"]["role"], "assistant");
  EXPECT_EQ(r["choices"][1]["message"]["content"], engine_->expected_text(6));
  EXPECT_EQ(r["choices"][1]["logprobs"]["content"].size(), 6u);
  EXPECT_TRUE(r["choices"][1]["logprobs"]["content"][0]["top_logprobs"].empty());
  // top_logprobs: that many {token, logprob, bytes} per token, the chosen one first here.
  json t = post("/v1/chat/completions",
                {{"messages", msgs}, {"max_tokens", 4}, {"logprobs", true}, {"top_logprobs", 3}},
                &status);
  ASSERT_EQ(status, 200) << t.dump();
  EXPECT_EQ(engine_->last_top_logprobs(), 3);
  const json& content = t["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 4u);
  for (size_t k = 0; k < content.size(); ++k) {
    const json& top = content[k]["top_logprobs"];
    ASSERT_EQ(top.size(), 3u) << top.dump();
    EXPECT_EQ(top[0]["token"], content[k]["token"]);
    for (int j = 0; j < 3; ++j) {
      EXPECT_FLOAT_EQ(top[j]["logprob"].get<float>(),
                      FakeEngine::logprob_of(static_cast<int>(k)) - 0.5f * static_cast<float>(j));
      EXPECT_EQ(top[j]["bytes"].size(), top[j]["token"].get<std::string>().size());
    }
  }
  // Without max_tokens, chat may use the rest of the context (vLLM's default).
  json d = post("/v1/chat/completions", {{"messages", msgs}}, &status);
  ASSERT_EQ(status, 200) << d.dump();
  EXPECT_EQ(d["usage"]["completion_tokens"], kContext - d["usage"]["prompt_tokens"].get<int>());

  StreamResult s = post_stream(port(), "/v1/chat/completions",
                               {{"messages", msgs}, {"max_tokens", 6}, {"stream", true}});
  ASSERT_EQ(s.status, 200);
  ASSERT_TRUE(s.done);
  ASSERT_GE(s.chunks.size(), 2u);
  EXPECT_EQ(s.chunks.front()["choices"][0]["delta"]["role"], "assistant");
  std::string text;
  for (const auto& c : s.chunks) {
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    if (c["choices"][0]["delta"].contains("content"))
      text += c["choices"][0]["delta"]["content"].get<std::string>();
  }
  EXPECT_EQ(s.chunks.back()["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(text, engine_->expected_text(6));
}

TEST_F(HttpApi, ErrorPaths) {
  const std::string c = "/v1/completions", chat = "/v1/chat/completions";
  expect_error(c, "{\"prompt\": ", 400, nullptr, "malformed JSON");
  expect_error(c, "[1,2]", 400, nullptr, "not an object");
  expect_error(c, R"({"max_tokens": 5})", 400, "prompt", "missing prompt");
  expect_error(chat, R"({"max_tokens": 5})", 400, "messages", "missing messages");
  expect_error(c, R"({"prompt": "x", "temperature": "hot"})", 400, "temperature", "wrong type");
  expect_error(c, R"({"prompt": "x", "temperature": -1})", 400, "temperature", "temperature < 0");
  expect_error(c, R"({"prompt": "x", "top_p": 0})", 400, "top_p", "top_p = 0");
  expect_error(c, R"({"prompt": "x", "top_p": 1.01})", 400, "top_p", "top_p > 1");
  expect_error(c, R"({"prompt": "x", "n": 0})", 400, "n", "n < 1");
  expect_error(c, R"({"prompt": "x", "max_tokens": 0})", 400, "max_tokens", "max_tokens < 1");
  expect_error(c, R"({"prompt": "x", "min_p": 2})", 400, "min_p", "min_p > 1");
  expect_error(c, R"({"prompt": "x", "stop": ["a", 1]})", 400, "stop", "stop of wrong type");
  expect_error(c, R"({"prompt": "x", "echo": true})", 400, "echo", "echo");
  expect_error(c, R"({"prompt": [1, 99999999]})", 400, "prompt", "token id outside the vocabulary");
  json long_prompt = {{"prompt", std::vector<int32_t>(kContext + 10, 5)}};
  expect_error(c, long_prompt.dump(), 400, "prompt", "prompt longer than the context");
  json long_chat = {
      {"messages", {{{"role", "user"}, {"content", std::string(kContext * 8, 'x')}}}}};
  expect_error(chat, long_chat.dump(), 400, "messages", "chat prompt longer than the context");
  expect_error(c, R"({"prompt": "x", "max_tokens": 100000})", 400, "max_tokens",
               "prompt + max_tokens > context");
  expect_error(c, R"({"prompt": "x", "model": "gpt-4"})", 404, "model", "unknown model");
  int status = 0;
  json nf = post_json(port(), c, R"({"prompt": "x", "model": "gpt-4"})", &status);
  EXPECT_EQ(nf["error"]["code"], "model_not_found");

  // Unknown routes and wrong methods, with the same error shape.
  auto cl = server_->client();
  auto r404 = cl.Get("/v1/nothing");
  ASSERT_TRUE(r404);
  EXPECT_EQ(r404->status, 404);
  EXPECT_TRUE(json::parse(r404->body)["error"]["message"].is_string());
  auto r405 = cl.Get("/v1/completions");
  ASSERT_TRUE(r405);
  EXPECT_EQ(r405->status, 405);
  EXPECT_EQ(r405->get_header_value("Allow"), "POST");
  EXPECT_TRUE(json::parse(r405->body)["error"]["message"].is_string());
  auto r405b = cl.Post("/health", "{}", "application/json");
  ASSERT_TRUE(r405b);
  EXPECT_EQ(r405b->status, 405);

  // Every refusal is counted; none reached the engine.
  auto m = metrics();
  EXPECT_GE(metric_sum(m, "kvq_request_errors_total"), 20.0);
  EXPECT_EQ(engine_->stats().requests_finished, 0);
}

TEST_F(HttpApi, ChatUnavailableWithoutKnownTemplate) {
  // The same vocabulary without tokenizer_config.json has no chat template.
  std::ifstream in(default_model_dir() + "/tokenizer.json");
  std::stringstream ss;
  ss << in.rdbuf();
  FakeEngine plain(Tokenizer::from_json(ss.str(), "tokenizer.json"), {5, 6});
  RunningServer srv(plain, {});
  int status = 0;
  json r = post_json(srv.port(), "/v1/chat/completions",
                     R"({"messages": [{"role": "user", "content": "hi"}]})", &status);
  EXPECT_EQ(status, 400);
  EXPECT_NE(r["error"]["message"].get<std::string>().find("chat is not available"),
            std::string::npos)
      << r.dump();
  // Completions still work.
  json ok =
      post_json(srv.port(), "/v1/completions", R"({"prompt": "hi", "max_tokens": 2})", &status);
  EXPECT_EQ(status, 200) << ok.dump();
}

TEST_F(HttpApi, EngineErrorsAre500) {
  const json body = {{"prompt", {5, FakeEngine::kFailToken}}, {"max_tokens", 10}};
  int status = 0;
  json r = post("/v1/completions", body, &status);
  EXPECT_EQ(status, 500) << r.dump();
  EXPECT_EQ(r["error"]["type"], "server_error");
  json sb = body;
  sb["stream"] = true;
  StreamResult s = post_stream(port(), "/v1/completions", sb);
  ASSERT_EQ(s.status, 200);  // the stream had started
  ASSERT_TRUE(s.done);
  ASSERT_GE(s.chunks.size(), 2u);
  EXPECT_EQ(s.chunks[s.chunks.size() - 2]["choices"][0]["finish_reason"], "error");
  EXPECT_EQ(s.chunks.back()["error"]["type"], "server_error");
}

TEST_F(HttpApi, ClientDisconnectCancels) {
  int chunks_seen = 0;
  // Far more tokens than will be read: the client hangs up after a few chunks.
  StreamResult s = post_stream(
      port(), "/v1/completions", {{"prompt", "x"}, {"max_tokens", 200}, {"stream", true}},
      [&](const std::string& so_far) {
        chunks_seen = static_cast<int>(std::count(so_far.begin(), so_far.end(), '\n')) / 2;
        return chunks_seen < 3;
      });
  EXPECT_FALSE(s.done);
  ASSERT_TRUE(eventually([&] { return engine_->cancelled_count() == 1; }))
      << "the request was not cancelled";
  EXPECT_TRUE(eventually([&] { return engine_->stats().running == 0; }));
  EXPECT_EQ(metric_sum(metrics(), "kvq_request_finished_total"), 1.0);
  EXPECT_EQ(metrics()["kvq_request_finished_total{finish_reason=\"cancelled\"}"], 1.0);
}

TEST_F(HttpApi, BindFailureNamesTheAddress) {
  ServerOptions o;
  o.host = "127.0.0.1";
  o.port = port();  // taken by the running server
  HttpServer second(*engine_, o);
  try {
    second.bind();
    FAIL() << "bind succeeded on a port in use";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(port())), std::string::npos)
        << e.what();
  }
}

TEST_F(HttpApi, StopCancelsRequestsInFlight) {
  int status = 0;
  std::thread client([&] {
    post_json(port(), "/v1/completions", R"({"prompt": "x", "max_tokens": 200})", &status);
  });
  ASSERT_TRUE(eventually([&] { return engine_->stats().running == 1; }));
  const auto t0 = std::chrono::steady_clock::now();
  server_->stop();
  client.join();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  EXPECT_EQ(engine_->cancelled_count(), 1);
  EXPECT_TRUE(status == 503 || status == -1) << status;
}

// Operator limits (kvq serve --max-*): body size 413, prompt tokens / max_tokens / n 400, each
// OpenAI-shaped and naming its flag; a default max_tokens is capped, not refused.
TEST_F(HttpApi, RequestLimitsAreOpenAIErrorsNamingTheFlag) {
  server_.reset();
  ServerOptions o;
  o.served_model_name = "tiny";
  o.max_body_bytes = 4096;
  o.max_input_tokens = 20;
  o.max_output_tokens = 5;
  o.max_n = 2;
  server_ = std::make_unique<RunningServer>(*engine_, o);
  auto message_of = [](const json& j) {
    return j.is_object() && j.contains("error") ? j["error"]["message"].get<std::string>() : "";
  };
  int status = 0;
  // Body size: one byte over the limit, then one under it.
  const std::string pad(4096, ' ');
  json j =
      post_json(port(), "/v1/completions", R"({"prompt": "x", "max_tokens": 1})" + pad, &status);
  EXPECT_EQ(status, 413);
  EXPECT_NE(message_of(j).find("--max-body-size"), std::string::npos) << j.dump();
  j = post_json(port(), "/v1/completions",
                R"({"prompt": "x", "max_tokens": 1})" + pad.substr(0, 4096 - 40), &status);
  EXPECT_EQ(status, 200) << j.dump();
  // Prompt tokens: 21 ids refused, 20 accepted.
  std::vector<int> ids(21);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = 5 + static_cast<int>(i);
  j = post("/v1/completions", {{"prompt", ids}, {"max_tokens", 1}}, &status);
  EXPECT_EQ(status, 400);
  EXPECT_EQ(j["error"]["param"], "prompt");
  EXPECT_EQ(j["error"]["code"], "context_length_exceeded");
  EXPECT_NE(message_of(j).find("--max-input-tokens"), std::string::npos) << j.dump();
  ids.pop_back();
  j = post("/v1/completions", {{"prompt", ids}, {"max_tokens", 1}}, &status);
  EXPECT_EQ(status, 200) << j.dump();
  // max_tokens: 6 refused (under each endpoint's name), 5 accepted, a chat default capped at 5.
  j = post("/v1/completions", {{"prompt", "x"}, {"max_tokens", 6}}, &status);
  EXPECT_EQ(status, 400);
  EXPECT_EQ(j["error"]["param"], "max_tokens");
  EXPECT_NE(message_of(j).find("--max-output-tokens"), std::string::npos) << j.dump();
  const json msgs = json::array({{{"role", "user"}, {"content", "hi"}}});
  j = post("/v1/chat/completions", {{"messages", msgs}, {"max_completion_tokens", 6}}, &status);
  EXPECT_EQ(status, 400);
  EXPECT_EQ(j["error"]["param"], "max_completion_tokens");
  j = post("/v1/completions", {{"prompt", "x"}, {"max_tokens", 5}}, &status);
  EXPECT_EQ(status, 200) << j.dump();
  EXPECT_EQ(j["usage"]["completion_tokens"], 5);
  j = post("/v1/chat/completions", {{"messages", msgs}}, &status);
  EXPECT_EQ(status, 200) << j.dump();
  EXPECT_EQ(j["usage"]["completion_tokens"], 5);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  // n: 3 refused, 2 accepted.
  j = post("/v1/completions", {{"prompt", "x"}, {"max_tokens", 1}, {"n", 3}}, &status);
  EXPECT_EQ(status, 400);
  EXPECT_EQ(j["error"]["param"], "n");
  EXPECT_NE(message_of(j).find("--max-n"), std::string::npos) << j.dump();
  j = post("/v1/completions", {{"prompt", "x"}, {"max_tokens", 1}, {"n", 2}}, &status);
  EXPECT_EQ(status, 200) << j.dump();
  EXPECT_EQ(j["choices"].size(), 2u);
  const auto m = metrics();
  EXPECT_EQ(m.at("kvq_request_errors_total{status=\"413\"}"), 1);
  EXPECT_EQ(m.at("kvq_request_errors_total{status=\"400\"}"), 4);
}

// --max-concurrent-requests: with the limit's worth of requests in flight, the next one gets 429
// with Retry-After at once, /health still answers, and a slot frees when a request ends.
TEST_F(HttpApi, ConcurrencyLimitAnswers429WithRetryAfter) {
  server_.reset();
  ServerOptions o;
  o.served_model_name = "tiny";
  o.max_concurrent_requests = 2;
  server_ = std::make_unique<RunningServer>(*engine_, o);
  const std::string held = json{{"prompt", {FakeEngine::kHoldToken}}, {"max_tokens", 3}}.dump();
  std::vector<int> statuses(2, 0);
  std::vector<std::thread> clients;
  for (int i = 0; i < 2; ++i)
    clients.emplace_back(
        [&, i] { post_json(port(), "/v1/completions", held, &statuses[static_cast<size_t>(i)]); });
  ASSERT_TRUE(eventually([&] { return engine_->stats().running == 2; }));
  auto c = server_->client();
  const auto t0 = std::chrono::steady_clock::now();
  auto busy = c.Post("/v1/completions", R"({"prompt": "x", "max_tokens": 1})", "application/json");
  ASSERT_TRUE(busy);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
  EXPECT_EQ(busy->status, 429);
  EXPECT_EQ(busy->get_header_value("Retry-After"), "1");
  const json e = json::parse(busy->body, nullptr, false);
  ASSERT_TRUE(e.is_object() && e.contains("error")) << busy->body;
  EXPECT_EQ(e["error"]["type"], "rate_limit_error");
  EXPECT_NE(e["error"]["message"].get<std::string>().find("--max-concurrent-requests"),
            std::string::npos);
  auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(engine_->stats().running, 2) << "the refused request reached the engine";
  server_->stop();  // cancels the held requests
  for (auto& t : clients) t.join();
  for (int s : statuses) EXPECT_TRUE(s == 503 || s == -1) << s;
}

// Graceful shutdown (SIGTERM in kvq serve): during the grace period /health says draining and
// new requests get 503 while those in flight run to their end; at the deadline the rest are
// cancelled and drain() says how many.
TEST_F(HttpApi, DrainFinishesRequestsInFlightAndCancelsAtTheDeadline) {
  int held_status = 0, normal_status = 0;
  json normal;
  std::thread held([&] {
    post_json(port(), "/v1/completions",
              json{{"prompt", {FakeEngine::kHoldToken}}, {"max_tokens", 3}}.dump(), &held_status);
  });
  std::thread finishing([&] {
    normal = post_json(port(), "/v1/completions", R"({"prompt": "x", "max_tokens": 200})",
                       &normal_status);
  });
  ASSERT_TRUE(eventually([&] { return engine_->stats().running == 2; }));
  int left = -1;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread drainer([&] { left = server_->drain(std::chrono::milliseconds(1500)); });
  ASSERT_TRUE(eventually([&] {
    auto h = server_->client().Get("/health");
    return h && h->status == 503;
  }));
  auto h = server_->client().Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(json::parse(h->body)["status"], "draining");
  int refused = 0;
  post_json(port(), "/v1/completions", R"({"prompt": "x", "max_tokens": 1})", &refused);
  EXPECT_EQ(refused, 503);
  finishing.join();
  EXPECT_EQ(normal_status, 200) << normal.dump();
  EXPECT_EQ(normal["usage"]["completion_tokens"], 200) << "the request in flight was cut short";
  drainer.join();
  held.join();
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(left, 1);
  EXPECT_GE(took, 1.4);
  EXPECT_LT(took, 10.0);
  EXPECT_TRUE(held_status == 503 || held_status == -1) << held_status;
  EXPECT_EQ(engine_->cancelled_count(), 1);
}

// While the model loads, kvq serve's port answers "not ready": /health 503 {"status":
// "loading"}, the API 503 with an OpenAI error; afterwards the port is free for the server.
TEST_F(HttpApi, LoadingResponderAnswersNotReadyThenFreesThePort) {
  int port_used = 0;
  {
    LoadingResponder loading("127.0.0.1", 0);
    port_used = loading.port();
    ASSERT_GT(port_used, 0);
    httplib::Client c("127.0.0.1", port_used);
    auto h = c.Get("/health");
    ASSERT_TRUE(h);
    EXPECT_EQ(h->status, 503);
    EXPECT_EQ(json::parse(h->body)["status"], "loading");
    for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
      auto r = c.Post(path, R"({"prompt": "x"})", "application/json");
      ASSERT_TRUE(r) << path;
      EXPECT_EQ(r->status, 503) << path;
      const json e = json::parse(r->body, nullptr, false);
      ASSERT_TRUE(e.is_object() && e.contains("error")) << r->body;
      EXPECT_EQ(e["error"]["code"], "model_loading");
    }
    auto m = c.Get("/v1/models");
    ASSERT_TRUE(m);
    EXPECT_EQ(m->status, 503);
    EXPECT_THROW(LoadingResponder("127.0.0.1", port_used), InputError) << "the port is taken";
  }
  ServerOptions o;
  o.host = "127.0.0.1";
  o.port = port_used;
  o.log_requests = false;
  HttpServer after(*engine_, o);
  EXPECT_EQ(after.bind(), port_used);
}

TEST(ApiKey, BearerMatchesOnlyTheExactKey) {
  std::mt19937 rng(std::random_device{}());
  std::string key(8 + rng() % 40, ' ');
  for (char& c : key) c = static_cast<char>('!' + rng() % 94);
  EXPECT_TRUE(bearer_matches("Bearer " + key, key));
  EXPECT_FALSE(bearer_matches("Bearer " + key + "x", key));
  EXPECT_FALSE(bearer_matches("Bearer " + key.substr(1), key));
  EXPECT_FALSE(bearer_matches("bearer " + key, key));
  EXPECT_FALSE(bearer_matches(key, key));
  EXPECT_FALSE(bearer_matches("", key));
  EXPECT_FALSE(bearer_matches("Bearer ", ""));  // an empty key never matches
  for (size_t i = 0; i < key.size(); ++i) {
    std::string wrong = key;
    wrong[i] = static_cast<char>(wrong[i] == '!' ? '"' : '!');
    EXPECT_FALSE(bearer_matches("Bearer " + wrong, key)) << "byte " << i;
  }
}

// --api-key: every /v1 route answers 401 (OpenAI-shaped, WWW-Authenticate) without the key or
// with a wrong one and works with it; /health stays open; /metrics is open unless keyed too.
TEST_F(HttpApi, ApiKeyGuardsV1Routes) {
  for (const bool metrics_keyed : {false, true}) {
    server_.reset();
    ServerOptions o;
    o.served_model_name = "tiny";
    o.api_key = "sk-kvq-" + std::to_string(std::random_device{}());
    o.metrics_require_key = metrics_keyed;
    server_ = std::make_unique<RunningServer>(*engine_, o);
    const httplib::Headers good = {{"Authorization", "Bearer " + o.api_key}};
    const httplib::Headers bad = {{"Authorization", "Bearer " + o.api_key + "0"}};
    auto c = server_->client();
    const std::string body = json{{"prompt", "x"}, {"max_tokens", 2}}.dump();
    for (const httplib::Headers* h : {static_cast<const httplib::Headers*>(nullptr), &bad}) {
      const std::string who = h == nullptr ? "no key" : "wrong key";
      auto p = h == nullptr ? c.Post("/v1/completions", body, "application/json")
                            : c.Post("/v1/completions", *h, body, "application/json");
      ASSERT_TRUE(p) << who;
      EXPECT_EQ(p->status, 401) << who;
      EXPECT_EQ(p->get_header_value("WWW-Authenticate"), "Bearer") << who;
      const json e = json::parse(p->body, nullptr, false);
      ASSERT_TRUE(e.is_object() && e.contains("error")) << who << ": " << p->body;
      EXPECT_EQ(e["error"]["code"], "invalid_api_key") << who;
      EXPECT_EQ(e["error"]["message"].get<std::string>().find(o.api_key), std::string::npos)
          << "the error echoes the key";
      auto m = h == nullptr ? c.Get("/v1/models") : c.Get("/v1/models", *h);
      ASSERT_TRUE(m);
      EXPECT_EQ(m->status, 401) << who;
      auto chat = h == nullptr ? c.Post("/v1/chat/completions", body, "application/json")
                               : c.Post("/v1/chat/completions", *h, body, "application/json");
      ASSERT_TRUE(chat);
      EXPECT_EQ(chat->status, 401) << who;
      auto met = h == nullptr ? c.Get("/metrics") : c.Get("/metrics", *h);
      ASSERT_TRUE(met);
      EXPECT_EQ(met->status, metrics_keyed ? 401 : 200) << who;
    }
    auto ok = c.Post("/v1/completions", good, body, "application/json");
    ASSERT_TRUE(ok);
    EXPECT_EQ(ok->status, 200) << ok->body;
    EXPECT_EQ(json::parse(ok->body)["usage"]["completion_tokens"], 2);
    auto models = c.Get("/v1/models", good);
    ASSERT_TRUE(models);
    EXPECT_EQ(models->status, 200);
    auto health = c.Get("/health");
    ASSERT_TRUE(health);
    EXPECT_EQ(health->status, 200);
    auto met = c.Get("/metrics", good);
    ASSERT_TRUE(met);
    EXPECT_EQ(met->status, 200);
    // Refusals are counted like other errors.
    EXPECT_NE(met->body.find("kvq_request_errors_total{status=\"401\"}"), std::string::npos);
  }
}

}  // namespace
}  // namespace kvq::testing
