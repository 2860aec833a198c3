#!/usr/bin/env bash
# GPU first contact: everything a GPU can prove and measure, in a fixed order, most important
# first, each step under its own time limit; a failed step does not stop the run.
#
#   on a GPU host, from a staged tree:   .gpu/run bash ../scripts/gpu_first_contact.sh
#   rehearsal, no GPU, repository root:  scripts/gpu_first_contact.sh --rehearse
#
# Writes one JSON line per step to $OUT/gpu_first_contact.jsonl (keys step, name, ok, seconds, the
# step's figures, and rehearsal: true where a figure means nothing on the emulator) and the
# Markdown summary $OUT/gpu_first_contact.md. docs/BENCHMARKS.md ("GPU first contact") says what
# each step measures and its target.
set -uo pipefail

usage() {
    cat <<'EOF'
usage: gpu_first_contact.sh [--rehearse] [--steps LIST] [--help]

Steps (in this order):
  1 environment    GPU, driver, CUDA, cuBLASLt, NVRTC and NCCL versions found
  2 cuda_tests     every test binary, FERROLM_REQUIRE_GPU=1, on the NVRTC path; the kernel
                   tests again on the fatbin path (FERROLM_KERNELS_FATBIN)
  3 train_vs_cpu   pretrain_llama on cuda:0 against the CPU, f32 and bf16, losses step by step
  4 nccl_one_proc  one process under launch --nproc-per-node 1, forced through NcclComm
                   (FERROLM_FORCE_NCCL=1), ZeRO-1, TP 1, optimizer offload on
  5 kernel_floors  bench_cuda: each kernel against its bandwidth or GEMM floor
  6 attention      attention fwd+bwd against PyTorch SDPA (flash backend)
  7 train_speed    pretrain_llama against scripts/bench_train_torch.py (eager, torch.compile)
  8 offload        optimizer offload: none, all-CPU (inf), DOS at the model's k, a k sweep
  9 memory         the estimator's predicted peak against the measured peak of every run above

Options:
  --rehearse     no GPU: build what is needed (cargo, dev profile), set FERROLM_CUDA_EMULATOR=1,
                 shrink every size; speed and PyTorch figures are marked "rehearsal": true
  --steps LIST   run only these steps, e.g. --steps 1,3 (a rerun appends to the same files)
  --help         this text

Environment:
  OUT              output folder [default: /tmp/out]
  FERROLM_PYTHON   the Python with torch and transformers [default: python3]
  FERROLM_BIN_DIR  folder of the binaries [default: ./bin in a staged .gpu/ (where .gpu/run
                   starts it), else .gpu/bin, else target/release, else target/debug]
  FERROLM_KERNELS_FATBIN  the kernels' fatbin for step 2's fatbin pass [default:
                   ferrolm_kernels.fatbin beside the binaries, else under target/]
  FC_STEP_TIMEOUT  seconds each step may take [default: per step, see the table in the script]
EOF
}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOG_TAG=first-contact
# shellcheck source=gpu_lib.sh
source "$ROOT/scripts/gpu_lib.sh"  # also OUT and PY, with their defaults
parse_args STEPS 1,2,3,4,5,6,7,8,9 steps 1,3 step "$@"
if ! [[ "$STEPS" =~ ^[1-9](,[1-9])*$ ]]; then
    echo "error: --steps '$STEPS': a comma-separated list of step numbers 1..9, e.g. 1,3" >&2
    exit 2
fi

NAMES=(_ environment cuda_tests train_vs_cpu nccl_one_proc kernel_floors attention train_speed offload memory)
# Seconds per step on a GPU host, then in the rehearsal (2 shared cores, the emulator).
LIMITS=(_ 60 900 600 300 600 300 1200 900 60)
RLIMITS=(_ 60 420 300 120 240 60 420 300 60)
# Steps whose figures mean nothing on the emulator or on a CPU PyTorch.
REHEARSAL_ONLY=" 5 6 7 8 "

