#!/usr/bin/env python3
"""Summarizes an Nsight Compute CSV (--metrics gpu__time_duration.sum --csv) per CUDA stream:
kernel count and time, the kernels by total time, and the kernel sequence of the stream's
last pass (the launches after its last `marker` kernel, default the embedding gather).

Usage: ncu_summary.py FILE.csv [--marker SUBSTRING] [--top N]"""
import csv
import sys
from collections import defaultdict


def main():
    args = sys.argv[1:]
    path = args[0]
    marker = "embed_kernel"
    top = 25
    if "--marker" in args:
        marker = args[args.index("--marker") + 1]
    if "--top" in args:
        top = int(args[args.index("--top") + 1])
    lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
    rows = [r for r in csv.DictReader(lines[start:]) if r.get("Metric Name") == "gpu__time_duration.sum"]
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    per_stream = defaultdict(list)
    for r in rows:
        unit = r["Metric Unit"]
        if unit not in scale:
            sys.exit(f"ncu_summary: unknown time unit {unit!r}")
        us = float(r["Metric Value"].replace(",", "")) * scale[unit]
        per_stream[r["Stream"]].append((int(r["ID"]), r["Kernel Name"][:70], r["Grid Size"], us))
    for stream, ks in sorted(per_stream.items()):
        ks.sort()
        total = sum(k[3] for k in ks)
        print(f"stream {stream}: {len(ks)} kernels, {total:.1f} us")
        agg = defaultdict(lambda: [0, 0.0])
        for _, name, grid, us in ks:
            agg[(name, grid)][0] += 1
            agg[(name, grid)][1] += us
        for (name, grid), (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"  {us:10.1f} us {n:6d} x {us / n:7.2f} us  {grid:>12s}  {name}")
        last = max((i for i, k in enumerate(ks) if marker in k[1]), default=None)
        if last is not None:
            tail = ks[last:]
            print(f"  last pass from '{marker}': {len(tail)} kernels, {sum(k[3] for k in tail):.1f} us")
            for _, name, grid, us in tail:
                print(f"    {us:7.2f} us  {grid:>12s}  {name}")


if __name__ == "__main__":
    main()
