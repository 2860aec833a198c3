#!/usr/bin/env bash
# The Ladder conversion on a real pretrained model (issue 54): a benchmark script, not a test.
#
# SmolLM2-135M-Instruct (30 layers; scripts/fetch_smollm2.py writes it to .cache/smollm2/model),
# on the CPU with ferrolm's release tools:
#   - held-out loss (`eval --text`) of the original model; of the zero-shot conversion with the
#     upper 15 of 30 layers Ladder (the paper's choice) and with all 30;
#   - the same after retraining each (`finetune_ladder`) for the same tokens on the same text,
#     beside the original model trained the same way (`finetune_ladder --ladder-layers 0`: the
#     same trainer, data order and seed; only the residual schedule differs);
#   - greedy chat answers (`generate --chat --temperature 0`) of all six models;
#   - tokens, wall time and tokens/s of each training run.
# Texts (public domain, data/corpus, Project Gutenberg editions of Shakespeare): the training
# text is the plays but the held-out one, in a fixed order, cut to 4 characters per trained token
# plus 40,000 (one pass, no repetition); the held-out text is the first HELDOUT_CHARS characters
# of HELDOUT, which no run trains on. Each training run writes a checkpoint of about 2.1 GB
# (weights and optimizer state): keep 7 GB free under OUT.
#
# Usage: scripts/ladder_real.sh [OUT_DIR]      (default runs/ladder_real)
# Env (sizes): STEPS=80 BATCH=4 SEQ_LEN=256 (tokens trained = STEPS*BATCH*SEQ_LEN per run)
#              LR=1e-4 SEED=1337 HELDOUT=hamlet HELDOUT_CHARS=60000 EVAL_SEQ_LEN=512
#              MAX_NEW_TOKENS=40 UPPER=15 (the layers made Ladder in the "upper" conversion)
#              REUSE=1: keep a training run that finished with the same flags (after an
#              interruption, or to redo only the evaluations)
# Writes OUT/results.md (a markdown table) and prints it; logs are in OUT/*.log.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/ladder_real}
STEPS=${STEPS:-80}
BATCH=${BATCH:-4}
SEQ_LEN=${SEQ_LEN:-256}
LR=${LR:-1e-4}
SEED=${SEED:-1337}
HELDOUT=${HELDOUT:-hamlet}
HELDOUT_CHARS=${HELDOUT_CHARS:-60000}
EVAL_SEQ_LEN=${EVAL_SEQ_LEN:-512}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-40}
UPPER=${UPPER:-15}
MODEL=${MODEL:-.cache/smollm2/model}
PY=${PYTHON:-python3}
NICE=(nice -n "${NICE_LEVEL:-19}")

if [ ! -f "$MODEL/model.safetensors" ]; then
  echo "error: no model at $MODEL: run scripts/fetch_smollm2.py first (or set MODEL=DIR)" >&2
  exit 1
fi
if [ ! -f "data/corpus/$HELDOUT.txt" ]; then
  echo "error: HELDOUT=$HELDOUT: no data/corpus/$HELDOUT.txt" >&2
  exit 2
fi
mkdir -p "$OUT"
cargo build --release --example finetune_ladder --example eval --example generate
bin=target/release/examples
layers=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['num_hidden_layers'])" "$MODEL/config.json")
tokens=$((STEPS * BATCH * SEQ_LEN))

