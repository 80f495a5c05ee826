// Chat prompts from a model's chat_template, for the templates kvq recognises by their marker
// strings (ChatML and Llama-3). kvq never runs Jinja: a template it does not recognise means
// chat is not available for that model.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvq {

struct ChatMessage {
  std::string role;  // system, developer, user, assistant, tool
  std::string content;
};

enum class ChatFormatKind : uint8_t { kChatML, kLlama3 };

struct ChatFormat {
  ChatFormatKind kind = ChatFormatKind::kChatML;
  // ChatML templates of some models (Qwen2, Qwen2.5) add a system message when the
  // conversation has none; empty when the template has no such default.
  std::string default_system;
};

constexpr std::string_view to_string(ChatFormatKind k) {
  return k == ChatFormatKind::kChatML ? "chatml" : "llama3";
}

// Recognises the template by its marker strings; nullopt when it is empty or unknown.
std::optional<ChatFormat> detect_chat_format(std::string_view chat_template);

// The prompt text, as the recognised template renders it (special tokens spelled out, to be
// encoded without adding special tokens). add_generation_prompt: end with the assistant header.
std::string render_chat(const ChatFormat& format, std::span<const ChatMessage> messages,
                        bool add_generation_prompt = true);

// The token text that ends an assistant turn (<|im_end|> / <|eot_id|>), to stop generation on.
std::string_view end_of_turn_token(const ChatFormat& format);

}  // namespace kvq
