#!/usr/bin/env python3
"""Load benchmark for `kvq serve` (not a test): N concurrent streaming clients over loopback for
a bounded time; reports requests/s, output tokens/s, and time-to-first-token and inter-token
latency percentiles, per KV cache dtype.

Either targets a running server (--url) or launches one per dtype (--kvq BIN --model DIR
--kv-dtypes a,b,c), on an ephemeral port, stopping it with SIGINT afterwards.
Python 3 standard library only.

  python3 bench/serve_load.py --kvq build/kvq --model models/kvq-code-tiny \\
      --kv-dtypes bf16,fp8,int8_per_token_head,int4_per_token_head --duration 20 --concurrency 16
  python3 bench/serve_load.py --url http://127.0.0.1:8000 --duration 30

Each client loops: POST /v1/completions with stream=true (logprobs=0, so that every token is
counted exactly; --no-logprobs: none, tokens from the usage chunk, so a CUDA model samples on
the device, ignore_eos so that every request runs to max_tokens), a prompt drawn from a
fixed list of code prompts, reading server-sent events until [DONE]. At the deadline the
clients hang up (the server cancels what they had in flight); only requests completed before
the deadline count as completed, and tokens received before it count as output.
"""
import argparse
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\ndef ",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):\n    ",
    "def read_lines(path):\n    \"\"\"Return the lines of the file at *path*.\"\"\"\n",
    "try:\n    import json\nexcept ImportError:\n",
    "    def __repr__(self):\n        return ",
    "if __name__ == '__main__':\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "class Node:\n    \"\"\"A node of a binary tree.\"\"\"\n\n    def __init__(self, value, left=None, right=None):\n",
    "with open(filename, 'rb') as f:\n    ",
    "def _check_closed(self):\n    if self.closed:\n",
]


def percentile(values, p):
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.completed = 0
        self.errors = 0
        self.output_tokens = 0
        self.ttft = []
        self.itl = []
        self.error_samples = []


def sse_chunks(resp):
    """The JSON chunks of a server-sent-event response, up to `data: [DONE]` (then the generator
    ends); EOFError when the stream ends before it."""
    while True:
        line = resp.readline()
        if not line:
            raise EOFError("stream ended without [DONE]")
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        payload = line[6:]
        if payload == b"[DONE]":
            return
        yield json.loads(payload)


def client_loop(host, port, model, args, deadline, stats, seed):
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        body = {
            "prompt": rng.choice(PROMPTS),
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "stream": True,
            "ignore_eos": True,
        }
        if args.no_logprobs:
            # Only ids leave the engine (a CUDA model samples on the device); tokens are counted
            # from the final usage chunk, latencies per streamed text event.
            body["stream_options"] = {"include_usage": True}
        else:
            body["logprobs"] = 0
        if model:
            body["model"] = model
        start = time.monotonic()
        first = None
        last = None
        tokens = 0
        usage_tokens = None
        itl = []
        conn = http.client.HTTPConnection(host, port, timeout=max(1.0, deadline - start + 5))
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError("HTTP %d: %s" % (resp.status, resp.read()[:200]))
            done = False
            for chunk in sse_chunks(resp):
                if time.monotonic() >= deadline:
                    break
                now = time.monotonic()
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices", []):
                    if args.no_logprobs:
                        k = 1 if choice.get("text") else 0
                    else:
                        lp = choice.get("logprobs") or {}
                        k = len(lp.get("tokens") or [])
                    if k == 0:
                        continue
                    if first is None:
                        first = now
                        if k > 1:
                            itl.extend([0.0] * (k - 1))
                    else:
                        itl.extend([(now - last) / k] * k)
                    last = now
                    tokens += k
            else:
                done = True
            if done and usage_tokens is not None:
                tokens = usage_tokens
            with stats.lock:
                stats.output_tokens += tokens
                if first is not None:
                    stats.ttft.append(first - start)
                stats.itl.extend(itl)
                if done:
                    stats.completed += 1
        except Exception as e:  # noqa: BLE001 - a benchmark reports errors, it does not stop
            if time.monotonic() < deadline:
                with stats.lock:
                    stats.errors += 1
                    if len(stats.error_samples) < 3:
                        stats.error_samples.append(str(e))
                time.sleep(0.05)
        finally:
            conn.close()


def get_text(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def scrape(base):
    out = {}
    try:
        for line in get_text(base + "/metrics").splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    except Exception:  # noqa: BLE001
        pass
    return out


def metric_sum(m, name):
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))