JSONL="$OUT/gpu_first_contact.jsonl"
MD="$OUT/gpu_first_contact.md"
RUNS="$OUT/fc_runs"

# ---------------------------------------------------------------- helpers
# parse_args, jstr, jnum, fig, find_bin, need_bin, write_config, train_data, tokenizer, pretrain,
# metric, median_after, predicted_mib, rehearsal_env, cargo_test_bins, test_counts:
# scripts/gpu_lib.sh.

# The JSON line of one step: record STEP NAME OK SECONDS FIGFILE REHEARSAL
record() {
    local step=$1 name=$2 ok=$3 secs=$4 figs=$5 reh=$6 line k v
    line="{\"step\":$step,\"name\":$(jstr "$name"),\"ok\":$ok,\"seconds\":$(jnum "$secs")"
    [ "$reh" = 1 ] && line+=",\"rehearsal\":true"
    if [ -s "$figs" ]; then
        while IFS=$'\t' read -r k v; do
            [ -n "$k" ] && line+=",$(jstr "$k"):$v"
        done <"$figs"
    fi
    line+="}"
    echo "$line" >>"$JSONL"
    echo "$line"
}

# The Markdown summary, rebuilt from the JSON lines (the last line of each step wins).
write_md() {
    {
        echo "# GPU first contact"
        echo
        echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
        echo "- mode: $([ "$REHEARSE" = 1 ] && echo 'rehearsal on the CUDA emulator (figures marked rehearsal mean nothing)' || echo 'GPU')"
        echo "- host: $(uname -n), $(nproc 2>/dev/null || echo '?') cores"
        echo "- command: \`$FC_COMMAND\`"
        echo
        echo "| step | name | ok | seconds | rehearsal | figures |"
        echo "|---:|---|---|---:|---|---|"
        awk '
        {
            s = $0; step = ""; if (match(s, /"step":[0-9]+/)) step = substr(s, RSTART + 7, RLENGTH - 7)
            last[step + 0] = s
        }
        END {
            for (i = 1; i <= 9; i++) {
                if (!(i in last)) continue
                s = last[i]
                name = s; sub(/.*"name":"/, "", name); sub(/".*/, "", name)
                ok = (s ~ /"ok":true/) ? "yes" : "**FAILED**"
                secs = s; sub(/.*"seconds":/, "", secs); sub(/[,}].*/, "", secs)
                reh = (s ~ /"rehearsal":true/) ? "yes" : ""
                figs = s; sub(/^\{"step":[0-9]+,"name":"[^"]*","ok":(true|false),"seconds":[^,}]*(,"rehearsal":true)?,?/, "", figs)
                sub(/\}$/, "", figs); gsub(/\|/, "\\|", figs); gsub(/"/, "", figs); gsub(/,/, ", ", figs)
                printf "| %d | %s | %s | %s | %s | %s |\n", i, name, ok, secs, reh, figs
            }
        }' "$JSONL"
        echo
        echo "Logs of each step: \`$OUT/fc_step<N>.log\`; runs: \`$RUNS/\`."
    } >"$MD"
}

# Shapes: tiny in the rehearsal; on a GPU a small model for correctness, 124M/350M/1B for speed.
config_for() {
    case "$1" in
        tiny) write_config tiny 32 64 2 2 ;;
        small) write_config small 256 688 4 4 ;;
        124m) write_config 124m 768 2048 12 12 ;;
        350m) write_config 350m 1024 2816 24 16 ;;
        1b) write_config 1b 2048 5632 16 32 ;;
        3b) write_config 3b 3072 8192 26 24 ;;
    esac
}

