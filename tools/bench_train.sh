#!/usr/bin/env bash
# Training benchmark on one GPU (notes/design.md §7, §8; notes/speed.md):
#   speed:  the default model and config B1 (notes/design.md §8), each under three routings: the router
#           from step 0 (with and without CUDA graphs), a trained router's recorded choices (300 steps of
#           training, then 20 passes recorded: --record_routing, replayed with --routing trace:FILE) and
#           --routing balanced (also with recompute 1, and with the weight gradients on the compute stream:
#           --wgrad_stream 0): median step time, tokens/s, MFU (train.cu's: 6 x active parameters + causal
#           attention FLOPs per token against 989 TFLOP/s bf16), pool peak, the experts' balance (max/mean
#           of the worst layer) and the device's used memory; the settling runs' balance by step; then the
#           per-operator breakdown of one step of each balanced run (--profile_step, runtime/profile.cuh:
#           CUDA events around every operator, summed over layers, sorted, % of the step, GB/s of the
#           memory-bound ones);
#   multi:  the default model on every GPU of the machine (2 or more) against one GPU, same flags and
#           per-rank batch (--gpus W keeps B x T per rank: W times the tokens per step): median step time,
#           tokens/s of all ranks, and the speed-up in tokens/s over one GPU, with expert parallelism over
#           all ranks (the default) and without it (--ep 1: experts replicated, no dispatch exchange; its
#           passes captured as CUDA graphs, and once more with --cuda_graph 0, the eager baseline); each under
#           --routing balanced and under the router from step 0, with the experts' balance;
#   ab:     BASE_TRAIN (another build's trainer, e.g. of the commit before a change) against TRAIN on one
#           GPU, alternating base, new, base, new on the default model and B1, both under --routing AB_ROUTING
#           (default balanced: pinned, so that a change cannot win by making one routing faster): each run's median step
#           time, and B1's per-operator breakdown of the last two runs side by side (what moved). Runs
#           on different machines, and even device calls, differ by more than many changes gain, so a
#           change is measured against its predecessor in one call (notes/speed.md, 'How to measure');
#   layout: sequence parallelism (--sp 2) and ZeRO-3 against --sp 1 --zero 1 on every GPU (2 or more; LAYOUT_SHARE=1:
#           2 ranks sharing one GPU, to check the part): the default model and reach's ~300M at T = LAYOUT_T (8192),
#           balanced routing: median step time, tokens/s, pool peak, tokens/s over the plain layout's;
#   reach:  the default model, a ~300M and a ~1B MoE: the longest context (B = 1, up to REACH_MAX_T, default
#           2,097,152) and the
#           largest batch (T = 2048) that fit with the plain stack (--recompute 0), recomputation alone
#           (--recompute 1) and --plan auto, found by doubling then bisecting on the trainer's memory
#           prediction (--dry_run 1, exact on one GPU; the search on the host against the GPU's measured room,
#           its result confirmed on the GPU), then one real step at the value found: step time,
#           tokens/s, pool peak against the prediction, pinned host memory, and what stops the next size
#           (no step above REACH_STEP_MAX_T tokens, when set: the row is the GPU's dry run).
#           REACH_MODELS ("default 300M 1B") picks the models, REACH_CONFIGS ("plain recompute auto") the
#           configurations and REACH_PROBES ("T B") the probes, so that a device call can take a part of one; each
#           real step's pool timeline is kept in OUT_DIR/reach_timelines/MODEL_{T,B}_CONFIG.csv. With recompute
#           and auto both asked for, one more row: --plan auto's step at the longest context recomputation
#           reaches, its speed against recomputation's step there (issue 58's >= 0.9x).
#   reach-shared: the longest context (B = 1 per sequence group) at W = 8 ranks sharing one GPU in sequence groups
#           (--sp D, notes/sequence_parallel.md; memory, not speed: collectives over sockets), under --recompute 1
#           and --recompute 1 --zero 3: the default model at D = 2 (its 6 heads of 64: no larger D divides
#           them) and reach's ~300M MoE at D = 8 (its 16 heads of 64), found as reach's are (rank 0's prediction;
#           the device shared by the 8 ranks' pools and what lies outside them); REACH_SHARED_MODELS
#           ("default 300M") picks the models, one device call each, REACH_SHARED_CONFIGS ("recompute zero3";
#           auto: --plan auto) the configurations. On a machine of 8 GPUs or more each rank has its own GPU: the
#           composed stack's reach at W = 8, and its step times are GPU timings.
# Usage: tools/bench_train.sh TRAIN_BIN DATA_DIR [OUT_DIR] [PARTS] (PARTS: "speed reach", the default,
# or any of speed, multi, ab, layout, reach, reach-shared; ab needs BASE_TRAIN=path in the environment). Prints markdown tables.
set -uo pipefail
train=$1; data=$2; out=${3:-build/bench}; parts=${4:-speed reach}
for p in $parts; do
  case $p in speed|multi|ab|layout|reach|reach-shared) ;; *) echo "bench_train.sh: unknown part '$p' (speed, multi, ab, layout, reach, reach-shared)"; exit 2 ;; esac
