#!/usr/bin/env bash
# One device call: build everything, run the whole test suite (CPU + GPU, both precisions),
# then the training run and the benchmarks that are asked for. Logs go to $OUT (or build/gpu-out).
# Usage: tests/gpu.sh [test] [dist] [toy8] [shared] [train] [train2] [bench] [speed] [multi] [ab] [bench-ep] [bench-opt] [bench-head] [head] [attention] [moe] [accum] [sco] [sco-timelines] [zero3] [layout] [reach] [reach-shared] [memory] [sanitize] [faults] [train-steps=N]   (default: test)
#   test: `make test`, then each GPU test binary once more in a shuffled order (--gtest_shuffle)
#   dist: the whole test_dist at W = 2, 4 and 8 (DIST_WORLDS), both precisions, the ranks sharing the GPUs where W
#     exceeds them (--share_gpus, notes/multi-gpu.md): one line per W and precision with the largest error of each suite
#     (dist.md), the rank logs (dist_logs.tgz); DIST_PRECISIONS, DIST_FILTER (a gtest filter) and DIST_TIMEOUT (s per run, 600) narrow it;
#     DIST_SHARD=i/n runs the i-th of n GoogleTest shards (i from 0), so that a run too long for one device call is n calls;
#     DIST_JOBS=n runs n of the (W, precision) runs at once; stopped by SIGTERM (a command limit), it stops the runs and
#     still writes dist_logs.tgz and the rows of the runs that had ended
#   toy8: the README's toy 8-rank run on CORPUS=large with the ranks sharing this machine's GPUs, each dispatcher and
#     the ring head beside one rank of the same global batch, and a resume at W = 8 (TOY_STEPS, default 100);
#     TOY_RUNS names the runs of this call (default all: one_rank ep ep_resumed llep pllep relay_expert relay_token
#     ring_dtp; ep_resumed resumes ep's checkpoint, so ep runs first on the same machine), the table shows every run there
#   shared: the multi-rank checks that waited for several GPUs, the ranks sharing this machine's: the two-rank Trainer
#     tests, training at W = 2 and 8 (llep, pllep, relay under --recompute 1; each optimizer) with resume, and
#     bench_ep_moe --check 1 and bench_optimizer at W = 2, 4, 8 (shared.md); SHARED_PARTS ("trainer train bench"),
#     SHARED_WORLDS (the training runs' W, "2 8"), SHARED_RUNS (a bash regex over the runs' --moe flags; default
#     every run) and SHARED_BENCH_WORLDS ("2 4 8") split it over device calls
#   train2: the default model on every GPU of the machine
#   bench: tools/bench_train.sh as `make bench` runs it, its parts from BENCH_PARTS (default "speed reach")
#   speed: issue 13's speed work (notes/speed.md): the whole test_gpu in both precisions (with 2 GPUs or more
#     also test_dist's DistModel), compute-sanitizer memcheck and racecheck over the grouped
#     GEMM, RMSNorm and RoPE tests, then
#     tools/bench_train.sh's speed part on one GPU: the default model and config B1 under the router, a trained
#     router's recorded trace and balanced routing, tokens/s, MFU, memory, the experts' balance, the settling runs'
#     balance by step, and the per-operator breakdown of step 20 (speed.md; the profile_step*.md files in
#     speed_profiles.tgz), and
#     bench_expert_gemm (the expert GEMMs of the default model's and B1's layers: flatmoe's grouped GEMM, cuBLAS's grouped call, the per-expert loop);
#     with 2 GPUs or more also bench_train.sh's multi part (the default model on every GPU against one, with and without
#     expert parallelism: the speed-up in tokens/s)
#   multi: bench_train.sh's multi part alone (2 GPUs or more): the default model on every GPU against one, under
#     balanced routing and the router
#   ab: bench_train.sh's ab part: this tree's BF16 trainer against the one built from ab-base/, a copy of an
#     older commit (`mkdir ab-base && git archive REV | tar -x -C ab-base`; git-ignored, so name it in the
#     device's carry): both alternating on the default model and B1, and B1's operators side by side; then
#     both trees' bench_expert_gemm, alternating base, new, base, new: the grouped_gemm TFLOP/s of each
#     expert GEMM of the default model's and B1's layers, side by side (ab_expert_gemm.md)
#   bench-ep: the expert-parallel dispatchers' benchmark (ep, llep, pllep, relay expert/token/auto, 1 GPU) at N=16384 tokens/rank, pllep
#     with c=2048 (K=8), --check 1, its memory timelines (ep_timelines.tgz), and pllep's token budget sweep on hot:1/4
#   bench-opt: the optimizer step (notes/offload_adamw.md): the CPU AdamW loop alone (scalar vs vectorised, 1 thread to
#     all) at 256M parameters; offload_adamw (beta x s sweep), cpu_adamw (its pipeline's chunks at each beta, and one
#     chunk) and adamw at 1B parameters on one GPU, at 4B
#     and 16B (where host memory allows) with beta 2^22 and 2^24 at s = 2; on every GPU at once at 1B and 4B per rank;
#     the compiler's vectorisation report of the CPU loop (cpu_adamw_vec.txt); about 3 minutes after the build
#   bench-head: the output heads (notes/ring_dtp.md): full vs chunked vs Ring-DTP (P = every GPU) at the paper's
#     Table 2 shape in FP32 (H 7168, V 200000, N 4096 per rank; Ring-DTP alone at N 110000, where weights move,
#     one timed pass), one rank's fused steps of P = 2 and P = 8 at that shape (full vs chunked: N 8192 V 100000
#     C 4080, N 32768 V 25000 C 1020) and at BF16 training shapes; each row with its per-pass milliseconds
#   head: the output heads' tests alone (test_gpu's ChunkedHeadGpu, test_dist's RingDTPDist and the ring-head
#     model tests, both precisions) and 30 training steps on every GPU with --head ring_dtp and --head chunked
#   attention: the attention kernels alone (notes/attention.md): GpuAttention* in both precisions, compute-sanitizer
#     racecheck, memcheck and synccheck over the BF16 determinism test and every kernel form against the reference
#     (SIMT, mma.sync, wgmma), and bench_attention (BF16: every form, T 1024/2048/4096, hd 64/128; then hd 64 at
#     T 1024/2048 with B1's 128 sequence-heads)
#   memory: the whole device beside the pool (the device ledger, runtime/pool.cuh) on the 334M-parameter MoE of
#     issue 11 (H 768, L 8, E 32, top-4, I 512, T 1024, batch 16), 3 steps on 1 GPU, on 2 with expert
#     parallelism and on 2 without (--ep 1): the first step's "memory after the first step" line
#   moe: the MoE dispatchers alone — test_gpu, then test_dist's EpMoEDist/LlepDist/RelayMoEDist/DistModel tests, in
#     both precisions (one log), and 30 training steps on every GPU with --moe ep, llep, pllep and relay (expert and
#     token mode; hot:0.5/2 routing), llep, pllep and relay also with --recompute 1
#   accum: BF16 gradient accumulation against the FP32 build: 200 steps of 8 micro-batches on one GPU,
#     the loss gap and the pool peak (build/base_bf16_train, when present: the same run before a change)
#   sco: SCO, selective attention recomputation and the memory prediction (notes/sco.md) — GpuSco.*,
#     GpuMemoryPrediction.* and the DistModel SCO/kept-attention/prediction tests in both precisions, then 30 BF16
#     training steps of B1 (T = 2048, batch 8) on the fortunes data: recompute off, on, SCO at 2, 4, 8 boundaries,
#     kept attention at 3 device budgets, and at T = 8192 (batch 2) recompute off, on and kept attention at 0.9:
#     mean step time of steps 11-30, pool peak, the prediction (sco.md)
#   sco-timelines: the pool's timeline of one B1 step under recomputation, with SCO on every boundary and with
#     kept attention (sco_timelines.tgz, CSV per run)
#   zero3: ZeRO-3's tests (test_gpu's, and test_dist's at W = 2 and 8: ZERO3_WORLDS, ZERO3_PRECISIONS) and the default
#     model at W = 8 ranks sharing the GPUs under --zero 1 and 3: predicted and measured peaks, step 5's pool timeline
#   reach: the longest context and the largest batch of three MoE models on one GPU, plain, recomputed and under
#     --plan auto, and --plan auto's step at recomputation's longest context (tools/bench_train.sh reach; REACH_MODELS
#     picks default, 300M and/or 1B, REACH_CONFIGS plain, recompute and/or auto, REACH_PROBES T and/or B)
#   layout: tools/bench_train.sh's layout part: --sp 2 and --zero 3 against --sp 1 --zero 1 on every GPU (2 or more;
#     LAYOUT_SHARE=1 on one GPU: 2 ranks sharing it, to check the part, not GPU timings): tokens/s and pool peak (layout.md)
#   reach-shared: the longest context at W = 8 ranks sharing the GPU in sequence groups (--sp), under --recompute 1 and
#     with --zero 3 (tools/bench_train.sh reach-shared; REACH_SHARED_MODELS picks default and/or 300M,
#     REACH_SHARED_CONFIGS recompute, zero3 and/or auto); on 8 GPUs or more one rank a GPU
#   sanitize: compute-sanitizer memcheck with leak check over the whole-model GPU tests and 3 training steps
#   faults: the multi-GPU failure tests (CommFailure.*: a rank that never joins, an NCCL error, a rank that
#     leaves during a layer's exchange) 3 times in each precision, one line each: their reliability
# FLATMOE_REQUIRE_GPU=1: a GPU test that finds no usable device fails instead of skipping.
# GPU_TARGETS: what to build instead of everything (make targets, e.g. "build/fp32/test_dist build/bf16/test_dist").
# Exit status: non-zero when the build, a test run or a sanitizer run failed (the other parts still run).
# Dependencies come from .deps/ (Debian packages unpacked: Eigen, GoogleTest sources, fortunes),
# since the GPU machine has no package registry.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
export FLATMOE_REQUIRE_GPU=1
deps=.deps/usr
vars="EIGEN_DIR=$deps/include/eigen3 GTEST_DIR=$deps/src/googletest/googletest FORTUNES=$deps/share/games/fortunes"
want=${*:-test}
steps=$(echo "$want" | sed -n 's/.*train-steps=\([0-9]*\).*/\1/p')
summary=()
status=0

