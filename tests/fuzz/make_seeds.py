#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/targets.h) under tests/fuzz/corpus/.

Run from the repository root: python3 tests/fuzz/make_seeds.py. The seeds are small, valid (and
a few nearly valid) inputs built from the repository's own fixtures and models; regression
inputs found by fuzzing go beside them as regress-*.bin and are not rewritten by this script.
"""
import json
import os
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def write(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def safetensors(tensors, metadata=None, declared=None):
    """tensors: [(name, dtype, shape, bytes)] laid out back to back."""
    header, blob, off = {}, b"", 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        blob += data
        off += len(data)
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    n = len(text) if declared is None else declared
    return struct.pack("<Q", n) + text + blob


def f32(*vals):
    return struct.pack("<%df" % len(vals), *vals)


def main():
    # ---- safetensors ----
    write("safetensors", "two_f32.safetensors",
          safetensors([("a", "F32", [2, 2], f32(1, 2, 3, 4)), ("b.k_scale", "F32", [], f32(0.5))]))
    write("safetensors", "mixed_dtypes.safetensors",
          safetensors([("w", "BF16", [4], b"\x80\x3f" * 4), ("h", "F16", [2], b"\x00\x3c" * 2),
                       ("q", "F8_E4M3", [8], bytes(range(8))), ("i", "I64", [1], b"\x01" + b"\x00" * 7),
                       ("d", "F64", [1], struct.pack("<d", 2.5))],
                      metadata={"format": "pt"}))
    write("safetensors", "empty_table.safetensors", safetensors([], metadata={}))
    write("safetensors", "truncated.safetensors",
          safetensors([("a", "F32", [3], f32(1, 2, 3))])[:-5])
    write("safetensors", "bad_length.safetensors",
          safetensors([("a", "F32", [1], f32(1))], declared=1 << 40))
    # ---- model_config: 4 selector bytes (kv, k, v, skip rule / block size) + config.json ----
    with open("models/kvq-code-tiny/config.json", "rb") as f:
        tiny = f.read()
    write("model_config", "tiny_default.bin", b"\x00\x00\x00\x00" + tiny)
    write("model_config", "tiny_fp8_skip.bin", b"\x05\x00\x00\x03" + tiny)
    write("model_config", "tiny_ctk_ctv.bin", b"\x00\x07\x09\x14" + tiny)
    with open("models/kvq-code-tiny-dflash/config.json", "rb") as f:
        write("model_config", "dflash.bin", b"\x05\x00\x00\x00" + f.read())
    llama = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "intermediate_size": 1024, "vocab_size": 1000, "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "tensor",
                                "dynamic": False, "symmetric": True}}}
    write("model_config", "llama_ct_kv.bin", b"\x01\x00\x00\x04" + json.dumps(llama).encode())
    mistral = {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 256,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 512, "vocab_size": 300, "max_position_embeddings": 1024,
        "torch_dtype": "float16", "sliding_window": 128,
        "quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"}}
    write("model_config", "mistral_modelopt.bin", b"\x00\x08\x00\x02" + json.dumps(mistral).encode())
    # FP8 weights as compressed-tensors publishes them (config_groups, ignore with re: patterns).
    fp8w = dict(llama)
    fp8w["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "dynamic": False,
                        "symmetric": True},
            "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                                  "dynamic": True}}},
        "ignore": ["lm_head", "re:.*mlp\\.down_proj", "re:model\\.layers\\.1.\\..*"],
        "kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "tensor",
                            "dynamic": False, "symmetric": True}}
    write("model_config", "llama_ct_fp8_weights.bin", b"\x00\x00\x00\x00" + json.dumps(fp8w).encode())
    # ---- tokenizer: byte 0 even + tokenizer.json, or byte 0 odd + text ----
    with open("models/kvq-code-tiny/tokenizer.json") as f:
        tok = json.load(f)
    small = dict(tok)
    model = dict(tok["model"])
    vocab = {k: v for k, v in tok["model"]["vocab"].items() if v < 320}
    model["vocab"] = vocab
    def parts(m):
        return m.split(" ") if isinstance(m, str) else m
    model["merges"] = [m for m in tok["model"]["merges"][:400]
                       if all(p in vocab for p in parts(m)) and "".join(parts(m)) in vocab]
    small["model"] = model
    write("tokenizer", "bytelevel_small.json", b"\x00" + json.dumps(small).encode())
    sp = {
        "version": "1.0", "added_tokens": [
            {"id": 0, "content": "<unk>", "special": True, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False},
            {"id": 1, "content": "<s>", "special": True, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False}],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True, "byte_fallback": True,
                  "vocab": dict({"<unk>": 0, "<s>": 1}, **{"<0x%02X>" % b: 2 + b for b in range(256)},
                                **{"\u2581": 258, "a": 259, "b": 260, "\u2581a": 261, "ab": 262}),
                  "merges": ["\u2581 a", "a b"]}}
    write("tokenizer", "sentencepiece_small.json", b"\x00" + json.dumps(sp).encode())
    write("tokenizer", "text_code.bin", b"\x01import os\n\ndef main(argv):\n    return 0  # done\n")
    write("tokenizer", "text_unicode.bin",
          b"\x03caf\xc3\xa9 \xe2\x82\xac 100 \xf0\x9f\x98\x80 <|endoftext|> <|im_start|>user\n")
    write("tokenizer", "text_invalid_utf8.bin", b"\x05abc\xff\xfe\xc3(def\xed\xa0\x80")
    # ---- openai_request: byte 0 even = /v1/completions, odd = /v1/chat/completions ----
    reqs = [
        (0, {"model": "m", "prompt": "def f(", "max_tokens": 16, "temperature": 0}),
        (0, {"prompt": [1, 2, 3], "max_tokens": 4, "stop": ["\n", "}"], "logprobs": 2, "n": 2,
             "seed": 7, "top_p": 0.9, "top_k": 20, "min_p": 0.05}),
        (2, {"prompt": "x", "stream": True, "stream_options": {"include_usage": True},
             "echo": False, "presence_penalty": 0.0}),
        (1, {"messages": [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "hi"}], "max_completion_tokens": 8,
             "logprobs": True, "top_logprobs": 3}),
        (3, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
             "stop": "END", "temperature": 0.7, "add_generation_prompt": False}),
    ]
    for i, (sel, body) in enumerate(reqs):
        write("openai_request", "req%d.bin" % i, bytes([sel]) + json.dumps(body).encode())
    # ---- flags: byte 0 % 4 selects dtype name / skip layers / byte size / speculative config ----
    for i, t in enumerate(["fp8", "bfloat16", "int4_per_token_head", "FP8_E4M3", "auto"]):
        write("flags", "dtype%d.bin" % i, bytes([0]) + t.encode())
    for i, t in enumerate(["0,2-4", "sliding_window", "boundary:2", "0-3,5"]):
        write("flags", "skip%d.bin" % i, bytes([1 + 4 * (8 + i)]) + t.encode())
    for i, t in enumerate(["4GiB", "1.5 GB", "123", "64KiB"]):
        write("flags", "bytes%d.bin" % i, bytes([2]) + t.encode())
    for i, t in enumerate([
            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}',
            '{"method": "dflash", "model": "m", "num_speculative_tokens": 8, "kv_cache_dtype": "fp8"}',
            '{"method": "draft_model", "model": "d", "num_speculative_tokens": 2, '
            '"kv_cache_dtype_skip_layers": "0", "disable_by_batch_size": 8, "auto_disable": true}']):
        write("flags", "spec%d.bin" % i, bytes([3]) + t.encode())


if __name__ == "__main__":
    main()
