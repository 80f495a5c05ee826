#!/usr/bin/env python3
"""Where a graph-replayed step's time goes, from a bench/trace/cupti_trace.cc timeline.

  python3 bench/trace_summary.py trace.csv [--skip 2] [--top 40] [--json out.json]

Takes the CUDA graph launched most often (a decode or verification step), drops its first
--skip launches, and prints, as medians over the rest:
  - the step's period (one cudaGraphLaunch to the next), the GPU span of its kernels (first
    start to last end), the time the GPU runs at least one of them (busy), and the host's share
    (the period outside the span: staging, launch, the copy back, the synchronisation);
  - every kernel class (name and template arguments): launches per step, exclusive time (how
    far its launches move the end of the timeline: the step's span is the sum of these and the
    idle gaps), summed duration, and the summed gap before its launches (start minus the
    previous kernel's end; negative where programmatic dependent launch overlapped them);
  - the host calls between two launches (runtime API, median summed time per step).
"""
import argparse
import bisect
import csv
import json
import re
import subprocess
import statistics
import sys
from collections import defaultdict


def demangle(names):
    # Kernels in anonymous namespaces come mangled from CUPTI; c++filt (binutils) where present.
    names = sorted(set(names))
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                             check=True).stdout.split("\n")
        return dict(zip(names, out)) if len(out) >= len(names) else {n: n for n in names}
    except (OSError, subprocess.SubprocessError):
        return {n: n for n in names}


def short(name):
    # "void kvq::ns::kernel<(kvq::KvDtype)2, 64>(args)" -> "kernel<2, 64>": the function name
    # and its template arguments without namespaces or casts (the tracer writes commas as ';').
    n = name[5:] if name.startswith("void ") else name
    n = n.replace(";", ",").replace("(anonymous namespace)::", "")
    depth, cut = 0, len(n)
    for i, c in enumerate(n):
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif c == "(" and depth == 0:
            cut = i
            break
    n = n[:cut]
    lt = n.find("<")
    base = (n if lt < 0 else n[:lt]).split("::")[-1]
    if lt >= 0:
        targs = n[lt:]
        while True:  # "(kvq::KvDtype)2" -> "2"
            t2 = re.sub(r"\([\w:]+\)", "", targs)
            if t2 == targs:
                break
            targs = t2
        base += re.sub(r"[\w]+::", "", targs)
    return base[:70]