done
reach_max_t=${REACH_MAX_T:-2097152} reach_wanted=${REACH_MODELS:-default 300M 1B}
reach_configs=${REACH_CONFIGS:-plain recompute auto} reach_probes=${REACH_PROBES:-T B}
reach_shared_wanted=${REACH_SHARED_MODELS:-default 300M} reach_shared_configs=${REACH_SHARED_CONFIGS:-recompute zero3}
[[ "$reach_max_t" =~ ^[0-9]+$ ]] && [ "$reach_max_t" -ge 16384 ] ||
  { echo "bench_train.sh: REACH_MAX_T must be a whole number of tokens, at least 16384 (got '$reach_max_t')"; exit 2; }
[ -z "${REACH_STEP_MAX_T:-}" ] || [[ "$REACH_STEP_MAX_T" =~ ^[0-9]+$ ]] ||
  { echo "bench_train.sh: REACH_STEP_MAX_T must be a whole number of tokens (got '$REACH_STEP_MAX_T')"; exit 2; }
for m in $reach_wanted; do
  case $m in default|300M|1B) ;; *) echo "bench_train.sh: REACH_MODELS names '$m' (default, 300M, 1B)"; exit 2 ;; esac
done
for x in $reach_configs; do
  case $x in plain|recompute|auto) ;; *) echo "bench_train.sh: REACH_CONFIGS names '$x' (plain, recompute, auto)"; exit 2 ;; esac
done
for x in $reach_probes; do
  case $x in T|B) ;; *) echo "bench_train.sh: REACH_PROBES names '$x' (T: the longest context, B: the largest batch)"; exit 2 ;; esac
done
for m in $reach_shared_wanted; do
  case $m in default|300M) ;; *) echo "bench_train.sh: REACH_SHARED_MODELS names '$m' (default, 300M)"; exit 2 ;; esac
done
for x in $reach_shared_configs; do
  case $x in recompute|zero3|auto) ;; *) echo "bench_train.sh: REACH_SHARED_CONFIGS names '$x' (recompute, zero3, auto)"; exit 2 ;; esac
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

# the experts' balance over the same steps: the median of the step's worst layer's max/mean routes per expert
balance() {  # log.csv
  awk -F, 'NR > 1 && $1 > 10 && $2 != "nan" { print $10 }' "$1" | sort -g | awk '{ a[NR] = $1 } END { printf "%.2f", a[int((NR + 1) / 2)] }'
}

# a run's tokens/s over its baseline's, or why there is none
times_over() {  # TOKENS_PER_S BASELINE_TOKENS_PER_S BASELINE_NAME
  awk -v a="$1" -v b="$2" -v name="$3" 'BEGIN { if (b == "") print "n/a (the " name " run failed)"; else printf "%.2fx", a / b }'
}

# the largest "device used" of a run's step lines (cudaMemGetInfo: context, libraries, pool reserve)
device_used() { grep -o 'device used [0-9.]*' "$1" | awk '{ if ($3 > m) m = $3 } END { printf "%.0f", m }'; }

# config B1 (notes/design.md §8; notes/speed.md, 'What fast means here'). V 16384: the fortunes
# tokenizer has 4096 ids, which fill the first 4096 rows of lm_head; all 16384 rows are projected (the
# same FLOPs as B1's vocabulary), and train.cu's MFU counts them.
b1="--hidden 1024 --layers 8 --heads 16 --experts 32 --topk 4 --expert_dim 512 --vocab 16384 --seq_len 2048 --batch 8"
profile_step=20  # after warm-up: the pool's blocks cached, cuBLAS's heuristics chosen

# name routing flags...: one run of 60 steps under a routing (router: the model's own, from step 0; balanced:
# the profile, every expert N·k/E routes; trace:FILE: recorded choices); the median over steps 11..60 (the
# profiled step is one of 50: its events stretch it a little, the median not), the experts' balance over
# them, and the breakdown of step $profile_step
speed_run() {
  local name=$1 routing=$2; shift 2
  "$train" --data "$data" --steps 60 --profile_step $profile_step --routing "$routing" "$@" $quiet --out "$out/$name" \
    > "$out/$name.log" 2>&1 || { echo "$name run failed (see $out/$name.log)"; tail -5 "$out/$name.log"; }
  echo "| $name | ${routing#trace:$out/} | $(summarise "$out/$name/log.csv") | $(balance "$out/$name/log.csv") | $(device_used "$out/$name.log") |"
}

# A trained router's choices: $settle steps of the config from scratch (the aux-loss-free bias balances the
# router; the run's log.csv shows when), then 20 more training passes recorded from its checkpoint
# (--record_routing); a replay from step 0 takes batch p mod 20 at pass p (data/routing_trace.hpp).
settle=300
record_trace() {  # name flags...: $out/$name.trace, and the settling run's balance by step ($out/${name}_settle/log.csv)
  local name=$1; shift
  "$train" --data "$data" --steps $settle $quiet --ckpt_every $settle "$@" --out "$out/${name}_settle" \
    > "$out/${name}_settle.log" 2>&1 &&
    "$train" --data "$data" --steps $((settle + 20)) $quiet "$@" --resume "$out/${name}_settle/ckpt_$(printf %06d $settle)" \
      --record_routing "$out/$name.trace" --out "$out/${name}_record" > "$out/${name}_record.log" 2>&1 ||
    echo "recording $name's trace failed (see $out/${name}_settle.log, $out/${name}_record.log)"
}

