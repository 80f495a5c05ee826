// Tiny random decoder models written by the tests (config.json + model.safetensors), an
// independent float64 forward pass over them (dense attention over unquantized K/V, no
// paging), and a driver that runs kvq's Model over a PagedKvCache.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "kvq/cache/paged_kv_cache.h"
#include "kvq/core/error.h"
#include "kvq/model/model.h"
#include "kvq/plan/kv_plan.h"
#include "kvq/quant/codec.h"
#include "support/fixtures.h"

namespace kvq::test {

// A fresh seed per run, or KVQ_TEST_SEED's (to replay a failure: tests print their seed).
inline uint32_t fresh_seed() {
  if (const char* e = std::getenv("KVQ_TEST_SEED"); e != nullptr && *e != '\0')
    return static_cast<uint32_t>(std::stoul(e));
  std::random_device rd;
  return rd();
}

struct TinySpec {
  std::string family = "llama";  // llama, mistral, qwen2, qwen3
  int layers = 3;
  int hidden = 128;
  int inter = 192;
  int vocab = 211;
  int q_heads = 4;
  int kv_heads = 2;
  int head_dim = 64;
  double theta = 10000.0;
  bool tie = false;
  bool attention_bias = false;
  bool mlp_bias = false;
  nlohmann::json rope_scaling = nullptr;  // transformers 4 spelling
  bool rope_parameters = false;           // transformers 5 spelling (rope_scaling moves there)
  std::vector<std::string> layer_types;   // empty: none written
  int sliding_window = 0;
  std::string weight_dtype = "F32";  // F32, BF16, F16
};

struct TinyModel {
  TinySpec spec;
  std::string dir;
  nlohmann::json config;
  // Every tensor's values as stored (after rounding to the weight dtype), row-major.
  std::map<std::string, std::vector<double>> w;
};

inline const char* arch_name(const std::string& family) {
  if (family == "llama") return "LlamaForCausalLM";
  if (family == "mistral") return "MistralForCausalLM";
  if (family == "qwen2") return "Qwen2ForCausalLM";
  return "Qwen3ForCausalLM";
}

inline nlohmann::json tiny_config(const TinySpec& s) {
  nlohmann::json c = {{"architectures", {arch_name(s.family)}},
                      {"model_type", s.family},
                      {"hidden_size", s.hidden},
                      {"intermediate_size", s.inter},
                      {"num_hidden_layers", s.layers},
                      {"num_attention_heads", s.q_heads},
                      {"num_key_value_heads", s.kv_heads},
                      {"head_dim", s.head_dim},
                      {"vocab_size", s.vocab},
                      {"max_position_embeddings", 4096},
                      {"rms_norm_eps", 1e-5},
                      {"hidden_act", "silu"},
                      {"tie_word_embeddings", s.tie},
                      {"torch_dtype", "float32"}};
  if (s.family != "qwen2") c["attention_bias"] = s.attention_bias;
  if (s.family == "llama") c["mlp_bias"] = s.mlp_bias;
  if (s.rope_parameters) {
    nlohmann::json rp =
        s.rope_scaling.is_null() ? nlohmann::json{{"rope_type", "default"}} : s.rope_scaling;
    rp["rope_theta"] = s.theta;
    c["rope_parameters"] = rp;
  } else {
    c["rope_theta"] = s.theta;
    c["rope_scaling"] = s.rope_scaling;
  }
  if (!s.layer_types.empty()) c["layer_types"] = s.layer_types;
  if (s.sliding_window > 0) c["sliding_window"] = s.sliding_window;
  return c;
}

inline bool has_qkv_bias(const TinySpec& s) {
  return s.family == "qwen2" || s.attention_bias;
}
inline bool has_o_bias(const TinySpec& s) {
  return s.family != "qwen2" && s.attention_bias;
}

// Random weights scaled so activations stay O(1); written as `weight_dtype`.
inline TinyModel make_tiny_model(const TinySpec& s, std::mt19937& rng) {
  TinyModel m;
  m.spec = s;
  m.config = tiny_config(s);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<FixtureTensor> tensors;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, double stddev, double mean) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    std::vector<double> vals(n);
    FixtureTensor t{name, s.weight_dtype, shape, {}};
    for (size_t i = 0; i < n; ++i) {
      const float f = static_cast<float>(mean + stddev * nd(rng));
      if (s.weight_dtype == "F32") {
        vals[i] = f;
        uint8_t b[4];
        std::memcpy(b, &f, 4);
        t.bytes.insert(t.bytes.end(), b, b + 4);
      } else {
        const uint16_t bits =
            s.weight_dtype == "BF16" ? quant::float_to_bf16_bits(f) : quant::float_to_fp16_bits(f);
        vals[i] = s.weight_dtype == "BF16" ? quant::bf16_bits_to_float(bits)
                                           : quant::fp16_bits_to_float(bits);
        t.bytes.push_back(static_cast<uint8_t>(bits & 0xff));
        t.bytes.push_back(static_cast<uint8_t>(bits >> 8));
      }
    }
    m.w[name] = std::move(vals);
    tensors.push_back(std::move(t));
  };
  const int64_t H = s.hidden, I = s.inter, V = s.vocab, d = s.head_dim;
  const int64_t q = s.q_heads * d, kv = s.kv_heads * d;
  add("model.embed_tokens.weight", {V, H}, 1.0, 0.0);
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {H}, 0.1, 1.0);
    add(p + "post_attention_layernorm.weight", {H}, 0.1, 1.0);
    const double sh = 1.0 / std::sqrt(static_cast<double>(H));
    add(p + "self_attn.q_proj.weight", {q, H}, sh, 0.0);
    add(p + "self_attn.k_proj.weight", {kv, H}, sh, 0.0);
    add(p + "self_attn.v_proj.weight", {kv, H}, sh, 0.0);
    if (has_qkv_bias(s)) {
      add(p + "self_attn.q_proj.bias", {q}, 0.2, 0.0);
      add(p + "self_attn.k_proj.bias", {kv}, 0.2, 0.0);
      add(p + "self_attn.v_proj.bias", {kv}, 0.2, 0.0);
    }
    if (s.family == "qwen3") {
      add(p + "self_attn.q_norm.weight", {d}, 0.1, 1.0);
      add(p + "self_attn.k_norm.weight", {d}, 0.1, 1.0);
    }
    add(p + "self_attn.o_proj.weight", {H, q}, 1.0 / std::sqrt(static_cast<double>(q)), 0.0);
    if (has_o_bias(s)) add(p + "self_attn.o_proj.bias", {H}, 0.2, 0.0);
    add(p + "mlp.gate_proj.weight", {I, H}, sh, 0.0);
    add(p + "mlp.up_proj.weight", {I, H}, sh, 0.0);
    add(p + "mlp.down_proj.weight", {H, I}, 1.0 / std::sqrt(static_cast<double>(I)), 0.0);
    if (s.mlp_bias) {
      add(p + "mlp.gate_proj.bias", {I}, 0.2, 0.0);
      add(p + "mlp.up_proj.bias", {I}, 0.2, 0.0);
      add(p + "mlp.down_proj.bias", {H}, 0.2, 0.0);
    }
  }
  add("model.norm.weight", {H}, 0.1, 1.0);
  if (!s.tie) add("lm_head.weight", {V, H}, 1.0 / std::sqrt(static_cast<double>(H)), 0.0);
  m.dir = make_model_dir(m.config, tensors);
  return m;
}

