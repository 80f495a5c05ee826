// The OpenAI-compatible HTTP server behind `kvq serve` (cpp-httplib):
//   POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events with stream)
//   GET  /v1/models, /v1/models/{id}, /health, /metrics (Prometheus text)
// With ServerOptions::api_key every /v1 route needs the key as a bearer token.
// Errors are OpenAI-shaped JSON with 4xx statuses. A streaming client that goes away has its
// engine requests cancelled (their KV blocks freed). One log line per request on stderr.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/engine/llm_engine.h"
#include "kvq/server/metrics.h"
#include "kvq/tokenizer/tokenizer.h"

namespace kvq {

// What the server needs from an engine: LlmEngine through serving_engine(), or a stand-in in
// tests. Same contract as LlmEngine (callbacks on the engine thread, one final event each).
class ServingEngine {
 public:
  virtual ~ServingEngine() = default;
  virtual const Tokenizer& tokenizer() const = 0;
  virtual int32_t context_length() const = 0;  // 0: unlimited
  // Tokens the whole KV cache holds: no sequence can be longer (default max_tokens stay below).
  virtual int64_t cache_capacity_tokens() const = 0;
  virtual std::vector<KvLayerGroup> kv_layer_groups() const = 0;
  // LlmEngine::add_request: top_logprobs alternatives per token (with want_logprobs).
  virtual RequestId add_request(std::vector<int32_t> prompt, const SamplingParams& params,
                                OutputCallback on_output, bool want_logprobs, int top_logprobs) = 0;
  virtual void cancel(RequestId id) = 0;
  virtual EngineStats stats() const = 0;
};

// A view of `engine` (which must outlive it).
std::unique_ptr<ServingEngine> serving_engine(LlmEngine& engine);

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: a free port chosen by the system (HttpServer::bind() returns it)
  std::string served_model_name = "kvq";
  // Worker threads: each open connection (a streaming request for its whole length) holds one;
  // connections beyond wait for a free worker.
  int http_threads = 64;
  bool log_requests = true;  // one line per generation request on stderr
  // Non-empty: every /v1 route needs `Authorization: Bearer <api_key>` (401 with an OpenAI
  // error otherwise; compared in constant time). /health stays open; /metrics too unless
  // metrics_require_key.
  std::string api_key;
  bool metrics_require_key = false;
  // Request limits an operator sets (kvq serve --max-*); each refusal is an OpenAI-shaped error
  // that names the limit and its flag. 0: no limit beyond the model's context.
  size_t max_body_bytes = size_t{16} << 20;  // 413 above
  int32_t max_input_tokens = 0;              // prompt tokens; 400 above
  int32_t max_output_tokens = 0;             // an explicit max_tokens above: 400; defaults capped
  int max_n = 16;                            // choices per request; 400 above
  // Generation requests in flight (running or waiting in the engine); beyond it 429 with
  // Retry-After. The HTTP worker pool is sized above it, so the refusal is immediate.
  int max_concurrent_requests = 128;
};

// Answers on host:port while the model loads (kvq serve binds its port before loading, so a
// client or a load balancer sees "not ready" rather than a refused connection): /health 503
// {"status": "loading"}, every other route 503 with an OpenAI error. The destructor stops it
// and frees the port for the HttpServer that follows.
class LoadingResponder {
 public:
  // Binds and starts answering; throws InputError naming host:port when it cannot bind.
  LoadingResponder(const std::string& host, int port);
  ~LoadingResponder();
  LoadingResponder(const LoadingResponder&) = delete;
  LoadingResponder& operator=(const LoadingResponder&) = delete;
  int port() const { return port_; }  // the bound port (the system's choice for port 0)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = -1;
};

// True when `authorization` (an Authorization header's value) is "Bearer <key>"; the comparison
// takes the same time wherever the first difference is.
bool bearer_matches(std::string_view authorization, std::string_view key);

class HttpServer {
 public:
  // The engine must outlive the server.
  HttpServer(ServingEngine& engine, ServerOptions options);
  ~HttpServer();  // stops, and waits until the engine has finished every request it was given

  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds the listening socket; returns the port. Throws InputError naming host:port when the
  // address cannot be bound (e.g. the port is in use).
  int bind();
  // Serves until stop(). Ignores SIGPIPE process-wide: a peer that disconnects must surface as a
  // failed write (and a cancelled request), not kill the process.
  void run();
  // Thread-safe and idempotent: refuses new requests, cancels those in flight, ends run().
  void stop();
  // Graceful shutdown (SIGTERM): new generation requests get 503 and /health answers 503
  // {"status": "draining"} at once; requests in flight run to their end for up to `grace`, then
  // stop() cancels what is left. Returns how many requests were still in flight at the deadline.
  int drain(std::chrono::milliseconds grace);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvq
