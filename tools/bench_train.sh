#!/usr/bin/env bash
# Training benchmark on one GPU (notes/design.md §7, §8; notes/speed.md):
#   speed:  the default model (recompute 0 and 1, and 0 without CUDA graphs: --cuda_graph 0, and with
#           the weight gradients on the compute stream: --wgrad_stream 0) and config B1 (the same four;
#           notes/design.md §8): median step time,
#           tokens/s, MFU (train.cu's: 6 x active parameters + causal attention FLOPs per token against
#           989 TFLOP/s bf16), pool peak and the device's used memory; then the per-operator breakdown
#           of one step of each (--profile_step, runtime/profile.cuh: CUDA events around every operator,
#           summed over layers, sorted, % of the step, GB/s of the memory-bound ones);
#   multi:  the default model on every GPU of the machine (2 or more) against one GPU, same flags and
#           per-rank batch (--gpus W keeps B x T per rank: W times the tokens per step): median step time,
#           tokens/s of all ranks, and the speed-up in tokens/s over one GPU, with expert parallelism over
#           all ranks (the default) and without it (--ep 1: experts replicated, no dispatch exchange; its
#           passes captured as CUDA graphs, and once more with --cuda_graph 0, the eager baseline);
#   ab:     BASE_TRAIN (another build's trainer, e.g. of the commit before a change) against TRAIN on one
#           GPU, alternating base, new, base, new on the default model and B1: each run's median step
#           time, and B1's per-operator breakdown of the last two runs side by side (what moved). Runs
#           on different machines, and even device calls, differ by more than many changes gain, so a
#           change is measured against its predecessor in one call (notes/speed.md, 'How to measure');
#   limits: one stated larger model: the longest context (B = 1) and the largest batch (T = 1024) that
#           fit, without and with layer recomputation, and with its best combination (recomputation, SCO
#           on every boundary, the chunked head), found by doubling then bisecting on the trainer's memory
#           prediction (--dry_run 1, exact on one GPU), then one real step at the value found (contexts up
#           to 262144).
# Usage: tools/bench_train.sh TRAIN_BIN DATA_DIR [OUT_DIR] [PARTS] (PARTS: "speed limits", the default,
# or any of speed, multi, ab, limits; ab needs BASE_TRAIN=path in the environment). Prints markdown tables.
set -uo pipefail
train=$1; data=$2; out=${3:-build/bench}; parts=${4:-speed limits}
for p in $parts; do
  case $p in speed|multi|ab|limits) ;; *) echo "bench_train.sh: unknown part '$p' (speed, multi, ab, limits)"; exit 2 ;; esac
done
if [[ " $parts " == *" ab "* ]] && [ ! -x "${BASE_TRAIN:-}" ]; then
  echo "bench_train.sh ab: BASE_TRAIN must name the trainer to compare against (got '${BASE_TRAIN:-}', not an executable)"
  exit 2
fi
mkdir -p "$out"
quiet="--val_every 0 --sample_every 0 --ckpt_every 0 --log_every 1"

# median of column 6 (ms) over rows with step > 10, and the matching tok/s, MFU, peak
summarise() {  # log.csv
  awk -F, 'NR > 1 && $1 > 10 && $2 != "nan" { print $6, $7, $8, $9 }' "$1" | sort -n |
    awk '{ a[NR] = $0 } END { split(a[int((NR + 1) / 2)], m, " "); printf "%.2f | %.0f | %.1f%% | %.1f", m[1], m[2], 100 * m[3], m[4] }'
}

# the largest "device used" of a run's step lines (cudaMemGetInfo: context, libraries, pool reserve)
device_used() { grep -o 'device used [0-9.]*' "$1" | awk '{ if ($3 > m) m = $3 } END { printf "%.0f", m }'; }

# config B1 (notes/design.md §8; notes/speed.md, 'What fast means here'). V 16384: the fortunes
# tokenizer has 4096 ids, which fill the first 4096 rows of lm_head; all 16384 rows are projected (the
# same FLOPs as B1's vocabulary), and train.cu's MFU counts them.
b1="--hidden 1024 --layers 8 --heads 16 --experts 32 --topk 4 --expert_dim 512 --vocab 16384 --seq_len 2048 --batch 8"
profile_step=20  # after warm-up: the pool's blocks cached, cuBLAS's heuristics chosen

