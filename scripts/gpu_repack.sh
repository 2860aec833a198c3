#!/usr/bin/env bash
# Re-pack what `../shared/gpu/stage` staged in .gpu/ into .gpu.txz with one large xz dictionary,
# so that the archive and the working tree travel to the GPU machine under its 64 MiB.
#
#   usage: bash scripts/gpu_repack.sh [DIR]      (DIR: where .gpu/ is; default the repository root)
#
# Why: stage packs with xz's default dictionary (8 MiB), smaller than one staged binary (each tool
# is about 20 MiB and shares most of its code with the others), so xz cannot reuse what it has
# seen in an earlier binary. With a 256 MiB dictionary it can: on 2026-12-07 the default staging
# (10 tools, 17 test binaries, 252 MiB) packed into 63 MiB by stage, 21.4 MiB here. Unpacking
# is unchanged (`tar xJf .gpu.txz`; xz then needs about 260 MiB of memory).
#
# It prints the archive's size and the size of everything that travels (the files git tracks,
# untracked files it does not ignore, and the archive), and exits 1 when that is over 64 MiB.
set -euo pipefail
dir=${1:-$(git rev-parse --show-toplevel)}
cd "$dir"
if [ ! -d .gpu ]; then
  echo "gpu_repack: no .gpu/ in $dir: run ../shared/gpu/stage first" >&2
  exit 2
fi
command -v xz >/dev/null || { echo "gpu_repack: xz is not installed (apt-get install xz-utils)" >&2; exit 2; }
tmp=$(mktemp .gpu.txz.XXXXXX)
trap 'rm -f "$tmp"' EXIT
# One thread: a block per thread would cut the dictionary's reach at each block's start.
tar -cf - .gpu | xz -T1 --lzma2=preset=9,dict=256MiB -c > "$tmp"
chmod 644 "$tmp"
mv "$tmp" .gpu.txz
trap - EXIT
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
archive=$(stat -c %s .gpu.txz)
tree=0
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # What travels besides the carried archive: tracked files, and untracked ones git does not ignore.
  tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
fi
total=$((archive + tree))
echo "gpu_repack: .gpu.txz $(mib "$archive") MiB; with the working tree ($(mib "$tree") MiB) $(mib "$total") MiB travels (limit 64 MiB)"
if [ "$total" -ge $((64 * 1048576)) ]; then
  echo "gpu_repack: over the 64 MiB that travels: stage fewer binaries (GPU_EXAMPLES, GPU_TESTS)" >&2
  exit 1
fi
