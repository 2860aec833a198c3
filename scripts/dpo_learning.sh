#!/usr/bin/env bash
# What preference tuning learns from the bundled pairs (issue 52's learning check): a benchmark
# script, not a test.
#
# `dpo` on data/prefs.jsonl (420 pairs, each conversation's own reply chosen, another
# conversation's rejected) from MODEL, validated on data/prefs_val.jsonl (178 pairs of the
# conversations data/prefs.jsonl does not use, no reply of theirs in a training pair), once per
# seed. Per run: the training pairs' rewards/accuracies (the mean over the last quarter of the
# steps: what the policy fits) and the held-out pairs' (`validation after preference tuning`:
# what it learned); chance is 0.5 on both. The reference is MODEL itself, live.
#
# Usage: scripts/dpo_learning.sh [OUT_DIR]          (default runs/dpo_learning)
# Env: MODEL=runs/finetune (the README's fine-tuned checkpoint; any model, run or checkpoint
#        directory with a chat template, e.g. .cache/smollm2/model from scripts/fetch_smollm2.py)
#      STEPS=100 LR=5e-5 BETA=0.1 SEEDS="1 2 3" EVAL_EVERY=STEPS  EXTRA="" (more dpo flags)
# Writes OUT/results.md (a markdown table) and prints it; logs are in OUT/seed-*.log.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/dpo_learning}
MODEL=${MODEL:-runs/finetune}
STEPS=${STEPS:-100}
LR=${LR:-5e-5}
BETA=${BETA:-0.1}
SEEDS=${SEEDS:-1 2 3}
EVAL_EVERY=${EVAL_EVERY:-$STEPS}
read -ra EXTRA_ARGS <<<"${EXTRA:-}"
PY=${PYTHON:-python3}

if [ ! -e "$MODEL" ]; then
  echo "error: MODEL=$MODEL: no such directory (run the README's fine-tuning example, or set MODEL=DIR)" >&2
  exit 1
fi
mkdir -p "$OUT"
cargo build --release --example dpo
bin=target/release/examples

rows=()
for seed in $SEEDS; do
  run="$OUT/seed-$seed"
  echo "== seed $seed: $bin/dpo --model $MODEL --steps $STEPS --lr $LR --beta $BETA ${EXTRA_ARGS[*]}" >&2
  start=$(date +%s)
  "$bin/dpo" --model "$MODEL" --data data/prefs.jsonl --val-data data/prefs_val.jsonl \
    --steps "$STEPS" --lr "$LR" --beta "$BETA" --seed "$seed" --eval-every "$EVAL_EVERY" \
    --save-every "$((STEPS + 1))" --out "$run" --overwrite "${EXTRA_ARGS[@]}" >"$OUT/seed-$seed.log" 2>&1 ||
    { echo "error: seed $seed: dpo failed (exit $?): see $OUT/seed-$seed.log" >&2; tail -n 3 "$OUT/seed-$seed.log" >&2; exit 1; }
  wall=$(($(date +%s) - start))
  rows+=("$("$PY" - "$run/metrics.jsonl" "$seed" "$wall" <<'EOF'
import json, sys
path, seed, wall = sys.argv[1], sys.argv[2], sys.argv[3]
lines = [json.loads(l) for l in open(path) if l.strip()]
train = [l for l in lines if "rewards/accuracies" in l]
val = [l for l in lines if "val_rewards/accuracies" in l]
q = train[len(train) - max(1, len(train) // 4):]
fit = sum(l["rewards/accuracies"] for l in q) / len(q)
curve = ", ".join(f'{l["val_rewards/accuracies"]:.3f}' for l in val)
last = val[-1]
print(f'| {seed} | {fit:.3f} | {curve} | {last["val_rewards/accuracies"]:.3f} | {last["val_rewards/margins"]:.4f} | {last["val_loss"]:.4f} | {wall} |')
EOF
)")
done

{
  echo "DPO on data/prefs.jsonl from $MODEL, validated on data/prefs_val.jsonl: $STEPS steps, lr $LR, beta $BETA ${EXTRA_ARGS[*]}"
  echo
  echo "| seed | training pairs' rewards/accuracies (last quarter) | held-out rewards/accuracies at each validation | held-out rewards/accuracies | held-out rewards/margins | held-out loss | wall (s) |"
  echo "|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee "$OUT/results.md"
