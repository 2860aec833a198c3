#!/usr/bin/env bash
# GPU perf: the CUDA tests, training speed against PyTorch (eager and torch.compile), bench_cuda,
# a kernel profile, bitwise determinism and resume, optimizer offload, the fused head's memory and
# fine-tuning steps (full, LoRA, QLoRA, DPO) against PyTorch, each part under its own
# time limit, the whole run within a budget (GP_BUDGET_S) that fits a short GPU lease. A failed
# part does not stop the run. `--help` says what each part does and what it writes;
# docs/BENCHMARKS.md ("GPU perf script", and its call plans) says the same.
set -uo pipefail

usage() {
    cat <<'EOF'
usage: gpu_perf.sh [--rehearse] [--parts LIST] [--help]

On a GPU host, from inside a staged tree (bin/, data/, scripts/):  bash scripts/gpu_perf.sh
Rehearsal with no GPU, from the repository root:                   scripts/gpu_perf.sh --rehearse

Parts (in this order; each has its own time limit, and the whole run keeps to GP_BUDGET_S):
  1 tests       every staged bin/test-* with FERROLM_REQUIRE_GPU=1: tests passed and failed  [120 s]
  2 train       pretrain_llama --device cuda:0 --dtype bf16 against scripts/bench_train_torch.py
                (PyTorch eager at both shapes, torch.compile at 124m), batch 8 x 1024,
                vocabulary 32000, the same config.json for both sides, at two shapes:
                124m (hidden 768, 12 layers, 12 heads, ffn 2048) and 1b (hidden 2048, 16 layers,
                32 query / 8 kv heads, ffn 8192). Ours: 12 steps, the median tokens_per_s of
                metrics.jsonl after 4 warm-up steps; the run is stopped once its last step is
                logged (the closing validation, checkpoint and sample are not measured). PyTorch:
                3 warm-up and 10 timed steps; torch.compile compiles in its warm-up steps, which
                are not timed, and its compile time is reported apart (compile_s). Figures:
                tokens/s, ours/eager, ours/compile, MFU of each by the same count,
                (6 N + 12 L T d) FLOPs per token over FERROLM_PEAK_TFLOPS [989]
                [124m: 45 s ours + 40 s eager + 120 s compile; 1b: 75 s + 60 s]
  3 bench_cuda  bench_cuda: every kernel against its floor, QLoRA's nf4_dequant rows included
                (figure nf4_dequant_floor_over_time) (GP_ATTENTION_ONLY=1: attention only,
                bench_cuda --attention-only); its bench_cuda.md and .json kept; then (GPU only)
                scripts/bench_attention_torch.py --ours on its attention rows: PyTorch SDPA flash
                forward and forward+backward beside ours, with TFLOP/s and the worst ratios as
                figures; bench_attention_torch.md kept                                     [130 s]
  4 profile     pretrain_llama --profile, three steps of the 124m model: launches per step, the
                top kernels and their shares, the largest share of a kernel family other than
                GEMM (nvjet/cuBLAS names) and attention (flash_*, attn_*), and gemm_fallbacks
                (fused GEMMs cuBLASLt refused, composed from separate kernels; target 0)    [50 s]
  5 determinism the 124m model twice for 20 steps, bf16, the same seed, a checkpoint every 10
                steps: same_bits_rerun (every loss and the final model.safetensors bitwise
                equal); then the first run's step-10 checkpoint resumed to step 20:
                same_bits_resume (its losses and final weights against the first run's)    [150 s]
  6 offload     optimizer offload to pinned host memory (--offload-optimizer), batch 2 x 1024,
                activation checkpointing, on the largest Llama of the 7B's width (32 layers,
                else fewer) whose host state (18 B a parameter with every subgroup on the CPU,
                plus 12 GiB) fits the host's memory, or GP_OFFLOAD_SHAPE: the step time of
                all-CPU offload (--offload-gpu-every inf), DOS with the model's k (auto), no
                offload (where the memory estimator lets it run), and a short sweep of k
                (GP_OFFLOAD_KS) while time is left, each beside bench_offload's prediction
                (fed the rates the auto run measured); the figure is dos_over_all_cpu. A 7B
                run costs minutes of start-up (initialisation, pinning): a call of its own  [540 s]
  7 head_memory the fused LM head's memory at Llama-3.2-1B's shape (issue 43): V 128256, tied,
                hidden 2048, 16 layers, 32 query / 8 kv heads, ffn 8192, bf16, batch 8 x 2048;
                three steps each of ours with the head fused in chunks (the default chunk), ours
                unfused (--loss-chunk-tokens 0) and PyTorch eager (1 warm-up, 2 timed steps):
                the peak of each (ours: the largest peak_tensor_mib of metrics.jsonl; PyTorch:
                torch.cuda.max_memory_allocated) and fused_over_eager_peak (target <= 0.6)
                [90 s + 90 s + 60 s]
  8 finetune    fine-tuning steps at part 2's 1b shape (vocabulary 32000), bf16, from a starting
                checkpoint of one pretrain_llama step (--save-every 1, stopped once saved): finetune
                with LoRA (--lora-rank 16), QLoRA (--lora-rank 16 --quantize-base nf4) and dpo
                (--lora-rank 16, sigmoid loss, the reference the base with the adapters off; 4
                generated standard pairs a step, each sequence cut to one 1024-token row), then
                full fine-tuning; finetune on token windows of the bundled corpus, batch 8 x 1024.
                Ours: 12 steps, the median tokens_per_s after 4 warm-up steps (stopped once the
                last step is logged), the largest peak_tensor_mib. Beside each, in the same call,
                scripts/bench_finetune_torch.py on the same config.json: plain torch and
                transformers (full: fp32 weights under bf16 autocast; LoRA: a bf16 frozen base,
                fp32 rank-16 adapters on q,k,v,o,gate,up,down; dpo: that policy, the reference
                with the adapters off under no_grad; qlora: bitsandbytes' nf4 Linear4bit, only
                where bitsandbytes imports, else qlora_torch_skipped says why), 3 warm-up and 10
                timed steps, max_memory_allocated. Figures: MODE_tokens_per_s,
                MODE_torch_tokens_per_s, MODE_over_torch (lora_over_torch, qlora_over_torch,
                dpo_over_torch, full_over_torch), MODE_peak_tensor_mib, MODE_torch_peak_mib,
                qlora_over_lora, qlora_over_lora_peak, lora_over_full. A failed run does not stop
                the others
                [checkpoint 90 s; 60 s each of ours; 60 s each of PyTorch's]

Every part that trains also reports gemm_fallback_runs: its runs whose log says cuBLASLt refused
a fused GEMM ("composing such GEMMs"); gpu_perf.json's top-level gemm_fallbacks holds the
profile's count and those runs (target: 0 and none).

Outputs in $OUT (the device tool brings back 8 files; these are at most 7, rewritten after every part):
  gpu_perf.md           the Markdown report: one row per part, then the train, profile,
                        determinism, offload, head_memory and finetune tables
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
  OUT                output folder [default: /tmp/out]
  FERROLM_PYTHON     the Python with torch and transformers [default: python3]
  FERROLM_BIN_DIR    folder of the binaries [default: ./bin of a staged tree, else
                     target/release, else target/debug; the rehearsal uses cargo's dev-profile
                     artifacts]
  GP_BUDGET_S        seconds the whole run may take; a part never runs past it [default: 470
                     on a GPU, 900 in the rehearsal]
  GP_WORK            working folder for runs and logs [default: a new folder under /tmp]
  GP_ATTENTION_ONLY  1: part 3 times attention only (bench_cuda --attention-only)
  GP_OFFLOAD_SHAPE   part 6's model: 7b, 7b-l28, 7b-l24, 7b-l16 or 1b [default: the largest of
                     the 7b ones whose host state fits]
  GP_OFFLOAD_KS      part 6's sweep of k [default: 1 2 4 8]
  GP_COMMIT          the commit the staged binaries were built from, recorded in the reports
                     [default: git rev-parse of the tree the script runs from]
EOF
}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOG_TAG=gpu-perf
# shellcheck source=gpu_lib.sh
source "$ROOT/scripts/gpu_lib.sh"  # also OUT and PY, with their defaults
parse_args PARTS 1,2,3,4,5,6,7,8 parts 2,4 part "$@"