// ---- the float64 reference forward pass -------------------------------------------------

inline std::vector<double> ref_rms_norm(const std::vector<double>& x, const std::vector<double>& w,
                                        double eps) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double r = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + eps);
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * r * w[i];
  return y;
}

// y = W x (+ b), W [out][in] row-major.
inline std::vector<double> ref_linear(const std::vector<double>& W, const std::vector<double>* b,
                                      const std::vector<double>& x) {
  const size_t in = x.size(), out = W.size() / in;
  std::vector<double> y(out);
  for (size_t o = 0; o < out; ++o) {
    double acc = b ? (*b)[o] : 0.0;
    for (size_t i = 0; i < in; ++i) acc += W[o * in + i] * x[i];
    y[o] = acc;
  }
  return y;
}

// The RoPE inverse frequencies as transformers' rope init functions define them.
inline std::vector<double> ref_inv_freq(const TinySpec& s) {
  const int d = s.head_dim;
  std::vector<double> f(static_cast<size_t>(d / 2));
  for (int i = 0; i < d / 2; ++i) f[static_cast<size_t>(i)] = std::pow(s.theta, -2.0 * i / d);
  const auto& rs = s.rope_scaling;
  if (rs.is_null()) return f;
  const std::string type = rs.value("rope_type", rs.value("type", std::string("default")));
  const double factor = rs.value("factor", 1.0);
  if (type == "linear") {
    for (double& x : f) x /= factor;
  } else if (type == "llama3") {
    const double lo = rs.value("low_freq_factor", 1.0), hi = rs.value("high_freq_factor", 4.0);
    const double old_len = rs.value("original_max_position_embeddings", 8192);
    for (double& x : f) {
      const double wavelen = 2 * std::numbers::pi / x;
      const double scaled = x / factor;
      if (wavelen < old_len / hi) continue;  // high frequency: unchanged
      if (wavelen > old_len / lo) {          // low frequency: scaled
        x = scaled;
        continue;
      }
      const double smooth = (old_len / wavelen - lo) / (hi - lo);
      x = (1 - smooth) * scaled + smooth * x;
    }
  }
  return f;
}

