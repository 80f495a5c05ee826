#include "kvq/server/http_server.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "kvq/core/error.h"
#include "kvq/server/chat_format.h"
#include "kvq/server/openai_protocol.h"

namespace kvq {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

constexpr std::string_view kJson = "application/json";

std::string dump(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// "cancelled" is kvq's word; OpenAI clients know vLLM's "abort" better.
std::string api_finish_reason(const std::string& r) {
  return r == "cancelled" ? "abort" : r;
}

// One choice of one HTTP request: the events the engine delivered, and what was made of them.
struct Choice {
  std::deque<RequestOutput> events;  // not yet consumed by the HTTP side
  bool finished = false;
  // Engine-thread bookkeeping (timing), touched only by the callback.
  std::optional<Clock::time_point> first_token, last_token;
  bool prompt_counted = false;
  // HTTP-side accumulation.
  ChoiceOutput out;
  int32_t prompt_tokens = 0, completion_tokens = 0, cached_prompt_tokens = 0;
  SpecCounters spec;
  int64_t text_offset = 0;
};

// Shared by one HTTP request's handler (or its stream provider) and its engine callbacks.
struct Exchange {
  GenerationRequest request;
  ResponseMeta meta;
  Clock::time_point arrival = Clock::now();
  std::vector<RequestId> ids;  // engine requests, one per choice (written under active_mu)

  std::mutex mu;
  std::condition_variable cv;
  std::vector<Choice> choices;
  int finished = 0;
  std::optional<Clock::time_point> first_token;  // over all choices
  bool logged = false;
};

// httplib listens with a backlog of 5 (compiled into the library): a burst of clients then
// overflows the accept queue and their connects stall for a second-long SYN retry. The
// listening socket is reachable from a subclass, so widen the backlog after binding.
class Server : public httplib::Server {
 public:
  Server() {
    // httplib's default also sets SO_REUSEPORT, which lets a second server bind a port in use
    // and silently share it; keep only SO_REUSEADDR (quick restarts over TIME_WAIT).
    set_socket_options([](socket_t sock) {
      int yes = 1;
      setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    });
  }
  // Binds host:port (0: a free port); returns the port. InputError naming the address otherwise.
  int bind_listener(const std::string& host, int port) {
    const std::string where = host + ":" + std::to_string(port);
    if (port < 0 || port > 65535)
      throw InputError("--port " + std::to_string(port) + ": accepted: 0 (any free port) to 65535");
    if (port == 0) {
      port = bind_to_any_port(host);
      if (port < 0)
        throw InputError("cannot listen on " + where + ": the host address cannot be bound");
    } else if (!bind_to_port(host, port)) {
      throw InputError("cannot listen on " + where +
                       ": the port is in use or the host address cannot be bound");
    }
    ::listen(svr_sock_, SOMAXCONN);
    return port;
  }
};

}  // namespace

bool bearer_matches(std::string_view authorization, std::string_view key) {
  constexpr std::string_view kScheme = "Bearer ";
  if (key.empty() || authorization.size() != kScheme.size() + key.size()) return false;
  // No early exit: every byte is compared, so the time does not tell where a guess went wrong.
  unsigned char diff = 0;
  for (size_t i = 0; i < authorization.size(); ++i) {
    const char want = i < kScheme.size() ? kScheme[i] : key[i - kScheme.size()];
    diff |= static_cast<unsigned char>(authorization[i] ^ want);
  }
  return diff == 0;
}

struct HttpServer::Impl {
  ServingEngine& engine;
  ServerOptions opt;
  Server http;
  ServerMetrics metrics;
  std::vector<KvLayerGroup> groups;
  std::optional<ChatFormat> chat;
  std::optional<int32_t> end_of_turn_id;
  std::string id_prefix;
  std::atomic<uint64_t> next_id{0};

  std::mutex active_mu;
  std::condition_variable active_cv;  // an exchange left `active`
  bool stopping = false;              // under active_mu
  std::atomic<bool> draining{false};  // drain(): refuse new requests, let these finish
  std::set<std::shared_ptr<Exchange>> active;

