#!/usr/bin/env bash
# GPU perf: the CUDA tests, training speed against PyTorch eager, bench_cuda and a kernel profile,
# each part under its own time limit, all within one short GPU lease (8 minutes on an H200).
# A failed part does not stop the run. `--help` says what each part does and what it writes;
# docs/BENCHMARKS.md ("GPU perf script") says the same.
set -uo pipefail

usage() {
    cat <<'EOF'
usage: gpu_perf.sh [--rehearse] [--parts LIST] [--help]

On a GPU host, from inside a staged tree (bin/, data/, scripts/):  bash scripts/gpu_perf.sh
Rehearsal with no GPU, from the repository root:                   scripts/gpu_perf.sh --rehearse

Parts (in this order; each has its own time limit, and the whole run keeps to GP_BUDGET_S):
  1 tests       every staged bin/test-* with FERROLM_REQUIRE_GPU=1: tests passed and failed   [75 s]
  2 train       pretrain_llama --device cuda:0 --dtype bf16 against scripts/bench_train_torch.py
                (PyTorch eager; torch.compile is skipped: it costs minutes), batch 8 x 1024,
                vocabulary 32000, the same config.json for both sides, at two shapes:
                124m (hidden 768, 12 layers, 12 heads, ffn 2048) and 1b (hidden 2048, 16 layers,
                32 query / 8 kv heads, ffn 8192). Ours: 12 steps, the median tokens_per_s of
                metrics.jsonl after 4 warm-up steps; the run is stopped once its last step is
                logged (the closing validation, checkpoint and sample are not measured). PyTorch:
                3 warm-up and 10 timed steps. Figures: tokens/s, ours/eager, MFU of both by the
                same count, (6 N + 12 L T d) FLOPs per token over FERROLM_PEAK_TFLOPS [989]
                [124m: 45 s ours + 40 s PyTorch; 1b: 75 s + 60 s]
  3 bench_cuda  bench_cuda: every kernel against its floor; its bench_cuda.md and .json kept;
                then (GPU only) scripts/bench_attention_torch.py --ours on its attention rows:
                PyTorch SDPA flash forward and forward+backward beside ours, with TFLOP/s and
                the worst ratios as figures; bench_attention_torch.md kept               [130 s]
  4 profile     pretrain_llama --profile, three steps of the 124m model: launches per step, the
                top kernels and their shares, the largest share of a kernel family other than
                GEMM (nvjet/cuBLAS names) and attention (flash_*, attn_*)                    [50 s]

Outputs in $OUT (the device tool brings back 8 files; these are at most 7, rewritten after every part):
  gpu_perf.md           the Markdown report: one row per part, then the train and profile tables
  gpu_perf.json         one key per part: ok, seconds, limit_s, figures, and "rehearsal": true
                        where the figures mean nothing (every part of a rehearsal)
  gpu_perf_logs.tar.gz  every log, metrics.jsonl, config and PyTorch result (no checkpoints)
  bench_cuda.md, bench_cuda.json   part 3's tables
  bench_attention_torch.md         part 3's attention table against PyTorch (GPU only)
  profile.json          part 4's profile, as pretrain_llama --profile wrote it

Options:
  --rehearse     no GPU: build what is needed (cargo, dev profile), FERROLM_CUDA_EMULATOR=1, tiny
                 shapes and steps, one small CUDA test binary, PyTorch on the CPU when it imports
                 (else its runs are skipped and marked); every figure is marked rehearsal
  --parts LIST   run only these parts, by number or name, e.g. --parts 2,4 or --parts train
  --help         this text

Environment:
  OUT              output folder [default: /tmp/out]
  FERROLM_PYTHON   the Python with torch and transformers [default: python3]
  FERROLM_BIN_DIR  folder of the binaries [default: ./bin of a staged tree, else target/release,
                   else target/debug; the rehearsal uses cargo's dev-profile artifacts]
  GP_BUDGET_S      seconds the whole run may take; a part never runs past it [default: 470 on a
                   GPU, 900 in the rehearsal]
  GP_WORK          working folder for runs and logs [default: a new folder under /tmp]
EOF
}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOG_TAG=gpu-perf
# shellcheck source=gpu_lib.sh
source "$ROOT/scripts/gpu_lib.sh"  # also OUT and PY, with their defaults
parse_args PARTS 1,2,3,4 parts 2,4 part "$@"

NAMES=(_ tests train bench_cuda profile)
# Seconds per part on a GPU host (caps: their sum, 475, is over the budget, which cuts the last
# part only if every part runs to its cap), then in the rehearsal (2 shared cores, the emulator,
# a dev build).
LIMITS=(_ 75 225 130 50)
RLIMITS=(_ 240 300 120 120)
# Train runs: ours, then PyTorch's, per shape (GPU; the rehearsal's are in RTRAIN_LIMIT).
TRAIN_LIMIT_124M=(45 40)
TRAIN_LIMIT_1B=(75 60)
RTRAIN_LIMIT=(120 60)

# --parts: numbers or names, in the canonical order, each once.
want=""
IFS=, read -ra asked <<<"$PARTS"
[ ${#asked[@]} -gt 0 ] || { echo "error: --parts '$PARTS': empty" >&2; exit 2; }
for p in "${asked[@]}"; do
    n=""
    for i in 1 2 3 4; do [ "$p" = "$i" ] || [ "$p" = "${NAMES[$i]}" ] && n=$i; done
    [ -n "$n" ] || { echo "error: --parts '$PARTS': '$p' is not a part (1 tests, 2 train, 3 bench_cuda, 4 profile)" >&2; exit 2; }
    want+=" $n"
done
PART_LIST=""
for i in 1 2 3 4; do [[ " $want " == *" $i "* ]] && PART_LIST+=" $i"; done

# ---------------------------------------------------------------- helpers
# parse_args, jstr, jnum, fig, figs_json, ratio, find_bin, need_bin, write_config, train_data,
# tokenizer, pretrain, metric, median_after, rehearsal_env, cargo_test_bins, test_counts:
# scripts/gpu_lib.sh.

# Seconds left before this part's deadline (GP_DEADLINE, epoch seconds), less $1 of margin.
left() { echo $(( ${GP_DEADLINE:-$(( $(date +%s) + 3600 ))} - $(date +%s) - ${1:-0} )); }

# A sub-step's limit: $1 seconds, or what is left of the part when that is less (at least 1).
within() { local l; l=$(left 2); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }

# pretrain_until RUN STEPS LIMIT ARGS...: pretrain_llama into $RUNS/RUN, stopped (by its process
# id) once metrics.jsonl logs step STEPS: the closing validation, checkpoint and sample are not
# part of a speed figure. Returns 0 when the last step was logged, else the run's exit status.
pretrain_until() {
    local run=$1 steps=$2 limit=$3; shift 3
    local bin; bin=$(need_bin pretrain_llama) || return 1
    local m="$RUNS/$run/metrics.jsonl" pid s=0 t0
    rm -rf "${RUNS:?}/$run"
    (cd "$RUNS" && exec "$bin" --out "$RUNS/$run" --tokenizer "$(tokenizer)" --eval-every 0 --save-every 0 \
        --log-level warn "$@") >"$RUNS/$run.log" 2>&1 &
    pid=$!
    t0=$(date +%s)
    while kill -0 "$pid" 2>/dev/null; do
        if grep -q "\"step\":$steps[,}].*\"tokens_per_s\"\|\"tokens_per_s\".*\"step\":$steps[,}]" "$m" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null; sleep 1; kill -KILL "$pid" 2>/dev/null
            wait "$pid" 2>/dev/null
            echo "stopped after step $steps (the closing validation, checkpoint and sample skipped)" >>"$RUNS/$run.log"
            s=0; break
        fi
        if [ $(( $(date +%s) - t0 )) -ge "$limit" ]; then
            kill -TERM "$pid" 2>/dev/null; sleep 1; kill -KILL "$pid" 2>/dev/null
            wait "$pid" 2>/dev/null
            echo "stopped: the ${limit}s limit ran out before step $steps" | tee -a "$RUNS/$run.log" >&2
            s=124; break
        fi
        sleep 0.5
    done
    if [ "$s" = 0 ] && ! grep -q '^stopped after step' "$RUNS/$run.log"; then
        wait "$pid"; s=$?
    fi
    rm -rf "$RUNS/$run/checkpoints"
    tail -n 3 "$RUNS/$run.log" >&2
    return $s
}

# FLOPs per token of a Llama config at sequence length $2 with $3 parameters (PaLM's count, as
# pretrain_llama's MFU): 6 N + 12 L T d, d = hidden size (query heads x head dim).
flops_per_token() {
    local h l
    h=$(grep -o '"hidden_size": *[0-9]*' "$1" | grep -o '[0-9]*$')
    l=$(grep -o '"num_hidden_layers": *[0-9]*' "$1" | grep -o '[0-9]*$')
    awk -v n="$3" -v l="$l" -v t="$2" -v h="$h" 'BEGIN { if (n + 0 > 0) printf "%.6g", 6 * n + 12 * l * t * h }'
}

# MFU of $1 tokens/s at $2 FLOPs per token over the bf16 dense peak.
mfu() {
    awk -v t="$1" -v f="$2" -v p="${FERROLM_PEAK_TFLOPS:-989}" 'BEGIN { if (t + 0 > 0 && f + 0 > 0) printf "%.4f", t * f / (p * 1e12) }'
}

# ---------------------------------------------------------------- the parts
part1() {
    local bins=() t name passed=0 failed=0 bfail=0 failed_names=""
    if [ "$REHEARSE" = 1 ]; then
        # One small CUDA test binary on the emulator: the rehearsal checks the counting, not the GPU.
        mapfile -t bins < <(cargo_test_bins -p ferrolm-cuda --test pinned)
    else
        local dir; dir=$(dirname "$(find_bin pretrain_llama || echo "$PWD/bin/x")")
        for t in "$dir"/test-*; do [ -x "$t" ] && [ -f "$t" ] && bins+=("$t"); done
    fi
    fig binaries "${#bins[@]}"
    for t in "${bins[@]}"; do
        name=$(basename "$t")
        echo "== $name"
        timeout --kill-after=5 "$(within 60)" "$t" --test-threads=1 >"$RUNS/test_$name.log" 2>&1
        local s=$? p f
        read -r p f < <(test_counts "$RUNS/test_$name.log")
        passed=$((passed + p)); failed=$((failed + f))
        if [ $s -ne 0 ]; then
            bfail=$((bfail + 1)); failed_names+="${failed_names:+ }$name"
            echo "FAILED: $name (exit $s)"; tail -n 15 "$RUNS/test_$name.log"
        fi
    done
    fig tests_passed "$passed"
    fig tests_failed "$failed"
    fig binaries_failed "$bfail"
    fig failed_binaries "$(jstr "$failed_names")"
    echo "tests: $passed passed, $failed failed; binaries failed: $bfail"
    [ ${#bins[@]} -gt 0 ] && [ "$bfail" -eq 0 ]
}

part2() {
    local bs=8 seq=1024 steps=12 warm=4 tsteps=10 twarm=3 ok=0 vocab=32000 torch_ok=1 torch_why=""
    local shapes=(124m 1b) lim_ours lim_torch shape cfg
    if [ "$REHEARSE" = 1 ]; then
        bs=2; seq=16; steps=3; warm=1; tsteps=2; twarm=1; vocab=4096
    fi
    if ! "$PY" -c 'import torch, transformers' >/dev/null 2>&1; then
        torch_ok=0; torch_why="torch or transformers does not import in $PY"
        log "$torch_why"
    fi
    local md="$WORK/md_train.md"
    {
        echo "### train: ferrolm against PyTorch eager (bf16, batch $bs x $seq, vocabulary $vocab)"
        echo
        echo "| shape | ours tok/s | eager tok/s | ours / eager | ours MFU | eager MFU | ours peak MiB | eager peak MiB |"
        echo "|---|---:|---:|---:|---:|---:|---:|---:|"
    } >"$md"
    for shape in "${shapes[@]}"; do
        if [ "$REHEARSE" = 1 ]; then
            # Tiny stand-ins of the two shapes; the second keeps grouped-query attention.
            [ "$shape" = 124m ] && cfg=$(write_config 124m 32 64 2 2 2 "$vocab") || cfg=$(write_config 1b 64 128 2 4 2 "$vocab")
            lim_ours=${RTRAIN_LIMIT[0]}; lim_torch=${RTRAIN_LIMIT[1]}
        elif [ "$shape" = 124m ]; then
            cfg=$(write_config 124m 768 2048 12 12 12 "$vocab"); lim_ours=${TRAIN_LIMIT_124M[0]}; lim_torch=${TRAIN_LIMIT_124M[1]}
        else
            cfg=$(write_config 1b 2048 8192 16 32 8 "$vocab"); lim_ours=${TRAIN_LIMIT_1B[0]}; lim_torch=${TRAIN_LIMIT_1B[1]}
        fi
        # Ours.
        local run="speed_$shape" ours="" oflops="" omfu="" opeak="" params=""
        pretrain_until "$run" "$steps" "$(within "$lim_ours")" --device cuda:0 --dtype bf16 --config "$cfg" \
            --data "$(train_data)" --steps "$steps" --batch-size "$bs" --seq-len "$seq"
        local s=$?
        [ $s -eq 0 ] || { ok=1; log "$shape: pretrain_llama failed or ran out of time (exit $s)"; }
        ours=$(metric "$RUNS/$run/metrics.jsonl" tokens_per_s | median_after "$warm")
        params=$(grep -o 'model: [0-9]* parameters' "$RUNS/$run.log" | head -n 1 | awk '{print $2}')
        oflops=$(flops_per_token "$cfg" "$seq" "$params")
        omfu=$(mfu "$ours" "$oflops")
        opeak=$(metric "$RUNS/$run/metrics.jsonl" peak_tensor_mib | sort -g | tail -n 1)
        fig "${shape}_ours_steps_logged" "$(metric "$RUNS/$run/metrics.jsonl" tokens_per_s | wc -l)"
        fig "${shape}_ours_tokens_per_s" "$(jnum "$ours")"
        fig "${shape}_ours_mfu" "$(jnum "$omfu")"
        fig "${shape}_ours_peak_tensor_mib" "$(jnum "$opeak")"
        fig "${shape}_params" "$(jnum "$params")"
        # PyTorch eager, the same config.json.
        local tj="$RUNS/torch_$shape.json" t="" tmfu="" tpeak="" tparams=""
        if [ "$torch_ok" = 1 ]; then
            local dev=cuda; [ "$REHEARSE" = 1 ] && dev=cpu
            timeout --kill-after=5 "$(within "$lim_torch")" "$PY" "$ROOT/scripts/bench_train_torch.py" --device $dev \
                --shape "$cfg" --batch-size "$bs" --seq-len "$seq" --steps "$tsteps" --warmup "$twarm" --mode eager \
                --json "$tj" >"$RUNS/torch_$shape.log" 2>&1
            s=$?
            [ $s -eq 0 ] || { ok=1; log "$shape: PyTorch eager failed (exit $s)"; tail -n 5 "$RUNS/torch_$shape.log"; }
            t=$(grep -o '"tokens_per_s": [0-9.eE+-]*' "$RUNS/torch_$shape.log" | head -n 1 | awk '{print $2}')
            tpeak=$(grep -o '"peak_mib": [0-9.eE+-]*' "$RUNS/torch_$shape.log" | head -n 1 | awk '{print $2}')
            tparams=$(grep -o '"params": [0-9]*' "$RUNS/torch_$shape.log" | head -n 1 | awk '{print $2}')
            tmfu=$(mfu "$t" "$(flops_per_token "$cfg" "$seq" "$tparams")")
        else
            fig "${shape}_eager_skipped" "$(jstr "$torch_why")"
            [ "$REHEARSE" = 1 ] || ok=1
        fi
        fig "${shape}_eager_tokens_per_s" "$(jnum "$t")"
        fig "${shape}_eager_mfu" "$(jnum "$tmfu")"
        fig "${shape}_eager_peak_mib" "$(jnum "$tpeak")"
        local r; r=$(ratio "$ours" "$t")
        fig "${shape}_ours_over_eager" "$(jnum "$r")"
        echo "$shape: ours ${ours:-?} tok/s (MFU ${omfu:-?}), PyTorch eager ${t:-?} tok/s (MFU ${tmfu:-?}), ratio ${r:-?}"
        awk -v s="$shape" -v a="$ours" -v b="$t" -v r="$r" -v m="$omfu" -v n="$tmfu" -v p="$opeak" -v q="$tpeak" '
            function num(x, f) { return (x == "" || x == "null") ? "-" : sprintf(f, x) }
            function pct(x) { return (x == "" || x == "null") ? "-" : sprintf("%.1f%%", x * 100) }
            BEGIN { printf "| %s | %s | %s | %s | %s | %s | %s | %s |\n", s, num(a, "%.0f"), num(b, "%.0f"), num(r, "%.3g"),
                    pct(m), pct(n), num(p, "%.0f"), num(q, "%.0f") }' >>"$md"
        [ -n "$ours" ] && [ "$ours" != null ] || ok=1
    done
    [ "$torch_ok" = 1 ] || { echo; echo "PyTorch: $torch_why (its figures are null)"; } >>"$md"
    return $ok
}

part3() {
    local bin args=() s
    bin=$(need_bin bench_cuda) || return 1
    [ "$REHEARSE" = 1 ] && args=(--quick --reps 10)
    mkdir -p "$WORK/bench"
    rm -f "$WORK/bench/bench_cuda.json" "$WORK/bench/bench_cuda.md"
    OUT="$WORK/bench" "$bin" "${args[@]}" --log-level warn
    s=$?
    cp -f "$WORK/bench/bench_cuda.md" "$WORK/bench/bench_cuda.json" "$OUT/" 2>/dev/null
    local md="$WORK/bench/bench_cuda.md" gemm copy rows
    gemm=$(grep 'GEMM' "$md" 2>/dev/null | grep -o '[0-9.]* TFLOP/s' | head -n 1 | awk '{print $1}')
    copy=$(grep 'device copy' "$md" 2>/dev/null | grep -o '[0-9.]* GB/s' | head -n 1 | awk '{print $1}')
    rows=$(awk '/^## Kernels/ {k = 1} /^## / && !/Kernels/ {k = 0} k && /^\| [^-k]/ {n++} END {print n + 0}' "$md" 2>/dev/null)
    fig kernel_rows "$(jnum "${rows:-0}")"
    fig gemm_tflops "$(jnum "$gemm")"
    fig copy_gb_s "$(jnum "$copy")"
    [ -s "$OUT/bench_cuda.json" ] && fig outputs "$(jstr "bench_cuda.md, bench_cuda.json")"
    [ "$REHEARSE" = 1 ] || attention_vs_torch
    [ $s -eq 0 ] && [ -s "$WORK/bench/bench_cuda.json" ]
}

# PyTorch SDPA (flash) on bench_cuda's attention shapes, beside ours (issue 32's table). A GPU
# and a torch that imports are needed; its failure does not fail part 3.
attention_vs_torch() {
    [ -s "$WORK/bench/bench_cuda.json" ] || return 0
    if ! "$PY" -c "import torch" >/dev/null 2>&1; then
        fig attention_torch_skipped "$(jstr "torch does not import in $PY")"
        return 0
    fi
    OUT="$WORK/bench" timeout --kill-after=5 "$(within 45)" "$PY" "$ROOT/scripts/bench_attention_torch.py" \
        --ours "$WORK/bench/bench_cuda.json" >"$WORK/bench/bench_attention_torch.log" 2>&1
    local js="$WORK/bench/bench_attention_torch.json" worst worst_fwd
    [ -s "$js" ] || { fig attention_torch_failed true; return 0; }
    cp -f "$WORK/bench/bench_attention_torch.md" "$OUT/" 2>/dev/null
    worst=$(grep -o '"ratio": *[0-9.]*' "$js" | grep -o '[0-9.]*$' | sort -g | head -n 1)
    worst_fwd=$(grep -o '"fwd_ratio": *[0-9.]*' "$js" | grep -o '[0-9.]*$' | sort -g | head -n 1)
    fig attention_worst_fwd_bwd_ratio "$(jnum "$worst")"
    fig attention_worst_fwd_ratio "$(jnum "$worst_fwd")"
}

# The summary of a profile.json (see --help): figures, and the Markdown table of the top kernels.
profile_summary() {
    local pj=$1 flat kernels
    flat=$(tr -d '\n\r' <"$pj")
    # The top-level numbers: the text with every [...] list (kernels, grids) cut out, whatever
    # order the keys come in.
    local head
    head=$(awk '{ out = ""; d = 0; n = length($0)
                  for (i = 1; i <= n; i++) { c = substr($0, i, 1); if (c == "[") d++; if (d == 0) out = out c; if (c == "]") d-- }
                  print out }' <<<"$flat")
    local k
    for k in launches_per_step ms_per_step launches steps total_ms; do
        fig "$k" "$(jnum "$(grep -o "\"$k\": *-\?[0-9][0-9.eE+-]*" <<<"$head" | head -n 1 | sed 's/.*: *//')")"
    done
    fig timed "$(grep -o '"timed": *\(true\|false\)' <<<"$head" | head -n 1 | sed 's/.*: *//' | grep . || echo null)"
    fig device "$(jstr "$(grep -o '"device": *"[^"]*"' <<<"$head" | head -n 1 | sed 's/.*: *"//; s/"$//')")"
    # One kernel per line: name, launches, total_ms, share.
    kernels=$(grep -o '{[^{}]*}' <<<"${flat#*\"kernels\"}" | awk '
        function val(s, k,   r) { if (match(s, "\"" k "\": *[-0-9.eE+]+")) { r = substr(s, RSTART, RLENGTH); sub(/.*: */, "", r); return r } return "" }
        { name = ""; if (match($0, /"name": *"[^"]*"/)) { name = substr($0, RSTART, RLENGTH); sub(/^"name": *"/, "", name); sub(/"$/, "", name) }
          if (name != "") printf "%s\t%s\t%s\t%s\n", name, val($0, "launches"), val($0, "total_ms"), val($0, "share") }')
    [ -n "$kernels" ] || { log "profile.json lists no kernels"; return 1; }
    fig kernels "$(wc -l <<<"$kernels")"
    # The top 8 (the file is sorted by total_ms; sort again in case).
    local top; top=$(sort -t$'\t' -k3,3gr <<<"$kernels" | head -n 8)
    fig top_kernels "[$(awk -F'\t' '{printf "%s{\"name\":\"%s\",\"launches\":%s,\"total_ms\":%s,\"share\":%s}", (NR > 1 ? "," : ""), $1, ($2 == "" ? "null" : $2), ($3 == "" ? "null" : $3), ($4 == "" ? "null" : $4)}' <<<"$top")]"
    # Families: GEMM (cuBLAS/cuBLASLt/nvjet/cutlass names), attention (flash_*, attn_*), else the
    # name up to its first dtype component (binary_bf16 -> binary, strided_copy_b16 -> strided_copy).
    local fam; fam=$(awk -F'\t' '
        function family(n,   parts, m, i, f) {
            if (n ~ /^(nvjet|cublas|cutlass|sm[0-9]+_xmma|ampere_|hopper_)/ || n ~ /gemm/) return "GEMM"
            if (n ~ /^(flash_|attn_)/) return "attention"
            m = split(n, parts, "_"); f = ""
            for (i = 1; i <= m; i++) {
                if (parts[i] ~ /^(f16|bf16|f32|f64|b8|b16|b32|b64|i8|i16|i32|i64|u8|u16|u32|u64)$/) break
                f = f (f == "" ? "" : "_") parts[i]
            }
            return f == "" ? n : f
        }
        { s[family($1)] += $4 }
        END { for (f in s) printf "%s\t%.4f\n", f, s[f] }' <<<"$kernels" | sort -t$'\t' -k2,2gr)
    local gemm attn other other_share
    gemm=$(awk -F'\t' '$1 == "GEMM" {print $2}' <<<"$fam")
    attn=$(awk -F'\t' '$1 == "attention" {print $2}' <<<"$fam")
    read -r other other_share < <(awk -F'\t' '$1 != "GEMM" && $1 != "attention" {print $1, $2; exit}' <<<"$fam")
    fig gemm_share "$(jnum "${gemm:-0}")"
    fig attention_share "$(jnum "${attn:-0}")"
    fig top_other_family "$(jstr "${other:-}")"
    fig top_other_family_share "$(jnum "${other_share:-}")"
    {
        echo "### profile: three training steps of the 124m model"
        echo
        echo "launches per step: $(grep -o '"launches_per_step": *[0-9.eE+-]*' <<<"$head" | sed 's/.*: *//'), timed: $(grep -o '"timed": *[a-z]*' <<<"$head" | sed 's/.*: *//'); GEMM share ${gemm:-0}, attention ${attn:-0}, largest other family \`${other:-none}\` ${other_share:-}"
        echo
        echo "| kernel | launches | total ms | share |"
        echo "|---|---:|---:|---:|"
        awk -F'\t' '{printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4}' <<<"$top"
        echo
        echo "| family | share |"
        echo "|---|---:|"
        head -n 6 <<<"$fam" | awk -F'\t' '{printf "| %s | %s |\n", $1, $2}'
    } >"$WORK/md_profile.md"
    echo "launches per step: $(grep -o '"launches_per_step": *[0-9.eE+-]*' <<<"$head" | sed 's/.*: *//'); largest other family: ${other:-none} ${other_share:-}"
}

part4() {
    local bs=8 seq=1024 steps=3 cfg data s run=profile_124m
    if [ "$REHEARSE" = 1 ]; then
        bs=2; seq=16; steps=2
        cfg=$(write_config profile 32 64 2 2 2 4096)
        data=$(train_data 20000)
    else
        cfg=$(write_config 124m 768 2048 12 12 12 32000)
        data=$(train_data)
    fi
    # Run to its end (the part's own limit bounds it): the profile is written when the tool exits.
    pretrain "$run" --device cuda:0 --dtype bf16 --config "$cfg" --data "$data" --steps "$steps" --batch-size "$bs" \
        --seq-len "$seq" --profile
    s=$?
    rm -rf "$RUNS/$run/checkpoints"
    fig steps_asked "$steps"
    fig pretrain_exit "$s"
    local pj="$RUNS/$run/profile.json"
    if [ ! -s "$pj" ]; then
        log "no $pj (pretrain_llama exit $s): does this build have --profile?"
        tail -n 5 "$RUNS/$run.log"
        return 1
    fi
    cp -f "$pj" "$OUT/profile.json"
    # The steps' wall time beside their device time: the gap is the device waiting for the host.
    local wall
    wall=$(metric "$RUNS/$run/metrics.jsonl" tokens_per_s | awk -v t=$((bs * seq)) '$1 > 0 {print 1000 * t / $1}' | median_after 1)
    fig wall_ms_per_step "$(jnum "$wall")"
    profile_summary "$pj" && [ $s -eq 0 ]
}

# ---------------------------------------------------------------- one part (a child under timeout)
if [ -n "$INTERNAL" ]; then
    FIGS="$WORK/figs_${NAMES[$INTERNAL]}.tsv"
    "part$INTERNAL"
    exit $?
fi

# ---------------------------------------------------------------- the report
# gpu_perf.json from the parts' records ($WORK/part_NAME.json, one object each).
write_json() {
    local i f body=""
    for i in 1 2 3 4; do
        f="$WORK/part_${NAMES[$i]}.json"
        [ -s "$f" ] && body+=",$(jstr "${NAMES[$i]}"):$(cat "$f")"
    done
    printf '{"script":"gpu_perf.sh","mode":%s,"date":%s,"host":%s,"gpu":%s,"budget_s":%s%s}\n' \
        "$(jstr "$([ "$REHEARSE" = 1 ] && echo rehearsal || echo gpu)")" "$(jstr "$(date -u '+%Y-%m-%d %H:%M UTC')")" \
        "$(jstr "$(uname -n)")" "$(jstr "$GPU_NAME")" "$BUDGET" "$body" >"$OUT/gpu_perf.json"
}

write_md() {
    local i f
    {
        echo "# GPU perf"
        echo
        echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'), host $(uname -n), $(nproc 2>/dev/null || echo '?') cores, GPU: $GPU_NAME"
        echo "- mode: $([ "$REHEARSE" = 1 ] && echo 'rehearsal on the CUDA emulator: every figure is marked rehearsal and means nothing' || echo GPU)"
        echo "- command: \`$GP_COMMAND\`, budget ${BUDGET} s"
        echo
        echo "| part | name | ok | seconds | limit s | rehearsal | figures |"
        echo "|---:|---|---|---:|---:|---|---|"
        for i in 1 2 3 4; do
            f="$WORK/row_${NAMES[$i]}.md"
            [ -s "$f" ] && cat "$f"
        done
        for f in "$WORK/md_train.md" "$WORK/md_profile.md"; do
            [ -s "$f" ] && { echo; cat "$f"; }
        done
        echo
        echo "Logs, metrics and configs: \`gpu_perf_logs.tar.gz\`; kernel tables: \`bench_cuda.md\`, \`profile.json\`."
    } >"$OUT/gpu_perf.md"
}

# All logs in one archive (no checkpoints, no tokenized data).
write_archive() {
    tar -czf "$OUT/gpu_perf_logs.tar.gz.tmp" -C "$WORK" --exclude='*/checkpoints' --exclude='runs/cache' \
        --exclude='data' --exclude='*.tsv' . 2>/dev/null
    mv -f "$OUT/gpu_perf_logs.tar.gz.tmp" "$OUT/gpu_perf_logs.tar.gz"
}

# ---------------------------------------------------------------- the run
mkdir -p "$OUT" || { echo "error: cannot create OUT=$OUT" >&2; exit 2; }
WORK=${GP_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_perf.XXXXXX")}
RUNS="$WORK/runs"
mkdir -p "$RUNS" || { echo "error: cannot create GP_WORK=$WORK" >&2; exit 2; }
GP_COMMAND="scripts/gpu_perf.sh$([ "$REHEARSE" = 1 ] && echo ' --rehearse') --parts $(echo $PART_LIST | tr ' ' ,)"
BUDGET=${GP_BUDGET_S:-$([ "$REHEARSE" = 1 ] && echo 900 || echo 470)}
[[ "$BUDGET" =~ ^[0-9]+$ ]] || { echo "error: GP_BUDGET_S '$BUDGET' is not a number of seconds" >&2; exit 2; }
GPU_NAME=none
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    GPU_NAME=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1)
fi
start=$(date +%s)
if [ "$REHEARSE" = 1 ]; then
    rehearsal_env
    GPU_NAME="emulator"
    log "rehearsal: building the examples and one CUDA test (dev profile)"
    t0=$(date +%s)
    (cd "$ROOT" && cargo build --examples -q && cargo test -p ferrolm-cuda --test pinned --no-run -q) ||
        log "build failed: the parts that need it will fail"
    log "build: $(( $(date +%s) - t0 )) s (not counted in the budget)"
    start=$(date +%s)
    export FERROLM_BIN_DIR=${FERROLM_BIN_DIR:-$(target_dir)/debug/examples}
else
    export FERROLM_REQUIRE_GPU=1
fi
export OUT PY REHEARSE WORK RUNS
# Only the run's own outputs go to $OUT: the device tool brings back 8 files.
rm -f "$OUT/gpu_perf.json" "$OUT/gpu_perf.md" "$OUT/gpu_perf_logs.tar.gz" "$OUT/profile.json" \
    "$OUT/bench_cuda.md" "$OUT/bench_cuda.json" "$OUT/bench_attention_torch.md"
for part in $PART_LIST; do
    name=${NAMES[$part]}
    limit=$([ "$REHEARSE" = 1 ] && echo "${RLIMITS[$part]}" || echo "${LIMITS[$part]}")
    # Never past the budget: keep 10 s for the report.
    rest=$(( start + BUDGET - $(date +%s) - 10 ))
    [ "$rest" -lt "$limit" ] && limit=$rest
    FIGS="$WORK/figs_$name.tsv"; rm -f "$FIGS"; : >"$FIGS"
    t0=$(date +%s.%N)
    if [ "$limit" -lt 10 ]; then
        log "part $part ($name): skipped, the budget of ${BUDGET}s is spent"
        fig skipped "$(jstr "budget spent")"
        s=1
    else
        log "part $part ($name), limit ${limit}s"
        GP_DEADLINE=$(( $(date +%s) + limit )) timeout --kill-after=5 "$limit" bash "$0" --internal-part "$part" \
            $([ "$REHEARSE" = 1 ] && echo --rehearse) >"$WORK/part$part.log" 2>&1
        s=$?
        tail -n 6 "$WORK/part$part.log" | sed 's/^/    /' >&2
    fi
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    { [ $s -eq 124 ] || [ $s -eq 137 ]; } && fig timed_out true
    [ $s -ne 0 ] && fig exit "$s"
    ok=$([ $s -eq 0 ] && echo true || echo false)
    reh=""; [ "$REHEARSE" = 1 ] && reh=',"rehearsal":true'
    printf '{"ok":%s,"seconds":%s,"limit_s":%s%s,"figures":%s}\n' "$ok" "$(jnum "$secs")" "$limit" "$reh" \
        "$(figs_json "$FIGS")" >"$WORK/part_$name.json"
    # The summary row: scalar figures only (lists are in the tables below it).
    figs_md=$(awk -F'\t' '$2 !~ /^[[{]/ {gsub(/"/, "", $2); gsub(/\|/, "\\|", $2); printf "%s%s: %s", (n++ ? ", " : ""), $1, $2}' "$FIGS")
    printf '| %d | %s | %s | %s | %s | %s | %s |\n' "$part" "$name" "$([ "$ok" = true ] && echo yes || echo '**FAILED**')" \
        "$secs" "$limit" "$([ "$REHEARSE" = 1 ] && echo yes)" "$figs_md" >"$WORK/row_$name.md"
    write_json
    write_md
    write_archive
done
log "done in $(( $(date +%s) - start )) s: $OUT/gpu_perf.md, $OUT/gpu_perf.json, $OUT/gpu_perf_logs.tar.gz"