def med(xs):
    return statistics.median(xs) if xs else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--json")
    ap.add_argument("--label", default="")
    a = ap.parse_args()

    kernels, runtime, copies = [], [], []
    with open(a.trace) as f:
        for r in csv.DictReader(f):
            row = (r["name"], int(r["start_ns"]), int(r["end_ns"]), int(r["correlation"]),
                   int(r["graph_id"]))
            {"K": kernels, "R": runtime, "M": copies}[r["kind"]].append(row)
    copies = [("memcpy DtoH" if c[0].startswith("memcpy2:") else "memcpy HtoD"
               if c[0].startswith("memcpy1:") else c[0].split(":")[0],) + c[1:] for c in copies]
    names = demangle([k[0] for k in kernels])
    names.update({c[0]: c[0] for c in copies})
    kernels = [(names[k[0]],) + k[1:] for k in kernels]
    launches = sorted((r for r in runtime if r[0].startswith("cudaGraphLaunch")),
                      key=lambda r: r[1])
    by_corr = defaultdict(list)
    for k in kernels:
        if k[4] != 0:
            by_corr[k[3]].append(k)
    graph_of = {}
    for lch in launches:
        ks = by_corr.get(lch[3])
        if ks:
            graph_of[lch[3]] = ks[0][4]
    count = defaultdict(int)
    for g in graph_of.values():
        count[g] += 1
    if not count:
        sys.exit("trace_summary: no graph launches with kernels in " + a.trace)
    graph = max(count, key=count.get)
    steps = [lch for lch in launches if graph_of.get(lch[3]) == graph][a.skip:]
    if len(steps) < 2:
        sys.exit("trace_summary: fewer than two launches of the busiest graph after --skip")

    period, span, busy, first_delay, nk = [], [], [], [], []
    cls_dur, cls_gap, cls_n = defaultdict(list), defaultdict(list), defaultdict(list)
    cls_excl = defaultdict(list)
    host = defaultdict(list)
    loose = sorted([k for k in kernels if k[4] == 0] + copies, key=lambda k: k[1])
    starts = [k[1] for k in loose]
    for i, lch in enumerate(steps):
        # The graph's kernels, and the kernels and copies launched outside it (sampling, the
        # staging and the ids' copy back) from this launch to the next.
        ks = list(by_corr[lch[3]])
        s0, s1 = min(k[1] for k in ks), max(k[2] for k in ks)  # the graph's own span
        if i + 1 < len(steps):
            lo, hi = bisect.bisect_left(starts, lch[1]), bisect.bisect_left(starts, steps[i + 1][1])
            ks += loose[lo:hi]
        ks.sort(key=lambda k: k[1])
        nk.append(len(ks))
        span.append((s1 - s0) / 1e3)
        first_delay.append((s0 - lch[1]) / 1e3)
        tot, cur0, cur1 = 0, None, None
        for k in ks:
            if cur1 is None or k[1] > cur1:
                if cur1 is not None:
                    tot += cur1 - cur0
                cur0, cur1 = k[1], k[2]
            else:
                cur1 = max(cur1, k[2])
        tot += cur1 - cur0
        busy.append(tot / 1e3)
        d, g, n, e = defaultdict(float), defaultdict(float), defaultdict(int), defaultdict(float)
        prev_end = None
        for k in ks:
            c = short(k[0])
            d[c] += (k[2] - k[1]) / 1e3
            if prev_end is not None:
                g[c] += (k[1] - prev_end) / 1e3
            # Exclusive: how far this kernel moves the timeline's end (a kernel launched early
            # by programmatic dependent launch waits inside its duration, overlapped).
            e[c] += max(0, k[2] - (k[1] if prev_end is None else max(k[1], prev_end))) / 1e3
            prev_end = k[2] if prev_end is None else max(prev_end, k[2])
            n[c] += 1
        for c in set(d) | set(cls_dur):
            cls_dur[c].append(d.get(c, 0.0))
            cls_gap[c].append(g.get(c, 0.0))
            cls_n[c].append(n.get(c, 0))
            cls_excl[c].append(e.get(c, 0.0))
        if i + 1 < len(steps):
            nxt = steps[i + 1]
            period.append((nxt[1] - lch[1]) / 1e3)
            h = defaultdict(float)
            for r in runtime:
                if lch[1] <= r[1] < nxt[1]:
                    h[r[0]] += (r[2] - r[1]) / 1e3
            for c in set(h) | set(host):
                host[c].append(h.get(c, 0.0))

    out = {
        "label": a.label,
        "graph_id": graph,
        "steps": len(steps),
        "records_per_step": med(nk),
        "period_us": med(period),
        "gpu_span_us": med(span),
        "gpu_busy_us": med(busy),
        "launch_to_first_kernel_us": med(first_delay),
        "classes": [],
        "host_calls": [],
    }
    rows = sorted(cls_dur, key=lambda c: -med(cls_excl[c]))
    for c in rows:
        out["classes"].append({"kernel": c, "per_step": med(cls_n[c]),
                               "exclusive_us": round(med(cls_excl[c]), 2),
                               "us": round(med(cls_dur[c]), 2), "gap_us": round(med(cls_gap[c]), 2)})
    for c in sorted(host, key=lambda c: -med(host[c])):
        out["host_calls"].append({"call": c, "us": round(med(host[c]), 2)})

    print(f"# {a.label} graph {graph}: {len(steps)} launches timed, {med(nk):.0f} kernels and copies a step")
    print(f"period {med(period):.1f} us | graph span {med(span):.1f} | GPU busy {med(busy):.1f} | "
          f"outside the span {med(period) - med(span):.1f} | launch -> first kernel "
          f"{med(first_delay):.1f}")
    print(f"{'kernel':70s} {'n':>4s} {'excl us':>8s} {'us':>8s} {'gap us':>8s}")
    for r in out["classes"][: a.top]:
        print(f"{r['kernel'][:70]:70s} {r['per_step']:4.0f} {r['exclusive_us']:8.1f} "
              f"{r['us']:8.1f} {r['gap_us']:8.1f}")
    print("host calls between launches (us per step):",
          ", ".join(f"{h['call']} {h['us']:.1f}" for h in out["host_calls"][:8]))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
