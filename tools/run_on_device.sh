#!/usr/bin/env bash
# Runs on the GPU machine from the repository root: a smoke test of both
# scripts (seconds; stops here if they break), then the real training of
# models/kvq-code-tiny and the goldens. The log and a tar of the produced
# folders go to $OUT. Env: STORIES (stories260K folder), MINUTES (training
# time cap per run), EPOCHS (space-separated --epochs values; the run
# with the lowest validation loss is kept), SKIP_SMOKE=1, SMOKE_ONLY=1.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kvq_out}
STORIES=${STORIES:-.carry/stories260K}
MINUTES=${MINUTES:-4.5}
EPOCHS=${EPOCHS:-20}
mkdir -p "$OUT"

steps() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  python3 -c 'import sys, torch, transformers, tokenizers; print(sys.version.split()[0], torch.__version__, transformers.__version__, tokenizers.__version__)' || return 1
  if [ -z "$SKIP_SMOKE" ]; then
  echo "== smoke"
  rm -rf /tmp/smoke
  python3 tools/train_default_model.py --out /tmp/smoke/kvq-code-tiny --steps 30 --max-files 100 \
    --eval-every 10 --log-every 10 --sample-tokens 16 || return 1
  timeout 180 python3 tools/make_goldens.py --code-model /tmp/smoke/kvq-code-tiny --stories "$STORIES" \
    --out /tmp/smoke/goldens --greedy-tokens 20 || return 1
  fi
  [ -n "$SMOKE_ONLY" ] && return 0
  rm -rf models/kvq-code-tiny tests/fixtures/goldens /tmp/runs
  # One run per --epochs value; the one with the lowest validation loss is kept.
  note="Chosen by validation loss among runs with --epochs $EPOCHS (same seed and settings otherwise)."
  for e in $EPOCHS; do
    echo "== train --epochs $e"
    python3 tools/train_default_model.py --out /tmp/runs/e$e --epochs "$e" --minutes "$MINUTES" \
      --readme-out models/kvq-code-tiny --note "$note" || return 1
  done
  best=$(python3 -c 'import json, sys
rows = [(json.load(open(d + "/train_summary.json"))["best_val_loss"], d) for d in sys.argv[1:]]
for v, d in sorted(rows): print(f"{d}: best_val_loss {v:.4f}", file=sys.stderr)
print(min(rows)[1])' /tmp/runs/e*) || return 1
  echo "== keeping $best"
  mkdir -p models && cp -r "$best" models/kvq-code-tiny || return 1
  echo "== goldens"
  timeout 240 python3 tools/make_goldens.py --code-model models/kvq-code-tiny --stories "$STORIES" \
    --out tests/fixtures/goldens
}

SECONDS=0
steps 2>&1 | tee "$OUT/log.txt"
rc=$?
echo "rc=$rc wall=${SECONDS}s" | tee -a "$OUT/log.txt"
tar cf "$OUT/artifacts.tar" models/kvq-code-tiny tests/fixtures/goldens 2>/dev/null
exit $rc
