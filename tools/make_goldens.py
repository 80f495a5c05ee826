#!/usr/bin/env python3
"""Write Hugging Face reference outputs ("goldens") that kvq's tests compare with.

For each model (kvq-code-tiny and stories260K):
  tests/fixtures/goldens/tokenizer_<model>.json  ids of tokenizers.Tokenizer.from_file(tokenizer.json)
      for the texts of tests/fixtures/tokenizer_texts.json, with and without special tokens, and decodes
  tests/fixtures/goldens/model_<model>.json      index: prompts, logits files, greedy continuations
  tests/fixtures/goldens/logits_<model>_<prompt>.bin  float32 little-endian, row-major [positions, vocab]

Logits and greedy tokens come from transformers in float32 on the CPU (weights upcast with model.float(),
attn_implementation="eager", no KV cache: the whole sequence is recomputed at every step), so they are the
plain-arithmetic reference. Greedy decoding never stops at EOS.

Needs torch, transformers, tokenizers. Usage:
    python3 tools/make_goldens.py --code-model models/kvq-code-tiny --stories ../shared/models/stories260K
"""

import argparse
import hashlib
import json
import os
import sys
import time

STORIES_BOS_TEXT = "Once upon a time, there was a little girl named Lily."
# From ../shared/models/stories260K/README.md (checked there against llama2.c's own forward pass).
STORIES_BOS_40 = [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337,
                  410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352]

STORY_TEXT = (
    "Once upon a time, there was a little boy named Tim. Tim had a red ball. He liked to play with his ball "
    "every day in the big green park near his house. One day, Tim saw a small cat under a tree. The cat was "
    "sad because it could not find its mom. Tim wanted to help the cat. He said, \"Do not be sad, little cat. "
    "I will help you find your mom.\" Tim and the cat walked around the park. They looked under the slide and "
    "behind the swings. They asked a bird and a dog, but nobody knew where the mom was. Then Tim heard a soft "
    "sound. \"Meow!\" It was the mom cat! She was happy to see her baby. The little cat ran to her mom and they "
    "hugged. Tim smiled. He felt good because he helped his new friend. The mom cat said thank you to Tim. "
    "From that day on, Tim and the cats played together in the park. They played with the red ball and ran "
    "in the sun. Tim's mom came to the park too. She saw Tim and the cats and laughed. \"You have new "
    "friends!\" she said. Tim nodded and hugged his mom. When the sun went down, they all went home. Tim went "
    "to bed and dreamed about the cats and his red ball. The next morning, Tim woke up early. He ate his "
    "breakfast and ran to the park again. The cats were there, waiting for him under the big tree."
)

CODE_P20_TEXT = ("import os\nimport sys\n\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n"
                 "        print(name)\n")
STORY_P20_TEXT = "Lily went to the park with her mom. She saw a big dog and a little bird in the tree."

