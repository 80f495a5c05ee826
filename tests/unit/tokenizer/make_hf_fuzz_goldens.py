#!/usr/bin/env python3
"""Recomputes the "results" of hf_fuzz_goldens.json with the Hugging Face tokenizers library.

The file holds small tokenizer.json configurations (or model folders, relative to the repository
root), random texts and random id lists; for each configuration the results are
encode(text, add_special_tokens=False/True).ids and decode(ids, skip_special_tokens=False/True)
(null where the library raised). Run from the repository root:
    python3 tests/unit/tokenizer/make_hf_fuzz_goldens.py
"""
import json
import os

import tokenizers

PATH = os.path.join(os.path.dirname(__file__), "hf_fuzz_goldens.json")

with open(PATH, encoding="utf-8") as f:
    g = json.load(f)
g["tokenizers_version"] = tokenizers.__version__
for name, cfg in g["configs"].items():
    if "tokenizer" in cfg:
        tk = tokenizers.Tokenizer.from_str(json.dumps(cfg["tokenizer"]))
    else:
        tk = tokenizers.Tokenizer.from_file(os.path.join(cfg["model_dir"], "tokenizer.json"))
    r = {"enc": [], "enc_special": [], "dec": [], "dec_skip": []}
    for t in g["texts"]:
        r["enc"].append(tk.encode(t, add_special_tokens=False).ids)
        r["enc_special"].append(tk.encode(t, add_special_tokens=True).ids)
    for ids in g["id_lists"]:
        for key, skip in (("dec", False), ("dec_skip", True)):
            try:
                r[key].append(tk.decode(ids, skip_special_tokens=skip))
            except Exception:
                r[key].append(None)
    g["results"][name] = r
    print(name, "done")
with open(PATH, "w", encoding="utf-8") as f:
    f.write(json.dumps(g, ensure_ascii=True, separators=(",", ":")) + "\n")
