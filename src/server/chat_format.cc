#include "kvq/server/chat_format.h"

namespace kvq {

namespace {

constexpr std::string_view kImStart = "<|im_start|>";
constexpr std::string_view kImEnd = "<|im_end|>";
constexpr std::string_view kStartHeader = "<|start_header_id|>";
constexpr std::string_view kEndHeader = "<|end_header_id|>";
constexpr std::string_view kEotId = "<|eot_id|>";
constexpr std::string_view kBeginOfText = "<|begin_of_text|>";

bool contains(std::string_view s, std::string_view what) {
  return s.find(what) != std::string_view::npos;
}

// Jinja's `trim` (Python's str.strip() on the whitespace that occurs in chat text).
std::string_view trim(std::string_view s) {
  constexpr std::string_view ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

// A literal default system message inside the template source, e.g. Qwen2.5's
// '<|im_start|>system\nYou are Qwen, ...<|im_end|>\n' (the newline is the two characters \n of
// a Jinja string literal). Only plain text is taken: anything that looks like template code
// means it is not a literal.
std::string chatml_default_system(std::string_view tpl) {
  constexpr std::string_view head = "<|im_start|>system\\n";
  for (size_t at = tpl.find(head); at != std::string_view::npos; at = tpl.find(head, at + 1)) {
    const size_t begin = at + head.size();
    const size_t end = tpl.find(kImEnd, begin);
    if (end == std::string_view::npos) break;
    std::string_view text = tpl.substr(begin, end - begin);
    if (text.empty() || text.find_first_of("'\"{}\\") != std::string_view::npos) continue;
    return std::string(text);
  }
  return {};
}

}  // namespace

std::optional<ChatFormat> detect_chat_format(std::string_view tpl) {
  if (contains(tpl, kImStart) && contains(tpl, kImEnd))
    return ChatFormat{ChatFormatKind::kChatML, chatml_default_system(tpl)};
  if (contains(tpl, kStartHeader) && contains(tpl, kEndHeader) && contains(tpl, kEotId))
    return ChatFormat{ChatFormatKind::kLlama3, {}};
  return std::nullopt;
}

std::string render_chat(const ChatFormat& format, std::span<const ChatMessage> messages,
                        bool add_generation_prompt) {
  std::string out;
  if (format.kind == ChatFormatKind::kChatML) {
    auto turn = [&](std::string_view role, std::string_view content) {
      out.append(kImStart).append(role).append("\n").append(content).append(kImEnd).append("\n");
    };
    const bool has_system = !messages.empty() && messages.front().role == "system";
    if (!has_system && !format.default_system.empty()) turn("system", format.default_system);
    for (const auto& m : messages) turn(m.role, m.content);
    if (add_generation_prompt) out.append(kImStart).append("assistant\n");
    return out;
  }
  // Llama-3 Instruct: BOS, then each turn with its content trimmed (the template's `| trim`).
  out.append(kBeginOfText);
  for (const auto& m : messages)
    out.append(kStartHeader)
        .append(m.role)
        .append(kEndHeader)
        .append("\n\n")
        .append(trim(m.content))
        .append(kEotId);
  if (add_generation_prompt)
    out.append(kStartHeader).append("assistant").append(kEndHeader).append("\n\n");
  return out;
}

std::string_view end_of_turn_token(const ChatFormat& format) {
  return format.kind == ChatFormatKind::kChatML ? kImEnd : kEotId;
}

}  // namespace kvq
