#!/usr/bin/env bash
# Training benchmark on one GPU (notes/design.md §7, issue "foundation" item 11):
#   1. the default model: median step time, tokens/s, MFU and pool peak over steps 11..N;
#   2. one stated larger model: the longest context (B = 1) and the largest batch (T = 1024) that fit,
#      with and without layer recomputation, found by doubling then bisecting in separate processes
#      (an out-of-memory run exits non-zero with the pool's report).
# Usage: tools/bench_train.sh TRAIN_BIN DATA_DIR [OUT_DIR]. Prints markdown tables.
set -uo pipefail
train=$1; data=$2; out=${3:-build/bench}
mkdir -p "$out"
quiet="--val_every 0 --sample_every 0 --ckpt_every 0 --log_every 1"

# median of column 6 (ms) over rows with step > 10, and the matching tok/s, MFU, peak
summarise() {  # log.csv
  awk -F, 'NR > 1 && $1 > 10 && $2 != "nan" { print $6, $7, $8, $9 }' "$1" | sort -n |
    awk '{ a[NR] = $0 } END { split(a[int((NR + 1) / 2)], m, " "); printf "%.2f | %.0f | %.1f%% | %.1f", m[1], m[2], 100 * m[3], m[4] }'
}

echo "## default model"
echo "| config | step ms (median) | tokens/s | MFU | pool peak MiB |"
echo "|---|---|---|---|---|"
for rc in 0 1; do
  "$train" --data "$data" --steps 60 --recompute $rc $quiet --out "$out/default_rc$rc" > "$out/default_rc$rc.log" 2>&1 ||
    { echo "default run failed (see $out/default_rc$rc.log)"; tail -5 "$out/default_rc$rc.log"; }
  echo "| default, recompute $rc | $(summarise "$out/default_rc$rc/log.csv") |"
done

# a stated larger model on a random-token shard long enough for any probe
big="--hidden 1024 --layers 4 --heads 16 --experts 8 --topk 2 --expert_dim 1024"
synthetic="$out/synthetic"
mkdir -p "$synthetic"
"$(dirname "$train")/../synthetic_tokens" "$synthetic/train_000.bin" 100000000 4095 0 ||
  { echo "could not write the synthetic shard"; exit 1; }
ln -sf train_000.bin "$synthetic/val_000.bin"
fits() {  # B T recompute
  "$train" --data "$data" --train "$synthetic/train_*.bin" --val "$synthetic/val_*.bin" $big --batch "$1" --seq_len "$2" \
    --steps 1 --warmup 1 --recompute "$3" $quiet --out "$out/probe" > "$out/probe.log" 2>&1
}
peak_of_last() { awk -F, 'NR > 1 && $2 != "nan" { p = $9 } END { print p }' "$out/probe/log.csv"; }
largest() {  # what(T|B) start cap recompute: doubling up to cap, then bisection to 1/8 of the last doubling
  local what=$1 v=$2 cap=$3 rc=$4 good=0 bad=0
  while [ "$v" -le "$cap" ]; do
    if [ "$what" = T ]; then fits 1 "$v" "$rc"; else fits "$v" 1024 "$rc"; fi
    if [ $? -eq 0 ]; then good=$v; v=$((v * 2)); else bad=$v; break; fi
  done
  local step=$(( (bad - good) / 8 ))
  while [ "$bad" -gt 0 ] && [ "$step" -gt 0 ] && [ $((bad - good)) -gt "$step" ]; do
    local mid=$(( (good + bad) / 2 / step * step ))
    [ "$mid" -le "$good" ] && break
    if [ "$what" = T ]; then fits 1 "$mid" "$rc"; else fits "$mid" 1024 "$rc"; fi
    if [ $? -eq 0 ]; then good=$mid; else bad=$mid; fi
  done
  if [ "$what" = T ]; then fits 1 "$good" "$rc"; else fits "$good" 1024 "$rc"; fi
  local shown=$good
  [ "$bad" -eq 0 ] && shown=">= $good (probe cap)"
  echo "$shown|$(peak_of_last)"
}
echo
echo "## limits of one H200 for: $big (V from the tokenizer), BF16 build"
echo "| probe | recompute | largest that fits | pool peak MiB at it |"
echo "|---|---|---|---|"
for rc in 0 1; do
  echo "| context T (B = 1) | $rc | $(largest T 4096 131072 $rc) |"
  echo "| batch B (T = 1024) | $rc | $(largest B 8 4096 $rc) |"
done