# name flags...: one run of 60 steps; the median over steps 11..60 (the profiled step is one of 50:
# its events stretch it a little, the median not), and the breakdown of step $profile_step
speed_run() {
  local name=$1; shift
  "$train" --data "$data" --steps 60 --profile_step $profile_step "$@" $quiet --out "$out/$name" > "$out/$name.log" 2>&1 ||
    { echo "$name run failed (see $out/$name.log)"; tail -5 "$out/$name.log"; }
  echo "| $name | $(summarise "$out/$name/log.csv") | $(device_used "$out/$name.log") |"
}

if [[ " $parts " == *" speed "* ]]; then
  echo "## speed, one GPU ($(basename "$(dirname "$train")") build)"
  echo "| config | step ms (median) | tokens/s | MFU | pool peak MiB | device used MiB |"
  echo "|---|---|---|---|---|---|"
  for rc in 0 1; do speed_run "default_rc$rc" --recompute $rc; done
  speed_run "default_rc0_eager" --recompute 0 --cuda_graph 0  # every kernel issued by the host (notes/speed.md, 'CUDA graphs')
  speed_run "default_rc0_one_stream" --recompute 0 --wgrad_stream 0  # the weight gradients in the chain (notes/speed.md, 'The weight-gradient lanes')
  for rc in 0 1; do speed_run "B1_rc$rc" $b1 --recompute $rc; done
  speed_run "B1_rc0_eager" $b1 --recompute 0 --cuda_graph 0
  speed_run "B1_rc0_one_stream" $b1 --recompute 0 --wgrad_stream 0
  for name in default_rc0 B1_rc0 B1_rc1; do
    echo
    echo "### per-operator breakdown: $name, step $profile_step"
    cat "$out/$name/profile_step$profile_step.md" 2>/dev/null || echo "(no breakdown: see $out/$name.log)"
  done