inline void ref_rope(double* x, int d, int pos, const std::vector<double>& inv_freq) {
  // rotate_half: out = x * cos + cat(-x2, x1) * sin
  std::vector<double> y(static_cast<size_t>(d));
  for (int i = 0; i < d; ++i) {
    const int f = i % (d / 2);
    const double a = pos * inv_freq[static_cast<size_t>(f)];
    const double rot = i < d / 2 ? -x[i + d / 2] : x[i - d / 2];
    y[static_cast<size_t>(i)] = x[i] * std::cos(a) + rot * std::sin(a);
  }
  std::copy(y.begin(), y.end(), x);
}

// Logits [n][vocab] of every position of one sequence, recomputed from scratch.
inline std::vector<std::vector<double>> ref_forward(const TinyModel& m,
                                                    const std::vector<int32_t>& tokens) {
  const TinySpec& s = m.spec;
  const int n = static_cast<int>(tokens.size()), H = s.hidden, d = s.head_dim;
  const double eps = 1e-5;
  const auto inv_freq = ref_inv_freq(s);
  auto W = [&](const std::string& name) -> const std::vector<double>& { return m.w.at(name); };
  auto Wp = [&](const std::string& name) -> const std::vector<double>* {
    auto it = m.w.find(name);
    return it == m.w.end() ? nullptr : &it->second;
  };
  std::vector<std::vector<double>> x(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t)
    x[t].assign(W("model.embed_tokens.weight").begin() + static_cast<ptrdiff_t>(tokens[t]) * H,
                W("model.embed_tokens.weight").begin() + static_cast<ptrdiff_t>(tokens[t] + 1) * H);
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const bool sliding = !s.layer_types.empty() && s.layer_types[l] == "sliding_attention";
    std::vector<std::vector<double>> q(n), k(n), v(n);
    for (int t = 0; t < n; ++t) {
      const auto xn = ref_rms_norm(x[t], W(p + "input_layernorm.weight"), eps);
      q[t] = ref_linear(W(p + "self_attn.q_proj.weight"), Wp(p + "self_attn.q_proj.bias"), xn);
      k[t] = ref_linear(W(p + "self_attn.k_proj.weight"), Wp(p + "self_attn.k_proj.bias"), xn);
      v[t] = ref_linear(W(p + "self_attn.v_proj.weight"), Wp(p + "self_attn.v_proj.bias"), xn);
      for (int h = 0; h < s.q_heads; ++h) {
        double* qh = q[t].data() + h * d;
        if (s.family == "qwen3") {
          auto nq =
              ref_rms_norm(std::vector<double>(qh, qh + d), W(p + "self_attn.q_norm.weight"), eps);
          std::copy(nq.begin(), nq.end(), qh);
        }
        ref_rope(qh, d, t, inv_freq);
      }
      for (int h = 0; h < s.kv_heads; ++h) {
        double* kh = k[t].data() + h * d;
        if (s.family == "qwen3") {
          auto nk =
              ref_rms_norm(std::vector<double>(kh, kh + d), W(p + "self_attn.k_norm.weight"), eps);
          std::copy(nk.begin(), nk.end(), kh);
        }
        ref_rope(kh, d, t, inv_freq);
      }
    }
    const int group = s.q_heads / s.kv_heads;
    for (int t = 0; t < n; ++t) {
      std::vector<double> att(static_cast<size_t>(s.q_heads * d), 0.0);
      const int lo = sliding ? std::max(0, t - s.sliding_window + 1) : 0;
      for (int h = 0; h < s.q_heads; ++h) {
        const int g = h / group;
        std::vector<double> sc;
        double mx = -1e300;
        for (int j = lo; j <= t; ++j) {
          double dot = 0;
          for (int i = 0; i < d; ++i) dot += q[t][h * d + i] * k[j][g * d + i];
          sc.push_back(dot / std::sqrt(static_cast<double>(d)));
          mx = std::max(mx, sc.back());
        }
        double sum = 0;
        for (double& e : sc) sum += (e = std::exp(e - mx));
        for (int j = lo; j <= t; ++j)
          for (int i = 0; i < d; ++i) att[h * d + i] += sc[j - lo] / sum * v[j][g * d + i];
      }
      const auto o =
          ref_linear(W(p + "self_attn.o_proj.weight"), Wp(p + "self_attn.o_proj.bias"), att);
      for (int i = 0; i < H; ++i) x[t][i] += o[i];
    }
    for (int t = 0; t < n; ++t) {
      const auto xn = ref_rms_norm(x[t], W(p + "post_attention_layernorm.weight"), eps);
      const auto g = ref_linear(W(p + "mlp.gate_proj.weight"), Wp(p + "mlp.gate_proj.bias"), xn);
      const auto u = ref_linear(W(p + "mlp.up_proj.weight"), Wp(p + "mlp.up_proj.bias"), xn);
      std::vector<double> a(g.size());
      for (size_t i = 0; i < g.size(); ++i) a[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
      const auto dn = ref_linear(W(p + "mlp.down_proj.weight"), Wp(p + "mlp.down_proj.bias"), a);
      for (int i = 0; i < H; ++i) x[t][i] += dn[i];
    }
  }
  const auto& head = s.tie ? W("model.embed_tokens.weight") : W("lm_head.weight");
  std::vector<std::vector<double>> logits(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t)
    logits[t] = ref_linear(head, nullptr, ref_rms_norm(x[t], W("model.norm.weight"), eps));
  return logits;
}

