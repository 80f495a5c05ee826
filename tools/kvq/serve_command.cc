// kvq serve: the OpenAI-compatible HTTP server over LlmEngine.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <thread>

#include "commands.h"
#include "kvq/cache/paged_kv_cache.h"
#include "kvq/core/error.h"
#include "kvq/engine/generator.h"
#include "kvq/engine/llm_engine.h"
#include "kvq/server/http_server.h"
#include "model_flags.h"

namespace kvq::cli {

namespace {

// The served name when none is given: the model folder's name.
std::string folder_name(const std::string& dir) {
  std::filesystem::path p(dir);
  while (!p.empty() && p.filename().empty()) p = p.parent_path();
  const std::string name = p.filename().string();
  return name.empty() ? "kvq" : name;
}

// SIGINT/SIGTERM: the handler only writes the signal number to a pipe (async-signal-safe);
// a watcher thread reads it and stops the server. A second signal exits at once.
int g_signal_pipe[2] = {-1, -1};
std::atomic<int> g_signals{0};

extern "C" void on_stop_signal(int sig) {
  if (g_signals.fetch_add(1) > 0) _exit(128 + sig);
  const unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t r = write(g_signal_pipe[1], &b, 1);
}

}  // namespace

Action add_serve_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "serve", "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)");
  struct State {
    ModelFlags model;
    std::string host = "127.0.0.1";
    int port = 8000;
    int max_num_seqs = 64;
    int max_num_batched_tokens = 512;
    std::string served_model_name;
    bool no_prefix_caching = false;
    std::string api_key;
    bool metrics_require_key = false;
    std::string max_body_size = "16MiB";
    int max_input_tokens = 0, max_output_tokens = 0, max_n = 16, max_concurrent_requests = 128;
    double shutdown_grace_period = 30.0;
  };
  auto st = std::make_shared<State>();
  st->model.add_to(*sub);
  st->model.plan.add_speculative_to(*sub);
  sub->add_option("--host", st->host, "address to listen on (default 127.0.0.1)");
  sub->add_option("--port", st->port, "port to listen on (default 8000; 0 = any free port)")
      ->check(CLI::Range(0, 65535));
  sub->add_option("--max-num-seqs", st->max_num_seqs, "sequences computed at once (default 64)")
      ->check(CLI::Range(1, 4096));
  sub->add_option("--max-num-batched-tokens", st->max_num_batched_tokens,
                  "tokens per engine step, prefill chunks and decodes together (default 512)")
      ->check(CLI::Range(1, 1 << 20));
  sub->add_option("--served-model-name", st->served_model_name,
                  "the model name clients send (default: the model folder's name)");
  sub->add_flag("--no-prefix-caching", st->no_prefix_caching,
                "do not share cached prompt prefixes between requests");
  CLI::Option* api_key =
      sub->add_option("--api-key", st->api_key,
                      "require 'Authorization: Bearer KEY' on every /v1 route (401 otherwise); "
                      "/health stays open (also from the environment: KVQ_API_KEY)")
          ->envname("KVQ_API_KEY");
  sub->add_flag("--metrics-require-api-key", st->metrics_require_key,
                "with --api-key, /metrics needs the key too (default: open, like /health)");
  sub->add_option("--max-body-size", st->max_body_size,
                  "largest request body (default 16MiB; e.g. 1MiB, 64MB); 413 above");
  sub->add_option("--max-input-tokens", st->max_input_tokens,
                  "most prompt tokens per request (default 0: the model's context); 400 above")
      ->check(CLI::Range(0, 1 << 30));
  sub->add_option("--max-output-tokens", st->max_output_tokens,
                  "most tokens generated per choice (default 0: the rest of the context); an "
                  "explicit larger max_tokens gets 400, defaults are capped")
      ->check(CLI::Range(0, 1 << 30));
  sub->add_option("--max-n", st->max_n, "most choices (n) per request (default 16; at most 128)")
      ->check(CLI::Range(1, 128));
  sub->add_option("--max-concurrent-requests", st->max_concurrent_requests,
                  "generation requests in flight, running or waiting (default 128); beyond it "
                  "429 with Retry-After")
      ->check(CLI::Range(1, 4096));
  sub->add_option("--shutdown-grace-period", st->shutdown_grace_period,
                  "seconds that requests in flight may run after SIGTERM / SIGINT before they are "
                  "cancelled (default 30; 0: cancel at once); new requests get 503 meanwhile")
      ->check(CLI::Range(0.0, 86400.0));

  return [st, api_key]() {
    if (api_key->count() > 0 && st->api_key.empty())
      throw InputError(
          "--api-key (or KVQ_API_KEY): empty; give the key clients send as "
          "'Authorization: Bearer KEY', or leave both unset for an open server");
    if (st->metrics_require_key && st->api_key.empty())
      throw InputError("--metrics-require-api-key needs --api-key (or KVQ_API_KEY)");
    const size_t max_body = parse_byte_size(st->max_body_size, "--max-body-size");
    // SIGINT / SIGTERM from here on: during start-up the process exits at once (exit 0), once
    // serving the server drains (--shutdown-grace-period). A second signal exits at once.
    if (pipe(g_signal_pipe) != 0) throw InternalError("kvq serve: pipe() failed");
    struct sigaction sa = {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
    std::atomic<HttpServer*> serving_server{nullptr};
    std::thread signal_thread([&] {
      unsigned char sig = 0;
      while (read(g_signal_pipe[0], &sig, 1) < 0 && errno == EINTR) {
      }
      if (sig == 0) return;  // the server ended on its own
      const char* name = sig == SIGINT ? "SIGINT" : "SIGTERM";
      HttpServer* server = serving_server.load();
      if (server == nullptr) {
        std::fprintf(stderr, "kvq serve: %s received during start-up, exiting\n", name);
        std::fflush(stderr);
        std::_Exit(0);
      }
      std::fprintf(stderr,
                   "kvq serve: %s received, refusing new requests; those in flight have %.0f s "
                   "to finish\n",
                   name, st->shutdown_grace_period);
      const int left = server->drain(
          std::chrono::milliseconds(static_cast<int64_t>(st->shutdown_grace_period * 1000.0)));
      if (left > 0)
        std::fprintf(stderr, "kvq serve: grace period over, %d request(s) cancelled\n", left);
    });
    struct JoinSignalThread {  // on every way out (start-up errors too), before the server goes
      std::thread& t;
      void join() {
        if (!t.joinable()) return;
        const unsigned char quit = 0;
        [[maybe_unused]] ssize_t w = write(g_signal_pipe[1], &quit, 1);
        t.join();
      }
      ~JoinSignalThread() { join(); }
    } join_signal_thread{signal_thread};
    // The port answers "loading" (/health 503) while the model loads, and a port in use fails
    // before the load.
    auto loading = std::make_unique<LoadingResponder>(st->host, st->port);
    st->model.max_num_seqs = st->max_num_seqs;
    st->model.max_num_batched_tokens = st->max_num_batched_tokens;
    LoadedModel lm = st->model.load();
    const std::optional<Speculation> spec = st->model.load_speculation(*lm.model, *lm.tokenizer);
    const KvPlan& plan = lm.model->plan();
    const int32_t context = model_context_length(*lm.model);
    size_t block_bytes = 0;
    for (const auto& l : plan.layers) block_bytes += l.block_bytes();
    const int block_tokens = plan.layers.empty() ? 16 : plan.layers.front().block_tokens;
    size_t budget = 0;
    int64_t num_blocks = -1;
    if (!st->model.plan.kv_cache_memory.empty()) {
      budget = parse_byte_size(st->model.plan.kv_cache_memory, "--kv-cache-memory");
    } else if (lm.model->max_cache_blocks() >= 0) {
      // A GPU model: what --gpu-memory-utilization leaves after weights and buffers.
      num_blocks = lm.model->max_cache_blocks();
    } else {
      // Default: room for --max-num-seqs full-context sequences, at most 4 GiB (the CPU default
      // of vLLM's VLLM_CPU_KVCACHE_SPACE).
      const size_t blocks_per_seq =
          (static_cast<size_t>(std::max(context, 1)) + block_tokens - 1) / block_tokens;
      budget = std::min<size_t>(
          size_t{4} << 30, blocks_per_seq * static_cast<size_t>(st->max_num_seqs) * block_bytes);
    }
    EngineConfig config;
    config.num_blocks = num_blocks >= 0 ? num_blocks : blocks_for_budget(plan.layers, budget);
    if (spec) {
      // The drafter's cache holds as many tokens as the target's. On a GPU both share what
      // --gpu-memory-utilization leaves; on the CPU the drafter's comes on top of the budget.
      const size_t drafter_bytes = spec->drafter_block_bytes();
      if (num_blocks >= 0 && drafter_bytes > 0)
        config.num_blocks = static_cast<int64_t>(static_cast<double>(num_blocks) * block_bytes /
                                                 static_cast<double>(block_bytes + drafter_bytes)) -
                            st->max_num_seqs;
      if (config.num_blocks < 1)
        throw InputError(
            "--speculative-config: no room for the KV caches of the target and the "
            "drafter (raise --gpu-memory-utilization)");
      config.proposer = spec->proposer(static_cast<int32_t>(config.num_blocks + st->max_num_seqs),
                                       st->max_num_batched_tokens);
      config.num_speculative_tokens = spec->config.num_speculative_tokens;
      config.speculative_disable_by_batch_size = spec->config.disable_by_batch_size;
      config.speculative_auto_disable = spec->config.auto_disable;
    }
    config.max_num_seqs = st->max_num_seqs;
    config.max_num_batched_tokens = st->max_num_batched_tokens;
    config.enable_prefix_caching = !st->no_prefix_caching;
    std::string summary = summarize_kv_plan(plan);
    if (spec) summary += " | speculative " + spec->summary();
    LlmEngine engine(std::move(lm.model), std::move(lm.tokenizer), config);
    auto serving = serving_engine(engine);

    ServerOptions options;
    options.host = st->host;
    options.port = loading->port();
    options.served_model_name =
        st->served_model_name.empty() ? folder_name(st->model.plan.model) : st->served_model_name;
    options.http_threads = std::min(1024, 2 * st->max_num_seqs + 16);
    options.api_key = st->api_key;
    options.metrics_require_key = st->metrics_require_key;
    options.max_body_bytes = max_body;
    options.max_input_tokens = st->max_input_tokens;
    options.max_output_tokens = st->max_output_tokens;
    options.max_n = st->max_n;
    options.max_concurrent_requests = st->max_concurrent_requests;
    HttpServer server(*serving, options);
    loading.reset();  // frees the port
    const int port = server.bind();
    std::fprintf(stderr,
                 "kvq serve: model '%s' (%s), context %d tokens | KV cache %lld blocks x %d tokens "
                 "(%.1f MiB) | "
                 "plan: %s\nkvq serve: listening on http://%s:%d%s (Ctrl-C to stop)\n",
                 options.served_model_name.c_str(), st->model.plan.model.c_str(), context,
                 static_cast<long long>(config.num_blocks), block_tokens,
                 static_cast<double>(config.num_blocks) * static_cast<double>(block_bytes) /
                     (1024.0 * 1024.0),
                 summary.c_str(), st->host.c_str(), port,
                 options.api_key.empty()
                     ? ""
                     : (options.metrics_require_key ? ", API key required on /v1 and /metrics"
                                                    : ", API key required on /v1"));

    serving_server = &server;
    server.run();
    join_signal_thread.join();  // a drain in progress returns before the server is destroyed
    std::fprintf(stderr, "kvq serve: stopped\n");
    return 0;
  };
}

}  // namespace kvq::cli