if [[ " $parts " == *" speed "* ]]; then
  record_trace default_router
  record_trace B1_router $b1
  echo "## speed, one GPU ($(basename "$(dirname "$train")") build)"
  echo
  echo "Routing: router = the model's own from step 0 (steps 11-60 of a fresh run: the bias has not balanced it yet);"
  echo "balanced = every expert gets N·k/E routes; X_router.trace = the router's choices after $settle steps of training"
  echo "(replayed: its passes are not captured as CUDA graphs, so router_eager is its like-for-like row)."
  echo "experts max/mean: the step's most loaded expert over the mean, in its worst layer (median over steps 11-60)."
  echo
  echo "| config | routing | step ms (median) | tokens/s | MFU | pool peak MiB | experts max/mean | device used MiB |"
  echo "|---|---|---|---|---|---|---|---|"
  for config in "default:" "B1:$b1"; do
    name=${config%%:*}
    flags=${config#*:}
    speed_run "${name}_router" router $flags --recompute 0
    speed_run "${name}_router_eager" router $flags --recompute 0 --cuda_graph 0  # every kernel issued by the host (notes/speed.md, 'CUDA graphs')
    speed_run "${name}_trace" "trace:$out/${name}_router.trace" $flags --recompute 0
    speed_run "${name}_balanced" balanced $flags --recompute 0
    speed_run "${name}_balanced_rc1" balanced $flags --recompute 1
    speed_run "${name}_balanced_one_stream" balanced $flags --recompute 0 --wgrad_stream 0  # the weight gradients in the chain (notes/speed.md, 'The weight-gradient lanes')
  done
  echo
  echo "### when the router settles: the worst layer's experts max/mean by step (training from scratch)"
  echo "| step | default | B1 |"
  echo "|---|---|---|"
  join -t, <(awk -F, 'NR > 1 && $2 != "nan" && ($1 <= 10 || $1 % 25 == 0) { print $1 "," $10 }' "$out/default_router_settle/log.csv" | sort -t, -k1,1) \
           <(awk -F, 'NR > 1 && $2 != "nan" && ($1 <= 10 || $1 % 25 == 0) { print $1 "," $10 }' "$out/B1_router_settle/log.csv" | sort -t, -k1,1) |
    sort -t, -k1,1n | awk -F, '{ printf "| %s | %s | %s |\n", $1, $2, $3 }'
  for name in default_balanced B1_balanced B1_balanced_rc1; do
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
  echo "Routing: balanced = every expert N·k/E routes; router = the model's own from step 0 (unsettled)."
  echo "| run | routing | step ms (median) | tokens/s (all ranks) | MFU | pool peak MiB | experts max/mean | speed-up in tokens/s over 1 GPU, same routing |"
  echo "|---|---|---|---|---|---|---|---|"
  for routing in balanced router; do
    one=""
    for run in "gpus1:--gpus 1" "gpus${gpus}_ep${gpus}:--gpus $gpus" "gpus${gpus}_ep1:--gpus $gpus --ep 1" \
               "gpus${gpus}_ep1_eager:--gpus $gpus --ep 1 --cuda_graph 0"; do
      name=${run%%:*}_$routing
      "$train" --data "$data" --steps 60 ${run#*:} --routing $routing $quiet --out "$out/$name" > "$out/$name.log" 2>&1 ||
        { echo "| $name | $routing | run failed (see $out/$name.log) | | | | | |"; continue; }
      row=$(summarise "$out/$name/log.csv")
      tok=$(echo "$row" | awk -F' [|] ' '{ print $2 }')
      [ "${run%%:*}" = gpus1 ] && one=$tok
      echo "| $name | $routing | $row | $(balance "$out/$name/log.csv") | $(times_over "$tok" "$one" 1-GPU) |"
    done
  done
fi
if [[ " $parts " == *" ab "* ]]; then
  ab_routing=${AB_ROUTING:-balanced}  # pinned: a change must not win by making one routing faster (notes/speed.md)
  echo "## A/B on one GPU: $BASE_TRAIN (base) against $train (new), alternating; routing $ab_routing"
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
        "$bin" --data "$data" --steps 60 --profile_step $profile_step --routing "$ab_routing" ${config#*:} $quiet \
          --out "$out/$run" > "$out/$run.log" 2>&1 ||
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
# Reach (issue 58, notes/composed_stack.md): three MoE models on a random-token shard long enough for any
# probe — the default (`make train`'s: H 384, L 6, E 8, top-2, I 384; 17M parameters), ~300M (H 1024, L 6, 16 heads,
# E 32, top-4, I 512; 336M: heads of 64, the tensor-core attention's, and 16 of them, so that reach-shared's D = 8
# divides them) and ~1B (H 1536, L 10, 24 heads, E 32, top-4, I 640).
reach_models=("default:" "300M:--hidden 1024 --layers 6 --heads 16 --experts 32 --topk 4 --expert_dim 512"
              "1B:--hidden 1536 --layers 10 --heads 24 --experts 32 --topk 4 --expert_dim 640")
# layout (issue 61, notes/sequence_parallel.md and zero3.md): what sequence parallelism and ZeRO-3 cost on real GPUs.
# Every GPU of the machine, the default model and reach's ~300M at T = LAYOUT_T (default 8192), one sequence per
# sequence group, balanced routing (pinned: the layouts route alike), 30 steps each: --sp 1 --zero 1, --sp 2,
# --zero 3 and both; the median of steps 11-30, and each run's tokens/s over the plain layout's. LAYOUT_SHARE=1 on a
# machine of one GPU runs the part with 2 ranks sharing it, to check the part itself: its timings are not GPU timings.
if [[ " $parts " == *" layout "* ]]; then
  gpus=$(nvidia-smi -L 2> /dev/null | wc -l) share="" layout_t=${LAYOUT_T:-8192}
  where="$gpus GPUs"
  if [ "$gpus" -lt 2 ]; then
    [ "${LAYOUT_SHARE:-0}" = 1 ] ||
      { echo "bench_train.sh layout: needs 2 GPUs or more, found $gpus (LAYOUT_SHARE=1: 2 ranks sharing one, not GPU timings)"; exit 2; }
    gpus=2 share="--share_gpus 1" where="2 ranks SHARING ONE GPU (not GPU timings)"
  fi
  echo "## sequence parallelism and ZeRO-3 on $where ($(basename "$(dirname "$train")") build)"
  echo "T = $layout_t, one sequence per sequence group, balanced routing; the median over steps 11-30."
  echo "| model | layout | step ms (median) | tokens/s (all ranks) | MFU | pool peak MiB | tokens/s over --sp 1 --zero 1 |"
  echo "|---|---|---|---|---|---|---|"
  for model in "${reach_models[@]:0:2}"; do
    plain=""
    for layout in "--sp 1 --zero 1" "--sp 2 --zero 1" "--sp 1 --zero 3" "--sp 2 --zero 3"; do
      name=layout_${model%%:*}_$(echo "$layout" | tr -d ' -')
      "$train" --data "$data" --gpus "$gpus" $share --seq_len "$layout_t" --batch 1 --steps 30 --routing balanced \
        ${model#*:} $layout $quiet --out "$out/$name" > "$out/$name.log" 2>&1 ||
        { echo "| ${model%%:*} | $layout | run failed (see $out/$name.log) | | | | |"; continue; }
      row=$(summarise "$out/$name/log.csv")
      tok=$(echo "$row" | awk -F' [|] ' '{ print $2 }')
      [ "$layout" = "--sp 1 --zero 1" ] && plain=$tok
      echo "| ${model%%:*} | $layout | $row | $(times_over "$tok" "$plain" plain) |"
    done
  done
fi
[[ " $parts " == *" reach "* || " $parts " == *" reach-shared "* ]] || exit 0

synthetic="$out/synthetic"
mkdir -p "$synthetic"
"$(dirname "$train")/../synthetic_tokens" "$synthetic/train_000.bin" 100000000 4095 0 ||
  { echo "could not write the synthetic shard"; exit 1; }
ln -sf train_000.bin "$synthetic/val_000.bin"
# A probe asks the trainer's memory prediction (--dry_run 1: exact for one GPU, tests/gpu_memory_prediction.cu)
# whether B x T fits beside what the GPU holds outside the pools. The search's probes run on the host: the
# trainer's dry run without a GPU gives the same prediction in half a second, without a CUDA context or, at W
# ranks, W processes and their communicators, against the GPU's capacity less what it holds outside the
# pools, both read from one dry run on the GPU at the row's first size. The value found is confirmed by a dry
# run on the GPU (a smaller one where that refuses it), then trained for one real step (at most
# REACH_STEP_TIMEOUT seconds, default 300; none above REACH_STEP_MAX_T tokens a sequence, where one step takes
# longer than a device command may run: such a row is the GPU's dry run alone) that records the pool's timeline, kept per row in
# $out/reach_timelines/ under the row's name (plot: tools/plot_timeline.sh CSV PNG).
rm -rf "$out/reach_failed"  # the failed steps of this run only
mkdir -p "$out/reach_timelines"
probe() {  # host|gpu|step B T FLAGS...
  local how=$1 b=$2 t=$3 mode=() hide=()
  shift 3
  case $how in
    host) mode=(--dry_run 1 --device_capacity "$capacity_less_outside"); hide=(env CUDA_VISIBLE_DEVICES=) ;;
    gpu) mode=(--dry_run 1) ;;
    step) mode=(--dry_run 0 --timeline_step 0) ;;
  esac
  rm -rf "$out/probe"  # its own run folder: a step stopped by the timeout leaves a log the trainer will not overwrite
  timeout "${REACH_STEP_TIMEOUT:-300}" "${hide[@]}" "$train" --data "$data" --train "$synthetic/train_*.bin" \
    --val "$synthetic/val_*.bin" --batch "$b" --seq_len "$t" --steps 1 --warmup 1 "${mode[@]}" "$@" $quiet \
    --out "$out/probe" > "$out/probe.log" 2>&1 && return 0
  local rc=$?
  cp "$out/probe.log" "$out/probe_refused.log"
  return $rc
}
# what the real step logged: ms, tokens/s, pool peak MiB | the prediction against it, and the peak's blocks as the
# pool holds them from CUDA | pinned host MiB
step_of_last() {
  local row pred held host
  row=$(awk -F, 'NR > 1 && $2 != "nan" { r = sprintf("%.0f | %.0f | %.0f", $6, $7, $9) } END { print r }' "$out/probe/log.csv")
  pred=$(grep -o 'predicted [0-9.]* MiB, measured pool peak [0-9.]* MiB ([^)]*)' "$out/probe.log" | sed 's/.*(\(.*\))/\1/' | head -1)
  held=$(grep -o 'its blocks as held from CUDA [0-9]*' "$out/probe.log" | grep -o '[0-9]*$' | head -1)
  [ -n "$held" ] && pred="$pred (blocks held $held MiB)"
  host=$(awk '/pinned host: / { match($0, /pinned host: [0-9.]+/); h += substr($0, RSTART + 13, RLENGTH - 13) }
              /MiB pinned\)/ { match($0, /\([0-9.]+ MiB pinned/); h += substr($0, RSTART + 1, RLENGTH - 12) }
              END { printf "%.0f", h }' "$out/probe.log")
  echo "$row | ${pred:-no prediction line} | $host"
}
# the first match of a grep pattern in a log, or the log's last line
reason() {  # LOG PATTERN
  local why
  why=$(grep -o "$2" "$1" | head -1)
  [ -n "$why" ] || why=$(grep -v '^ *$' "$1" | tail -1)
  echo "$why"
}
# why the last refused probe did not fit: the prediction's peak and where, or its last line
refusal() {
  reason "$out/probe_refused.log" 'predicted peak [0-9]* MiB at [^(]*\|largest term[^.;]*\|cannot fit on the GPU: [^(]*' |
    cut -c1-90
}
# a real step that failed: its log kept as $out/reach_failed/NAME.log, and the trainer's error for the row
failed_step() {  # NAME
  mkdir -p "$out/reach_failed"
  cp "$out/probe.log" "$out/reach_failed/$1.log"
  echo "FAILED: $(reason "$out/probe.log" '[^ ]* error.*' | tr '|' '/' | cut -c1-160) (reach_failed/$1.log)"
}
# whether a step at T tokens a sequence is past REACH_STEP_MAX_T (then its row is the GPU's dry run alone)
past_step_max() { [ -n "${REACH_STEP_MAX_T:-}" ] && [ "$1" -gt "$REACH_STEP_MAX_T" ]; }
largest() {  # ROW what(T|B) start cap FLAGS...: doubling up to cap, then bisection to 1/8 of the last doubling
  local timeline_name what=$2 start=$3 cap=$4 good=0 bad=0 v=$3
  timeline_name=$(echo "$1" | tr -c 'A-Za-z0-9_\n' '_' | sed 's/__*/_/g')  # the row's name as a file name
  shift 4
  at() { if [ "$what" = T ]; then probe "$1" 1 "$2" "${@:3}"; else probe "$1" "$2" 2048 "${@:3}"; fi; }
  if ! at gpu "$start" "$@"; then echo "0 | none fits | | | | | $start: $(refusal)"; return; fi
  local measured device outside
  measured=$(sed -n 's/.*outside the pool \([0-9.]*\) MiB (measured); device \([0-9.]*\) MiB.*/\1 \2/p' "$out/probe.log" | head -1)
  [ -n "$measured" ] || { echo "$start | FAILED: no measured capacity in the GPU's dry run ($out/probe.log) | | | | | "; return; }
  outside=${measured% *}; device=${measured#* }
  echo "$outside" > "$out/reach_outside"
  capacity_less_outside=$(awk -v d="$device" -v o="$outside" 'BEGIN { printf "%.0f", (d - o) * 1048576 }')
  good=$start; v=$((start * 2))
  while [ "$v" -le "$cap" ]; do
    if at host "$v" "$@"; then good=$v; v=$((v * 2)); else bad=$v; break; fi
  done
  local step=$(( (bad - good) / 8 ))
  while [ "$bad" -gt 0 ] && [ "$step" -gt 0 ] && [ $((bad - good)) -gt "$step" ]; do
    local mid=$(( (good + bad) / 2 / step * step ))
    [ "$mid" -le "$good" ] && break
    if at host "$mid" "$@"; then good=$mid; else bad=$mid; fi
  done
  # the GPU's own check has the last word (its margin under --plan auto differs by 5 % of what lies outside)
  local down=$(( step > 0 ? step : good / 8 ))
  while [ "$good" -gt "$start" ] && ! at gpu "$good" "$@"; do
    bad=$good; good=$(( good - down > start ? good - down : start ))
  done
  local shown=$good why=""
  [ "$bad" -eq 0 ] && shown=">= $good (probe cap)"
  [ "$bad" -gt 0 ] && why="$bad: $(refusal)"
  echo "$good" > "$out/reach_found"
  if [ "$what" = T ] && past_step_max "$good"; then
    echo "$shown | not run: T above REACH_STEP_MAX_T = $REACH_STEP_MAX_T (the GPU's dry run fits it) | | | | | ${why}"
    return
  fi
  at step "$good" "$@"
  case $? in
    0) cp "$out/probe/timeline_step0.csv" "$out/reach_timelines/$timeline_name.csv" 2> /dev/null
       local row
       row=$(step_of_last)
       echo "${row%% |*}" > "$out/reach_step_ms"
       echo "$shown | $row | ${why}" ;;
    124) echo "$shown | not run: the step took over ${REACH_STEP_TIMEOUT:-300} s | | | | | ${why}" ;;
    *) echo "$shown | $(failed_step "$timeline_name") | | | | | ${why}" ;;
  esac
}
if [[ " $parts " == *" reach "* ]]; then
  echo
  echo "## reach of one GPU ($(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1)), BF16 build"
  echo "Each row: the longest sequence (B = 1) or the largest batch (T = 2048) whose prediction fits, found by"
  echo "doubling then bisecting with --dry_run 1, then one real step there: its time, tokens/s, pool peak, the"
  echo "prediction against that peak, the pinned host memory, and what stops the next size."
  echo
  echo "| model | probe | configuration | largest that fits | step ms | tokens/s | pool peak MiB | prediction vs peak | pinned host MiB | the next size stops at |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  for model in "${reach_models[@]}"; do
    name=${model%%:*}
    flags=${model#*:}
    [[ " $reach_wanted " == *" $name "* ]] || continue
    for short in $reach_configs; do
      case $short in plain) config="--recompute 0" ;; recompute) config="--recompute 1" ;; auto) config="--plan auto" ;; esac
      for what in $reach_probes; do
        rm -f "$out/reach_found" "$out/reach_step_ms"
        if [ "$what" = T ]; then
          echo "| $name | context T (B = 1) | $config | $(largest "${name}_T_$config" T 4096 "$reach_max_t" $flags $config) |"
        else
          echo "| $name | batch B (T = 2048) | $config | $(largest "${name}_B_$config" B 1 4096 $flags $config) |"
        fi
        # issue 58's speed target: --plan auto at the longest context recomputation reaches, against its step
        if [ "$short" = recompute ] && [ "$what" = T ] && [[ " $reach_configs " == *" auto "* ]] && [ -s "$out/reach_found" ]; then
          t_found=$(cat "$out/reach_found") recompute_ms=$(cat "$out/reach_step_ms" 2> /dev/null)
          if past_step_max "$t_found"; then
            echo "| $name | context T = $t_found, recompute's | --plan auto | $t_found | not run: T above REACH_STEP_MAX_T = $REACH_STEP_MAX_T | | | | | |"
            continue
          fi
          probe step 1 "$t_found" $flags --plan auto
          case $? in
            0) auto_row=$(step_of_last)
               auto_ms=${auto_row%% |*}
               echo "| $name | context T = $t_found, recompute's | --plan auto | $t_found | $auto_row | $(awk -v a="$auto_ms" \
                 -v r="$recompute_ms" 'BEGIN { if (r > 0 && a > 0) printf "speed %.2fx recomputation'"'"'s (%s ms)", r / a, r; else print "no recomputation step to compare" }') |" ;;
            124) echo "| $name | context T = $t_found, recompute's | --plan auto | $t_found | not run: the step took over ${REACH_STEP_TIMEOUT:-300} s | | | | | |" ;;
            *) echo "| $name | context T = $t_found, recompute's | --plan auto | $t_found | $(failed_step "${name}_T${t_found}_plan_auto") | | | | | |" ;;
          esac
        fi
      done
    done
  done