// ---- driving kvq's model ------------------------------------------------------------------

inline KvPlan plan_for(const std::string& dir, KvDtype kv = KvDtype::kFloat32,
                       int block_tokens = 16) {
  KvPlanOptions o;
  o.kv = DtypeFlag{kv, "--kv-cache-dtype " + std::string(to_string(kv))};
  o.block_tokens = block_tokens;
  return make_kv_plan(load_model_config(dir), o);
}

// A model with its own cache; step() runs one forward over several sequences' new tokens.
class Runner {
 public:
  Runner(std::shared_ptr<const Model> model, int32_t num_blocks)
      : model_(std::move(model)), cache_(model_->plan().layers, num_blocks) {}

  PagedKvCache& cache() { return cache_; }
  const Model& model() const { return *model_; }

  // Appends `tokens[i]` to sequence `ids[i]` (registered on first use) and returns the logits
  // of every new token, in batch order: [sum of lengths][vocab].
  std::vector<float> step(const std::vector<SequenceId>& ids,
                          const std::vector<std::vector<int32_t>>& tokens) {
    std::vector<int32_t> toks, pos, q_indptr{0}, rows;
    std::vector<int64_t> slots;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (!cache_.has_sequence(ids[i])) cache_.add_sequence(ids[i]);
      const int32_t start = cache_.seq_len(ids[i]);
      auto s = cache_.append(ids[i], static_cast<int32_t>(tokens[i].size()));
      EXPECT_EQ(s.size(), tokens[i].size()) << "cache full";
      for (size_t j = 0; j < tokens[i].size(); ++j) {
        rows.push_back(static_cast<int32_t>(toks.size()));
        toks.push_back(tokens[i][j]);
        pos.push_back(start + static_cast<int32_t>(j));
      }
      slots.insert(slots.end(), s.begin(), s.end());
      q_indptr.push_back(static_cast<int32_t>(toks.size()));
    }
    PagedKvCache::BlockTableStorage storage;
    ForwardBatch b;
    b.tokens = toks;
    b.positions = pos;
    b.q_indptr = q_indptr;
    b.slots = slots;
    b.block_table = cache_.block_table(ids, storage);
    b.logit_rows = rows;
    std::vector<float> logits(rows.size() * static_cast<size_t>(model_->vocab_size()));
    model_->forward(b, cache_, logits);
    return logits;
  }

 private:
  std::shared_ptr<const Model> model_;
  PagedKvCache cache_;
};

inline std::vector<int32_t> random_tokens(int n, int vocab, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> u(0, vocab - 1);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = u(rng);
  return t;
}

inline int argmax(const float* row, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i)
    if (row[i] > row[best]) best = i;
  return best;
}

}  // namespace kvq::test
