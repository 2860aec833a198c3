#!/usr/bin/env bash
# Ladder quality check (issue 8): a benchmark script, not a test.
#   1. From scratch on the bundled corpus, same config, steps and seed: standard Llama vs
#      all-Ladder vs upper-half Ladder; final validation losses side by side.
#   2. Conversion: the standard model from (1), its upper half converted to Ladder, validation
#      loss before and after a short fine-tune, beside the unconverted model fine-tuned the same
#      way (so the comparison is not just "more training").
# Usage: scripts/ladder_quality.sh [OUT_DIR]   (env: STEPS=500 FT_STEPS=100 CONFIG=tiny SEED=1337)
# Prints a markdown table at the end; docs/LADDER.md records one run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/ladder_quality}
STEPS=${STEPS:-500}
FT_STEPS=${FT_STEPS:-100}
CONFIG=${CONFIG:-tiny}
SEED=${SEED:-1337}
mkdir -p "$OUT"
cargo build --release --example pretrain_llama --example finetune_ladder
bin=target/release/examples
case $CONFIG in
  tiny) layers=4 ;;
  small) layers=8 ;;
  *) layers=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['num_hidden_layers'])" "$CONFIG") ;;
esac
half=$((layers / 2))

declare -A val
for name in standard all upper_half; do
  case $name in
    standard) extra=() ;;
    all) extra=(--ladder-layers all) ;;
    upper_half) extra=(--ladder-layers "$half") ;;
  esac
  echo "== pretrain $name (${extra[*]:-standard}) for $STEPS steps"
  "$bin/pretrain_llama" --config "$CONFIG" --steps "$STEPS" --seed "$SEED" --eval-every 0 --save-every 0 \
    --out "$OUT/$name" --overwrite "${extra[@]}" > "$OUT/$name.log" 2>&1
  # The whole validation split, as pretrain_llama reports it at the end.
  val[$name]=$(sed -n 's/^final validation loss \([0-9.]*\).*/\1/p' "$OUT/$name.log")
  grep "^final validation loss" "$OUT/$name.log"
done

ckpt=$(ls -d "$OUT"/standard/checkpoints/*/ | sort | tail -1)
echo "== convert the upper $half layers of $ckpt and fine-tune $FT_STEPS steps"
"$bin/finetune_ladder" --model "$ckpt" --ladder-layers "$half" --steps "$FT_STEPS" --eval-every 0 --save-every 0 \
  --out "$OUT/converted" --overwrite 2>&1 | tee "$OUT/converted.log" | grep -i "loss" | tail -4
echo "== the unconverted model fine-tuned the same way (no Ladder layers)"
"$bin/finetune_ladder" --model "$ckpt" --ladder-layers 0 --steps "$FT_STEPS" --eval-every 0 --save-every 0 \
  --out "$OUT/unconverted" --overwrite 2>&1 | tee "$OUT/unconverted.log" | grep -i "loss" | tail -4

echo
echo "| from scratch ($CONFIG, $STEPS steps, seed $SEED) | final val loss |"
echo "|---|---|"
echo "| standard Llama | ${val[standard]} |"
echo "| all-Ladder | ${val[all]} |"
echo "| upper-half Ladder (last $half of $layers) | ${val[upper_half]} |"
echo
echo "| conversion (upper $half layers) | val loss |"
echo "|---|---|"
num() { sed -n "s/.*$1 \([0-9.]*\).*/\1/p" "$OUT/converted.log" | head -1; }
echo "| pretrained Llama (unconverted) | $(num 'plain Llama validation loss') |"
echo "| converted, before fine-tune | $(num 'before fine-tuning') |"
echo "| converted, after $FT_STEPS steps | $(num 'after fine-tuning') |"
echo "| unconverted, after the same $FT_STEPS steps | $(sed -n 's/.*after fine-tuning \([0-9.]*\).*/\1/p' "$OUT/unconverted.log" | head -1) |"