fi
if [[ " $parts " == *" multi "* ]]; then
  gpus=$(nvidia-smi -L 2> /dev/null | wc -l)
  if [ "$gpus" -lt 2 ]; then
    echo "bench_train.sh multi: needs 2 GPUs or more, found $gpus"
    exit 2
  fi
  echo "## speed on $gpus GPUs against one ($(basename "$(dirname "$train")") build, the default model)"
  echo "| run | step ms (median) | tokens/s (all ranks) | MFU | pool peak MiB | speed-up in tokens/s over 1 GPU |"
  echo "|---|---|---|---|---|---|"
  one=""
  for run in "gpus1:--gpus 1" "gpus${gpus}_ep${gpus}:--gpus $gpus" "gpus${gpus}_ep1:--gpus $gpus --ep 1" \
             "gpus${gpus}_ep1_eager:--gpus $gpus --ep 1 --cuda_graph 0"; do
    name=${run%%:*}
    "$train" --data "$data" --steps 60 ${run#*:} $quiet --out "$out/$name" > "$out/$name.log" 2>&1 ||
      { echo "| $name | run failed (see $out/$name.log) | | | | |"; continue; }
    row=$(summarise "$out/$name/log.csv")
    tok=$(echo "$row" | awk -F' [|] ' '{ print $2 }')
    [ "$name" = gpus1 ] && one=$tok
    echo "| $name | $row | $(awk -v a="$tok" -v b="$one" 'BEGIN { if (b == "") print "n/a (the 1-GPU run failed)"; else printf "%.2fx", a / b }') |"
  done
fi
if [[ " $parts " == *" ab "* ]]; then
  echo "## A/B on one GPU: $BASE_TRAIN (base) against $train (new), alternating"
  echo "| config | base: step ms (median), two runs | new: step ms (median), two runs | new − base (means) |"
  echo "|---|---|---|---|"
  for config in "default:" "B1:$b1"; do
    name=${config%%:*}
    declare -A ms=()
    for round in 1 2; do
      for side in base new; do
        bin=$train
        [ "$side" = base ] && bin=$BASE_TRAIN
        run="ab_${name}_${side}"
        "$bin" --data "$data" --steps 60 --profile_step $profile_step ${config#*:} $quiet --out "$out/$run" > "$out/$run.log" 2>&1 ||
          { echo "$run run failed (see $out/$run.log)"; tail -5 "$out/$run.log"; }
        ms[$side$round]=$(summarise "$out/$run/log.csv" | awk -F' [|] ' '{ print $1 }')
        cp "$out/$run/profile_step$profile_step.md" "$out/$run.profile.md" 2>/dev/null
      done
    done
    echo "| $name | ${ms[base1]} / ${ms[base2]} | ${ms[new1]} / ${ms[new2]} | $(awk -v a="${ms[base1]}" -v b="${ms[base2]}" \
      -v c="${ms[new1]}" -v d="${ms[new2]}" 'BEGIN { printf "%+.2f ms (%+.1f %%)", (c + d - a - b) / 2, 100 * (c + d - a - b) / (a + b) }') |"
    unset ms
  done
  echo
  echo "### B1's step $profile_step, operator by operator (the second base and new runs), largest change first"
  step_gpu() { grep -o '[0-9.]* ms on the GPU' "$1" 2>/dev/null | head -1; }
  echo "The profiled steps: base $(step_gpu "$out/ab_B1_base.profile.md"), new $(step_gpu "$out/ab_B1_new.profile.md")"
  echo "(against the medians above: a profiled step slower than its run's median stretches every row)."
  echo
  echo "| operator (summed over layers) | base ms | new ms | new − base ms |"
  echo "|---|---|---|---|"
  profile_ms() { awk -F'|' 'NF >= 6 && $4 ~ /^ *[0-9.]+ *$/ { gsub(/^ +| +$/, "", $2); printf "%s\t%s\n", $2, $4 + 0 }' "$1"; }
  join -t $'\t' -a 1 -a 2 -e 0 -o 0,1.2,2.2 <(profile_ms "$out/ab_B1_base.profile.md" | sort) \
    <(profile_ms "$out/ab_B1_new.profile.md" | sort) |
    awk -F'\t' '{ d = $3 - $2; printf "%s\t| %s | %.3f | %.3f | %+.3f |\n", (d < 0 ? -d : d), $1, $2, $3, d }' | sort -g -r | cut -f2-
fi
[[ " $parts " == *" limits "* ]] || exit 0

# a stated larger model on a random-token shard long enough for any probe
big="--hidden 1024 --layers 4 --heads 16 --experts 8 --topk 2 --expert_dim 1024"
synthetic="$out/synthetic"
mkdir -p "$synthetic"
"$(dirname "$train")/../synthetic_tokens" "$synthetic/train_000.bin" 100000000 4095 0 ||
  { echo "could not write the synthetic shard"; exit 1; }
ln -sf train_000.bin "$synthetic/val_000.bin"
# A probe asks the trainer's memory prediction (--dry_run 1: exact for one GPU, tests/gpu_memory_prediction.cu)
# whether B x T fits beside what lies outside the pool; the largest value found is then run for one real step.
probe() {  # dry_run B T FLAGS...
  local dry=$1 b=$2 t=$3
  shift 3
  "$train" --data "$data" --train "$synthetic/train_*.bin" --val "$synthetic/val_*.bin" $big --batch "$b" --seq_len "$t" \
    --steps 1 --warmup 1 --dry_run "$dry" "$@" $quiet --out "$out/probe" > "$out/probe.log" 2>&1
}
peak_of_last() { awk -F, 'NR > 1 && $2 != "nan" { p = $9 } END { print p }' "$out/probe/log.csv"; }
largest() {  # what(T|B) start cap FLAGS...: doubling up to cap, then bisection to 1/8 of the last doubling
  local what=$1 v=$2 cap=$3 good=0 bad=0
  shift 3
  at() { if [ "$what" = T ]; then probe "$1" 1 "$2" "${@:3}"; else probe "$1" "$2" 1024 "${@:3}"; fi; }
  while [ "$v" -le "$cap" ]; do
    if at 1 "$v" "$@"; then good=$v; v=$((v * 2)); else bad=$v; break; fi
  done
  local step=$(( (bad - good) / 8 ))
  while [ "$bad" -gt 0 ] && [ "$step" -gt 0 ] && [ $((bad - good)) -gt "$step" ]; do
    local mid=$(( (good + bad) / 2 / step * step ))
    [ "$mid" -le "$good" ] && break
    if at 1 "$mid" "$@"; then good=$mid; else bad=$mid; fi
  done
  local ran="ran"
  if [ "$what" = T ] && [ "$good" -gt 262144 ]; then
    ran="not run (minutes per step)"
    rm -f "$out/probe/log.csv"
  else
    at 0 "$good" "$@" || ran="FAILED (see $out/probe.log)"
  fi
  local shown=$good
  [ "$bad" -eq 0 ] && shown=">= $good (probe cap)"
  echo "$shown | $ran | $(peak_of_last)"
}
echo
echo "## limits of one H200 for: $big (V from the tokenizer), BF16 build"
echo "| probe | configuration | largest that fits (prediction) | one step there | pool peak MiB at it |"
echo "|---|---|---|---|---|"
for config in "--recompute 0" "--recompute 1" "--recompute 1 --offload_budget 1000000000000 --head chunked"; do
  echo "| context T (B = 1) | $config | $(largest T 4096 1048576 $config) |"
  echo "| batch B (T = 1024) | $config | $(largest B 8 8192 $config) |"
done
