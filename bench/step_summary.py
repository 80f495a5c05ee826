# Reads one `kvq bench --json` document on stdin; writes it back as one JSON line with
# "ab": TAG added (stdout) and a summary line on stderr: tokens/s, median step, the weight
# floor and the ratio (for a speculative run: the plain and speculative steps and the speedup).
#   kvq bench ... --json | python3 bench/step_summary.py TAG >> out.jsonl
import json
import sys

tag = sys.argv[1]
text = sys.stdin.read()
if not text.strip():
    print(f"{tag}: no output from kvq bench", file=sys.stderr)
    sys.exit(0)
j = json.loads(text)
j["ab"] = tag
print(json.dumps(j))
if "spec_ms_per_step" in j:  # a speculative run (--speculative-config)
    print(f"{tag:24s} kv={j['plan'][:12]:12s} B={j['batch']:2d}: plain {j['plain_ms_per_step']:.3f} "
          f"ms/step, spec {j['spec_ms_per_step']:.3f} ms/step (forward "
          f"{j['spec_forward_ms_per_step']:.3f}), x{j['speedup']:.2f}, "
          f"length {j['mean_accepted_length']:.2f}", file=sys.stderr)
    sys.exit(0)
m = j.get("memory") or {}
floor = j.get("decode_floor_ms") or 0.0
ratio = j["decode_step_ms_median"] / floor if floor > 0 else float("nan")
print(f"{tag:24s} w={str(m.get('weight_dtype')):8s} kv={j['plan'][:12]:12s} ctx {j['input_len']:5d} "
      f"B={j['batch']:2d}: {j['decode_tokens_per_s']:8.0f} tok/s "
      f"{j['decode_step_ms_median']:.3f} ms/step floor {floor:.3f} ({ratio:.3f}x)",
      file=sys.stderr)
