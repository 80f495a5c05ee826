// The fuzz targets of targets.h.
#include "fuzz/targets.h"

#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kvq/cache/paged_kv_cache.h"
#include "kvq/core/error.h"
#include "kvq/core/json_text.h"
#include "kvq/core/kv_dtype.h"
#include "kvq/io/safetensors.h"
#include "kvq/plan/kv_plan.h"
#include "kvq/plan/model_config.h"
#include "kvq/plan/speculative_config.h"
#include "kvq/server/chat_format.h"
#include "kvq/server/openai_protocol.h"
#include "kvq/tokenizer/tokenizer.h"
#include "model/weight_quant.h"

namespace kvq::fuzz {

namespace {

std::string_view as_text(Input d) {
  return {reinterpret_cast<const char*>(d.data()), d.size()};
}

// A failed invariant: report and abort (libFuzzer saves the input).
[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "kvq fuzz finding: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

// An expected rejection; KVQ_FUZZ_VERBOSE=1 prints it (to see what a corpus exercises).
void rejected(const InputError& e) {
  static const bool verbose = std::getenv("KVQ_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "rejected: %s\n", e.what());
}

// Input bytes as a file the parser can open by path: an anonymous memory file (no disk, no
// leftovers); a file under $TMPDIR where memfd_create is not available.
class InputFile {
 public:
  explicit InputFile(Input d) {
    fd_ = memfd_create("kvq-fuzz", 0);
    if (fd_ >= 0) {
      path_ = "/proc/self/fd/" + std::to_string(fd_);
      write_all(fd_, d);
      return;
    }
    path_ = (std::filesystem::temp_directory_path() /
             ("kvq-fuzz-" + std::to_string(getpid()) + ".safetensors"))
                .string();
    std::ofstream(path_, std::ios::binary)
        .write(reinterpret_cast<const char*>(d.data()), static_cast<std::streamsize>(d.size()));
  }
  ~InputFile() {
    if (fd_ >= 0)
      close(fd_);
    else
      std::filesystem::remove(path_);
  }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  static void write_all(int fd, Input d) {
    size_t done = 0;
    while (done < d.size()) {
      const ssize_t n = write(fd, d.data() + done, d.size() - done);
      if (n <= 0) finding("could not write the input to a memory file");
      done += static_cast<size_t>(n);
    }
  }
  int fd_ = -1;
  std::string path_;
};

// A dtype flag drawn from one byte: none, or any registry entry (auto included).
std::optional<DtypeFlag> dtype_flag(uint8_t b, const char* flag) {
  if (b % (kNumKvDtypes + 1) == 0) return std::nullopt;
  const KvDtypeTraits& t = kKvDtypeTraits[b % (kNumKvDtypes + 1) - 1];
  return DtypeFlag{t.dtype, std::string(flag) + " " + std::string(t.name)};
}

constexpr std::array<std::string_view, 10> kSkipRules = {
    "", "0", "0-2", "sliding_window", "boundary:1", "1,3", "99", "boundary:0", "3-1", "0,0,-1"};

}  // namespace

void safetensors_file(Input data) {
  const InputFile f(data);
  try {
    const SafetensorsFile st = SafetensorsFile::open(f.path());
    for (const TensorInfo& t : st.tensors()) {
      (void)st.find(t.name);
      if (t.numel() <= 4096) {
        try {
          const std::vector<float> v = st.read_floats(t);
          if (static_cast<int64_t>(v.size()) != t.numel())
            finding("read_floats gave " + std::to_string(v.size()) + " values for " +
                    std::to_string(t.numel()) + " elements of " + t.name);
        } catch (const InputError&) {  // not a float dtype
        }
      }
    }
  } catch (const InputError& e) {
    rejected(e);
  }
}

void model_config(Input data) {
  if (data.size() < 4) return;
  const uint8_t* sel = data.data();
  try {
    const nlohmann::json j = parse_json_text(as_text(data.subspan(4)), "fuzz/config.json");
    // The weight quantization first: a config whose weights kvq refuses may still plan.
    try {
      const model::WeightQuantization wq = model::parse_weight_quantization(
          j, nlohmann::json(), "fuzz/config.json", "fuzz/hf_quant_config.json");
      for (const char* name : {"lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
                               "model.layers.12.mlp.down_proj.weight"})
        (void)wq.quantizes(name);
    } catch (const InputError& e) {
      rejected(e);
    }
    const ModelConfig config = parse_model_config(j, "fuzz/config.json");
    (void)read_checkpoint_kv_scheme(config);
    KvPlanOptions o;
    o.kv = dtype_flag(sel[0], "--kv-cache-dtype");
    o.k = dtype_flag(sel[1], "-ctk");
    o.v = dtype_flag(sel[2], "-ctv");
    o.skip_layers = std::string(kSkipRules[sel[3] % kSkipRules.size()]);
    o.block_tokens = std::array<int, 4>{16, 32, 8, 0}[(sel[3] / 16) % 4];
    const KvPlan plan = make_kv_plan(config, o);
    if (plan.layers.size() != plan.decisions.size())
      finding("a plan with " + std::to_string(plan.layers.size()) + " layers and " +
              std::to_string(plan.decisions.size()) + " decisions");
    for (const LayerKvSpec& s : plan.layers)
      if (!traits(s.k_dtype).concrete || !traits(s.v_dtype).concrete)
        finding("a planned layer is left auto");
    (void)kv_plan_to_json(plan).dump();
    (void)format_kv_plan(plan);
    (void)summarize_kv_plan(plan);
  } catch (const InputError& e) {
    rejected(e);
  }
}

void tokenizer(Input data) {
  if (data.empty()) return;
  if (data[0] % 2 == 1) {
    // Text through the default model's tokenizer ($KVQ_FUZZ_TOKENIZER: its tokenizer.json).
    static const std::unique_ptr<const Tokenizer> tok = []() -> std::unique_ptr<const Tokenizer> {
      const char* path = std::getenv("KVQ_FUZZ_TOKENIZER");
      if (path == nullptr) return nullptr;
      std::ifstream f(path, std::ios::binary);
      const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      return std::make_unique<const Tokenizer>(Tokenizer::from_json(text, path));
    }();
    if (tok != nullptr) {
      const std::string_view text = as_text(data.subspan(1));
      const std::vector<int32_t> ids = tok->encode(text, false);
      const std::string back = tok->decode(ids, false);
      // Byte-level BPE without a normalizer loses nothing: valid UTF-8 comes back as it was.
      const std::string valid = nlohmann::json(std::string(text))
                                    .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      const bool is_utf8 = nlohmann::json::parse(valid).get<std::string>() == text;
      if (is_utf8 && back != text)
        finding("decode(encode(text)) differs from the text (" + std::to_string(text.size()) +
                " bytes in, " + std::to_string(back.size()) + " out)");
      return;
    }
  }
  try {
    const Tokenizer tok = Tokenizer::from_json(as_text(data.subspan(1)), "fuzz/tokenizer.json");
    static constexpr std::string_view kSample =
        "def f(x):\n    return x  # caf\xc3\xa9 \xe2\x82\xac\n<|endoftext|> \xff end";
    const std::vector<int32_t> ids = tok.encode(kSample, true);
    (void)tok.decode(ids, false);
    (void)tok.decode(ids, true);
    // Arbitrary ids, in range or not.
    std::vector<int32_t> raw;
    for (size_t i = 1; i + 4 <= data.size() && raw.size() < 64; i += 4) {
      int32_t v = 0;
      std::memcpy(&v, data.data() + i, 4);
      raw.push_back(v);
    }
    (void)tok.decode(raw, false);
  } catch (const InputError& e) {
    rejected(e);
  }
}

void openai_request(Input data) {
  if (data.empty()) return;
  try {
    const nlohmann::json body = parse_json_body(as_text(data.subspan(1)));
    if (data[0] % 2 == 0) {
      (void)parse_completion_request(body);
      return;
    }
    const GenerationRequest r = parse_chat_request(body);
    for (std::string_view tmpl :
         {"{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}",
          "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"}) {
      const std::optional<ChatFormat> format = detect_chat_format(tmpl);
      if (!format.has_value()) finding("a known chat template was not recognised");
      (void)render_chat(*format, r.messages, data[0] % 4 == 1);
    }
  } catch (const InputError& e) {
    rejected(e);
  }
}

void flags(Input data) {
  if (data.empty()) return;
  const std::string_view text = as_text(data.subspan(1));
  try {
    switch (data[0] % 4) {
      case 0:
        (void)parse_kv_dtype(text);
        (void)parse_kv_dtype_or_throw(text, "--kv-cache-dtype");
        break;
      case 1: {
        ModelConfig c;
        c.num_layers = 1 + data[0] / 4 % 40;
        c.sliding_window = 64;
        c.layer_attention.assign(static_cast<size_t>(c.num_layers), AttentionKind::kCausal);
        for (size_t i = 0; i < c.layer_attention.size(); i += 2)
          c.layer_attention[i] = AttentionKind::kSlidingWindow;
        const std::vector<bool> skip = parse_skip_layers(text, c);
        if (skip.size() != static_cast<size_t>(c.num_layers))
          finding("parse_skip_layers gave " + std::to_string(skip.size()) + " flags for " +
                  std::to_string(c.num_layers) + " layers");
        break;
      }
      case 2:
        (void)parse_byte_size(text, "--kv-cache-memory");
        break;
      default: {
        const SpeculativeConfig sc = parse_speculative_config(text);
        if (sc.num_speculative_tokens < 1 || sc.num_speculative_tokens > kMaxSpeculativeTokens)
          finding("num_speculative_tokens " + std::to_string(sc.num_speculative_tokens) +
                  " accepted");
        (void)drafter_plan_options(KvPlanOptions{}, sc);
        break;
      }
    }
  } catch (const InputError& e) {
    rejected(e);
  }
}

std::span<const Target> targets() {
  static constexpr std::array<Target, 5> kTargets = {{{"safetensors", safetensors_file},
                                                      {"model_config", model_config},
                                                      {"tokenizer", tokenizer},
                                                      {"openai_request", openai_request},
                                                      {"flags", flags}}};
  return kTargets;
}

}  // namespace kvq::fuzz
