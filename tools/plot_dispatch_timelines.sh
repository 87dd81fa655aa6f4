#!/usr/bin/env bash
# Plots the MoE live set of several pool timelines side by side (written by bench_ep_moe --timeline):
# per panel, stacked over time, the Dispatch and ExpertIntermediates bytes and what the pass adds to
# Weights + Grads (LLEP's borrowed expert weights and their gradients), on one y scale, against the
# pool's events in order (allocations and frees: the host enqueues ahead of the GPU, so its clock
# says little about when memory is in use), with Debian's gnuplot. Usage: tools/plot_dispatch_timelines.sh out.png "title" a.csv [b.csv ...]
set -euo pipefail
png=$1; title=$2; shift 2
command -v gnuplot > /dev/null || { echo "gnuplot not found (apt-get install gnuplot-nox)" >&2; exit 1; }
tmpdir=$(mktemp -d)
trap 'rm -rf "$tmpdir"' EXIT
ymax=0
i=0
for csv in "$@"; do
  i=$((i + 1))
  # columns: 7 weights, 8 grads, 12 dispatch, 13 expert_intermediates; event number and MiB stacked
  awk -F, 'NR == 2 { wg0 = $7 + $8 }
           NR > 1 { d = $12 / 1048576; e = d + $13 / 1048576; w = e + ($7 + $8 - wg0) / 1048576
                    printf "%d %.4f %.4f %.4f\n", NR - 1, d, e, w }' "$csv" > "$tmpdir/$i.dat"
  m=$(awk 'BEGIN { m = 0 } { if ($4 > m) m = $4 } END { print m }' "$tmpdir/$i.dat")
  ymax=$(awk -v a="$ymax" -v b="$m" 'BEGIN { print (b > a ? b : a) }')
done
n=$#
gnuplot <<GP
set terminal pngcairo size $((480 * n)),520 noenhanced font ",11"
set output "$png"
set multiplot layout 1,$n title "$title"
set xlabel "pool events in order (forward, then backward)"
set ylabel "live MiB (stacked)"
set yrange [0:$ymax * 1.08]
set grid
set style fill solid 0.85 noborder
set key top right
$(i=0; for csv in "$@"; do i=$((i + 1)); echo "set title \"$(basename "$csv" .csv)\""; echo "plot \"$tmpdir/$i.dat\" using 1:4 with fillsteps lc rgb '#7570b3' title 'borrowed weights + grads', '' using 1:3 with fillsteps lc rgb '#d95f02' title 'expert intermediates', '' using 1:2 with fillsteps lc rgb '#1b9e77' title 'dispatch'"; done)
unset multiplot
GP
echo "wrote $png"