def run_load(base, args, label):
    u = urllib.parse.urlparse(base)
    models = json.loads(get_text(base + "/v1/models"))
    model = models["data"][0]["id"] if models.get("data") else None
    before = scrape(base)
    stats = Stats()
    start = time.monotonic()
    deadline = start + args.duration
    threads = [
        threading.Thread(target=client_loop, args=(u.hostname, u.port, model, args, deadline, stats, args.seed + i),
                         daemon=True)
        for i in range(args.concurrency)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=args.duration + 60)
    elapsed = max(time.monotonic() - start, 1e-9)
    after = scrape(base)
    ms = lambda v: v * 1e3  # noqa: E731
    return {
        "label": label,
        "concurrency": args.concurrency,
        "duration_s": round(elapsed, 2),
        "max_tokens": args.max_tokens,
        "completed": stats.completed,
        "errors": stats.errors,
        "error_samples": stats.error_samples,
        "requests_per_s": stats.completed / elapsed,
        "output_tokens_per_s": stats.output_tokens / elapsed,
        "ttft_ms": {p: ms(percentile(stats.ttft, p)) for p in (50, 90, 99)},
        "itl_ms": {p: ms(percentile(stats.itl, p)) for p in (50, 90, 99)},
        "preemptions": metric_sum(after, "kvq_preemptions_total") - metric_sum(before, "kvq_preemptions_total"),
        "kv_blocks_total": metric_sum(after, "kvq_kv_blocks_total"),
    }


def launch(args, dtype):
    cmd = [args.kvq, "serve", "--model", args.model, "--host", "127.0.0.1", "--port", "0"]
    if dtype:
        cmd += ["--kv-cache-dtype", dtype]
    cmd += args.server_arg
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines = []
    port = None
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on http://[^:]+:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    if port is None:
        proc.kill()
        raise SystemExit("kvq serve did not start: %s\n%s" % (" ".join(cmd), "".join(lines)))
    # Keep draining stderr (one log line per request) so the server never blocks on it.
    log = []
    threading.Thread(target=lambda: [log.append(l) for l in proc.stderr], daemon=True).start()
    base = "http://127.0.0.1:%d" % port
    for _ in range(200):
        try:
            if "ok" in get_text(base + "/health"):
                break
        except Exception:  # noqa: BLE001
            time.sleep(0.05)
    return proc, base, lines


def stop(proc):
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def table(results):
    rows = ["| KV dtype | clients | req/s | output tok/s | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) "
            "| completed | errors | preemptions |",
            "|---|---:|---:|---:|---|---|---:|---:|---:|"]
    for r in results:
        rows.append("| %s | %d | %.2f | %.1f | %.0f / %.0f / %.0f | %.1f / %.1f / %.1f | %d | %d | %d |" % (
            r["label"], r["concurrency"], r["requests_per_s"], r["output_tokens_per_s"],
            r["ttft_ms"][50], r["ttft_ms"][90], r["ttft_ms"][99], r["itl_ms"][50], r["itl_ms"][90], r["itl_ms"][99],
            r["completed"], r["errors"], r["preemptions"]))
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="target a running server (e.g. http://127.0.0.1:8000)")
    ap.add_argument("--kvq", help="kvq binary: launch `kvq serve` once per --kv-dtypes entry")
    ap.add_argument("--model", help="model directory for the launched server")
    ap.add_argument("--kv-dtypes", default="", help="comma-separated --kv-cache-dtype values (launch mode)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for kvq serve (repeatable)")
    ap.add_argument("--concurrency", type=int, default=16, help="concurrent streaming clients (default 16)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per run (default 20)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--no-logprobs", action="store_true",
                    help="ask for no logprobs (the device-sampling path of a CUDA model); count "
                    "tokens from the final usage chunk")
    args = ap.parse_args()

    results = []
    if args.url:
        results.append(run_load(args.url.rstrip("/"), args, "(as served)"))
    else:
        if not args.kvq or not args.model:
            ap.error("give --url, or --kvq and --model")
        for dtype in [d for d in args.kv_dtypes.split(",") if d] or [""]:
            proc, base, start_lines = launch(args, dtype)
            try:
                sys.stderr.write("".join(start_lines))
                r = run_load(base, args, dtype or "(model default)")
            finally:
                stop(proc)
            results.append(r)
            sys.stderr.write("%s: %.2f req/s, %.1f tok/s\n" % (r["label"], r["requests_per_s"], r["output_tokens_per_s"]))
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(table(results))
    for r in results:
        for e in r["error_samples"]:
            sys.stderr.write("%s: error: %s\n" % (r["label"], e))


if __name__ == "__main__":
    main()