# ---------------------------------------------------------------- the steps
step1() {
    local smi driver cuda gpu lib f
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
        gpu=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1)
        driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1)
        cuda=$(nvidia-smi | grep -o 'CUDA Version: [0-9.]*' | awk '{print $3}')
    fi
    fig gpu "$(jstr "${gpu:-none}")"
    fig driver "$(jstr "${driver:-none}")"
    fig cuda "$(jstr "${cuda:-none}")"
    # The libraries cudarc will dlopen, as the loader would find them on LD_LIBRARY_PATH.
    for lib in cublasLt nvrtc nccl cublas; do
        f=""
        local d
        for d in ${LD_LIBRARY_PATH:+${LD_LIBRARY_PATH//:/ }} /usr/lib/x86_64-linux-gnu /usr/local/cuda/lib64; do
            f=$(ls -1 "$d"/lib$lib.so.* 2>/dev/null | sort -V | tail -n 1)
            [ -n "$f" ] && break
        done
        fig "$lib" "$(jstr "${f:+$(basename "$(readlink -f "$f")")}")"
    done
    if command -v nvcc >/dev/null 2>&1; then fig nvcc "$(jstr "$(nvcc --version | grep -o 'release [0-9.]*')")"; fi
    fig emulator "$([ "${FERROLM_CUDA_EMULATOR:-}" = 1 ] && echo true || echo false)"
    echo "gpu=${gpu:-none} driver=${driver:-none} cuda=${cuda:-none}"
    [ "$REHEARSE" = 1 ] || [ -n "${gpu:-}" ]
}

# Every CUDA test binary, twice: kernels from NVRTC sources, then from the built fatbin.
step2() {
    local bins=() t fatbin passed=0 failed=0 bfail=0 pass name
    if [ "$REHEARSE" = 1 ]; then
        # The emulator runs the CUDA crate's tests and the ops' CUDA tests (the rest is CI's).
        mapfile -t bins < <(cargo_test_bins -p ferrolm-cuda -p ferrolm-ops --test cuda --test kernels --test nvrtc --test optim --test pinned)
    else
        local dir; dir=$(dirname "$(find_bin pretrain_llama || echo "$PWD/bin/x")")
        for t in "$dir"/test-*; do [ -x "$t" ] && bins+=("$t"); done
    fi
    fatbin=${FERROLM_KERNELS_FATBIN:-}
    if [ -z "$fatbin" ]; then
        for f in "$(dirname "${bins[0]:-.}")/ferrolm_kernels.fatbin" $(ls -t "$(target_dir)"/*/build/ferrolm-*/out/ferrolm_kernels.fatbin 2>/dev/null); do
            [ -f "$f" ] && { fatbin=$f; break; }
        done
    fi
    fig binaries "${#bins[@]}"
    fig fatbin "$(jstr "${fatbin:-not found}")"
    for pass in nvrtc fatbin; do
        [ "$pass" = fatbin ] && [ -z "$fatbin" ] && { log "no ferrolm_kernels.fatbin found: the fatbin pass fails"; bfail=$((bfail + 1)); continue; }
        for t in "${bins[@]}"; do
            name=$(basename "$t")
            # The fatbin pass: the tests that load kernels themselves (the rest use the built-in image).
            [ "$pass" = fatbin ] && [ "$REHEARSE" = 0 ] && ! [[ "$name" =~ ^test-(kernels|cuda|optim|pinned|nvrtc)- ]] && continue
            echo "== $pass $name"
            if [ "$pass" = fatbin ]; then
                FERROLM_KERNELS_FATBIN=$fatbin "$t" --test-threads=1 >"$OUT/fc_step2_${pass}_$name.log" 2>&1
            else
                env -u FERROLM_KERNELS_FATBIN "$t" --test-threads=1 >"$OUT/fc_step2_${pass}_$name.log" 2>&1
            fi
            local s=$?
            local p f
            read -r p f < <(test_counts "$OUT/fc_step2_${pass}_$name.log")
            passed=$((passed + p)); failed=$((failed + f))
            if [ $s -ne 0 ]; then bfail=$((bfail + 1)); echo "FAILED: $pass $name (exit $s)"; tail -n 15 "$OUT/fc_step2_${pass}_$name.log"; fi
        done
    done
    fig tests_passed "$passed"
    fig tests_failed "$failed"
    fig binaries_failed "$bfail"
    [ ${#bins[@]} -gt 0 ] && [ "$bfail" -eq 0 ]
}

# Losses of cuda:0 against the CPU, step by step, at docs/BENCHMARKS.md's tolerances:
# |loss_gpu - loss_cpu| <= tol * max(1, |loss_cpu|), tol 2e-3 in f32, 3e-2 in bf16.
step3() {
    local steps=50 shape=small bs=8 seq=64 ok=0 dtype cfg tol worst
    [ "$REHEARSE" = 1 ] && { steps=3; shape=tiny; bs=2; seq=16; }
    cfg=$(config_for $shape)
    fig steps "$steps"
    fig shape "$(jstr $shape)"
    for dtype in f32 bf16; do
        tol=$([ $dtype = f32 ] && echo 2e-3 || echo 3e-2)
        local common=(--config "$cfg" --data "$(train_data)" --dtype $dtype --steps $steps --batch-size $bs --seq-len $seq --seed 1337)
        pretrain "train_cpu_$dtype" --device cpu "${common[@]}" || { log "CPU run $dtype failed"; ok=1; }
        pretrain "train_cuda_$dtype" --device cuda:0 "${common[@]}" || { log "cuda:0 run $dtype failed"; ok=1; }
        worst=$(paste <(metric "$RUNS/train_cpu_$dtype/metrics.jsonl" loss) <(metric "$RUNS/train_cuda_$dtype/metrics.jsonl" loss) |
            awk -v tol="$tol" -v want="$steps" '
            NF == 2 { n++; d = $1 - $2; if (d < 0) d = -d; s = ($1 < 0 ? -$1 : $1); if (s < 1) s = 1
                      r = d / s; if (r > w) w = r; if (r > tol) bad++ }
            END { printf "%d %.3g %d\n", n, w, bad + (n < want ? 1 : 0) }')
        read -r n w bad <<<"$worst"
        echo "$dtype: $n steps compared, worst relative loss difference $w (tolerance $tol), $bad over"
        fig "${dtype}_steps_compared" "$(jnum "$n")"
        fig "${dtype}_worst_rel_diff" "$(jnum "$w")"
        fig "${dtype}_tolerance" "$tol"
        [ "$bad" = 0 ] || ok=1
    done
    return $ok
}

# One process through NcclComm: launch --nproc-per-node 1, FERROLM_FORCE_NCCL=1, ZeRO-1, TP 1, offload.
step4() {
    local steps=20 shape=small bs=8 seq=64 launch s
    [ "$REHEARSE" = 1 ] && { steps=2; shape=tiny; bs=2; seq=16; }
    launch=$(need_bin launch) || return 1
    local bin; bin=$(need_bin pretrain_llama) || return 1
    local run=nccl_one_proc
    rm -rf "${RUNS:?}/$run"
    fig launcher "$(jstr "launch --nproc-per-node 1")"
    (cd "$RUNS" && FERROLM_FORCE_NCCL=1 "$launch" --nproc-per-node 1 "$bin" --out "$RUNS/$run" --tokenizer "$(tokenizer)" \
        --eval-every 0 --save-every 0 --log-level info --config "$(config_for $shape)" --data "$(train_data)" \
        --device cuda --dtype bf16 --steps $steps --batch-size $bs --seq-len $seq \
        --tp 1 --zero 1 --offload-optimizer --offload-gpu-every auto) >"$RUNS/$run.log" 2>&1
    s=$?
    echo "$run" >>"$RUNS/runs.txt"
    tail -n 8 "$RUNS/$run.log"
    local through=false
    grep -q '^parallel: tp 1 x dp 1' "$RUNS/$run.log" && through=true
    fig through_nccl "$through"
    fig steps_done "$(metric "$RUNS/$run/metrics.jsonl" loss | wc -l)"
    fig final_loss "$(jnum "$(metric "$RUNS/$run/metrics.jsonl" loss | tail -n 1)")"
    [ $s -eq 0 ] && [ "$through" = true ]
}

step5() {
    local bin args=()
    bin=$(need_bin bench_cuda) || return 1
    [ "$REHEARSE" = 1 ] && args=(--quick --reps 10)
    rm -f "$OUT/bench_cuda.json"
    OUT=$OUT "$bin" "${args[@]}" --log-level warn
    local s=$?
    fig table "$(jstr "$OUT/bench_cuda.md")"
    fig attention_rows "$(grep -c '"b[0-9]*_hq' "$OUT/bench_cuda.json" 2>/dev/null || echo 0)"
    [ $s -eq 0 ] && [ -s "$OUT/bench_cuda.json" ]
}

step6() {
    local s
    [ -s "$OUT/bench_cuda.json" ] || log "no $OUT/bench_cuda.json (step 5): PyTorch's times only"
    if [ "$REHEARSE" = 1 ]; then
        # The attention script times CUDA only: the rehearsal checks it runs and reads our JSON.
        "$PY" "$ROOT/scripts/bench_attention_torch.py" --help >/dev/null && "$PY" -c "
import sys; sys.path.insert(0, '$ROOT/scripts'); import bench_attention_torch as b
ours = b.load_ours('$OUT/bench_cuda.json'); print('ours:', len(ours), 'attention rows'); assert ours" 
        s=$?
    else
        OUT=$OUT "$PY" "$ROOT/scripts/bench_attention_torch.py" --ours "$OUT/bench_cuda.json"
        s=$?
        fig table "$(jstr "$OUT/bench_attention_torch.md")"
        local worst; worst=$(grep -o '"ratio": *[0-9.]*' "$OUT/bench_attention_torch.json" 2>/dev/null | grep -o '[0-9.]*$' | sort -g | head -n 1)
        fig worst_ratio_vs_flash "$(jnum "$worst")"
    fi
    return $s
}

# Our tokens/s, MFU, peak against PyTorch eager and torch.compile at each shape.
step7() {
    local shapes=(124m 350m 1b) bs=8 seq=1024 steps=30 warm=10 tsteps=20 ok=0 shape cfg
    [ "$REHEARSE" = 1 ] && { shapes=(tiny); bs=2; seq=16; steps=3; warm=1; tsteps=2; }
    for shape in "${shapes[@]}"; do
        cfg=$(config_for "$shape")
        pretrain "speed_$shape" --device cuda:0 --dtype bf16 --config "$cfg" --data "$(train_data)" \
            --steps $steps --batch-size $bs --seq-len $seq || ok=1
        local m="$RUNS/speed_$shape/metrics.jsonl" ours mfu peak
        ours=$(metric "$m" tokens_per_s | median_after $warm)
        mfu=$(metric "$m" mfu | median_after $warm)
        peak=$(metric "$m" peak_tensor_mib | sort -g | tail -n 1)
        fig "${shape}_ours_tokens_per_s" "$(jnum "$ours")"
        fig "${shape}_ours_mfu" "$(jnum "$mfu")"
        fig "${shape}_ours_peak_mib" "$(jnum "$peak")"
        local dev=cuda; [ "$REHEARSE" = 1 ] && dev=cpu
        "$PY" "$ROOT/scripts/bench_train_torch.py" --device $dev --shape "$cfg" --batch-size $bs --seq-len $seq \
            --steps $tsteps --warmup $((warm < 3 ? warm : 3)) --mode both --json "$RUNS/torch_$shape.json" \
            >"$RUNS/torch_$shape.log" 2>&1 || { ok=1; tail -n 5 "$RUNS/torch_$shape.log"; }
        local mode t tmfu tpeak
        for mode in eager compile; do
            t=$(grep "\"mode\": \"$mode\"" "$RUNS/torch_$shape.log" | grep -o '"tokens_per_s": [0-9.eE+-]*' | awk '{print $2}')
            tmfu=$(grep "\"mode\": \"$mode\"" "$RUNS/torch_$shape.log" | grep -o '"mfu": [0-9.eE+-]*' | awk '{print $2}')
            tpeak=$(grep "\"mode\": \"$mode\"" "$RUNS/torch_$shape.log" | grep -o '"peak_mib": [0-9.eE+-]*' | awk '{print $2}')
            fig "${shape}_torch_${mode}_tokens_per_s" "$(jnum "$t")"
            fig "${shape}_torch_${mode}_mfu" "$(jnum "$tmfu")"
            fig "${shape}_torch_${mode}_peak_mib" "$(jnum "$tpeak")"
            fig "${shape}_ratio_vs_${mode}" "$(jnum "$(awk -v a="$ours" -v b="$t" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.3f", a / b }')")"
            echo "$shape: ours ${ours} tok/s, PyTorch $mode ${t:-?} tok/s"
        done
    done
    return $ok
}

# Optimizer offload on one GPU: no offload, all on the CPU (inf), DOS at the model's k, a k sweep.
step8() {
    local shape=3b bs=4 seq=1024 steps=8 warm=3 ok=0 base k
    local sweep=(1 2 4 8 16)
    [ "$REHEARSE" = 1 ] && { shape=tiny; bs=2; seq=16; steps=2; warm=0; sweep=(1 2); }
    local bo; bo=$(need_bin bench_offload) && {
        if [ "$REHEARSE" = 1 ]; then "$bo" --elems 1048576 --reps 2; else "$bo"; fi >"$RUNS/bench_offload.log" 2>&1 || ok=1
        tail -n 5 "$RUNS/bench_offload.log"
    }
    base=(--device cuda:0 --dtype bf16 --config "$(config_for $shape)" --data "$(train_data)" --steps $steps --batch-size $bs --seq-len $seq)
    fig shape "$(jstr $shape)"
    run_k() { # NAME [offload flags]: tokens/s median of the run, or empty
        local name=$1; shift
        pretrain "offload_$name" "${base[@]}" "$@" >/dev/null || { log "offload run $name failed (no offload may not fit: expected for the model that needs it)"; return 1; }
        metric "$RUNS/offload_$name/metrics.jsonl" tokens_per_s | median_after $warm
    }
    local none inf auto kauto best bestk=""
    none=$(run_k none); fig none_tokens_per_s "$(jnum "$none")"
    inf=$(run_k inf --offload-optimizer --offload-gpu-every inf) || ok=1; fig all_cpu_tokens_per_s "$(jnum "$inf")"
    auto=$(run_k auto --offload-optimizer --offload-gpu-every auto) || ok=1; fig dos_auto_tokens_per_s "$(jnum "$auto")"
    kauto=$(grep -o 'the model chose k = [0-9a-z]*' "$RUNS/offload_auto.log" | awk '{print $NF}' | head -n 1)
    [ -z "$kauto" ] && kauto=$(grep -o 'updated on the device: k = [0-9a-z]*' "$RUNS/offload_auto.log" | awk '{print $NF}' | head -n 1)
    fig model_k "$(jstr "${kauto:-?}")"
    best=0
    for k in "${sweep[@]}"; do
        local t; t=$(run_k "k$k" --offload-optimizer --offload-gpu-every "$k") || ok=1
        fig "k${k}_tokens_per_s" "$(jnum "$t")"
        if awk -v a="$t" -v b="$best" 'BEGIN { exit !(a + 0 > b + 0) }'; then best=$t; bestk=$k; fi
    done
    fig best_k "$(jnum "$bestk")"
    fig dos_over_all_cpu "$(jnum "$(awk -v a="$auto" -v b="$inf" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.3f", a / b }')")"
    echo "none ${none:-failed} | all-CPU ${inf:-failed} | DOS k=${kauto:-?} ${auto:-failed} | best swept k=${bestk:-?} tok/s"
    return $ok
}

# The estimator's prediction against the measured peak, for every run of this invocation.
step9() {
    local run pred meas n=0 bad=0
    [ -s "$RUNS/runs.txt" ] || { echo "no runs to compare (run steps 3, 4, 7 or 8 first)"; return 1; }
    for run in $(sort -u "$RUNS/runs.txt"); do
        [ -f "$RUNS/$run.log" ] || continue
        pred=$(predicted_mib "$RUNS/$run.log")
        meas=$(metric "$RUNS/$run/metrics.jsonl" peak_tensor_mib | sort -g | tail -n 1)
        [ -n "$pred" ] || continue
        n=$((n + 1))
        fig "${run}_predicted_mib" "$(jnum "$pred")"
        fig "${run}_measured_mib" "$(jnum "$meas")"
        local r; r=$(awk -v p="$pred" -v m="$meas" 'BEGIN { if (m + 0 > 0) printf "%.3f", p / m }')
        fig "${run}_predicted_over_measured" "$(jnum "$r")"
        echo "$run: predicted $pred MiB, measured ${meas:-?} MiB (ratio ${r:-?})"
        # A prediction below the measured peak is the failure that matters (an OOM it did not see).
        awk -v r="$r" 'BEGIN { exit !(r != "" && r + 0 < 1.0) }' && bad=$((bad + 1))
    done
    fig runs_compared "$n"
    fig under_predicted "$bad"
    [ $n -gt 0 ] && [ $bad -eq 0 ]
}

# ---------------------------------------------------------------- one step (a child under timeout)
if [ -n "$INTERNAL" ]; then
    FIGS="$OUT/.fc_figs_$INTERNAL"
    "step$INTERNAL"
    exit $?
fi

# ---------------------------------------------------------------- the run
mkdir -p "$OUT" "$RUNS" || { echo "error: cannot create OUT=$OUT" >&2; exit 2; }
FC_COMMAND="$0 $([ "$REHEARSE" = 1 ] && echo --rehearse) --steps $STEPS"
export OUT PY REHEARSE FC_COMMAND
if [ "$REHEARSE" = 1 ]; then
    rehearsal_env
    log "rehearsal: building the examples and the CUDA tests (dev profile)"
    t0=$(date +%s)
    (cd "$ROOT" && cargo build --examples -q && cargo test -p ferrolm-cuda -p ferrolm-ops --test cuda --test kernels \
        --test nvrtc --test optim --test pinned --no-run -q) || log "build failed: the steps that need it will fail"
    log "build: $(( $(date +%s) - t0 )) s"
    # The tools prefer the dev profile's artifacts in the rehearsal.
    export FERROLM_BIN_DIR=${FERROLM_BIN_DIR:-$(target_dir)/debug/examples}
else
    export FERROLM_REQUIRE_GPU=1
fi
start=$(date +%s)
for step in ${STEPS//,/ }; do
    name=${NAMES[$step]}
    limit=${FC_STEP_TIMEOUT:-$([ "$REHEARSE" = 1 ] && echo "${RLIMITS[$step]}" || echo "${LIMITS[$step]}")}
    figs="$OUT/.fc_figs_$step"; rm -f "$figs"; : >"$figs"
    log "step $step ($name), limit ${limit}s"
    t0=$(date +%s.%N)
    timeout --kill-after=10 "$limit" bash "$0" --internal-step "$step" $([ "$REHEARSE" = 1 ] && echo --rehearse) \
        >"$OUT/fc_step$step.log" 2>&1
    s=$?
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    tail -n 6 "$OUT/fc_step$step.log" | sed 's/^/    /' >&2
    [ $s -eq 124 ] || [ $s -eq 137 ] && printf 'timed_out\ttrue\n' >>"$figs"
    [ $s -ne 0 ] && printf 'exit\t%d\n' "$s" >>"$figs"
    reh=0; [ "$REHEARSE" = 1 ] && [[ "$REHEARSAL_ONLY" == *" $step "* ]] && reh=1
    record "$step" "$name" "$([ $s -eq 0 ] && echo true || echo false)" "$secs" "$figs" "$reh"
    rm -f "$figs"
    write_md
done
log "done in $(( $(date +%s) - start )) s: $JSONL and $MD"
