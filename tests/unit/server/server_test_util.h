// Test support for the HTTP server: a server on an ephemeral loopback port run in a thread, a
// streaming POST client, SSE parsing, and a stand-in engine that needs no model.
#pragma once

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "kvq/core/error.h"
#include "kvq/server/http_server.h"
#include "kvq/tokenizer/tokenizer.h"
#include "support/source_dir.h"

namespace kvq::testing {

inline std::string default_model_dir() {
  return ::kvq::test::source_dir() + "/models/kvq-code-tiny";
}

// Runs `server` (bound to port 0) on a thread until destroyed.
class RunningServer {
 public:
  RunningServer(ServingEngine& engine, ServerOptions options) {
    options.host = "127.0.0.1";
    options.port = 0;
    options.log_requests = false;
    server_ = std::make_unique<HttpServer>(engine, options);
    port_ = server_->bind();
    thread_ = std::thread([this] { server_->run(); });
  }
  ~RunningServer() { stop(); }
  void stop() {
    if (!server_) return;
    server_->stop();
    thread_.join();
    server_.reset();
  }
  int port() const { return port_; }
  int drain(std::chrono::milliseconds grace) { return server_->drain(grace); }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(60, 0);
    return c;
  }

 private:
  std::unique_ptr<HttpServer> server_;
  std::thread thread_;
  int port_ = 0;
};

struct StreamResult {
  int status = 0;
  std::string raw;                     // the body as received
  std::vector<nlohmann::json> chunks;  // parsed `data:` events before [DONE]
  bool done = false;                   // saw data: [DONE]
};

// Splits an SSE body into events; every event must be one `data: ` line.
inline void parse_sse(StreamResult& r) {
  size_t pos = 0;
  while (pos < r.raw.size()) {
    const size_t end = r.raw.find("\n\n", pos);
    if (end == std::string::npos) break;
    const std::string event = r.raw.substr(pos, end - pos);
    pos = end + 2;
    if (event.rfind("data: ", 0) != 0) throw std::runtime_error("SSE event without data: " + event);
    const std::string payload = event.substr(6);
    if (payload == "[DONE]") {
      r.done = true;
      continue;
    }
    r.chunks.push_back(nlohmann::json::parse(payload));
  }
}

// POSTs `body`; `on_data` may stop the transfer by returning false (the client then closes).
inline StreamResult post_stream(
    int port, const std::string& path, const nlohmann::json& body,
    const std::function<bool(const std::string& so_far)>& on_data = {}) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(60, 0);
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  StreamResult r;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    r.raw.append(data, n);
    return on_data ? on_data(r.raw) : true;
  };
  auto res = c.send(req);
  if (res) r.status = res->status;
  parse_sse(r);
  return r;
}

inline nlohmann::json post_json(int port, const std::string& path, const std::string& body,
                                int* status) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(60, 0);
  auto res = c.Post(path.c_str(), body, "application/json");
  if (!res) {
    *status = -1;
    return nullptr;
  }
  *status = res->status;
  return nlohmann::json::parse(res->body, nullptr, false);
}

// Polls `cond` for up to `seconds`.
inline bool eventually(const std::function<bool()>& cond, double seconds = 5.0) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < until) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return cond();
}

// A Prometheus exposition's samples: "name{labels}" -> value.
inline std::map<std::string, double> parse_metrics(const std::string& text) {
  std::map<std::string, double> out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    out[line.substr(0, sp)] = std::stod(line.substr(sp + 1));
  }
  return out;
}

// Sum of the samples of one metric over all label sets.
inline double metric_sum(const std::map<std::string, double>& m, const std::string& name) {
  double s = 0.0;
  for (const auto& [k, v] : m)
    if (k == name || k.rfind(name + "{", 0) == 0) s += v;
  return s;
}

