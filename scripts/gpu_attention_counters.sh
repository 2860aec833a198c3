#!/usr/bin/env bash
# Nsight Compute's hardware counters on one launch of each flash attention kernel (issue 32): how
# busy the tensor pipe is, what shared memory and the warps wait on, beside bench_cuda's times.
# `--help` says what it runs and writes; docs/BENCHMARKS.md ("Owed to a GPU") says when to run it.
set -uo pipefail

usage() {
    cat <<'EOF'
usage: gpu_attention_counters.sh [--shape B,HQ,HKV,T] [--help]

On a GPU host, from inside a staged tree (bin/, scripts/):  bash scripts/gpu_attention_counters.sh

For each flash kernel, flash_fwd_bf16_d128, flash_bwd_dkdv_bf16_d128, flash_bwd_dq_bf16_d128,
then the same three at head dim 64, it runs
  ncu --set full --launch-count 1 -k regex:^KERNEL$ --page raw --csv
      bench_cuda --quick --reps 10 --attention B,HQ,HKV,T,D
and keeps the counters of that one launch: about 20 s a kernel on an H200 [limit 90 s each,
AC_BUDGET_S for all six].

Outputs in $OUT (two files, beside gpu_perf.sh's at most six: the device tool brings back 8):
  attention_ncu.csv   every counter of the six launches (ncu's raw page, one block a kernel)
  attention_ncu.md    a row a kernel: duration, registers, achieved occupancy, tensor (HMMA) pipe
                      active, shared-memory bank conflicts on loads and stores, LDSM instructions,
                      and the three largest warp stall reasons; then the log's end of each launch
                      that gave no counters

Options:
  --shape B,HQ,HKV,T  batch, query heads, kv heads, sequence of the launches [default: 4,16,16,2048]
  --help              this text

Environment:
  OUT              output folder [default: /tmp/out]
  AC_BUDGET_S      seconds for all six launches; a launch never runs past it [default: 240]
  NCU              the ncu binary [default: ncu on PATH, else /usr/local/cuda/bin/ncu]
  FERROLM_BIN_DIR  folder of bench_cuda [default: ./bin of a staged tree, else target/release]
  FERROLM_PYTHON   python3 for the summary [default: python3]

With no ncu it says so and exits 0 (1 under FERROLM_REQUIRE_GPU=1); a kernel whose launch gave no
counters is a failed row, and the exit status is 1.
EOF
}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOG_TAG=attention-counters
# shellcheck source=gpu_lib.sh
source "$ROOT/scripts/gpu_lib.sh"  # also OUT and PY, with their defaults
parse_args SHAPE 4,16,16,2048 shape 8,32,8,1024 - "$@"
if ! [[ "$SHAPE" =~ ^[1-9][0-9]*(,[1-9][0-9]*){3}$ ]]; then
    echo "error: --shape '$SHAPE': four positive numbers B,HQ,HKV,T, e.g. 4,16,16,2048" >&2
    exit 2
fi
IFS=, read -r _ HQ HKV _ <<<"$SHAPE"
if [ $((HQ % HKV)) -ne 0 ]; then
    echo "error: --shape '$SHAPE': $HQ query heads are not a multiple of $HKV kv heads" >&2
    exit 2
fi

BUDGET=${AC_BUDGET_S:-240}
[[ "$BUDGET" =~ ^[0-9]+$ ]] || { echo "error: AC_BUDGET_S '$BUDGET' is not a number of seconds" >&2; exit 2; }
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
if ! [ -x "$NCU" ]; then
    log "skipped: no Nsight Compute at $NCU (set NCU)"
    [ "${FERROLM_REQUIRE_GPU:-}" = 1 ] && exit 1
    exit 0
fi
bin=$(need_bin bench_cuda) || exit 1
mkdir -p "$OUT" || { echo "error: cannot create OUT=$OUT" >&2; exit 2; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/attention_ncu.XXXXXX")
start=$(date +%s)
# Named counters beside the full set's sections; a launch that refuses one is rerun without them.
EXTRA=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
EXTRA+=,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum
EXTRA+=,smsp__inst_executed_op_ldsm.sum

status=0
: >"$OUT/attention_ncu.csv"
for d in 128 64; do
    for k in fwd bwd_dkdv bwd_dq; do
        kernel=flash_${k}_bf16_d$d
        log "$kernel at $SHAPE,$d"
        for metrics in "--metrics $EXTRA" ""; do
            limit=$(( start + BUDGET - $(date +%s) ))
            [ "$limit" -gt 90 ] && limit=90
            if [ "$limit" -lt 5 ]; then
                echo "budget of ${BUDGET}s spent before this launch" >"$WORK/$kernel.log"
                break
            fi
            # shellcheck disable=SC2086 # $metrics is two words or none
            timeout --kill-after=5 "$limit" "$NCU" --set full $metrics --launch-count 1 -k "regex:^$kernel\$" --page raw --csv \
                --log-file "$WORK/$kernel.csv" "$bin" --quick --reps 10 --attention "$SHAPE,$d" >"$WORK/$kernel.log" 2>&1
            # The report goes to --log-file; should this ncu print it among the program's output
            # instead, take the CSV lines from there.
            if ! grep -q "$kernel" "$WORK/$kernel.csv" 2>/dev/null && grep -q '^"ID"' "$WORK/$kernel.log"; then
                sed -n '/^"ID"/,$p' "$WORK/$kernel.log" | grep '^"' >"$WORK/$kernel.csv"
            fi
            grep -q "$kernel" "$WORK/$kernel.csv" 2>/dev/null && break
            log "$kernel: no counters${metrics:+ with the named metrics, again without them}"
        done
        if grep -q "$kernel" "$WORK/$kernel.csv" 2>/dev/null; then
            { echo "# $kernel"; grep -v '^==' "$WORK/$kernel.csv"; echo; } >>"$OUT/attention_ncu.csv"
        else
            status=1
            { echo "## $kernel: no counters"; echo; echo '```'; tail -n 5 "$WORK/$kernel.log"; echo '```'; echo; } >>"$WORK/failures.md"
            tail -n 5 "$WORK/$kernel.log" >&2
        fi
    done
done

"$PY" - "$OUT/attention_ncu.csv" "$SHAPE" >"$OUT/attention_ncu.md" <<'PY' || status=1
import csv, re, sys

path, shape = sys.argv[1], sys.argv[2]
KERNELS = [f"flash_{k}_bf16_d{d}" for d in (128, 64) for k in ("fwd", "bwd_dkdv", "bwd_dq")]
blocks, name = {}, None
for line in open(path):
    if line.startswith("# "):
        name = line[2:].strip()
        blocks[name] = []
    elif name and line.strip():
        blocks[name].append(line)


def num(s):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def launch(lines):
    """The raw page's header, units (a row whose ID cell is not a number) and first launch as
    {counter: (value, unit)}."""
    rows = [r for r in csv.reader(lines) if r]
    if len(rows) < 2:
        return {}
    head, rest = rows[0], rows[1:]
    units = rest.pop(0) if num(rest[0][0]) is None else [""] * len(head)
    return {h: (v, u) for h, u, v in zip(head, units, rest[0])} if rest else {}


def fmt(c, key, scale=1.0, digits=1):
    v = num(c.get(key, ("", ""))[0])
    return "n/a" if v is None else f"{v * scale:,.{digits}f}"


print(f"# Flash attention counters (Nsight Compute, one launch each, shape {shape},D)\n")
print("| kernel | duration us | regs | achieved occupancy % | HMMA pipe active % | smem bank conflicts ld / st | LDSM | top stalls (cycles per issue) |")
print("|---|---:|---:|---:|---:|---|---:|---|")
for k in KERNELS:
    c = launch(blocks.get(k, []))
    if not c:
        print(f"| {k} | **no counters** | | | | | | |")
        continue
    dur, unit = c.get("gpu__time_duration.sum", ("", ""))
    us = num(dur)
    us = None if us is None else us * {"nsecond": 1e-3, "ns": 1e-3, "msecond": 1e3, "ms": 1e3}.get(unit, 1.0)
    stalls = []
    for h, (v, _) in c.items():
        m = re.match(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$", h)
        if m and num(v) is not None and m.group(1) not in ("not_selected", "selected"):
            stalls.append((num(v), m.group(1)))
    top = ", ".join(f"{n} {v:.2f}" for v, n in sorted(stalls, reverse=True)[:3]) or "n/a"
    print(
        f"| {k} | {'n/a' if us is None else f'{us:,.1f}'} | {fmt(c, 'launch__registers_per_thread', digits=0)} "
        f"| {fmt(c, 'sm__warps_active.avg.pct_of_peak_sustained_active')} "
        f"| {fmt(c, 'sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active')} "
        f"| {fmt(c, 'l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum', digits=0)} / "
        f"{fmt(c, 'l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum', digits=0)} "
        f"| {fmt(c, 'smsp__inst_executed_op_ldsm.sum', digits=0)} | {top} |"
    )
PY
[ -s "$WORK/failures.md" ] && { echo; cat "$WORK/failures.md"; } >>"$OUT/attention_ncu.md"
rm -rf "$WORK"
log "wrote $OUT/attention_ncu.md and $OUT/attention_ncu.csv"
exit $status
