#!/usr/bin/env python3
"""Markdown tables from bench/run_e2e_bench.sh's JSON lines (one `kvq bench --json` per line)."""
import json
import re
import sys


def dtype_of(row):
    if "kv_dtype" in row:
        return row["kv_dtype"]
    m = re.match(r"(\S+) x\d+", row["plan"])
    return m.group(1) if m else row["plan"]


# kvq's KV dtypes beside the llama.cpp cache type of the same width.
PEER_PAIRS = [("f16", ["bfloat16"]), ("q8_0", ["fp8_e4m3", "int8_per_token_head"]),
              ("q4_0", ["int4_per_token_head"])]


def peer_table(rows, peers):
    """kvq beside llama.cpp (rows of bench/peer_llamacpp.py) at the points both ran."""
    kvq = {(dtype_of(r), r["input_len"], r["batch"]): r for r in rows if "error" not in r}
    lc = {(r["kv_dtype"], r["input_len"], r["batch"]): r for r in peers}
    points = sorted({(c, b) for (_, c, b) in lc})
    head, cols = [], []
    for ptype, ours in PEER_PAIRS:
        if not any(k[0] == ptype for k in lc):
            continue
        head.append("llama.cpp %s" % ptype)
        cols.append(("peer", ptype))
        for d in ours:
            head.append("kvq %s (/ llama.cpp)" % d)
            cols.append(("kvq", d, ptype))
    print("Side by side with llama.cpp (same device call): decode tokens/s")
    print()
    print("| context | batch | " + " | ".join(head) + " |")
    print("|---|---|" + "---|" * len(head))
    for c, b in points:
        cells = []
        for col in cols:
            if col[0] == "peer":
                r = lc.get((col[1], c, b))
                cells.append("%.1f" % r["decode_tokens_per_s"] if r else "-")
            else:
                r, p = kvq.get((col[1], c, b)), lc.get((col[2], c, b))
                if r is None:
                    cells.append("-")
                elif p is None:
                    cells.append("%.1f" % r["decode_tokens_per_s"])
                else:
                    cells.append("%.1f (%.2fx)" % (r["decode_tokens_per_s"],
                                                   r["decode_tokens_per_s"] / p["decode_tokens_per_s"]))
        print("| %d | %d | %s |" % (c, b, " | ".join(cells)))
    print()


def main(path):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    peers = [r for r in rows if r.get("engine") == "llama.cpp"]
    rows = [r for r in rows if r.get("engine", "kvq") == "kvq"]
    if peers:
        peer_table(rows, peers)
    dtypes = []
    for r in rows:
        d = dtype_of(r)
        if d not in dtypes:
            dtypes.append(d)
    ctxs = sorted({r["input_len"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    by = {(dtype_of(r), r["input_len"], r["batch"]): r for r in rows}
    print("Decode tokens/s (ms per step; step / floor), prefill of one sequence in tokens/s")
    print()
    print("| context | batch | " + " | ".join(dtypes) + " |")
    print("|---|---|" + "---|" * len(dtypes))
    for c in ctxs:
        for b in batches:
            cells = []
            for d in dtypes:
                r = by.get((d, c, b))
                if r is None:
                    cells.append("-")
                elif "error" in r:
                    cells.append("does not fit" if "at most" in r["error"] else "error")
                else:
                    floor = r["decode_floor_ms"]
                    ratio = r["decode_step_ms_median"] / floor if floor else 0
                    cells.append("%.0f (%.2f ms; %.2fx)" % (r["decode_tokens_per_s"],
                                                           r["decode_step_ms_median"], ratio))
            print("| %d | %d | %s |" % (c, b, " | ".join(cells)))
    print()
    base = dtypes[0]
    print("Decode tokens/s relative to %s at the same point" % base)
    print()
    print("| context | batch | " + " | ".join(dtypes[1:]) + " |")
    print("|---|---|" + "---|" * (len(dtypes) - 1))
    for c in ctxs:
        for b in batches:
            r0 = by.get((base, c, b))
            cells = []
            for d in dtypes[1:]:
                r = by.get((d, c, b))
                if r is None or "error" in r:
                    cells.append("-")
                elif r0 is None or "error" in r0:
                    cells.append("(%s does not fit)" % base)
                else:
                    cells.append("%.2fx" % (r["decode_tokens_per_s"] / r0["decode_tokens_per_s"]))
            print("| %d | %d | %s |" % (c, b, " | ".join(cells)))
    print()
    print("Largest batch that fits (KV capacity in tokens) at context + 64 output tokens")
    print()
    print("| context | " + " | ".join(dtypes) + " |")
    print("|---|" + "---|" * len(dtypes))
    for c in ctxs:
        cells = []
        for d in dtypes:
            ok = [r for (dd, cc, _), r in by.items() if dd == d and cc == c and "error" not in r]
            if ok:
                cells.append("%d (%d)" % (ok[0]["largest_batch"], ok[0]["kv_capacity_tokens"]))
            else:
                cells.append("-")
        print("| %d | %s |" % (c, " | ".join(cells)))
    print()
    print("Prefill tokens/s (one sequence of `context` tokens, chunks of 8192)")
    print()
    print("| context | " + " | ".join(dtypes) + " |")
    print("|---|" + "---|" * len(dtypes))
    for c in ctxs:
        cells = []
        for d in dtypes:
            ok = [r for (dd, cc, _), r in by.items() if dd == d and cc == c and "error" not in r]
            cells.append("%.0f" % ok[0]["prefill_tokens_per_s"] if ok else "-")
        print("| %d | %s |" % (c, " | ".join(cells)))


if __name__ == "__main__":
    main(sys.argv[1])