  // Engine requests whose final event has not arrived: the destructor waits for them, since
  // their callbacks use this object.
  std::mutex outstanding_mu;
  std::condition_variable outstanding_cv;
  int64_t outstanding = 0;

  std::atomic<bool> in_run{false};
  int bound_port = -1;

  Impl(ServingEngine& e, ServerOptions o) : engine(e), opt(std::move(o)) {
    groups = engine.kv_layer_groups();
    chat = detect_chat_format(engine.tokenizer().chat_template());
    if (chat) end_of_turn_id = engine.tokenizer().token_to_id(end_of_turn_token(*chat));
    std::random_device rd;
    char buf[24];
    std::snprintf(buf, sizeof buf, "%08x", rd());
    id_prefix = buf;
    setup_routes();
  }

  // ---- responses -------------------------------------------------------------------------
  void send_error(httplib::Response& res, const ApiError& e) {
    metrics.count_error(e.status());
    res.status = e.status();
    if (e.status() == 429) res.set_header("Retry-After", "1");
    res.set_content(dump(error_json(e)), std::string(kJson));
  }

  void setup_routes() {
    // Room for every admitted request (a streaming one holds its worker) plus spares that answer
    // 429, /health and /metrics while the server is full.
    const int workers = std::max({1, opt.http_threads, opt.max_concurrent_requests + 8});
    http.new_task_queue = [workers] {
      return new httplib::ThreadPool(static_cast<size_t>(workers));
    };
    http.set_tcp_nodelay(true);
    http.set_payload_max_length(opt.max_body_bytes > 0 ? opt.max_body_bytes
                                                       : std::numeric_limits<size_t>::max());
    if (!opt.api_key.empty())
      http.set_pre_routing_handler([this](const httplib::Request& q, httplib::Response& r) {
        const bool keyed =
            q.path.starts_with("/v1/") || (opt.metrics_require_key && q.path == "/metrics");
        if (!keyed || bearer_matches(q.get_header_value("Authorization"), opt.api_key))
          return httplib::Server::HandlerResponse::Unhandled;
        r.set_header("WWW-Authenticate", "Bearer");
        send_error(r, ApiError(401,
                               "missing or wrong API key: this server needs the header "
                               "'Authorization: Bearer <key>' (kvq serve --api-key)",
                               "", "invalid_api_key"));
        return httplib::Server::HandlerResponse::Handled;
      });

    http.Post("/v1/completions", [this](const httplib::Request& q, httplib::Response& r) {
      handle_generate(q, r, Endpoint::kCompletions);
    });
    http.Post("/v1/chat/completions", [this](const httplib::Request& q, httplib::Response& r) {
      handle_generate(q, r, Endpoint::kChatCompletions);
    });
    http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& r) {
      r.set_content(dump({{"object", "list"}, {"data", nlohmann::json::array({model_card()})}}),
                    std::string(kJson));
    });
    http.Get("/v1/models/(.+)", [this](const httplib::Request& q, httplib::Response& r) {
      if (q.matches[1] != opt.served_model_name)
        return send_error(
            r, ApiError(404, "The model '" + std::string(q.matches[1]) + "' does not exist.",
                        "model", "model_not_found"));
      r.set_content(dump(model_card()), std::string(kJson));
    });
    http.Get("/health", [this](const httplib::Request&, httplib::Response& r) {
      if (draining.load()) {
        r.status = 503;
        r.set_content(R"({"status":"draining"})", std::string(kJson));
        return;
      }
      r.set_content(R"({"status":"ok"})", std::string(kJson));
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& r) {
      r.set_content(metrics.render(engine.stats(), groups),
                    "text/plain; version=0.0.4; charset=utf-8");
    });

