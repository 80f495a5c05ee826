// The server over the real engine and the default model (skipped when it is absent): shapes and
// usage against the tokenizer, streaming == whole, 32 concurrent streams == solo runs, preemption
// in a tiny cache, prefix-cache hits, disconnects, and no KV block left in use afterwards.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <thread>

#include "kvq/engine/llm_engine.h"
#include "kvq/model/model.h"
#include "kvq/plan/kv_plan.h"
#include "kvq/server/chat_format.h"
#include "server_test_util.h"

namespace kvq::testing {
namespace {

using json = nlohmann::json;

// Loaded once; each test's engine runs the same weights (Model::with_plan shares them).
const Model* shared_model() {
  static const std::unique_ptr<Model> m = []() -> std::unique_ptr<Model> {
    if (!std::filesystem::exists(default_model_dir() + "/model.safetensors")) return nullptr;
    return Model::load(make_kv_plan(load_model_config(default_model_dir()), KvPlanOptions{}));
  }();
  return m.get();
}

// Code-like prompts of the kind the default model was trained on.
const std::vector<std::string> kPrompts = {
    "def fibonacci(n):",
    "import os\n\ndef ",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):\n    ",
    "def read_lines(path):\n    \"\"\"Return the lines of the file at *path*.\"\"\"\n",
    "try:\n    import json\nexcept ImportError:\n",
    "    def __repr__(self):\n        return ",
    "if __name__ == '__main__':\n",
};

class ModelServer : public ::testing::Test {
 protected:
  void SetUp() override {
    if (shared_model() == nullptr)
      GTEST_SKIP() << "default model not found at " << default_model_dir();
  }
  void start(EngineConfig config) {
    engine_ = std::make_unique<LlmEngine>(
        shared_model()->with_plan(shared_model()->plan()),
        std::make_unique<Tokenizer>(Tokenizer::load(default_model_dir())), config);
    serving_ = serving_engine(*engine_);
    ServerOptions o;
    o.served_model_name = "kvq-code-tiny";
    o.http_threads = 48;
    server_ = std::make_unique<RunningServer>(*serving_, o);
  }
  void TearDown() override {
    server_.reset();
    serving_.reset();
    engine_.reset();
  }
  int port() const { return server_->port(); }
  const Tokenizer& tokenizer() const { return engine_->tokenizer(); }
  std::map<std::string, double> metrics() {
    auto res = server_->client().Get("/metrics");
    EXPECT_TRUE(res && res->status == 200);
    return res ? parse_metrics(res->body) : std::map<std::string, double>{};
  }
  // Nothing running or waiting, and no KV block held, as /metrics reports it.
  void expect_idle() {
    ASSERT_TRUE(eventually([&] {
      auto m = metrics();
      return m["kvq_requests_running"] == 0 && m["kvq_requests_waiting"] == 0 &&
             metric_sum(m, "kvq_kv_blocks_used") == 0;
    })) << "requests or KV blocks still in use after every request ended";
    auto m = metrics();
    EXPECT_GT(metric_sum(m, "kvq_kv_blocks_free"), 0);
    EXPECT_EQ(metric_sum(m, "kvq_kv_bytes_used"), 0);
  }
  json completion(const json& body) {
    int status = 0;
    json r = post_json(port(), "/v1/completions", body.dump(), &status);
    EXPECT_EQ(status, 200) << r.dump();
    return r;
  }

