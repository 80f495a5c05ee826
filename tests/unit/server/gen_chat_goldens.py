#!/usr/bin/env python3
"""Renders conversations with real chat templates through Jinja2 (the oracle kvq's
marker-based ChatML / Llama-3 rendering is checked against) and writes chat_goldens.json.

Templates: the one in models/kvq-code-tiny/tokenizer_config.json (ChatML), Meta-Llama-3-8B-Instruct's,
and the non-tool branch of Qwen2.5-Instruct's (ChatML with a default system message).
Run: python3 tests/unit/server/gen_chat_goldens.py   (needs jinja2)
"""
import json
import os

import jinja2

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", "..", ".."))

with open(os.path.join(ROOT, "models", "kvq-code-tiny", "tokenizer_config.json")) as f:
    TINY = json.load(f)["chat_template"]

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ "
    "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role == \"assistant\") %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

CONVERSATIONS = [
    [{"role": "user", "content": "def add(a, b):"}],
    [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}],
    [
        {"role": "system", "content": "  padded system \n"},
        {"role": "user", "content": "\n\nfirst question\t "},
        {"role": "assistant", "content": " an answer with  inner  spaces "},
        {"role": "user", "content": "caf\u00e9 \u2014 \u65e5\u672c\u8a9e \U0001F600"},
    ],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "<|im_start|> literal markers <|eot_id|> in text"}],
]


def main():
    env = jinja2.Environment()
    cases = []
    for name, tpl, bos in [("kvq-code-tiny", TINY, "<|endoftext|>"), ("llama3", LLAMA3, "<|begin_of_text|>"),
                           ("qwen2.5", QWEN25, "<|endoftext|>")]:
        t = env.from_string(tpl)
        for conv in CONVERSATIONS:
            for agp in (True, False):
                cases.append({"template_name": name, "template": tpl, "messages": conv, "add_generation_prompt": agp,
                              "rendered": t.render(messages=conv, add_generation_prompt=agp, bos_token=bos)})
    out = {"generator": "tests/unit/server/gen_chat_goldens.py", "jinja2": jinja2.__version__, "cases": cases}
    with open(os.path.join(HERE, "chat_goldens.json"), "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