NAMES=(_ tests train bench_cuda profile determinism offload head_memory finetune)
NPARTS=8
# Seconds per part on a GPU host (caps, not expected times: the budget cuts a part that would
# run past it), then in the rehearsal (2 shared cores, the emulator, a dev build).
LIMITS=(_ 120 345 130 50 150 540 245 360)
RLIMITS=(_ 240 420 120 120 180 240 150 300)
# Train runs: ours, then PyTorch eager's, then torch.compile's (124m only), per shape (GPU; the
# rehearsal's are in RTRAIN_LIMIT).
TRAIN_LIMIT_124M=(45 40 120)
TRAIN_LIMIT_1B=(75 60)
RTRAIN_LIMIT=(120 60 120)
# Finetune runs (part 8): the starting checkpoint, each of ours, each of PyTorch's (GPU, rehearsal).
FT_LIMIT=(90 60 60)
RFT_LIMIT=(120 120 60)

# --parts: numbers or names, in the canonical order, each once.
want=""
IFS=, read -ra asked <<<"$PARTS"
[ ${#asked[@]} -gt 0 ] || { echo "error: --parts '$PARTS': empty" >&2; exit 2; }
for p in "${asked[@]}"; do
    n=""
    for i in $(seq 1 $NPARTS); do [ "$p" = "$i" ] || [ "$p" = "${NAMES[$i]}" ] && n=$i; done
    [ -n "$n" ] || {
        echo "error: --parts '$PARTS': '$p' is not a part (1 tests, 2 train, 3 bench_cuda, 4 profile, 5 determinism, 6 offload, 7 head_memory, 8 finetune)" >&2
        exit 2
    }
    want+=" $n"
done
PART_LIST=""
for i in $(seq 1 $NPARTS); do [[ " $want " == *" $i "* ]] && PART_LIST+=" $i"; done

# ---------------------------------------------------------------- helpers
# parse_args, jstr, jnum, fig, figs_json, ratio, find_bin, need_bin, write_config, train_data,
# tokenizer, pretrain, metric, median_after, rehearsal_env, cargo_test_bins, test_counts:
# scripts/gpu_lib.sh.

# Seconds left before this part's deadline (GP_DEADLINE, epoch seconds), less $1 of margin.
left() { echo $(( ${GP_DEADLINE:-$(( $(date +%s) + 3600 ))} - $(date +%s) - ${1:-0} )); }

# A sub-step's limit: $1 seconds, or what is left of the part when that is less (at least 1).
within() { local l; l=$(left 2); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }

# pretrain_until RUN STEPS LIMIT ARGS...: pretrain_llama (GP_TOOL: another training tool with its
# flags, finetune or dpo) into $RUNS/RUN, stopped (by its process
# id) once metrics.jsonl logs step STEPS: the closing validation, checkpoint and sample are not
# part of a speed figure. Returns 0 when the last step was logged, else the run's exit status.
# With SAVE_EVERY set, it checkpoints every SAVE_EVERY steps and is stopped only once the
# checkpoint of step STEPS is saved (the sample after it is skipped), and keeps its checkpoints.
pretrain_until() {
    local run=$1 steps=$2 limit=$3; shift 3
    local bin; bin=$(need_bin "${GP_TOOL:-pretrain_llama}") || return 1
    local m="$RUNS/$run/metrics.jsonl" pid s=0 t0 saved
    saved="saved checkpoint .*$(printf 'step-%06d' "$steps")"
    rm -rf "${RUNS:?}/$run"
    (cd "$RUNS" && exec "$bin" --out "$RUNS/$run" --tokenizer "$(tokenizer)" --eval-every 0 --save-every "${SAVE_EVERY:-0}" \
        --log-level warn "$@") >"$RUNS/$run.log" 2>&1 &
    pid=$!
    t0=$(date +%s)
    while kill -0 "$pid" 2>/dev/null; do
        if { [ -z "${SAVE_EVERY:-}" ] && grep -q "\"step\":$steps[,}].*\"tokens_per_s\"\|\"tokens_per_s\".*\"step\":$steps[,}]" "$m" 2>/dev/null; } ||
            { [ -n "${SAVE_EVERY:-}" ] && grep -q "$saved" "$RUNS/$run.log" 2>/dev/null; }; then
            kill -TERM "$pid" 2>/dev/null; sleep 1; kill -KILL "$pid" 2>/dev/null
            wait "$pid" 2>/dev/null
            if [ -n "${SAVE_EVERY:-}" ]; then
                echo "stopped after step $steps (its checkpoint saved; the sample skipped)" >>"$RUNS/$run.log"
            else
                echo "stopped after step $steps (the closing validation, checkpoint and sample skipped)" >>"$RUNS/$run.log"
            fi
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
    [ -n "${SAVE_EVERY:-}" ] || rm -rf "$RUNS/$run/checkpoints"
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

# The runs among $@ whose log says cuBLASLt refused a fused GEMM and it was composed from
# separate kernels (backend.rs prints it once a process): the figure gemm_fallback_runs.
FALLBACK_LINE='composing such GEMMs'
fallback_figure() {
    local r out=""
    for r in "$@"; do grep -qF "$FALLBACK_LINE" "$RUNS/$r.log" 2>/dev/null && out+="${out:+,}$(jstr "$r")"; done
    fig gemm_fallback_runs "[$out]"
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

# torch_run SHAPE MODE CFG LIMIT: scripts/bench_train_torch.py on the same config.json as ours;
# prints "tokens_per_s mfu peak_mib compile_s" (empty fields as -) and records its figures.
torch_run() {
    local shape=$1 mode=$2 cfg=$3 lim=$4 dev=cuda s extra=()
    # The rehearsal runs torch.compile's path with its eager backend: inductor's C++ build of the
    # model takes minutes on a small CPU.
    [ "$REHEARSE" = 1 ] && { dev=cpu; [ "$mode" = compile ] && extra=(--compile-backend eager); }
    local tj="$RUNS/torch_${mode}_$shape.json" tl="$RUNS/torch_${mode}_$shape.log"
    timeout --kill-after=5 "$(within "$lim")" "$PY" "$ROOT/scripts/bench_train_torch.py" --device $dev \
        --shape "$cfg" --batch-size "$BS" --seq-len "$SEQ" --steps "$TSTEPS" --warmup "$TWARM" --mode "$mode" \
        --json "$tj" "${extra[@]}" >"$tl" 2>&1
    s=$?
    [ $s -eq 0 ] || { log "$shape: PyTorch $mode failed (exit $s)"; tail -n 5 "$tl" >&2; }
    val() { grep -o "\"$1\": [0-9.eE+-]*" "$tl" | head -n 1 | awk '{print $2}'; }
    local t peak params cs m
    t=$(val tokens_per_s); peak=$(val peak_mib); params=$(val params); cs=$(val compile_s)
    m=$(mfu "$t" "$(flops_per_token "$cfg" "$SEQ" "$params")")
    fig "${shape}_${mode}_tokens_per_s" "$(jnum "$t")"
    fig "${shape}_${mode}_mfu" "$(jnum "$m")"
    fig "${shape}_${mode}_peak_mib" "$(jnum "$peak")"
    [ "$mode" = compile ] && fig "${shape}_compile_s" "$(jnum "$cs")"
    echo "${t:--} ${m:--} ${peak:--} ${cs:--}"
    return $s
}

part2() {
    local steps=12 warm=4 ok=0 vocab=32000 torch_ok=1 torch_why=""
    local shapes=(124m 1b) lim_ours lim_eager lim_compile shape cfg
    BS=8; SEQ=1024; TSTEPS=10; TWARM=3
    if [ "$REHEARSE" = 1 ]; then
        BS=2; SEQ=16; steps=3; warm=1; TSTEPS=2; TWARM=1; vocab=4096
    fi
    if ! "$PY" -c 'import torch, transformers' >/dev/null 2>&1; then
        torch_ok=0; torch_why="torch or transformers does not import in $PY"
        log "$torch_why"
    fi
    local md="$WORK/md_train.md" eager_json="" compile_json=""
    {
        echo "### train: ferrolm against PyTorch eager and torch.compile (bf16, batch $BS x $SEQ, vocabulary $vocab)"
        echo
        echo "| shape | ours tok/s | eager tok/s | ours/eager | compile tok/s | ours/compile | compile s | ours MFU | eager MFU | compile MFU | ours peak MiB | eager peak MiB |"
        echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    } >"$md"
    for shape in "${shapes[@]}"; do
        lim_compile=0
        if [ "$REHEARSE" = 1 ]; then
            # Tiny stand-ins of the two shapes; the second keeps grouped-query attention.
            [ "$shape" = 124m ] && cfg=$(write_config 124m 32 64 2 2 2 "$vocab") || cfg=$(write_config 1b 64 128 2 4 2 "$vocab")
            lim_ours=${RTRAIN_LIMIT[0]}; lim_eager=${RTRAIN_LIMIT[1]}
            [ "$shape" = 124m ] && lim_compile=${RTRAIN_LIMIT[2]}
        elif [ "$shape" = 124m ]; then
            cfg=$(write_config 124m 768 2048 12 12 12 "$vocab")
            lim_ours=${TRAIN_LIMIT_124M[0]}; lim_eager=${TRAIN_LIMIT_124M[1]}; lim_compile=${TRAIN_LIMIT_124M[2]}
        else
            cfg=$(write_config 1b 2048 8192 16 32 8 "$vocab"); lim_ours=${TRAIN_LIMIT_1B[0]}; lim_eager=${TRAIN_LIMIT_1B[1]}
        fi
        # Ours.
        local run="speed_$shape" ours="" oflops="" omfu="" opeak="" params=""
        pretrain_until "$run" "$steps" "$(within "$lim_ours")" --device cuda:0 --dtype bf16 --config "$cfg" \
            --data "$(train_data)" --steps "$steps" --batch-size "$BS" --seq-len "$SEQ"
        local s=$?
        [ $s -eq 0 ] || { ok=1; log "$shape: pretrain_llama failed or ran out of time (exit $s)"; }
        ours=$(metric "$RUNS/$run/metrics.jsonl" tokens_per_s | median_after "$warm")
        params=$(grep -o 'model: [0-9]* parameters' "$RUNS/$run.log" | head -n 1 | awk '{print $2}')
        oflops=$(flops_per_token "$cfg" "$SEQ" "$params")
        omfu=$(mfu "$ours" "$oflops")
        opeak=$(metric "$RUNS/$run/metrics.jsonl" peak_tensor_mib | sort -g | tail -n 1)
        fig "${shape}_ours_steps_logged" "$(metric "$RUNS/$run/metrics.jsonl" tokens_per_s | wc -l)"
        fig "${shape}_ours_tokens_per_s" "$(jnum "$ours")"
        fig "${shape}_ours_mfu" "$(jnum "$omfu")"
        fig "${shape}_ours_peak_tensor_mib" "$(jnum "$opeak")"
        fig "${shape}_params" "$(jnum "$params")"
        # PyTorch, the same config.json: eager at both shapes, torch.compile at 124m.
        local e=(- - - -) c=(- - - -)
        if [ "$torch_ok" = 1 ]; then
            torch_run "$shape" eager "$cfg" "$lim_eager" >"$RUNS/torch_row.txt" || ok=1
            read -ra e <"$RUNS/torch_row.txt"
            if [ "$lim_compile" -gt 0 ]; then
                torch_run "$shape" compile "$cfg" "$lim_compile" >"$RUNS/torch_row.txt" || ok=1
                read -ra c <"$RUNS/torch_row.txt"
            fi
        else
            fig "${shape}_eager_skipped" "$(jstr "$torch_why")"
            [ "$lim_compile" -gt 0 ] && fig "${shape}_compile_skipped" "$(jstr "$torch_why")"
            [ "$REHEARSE" = 1 ] || ok=1
        fi
        local t=${e[0]#-} tc=${c[0]#-} r rc
        r=$(ratio "$ours" "$t"); rc=$(ratio "$ours" "$tc")
        fig "${shape}_ours_over_eager" "$(jnum "$r")"
        eager_json+="${eager_json:+,}$(jstr "$shape"):$(jnum "$r")"
        if [ "$lim_compile" -gt 0 ]; then
            fig "${shape}_ours_over_compile" "$(jnum "$rc")"
            compile_json+="${compile_json:+,}$(jstr "$shape"):$(jnum "$rc")"
        fi
        echo "$shape: ours ${ours:-?} tok/s (MFU ${omfu:-?}), eager ${t:-?} tok/s, ratio ${r:-?}; compile ${tc:-?} tok/s, ratio ${rc:-?}"
        awk -v s="$shape" -v a="$ours" -v b="$t" -v r="$r" -v tc="$tc" -v rc="$rc" -v cs="${c[3]#-}" -v m="$omfu" \
            -v n="${e[1]#-}" -v nc="${c[1]#-}" -v p="$opeak" -v q="${e[2]#-}" '
            function num(x, f) { return (x == "" || x == "null") ? "-" : sprintf(f, x) }
            function pct(x) { return (x == "" || x == "null") ? "-" : sprintf("%.1f%%", x * 100) }
            BEGIN { printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", s, num(a, "%.0f"), num(b, "%.0f"),
                    num(r, "%.3g"), num(tc, "%.0f"), num(rc, "%.3g"), num(cs, "%.1f"), pct(m), pct(n), pct(nc),
                    num(p, "%.0f"), num(q, "%.0f") }' >>"$md"
        [ -n "$ours" ] && [ "$ours" != null ] || ok=1
    done
    # The ratios the issue names, by shape: ours/eager at both, ours/compile at 124m.
    fig "ours/eager" "{$eager_json}"
    fig "ours/compile" "{$compile_json}"
    [ "$torch_ok" = 1 ] || { echo; echo "PyTorch: $torch_why (its figures are null)"; } >>"$md"
    fallback_figure speed_124m speed_1b
    return $ok
}

part3() {
    local bin args=() s
    bin=$(need_bin bench_cuda) || return 1
    [ "$REHEARSE" = 1 ] && args=(--quick --reps 10)
    [ "${GP_ATTENTION_ONLY:-0}" = 1 ] && args+=(--attention-only)
    fig attention_only "$([ "${GP_ATTENTION_ONLY:-0}" = 1 ] && echo true || echo false)"
    mkdir -p "$WORK/bench"
    rm -f "$WORK/bench/bench_cuda.json" "$WORK/bench/bench_cuda.md"
    OUT="$WORK/bench" "$bin" "${args[@]}" --log-level warn
    s=$?
    cp -f "$WORK/bench/bench_cuda.md" "$WORK/bench/bench_cuda.json" "$OUT/" 2>/dev/null
    local md="$WORK/bench/bench_cuda.md" gemm copy rows nf4
    gemm=$(grep 'GEMM' "$md" 2>/dev/null | grep -o '[0-9.]* TFLOP/s' | head -n 1 | awk '{print $1}')
    copy=$(grep 'device copy' "$md" 2>/dev/null | grep -o '[0-9.]* GB/s' | head -n 1 | awk '{print $1}')
    rows=$(awk '/^## Kernels/ {k = 1} /^## / && !/Kernels/ {k = 0} k && /^\| [^-k]/ {n++} END {print n + 0}' "$md" 2>/dev/null)
    fig kernel_rows "$(jnum "${rows:-0}")"
    fig gemm_tflops "$(jnum "$gemm")"
    fig copy_gb_s "$(jnum "$copy")"
    # QLoRA's dequantize (issue 53): the last bf16 row's floor / time (the largest weight).
    nf4=$(grep '^| nf4_dequant (bf16) ' "$md" 2>/dev/null | tail -n 1 | awk -F'|' '{gsub(/ /, "", $8); print $8}')
    fig nf4_dequant_floor_over_time "$(jnum "$nf4")"
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
    # Fused GEMMs cuBLASLt refused, composed from separate kernels (target 0); null from a build
    # whose profile.json lacks the count.
    fig gemm_fallbacks "$(jnum "$(grep -o '"gemm_fallbacks": *[0-9]*' <<<"$head" | head -n 1 | sed 's/.*: *//')")"
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
        echo "launches per step: $(grep -o '"launches_per_step": *[0-9.eE+-]*' <<<"$head" | sed 's/.*: *//'), timed: $(grep -o '"timed": *[a-z]*' <<<"$head" | sed 's/.*: *//'); GEMM share ${gemm:-0}, attention ${attn:-0}, largest other family \`${other:-none}\` ${other_share:-}; gemm_fallbacks $(grep -o '"gemm_fallbacks": *[0-9]*' <<<"$head" | sed 's/.*: *//') (target 0)"
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
    fallback_figure "$run"
    # The steps' wall time beside their device time: the gap is the device waiting for the host.
    local wall
    wall=$(metric "$RUNS/$run/metrics.jsonl" tokens_per_s | awk -v t=$((bs * seq)) '$1 > 0 {print 1000 * t / $1}' | median_after 1)
    fig wall_ms_per_step "$(jnum "$wall")"
    profile_summary "$pj" && [ $s -eq 0 ]
}

# (step loss) of each logged training step of run $1 after step $2 (default 0), as logged: the
# loss is written with every digit an f64 needs, so equal text is equal bits.
step_losses() {
    awk -v from="${2:-0}" 'match($0, /"loss":[^,}]*/) {
        l = substr($0, RSTART + 7, RLENGTH - 7)
        if (match($0, /"step":[0-9]+/)) { s = substr($0, RSTART + 7, RLENGTH - 7); if (s + 0 > from + 0) print s, l } }' \
        "$RUNS/$1/metrics.jsonl" 2>/dev/null | sort -n
}

# sha256 of a file, or "missing".
sha() { [ -f "$1" ] && sha256sum "$1" | cut -c1-64 || echo missing; }

# The optimizer's files of a checkpoint (every .safetensors but the model's), hashed as one.
state_sha() { find "$1" -maxdepth 2 -name '*.safetensors' ! -name model.safetensors 2>/dev/null | sort | xargs -r sha256sum | awk '{print $1}' | sha256sum | cut -c1-64; }

part5() {
    local steps=20 every=10 bs=8 seq=1024 cfg data ok=0
    if [ "$REHEARSE" = 1 ]; then
        steps=4; every=2; bs=2; seq=16
        cfg=$(write_config det 64 128 2 1 1 4096)   # head dim 64: the tensor-core flash kernels
        data=$(train_data 20000)
    else
        cfg=$(write_config 124m 768 2048 12 12 12 32000)
        data=$(train_data)
    fi
    local args=(--device cuda:0 --dtype bf16 --config "$cfg" --data "$data" --steps "$steps" --batch-size "$bs" --seq-len "$seq" --seed 1234)
    local mid fin
    mid=$(printf 'step-%06d' "$every"); fin=$(printf 'step-%06d' "$steps")
    fig steps "$steps"
    fig resumed_from "$(jstr "$mid")"
    # Each run is stopped once its last checkpoint is saved (the sample after it is not needed).
    SAVE_EVERY=$every pretrain_until det_a "$steps" "$(within 100)" "${args[@]}" || { ok=1; log "determinism: the first run failed"; }
    SAVE_EVERY=$every pretrain_until det_b "$steps" "$(within 100)" "${args[@]}" || { ok=1; log "determinism: the second run failed"; }
    SAVE_EVERY=$every pretrain_until det_resume "$steps" "$(within 100)" "${args[@]}" --resume "$RUNS/det_a/checkpoints/$mid" ||
        { ok=1; log "determinism: the resumed run failed"; }
    # The same bits: every loss, the final weights (model.safetensors) and the optimizer's state.
    local la lb lr la_tail wa wb wr sa sb sr
    la=$(step_losses det_a); lb=$(step_losses det_b)
    la_tail=$(step_losses det_a "$every"); lr=$(step_losses det_resume "$every")
    wa=$(sha "$RUNS/det_a/checkpoints/$fin/model.safetensors"); wb=$(sha "$RUNS/det_b/checkpoints/$fin/model.safetensors")
    wr=$(sha "$RUNS/det_resume/checkpoints/$fin/model.safetensors")
    sa=$(state_sha "$RUNS/det_a/checkpoints/$fin"); sb=$(state_sha "$RUNS/det_b/checkpoints/$fin")
    sr=$(state_sha "$RUNS/det_resume/checkpoints/$fin")
    local n_a n_r
    n_a=$(grep -c . <<<"$la"); n_r=$(grep -c . <<<"$lr")
    fig losses_compared "$n_a"
    fig resume_losses_compared "$n_r"
    # A figure only when both sides are whole: every step logged and the final checkpoint written.
    local same_rerun=null same_resume=null eq
    eq() { [ "$1" = "$2" ] && echo true || echo false; }
    if [ "$n_a" = "$steps" ] && [ "$wa" != missing ] && [ "$wb" != missing ]; then
        fig rerun_losses_equal "$(eq "$la" "$lb")"
        fig rerun_weights_equal "$(eq "$wa" "$wb")"
        fig rerun_optimizer_state_equal "$(eq "$sa" "$sb")"
        same_rerun=$([ "$la" = "$lb" ] && [ "$wa" = "$wb" ] && echo true || echo false)
        [ "$la" = "$lb" ] || fig rerun_first_difference "$(jstr "$(diff <(echo "$la") <(echo "$lb") | grep '^[<>]' | head -n 2 | tr '\n' ' ')")"
    fi
    if [ "$n_r" = $((steps - every)) ] && [ "$wr" != missing ] && [ "$wa" != missing ]; then
        fig resume_losses_equal "$(eq "$la_tail" "$lr")"
        fig resume_weights_equal "$(eq "$wa" "$wr")"
        fig resume_optimizer_state_equal "$(eq "$sa" "$sr")"
        same_resume=$([ "$la_tail" = "$lr" ] && [ "$wa" = "$wr" ] && echo true || echo false)
        [ "$la_tail" = "$lr" ] || fig resume_first_difference "$(jstr "$(diff <(echo "$la_tail") <(echo "$lr") | grep '^[<>]' | head -n 2 | tr '\n' ' ')")"
    fi
    fig same_bits_rerun "$same_rerun"
    fig same_bits_resume "$same_resume"
    fig weights_sha256 "$(jstr "${wa:0:16}")"
    {
        echo "### determinism: the 124m model twice, $steps steps, bf16, seed 1234; resumed from $mid"
        echo
        echo "| comparison | losses | final model.safetensors | optimizer state | same bits |"
        echo "|---|---|---|---|---|"
        echo "| second run against the first | $n_a steps, $(eq "$la" "$lb") | ${wa:0:12} / ${wb:0:12} | $(eq "$sa" "$sb") | $same_rerun |"
        echo "| resumed at $every against the first | $n_r steps, $(eq "$la_tail" "$lr") | ${wa:0:12} / ${wr:0:12} | $(eq "$sa" "$sr") | $same_resume |"
    } >"$WORK/md_determinism.md"
    echo "same_bits_rerun: $same_rerun, same_bits_resume: $same_resume (losses of $n_a and $n_r steps, weights ${wa:0:12})"
    rm -rf "$RUNS"/det_*/checkpoints
    fallback_figure det_a det_b det_resume
    # The claim is that they are equal: a difference (or a run that failed) fails the part.
    [ "$ok" = 0 ] && [ "$same_rerun" = true ] && [ "$same_resume" = true ]
}

# Part 6's Llama shapes: NAME -> hidden, intermediate, layers, heads, kv heads.
offload_shape() {
    case "$1" in
        7b) echo 4096 11008 32 32 32 ;;
        7b-l28) echo 4096 11008 28 32 32 ;;
        7b-l24) echo 4096 11008 24 32 32 ;;
        7b-l16) echo 4096 11008 16 32 32 ;;
        1b) echo 2048 8192 16 32 8 ;;
        tiny) echo 64 128 2 1 1 ;;
        *) return 1 ;;
    esac
}