  std::unique_ptr<LlmEngine> engine_;
  std::unique_ptr<ServingEngine> serving_;
  std::unique_ptr<RunningServer> server_;
};

// A greedy output as tokens (their text) and logprobs.
struct Greedy {
  std::vector<std::string> tokens;
  std::vector<float> logprobs;
  std::string text;
};

Greedy from_choice(const json& choice) {
  Greedy g;
  g.text = choice["text"];
  for (const auto& t : choice["logprobs"]["tokens"]) g.tokens.push_back(t);
  for (const auto& v : choice["logprobs"]["token_logprobs"]) g.logprobs.push_back(v);
  return g;
}

// Greedy runs agree, or part at a near tie: logits are not bit-identical across batch shapes
// (summation order), so where the two top tokens are within a hair of each other either may be
// taken. At the parting token both runs' chosen logprobs are then almost equal (both are the
// top probability); any real difference shows as a gap. Returns "" when they agree.
std::string compare_greedy(const Greedy& want, const Greedy& got, int* near_ties) {
  if (got.tokens == want.tokens) return got.text == want.text ? "" : "same tokens, different text";
  size_t k = 0;
  while (k < got.tokens.size() && k < want.tokens.size() && got.tokens[k] == want.tokens[k]) ++k;
  if (k == got.tokens.size() || k == want.tokens.size())
    return "one output is a prefix of the other: '" + got.text + "' vs '" + want.text + "'";
  const float a = want.logprobs[k], b = got.logprobs[k];
  if (std::abs(a - b) <= 2e-3f) {
    ++*near_ties;
    return "";
  }
  return "outputs part at token " + std::to_string(k) + " ('" + got.tokens[k] + "' logprob " +
         std::to_string(b) + " vs '" + want.tokens[k] + "' logprob " + std::to_string(a) + ")";
}

Greedy from_stream(const StreamResult& s) {
  Greedy g;
  for (const auto& c : s.chunks) {
    if (c["choices"].empty()) continue;
    const json& ch = c["choices"][0];
    g.text += ch["text"].get<std::string>();
    if (ch["logprobs"].is_object()) {
      for (const auto& t : ch["logprobs"]["tokens"]) g.tokens.push_back(t);
      for (const auto& v : ch["logprobs"]["token_logprobs"]) g.logprobs.push_back(v);
    }
  }
  return g;
}

TEST_F(ModelServer, ShapesUsageAndStreamingMatchWhole) {
  EngineConfig config;
  config.num_blocks = 256;
  start(config);
  std::random_device rd;
  const unsigned seed = rd();
  const std::string& prompt = kPrompts[seed % kPrompts.size()];
  SCOPED_TRACE("seed " + std::to_string(seed) + ", prompt '" + prompt + "'");
  const int max_tokens = 12;

  json whole = completion({{"prompt", prompt},
                           {"max_tokens", max_tokens},
                           {"temperature", 0},
                           {"n", 2},
                           {"logprobs", 0}});
  ASSERT_EQ(whole["choices"].size(), 2u);
  EXPECT_EQ(whole["object"], "text_completion");
  const size_t prompt_tokens = tokenizer().encode(prompt, true).size();
  EXPECT_EQ(whole["usage"]["prompt_tokens"], prompt_tokens);
  size_t generated = 0;
  for (const auto& c : whole["choices"]) {
    const Greedy g = from_choice(c);
    generated += g.tokens.size();
    EXPECT_EQ(c["finish_reason"],
              g.tokens.size() == static_cast<size_t>(max_tokens) ? "length" : "stop");
    EXPECT_LE(g.tokens.size(), static_cast<size_t>(max_tokens));
    for (float lp : g.logprobs) EXPECT_LE(lp, 0.0f);
  }
  EXPECT_EQ(whole["usage"]["completion_tokens"], generated);
  EXPECT_EQ(whole["usage"]["total_tokens"], prompt_tokens + generated);
  int near_ties = 0;
  EXPECT_EQ(compare_greedy(from_choice(whole["choices"][0]), from_choice(whole["choices"][1]),
                           &near_ties),
            "");

  StreamResult s = post_stream(port(), "/v1/completions",
                               {{"prompt", prompt},
                                {"max_tokens", max_tokens},
                                {"temperature", 0},
                                {"stream", true},
                                {"logprobs", 0},
                                {"stream_options", {{"include_usage", true}}}});
  ASSERT_EQ(s.status, 200);
  ASSERT_TRUE(s.done);
  EXPECT_EQ(compare_greedy(from_choice(whole["choices"][0]), from_stream(s), &near_ties), "");
  const json& usage = s.chunks.back()["usage"];
  EXPECT_EQ(usage["prompt_tokens"], prompt_tokens);
  EXPECT_EQ(usage["completion_tokens"], from_stream(s).tokens.size());

  // Chat: the prompt is the template's rendering, encoded without added special tokens.
  const auto fmt = detect_chat_format(tokenizer().chat_template());
  ASSERT_TRUE(fmt) << "the default model has a ChatML template";
  const std::vector<ChatMessage> msgs = {{"system", "You write Python."}, {"user", prompt}};
  const json jmsgs = {{{"role", "system"}, {"content", "You write Python."}},
                      {{"role", "user"}, {"content", prompt}}};
  int status = 0;
  json chat = post_json(
      port(), "/v1/chat/completions",
      json({{"messages", jmsgs}, {"max_tokens", max_tokens}, {"temperature", 0}, {"n", 2}}).dump(),
      &status);
  ASSERT_EQ(status, 200) << chat.dump();
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["usage"]["prompt_tokens"],
            tokenizer().encode(render_chat(*fmt, msgs), false).size());
  ASSERT_EQ(chat["choices"].size(), 2u);
  EXPECT_EQ(chat["choices"][0]["message"]["role"], "assistant");
  StreamResult cs = post_stream(
      port(), "/v1/chat/completions",
      {{"messages", jmsgs}, {"max_tokens", max_tokens}, {"temperature", 0}, {"stream", true}});
  ASSERT_TRUE(cs.done);
  std::string text;
  for (const auto& c : cs.chunks) {
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    if (c["choices"][0]["delta"].contains("content"))
      text += c["choices"][0]["delta"]["content"].get<std::string>();
  }
  EXPECT_FALSE(cs.chunks.back()["choices"][0]["finish_reason"].is_null());
  EXPECT_EQ(text, chat["choices"][0]["message"]["content"].get<std::string>());
  EXPECT_LE(near_ties, 1);
  expect_idle();
}