    // Known paths with the wrong method: 405 with Allow, as HTTP asks.
    auto not_allowed = [this](const char* allow) {
      return [this, allow](const httplib::Request& q, httplib::Response& r) {
        r.set_header("Allow", allow);
        send_error(
            r,
            ApiError(405, "method " + q.method + " is not allowed on " + q.path + "; use " + allow,
                     "", "method_not_allowed"));
      };
    };
    for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
      http.Get(path, not_allowed("POST"));
      http.Put(path, not_allowed("POST"));
      http.Patch(path, not_allowed("POST"));
      http.Delete(path, not_allowed("POST"));
    }
    for (const char* path : {"/v1/models", "/health", "/metrics"}) {
      http.Post(path, not_allowed("GET"));
      http.Put(path, not_allowed("GET"));
      http.Patch(path, not_allowed("GET"));
      http.Delete(path, not_allowed("GET"));
    }
    // Unrouted paths (and httplib's own refusals) come back with an empty body: give them the
    // OpenAI error shape too.
    http.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& q,
                                                                       httplib::Response& r) {
      if (!r.body.empty() || r.is_chunked_content_provider_)
        return httplib::Server::HandlerResponse::Unhandled;
      metrics.count_error(r.status);
      const std::string msg =
          r.status == 404 ? "no route " + q.method + " " + q.path +
                                "; the API has POST /v1/completions, POST /v1/chat/completions, "
                                "GET /v1/models, GET /health, GET /metrics"
          : r.status == 413
              ? "the request body is over this server's limit of " +
                    std::to_string(opt.max_body_bytes) + " bytes (kvq serve --max-body-size)"
              : "HTTP " + std::to_string(r.status) + " for " + q.method + " " + q.path;
      ApiError e(r.status, msg, "", r.status == 404 ? "not_found" : "");
      r.set_content(dump(error_json(e)), std::string(kJson));
      return httplib::Server::HandlerResponse::Handled;
    }));
    http.set_exception_handler(
        [this](const httplib::Request&, httplib::Response& r, std::exception_ptr ep) {
          std::string what = "unknown exception";
          try {
            std::rethrow_exception(ep);
          } catch (const std::exception& e) {
            what = e.what();
          } catch (...) {
          }
          std::fprintf(stderr, "kvq serve: internal error: %s\n", what.c_str());
          send_error(r, ApiError(500, "internal error: " + what, "", "", "server_error"));
        });
  }

  nlohmann::json model_card() const {
    return {{"id", opt.served_model_name},
            {"object", "model"},
            {"created", 0},
            {"owned_by", "kvq"},
            {"max_model_len", engine.context_length()}};
  }

  // ---- generation --------------------------------------------------------------------------
  std::vector<int32_t> prompt_ids(const GenerationRequest& g) {
    const Tokenizer& tok = engine.tokenizer();
    if (g.endpoint == Endpoint::kChatCompletions) {
      if (!chat)
        throw ApiError(400,
                       "chat is not available for this model: its tokenizer_config.json has no "
                       "chat_template that "
                       "kvq recognises (ChatML or Llama-3); use /v1/completions with a prompt",
                       "messages", "chat_template_unavailable");
      return tok.encode(render_chat(*chat, g.messages, g.add_generation_prompt),
                        /*add_special_tokens=*/false);
    }
    if (g.prompt_ids_given) {
      const int32_t vocab = tok.vocab_size();
      for (int32_t id : g.prompt_ids)
        if (id >= vocab)
          throw ApiError(400,
                         "'prompt': token id " + std::to_string(id) +
                             " is outside the vocabulary [0, " + std::to_string(vocab) + ")",
                         "prompt");
      return g.prompt_ids;
    }
    std::vector<int32_t> ids = tok.encode(g.prompt_text, /*add_special_tokens=*/true);
    if (ids.empty() && tok.bos_id()) ids.push_back(*tok.bos_id());
    if (ids.empty())
      throw ApiError(400, "'prompt' is empty and the model has no BOS token to start from",
                     "prompt");
    return ids;
  }

  // max_tokens: explicit values must fit the context (as OpenAI and vLLM answer); defaults are
  // 16 for completions and the rest of the context for chat, as vLLM does, kept within what the
  // KV cache can hold for one sequence (the engine refuses more).
  int resolve_max_tokens(const GenerationRequest& g, size_t prompt_len) {
    const int64_t ctx = engine.context_length();
    const int64_t p = static_cast<int64_t>(prompt_len);
    const char* prompt_field = g.endpoint == Endpoint::kCompletions ? "prompt" : "messages";
    const char* max_field =
        g.endpoint == Endpoint::kCompletions ? "max_tokens" : "max_completion_tokens";
    if (opt.max_input_tokens > 0 && p > opt.max_input_tokens)
      throw ApiError(400,
                     "the prompt has " + std::to_string(p) +
                         " tokens; this server accepts at most " +
                         std::to_string(opt.max_input_tokens) + " (kvq serve --max-input-tokens)",
                     prompt_field, "context_length_exceeded");
    if (opt.max_output_tokens > 0 && g.max_tokens && *g.max_tokens > opt.max_output_tokens)
      throw ApiError(400,
                     "'" + std::string(max_field) + "' is " + std::to_string(*g.max_tokens) +
                         "; this server generates at most " +
                         std::to_string(opt.max_output_tokens) +
                         " tokens per choice (kvq serve --max-output-tokens)",
                     max_field, "max_tokens_exceeded");
    if (ctx > 0 && p >= ctx)
      throw ApiError(400,
                     "This model's maximum context length is " + std::to_string(ctx) +
                         " tokens; the prompt has " + std::to_string(p) + " tokens",
                     prompt_field, "context_length_exceeded");
    const int64_t room = ctx > 0 ? ctx - p : int64_t{1} << 30;
    if (g.max_tokens) {
      if (*g.max_tokens > room)
        throw ApiError(
            400,
            "This model's maximum context length is " + std::to_string(ctx) +
                " tokens; you asked for " + std::to_string(p + *g.max_tokens) + " (" +
                std::to_string(p) + " in the prompt, " + std::to_string(*g.max_tokens) +
                " to generate)",
            g.endpoint == Endpoint::kCompletions ? "max_tokens" : "max_completion_tokens",
            "context_length_exceeded");
      return *g.max_tokens;
    }
    int64_t fits = std::max<int64_t>(1, std::min(room, engine.cache_capacity_tokens() - p));
    if (opt.max_output_tokens > 0) fits = std::min<int64_t>(fits, opt.max_output_tokens);
    const int64_t def = g.endpoint == Endpoint::kCompletions ? std::min<int64_t>(16, fits) : fits;
    return static_cast<int>(std::min<int64_t>(def, std::numeric_limits<int32_t>::max()));
  }

  OutputCallback make_callback(const std::shared_ptr<Exchange>& ex, size_t index) {
    return [this, ex, index](const RequestOutput& o) {
      const auto now = Clock::now();
      Choice& c = ex->choices[index];  // timing fields are only touched here (one engine thread)
      const int64_t k = static_cast<int64_t>(o.token_ids.size());
      if (!c.prompt_counted && (k > 0 || o.finished)) {
        c.prompt_counted = true;
        metrics.prompt_rate.add(std::max<int64_t>(0, o.prompt_tokens - o.cached_prompt_tokens));
      }
      if (k > 0) {
        if (!c.first_token) {
          c.first_token = now;
          metrics.time_to_first_token.observe(seconds_between(ex->arrival, now));
          if (k > 1) metrics.inter_token_latency.observe(0.0, k - 1);
        } else {
          metrics.inter_token_latency.observe(
              seconds_between(*c.last_token, now) / static_cast<double>(k), k);
        }
        c.last_token = now;
        metrics.generation_rate.add(k);
      }
      if (o.finished) {
        metrics.request_latency.observe(seconds_between(ex->arrival, now));
        metrics.count_finished(o.finish_reason);
      }
      {
        std::lock_guard lk(ex->mu);
        if (k > 0 && !ex->first_token) ex->first_token = now;
        c.events.push_back(o);
        if (o.finished) ++ex->finished;
        ex->cv.notify_all();
      }
      if (o.finished) {
        // Last use of this object by this engine request; notify under the lock so the
        // destructor cannot run between the decrement and the notify.
        std::lock_guard lk(outstanding_mu);
        --outstanding;
        outstanding_cv.notify_all();
      }
    };
  }

  // Queues one engine request per choice. Under active_mu, so stop() either sees them all (and
  // cancels them) or this sees `stopping` and refuses.
  void submit(const std::shared_ptr<Exchange>& ex, const std::vector<int32_t>& ids) {
    std::lock_guard lk(active_mu);
    if (stopping || draining.load())
      throw ApiError(503, "the server is shutting down", "", "", "server_error");
    if (opt.max_concurrent_requests > 0 &&
        active.size() >= static_cast<size_t>(opt.max_concurrent_requests))
      throw ApiError(429,
                     "the server is at its limit of " +
                         std::to_string(opt.max_concurrent_requests) +
                         " requests in flight (kvq serve --max-concurrent-requests); retry later",
                     "", "server_busy", "rate_limit_error");
    const GenerationRequest& g = ex->request;
    try {
      for (int i = 0; i < g.n; ++i) {
        SamplingParams p = g.sampling;
        // n choices from one seed must still differ, and stay reproducible.
        if (p.seed && i > 0) p.seed = *p.seed + static_cast<uint64_t>(i);
        {
          std::lock_guard ol(outstanding_mu);
          ++outstanding;
        }
        try {
          // completions: `logprobs: k` asks k alternatives; chat: `top_logprobs: k`.
          const int top = !g.logprobs                            ? 0
                          : g.endpoint == Endpoint::kCompletions ? *g.logprobs
                                                                 : g.top_logprobs;
          ex->ids.push_back(engine.add_request(ids, p, make_callback(ex, static_cast<size_t>(i)),
                                               g.logprobs.has_value(), top));
        } catch (...) {
          std::lock_guard ol(outstanding_mu);
          --outstanding;
          throw;
        }
      }
    } catch (const InputError& e) {
      for (RequestId id : ex->ids) engine.cancel(id);
      if (const auto* api = dynamic_cast<const ApiError*>(&e)) throw *api;
      throw ApiError(400, e.what());
    }
    active.insert(ex);
  }

  void release(const std::shared_ptr<Exchange>& ex) {
    std::lock_guard lk(active_mu);
    active.erase(ex);
    active_cv.notify_all();
  }

  void cancel_all(const std::shared_ptr<Exchange>& ex) {
    for (RequestId id : ex->ids) engine.cancel(id);  // no-op for finished ones
  }

  // Folds newly arrived events into the choices' outputs (caller holds ex->mu).
  static void absorb(Choice& c, const RequestOutput& o) {
    c.out.text += o.text;
    c.out.token_ids.insert(c.out.token_ids.end(), o.token_ids.begin(), o.token_ids.end());
    c.out.logprobs.insert(c.out.logprobs.end(), o.logprobs.begin(), o.logprobs.end());
    c.prompt_tokens = o.prompt_tokens;
    c.completion_tokens = o.completion_tokens;
    c.cached_prompt_tokens = o.cached_prompt_tokens;
    c.spec = o.spec;
    if (o.finished) {
      c.finished = true;
      c.out.finish_reason = api_finish_reason(o.finish_reason);
    }
  }

  static Usage usage_of(const Exchange& ex) {
    Usage u;
    if (!ex.choices.empty()) {
      u.prompt_tokens = ex.choices.front().prompt_tokens;  // one prompt, counted once (as OpenAI)
      u.cached_prompt_tokens = ex.choices.front().cached_prompt_tokens;
    }
    for (const auto& c : ex.choices) u.completion_tokens += c.completion_tokens;
    return u;
  }

  // One token's text: as logprobs show it (special tokens included), or as the returned text
  // has it (special tokens skipped there: what text_offset advances by).
  TokenText token_text(bool skip_special = false) const {
    return [this, skip_special](int32_t id) {
      const int32_t one[1] = {id};
      return engine.tokenizer().decode(one, skip_special);
    };
  }
  TokenText token_in_text() const { return token_text(/*skip_special=*/true); }

  void log_request(Exchange& ex, const char* outcome) {
    if (!opt.log_requests) return;
    const auto now = Clock::now();
    std::lock_guard lk(ex.mu);
    if (ex.logged) return;
    ex.logged = true;
    const Usage u = usage_of(ex);
    std::string reasons;
    for (const auto& c : ex.choices) {
      if (!reasons.empty()) reasons += ",";
      reasons += c.out.finish_reason.empty() ? "-" : c.out.finish_reason;
    }
    SpecCounters spec;
    for (const auto& c : ex.choices) spec.add(c.spec);
    char spec_text[96] = "";
    if (spec.verify_steps > 0)
      std::snprintf(spec_text, sizeof spec_text,
                    ", spec drafted %lld accepted %lld (%.0f%%) mean len %.2f",
                    static_cast<long long>(spec.drafted), static_cast<long long>(spec.accepted),
                    100.0 * spec.acceptance_rate(), spec.mean_accepted_length());
    char ttft[32] = "-";
    if (ex.first_token)
      std::snprintf(ttft, sizeof ttft, "%.1f ms",
                    1e3 * seconds_between(ex.arrival, *ex.first_token));
    std::fprintf(
        stderr,
        "kvq serve: %s %s n=%zu prompt %lld tok (%lld cached), output %lld tok (%s), ttft %s, "
        "total %.1f ms%s\n",
        ex.meta.id.c_str(), outcome, ex.choices.size(), static_cast<long long>(u.prompt_tokens),
        static_cast<long long>(u.cached_prompt_tokens), static_cast<long long>(u.completion_tokens),
        reasons.c_str(), ttft, 1e3 * seconds_between(ex.arrival, now), spec_text);
  }

  void handle_generate(const httplib::Request& req, httplib::Response& res, Endpoint endpoint) {
    std::shared_ptr<Exchange> ex;
    try {
      nlohmann::json body = parse_json_body(req.body);
      GenerationRequest g = endpoint == Endpoint::kCompletions ? parse_completion_request(body)
                                                               : parse_chat_request(body);
      if (opt.max_n > 0 && g.n > opt.max_n)
        throw ApiError(400,
                       "'n' is " + std::to_string(g.n) + "; this server returns at most " +
                           std::to_string(opt.max_n) + " choices per request (kvq serve --max-n)",
                       "n");
      if (g.model && *g.model != opt.served_model_name)
        throw ApiError(404,
                       "The model '" + *g.model + "' does not exist; this server serves '" +
                           opt.served_model_name + "'",
                       "model", "model_not_found");
      const std::vector<int32_t> ids = prompt_ids(g);
      g.sampling.max_tokens = resolve_max_tokens(g, ids.size());
      if (endpoint == Endpoint::kChatCompletions && end_of_turn_id)
        g.sampling.stop_token_ids.push_back(*end_of_turn_id);

      ex = std::make_shared<Exchange>();
      ex->choices.resize(static_cast<size_t>(g.n));
      ex->request = std::move(g);
      const uint64_t seq = next_id.fetch_add(1);
      char idbuf[64];
      std::snprintf(idbuf, sizeof idbuf, "%s-%s%06llx",
                    endpoint == Endpoint::kCompletions ? "cmpl" : "chatcmpl", id_prefix.c_str(),
                    static_cast<unsigned long long>(seq));
      ex->meta = {endpoint, idbuf, static_cast<int64_t>(std::time(nullptr)), opt.served_model_name};
      submit(ex, ids);
    } catch (const ApiError& e) {
      return send_error(res, e);
    } catch (const InputError& e) {
      return send_error(res, ApiError(400, e.what()));
    }
    if (ex->request.stream)
      stream_response(ex, res);
    else
      whole_response(ex, res);
  }

  void whole_response(const std::shared_ptr<Exchange>& ex, httplib::Response& res) {
    {
      std::unique_lock lk(ex->mu);
      ex->cv.wait(lk, [&] { return ex->finished == static_cast<int>(ex->choices.size()); });
      for (auto& c : ex->choices) {
        while (!c.events.empty()) {
          absorb(c, c.events.front());
          c.events.pop_front();
        }
      }
    }
    release(ex);
    bool cancelled = false, failed = false;
    std::vector<ChoiceOutput> outs;
    for (const auto& c : ex->choices) {
      cancelled = cancelled || c.out.finish_reason == "abort";
      failed = failed || c.out.finish_reason == "error";
      outs.push_back(c.out);
    }
    if (failed) {
      log_request(*ex, "500 engine error");
      return send_error(res, ApiError(500, "internal error while generating (see the server log)",
                                      "", "", "server_error"));
    }
    if (cancelled) {
      log_request(*ex, "503 cancelled");
      return send_error(res, ApiError(503, "the request was cancelled: the server is shutting down",
                                      "", "", "server_error"));
    }
    res.set_content(dump(make_response(ex->meta, outs, usage_of(*ex),
                                       ex->request.logprobs.has_value(), token_text(),
                                       token_in_text())),
                    std::string(kJson));
    log_request(*ex, "200");
  }

  // Server-sent events. The provider runs on this connection's worker thread after the handler
  // returns; httplib calls it until it calls sink.done() or returns false (then, or when a
  // write fails because the peer went away, the request is cancelled by the releaser).
  void stream_response(const std::shared_ptr<Exchange>& ex, httplib::Response& res) {
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    auto started = std::make_shared<bool>(false);
    auto done = std::make_shared<bool>(false);
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, ex, started, done](size_t, httplib::DataSink& sink) -> bool {
          const GenerationRequest& g = ex->request;
          const bool is_chat = g.endpoint == Endpoint::kChatCompletions;
          std::string out;
          if (!*started) {
            *started = true;
            // Chat streams open with the assistant role, before any token (as OpenAI does).
            if (is_chat)
              for (int i = 0; i < g.n; ++i)
                out += sse_data(
                    make_stream_chunk(ex->meta, i, "", true, "", nullptr, g.include_usage));
          }
          bool all_done = false;
          {
            std::unique_lock lk(ex->mu);
            auto has_events = [&] {
              return std::any_of(ex->choices.begin(), ex->choices.end(),
                                 [](const Choice& c) { return !c.events.empty(); });
            };
            if (out.empty()) ex->cv.wait_for(lk, std::chrono::milliseconds(100), has_events);
            for (size_t i = 0; i < ex->choices.size(); ++i) {
              Choice& c = ex->choices[i];
              while (!c.events.empty()) {
                RequestOutput o = std::move(c.events.front());
                c.events.pop_front();
                absorb(c, o);
                const bool finishing = o.finished;
                if (o.text.empty() && o.logprobs.empty() && !finishing) continue;
                nlohmann::json lp = nullptr;
                if (g.logprobs)
                  lp = logprobs_json(g.endpoint, o.logprobs, token_text(), &c.text_offset,
                                     token_in_text());
                out += sse_data(make_stream_chunk(ex->meta, static_cast<int>(i), o.text, false,
                                                  finishing ? c.out.finish_reason : "", lp,
                                                  g.include_usage));
                // The engine failed this choice: say so in the stream too (as vLLM does).
                if (finishing && c.out.finish_reason == "error")
                  out +=
                      sse_data(error_json(ApiError(500,
                                                   "internal error while generating choice " +
                                                       std::to_string(i) + " (see the server log)",
                                                   "", "", "server_error")));
              }
            }
            all_done = ex->finished == static_cast<int>(ex->choices.size());
          }
          if (all_done) {
            if (g.include_usage) out += sse_data(make_usage_chunk(ex->meta, usage_of(*ex)));
            out += kSseDone;
          }
          // A zero-length write would tell httplib the content has ended.
          if (!out.empty() && !sink.write(out.data(), out.size())) return false;
          if (all_done) {
            *done = true;
            sink.done();
            return true;
          }
          // Nothing to send for a while: still notice a peer that has gone.
          return out.empty() ? sink.is_writable() : true;
        },
        [this, ex, done](bool success) {
          cancel_all(ex);
          release(ex);
          log_request(*ex, success && *done
                               ? "200 stream"
                               : "stream ended early (client gone or shutdown), cancelled");
        });
  }

  int drain(std::chrono::milliseconds grace) {
    int left = 0;
    {
      std::unique_lock lk(active_mu);
      draining = true;
      active_cv.wait_for(lk, grace, [&] { return active.empty(); });
      left = static_cast<int>(active.size());
    }
    stop();
    return left;
  }

  void stop() {
    {
      std::lock_guard lk(active_mu);
      stopping = true;
      draining = true;
      for (const auto& ex : active) cancel_all(ex);
    }
    if (!in_run.load()) return;
    // run() may not have started accepting yet; httplib's stop() only acts on a running server.
    while (in_run.load() && !http.is_running())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    http.stop();
  }
};

