# Shell helpers shared by the GPU scripts (gpu_first_contact.sh, gpu_perf.sh): sourced, never run.
#
# The sourcing script sets ROOT (the repository root, or a staged .gpu/) and LOG_TAG (the script's
# name in log lines) before sourcing, then calls parse_args (REHEARSE), and sets RUNS (the folder
# of training runs) and, while a step runs, FIGS (its figure file).

# Where the reports go, and the Python with torch and transformers.
OUT=${OUT:-/tmp/out}
PY=${FERROLM_PYTHON:-python3}

log() { echo "[${LOG_TAG:-gpu}] $*" >&2; }

# The scripts' command line: `parse_args VAR DEFAULT LIST EXAMPLE ITEM "$@"` reads --LIST X (or
# --LIST=X) and --help (the script's `usage`), and, for a script that runs its steps as timed
# sub-runs of itself (ITEM: what one is called, `part` or `step`), --rehearse and
# --internal-ITEM N; ITEM `-` is a script with neither. It sets VAR (X, else DEFAULT), REHEARSE
# (0 or 1) and INTERNAL. Anything else, or --LIST without its value, exits 2 naming it.
parse_args() {
    local var=$1 value=$2 list=$3 example=$4 item=$5
    shift 5
    REHEARSE=0
    INTERNAL=""
    while [ $# -gt 0 ]; do
        case "$1" in
            "--$list")
                [ $# -ge 2 ] || { echo "error: --$list needs a list, e.g. --$list $example" >&2; exit 2; }
                value=$2; shift ;;
            "--$list="*) value=${1#"--$list="} ;;
            -h|--help) usage; exit 0 ;;
            *)
                if [ "$item" != - ] && [ "$1" = --rehearse ]; then
                    REHEARSE=1
                elif [ "$item" != - ] && [ "$1" = "--internal-$item" ]; then
                    INTERNAL=${2:-}; shift
                else
                    echo "error: unknown argument '$1' (see --help)" >&2; exit 2
                fi ;;
        esac
        shift
    done
    printf -v "$var" '%s' "$value"
}

# JSON string of $1.
jstr() {
    local s=$1
    s=${s//\\/\\\\}; s=${s//\"/\\\"}; s=${s//$'\n'/\\n}; s=${s//$'\t'/ }; s=${s//$'\r'/}
    printf '"%s"' "$s"
}

# A JSON number, or null when $1 is not one.
jnum() {
    if [[ "$1" =~ ^-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$ ]]; then printf '%s' "$1"; else printf null; fi
}

# Figures of the running step: `fig key json-value` appends to the step's figure file.
fig() { printf '%s\t%s\n' "$1" "$2" >>"$FIGS"; }

# The JSON object of a figure file (lines `key<TAB>json-value`; a later key wins in readers).
figs_json() {
    local f=$1 out="" k v
    if [ -s "$f" ]; then
        while IFS=$'\t' read -r k v; do
            [ -n "$k" ] && out+="${out:+,}$(jstr "$k"):$v"
        done <"$f"
    fi
    printf '{%s}' "$out"
}

# a / b to 4 significant digits, or an empty string when either is not a positive number.
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.4g", a / b }'; }

# Where cargo puts its artifacts (CARGO_TARGET_DIR when set).
target_dir() {
    local t=${CARGO_TARGET_DIR:-$ROOT/target}
    [[ "$t" == /* ]] || t="$ROOT/$t"
    echo "$t"
}

# The binary NAME (an example or a test-* binary), or an empty string. A staged tree's bin/ comes
# first on a GPU host; the rehearsal uses cargo's artifacts only.
find_bin() {
    local name=$1 d t
    t=$(target_dir)
    for d in "${FERROLM_BIN_DIR:-}" "$PWD/bin" "$ROOT/bin" "$ROOT/.gpu/bin" "$t/release/examples" "$t/debug/examples"; do
        [ -n "$d" ] && [ "$REHEARSE" = 1 ] && [[ "$d" == */.gpu/bin || "$d" == "$PWD/bin" || "$d" == "$ROOT/bin" ]] && continue
        if [ -n "$d" ] && [ -x "$d/$name" ] && [ -f "$d/$name" ]; then echo "$d/$name"; return 0; fi
    done
    return 1
}

need_bin() {
    local b
    b=$(find_bin "$1") || { log "missing binary $1 (stage it, or build it: cargo build --release --examples)"; return 1; }
    echo "$b"
}

# A Llama config.json: write_config NAME HIDDEN INTER LAYERS HEADS [KV_HEADS] [VOCAB] [TIED: true|false]
# -> its path.
write_config() {
    local f="$RUNS/config_$1.json"
    mkdir -p "$RUNS"
    cat >"$f" <<EOF
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": ${7:-4096}, "hidden_size": $2,
 "intermediate_size": $3, "num_hidden_layers": $4, "num_attention_heads": $5, "num_key_value_heads": ${6:-$5},
 "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": ${8:-false}}
EOF
    echo "$f"
}