fi
[[ " $parts " == *" reach-shared "* ]] || exit 0
# W = 8 ranks: sharing this machine's GPU where it has fewer than 8, else one GPU each (the composed stack on real GPUs)
gpus=$(nvidia-smi -L 2> /dev/null | wc -l) share="--share_gpus 1"
[ "$gpus" -ge 8 ] && share=""
echo
if [ -n "$share" ]; then
  echo "## reach of 8 ranks sharing one GPU ($(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1)) in sequence groups, BF16 build"
  echo "Each row: the longest sequence whose rank-0 prediction fits beside the other 7 ranks' pools and what lies"
  echo "outside them (B = 1 per sequence group: 8/D sequences a step), then one real step there (collectives over"
  echo "sockets: its time is not a GPU time). Outside the pools: what the GPU's dry run measured beside them (every"
  echo "rank's context, communicators and cuBLAS handle)."
else
  echo "## reach of 8 GPUs ($(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1)), one rank each, in sequence groups, BF16 build"
  echo "Each row: the longest sequence whose rank-0 prediction fits its GPU (B = 1 per sequence group: 8/D sequences"
  echo "a step), then one real step there. Outside the pools: what rank 0's GPU holds beside its pool."
fi
echo
echo "| model | D | configuration | longest T that fits | step ms | tokens/s | pool peak MiB (rank 0) | prediction vs peak | pinned host MiB | the next size stops at | outside the pools MiB |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
shared_models=("default:2:" "300M:8:${reach_models[1]#*:}")
for model in "${shared_models[@]}"; do
  name=${model%%:*}
  [[ " $reach_shared_wanted " == *" $name "* ]] || continue
  rest=${model#*:}
  D=${rest%%:*}
  flags="${rest#*:} --gpus 8 $share --sp $D"
  for short in $reach_shared_configs; do
    case $short in recompute) config="--recompute 1" ;; zero3) config="--recompute 1 --zero 3" ;; auto) config="--plan auto" ;; esac
    rm -f "$out/reach_outside"
    row=$(largest "shared_${name}_D${D}_$config" T 16384 "$reach_max_t" $flags $config)
    echo "| $name | $D | $config | $row | $(cat "$out/reach_outside" 2> /dev/null) |"
  done
done