HttpServer::HttpServer(ServingEngine& engine, ServerOptions options)
    : impl_(std::make_unique<Impl>(engine, std::move(options))) {}

HttpServer::~HttpServer() {
  stop();
  std::unique_lock lk(impl_->outstanding_mu);
  impl_->outstanding_cv.wait(lk, [&] { return impl_->outstanding == 0; });
}

int HttpServer::bind() {
  Impl& s = *impl_;
  s.bound_port = s.http.bind_listener(s.opt.host, s.opt.port);
  return s.bound_port;
}

void HttpServer::run() {
  Impl& s = *impl_;
  KVQ_CHECK(s.bound_port >= 0, "HttpServer::run() before bind()");
  std::signal(SIGPIPE, SIG_IGN);
  s.in_run = true;
  {
    std::lock_guard lk(s.active_mu);
    if (s.stopping) {
      s.in_run = false;
      return;
    }
  }
  s.http.listen_after_bind();
  s.in_run = false;
}

void HttpServer::stop() {
  impl_->stop();
}

int HttpServer::drain(std::chrono::milliseconds grace) {
  return impl_->drain(grace);
}

struct LoadingResponder::Impl {
  Server http;
  std::thread thread;
  std::atomic<bool> ended{false};  // listen_after_bind() returned
};