LONG_LEN = 300          # longer than kvq-code-tiny's sliding window (256)
LONG_POSITIONS = list(range(248, 264)) + list(range(284, 300))  # across and past the window edge


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def weights_dtype(path):
    """dtype of the first tensor in model.safetensors, from its JSON header."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    dtypes = sorted({v["dtype"] for k, v in header.items() if k != "__metadata__"})
    return ",".join(dtypes)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--code-model", default="models/kvq-code-tiny")
    ap.add_argument("--code-model-ref", default="models/kvq-code-tiny",
                    help="path recorded in the index (relative to the repository root)")
    ap.add_argument("--stories", default="../shared/models/stories260K")
    ap.add_argument("--stories-ref", default="../shared/models/stories260K")
    ap.add_argument("--texts", default="tests/fixtures/tokenizer_texts.json")
    ap.add_argument("--out", default="tests/fixtures/goldens")
    ap.add_argument("--greedy-tokens", type=int, default=64)
    args = ap.parse_args()

    import torch
    import tokenizers
    import transformers

    torch.set_num_threads(min(16, os.cpu_count() or 1))
    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    with open(args.texts, encoding="utf-8") as f:
        texts = json.load(f)["texts"]
    print(f"[env] torch={torch.__version__} transformers={transformers.__version__} tokenizers={tokenizers.__version__}")
    failures = []

    models = [
        {"name": "kvq-code-tiny", "path": args.code_model, "ref": args.code_model_ref,
         "short": "def fibonacci(n):", "p20": CODE_P20_TEXT},
        {"name": "stories260K", "path": args.stories, "ref": args.stories_ref,
         "short": "Once upon a time", "p20": STORY_P20_TEXT},
    ]
    for m in models:
        name, path = m["name"], m["path"]
        if not os.path.exists(os.path.join(path, "model.safetensors")):
            print(f"[skip] {name}: no model.safetensors under {path}")
            failures.append(f"{name}: missing")
            continue
        t0 = time.time()
        tk = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))

        # ---- tokenizer goldens ----
        cases = []
        for t in texts:
            e0 = tk.encode(t["text"], add_special_tokens=False)
            e1 = tk.encode(t["text"], add_special_tokens=True)
            cases.append({"name": t["name"], "text": t["text"], "ids": e0.ids, "ids_with_special": e1.ids,
                          "tokens": e0.tokens,
                          "decoded": tk.decode(e0.ids, skip_special_tokens=False),
                          "decoded_skip_special": tk.decode(e0.ids, skip_special_tokens=True)})
        tok_doc = {
            "tokenizer": m["ref"] + "/tokenizer.json",
            "tokenizer_sha256": sha256_file(os.path.join(path, "tokenizer.json")),
            "tokenizers_version": tokenizers.__version__,
            "how": ("tokenizers.Tokenizer.from_file(tokenizer.json); ids = encode(text, add_special_tokens=False).ids; "
                    "ids_with_special = encode(text, add_special_tokens=True).ids; decoded = decode(ids, "
                    "skip_special_tokens=False); decoded_skip_special = decode(ids) (the library's default)"),
            "cases": cases,
        }
        tpath = os.path.join(args.out, f"tokenizer_{name}.json")
        with open(tpath, "w", encoding="utf-8") as f:
            json.dump(tok_doc, f, indent=1, ensure_ascii=True)
            f.write("\n")
        rt = sum(c["decoded"] == c["text"] for c in cases)
        print(f"[tok] {name}: {len(cases)} cases, exact round trip for {rt}; "
              f"e.g. {cases[2]['name']}: {cases[2]['ids'][:16]}...")

        # ---- model ----
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager").float().eval()
        sdpa = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa").float().eval()
        cfg = model.config
        bos = cfg.bos_token_id
        vocab = cfg.vocab_size
        print(f"[model] {name}: {type(model).__name__} vocab={vocab} bos={bos} "
              f"layer_types={getattr(cfg, 'layer_types', None)} sliding_window={getattr(cfg, 'sliding_window', None)}")

        def enc(text, n=None):
            ids = tk.encode(text, add_special_tokens=True).ids
            if ids[0] != bos:  # both tokenizers prepend BOS; keep the prompts uniform if one ever does not
                ids = [bos] + ids
            return ids[:n] if n else ids

        if name == "kvq-code-tiny":
            with open(os.path.join(path, "heldout.txt"), encoding="utf-8") as f:
                long_ids = enc(f.read(), LONG_LEN)
        else:
            long_ids = enc(STORY_TEXT, LONG_LEN)
        assert len(long_ids) == LONG_LEN, f"long prompt has {len(long_ids)} tokens"
        prompts = [
            ("bos", [bos], None),
            ("short", enc(m["short"]), None),
            ("p20", enc(m["p20"], 20), None),
            ("long", long_ids, LONG_POSITIONS),
        ]

        @torch.no_grad()
        def logits_of(mdl, ids):
            return mdl(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()

        logit_entries = []
        for pname, ids, positions in prompts:
            full = logits_of(model, ids)
            pos = positions if positions is not None else list(range(min(16, len(ids))))
            rows = full[pos].contiguous()
            fname = f"logits_{name}_{pname}.bin"
            with open(os.path.join(args.out, fname), "wb") as f:
                f.write(rows.numpy().astype("<f4").tobytes())
            sd = (logits_of(sdpa, ids) - full).abs().max().item()
            top2 = rows.topk(2, dim=-1)
            logit_entries.append({
                "name": pname, "file": fname, "prompt_ids": ids, "prompt_text": tk.decode(ids, skip_special_tokens=False),
                "positions": pos, "shape": [len(pos), vocab], "dtype": "float32", "byte_order": "little",
                "argmax": top2.indices[:, 0].tolist(),
                "min_top1_top2_margin": float((top2.values[:, 0] - top2.values[:, 1]).min()),
                "max_abs_logit": float(rows.abs().max()),
                "sdpa_vs_eager_max_abs_diff": sd,
            })
            print(f"[logits] {name}/{pname}: {len(ids)} tokens, rows {len(pos)}, sdpa-vs-eager {sd:.2e}")

        @torch.no_grad()
        def greedy(ids, n):
            x = list(ids)
            gen, margins, top1 = [], [], []
            for _ in range(n):
                last = logits_of(model, x)[-1]
                v, i = last.topk(2)
                gen.append(int(i[0]))
                margins.append(round(float(v[0] - v[1]), 6))
                top1.append(round(float(v[0]), 6))
                x.append(int(i[0]))
            return gen, margins, top1

        greedy_entries = []
        runs = [("bos", [bos], args.greedy_tokens), ("short", enc(m["short"]), args.greedy_tokens)]
        if name == "kvq-code-tiny":
            runs.append(("long", long_ids, 32))  # decoding past the sliding window
        for gname, ids, n in runs:
            gen, margins, top1 = greedy(ids, n)
            entry = {"name": gname, "prompt_ids": ids, "ids": gen,
                     "text": tk.decode(gen, skip_special_tokens=False),
                     "full_text": tk.decode(ids + gen, skip_special_tokens=True),
                     "top1_logits": top1, "top1_top2_margins": margins, "min_margin": min(margins)}
            greedy_entries.append(entry)
            print(f"[greedy] {name}/{gname} ({len(ids)}-token prompt, {n} tokens, min margin {min(margins):.4f}):\n"
                  f"{entry['full_text'] if gname != 'long' else entry['text']}\n[greedy] ----")
            if name == "stories260K" and gname == "bos":
                if n >= 20 and not entry["text"].startswith(STORIES_BOS_TEXT):
                    failures.append(f"stories260K from BOS gave {entry['text'][:80]!r}")
                if gen[:40] != STORIES_BOS_40[:len(gen)]:
                    failures.append(f"stories260K first ids differ from its README: {gen[:40]}")
                else:
                    print(f"[check] stories260K from BOS matches its README's ids and begins {STORIES_BOS_TEXT!r}")

        index = {
            "model": name,
            "model_path": m["ref"],
            "files_sha256": {f: sha256_file(os.path.join(path, f))
                             for f in ("model.safetensors", "config.json", "tokenizer.json")},
            "weights_dtype": weights_dtype(os.path.join(path, "model.safetensors")),
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "compute": ("float32 on CPU: from_pretrained(dtype=float32, attn_implementation='eager').float(); "
                        "forward over the whole sequence with use_cache=False"),
            "greedy_rule": "argmax of the last position's logits, whole sequence recomputed each step, no EOS stop",
            "logits": logit_entries,
            "greedy": greedy_entries,
        }
        if name == "kvq-code-tiny":
            index["sliding_window_check"] = sliding_semantics(torch, transformers)
            print(f"[check] {index['sliding_window_check']}")
        with open(os.path.join(args.out, f"model_{name}.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=1, ensure_ascii=True)
            f.write("\n")
        print(f"[done] {name} in {time.time()-t0:.1f}s")

    total = 0
    for fn in sorted(os.listdir(args.out)):
        sz = os.path.getsize(os.path.join(args.out, fn))
        total += sz
        print(f"[files] {fn} {sz:,}")
    print(f"[files] total {total:,} bytes")
    if failures:
        print("[FAIL] " + "; ".join(failures))
        sys.exit(1)


def sliding_semantics(torch, transformers):
    """One sliding layer with window W: which earlier positions change the
    output at q? Tells kvq exactly how transformers counts the window."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_default_model import make_qwen3_config

    W, q = 4, 10
    cfg = make_qwen3_config(
        transformers, vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
        tie_word_embeddings=False, use_sliding_window=True, sliding_window=W,
        layer_types=["sliding_attention"], rope_theta=10000.0)
    result = {}
    for impl in ("eager", "sdpa"):
        torch.manual_seed(0)
        try:
            mdl = transformers.Qwen3ForCausalLM._from_config(cfg, attn_implementation=impl)
        except TypeError:
            cfg._attn_implementation = impl
            mdl = transformers.Qwen3ForCausalLM(cfg)
        mdl = mdl.float().eval()
        print(f"[check] sliding probe model attn={mdl.config._attn_implementation}")
        x = torch.randint(0, 32, (1, q + 2))
        with torch.no_grad():
            base = mdl(input_ids=x, use_cache=False).logits[0, q]
            seen = []
            for k in range(q + 1):
                y = x.clone()
                y[0, k] = (y[0, k] + 1) % 32
                if (mdl(input_ids=y, use_cache=False).logits[0, q] - base).abs().max().item() > 1e-6:
                    seen.append(k)
        result[impl] = seen
    want = list(range(q - W + 1, q + 1))
    ok = result["eager"] == want and result["sdpa"] == want
    return {"window": W, "query": q, "key_positions_that_matter": result,
            "conclusion": (f"query q attends keys q-{W}+1..q (W keys including itself)" if ok
                           else f"UNEXPECTED: expected {want}")}


if __name__ == "__main__":
    main()
