// kvq quantize: writes a checkpoint in the compressed-tensors layout other engines load: every
// decoder projection (q/k/v/o, gate/up/down) as F8_E4M3 with a per-channel (or per-tensor)
// `weight_scale`, everything else copied as it is, config.json's quantization_config declaring
// it (dynamic per-token FP8 activations, lm_head ignored); with --kv-cache-dtype fp8, the
// kv_cache_scheme and k_scale / v_scale per layer (per kv head with --kv-scales head) calibrated
// on a text: the largest |K| and |V| the quantized model writes into its cache over the text,
// divided by fp8_e4m3's largest value. The layout: docs/QUANTIZE.md.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>

#include "commands.h"
#include "kvq/cache/paged_kv_cache.h"
#include "kvq/core/error.h"
#include "kvq/core/json_text.h"
#include "kvq/io/safetensors.h"
#include "kvq/model/model.h"
#include "kvq/plan/kv_plan.h"
#include "kvq/plan/model_config.h"
#include "kvq/quant/codec.h"
#include "kvq/tokenizer/tokenizer.h"

namespace kvq::cli {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr float kE4m3Max = 448.0f;

bool is_projection(const std::string& name) {
  static const std::regex re(
      R"(model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight)");
  return std::regex_match(name, re);
}

std::vector<std::byte> raw_bytes(const SafetensorsFile& f, const TensorInfo& t) {
  std::vector<std::byte> b(t.end - t.begin);
  std::ifstream in(f.path(), std::ios::binary);
  in.seekg(static_cast<std::streamoff>(f.data_offset() + t.begin));
  in.read(reinterpret_cast<char*>(b.data()), static_cast<std::streamsize>(b.size()));
  if (!in) throw InputError(f.path() + ": could not read tensor '" + t.name + "'");
  return b;
}

void write_text_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  if (!f) throw InputError(path + ": write failed");
}