# The bundled corpus folder.
corpus_dir() {
    local corpus
    for corpus in "$ROOT/data/corpus" "$PWD/data/corpus"; do [ -d "$corpus" ] && { echo "$corpus"; return; }; done
}

# Training text: the first $1 bytes of one play in the rehearsal (default 60000, so the closing
# full validation is short), the whole bundled corpus on a GPU.
train_data() {
    local corpus bytes=${1:-60000}
    corpus=$(corpus_dir)
    if [ "$REHEARSE" = 1 ]; then
        mkdir -p "$RUNS/data"
        [ -s "$RUNS/data/rehearsal_$bytes.txt" ] || head -c "$bytes" "$corpus/hamlet.txt" >"$RUNS/data/rehearsal_$bytes.txt"
        echo "$RUNS/data/rehearsal_$bytes.txt"
    else
        echo "$corpus"
    fi
}

tokenizer() {
    local t
    for t in "$ROOT/data/tokenizer.json" "$PWD/data/tokenizer.json"; do [ -f "$t" ] && { echo "$t"; return; }; done
}

# pretrain RUN ARGS...: pretrain_llama into $RUNS/RUN (log RUN.log); the exit status is its own.
# No evaluation; a checkpoint every SAVE_EVERY steps (default 0: only the closing one).
pretrain() {
    local run=$1; shift
    local bin; bin=$(need_bin pretrain_llama) || return 1
    rm -rf "${RUNS:?}/$run"
    (cd "$RUNS" && "$bin" --out "$RUNS/$run" --tokenizer "$(tokenizer)" --eval-every 0 --save-every "${SAVE_EVERY:-0}" \
        --log-level warn "$@") >"$RUNS/$run.log" 2>&1
    local s=$?
    echo "$run" >>"$RUNS/runs.txt"
    tail -n 3 "$RUNS/$run.log" >&2
    return $s
}

# Values of KEY in a metrics.jsonl, one a line (training-step lines only).
metric() { grep -o "\"$2\":-\?[0-9][-0-9.eE+]*" "$1" 2>/dev/null | cut -d: -f2; }

# Median of the numbers on stdin, skipping the first $1 (warm-up).
median_after() {
    tail -n +"$(( $1 + 1 ))" | sort -g | awk '{a[NR] = $1} END {if (NR == 0) print "null"; else if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2}'
}

# The estimator's predicted peak of a run, in MiB (from its "memory: predicted peak" line).
predicted_mib() {
    grep -o 'memory: predicted peak [0-9.]* [KMGT]iB' "$1" | head -n 1 | awk '{u = $5; v = $4; m = (u == "KiB") ? v / 1024 : (u == "MiB") ? v : (u == "GiB") ? v * 1024 : v * 1048576; print m}'
}

# The rehearsal's environment: the CUDA emulator, no GPU required, the pinned CUDA libraries of
# the repository's .cuda/ (when present) on LD_LIBRARY_PATH.
rehearsal_env() {
    export FERROLM_CUDA_EMULATOR=1
    unset FERROLM_REQUIRE_GPU
    if [ -d "$ROOT/.cuda" ]; then
        local nv; nv=$(ls -d "$ROOT"/.cuda/lib/python3.*/site-packages/nvidia/cu13/lib 2>/dev/null | head -n 1)
        [ -n "$nv" ] && export LD_LIBRARY_PATH="$nv${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
}

# The executables cargo builds for these `cargo test` arguments (e.g. -p ferrolm-cuda --test pinned).
cargo_test_bins() {
    (cd "$ROOT" && cargo test "$@" --no-run --message-format=json 2>/dev/null) |
        grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | sort -u
}

# Passed and failed test counts in a libtest log: prints "PASSED FAILED".
test_counts() {
    local p f
    p=$(grep "test result:" "$1" | grep -o "[0-9]* passed" | awk "{n += \$1} END {print n + 0}")
    f=$(grep "test result:" "$1" | grep -o "[0-9]* failed" | awk "{n += \$1} END {print n + 0}")
    echo "$p $f"
}
