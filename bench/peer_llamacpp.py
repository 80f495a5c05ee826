#!/usr/bin/env python3
"""JSON lines from the output of ../shared/peers/run_llamacpp.sh (llama-batched-bench tables).

Reads the script's stdout on stdin: a line "llama.cpp -ctk KV -ctv KV" before each KV type's
table, whose header names the columns (PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s,
T s, S t/s). Writes one JSON object per table row: engine "llama.cpp", its KV type, batch,
input_len (PP), output_len (TG), decode_tokens_per_s (S_TG), prefill_tokens_per_s (S_PP), and
decode_step_ms (T_TG / TG, one step of the whole batch). Rows it cannot read are skipped with
a note on stderr, so a peer that fails leaves kvq's own tables intact."""
import json
import re
import sys


def main():
    kv, cols = None, None
    for line in sys.stdin:
        line = line.rstrip("\n")
        m = re.match(r"llama\.cpp -ctk (\S+) -ctv (\S+)", line)
        if m:
            kv, cols = m.group(1), None
            continue
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "S_TG t/s" in cells:
            cols = cells
            continue
        if cols is None or kv is None or set("".join(cells)) <= set("-: "):
            continue
        try:
            row = dict(zip(cols, cells))
            tg = int(row["TG"])
            out = {"engine": "llama.cpp", "kv_dtype": kv, "batch": int(row["B"]),
                   "input_len": int(row["PP"]), "output_len": tg,
                   "decode_tokens_per_s": float(row["S_TG t/s"]),
                   "prefill_tokens_per_s": float(row["S_PP t/s"]),
                   "decode_step_ms": 1000.0 * float(row["T_TG s"]) / tg if tg else None}
        except (KeyError, ValueError) as e:
            print(f"peer_llamacpp.py: skipped a row ({e}): {line}", file=sys.stderr)
            continue
        print(json.dumps(out))


if __name__ == "__main__":
    main()