if [ -n "${DIST_SHARD:-}" ] && ! [[ "$DIST_SHARD" =~ ^([0-9]+)/([0-9]+)$ && ${BASH_REMATCH[1]} -lt ${BASH_REMATCH[2]} ]]; then
  echo "tests/gpu.sh: DIST_SHARD must be i/n with 0 <= i < n (got '$DIST_SHARD')"
  exit 2
fi
for part in ${SHARED_PARTS:-}; do
  case $part in trainer|train|bench) ;; *) echo "tests/gpu.sh: SHARED_PARTS names '$part' (trainer, train, bench)"; exit 2 ;; esac
done
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
t0=$(date +%s)
make -j"$(nproc)" $vars ${GPU_TARGETS:-all data} > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
summary+=("build: $(( $(date +%s) - t0 )) s")

if [[ " $want " == *" test "* ]]; then
  make $vars test > "$OUT/test.log" 2>&1 || status=1
  for p in fp32 bf16; do
    grep -h "^\[err\]\|^\[mem\]\|^\[train\]\|^\[overfit\]\|^\[route\]\|^\[dist\] step" build/test-logs/build_test_cpu.log build/test-logs/build_${p}_test_gpu.log \
      build/test-logs/build_${p}_test_dist.log > "$OUT/errors-$p.txt"
  done
  grep -h "FAILED\|Failure\|error" build/test-logs/*.log | head -40
  summary+=("tests: $(tail -1 "$OUT/test.log")")
  for p in fp32 bf16; do
    build/$p/test_gpu --gtest_shuffle > "$OUT/test_gpu_shuffled_$p.log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || status=1
    summary+=("$p test_gpu shuffled: exit $rc | $(grep -o 'seed of [0-9]*' "$OUT/test_gpu_shuffled_$p.log" | head -1) | $(
      grep '^\[  \(PASSED  \|FAILED  \|SKIPPED \)\] [0-9]* test' "$OUT/test_gpu_shuffled_$p.log" | tr '\n' ' ')")
    # a failure in the shuffled order names the test and its first assertion's location and message
    grep -q '^\[  FAILED  \]' "$OUT/test_gpu_shuffled_$p.log" && summary+=("  $(grep -m1 -A2 ': Failure$' "$OUT/test_gpu_shuffled_$p.log" | tr '\n' ' ') | $(
      grep '^\[  FAILED  \] [A-Za-z]' "$OUT/test_gpu_shuffled_$p.log" | sort -u | tr '\n' ' ')")
  done
fi

# dist: the whole test_dist at W = 2, 4 and 8 in both precisions; W above the machine's GPUs with the ranks
# sharing them (FLATMOE_SHARE_GPUS=1). One line per W and precision, and the largest measured error of each
# suite over every rank's log (dist.md); the rank logs in dist_logs.tgz.
if [[ " $want " == *" dist "* ]]; then
  gpus=$(nvidia-smi -L | wc -l)
  rm -rf build/dist-logs && mkdir -p build/dist-logs
  dist_run() {  # W PRECISION: one test_dist run; its exit status in $logs.rc, its table row in $logs.row, its summary lines in $logs.sum
    local W=$1 p=$2 logs=build/dist-logs/W$1-$2 share=0 t1 rc errors
    [ "$W" -gt "$gpus" ] && share=1
    t1=$(date +%s)
    FLATMOE_SHARE_GPUS=$share FLATMOE_TEST_WORLD=$W FLATMOE_TEST_LOG_DIR=$logs timeout --foreground "${DIST_TIMEOUT:-600}" \
      env ${DIST_SHARD:+GTEST_SHARD_INDEX=${DIST_SHARD%/*} GTEST_TOTAL_SHARDS=${DIST_SHARD#*/}} \
      build/$p/test_dist ${DIST_FILTER:+--gtest_filter=$DIST_FILTER} > "$logs.log" 2>&1
    rc=$?
    echo $rc > "$logs.rc"
    count() { sed -n "s/^\[  $1 *\] \([0-9]*\) test.*/\1/p" "$logs.log" | tail -1; }
    errors=$(awk '/^\[ RUN      \] / { split($4, name, "."); suite = name[1] }
                  /^\[err\]/ { for (i = 1; i <= NF; i++) if ($i ~ /^rel=/) { v = substr($i, 5) + 0; if (v > most[suite]) most[suite] = v } }
                  END { for (s in most) printf "%s %.2e, ", s, most[s] }' "$logs"/dist_rank*.log 2>/dev/null | sed 's/, $//')
    echo "| $W${DIST_SHARD:+ (shard $DIST_SHARD)} | $gpus | $p | $(count PASSED) | $(count FAILED) | $(count SKIPPED) | $(( $(date +%s) - t1 )) | ${errors:-none} |" > "$logs.row"
    {
      echo "test_dist W=$W $p (share $share): exit $rc | $(grep '^\[  \(PASSED  \|FAILED  \|SKIPPED \)\] [0-9]* test' "$logs.log" | tr '\n' ' ')"
      grep -q '^\[  FAILED  \]' "$logs.log" && echo "  $(grep '^\[  FAILED  \] [A-Za-z]' "$logs.log" | sort -u | tr '\n' ' ')"
      # where the run's time went: rank 0's five slowest tests
      echo "  slowest: $(sed -n 's/^\[ *\(OK\|FAILED\) *\] \([^ ]*\) (\([0-9]*\) ms)$/\3 \2/p' "$logs"/dist_rank0.log 2>/dev/null |
        sort -rn | head -5 | awk '{ printf "%s %.0f s, ", $2, $1 / 1000 }' | sed 's/, $//')"
    } > "$logs.sum"
  }
  # A call stopped from outside (a device's command limit: SIGTERM) stops the runs (each run's `timeout` passes
  # the signal to test_dist, whose launcher passes it to the ranks) and still leaves the rows of the runs that had
  # ended and every rank log written so far
  dist_stopped() {
    for pid in "${run_pids[@]}"; do pkill -TERM -P "$pid"; done
    wait
    echo "tests/gpu.sh: stopped; the dist runs that had ended:"
    cat build/dist-logs/*.row 2>/dev/null
    tar czf "$OUT/dist_logs.tgz" -C build dist-logs
    exit 124
  }
  trap dist_stopped TERM
  # DIST_JOBS runs that many (W, precision) runs at once (their ranks all on this machine's GPUs): the wall times
  # in dist.md are then those of runs sharing the machine with each other
  runs=() run_pids=()
  for W in ${DIST_WORLDS:-2 4 8}; do for p in ${DIST_PRECISIONS:-fp32 bf16}; do runs+=("$W $p"); done; done
  for run in "${runs[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "${DIST_JOBS:-1}" ]; do wait -n; done
    dist_run $run &
    run_pids+=($!)
  done
  wait
  echo "| W | GPUs | precision | passed | failed | skipped | s | largest error per suite (over every rank) |" > "$OUT/dist.md"
  echo "|---|---|---|---|---|---|---|---|" >> "$OUT/dist.md"
  for run in "${runs[@]}"; do
    logs=build/dist-logs/W${run% *}-${run#* }
    cat "$logs.row" >> "$OUT/dist.md"
    [ "$(cat "$logs.rc")" -eq 0 ] || status=1
    while IFS= read -r line; do summary+=("$line"); done < "$logs.sum"
  done
  tar czf "$OUT/dist_logs.tgz" -C build dist-logs
  trap - TERM
  cat "$OUT/dist.md"
fi

if [[ " $want " == *" train "* ]]; then
  build/bf16/train --data data/fortunes --out build/run-default ${steps:+--steps $steps} --timeline_step 5 \
    > "$OUT/train.log" 2>&1
  summary+=("train: exit $? | $(grep -c '^step' "$OUT/train.log") log lines | $(grep 'val loss' "$OUT/train.log" | sed -n '1p;$p' | tr '\n' ' ')")
  cp build/run-default/log.csv "$OUT/train_log.csv" 2>/dev/null
  cp build/run-default/timeline_step5.csv "$OUT/" 2>/dev/null
fi

# toy8: the README's toy 8-rank run on this machine's GPUs (the ranks sharing them): the default model on
# CORPUS=large, T 1024, batch 2 per rank, TOY_STEPS steps (default 100) for each dispatcher (ep, llep, pllep, relay
# expert and token) and the ring head, beside one rank with the same global batch (--batch 16); the ep run resumed at
# W = 8 from its checkpoint at half the steps must log the same losses bit for bit. toy8.md: the validation losses of
# every run side by side; toy8_logs.tgz: every log.csv and log.
if [[ " $want " == *" toy8 "* ]]; then
  make $vars data CORPUS=large > "$OUT/toy8_data.log" 2>&1 || { status=1; tail -5 "$OUT/toy8_data.log"; }
  toy_steps=${TOY_STEPS:-100}
  half=$((toy_steps / 2))
  toy_runs=" ${TOY_RUNS:-one_rank ep ep_resumed llep pllep relay_expert relay_token ring_dtp} "
  mkdir -p build/toy8
  common="--data data/large --seq_len 1024 --steps $toy_steps --val_every $((toy_steps / 4)) --val_batches 10 --sample_every 0 --log_every 10"
  toy_run() {  # NAME FLAGS... (only the runs TOY_RUNS names)
    local name=$1 t1
    shift
    [[ "$toy_runs" == *" $name "* ]] || return 0
    rm -rf "build/toy8/$name" "build/toy8/$name.log"
    t1=$(date +%s)
    timeout "${TOY_TIMEOUT:-300}" build/bf16/train $common --out build/toy8/$name "$@" > build/toy8/$name.log 2>&1
    local rc=$?
    [ "$rc" -eq 0 ] || status=1
    summary+=("toy8 $name: exit $rc, $(( $(date +%s) - t1 )) s | $(grep '^step' build/toy8/$name.log | tail -1 | cut -c1-120)")
  }
  toy_run one_rank --gpus 1 --batch 16
  toy_run ep --gpus 8 --share_gpus 1 --batch 2 --moe ep --ckpt_every $half
  toy_run ep_resumed --gpus 8 --share_gpus 1 --batch 2 --moe ep --ckpt_every $half --resume build/toy8/ep/ckpt_$(printf %06d $half)
  toy_run llep --gpus 8 --share_gpus 1 --batch 2 --moe llep --ckpt_every 0
  toy_run pllep --gpus 8 --share_gpus 1 --batch 2 --moe pllep --token_budget 512 --ckpt_every 0
  toy_run relay_expert --gpus 8 --share_gpus 1 --batch 2 --moe relay --relay_mode expert --ckpt_every 0
  toy_run relay_token --gpus 8 --share_gpus 1 --batch 2 --moe relay --relay_mode token --ckpt_every 0
  toy_run ring_dtp --gpus 8 --share_gpus 1 --batch 2 --head ring_dtp --ckpt_every 0
  # the resumed run's training losses against the straight run's, from step half + 1 (bit for bit: the same text)
  resumed=$(awk -F, -v h=$half 'NR > 1 && $2 != "nan" && $1 > h { print $1 "," $2 }' build/toy8/ep_resumed/log.csv 2>/dev/null)
  straight=$(awk -F, -v h=$half 'NR > 1 && $2 != "nan" && $1 > h { print $1 "," $2 }' build/toy8/ep/log.csv 2>/dev/null)
  if [[ "$toy_runs" == *" ep_resumed "* ]]; then
    if [ -n "$resumed" ] && [ "$resumed" == "$straight" ]; then summary+=("toy8 resume at W=8: steps $((half + 1))-$toy_steps bit-identical")
    else summary+=("toy8 resume at W=8: DIFFERS"); status=1; fi
  fi
  # one row a run: the steps it logged (fewer where TOY_TIMEOUT cut it), its validation losses at one rank's
  # validation steps (- where it did not reach them), the largest train-loss gap to one rank over the steps both logged
  if [ ! -s build/toy8/one_rank/log.csv ]; then
    echo "toy8: no table: one_rank's log is missing (name one_rank in TOY_RUNS on this machine first)" > "$OUT/toy8.md"
  else {
    echo "| run | steps | $(awk -F, 'NR > 1 && $2 == "nan" { printf "val@%s | ", $1 }' build/toy8/one_rank/log.csv)last train loss | largest train-loss gap to one_rank | ms/step (shared: not GPU timings) |"
    echo "|---|---|$(awk -F, 'NR > 1 && $2 == "nan" { printf "---|" }' build/toy8/one_rank/log.csv)---|---|---|"
    for name in one_rank ep llep pllep relay_expert relay_token ring_dtp; do
      [ -s build/toy8/$name/log.csv ] || continue
      awk -F, -v name=$name 'FNR == 1 { file++; next }
        file == 1 && $2 == "nan" { vsteps[++nv] = $1 } file == 1 && $2 != "nan" { base[$1] = $2 }
        file == 2 && $2 == "nan" { val[$1] = sprintf("%.4f", $3) }
        file == 2 && $2 != "nan" { last = $2; steps = $1; if ($1 > 10) { ms += $6; k++ }
                                   if ($1 in base) { d = $2 - base[$1]; if (d < 0) d = -d; if (d > gap) { gap = d; at = $1 } } }
        END { printf "| %s | %d | ", name, steps; for (i = 1; i <= nv; i++) printf "%s | ", (vsteps[i] in val) ? val[vsteps[i]] : "-"
              printf "%.4f | %.4f (step %d) | %.1f |\n", last, gap, at, k ? ms / k : 0 }' build/toy8/one_rank/log.csv build/toy8/$name/log.csv
    done
  } > "$OUT/toy8.md"
  fi
  cat "$OUT/toy8.md"
  tar czf "$OUT/toy8_logs.tgz" --exclude='ckpt_*' -C build toy8
fi

# zero3: ZeRO-3 (notes/zero3.md): test_gpu's GpuZero3.* and the two-rank trainer resume under --zero 3 (the ranks
# sharing the GPUs); test_dist's tests that run --zero 3 (DistModel.Zero3*, RecomputeAtWRanks*, StateSaved*,
# MemoryPrediction*, DistSequenceParallel.FirstStepUnderZero3*) at W = 2 and 8 (ZERO3_WORLDS), in both precisions (ZERO3_PRECISIONS); then the default model
# at W = 8 ranks sharing the GPUs, 6 BF16 steps under --zero 1 and --zero 3 with step 5's pool timeline: the
# start-up prediction and the first step's measured peak of each (zero3.md), the logs and timelines in zero3_logs.tgz.
if [[ " $want " == *" zero3 "* ]]; then
  rm -rf build/zero3 && mkdir -p build/zero3
  count_line() { grep -h '^\[  \(PASSED  \|FAILED  \|SKIPPED \)\] [0-9]* test' "$1" | tr '\n' ' '; }
  for p in ${ZERO3_PRECISIONS:-fp32 bf16}; do
    FLATMOE_SHARE_GPUS=1 FLATMOE_BIN=build/ FLATMOE_TRAIN=build/fp32/train build/$p/test_gpu \
      --gtest_filter='GpuZero3.*:Trainer.ResumeUnderZero3*:GpuMemoryPrediction.HoldsUnderZero3' > build/zero3/test_gpu_$p.log 2>&1 || status=1
    summary+=("zero3 test_gpu $p: $(count_line build/zero3/test_gpu_$p.log)")
    for W in ${ZERO3_WORLDS:-2 8}; do
      FLATMOE_SHARE_GPUS=1 FLATMOE_TEST_WORLD=$W FLATMOE_TEST_LOG_DIR=build/zero3/dist_W${W}_$p timeout "${DIST_TIMEOUT:-600}" \
        build/$p/test_dist --gtest_filter='DistModel.Zero3*:DistModel.RecomputeAtWRanks*:DistModel.StateSaved*:DistModel.MemoryPrediction*:DistSequenceParallel.FirstStepUnderZero3*' \
        > build/zero3/dist_W${W}_$p.log 2>&1 || status=1
      summary+=("zero3 test_dist W=$W $p: $(count_line build/zero3/dist_W${W}_$p.log)")
    done
  done
  echo "| --zero | predicted pool peak (rank 0) | measured after the first step |" > "$OUT/zero3.md"
  echo "|---|---|---|" >> "$OUT/zero3.md"
  for z in 1 3; do
    timeout 300 build/bf16/train --data data/fortunes --gpus 8 --share_gpus 1 --zero $z --steps 6 --val_every 0 --sample_every 0 \
      --ckpt_every 0 --log_every 1 --timeline_step 5 --out build/zero3/train_zero$z > build/zero3/train_zero$z.log 2>&1 || status=1
    echo "| $z | $(grep -m1 '^memory prediction (Eq. 6' build/zero3/train_zero$z.log | cut -c1-400) | $(grep -m1 '^memory prediction vs the first step' build/zero3/train_zero$z.log) |" >> "$OUT/zero3.md"
  done
  cat "$OUT/zero3.md"
  tar czf "$OUT/zero3_logs.tgz" -C build zero3
fi

# shared: the multi-rank checks that waited for a machine of several GPUs, with the ranks sharing this one's
# (correctness and memory; their timings are not GPU timings): test_gpu's two-rank Trainer tests in both precisions;
# 20 BF16 training steps at W = 2 and 8 of --moe llep, pllep and relay (expert, token) under --recompute 1 and of
# each optimizer, each resumed from its step-10 checkpoint (steps 11-20 bit-identical); bench_ep_moe --check 1 and
# bench_optimizer at W = 2, 4 and 8 (shared.md; the logs in shared_logs.tgz).
if [[ " $want " == *" shared "* ]]; then
  rm -rf build/shared && mkdir -p build/shared
  shared_parts=" ${SHARED_PARTS:-trainer train bench} "
  for p in fp32 bf16; do
    [[ "$shared_parts" == *" trainer "* ]] || break
    FLATMOE_SHARE_GPUS=1 FLATMOE_BIN=build/ FLATMOE_TRAIN=build/fp32/train build/$p/test_gpu --gtest_filter='Trainer.*TwoRanks*' \
      > build/shared/trainer_$p.log 2>&1 || status=1
    summary+=("Trainer two-rank tests $p (shared): $(grep -h '^\[  \(PASSED  \|FAILED  \|SKIPPED \)\] [0-9]* test' build/shared/trainer_$p.log | tr '\n' ' ')")
  done
  echo "| W | run | exit | last logged step | resumed steps 11-20 |" > "$OUT/shared.md"
  echo "|---|---|---|---|---|" >> "$OUT/shared.md"
  for W in ${SHARED_WORLDS:-2 8}; do
    [[ "$shared_parts" == *" train "* ]] || break
    for run in "llep --recompute 1" "pllep --token_budget 512 --recompute 1" "relay --relay_mode expert --recompute 1" \
               "relay --relay_mode token --recompute 1" "ep --optimizer adamw" "ep --optimizer cpu_adamw" \
               "ep --optimizer offload_adamw --offload_bucket 1048576"; do
      [[ -z "${SHARED_RUNS:-}" || "$run" =~ $SHARED_RUNS ]] || continue
      name=W${W}_$(echo "$run" | tr -c 'a-z0-9' '_' | sed 's/__*/_/g; s/_$//')
      flags="--gpus $W --share_gpus 1 --moe $run --data data/fortunes --steps 20 --val_every 0 --sample_every 0 --log_every 1 --ckpt_every 10"
      timeout 240 build/bf16/train $flags --out build/shared/$name > build/shared/$name.log 2>&1
      rc=$?
      timeout 240 build/bf16/train $flags --out build/shared/${name}_resumed --resume build/shared/$name/ckpt_000010 \
        > build/shared/${name}_resumed.log 2>&1 || rc=$((rc + 100))
      [ "$rc" -eq 0 ] || status=1
      same=$(diff <(awk -F, 'NR > 1 && $1 > 10 { print $1, $2, $5 }' build/shared/$name/log.csv 2>/dev/null) \
                  <(awk -F, 'NR > 1 { print $1, $2, $5 }' build/shared/${name}_resumed/log.csv 2>/dev/null) > /dev/null &&
             [ -s build/shared/${name}_resumed/log.csv ] && echo "bit-identical (loss, norm)" || echo DIFFER)
      [ "$same" = DIFFER ] && status=1
      echo "| $W | --moe $run | $rc | $(grep '^step' build/shared/$name.log | tail -1 | cut -d'|' -f1-3) | $same |" >> "$OUT/shared.md"
    done
  done
  for W in ${SHARED_BENCH_WORLDS:-2 4 8}; do
    [[ "$shared_parts" == *" bench "* ]] || break
    build/bf16/bench_ep_moe --gpus $W --share_gpus 1 --tokens 2048 --hidden 256 --inter 128 --experts 16 --topk 4 \
      --token_budget 256 --check 1 --warmup 1 --iters 2 > build/shared/bench_ep_W$W.md 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || status=1
    summary+=("bench_ep_moe --check 1 W=$W (shared): exit $rc | $(grep -c '^| ' build/shared/bench_ep_W$W.md) rows | $(grep -i 'check' build/shared/bench_ep_W$W.md | tail -1 | cut -c1-100)")
    build/bf16/bench_optimizer --gpus $W --share_gpus 1 --mparams 16 --buckets 1048576 --slots 2 --iters 2 \
      > build/shared/bench_opt_W$W.md 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || status=1
    summary+=("bench_optimizer W=$W (shared): exit $rc | $(grep -c '^| [0-9]' build/shared/bench_opt_W$W.md) rows")
  done
  cat "$OUT/shared.md"
  tar czf "$OUT/shared_logs.tgz" --exclude='ckpt_*' -C build shared
fi

if [[ " $want " == *" train2 "* ]]; then
  gpus=$(nvidia-smi -L | wc -l)
  build/bf16/train --gpus "$gpus" --data data/fortunes --out build/run-multi ${steps:+--steps $steps} > "$OUT/train_multi.log" 2>&1
  summary+=("train on $gpus GPUs: exit $? | $(grep 'val loss' "$OUT/train_multi.log" | sed -n '1p;$p' | tr '\n' ' ')")
  cp build/run-multi/log.csv "$OUT/train_multi_log.csv" 2>/dev/null
fi

if [[ " $want " == *" moe "* ]]; then
  : > "$OUT/moe_tests.log"
  for p in fp32 bf16; do
    for run in "build/$p/test_gpu" "build/$p/test_dist --gtest_filter=EpMoEDist.*:LlepDist.*:RelayMoEDist.*:DistModel.*"; do
      $run > build/moe_run.log 2>&1
      rc=$?
      [ "$rc" -eq 0 ] || status=1
      cat build/moe_run.log >> "$OUT/moe_tests.log"
      summary+=("$run: exit $rc | $(grep '^\[  \(PASSED  \|FAILED  \|SKIPPED \)\] [0-9]* test' build/moe_run.log | tr '\n' ' ')")
      grep -q '^\[  FAILED  \]' build/moe_run.log && summary+=("  $(grep -m1 -A2 ': Failure$' build/moe_run.log | tr '\n' ' ')")
    done
  done
  gpus=$(nvidia-smi -L | wc -l)
  : > "$OUT/moe_train.log"
  for m in ep llep pllep "relay --relay_mode expert" "relay --relay_mode token" "llep --recompute 1" "pllep --recompute 1" \
           "relay --relay_mode expert --recompute 1" "relay --relay_mode token --recompute 1"; do
    rm -rf build/run-moe
    build/bf16/train --gpus "$gpus" --moe $m --routing hot:0.5/2 --llep_min_rows 16 --token_budget 512 --data data/fortunes \
      --steps 30 --val_every 0 --sample_every 0 --ckpt_every 0 --log_every 10 --out build/run-moe > build/moe_train.log 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || status=1
    cat build/moe_train.log >> "$OUT/moe_train.log"
    summary+=("train --moe $m on $gpus GPUs: exit $rc | $(grep '^step' build/moe_train.log | tail -1)")
  done
fi

if [[ " $want " == *" bench-ep "* ]]; then
  gpus=$(nvidia-smi -L | wc -l)
  rm -rf build/ep-timelines && mkdir -p build/ep-timelines
  build/bf16/bench_ep_moe --gpus "$gpus" --tokens 16384 --token_budget 2048 --check 1 --timeline build/ep-timelines > "$OUT/bench_ep.md" \
    2> build/bench_ep.err || { status=1; tail -20 build/bench_ep.err; }
  tar czf "$OUT/ep_timelines.tgz" -C build ep-timelines
  cat "$OUT/bench_ep.md"
  echo "| token budget c | K | largest chunk R_d | fwd ms | / llep | fwd+bwd ms | / llep | checkpointed ms | / llep | peak D+EI MiB | peak / llep |" > "$OUT/bench_ep_budget.md"
  echo "|---|---|---|---|---|---|---|---|---|---|---|" >> "$OUT/bench_ep_budget.md"
  for c in 16384 8192 4096 3277 2731 2341 2048 1024 512 256; do  # K = 1, 2, 4, 5, 6, 7, 8, 16, 32, 64
    row=$(build/bf16/bench_ep_moe --gpus "$gpus" --tokens 16384 --dispatchers llep,pllep --profiles hot:1/4 --token_budget $c \
      --kmax 64 --warmup 2 --iters 5 2>> build/bench_ep.err | grep '| pllep |')
    echo "| $c | $(( (16384 + c - 1) / c )) | $(echo "$row" | cut -d'|' -f4-12) |" >> "$OUT/bench_ep_budget.md"
  done
  cat "$OUT/bench_ep_budget.md"
fi

if [[ " $want " == *" bench-opt "* ]]; then
  gpus=$(nvidia-smi -L | wc -l)
  rm -f build/cpu_adamw.vec
  make $vars build/cpu_adamw.vec > /dev/null 2>&1 && cp build/cpu_adamw.vec "$OUT/cpu_adamw_vec.txt" || status=1
  build/bench_cpu_adamw --mparams 256 > "$OUT/bench_cpu_adamw.md" 2>&1 || status=1
  {
    build/bf16/bench_optimizer --mparams 1000 &&
      build/bf16/bench_optimizer --mparams 4000,16000 --buckets 4194304,16777216 --slots 2 | sed -n '/^| [0-9]/p'
  } > "$OUT/bench_optimizer_1gpu.md" 2> build/bench_opt.err || { status=1; tail -20 build/bench_opt.err; }
  if [ "$gpus" -ge 2 ]; then
    build/bf16/bench_optimizer --gpus "$gpus" --mparams 1000,4000 --buckets 16777216 --slots 2 \
      > "$OUT/bench_optimizer_${gpus}gpu.md" 2>> build/bench_opt.err || { status=1; tail -20 build/bench_opt.err; }
  fi
  cat "$OUT/bench_cpu_adamw.md" "$OUT"/bench_optimizer_*gpu.md
  summary+=("bench-opt: $(grep -c '^| [0-9]' "$OUT"/bench_optimizer_*gpu.md | tr '\n' ' ') rows")
fi

if [[ " $want " == *" bench-head "* ]]; then
  gpus=$(nvidia-smi -L | wc -l)
  rm -rf build/head-timelines && mkdir -p build/head-timelines
  {
    build/fp32/bench_head --gpus "$gpus" --shapes 4096:200000:7168 --block 8192 &&
      build/fp32/bench_head --gpus "$gpus" --shapes 4096:200000:7168 --block 4096 --heads ring --modes auto |
        sed -n '/^| [0-9]/s/| ring |/| ring, C 4096 |/p' &&
      build/fp32/bench_head --gpus "$gpus" --shapes 110000:200000:7168 --block 2048 --heads ring --modes auto \
        --warmup 0 --iters 1 | sed -n '/^| [0-9]/p' &&
      build/fp32/bench_head --shapes 8192:100000:7168 --block 4080 --heads full,chunked | sed -n '/^| [0-9]/p' &&
      build/fp32/bench_head --shapes 32768:25000:7168 --block 1020 --heads full,chunked | sed -n '/^| [0-9]/p' &&
      build/bf16/bench_head --gpus "$gpus" --shapes 16384:32768:768,65536:32768:768,8192:131072:2048 --block 4096 \
        --timeline build/head-timelines
  } > "$OUT/bench_head.md" 2> build/bench_head.err || { status=1; tail -20 build/bench_head.err; }
  tar czf "$OUT/head_timelines.tgz" -C build/head-timelines $(cd build/head-timelines && ls 65536_*)
  cat "$OUT/bench_head.md"
  summary+=("bench-head: $(grep -c '^| [0-9]' "$OUT/bench_head.md") rows")
fi

if [[ " $want " == *" head "* ]]; then
  for p in fp32 bf16; do
    build/$p/test_gpu --gtest_filter='ChunkedHead*:RingDTP*' > "$OUT/head_gpu_$p.log" 2>&1 || status=1
    build/$p/test_dist --gtest_filter='RingDTPDist.*:DistModel.*Ring*:DistModel.StateSaved*' > "$OUT/head_dist_$p.log" 2>&1 || status=1
    FLATMOE_TRAIN=build/fp32/train build/$p/test_gpu --gtest_filter='Trainer.Resume*Head*' > "$OUT/head_trainer_$p.log" 2>&1 || status=1
    summary+=("head tests $p: $(grep -h '^\[  \(PASSED  \|FAILED  \|SKIPPED \)\] [0-9]* test' "$OUT"/head_*_$p.log | tr '\n' ' ')")
  done
  gpus=$(nvidia-smi -L | wc -l)
  for h in "ring_dtp --gpus $gpus" "chunked --gpus 1"; do
    build/bf16/train --head $h --data data/fortunes --steps 30 --val_every 10 --sample_every 30 --sample_len 16 \
      --ckpt_every 0 --log_every 10 --out build/run-head > "$OUT/train_head_${h%% *}.log" 2>&1
    summary+=("train --head $h: exit $? | $(grep '^step' "$OUT/train_head_${h%% *}.log" | tail -1) | $(grep 'val loss' "$OUT/train_head_${h%% *}.log" | tail -1)")
  done
fi

if [[ " $want " == *" attention "* ]]; then
  for p in fp32 bf16; do
    build/$p/test_gpu --gtest_filter='GpuAttention*' > "$OUT/attention_$p.log" 2>&1 || status=1
    summary+=("attention tests $p: $(grep -h '^\[  \(PASSED  \|FAILED  \|SKIPPED \)\] [0-9]* test' "$OUT/attention_$p.log" | tr '\n' ' ')")
  done
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in racecheck memcheck synccheck; do
    timeout 120 "$sanitizer" --tool $tool build/bf16/test_gpu \
      --gtest_filter='GpuAttention.IsBitwiseDeterministic:GpuAttention.EveryKernelFormMatchesReference' \
      > "$OUT/attention_$tool.log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || status=1
    summary+=("attention $tool: exit $rc | $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' "$OUT/attention_$tool.log" | tr '\n' ' ')")
  done
  build/bf16/bench_attention > "$OUT/bench_attention.md" 2> build/bench_attention.err || { status=1; tail -20 build/bench_attention.err; }
  cat "$OUT/bench_attention.md"
  # at B1's own attention (B 8, nh 16: 128 sequence-heads), where the issue's targets are read
  build/bf16/bench_attention --seqs 1024,2048 --hds 64 --pairs 128 > "$OUT/bench_attention_b1.md" \
    2> build/bench_attention.err || { status=1; tail -20 build/bench_attention.err; }
  cat "$OUT/bench_attention_b1.md"
fi

if [[ " $want " == *" memory "* ]]; then
  m334="--hidden 768 --layers 8 --heads 12 --experts 32 --topk 4 --expert_dim 512 --seq_len 1024 --batch 16"
  for run in "--gpus 1" "--gpus 2" "--gpus 2 --ep 1"; do
    build/bf16/train $run $m334 --data data/fortunes --steps 3 --val_every 0 --sample_every 0 --ckpt_every 0 \
      --log_every 1 --out build/run-memory > "$OUT/memory.log" 2>&1
    summary+=("memory $run: exit $? | $(grep -o 'device used.*' "$OUT/memory.log" | head -1) | $(grep -o 'peak [0-9.]* MiB' "$OUT/memory.log" | tail -1)")
  done
fi

if [[ " $want " == *" accum "* ]]; then
  a="--data data/fortunes --steps 200 --total_batch 32768 --val_every 0 --sample_every 0 --ckpt_every 0 --log_every 1"
  runs="fp32:build/fp32/train bf16:build/bf16/train"
  [ -x build/base_bf16_train ] && runs="$runs bf16-before:build/base_bf16_train"
  echo "| run | loss at step 200 | mean loss gap to FP32, steps 151-200 | largest gap | pool peak MiB |" > "$OUT/accum.md"
  echo "|---|---|---|---|---|" >> "$OUT/accum.md"
  for r in $runs; do
    name=${r%%:*}
    ${r#*:} $a --out build/accum-$name > build/accum-$name.log 2>&1 || { status=1; tail -5 build/accum-$name.log; }
    awk -F, -v run=$name 'FNR == 1 { next } NR == FNR { want[$1] = $2; next }
      { d = $2 - want[$1]; if (d < 0) d = -d; if ($1 > 150) { sum += d; n++ } if (d > most) most = d; last = $2; peak = $9 }
      END { printf "| %s | %.4f | %.4f | %.4f | %.1f |\n", run, last, n ? sum / n : 0, most, peak }' \
      build/accum-fp32/log.csv build/accum-$name/log.csv >> "$OUT/accum.md"
  done
  cat "$OUT/accum.md"
fi

if [[ " $want " == *" sco "* ]]; then
  for p in fp32 bf16; do
    build/$p/test_gpu --gtest_filter='GpuSco.*:GpuMemoryPrediction.*' > build/sco_tests_$p.log 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || status=1
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
      build/$p/test_dist --gtest_filter='DistModel.Sco*:DistModel.KeptAttention*:DistModel.MemoryPrediction*' \
        >> build/sco_tests_$p.log 2>&1 || { rc=$?; status=1; }
    fi
    cat build/sco_tests_$p.log >> "$OUT/sco_tests.log"
    summary+=("$p sco/attention/prediction tests: exit $rc | $(grep '^\[  \(PASSED  \|FAILED  \|SKIPPED \)\] [0-9]* test' build/sco_tests_$p.log | tr '\n' ' ')")
    grep -q '^\[  FAILED  \]' build/sco_tests_$p.log && summary+=("  $(grep -m1 -A2 ': Failure$' build/sco_tests_$p.log | tr '\n' ' ')")
  done
  # B1 on the fortunes data: recompute off, on, on + SCO at 25/50/100 % of the boundaries, on + selective
  # attention recomputation at device budgets of the predicted peak + 30 % and + 60 % of every option's
  # bytes, and 0.9 of the GPU
  b1="--hidden 1024 --layers 8 --heads 16 --experts 32 --topk 4 --expert_dim 512 --seq_len 2048 --batch 8"
  boundary=$((8 * 2048 * 1024 * 2))
  all_options=$((8 * (8 * 2048 * 1024 * 2 + 4 * 8 * 2048 * 16 + 4 * 8 * 2048 * 1024 * 2 + 4 * 8 * 2048)))
  echo "| run | ms/step (steps 11-30) | pool peak MiB | predicted MiB | start-up |" > "$OUT/sco.md"
  echo "|---|---|---|---|---|" >> "$OUT/sco.md"
  sco_run() {  # NAME FLAGS...
    local name=$1
    shift
    rm -rf build/run-sco
    build/bf16/train $b1 "$@" --data data/fortunes --steps 30 --val_every 0 --sample_every 0 \
      --ckpt_every 0 --log_every 1 --out build/run-sco > build/sco_train.log 2>&1 || { status=1; tail -5 build/sco_train.log; }
    cat build/sco_train.log >> "$OUT/sco_train.log"
    local line predicted
    line=$(grep '^layer boundaries\|^selective attention' build/sco_train.log | tr '\n' ' ')
    predicted=$(sed -n 's/^memory prediction vs the first step.*predicted \([0-9.]*\) MiB.*/\1/p' build/sco_train.log)
    awk -F, -v name="$name" -v line="$line" -v pred="$predicted" 'FNR == 1 || $2 == "nan" { next }
      { if ($1 > 10) { sum += $6; k++ } if ($9 > peak) peak = $9 } END { printf "| %s | %.1f | %.1f | %s | %s |\n", name, k ? sum / k : 0, peak, pred, line }' \
      build/run-sco/log.csv >> "$OUT/sco.md"
  }
  sco_run "recompute off" --recompute 0
  sco_run "recompute on" --recompute 1
  full=$(sed -n 's/^memory prediction (Eq. 6, rank 0): pool peak \([0-9]*\).*/\1/p' build/sco_train.log)
  for n in 2 4 8; do sco_run "recompute on, SCO $n of 8 boundaries" --recompute 1 --offload_budget $((n * boundary)); done
  for pct in 30 60; do
    sco_run "recompute on, attention kept, budget peak + $pct % of the options" --recompute 1 \
      --device_budget $(( (full + 1) * 1048576 + all_options * pct / 100 ))
  done
  sco_run "recompute on, attention kept, budget 0.9 of the GPU" --recompute 1 --device_budget 0.9
  sco_run "recompute on, SCO all + attention kept (0.9)" --recompute 1 --offload_budget $((8 * boundary)) --device_budget 0.9
  # the same tokens per step at T = 8192 (batch 2): attention's share of what recomputation redoes grows with T
  b1="--hidden 1024 --layers 8 --heads 16 --experts 32 --topk 4 --expert_dim 512 --seq_len 8192 --batch 2"
  sco_run "T 8192, batch 2: recompute off" --recompute 0
  sco_run "T 8192, batch 2: recompute on" --recompute 1
  sco_run "T 8192, batch 2: recompute on, attention kept, budget 0.9 of the GPU" --recompute 1 --device_budget 0.9
  cat "$OUT/sco.md"
fi

if [[ " $want " == *" sco-timelines "* ]]; then
  # the pool's timeline of step 3 of B1 (T = 2048, batch 8, one micro-batch) under recomputation alone, with SCO on
  # every boundary, and with the attention that 0.9 of the GPU keeps (sco_timelines.tgz; plotted with
  # tools/plot_timeline.sh); 30 steps each, so that the mean step time is a second sample of the sco table's rows
  b1="--hidden 1024 --layers 8 --heads 16 --experts 32 --topk 4 --expert_dim 512 --seq_len 2048 --batch 8 --recompute 1"
  rm -rf build/sco-timelines && mkdir -p build/sco-timelines
  for run in "recompute:" "sco_all:--offload_budget $((8 * 8 * 2048 * 1024 * 2))" "kept_attention:--device_budget 0.9"; do
    name=${run%%:*}
    rm -rf build/run-timeline
    build/bf16/train $b1 ${run#*:} --data data/fortunes --steps 30 --timeline_step 3 --val_every 0 --sample_every 0 \
      --ckpt_every 0 --log_every 1 --out build/run-timeline > build/timeline_train.log 2>&1 || { status=1; tail -5 build/timeline_train.log; }
    cp build/run-timeline/timeline_step3.csv "build/sco-timelines/$name.csv"
    summary+=("$name: $(awk -F, 'FNR > 1 && $2 != "nan" && $1 > 10 { sum += $6; k++ } END { printf "%.1f ms/step (steps 11-30)", k ? sum / k : 0 }' build/run-timeline/log.csv)")
  done
  tar czf "$OUT/sco_timelines.tgz" -C build sco-timelines
  summary+=("sco-timelines: $(ls build/sco-timelines | tr '\n' ' ')")
fi

# the reach parts' real steps: their pool timelines (reach_timelines.tgz, with the logs of steps that failed,
# reach_failed/) and, for each, the pool's peak by category beside each category's largest (reach_peaks.md,
# tools/timeline_peak.sh): the measured side of the per-rank budget's terms
reach_timelines_out() {
  tar czf "$OUT/reach_timelines.tgz" -C build/bench reach_timelines $(cd build/bench && ls -d reach_failed 2> /dev/null)
  for csv in build/bench/reach_timelines/*.csv; do
    [ -e "$csv" ] || continue
    echo "### $(basename "$csv" .csv)"
    tools/timeline_peak.sh "$csv"
    echo
  done > "$OUT/reach_peaks.md"
}
if [[ " $want " == *" reach "* ]]; then
  tools/bench_train.sh build/bf16/train data/fortunes build/bench reach > "$OUT/reach.md" 2> build/reach.err
  cat "$OUT/reach.md"
  reach_timelines_out
fi

if [[ " $want " == *" layout "* ]]; then
  tools/bench_train.sh build/bf16/train data/fortunes build/bench layout > "$OUT/layout.md" 2> build/layout.err || status=1
  cat "$OUT/layout.md"
fi

# reach-shared: issue 57's reach at W = 8 ranks sharing this machine's GPU in sequence groups (bench_train.sh's
# reach-shared part; REACH_SHARED_MODELS="default" or "300M" for one model a device call)
if [[ " $want " == *" reach-shared "* ]]; then
  tools/bench_train.sh build/bf16/train data/fortunes build/bench reach-shared > "$OUT/reach_shared.md" 2> build/reach_shared.err
  cat "$OUT/reach_shared.md"
  reach_timelines_out
fi

if [[ " $want " == *" bench "* ]]; then
  tools/bench_train.sh build/bf16/train data/fortunes build/bench "${BENCH_PARTS:-speed reach}" > "$OUT/bench.md" 2> build/bench.err
  cat "$OUT/bench.md"
fi

if [[ " $want " == *" speed "* ]]; then
  : > "$OUT/speed_tests.log"
  gpus=$(nvidia-smi -L | wc -l)
  for p in fp32 bf16; do
    runs=("build/$p/test_gpu")
    [ "$gpus" -ge 2 ] && runs+=("build/$p/test_dist --gtest_filter=DistModel.*")
    for run in "${runs[@]}"; do
      $run > build/speed_run.log 2>&1
      rc=$?
      [ "$rc" -eq 0 ] || status=1
      cat build/speed_run.log >> "$OUT/speed_tests.log"
      summary+=("$run: exit $rc | $(grep '^\[  \(PASSED  \|FAILED  \|SKIPPED \)\] [0-9]* test' build/speed_run.log | tr '\n' ' ')")
      grep -q '^\[  FAILED  \]' build/speed_run.log && summary+=("  $(grep -m1 -A2 ': Failure$' build/speed_run.log | tr '\n' ' ')")
    done
  done
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in memcheck racecheck; do  # the kernels with shared memory and cp.async that this work wrote
    timeout 120 "$sanitizer" --tool $tool build/bf16/test_gpu \
      --gtest_filter='GroupedGemmGpu.*:RmsNormGpu.MatchesReferenceSeveralRowsPerBackwardBlock:GpuRope.*' > "$OUT/speed_$tool.log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || status=1
    summary+=("speed kernels $tool: exit $rc | $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' "$OUT/speed_$tool.log" | tr '\n' ' ')")
  done
  CUDA_VISIBLE_DEVICES=0 tools/bench_train.sh build/bf16/train data/fortunes build/bench-speed speed > "$OUT/speed.md" \
    2> build/bench-speed.err || status=1
  tar czf "$OUT/speed_profiles.tgz" -C build/bench-speed $(cd build/bench-speed && ls -d */profile_step*.md 2>/dev/null)
  CUDA_VISIBLE_DEVICES=0 build/bf16/bench_expert_gemm > "$OUT/expert_gemm.md" 2>&1 || status=1
  cat "$OUT/speed.md" "$OUT/expert_gemm.md"
fi

# speed with 2 GPUs or more, or multi asked for: the default model on every GPU against one
if [[ " $want " == *" multi "* ]] || { [[ " $want " == *" speed "* ]] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; }; then
  tools/bench_train.sh build/bf16/train data/fortunes build/bench-multi multi > "$OUT/speed_multi.md" 2> build/bench-multi.err ||
    status=1
  cat "$OUT/speed_multi.md"
fi

# ab: the same runs of this tree's trainer and ab-base/'s, alternating (bench_train.sh ab)
if [[ " $want " == *" ab "* ]]; then
  if [ ! -f ab-base/train.cu ]; then
    echo "ab: ab-base/ holds no tree (mkdir ab-base && git archive REV | tar -x -C ab-base)"
    status=1
  elif ! make -C ab-base -j"$(nproc)" $(echo "$vars" | sed "s|=\.deps|=$PWD/.deps|g") build/bf16/train build/bf16/bench_expert_gemm \
      > "$OUT/ab_build.log" 2>&1; then
    tail -20 "$OUT/ab_build.log"
    echo "ab: the build of ab-base/ failed"
    status=1
  else
    BASE_TRAIN=ab-base/build/bf16/train CUDA_VISIBLE_DEVICES=0 tools/bench_train.sh build/bf16/train data/fortunes \
      build/bench-ab ab > "$OUT/ab.md" 2> build/bench-ab.err || status=1
    cat "$OUT/ab.md"
    summary+=("ab (new − base): default $(sed -n 's/^| default | .* | \([^|]*\) |$/\1/p' "$OUT/ab.md"), B1 $(sed -n 's/^| B1 | .* | \([^|]*\) |$/\1/p' "$OUT/ab.md")")
    # each expert GEMM's grouped_gemm TFLOP/s (column 5 of bench_expert_gemm's rows), one line per GEMM and layer
    expert_tflops() { awk -F'|' '/^### /{ layer = $0; sub(/^### /, "", layer); sub(/ \(.*/, "", layer) }
                                 /^\| [a-zA-Z]/ && $3 ~ /[0-9]/ { gsub(/^ +| +$/, "", $2); gsub(/ /, "", $6); print layer " | " $2 "\t" $6 }' "$1"; }
    for round in 1 2; do
      for side in base new; do
        bin=build/bf16/bench_expert_gemm
        [ "$side" = base ] && bin=ab-base/build/bf16/bench_expert_gemm
        CUDA_VISIBLE_DEVICES=0 "$bin" > "build/bench-ab/expert_gemm_$side$round.md" 2>> build/bench-ab.err || status=1
      done
    done
    {
      echo "## bench_expert_gemm: grouped_gemm TFLOP/s, ab-base (base) against this tree (new), alternating"
      echo "| layer | GEMM | base, two runs | new, two runs |"
      echo "|---|---|---|---|"
      paste <(expert_tflops build/bench-ab/expert_gemm_base1.md) <(expert_tflops build/bench-ab/expert_gemm_base2.md | cut -f2) \
        <(expert_tflops build/bench-ab/expert_gemm_new1.md | cut -f2) <(expert_tflops build/bench-ab/expert_gemm_new2.md | cut -f2) |
        awk -F'\t' '{ printf "| %s | %s / %s | %s / %s |\n", $1, $2, $3, $4, $5 }'
    } > "$OUT/ab_expert_gemm.md"
    cat "$OUT/ab_expert_gemm.md"
  fi
fi

# sanitize NAME COMMAND...: compute-sanitizer memcheck with leak check; log in $OUT/sanitize_NAME.log,
# its ERROR SUMMARY line in the summary; anything but "0 errors" and exit 0 is a failure.
sanitize() {
  local name=$1 rc errors
  shift
  "$sanitizer" --tool memcheck --leak-check full "$@" > "$OUT/sanitize_$name.log" 2>&1
  rc=$?
  errors=$(grep 'ERROR SUMMARY' "$OUT/sanitize_$name.log" | tail -1)
  [[ "$rc" -eq 0 && "$errors" == *"ERROR SUMMARY: 0 errors"* ]] || status=1
  summary+=("sanitize $*: exit $rc | ${errors:-no ERROR SUMMARY line}")
}

if [[ " $want " == *" sanitize "* ]]; then
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  sanitize test_gpu build/fp32/test_gpu --gtest_filter='GpuModel.*'
  sanitize train build/fp32/train --data data/fortunes --steps 3 --out build/run-sanitize --val_every 0 \
    --sample_every 0 --ckpt_every 0
fi

if [[ " $want " == *" faults "* ]]; then
  for p in fp32 bf16; do
    for run in 1 2 3; do
      build/$p/test_dist --gtest_filter='CommFailure.*' > "$OUT/faults_${p}_$run.log" 2>&1
      rc=$?
      [ "$rc" -eq 0 ] || status=1
      summary+=("faults $p run $run: exit $rc | $(grep -o 'scenario [A-Za-z]*: exit code [0-9]* after [0-9.]* s' \
        "$OUT/faults_${p}_$run.log" | sed 's/scenario //' | tr '\n' ' ')")
    done
  done
fi

echo
echo "==== summary"
for s in "${summary[@]}"; do echo "$s"; done
for p in fp32 bf16; do
  [ -f "$OUT/errors-$p.txt" ] && { echo "largest errors, $p:"; grep '^\[err\]' "$OUT/errors-$p.txt" | sed 's/ tol=.*//' | sort -t= -k2 -g | tail -4; }
done
exit $status