# The texts. About 3.3 characters per token with this tokenizer on Shakespeare; the training
# text gets 4 per token (one pass, no repetition) plus the 5% validation split it is cut into,
# and is cut to that length: the trainer validates three times on the whole split, so a longer
# text would only make those passes longer.
heldout="$OUT/heldout.txt"
head -c "$HELDOUT_CHARS" "data/corpus/$HELDOUT.txt" > "$heldout"
train="$OUT/train/train.txt"
mkdir -p "$OUT/train"
need=$((tokens * 4 + 40000))
plays=()
files=()
have=0
for f in data/corpus/*.txt; do
  [ "$(basename "$f" .txt)" = "$HELDOUT" ] && continue
  [ "$have" -ge "$need" ] && break
  plays+=("$(basename "$f" .txt)")
  files+=("$f")
  have=$((have + $(stat -c %s "$f")))
done
cat "${files[@]}" > "$train.all"
head -c "$need" "$train.all" > "$train"
rm "$train.all"
echo "training text: ${plays[*]} ($(stat -c %s "$train") bytes); held out: the first $HELDOUT_CHARS characters of $HELDOUT"

# A zero-shot conversion is a config change: the same weights, `model_type: llamaLadder` and
# `ladder_layers` in config.json (what `finetune_ladder --steps 0` writes, less the remote-code
# files transformers needs, and without its two validation passes).
zero_shot() { # NAME LADDER_LAYERS
  local d="$OUT/$1"
  mkdir -p "$d"
  for f in "$MODEL"/*; do ln -sf "$(realpath "$f")" "$d/"; done
  rm -f "$d/config.json"
  "$PY" - "$MODEL/config.json" "$d/config.json" "$2" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
v = sys.argv[3]
c["ladder_layers"] = c["num_hidden_layers"] if v == "all" else int(v)
c["model_type"] = "llamaLadder"
c["architectures"] = ["LlamaLadderForCausalLM"]
json.dump(c, open(sys.argv[2], "w"), indent=2)
EOF
}
zero_shot zero_upper "$UPPER"
zero_shot zero_all all

declare -A wall tps val_plain val_before val_after
train_run() { # NAME LADDER_LAYERS
  local name=$1 ll=$2 t0 t1
  local args=(--model "$MODEL" --ladder-layers "$ll" --data "$train" --cache-dir "$OUT/cache" --steps "$STEPS"
    --batch-size "$BATCH" --seq-len "$SEQ_LEN" --lr "$LR" --seed "$SEED" --eval-every 0 --save-every 0)
  if [ "${REUSE:-0}" = 1 ] && [ -f "$OUT/$name.wall" ] && [ "$(cat "$OUT/$name.args")" = "${args[*]}" ]; then
    echo "== $name: reusing the finished run in $OUT/$name (REUSE=1)"
  else
    echo "== finetune_ladder --ladder-layers $ll: $STEPS steps of $BATCH x $SEQ_LEN tokens"
    rm -f "$OUT/$name.wall"
    t0=$(date +%s)
    "${NICE[@]}" "$bin/finetune_ladder" "${args[@]}" --out "$OUT/$name" --overwrite > "$OUT/$name.log" 2>&1 \
      || { echo "error: finetune_ladder failed, see $OUT/$name.log" >&2; tail -5 "$OUT/$name.log" >&2; exit 1; }
    t1=$(date +%s)
    echo "${args[*]}" > "$OUT/$name.args"
    echo $((t1 - t0)) > "$OUT/$name.wall"
  fi
  wall[$name]=$(cat "$OUT/$name.wall")
  # tok/s of the last step line (the trainer's running rate).
  tps[$name]=$(sed -n 's/.* \([0-9.]*\) tok\/s.*/\1/p' "$OUT/$name.log" | tail -1)
  val_plain[$name]=$(sed -n 's/.*plain Llama validation loss \([0-9.]*\).*/\1/p' "$OUT/$name.log" | head -1)
  val_before[$name]=$(sed -n 's/.*validation loss before fine-tuning \([0-9.]*\).*/\1/p' "$OUT/$name.log" | head -1)
  val_after[$name]=$(sed -n 's/.*validation loss after fine-tuning \([0-9.]*\).*/\1/p' "$OUT/$name.log" | head -1)
  grep -E "validation loss" "$OUT/$name.log" || true
}
train_run ft_upper "$UPPER"
train_run ft_all all
train_run ft_orig 0

