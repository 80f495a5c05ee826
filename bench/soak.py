#!/usr/bin/env python3
"""Soak test of `kvq serve` with faults (issue #16; loopback only, bounded in time).

Launches `kvq serve` with a KV cache small enough to force preemption, records a solo greedy
reference for every prompt, then for --duration seconds runs client threads at each level of
--concurrency in turn, every request one of:
  stream      streaming greedy completion read to [DONE]          (text must equal the solo run)
  whole       non-streaming greedy completion                       (text must equal the solo run)
  chat        non-streaming greedy chat completion                  (text must equal the solo run)
  long        greedy completion whose prompt fills the context up to max_tokens (token ids)
  disconnect  streaming request dropped after a few events          (the server cancels it)
  sampled     n = 2 sampled choices with a seed                      (both finish, right lengths)
Halfway through, the server gets SIGTERM under load (it must drain and exit 0) and is started
again; requests cut by the restart count as interrupted, not as errors.
Checks, all printed and in --json: no wrong or lost response (a greedy text that differs from its
solo run, a 5xx, a missing [DONE]), where a text that parts from its solo run at a near tie is
counted apart, not as wrong: the solo references carry the top two logprobs of every token, and
a parting counts as a near tie when the solo run's two most likely tokens there were within
--tie-eps nats and the loaded run took the second (batch shapes may move such a tie on a GPU,
whose GEMMs and attention splits depend on the batch); 0 KV blocks in use once idle (kvq_kv_blocks_used); resident
memory after warm-up within --rss-bound (default 5%) of its value at the end of warm-up; every
server log line that reports an error names its request id. Exit status 1 when a check fails.

  python3 bench/soak.py --kvq build/kvq --model models/kvq-code-tiny --duration 600 \\
      --concurrency 1,4,16 --json soak.json
Python 3 standard library only.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The load benchmark's code prompts, SSE reader and /metrics scraper.
from serve_load import PROMPTS, metric_sum, scrape, sse_chunks  # noqa: E402

SPECIAL = re.compile(r"<\|[^|<>]*\|>")  # how kvq-code-tiny's special tokens are spelled


class Server:
    def __init__(self, args, log_path):
        self.args = args
        self.log = open(log_path, "ab")
        start = os.path.getsize(log_path)  # this server's banner comes after what is there
        cmd = [args.kvq, "serve", "--model", args.model, "--port", "0",
               "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.max_num_seqs),
               "--shutdown-grace-period", str(args.grace)] + args.extra
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log)
        self.port = None
        deadline = time.time() + 300
        while time.time() < deadline and self.port is None:
            if self.proc.poll() is not None:
                raise RuntimeError("kvq serve exited with %d at start-up (see %s)" %
                                   (self.proc.returncode, log_path))
            with open(log_path, "rb") as f:
                f.seek(start)
                m = re.findall(rb"listening on http://127\.0\.0\.1:(\d+)", f.read())
            if m:
                self.port = int(m[-1])
            else:
                time.sleep(0.05)
        if self.port is None:
            raise RuntimeError("kvq serve did not start")

    def rss_kib(self):
        try:
            with open("/proc/%d/status" % self.proc.pid) as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except OSError:
            return None
        return None

    def stop(self, sig=signal.SIGTERM, timeout=120):
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


def request(port, path, body, timeout=600, stream=False, drop_after=None):
    """Returns (status, text or json, done) ; raises OSError on connection problems."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        if not stream or r.status != 200:
            data = r.read()
            try:
                return r.status, json.loads(data), True
            except ValueError:
                return r.status, None, True
        text, events = "", 0
        try:
            for chunk in sse_chunks(r):
                if "error" in chunk:
                    return 500, chunk, False
                for ch in chunk.get("choices", []):
                    text += ch.get("text", "")
                events += 1
                if drop_after is not None and events >= drop_after:
                    return 200, text, False
        except EOFError:
            return r.status, text, False
        return r.status, text, True
    finally:
        c.close()