# Parameters of an untied Llama: HIDDEN INTER LAYERS HEADS KV VOCAB.
llama_params() {
    awk -v h="$1" -v f="$2" -v l="$3" -v q="$4" -v k="$5" -v v="$6" \
        'BEGIN { d = h / q; printf "%.0f", 2 * v * h + h + l * (2 * h * h + 2 * h * k * d + 3 * h * f + 2 * h) }'
}

# bench_offload's predicted optimizer time (update + exposed gradients, s) for k ($2: a number,
# inf, or none for no offload) from its output $1.
predicted_s() {
    if [ "$2" = none ]; then
        # "| no offload ... | states | fits | update (or "(x if it fit)") | 0 | total |"
        awk -F'|' '/^\| no offload/ { gsub(/[^0-9.]/, "", $5); print $5; exit }' "$1"
    else
        awk -F'|' -v k="$2" 'NF == 11 { c = $2; gsub(/ /, "", c); if (c == k) { gsub(/ /, "", $10); print $10; exit } }' "$1"
    fi
}

part6() {
    local bs=2 seq=1024 steps=6 warm=2 vocab=32000 subgroup=10000000 ok=0 shape="${GP_OFFLOAD_SHAPE:-}"
    local ks=(${GP_OFFLOAD_KS:-1 2 4 8}) mem_gib gpu_gib
    mem_gib=$(awk '/^MemTotal:/ {printf "%.1f", $2 / 1048576}' /proc/meminfo 2>/dev/null)
    gpu_gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1 | awk '{printf "%.1f", $1 / 1024}')
    if [ "$REHEARSE" = 1 ]; then
        bs=2; seq=16; steps=2; warm=1; vocab=4096; subgroup=2000; shape=${shape:-tiny}; ks=(${GP_OFFLOAD_KS:-1 2})
    fi
    local dims params
    if [ -z "$shape" ]; then
        # The largest 7b-width model whose host state fits: 18 B a parameter with every subgroup
        # on the CPU (master, m, v; the fp32 gradient; the bf16 parameter), plus 12 GiB.
        for shape in 7b 7b-l28 7b-l24 7b-l16 1b; do
            read -ra dims < <(offload_shape "$shape")
            params=$(llama_params "${dims[@]}" "$vocab")
            awk -v n="$params" -v m="${mem_gib:-0}" 'BEGIN { exit !(18 * n / 2^30 + 12 <= m) }' && break
        done
    fi
    read -ra dims < <(offload_shape "$shape") || { log "GP_OFFLOAD_SHAPE '$shape' is not one of 7b, 7b-l28, 7b-l24, 7b-l16, 1b"; return 1; }
    params=$(llama_params "${dims[@]}" "$vocab")
    local cfg; cfg=$(write_config "offload_$shape" "${dims[@]}" "$vocab")
    fig shape "$(jstr "$shape")"
    fig params "$(jnum "$params")"
    fig host_mem_gib "$(jnum "$mem_gib")"
    fig host_state_gib "$(jnum "$(awk -v n="$params" 'BEGIN { printf "%.1f", 18 * n / 2^30 }')")"
    fig gpu_mem_gib "$(jnum "$gpu_gib")"
    local data; data=$(train_data)
    [ "$REHEARSE" = 1 ] && data=$(train_data 20000)
    local base=(--device cuda:0 --dtype bf16 --config "$cfg" --data "$data" --steps "$steps" --batch-size "$bs" --seq-len "$seq"
        --activation-checkpointing)
    local off=(--offload-optimizer --offload-subgroup-size "$subgroup")
    # The memory check knows the GPU's capacity only from FERROLM_DEVICE_MEMORY_GIB: with it, a run
    # that cannot fit is refused before the model is built (minutes at 7B), not by an allocation.
    [ -n "$gpu_gib" ] && export FERROLM_DEVICE_MEMORY_GIB=$gpu_gib
    local longest=0 rows="" names=()
    # run_one NAME [FLAGS...]: one run to its last step; sets STEP_S and TOK_S (empty when it
    # failed), records its figures.
    run_one() {
        local name=$1 t0 s lim est; shift
        STEP_S=""; TOK_S=""
        est=$(( longest + longest / 10 + 5 ))
        lim=$(left 5)
        if [ "$longest" -gt 0 ] && [ "$lim" -lt "$est" ]; then
            log "offload $name: skipped, ${lim}s left and a run takes about ${longest}s"
            fig "${name}_skipped" "$(jstr "time: ${lim}s left, a run takes about ${longest}s")"
            return 2
        fi
        t0=$(date +%s)
        pretrain_until "offload_$name" "$steps" "$lim" "${base[@]}" "$@"
        s=$?
        local took=$(( $(date +%s) - t0 ))
        [ "$took" -gt "$longest" ] && longest=$took
        names+=("offload_$name")
        fig "${name}_run_s" "$took"
        local m="$RUNS/offload_$name/metrics.jsonl"
        TOK_S=$(metric "$m" tokens_per_s | median_after "$warm")
        [ "$TOK_S" = null ] && TOK_S=""
        STEP_S=$(awk -v t="$TOK_S" -v n=$((bs * seq)) 'BEGIN { if (t + 0 > 0) printf "%.4f", n / t }')
        fig "${name}_tokens_per_s" "$(jnum "$TOK_S")"
        fig "${name}_step_s" "$(jnum "$STEP_S")"
        [ $s -eq 0 ] && [ -n "$STEP_S" ]
    }
    # 1. all-CPU, 2. DOS at the model's k: the figure; then no offload, then the sweep.
    local inf auto none k kauto
    run_one inf "${off[@]}" --offload-gpu-every inf || ok=1
    inf=$STEP_S
    run_one auto "${off[@]}" --offload-gpu-every auto || ok=1
    auto=$STEP_S
    local rates
    rates=$(grep -o 'measured CPU AdamW [0-9.e+-]* elem/s, device AdamW [0-9.e+-]* elem/s, H2D [0-9.]* GB/s, D2H [0-9.]* GB/s; the model chose k = [0-9a-z]*' \
        "$RUNS/offload_auto.log" | head -n 1)
    kauto=$(awk '{print $NF}' <<<"$rates")
    [ -n "$kauto" ] || kauto=$(grep -o 'updated on the device: k = [0-9a-z]*' "$RUNS/offload_auto.log" | awk '{print $NF}' | head -n 1)
    fig model_k "$(jstr "${kauto:-?}")"
    fig measured_rates "$(jstr "$rates")"
    # no offload: refused at once by the memory check where it cannot fit.
    run_one none
    local s_none=$?
    none=$STEP_S
    if [ -z "$none" ]; then
        local why; why=$(grep -o 'needs about .* are available' "$RUNS/offload_none.log" | head -n 1)
        fig none_fits false
        fig none_refused "$(jstr "${why:-$(tail -n 1 "$RUNS/offload_none.log" 2>/dev/null)}")"
    else
        fig none_fits true
    fi
    [ "$s_none" = 2 ] && fig none_fits null
    # The sweep, while time is left (the model's k is already measured).
    local best="" bestk=""
    [ -n "$auto" ] && [[ "$kauto" =~ ^[0-9]+$ ]] && { best=$auto; bestk=$kauto; }
    for k in "${ks[@]}"; do
        [ "$k" = "$kauto" ] && continue
        run_one "k$k" "${off[@]}" --offload-gpu-every "$k"
        [ $? = 2 ] && break
        if [ -n "$STEP_S" ] && { [ -z "$best" ] || awk -v a="$STEP_S" -v b="$best" 'BEGIN { exit !(a + 0 < b + 0) }'; }; then
            best=$STEP_S; bestk=$k
        fi
    done
    fig best_k "$(jnum "$bestk")"
    fig best_k_step_s "$(jnum "$best")"
    # bench_offload's model on the same shape, fed the rates the auto run measured.
    local bo pred="$RUNS/bench_offload.log" bargs=(--params "$params" --subgroup "$subgroup")
    [ -n "$gpu_gib" ] && bargs+=(--gpu-gb "$(awk -v g="$gpu_gib" 'BEGIN { printf "%.1f", g * 1.073741824 }')")
    if [ -n "$rates" ]; then
        local cpu dev h2d d2h
        read -r cpu dev h2d d2h < <(awk '{print $4, $8, $11, $14}' <<<"$rates")
        bargs+=(--cpu-adam-elems-per-s "$cpu" --pcie-gbs "$(awk -v a="$h2d" -v b="$d2h" 'BEGIN { print (a < b ? a : b) }')"
            --hbm-gbs "$(awk -v r="$dev" 'BEGIN { printf "%.1f", r * 32 / 1e9 }')")
    fi
    # Every k measured, the model's among them, gets a row of its own.
    local kl; kl=$(printf '%s\n' "$kauto" "${ks[@]}" | grep -x '[0-9]*' | grep -v '^0*$' | sort -un | paste -sd, -)
    [ -n "$kl" ] && bargs+=("--k=$kl")
    [ "$REHEARSE" = 1 ] && bargs+=(--elems 1048576 --reps 2)
    if bo=$(need_bin bench_offload); then
        timeout --kill-after=5 "$(within 60)" "$bo" "${bargs[@]}" >"$pred" 2>&1 || { ok=1; log "bench_offload failed"; tail -n 3 "$pred" >&2; }
    else
        ok=1
    fi
    {
        echo "### offload: $shape ($params parameters), batch $bs x $seq, activation checkpointing, subgroups of $subgroup"
        echo
        echo "host memory ${mem_gib:-?} GiB, GPU ${gpu_gib:-?} GiB; the auto run measured: ${rates:-nothing}"
        echo
        echo "| run | --offload-gpu-every | step s (measured) | tok/s | bench_offload: update + exposed grads s |"
        echo "|---|---|---:|---:|---:|"
    } >"$WORK/md_offload.md"
    local row name kk p
    for row in "inf:inf" "auto:${kauto:-auto}" "none:none" $(for k in "${ks[@]}"; do echo "k$k:$k"; done); do
        name=${row%%:*}; kk=${row#*:}
        [ -f "$RUNS/offload_$name.log" ] || continue
        p=$(predicted_s "$pred" "$kk")
        fig "${name}_predicted_s" "$(jnum "$p")"
        local st tk
        st=$(awk -F'\t' -v k="${name}_step_s" '$1 == k {v = $2} END {print v}' "$FIGS")
        tk=$(awk -F'\t' -v k="${name}_tokens_per_s" '$1 == k {v = $2} END {print v}' "$FIGS")
        echo "| $name | $([ "$name" = none ] && echo '(no offload)' || echo "$kk") | ${st:--} | ${tk:--} | ${p:--} |" >>"$WORK/md_offload.md"
    done
    local dos best_over
    dos=$(ratio "$inf" "$auto"); best_over=$(ratio "$inf" "$best")
    fig dos_over_all_cpu "$(jnum "$dos")"
    fig best_k_over_all_cpu "$(jnum "$best_over")"
    { echo; echo "DOS over all-CPU (step time of inf over auto's): ${dos:-?}x (the paper: 1.4-2.5x); the best swept k ${bestk:-?}: ${best_over:-?}x"; } >>"$WORK/md_offload.md"
    echo "offload $shape: all-CPU ${inf:-?} s, DOS k=${kauto:-?} ${auto:-?} s (${dos:-?}x), no offload ${none:-does not run} s, best k ${bestk:-?}"
    unset FERROLM_DEVICE_MEMORY_GIB
    fallback_figure "${names[@]}"
    [ "$ok" = 0 ] && [ -n "$dos" ]
}

