// serving_engine(): LlmEngine seen through the ServingEngine interface the HTTP server uses.
#include "kvq/engine/llm_engine.h"
#include "kvq/server/http_server.h"

namespace kvq {

namespace {

class LlmServingEngine final : public ServingEngine {
 public:
  explicit LlmServingEngine(LlmEngine& e)
      : e_(e), groups_(::kvq::kv_layer_groups(e.model().plan().layers)) {}
  const Tokenizer& tokenizer() const override { return e_.tokenizer(); }
  int32_t context_length() const override { return e_.context_length(); }
  int64_t cache_capacity_tokens() const override {
    const auto& layers = e_.model().plan().layers;
    return layers.empty() ? 0 : e_.stats().blocks_total * layers.front().block_tokens;
  }
  std::vector<KvLayerGroup> kv_layer_groups() const override { return groups_; }
  RequestId add_request(std::vector<int32_t> prompt, const SamplingParams& params,
                        OutputCallback on_output, bool want_logprobs, int top_logprobs) override {
    return e_.add_request(std::move(prompt), params, std::move(on_output), want_logprobs,
                          top_logprobs);
  }
  void cancel(RequestId id) override { e_.cancel(id); }
  EngineStats stats() const override { return e_.stats(); }

 private:
  LlmEngine& e_;
  std::vector<KvLayerGroup> groups_;
};

}  // namespace

std::unique_ptr<ServingEngine> serving_engine(LlmEngine& engine) {
  return std::make_unique<LlmServingEngine>(engine);
}

}  // namespace kvq