// A progress line on stderr, redrawn only when the whole percent changes (a large checkpoint
// has thousands of tensors).
void progress(const char* what, size_t done, size_t total) {
  static const char* shown_what = nullptr;
  static size_t shown = 0;
  const size_t pct = total ? done * 100 / total : 100;
  if (what == shown_what && pct == shown && done != total) return;
  shown_what = what;
  shown = pct;
  std::fprintf(stderr, "\rkvq quantize: %s %3zu%%", what, pct);
  if (done == total) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

struct Options {
  std::string in, out, weights = "fp8", weight_scales = "channel", kv = "none",
                       kv_scales = "tensor", calibration_text;
  int64_t calibration_tokens = 4096;
};

// The largest |K| and |V| per layer and kv head that `dir`'s model writes over `tokens`
// (float32 cache, so the values are the exact ones), in windows of the model's context.
void calibrate(const std::string& dir, const std::vector<int32_t>& tokens,
               std::vector<std::vector<float>>& kmax, std::vector<std::vector<float>>& vmax) {
  KvPlanOptions o;
  o.kv = DtypeFlag{KvDtype::kFloat32, "kvq quantize calibration (float32)"};
  const KvPlan plan = make_kv_plan(load_model_config(dir), o);
  const std::unique_ptr<Model> model = Model::load(plan);
  const int ctx = std::max(
      16,
      std::min(plan.model.max_position_embeddings > 0 ? plan.model.max_position_embeddings : 2048,
               2048));
  const int bt = plan.layers.front().block_tokens;
  const size_t L = plan.layers.size();
  kmax.assign(L, {});
  vmax.assign(L, {});
  for (size_t l = 0; l < L; ++l) {
    kmax[l].assign(static_cast<size_t>(plan.layers[l].num_kv_heads), 0.0f);
    vmax[l].assign(static_cast<size_t>(plan.layers[l].num_kv_heads), 0.0f);
  }
  constexpr int kChunk = 256;
  size_t done = 0;
  for (size_t w0 = 0; w0 < tokens.size(); w0 += static_cast<size_t>(ctx)) {
    const int n = static_cast<int>(std::min(tokens.size() - w0, static_cast<size_t>(ctx)));
    const auto cache = model->create_cache((n + bt - 1) / bt);
    cache->add_sequence(1);
    const SequenceId ids[1] = {1};
    for (int c0 = 0; c0 < n; c0 += kChunk) {
      const int m = std::min(kChunk, n - c0);
      const std::span<const int32_t> chunk(tokens.data() + w0 + static_cast<size_t>(c0),
                                           static_cast<size_t>(m));
      std::vector<int32_t> pos(static_cast<size_t>(m));
      for (int i = 0; i < m; ++i) pos[static_cast<size_t>(i)] = c0 + i;
      const std::vector<int64_t> slots = cache->append(1, m);
      const int32_t qi[2] = {0, m};
      PagedKvCache::BlockTableStorage st;
      const ForwardBatch fb{chunk, pos, qi, slots, cache->block_table(ids, st), {}};
      model->forward(fb, *cache, {});
      done += static_cast<size_t>(m);
      progress("calibrating", done, tokens.size());
    }
    const std::vector<int32_t> blocks(cache->blocks(1).begin(), cache->blocks(1).end());
    for (size_t l = 0; l < L; ++l) {
      const LayerCacheView v = cache->layer_view(l);
      for (KvSide side : {KvSide::kK, KvSide::kV}) {
        const KvSideLayout& lay = v.layout(side);
        std::vector<float>& mx = side == KvSide::kK ? kmax[l] : vmax[l];
        for (int t = 0; t < n; ++t) {
          const std::byte* blk = v.block(side, blocks[static_cast<size_t>(t / bt)]);
          for (int h = 0; h < lay.num_kv_heads; ++h) {
            const auto* row = reinterpret_cast<const float*>(blk + lay.value_offset(h, t % bt));
            for (int d = 0; d < lay.head_dim; ++d)
              if (std::isfinite(row[d]))
                mx[static_cast<size_t>(h)] = std::max(mx[static_cast<size_t>(h)], std::abs(row[d]));
          }
        }
      }
    }
  }
}

int run_quantize(const Options& opt) {
  if (opt.weights != "fp8" && opt.weights != "none")
    throw InputError("--weights " + opt.weights + ": accepted: fp8, none");
  if (opt.weight_scales != "channel" && opt.weight_scales != "tensor")
    throw InputError("--weight-scales " + opt.weight_scales + ": accepted: channel, tensor");
  if (opt.kv != "fp8" && opt.kv != "none")
    throw InputError("--kv-cache-dtype " + opt.kv +
                     ": accepted: fp8 (calibrated per-tensor or per-head scales), none");
  if (opt.kv_scales != "tensor" && opt.kv_scales != "head")
    throw InputError("--kv-scales " + opt.kv_scales + ": accepted: tensor, head");
  if (opt.weights == "none" && opt.kv == "none")
    throw InputError("nothing to do: --weights none and --kv-cache-dtype none");
  if (opt.kv == "fp8" && opt.calibration_text.empty())
    throw InputError(
        "--kv-cache-dtype fp8 needs --calibration-text FILE (the scales come from "
        "the K/V the model writes over it)");
  if (!opt.calibration_text.empty() && !fs::is_regular_file(opt.calibration_text))
    throw InputError("--calibration-text " + opt.calibration_text + ": not a readable file");
  if (fs::exists(opt.out) && !(fs::is_directory(opt.out) && fs::is_empty(opt.out)))
    throw InputError("--out " + opt.out + " exists and is not an empty directory");
  if (fs::weakly_canonical(opt.out) == fs::weakly_canonical(opt.in))
    throw InputError("--out must differ from --model");
  const fs::path cfg_path = fs::path(opt.in) / "config.json";
  json cfg = parse_json_file(cfg_path.string());
  if (!cfg.is_object()) throw InputError(cfg_path.string() + ": not a JSON object");
  if (cfg.contains("quantization_config") && !cfg["quantization_config"].is_null())
    throw InputError(cfg_path.string() +
                     ": the model is already quantized (quantization_config); kvq quantize "
                     "starts from F32/F16/BF16 weights");
  (void)load_model_config(opt.in);  // an architecture kvq runs
  const CheckpointFiles files = CheckpointFiles::open(opt.in);
  if (!files.has_weights()) throw InputError(opt.in + ": no safetensors weights");

  fs::create_directories(opt.out);
  // Everything but the weights and config.json: tokenizer files and the rest.
  for (const auto& e : fs::directory_iterator(opt.in)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file() || name == "config.json" || name.ends_with(".safetensors") ||
        name == "model.safetensors.index.json" || name == "hf_quant_config.json")
      continue;
    fs::copy_file(e.path(), fs::path(opt.out) / name);
  }

  // The weights: projections to F8_E4M3 + weight_scale, the rest as they are.
  const bool fp8w = opt.weights == "fp8";
  const bool per_channel = opt.weight_scales == "channel";
  std::vector<SafetensorsWriter::Entry> entries;
  std::vector<std::pair<const SafetensorsFile*, const TensorInfo*>> order;
  for (const SafetensorsFile& f : files.files())
    for (const TensorInfo& t : f.tensors()) order.emplace_back(&f, &t);
  std::sort(order.begin(), order.end(),
            [](const auto& a, const auto& b) { return a.second->name < b.second->name; });
  for (const auto& [f, t] : order) {
    if (fp8w && is_projection(t->name) && t->shape.size() == 2) {
      entries.push_back({t->name, TensorDtype::kF8E4M3, t->shape});
      entries.push_back(
          {t->name + "_scale", TensorDtype::kF32,
           per_channel ? std::vector<int64_t>{t->shape[0], 1} : std::vector<int64_t>{}});
    } else {
      entries.push_back({t->name, t->dtype, t->shape});
    }
  }
  const bool kv = opt.kv == "fp8";
  const std::string weights_file = kv ? "model-00001-of-00002.safetensors" : "model.safetensors";
  {
    SafetensorsWriter w((fs::path(opt.out) / weights_file).string(), entries,
                        {{"format", "pt"}, {"producer", "kvq quantize"}});
    size_t i = 0;
    for (const auto& [f, t] : order) {
      if (fp8w && is_projection(t->name) && t->shape.size() == 2) {
        const std::vector<float> v = f->read_floats(*t);
        const int64_t rows = t->shape[0], cols = t->shape[1];
        std::vector<float> scale(per_channel ? static_cast<size_t>(rows) : 1, 0.0f);
        for (int64_t r = 0; r < rows; ++r) {
          float& s = scale[per_channel ? static_cast<size_t>(r) : 0];
          for (int64_t c = 0; c < cols; ++c)
            s = std::max(s, std::abs(v[static_cast<size_t>(r * cols + c)]));
        }
        for (float& s : scale) s = s > 0.0f && std::isfinite(s) ? s / kE4m3Max : 1.0f;
        std::vector<uint8_t> codes(v.size());
        for (size_t e = 0; e < v.size(); ++e)
          codes[e] =
              quant::fp8_e4m3_encode(v[e] / scale[per_channel ? e / static_cast<size_t>(cols) : 0]);
        w.add(t->name, codes.data(), codes.size());
        w.add(t->name + "_scale", scale.data(), scale.size() * sizeof(float));
      } else {
        const std::vector<std::byte> b = raw_bytes(*f, *t);
        w.add(t->name, b.data(), b.size());
      }
      progress("writing weights", ++i, order.size());
    }
    w.finish();
  }

  json q = json::object();
  if (fp8w) {
    q = {{"quant_method", "compressed-tensors"},
         {"format", "float-quantized"},
         {"quantization_status", "compressed"},
         {"config_groups",
          {{"group_0",
            {{"targets", {"Linear"}},
             {"weights",
              {{"type", "float"},
               {"num_bits", 8},
               {"strategy", per_channel ? "channel" : "tensor"},
               {"dynamic", false},
               {"symmetric", true}}},
             {"input_activations",
              {{"type", "float"},
               {"num_bits", 8},
               {"strategy", "token"},
               {"dynamic", true},
               {"symmetric", true}}}}}}},
         {"ignore", {"lm_head"}}};
  } else {
    q = {{"quant_method", "compressed-tensors"}, {"format", "float-quantized"}};
  }
  json out_cfg = cfg;
  out_cfg["quantization_config"] = q;
  write_text_file((fs::path(opt.out) / "config.json").string(), out_cfg.dump(2) + "\n");

  if (kv) {
    // An index over the weights alone while the quantized model calibrates itself.
    json index = {{"metadata", json::object()}, {"weight_map", json::object()}};
    for (const auto& e : entries) index["weight_map"][e.name] = weights_file;
    const std::string index_path = (fs::path(opt.out) / "model.safetensors.index.json").string();
    write_text_file(index_path, index.dump(2) + "\n");
    std::ifstream tf(opt.calibration_text, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(tf)), std::istreambuf_iterator<char>());
    std::vector<int32_t> tokens = Tokenizer::load(opt.in).encode(text, /*add_special_tokens=*/true);
    if (static_cast<int64_t>(tokens.size()) > opt.calibration_tokens)
      tokens.resize(static_cast<size_t>(opt.calibration_tokens));
    if (tokens.size() < 2)
      throw InputError("--calibration-text " + opt.calibration_text + ": fewer than 2 tokens");
    std::vector<std::vector<float>> kmax, vmax;
    calibrate(opt.out, tokens, kmax, vmax);
    const std::string scales_file = "model-00002-of-00002.safetensors";
    std::vector<SafetensorsWriter::Entry> se;
    const bool per_head = opt.kv_scales == "head";
    for (size_t l = 0; l < kmax.size(); ++l)
      for (const char* s : {"k_scale", "v_scale"})
        se.push_back({"model.layers." + std::to_string(l) + ".self_attn." + s, TensorDtype::kF32,
                      per_head ? std::vector<int64_t>{static_cast<int64_t>(kmax[l].size())}
                               : std::vector<int64_t>{}});
    SafetensorsWriter w((fs::path(opt.out) / scales_file).string(), se,
                        {{"format", "pt"}, {"producer", "kvq quantize"}});
    auto scales = [&](const std::vector<float>& mx) {
      std::vector<float> s;
      if (per_head) {
        for (float m : mx) s.push_back(m > 0.0f ? m / kE4m3Max : 1.0f);
      } else {
        const float m = *std::max_element(mx.begin(), mx.end());
        s.push_back(m > 0.0f ? m / kE4m3Max : 1.0f);
      }
      return s;
    };
    size_t i = 0;
    for (size_t l = 0; l < kmax.size(); ++l) {
      const std::vector<float> ks = scales(kmax[l]), vs = scales(vmax[l]);
      w.add(se[i].name, ks.data(), ks.size() * 4);
      index["weight_map"][se[i++].name] = scales_file;
      w.add(se[i].name, vs.data(), vs.size() * 4);
      index["weight_map"][se[i++].name] = scales_file;
    }
    w.finish();
    write_text_file(index_path, index.dump(2) + "\n");
    out_cfg["quantization_config"]["kv_cache_scheme"] = {
        {"type", "float"},
        {"num_bits", 8},
        {"strategy", per_head ? "attn_head" : "tensor"},
        {"dynamic", false},
        {"symmetric", true}};
    write_text_file((fs::path(opt.out) / "config.json").string(), out_cfg.dump(2) + "\n");
    std::fprintf(stderr, "kvq quantize: k/v scales of %zu layers from %zu calibration tokens\n",
                 kmax.size(), tokens.size());
  }
  std::fprintf(stderr, "kvq quantize: wrote %s (%s weights%s)\n", opt.out.c_str(),
               fp8w ? (per_channel ? "FP8 per-channel" : "FP8 per-tensor") : "unchanged",
               kv ? (opt.kv_scales == "head" ? ", fp8 KV with per-head scales"
                                             : ", fp8 KV with per-tensor scales")
                  : "");
  return 0;
}

}  // namespace

Action add_quantize_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "quantize",
      "write an FP8-weight checkpoint (compressed-tensors layout) with calibrated k/v scales");
  auto opt = std::make_shared<Options>();
  sub->add_option("--model", opt->in, "input model folder (F32/F16/BF16 safetensors)")->required();
  sub->add_option("--out", opt->out, "output folder (new or empty)")->required();
  sub->add_option("--weights", opt->weights, "fp8 (default) or none");
  sub->add_option("--weight-scales", opt->weight_scales, "channel (default) or tensor");
  sub->add_option("--kv-cache-dtype", opt->kv,
                  "fp8: declare an fp8 KV cache with calibrated k/v scales; none (default)");
  sub->add_option("--kv-scales", opt->kv_scales, "tensor (default) or head (one per kv head)");
  sub->add_option("--calibration-text", opt->calibration_text, "UTF-8 text for the k/v scales");
  sub->add_option("--calibration-tokens", opt->calibration_tokens,
                  "tokens of the text to use (default 4096)")
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 30));
  return [opt]() { return run_quantize(*opt); };
}

}  // namespace kvq::cli
