#!/usr/bin/env python3
"""PyTorch SDPA decode timings on the shapes of cuda_decode_bench, and the merged report.

  sdpa_bench.py --json sdpa.json [--csv sdpa.csv] [--quick]
      bf16, contiguous K/V [batch, kv_heads, ctx, 128], one query per sequence,
      enable_gqa=True, no mask (the decode query is the last position), with the cuDNN and the
      flash backend each forced. CUDA events around each call, median after warm-up; when the
      K/V of a point would fit in L2 the calls rotate over several copies.

  sdpa_bench.py --prefill --json sdpa_prefill.json
      Prefill shapes of cuda_prefill_bench (batch 1, 32 / 8 heads, head_dim 128, bf16):
      8192-token causal prefill (is_causal) and the last 2048-token chunk of 8192 (causal
      aligned bottom-right through causal_lower_right), cuDNN and flash forced.

  sdpa_bench.py --prefill-report kvq_prefill.json sdpa_prefill.json [--markdown tables.md]
      Time and TFLOP/s (causal FLOPs) per shape, and each kvq dtype's speed relative to the
      best SDPA (best SDPA time / kvq time; the issue's target is >= 0.8 for fp8).

  sdpa_bench.py --report kvq.json sdpa.json [--csv merged.csv] [--markdown tables.md]
      Joins both: per point and dtype the time, effective TB/s of bytes read, % of the measured
      device-to-device copy bandwidth and the ratio to the best SDPA time; prints a compact table.
"""
import argparse
import csv
import json
import math
import statistics
import sys

HEADS = ((32, 8), (64, 8))
HEAD_DIM = 128


def grid(quick):
    if quick:
        return [1, 32], [1024, 16384]
    return [1, 8, 32, 64, 128], [256, 1024, 4096, 16384, 32768]