# The fused head's memory at Llama-3.2-1B's shape: ours fused, ours unfused, PyTorch eager.
part7() {
    local ok=0 steps=3 cfg run peak fused="" unfused="" eager="" lim=90 e=(- - - -)
    BS=8; SEQ=2048; TSTEPS=2; TWARM=1
    if [ "$REHEARSE" = 1 ]; then
        BS=2; SEQ=16; steps=2; TSTEPS=1; lim=60
        cfg=$(write_config head_v128k 64 128 2 4 2 128256 true)
    else
        cfg=$(write_config head_v128k 2048 8192 16 32 8 128256 true)
    fi
    for run in fused unfused; do
        local extra=()
        [ "$run" = unfused ] && extra=(--loss-chunk-tokens 0)
        pretrain_until "head_$run" "$steps" "$(within "$lim")" --device cuda:0 --dtype bf16 --config "$cfg" \
            --data "$(train_data)" --steps "$steps" --batch-size "$BS" --seq-len "$SEQ" "${extra[@]}" ||
            { ok=1; log "head_memory: pretrain_llama ($run) failed or ran out of time"; }
        peak=$(metric "$RUNS/head_$run/metrics.jsonl" peak_tensor_mib | sort -g | tail -n 1)
        fig "${run}_peak_mib" "$(jnum "$peak")"
        [ -n "$peak" ] || ok=1
        [ "$run" = fused ] && fused=$peak || unfused=$peak
    done
    if "$PY" -c 'import torch, transformers' >/dev/null 2>&1; then
        torch_run head_v128k eager "$cfg" "$(within 60)" >"$RUNS/torch_row.txt" || ok=1
        read -ra e <"$RUNS/torch_row.txt"
        eager=${e[2]#-}
    else
        fig eager_skipped "$(jstr "torch or transformers does not import in $PY")"
        [ "$REHEARSE" = 1 ] || ok=1
    fi
    local fe fu
    fe=$(ratio "$fused" "$eager"); fu=$(ratio "$fused" "$unfused")
    fig eager_peak_mib "$(jnum "$eager")"
    fig fused_over_eager_peak "$(jnum "$fe")"
    fig fused_over_unfused_peak "$(jnum "$fu")"
    {
        echo "### head_memory: the LM head and its loss fused, at Llama-3.2-1B's shape (V 128256, tied, bf16, batch $BS x $SEQ)"
        echo
        echo "| run | peak MiB | over PyTorch eager |"
        echo "|---|---:|---:|"
        echo "| ours, fused in chunks (default) | ${fused:--} | ${fe:--} |"
        echo "| ours, unfused (--loss-chunk-tokens 0) | ${unfused:--} | $(ratio "$unfused" "$eager") |"
        echo "| PyTorch eager | ${eager:--} | 1 |"
        echo
        echo "Target: fused <= 0.6 x eager. Ours is the tensor peak (peak_tensor_mib), PyTorch's max_memory_allocated."
    } >"$WORK/md_head_memory.md"
    echo "head_memory: fused ${fused:-?} MiB, unfused ${unfused:-?} MiB, eager ${eager:-?} MiB; fused/eager ${fe:-?}"
    fallback_figure head_fused head_unfused
    return $ok
}

# Preference pairs for part 8's dpo runs: N standard (text) records cut from the bundled corpus, a
# PROMPT-byte prompt and two COMPLETION-byte completions each, long enough that --max-length cuts
# every sequence to one full row (a pair: two rows of --seq-len tokens, as PyTorch's side).
make_pref_pairs() {
    local f=$1 n=$2 pb=$3 cb=$4 src size i off p c r
    src="$(corpus_dir)/hamlet.txt"
    size=$(wc -c <"$src")
    mkdir -p "$(dirname "$f")"
    : >"$f"
    for ((i = 0; i < n; i++)); do
        off=$(( (i * 7919) % (size - pb - 2 * cb) ))
        p=$(tail -c +"$((off + 1))" "$src" | head -c "$pb")
        c=$(tail -c +"$((off + pb + 1))" "$src" | head -c "$cb")
        r=$(tail -c +"$((off + pb + cb + 1))" "$src" | head -c "$cb")
        printf '{"prompt": %s, "chosen": %s, "rejected": %s}\n' "$(jstr "$p")" "$(jstr "$c")" "$(jstr "$r")" >>"$f"
    done
}

# Fine-tuning steps at part 2's 1b shape: finetune full, LoRA, QLoRA and dpo (LoRA), each beside
# scripts/bench_finetune_torch.py's step on the same config.json. The modes run in this order, so
# a part cut short keeps the adapters' figures (issue 49's "LoRA step") first.
FT_MODES=(lora qlora dpo full)
part8() {
    local ok=0 steps=12 warm=4 vocab=32000 cfg base=ft_base dev=cuda plen=32 pbytes=160 torch_ok=1 torch_why=""
    local lim_base lim_ours lim_torch
    BS=8; SEQ=1024; TSTEPS=10; TWARM=3
    read -r lim_base lim_ours lim_torch <<<"${FT_LIMIT[*]}"
    if [ "$REHEARSE" = 1 ]; then
        BS=2; SEQ=16; steps=3; warm=1; TSTEPS=2; TWARM=1; vocab=4096; dev=cpu; plen=4; pbytes=24
        read -r lim_base lim_ours lim_torch <<<"${RFT_LIMIT[*]}"
        # The tiny stand-in of part 2's 1b (grouped-query attention kept; widths of 64, nf4's block).
        cfg=$(write_config ft_1b 64 128 2 4 2 "$vocab")
    else
        cfg=$(write_config ft_1b 2048 8192 16 32 8 "$vocab")
    fi
    local pairs=$((BS / 2)) prefs="$RUNS/data/prefs_ft_$SEQ.jsonl"
    if ! "$PY" -c 'import torch, transformers' >/dev/null 2>&1; then
        torch_ok=0; torch_why="torch or transformers does not import in $PY"
        log "$torch_why"
    fi
    fig shape "$(jstr "$([ "$REHEARSE" = 1 ] && echo "1b stand-in (h64, 2 layers)" || echo 1b)")"
    fig batch "$(jstr "$BS x $SEQ (dpo: $pairs pairs, 2 rows each)")"
    # The starting checkpoint: one pretrain_llama step at this shape, stopped once it is saved.
    local t0 s base_ok=1
    t0=$(date +%s)
    SAVE_EVERY=1 pretrain_until "$base" 1 "$(within "$lim_base")" --device cuda:0 --dtype bf16 --config "$cfg" \
        --data "$(train_data)" --steps 1 --batch-size 1 --seq-len "$SEQ"
    s=$?
    fig base_s "$(( $(date +%s) - t0 ))"
    if [ $s -ne 0 ] || ! ls -d "$RUNS/$base"/checkpoints/step-* >/dev/null 2>&1; then
        base_ok=0; ok=1
        log "finetune: no starting checkpoint (pretrain_llama --steps 1, exit $s): our runs are skipped"
        fig base_failed "$(jstr "pretrain_llama --steps 1 exit $s: $(tail -n 1 "$RUNS/$base.log" 2>/dev/null)")"
    fi
    fig params "$(jnum "$(grep -o 'model: [0-9]* parameters' "$RUNS/$base.log" 2>/dev/null | head -n 1 | awk '{print $2}')")"
    make_pref_pairs "$prefs" $(( steps * pairs + 2 )) "$pbytes" $(( 5 * SEQ + 256 ))
    local mode tool args run ours tt peak tpeak pred r over_json="" md="$WORK/md_finetune.md" names=()
    declare -A TOK=()
    {
        echo "### finetune: fine-tuning steps against PyTorch (bf16, $([ "$REHEARSE" = 1 ] && echo "a tiny stand-in of 1b" || echo "1b: hidden 2048, 16 layers, 32 query / 8 kv heads, ffn 8192, vocabulary $vocab"), batch $BS x $SEQ; dpo $pairs pairs a step, 2 rows each)"
        echo
        echo "| run | ours tok/s | PyTorch tok/s | ours/PyTorch | ours peak MiB | PyTorch peak MiB | ours predicted MiB |"
        echo "|---|---:|---:|---:|---:|---:|---:|"
    } >"$md"
    for mode in "${FT_MODES[@]}"; do
        run="ft_$mode"; ours=""; tt=""; peak=""; tpeak=""; pred=""
        case $mode in
            full) tool=finetune; args=(--data "$(train_data)" --batch-size "$BS") ;;
            lora) tool=finetune; args=(--data "$(train_data)" --batch-size "$BS" --lora-rank 16) ;;
            qlora) tool=finetune; args=(--data "$(train_data)" --batch-size "$BS" --lora-rank 16 --quantize-base nf4) ;;
            dpo) tool=dpo; args=(--data "$prefs" --data-format standard --batch-size "$pairs" --max-prompt-length "$plen"
                --val-fraction 0 --lora-rank 16) ;;
        esac
        # Ours: the median tokens_per_s after the warm-up steps, stopped once the last is logged.
        if [ "$base_ok" = 1 ]; then
            names+=("$run")
            GP_TOOL=$tool pretrain_until "$run" "$steps" "$(within "$lim_ours")" --model "$RUNS/$base" --device cuda:0 \
                --dtype bf16 --steps "$steps" --seq-len "$SEQ" --lr 1e-4 "${args[@]}"
            s=$?
            [ $s -eq 0 ] || { ok=1; fig "${mode}_exit" "$s"; log "finetune $mode: $tool failed or ran out of time (exit $s)"; }
            ours=$(metric "$RUNS/$run/metrics.jsonl" tokens_per_s | median_after "$warm")
            [ "$ours" = null ] && ours=""
            peak=$(metric "$RUNS/$run/metrics.jsonl" peak_tensor_mib | sort -g | tail -n 1)
            pred=$(predicted_mib "$RUNS/$run.log" 2>/dev/null)
            fig "${mode}_steps_logged" "$(metric "$RUNS/$run/metrics.jsonl" tokens_per_s | wc -l)"
            [ -n "$ours" ] || ok=1
        else
            fig "${mode}_skipped" "$(jstr "no starting checkpoint")"
        fi
        fig "${mode}_tokens_per_s" "$(jnum "$ours")"
        fig "${mode}_peak_tensor_mib" "$(jnum "$peak")"
        fig "${mode}_predicted_mib" "$(jnum "$pred")"
        TOK[$mode]=$ours
        # PyTorch, the same config.json, one process a mode.
        if [ "$torch_ok" = 1 ]; then
            local tj="$RUNS/torch_ft_$mode.json" tl="$RUNS/torch_ft_$mode.log" b=$BS
            [ "$mode" = dpo ] && b=$pairs
            rm -f "$tj"
            timeout --kill-after=5 "$(within "$lim_torch")" "$PY" "$ROOT/scripts/bench_finetune_torch.py" --device $dev \
                --config "$cfg" --mode "$mode" --batch-size "$b" --seq-len "$SEQ" --prompt-len "$plen" --lora-rank 16 \
                --steps "$TSTEPS" --warmup "$TWARM" --json "$tj" >"$tl" 2>&1
            s=$?
            if [ $s -eq 3 ] && grep -q '"skipped"' "$tl"; then
                fig "${mode}_torch_skipped" "$(jstr "$(grep -o '"skipped": "[^"]*' "$tl" | head -n 1 | cut -d'"' -f4)")"
            else
                [ $s -eq 0 ] || { ok=1; fig "${mode}_torch_exit" "$s"; log "finetune $mode: PyTorch failed (exit $s)"; tail -n 5 "$tl" >&2; }
                tt=$(grep -o '"tokens_per_s": [0-9.eE+-]*' "$tl" | head -n 1 | awk '{print $2}')
                tpeak=$(grep -o '"peak_mib": [0-9.eE+-]*' "$tl" | head -n 1 | awk '{print $2}')
            fi
        else
            fig "${mode}_torch_skipped" "$(jstr "$torch_why")"
            [ "$REHEARSE" = 1 ] || ok=1
        fi
        fig "${mode}_torch_tokens_per_s" "$(jnum "$tt")"
        fig "${mode}_torch_peak_mib" "$(jnum "$tpeak")"
        r=$(ratio "$ours" "$tt")
        fig "${mode}_over_torch" "$(jnum "$r")"
        over_json+="${over_json:+,}$(jstr "$mode"):$(jnum "$r")"
        echo "finetune $mode: ours ${ours:-?} tok/s (peak ${peak:-?} MiB), PyTorch ${tt:-?} tok/s, ratio ${r:-?}"
        awk -v m="$mode" -v a="$ours" -v b="$tt" -v r="$r" -v p="$peak" -v q="$tpeak" -v e="$pred" '
            function num(x, f) { return (x == "" || x == "null") ? "-" : sprintf(f, x) }
            BEGIN { printf "| %s | %s | %s | %s | %s | %s | %s |\n", m, num(a, "%.0f"), num(b, "%.0f"), num(r, "%.3g"),
                    num(p, "%.0f"), num(q, "%.0f"), num(e, "%.0f") }' >>"$md"
    done
    fig "ours/torch" "{$over_json}"
    # QLoRA against LoRA (ours): the 4-bit base's cost in speed and its saving in memory.
    local qp lp
    qp=$(awk -F'\t' '$1 == "qlora_peak_tensor_mib" {v = $2} END {print v}' "$FIGS")
    lp=$(awk -F'\t' '$1 == "lora_peak_tensor_mib" {v = $2} END {print v}' "$FIGS")
    fig qlora_over_lora "$(jnum "$(ratio "${TOK[qlora]:-}" "${TOK[lora]:-}")")"
    fig qlora_over_lora_peak "$(jnum "$(ratio "$qp" "$lp")")"
    fig lora_over_full "$(jnum "$(ratio "${TOK[lora]:-}" "${TOK[full]:-}")")"
    {
        echo
        echo "Ours: finetune (full; --lora-rank 16; --lora-rank 16 --quantize-base nf4) and dpo --lora-rank 16 (sigmoid, the reference the base with the adapters off) from a one-step pretrain_llama checkpoint, token windows of the bundled corpus (dpo: standard pairs cut to one row a sequence), the median tokens_per_s after $warm warm-up steps, peak_tensor_mib. PyTorch: scripts/bench_finetune_torch.py (plain torch: fp32 weights under bf16 autocast for full; a bf16 frozen base with fp32 rank-16 adapters on the seven projections for the others; bitsandbytes' nf4 for qlora), $TWARM warm-up and $TSTEPS timed steps, max_memory_allocated."
        echo "QLoRA over LoRA (ours): tokens/s $(ratio "${TOK[qlora]:-}" "${TOK[lora]:-}"), peak $(ratio "$qp" "$lp"); LoRA over full: $(ratio "${TOK[lora]:-}" "${TOK[full]:-}")."
        awk -F'\t' '$1 ~ /_skipped$|^base_failed$/ {gsub(/"/, "", $2); print "- " $1 ": " $2}' "$FIGS"
    } >>"$md"
    rm -rf "${RUNS:?}/$base/checkpoints"
    fallback_figure "$base" "${names[@]}"
    return $ok
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
    for i in $(seq 1 $NPARTS); do
        f="$WORK/part_${NAMES[$i]}.json"
        [ -s "$f" ] && body+=",$(jstr "${NAMES[$i]}"):$(cat "$f")"
    done
    printf '{"script":"gpu_perf.sh","mode":%s,"date":%s,"host":%s,"gpu":%s,"commit":%s,"budget_s":%s,"gemm_fallbacks":%s%s}\n' \
        "$(jstr "$([ "$REHEARSE" = 1 ] && echo rehearsal || echo gpu)")" "$(jstr "$(date -u '+%Y-%m-%d %H:%M UTC')")" \
        "$(jstr "$(uname -n)")" "$(jstr "$GPU_NAME")" "$(jstr "$COMMIT")" "$BUDGET" "$(fallbacks_json)" "$body" >"$OUT/gpu_perf.json"
}