TEST_F(ModelServer, ConcurrentStreamsMatchSoloRuns) {
  EngineConfig config;
  config.num_blocks = 512;
  config.max_num_seqs = 32;
  config.max_num_batched_tokens = 256;
  start(config);
  const int max_tokens = 16;
  auto body = [&](size_t p, bool stream) {
    json b = {
        {"prompt", kPrompts[p]}, {"max_tokens", max_tokens}, {"temperature", 0}, {"logprobs", 0}};
    if (stream) b["stream"] = true;
    return b;
  };
  std::vector<Greedy> solo;
  for (size_t p = 0; p < kPrompts.size(); ++p)
    solo.push_back(from_choice(completion(body(p, false))["choices"][0]));

  constexpr int kClients = 32;
  std::vector<StreamResult> results(kClients);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i)
    clients.emplace_back([&, i] {
      results[i] = post_stream(port(), "/v1/completions", body(i % kPrompts.size(), true));
    });
  for (auto& t : clients) t.join();
  int near_ties = 0;
  for (int i = 0; i < kClients; ++i) {
    SCOPED_TRACE("client " + std::to_string(i) + ", prompt '" + kPrompts[i % kPrompts.size()] +
                 "'");
    ASSERT_EQ(results[i].status, 200) << results[i].raw;
    ASSERT_TRUE(results[i].done) << results[i].raw;
    EXPECT_EQ(compare_greedy(solo[i % kPrompts.size()], from_stream(results[i]), &near_ties), "");
  }
  EXPECT_LE(near_ties, 2);
  auto m = metrics();
  EXPECT_GE(m["kvq_time_to_first_token_seconds_count"], kClients);
  EXPECT_GT(m["kvq_inter_token_latency_seconds_count"], 0);
  expect_idle();
}

