#!/usr/bin/env python3
"""docs/decode_h100.png from run_gpu_bench.sh's decode_merged.csv (needs matplotlib:
Debian's python3-matplotlib, i.e. /usr/bin/python3 bench/plot_decode.py CSV PNG)."""
import collections
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(csv_path, png_path, title):
    rows = list(csv.DictReader(open(csv_path)))
    series = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in rows:
        if int(r["hq"]) != 32:
            continue
        name = ("SDPA " + r["dtype"]) if r["impl"] == "sdpa" else "kvq " + r["dtype"]
        tokens = int(r["batch"]) * int(r["ctx"])
        series[name][tokens].append((float(r["pct_copy"]), float(r["ratio_to_best_sdpa"])))
    keep = ["SDPA cudnn", "SDPA flash", "kvq bfloat16", "kvq fp8_e4m3", "kvq int8_per_token_head",
            "kvq int4_per_token_head", "kvq nvfp4"]
    colors = dict(zip(keep, ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                             "#e377c2"]))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for name in keep:
        by = series[name]
        xs = sorted(by)
        sdpa = name.startswith("SDPA")
        axes[0].plot(xs, [max(p for p, _ in by[x]) for x in xs], marker="o", ms=3, label=name,
                     ls="--" if sdpa else "-", color=colors[name])
        if not sdpa:
            axes[1].plot(xs, [1 / min(q for _, q in by[x]) for x in xs], marker="o", ms=3,
                         label=name, color=colors[name])
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch x context (tokens); 32 q / 8 kv heads, head_dim 128; best point")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("% of measured copy bandwidth (bytes read)")
    axes[0].axhline(90, color="grey", lw=0.8)
    axes[0].set_title("effective bandwidth")
    axes[1].set_ylabel("speed-up over the best bf16 SDPA (cuDNN / flash)")
    axes[1].axhline(1, color="grey", lw=0.8)
    axes[1].axhline(3, color="grey", lw=0.8, ls=":")
    axes[1].set_title("kvq decode vs PyTorch SDPA")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "kvq decode attention")