# gpu_perf.json's gemm_fallbacks: the profile's count (null when part 4 did not run) and every
# run of this invocation whose log says cuBLASLt refused a fused GEMM.
fallbacks_json() {
    local count="" runs="" f r
    [ -s "$WORK/figs_profile.tsv" ] && count=$(awk -F'\t' '$1 == "gemm_fallbacks" {v = $2} END {print v}' "$WORK/figs_profile.tsv")
    for f in "$RUNS"/*.log; do
        [ -f "$f" ] && grep -qF "$FALLBACK_LINE" "$f" && { r=$(basename "$f" .log); runs+="${runs:+,}$(jstr "$r")"; }
    done
    printf '{"profile_count":%s,"runs":[%s],"target":0}' "$(jnum "$count")" "$runs"
}

write_md() {
    local i f
    {
        echo "# GPU perf"
        echo
        echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'), host $(uname -n), $(nproc 2>/dev/null || echo '?') cores, GPU: $GPU_NAME"
        echo "- mode: $([ "$REHEARSE" = 1 ] && echo 'rehearsal on the CUDA emulator: every figure is marked rehearsal and means nothing' || echo GPU)"
        echo "- command: \`$GP_COMMAND\`, budget ${BUDGET} s, commit $COMMIT"
        echo "- gemm_fallbacks (fused GEMMs cuBLASLt refused; target 0): $(fallbacks_json)"
        echo
        echo "| part | name | ok | seconds | limit s | rehearsal | figures |"
        echo "|---:|---|---|---:|---:|---|---|"
        for i in $(seq 1 $NPARTS); do
            f="$WORK/row_${NAMES[$i]}.md"
            [ -s "$f" ] && cat "$f"
        done
        for f in "$WORK/md_train.md" "$WORK/md_profile.md" "$WORK/md_determinism.md" "$WORK/md_offload.md" \
            "$WORK/md_head_memory.md" "$WORK/md_finetune.md"; do
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
# The commit the binaries and scripts were built from: GP_COMMIT (a staged tree has no git), else
# the repository's.
COMMIT=${GP_COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)}
COMMIT=${COMMIT:-unknown (set GP_COMMIT)}
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