TEST_F(ModelServer, TinyCachePreemptsAndStillMatchesSoloRuns) {
  EngineConfig config;
  config.num_blocks =
      12;  // 192 tokens; each request alone needs up to 4 blocks, 8 at once need ~28
  config.max_num_seqs = 8;
  config.max_num_batched_tokens = 64;
  start(config);
  const int max_tokens = 28;
  auto body = [&](size_t p) {
    return json{{"prompt", kPrompts[p]},
                {"max_tokens", max_tokens},
                {"temperature", 0},
                {"logprobs", 0},
                {"ignore_eos", true}};
  };
  std::vector<Greedy> solo;
  for (size_t p = 0; p < kPrompts.size(); ++p)
    solo.push_back(from_choice(completion(body(p))["choices"][0]));
  EXPECT_EQ(metrics()["kvq_preemptions_total"], 0) << "one request at a time fits";

  std::vector<json> results(kPrompts.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < kPrompts.size(); ++i)
    clients.emplace_back([&, i] { results[i] = completion(body(i)); });
  for (auto& t : clients) t.join();
  int near_ties = 0;
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    SCOPED_TRACE("prompt '" + kPrompts[i] + "'");
    ASSERT_EQ(results[i]["choices"].size(), 1u) << results[i].dump();
    EXPECT_EQ(results[i]["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(results[i]["usage"]["completion_tokens"], max_tokens) << "a request was truncated";
    EXPECT_EQ(compare_greedy(solo[i], from_choice(results[i]["choices"][0]), &near_ties), "");
  }
  EXPECT_LE(near_ties, 1);
  EXPECT_GT(metrics()["kvq_preemptions_total"], 0) << "the cache was meant to be too small";
  expect_idle();
}

TEST_F(ModelServer, SharedSystemPromptHitsThePrefixCache) {
  EngineConfig config;
  config.num_blocks = 256;
  start(config);
  const std::string system =
      "You are a careful Python programmer. You write small, readable functions with docstrings, "
      "type hints and no external dependencies. You never use global state.";
  std::vector<int64_t> cached;
  for (const char* q :
       {"Reverse a string.", "Sum a list of numbers.", "Parse an integer safely."}) {
    json body = {{"messages",
                  {{{"role", "system"}, {"content", system}}, {{"role", "user"}, {"content", q}}}},
                 {"max_tokens", 4},
                 {"temperature", 0}};
    int status = 0;
    json r = post_json(port(), "/v1/chat/completions", body.dump(), &status);
    ASSERT_EQ(status, 200) << r.dump();
    cached.push_back(r["usage"]["prompt_tokens_details"]["cached_tokens"]);
  }
  EXPECT_EQ(cached[0], 0);
  EXPECT_GE(cached[1], 16) << "the shared system prompt spans whole blocks";
  EXPECT_GE(cached[2], 16);
  auto m = metrics();
  EXPECT_GE(m["kvq_prefix_cache_hits_total"], static_cast<double>(cached[1] + cached[2]));
  EXPECT_GT(m["kvq_prefix_cache_hit_rate"], 0.0);
  expect_idle();
}

TEST_F(ModelServer, DisconnectCancelsAndFreesBlocks) {
  EngineConfig config;
  config.num_blocks = 256;
  start(config);
  StreamResult s = post_stream(
      port(), "/v1/completions",
      {{"prompt", kPrompts[0]}, {"max_tokens", 1500}, {"ignore_eos", true}, {"stream", true}},
      [](const std::string& so_far) {
        return std::count(so_far.begin(), so_far.end(), '\n') < 8;  // 4 events
      });
  EXPECT_FALSE(s.done);
  ASSERT_TRUE(eventually([&] {
    return metrics()["kvq_request_finished_total{finish_reason=\"cancelled\"}"] == 1;
  })) << "the request was not cancelled";
  EXPECT_LT(metrics()["kvq_generation_tokens_total"], 1500);
  expect_idle();
}

TEST_F(ModelServer, EngineRefusalsAre400) {
  EngineConfig config;
  config.num_blocks = 8;  // 128 tokens
  start(config);
  int status = 0;
  // Fits the context (2048) but never the cache.
  json r = post_json(port(), "/v1/completions", json({{"prompt", "x"}, {"max_tokens", 500}}).dump(),
                     &status);
  EXPECT_EQ(status, 400) << r.dump();
  EXPECT_TRUE(r["error"]["message"].is_string());
  // Longer than the context.
  json longp = {{"prompt", std::vector<int32_t>(engine_->context_length() + 1, 7)}};
  r = post_json(port(), "/v1/completions", longp.dump(), &status);
  EXPECT_EQ(status, 400) << r.dump();
  EXPECT_EQ(r["error"]["code"], "context_length_exceeded");
  // Chat without max_tokens may only use what the cache holds: it runs rather than failing.
  r = post_json(
      port(), "/v1/chat/completions",
      R"({"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": true})",
      &status);
  EXPECT_EQ(status, 200) << r.dump();
  EXPECT_LE(r["usage"]["total_tokens"].get<int>(), 128);
  expect_idle();
}

}  // namespace
}  // namespace kvq::testing