LoadingResponder::LoadingResponder(const std::string& host, int port)
    : impl_(std::make_unique<Impl>()) {
  Server& http = impl_->http;
  http.new_task_queue = [] { return new httplib::ThreadPool(2); };
  http.Get("/health", [](const httplib::Request&, httplib::Response& r) {
    r.status = 503;
    r.set_content(R"({"status":"loading"})", std::string(kJson));
  });
  // Every other route: the same answer in the OpenAI error shape.
  http.set_error_handler(
      httplib::Server::HandlerWithResponse([](const httplib::Request&, httplib::Response& r) {
        if (!r.body.empty()) return httplib::Server::HandlerResponse::Unhandled;  // /health
        r.status = 503;
        r.set_content(dump(error_json(ApiError(503, "the model is still loading; retry shortly", "",
                                               "model_loading", "server_error"))),
                      std::string(kJson));
        return httplib::Server::HandlerResponse::Handled;
      }));
  for (const char* path : {"/v1/completions", "/v1/chat/completions"})
    http.Post(path, [](const httplib::Request&, httplib::Response& r) { r.status = 503; });
  port_ = http.bind_listener(host, port);
  std::signal(SIGPIPE, SIG_IGN);
  impl_->thread = std::thread([this] {
    impl_->http.listen_after_bind();
    impl_->ended = true;
  });
}

LoadingResponder::~LoadingResponder() {
  // httplib's stop() only acts on a server that is accepting: wait until it is (or has ended).
  while (!impl_->http.is_running() && !impl_->ended.load())
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  impl_->http.stop();
  impl_->thread.join();
}

}  // namespace kvq