// Emits one token per request per tick, cycling through `cycle` ids, until max_tokens (finish
// "length") or cancel ("cancelled"). Enough to test the HTTP layer without a model.
class FakeEngine final : public ServingEngine {
 public:
  FakeEngine(Tokenizer tok, std::vector<int32_t> cycle, int32_t context = 4096)
      : tok_(std::move(tok)),
        cycle_(std::move(cycle)),
        context_(context),
        thread_([this] { loop(); }) {}
  ~FakeEngine() override {
    {
      std::lock_guard lk(mu_);
      quit_ = true;
      for (auto& [id, r] : reqs_) r.cancelled = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  const Tokenizer& tokenizer() const override { return tok_; }
  int32_t context_length() const override { return context_; }
  int64_t cache_capacity_tokens() const override { return int64_t{1} << 40; }
  std::vector<KvLayerGroup> kv_layer_groups() const override { return {}; }
  RequestId add_request(std::vector<int32_t> prompt, const SamplingParams& params,
                        OutputCallback cb, bool want_logprobs, int top_logprobs) override {
    if (prompt.empty()) throw InputError("empty prompt");
    std::lock_guard lk(mu_);
    const RequestId id = ++next_;
    Req r{std::move(cb),
          params,
          want_logprobs,
          static_cast<int32_t>(prompt.size()),
          0,
          false,
          std::make_unique<StreamingDecoder>(tok_),
          std::find(prompt.begin(), prompt.end(), kFailToken) != prompt.end(),
          std::find(prompt.begin(), prompt.end(), kHoldToken) != prompt.end()};
    r.top = top_logprobs;
    last_params_ = params;
    last_prompt_ = prompt;
    last_top_logprobs_ = top_logprobs;
    reqs_.emplace(id, std::move(r));
    cv_.notify_all();
    return id;
  }
  void cancel(RequestId id) override {
    std::lock_guard lk(mu_);
    if (auto it = reqs_.find(id); it != reqs_.end()) it->second.cancelled = true;
  }
  EngineStats stats() const override {
    std::lock_guard lk(mu_);
    EngineStats s;
    s.running = static_cast<int32_t>(reqs_.size());
    s.blocks_total = 1000;
    s.blocks_used = static_cast<int64_t>(reqs_.size());
    s.requests_finished = finished_;
    return s;
  }
  int64_t cancelled_count() const {
    std::lock_guard lk(mu_);
    return cancelled_;
  }
  int last_top_logprobs() const {
    std::lock_guard lk(mu_);
    return last_top_logprobs_;
  }
  SamplingParams last_params() const {
    std::lock_guard lk(mu_);
    return last_params_;
  }
  std::vector<int32_t> last_prompt() const {
    std::lock_guard lk(mu_);
    return last_prompt_;
  }
  // The text `k` tokens of output decode to.
  std::string expected_text(int k) const {
    std::vector<int32_t> ids;
    for (int i = 0; i < k; ++i) ids.push_back(cycle_[static_cast<size_t>(i) % cycle_.size()]);
    return tok_.decode(ids, true);
  }
  static float logprob_of(int k) { return -0.125f * static_cast<float>(k % 8 + 1); }
  // A prompt holding this id fails after two tokens with finish_reason "error".
  static constexpr int32_t kFailToken = 4095;
  // A prompt holding this id produces nothing until it is cancelled (a request in flight).
  static constexpr int32_t kHoldToken = 4094;
  std::chrono::microseconds tick{500};

 private:
  struct Req {
    OutputCallback cb;
    SamplingParams params;
    bool want_logprobs = false;
    int32_t prompt_tokens = 0;
    int32_t generated = 0;
    bool cancelled = false;
    std::unique_ptr<StreamingDecoder> decoder;
    bool fail = false;
    bool hold = false;
    int top = 0;  // alternatives: the token, then the next ones of the cycle, 0.5 less each
  };

  void loop() {
    std::unique_lock lk(mu_);
    while (true) {
      cv_.wait_for(lk, tick, [&] { return quit_; });
      for (auto it = reqs_.begin(); it != reqs_.end();) {
        Req& r = it->second;
        RequestOutput o;
        o.id = it->first;
        o.prompt_tokens = r.prompt_tokens;
        if (r.cancelled) {
          o.finished = true;
          o.finish_reason = "cancelled";
          ++cancelled_;
        } else if (r.hold) {
          ++it;
          continue;
        } else if (r.fail && r.generated == 2) {
          o.finished = true;
          o.finish_reason = "error";
        } else {
          const int32_t tok = cycle_[static_cast<size_t>(r.generated) % cycle_.size()];
          if (r.want_logprobs) {
            TokenLogprob lp{tok, logprob_of(r.generated)};
            for (int j = 0; j < r.top; ++j)
              lp.top.emplace_back(cycle_[static_cast<size_t>(r.generated + j) % cycle_.size()],
                                  logprob_of(r.generated) - 0.5f * static_cast<float>(j));
            o.logprobs.push_back(std::move(lp));
          }
          ++r.generated;
          o.token_ids.push_back(tok);
          o.text = r.decoder->push(tok);
          if (r.generated >= r.params.max_tokens) {
            o.text += r.decoder->finish();
            o.finished = true;
            o.finish_reason = "length";
          }
        }
        o.completion_tokens = r.generated;
        r.cb(o);
        if (o.finished) {
          ++finished_;
          it = reqs_.erase(it);
        } else {
          ++it;
        }
      }
      if (quit_ && reqs_.empty()) return;
    }
  }

  Tokenizer tok_;
  std::vector<int32_t> cycle_;
  int32_t context_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<RequestId, Req> reqs_;
  RequestId next_ = 0;
  int64_t cancelled_ = 0, finished_ = 0;
  SamplingParams last_params_;
  std::vector<int32_t> last_prompt_;
  int last_top_logprobs_ = 0;
  bool quit_ = false;
  std::thread thread_;
};

}  // namespace kvq::testing