declare -A loss
names=(original zero_upper zero_all ft_upper ft_all ft_orig)
dir_of() { case $1 in original) echo "$MODEL" ;; zero_*) echo "$OUT/$1" ;; *) echo "$OUT/$1/checkpoints/latest" ;; esac; }
prompts=("What is the capital of France?" "Give me three tips for a good night's sleep.")
for n in "${names[@]}"; do
  d=$(dir_of "$n")
  "${NICE[@]}" "$bin/eval" --model "$d" --text "$heldout" --seq-len "$EVAL_SEQ_LEN" --batch-size 4 > "$OUT/eval_$n.log" 2>&1 \
    || { echo "error: eval failed, see $OUT/eval_$n.log" >&2; exit 1; }
  loss[$n]=$(sed -n 's/^loss \([0-9.]*\) ppl.*/\1/p' "$OUT/eval_$n.log" | tail -1)
  heldout_tokens=$(sed -n 's/.* tokens \([0-9]*\).*/\1/p' "$OUT/eval_$n.log" | tail -1)
  echo "held-out loss $n: ${loss[$n]}"
  for i in "${!prompts[@]}"; do
    "${NICE[@]}" "$bin/generate" --model "$d" --chat "${prompts[$i]}" --temperature 0 \
      --max-new-tokens "$MAX_NEW_TOKENS" > "$OUT/gen_${n}_$i.txt" 2> "$OUT/gen_${n}_$i.log" \
      || { echo "error: generate failed, see $OUT/gen_${n}_$i.log" >&2; exit 1; }
  done
done

label() {
  case $1 in
    original) echo "original SmolLM2-135M-Instruct" ;;
    zero_upper) echo "zero-shot: upper $UPPER of $layers layers Ladder" ;;
    zero_all) echo "zero-shot: all $layers layers Ladder" ;;
    ft_upper) echo "upper $UPPER Ladder, retrained" ;;
    ft_all) echo "all Ladder, retrained" ;;
    ft_orig) echo "original, trained the same (no Ladder layer)" ;;
  esac
}
oneline() { tr '\n' ' ' < "$1" | sed 's/|/\\|/g; s/  */ /g; s/ *$//'; }
{
  echo "$(date -u +%Y-%m-%d) · $(nproc)-core CPU ($(uname -m)) · f32 · training: $STEPS steps of $BATCH × $SEQ_LEN tokens ="
  echo "$tokens tokens per run, lr $LR, seed $SEED, on the first $need characters of data/corpus's ${plays[*]};"
  echo "held out: the first $HELDOUT_CHARS characters of $HELDOUT ($heldout_tokens tokens scored, windows of $EVAL_SEQ_LEN)."
  echo
  echo "| model | held-out loss | Δ vs original | val loss (training text's split) |"
  echo "|---|---:|---:|---:|"
  for n in "${names[@]}"; do
    case $n in
      original) v=${val_plain[ft_orig]:-} ;;
      zero_upper) v=${val_before[ft_upper]:-} ;;
      zero_all) v=${val_before[ft_all]:-} ;;
      *) v=${val_after[$n]:-} ;;
    esac
    delta=$("$PY" -c "import sys; print(f'{float(sys.argv[1]) - float(sys.argv[2]):+.4f}')" "${loss[$n]}" "${loss[original]}")
    echo "| $(label "$n") | ${loss[$n]} | $delta | $v |"
  done
  echo
  echo "| training run | tokens | wall time (s, with 3 validation passes) | tokens/s (trainer) |"
  echo "|---|---:|---:|---:|"
  for n in ft_upper ft_all ft_orig; do
    echo "| $(label "$n") | $tokens | ${wall[$n]} | ${tps[$n]} |"
  done
  echo
  for i in "${!prompts[@]}"; do
    echo "Greedy answers to \"${prompts[$i]}\" ($MAX_NEW_TOKENS new tokens at most):"
    echo
    echo "| model | answer |"
    echo "|---|---|"
    for n in "${names[@]}"; do
      echo "| $(label "$n") | $(oneline "$OUT/gen_${n}_$i.txt") |"
    done
    echo
  done
} > "$OUT/results.md"
echo
cat "$OUT/results.md"
