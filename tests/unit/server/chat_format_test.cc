// Chat rendering checked against Jinja2's rendering of real templates (chat_goldens.json,
// written by gen_chat_goldens.py), and template detection.
#include "kvq/server/chat_format.h"
#include "support/source_dir.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

namespace kvq {
namespace {

TEST(ChatFormat, RendersLikeJinjaForKnownTemplates) {
  std::ifstream in(::kvq::test::source_dir() + "/tests/unit/server/chat_goldens.json");
  ASSERT_TRUE(in) << "missing tests/unit/server/chat_goldens.json (run gen_chat_goldens.py)";
  const auto goldens = nlohmann::json::parse(in);
  ASSERT_GE(goldens["cases"].size(), 20u);
  for (const auto& c : goldens["cases"]) {
    const std::string name = c["template_name"];
    auto format = detect_chat_format(c["template"].get<std::string>());
    ASSERT_TRUE(format) << name;
    EXPECT_EQ(format->kind, name == "llama3" ? ChatFormatKind::kLlama3 : ChatFormatKind::kChatML)
        << name;
    std::vector<ChatMessage> msgs;
    for (const auto& m : c["messages"]) msgs.push_back({m["role"], m["content"]});
    EXPECT_EQ(render_chat(*format, msgs, c["add_generation_prompt"]),
              c["rendered"].get<std::string>())
        << name << " with " << c["messages"].dump();
  }
}

TEST(ChatFormat, DefaultSystemOnlyFromPlainLiterals) {
  auto qwen = detect_chat_format(
      "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
      "{{- '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}{{ '<|im_start|>' }}");
  ASSERT_TRUE(qwen);
  EXPECT_EQ(qwen->default_system, "Be brief.");
  auto plain = detect_chat_format(
      "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}");
  ASSERT_TRUE(plain);
  EXPECT_EQ(plain->default_system, "");
}

TEST(ChatFormat, UnknownTemplatesAreRefused) {
  EXPECT_FALSE(detect_chat_format(""));
  EXPECT_FALSE(
      detect_chat_format("{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"));
  EXPECT_FALSE(detect_chat_format("<|im_start|> without its end marker"));
  EXPECT_FALSE(detect_chat_format("<|start_header_id|>user<|end_header_id|> but no end of turn"));
  // Random printable noise never contains a full marker set.
  std::random_device rd;
  const unsigned seed = rd();
  std::mt19937 rng(seed);
  for (int t = 0; t < 50; ++t) {
    std::string s(200, ' ');
    for (auto& ch : s) ch = static_cast<char>(32 + rng() % 95);
    EXPECT_FALSE(detect_chat_format(s)) << "seed " << seed << ": " << s;
  }
}

TEST(ChatFormat, EndOfTurnTokens) {
  EXPECT_EQ(end_of_turn_token({ChatFormatKind::kChatML, {}}), "<|im_end|>");
  EXPECT_EQ(end_of_turn_token({ChatFormatKind::kLlama3, {}}), "<|eot_id|>");
}

}  // namespace
}  // namespace kvq