def metrics(port):
    """Each metric summed over its label sets; OSError when the server does not answer."""
    m = scrape("http://127.0.0.1:%d" % port)
    if not m:
        raise OSError("no /metrics from port %d" % port)
    return {name: metric_sum(m, name) for name in {k.split("{", 1)[0] for k in m}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvq", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--kv-cache-memory", default="7MiB",
                    help="small enough to preempt, large enough for one context-filling prompt")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--grace", type=float, default=10)
    ap.add_argument("--rss-bound", type=float, default=0.05)
    ap.add_argument("--tie-eps", type=float, default=0.1,
                    help="a parting is a near tie when the solo run's top two were this close (nats)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--log", default="soak-server.log")
    ap.add_argument("extra", nargs="*", help="more kvq serve flags (after --)")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    levels = [int(x) for x in args.concurrency.split(",")]
    if os.path.exists(args.log):
        os.remove(args.log)
    print("soak: seed %d, %s s, concurrency %s, KV cache %s" %
          (seed, args.duration, levels, args.kv_cache_memory), flush=True)

    server = Server(args, args.log)
    port = server.port
    M = args.max_tokens
    # Context length from /v1/models; the long prompt is token ids up to the context minus M.
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/v1/models")
    ctx = json.loads(c.getresponse().read())["data"][0]["max_model_len"]
    c.close()
    long_ids = [rng.randrange(3, 4000) for _ in range(ctx - M)]

    def greedy_body(kind, i, top2=False):
        if kind == "chat":
            body = {"messages": [{"role": "user", "content": PROMPTS[i]}],
                    "max_completion_tokens": M, "temperature": 0, "ignore_eos": True}
            if top2:
                body.update({"logprobs": True, "top_logprobs": 2})
            return "/v1/chat/completions", body
        prompt = long_ids if kind == "long" else PROMPTS[i]
        body = {"prompt": prompt, "max_tokens": M, "temperature": 0, "ignore_eos": True}
        if top2:
            body["logprobs"] = 2
        return "/v1/completions", body

    def solo_tokens(kind, payload):
        """[(text offset, token text, [(alternative text, logprob) x 2])] of a solo reference."""
        lp = payload["choices"][0]["logprobs"]
        out = []
        if kind == "chat":
            at = 0
            for t in lp["content"]:
                out.append((at, t["token"], [(a["token"], a["logprob"]) for a in t["top_logprobs"]]))
                # A special token (an end-of-text generated under ignore_eos) is not in the text.
                if not SPECIAL.fullmatch(t["token"]):
                    at += len(t["token"])
        else:
            for at, tok, top in zip(lp["text_offset"], lp["tokens"], lp["top_logprobs"]):
                out.append((at, tok, sorted(top.items(), key=lambda kv: -kv[1])))
        return out

    def text_of(kind, status, payload):
        if status != 200 or payload is None:
            return None
        if kind == "stream":
            return payload
        ch = payload["choices"][0]
        return ch["message"]["content"] if kind == "chat" else ch["text"]

    # Solo references (one request at a time), with the top two logprobs of every token.
    ref, ref_tokens = {}, {}
    for kind in ("whole", "chat"):
        for i in range(len(PROMPTS)):
            path, body = greedy_body(kind, i, top2=True)
            st, p, _ = request(port, path, body)
            ref[(kind, i)] = text_of(kind, st, p)
            if ref[(kind, i)] is None:
                raise RuntimeError("solo reference failed: %s %d status %s" % (kind, i, st))
            ref_tokens[(kind, i)] = solo_tokens(kind, p)
    path, body = greedy_body("long", 0, top2=True)
    st, p, _ = request(port, path, body)
    ref[("long", 0)] = text_of("long", st, p)
    if ref[("long", 0)] is None:
        raise RuntimeError("solo reference of the context-filling prompt failed: %s %s" % (st, p))
    ref_tokens[("long", 0)] = solo_tokens("long", p)
    print("soak: %d solo references (context %d, long prompt %d tokens)" %
          (len(ref), ctx, len(long_ids)), flush=True)

    lock = threading.Lock()
    counts = {k: 0 for k in ("stream", "whole", "chat", "long", "disconnect", "sampled")}
    failures, interrupted = [], [0]
    state = {"port": port, "restarting": False}
    stop = threading.Event()
    active_level = [levels[0]]

    wrong_total = [0]
    ties = {}  # (kind, prompt, char) -> [count, gap of the solo run's top two]
    unexplained = {}  # (kind, prompt, char) -> what the two runs had there (first of each)

    def record_failure(msg):
        with lock:
            wrong_total[0] += 1
            if len(failures) < 50:
                failures.append(msg)

    def tie(kind, i, at, gap):
        with lock:
            t = ties.setdefault((kind, i, at), [0, gap])
            t[0] += 1

    def check_text(kind, i, got, want_key, got_tokens=None):
        """A greedy text against its solo run: equal, a near tie, or wrong (recorded).
        got_tokens: the loaded run's token texts (from its logprobs), when it has them: then the
        first differing token is found even where two tokenizations spell the same text."""
        want = ref[want_key]
        solo = ref_tokens[want_key]
        if got == want and (got_tokens is None or got_tokens == [t[1] for t in solo]):
            return
        at = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]),
                  min(len(got), len(want)))
        if got_tokens is not None:
            j = next((k for k in range(min(len(got_tokens), len(solo)))
                      if got_tokens[k] != solo[k][1]), None)
            if j is not None:
                top = solo[j][2]
                if (len(top) >= 2 and top[0][0] == solo[j][1] and got_tokens[j] == top[1][0]
                        and top[0][1] - top[1][1] <= args.tie_eps):
                    tie(kind, i, solo[j][0], top[0][1] - top[1][1])
                    return
        else:
            # The solo token that holds the first differing character, and its top two there.
            for off, tok, top in solo:
                if off <= at < off + max(len(tok), 1):
                    if (len(top) >= 2 and top[0][0] == tok and top[0][1] - top[1][1] <= args.tie_eps
                            and got[off:].startswith(top[1][0])):
                        tie(kind, i, at, top[0][1] - top[1][1])
                        return
                    break
        with lock:
            key = (kind, i, at)
            if key not in unexplained and len(unexplained) < 20:
                near = [(o, t, tp) for o, t, tp in solo if at - 40 <= o <= at + 8]
                unexplained[key] = {"want": want[max(0, at - 40):at + 20],
                                    "got": got[max(0, at - 40):at + 20],
                                    "got_tokens": got_tokens, "solo_tokens_near": near}
        record_failure("%s %d: text differs from the solo run at char %d" % (kind, i, at))

    def client(idx, crng):
        while not stop.is_set():
            if idx >= active_level[0]:
                time.sleep(0.05)
                continue
            r = crng.random()
            kind = ("stream" if r < 0.3 else "whole" if r < 0.5 else "chat" if r < 0.65 else
                    "long" if r < 0.75 else "disconnect" if r < 0.9 else "sampled")
            i = 0 if kind == "long" else crng.randrange(len(PROMPTS))
            p_now = state["port"]
            try:
                if kind in ("stream", "disconnect"):
                    _, body = greedy_body("whole", i)
                    body["stream"] = True
                    drop = crng.randrange(1, 6) if kind == "disconnect" else None
                    st, payload, done = request(p_now, "/v1/completions", body, stream=True,
                                                drop_after=drop)
                    if kind == "stream":
                        if st == 503 or (st == 200 and not done and state["restarting"]):
                            interrupted[0] += 1
                            continue
                        if st != 200 or not done:
                            record_failure("stream %d: status %s, done %s" % (i, st, done))
                        else:
                            check_text("stream", i, payload, ("whole", i))
                elif kind == "sampled":
                    body = {"prompt": PROMPTS[i], "max_tokens": M, "temperature": 0.8, "n": 2,
                            "seed": crng.randrange(1 << 30), "ignore_eos": True}
                    st, payload, _ = request(p_now, "/v1/completions", body)
                    if st == 503:
                        interrupted[0] += 1
                        continue
                    if st != 200 or len(payload["choices"]) != 2 or \
                            payload["usage"]["completion_tokens"] != 2 * M:
                        record_failure("sampled %d: status %s %s" % (i, st, str(payload)[:200]))
                else:
                    path, body = greedy_body(kind, i)
                    # Half the non-streamed completions bring their tokens (logprobs: 0, the
                    # host-sampling path), so a parting is found token by token.
                    with_tokens = kind != "chat" and crng.random() < 0.5
                    if with_tokens:
                        body["logprobs"] = 0
                    st, payload, _ = request(p_now, path, body)
                    if st == 503:
                        interrupted[0] += 1
                        continue
                    got = text_of(kind, st, payload)
                    if got is None:
                        record_failure("%s %d: status %s %s" % (kind, i, st, str(payload)[:200]))
                    else:
                        toks = (payload["choices"][0]["logprobs"]["tokens"] if with_tokens
                                else None)
                        check_text(kind, i, got, (kind, 0 if kind == "long" else i), toks)
                with lock:
                    counts[kind] += 1
            except (OSError, http.client.HTTPException, ValueError) as e:
                if state["restarting"] or p_now != state["port"]:
                    interrupted[0] += 1
                    time.sleep(0.1)
                else:
                    record_failure("%s %d: %s: %s" % (kind, i, type(e).__name__, e))

    threads = [threading.Thread(target=client, args=(k, random.Random(seed + 1 + k)), daemon=True)
               for k in range(max(levels))]
    for t in threads:
        t.start()
    samples = []  # (t, rss KiB, blocks used, running, waiting)
    t0 = time.time()
    restarted = False
    restart_exit = None
    while time.time() - t0 < args.duration:
        el = time.time() - t0
        active_level[0] = levels[min(len(levels) - 1, int(el / (args.duration / len(levels))))]
        if not restarted and el >= args.duration / 2:
            # The fault: SIGTERM under load, then a fresh server.
            state["restarting"] = True
            restart_exit = server.stop(signal.SIGTERM, timeout=args.grace + 60)
            if restart_exit != 0:
                record_failure("SIGTERM under load: exit status %s" % restart_exit)
            server = Server(args, args.log)
            state["port"] = server.port
            time.sleep(0.5)
            state["restarting"] = False
            restarted = True
            samples.append(("restart", el))
            continue
        if server.proc.poll() is not None:
            record_failure("kvq serve exited on its own with status %s at %.0f s (see %s)" %
                           (server.proc.returncode, el, args.log))
            break
        try:
            m = metrics(state["port"])
            samples.append((el, server.rss_kib(), m.get("kvq_kv_blocks_used", 0.0),
                            m.get("kvq_requests_running", 0.0), m.get("kvq_requests_waiting", 0.0)))
        except OSError:
            pass
        time.sleep(5)
    stop.set()
    for t in threads:
        t.join(timeout=args.max_tokens * 5 + 60)
    # Idle: every block back.
    blocks_idle, m = None, {}
    for _ in range(100 if server.proc.poll() is None else 0):
        m = metrics(state["port"])
        blocks_idle = m.get("kvq_kv_blocks_used", 0.0)
        if blocks_idle == 0 and m.get("kvq_requests_running", 0) == 0:
            break
        time.sleep(0.1)
    final_exit = server.stop(signal.SIGTERM) if server.proc.poll() is None else server.proc.returncode
    with open(args.log, "rb") as f:
        log = f.read().decode(errors="replace").splitlines()
    bad_log = [l for l in log if re.search(r"error|internal", l, re.I) and
               not re.search(r"(chat)?cmpl-[0-9a-f]+", l)]
    # RSS: the samples of the server running at the end (after the restart); warm-up = its first
    # fifth.
    cut = max([k + 1 for k, s in enumerate(samples) if s[0] == "restart"] or [0])
    after = [s for s in samples[cut:] if s[1]]
    rss_growth = None
    if len(after) >= 3:
        warm = after[max(0, len(after) // 5)][1]
        rss_growth = max(s[1] for s in after[len(after) // 5:]) / warm - 1.0
    ok = (not failures and blocks_idle == 0 and final_exit == 0 and (restart_exit in (0, None)) and
          not bad_log and (rss_growth is None or rss_growth <= args.rss_bound))
    report = {
        "seed": seed, "duration_s": args.duration, "concurrency": levels,
        "kv_cache_memory": args.kv_cache_memory, "max_tokens": M, "context": ctx,
        "completed": counts, "interrupted_by_restart": interrupted[0], "failures": failures,
        "wrong_or_lost": wrong_total[0], "tie_eps": args.tie_eps,
        "near_ties": sum(t[0] for t in ties.values()),
        "near_tie_partings": [{"kind": k[0], "prompt": k[1], "char": k[2], "count": t[0],
                               "top2_gap": t[1]} for k, t in sorted(ties.items())],
        "unexplained_partings": [dict(kind=k[0], prompt=k[1], char=k[2], **v)
                                 for k, v in sorted(unexplained.items())],
        "kv_blocks_used_idle": blocks_idle, "sigterm_under_load_exit": restart_exit,
        "final_exit": final_exit, "rss_growth_after_warmup": rss_growth,
        "rss_kib_samples": [s[1] for s in after], "max_blocks_used": max(
            [s[2] for s in samples if s[0] != "restart"] or [0]),
        "error_log_lines_without_request_id": bad_log[:20],
        "preemptions_after_restart": m.get("kvq_preemptions_total"), "ok": ok,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "rss_kib_samples"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