def run_sdpa(args):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    batches, contexts = grid(args.quick)
    results = []
    torch.manual_seed(0)
    for hq, hkv in HEADS:
        for b in batches:
            for ctx in contexts:
                kv_bytes = 2 * b * hkv * ctx * HEAD_DIM * 2
                free, _ = torch.cuda.mem_get_info()
                copies = max(1, min(64, math.ceil(4 * l2 / kv_bytes)))
                while copies > 1 and copies * kv_bytes + (2 << 30) > free:
                    copies //= 2
                base = {"impl": "sdpa", "batch": b, "ctx": ctx, "hq": hq, "hkv": hkv,
                        "head_dim": HEAD_DIM, "bytes_read": kv_bytes + 2 * b * hq * HEAD_DIM * 2}
                if kv_bytes + (2 << 30) > free:
                    for name in backends:
                        results.append(dict(base, dtype=name, time_us=0.0,
                                            note="skipped: does not fit in device memory"))
                    continue
                q = torch.randn(b, hq, 1, HEAD_DIM, device=dev, dtype=torch.bfloat16)
                ks = [torch.randn(b, hkv, ctx, HEAD_DIM, device=dev, dtype=torch.bfloat16)
                      for _ in range(copies)]
                vs = [torch.randn(b, hkv, ctx, HEAD_DIM, device=dev, dtype=torch.bfloat16)
                      for _ in range(copies)]
                for name, backend in backends.items():
                    row = dict(base, dtype=name, copies=copies)
                    try:
                        with sdpa_kernel([backend]):
                            def call(i):
                                return F.scaled_dot_product_attention(
                                    q, ks[i % copies], vs[i % copies], enable_gqa=True)
                            out = None
                            for w in range(3):
                                out = call(w)
                            torch.cuda.synchronize()
                            if not torch.isfinite(out).all():
                                raise RuntimeError("non-finite output")
                            e0 = torch.cuda.Event(enable_timing=True)
                            e1 = torch.cuda.Event(enable_timing=True)
                            e0.record()
                            call(0)
                            e1.record()
                            torch.cuda.synchronize()
                            probe = max(e0.elapsed_time(e1), 1e-3)
                            iters = int(min(200, max(10, 30.0 / probe)))
                            ev = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
                            ev[0].record()
                            for i in range(iters):
                                call(i + 1)
                                ev[i + 1].record()
                            torch.cuda.synchronize()
                            ms = [ev[i].elapsed_time(ev[i + 1]) for i in range(iters)]
                        row["time_us"] = statistics.median(ms) * 1e3
                        row["min_us"] = min(ms) * 1e3
                        row["iters"] = iters
                        row["note"] = ""
                        print(f"sdpa {name:6s} hq {hq:2d} B {b:3d} ctx {ctx:5d}: "
                              f"{row['time_us']:9.1f} us  "
                              f"{row['bytes_read'] / (row['time_us'] * 1e-6) / 1e12:5.2f} TB/s",
                              flush=True)
                    except Exception as e:  # a backend that refuses the shape is a result too
                        row["time_us"] = 0.0
                        row["note"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                        print(f"sdpa {name:6s} hq {hq:2d} B {b:3d} ctx {ctx:5d}: {row['note']}",
                              flush=True)
                    results.append(row)
                del ks, vs, q
                torch.cuda.empty_cache()
    doc = {"device": props.name, "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "results": results}
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    if args.csv:
        keys = ["impl", "dtype", "batch", "ctx", "hq", "hkv", "head_dim", "time_us", "min_us",
                "bytes_read", "copies", "iters", "note"]
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            for r in results:
                w.writerow(r)


SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "fp8_e4m3": "fp8",
         "fp8_e5m2": "e5m2", "int8_per_token_head": "int8pth", "fp8_per_token_head": "fp8pth",
         "int4_per_token_head": "int4pth", "nvfp4": "nvfp4"}


def report(args):
    kvq_path, sdpa_path = args.report
    kvq = json.load(open(kvq_path))
    try:
        sdpa = json.load(open(sdpa_path))
    except (OSError, ValueError):
        sdpa = {"results": []}
    copy = kvq["copy_tbs"]
    best = {}
    sdpa_by = {}
    for r in sdpa["results"]:
        key = (r["hq"], r["batch"], r["ctx"])
        sdpa_by[key + (r["dtype"],)] = r
        if r.get("time_us", 0) > 0 and (key not in best or r["time_us"] < best[key]["time_us"]):
            best[key] = r
    rows = []
    for r in kvq["results"] + sdpa["results"]:
        t = r.get("time_us", 0)
        eff = r["bytes_read"] / (t * 1e-6) / 1e12 if t > 0 else 0.0
        b = best.get((r["hq"], r["batch"], r["ctx"]))
        rows.append(dict(r, eff_tbs=eff, pct_copy=100 * eff / copy if copy else 0,
                         ratio_to_best_sdpa=(t / b["time_us"]) if (b and t > 0) else 0.0))
    if args.csv:
        keys = ["impl", "dtype", "batch", "ctx", "hq", "hkv", "head_dim", "time_us", "min_us",
                "bytes_read", "eff_tbs", "pct_copy", "ratio_to_best_sdpa", "splits", "copies",
                "iters", "note"]
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            for r in rows:
                w.writerow(r)

    by = {(r["impl"], r["dtype"], r["hq"], r["batch"], r["ctx"]): r for r in rows}
    dtypes = [d for d in SHORT if any(k[1] == d for k in by if k[0] == "kvq")]
    md = [f"Device: {kvq['device']} ({kvq['sms']} SMs); measured device-to-device copy "
          f"{copy:.2f} TB/s (bytes read + written). SDPA: torch {sdpa.get('torch', '?')}, "
          f"cuDNN {sdpa.get('cudnn', '?')}, bf16, contiguous KV, enable_gqa=True.", ""]
    for hq, hkv in HEADS:
        md.append(f"### {hq} query heads / {hkv} kv heads, head_dim 128, block 16: time in us "
                  "(effective TB/s of bytes read)")
        md.append("")
        head = ["B", "ctx", "SDPA cuDNN", "SDPA flash"] + [SHORT[d] for d in dtypes]
        md.append("| " + " | ".join(head) + " |")
        md.append("|" + "---|" * len(head))
        for b, ctx in sorted({(k[3], k[4]) for k in by if k[2] == hq}):
            cells = [str(b), str(ctx)]
            for name in ("cudnn", "flash"):
                r = by.get(("sdpa", name, hq, b, ctx))
                cells.append(f"{r['time_us']:.1f} ({r['eff_tbs']:.2f})" if r and r["time_us"] > 0
                             else "-")
            for d in dtypes:
                r = by.get(("kvq", d, hq, b, ctx))
                cells.append(f"{r['time_us']:.1f} ({r['eff_tbs']:.2f})" if r and r["time_us"] > 0
                             else "-")
            md.append("| " + " | ".join(cells) + " |")
        md.append("")
        md.append(f"### {hq}/{hkv} heads: % of copy bandwidth, and time / best SDPA time")
        md.append("")
        head = ["B", "ctx"] + [SHORT[d] for d in dtypes]
        md.append("| " + " | ".join(head) + " |")
        md.append("|" + "---|" * len(head))
        for b, ctx in sorted({(k[3], k[4]) for k in by if k[2] == hq}):
            cells = [str(b), str(ctx)]
            for d in dtypes:
                r = by.get(("kvq", d, hq, b, ctx))
                if r and r["time_us"] > 0:
                    ratio = f", {r['ratio_to_best_sdpa']:.2f}x" if r["ratio_to_best_sdpa"] else ""
                    cells.append(f"{r['pct_copy']:.0f}%{ratio}")
                else:
                    cells.append("-")
            md.append("| " + " | ".join(cells) + " |")
        md.append("")
    text = "\n".join(md)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")

    # Compact console table: the main dtypes against the best SDPA.
    show = [d for d in ("bfloat16", "fp8_e4m3", "int8_per_token_head", "int4_per_token_head",
                        "nvfp4") if d in dtypes]
    print(f"\ncopy bandwidth {copy:.2f} TB/s; entries: us (% of copy bw) [time / best SDPA]")
    print(f"{'hq':>3} {'B':>4} {'ctx':>6} {'SDPA best':>16} " +
          " ".join(f"{SHORT[d]:>24}" for d in show))
    for hq, _ in HEADS:
        for b, ctx in sorted({(k[3], k[4]) for k in by if k[2] == hq}):
            bs = best.get((hq, b, ctx))
            line = f"{hq:>3} {b:>4} {ctx:>6} "
            line += (f"{bs['time_us']:9.1f} {bs['dtype']:>6} " if bs else f"{'-':>16} ")
            for d in show:
                r = by.get(("kvq", d, hq, b, ctx))
                if r and r["time_us"] > 0:
                    s = f"{r['time_us']:.1f} ({r['pct_copy']:.0f}%)"
                    if r["ratio_to_best_sdpa"]:
                        s += f" [{r['ratio_to_best_sdpa']:.2f}]"
                    line += f"{s:>25}"
                else:
                    line += f"{'-':>25}"
            print(line)


PREFILL_SHAPES = (("prefill1024", 1024, 1024), ("prefill4096", 4096, 4096),
                  ("prefill8192", 8192, 8192), ("prefill16384", 16384, 16384),
                  ("chunk2048", 2048, 8192), ("chunk8192", 8192, 32768))


def prefill_flops(q_len, kv_len, hq=32, hd=HEAD_DIM):
    visible = sum(kv_len - q_len + j + 1 for j in range(q_len))
    return 4.0 * hd * visible * hq


def run_sdpa_prefill(args):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    hq, hkv = 32, 8
    results = []
    torch.manual_seed(0)
    for name_shape, q_len, kv_len in PREFILL_SHAPES:
        q = torch.randn(1, hq, q_len, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, hkv, kv_len, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, hkv, kv_len, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        flops = prefill_flops(q_len, kv_len)
        for name, backend in backends.items():
            row = {"impl": "sdpa", "dtype": name, "shape": name_shape, "q_len": q_len,
                   "kv_len": kv_len, "flops": flops, "note": ""}
            variants = [("is_causal", lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True))]
            if q_len != kv_len:
                bias = causal_lower_right(q_len, kv_len)
                variants = [("causal_lower_right", lambda: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=bias, enable_gqa=True)),
                    # A backend that refuses the bottom-right mask: the same chunk with the
                    # keys repeated per head (no enable_gqa).
                    ("causal_lower_right, K/V repeated", lambda: F.scaled_dot_product_attention(
                        q, k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1),
                        attn_mask=bias))]
            for vname, call in variants:
                try:
                    with sdpa_kernel([backend]):
                        for _ in range(3):
                            out = call()
                        torch.cuda.synchronize()
                        if not torch.isfinite(out).all():
                            raise RuntimeError("non-finite output")
                        ms = []
                        for _ in range(20):
                            e0 = torch.cuda.Event(enable_timing=True)
                            e1 = torch.cuda.Event(enable_timing=True)
                            e0.record()
                            call()
                            e1.record()
                            torch.cuda.synchronize()
                            ms.append(e0.elapsed_time(e1))
                    row["time_us"] = statistics.median(ms) * 1e3
                    row["tflops"] = flops / (row["time_us"] * 1e-6) / 1e12
                    row["note"] = vname
                    break
                except Exception as e:  # a backend that refuses the shape is a result too
                    row["time_us"] = 0.0
                    row["tflops"] = 0.0
                    row["note"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            print(f"sdpa {name:6s} {name_shape:12s}: {row['time_us']:9.1f} us "
                  f"{row['tflops']:6.1f} TFLOP/s  {row['note']}", flush=True)
            results.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    doc = {"device": props.name, "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "results": results}
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)


def prefill_report(args):
    kvq_path, sdpa_path = args.prefill_report
    kvq = json.load(open(kvq_path))
    try:
        sdpa = json.load(open(sdpa_path))
    except (OSError, ValueError):
        sdpa = {"results": []}
    best = {}
    for r in sdpa["results"]:
        if r.get("time_us", 0) > 0 and (r["shape"] not in best or
                                         r["time_us"] < best[r["shape"]]["time_us"]):
            best[r["shape"]] = r
    dtypes = [d for d in SHORT if any(r["dtype"] == d for r in kvq["results"])]
    md = [f"Device: {kvq['device']}. SDPA: torch {sdpa.get('torch', '?')}, cuDNN "
          f"{sdpa.get('cudnn', '?')}, bf16, enable_gqa. Entries: time in us (TFLOP/s, causal "
          "FLOPs) [speed relative to the best SDPA: best SDPA time / time].", ""]
    head = ["shape", "SDPA cuDNN", "SDPA flash"] + [SHORT[d] for d in dtypes]
    md.append("| " + " | ".join(head) + " |")
    md.append("|" + "---|" * len(head))
    for name_shape, q_len, kv_len in PREFILL_SHAPES:
        cells = [f"{name_shape} (q {q_len}, kv {kv_len})"]
        b = best.get(name_shape)
        for name in ("cudnn", "flash"):
            r = next((x for x in sdpa["results"] if x["shape"] == name_shape and
                      x["dtype"] == name), None)
            cells.append(f"{r['time_us']:.0f} ({r['tflops']:.0f})" if r and r["time_us"] > 0
                         else "-")
        for d in dtypes:
            # Every kernel kvq ran on the shape (mma, wgmma), fastest last.
            rs = sorted((x for x in kvq["results"] if x["shape"] == name_shape and
                         x["dtype"] == d and x["time_us"] > 0), key=lambda x: -x["time_us"])
            parts = []
            for r in rs:
                rel = f" [{b['time_us'] / r['time_us']:.2f}]" if b else ""
                parts.append(f"{r.get('kernel', 'mma')} {r['time_us']:.0f} ({r['tflops']:.0f}){rel}")
            cells.append("; ".join(parts) if parts else "-")
        md.append("| " + " | ".join(cells) + " |")
    text = "\n".join(md)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--csv")
    ap.add_argument("--markdown")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--report", nargs=2, metavar=("KVQ_JSON", "SDPA_JSON"))
    ap.add_argument("--prefill", action="store_true")
    ap.add_argument("--prefill-report", nargs=2, metavar=("KVQ_JSON", "SDPA_JSON"))
    args = ap.parse_args()
    if args.prefill_report:
        prefill_report(args)
    elif args.prefill and args.json:
        run_sdpa_prefill(args)
    elif args.report:
        report(args)
    elif args.json:
        run_sdpa(args)
    else:
        ap.error("give --json (run SDPA) or --report KVQ_JSON SDPA_JSON")


if __name__ == "__main__":
    sys.exit(main())
