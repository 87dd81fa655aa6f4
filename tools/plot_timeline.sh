#!/usr/bin/env bash
# Plots a pool timeline CSV (written by train --timeline_step S) as stacked live bytes per
# category over time, with Debian's gnuplot. Usage: tools/plot_timeline.sh timeline.csv out.png
# The time axis is host time: when the host issued each alloc/free (runtime/pool.cuh), which runs
# ahead of the GPU, so it shows the order of the step's allocations, not GPU timing. The trainer
# records rank 0's pool only.
set -euo pipefail
csv=$1; png=$2
command -v gnuplot > /dev/null || { echo "gnuplot not found (apt-get install gnuplot-nox)" >&2; exit 1; }
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
# columns 7..16 are live bytes per category; write time (ms) and cumulative MiB per category
header=$(head -1 "$csv")
awk -F, 'NR == 2 { t0 = $1 } NR > 1 { printf "%.3f", ($1 - t0) / 1000; c = 0; for (i = 7; i <= NF; i++) { c += $i / 1048576; printf " %.4f", c } printf "\n" }' "$csv" > "$tmp"
ncat=$(echo "$header" | awk -F, '{ print NF - 6 }')
names=$(echo "$header" | cut -d, -f7- | tr ',' ' ')
gnuplot <<GP
set terminal pngcairo size 1400,700 noenhanced font ",11"
set output "$png"
set title "flatmoe device memory by category (pool live bytes) — $(basename "$csv")"
set xlabel "host time within the step (ms): when the host enqueued each allocation and free"
set ylabel "live MiB (stacked)"
set key outside right
set grid
names = "$names"
colors = "#1b9e77 #d95f02 #7570b3 #e7298a #66a61e #e6ab02 #a6761d #666666 #1f78b4 #fb9a99"
plot for [i=$ncat:1:-1] "$tmp" using 1:(column(i+1)) with filledcurves x1 lc rgb word(colors, i) title word(names, i)
GP
echo "wrote $png"
